"""Data: sources (files, datasets, builtin text, stdin) read into texts, then cut into token
batches that are identical for identical options."""
