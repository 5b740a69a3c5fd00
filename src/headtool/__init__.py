"""headtool: measure, prune and merge attention heads of Hugging Face transformers."""
from __future__ import annotations

from .version import __version__

__all__ = ["__version__", "load"]


def load(ref: str, **kwargs):
    """Load a model (folder, .gguf, short name, hub id, or a headtool output) and its tokenizer."""
    from .model.loading import load_model

    return load_model(ref, **kwargs)
