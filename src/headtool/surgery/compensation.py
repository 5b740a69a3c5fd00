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
from ..errors import UsageError
from ..measure.layerwise import Replayer, real_tokens, record_inputs


@dataclass
class LayerStats:
    """G = X'ᵀX', C = X'ᵀY (float64; a last row/column for the bias when there is one), tr(YᵀY)."""

    G: torch.Tensor
    C: torch.Tensor
    yy: float
    tokens: int
    bias: bool

    def restrict(self, columns: Sequence[int]) -> LayerStats:
        """Statistics of the kept input columns only (the bias column, if any, stays)."""
        idx = list(columns) + ([self.G.shape[0] - 1] if self.bias else [])
        ix = torch.tensor(idx, dtype=torch.long)
        return LayerStats(self.G[ix][:, ix], self.C[ix], self.yy, self.tokens, self.bias)


# ----------------------------------------------------------------------------- weights
def o_proj_matrix(adapter: Adapter, module: nn.Module) -> torch.Tensor:
    """The output projection as W [out, in] (float64) with its bias as an extra column if any."""
    w = module.weight.detach().to(torch.float64)
    w = w if adapter.o_axis(module) == 1 else w.T
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
        module.weight.copy_((w if adapter.o_axis(module) == 1 else w.T).to(module.weight.dtype))


def o_columns(adapter: Adapter, geo: LayerHeads, heads: Sequence[int]) -> list[int]:
    """Input columns of the output projection that belong to query heads `heads`."""
    ht = next(t for t in adapter.tensors if t.kinds == ("o",) and t.name.endswith("weight"))
    pos = ht.positions("o", geo)
    return [int(c) for h in heads for c in pos[h]]


# ----------------------------------------------------------------------------- math on statistics
def _mean_diag(G: torch.Tensor, bias: bool) -> float:
    n = G.shape[0] - (1 if bias else 0)
    return float(G.diagonal()[:n].mean()) if n else 0.0


def _damped(G: torch.Tensor, damping: float, bias: bool) -> torch.Tensor:
    n = G.shape[0] - (1 if bias else 0)
    lam = damping * float(G.diagonal()[:n].mean()) if n else 0.0
    Gd = G.clone()
    Gd.diagonal()[:n] += max(lam, 1e-12)
    return Gd


def _anchored(stats: LayerStats, damping: float, anchor: float, w0: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The normal equations H Wᵀ = B of the anchored ridge, and μ (the anchor's absolute strength)."""
    mu = anchor * _mean_diag(stats.G, stats.bias)
    H = _damped(stats.G, damping, stats.bias)
    H.diagonal().add_(mu)
    return H, stats.C + mu * w0.to(torch.float64).T, mu


def ridge_solution(stats: LayerStats, damping: float, anchor: float = 0.0,
                   w0: torch.Tensor | None = None) -> torch.Tensor:
    """W [out, in(+1)] minimizing ||X'Wᵀ - Y||² + λ||W||² + μ||W - W0||² (float64).

    λ = damping and μ = anchor, each times the mean diagonal of G (the bias column left out of
    the mean). The damping is numerical and leaves the bias alone; the anchor pulls every
    column, bias included, toward W0, the weights the layer has without a refit. Closed form:
    Wᵀ = (G + λI + μI)⁻¹ (C + μW0ᵀ). `anchor` 0 is the plain damped refit (W0 not needed),
    `anchor` inf is W0 itself (no refit).
    """
    if anchor == 0:
        return torch.linalg.solve(_damped(stats.G, damping, stats.bias), stats.C).T
    if w0 is None:
        raise ValueError("an anchored refit needs the weights it is anchored to (w0)")
    if math.isinf(anchor):
        return w0.to(torch.float64).clone()
    H, B, _ = _anchored(stats, damping, anchor, w0)
    return torch.linalg.solve(H, B).T


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


@dataclass
class ObsFactor:
    """A removal set's columns S with what extending S needs: the Cholesky factor L of (G⁻¹)_SS, Z = L⁻¹W_Sᵀ
    and the cost ||Z||² (= obs_cost). `chol` None: S is empty, or its factorization failed (`exact`
    False), and every set grown from it is costed from scratch."""

    columns: list[int]
    chol: torch.Tensor | None
    z: torch.Tensor | None
    value: float
    exact: bool = True


class _ObsCost:
    """obs_cost for many column sets of one layer: tr(((G⁻¹)_SS)⁻¹ (WᵀW)_SS), one Cholesky a set.

    The same number as obs_cost up to rounding, at a fraction of the work: the set's block of
    WᵀW is precomputed for the whole layer once instead of solving for every output row.

    A search that grows sets one unit at a time (choose_removals' beam) extends a set's factor
    instead (`extension_values`, `extended`): with L, Z of S and a block c of new columns,
    X = L⁻¹(G⁻¹)_Sc, the Schur complement (G⁻¹)_cc - XᵀX = L_c L_cᵀ and Z_c = L_c⁻¹(W_cᵀ - XᵀZ) give
    cost(S ∪ c) = cost(S) + ||Z_c||², every candidate block of a round in one batched solve.
    """

    def __init__(self, w: torch.Tensor, g_inv: torch.Tensor):
        self.w, self.g_inv = w, g_inv
        self.p = w.T @ w

    def __call__(self, columns: Sequence[int]) -> float:
        if not columns:
            return 0.0
        s = torch.tensor(list(columns), dtype=torch.long)
        chol, info = torch.linalg.cholesky_ex(self.g_inv[s][:, s])
        if int(info):  # not numerically positive definite: the general solve
            return obs_cost(self.w, self.g_inv, columns)
        return float((torch.cholesky_inverse(chol) * self.p[s][:, s]).sum())

    def empty(self) -> ObsFactor:
        return ObsFactor([], None, None, 0.0)

    def _schur(self, f: ObsFactor, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """For blocks [k, b] of columns: the Schur complements [k, b, b] of S in S ∪ block, the
        right-hand sides W_cᵀ - XᵀZ [k, b, out] and X [n, k*b] (None for an empty S)."""
        diag = self.g_inv[blocks[:, :, None], blocks[:, None, :]]
        rhs = self.w[:, blocks].permute(1, 2, 0)
        if not f.columns:
            return diag, rhs, None
        k, b = blocks.shape
        s = torch.tensor(f.columns, dtype=torch.long)
        x = torch.linalg.solve_triangular(f.chol, self.g_inv[s[:, None], blocks.reshape(1, -1)], upper=False)
        xk = x.T.reshape(k, b, -1)
        return diag - xk @ xk.transpose(1, 2), rhs - xk @ f.z, x

    def extension_values(self, f: ObsFactor, blocks: Sequence[Sequence[int]]) -> list[float]:
        """cost(S ∪ block) for every block (each of the same number of columns, none in S)."""
        if not blocks:
            return []
        if not f.exact or len({len(b) for b in blocks}) > 1:
            return [self(f.columns + list(b)) for b in blocks]
        diag, rhs, _ = self._schur(f, torch.tensor([list(b) for b in blocks], dtype=torch.long))
        chol, info = torch.linalg.cholesky_ex(diag)
        z = torch.linalg.solve_triangular(chol, rhs, upper=False)
        out = (f.value + z.pow(2).sum((1, 2))).tolist()
        for j in info.nonzero().flatten().tolist():  # that set's block is not numerically definite
            out[j] = self(f.columns + list(blocks[j]))
        return out

    def extended(self, f: ObsFactor, block: Sequence[int]) -> ObsFactor:
        """The factor of S ∪ block."""
        columns = f.columns + list(block)
        if not f.exact:
            return ObsFactor(columns, None, None, self(columns), exact=False)
        diag, rhs, x = self._schur(f, torch.tensor([list(block)], dtype=torch.long))
        lc, info = torch.linalg.cholesky_ex(diag[0])
        if int(info):
            return ObsFactor(columns, None, None, self(columns), exact=False)
        zc = torch.linalg.solve_triangular(lc, rhs[0], upper=False)
        n, b = len(f.columns), len(block)
        chol = lc.new_zeros(n + b, n + b)
        chol[n:, n:] = lc
        if n:
            chol[:n, :n] = f.chol
            chol[n:, :n] = x.T
        z = zc if f.z is None else torch.cat([f.z, zc])
        return ObsFactor(columns, chol, z, f.value + float(zc.pow(2).sum()))


class RemovalCost:
    """cost(query heads) of one layer: base + the obs cost of the heads' columns - mu x their columns'
    squared weights (the anchored refit's terms, removal_cost). Also incremental, for a search that
    grows sets one unit at a time (selection.IncrementalCost): a state is a set's ObsFactor and its
    summed column penalty."""

    def __init__(self, obs: _ObsCost, head_columns: Sequence[Sequence[int]], base: float,
                 col_norm: torch.Tensor | None = None, mu: float = 0.0):
        self.obs, self.base, self.mu = obs, base, mu
        self.head_columns = [list(c) for c in head_columns]
        self.col_norm = col_norm

    def _columns(self, heads: Sequence[int]) -> list[int]:
        return [c for h in heads for c in self.head_columns[h]]

    def _penalty(self, cols: Sequence[int]) -> float:
        return self.mu * float(self.col_norm[list(cols)].sum()) if self.mu and cols else 0.0

    def __call__(self, heads: Sequence[int]) -> float:
        cols = self._columns(heads)
        return self.base + self.obs(cols) - self._penalty(cols) if cols else self.base

    def start(self) -> tuple[ObsFactor, float]:
        return self.obs.empty(), 0.0

    def extensions(self, state: tuple[ObsFactor, float], units: Sequence[Sequence[int]]) -> list[float]:
        factor, penalty = state
        blocks = [self._columns(u) for u in units]
        values = self.obs.extension_values(factor, blocks)
        return [self.base + v - penalty - self._penalty(b) for v, b in zip(values, blocks)]

    def extend(self, state: tuple[ObsFactor, float], unit: Sequence[int]) -> tuple[ObsFactor, float]:
        factor, penalty = state
        block = self._columns(unit)
        return self.obs.extended(factor, block), penalty + self._penalty(block)


def removal_cost(stats: LayerStats, damping: float, adapter: Adapter, geo: LayerHeads,
                 anchor: float = 0.0, w0: torch.Tensor | None = None) -> Callable[[list[int]], float]:
    """cost(query heads) = objective left after removing them and refitting the rest.

    Uses the layer's own best refit W* (not its current weights), so the cost also counts
    what earlier layers' changes did to this layer's input: exact, not an approximation.
    With `anchor` (and `w0`, the layer's weights before removal) the refit is the anchored
    one, toward W0 with the removed columns dropped; `anchor` inf: no refit, the cost is the
    error of W0 with the columns dropped.
    """
    if anchor != 0 and w0 is None:
        raise ValueError("an anchored removal cost needs the layer's weights (w0)")
    head_columns = [o_columns(adapter, geo, [h]) for h in range(geo.num_heads)]
    if math.isinf(anchor):
        def no_refit(heads: list[int]) -> float:
            w = w0.to(torch.float64).clone()
            w[:, [c for h in heads for c in head_columns[h]]] = 0.0
            return squared_error(stats, w)
        return no_refit
    if anchor == 0:
        gd = _damped(stats.G, damping, stats.bias)
        w_star = torch.linalg.solve(gd, stats.C).T
        base = float(stats.yy - (w_star.T * stats.C).sum())  # objective of W* (ridge)
        return RemovalCost(_ObsCost(w_star, torch.linalg.inv(gd)), head_columns, base)
    H, B, mu = _anchored(stats, damping, anchor, w0)
    w_star = torch.linalg.solve(H, B).T
    w0 = w0.to(torch.float64)
    # objective of W*: tr(YᵀY) + μ||W0||² - tr(W* B); the removed columns' μ||W0_S||² is no
    # part of the pruned layer's objective (its anchor is W0 without those columns)
    base = float(stats.yy + mu * (w0 * w0).sum() - (w_star.T * B).sum())
    return RemovalCost(_ObsCost(w_star, torch.linalg.inv(H)), head_columns, base, (w0 * w0).sum(0), mu)


# ----------------------------------------------------------------------------- choosing the anchor
ANCHOR_GRID = (0.0, 0.01, 0.1, 1.0, 10.0, math.inf)


# The default strength. Measured once on SmolLM2-135M calibrated on 32 blocks of builtin:pydoc
# (8 more held out), perplexity ratios on 16 further pydoc blocks / on 16 blocks of English prose
# (quotations, fortune's literature files) that the calibration never saw:
# 3 -> 1 KV fit + refit: anchor 0 2.79x / 7.17x, 0.1 (what per-layer held-out choice mostly
# picks) 2.35x / 5.48x, 1 2.70x / 4.16x, 10 3.59x / 4.73x, inf (no refit) 4.50x / 4.72x;
# 25% of query heads with --compensate: 0 1.095x / 1.266x, 1 1.084x / 1.247x. A layer's
# held-out error cannot see how the layers' changes compound, so choosing per layer favours
# weak anchors that fit the calibration domain; 1 held up best out of domain.
DEFAULT_ANCHOR = 1.0


def anchor_candidates(anchor: float | Sequence[float]) -> list[float]:
    """The anchor strengths to choose from, strongest first; inf (no refit) is always one."""
    values = [anchor] if isinstance(anchor, (int, float)) else list(anchor)
    out = set()
    for a in values:
        a = float(a)
        if math.isnan(a) or a < 0:
            raise UsageError(f"anchor strengths must be >= 0 or inf (got {a:g})")
        out.add(a)
    return sorted(out | {math.inf}, reverse=True)


def kept_share_anchor(anchor: float | Sequence[float], kept: int, heads: int,
                      power: float) -> float | Sequence[float]:
    """A pruned layer's anchor under --anchor-power: every strength times (kept / heads) ** power,
    so a layer that lost most of its heads gets a freer refit (its few remaining heads must carry
    what the others did; measured out of domain on SmolLM2, see prune --anchor-power). power 0:
    the anchor as given."""
    if not power:
        return anchor
    factor = (kept / heads) ** power
    if isinstance(anchor, (int, float)):
        return anchor * factor
    return tuple(a * factor for a in anchor)


def _label(a: float) -> str:
    return f"{a:g}"


def _rank(e: float) -> float:
    return e if math.isfinite(e) else math.inf


def choose_anchor(stats: LayerStats, w0: torch.Tensor, damping: float, anchor: float | Sequence[float],
                  held: LayerStats | None = None) -> tuple[torch.Tensor | None, dict]:
    """The refit of one layer with the anchor strength that does best, or None (keep W0).

    Every candidate is solved on the calibration statistics `stats` and judged on `held` (the
    held-out statistics) when given, else on `stats`; the error of any weights follows from
    the statistics, so no candidate costs a forward. W0 (anchor inf) is always a candidate and
    wins ties, as does a stronger anchor over a weaker one. The record: calibration errors of
    W0 and of the best finite-anchor refit (`rel_error_before` / `rel_error_after`), the same
    on held-out data when given, `kept` (the refit is applied), `anchor` (its strength, None
    when W0 stays) and, with several finite candidates, every candidate's judged error.
    """
    judge = held if held is not None else stats
    candidates = anchor_candidates(anchor)
    before = relative_error(judge, w0)
    judged: dict[float, float] = {math.inf: before}
    best: tuple[float, torch.Tensor, float] | None = None  # (anchor, W, judged error)
    for a in candidates:
        if math.isinf(a):
            continue
        w = ridge_solution(stats, damping, a, w0)
        e = relative_error(judge, w)
        judged[a] = e
        if best is None or _rank(e) < _rank(best[2]):  # strictly: ties stay with the stronger anchor
            best = (a, w, e)
    rec: dict = {"rel_error_before": relative_error(stats, w0) if held is not None else before}
    if best is None:
        rec["rel_error_after"] = rec["rel_error_before"]
        w_best = None
    else:
        w_best = best[1]
        rec["rel_error_after"] = relative_error(stats, w_best) if held is not None else best[2]
    if held is not None:
        rec["heldout_rel_error_before"] = before
        rec["heldout_rel_error_after"] = best[2] if best is not None else before
    keep = best is not None and best[2] < before
    if not all(math.isfinite(v) for v in rec.values()):
        keep = False
    rec["kept"] = bool(keep)
    rec["anchor"] = best[0] if keep else None
    if len(judged) > 2:
        key = "heldout_rel_errors" if held is not None else "rel_errors"
        rec[key] = {_label(a): (e if math.isfinite(e) else None) for a, e in sorted(judged.items())}
    return (w_best if keep else None), rec


# ----------------------------------------------------------------------------- collecting
class _Acc:
    """G, C, tr(YᵀY) accumulated batch by batch (float64 on CPU): no activations are kept."""

    def __init__(self, bias: bool):
        self.bias = bias
        self.G: torch.Tensor | None = None
        self.C: torch.Tensor | None = None
        self.yy, self.tokens = 0.0, 0

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """One batch: inputs X' and targets Y [N, features]."""
        x = x.to(torch.float64).cpu()
        if self.bias:
            x = torch.cat([x, torch.ones_like(x[:, :1])], dim=1)
        y = y.to(torch.float64).cpu()
        self.G = x.T @ x if self.G is None else self.G + x.T @ x
        self.C = x.T @ y if self.C is None else self.C + x.T @ y
        self.yy += float((y * y).sum())
        self.tokens += x.shape[0]

    def stats(self) -> LayerStats:
        return LayerStats(self.G, self.C, self.yy, self.tokens, self.bias)


def _accumulate(xs: Sequence[torch.Tensor], ys: Sequence[torch.Tensor], bias: bool) -> LayerStats:
    """G, C, tr(YᵀY) from per-batch inputs X' and targets Y ([N, features] each)."""
    acc = _Acc(bias)
    for x, y in zip(xs, ys):
        acc.add(x, y)
    return acc.stats()


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

    def _run_capturing(self, layer: nn.Module, o_proj: nn.Module, index: int, hidden, acc: _Acc | None):
        """Run `layer` on `hidden`; o_proj's outputs Y on the real tokens, per batch (with `acc`:
        its inputs X too, accumulated with Y at once and no Y kept)."""
        ys: list[torch.Tensor] = []
        state: dict = {}

        def before(b: int, dev) -> None:
            state["mask"] = self.replay.mask(b, dev)

        def grab_x(module, args):
            state["x"] = real_tokens(args[0], state["mask"]).float().cpu()

        def grab_y(module, args, out):
            y = real_tokens(out[0] if isinstance(out, tuple) else out, state["mask"]).float().cpu()
            if acc is None:
                ys.append(y)
            else:
                acc.add(state.pop("x"), y)

        handles = ([o_proj.register_forward_pre_hook(grab_x)] if acc is not None else []) + \
                  [o_proj.register_forward_hook(grab_y)]
        try:
            outs = self.replay.run(layer, index, hidden, before_batch=before)
        finally:
            for h in handles:
                h.remove()
        return outs, ys

    def layer_stats(self, original, modified, adapter: Adapter, index: int) -> LayerStats:
        """Statistics of layer `index` (modified's input X' against original's output Y); advances `orig`.

        The original layer runs whole (its output feeds the next layer); the modified one only
        up to its output projection, whose input is all that is needed of it here.
        """
        lo, o_orig = adapter.layer_module(original, index), adapter.o_proj_module(original, index)
        o_mod = adapter.o_proj_module(modified, index)
        acc = _Acc(getattr(o_mod, "bias", None) is not None)
        if self.diverged:
            self.orig, ys = self._run_capturing(lo, o_orig, index, self.orig, None)

            def take(b: int, x: torch.Tensor) -> None:
                acc.add(real_tokens(x, self.replay.mask(b, x.device)).float().cpu(), ys[b])
                ys[b] = None  # accumulated: free it

            self.replay.inputs_of(adapter.layer_module(modified, index), index, self.mod, o_mod, take)
        else:  # the same model on the same inputs: one pass gives both
            self.orig, _ = self._run_capturing(lo, o_orig, index, self.orig, acc)
        return acc.stats()

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
    anchor: float | Sequence[float] = DEFAULT_ANCHOR,
    heldout_batches: Sequence[dict] | None = None,
    on_layer: OnLayer | None = None,
    device: torch.device | str | None = None,
    layer_anchor: Callable[[int], float | Sequence[float]] | None = None,
) -> list[dict]:
    """Refit `modified`'s output projections, layer by layer, to reproduce `original`'s.

    Each layer's refit is the ridge toward W0, the weights the layer has without a refit
    (`ridge_solution`): `anchor` is its strength relative to the mean diagonal of the Gram
    matrix (0: the plain damped refit as before anchors existed, inf: no refit; default
    DEFAULT_ANCHOR), one value or several (e.g. ANCHOR_GRID) to choose from per layer. The
    candidates, and W0 itself, are judged on `heldout_batches` when given (else on the
    calibration batches) and the best is applied (`choose_anchor`): with one value, the
    refit is kept only where it lowers that error.

    Returns per layer {layer, rel_error_before, rel_error_after, tokens, kept, anchor} (and
    the held-out errors when `heldout_batches` are given; every candidate's judged error when
    there are several). `original` may be `modified` itself when `on_layer` makes the
    changes: each layer's targets are taken before `on_layer` touches it. `layer_anchor(layer)`,
    asked after `on_layer`, overrides `anchor` per layer (prune's --anchor-power).

    The layers are replayed one at a time on cached hidden states (layerwise.py): one pass
    per layer and model. With `device`, the models stay where they are (e.g. on CPU, hidden
    states too) and each layer moves to `device` only while it runs.
    """
    anchor_candidates(anchor)  # a usage error before any work
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
            strength = layer_anchor(layer) if layer_anchor is not None else anchor
            w_new, rec = choose_anchor(stats, o_proj_matrix(adapter, module), damping, strength, held)
            row = {"layer": layer, "rel_error_before": rec.pop("rel_error_before"),
                   "rel_error_after": rec.pop("rel_error_after"), "tokens": stats.tokens, **rec}
            if w_new is not None:
                set_o_proj_matrix(adapter, module, w_new)
            changed = row["kept"] or columns is not None or original is not modified
            for s in streams:
                if layer < layers[-1]:
                    s.advance_modified(modified, adapter, layer, changed)
            report.append(row)
            bar.update(task, advance=1, rate=f"layer {layer}: {row['rel_error_before']:.3g} -> "
                                             f"{row['rel_error_after']:.3g}")
    return report


def refit_table(report: Sequence[dict]) -> str:
    """The per-layer refit record as a markdown table (for summaries and model cards)."""
    held = any("heldout_rel_error_before" in r for r in report)
    head = "| layer | anchor | calibration error | " + ("held-out error | " if held else "") + "refit |"
    lines = [head, "|---:|---:|---|" + ("---|" if held else "") + "---|"]
    for r in report:
        a = r.get("anchor")
        cells = [str(r["layer"]), "-" if a is None else f"{a:g}",
                 f"{r['rel_error_before']:.4g} → {r['rel_error_after']:.4g}"]
        if held:
            cells.append(f"{r['heldout_rel_error_before']:.4g} → {r['heldout_rel_error_after']:.4g}"
                         if "heldout_rel_error_before" in r else "-")
        cells.append("kept" if r["kept"] else "rejected")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def refit_heading(heldout: dict | None) -> str:
    """The model card's line above `refit_table` for a conversion: what judged each layer's refit (its
    anchor, or none): held-out blocks (their Batches info), or without any the calibration blocks it was
    fitted to, where a refit nearly always looks better than none."""
    what = "Output-projection refit per layer (anchor: the pull toward the weights without a refit, "
    if heldout:
        return what + f"chosen on held-out blocks of `{heldout.get('source')}`):"
    return what + ("kept where it lowered the error on the calibration blocks it was fitted to: no held-out "
                   "blocks, --heldout-samples 0):")
