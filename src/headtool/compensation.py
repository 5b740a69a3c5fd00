"""Least-squares refit of output projections after heads are removed or K/V heads merged.

For one layer, the output projection maps x' (its input in the modified model) to the
attention output; we want it to reproduce y (the original model's attention output on the
same model inputs). With x' augmented by a constant 1 when the projection has a bias, every
quantity needed comes from three accumulated statistics: G = X'ᵀX', C = X'ᵀY and tr(YᵀY).
The ridge solution is W = (G + λI)⁻¹ C with λ relative to the mean diagonal of G; the same
statistics give the error of any weights, and the OBS identity gives, in closed form, the
error left after refitting without any subset of the input columns (which heads to remove).

Calibration is sequential: layer l is fitted on inputs produced by the modified model whose
earlier layers are already changed and refit. The original's outputs are captured for all
layers in one pass first, so `original` may be the very model that is modified afterwards.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn

from .arch import Adapter, LayerHeads
from .console import progress
from .evaluation import to_device


class _Stop(Exception):
    """Raised in a hook to end a forward pass once the layer of interest has been seen."""


@dataclass
class LayerStats:
    """G = X'ᵀX', C = X'ᵀY (float64; a last row/column for the bias when there is one), tr(YᵀY)."""

    G: torch.Tensor
    C: torch.Tensor
    yy: float
    tokens: int
    bias: bool

    def restrict(self, columns: Sequence[int]) -> "LayerStats":
        """Statistics of the kept input columns only (the bias column, if any, stays)."""
        idx = list(columns) + ([self.G.shape[0] - 1] if self.bias else [])
        ix = torch.tensor(idx, dtype=torch.long)
        return LayerStats(self.G[ix][:, ix], self.C[ix], self.yy, self.tokens, self.bias)


# ----------------------------------------------------------------------------- weights
def o_proj_matrix(adapter: Adapter, module: nn.Module) -> torch.Tensor:
    """The output projection as W [out, in] (float64) with its bias as an extra column if any."""
    w = module.weight.detach().to(torch.float64)
    w = w if adapter.o_axis() == 1 else w.T
    b = getattr(module, "bias", None)
    if b is not None:
        w = torch.cat([w, b.detach().to(torch.float64)[:, None]], dim=1)
    return w


def set_o_proj_matrix(adapter: Adapter, module: nn.Module, w: torch.Tensor) -> None:
    """Write W [out, in(+1 bias column)] back into the module (its layout and dtype)."""
    b = getattr(module, "bias", None)
    with torch.no_grad():
        if b is not None:
            b.copy_(w[:, -1].to(b.dtype))
            w = w[:, :-1]
        module.weight.copy_((w if adapter.o_axis() == 1 else w.T).to(module.weight.dtype))


def o_columns(adapter: Adapter, geo: LayerHeads, heads: Sequence[int]) -> list[int]:
    """Input columns of the output projection that belong to query heads `heads`."""
    ht = next(t for t in adapter.tensors if t.kinds == ("o",) and t.name.endswith("weight"))
    pos = ht.positions("o", geo)
    return [int(c) for h in heads for c in pos[h]]


# ----------------------------------------------------------------------------- math on statistics
def _damped(G: torch.Tensor, damping: float, bias: bool) -> torch.Tensor:
    n = G.shape[0] - (1 if bias else 0)
    lam = damping * float(G.diagonal()[:n].mean()) if n else 0.0
    Gd = G.clone()
    Gd.diagonal()[:n] += max(lam, 1e-12)
    return Gd


def ridge_solution(stats: LayerStats, damping: float) -> torch.Tensor:
    """W [out, in(+1)] minimizing ||X'Wᵀ - Y||² + λ||W||² (float64)."""
    return torch.linalg.solve(_damped(stats.G, damping, stats.bias), stats.C).T


def squared_error(stats: LayerStats, w: torch.Tensor) -> float:
    """||X'Wᵀ - Y||² from the statistics alone."""
    wt = w.T
    return float(stats.yy - 2.0 * (wt * stats.C).sum() + (wt * (stats.G @ wt)).sum())


def relative_error(stats: LayerStats, w: torch.Tensor) -> float:
    return max(squared_error(stats, w), 0.0) / max(stats.yy, 1e-30)


def obs_cost(w: torch.Tensor, g_inv: torch.Tensor, columns: Sequence[int]) -> float:
    """tr(W_S ((G⁻¹)_SS)⁻¹ W_Sᵀ): what removing input columns S of W costs after a refit.

    `w` is [out, in]; with `w` the least-squares solution for G, this is exactly the increase
    of the (ridge) objective when columns S are dropped and the rest refit.
    """
    if not columns:
        return 0.0
    s = torch.tensor(list(columns), dtype=torch.long)
    ws = w[:, s]
    return float((ws * torch.linalg.solve(g_inv[s][:, s], ws.T).T).sum())


def removal_cost(stats: LayerStats, damping: float, adapter: Adapter, geo: LayerHeads
                 ) -> Callable[[list[int]], float]:
    """cost(query heads) = objective left after removing them and refitting the rest.

    Uses the layer's own best refit W* (not its current weights), so the cost also counts
    what earlier layers' changes did to this layer's input: exact, not an approximation.
    """
    gd = _damped(stats.G, damping, stats.bias)
    w_star = torch.linalg.solve(gd, stats.C).T
    g_inv = torch.linalg.inv(gd)
    base = float(stats.yy - (w_star.T * stats.C).sum())  # objective of W* (ridge)
    return lambda heads: base + obs_cost(w_star, g_inv, o_columns(adapter, geo, heads))


# ----------------------------------------------------------------------------- collecting
@torch.no_grad()
def capture_targets(model: nn.Module, adapter: Adapter, batches: Sequence[dict], layers: Sequence[int]
                    ) -> list[dict[int, torch.Tensor]]:
    """Per batch, the output-projection output of `layers` on real tokens ([N, hidden], CPU fp32)."""
    device = next(model.parameters()).device
    out: list[dict[int, torch.Tensor]] = []
    current: dict[int, torch.Tensor] = {}
    state: dict = {}

    def make(i: int):
        def hook(module, args, output):
            y = output[0] if isinstance(output, tuple) else output
            current[i] = _real_tokens(y, state["mask"]).float().cpu()
        return hook

    handles = [adapter.o_proj_module(model, i).register_forward_hook(make(i)) for i in layers]
    try:
        for batch in batches:
            b = to_device(batch, device)
            state["mask"] = b.get("attention_mask")
            current = {}
            model(input_ids=b["input_ids"], attention_mask=b.get("attention_mask"))
            out.append(current)
    finally:
        for h in handles:
            h.remove()
    return out


def _real_tokens(t: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    t = t.reshape(-1, t.shape[-1])
    if mask is None:
        return t
    return t[mask.reshape(-1).to(t.device).bool()]


@torch.no_grad()
def layer_stats(model: nn.Module, adapter: Adapter, layer: int, batches: Sequence[dict],
                targets: Sequence[dict[int, torch.Tensor]]) -> LayerStats:
    """Accumulate G, C, tr(YᵀY) for `layer` of `model` (forward passes stop after that layer)."""
    device = next(model.parameters()).device
    module = adapter.o_proj_module(model, layer)
    bias = getattr(module, "bias", None) is not None
    state: dict = {}

    def hook(mod, args):
        state["x"] = _real_tokens(args[0], state["mask"])
        raise _Stop

    G = C = None
    yy, tokens = 0.0, 0
    handle = module.register_forward_pre_hook(hook)
    try:
        for batch, tgt in zip(batches, targets):
            b = to_device(batch, device)
            state["mask"] = b.get("attention_mask")
            try:
                model(input_ids=b["input_ids"], attention_mask=b.get("attention_mask"))
            except _Stop:
                pass
            x = state.pop("x").to(torch.float64).cpu()
            if bias:
                x = torch.cat([x, torch.ones_like(x[:, :1])], dim=1)
            y = tgt[layer].to(torch.float64)
            G = x.T @ x if G is None else G + x.T @ x
            C = x.T @ y if C is None else C + x.T @ y
            yy += float((y * y).sum())
            tokens += x.shape[0]
    finally:
        handle.remove()
    return LayerStats(G, C, yy, tokens, bias)


# ----------------------------------------------------------------------------- the refit
# on_layer(layer, stats, heldout_stats) may change the layer of `modified` before it is refit
# (prune: choose and remove heads) and returns the input columns that remain (None: all).
OnLayer = Callable[[int, LayerStats, "LayerStats | None"], "Sequence[int] | None"]


def sequential_refit(
    original: nn.Module,
    modified: nn.Module,
    adapter: Adapter,
    batches: Sequence[dict],
    *,
    layers: Sequence[int] | None = None,
    damping: float = 1e-2,
    heldout_batches: Sequence[dict] | None = None,
    on_layer: OnLayer | None = None,
) -> list[dict]:
    """Refit `modified`'s output projections, layer by layer, to reproduce `original`'s.

    Returns per layer {layer, rel_error_before, rel_error_after, kept} (and the held-out
    errors when `heldout_batches` are given: a refit is kept only if it lowers them).
    `original` may be `modified` itself when `on_layer` makes the changes (targets are
    captured before anything is touched).
    """
    n_layers = adapter.num_layers(modified.config)
    layers = sorted(range(n_layers) if layers is None else set(layers))
    targets = capture_targets(original, adapter, batches, layers)
    held_targets = capture_targets(original, adapter, heldout_batches, layers) if heldout_batches else None
    report = []
    with progress() as bar:
        task = bar.add_task("refit", total=len(layers), rate="")
        for layer in layers:
            stats = layer_stats(modified, adapter, layer, batches, targets)
            held = layer_stats(modified, adapter, layer, heldout_batches, held_targets) if held_targets else None
            columns = on_layer(layer, stats, held) if on_layer else None
            if columns is not None:
                stats = stats.restrict(columns)
                held = held.restrict(columns) if held is not None else None
            module = adapter.o_proj_module(modified, layer)
            w_old = o_proj_matrix(adapter, module)
            w_new = ridge_solution(stats, damping)
            row = {"layer": layer, "rel_error_before": relative_error(stats, w_old),
                   "rel_error_after": relative_error(stats, w_new), "tokens": stats.tokens}
            keep = row["rel_error_after"] < row["rel_error_before"]
            if held is not None:
                row["heldout_rel_error_before"] = relative_error(held, w_old)
                row["heldout_rel_error_after"] = relative_error(held, w_new)
                keep = row["heldout_rel_error_after"] < row["heldout_rel_error_before"]
            if not all(math.isfinite(v) for k, v in row.items() if k.startswith(("rel", "held"))):
                keep = False
            row["kept"] = bool(keep)
            if keep:
                set_o_proj_matrix(adapter, module, w_new)
            report.append(row)
            bar.update(task, advance=1, rate=f"layer {layer}: {row['rel_error_before']:.3g} -> "
                                             f"{row['rel_error_after']:.3g}")
    return report
