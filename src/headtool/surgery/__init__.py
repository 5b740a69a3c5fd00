"""Changing heads: selection, head tensor math, pruning, output-projection compensation, K/V
merging, and streaming surgery on safetensors shards."""
