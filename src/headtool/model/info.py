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


def window_figures(per_layer: list[int], windows: list[int | None]) -> dict[str, Any]:
    """The sliding-window layers' cache: per layer its window in tokens (None: a global layer) and
    the most bytes those layers hold together, once the context fills their windows."""
    return {"kv_cache_window_per_layer": windows,
            "kv_cache_window_bytes": sum(b * w for b, w in zip(per_layer, windows) if w is not None)}


def conversion_figures(info: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    """`keys` of model_info for the before/after columns of a conversion (convert-gqa, convert-mla),
    whose budgets (--kv-cache) are fractions of every layer's bytes per token: there
    kv_cache_bytes_per_token counts the sliding-window layers too (their cache until the window
    fills), and the window figures come along where the model has such layers."""
    out = {k: info[k] for k in keys}
    if info["kv_cache_bytes_per_token_per_layer"] is not None:
        out["kv_cache_bytes_per_token"] = sum(info["kv_cache_bytes_per_token_per_layer"])
    return {**out, **{k: info[k] for k in ("kv_cache_window_per_layer", "kv_cache_window_bytes") if k in info}}


def conversion_kv_label(before: dict[str, Any], label: str = "KV cache per token") -> str:
    """The name of conversion_figures' KV row (tables and model cards): on a model with sliding-window
    layers it counts every layer, where `info` counts the global ones, and says so."""
    return label + (" (every layer, windows not full)" if before.get("kv_cache_window_per_layer") else "")


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
    windows = adapter.cache_windows(config) if per_layer is not None else [None] * len(geometry)
    out = {
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
        # what one more token adds: the layers whose cache grows with the context (a sliding-window
        # layer's is bounded by its window, stated apart below)
        "kv_cache_bytes_per_token": None if per_layer is None else
        sum(b for b, w in zip(per_layer, windows) if w is None),
        "kv_cache_bytes_per_token_per_layer": per_layer,
        **(window_figures(per_layer, windows) if any(w is not None for w in windows) else {}),
        "grouped_query": any(g.num_kv_heads != g.num_heads for g in geometry),
        # prune --unit head: layers whose KV heads serve different numbers of query heads
        **({"kv_group_sizes": {i: list(g.group_sizes) for i, g in enumerate(geometry) if g.uneven}}
           if any(g.uneven for g in geometry) else {}),
        **({"kv_rank": _uniform_or_list([int(r) for r in spec["kv_rank"]]), "rope_dim": int(spec["rope_dim"])}
           if spec else {}),
    }
    if spec:  # latent attention keeps no KV heads: every query head reads the one latent of its layer
        out.update(num_kv_heads=None, total_kv_heads=None, grouped_query=None,
                   source_num_kv_heads=_uniform_or_list([g.num_kv_heads for g in geometry]))
        out.pop("kv_group_sizes", None)
    return out
