"""Per-head gates on the input of every layer's output projection.

Multiplying head h's slice of the output-projection input by g_h is the same operation for
eager, sdpa and flash attention and for every family, which is why scoring, ablation and the
equivalence tests all go through it. Hooks are removed on exit, also on exceptions.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Sequence

import torch
from torch import nn

from ..arch import Adapter, LayerHeads
from ..model.placement import input_device


class HeadGates:
    """Gate values for every layer: `values[i]` has shape [num_heads_i] or [batch, num_heads_i].

    Layers may differ in head count (pruned models), hence a list rather than one tensor;
    `stacked()` gives a [layers, heads] tensor when all layers agree.
    """

    def __init__(self, geometry: Sequence[LayerHeads], values: list[torch.Tensor]):
        self.geometry = list(geometry)
        self.values = values

    def __getitem__(self, layer: int) -> torch.Tensor:
        return self.values[layer]

    def set(self, layer: int, head: int, value: float) -> None:
        with torch.no_grad():
            self.values[layer][..., head] = value

    def fill_(self, value: float) -> None:
        with torch.no_grad():
            for v in self.values:
                v.fill_(value)

    def load(self, mask: Sequence[Sequence[float]] | torch.Tensor) -> None:
        """Copy a layers x heads mask (nested lists or tensor) into the gates."""
        with torch.no_grad():
            for v, row in zip(self.values, mask):
                v.copy_(torch.as_tensor(row, dtype=v.dtype).expand_as(v))

    def grads(self) -> list[torch.Tensor | None]:
        return [v.grad for v in self.values]

    def zero_grad(self) -> None:
        for v in self.values:
            v.grad = None

    def stacked(self) -> torch.Tensor:
        return torch.stack(list(self.values))


def _gate_hook(heads: LayerHeads, gates: HeadGates, layer: int):
    def hook(module: nn.Module, args: tuple) -> tuple:
        x = args[0]
        g = gates.values[layer]
        if g is None:
            return None
        shape = x.shape
        xh = x.reshape(*shape[:-1], heads.num_heads, heads.head_dim)
        if g.dim() == 1:
            gb = g
        else:  # per-example gates [B, H] -> broadcast over the sequence dims
            gb = g.reshape(g.shape[0], *([1] * (xh.dim() - 3)), heads.num_heads)
        xh = xh * gb.to(device=x.device, dtype=x.dtype)[..., None]  # layers may sit on other devices
        return (xh.reshape(shape), *args[1:])

    return hook


@contextmanager
def head_gates(
    model: nn.Module,
    adapter: Adapter,
    *,
    init: float | Sequence[Sequence[float]] | torch.Tensor = 1.0,
    requires_grad: bool = False,
    batch_size: int | None = None,
    dtype: torch.dtype = torch.float32,
    geometry: Sequence[LayerHeads] | None = None,
) -> Iterator[HeadGates]:
    """Attach gates to `model`; yields a HeadGates whose values may be changed while inside.

    `batch_size` gives gates a batch dimension ([B, H] per layer), so that one backward
    gives every example's gradient (Fisher scoring). `requires_grad` makes them leaves
    that collect gradients; parameters are untouched.
    """
    geometry = list(geometry or adapter.geometry(model.config))
    device = input_device(model)
    values = []
    for i, g in enumerate(geometry):
        shape = (g.num_heads,) if batch_size is None else (batch_size, g.num_heads)
        if isinstance(init, (int, float)):
            v = torch.full(shape, float(init), dtype=dtype, device=device)
        else:
            v = torch.as_tensor(init[i], dtype=dtype, device=device).expand(shape).clone()
        v.requires_grad_(requires_grad)
        values.append(v)
    gates = HeadGates(geometry, values)
    handles = []
    try:
        for i, g in enumerate(geometry):
            mod = adapter.o_proj_module(model, i)
            handles.append(mod.register_forward_pre_hook(_gate_hook(g, gates, i)))
        yield gates
    finally:
        for h in handles:
            h.remove()


@contextmanager
def capture_o_proj_inputs(model: nn.Module, adapter: Adapter, layers: Sequence[int], store: dict) -> Iterator[dict]:
    """Record the output-projection input of `layers` on each forward into `store[layer]` (list of tensors)."""
    handles = []

    def make(i: int):
        def hook(module, args):
            store.setdefault(i, []).append(args[0].detach())
        return hook

    try:
        for i in layers:
            handles.append(adapter.o_proj_module(model, i).register_forward_pre_hook(make(i)))
        yield store
    finally:
        for h in handles:
            h.remove()
