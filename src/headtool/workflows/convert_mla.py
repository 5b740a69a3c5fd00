"""`headtool convert-mla`: K/V heads into one shared latent per token (multi-head latent attention),
RoPE kept exact by per-frequency rotations across the KV heads; writes a remote-code folder.

`run_convert_mla` loads, converts and writes; `convert_mla_loaded` converts a model in memory and
is shared with the recipe step `convert_mla`, so both run the same code on the same blocks."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..console import info
from ..data.batches import blocks_read, resolve_auto
from ..data.sources import DataSpec
from ..errors import UsageError
from ..io.output import check_output_target, write_output
from ..io.provenance import RECORD, fitted_on, original_heads_kept_as_is, written_record
from ..measure.evaluation import evaluate
from ..measure.objectives import DATA_TASK, resolve_objective
from ..model.info import conversion_kv_label
from ..model.loading import LoadedModel, load_model
from ..model.placement import require_resident_weights
from ..surgery.compensation import refit_heading, refit_table
from ..surgery.latent import (
    CONVERT_INSTEAD,
    LatentConverted,
    budget_dims,
    check_latent_target,
    convert_model_latent,
    latent_grams,
    ranks_for_budget,
    summary_figures,
)
from .data_plan import calibration_blocks, with_default_blocks
from .requests import LatentRequest, parse_anchor


def _ranks_text(ranks: list[int]) -> str:
    return str(ranks[0]) if len(set(ranks)) == 1 else f"{', '.join(map(str, ranks))} (per layer)"


def card_table(summary: dict[str, Any]) -> str:
    b, a = summary["before"], summary["after"]
    ranks = summary["kv_rank"]
    lines = ["| | before | after |", "| --- | --- | --- |",
             f"| attention | {b['num_heads']} query heads, {b['num_kv_heads']} KV heads | latent attention, "
             f"kv_rank {_ranks_text(ranks)}, rope_dim {summary['rope_dim']} |",
             f"| parameters | {b['params']:,} | {a['params']:,} |",
             f"| {conversion_kv_label(b, 'KV cache bytes per token')} | {b['kv_cache_bytes_per_token']:,} | "
             f"{a['kv_cache_bytes_per_token']:,} |"]
    if summary.get("eval_before"):
        lines.append(f"| eval loss | {summary['eval_before']['loss']:.4f} | {summary['eval_after']['loss']:.4f} |")
    if summary.get("refit"):
        lines += ["", refit_heading(summary.get("heldout_data")), "", refit_table(summary["refit"])]
    return "\n".join(lines)


# Share of a --kv-cache budget that the default --rope-dim gives the rotary key. Measured on
# SmolLM2-135M (benchmarks/results/mla_rope_sweep*.json, pydoc+self calibration, no training,
# perplexity ratio news / legal): at a third of the cache (128 dims a layer) rope_dim 16 7.09x /
# 10.73x, 32 3.20x / 4.81x, 40 2.42x / 3.31x, 48 2.36x / 3.33x, 56 2.47x / 3.51x, 64 (one head's
# rotary dims, the earlier default) 2.70x / 3.90x, 80 3.63x / 5.39x, 96 5.18x / 8.49x; at an
# eighth (48 dims a layer) 8 13.19x / 23.06x, 16 12.60x / 22.59x, (18, this share: 11.99x / 22.10x),
# 24 10.71x / 20.48x, 32 11.51x / 22.67x, 40 14.51x / 27.39x. The best share grows as the budget
# shrinks (3/8 at a third, 1/2 at an eighth); two points of one model are too few for a rule, and
# at an eighth the best split is still far from usable without training.
ROPE_SHARE = 3 / 8


def default_rope_dim(geometry, rot: int, kv_cache: float | None) -> int:
    """--rope-dim when none is given: 0 without RoPE; with a --kv-cache budget, ROPE_SHARE of the
    per-layer budget (even, within what the KV heads rotate), or every rotary dim of the KV heads
    where the budget holds the whole cache (--kv-cache 1: the rotary key of all of them plus the
    full-rank latent is exactly today's size, and the conversion is exact; 3/8 of it dropped RoPE on
    the other slots, far from exact, at no saving); else one head's rotary dims (as DeepSeek and
    TransMLA)."""
    if not rot:
        return 0
    if kv_cache is None:
        return rot
    top = min(g.num_kv_heads for g in geometry) * rot
    if budget_dims(geometry, kv_cache) >= sum(2 * g.num_kv_heads * g.head_dim for g in geometry):
        return top
    per_layer = budget_dims(geometry, kv_cache) / len(geometry)
    return max(2, min(top, 2 * int(per_layer * ROPE_SHARE / 2)))


def latent_target(lm: LoadedModel, req: LatentRequest, geometry=None) -> tuple[list[int], int]:
    """(kv_rank per layer, rope_dim) that `req` asks of this model (of `geometry`, the heads it will
    have when the step runs; default its heads now), or a UsageError (exit 2)."""
    geometry = lm.geometry if geometry is None else geometry
    rot = lm.adapter.rotary_dim(lm.config, geometry[0].head_dim) if lm.adapter.latent else 0
    rope_dim = req.rope_dim
    if rope_dim is None:
        rope_dim = default_rope_dim(geometry, rot, req.kv_cache)
    kv_rank: int | list[int] = req.kv_rank if req.kv_rank is not None else 1
    if req.kv_cache is not None:
        check_latent_target(lm.adapter, lm.config, geometry, 1, rope_dim)  # family and rope_dim first
        kv_rank = ranks_for_budget(geometry, req.kv_cache, rope_dim, req.rank_allocation)
    return check_latent_target(lm.adapter, lm.config, geometry, kv_rank, rope_dim), rope_dim


@dataclass
class MlaRun:
    """What convert_mla_loaded did: the converted model, its summary and its headtool.json entries."""

    conv: LatentConverted
    summary: dict[str, Any]
    meta: dict[str, Any]


def convert_mla_loaded(lm: LoadedModel, req: LatentRequest, *, text_model: LoadedModel | None = None,
                       calib_device=None) -> MlaRun:
    """Calibrate on req.data, convert (lm.model is left untouched), evaluate before and after on
    req.eval_data. `headtool convert-mla` and the recipe step `convert_mla`."""
    req.validate()
    require_resident_weights(lm.model, "convert-mla", CONVERT_INSTEAD)
    ranks, rope_dim = latent_target(lm, req)
    tm = text_model or lm  # the model `--data self` samples from
    spec = with_default_blocks(req.data or DataSpec(), req.default_blocks)
    objective = resolve_objective("auto", lm.task)
    data_task = DATA_TASK[objective]
    spec = resolve_auto(spec, lm.tokenizer, tm, data_task)
    blocks = calibration_blocks(spec, lm.tokenizer, data_task, tm, calibrate=True, hold_out=req.refit,
                                heldout_samples=req.heldout_samples, heldout_data=req.heldout_data,
                                eval_data=req.eval_data, eval_samples=req.eval_samples)
    cal, held, ev = blocks.cal, blocks.held, blocks.ev
    grams = latent_grams(lm.model, lm.adapter, cal.batches, device=calib_device)
    eval_before = evaluate(lm.model, ev.batches, objective, label="eval before") if ev else None
    before = summary_figures(lm.model, lm.adapter)
    info("converting to latent attention: " + (f"kv_rank {_ranks_text(ranks)}" if req.rank_allocation == "uniform"
                                                else f"{sum(ranks)} latent dims over {len(ranks)} layers (auto)")
         + f", rope_dim {rope_dim}")
    conv = convert_model_latent(lm.model, lm.adapter, ranks, rope_dim=rope_dim, grams=grams, damping=req.damping,
                                refit=req.refit, batches=cal.batches, heldout_batches=held.batches if held else None,
                                anchor=parse_anchor(req.anchor), key_weight=req.key_weight,
                                allocation=req.rank_allocation)
    ranks = list(conv.spec["kv_rank"])
    after = summary_figures(conv.model, lm.adapter)
    eval_after = evaluate(conv.model, ev.batches, objective, label="eval after") if ev else None
    summary: dict[str, Any] = {
        "model": req.model, "output": req.output, "kv_rank": ranks, "rope_dim": rope_dim, "damping": req.damping,
        "qk_nope_dim": conv.spec["qk_nope_dim"], "before": before, "after": after,
        "kv_cache_reduction": before["kv_cache_bytes_per_token"] / max(after["kv_cache_bytes_per_token"], 1),
        "kv_cache_fraction": after["kv_cache_bytes_per_token"] / max(before["kv_cache_bytes_per_token"], 1),
        "kv_cache_budget": req.kv_cache, "rank_allocation": req.rank_allocation,
        "layers": conv.layers, "refit": conv.refit, "seconds": round(conv.seconds, 2), "eval_before": eval_before,
        "eval_after": eval_after, "calibration_data": cal.info, "heldout_data": held.info if held else None,
        "eval_data": ev.info if ev else None,
    }
    meta = {
        "operation": "convert-mla",
        "method": "rorope+whitened-svd",
        "kv_rank": ranks,
        "rope_dim": rope_dim,
        "rope_slots": [[[p, m] for p, m in zip(ps, ms)]
                       for ps, ms in zip(conv.spec["rope_planes"], conv.spec["rope_heads"])],
        "num_kv_heads": [g.num_kv_heads for g in lm.geometry],
        "kv_cache_bytes_per_token": {"before": before["kv_cache_bytes_per_token"],
                                     "after": after["kv_cache_bytes_per_token"]},
        "rank_allocation": req.rank_allocation,
        "options": {"kv_rank": req.kv_rank, "kv_cache": req.kv_cache, "rank_allocation": req.rank_allocation,
                    "rope_dim": rope_dim, "damping": req.damping,
                    "key_weight": req.key_weight, "refit": req.refit, "anchor": req.anchor},
        "summary": {k: summary[k] for k in ("before", "after", "kv_cache_reduction", "kv_cache_fraction", "kv_cache_budget", "layers",
                                             "refit", "eval_before", "eval_after", "calibration_data", "heldout_data",
                                             "eval_data")},
    }
    return MlaRun(conv, summary, meta)


def run_convert_mla(req: LatentRequest) -> dict[str, Any]:
    """Check, load, calibrate, convert, write; returns the summary (also recorded in headtool.json)."""
    req.validate()
    if req.output is None:
        raise UsageError("convert-mla needs -o OUT (the output folder)")
    lm = load_model(req.model, rewrites="convert-mla", **req.load.kwargs())
    require_resident_weights(lm.model, "convert-mla", CONVERT_INSTEAD)
    latent_target(lm, req)  # an impossible target is refused before the output folder is looked at
    check_output_target(req.output, lm.path, req.overwrite)
    with blocks_read() as seen:
        done = convert_mla_loaded(lm, req)
    summary = done.summary
    meta = {**done.meta, RECORD: written_record(seen, lm.path),
            **original_heads_kept_as_is(lm.path, [g.num_heads for g in lm.geometry])}
    if summary.get("eval_data"):
        summary["eval_data"] = {**summary["eval_data"], "in_domain": fitted_on(meta[RECORD], summary["eval_data"])}
    written = write_output(req.output, model=done.conv.model, tokenizer=lm.tokenizer, source=lm, meta=meta,
                           card_table=card_table(summary), overwrite=req.overwrite, shard_size=req.shard_size)
    summary["config_kind"] = written["config_kind"]
    summary["path"] = written["path"]
    return summary
