"""Run a validated recipe in one process, the model kept in memory between steps.

Each step calls the same library functions as its command (scoring, selection + pruning,
conversion, evaluation, healing); the final model is written once, with the resolved recipe
in headtool.json and in the model card.
"""
from __future__ import annotations

import copy
import dataclasses
import time
from typing import Any

import yaml

from ..data.batches import make_batches
from ..data.sources import DataSpec
from ..errors import UsageError
from ..measure.objectives import DATA_TASK, resolve_objective
from ..model.info import model_info
from ..model.loading import LoadedModel, load_model
from ..model.placement import (
    LoadOptions,
    has_offloaded_weights,
    require_resident_weights,
    sequential_placement,
)
from .recipe_schema import Recipe, resolved, step_data, validate

DEFAULT_CALIBRATION = 32  # blocks, when a step's data block gives no max_samples


def _spec(block: dict[str, Any] | None, default_samples: int | None = DEFAULT_CALIBRATION) -> DataSpec:
    block = {k: v for k, v in (block or {}).items() if v is not None}
    if "max_samples" not in block and "num_tokens" not in block and default_samples:
        block["max_samples"] = default_samples
    return DataSpec(**block)


@dataclasses.dataclass
class Context:
    recipe: Recipe
    lm: LoadedModel
    original: Any = None  # the unmodified model, kept when an eval or heal step needs it
    calib_device: Any = None  # with `sequential: true`: the device each layer visits during calibration
    scores: list[list[float]] | None = None
    records: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)

    def objective(self, asked: str = "auto") -> str:
        return resolve_objective(asked, self.lm.task)

    def batches(self, block: dict | None, task: str, default_samples: int | None = DEFAULT_CALIBRATION):
        return make_batches(_spec(block, default_samples), self.lm.tokenizer, task)


def check_geometry(ctx: Context) -> None:
    """Targets that are impossible for this model, all reported at once before any step runs."""
    from ..surgery.merging import check_target as check_kv
    from ..surgery.selection import check_target

    problems: list[str] = []
    geometry = ctx.lm.geometry
    for i, step in enumerate(ctx.recipe.steps):
        where = f"{ctx.recipe.where(f'steps.{i}')}: steps.{i}"
        try:
            if step["step"] == "prune" and step.get("heads") is None:
                check_target(_target(step), geometry)
            if step["step"] == "convert_gqa":
                check_kv(ctx.lm.adapter, geometry, int(step["kv_heads"]))
                geometry = [dataclasses.replace(g, num_kv_heads=int(step["kv_heads"])) for g in geometry]
        except UsageError as e:
            problems.append(f"{where}: {e}")
    if problems:
        raise UsageError(f"recipe {ctx.recipe.path} has {len(problems)} problem(s):\n  " + "\n  ".join(problems))


def _target(step: dict):
    from ..surgery.selection import Target

    return Target(fraction=step.get("fraction"), num_heads=step.get("num_heads"), threshold=step.get("threshold"),
                  scope=step.get("scope", "global"), min_heads_per_layer=step.get("min_heads_per_layer", 1),
                  unit=step.get("unit", "query"))


# --------------------------------------------------------------------------- steps
def step_score(ctx: Context, step: dict) -> dict[str, Any]:
    from ..measure.scores_doc import build_document, write_document
    from ..measure.scoring import DATA_METHODS, score_heads

    method = step.get("method", "gradient")
    objective = batches = data = None
    if method in DATA_METHODS:
        objective = ctx.objective(step.get("objective", "auto"))
        b = ctx.batches(step_data(ctx.recipe, step), DATA_TASK[objective])
        batches, data = b.batches, b.info
    res = score_heads(ctx.lm.model, ctx.lm.adapter, batches, method=method, objective=objective,
                      normalize=step.get("normalize", "auto"), iterative=step.get("iterative", 0),
                      seed=ctx.recipe.values.get("seed", 0))
    ctx.scores = res.scores
    if step.get("output"):
        write_document(build_document(ctx.lm, res, data), step["output"])
    return {"method": res.estimator, "objective": objective, "baseline_loss": res.baseline_loss,
            "heads": ctx.lm.geometry and sum(g.num_heads for g in ctx.lm.geometry)}


def step_prune(ctx: Context, step: dict) -> dict[str, Any]:
    from ..surgery.pruning import prune
    from ..surgery.selection import parse_heads, select_heads, selection_from_removed

    lm = ctx.lm
    geometry = lm.geometry
    if step.get("heads") is not None:
        selection = selection_from_removed(parse_heads(step["heads"], geometry), geometry,
                                           step.get("min_heads_per_layer", 1))
    else:
        if ctx.scores is None or step.get("method"):
            step_score(ctx, {"step": "score", "method": step.get("method", "gradient"),
                             "objective": step.get("objective", "auto"), "data": step.get("data")})
        selection = select_heads(ctx.scores, geometry, _target(step))
    calib = heldout = evalb = None
    objective = None
    if step.get("compensate"):
        spec = _spec(step_data(ctx.recipe, step))
        calib = make_batches(spec, lm.tokenizer, "plain").batches
        heldout = make_batches(dataclasses.replace(spec, skip_samples=spec.skip_samples + spec.max_samples,
                                                   max_samples=max(4, spec.max_samples // 4), num_tokens=None),
                               lm.tokenizer, "plain").batches
    if step.get("eval_data"):
        objective = ctx.objective()
        evalb = ctx.batches(step_data(ctx.recipe, step, "eval_data"), DATA_TASK[objective], 16).batches
    result = prune(lm, selection, unit=step.get("unit", "query"), calib_batches=calib, heldout_batches=heldout,
                   compensate=bool(step.get("compensate")), damping=step.get("damping", 1e-2),
                   eval_batches=evalb, objective=objective, calib_device=ctx.calib_device)
    ctx.scores = None  # scores refer to the heads before pruning
    ctx.meta.setdefault("kept_heads", [list(k) for k in result.selection.kept])
    out = {"heads_removed": result.summary()["heads_removed"]}
    if result.eval_after:
        out["loss_before"], out["loss_after"] = result.eval_before["loss"], result.eval_after["loss"]
    return out


def step_convert(ctx: Context, step: dict) -> dict[str, Any]:
    from ..measure.calibration import attention_input_grams
    from ..measure.evaluation import evaluate
    from ..surgery.merging import DATA_METHODS, convert_model

    lm = ctx.lm
    merge = step.get("merge", "fit")
    methods = merge if isinstance(merge, list) else [m.strip() for m in str(merge).split(",")]
    grouping = step.get("grouping", "contiguous")
    objective = ctx.objective()
    task = DATA_TASK[objective]
    cal = held = grams = None
    if grouping == "similarity" or any(m in DATA_METHODS for m in methods):
        spec = _spec(step_data(ctx.recipe, step))
        cal = make_batches(spec, lm.tokenizer, task)
        held = make_batches(dataclasses.replace(spec, skip_samples=spec.skip_samples + cal.info["samples"],
                                                max_samples=max(4, cal.info["samples"] // 4), num_tokens=None),
                            lm.tokenizer, task)
        grams = attention_input_grams(lm.model, lm.adapter, cal.batches, device=ctx.calib_device)
    best = best_loss = None
    tried = {}
    for m in methods:
        conv = convert_model(lm.model, lm.adapter, int(step["kv_heads"]), method=m, grouping=grouping, grams=grams,
                             refit=(m == "fit" and cal is not None), batches=cal.batches if cal else None,
                             heldout_batches=held.batches if held else None, calib_device=ctx.calib_device)
        loss = evaluate(conv.model, held.batches, objective, label=f"held-out {m}")["loss"] if held else 0.0
        tried[m] = loss
        if best is None or loss < best_loss:
            best, best_loss = conv, loss
    lm.model = best.model
    ctx.meta.setdefault("kv_groups", [[list(g) for g in p.groups] for p in best.plans])
    return {"merge": best.method, "heldout_loss": tried}


def step_eval(ctx: Context, step: dict) -> dict[str, Any]:
    from ..measure.evaluation import evaluate

    objective = ctx.objective(step.get("objective", "auto"))
    if objective == "kl":
        raise UsageError("an eval step needs a model with an LM or classification head")
    b = ctx.batches(step_data(ctx.recipe, step), DATA_TASK[objective], 16)
    before = evaluate(ctx.original, b.batches, objective, label="eval original") if ctx.original is not None else None
    after = evaluate(ctx.lm.model, b.batches, objective, label="eval")
    out = {"loss": after["loss"], "tokens": after["tokens"]}
    if "perplexity" in after:
        out["perplexity"] = after["perplexity"]
    if before:
        out["loss_before"] = before["loss"]
        if "perplexity" in before:
            out["perplexity_before"] = before["perplexity"]
    return out


def step_heal(ctx: Context, step: dict) -> dict[str, Any]:
    from ..train.healing import HealOptions, heal_model

    keys = {f.name for f in dataclasses.fields(HealOptions)}
    opts = HealOptions(**{k: v for k, v in step.items() if k in keys}, seed=ctx.recipe.values.get("seed", 0))
    objective = ctx.objective()
    objective = None if objective == "kl" else objective
    task = DATA_TASK[objective or "kl"]
    block = step_data(ctx.recipe, step) or {}
    if step.get("num_tokens"):  # the heal budget in tokens caps the training data
        block = {**block, "num_tokens": step["num_tokens"], "max_samples": None}
    train = ctx.batches(block, task, 64)
    ev_block = step_data(ctx.recipe, step, "eval_data") or {**(step_data(ctx.recipe, step) or {}),
                                                            "skip_samples": train.info["samples"]}
    ev = ctx.batches(ev_block, task, 8)
    res = heal_model(ctx.lm.model, ctx.original, ctx.lm.adapter, train.batches, ev.batches, opts, objective=objective)
    doc = res.to_json()
    return {k: doc[k] for k in ("steps", "eval_before", "eval_after") if k in doc}


STEPS = {"score": step_score, "prune": step_prune, "convert_gqa": step_convert, "eval": step_eval,
         "heal": step_heal}


def summary_row(step: str, figures: dict, info: dict, seconds: float) -> dict[str, Any]:
    return {"step": step, "heads": info["total_heads"], "kv_heads": info["total_kv_heads"],
            "params": info["params"], "kv_cache_bytes_per_token": info["kv_cache_bytes_per_token"],
            "seconds": round(seconds, 2), **figures}


def run_recipe(recipe: Recipe, *, output: str | None = None, overwrite: bool | None = None,
               on_step=None) -> dict[str, Any]:
    """Validate `recipe` whole, then run its steps; returns the summary (and writes the output)."""
    from ..io.output import check_output_target, write_output

    validate(recipe)
    v = recipe.values
    out = output or v.get("output")
    ow = bool(v.get("overwrite")) if overwrite is None else overwrite
    load, calib_device = sequential_placement(
        LoadOptions(dtype=v.get("dtype", "auto"), device=v.get("device", "auto"),
                    trust_remote_code=bool(v.get("trust_remote_code")), device_map=v.get("device_map"),
                    max_memory=v.get("max_memory")), bool(v.get("sequential")))
    lm = load_model(v["model"], **load.kwargs())
    ctx = Context(recipe, lm, calib_device=calib_device)
    check_geometry(ctx)
    offloaded = has_offloaded_weights(lm.model)
    rewrites = sorted({s["step"] for s in recipe.steps if s["step"] in ("prune", "convert_gqa", "heal")})
    if rewrites or out:  # before any step runs, not in the middle of the recipe
        require_resident_weights(lm.model, f"{v['model']}: the recipe ({', '.join(rewrites) or 'its output'})",
                                 "use sequential: true (one layer at a time on the device) instead")
    if out:
        check_output_target(out, lm.path, ow)
    if lm.tokenizer is None and any(s["step"] != "score" or s.get("method") not in ("magnitude", "random")
                                    for s in recipe.steps):
        raise UsageError(f"{v['model']}: no tokenizer files beside the model; recipe steps need data")
    source_fingerprint = lm.fingerprint
    if any(s["step"] in ("eval", "heal") for s in recipe.steps) and not offloaded:
        ctx.original = copy.deepcopy(lm.model)  # (offloaded: only score/eval steps, the model stays unchanged)
    rows = [summary_row("load", {}, model_info(lm.model, lm.adapter), 0.0)]
    for i, step in enumerate(recipe.steps):
        t0 = time.perf_counter()
        figures = STEPS[step["step"]](ctx, step)
        row = summary_row(step["step"], figures, model_info(ctx.lm.model, ctx.lm.adapter), time.perf_counter() - t0)
        rows.append(row)
        if on_step:
            on_step(i, row)
    result: dict[str, Any] = {"recipe": resolved(recipe), "steps": rows, "output": None}
    if out:
        meta = {"operation": "recipe", "recipe": resolved(recipe), "steps": rows,
                "source_fingerprint": source_fingerprint,
                "num_heads": [g.num_heads for g in ctx.lm.geometry],
                "num_kv_heads": [g.num_kv_heads for g in ctx.lm.geometry], **ctx.meta}
        card = "Recipe:\n\n```yaml\n" + yaml.safe_dump(resolved(recipe), sort_keys=False) + "```\n"
        result["output"] = write_output(out, model=ctx.lm.model, tokenizer=lm.tokenizer, source=lm, meta=meta,
                                        card_table=card, overwrite=ow)
    return result
