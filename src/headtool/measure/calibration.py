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

from ..arch import Adapter
from ..console import progress
from .layerwise import Replayer, real_tokens, record_inputs


@torch.no_grad()
def attention_input_grams(
    model: nn.Module,
    adapter: Adapter,
    batches: Sequence[dict],
    layers: Sequence[int] | None = None,
    device: torch.device | str | None = None,
) -> dict[int, torch.Tensor]:
    """E[x~ x~^T] (float64, [D+1, D+1], last coordinate the constant 1) per layer.

    Averaged over the real (attention-mask) tokens of `batches`; padding is left out. The
    layers run one at a time on cached hidden states (layerwise.py); with `device`, the model
    stays where it is and each layer moves to `device` only while it runs.
    """
    layers = list(range(adapter.num_layers(model.config))) if layers is None else list(layers)
    wanted = set(layers)
    inputs = record_inputs(model, adapter, batches, store="cpu" if device is not None else None)
    replay = Replayer(inputs, device)
    count = sum(float(m.sum()) if m is not None else float(h.shape[0] * h.shape[1])
                for h, m in zip(inputs.hidden, inputs.masks))
    sums: dict[int, torch.Tensor] = {}
    state: dict = {}

    def before(b: int, dev) -> None:
        state["mask"] = replay.mask(b, dev)

    def make(i: int):
        def hook(module: nn.Module, args: tuple) -> None:
            x = real_tokens(args[0].detach(), state["mask"]).to(torch.float64)
            xa = torch.cat([x, torch.ones_like(x[:, :1])], dim=1)
            g = (xa.T @ xa).cpu()
            sums[i] = g if i not in sums else sums[i] + g
        return hook

    hidden = inputs.hidden
    last = max(layers) if layers else -1
    with progress() as bar:
        task = bar.add_task("calibrating", total=last + 1, rate="")
        for i in range(last + 1):
            handle = (adapter.projection_module(model, i, "q").register_forward_pre_hook(make(i))
                      if i in wanted else None)
            try:
                hidden = replay.run(adapter.layer_module(model, i), i, hidden, before_batch=before)
            finally:
                if handle is not None:
                    handle.remove()
            bar.update(task, advance=1)
    return {i: sums[i] / max(count, 1.0) for i in layers}
