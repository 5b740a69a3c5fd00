"""Measurement on a loaded model: head gates, objectives, scoring, layer-by-layer replay,
evaluation, inspection and speed. Reads models; never rewrites their weights."""
