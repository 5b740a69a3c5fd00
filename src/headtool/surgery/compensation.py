"""Least-squares refit of output projections after heads are removed or K/V heads merged.

For one layer, the output projection maps x' (its input in the modified model) to the
attention output; we want it to reproduce y (the original model's attention output on the
same model inputs). With x' augmented by a constant 1 when the projection has a bias, every
quantity needed comes from three accumulated statistics: G = X'ᵀX', C = X'ᵀY and tr(YᵀY).
The ridge solution is W = (G + λI)⁻¹ C with λ relative to the mean diagonal of G; the same
statistics give the error of any weights, and the OBS identity gives, in closed form, the
error left after refitting without any subset of the input columns (which heads to remove).

Calibration is sequential: layer l is fitted on inputs produced by the modified model whose
earlier layers are already changed and refit. The layers are replayed one at a time on cached
hidden states (layerwise.py), the original's and the modified model's side by side, so each
layer costs one pass per model, and `original` may be the very model that is modified as it
goes (each layer's targets are taken before the layer is changed).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn

from ..arch import Adapter, LayerHeads
from ..console import progress
from ..measure.layerwise import Replayer, real_tokens, record_inputs


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
def _accumulate(xs: Sequence[torch.Tensor], ys: Sequence[torch.Tensor], bias: bool) -> LayerStats:
    """G, C, tr(YᵀY) from per-batch inputs X' and targets Y ([N, features] each)."""
    G = C = None
    yy, tokens = 0.0, 0
    for x, y in zip(xs, ys):
        x = x.to(torch.float64).cpu()
        if bias:
            x = torch.cat([x, torch.ones_like(x[:, :1])], dim=1)
        y = y.to(torch.float64).cpu()
        G = x.T @ x if G is None else G + x.T @ x
        C = x.T @ y if C is None else C + x.T @ y
        yy += float((y * y).sum())
        tokens += x.shape[0]
    return LayerStats(G, C, yy, tokens, bias)


class _Stream:
    """One set of batches flowing through the original and the modified model, layer by layer.

    `orig` / `mod` are the hidden states entering the current layer in each model; while
    nothing has been changed yet (`original` is `modified`) they are the same list.
    """

    def __init__(self, original: nn.Module, modified: nn.Module, adapter: Adapter, batches: Sequence[dict],
                 device, store):
        self.inputs = record_inputs(modified, adapter, batches, store=store)
        self.replay = Replayer(self.inputs, device)
        self.orig = self.inputs.hidden
        self.mod = self.orig
        self.diverged = original is not modified

    def _run_capturing(self, layer: nn.Module, o_proj: nn.Module, index: int, hidden, want_x: bool,
                       want_y: bool):
        """Run `layer` on `hidden`; o_proj's inputs X and/or outputs Y on the real tokens, per batch."""
        xs: list[torch.Tensor] = []
        ys: list[torch.Tensor] = []
        state: dict = {}

        def before(b: int, dev) -> None:
            state["mask"] = self.replay.mask(b, dev)

        def grab_x(module, args):
            xs.append(real_tokens(args[0], state["mask"]).float().cpu())

        def grab_y(module, args, out):
            ys.append(real_tokens(out[0] if isinstance(out, tuple) else out, state["mask"]).float().cpu())

        handles = ([o_proj.register_forward_pre_hook(grab_x)] if want_x else []) + \
                  ([o_proj.register_forward_hook(grab_y)] if want_y else [])
        try:
            outs = self.replay.run(layer, index, hidden, before_batch=before)
        finally:
            for h in handles:
                h.remove()
        return outs, xs, ys

    def layer_stats(self, original, modified, adapter: Adapter, index: int) -> LayerStats:
        """Statistics of layer `index` (modified's input X' against original's output Y); advances `orig`."""
        lo, o_orig = adapter.layer_module(original, index), adapter.o_proj_module(original, index)
        o_mod = adapter.o_proj_module(modified, index)
        if self.diverged:
            self.orig, _, ys = self._run_capturing(lo, o_orig, index, self.orig, False, True)
            _, xs, _ = self._run_capturing(adapter.layer_module(modified, index), o_mod, index, self.mod, True, False)
        else:  # the same model on the same inputs: one pass gives both
            self.orig, xs, ys = self._run_capturing(lo, o_orig, index, self.orig, True, True)
        return _accumulate(xs, ys, getattr(o_mod, "bias", None) is not None)

    def advance_modified(self, modified, adapter: Adapter, index: int, changed: bool) -> None:
        """Move `mod` past layer `index` of the (now changed) modified model."""
        if changed or self.diverged:
            self.mod = self.replay.run(adapter.layer_module(modified, index), index, self.mod)
            self.diverged = True
        else:
            self.mod = self.orig

    def advance_both(self, original, modified, adapter: Adapter, index: int) -> None:
        """Move both streams past a layer that is not refit."""
        self.orig = self.replay.run(adapter.layer_module(original, index), index, self.orig)
        self.mod = (self.replay.run(adapter.layer_module(modified, index), index, self.mod)
                    if self.diverged else self.orig)


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
    device: torch.device | str | None = None,
) -> list[dict]:
    """Refit `modified`'s output projections, layer by layer, to reproduce `original`'s.

    Returns per layer {layer, rel_error_before, rel_error_after, kept} (and the held-out
    errors when `heldout_batches` are given: a refit is kept only if it lowers them).
    `original` may be `modified` itself when `on_layer` makes the changes: each layer's
    targets are taken before `on_layer` touches it.

    The layers are replayed one at a time on cached hidden states (layerwise.py): one pass
    per layer and model. With `device`, the models stay where they are (e.g. on CPU, hidden
    states too) and each layer moves to `device` only while it runs.
    """
    n_layers = adapter.num_layers(modified.config)
    layers = sorted(range(n_layers) if layers is None else set(layers))
    if not layers:
        return []
    store = "cpu" if device is not None else None
    streams = [_Stream(original, modified, adapter, batches, device, store)]
    if heldout_batches:
        streams.append(_Stream(original, modified, adapter, heldout_batches, device, store))
    todo = set(layers)
    report = []
    with progress() as bar:
        task = bar.add_task("refit", total=len(layers), rate="")
        for layer in range(layers[-1] + 1):
            if layer not in todo:
                for s in streams:
                    s.advance_both(original, modified, adapter, layer)
                continue
            stats = streams[0].layer_stats(original, modified, adapter, layer)
            held = streams[1].layer_stats(original, modified, adapter, layer) if heldout_batches else None
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
            changed = keep or columns is not None or original is not modified
            for s in streams:
                if layer < layers[-1]:
                    s.advance_modified(modified, adapter, layer, changed)
            report.append(row)
            bar.update(task, advance=1, rate=f"layer {layer}: {row['rel_error_before']:.3g} -> "
                                             f"{row['rel_error_after']:.3g}")
    return report
