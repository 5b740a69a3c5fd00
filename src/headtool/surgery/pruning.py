"""Pruning as a library call: selection -> surgery -> (compensation) -> summary.

Works on an in-memory model (recipes, notebooks) as well as for `headtool prune`:

    sel = select_heads(scores, loaded.geometry, Target(fraction=0.25))
    result = prune(loaded, sel, calib_batches=batches, compensate=True)

The model is changed in place; `write_output` in checkpoint.py saves it.
"""
from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, Sequence

from torch import nn

from ..arch import Adapter, LayerHeads
from ..arch.heads import keep_for_query_heads, prune_layer_tensors
from ..data.batches import real_token_count
from ..errors import UsageError
from ..measure.evaluation import against_text, evaluate
from ..model.info import model_info
from ..model.placement import require_resident_weights
from ..model.resize import resize_attention
from .compensation import (
    DEFAULT_ANCHOR,
    anchor_candidates,
    kept_share_anchor,
    o_columns,
    o_proj_matrix,
    refit_table,
    removal_cost,
    sequential_refit,
)
from .prune_defaults import DEFAULT_PRUNE_DAMPING, default_anchor_power
from .selection import Selection, choose_removal

CHOICES = ("auto", "scores", "refit")
REFIT_LAYERS = ("pruned", "all")


def normalization_label(mode: str) -> str:
    """The scores a --normalize mode allocates heads from, in words (summary, card and progress log)."""
    return {"layer": "per-layer normalized scores", "geometric": "scores between raw and per-layer normalized",
            "none": "raw scores", "obs": "refit errors weighted by loss sensitivity"}.get(mode, mode)


@dataclass
class PruneResult:
    """What changed, with the figures for the summary and headtool.json."""

    selection: Selection
    geometry_before: list[LayerHeads]
    geometry_after: list[LayerHeads]
    info_before: dict
    info_after: dict
    eval_before: dict | None = None
    eval_after: dict | None = None
    compensation: list[dict] = field(default_factory=list)
    choice: str = "scores"
    elapsed_s: float = 0.0
    #: how many heads each layer lost came from scores normalized so ({"normalize", "candidates": [...]},
    #: with the held-out losses when several were compared); None: the scores as they were given
    allocation: dict | None = None
    #: the --anchor-power the refit used (given, or default_anchor_power of its calibration); None: no refit
    anchor_power: float | None = None

    def layers(self) -> list[dict[str, Any]]:
        rows = []
        for i, (g0, g1, kept) in enumerate(zip(self.geometry_before, self.geometry_after, self.selection.kept)):
            row = {"layer": i, "heads_before": g0.num_heads, "heads_after": g1.num_heads,
                   "kv_heads_before": g0.num_kv_heads, "kv_heads_after": g1.num_kv_heads,
                   "kept_heads": list(kept), "removed_heads": sorted(set(range(g0.num_heads)) - set(kept))}
            if g1.uneven:  # --unit head: query heads per kept KV head
                row["kv_group_sizes_after"] = list(g1.group_sizes)
            rows.append(row)
        return rows

    def totals(self) -> dict[str, Any]:
        keys = ("params", "attention_params", "kv_cache_bytes_per_token", "total_heads", "total_kv_heads")
        return {k: {"before": self.info_before[k], "after": self.info_after[k]} for k in keys}

    def summary(self) -> dict[str, Any]:
        out = {"layers": self.layers(), "totals": self.totals(),
               "heads_removed": self.info_before["total_heads"] - self.info_after["total_heads"],
               "in_layer_choice": self.choice, "elapsed_s": round(self.elapsed_s, 3)}
        if self.eval_before is not None:
            out["eval"] = {"before": self.eval_before, "after": self.eval_after}
        if self.compensation:
            out["compensation"] = self.compensation
        if self.allocation:
            out["allocation"] = self.allocation
        return out

    def allocation_line(self) -> str | None:
        """One sentence on the layer allocation: which normalization, and what it was compared with."""
        a = self.allocation
        if not a:
            return None
        label = normalization_label
        chosen = f"heads per layer from {label(a['normalize'])} (--normalize {a['normalize']})"
        others = [c for c in a["candidates"] if c["normalize"] != a["normalize"] and "heldout_loss" in c]
        if not others:
            return chosen
        mine = next(c for c in a["candidates"] if c["normalize"] == a["normalize"])
        on = (a.get("compared_on") or {}).get("source")
        where = f"{a['heldout_blocks']} blocks" + (f" of {'self text' if on == 'self' else on}" if on else "")
        vs = against_text([(label(c["normalize"]), c) for c in others], where)
        return f"{chosen}: held-out loss {mine['heldout_loss']:.4f} {vs}"


def prune_layer(model, adapter: Adapter, layer: int, geo: LayerHeads, kept: Sequence[int],
                uneven: bool = False) -> LayerHeads:
    """Remove every query head of `layer` not in `kept` (and KV heads left without queries);
    `uneven`: the KV groups may end up different in size (--unit head)."""
    keep = keep_for_query_heads(geo, kept, uneven)
    if keep.q == tuple(range(geo.num_heads)) and keep.kv == tuple(range(geo.num_kv_heads)):
        return geo
    prefix = adapter.layer_prefix(model, layer)
    layer_sd = {k: v for k, v in model.state_dict().items() if k.startswith(prefix)}
    new_geo = keep.geometry(geo)
    resize_attention(model, adapter, layer, new_geo, prune_layer_tensors(layer_sd, adapter, prefix, geo, keep))
    return new_geo


def trial_copy(model: nn.Module, adapter: Adapter) -> nn.Module:
    """A copy of `model` to prune and refit on trial (comparing allocations). Pruning replaces or
    rewrites only each layer's attention and output projection (the modules that hold head-carrying
    tensors), so the copy owns those and shares every other tensor with `model`: a trial costs the
    memory of the attention weights (about a fifth of SmolLM2, a third of a Llama-7B), not of the
    whole model."""
    owned: set[int] = set()
    for i in range(adapter.num_layers(model.config)):
        layer = adapter.layer_module(model, i)
        modules = [adapter.attention_module(model, i), adapter.o_proj_module(model, i)]
        modules += [layer.get_submodule(t.name.rsplit(".", 1)[0]) for t in adapter.tensors]
        owned.update(id(t) for m in modules for t in chain(m.parameters(), m.buffers()))
    shared = {id(t): t for t in chain(model.parameters(), model.buffers()) if id(t) not in owned}
    return copy.deepcopy(model, shared)


def apply_selection(model, adapter: Adapter, selection: Selection, geometry: Sequence[LayerHeads]) -> None:
    """Physically remove the heads `selection` does not keep, every layer, in place."""
    for i, (geo, kept) in enumerate(zip(geometry, selection.kept)):
        prune_layer(model, adapter, i, geo, kept, uneven=True)  # the selection was checked when made


def _evaluate(model, batches, objective):
    return evaluate(model, batches, objective, label="eval") if batches else None


PRUNE_INSTEAD = ("prune with --sequential (one layer at a time on --device) or, with --scores/--heads and no "
                 "--compensate, with --streaming (score with --device-map first)")


def prune(
    loaded,
    selection: Selection,
    *,
    unit: str = "query",
    calib_batches: Sequence[dict] | None = None,
    heldout_batches: Sequence[dict] | None = None,
    compensate: bool = False,
    choose_in_layer: str = "auto",
    refit_layers: str = "pruned",
    damping: float = DEFAULT_PRUNE_DAMPING,
    anchor: float | Sequence[float] = DEFAULT_ANCHOR,
    anchor_power: float | None = None,
    eval_batches: Sequence[dict] | None = None,
    objective: str | None = None,
    calib_device=None,
) -> PruneResult:
    """Prune `loaded.model` in place to `selection` and return the summary figures.

    With `compensate`, layers are processed in order on `calib_batches`: each layer's heads
    to remove are chosen (`choose_in_layer` 'refit': the set whose removal leaves the least
    error after refitting, with the count per layer from `selection`; 'scores': exactly
    `selection`), removed, and the output projection refit by ridge least squares to the
    original attention output (sequential calibration, see compensation.py). With
    `calib_device`, the model stays where it is and each layer visits that device in turn.

    `anchor` pulls each refit toward the layer's weights without a refit (the original output
    projection less the removed heads' columns), relative to the mean diagonal of the Gram
    matrix: 0 is the plain damped refit, inf no refit; several values are candidates chosen
    per layer on `heldout_batches` (which may come from another source than the calibration;
    without them, on the calibration batches). A layer keeps its refit only where it lowers
    that error. The default, compensation.DEFAULT_ANCHOR (1), held up best on text the
    calibration never saw. Heads are chosen ('refit') for the weakest finite candidate.
    `anchor_power` P scales a layer's refit anchor by (kept heads / heads) ** P
    (compensation.kept_share_anchor): the more heads a layer loses, the freer its refit. Which heads
    go is still chosen at `anchor` (costed at the freer anchor, the choices held up worse). `damping`
    and `anchor_power` default to what `headtool prune --compensate` uses (prune_defaults.py: 0.001,
    and a power by the calibration's size, default_anchor_power; measured out of domain); 0.01 and 0
    are the refit before those measurements. The result records the power the refit used.
    """
    if choose_in_layer not in CHOICES:
        raise UsageError(f"--choose-in-layer must be one of {', '.join(CHOICES)} (got {choose_in_layer!r})")
    if refit_layers not in REFIT_LAYERS:
        raise UsageError(f"--refit-layers must be one of {', '.join(REFIT_LAYERS)} (got {refit_layers!r})")
    if compensate and not calib_batches:
        raise UsageError("--compensate needs calibration data (--data)")
    if damping <= 0:
        raise UsageError(f"--damping must be positive (got {damping})")
    if anchor_power is None:
        anchor_power = default_anchor_power(real_token_count(calib_batches or []))
    if anchor_power < 0 or math.isnan(anchor_power):
        raise UsageError(f"--anchor-power must be >= 0 (got {anchor_power:g})")
    candidates = anchor_candidates(anchor)
    cost_anchor = min(candidates)  # inf only when no refit is a candidate
    t0 = time.perf_counter()
    model, adapter = loaded.model, loaded.adapter
    require_resident_weights(model, "prune", PRUNE_INSTEAD)
    geometry = list(adapter.geometry(model.config))
    info_before = model_info(model, adapter)
    eval_before = _evaluate(model, eval_batches, objective)
    choice = ("refit" if compensate else "scores") if choose_in_layer == "auto" else choose_in_layer
    if choice == "refit" and not compensate:
        raise UsageError("--choose-in-layer refit needs --compensate (it ranks heads by the error left after the refit)")
    report: list[dict] = []
    if compensate:
        kept_final: list[tuple[int, ...]] = list(selection.kept)
        layer_anchors: dict[int, float | Sequence[float]] = {}

        def on_layer(layer: int, stats, held) -> list[int]:
            geo = geometry[layer]
            kept = list(selection.kept[layer])
            n_remove = geo.num_heads - len(kept)
            layer_anchors[layer] = kept_share_anchor(anchor, len(kept), geo.num_heads, anchor_power)
            if choice == "refit" and n_remove:
                w0 = o_proj_matrix(adapter, adapter.o_proj_module(model, layer)) if cost_anchor else None
                cost = removal_cost(stats, damping, adapter, geo, anchor=cost_anchor, w0=w0)
                gone = choose_removal(geo, n_remove, unit, cost)
                kept = [h for h in range(geo.num_heads) if h not in set(gone)]
            kept_final[layer] = tuple(kept)
            prune_layer(model, adapter, layer, geo, kept, uneven=unit == "head")
            return o_columns(adapter, geo, kept)

        layers = [i for i, g in enumerate(geometry) if refit_layers == "all" or len(selection.kept[i]) < g.num_heads]
        report = sequential_refit(model, model, adapter, calib_batches, layers=layers, damping=damping,
                                  anchor=anchor, heldout_batches=heldout_batches, on_layer=on_layer, device=calib_device,
                                  layer_anchor=layer_anchors.__getitem__)
        done = set(layers)
        for i, g in enumerate(geometry):  # layers that were not refit are still pruned
            if i not in done:
                prune_layer(model, adapter, i, g, selection.kept[i], uneven=True)
        selection = Selection.from_kept(geometry, kept_final, uneven=unit == "head")
    else:
        apply_selection(model, adapter, selection, geometry)
    info_after = model_info(model, adapter)
    eval_after = _evaluate(model, eval_batches, objective)
    return PruneResult(selection, geometry, list(adapter.geometry(model.config)), info_before, info_after,
                       eval_before, eval_after, report, choice, time.perf_counter() - t0,
                       anchor_power=anchor_power if compensate else None)


def kv_heads_cell(row: dict[str, Any]) -> str:
    """'2 → 2' for a layer row, with the KV groups' sizes where they differ: '2 → 2 (1+2)'."""
    sizes = row.get("kv_group_sizes_after")
    return f"{row['kv_heads_before']} → {row['kv_heads_after']}" + (f" ({'+'.join(map(str, sizes))})" if sizes else "")


def _count(n: int | None) -> str:
    return "n/a" if n is None else f"{n:,}"  # None: an encoder keeps no KV cache


def markdown_table(result: PruneResult) -> str:
    """The summary as markdown (the model card's table; the card's header gives the config kind)."""
    lines = ["| layer | query heads | KV heads | removed (original indices) |", "|---:|---:|---:|---|"]
    for r in result.layers():
        lines.append(f"| {r['layer']} | {r['heads_before']} → {r['heads_after']} | "
                     f"{kv_heads_cell(r)} | "
                     f"{', '.join(map(str, r['removed_heads'])) or '-'} |")
    lines += ["", "| total | before | after |", "|---|---:|---:|"]
    names = {"params": "parameters", "attention_params": "attention parameters",
             "kv_cache_bytes_per_token": "KV-cache bytes per token", "total_heads": "query heads",
             "total_kv_heads": "KV heads"}
    for k, v in result.totals().items():
        lines.append(f"| {names[k]} | {_count(v['before'])} | {_count(v['after'])} |")
    if result.eval_before is not None:
        metric = "perplexity" if "perplexity" in result.eval_before else "accuracy"
        lines.append(f"| eval loss | {result.eval_before['loss']:.4f} | {result.eval_after['loss']:.4f} |")
        lines.append(f"| eval {metric} | {result.eval_before[metric]:.4f} | {result.eval_after[metric]:.4f} |")
    if result.compensation:
        lines += ["", ("Output-projection refit per layer (relative errors before → after; anchor: strength "
                       "toward the unrefit weights, - where the refit was rejected):"), "",
                  refit_table(result.compensation)]
    if result.allocation_line():
        lines += ["", f"Layer allocation: {result.allocation_line()}."]
    return "\n".join(lines)
