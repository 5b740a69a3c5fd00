"""`headtool score`: the importance of every attention head, as a JSON score document."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from ...errors import UsageError
from ..options import MODEL_HELP, LoadOptions, data_options, model_options

METHOD_HELP = ("gradient (default, Michel et al.) | ablation (exact loss increase) | taylor (TextPruner) | "
               "fisher (Kwon et al.) | magnitude (weights, no data) | random (seeded baseline)")


@model_options
@data_options()
def score_cmd(
    model: Annotated[str, typer.Argument(help=MODEL_HELP)],
    method: Annotated[str, typer.Option("--method", "-m", help=METHOD_HELP)] = "gradient",
    objective: Annotated[str, typer.Option(
        "--objective", help="auto | lm | mlm | classification | kl (divergence from the model's own outputs; "
                            "any model, headless encoders too)")] = "auto",
    normalize: Annotated[str, typer.Option(
        "--normalize", help="auto | layer (per-layer L2, Michel) | none; auto = layer for gradient, taylor "
                            "and fisher, none otherwise. raw_scores are always kept")] = "auto",
    iterative: Annotated[int, typer.Option(
        "--iterative", help="K rounds of: score, gate off the weakest heads, re-score (Michel); "
                            "records removal_order", min=0)] = 0,
    fraction: Annotated[Optional[float], typer.Option(
        "--fraction", help="with --iterative: fraction of all heads gated off over the K rounds "
                           "(default 0.5, spread evenly)")] = None,
    iterative_fraction: Annotated[Optional[float], typer.Option(
        "--iterative-fraction", help="with --iterative: fraction of all heads gated off after each round "
                                     "(instead of --fraction)")] = None,
    output: Annotated[Optional[str], typer.Option(
        "--output", "-o", help="write the score document here (atomically); default: stdout")] = None,
    plot: Annotated[Optional[str], typer.Option(
        "--plot", help="save the heatmap as a picture, e.g. scores.png (needs matplotlib)")] = None,
    ablation_batch: Annotated[Optional[int], typer.Option(
        "--ablation-batch", help="heads evaluated together in one batched ablation pass (default: as many "
                                 "as fit in about 1 GiB of activations)", min=1)] = None,
    load: LoadOptions = LoadOptions(),
    data_spec=None,
) -> None:
    """Importance of every attention head (higher = more important), as JSON on stdout or -o FILE.

    Example: headtool score smollm2-135m --data builtin:pydoc --max-samples 64 -o scores.json --plot scores.png

    Pipe it into prune: headtool score m --data d | headtool prune m --scores - --fraction 0.3 -o out
    """
    from ...console import err_console, info
    from ...data.sources import DataSpec
    from ...measure.scores_doc import write_document
    from ...workflows.score import ScoreRequest, run_score
    from ..render import heatmap_table

    req = ScoreRequest(model, method=method, objective=objective, normalize=normalize, iterative=iterative,
                       fraction=fraction, iterative_fraction=iterative_fraction, ablation_batch=ablation_batch,
                       data=data_spec or DataSpec(), load=load)
    req.validate()
    if output and output != "-":
        _check_writable(output, "-o")
    if plot:
        _check_writable(plot, "--plot")
        from ..plotting import _pyplot

        _pyplot()
    run = run_score(req)
    if run.document is None:
        return  # not rank 0 of a distributed run
    doc, result, resolved, norm = run.document, run.result, run.objective, run.normalize
    title = (f"head scores: {model} ({result.estimator}" + (f", {resolved}" if resolved else "")
             + (f", normalize {norm}" if norm != "none" else "") + ")")
    err_console().print(heatmap_table(title, doc["scores"], fmt=_fmt_for(doc["scores"])))
    if result.baseline_loss is not None:
        info(f"baseline loss {result.baseline_loss:.4f} on {result.loss_positions} positions; "
             f"{result.passes} passes in {result.elapsed_s:.1f} s")
    if plot:
        from ..plotting import plot_heatmap

        plot_heatmap(doc["scores"], plot, title=title, colorbar_label=_cbar_label(result.estimator, norm),
                     marked=doc.get("removal_order") or ())
        info(f"heatmap saved to {plot}")
    write_document(doc, output)
    if output and output != "-":
        info(f"scores written to {output}")


def _check_writable(path: str, opt: str) -> None:
    p = Path(path)
    if p.is_dir():
        raise UsageError(f"{opt} {path}: is a folder; give a file name")
    if not p.parent.exists():
        raise UsageError(f"{opt} {path}: folder {p.parent} does not exist")


def _fmt_for(matrix) -> str:
    flat = [abs(v) for row in matrix for v in row]
    top = max(flat, default=0.0)
    if top == 0 or 0.01 <= top < 1000:
        return "{:.3f}" if top < 10 else "{:.1f}"
    return "{:.1e}"


def _cbar_label(estimator: str, norm: str) -> str:
    base = {"gradient": "mean |dL/dg|", "fisher": "Fisher (2nd-order Δloss)", "ablation": "loss increase",
            "taylor": "|Σ W·dL/dW|", "magnitude": "weight norm", "random": "random"}[estimator]
    return base + (" / layer L2 norm" if norm == "layer" else "")


def register(app: typer.Typer) -> None:
    app.command("score")(score_cmd)
