"""Run a validated recipe in one process, the model kept in memory between steps.

Each step builds its command's request from its keys (`build_request`) and runs the same
function the command runs on the model it loaded (`score_loaded`, `prune_loaded`,
`convert_loaded`, `convert_mla_loaded`, `eval_loaded`, `heal_loaded`); the final model is written once, with the
resolved recipe in headtool.json and in the model card.
"""
from __future__ import annotations

import copy
import dataclasses
import os
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Sequence

import yaml

from ..console import info, warn
from ..data.batches import blocks_read, evaluation_reads, resolve_auto
from ..data.selfgen import can_sample
from ..data.sources import AUTO_SOURCE, DataSpec, file_identity, is_auto, parse_sources, self_source
from ..errors import HeadtoolError, UsageError
from ..io.output import check_output_target, write_output
from ..io.provenance import RECORD, fitted_on, original_heads, written_record
from ..measure.objectives import DATA_TASK, resolve_objective
from ..measure.scores_doc import build_document, write_document
from ..measure.scoring import ScoreResult
from ..model.info import model_info
from ..model.loading import LoadedModel, load_model
from ..model.placement import (
    LoadOptions,
    has_offloaded_weights,
    require_resident_weights,
    sequential_placement,
)
from ..optionspec import options_of
from ..surgery.merging import check_target as check_kv
from ..surgery.merging import merged_geometry
from ..surgery.selection import check_target, parse_heads, resolve_unit, selection_from_removed
from .convert_gqa import convert_loaded
from .convert_mla import convert_mla_loaded, latent_target
from .data_plan import evaluation_cut
from .evaluate import eval_loaded
from .heal import heal_loaded
from .prune import prune_loaded, prune_target
from .recipe_schema import (
    STEP_REQUESTS,
    Recipe,
    output_problems,
    raise_problems,
    resolved,
    rewriting_steps,
    step_data,
    step_options,
    unused_score_problems,
    validate,
)
from .requests import reads_no_data
from .score import score_loaded


@dataclasses.dataclass
class Context:
    recipe: Recipe
    lm: LoadedModel
    original: Any = None  # the unmodified model, kept when an eval or heal step or `self` data needs it
    calib_device: Any = None  # with `sequential: true`: the device each layer visits during calibration
    scores: ScoreResult | None = None  # the last score step's, until a prune uses them
    #: what the steps so far read (blocks_read infos): the output's data_read, where eval steps start and
    #: their in-domain mark
    reads: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    dry_run: bool = False  # nothing is written: not the model, not a score step's document
    num_heads_before: list[int] = dataclasses.field(default_factory=list)  # the recipe model's, per layer
    #: per layer, the recipe model's query head at each position of the model as it stands (None: unchanged)
    heads: list[list[int]] | None = None
    #: the score steps' documents and their files, written when every step has run
    documents: list[tuple[dict[str, Any], str]] = dataclasses.field(default_factory=list)

    def keep(self, positions: Sequence[Sequence[int]]) -> None:
        """A step kept (and ordered) these positions of each layer: the output's kept_heads name the heads
        of the recipe's model, the folder its headtool.json gives as the source, through every step."""
        now = self.heads or [list(range(n)) for n in self.num_heads_before]
        self.heads = [[layer[p] for p in kept] for layer, kept in zip(now, positions)]
        self.meta["kept_heads"] = self.heads

    def recipe_heads(self, layer: int, positions: Sequence[int]) -> list[int]:
        """Positions of a layer of the model as it stands, as the recipe model's query heads."""
        return [self.heads[layer][p] for p in positions] if self.heads else list(positions)

    @property
    def text_model(self) -> LoadedModel:
        """The model `self` data is sampled from: the original, however many steps changed lm."""
        return dataclasses.replace(self.lm, model=self.original) if self.original is not None else self.lm


def default_source(cls: type) -> str:
    """The source a step of this request class reads when no data block names one: the command's own
    default (`auto` for the steps that calibrate, prune included; builtin:pydoc for eval)."""
    f = next(f for f in dataclasses.fields(cls) if f.name == "data")
    default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    return default.source if isinstance(default, DataSpec) else AUTO_SOURCE


def build_request(recipe: Recipe, step: dict[str, Any]) -> Any:
    """The request a step runs: its command's request class, the step's keys over the class's
    defaults, its data block merged over the recipe's, the recipe's model and seed."""
    name = step["step"]
    cls, nested = STEP_REQUESTS[name]
    own = step_options(name)
    nested_keys = {field_name: {o.name for o in options_of(c)} for field_name, c in nested.items()}
    inner = set().union(*nested_keys.values())
    kwargs: dict[str, Any] = {}
    for key, value in step.items():
        if key in own and key not in inner:
            kwargs[key] = ",".join(map(str, value)) if isinstance(value, list) else value
    data = DataSpec(**{"source": default_source(cls), **(step_data(recipe, step) or {})})
    for field_name, keys in nested_keys.items():
        kwargs[field_name] = nested[field_name](**{k: v for k, v in step.items() if k in keys}, seed=data.seed)
    for key, opt in own.items():  # eval_data, heldout_data: a data block (over the recipe's) or a source
        if isinstance(step.get(key), dict) and isinstance(opt.type, tuple) and DataSpec in opt.type:
            block = {k: v for k, v in step_data(recipe, step, key).items() if k not in CUT_KEYS or k in step[key]}
            kwargs[key] = DataSpec(**block)
    model = recipe.values["model"]
    if name == "eval":
        return cls(models=(model,), **kwargs, data=data)
    if name == "heal":
        return cls(student=model, teacher=model, output="", **kwargs, data=data)
    return cls(model=model, **kwargs, data=data)


#: how many blocks and which: a held-out or evaluation block says these itself (or takes its
#: command's default, e.g. eval_samples), never from the recipe's calibration block
CUT_KEYS = ("max_samples", "num_tokens", "skip_samples")


def check_geometry(ctx: Context) -> None:
    """Targets that are impossible for this model, all reported at once before any step runs (the
    step orders a run refuses are the validator's: recipe_schema.REFUSED_ORDERS)."""
    problems: list[str] = []
    geometry = ctx.lm.geometry
    known = True  # the geometry is the model's as the step finds it (not after a prune that chooses by scores)
    for i, step in enumerate(ctx.recipe.steps):
        where = f"{ctx.recipe.where(f'steps.{i}')}: steps.{i}"
        try:
            if step["step"] == "convert_mla":  # (pruned KV heads are known only when prune runs: its check then)
                latent_target(ctx.lm, build_request(ctx.recipe, step), geometry)
            if step["step"] == "prune" and step.get("heads") is None:
                check_target(prune_target(build_request(ctx.recipe, step), geometry), geometry)
                known = False
            elif step["step"] == "prune" and known:  # the listed heads, as the step will check them
                req = build_request(ctx.recipe, step)
                unit = resolve_unit(req.unit, geometry, req.compensate, req.scope)
                chosen = selection_from_removed(parse_heads(req.heads, geometry), geometry, req.min_heads_per_layer,
                                                unit)
                geometry = chosen.geometry(geometry)
            if step["step"] == "convert_gqa":
                check_kv(ctx.lm.adapter, geometry, int(step["kv_heads"]))
                geometry = merged_geometry(geometry, int(step["kv_heads"]))
        except UsageError as e:
            problems.append(f"{where}: {e}")
    raise_problems(ctx.recipe, problems)


# --------------------------------------------------------------------------- steps
def step_score(ctx: Context, step: dict) -> dict[str, Any]:
    req = build_request(ctx.recipe, step)
    run = score_loaded(ctx.lm, req, ctx.text_model)
    ctx.scores = run.result
    if req.output and not ctx.dry_run:  # written once every step has run: a later refusal leaves nothing
        ctx.documents.append((build_document(ctx.lm, run.result, run.batches_info), req.output))
    out = {"method": run.result.estimator, "objective": run.objective, "baseline_loss": run.result.baseline_loss,
           "heads": sum(g.num_heads for g in ctx.lm.geometry)}
    if run.batches_info:
        out["data"] = run.batches_info.get("source")
    return out


def step_prune(ctx: Context, step: dict) -> dict[str, Any]:
    req = build_request(ctx.recipe, step)
    earlier = ctx.scores if "method" not in step and "scores" not in step else None
    done = prune_loaded(ctx.lm, req, calib_device=ctx.calib_device, scores=earlier, text_model=ctx.text_model)
    result = done.result
    ctx.scores = None  # scores refer to the heads before pruning
    ctx.keep(result.selection.kept)
    out = {"heads_removed": result.summary()["heads_removed"]}
    if result.allocation:
        out["normalize"] = result.allocation["normalize"]
    # the heads were scored now with a data method (an objective), on this text (the data column was empty)
    scored_on = done.score_info.get("data") if done.score_info.get("objective") else None
    if done.score_info.get("from") == "data" and scored_on:
        out["data"] = scored_on["source"]
    if result.compensation:
        out["refits_kept"] = sum(bool(c["kept"]) for c in result.compensation)
        out["data"] = done.data.source
    if result.eval_after:
        out["loss_before"], out["loss_after"] = result.eval_before["loss"], result.eval_after["loss"]
    return out


def step_convert(ctx: Context, step: dict) -> dict[str, Any]:
    req = build_request(ctx.recipe, step)
    done = convert_loaded(ctx.lm, req, calib_device=ctx.calib_device, text_model=ctx.text_model)
    ctx.lm.model = done.best.model
    ctx.scores = None  # scores name the heads before the merge (reordered when grouped by similarity)
    ctx.meta["kv_groups"] = [[ctx.recipe_heads(i, g) for g in p.groups] for i, p in enumerate(done.best.plans)]
    ctx.keep([p.order for p in done.best.plans])
    out: dict[str, Any] = {"merge": done.best.method,
                           "heldout_loss": {r["method"]: r.get("heldout_loss") for r in done.results}}
    gaps = {r["method"]: {"difference": r["difference"], "standard_error": r["standard_error"]}
            for r in done.results if "standard_error" in r}
    if gaps:  # the other methods' held-out loss above the kept one's, paired over the same blocks
        out["heldout_gap"] = gaps
    if done.chosen_on == "eval_data":  # no held-out blocks: the step's eval blocks chose the merge (warned)
        out["merge_chosen_on"] = "eval_data"
    if done.calibration is not None:
        out["data"] = done.calibration.info.get("source")
    if done.eval_before:
        chosen = next(r for r in done.results if r["method"] == done.best.method)
        out["loss_before"], out["loss_after"] = done.eval_before["loss"], chosen["eval"]["loss"]
    return out


def step_convert_mla(ctx: Context, step: dict) -> dict[str, Any]:
    req = build_request(ctx.recipe, step)
    done = convert_mla_loaded(ctx.lm, req, text_model=ctx.text_model, calib_device=ctx.calib_device)
    ctx.lm.model = done.conv.model
    ctx.scores = None  # scores name the heads of the attention latent attention replaced
    s = done.summary
    ctx.meta.update({k: done.meta[k] for k in ("kv_rank", "rope_dim", "rope_slots")})
    # kv_rank and rope_dim come with every row from the model as it stands (summary_row), in one form
    out: dict[str, Any] = {"kv_cache": req.kv_cache,
                           "rank_allocation": req.rank_allocation, "data": s["calibration_data"].get("source"),
                           "calibration_blocks": s["calibration_data"]["samples"]}
    if s["heldout_data"]:
        out["heldout_data"] = s["heldout_data"].get("source")
    if s["refit"]:
        out["refits_kept"] = sum(bool(r["kept"]) for r in s["refit"])
    if s["eval_before"]:
        out["loss_before"], out["loss_after"] = s["eval_before"]["loss"], s["eval_after"]["loss"]
        out["eval_data"] = s["eval_data"].get("source")
    return out


def _after_the_calibration(ctx: Context, step: dict, req: Any) -> Any:
    """An eval step that does not say where its blocks start begins after the blocks of its source (one
    source or a mixture, `auto` as it resolves) that earlier steps calibrated, refitted or trained on, or
    that the recipe's model was fitted on: the cut `headtool eval` makes on the output's record
    (data_plan.evaluation_cut), since a figure measured on them flatters."""
    if "skip_samples" in (step_data(ctx.recipe, step) or {}):
        return req
    objective = resolve_objective(req.objective, ctx.lm.task, req.data.label_column)
    d = resolve_auto(req.data, ctx.lm.tokenizer, ctx.text_model, DATA_TASK[objective])
    cut = evaluation_cut(d, {"recipe": written_record(ctx.reads, ctx.lm.path)})
    n = cut.spec.skip_samples
    if n:
        info(f"eval on {d.source}: from block {n} on (the model was fitted on the {n} before it)")
    if cut.other_cut:
        warn(f"eval on {d.source}: earlier steps read it with another seq_len or seed, so its blocks may "
             "overlap theirs; give the eval step skip_samples")
    return dataclasses.replace(req, data=cut.spec)


def step_eval(ctx: Context, step: dict) -> dict[str, Any]:
    req = _after_the_calibration(ctx, step, build_request(ctx.recipe, step))
    res = eval_loaded(ctx.lm, req, ctx.original, ctx.text_model)
    before, after = res["before"], res["after"]
    out = {"loss": after["loss"], "tokens": after["tokens"], "data": req.data.source,
           # as `headtool eval` marks it: text of a source an earlier step (or the recipe's model) was fitted on
           "in_domain": fitted_on(written_record(ctx.reads, ctx.lm.path),
                                  {"source": req.data.source, **file_identity(req.data.source),
                                   "mixture": [{"source": p.source, **file_identity(p.source)}
                                               for p in parse_sources(req.data.source)]})}
    if req.data.skip_samples:
        out["skip_samples"] = req.data.skip_samples
    if "perplexity" in after:
        out["perplexity"] = after["perplexity"]
    if before:
        out["loss_before"] = before["loss"]
        if "perplexity" in before:
            out["perplexity_before"] = before["perplexity"]
    if "loss_delta_se" in res:
        out["loss_delta_se"] = res["loss_delta_se"]
    return out


def step_heal(ctx: Context, step: dict) -> dict[str, Any]:
    req = build_request(ctx.recipe, step)
    res = heal_loaded(ctx.lm, ctx.text_model, req)
    doc = res.to_json()
    out: dict[str, Any] = {"steps": doc["steps"], "best_step": doc["best_step"], "best_by": doc["best_by"],
                           "data": doc.get("data_source", req.data.source)}
    # the held-out figures before and after (the step's kept weights), as heal's own summary shows them
    for when, e in (("before", doc.get("before")), ("after", doc.get("after"))):
        if e:
            out[f"distill_{when}"] = e["distill"]
            if "loss" in e:
                out[f"loss_{when}"] = e["loss"]
                out["perplexity_before" if when == "before" else "perplexity"] = e["perplexity"]
    return out


STEPS = {"score": step_score, "prune": step_prune, "convert_gqa": step_convert, "convert_mla": step_convert_mla,
         "eval": step_eval, "heal": step_heal}


def _samples_itself(recipe: Recipe, lm: LoadedModel) -> bool:
    """Does any step read `self` (text sampled from the original model), written out or as what
    `auto` (a calibrating step's default) means for this model?"""
    sources = []
    for s in recipe.steps:
        cls = STEP_REQUESTS[s["step"]][0]
        sources.append((step_data(recipe, s) or {}).get("source", default_source(cls)))
        for key in ("eval_data", "heldout_data"):
            sources.append(s[key].get("source") if isinstance(s.get(key), dict) else s.get(key))
    sampling = any(is_auto(src) for src in sources) and can_sample(lm, lm.tokenizer)
    return sampling or any(isinstance(src, str) and not is_auto(src)
                           and any(self_source(p.source)[0] for p in parse_sources(src)) for src in sources)


def summary_row(step: str, figures: dict, info: dict, seconds: float) -> dict[str, Any]:
    return {"step": step, "heads": info["total_heads"], "kv_heads": info["total_kv_heads"],
            "params": info["params"], "kv_cache_bytes_per_token": info["kv_cache_bytes_per_token"],
            "seconds": round(seconds, 2),
            **({"kv_rank": info["kv_rank"], "rope_dim": info["rope_dim"]} if "kv_rank" in info else {}), **figures}


def validate_whole(recipe: Recipe, *, output: str | None = None, dry_run: bool = False,
                   json_stdout: bool = False) -> None:
    """The recipe's keys and step order (recipe_schema.validate), then each step's request as its
    command checks it; an output where steps rewrite the weights (unless `dry_run`) listed with either.
    json_stdout: the run's summary goes to stdout (`run --json`), which a score document may not share."""
    nowhere = [] if dry_run else output_problems(recipe, output)
    validate(recipe, more=nowhere)
    documents = [] if dry_run else document_problems(recipe, output) + (
        stdout_problems(recipe) if json_stdout else [])
    raise_problems(recipe, request_problems(recipe) + nowhere + documents)
    for line in unused_score_problems(recipe, at_end=True):
        warn(line)


def stdout_problems(recipe: Recipe) -> list[str]:
    """A score step writing its document to stdout (`output: "-"`) beside `run --json`'s summary would
    make stdout two JSON documents that no reader parses."""
    return [f"{recipe.where(f'steps.{i}.output')}: steps.{i}.output: '-' writes the score document to stdout, "
            "where --json writes the run's summary: give the step a file, or leave out --json"
            for i, step in enumerate(recipe.steps) if step["step"] == "score" and step.get("output") == "-"]


def document_problems(recipe: Recipe, output: str | None = None) -> list[str]:
    """A score step's document follows the rules of `headtool score -o` (io.files.check_output_path): never
    inside an input model folder nor over a file the run reads (the model, every step's data, the recipe),
    in a folder that exists; found before the model loads, not when the scoring is done. Nor inside the
    run's output folder (`output`: -o, else the recipe's), which the final model replaces: the document was
    deleted with an --overwrite, or made the folder one that is not a model's, refused after every step."""
    from ..io.files import check_output_path, inside

    folder = output or recipe.values.get("output")
    folder = Path(os.path.expanduser(folder)).resolve() if isinstance(folder, str) and folder.strip() else None

    inputs = [recipe.values.get("model"), recipe.path]
    for step in recipe.steps:
        try:
            req = build_request(recipe, step)
        except UsageError:
            continue  # (listed by request_problems)
        for spec in (req.data, getattr(req, "eval_data", None), getattr(req, "heldout_data", None)):
            source = spec.source if isinstance(spec, DataSpec) else spec
            if isinstance(source, str):
                inputs += [part.source for part in parse_sources(source)]
    problems = []
    written: dict[Path, int] = {}  # each document's file -> the step that writes it
    for i, step in enumerate(recipe.steps):
        out = step.get("output") if step["step"] == "score" else None
        if isinstance(out, str) and out != "-":
            where = f"{recipe.where(f'steps.{i}.output')}: steps.{i}.output"
            real = Path(os.path.expanduser(out)).resolve()
            if real in written:  # the later document replaced the earlier one, after it was computed
                problems.append(f"{where}: {out}: steps.{written[real]} writes its document there too, and this "
                                "one would replace it; give each score step its own file")
                continue
            written[real] = i
            if folder is not None and inside(real, folder):
                problems.append(f"{where}: {out}: lies inside the recipe's output folder {folder}, which the final "
                                "model replaces; write the document elsewhere")
                continue
            try:
                check_output_path(out, "output", inputs)
            except UsageError as e:
                problems.append(f"{where}: {str(e).removeprefix('output ')}")
    return problems


def request_problems(recipe: Recipe) -> list[str]:
    """Each step's request checked as its command checks it (`validate()`: combinations of options a
    schema of single keys cannot see), before the model loads."""
    problems = []
    for i, step in enumerate(recipe.steps):
        try:
            req = build_request(recipe, step)
            req.validate()
        except UsageError as e:
            problems.append(f"{recipe.where(f'steps.{i}')}: steps.{i} ({step['step']}): {e}")
            continue
        if step["step"] == "convert_gqa" and "data" in step and not req.reads_data:
            # as `headtool convert-gqa` refuses its data options here (the recipe's own data block is shared)
            why = reads_no_data(recipe=True, remedy="leave the step's data block out")
            problems.append(f"{recipe.where(f'steps.{i}.data')}: steps.{i}.data: {why}")
        problems += _unread_keys(recipe, i, step)
    return problems


def _unread_keys(recipe: Recipe, i: int, step: dict[str, Any]) -> list[str]:
    """A step's own data block (or key) that nothing in the step reads, at its location: a prune that
    removes listed heads without a refit, a score step with method magnitude (or random, which reads only
    seed). The recipe's top-level data block, which other steps share, is not the step's own."""
    where = f"{recipe.where(f'steps.{i}.data')}: steps.{i}.data"
    if step["step"] == "prune" and step.get("heads") is not None and not step.get("compensate") \
            and "data" in step and step.get("eval_data") is None:
        return [f"{where}: a prune that removes the heads its heads: lists reads no data without compensate "
                "(add compensate: true to refit on it, or leave the step's data block out)"]
    if step["step"] == "score" and step.get("method") in ("magnitude", "random"):
        reads = {"seed"} if step["method"] == "random" else set()
        keys = [k for k in (step.get("data") or {}) if k not in reads] if isinstance(step.get("data"), dict) else []
        what = "no data" if step["method"] == "magnitude" else "only seed"
        out = [f"{where}: {', '.join(keys)}: method {step['method']} reads {what} (leave "
               f"{'them' if len(keys) > 1 else 'it'} out, or use a data-driven method)"] if keys else []
        if "objective" in step:
            out.append(f"{recipe.where(f'steps.{i}.objective')}: steps.{i}.objective: method {step['method']} "
                       "has no objective (it reads no loss): leave it out")
        return out
    return []


def run_recipe(recipe: Recipe, *, output: str | None = None, overwrite: bool | None = None,
               on_step=None, dry_run: bool = False, json_stdout: bool = False) -> dict[str, Any]:
    """Validate `recipe` whole, then run its steps; returns the summary (and writes the output,
    unless `dry_run`: then nothing is written). json_stdout: the caller prints the summary on stdout."""
    validate_whole(recipe, output=output, dry_run=dry_run, json_stdout=json_stdout)
    v = recipe.values
    out = None if dry_run else output or v.get("output")
    ow = bool(v.get("overwrite")) if overwrite is None else overwrite
    load, calib_device = sequential_placement(
        LoadOptions(**{o.name: v[o.name] for o in options_of(LoadOptions) if v.get(o.name) is not None}),
        bool(v.get("sequential")))
    rewrites = rewriting_steps(recipe)
    lm = load_model(v["model"], rewrites=f"the recipe ({', '.join(rewrites)})" if rewrites else None, **load.kwargs())
    ctx = Context(recipe, lm, calib_device=calib_device, dry_run=dry_run,
                  num_heads_before=[g.num_heads for g in lm.geometry])
    check_geometry(ctx)
    offloaded = has_offloaded_weights(lm.model)
    if rewrites or out:  # before any step runs, not in the middle of the recipe
        require_resident_weights(lm.model, f"{v['model']}: the recipe ({', '.join(rewrites) or 'its output'})",
                                 "use sequential: true (one layer at a time on the device) instead")
    if out:
        check_output_target(out, lm.path, ow)
    if lm.tokenizer is None and any(s["step"] != "score" or s.get("method") not in ("magnitude", "random")
                                    for s in recipe.steps):
        raise UsageError(f"{v['model']}: no tokenizer files beside the model; recipe steps need data")
    source_fingerprint = lm.fingerprint
    if (any(s["step"] in ("eval", "heal") for s in recipe.steps) or _samples_itself(recipe, lm)) and not offloaded:
        ctx.original = copy.deepcopy(lm.model)  # (offloaded: only score/eval steps, the model stays unchanged)
    rows = [summary_row("load", {}, model_info(lm.model, lm.adapter), 0.0)]
    for i, step in enumerate(recipe.steps):
        t0 = time.perf_counter()
        try:
            with blocks_read() as seen, (evaluation_reads() if step["step"] == "eval" else nullcontext()):
                figures = STEPS[step["step"]](ctx, step)
        except HeadtoolError as e:  # which step of the recipe refused, where it is (a recipe may prune twice)
            if type(e) not in (UsageError, HeadtoolError):
                raise
            raise type(e)(f"{recipe.where(f'steps.{i}')}: steps.{i} ({step['step']}): {e}") from e
        ctx.reads += seen
        row = summary_row(step["step"], figures, model_info(ctx.lm.model, ctx.lm.adapter), time.perf_counter() - t0)
        rows.append(row)
        if on_step:
            on_step(i, row)
    as_run = resolved(recipe, output, overwrite)
    result: dict[str, Any] = {"recipe": as_run, "steps": rows, "output": None, "dry_run": dry_run}
    if out:
        meta = {"operation": "recipe", "recipe": as_run, "steps": rows,
                "source_fingerprint": source_fingerprint,
                "num_heads": [g.num_heads for g in ctx.lm.geometry],
                "num_kv_heads": [g.num_kv_heads for g in ctx.lm.geometry], **ctx.meta,
                **original_heads(lm.path, ctx.meta.get("kept_heads"), ctx.num_heads_before),
                RECORD: written_record(ctx.reads, lm.path)}
        card = "Recipe:\n\n```yaml\n" + yaml.safe_dump(as_run, sort_keys=False) + "```\n"
        result["output"] = write_output(out, model=ctx.lm.model, tokenizer=lm.tokenizer, source=lm, meta=meta,
                                        card_table=card, overwrite=ow, shard_size=v.get("shard_size", "5GB"))
    for doc, path in ctx.documents:  # (after the model: a run that fails writes neither)
        write_document(doc, path)
    return result
