"""Pure tensor math on an adapter's description of a layer: slice heads out, put heads back.

Everything here takes tensors and `HeadTensor` layouts and returns new tensors; nothing needs
a model object, so the same functions serve in-memory models and checkpoints streamed shard
by shard (one implementation for both).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from ..errors import UsageError
from .base import Adapter, HeadTensor, LayerHeads


@dataclass(frozen=True)
class LayerKeep:
    """Which query heads and KV heads of one layer survive (original indices, ascending), and how
    many kept query heads each kept KV head serves (None: the groups stay equal)."""

    q: tuple[int, ...]
    kv: tuple[int, ...]
    group_sizes: tuple[int, ...] | None = None

    def of(self, kind: str) -> tuple[int, ...]:
        return self.q if kind in ("q", "o") else self.kv

    def geometry(self, old: LayerHeads) -> LayerHeads:
        return LayerHeads(len(self.q), len(self.kv), old.head_dim, self.group_sizes)


def keep_for_query_heads(geo: LayerHeads, kept_q: Sequence[int], uneven: bool = False) -> LayerKeep:
    """KV heads that still serve a kept query head survive.

    The groups must stay equal in size unless `uneven` (prune --unit head: the layer keeps every
    KV head with a reader, each serving what is left of its group); UsageError otherwise when
    the kept query heads would leave groups of different sizes.
    """
    kept_q = tuple(sorted(set(int(h) for h in kept_q)))
    if not kept_q:
        raise UsageError("cannot remove every query head of a layer (use --min-heads-per-layer >= 1)")
    if any(h < 0 or h >= geo.num_heads for h in kept_q):
        raise UsageError(f"head index out of range 0..{geo.num_heads - 1}: {list(kept_q)}")
    per_group: dict[int, int] = {}
    for h in kept_q:
        per_group[geo.kv_head_of(h)] = per_group.get(geo.kv_head_of(h), 0) + 1
    sizes = tuple(per_group[k] for k in sorted(per_group))
    if len(set(sizes)) > 1 and not uneven:
        raise UsageError(f"kept query heads {list(kept_q)} leave KV groups of unequal sizes "
                         f"{sorted(per_group.items())}; every group of a layer must keep the same number "
                         "(or prune with --unit head)")
    return LayerKeep(kept_q, tuple(sorted(per_group)), sizes if len(set(sizes)) > 1 else None)


def _move_axis_front(t: torch.Tensor, axis: int) -> torch.Tensor:
    return t.movedim(axis, 0)


def extract_heads(tensor: torch.Tensor, ht: HeadTensor, geo: LayerHeads, kind: str) -> torch.Tensor:
    """The `kind` slices of `tensor` as [num_heads_of_kind, head_dim, *other dims]."""
    pos = ht.positions(kind, geo)  # [n, hd]
    t = _move_axis_front(tensor, ht.axis)
    return t[pos.reshape(-1)].reshape(*pos.shape, *t.shape[1:])


def assemble(ht: HeadTensor, geo: LayerHeads, blocks: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Build a tensor of layout `ht` for geometry `geo` from per-kind blocks [n, hd, *rest]."""
    first = next(iter(blocks.values()))
    rest = first.shape[2:]
    out = first.new_empty((ht.size(geo), *rest))
    for kind in ht.kinds:
        b = blocks[kind]
        pos = ht.positions(kind, geo)
        if tuple(b.shape[:2]) != tuple(pos.shape):
            raise ValueError(f"{ht.name}: {kind} block has shape {tuple(b.shape[:2])}, layout wants {tuple(pos.shape)}")
        out[pos.reshape(-1)] = b.reshape(-1, *rest)
    return out.movedim(0, ht.axis).contiguous()


def slice_positions(ht: HeadTensor, geo: LayerHeads, keep: LayerKeep) -> torch.Tensor:
    """Indices along `ht.axis` that survive, in storage order (keeps fused layouts valid)."""
    idx = [ht.positions(k, geo)[list(keep.of(k))].reshape(-1) for k in ht.kinds]
    return torch.cat(idx).sort().values


def slice_tensor(tensor: torch.Tensor, ht: HeadTensor, geo: LayerHeads, keep: LayerKeep) -> torch.Tensor:
    """`tensor` with only the kept heads' slices along its head axis."""
    if tensor.shape[ht.axis] != ht.size(geo):
        raise UsageError(f"{ht.name}: axis {ht.axis} has {tensor.shape[ht.axis]} entries, "
                         f"expected {ht.size(geo)} for {geo}")
    pos = slice_positions(ht, geo, keep).tolist()
    runs: list[tuple[int, int]] = []  # (start, length) of consecutive kept positions
    for p in pos:
        if runs and runs[-1][0] + runs[-1][1] == p:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((p, 1))
    # whole slabs copied per run of heads: much faster than a gather along a column axis
    return torch.cat([tensor.narrow(ht.axis, s, n) for s, n in runs], dim=ht.axis).contiguous() if runs else \
        tensor.narrow(ht.axis, 0, 0).contiguous()


def layer_tensor_names(adapter: Adapter, prefix: str, available: Sequence[str] | set[str]) -> list[tuple[str, HeadTensor]]:
    """(full key, layout) of every head-carrying tensor of a layer present in `available`.

    A required tensor that is missing is a UsageError (a truncated or foreign checkpoint).
    """
    out = []
    avail = set(available)
    for ht in adapter.tensors:
        key = prefix + ht.name
        if key in avail:
            out.append((key, ht))
        elif not ht.optional:
            raise UsageError(f"weights missing for a layer: {key} is not in the checkpoint")
    return out


def prune_layer_tensors(
    tensors: Mapping[str, torch.Tensor], adapter: Adapter, prefix: str, geo: LayerHeads, keep: LayerKeep
) -> dict[str, torch.Tensor]:
    """New values of a layer's head-carrying tensors after keeping `keep` (others unchanged)."""
    return {key: slice_tensor(tensors[key], ht, geo, keep)
            for key, ht in layer_tensor_names(adapter, prefix, tensors.keys())}
