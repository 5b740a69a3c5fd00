"""A small built-in low-rank adapter (LoRA-style) that is merged back into the weights.

`heal --train lora` trains W + (alpha / r) * B @ A on the attention projections with W frozen,
then folds the product into W, so the output is a plain checkpoint of the student's own
architecture (no adapter files, no peft at load time). Built in because peft would be a
dependency for ~80 lines, and it cannot wrap the Conv1D of GPT-2 and headtool's own
non-uniform attention the same way; this works on any ``nn.Linear`` or ``Conv1D``.
"""
from __future__ import annotations

import math
from typing import Iterable

import torch
from torch import nn


def _conv1d_class():
    try:
        from transformers.pytorch_utils import Conv1D

        return Conv1D
    except ImportError:  # pragma: no cover
        return ()


def is_projection(module: nn.Module) -> bool:
    """Modules a low-rank update can wrap: nn.Linear and transformers' Conv1D (weight [in, out])."""
    return isinstance(module, (nn.Linear, _conv1d_class()))


class LowRankLinear(nn.Module):
    """`base(x) + scale * x A^T B^T` with `base` frozen; B starts at zero, so it starts as `base`."""

    def __init__(self, base: nn.Module, rank: int, alpha: float, generator: torch.Generator | None = None):
        super().__init__()
        if rank < 1:
            raise ValueError("rank must be at least 1")
        self.base = base
        self.conv1d = not isinstance(base, nn.Linear)
        w = base.weight
        d_in, d_out = (w.shape[0], w.shape[1]) if self.conv1d else (w.shape[1], w.shape[0])
        self.rank = rank
        self.scale = alpha / rank
        a = torch.empty(rank, d_in, dtype=torch.float32)
        bound = 1.0 / math.sqrt(d_in)  # kaiming-uniform(a=sqrt(5)) bound, as nn.Linear and LoRA use
        a.uniform_(-bound, bound, generator=generator)
        self.lora_a = nn.Parameter(a.to(device=w.device, dtype=w.dtype))
        self.lora_b = nn.Parameter(torch.zeros(d_out, rank, device=w.device, dtype=w.dtype))
        for p in base.parameters():
            p.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.lora_a.to(x.dtype)
        b = self.lora_b.to(x.dtype)
        return self.base(x) + (x @ a.t() @ b.t()) * self.scale

    @property
    def weight(self) -> torch.Tensor:
        """The effective weight, base + update, in the base's layout and differentiable in the update:
        for modeling code that reads a projection's weight instead of calling it (latent attention's
        absorbed and folded paths)."""
        w = self.base.weight
        return w + self.delta().to(device=w.device, dtype=w.dtype)

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base.bias

    def delta(self) -> torch.Tensor:
        """The update in the base weight's own layout."""
        d = (self.lora_b.float() @ self.lora_a.float()) * self.scale  # [out, in]
        return d.t() if self.conv1d else d

    @torch.no_grad()
    def merged(self) -> nn.Module:
        """The base module with the update folded into its weight."""
        w = self.base.weight
        w.add_(self.delta().to(device=w.device, dtype=w.dtype))
        return self.base


def add_lowrank(model: nn.Module, roots: Iterable[nn.Module], rank: int, alpha: float,
                seed: int = 0) -> list[str]:
    """Wrap every projection under each of `roots` in place; returns the wrapped modules' names.

    Every parameter of `model` is frozen except the new low-rank factors. The factors are
    initialised from `seed` alone, so a resumed run rebuilds the same modules.
    """
    for p in model.parameters():
        p.requires_grad_(False)
    g = torch.Generator().manual_seed(seed)
    targets = {id(m) for root in roots for m in root.modules() if is_projection(m)}
    found = [(n, m) for n, m in model.named_modules() if id(m) in targets and n]
    most = max((min(m.weight.shape) for _, m in found), default=0)
    if found and rank > most:  # B @ A of a larger rank spans nothing more, at the memory of its rank
        from ..errors import UsageError

        raise UsageError(f"--lora-rank {rank} is more than any adapted projection's update can use (at most "
                         f"{most}, the smaller side of the largest); give --lora-rank {most} or less, or "
                         "--train attention to train the projections themselves")
    wrapped: list[str] = []
    for full, child in found:  # named_modules order: deterministic, so resumes rebuild the same
        parent_name, _, attr = full.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, LowRankLinear(child, rank, alpha, generator=g))
        wrapped.append(full)
    if not wrapped:
        raise ValueError("no linear projections found to adapt")
    return wrapped


def merge_lowrank(model: nn.Module) -> int:
    """Fold every low-rank update into its base weight and remove the wrappers; returns the count."""
    count = 0
    for name, mod in list(model.named_modules()):
        if isinstance(mod, LowRankLinear):
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, attr, mod.merged())
            count += 1
    return count
