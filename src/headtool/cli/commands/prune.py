"""`headtool prune`: remove attention heads physically and write a checkpoint that reloads."""
from __future__ import annotations

import typer

from ...data.sources import AUTO_SOURCE
from ...workflows.requests import PruneRequest
from ..options import (JsonOpt, LoadOptions, command_options, data_option_names, data_options, given_options,
                       model_options)


@model_options
@data_options(default=AUTO_SOURCE)
@command_options(PruneRequest)
def prune_cmd(ctx: typer.Context, json_out: JsonOpt = False, fields=None, load: LoadOptions = LoadOptions(),
              data_spec=None) -> None:
    """Remove attention heads (chosen from scores or listed) and write a smaller checkpoint.

    Without --scores or --heads the heads are scored now on --data (default auto: builtin:pydoc
    mixed with text sampled from the model on a causal LM, builtin:pydoc otherwise; 64 blocks, 256
    with --compensate), which --compensate also refits on.

    Examples:
      headtool score m --data d | headtool prune m --scores - --fraction 0.3 -o out
      headtool prune smollm2-135m --data builtin:pydoc --max-samples 32 --fraction 0.25 --compensate -o out
      headtool prune m --heads "3:0,5;7:2" -o out
    """
    from ...console import err_console, info, print_json
    from ...workflows.prune import run_prune

    from ...errors import UsageError

    req = PruneRequest(**fields, data=data_spec, load=load)
    if not req.reads_data and (given := given_options(ctx, data_option_names())):
        raise UsageError(f"{', '.join(given)}: prune reads no text with --heads or --scores unless it refits "
                         "(--compensate), compares a --normalize list or evaluates (--eval-data): leave the data "
                         "options out")
    run = run_prune(req)
    if run.streamed is not None:
        info(f"written to {run.streamed['path']} ({run.streamed['config_kind']}, streamed)")
        if json_out:
            print_json(run.streamed)
        return
    protected = run.target.protected(len(run.result.geometry_before)) if run.target else set()
    _render(err_console(), req.model, run.result, run.config_kind, run.eval_info, run.written, req.dry_run,
            protected)
    if req.anchor_power is None and run.result.anchor_power is not None:
        info(_default_power_line(run.result.anchor_power))
    if req.unit == "auto" and run.target is not None and run.target.unit == "head":
        was_uneven = any(g.uneven for g in run.result.geometry_before)
        info("single query heads removed (--unit auto): a layer's KV groups may differ in size"
             + ("" if was_uneven else "; --unit query keeps them equal"))
    if json_out:
        print_json(run.report)
    elif run.written:
        info(f"written to {run.written['path']} ({run.config_kind})")


def _render(console, ref: str, result, kind: str, eval_info, written, dry_run: bool,
            protected: set[int] = frozenset()) -> None:
    from ..render import Table

    from ...io.provenance import IN_DOMAIN_NOTE
    from ...surgery.pruning import kv_heads_cell
    from ..render import human_bytes, human_int

    t = Table(title=f"headtool prune: {ref}" + (" (dry run)" if dry_run else ""), title_justify="left")
    for col in ("layer", "query heads", "KV heads", "removed"):
        t.add_column(col, justify="left" if col == "removed" else "right")
    comp = {r["layer"]: r for r in result.compensation}
    if comp:
        t.add_column("refit rel. error", justify="right")
    for r in result.layers():
        changed = r["heads_after"] != r["heads_before"]
        row = [str(r["layer"]), f"{r['heads_before']} → {r['heads_after']}",
               kv_heads_cell(r),
               ",".join(map(str, r["removed_heads"])) or ("- (protected)" if r["layer"] in protected else "-")]
        if comp:
            c = comp.get(r["layer"])
            row.append(f"{c['rel_error_before']:.3f} → {c['rel_error_after']:.3f}"
                       + ((f" (anchor {c['anchor']:.3g})" if c.get("anchor") else "") if c["kept"] else " (not kept)")
                       if c else "")
        t.add_row(*row, style=None if changed else "dim")
    console.print(t)
    tot = Table(show_header=True, title_justify="left")
    for col in ("total", "before", "after", "change"):
        tot.add_column(col, justify="left" if col == "total" else "right")
    names = {"params": ("parameters", human_int), "attention_params": ("attention parameters", human_int),
             "kv_cache_bytes_per_token": ("KV cache per token", human_bytes),
             "total_heads": ("query heads", str), "total_kv_heads": ("KV heads", str)}
    for k, v in result.totals().items():
        label, fmt = names[k]
        if v["before"] is None:  # an encoder's KV cache: none to change
            tot.add_row(label, "n/a", "n/a", "")
            continue
        change = (v["after"] - v["before"]) / v["before"] * 100 if v["before"] else 0.0
        tot.add_row(label, fmt(v["before"]), fmt(v["after"]), f"{change:+.1f}%")
    if result.eval_before is not None:
        metric = "perplexity" if "perplexity" in result.eval_before else "accuracy"
        b, a = result.eval_before, result.eval_after
        tot.add_row("eval loss", f"{b['loss']:.4f}", f"{a['loss']:.4f}", f"{a['loss'] - b['loss']:+.4f}")
        tot.add_row(f"eval {metric}", f"{b[metric]:.3f}", f"{a[metric]:.3f}", f"{a[metric] / b[metric]:.3f}x")
    console.print(tot)
    if result.allocation_line():
        console.print(result.allocation_line())
    if eval_info:
        console.print(f"eval: {eval_info.get('samples')} blocks, {eval_info.get('tokens')} tokens of "
                      f"{eval_info.get('source')} (skipping the first {eval_info.get('skip_samples')})"
                      + (f"; {IN_DOMAIN_NOTE}" if eval_info.get("in_domain") else ""))
    console.print(f"config: {kind}" + (" (loads with trust_remote_code=True; the folder carries its modeling file)"
                                       if kind != "standard" else " (loads with plain from_pretrained)"))


def _default_power_line(power: float) -> str:
    """Which default --anchor-power the refit took, and why (it depends on the calibration's size)."""
    from ...surgery.prune_defaults import FEW_TOKENS_ANCHOR_POWER, MANY_CALIBRATION_TOKENS, MANY_TOKENS_ANCHOR_POWER

    many = power == MANY_TOKENS_ANCHOR_POWER
    return (f"refit at --anchor-power {power:g}, the default on {'' if many else 'fewer than '}"
            f"{MANY_CALIBRATION_TOKENS:,} calibration tokens{' or more' if many else ''} "
            f"({FEW_TOKENS_ANCHOR_POWER if many else MANY_TOKENS_ANCHOR_POWER:g} on {'fewer' if many else 'more'})")


def register(app: typer.Typer) -> None:
    app.command("prune")(prune_cmd)
