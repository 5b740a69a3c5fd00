"""`headtool prune`: remove attention heads physically and write a checkpoint that reloads."""
from __future__ import annotations

from dataclasses import replace
from typing import Annotated, Optional

import typer

from ...errors import UsageError
from ...model.placement import sequential_placement
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
        "--heads", help='explicit heads to remove, layer:heads;... e.g. "3:0,5;7:2"', rich_help_panel="Heads")] = None,
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
    from ...io.output import check_output_target, write_output
    from ...io.sizes import parse_size
    from ...model.loading import load_model
    from ...model.placement import require_resident_weights
    from ...surgery.pruning import PRUNE_INSTEAD
    from ...surgery.selection import (
        Target,
        check_target,
        parse_heads,
        select_heads,
        selection_from_removed,
    )

    given = [n for n, v in (("--scores", scores), ("--heads", heads)) if v is not None]
    if len(given) > 1:
        raise UsageError("give either --scores or --heads, not both")
    if not given and data_spec is None:
        raise UsageError("say which heads to remove: --scores FILE|-, --heads LIST, or --data D to score now")
    if heads is not None and any(v is not None for v in (fraction, num_heads, threshold)):
        raise UsageError("--heads lists the heads to remove; it takes no --fraction/--num-heads/--threshold")
    if compensate and data_spec is None:
        raise UsageError("--compensate needs calibration data: pass --data")
    if not dry_run and not output:
        raise UsageError("give an output folder with -o OUT (or --dry-run)")
    parse_size(shard_size)
    if streaming:
        if not given or compensate or eval_data or dry_run:
            raise UsageError("--streaming needs no forward pass: give --scores or --heads, and no "
                             "--compensate, --eval-data or --dry-run")
        from ...surgery.streaming import prune_checkpoint_streaming

        target = None if heads is not None else Target(fraction=fraction, num_heads=num_heads, threshold=threshold,
                                                       scope=scope, min_heads_per_layer=min_heads, unit=unit)
        written = prune_checkpoint_streaming(model, output, scores=scores, heads=heads, target=target,
                                             min_heads=min_heads, overwrite=overwrite, shard_size=shard_size,
                                             trust_remote_code=load.trust_remote_code)
        info(f"written to {written['path']} ({written['config_kind']}, streamed)")
        if json_out:
            print_json(written)
        return
    load, calib_device = sequential_placement(load, sequential)
    lm = load_model(model, **load.kwargs())
    if not dry_run:
        require_resident_weights(lm.model, "prune", PRUNE_INSTEAD)
    lm.fingerprint  # of the input, before anything changes (headtool.json records it)
    if not dry_run:
        check_output_target(output, lm.path, overwrite)
    geometry = lm.geometry
    target = None
    if heads is not None:
        selection = selection_from_removed(parse_heads(heads, geometry), geometry, min_heads)
    else:
        target = Target(fraction=fraction, num_heads=num_heads, threshold=threshold, scope=scope,
                        min_heads_per_layer=min_heads, unit=unit)
        check_target(target, geometry)
    needs_tokens = data_spec is not None or eval_data is not None
    if needs_tokens and lm.tokenizer is None:
        raise UsageError(f"{model}: no tokenizer files beside the model; --data / --eval-data need them")
    score_info: dict = {}
    if target is not None:
        matrix, score_info = _scores(lm, scores, data_spec, method, objective)
        selection = select_heads(matrix, geometry, target)
    calib, heldout, eval_batches, eval_objective, eval_info = _data(lm, data_spec, compensate, heldout_samples,
                                                                    eval_data, eval_samples, objective)
    from ...surgery.pruning import markdown_table, prune

    result = prune(lm, selection, unit=unit, calib_batches=calib, heldout_batches=heldout, compensate=compensate,
                   choose_in_layer=choose_in_layer, refit_layers=refit_layers, damping=damping,
                   eval_batches=eval_batches, objective=eval_objective, calib_device=calib_device)
    kind = _config_kind(lm)
    summary = result.summary()
    options = {"target": target.describe() if target else None, "heads": heads, "compensate": compensate,
               "choose_in_layer": result.choice, "refit_layers": refit_layers if compensate else None,
               "damping": damping if compensate else None, "heldout_samples": heldout_samples,
               "calibration_data": (calib_info(lm, data_spec) if compensate else None), "dtype": load.dtype}
    meta = {"operation": "prune", "method": score_info.get("method", "explicit" if heads else None),
            "scores": score_info or None, "options": options,
            "kept_heads": [list(k) for k in result.selection.kept],
            "num_kv_heads": [g.num_kv_heads for g in result.geometry_after],
            "num_heads": [g.num_heads for g in result.geometry_after], "summary": summary}
    written = None
    if not dry_run:
        written = write_output(output, model=lm.model, tokenizer=lm.tokenizer, source=lm, meta=meta,
                               card_table=markdown_table(result, kind), overwrite=overwrite, shard_size=shard_size)
        kind = written["config_kind"]
    _render(err_console(), model, result, kind, eval_info, written, dry_run)
    if json_out:
        print_json({"model": model, "output": written, "dry_run": dry_run, "config_kind": kind,
                    "source": {"path": lm.path, "fingerprint": lm.fingerprint},
                    **{k: v for k, v in meta.items() if k not in ("summary",)}, **summary,
                    "eval_data": eval_info})
    elif written:
        info(f"written to {written['path']} ({kind})")


def calib_info(lm, spec) -> dict | None:
    return {"source": spec.source, "max_samples": spec.max_samples, "seq_len": spec.seq_len, "seed": spec.seed} \
        if spec else None


def _scores(lm, scores: str | None, spec, method: str, objective: str) -> tuple[list[list[float]], dict]:
    """The score matrix (from a document, or by scoring now on --data) and where it came from."""
    if scores is not None:
        from ...measure.scores_doc import read_scores

        doc = read_scores(scores, lm)
        return doc["scores"], {"from": scores, "method": doc.get("method"), "objective": doc.get("objective"),
                               "normalize": doc.get("normalize"), "data": doc.get("data")}
    from ...console import info
    from ...data.batches import make_batches
    from ...measure.objectives import DATA_TASK, resolve_objective
    from ...measure.scoring import DATA_METHODS, score_heads

    resolved = None
    batches = None
    if method in DATA_METHODS:
        resolved = resolve_objective(objective, lm.task, spec.label_column)
        batches = make_batches(spec, lm.tokenizer, DATA_TASK[resolved]).batches
    result = score_heads(lm.model, lm.adapter, batches, method=method, objective=resolved, seed=spec.seed,
                         label="score")
    info(f"scored with {result.estimator}" + (f" ({resolved})" if resolved else ""))
    return result.scores, {"from": "data", "method": method, "estimator": result.estimator, "objective": resolved,
                           "normalize": result.normalize, "data": calib_info(lm, spec)}


def _data(lm, spec, compensate: bool, heldout_samples: int, eval_data: str | None, eval_samples: int,
          objective: str):
    """Calibration, held-out-for-refit and evaluation batches (evaluation disjoint from the others)."""
    from ...data.batches import make_batches
    from ...data.sources import DataSpec
    from ...measure.objectives import DATA_TASK, resolve_objective

    calib = heldout = eval_batches = None
    eval_objective = eval_info = None
    used = 0
    if compensate:
        if spec.max_samples is None and (heldout_samples or eval_data == spec.source):
            raise UsageError("give --max-samples for the calibration data so that held-out blocks can follow it")
        calib = make_batches(spec, lm.tokenizer, "plain").batches
        used = spec.skip_samples + (spec.max_samples or 0)
        if heldout_samples:
            heldout = make_batches(replace(spec, skip_samples=used, max_samples=heldout_samples),
                                   lm.tokenizer, "plain").batches
            used += heldout_samples
    elif spec is not None and spec.max_samples is not None:
        used = spec.skip_samples + spec.max_samples
    if eval_data is not None:
        eval_objective = resolve_objective(objective, lm.task, None)
        if eval_objective == "kl":
            raise UsageError("--eval-data needs a model with an LM head (there is no loss to report otherwise)")
        base = spec if spec is not None else DataSpec(source=eval_data)
        skip = used if (spec is not None and eval_data == spec.source) else 0
        if spec is not None and eval_data == spec.source and spec.max_samples is None:
            raise UsageError("--eval-data is the same source as --data: give --max-samples so the evaluation "
                             "blocks can be held out from it")
        espec = replace(base, source=eval_data, max_samples=eval_samples, skip_samples=skip, label_column=None)
        if spec is not None and eval_data != spec.source:  # another source: its own columns and split
            espec = replace(espec, split=None, text_column=None)
        eb = make_batches(espec, lm.tokenizer, DATA_TASK[eval_objective])
        eval_batches = eb.batches
        eval_info = {**eb.info, "skip_samples": skip}
    return calib, heldout, eval_batches, eval_objective, eval_info


def _config_kind(lm) -> str:
    from ...arch import LAYOUT_KEY
    from ...io.output import REMOTE_CODE, STANDARD

    return REMOTE_CODE if getattr(lm.model.config, LAYOUT_KEY, None) else STANDARD


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
