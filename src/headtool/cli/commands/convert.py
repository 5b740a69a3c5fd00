"""`headtool convert-gqa`: merge K/V heads into N groups and write a standard checkpoint."""
from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Optional

import typer

from ...console import err_console, info, print_json
from ...model.placement import sequential_placement
from ..options import (
    MODEL_HELP,
    JsonOpt,
    LoadOptions,
    SequentialOpt,
    data_options,
    model_options,
)

DEFAULT_CALIBRATION_SAMPLES = 64


def _methods(merge: str) -> list[str]:
    from ...errors import UsageError
    from ...surgery.merging import METHODS

    methods = [m.strip() for m in merge.split(",") if m.strip()]
    bad = [m for m in methods if m not in METHODS]
    if not methods or bad:
        raise UsageError(f"--merge {merge!r}: use one or more of {', '.join(METHODS)} separated by commas")
    return list(dict.fromkeys(methods))


def _kv_rows(before: list[int], after: list[int]) -> list[tuple[str, str]]:
    """'layers a-b: x -> y' rows, consecutive layers with the same change folded together."""
    rows, start = [], 0
    for i in range(1, len(before) + 1):
        if i == len(before) or (before[i], after[i]) != (before[start], after[start]):
            span = f"{start}" if i - 1 == start else f"{start}-{i - 1}"
            rows.append((f"layers {span}", f"{before[start]} -> {after[start]}"))
            start = i
    return rows


def _tables(summary: dict[str, Any]):
    from rich.table import Table

    from ..render import human_bytes, human_int

    t = Table(title=f"headtool convert-gqa: {summary['model']} -> {summary['output'] or '(not written)'}",
              show_header=False, title_justify="left")
    t.add_column("key", style="bold")
    t.add_column("value")
    b, a = summary["before"], summary["after"]
    for label, value in _kv_rows(summary["num_kv_heads_before"], summary["num_kv_heads_after"]):
        t.add_row(f"KV heads, {label}", value)
    t.add_row("grouping", summary["grouping"])
    t.add_row("parameters", f"{human_int(b['params'])} -> {human_int(a['params'])} "
                            f"({a['params'] - b['params']:+,})")
    t.add_row("attention parameters", f"{human_int(b['attention_params'])} -> {human_int(a['attention_params'])}")
    t.add_row("KV cache per token", f"{human_bytes(b['kv_cache_bytes_per_token'])} -> "
                                    f"{human_bytes(a['kv_cache_bytes_per_token'])} "
                                    f"({summary['kv_cache_reduction']:.2f}x smaller)")
    t.add_row("written", f"{summary['chosen']}" + (f" ({summary['config_kind']} config)"
                                                  if summary.get("config_kind") else ""))
    m = Table(title="merge methods" + (f" (eval: {summary['eval_data']['samples']} blocks of "
                                       f"{summary['eval_data']['source']}, held out)" if summary.get("eval_data") else ""),
              title_justify="left")
    for col in ("method", "refit layers kept", "held-out calib loss", "eval loss", "perplexity", "time"):
        m.add_column(col, justify="left" if col == "method" else "right")
    if summary.get("eval_before"):
        e = summary["eval_before"]
        m.add_row("(before)", "", "", f"{e['loss']:.4f}", f"{e['perplexity']:.2f}" if "perplexity" in e else "", "")
    for r in summary["results"]:
        refit = r.get("refit")
        kept = "" if refit is None else f"{sum(x['kept'] for x in refit)}/{len(refit)}"
        ev = r.get("eval")
        hl = r.get("heldout_loss")
        m.add_row(r["method"] + (" *" if r["method"] == summary["chosen"] else ""), kept,
                  "" if hl is None else f"{hl:.4f}", "" if ev is None else f"{ev['loss']:.4f}",
                  "" if ev is None or "perplexity" not in ev else f"{ev['perplexity']:.2f}", f"{r['seconds']:.1f}s")
    return t, m


def _card(summary: dict[str, Any]) -> str:
    b, a = summary["before"], summary["after"]
    lines = ["| | before | after |", "| --- | --- | --- |",
             f"| KV heads per layer | {b['num_kv_heads']} | {a['num_kv_heads']} |",
             f"| query heads per layer | {b['num_heads']} | {a['num_heads']} |",
             f"| parameters | {b['params']:,} | {a['params']:,} |",
             f"| KV cache bytes per token | {b['kv_cache_bytes_per_token']:,} | {a['kv_cache_bytes_per_token']:,} |"]
    if summary.get("eval_before"):
        lines.append(f"| eval loss | {summary['eval_before']['loss']:.4f} | "
                     f"{next(r for r in summary['results'] if r['method'] == summary['chosen'])['eval']['loss']:.4f} |")
    lines += ["", f"Merge: `{summary['chosen']}`, grouping `{summary['grouping']}`."]
    return "\n".join(lines)


def convert_gqa_cmd(
    model: Annotated[str, typer.Argument(help=MODEL_HELP)],
    kv_heads: Annotated[int, typer.Option("--kv-heads", help="KV heads per layer after merging (1 = MQA)")],
    output: Annotated[Optional[str], typer.Option("-o", "--output", help="output folder")] = None,
    grouping: Annotated[str, typer.Option("--grouping", help="contiguous | similarity (needs --data)")] = "contiguous",
    merge: Annotated[str, typer.Option("--merge", help="mean | aligned | fit, or a comma list to compare "
                                                       "(the best is written)")] = "fit",
    refit: Annotated[Optional[bool], typer.Option("--refit/--no-refit", help="sequential output-projection "
                                                  "refit (default: on for fit)")] = None,
    damping: Annotated[float, typer.Option("--damping", help="ridge damping of the refit, relative")] = 1e-2,
    heldout_samples: Annotated[Optional[int], typer.Option(
        "--heldout-samples", help="calibration blocks held out to check each refit (default: a quarter)")] = None,
    eval_data: Annotated[Optional[str], typer.Option("--eval-data", help="data to measure loss before/after "
                                                     "(blocks disjoint from calibration when it is the same source)")] = None,
    eval_samples: Annotated[int, typer.Option("--eval-samples", help="blocks of --eval-data")] = 32,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="replace an existing output folder")] = False,
    shard_size: Annotated[str, typer.Option("--shard-size", help="largest safetensors shard")] = "5GB",
    streaming: Annotated[bool, typer.Option(
        "--streaming", help="work shard by shard on the safetensors files, never building the model "
                            "(checkpoints larger than memory; --merge mean with contiguous grouping)")] = False,
    sequential: SequentialOpt = False,
    json_out: JsonOpt = False,
    load: LoadOptions = LoadOptions(),
    data_spec=None,
) -> None:
    """Merge K/V heads into --kv-heads groups (MHA to GQA, GQA to fewer groups, to MQA).

    Calibration (--data, default builtin:pydoc, 64 blocks) drives similarity grouping and the
    data-aware merges; the output has a standard config with num_key_value_heads = N.

    Example: headtool convert-gqa smollm2-135m --kv-heads 1 --merge mean,aligned,fit
    --eval-data builtin:pydoc -o smollm2-mqa
    """
    from ...data.batches import make_batches
    from ...data.sources import DataSpec
    from ...errors import UsageError
    from ...io.output import check_output_target, write_output
    from ...measure.calibration import attention_input_grams
    from ...measure.evaluation import evaluate
    from ...measure.objectives import DATA_TASK, resolve_objective
    from ...model.loading import load_model
    from ...model.placement import require_resident_weights
    from ...surgery.merging import (
        CONVERT_INSTEAD,
        DATA_METHODS,
        GROUPINGS,
        check_target,
        convert_model,
        summary_figures,
    )

    methods = _methods(merge)
    if grouping not in GROUPINGS:
        raise UsageError(f"--grouping {grouping!r}: use {' or '.join(GROUPINGS)}")
    if damping < 0:
        raise UsageError(f"--damping must be >= 0 (got {damping})")
    if output is None:
        raise UsageError("convert-gqa needs -o OUT (the output folder)")
    if streaming:
        if methods != ["mean"] or grouping != "contiguous" or refit or eval_data:
            raise UsageError("--streaming needs no forward pass: use --merge mean --grouping contiguous, "
                             "without --refit or --eval-data")
        from ...surgery.streaming import open_checkpoint, stream_convert_mean

        ck = open_checkpoint(model, load.trust_remote_code)
        check_target(ck.adapter, ck.geometry, kv_heads)
        meta = {"operation": "convert-gqa", "method": "mean", "streaming": True,
                "num_kv_heads": [kv_heads] * len(ck.geometry),
                "options": {"kv_heads": kv_heads, "grouping": grouping, "merge": methods}}
        written = stream_convert_mean(ck, kv_heads, output, meta=meta, overwrite=overwrite, shard_size=shard_size)
        info(f"written to {written['path']} ({written['config_kind']}, streamed)")
        if json_out:
            print_json(written)
        return
    load, calib_device = sequential_placement(load, sequential)
    lm = load_model(model, **load.kwargs())
    require_resident_weights(lm.model, "convert-gqa", CONVERT_INSTEAD)
    check_target(lm.adapter, lm.geometry, kv_heads)
    check_output_target(output, lm.path, overwrite)
    needs_data = grouping == "similarity" or any(m in DATA_METHODS for m in methods) or bool(refit)
    spec = data_spec or DataSpec()
    if spec.max_samples is None and spec.num_tokens is None:
        spec = dataclasses.replace(spec, max_samples=DEFAULT_CALIBRATION_SAMPLES)
    objective = resolve_objective("auto", lm.task)
    data_task = DATA_TASK[objective]
    cal = held = grams = None
    used = 0
    if needs_data:
        cal = make_batches(spec, lm.tokenizer, data_task)
        n_held = heldout_samples if heldout_samples is not None else max(4, cal.info["samples"] // 4)
        used = cal.info["samples"]
        if n_held > 0:
            held = make_batches(dataclasses.replace(spec, max_samples=n_held, num_tokens=None,
                                                    skip_samples=used), lm.tokenizer, data_task)
            used += held.info["samples"]
        info(f"calibrating on {cal.info['samples']} blocks of {spec.seq_len} tokens from {spec.source}"
             + (f" ({held.info['samples']} more held out)" if held else ""))
        grams = attention_input_grams(lm.model, lm.adapter, cal.batches, device=calib_device)
    ev = None
    if eval_data:
        same = eval_data == spec.source
        ev_spec = DataSpec(source=eval_data, seq_len=spec.seq_len, batch_size=spec.batch_size,
                           max_samples=eval_samples, seed=spec.seed, skip_samples=used if same else 0)
        ev = make_batches(ev_spec, lm.tokenizer, data_task)
    eval_before = evaluate(lm.model, ev.batches, objective, label="eval before") if ev else None

    before = summary_figures(lm.model, lm.adapter)
    results: list[dict[str, Any]] = []
    best = best_key = None
    for method in methods:
        do_refit = (method == "fit") if refit is None else refit
        info(f"merging: {method}" + (" + sequential output-projection refit" if do_refit and cal else ""))
        conv = convert_model(lm.model, lm.adapter, kv_heads, method=method, grouping=grouping, grams=grams,
                             refit=do_refit and cal is not None, batches=cal.batches if cal else None,
                             heldout_batches=held.batches if held else None, damping=damping,
                             calib_device=calib_device)
        row: dict[str, Any] = {"method": method, "seconds": round(conv.seconds, 2), "refit": conv.refit}
        if held:
            row["heldout_loss"] = evaluate(conv.model, held.batches, objective, label=f"held-out {method}")["loss"]
        if ev:
            row["eval"] = evaluate(conv.model, ev.batches, objective, label=f"eval {method}")
        key = row["eval"]["loss"] if ev else row.get("heldout_loss", 0.0)
        results.append(row)
        if best is None or key < best_key:
            best, best_key = conv, key
        del conv
    after = summary_figures(best.model, lm.adapter)
    geo_before = lm.geometry
    summary: dict[str, Any] = {
        "model": model, "output": output, "kv_heads": kv_heads, "grouping": grouping, "merge": methods,
        "chosen": best.method, "damping": damping,
        "num_kv_heads_before": [g.num_kv_heads for g in geo_before],
        "num_kv_heads_after": [p.new_geo.num_kv_heads for p in best.plans],
        "before": before, "after": after,
        "kv_cache_reduction": before["kv_cache_bytes_per_token"] / max(after["kv_cache_bytes_per_token"], 1),
        "eval_before": eval_before, "results": results,
        "calibration_data": cal.info if cal else None, "heldout_data": held.info if held else None,
        "eval_data": ev.info if ev else None,
    }
    meta = {
        "operation": "convert-gqa",
        "kept_heads": [p.order for p in best.plans],
        "num_kv_heads": summary["num_kv_heads_after"],
        "kv_groups": [[list(g) for g in p.groups] for p in best.plans],
        "method": best.method,
        "options": {"kv_heads": kv_heads, "grouping": grouping, "merge": methods, "refit": refit,
                    "damping": damping},
        "summary": {k: summary[k] for k in ("before", "after", "kv_cache_reduction", "eval_before", "results",
                                             "calibration_data", "heldout_data", "eval_data")},
    }
    written = write_output(output, model=best.model, tokenizer=lm.tokenizer, source=lm, meta=meta,
                           card_table=_card(summary), overwrite=overwrite, shard_size=shard_size)
    summary["config_kind"] = written["config_kind"]
    summary["path"] = written["path"]
    for table in _tables(summary):
        err_console().print(table)
    if json_out:
        print_json(summary)


def register(app: typer.Typer) -> None:
    app.command("convert-gqa")(model_options(data_options(required=False, default="builtin:pydoc")(convert_gqa_cmd)))
