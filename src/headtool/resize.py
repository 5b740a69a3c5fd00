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

from .arch import LAYOUT_KEY, RESIZE_SPEC_KEY, Adapter, LayerHeads, adapter_for
from .errors import UsageError
from .templates import modeling_headtool as _tpl


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
    setattr(config, LAYOUT_KEY, {"num_heads": [g.num_heads for g in geometry],
                                 "num_kv_heads": [g.num_kv_heads for g in geometry],
                                 "head_dim": geometry[0].head_dim})
    setattr(config, RESIZE_SPEC_KEY, adapter.resize_spec())


def resize_attention(model: nn.Module, adapter: Adapter, layer: int, new_geo: LayerHeads,
                     new_tensors: Mapping[str, torch.Tensor]) -> None:
    """Give layer `layer` the geometry `new_geo` and the head-carrying tensors `new_tensors`.

    `new_tensors` maps full state-dict keys (e.g. 'model.layers.3.self_attn.q_proj.weight')
    to the new values, typically from `surgery.prune_layer_tensors`. Projections get new
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
                          tensors=rel)
    except ValueError as e:
        raise UsageError(str(e)) from e
    geometry[layer] = new_geo
    if spec["config_keys"]:
        # layers whose forward reads head counts from the config get their own view of it
        # before the shared config's keys may change below
        for i, g in enumerate(geometry):
            attn = adapter.attention_module(model, i)
            if not isinstance(attn.config, _tpl.LayerConfig):
                shared = attn.config
                attn.config = _tpl.LayerConfig(shared, {k: _tpl.quantity(q, g.num_heads, g.num_kv_heads, g.head_dim)
                                                        for k, q in spec["config_keys"]})
    _set_geometry(model.config, adapter, geometry)


def read_layout(raw: Mapping, where: str) -> dict:
    """The per-layer table of a headtool config, checked (a hand-edited table is bad input)."""
    layout = raw.get(LAYOUT_KEY)
    try:
        nq = [int(x) for x in layout["num_heads"]]
        nkv = [int(x) for x in layout["num_kv_heads"]]
        hd = int(layout["head_dim"])
    except (TypeError, KeyError, ValueError) as e:
        raise UsageError(f"{where}: {LAYOUT_KEY} must hold num_heads, num_kv_heads (lists) and head_dim") from e
    if len(nq) != len(nkv) or any(k < 1 or q < k or q % k for q, k in zip(nq, nkv)) or hd < 1:
        raise UsageError(f"{where}: {LAYOUT_KEY} is inconsistent (query heads {nq}, KV heads {nkv})")
    return {"num_heads": nq, "num_kv_heads": nkv, "head_dim": hd}


def config_from_headtool_folder(path: str | Path, raw_config: Mapping):
    """The config of a headtool output folder with a per-layer head table (no remote code run)."""
    from transformers import CONFIG_MAPPING

    where = str(Path(path) / "config.json")
    raw = dict(raw_config)
    model_type = raw.get("model_type")
    if model_type not in CONFIG_MAPPING:
        raise UsageError(f"{where}: unknown model_type {model_type!r}")
    layout = read_layout(raw, where)
    raw[LAYOUT_KEY] = layout
    if RESIZE_SPEC_KEY not in raw:
        raise UsageError(f"{where}: {LAYOUT_KEY} without {RESIZE_SPEC_KEY}; not a headtool output")
    try:
        config = CONFIG_MAPPING[model_type].from_dict(raw)
    except Exception as e:  # noqa: BLE001 - config validators raise many types
        raise UsageError(f"{where}: cannot read the config: {str(e).splitlines()[0]}") from e
    adapter = adapter_for(config)
    if len(layout["num_heads"]) != adapter.num_layers(config):
        raise UsageError(f"{where}: {LAYOUT_KEY} lists {len(layout['num_heads'])} layers, "
                         f"the model has {adapter.num_layers(config)}")
    return config


def model_class(config, task: str):
    """The transformers class for `task` of this config's family."""
    import transformers

    from .loading import auto_class

    auto = auto_class(task)
    for arch in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, arch, None)
        if cls is not None and type(config) in auto._model_mapping and \
                cls is auto._model_mapping[type(config)]:
            return cls
    try:
        return auto._model_mapping[type(config)]
    except KeyError as e:
        raise UsageError(f"{type(config).__name__} has no {task} model class") from e


def resized_class(config, task: str):
    """The family's class for `task`, building the per-layer head table on construction."""
    return _tpl.headtool_class(model_class(config, task))


def load_headtool_folder(path: str | Path, config, task: str, **from_pretrained_kwargs):
    """Load a headtool output folder with a per-layer head table, without its remote code."""
    return resized_class(config, task).from_pretrained(str(path), config=config, **from_pretrained_kwargs)


def modeling_file_source(class_names: Mapping[str, str]) -> str:
    """Text of the self-contained modeling file for an output folder.

    `class_names` maps the exported name (e.g. 'HeadtoolLlamaForCausalLM') to the
    transformers class it resizes (e.g. 'LlamaForCausalLM').
    """
    text = Path(_tpl.__file__).read_text()
    lines = ["import transformers as _transformers", ""]
    for exported, base in class_names.items():
        lines.append(f"{exported} = headtool_class(_transformers.{base})")
    return text + "\n".join(lines) + "\n"

