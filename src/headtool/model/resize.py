"""Resize a model's attention in memory to a new per-layer head geometry, and load headtool folders.

The resizing itself is the self-contained code in `templates/modeling_headtool.py` (driven by
the adapter's `resize_spec()`), so a model resized here and one rebuilt from a saved folder by
`from_pretrained(..., trust_remote_code=True)` go through exactly the same code.
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping

import torch
from torch import nn

from ..arch import LAYOUT_KEY, RESIZE_SPEC_KEY, Adapter, LayerHeads
from ..errors import UsageError
from ..templates import modeling_headtool as _tpl
from .classes import model_class


def _set_geometry(config, adapter: Adapter, geometry: list[LayerHeads]) -> None:
    """Describe `geometry` in the config: the family's own keys when they can, else the table."""
    if adapter.can_write_standard_config(config, geometry):
        adapter.set_standard_heads(config, geometry[0])
        if hasattr(config, RESIZE_SPEC_KEY):
            delattr(config, RESIZE_SPEC_KEY)
        return
    hd = {g.head_dim for g in geometry}
    if len(hd) != 1:
        raise UsageError(f"layers with different head_dim {sorted(hd)} are not supported")
    layout = {"num_heads": [g.num_heads for g in geometry], "num_kv_heads": [g.num_kv_heads for g in geometry],
              "head_dim": geometry[0].head_dim}
    if any(g.uneven for g in geometry):  # prune --unit head: the KV groups of some layers differ in size
        layout["group_sizes"] = [list(g.group_sizes) if g.uneven else None for g in geometry]
    setattr(config, LAYOUT_KEY, layout)
    setattr(config, RESIZE_SPEC_KEY, adapter.resize_spec())


def resize_attention(model: nn.Module, adapter: Adapter, layer: int, new_geo: LayerHeads,
                     new_tensors: Mapping[str, torch.Tensor]) -> None:
    """Give layer `layer` the geometry `new_geo` and the head-carrying tensors `new_tensors`.

    `new_tensors` maps full state-dict keys (e.g. 'model.layers.3.self_attn.q_proj.weight')
    to the new values, typically from `arch.heads.prune_layer_tensors`. Projections get new
    parameters, head-count attributes are set, and `model.config` is updated (standard keys
    when expressible, else the per-layer table), so the model runs forward/generate at once.
    """
    geometry = adapter.geometry(model.config)
    if not 0 <= layer < len(geometry):
        raise UsageError(f"layer {layer} out of range 0..{len(geometry) - 1}")
    if new_geo.head_dim != geometry[layer].head_dim:
        raise UsageError(f"layer {layer}: changing head_dim ({geometry[layer].head_dim} -> {new_geo.head_dim}) "
                         "is not supported")
    prefix = adapter.layer_prefix(model, layer)
    rel = {}
    for key, t in new_tensors.items():
        if not key.startswith(prefix):
            raise UsageError(f"tensor {key} does not belong to layer {layer} ({prefix}...)")
        rel[key[len(prefix):]] = t
    spec = adapter.resize_spec()
    try:
        _tpl.resize_layer(model, spec, layer, new_geo.num_heads, new_geo.num_kv_heads, new_geo.head_dim,
                          tensors=rel, group_sizes=new_geo.group_sizes)
    except ValueError as e:
        raise UsageError(str(e)) from e
    geometry[layer] = new_geo
    if spec["config_keys"]:
        # layers whose forward reads head counts from the config get their own view of it
        # before the shared config's keys may change below
        for i, g in enumerate(geometry):
            attn = adapter.attention_module(model, i)
            if not _tpl.is_layer_view(attn.config):
                shared = attn.config
                attn.config = _tpl.LayerConfig(shared, {k: _tpl.quantity(q, g.num_heads, g.num_kv_heads, g.head_dim,
                                                                          g.group_sizes)
                                                        for k, q in spec["config_keys"]})
    _set_geometry(model.config, adapter, geometry)


def resized_class(config, task: str):
    """The family's class for `task`, building the per-layer head table on construction."""
    return _tpl.headtool_class(model_class(config, task))


def load_headtool_folder(path: str | Path, config, task: str, **from_pretrained_kwargs):
    """Load a headtool output folder with a per-layer head table, without its remote code."""
    return resized_class(config, task).from_pretrained(str(path), config=config, **from_pretrained_kwargs)
