"""Second moments of the attention input, collected on calibration batches.

Every q, k and v of a layer is an affine map of the same attention input x (the normed
hidden state that enters q_proj / k_proj / v_proj, or a fused qkv_proj). So the Gram matrix
of x~ = [x, 1] gives every statistic K/V merging needs (query energies per frequency plane,
K/V covariances and cross-covariances, merge errors) for any head and any candidate merged
projection, in closed form, without storing activations. One forward pre-hook per layer on
the module the adapter names; works the same for separate and fused projections.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from .arch import Adapter
from .console import progress
from .evaluation import to_device


@torch.no_grad()
def attention_input_grams(
    model: nn.Module,
    adapter: Adapter,
    batches: Sequence[dict],
    layers: Sequence[int] | None = None,
) -> dict[int, torch.Tensor]:
    """E[x~ x~^T] (float64, [D+1, D+1], last coordinate the constant 1) per layer.

    Averaged over the real (attention-mask) tokens of `batches`; padding is left out.
    """
    layers = list(range(adapter.num_layers(model.config))) if layers is None else list(layers)
    device = next(model.parameters()).device
    sums: dict[int, torch.Tensor] = {}
    state: dict[str, torch.Tensor | None] = {"mask": None}
    count = [0.0]

    def make(i: int):
        def hook(module: nn.Module, args: tuple) -> None:
            x = args[0].detach().to(torch.float64)
            x = x.reshape(-1, x.shape[-1])
            m = state["mask"]
            if m is not None:
                x = x[m.reshape(-1).to(x.device).bool()]
            xa = torch.cat([x, torch.ones_like(x[:, :1])], dim=1)
            g = xa.T @ xa
            sums[i] = g if i not in sums else sums[i] + g
        return hook

    handles = [adapter.projection_module(model, i, "q").register_forward_pre_hook(make(i)) for i in layers]
    try:
        with progress() as bar:
            task = bar.add_task("calibrating", total=len(batches), rate="")
            for batch in batches:
                b = to_device(batch, device)
                mask = b.get("attention_mask")
                state["mask"] = mask
                count[0] += float(mask.sum()) if mask is not None else float(b["input_ids"].numel())
                model(input_ids=b["input_ids"], attention_mask=mask)
                bar.update(task, advance=1)
    finally:
        for h in handles:
            h.remove()
    return {i: (sums[i] / max(count[0], 1.0)).cpu() for i in layers}
