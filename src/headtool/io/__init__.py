"""Files on disk: safetensors shards read and written tensor by tensor, and output folders that are
written whole or not at all. Knows nothing of models beyond their config and state dict."""
