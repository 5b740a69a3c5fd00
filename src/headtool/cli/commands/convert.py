"""`headtool convert-gqa`: merge K/V heads into N groups and write a standard checkpoint."""
from __future__ import annotations

from typing import Any

import typer

from ...console import err_console, info, print_json
from ...data.sources import AUTO_SOURCE
from ...io.provenance import IN_DOMAIN_NOTE
from ...workflows.requests import ConvertRequest, calibration_data, reads_no_data
from ...errors import UsageError
from ..options import (JsonOpt, LoadOptions, command_options, data_option_names, data_options, given_options,
                       model_options)


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
    from ..render import Table

    from ...measure.evaluation import PAIRED_NOTE, gap_text  # torch: only once a command runs
    from ...model.info import conversion_kv_label
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
    t.add_row(conversion_kv_label(b), f"{human_bytes(b['kv_cache_bytes_per_token'])} -> "
                                    f"{human_bytes(a['kv_cache_bytes_per_token'])} "
                                    f"({summary['kv_cache_reduction']:.2f}x smaller)")
    t.add_row("written", f"{summary['chosen']}" + (f" ({summary['config_kind']} config)"
                                                  if summary.get("config_kind") else ""))
    ev_data = summary.get("eval_data")
    chose = summary.get("chosen_on") == "eval_data"  # no held-out blocks: the evaluation chose the merge
    m = Table(title="merge methods" + (f" (eval: {ev_data['samples']} blocks of {ev_data['source']}, "
                                       + ("which chose the merge" if chose else "held out")
                                       + (f"; {IN_DOMAIN_NOTE}" if ev_data.get("in_domain") else "") + ")"
                                       if ev_data else ""), title_justify="left")
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
                  "" if hl is None else f"{hl:.4f}" + gap_text(r), "" if ev is None else f"{ev['loss']:.4f}",
                  "" if ev is None or "perplexity" not in ev else f"{ev['perplexity']:.2f}", f"{r['seconds']:.1f}s")
    if any("standard_error" in r for r in summary["results"]):
        m.caption = f"(+gap ± se): held-out loss above the written merge's, {PAIRED_NOTE}"
        m.caption_justify = "left"
    return t, m


@command_options(ConvertRequest)
def convert_gqa_cmd(ctx: typer.Context, json_out: JsonOpt = False, fields=None, load: LoadOptions = LoadOptions(),
                    data_spec=None) -> None:
    """Merge K/V heads into --kv-heads groups (MHA to GQA, GQA to fewer groups, to MQA).

    Families whose config sets the KV heads, MHA checkpoints included: gemma, gemma2, gemma3_text,
    llama, mistral, phi3, qwen2, qwen3. GPT-2, GPT-NeoX, OPT and BERT-style encoders give every
    query head its own K/V in their config (refused): convert-mla shrinks their cache (not BERT's),
    prune removes whole heads.

    Calibration (--data, default auto: builtin:pydoc mixed with text sampled from the model on a
    causal LM, builtin:pydoc otherwise; 64 blocks) drives similarity grouping and the data-aware
    merges; the output has a standard config with num_key_value_heads = N.

    Example: headtool convert-gqa smollm2-135m --kv-heads 1 --merge mean,aligned,fit
    --eval-data builtin:pydoc -o smollm2-mqa
    """
    from ...workflows.convert_gqa import run_convert_gqa

    req = ConvertRequest(**fields, data=data_spec or calibration_data(), load=load)
    # without a calibration the data options are read by nothing, but those that cut the --eval-data blocks
    shaping = {"seq_len", "batch_size", "seed"} if req.eval_data is not None else set()
    if not req.reads_data and (given := given_options(ctx, data_option_names() - shaping)):
        raise UsageError(f"{', '.join(given)}: {reads_no_data(recipe=False, remedy='leave the data options out')}")
    run = run_convert_gqa(req)
    if run.streamed is not None:
        info(f"written to {run.streamed['path']} ({run.streamed['config_kind']}, streamed)")
        if json_out:
            print_json(run.summary)
        return
    for table in _tables(run.summary):
        err_console().print(table)
    if json_out:
        print_json(run.summary)


def register(app: typer.Typer) -> None:
    app.command("convert-gqa")(model_options(data_options(default=AUTO_SOURCE)(convert_gqa_cmd)))
