"""How many heads each layer loses, from what the refit cannot repair (`prune --normalize obs`).

Scores say how much the loss needs a head with every other head in place; the output-projection
refit then rebuilds much of a removed head's output from the heads its layer keeps, so a head that
is important but redundant costs little, and the scores cannot see that. This allocation asks the
refit itself (Optimal Brain Surgeon on heads, as ZipLM and SlimGPT do for structured pruning):

- per layer, on the calibration blocks of the unpruned model: the Gram matrix of the output
  projection's input (every head's output side by side) and E||dL/dy||², the mean squared gradient
  of the loss with respect to the attention output y (the layer's loss sensitivity: an error e at
  y costs about E[(g·e)²] ≈ E||g||² E||e||² / d);
- per layer and per count the layer may lose (its removal steps, as `select_heads` takes them): the
  error the anchored refit leaves when the heads it would choose are removed (`removal_cost` with
  `choose_removals`, exactly what `--choose-in-layer refit` minimizes, here on the unpruned inputs);
- the counts: the split of the target's number of heads over the layers (protected layers lose
  none) that minimizes the sum of sensitivity x error, by dynamic programming (exact; the errors
  are not additive over layers in truth, since a layer's refit sees the drift of the layers before
  it, which the sequential refit then repairs as it can).

Which heads go inside a layer is still `--choose-in-layer`'s: with `--compensate` the refit's
choice, the steps of the scores otherwise. Costs one forward and backward pass over the
calibration blocks, as gradient scoring does; where prune scores on those blocks with a gradient
method, that very pass (`SensitivityProbe` attached to the scoring): no pass of its own.
"""
from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
from torch import nn

from ..arch import Adapter, LayerHeads
from ..console import progress
from ..data.batches import to_device
from ..errors import UsageError
from ..measure.objectives import objective_losses, forward_output
from ..measure.scoring import scoring_mode
from ..model.placement import input_device
from .compensation import LayerStats, o_proj_matrix, removal_cost
from .selection import Selection, Target, choose_removals, layer_steps, selection_from_steps


@dataclass
class LayerSensitivity:
    """Per layer: the output projection's input Gram (float64, with a constant column when the
    projection has a bias), the tokens it sums over, and sum ||dL/dy||² over those tokens."""

    grams: list[torch.Tensor]
    gradient_energy: list[float]
    tokens: int
    seconds: float = 0.0


@torch.no_grad()
def _gram_of(x: torch.Tensor, bias: bool) -> torch.Tensor:
    rows = x.detach().reshape(-1, x.shape[-1]).to(torch.float64)
    if bias:
        rows = torch.cat([rows, torch.ones_like(rows[:, :1])], dim=1)
    return (rows.T @ rows).cpu()


class SensitivityProbe:
    """What `layer_sensitivity` measures, collected on whatever forward and backward passes run while it
    is attached: each output projection's input Gram (a pre-hook) and the gradient at its output, taken
    through a zero added to that output (a hook), so no path through later layers is cut. Gradient
    scoring runs the same passes over the same blocks: attached there (`score_heads(probe=...)`), the
    allocation costs no pass of its own.

    Per batch: `start_batch()` before the forward, `leaves()` after it (the zeros to differentiate
    against, in layer order), `add_gradients(grads, scale, tokens)` with the gradients of the loss
    whose mean over the batch's weighted tokens is the objective, times `scale`."""

    def __init__(self, model: nn.Module, adapter: Adapter, layers: Sequence[int] | None = None):
        self.model, self.adapter = model, adapter
        self.layers = list(range(adapter.num_layers(model.config))) if layers is None else list(layers)
        self.grams: dict[int, torch.Tensor] = {}
        self.energy = {i: 0.0 for i in self.layers}
        self.tokens = 0
        self._zeros: dict[int, torch.Tensor] = {}
        self._order: list[int] = []

    @contextmanager
    def attached(self) -> Iterator["SensitivityProbe"]:
        handles = []
        try:
            for i in self.layers:
                module = self.adapter.o_proj_module(self.model, i)
                handles += self._hooks(i, module, getattr(module, "bias", None) is not None)
            yield self
        finally:
            for h in handles:
                h.remove()
            self._zeros.clear()

    def _hooks(self, i: int, module: nn.Module, bias: bool) -> list:
        def pre(mod, args) -> None:
            g = _gram_of(args[0], bias)
            self.grams[i] = g if i not in self.grams else self.grams[i] + g

        def post(mod, args, out):
            zero = torch.zeros_like(out, requires_grad=True)
            self._zeros[i] = zero
            return out + zero
        return [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]

    def start_batch(self) -> None:
        self._zeros.clear()

    def leaves(self) -> list[torch.Tensor]:
        self._order = [i for i in self.layers if i in self._zeros]
        return [self._zeros[i] for i in self._order]

    def add_gradients(self, grads: Sequence[torch.Tensor | None], scale: float, tokens: int) -> None:
        for i, g in zip(self._order, grads):
            if g is not None:
                self.energy[i] += float((g.detach().to(torch.float64) * scale).pow(2).sum())
        self.tokens += tokens

    def result(self, seconds: float = 0.0) -> LayerSensitivity:
        return LayerSensitivity([self.grams[i] for i in self.layers], [self.energy[i] for i in self.layers],
                                self.tokens, seconds)


def layer_sensitivity(model: nn.Module, adapter: Adapter, batches: Sequence[dict], objective: str,
                      layers: Sequence[int] | None = None) -> LayerSensitivity:
    """One forward and backward pass per batch (parameters frozen) with a `SensitivityProbe` attached:
    every layer's output-projection input Gram and the squared gradient of the loss at its attention
    output."""
    t0 = time.perf_counter()
    device = input_device(model)
    probe = SensitivityProbe(model, adapter, layers)
    with scoring_mode(model), torch.enable_grad(), progress() as bar, probe.attached():
        task = bar.add_task("layer sensitivity", total=len(batches), rate="")
        for batch in batches:
            b = to_device(batch, device)
            probe.start_batch()
            out, _ = forward_output(model, b)
            losses, w = objective_losses(objective, out, b)
            total = (losses * w).sum() / w.sum().clamp_min(1.0)
            grads = torch.autograd.grad(total, probe.leaves(), allow_unused=True)
            probe.add_gradients(grads, 1.0, int(b["input_ids"].numel()))
            bar.update(task, advance=1)
    return probe.result(time.perf_counter() - t0)


def layer_errors(model: nn.Module, adapter: Adapter, geometry: Sequence[LayerHeads], grams: Sequence[torch.Tensor],
                 counts: Sequence[Sequence[int]], unit: str, damping: float, anchor: float) -> list[list[float]]:
    """For every layer and every count it may lose (counts[i], ascending, starting at 0), the error the
    anchored refit leaves after removing the heads it would choose: the increase of the refit
    objective over the layer with all heads (the unpruned model's inputs). At `anchor` also under
    --anchor-power: costed at the freer anchors a prune then gives, the split piled the heads into
    fewer layers and held up worse out of domain (seeds 0-1 of obs_allocation*.json)."""
    out = []
    for i, (geo, gram) in enumerate(zip(geometry, grams)):
        module = adapter.o_proj_module(model, i)
        w = o_proj_matrix(adapter, module)  # with the bias as a last column, as the Gram has the constant
        bias = getattr(module, "bias", None) is not None
        stats = LayerStats(gram, gram @ w.T, float((w @ gram * w).sum()), 0, bias)
        cost = removal_cost(stats, damping, adapter, geo, anchor=anchor, w0=w)
        base = cost([])
        chosen = choose_removals(geo, counts[i], unit, cost)
        out.append([0.0 if n == 0 else max(cost(chosen[n]) - base, 0.0) for n in counts[i]])
    return out


def split_counts(costs: Sequence[Sequence[float]], counts: Sequence[Sequence[int]], total: int) -> list[int] | None:
    """The choice of one count per layer (counts[i][k] heads at costs[i][k]) that removes exactly
    `total` heads at the least summed cost (dynamic programming over layers; ties: fewer heads in
    earlier layers); None when no choice sums to `total`."""
    inf = math.inf
    best = [0.0] + [inf] * total
    picks: list[list[int]] = []
    for cs, ns in zip(costs, counts):
        new, pick = [inf] * (total + 1), [-1] * (total + 1)
        for s in range(total + 1):
            for k, (n, c) in enumerate(zip(ns, cs)):
                if n <= s and best[s - n] < inf and best[s - n] + c < new[s]:
                    new[s], pick[s] = best[s - n] + c, k
        best = new
        picks.append(pick)
    if best[total] == inf:
        return None
    chosen, s = [0] * len(counts), total
    for i in reversed(range(len(counts))):
        k = picks[i][s]
        chosen[i] = counts[i][k]
        s -= counts[i][k]
    return chosen


@dataclass
class ObsAllocation:
    """The selection, and what it was made from (for headtool.json)."""

    selection: Selection
    sensitivity: list[float]  # E||dL/dy||² per layer (mean over tokens)
    seconds: float
    shared_pass: bool = False  # the sensitivity came from the scoring pass (no pass of its own)

    def record(self) -> dict:
        out = {"layer_sensitivity": [float(f"{v:.6g}") for v in self.sensitivity], "seconds": round(self.seconds, 2)}
        if self.shared_pass:
            out["sensitivity_from"] = "the scoring pass"
        return out


def obs_selection(model: nn.Module, adapter: Adapter, geometry: Sequence[LayerHeads], scores: Sequence[Sequence[float]],
                  target: Target, total: int, batches: Sequence[dict], objective: str, *, damping: float,
                  anchor: float, sensitivity: LayerSensitivity | None = None) -> ObsAllocation:
    """`total` heads removed, split over the layers by sensitivity x refit error (module doc); inside a
    layer the first steps of the scores (the refit re-chooses the heads with --compensate).
    `sensitivity`: measured already on these blocks (a `SensitivityProbe` attached while scoring);
    else one forward and backward pass over `batches` measures it here."""
    if math.isinf(anchor):
        raise UsageError("--normalize obs allocates by what the refit repairs: it needs a refit (an --anchor "
                         "that is not inf)")
    steps = layer_steps(scores, geometry, target)
    counts = [[0] + [sum(len(s) for s in st[:k]) for k in range(1, len(st) + 1)] for st in steps]
    sens = sensitivity if sensitivity is not None else layer_sensitivity(model, adapter, batches, objective)
    t0 = time.perf_counter()
    per_token = [e / max(sens.tokens, 1) for e in sens.gradient_energy]
    errors = layer_errors(model, adapter, geometry, [g / max(sens.tokens, 1) for g in sens.grams], counts,
                          target.unit, damping, anchor)
    costs = [[p * e for e in row] for p, row in zip(per_token, errors)]
    split = split_counts(costs, counts, total)
    if split is None:
        raise UsageError(f"no split of {total} heads over the layers' removal steps exists")
    taken = [ns.index(n) for ns, n in zip(counts, split)]  # counts are the steps' running totals
    return ObsAllocation(selection_from_steps(geometry, steps, taken), per_token,
                         sens.seconds + time.perf_counter() - t0, sensitivity is not None)
