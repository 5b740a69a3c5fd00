# Written by headtool into a pruned / merged checkpoint.
#
# The attention layers of this model have head counts that the family's stock config cannot
# express (a different count per layer, KV groups of different sizes in a layer, or a family
# whose head_dim is derived from the width).
# This file builds the original family's model and resizes each layer's attention to the table
# in config.json ("headtool_head_layout"), following the recipe in "headtool_resize_spec".
# It needs only torch and transformers; load with
#     AutoModelFor...from_pretrained(folder, trust_remote_code=True)
# headtool itself uses the same functions (headtool.model.resize) for models in memory.
from __future__ import annotations

import sys

import torch
from torch import nn

LAYOUT_KEY = "headtool_head_layout"
RESIZE_SPEC_KEY = "headtool_resize_spec"
# the attention function of layers whose KV groups differ in size (registered below)
UNEVEN_ATTENTION = "headtool_uneven_groups"


def _get(obj, key, default=None):
    return obj.get(key, default) if isinstance(obj, dict) else getattr(obj, key, default)


def quantity(name: str, num_heads: int, num_kv_heads: int, head_dim: int, group_sizes=None) -> int:
    """A head-derived number that an attention module stores (see Adapter.resize_attrs).

    With KV groups of different sizes (`group_sizes`) the attention function sees every group
    padded to the largest (`uneven_attention`), so the group size is that largest size.
    """
    values = {
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "group_size": max(group_sizes) if group_sizes else num_heads // num_kv_heads,
        "q_width": num_heads * head_dim,
        "kv_width": num_kv_heads * head_dim,
    }
    if name not in values:
        raise ValueError(f"unknown resize quantity {name!r}")
    return values[name]


def axis_size(kinds, num_heads: int, num_kv_heads: int, head_dim: int) -> int:
    """Length of a head-carrying axis holding `kinds` (q/o: query heads, k/v: KV heads)."""
    return sum(num_heads if k in ("q", "o") else num_kv_heads for k in kinds) * head_dim


class LayerConfig:
    """A per-layer view of a model config: some keys overridden, everything else shared.

    Reads and writes of other attributes go to the shared config, so settings changed later
    on the model (e.g. the attention implementation) reach every layer.
    """

    def __init__(self, base, overrides: dict):
        object.__setattr__(self, "_base", base)
        object.__setattr__(self, "_overrides", dict(overrides))

    def __getattr__(self, name):
        if name.startswith("__") or name in ("_base", "_overrides"):
            raise AttributeError(name)
        overrides = object.__getattribute__(self, "_overrides")
        if name in overrides:
            return overrides[name]
        return getattr(object.__getattribute__(self, "_base"), name)

    def __setattr__(self, name, value):
        if name.startswith("_attn_implementation"):  # the model's choice; a layer may only route it
            setattr(self._base, name, value)
        elif name in self._overrides:
            self._overrides[name] = value
        else:
            setattr(self._base, name, value)

    def to_dict(self):
        d = self._base.to_dict()
        d.update(self._overrides)
        return d


def is_layer_view(config) -> bool:
    """Whether `config` is a LayerConfig, this file's or a copy's (a folder's remote code has its own class)."""
    return config is not None and "_overrides" in getattr(config, "__dict__", {})


def shared_config(config):
    """The model's config behind a layer's view (the config itself when it is no view)."""
    while is_layer_view(config):
        config = object.__getattribute__(config, "_base")
    return config


def _base_model(model):
    return getattr(model, "base_model", model)


def _fix_sizes(module: nn.Module, conv1d: bool) -> None:
    """Keep a projection's size attributes in line with its (new) weight."""
    w = module.weight
    if conv1d and hasattr(module, "nf"):  # transformers' Conv1D: weight [nx, nf]
        module.nx, module.nf = int(w.shape[0]), int(w.shape[1])
    elif isinstance(module, nn.Linear):
        module.out_features, module.in_features = int(w.shape[0]), int(w.shape[1])


def resize_layer(model: nn.Module, spec: dict, layer: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, tensors: dict | None = None, group_sizes=None) -> None:
    """Resize the attention of `layer` to (num_heads, num_kv_heads, head_dim), in place.

    With `tensors` (names relative to the layer, e.g. "self_attn.q_proj.weight") the new
    parameters take those values; without, they are allocated empty on the same device and
    dtype (from_pretrained then fills them from the checkpoint). `group_sizes` (query heads per
    KV head, in order) gives KV groups of different sizes; None: equal groups.
    """
    if group_sizes is not None:
        group_sizes = [int(g) for g in group_sizes]
        if len(group_sizes) != num_kv_heads or sum(group_sizes) != num_heads or min(group_sizes) < 1:
            raise ValueError(f"layer {layer}: KV group sizes {group_sizes} do not split {num_heads} query heads "
                             f"over {num_kv_heads} KV heads")
        if len(set(group_sizes)) == 1:
            group_sizes = None
    if group_sizes is None and (num_kv_heads < 1 or num_heads < num_kv_heads or num_heads % num_kv_heads):
        raise ValueError(f"layer {layer}: {num_heads} query heads cannot share {num_kv_heads} KV heads")
    layer_mod = _base_model(model).get_submodule(f"{spec['layers_path']}.{layer}")
    for entry in spec["tensors"]:
        mod_path, pname = entry["name"].rsplit(".", 1)
        mod = layer_mod.get_submodule(mod_path)
        old = getattr(mod, pname, None)
        if old is None:
            if tensors is not None and entry["name"] in tensors:
                raise ValueError(f"layer {layer}: {entry['name']} given but the model has no such parameter")
            continue
        if tensors is not None:
            if entry["name"] not in tensors:
                raise ValueError(f"layer {layer}: no new value for {entry['name']}")
            new = tensors[entry["name"]].to(device=old.device, dtype=old.dtype)
        else:
            shape = list(old.shape)
            shape[entry["axis"]] = axis_size(entry["kinds"], num_heads, num_kv_heads, head_dim)
            new = torch.empty(shape, dtype=old.dtype, device=old.device)
        expected = axis_size(entry["kinds"], num_heads, num_kv_heads, head_dim)
        if new.shape[entry["axis"]] != expected:
            raise ValueError(f"layer {layer}: {entry['name']} has {new.shape[entry['axis']]} entries on axis "
                             f"{entry['axis']}, expected {expected}")
        setattr(mod, pname, nn.Parameter(new.contiguous(), requires_grad=old.requires_grad))
        if pname == "weight":
            _fix_sizes(mod, bool(spec.get("conv1d")))
    for path, qty in spec.get("attrs", []):
        owner, _, attr = path.rpartition(".")
        obj = layer_mod.get_submodule(owner) if owner else layer_mod
        setattr(obj, attr, quantity(qty, num_heads, num_kv_heads, head_dim, group_sizes))
    attn = layer_mod.get_submodule(spec["attention"])
    current = getattr(attn, "config", None)
    shared = shared_config(current)
    overrides = {key: quantity(qty, num_heads, num_kv_heads, head_dim, group_sizes)
                 for key, qty in spec.get("config_keys", [])}
    if group_sizes is not None:
        if current is None:
            raise ValueError(f"layer {layer}: this attention module has no config to route uneven KV groups through")
        # the layer's attention goes through uneven_attention, which pads its groups to the
        # largest and calls the model's chosen attention function on the cached KV heads
        overrides["_attn_implementation"] = UNEVEN_ATTENTION
        attn.headtool_group_sizes = tuple(group_sizes)
    elif hasattr(attn, "headtool_group_sizes"):
        del attn.headtool_group_sizes
    if overrides:
        attn.config = LayerConfig(shared, overrides)
    elif is_layer_view(current):
        attn.config = shared


def uneven_attention(module, query, key, value, attention_mask, **kwargs):
    """The attention of a layer whose KV groups differ in size.

    The query heads [batch, heads, seq, dim] are laid out in groups padded to the largest (zero
    queries in the gaps), so the model's attention function (eager: the family's own; sdpa, flash,
    flex from transformers' registry) runs on equal groups as for any grouped-query layer, reading
    the cached KV heads as they are (no copy per query head: gathering them was measured 2.8x slower
    at 2,048 tokens of context); the padded heads' outputs are dropped.
    """
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    sizes = module.headtool_group_sizes
    width = max(sizes)
    slots = [k * width + i for k, n in enumerate(sizes) for i in range(n)]
    index = torch.tensor(slots, device=query.device)
    padded = query.new_zeros(query.shape[0], len(sizes) * width, *query.shape[2:])
    padded[:, index] = query
    # the model's choice (the shared config behind the layer's view): the mask was made for it
    chosen = shared_config(module.config)._attn_implementation
    family_eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward")
    fn = family_eager if chosen in (None, "eager", UNEVEN_ATTENTION) else ALL_ATTENTION_FUNCTIONS[chosen]
    out, weights = fn(module, padded, key, value, attention_mask, **kwargs)  # out [batch, seq, heads, dim]
    return out[:, :, index], (None if weights is None else weights[:, index])


def _register_uneven_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(UNEVEN_ATTENTION, uneven_attention)


_register_uneven_attention()


def apply_layout(model: nn.Module, config) -> None:
    """Resize every layer of a freshly built model to the config's per-layer head table."""
    layout = _get(config, LAYOUT_KEY)
    spec = _get(config, RESIZE_SPEC_KEY)
    if not layout or not spec:
        return
    hd = int(layout["head_dim"])
    sizes = _get(layout, "group_sizes") or [None] * len(layout["num_heads"])
    for i, (nq, nkv, gs) in enumerate(zip(layout["num_heads"], layout["num_kv_heads"], sizes)):
        resize_layer(model, spec, i, int(nq), int(nkv), hd, group_sizes=gs)


def headtool_class(base_cls):
    """A subclass of a transformers model class that builds the resized attention.

    The subclass keeps the family's class name (transformers looks up weight renamings such
    as GPT-NeoX's embed_out -> lm_head by class name; save_pretrained writes it as the
    architecture); the module exports it as Headtool<name>.
    """

    class Resized(base_cls):
        def __init__(self, config, *args, **kwargs):
            super().__init__(config, *args, **kwargs)
            apply_layout(self, config)

        @classmethod
        def is_custom_code(cls) -> bool:
            # the family's own modeling code with resized attention: the family's checkpoint
            # conventions (weight renamings, init) apply unchanged
            return False

        def _get_static_cache_init_shape(self):
            # the config's global head counts are not this model's: let a StaticCache size
            # itself lazily from the first keys of each layer
            return None

    Resized.__name__ = Resized.__qualname__ = base_cls.__name__
    return Resized


# Classes named in config.json's auto_map (generated by headtool for this checkpoint):
