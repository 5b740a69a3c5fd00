"""The figures `headtool info` reports (and the `model` block of every JSON document)."""
from __future__ import annotations

from typing import Any

import torch

from ..arch import Adapter, LayerHeads
from .latent import latent_cache_bytes_per_layer, latent_spec


def _uniform_or_list(values: list[int]) -> int | list[int]:
    return values[0] if len(set(values)) == 1 else values


def attention_param_names(model: torch.nn.Module, adapter: Adapter) -> list[str]:
    """Every parameter of the attention blocks (projections, biases, qk-norms)."""
    names = []
    n_layers = adapter.num_layers(model.config)
    prefixes = [adapter.layer_prefix(model, i) + adapter.attention + "." for i in range(n_layers)]
    o_prefixes = [adapter.layer_prefix(model, i) + adapter.o_proj + "." for i in range(n_layers)]
    for name, _ in model.named_parameters():
        if any(name.startswith(p) for p in prefixes) or any(name.startswith(p) for p in o_prefixes):
            if "layernorm" in name.lower() or "layer_norm" in name.lower():
                continue  # BERT keeps its post-attention LayerNorm inside the attention block
            names.append(name)
    return names


def count_params(model: torch.nn.Module) -> int:
    """Unique parameters (tied embeddings counted once)."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


def kv_cache_bytes_per_layer(geometry: list[LayerHeads], dtype: torch.dtype) -> list[int]:
    """K and V bytes one token adds to each layer's cache."""
    elem = torch.empty((), dtype=dtype).element_size()
    return [2 * g.num_kv_heads * g.head_dim * elem for g in geometry]


def kv_cache_bytes_per_token(geometry: list[LayerHeads], dtype: torch.dtype) -> int:
    """K and V bytes one token adds to the cache, summed over layers."""
    return sum(kv_cache_bytes_per_layer(geometry, dtype))


def model_info(model: torch.nn.Module, adapter: Adapter) -> dict[str, Any]:
    """The stable `info --json` keys (per-layer lists where layers differ)."""
    config = model.config
    geometry = adapter.geometry(config)
    params = dict(model.named_parameters())
    attn = sum(params[n].numel() for n in attention_param_names(model, adapter))
    dtype = next(model.parameters()).dtype
    spec = latent_spec(config)
    # latent attention (convert-mla) caches one latent and one shared rotary key per token and layer;
    # an encoder keeps no cache at all (None: n/a, as eval --speed reports it)
    per_layer = (None if not adapter.caches_kv(config) else
                 latent_cache_bytes_per_layer(spec, dtype) if spec else kv_cache_bytes_per_layer(geometry, dtype))
    return {
        "model_type": config.model_type,
        "family": adapter.family,
        "architecture": (getattr(config, "architectures", None) or [type(model).__name__])[0],
        "num_layers": len(geometry),
        "num_heads": _uniform_or_list([g.num_heads for g in geometry]),
        "num_kv_heads": _uniform_or_list([g.num_kv_heads for g in geometry]),
        "head_dim": _uniform_or_list([g.head_dim for g in geometry]),
        "hidden_size": adapter.hidden_size(config),
        "total_heads": sum(g.num_heads for g in geometry),
        "total_kv_heads": sum(g.num_kv_heads for g in geometry),
        "params": count_params(model),
        "attention_params": attn,
        "dtype": str(dtype).replace("torch.", ""),
        "kv_cache_bytes_per_token": None if per_layer is None else sum(per_layer),
        "kv_cache_bytes_per_token_per_layer": per_layer,
        "grouped_query": any(g.num_kv_heads != g.num_heads for g in geometry),
        # prune --unit head: layers whose KV heads serve different numbers of query heads
        **({"kv_group_sizes": {i: list(g.group_sizes) for i, g in enumerate(geometry) if g.uneven}}
           if any(g.uneven for g in geometry) else {}),
        **({"kv_rank": _uniform_or_list([int(r) for r in spec["kv_rank"]]), "rope_dim": int(spec["rope_dim"])}
           if spec else {}),
    }
