"""Second moments of the attention input, collected on calibration batches.

Every q, k and v of a layer is an affine map of the same attention input x (the normed
hidden state that enters q_proj / k_proj / v_proj, or a fused qkv_proj). So the Gram matrix
of x~ = [x, 1] gives every statistic K/V merging needs (query energies per frequency plane,
K/V covariances and cross-covariances, merge errors) for any head and any candidate merged
projection, in closed form, without storing activations. One forward pre-hook per layer on
the module the adapter names; works the same for separate and fused projections.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn

from ..arch import Adapter
from ..console import progress
from ..data.batches import real_token_count
from .layerwise import Replayer, real_tokens, record_inputs


def _layer_sums(model: nn.Module, adapter: Adapter, batches: Sequence[dict], layers: Sequence[int] | None,
                device, attach: Callable[[int, Callable[[str, torch.Tensor], None]], list]) -> tuple[dict, float, list]:
    """Run the layers one at a time on cached hidden states; `attach(i, add)` registers layer i's
    hooks (returned as handles), which call `add(name, x)` with x [batch, seq, f] (one Gram) or
    [batch, seq, heads, f] (one per head), summed in float64 over the real tokens under `name`.
    Returns (sums per layer and name, the number of real tokens, the layers)."""
    layers = list(range(adapter.num_layers(model.config))) if layers is None else list(layers)
    wanted = set(layers)
    inputs = record_inputs(model, adapter, batches, store="cpu" if device is not None else None)
    replay = Replayer(inputs, device)
    count = float(real_token_count(batches))  # the recorded masks are the batches' own
    sums: dict[int, dict[str, torch.Tensor]] = {}
    state: dict = {}

    def before(b: int, dev) -> None:
        state["mask"] = replay.mask(b, dev)

    def adder(i: int) -> Callable[[str, torch.Tensor], None]:
        def add(name: str, x: torch.Tensor) -> None:
            # [batch, seq, f] -> one Gram [f, f]; [batch, seq, heads, f] -> one per head [heads, f, f]
            x = x.detach()
            rows = real_tokens(x.reshape(*x.shape[:2], -1), state["mask"]).to(torch.float64)
            rows = rows.reshape(rows.shape[0], *x.shape[2:])
            g = (rows.T @ rows).cpu() if rows.dim() == 2 else torch.einsum("nhd,nhe->hde", rows, rows).cpu()
            layer = sums.setdefault(i, {})
            layer[name] = g if name not in layer else layer[name] + g
        return add

    hidden = inputs.hidden
    last = max(layers) if layers else -1
    with progress() as bar:
        task = bar.add_task("calibrating", total=last + 1, rate="")
        for i in range(last + 1):
            handles = attach(i, adder(i)) if i in wanted else []
            try:
                hidden = replay.run(adapter.layer_module(model, i), i, hidden, before_batch=before)
            finally:
                for handle in handles:
                    handle.remove()
            bar.update(task, advance=1)
    return sums, max(count, 1.0), layers


def _with_one(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x, torch.ones_like(x[..., :1])], dim=-1)


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
    def attach(i: int, add) -> list:
        def hook(module: nn.Module, args: tuple) -> None:
            add("x", _with_one(args[0]))
        return [adapter.projection_module(model, i, "q").register_forward_pre_hook(hook)]

    sums, count, layers = _layer_sums(model, adapter, batches, layers, device, attach)
    return {i: sums[i]["x"] / count for i in layers}


@dataclass
class NormedGrams:
    """Second moments of a layer whose queries and keys are RMS-normed per head (Qwen 3, Gemma 3):
    q and k are no affine maps of the attention input there, so the statistics are taken on the
    normed heads themselves. `q` [H, d, d]: E[q_h q_h^T] of every normed query head (cross-head
    terms are never needed); `kv` [2Kd+1, 2Kd+1]: E[f~ f~^T] of f~ = [normed k_1..k_K, v_1..v_K, 1]."""

    q: torch.Tensor
    kv: torch.Tensor


@torch.no_grad()
def normed_head_grams(model: nn.Module, adapter: Adapter, batches: Sequence[dict],
                      layers: Sequence[int] | None = None,
                      device: torch.device | str | None = None) -> dict[int, NormedGrams]:
    """`NormedGrams` per layer: the layer's q/k/v projection outputs, q and k through the layer's
    own q_norm / k_norm (per head, whatever layout the family's forward gives them)."""
    geometry = adapter.geometry(model.config)

    def attach(i: int, add) -> list:
        layer = adapter.layer_module(model, i)
        q_norm, k_norm = (layer.get_submodule(name.rpartition(".")[0]) for name in adapter.qk_norm)
        d = geometry[i].head_dim
        seen: dict[str, torch.Tensor] = {}

        def heads(out: torch.Tensor) -> torch.Tensor:  # [b, t, n * d] -> [b, t, n, d]
            return out.reshape(*out.shape[:2], -1, d)

        def q_hook(module, args, out) -> None:
            add("q", q_norm(heads(out)))

        def pair(name: str, value: torch.Tensor) -> None:
            seen[name] = value.reshape(*value.shape[:2], -1)
            if len(seen) == 2:
                add("kv", _with_one(torch.cat([seen.pop("k"), seen.pop("v")], dim=-1)))

        def k_hook(module, args, out) -> None:
            pair("k", k_norm(heads(out)))

        def v_hook(module, args, out) -> None:
            pair("v", out)

        return [adapter.projection_module(model, i, kind).register_forward_hook(hook)
                for kind, hook in (("q", q_hook), ("k", k_hook), ("v", v_hook))]

    sums, count, layers = _layer_sums(model, adapter, batches, layers, device, attach)
    return {i: NormedGrams(sums[i]["q"] / count, sums[i]["kv"] / count) for i in layers}
