"""Latent attention (convert-mla) in memory and on disk: install it in a model, load its folders,
count its cache.

The modules themselves are the self-contained code in `templates/modeling_headtool_mla.py`, so a
model converted in memory and one rebuilt from its folder by `from_pretrained(...,
trust_remote_code=True)` run exactly the same code (as `model.resize` does for head tables).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from ..arch import Adapter
from ..errors import UsageError
from ..templates import modeling_headtool_mla as _mla
from .classes import model_class

MLA_KEY = _mla.MLA_KEY
LatentAttention = _mla.LatentAttention


def latent_spec(config) -> dict[str, Any] | None:
    """The latent-attention table of a config (None for any other model)."""
    spec = getattr(config, MLA_KEY, None)
    return spec or None


HEAD_SURGERY = ("prune", "convert-gqa", "convert-mla")  # commands that rewrite per-head K/V weights


def refuse_latent_surgery(config, ref: str, what: str) -> None:
    """Head surgery on latent attention is not supported: its K/V live in one shared latent, so there are
    no per-head k_proj / v_proj to slice or merge (it failed late, naming a missing k_proj weight)."""
    if what in HEAD_SURGERY and latent_spec(config):
        raise UsageError(f"{ref}: already uses latent attention (a convert-mla output), which {what} cannot "
                         "rewrite: run it on the model this one was converted from, then convert-mla (heal, eval, "
                         "info and inspect read latent attention)")


def latent_cache_bytes_per_layer(spec: Mapping[str, Any], dtype: torch.dtype) -> list[int]:
    """Bytes one token adds to each layer's cache: its latent and the shared rotary key."""
    elem = torch.empty((), dtype=dtype).element_size()
    return [(int(r) + int(spec["rope_dim"])) * elem for r in spec["kv_rank"]]


def install_latent(model: nn.Module, adapter: Adapter, spec: dict[str, Any],
                   tensors: Sequence[Mapping[str, torch.Tensor]]) -> None:
    """Replace every attention layer of `model` by latent attention per `spec`, in place.

    `tensors[i]` maps parameter names relative to the attention module ('q_proj.weight',
    'kv_a_proj_with_mqa.weight', 'kv_b_proj.weight', 'o_proj.weight' and biases) to layer i's
    values; the config gets the table, so the model runs forward/generate at once and
    save_pretrained writes a folder that the modeling file rebuilds.
    """
    if len(tensors) != len(spec["kv_rank"]):
        raise ValueError(f"{len(tensors)} layers of tensors for {len(spec['kv_rank'])} layers")
    setattr(model.config, MLA_KEY, spec)
    _mla.install_latent_attention(model, model.config)
    for i, values in enumerate(tensors):
        attn = adapter.attention_module(model, i)
        if not isinstance(attn, LatentAttention):
            raise ValueError(f"layer {i}: attention was not replaced")
        params = dict(attn.named_parameters())
        if set(values) != set(params):
            raise ValueError(f"layer {i}: tensors {sorted(values)} do not match the module's {sorted(params)}")
        with torch.no_grad():
            for name, value in values.items():
                p = params[name]
                if tuple(value.shape) != tuple(p.shape):
                    raise ValueError(f"layer {i}: {name} has shape {tuple(value.shape)}, expected {tuple(p.shape)}")
                p.copy_(value.to(device=p.device, dtype=p.dtype))


def latent_class(config, task: str):
    """The family's class for `task` with latent attention built on construction."""
    return _mla.headtool_mla_class(model_class(config, task))


def load_latent_folder(path: str | Path, config, task: str, **from_pretrained_kwargs):
    """Load a convert-mla output folder without its remote code."""
    return latent_class(config, task).from_pretrained(str(path), config=config, **from_pretrained_kwargs)
