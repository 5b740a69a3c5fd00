"""`headtool convert-gqa`: merge K/V heads into N groups (MHA to GQA, GQA to fewer groups, to MQA)
and write a standard checkpoint; with several merge methods, the best on held-out data is written."""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from ..console import info, warn
from ..data.batches import blocks_read, read_to_fit, resolve_auto
from ..data.sources import DataSpec
from ..errors import UsageError
from ..io.output import check_output_target, write_output
from ..io.provenance import RECORD, fitted_on, original_heads, written_record
from ..measure.calibration import attention_input_grams
from ..measure.evaluation import against_text, evaluate, record_gaps
from ..measure.objectives import DATA_TASK, resolve_objective
from ..model.info import conversion_kv_label
from ..model.latent import refuse_latent_surgery
from ..model.loading import LoadedModel, cast_dtype, load_model
from ..model.placement import require_resident_weights, sequential_placement
from ..surgery.compensation import refit_heading, refit_table
from ..surgery.merging import (
    CONVERT_INSTEAD,
    GROUPINGS,
    METHODS,
    LayerPlan,
    check_target,
    contiguous_plans,
    convert_model,
    summary_figures,
)
from ..surgery.streaming import open_checkpoint, stream_convert_mean
from .data_plan import calibration_blocks, with_default_blocks
from .requests import ConvertRequest, parse_anchor

@dataclass
class ConvertRun:
    """The summary of a conversion (the same shape in memory and streamed) and, streamed, what was
    written."""

    summary: dict[str, Any] | None
    streamed: dict[str, Any] | None


def _methods(req: ConvertRequest) -> list[str]:
    """`req.methods` (the --merge list, once each), or a UsageError naming what is allowed."""
    methods = req.methods
    if not methods or any(m not in METHODS for m in methods):
        raise UsageError(f"--merge {req.merge!r}: use one or more of {', '.join(METHODS)} separated by commas")
    return methods


def merge_line(summary: dict[str, Any]) -> str | None:
    """One sentence on how the written merge compared with the others on the held-out blocks (None
    with one method, or without held-out blocks)."""
    rows = summary["results"]
    mine = next((r for r in rows if r["method"] == summary["chosen"]), None)
    others = [r for r in rows if r is not mine and "heldout_loss" in r]
    if mine is None or "heldout_loss" not in mine or not others:
        return None
    held = summary.get("heldout_data") or {}
    where = f"{held['samples']} held-out blocks of {held.get('source')}" if held.get("samples") else "held-out blocks"
    vs = against_text([(r["method"], r) for r in others], where)
    return f"Held-out loss of `{mine['method']}` {mine['heldout_loss']:.4f} {vs}."


def card_table(summary: dict[str, Any]) -> str:
    b, a = summary["before"], summary["after"]
    lines = ["| | before | after |", "| --- | --- | --- |",
             f"| KV heads per layer | {b['num_kv_heads']} | {a['num_kv_heads']} |",
             f"| query heads per layer | {b['num_heads']} | {a['num_heads']} |",
             f"| parameters | {b['params']:,} | {a['params']:,} |",
             f"| {conversion_kv_label(b, 'KV cache bytes per token')} | {b['kv_cache_bytes_per_token']:,} | "
             f"{a['kv_cache_bytes_per_token']:,} |"]
    if summary.get("eval_before"):
        lines.append(f"| eval loss | {summary['eval_before']['loss']:.4f} | "
                     f"{next(r for r in summary['results'] if r['method'] == summary['chosen'])['eval']['loss']:.4f} |")
    lines += ["", f"Merge: `{summary['chosen']}`, grouping `{summary['grouping']}`."]
    compared = merge_line(summary)
    if compared:
        lines += ["", compared]
    if summary.get("chosen_on") == "eval_data":
        lines += ["", "The merge was chosen on the evaluation blocks (no held-out blocks): its eval loss flatters it."]
    refit = next((r.get("refit") for r in summary["results"] if r["method"] == summary["chosen"]), None)
    if refit:
        lines += ["", refit_heading(summary.get("heldout_data")), "", refit_table(refit)]
    return "\n".join(lines)


def run_convert_gqa(req: ConvertRequest) -> ConvertRun:
    """Check, load, calibrate, merge with every requested method, keep the best, write it."""
    req.validate()
    methods = _methods(req)
    if req.grouping not in GROUPINGS:
        raise UsageError(f"--grouping {req.grouping!r}: use {' or '.join(GROUPINGS)}")
    if req.damping < 0:
        raise UsageError(f"--damping must be >= 0 (got {req.damping})")
    if req.output is None:
        raise UsageError("convert-gqa needs -o OUT (the output folder)")
    if req.streaming:
        if methods != ["mean"] or req.grouping != "contiguous" or req.refit or req.eval_data:
            raise UsageError("--streaming needs no forward pass: use --merge mean --grouping contiguous, "
                             "without --refit or --eval-data")
        return _run_streaming(req, methods)
    load, calib_device = sequential_placement(req.load, req.sequential)
    lm = load_model(req.model, rewrites="convert-gqa", **load.kwargs())
    require_resident_weights(lm.model, "convert-gqa", CONVERT_INSTEAD)
    check_target(lm.adapter, lm.geometry, req.kv_heads)
    check_output_target(req.output, lm.path, req.overwrite)
    with blocks_read() as seen:
        done = convert_loaded(lm, req, calib_device=calib_device)
    best, before, results, eval_before = done.best, done.before, done.results, done.eval_before
    cal, held, ev, methods = done.calibration, done.heldout, done.evaluation, done.methods
    after = summary_figures(best.model, lm.adapter)
    summary = convert_summary(req, methods, best.method, best.plans, lm.geometry, before, after, results,
                              eval_before=eval_before, data=(cal, held, ev), chosen_on=done.chosen_on)
    meta = convert_meta(req, summary, best.plans, seen=seen, source_path=lm.path)
    if ev:
        summary["eval_data"] = {**ev.info, "in_domain": fitted_on(meta[RECORD], ev.info)}
    written = write_output(req.output, model=best.model, tokenizer=lm.tokenizer, source=lm, meta=meta,
                           card_table=card_table(summary), overwrite=req.overwrite, shard_size=req.shard_size)
    summary["config_kind"] = written["config_kind"]
    summary["path"] = written["path"]
    return ConvertRun(summary=summary, streamed=None)


def convert_summary(req: ConvertRequest, methods: list[str], chosen: str, plans: Sequence[LayerPlan],
                    geo_before: Sequence[Any], before: dict, after: dict, results: list[dict], *,
                    eval_before: dict | None = None, data: tuple = (None, None, None),
                    chosen_on: str | None = None) -> dict[str, Any]:
    """The conversion's summary (`--json`, and headtool.json's `summary`); `data`: the calibration,
    held-out and evaluation blocks (Batches or None); `chosen_on`: which of them chose the merge."""
    cal, held, ev = data
    return {
        "model": req.model, "output": req.output, "kv_heads": req.kv_heads, "grouping": req.grouping, "merge": methods,
        "chosen": chosen, "chosen_on": chosen_on, "damping": req.damping,
        "num_kv_heads_before": [g.num_kv_heads for g in geo_before],
        "num_kv_heads_after": [p.new_geo.num_kv_heads for p in plans],
        "before": before, "after": after,
        "kv_cache_reduction": before["kv_cache_bytes_per_token"] / max(after["kv_cache_bytes_per_token"], 1),
        "eval_before": eval_before, "results": results,
        "calibration_data": cal.info if cal else None, "heldout_data": held.info if held else None,
        "eval_data": ev.info if ev else None,
    }


def convert_meta(req: ConvertRequest, summary: dict[str, Any], plans: Sequence[LayerPlan], *,
                 seen: Iterable[dict], source_path: str | None, streaming: bool = False) -> dict[str, Any]:
    """headtool.json of convert-gqa, in memory or streamed: one builder, so that the two cannot drift
    apart (a streamed copy once lost kept_heads and the input's `data_read`)."""
    return {
        "operation": "convert-gqa",
        "streaming": streaming,
        "kept_heads": [p.order for p in plans],
        "num_kv_heads": summary["num_kv_heads_after"],
        "kv_groups": [[list(g) for g in p.groups] for p in plans],
        "method": summary["chosen"],
        "options": {"kv_heads": req.kv_heads, "grouping": req.grouping, "merge": summary["merge"],
                    "refit": req.refit, "damping": req.damping, "anchor": req.anchor},
        "summary": {k: summary[k] for k in ("before", "after", "kv_cache_reduction", "eval_before", "results",
                                             "chosen_on", "calibration_data", "heldout_data", "eval_data")},
        RECORD: written_record(seen, source_path),
        **original_heads(source_path, [p.order for p in plans], [len(p.order) for p in plans]),
    }


def _run_streaming(req: ConvertRequest, methods: list[str]) -> ConvertRun:
    """`convert-gqa --streaming` (mean, contiguous groups): shard by shard; headtool.json from
    `convert_meta`, as in memory, with the figures of the weightless model before and after."""
    ck = open_checkpoint(req.model, req.load.trust_remote_code, cast_dtype(req.load.dtype))
    refuse_latent_surgery(ck.config, req.model, "convert-gqa")
    check_target(ck.adapter, ck.geometry, req.kv_heads)
    plans = contiguous_plans(ck.geometry, req.kv_heads)
    t0 = time.perf_counter()

    @functools.cache  # one for the record and the card: built once, the same timing in both
    def summary(after) -> dict[str, Any]:
        results = [{"method": "mean", "seconds": round(time.perf_counter() - t0, 2), "refit": None}]
        return convert_summary(req, methods, "mean", plans, ck.geometry, summary_figures(ck.model, ck.adapter),
                               summary_figures(after, ck.adapter), results)

    def meta(after) -> dict[str, Any]:
        return convert_meta(req, summary(after), plans, seen=[], source_path=ck.path, streaming=True)

    def card(after, kind) -> str:
        resized.append(after)
        return card_table(summary(after))

    resized: list = []  # the weightless model after surgery: the summary's figures after
    written = stream_convert_mean(ck, req.kv_heads, req.output, meta=meta, overwrite=req.overwrite,
                                  shard_size=req.shard_size, card_table=card)
    # the summary the in-memory path prints (--json): no forward pass, so no held-out or eval figures
    done = {**summary(resized[-1]), "config_kind": written["config_kind"], "path": written["path"]}
    return ConvertRun(summary=done, streamed=written)


@dataclass
class Converted:
    """What convert_loaded did: the best conversion (not yet installed in the LoadedModel), every
    method's row, the model's figures before, and the data it used."""

    best: Any
    methods: list[str]
    results: list[dict[str, Any]]
    before: dict[str, Any]
    eval_before: dict[str, Any] | None
    calibration: Any
    heldout: Any
    evaluation: Any
    #: what chose the written merge among several: "heldout_data" or "eval_data" (None: one method)
    chosen_on: str | None = None


def convert_loaded(lm: LoadedModel, req: ConvertRequest, *, calib_device=None,
                   text_model: LoadedModel | None = None) -> Converted:
    """Calibrate, merge with every method of req.merge and keep the best: the lowest loss on the
    held-out calibration blocks when there are any (the --eval-data loss is reported, never used to
    choose: a figure that chose the model would flatter it), else on --eval-data. `headtool
    convert-gqa` and recipe steps."""
    methods = _methods(req)
    check_target(lm.adapter, lm.geometry, req.kv_heads)
    tm = text_model or lm  # the model `--data self` samples from
    needs_data = req.reads_data  # (the request's, so that its checks refuse what no data reads)
    spec = with_default_blocks(req.data or DataSpec(), req.default_blocks)
    objective = resolve_objective("auto", lm.task)
    data_task = DATA_TASK[objective]
    if needs_data:
        spec = resolve_auto(spec, lm.tokenizer, tm, data_task)
    blocks = calibration_blocks(spec, lm.tokenizer, data_task, tm, calibrate=needs_data, hold_out=True,
                                heldout_samples=req.heldout_samples, heldout_data=req.heldout_data,
                                eval_data=req.eval_data, eval_samples=req.eval_samples)
    cal, held, ev = blocks.cal, blocks.held, blocks.ev
    grams = attention_input_grams(lm.model, lm.adapter, cal.batches, device=calib_device) if cal else None
    eval_before = evaluate(lm.model, ev.batches, objective, label="eval before") if ev else None

    before = summary_figures(lm.model, lm.adapter)
    results: list[dict[str, Any]] = []
    verdicts: list[dict] = []  # held-out losses per block, for the gaps between the methods
    best = best_key = best_verdict = None
    for method in methods:
        do_refit = (method == "fit") if req.refit is None else req.refit
        info(f"merging: {method}" + (" + sequential output-projection refit" if do_refit and cal else ""))
        conv = convert_model(lm.model, lm.adapter, req.kv_heads, method=method, grouping=req.grouping, grams=grams,
                             refit=do_refit and cal is not None, batches=cal.batches if cal else None,
                             heldout_batches=held.batches if held else None, damping=req.damping,
                             anchor=parse_anchor(req.anchor), calib_device=calib_device)
        row: dict[str, Any] = {"method": method, "seconds": round(conv.seconds, 2), "refit": conv.refit}
        verdict = None
        if held:
            verdict = evaluate(conv.model, held.batches, objective, label=f"held-out {method}", per_block=True)
            row["heldout_loss"] = verdict["loss"]
        if ev:
            row["eval"] = evaluate(conv.model, ev.batches, objective, label=f"eval {method}")
        key = row["heldout_loss"] if held else (row["eval"]["loss"] if ev else 0.0)
        results.append(row)
        verdicts.append(verdict)
        if best is None or key < best_key:
            best, best_key, best_verdict = conv, key, verdict
        del conv
    if best_verdict is not None and len(methods) > 1:
        record_gaps(results, verdicts, best_verdict)
    chosen_on = None if len(methods) == 1 else "heldout_data" if held else "eval_data"
    if chosen_on == "eval_data":  # (validate refuses several merges with neither)
        read_to_fit(ev.info)
        warn(f"--merge {','.join(methods)} with --heldout-samples 0: `{best.method}` was chosen on the --eval-data "
             f"blocks of {ev.info.get('source')}, so its evaluation figure flatters it (recorded as fitted on); "
             "held-out blocks would choose without touching the evaluation")
    return Converted(best, methods, results, before, eval_before, cal, held, ev, chosen_on)
