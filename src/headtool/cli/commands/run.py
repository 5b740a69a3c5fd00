"""`headtool run RECIPE.yaml`: a declared pipeline, validated whole, run in one process."""
from __future__ import annotations

from typing import Annotated, Optional

import typer

from ..options import JsonOpt


def _kv(row: dict) -> str:
    """KV heads, or the latent of latent attention (kv_rank + rotary key dims per layer)."""
    if row.get("kv_rank") is None:
        return str(row["kv_heads"])
    from ..render import value_range

    return f"latent {value_range(row['kv_rank'])}+{row['rope_dim']}"


def render_summary(result: dict) -> None:
    from ..render import Table

    from ...console import err_console
    from ..render import human_bytes, human_int

    t = Table(title=f"headtool run: {result['recipe'].get('name', 'recipe')}", title_justify="left")
    for col in ("step", "data", "heads", "KV heads", "params", "KV/token", "loss before", "loss after", "ppl", "time"):
        t.add_column(col, justify="left" if col in ("step", "data") else "right")
    for r in result["steps"]:
        after = r.get("loss_after", r.get("loss"))
        ppl = r.get("perplexity")
        data = r.get("data", "") + (" *" if r.get("in_domain") else "")
        t.add_row(r["step"], data, str(r["heads"]), _kv(r), human_int(r["params"]),
                  human_bytes(r["kv_cache_bytes_per_token"]),
                  "" if r.get("loss_before") is None else f"{r['loss_before']:.4f}",
                  "" if after is None else f"{after:.4f}",
                  "" if ppl is None else (f"{r['perplexity_before']:.2f} → {ppl:.2f}" if r.get("perplexity_before")
                                          else f"{ppl:.2f}"),
                  f"{r['seconds']:.1f}s")
    err_console().print(t)
    if any(r.get("in_domain") for r in result["steps"]):
        from ...io.provenance import IN_DOMAIN_NOTE

        err_console().print(f"* {IN_DOMAIN_NOTE}", markup=False)
    if result.get("output"):
        err_console().print(f"written to {result['output']['path']} ({result['output']['config_kind']})")
    elif result.get("dry_run"):
        err_console().print("dry run: nothing written")


def run_cmd(
    recipe: Annotated[str, typer.Argument(help="a recipe YAML file (see recipes/)")],
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="override a value: KEY=VALUE, "
                                                      "e.g. steps.1.fraction=0.4 or model=./my-model")] = None,
    output: Annotated[Optional[str], typer.Option("-o", "--output", help="output folder (overrides the recipe's)")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="replace an existing output folder")] = False,
    check: Annotated[bool, typer.Option("--check", help="only validate the recipe (as this run would, "
                                        "with its -o and --dry-run)")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="run the steps and show the summary; nothing "
                                          "written (no model, no score documents)")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Run a recipe: model, data and steps (score, prune, convert_gqa, convert_mla, eval, heal) declared in YAML.

    Every problem of a broken recipe is listed at once with its file:line:col, before anything runs.
    Steps that rewrite the weights (prune, convert_gqa, convert_mla, heal) need an output (the
    recipe's output: or -o), or --dry-run to compute them and write nothing.

    Example: headtool run recipes/prune-gqa-compensated.yaml --set steps.1.fraction=0.3 -o out/
    """
    from ...console import info, print_json
    from ...workflows.recipe_runner import run_recipe, validate_whole
    from ...workflows.recipe_schema import apply_overrides, load_recipe, resolved

    r = load_recipe(recipe)
    apply_overrides(r, list(set_ or []))
    if check:
        validate_whole(r, output=output, dry_run=dry_run, json_stdout=json_out)
        info(f"{recipe}: valid ({len(r.steps)} step{'' if len(r.steps) == 1 else 's'})")
        if json_out:
            print_json(resolved(r, output, overwrite or None))
        return
    result = run_recipe(r, output=output, overwrite=overwrite or None, dry_run=dry_run, json_stdout=json_out,
                        on_step=lambda i, row: info(f"step {i + 1}/{len(r.steps)} {row['step']}: done in "
                                                    f"{row['seconds']:.1f}s"))
    render_summary(result)
    if json_out:
        print_json(result)


def register(app: typer.Typer) -> None:
    app.command("run")(run_cmd)
