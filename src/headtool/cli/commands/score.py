"""`headtool score`: the importance of every attention head, as a JSON score document."""
from __future__ import annotations

from typing import Annotated, Optional

import typer

from ...data.sources import AUTO_SOURCE
from ...workflows.requests import ScoreRequest, calibration_data
from ..options import (JsonOpt, LoadOptions, command_inputs, command_options, data_option_names, data_options,
                       given_options, model_options)


@model_options
@data_options(default=AUTO_SOURCE)
@command_options(ScoreRequest)
def score_cmd(
    ctx: typer.Context,
    json_out: JsonOpt = False,
    plot: Annotated[Optional[str], typer.Option(
        "--plot", help="save the heatmap as a picture, e.g. scores.png (needs matplotlib)")] = None,
    fields=None,
    load: LoadOptions = LoadOptions(),
    data_spec=None,
) -> None:
    """Importance of every attention head (higher = more important), as JSON on stdout or -o FILE.

    Example: headtool score smollm2-135m --data builtin:pydoc --max-samples 64 -o scores.json --plot scores.png

    Pipe it into prune: headtool score m --data d | headtool prune m --scores - --fraction 0.3 -o out
    """
    from ...console import err_console, info, result_stream
    from ...errors import UsageError
    from ...io.files import check_output_path
    from ...measure.scores_doc import write_document
    from ...workflows.score import run_score
    from ..render import heatmap_table

    req = ScoreRequest(**fields, data=data_spec or calibration_data(), load=load)
    req.validate()
    _refuse_data_options(ctx, req.method)
    model, output = req.model, req.output
    if json_out and output and output != "-":  # --json as every other command takes it: the document on stdout
        raise UsageError(f"--json prints the score document on stdout and -o {output} writes it to a file: "
                         "give one of them")
    inputs = command_inputs(model, req.data)
    if output and output != "-":
        check_output_path(output, "-o", inputs)
    else:  # the document goes to stdout: a closed one is refused before scoring
        result_stream("the score document", "write it with -o FILE")
    if plot:
        from ..plotting import check_plot_file

        picture = check_plot_file(plot, inputs)  # needs matplotlib, and a format it writes
        if output and output != "-" and picture.expanduser().resolve() == check_output_path(output, "-o").resolve():
            # (the heatmap was saved, then the document written over it, both reported)
            raise UsageError(f"--plot {plot} and -o {output} are the same file: give each its own")
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


def _refuse_data_options(ctx: typer.Context, method: str) -> None:
    """magnitude reads the weights alone and random only --seed: a data option or --objective given to
    them was ignored, and the document looked calibrated on text it never read."""
    from ...measure.scoring import DATA_METHODS
    from ...workflows.requests import refuse_unused

    if method in DATA_METHODS:
        return
    unused = given_options(ctx, (data_option_names() | {"objective"}) - ({"seed"} if method == "random" else set()))
    refuse_unused(unused, f"with a data-driven --method ({', '.join(DATA_METHODS)}); --method {method} reads "
                  + ("no data" if method == "magnitude" else "only --seed"))


def _fmt_for(matrix) -> str:
    flat = [abs(v) for row in matrix for v in row]
    top = max(flat, default=0.0)
    if top == 0 or 0.01 <= top < 1000:
        return "{:.3f}" if top < 10 else "{:.1f}"
    return "{:.1e}"


def _cbar_label(estimator: str, norm: str) -> str:
    base = {"gradient": "mean |dL/dg|", "fisher": "Fisher (2nd-order Δloss)", "ablation": "loss increase",
            "taylor": "|Σ W·dL/dW|", "magnitude": "weight norm", "random": "random"}[estimator]
    return base + {"layer": " / layer L2 norm", "geometric": " / sqrt(layer L2 norm)"}.get(norm, "")


def register(app: typer.Typer) -> None:
    app.command("score")(score_cmd)
