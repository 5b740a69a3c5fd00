"""Architecture adapters and their registry: the only code that knows model layouts."""
from __future__ import annotations

from .base import (
    KINDS,
    LAYOUT_KEY,
    RESIZE_QUANTITIES,
    RESIZE_SPEC_KEY,
    Adapter,
    ConfigSupport,
    HeadTensor,
    LayerHeads,
)
from .registry import adapter_for, kv_head_families, latent_families, supported_families

__all__ = [
    "KINDS", "LAYOUT_KEY", "RESIZE_QUANTITIES", "RESIZE_SPEC_KEY", "Adapter", "ConfigSupport", "HeadTensor", "LayerHeads",
    "adapter_for", "kv_head_families", "latent_families", "supported_families",
]
