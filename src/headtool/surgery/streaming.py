"""Surgery on checkpoints larger than memory: shard by shard, tensor by tensor, no model built.

Used when no forward pass is needed (prune with a score document or a head list and no
compensation; convert-gqa with `--merge mean`). The tensor math is the in-memory path's own
(`arch.heads.prune_layer_tensors`, `surgery.merging.mean_layer_tensors`); the config and model card come from a
model built on the meta device (no memory), so the output folder is the same as in memory.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ..arch import LAYOUT_KEY, Adapter, LayerHeads, adapter_for
from ..arch.heads import keep_for_query_heads, prune_layer_tensors
from ..errors import UsageError
from ..io.output import check_output_target, finish_folder, output_kind, temp_folder
from ..io.safetensors_stream import DTYPES, LazyCheckpoint, write_checkpoint_streaming
from ..io.sizes import parse_size
from ..model.classes import auto_class, model_class, pick_task
from ..model.config import load_config, refuse_quantized
from ..model.fingerprint import checkpoint_fingerprint
from ..model.refs import packaged_hint, resolve_ref
from ..model.resize import resize_attention, resized_class
from .merging import check_target, contiguous_plans, mean_layer_tensors

LayerFn = Callable[[int, dict[str, torch.Tensor]], dict[str, torch.Tensor]]
#: headtool.json, or what builds it from the weightless model resized to the new geometry (its figures after)
Meta = dict | Callable[[Any], dict]
#: the model card's summary table, or what builds it from that model and its config kind
Card = str | Callable[[Any, str], str]
_NAMES = {v: k for k, v in DTYPES.items()}  # torch dtype -> safetensors name


@dataclass
class CheckpointRef:
    """A checkpoint on disk, described without loading its weights (quacks like LoadedModel
    where read_scores, check_output_target and write-out need it)."""

    ref: str
    path: str
    config: Any
    adapter: Adapter
    lazy: LazyCheckpoint
    task: str
    tokenizer: Any = None
    #: --dtype: floating tensors are written in it; None (auto) copies them as stored
    cast_to: torch.dtype | None = None
    _fingerprint: str | None = field(default=None, repr=False)
    _prefixes: list[str] | None = field(default=None, repr=False)

    @property
    def geometry(self) -> list[LayerHeads]:
        return self.adapter.geometry(self.config)

    @property
    def layer_prefixes(self) -> list[str]:
        """Each layer's key prefix in the checkpoint (found once: a scan over all keys)."""
        if self._prefixes is None:
            keys = self.lazy.keys()
            self._prefixes = [self.adapter.layer_prefix_in_keys(keys, i) for i in range(len(self.geometry))]
        return self._prefixes

    @property
    def fingerprint(self) -> str:
        """The same fingerprint as `LoadedModel.fingerprint` of the loaded model."""
        if self._fingerprint is None:
            self._fingerprint = checkpoint_fingerprint(self.config.to_dict(), self.lazy)
        return self._fingerprint

    @property
    def dtype(self) -> torch.dtype | None:
        """The dtype of the copy's figures: --dtype, or for auto what loading picks (the config's, else the
        first floating tensor's), so that its KV bytes and parameters' dtype read as the loaded copy's."""
        return self.cast_to or _auto_dtype(self.config, self.lazy)

    @property
    def model(self):
        """A weightless (meta-device) model in the copy's dtype: for figures and the output config,
        never for compute."""
        model, dtype = meta_model(self.config, self.task), self.dtype
        if dtype is not None:
            model.to(dtype)
            model.config.dtype = dtype  # what a model loaded in that dtype records
        return model


def open_checkpoint(ref: str, trust_remote_code: bool = False, dtype: torch.dtype | None = None) -> CheckpointRef:
    """A local safetensors folder (or packaged model) opened for streaming; UsageError otherwise.
    dtype: what --dtype names, None for auto (tensors copied as stored)."""
    path, source = resolve_ref(ref)
    if source == "hub":
        raise UsageError(f"--streaming needs a local folder with safetensors weights, not the hub id {ref!r}"
                         + packaged_hint(ref))
    config = load_config(path, source, trust_remote_code)
    adapter = adapter_for(config)
    refuse_quantized(config, ref, "streaming surgery")
    lazy = LazyCheckpoint(path)
    return CheckpointRef(ref, path, config, adapter, lazy, pick_task(config), cast_to=dtype)


def _auto_dtype(config, lazy: LazyCheckpoint) -> torch.dtype | None:
    """The dtype `--dtype auto` loads a checkpoint in (transformers' rule): the config's, else that of
    the first floating tensor; None when there is none."""
    named = getattr(config, "dtype", None)
    if isinstance(named, str) and isinstance(getattr(torch, named, None), torch.dtype):
        return getattr(torch, named)
    if isinstance(named, torch.dtype):
        return named
    return next((DTYPES[e.dtype] for e in lazy.index.values() if DTYPES[e.dtype].is_floating_point), None)


def meta_model(config, task: str):
    """The model built on the meta device: its class, config and head geometry, no weights."""
    import copy

    config = copy.deepcopy(config)  # resizing updates the model's config; the checkpoint's stays as read
    with torch.device("meta"):
        try:  # a headtool folder's per-layer table sizes its layers (its figures are the loaded model's)
            cls = resized_class(config, task) if getattr(config, LAYOUT_KEY, None) else model_class(config, task)
            return cls._from_config(config) if hasattr(cls, "_from_config") else cls(config)
        except Exception:  # noqa: BLE001 - fall back to the auto class
            return auto_class(task).from_config(config)


def plan_entries(ck: CheckpointRef, new_geometry: list[LayerHeads]) -> list[tuple[str, str, tuple[int, ...]]]:
    """Output tensor names, dtypes and shapes, computed before any tensor is read."""
    shapes: dict[str, tuple[int, ...]] = {}
    for prefix, geo in zip(ck.layer_prefixes, new_geometry):
        for ht in ck.adapter.tensors:
            key = prefix + ht.name
            if key not in ck.lazy:
                if not ht.optional:
                    raise UsageError(f"weights missing for a layer: {key} is not in the checkpoint")
                continue
            shape = list(ck.lazy.index[key].shape)
            shape[ht.axis] = ht.size(geo)
            shapes[key] = tuple(shape)
    return [(e.name, e.dtype, shapes.get(e.name, e.shape)) for e in ck.lazy.index.values()]


def layer_of(ck: CheckpointRef) -> dict[str, int]:
    """Which layer each checkpoint key belongs to (only keys of attention tensors)."""
    out = {}
    for i, prefix in enumerate(ck.layer_prefixes):
        for ht in ck.adapter.tensors:
            out[prefix + ht.name] = i
    return out


class _LayerTensors(Mapping):
    """A layer's attention tensors, each read from disk only when the layer function asks for it
    (a tensor it never touches is copied file to file)."""

    def __init__(self, lazy: LazyCheckpoint, keys: list[str], dtype: torch.dtype | None = None):
        self._lazy, self._keys, self._read, self._dtype = lazy, keys, {}, dtype

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self._read:
            if key not in self._keys:
                raise KeyError(key)
            self._read[key] = cast_floating(self._lazy[key], self._dtype)
        return self._read[key]

    def __contains__(self, key) -> bool:  # Mapping's default would read the tensor
        return key in self._keys

    def __iter__(self):
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


def cast_floating(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """`t` in `dtype` when it is floating point (as loading in a dtype casts parameters); else as is."""
    return t.to(dtype) if dtype is not None and t.is_floating_point() else t


def _recast(stored: str, dtype: torch.dtype | None) -> bool:
    """Whether a tensor stored as `stored` (a safetensors dtype name) is written in another dtype."""
    return dtype is not None and DTYPES[stored].is_floating_point and DTYPES[stored] != dtype


def stream_surgery(ck: CheckpointRef, out: str | Path, new_geometry: list[LayerHeads], layer_fn: LayerFn, *,
                   meta: Meta, card_table: Card = "", overwrite: bool = False,
                   shard_size: str | int = "5GB") -> dict[str, Any]:
    """Write the checkpoint with every layer's attention tensors replaced by `layer_fn(i, tensors)`.
    `meta` and `card_table` may be functions of the resized weightless model: the in-memory path's
    builders take the model after surgery, and the streamed record must come from the same builders.
    With `ck.cast_to` (--dtype), floating tensors are cast to it before the layer function sees them, as
    loading casts them; otherwise (auto) every tensor keeps its stored dtype.

    Peak memory: the tensors of one layer's attention plus the one being written.
    """
    target = check_output_target(out, ck.path, overwrite)
    shard_bytes = parse_size(shard_size)
    dtype = ck.cast_to
    entries = [(n, _NAMES[dtype] if _recast(d, dtype) else d, shape) for n, d, shape in plan_entries(ck, new_geometry)]
    owner = layer_of(ck)
    done: dict[int, dict[str, torch.Tensor]] = {}

    def produce(name: str) -> torch.Tensor:
        i = owner.get(name)
        if i is not None and i not in done:
            done.clear()  # one layer at a time
            prefix = ck.layer_prefixes[i]
            done[i] = layer_fn(i, _LayerTensors(ck.lazy, [prefix + ht.name for ht in ck.adapter.tensors
                                                         if prefix + ht.name in ck.lazy], dtype))
        if i is not None and name in done[i]:
            return done[i][name]
        if _recast(ck.lazy.index[name].dtype, dtype):
            return cast_floating(ck.lazy[name], dtype)
        return ck.lazy.raw(name)  # unchanged: bytes copied file to file

    # the output config from a weightless model resized to the new geometry
    model = ck.model
    planned = {name: (DTYPES[d], shape) for name, d, shape in entries}
    for i, (geo, old) in enumerate(zip(new_geometry, ck.geometry)):
        if geo != old:
            prefix, file_prefix = ck.adapter.layer_prefix(model, i), ck.layer_prefixes[i]
            new = {prefix + n[len(file_prefix):]: torch.empty(planned[n][1], dtype=planned[n][0], device="meta")
                   for n, layer in owner.items() if layer == i and n in planned}
            resize_attention(model, ck.adapter, i, geo, new)
    kind = output_kind(model)
    with temp_folder(target) as tmp:
        write_checkpoint_streaming(tmp, entries, produce, shard_bytes)
        model.config.save_pretrained(tmp)
        doc = meta(model) if callable(meta) else meta
        card = card_table(model, kind) if callable(card_table) else card_table
        return finish_folder(tmp, target, model=model, source=ck, tokenizer=None, meta=doc,
                             card_table=card, kind=kind)


def stream_prune(ck: CheckpointRef, kept: list[list[int]] | list[tuple[int, ...]], out: str | Path, *,
                 meta: Meta, card_table: Card = "", overwrite: bool = False, shard_size: str | int = "5GB",
                 uneven: bool = False) -> dict:
    """Remove every query head not in `kept[i]` (and KV heads left without queries), streaming;
    `uneven`: KV groups may end up different in size (--unit head)."""
    geometry = ck.geometry
    keeps = [keep_for_query_heads(g, k, uneven) for g, k in zip(geometry, kept)]
    new_geometry = [k.geometry(g) for k, g in zip(keeps, geometry)]

    def layer_fn(i: int, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if new_geometry[i] == geometry[i]:
            return {}  # nothing removed in this layer: its tensors are copied as they are
        return prune_layer_tensors(tensors, ck.adapter, ck.layer_prefixes[i], geometry[i], keeps[i])

    return stream_surgery(ck, out, new_geometry, layer_fn, meta=meta, card_table=card_table,
                          overwrite=overwrite, shard_size=shard_size)


def stream_convert_mean(ck: CheckpointRef, n_kv: int, out: str | Path, *, meta: Meta, card_table: Card = "",
                        overwrite: bool = False, shard_size: str | int = "5GB") -> dict:
    """Average the K/V projections of contiguous groups into `n_kv` KV heads per layer, streaming."""
    geometry = ck.geometry
    check_target(ck.adapter, geometry, n_kv)
    plans = contiguous_plans(geometry, n_kv)

    def layer_fn(i: int, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        plan = plans[i]
        if not plan.merged:
            return {}  # already n_kv KV heads or fewer: its tensors are copied as they are
        return mean_layer_tensors(tensors, ck.adapter, ck.layer_prefixes[i], geometry[i], plan.groups, plan.new_geo)

    return stream_surgery(ck, out, [p.new_geo for p in plans], layer_fn, meta=meta, card_table=card_table,
                          overwrite=overwrite, shard_size=shard_size)
