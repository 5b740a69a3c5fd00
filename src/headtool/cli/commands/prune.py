"""`headtool prune`: remove attention heads physically and write a checkpoint that reloads."""
from __future__ import annotations

from typing import Annotated, Optional

import typer

from ..options import (
    MODEL_HELP,
    JsonOpt,
    LoadOptions,
    SequentialOpt,
    data_options,
    model_options,
)


@model_options
@data_options(default=None)
def prune_cmd(
    model: Annotated[str, typer.Argument(help=MODEL_HELP)],
    output: Annotated[Optional[str], typer.Option("--output", "-o", help="output folder (written atomically)")] = None,
    scores: Annotated[Optional[str], typer.Option(
        "--scores", help="score document from `headtool score` (a file, or - for stdin)", rich_help_panel="Heads")] = None,
    heads: Annotated[Optional[str], typer.Option(
        "--heads", help='explicit heads to remove: LAYER:HEAD,HEAD;LAYER:HEAD, e.g. "3:0,5;7:2" (layer 3 heads 0 '
        'and 5, layer 7 head 2); "3:1,5:0" works too (an item with ":" starts a new layer); "" removes none',
        rich_help_panel="Heads")] = None,
    method: Annotated[str, typer.Option(
        "--method", help="with --data and no --scores: scoring method (gradient, ablation, taylor, fisher, "
                         "magnitude, random)", rich_help_panel="Heads")] = "gradient",
    objective: Annotated[str, typer.Option(
        "--objective", help="auto | lm | mlm | classification | kl (scoring and --eval-data)",
        rich_help_panel="Heads")] = "auto",
    fraction: Annotated[Optional[float], typer.Option(
        "--fraction", help="fraction of query heads to remove, in (0, 1)", rich_help_panel="Target")] = None,
    num_heads: Annotated[Optional[int], typer.Option(
        "--num-heads", help="number of query heads to remove", rich_help_panel="Target")] = None,
    threshold: Annotated[Optional[float], typer.Option(
        "--threshold", help="remove heads scoring below this", rich_help_panel="Target")] = None,
    scope: Annotated[str, typer.Option(
        "--scope", help="global (rank all heads together) | layer (same number from every layer)",
        rich_help_panel="Target")] = "global",
    min_heads: Annotated[int, typer.Option(
        "--min-heads-per-layer", help="query heads every layer keeps at least", rich_help_panel="Target")] = 1,
    unit: Annotated[str, typer.Option(
        "--unit", help="GQA: query (query heads inside KV groups, groups stay equal) | group (whole KV groups)",
        rich_help_panel="Target")] = "query",
    compensate: Annotated[bool, typer.Option(
        "--compensate", help="refit each pruned layer's output projection by least squares on --data "
                             "(sequential calibration)", rich_help_panel="Compensation")] = False,
    choose_in_layer: Annotated[str, typer.Option(
        "--choose-in-layer", help="auto | scores | refit: which heads go inside a layer (refit: the least "
                                  "error after the refit; auto = refit with --compensate)",
        rich_help_panel="Compensation")] = "auto",
    refit_layers: Annotated[str, typer.Option(
        "--refit-layers", help="pruned | all (also refit unpruned layers to undo earlier layers' drift)",
        rich_help_panel="Compensation")] = "pruned",
    damping: Annotated[float, typer.Option(
        "--damping", help="ridge damping, relative to the mean diagonal of the Gram matrix",
        rich_help_panel="Compensation")] = 1e-2,
    heldout_samples: Annotated[int, typer.Option(
        "--heldout-samples", help="blocks after the calibration data on which each refit must lower the "
                                  "error to be kept (0: no check)", min=0, rich_help_panel="Compensation")] = 0,
    eval_data: Annotated[Optional[str], typer.Option(
        "--eval-data", help="measure loss / perplexity before and after on this data (held out from --data "
                            "when it is the same source)", rich_help_panel="Evaluation")] = None,
    eval_samples: Annotated[int, typer.Option(
        "--eval-samples", help="blocks for --eval-data", min=1, rich_help_panel="Evaluation")] = 32,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="plan and summary; nothing written")] = False,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="replace an existing output folder")] = False,
    shard_size: Annotated[str, typer.Option("--shard-size", help="largest safetensors shard")] = "5GB",
    streaming: Annotated[bool, typer.Option(
        "--streaming", help="work shard by shard on the safetensors files, never building the model "
                            "(checkpoints larger than memory; needs --scores or --heads, no --compensate)")] = False,
    sequential: SequentialOpt = False,
    json_out: JsonOpt = False,
    load: LoadOptions = LoadOptions(),
    data_spec=None,
) -> None:
    """Remove attention heads (chosen from scores or listed) and write a smaller checkpoint.

    Examples:
      headtool score m --data d | headtool prune m --scores - --fraction 0.3 -o out
      headtool prune smollm2-135m --data builtin:pydoc --max-samples 32 --fraction 0.25 --compensate -o out
      headtool prune m --heads "3:0,5;7:2" -o out
    """
    from ...console import err_console, info, print_json
    from ...workflows.prune import PruneRequest, run_prune

    run = run_prune(PruneRequest(
        model, output=output, scores=scores, heads=heads, method=method, objective=objective, fraction=fraction,
        num_heads=num_heads, threshold=threshold, scope=scope, min_heads=min_heads, unit=unit,
        compensate=compensate, choose_in_layer=choose_in_layer, refit_layers=refit_layers, damping=damping,
        heldout_samples=heldout_samples, eval_data=eval_data, eval_samples=eval_samples, dry_run=dry_run,
        overwrite=overwrite, shard_size=shard_size, streaming=streaming, sequential=sequential, data=data_spec,
        load=load))
    if run.streamed is not None:
        info(f"written to {run.streamed['path']} ({run.streamed['config_kind']}, streamed)")
        if json_out:
            print_json(run.streamed)
        return
    _render(err_console(), model, run.result, run.config_kind, run.eval_info, run.written, dry_run)
    if json_out:
        print_json(run.report)
    elif run.written:
        info(f"written to {run.written['path']} ({run.config_kind})")


def _render(console, ref: str, result, kind: str, eval_info, written, dry_run: bool) -> None:
    from rich.table import Table

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
               f"{r['kv_heads_before']} → {r['kv_heads_after']}",
               ",".join(map(str, r["removed_heads"])) or "-"]
        if comp:
            c = comp.get(r["layer"])
            row.append(f"{c['rel_error_before']:.3f} → {c['rel_error_after']:.3f}" + ("" if c["kept"] else " (not kept)")
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
        change = (v["after"] - v["before"]) / v["before"] * 100 if v["before"] else 0.0
        tot.add_row(label, fmt(v["before"]), fmt(v["after"]), f"{change:+.1f}%")
    if result.eval_before is not None:
        metric = "perplexity" if "perplexity" in result.eval_before else "accuracy"
        b, a = result.eval_before, result.eval_after
        tot.add_row("eval loss", f"{b['loss']:.4f}", f"{a['loss']:.4f}", f"{a['loss'] - b['loss']:+.4f}")
        tot.add_row(f"eval {metric}", f"{b[metric]:.3f}", f"{a[metric]:.3f}", f"{a[metric] / b[metric]:.3f}x")
    console.print(tot)
    if eval_info:
        console.print(f"eval: {eval_info.get('samples')} blocks, {eval_info.get('tokens')} tokens of "
                      f"{eval_info.get('source')} (skipping the first {eval_info.get('skip_samples')})")
    console.print(f"config: {kind}" + (" (loads with trust_remote_code=True; the folder carries its modeling file)"
                                       if kind != "standard" else " (loads with plain from_pretrained)"))


def register(app: typer.Typer) -> None:
    app.command("prune")(prune_cmd)
