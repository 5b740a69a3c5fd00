"""headtool: measure, prune and merge attention heads of Hugging Face transformers."""
from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__", "load"]


def load(ref: str, **kwargs):
    """Load a model (folder, .gguf, short name, hub id, or a headtool output) and its tokenizer."""
    from .loading import load_model

    return load_model(ref, **kwargs)
