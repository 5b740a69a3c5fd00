"""`headtool prune`: remove attention heads physically (chosen from scores, scored now on --data,
or listed) and write a checkpoint that reloads; optionally refit the output projections."""
from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass, replace
from typing import Any, Iterable, Sequence

from ..console import info
from ..data.batches import blocks_read, evaluation_reads, make_batches, resolve_auto
from ..data.selfgen import can_sample
from ..data.sources import DataSpec, is_auto, reads_stdin, self_source
from ..errors import UsageError
from ..io.output import check_output_target, output_kind, write_output
from ..io.provenance import RECORD, fitted_on, original_heads, read_entries, written_record
from ..io.sizes import parse_size
from ..measure.evaluation import evaluate, paired_difference, record_gaps
from ..measure.objectives import DATA_TASK, resolve_objective
from ..measure.scores_doc import read_scores
from ..measure.scoring import DATA_METHODS, ScoreResult, carries_probe, normalize_scores, score_heads
from ..model.loading import LoadedModel, cast_dtype, load_model
from ..model.info import model_info
from ..model.latent import refuse_latent_surgery
from ..model.placement import require_resident_weights, sequential_placement
from ..arch import LayerHeads
from ..surgery.pruning import PRUNE_INSTEAD, PruneResult, markdown_table, normalization_label, prune, trial_copy
from ..surgery.selection import (
    Selection,
    Target,
    check_target,
    parse_heads,
    parse_protect,
    resolve_unit,
    select_heads,
    selection_from_removed,
)
from ..surgery.compensation import anchor_candidates
from ..surgery.obs_allocation import LayerSensitivity, SensitivityProbe, obs_selection
from ..surgery.streaming import CheckpointRef, open_checkpoint, stream_prune
from .data_plan import allocation_spec, eval_spec, heldout_spec, with_default_blocks
from .requests import NORMALIZATIONS, PruneRequest, parse_anchor


@dataclass
class PruneRun:
    """An in-memory prune (its result, what was written and the `--json` report), or what a
    streamed one wrote."""

    result: PruneResult | None = None
    target: Target | None = None  # None for explicit --heads
    config_kind: str | None = None
    eval_info: dict | None = None
    written: dict | None = None
    report: dict[str, Any] | None = None
    streamed: dict | None = None


def run_prune(req: PruneRequest) -> PruneRun:
    """Check, load, choose the heads, prune (and refit), write; nothing is written on --dry-run."""
    given = [n for n, v in (("--scores", req.scores), ("--heads", req.heads)) if v is not None]
    if len(given) > 1:
        raise UsageError("give either --scores or --heads, not both")
    if not given and req.data is None:
        raise UsageError("say which heads to remove: --scores FILE|-, --heads LIST, or --data D to score now")
    if req.heads is not None and any(v is not None for v in (req.fraction, req.num_heads, req.threshold)):
        raise UsageError("--heads lists the heads to remove; it takes no --fraction/--num-heads/--threshold")
    if req.scores == "-" and any(reads_stdin(d) for d in (req.data, req.eval_data, req.heldout_data)):
        raise UsageError("--scores - and --data - (or --eval-data / --heldout-data -) both read stdin, which "
                         "holds one of them: give the other as a file")
    if req.compensate and req.data is None:
        raise UsageError("--compensate needs calibration data: pass --data")
    if not req.dry_run and not req.output:
        raise UsageError("give an output folder with -o OUT (or --dry-run)")
    req.validate()
    parse_size(req.shard_size)
    if req.streaming:
        if not given or req.compensate or req.eval_data or req.dry_run:
            raise UsageError("--streaming needs no forward pass: give --scores or --heads, and no "
                             "--compensate, --eval-data or --dry-run")
        if req.normalize != "auto":
            raise UsageError("--streaming takes the scores as they were scored: leave out --normalize (or score "
                             "with `headtool score --normalize`)")
        return _run_streaming(req)
    load, calib_device = sequential_placement(req.load, req.sequential)
    lm = load_model(req.model, rewrites=None if req.dry_run else "prune", **load.kwargs())
    refuse_latent_surgery(lm.config, req.model, "prune")  # a dry run plans what it could not do
    if not req.dry_run:
        require_resident_weights(lm.model, "prune", PRUNE_INSTEAD)
    lm.fingerprint  # of the input, before anything changes (headtool.json records it)
    if not req.dry_run:
        check_output_target(req.output, lm.path, req.overwrite)
    with blocks_read() as seen:
        done = prune_loaded(lm, req, calib_device=calib_device)
    result, target, score_info, eval_info = done.result, done.target, done.score_info, done.eval_info
    spec = done.data
    kind = output_kind(lm.model)
    summary = result.summary()
    meta = prune_meta(req, result, target, score_info, seen=seen, source_path=lm.path,
                      calibration=calib_info(lm, spec) if req.compensate else None, dtype=load.dtype)
    if eval_info:
        eval_info["in_domain"] = fitted_on(meta[RECORD], eval_info)
    written = None
    if not req.dry_run:
        written = write_output(req.output, model=lm.model, tokenizer=lm.tokenizer, source=lm, meta=meta,
                               card_table=markdown_table(result), overwrite=req.overwrite,
                               shard_size=req.shard_size)
        kind = written["config_kind"]
    report = {"model": req.model, "output": written, "dry_run": req.dry_run, "config_kind": kind,
              "source": {"ref": lm.ref, "path": lm.path, "fingerprint": lm.fingerprint},
              **{k: v for k, v in meta.items() if k not in ("summary",)}, **summary,
              "eval_data": eval_info}
    return PruneRun(result=result, target=target, config_kind=kind, eval_info=eval_info, written=written,
                    report=report)


def prune_meta(req: PruneRequest, result: PruneResult, target: Target | None, score_info: dict, *,
               seen: Iterable[dict], source_path: str | None, calibration: dict | None, dtype: str,
               streaming: bool = False) -> dict[str, Any]:
    """headtool.json of a prune, in memory or streamed: one builder, so that the two cannot drift apart
    (a streamed copy once lost the input's `data_read`, and `eval` scored it on its own fitting blocks)."""
    options = {"target": target.describe() if target else None, "heads": req.heads, "compensate": req.compensate,
               "normalize": result.allocation["normalize"] if result.allocation else None,
               "choose_in_layer": result.choice, "refit_layers": req.refit_layers if req.compensate else None,
               "damping": req.damping if req.compensate else None, "heldout_samples": req.heldout_samples,
               "anchor": req.anchor if req.compensate else None,
               "anchor_power": result.anchor_power,
               "heldout_data": (req.heldout_data if isinstance(req.heldout_data, (str, type(None)))
                                else req.heldout_data.source) if req.compensate else None,
               "calibration_data": calibration, "dtype": dtype}
    from_doc = score_info.get("from") != "data" and score_info.get("data")  # a score document's reads
    return {"operation": "prune", "method": score_info.get("method", "explicit" if req.heads is not None else None),
            "streaming": streaming, "scores": score_info or None, "options": options,
            "kept_heads": [list(k) for k in result.selection.kept],
            **original_heads(source_path, result.selection.kept, [g.num_heads for g in result.geometry_before]),
            "num_kv_heads": [g.num_kv_heads for g in result.geometry_after],
            "num_heads": [g.num_heads for g in result.geometry_after], "summary": result.summary(),
            RECORD: written_record(seen, source_path, read_entries([score_info["data"]]) if from_doc else [])}


def _run_streaming(req: PruneRequest) -> PruneRun:
    """`prune --streaming`: the heads from --heads or a score document, removed shard by shard; its
    headtool.json and model card from the in-memory path's builders (`prune_meta`, `markdown_table`)."""
    ck = open_checkpoint(req.model, req.load.trust_remote_code, cast_dtype(req.load.dtype))
    refuse_latent_surgery(ck.config, req.model, "prune")
    check_output_target(req.output, ck.path, req.overwrite)
    selection, target, score_info, unit = _streaming_selection(ck, req)
    t0 = time.perf_counter()

    @functools.cache  # one for the record and the card: built once, the same timing in both
    def result(after) -> PruneResult:
        return PruneResult(selection, ck.geometry, list(ck.adapter.geometry(after.config)),
                           model_info(ck.model, ck.adapter), model_info(after, ck.adapter),
                           elapsed_s=time.perf_counter() - t0)

    def meta(after) -> dict[str, Any]:
        return prune_meta(req, result(after), target, score_info, seen=[], source_path=ck.path, calibration=None,
                          dtype=req.load.dtype, streaming=True)

    kept = [list(k) for k in selection.kept]
    written = stream_prune(ck, kept, req.output, meta=meta, overwrite=req.overwrite, shard_size=req.shard_size,
                           uneven=unit == "head",
                           card_table=lambda after, kind: markdown_table(result(after)))
    return PruneRun(streamed={**written, "kept_heads": kept})


def _streaming_selection(ck: CheckpointRef, req: PruneRequest) -> tuple[Selection, Target | None, dict, str]:
    """The heads a streamed prune keeps, chosen as prune_loaded chooses them without a refit: (selection,
    target or None for --heads, where the scores came from, the unit)."""
    geometry = ck.geometry
    if req.heads is not None:
        unit = resolve_unit(req.unit, geometry, req.compensate, req.scope)
        return selection_from_removed(parse_heads(req.heads, geometry), geometry, req.min_heads_per_layer,
                                      unit), None, {}, unit
    target = prune_target(req, geometry)  # resolves --protect-layers auto and --unit auto on the checkpoint
    check_target(target, geometry)
    scored, score_info = _scores(ck, req.scores, None, req.method, req.objective, ck)
    return select_heads(scored.scores, geometry, target), target, score_info, target.unit


@dataclass
class Pruned:
    """What prune_loaded did: the result, the target (None for explicit heads), where the scores
    came from, the evaluation data and the calibration spec it used."""

    result: PruneResult
    target: Target | None
    score_info: dict
    eval_info: dict | None
    data: DataSpec | None


def prune_loaded(lm: LoadedModel, req: PruneRequest, *, calib_device=None,
                 scores: ScoreResult | list[list[float]] | None = None,
                 text_model: LoadedModel | None = None) -> Pruned:
    """Choose the heads (listed, from `scores`, from req.scores or by scoring now on req.data),
    prune them (refitting with req.compensate); `headtool prune` and recipe steps. lm.model is the
    pruned model afterwards: pruned in place, or, when normalizations are compared, the winning
    candidate (the others were pruned on copies). `scores`: an earlier score step's result (a bare
    matrix cannot be renormalized). text_model: the model `--data self` samples from (default lm;
    a recipe passes the original)."""
    tm = text_model or lm
    geometry = lm.geometry
    # listed heads are removed as listed: the refit does not choose others in their layers (`auto` is refit
    # with --compensate, for heads chosen from scores; validate refuses an explicit refit with --heads)
    listed = req.heads is not None and req.choose_in_layer == "auto"
    req = replace(req, unit=resolve_unit(req.unit, geometry, req.compensate, req.scope),
                  choose_in_layer="scores" if listed else req.choose_in_layer)
    spec = with_default_blocks(req.data, req.default_blocks)
    if spec is not None and is_auto(spec.source) and not _reads_data(req, scores):
        spec = None  # the default data, and nothing in this prune reads it
    target = None
    if req.heads is not None:
        selection = selection_from_removed(parse_heads(req.heads, geometry), geometry, req.min_heads_per_layer,
                                           req.unit)
    else:
        target = prune_target(req, geometry)
        check_target(target, geometry)
    needs_tokens = spec is not None or req.eval_data is not None
    if needs_tokens and lm.tokenizer is None:
        raise UsageError(f"{req.model}: no tokenizer files beside the model; --data / --eval-data need them")
    spec = resolve_auto(spec, lm.tokenizer, tm, "plain")
    score_info: dict = {}
    candidates: dict[str, Selection] = {}
    obs = sensitivity = None
    if target is not None:
        if isinstance(scores, ScoreResult):
            scored, score_info = Scored.of(scores), {"from": "an earlier score step"}
        elif scores is not None:
            scored, score_info = Scored(scores), {"from": "an earlier score step"}
        else:
            probe = _sensitivity_probe(lm, req, spec)
            scored, score_info = _scores(lm, req.scores, spec, req.method, req.objective, tm, probe,
                                         seed=(req.data or DataSpec()).seed)
            sensitivity = probe.result() if probe is not None else None
        modes = normalizations(req, scored, spec, lm.task)
        if modes and "obs" in modes:
            obs = _obs_candidate(lm, req, scored, target, spec, tm, sensitivity)
        candidates = {m: obs.selection if m == "obs" else select_heads(scored.matrix(m), geometry, target)
                      for m in modes or [None]}
        selection = next(iter(candidates.values()))
    compared = len({c.kept for c in candidates.values()}) > 1
    data = _data(lm, spec, req, tm, compared)

    def run(trial: LoadedModel, chosen: Selection, evaluation=data.eval_batches) -> PruneResult:
        return prune(trial, chosen, unit=req.unit, calib_batches=data.calib, heldout_batches=data.heldout,
                     compensate=req.compensate, choose_in_layer=req.choose_in_layer, refit_layers=req.refit_layers,
                     damping=req.damping, anchor=parse_anchor(req.anchor), anchor_power=req.anchor_power,
                     eval_batches=evaluation,
                     objective=data.eval_objective, calib_device=calib_device)

    if compared:
        cspec = data.compare_spec
        compared_on = {"source": cspec.source, "skip_samples": cspec.skip_samples, "seed": cspec.seed}
        result = _best_allocation(lm, candidates, run, data.compare_batches, data.eval_batches,
                                  resolve_objective(req.objective, lm.task, None), compared_on,
                                  req.allocation_margin)
    else:
        result = run(lm, selection)
        if candidates and next(iter(candidates)) is not None:
            result.allocation = {"normalize": next(iter(candidates)), "candidates": [
                {"normalize": m, "removed_per_layer": _per_layer(c, geometry)} for m, c in candidates.items()]}
    if obs is not None:
        result.allocation["obs"] = obs.record()
    return Pruned(result, target, score_info, data.eval_info, spec)


def _obs_candidate(lm: LoadedModel, req: PruneRequest, scored: Scored, target: Target, spec: DataSpec, tm,
                   sensitivity: LayerSensitivity | None = None):
    """The `--normalize obs` allocation: as many heads as the scores' selection removes, split over the
    layers by what the refit cannot repair (surgery/obs_allocation.py), on the calibration blocks
    (`sensitivity`: measured on them while scoring, else a pass of its own)."""
    objective = resolve_objective(req.objective, lm.task, None)
    total = select_heads(scored.scores, lm.geometry, target).num_removed(lm.geometry)
    batches = None if sensitivity is not None else \
        make_batches(spec, lm.tokenizer, DATA_TASK[objective], model=tm).batches
    anchors = [a for a in anchor_candidates(parse_anchor(req.anchor)) if not math.isinf(a)]
    return obs_selection(lm.model, lm.adapter, lm.geometry, scored.scores, target, total, batches, objective,
                         damping=req.damping, anchor=min(anchors) if anchors else math.inf,
                         sensitivity=sensitivity)


def _sensitivity_probe(lm: LoadedModel, req: PruneRequest, spec: DataSpec | None) -> SensitivityProbe | None:
    """A probe for --normalize obs's layer sensitivity to ride on the scoring pass, where this prune scores
    now and will allocate by obs on the same blocks with the same loss: the allocation's own forward and
    backward pass is then saved (about a third of a default prune's time on SmolLM2). None elsewhere:
    scores from a document, another method or objective, several processes."""
    if spec is None or req.scores is not None or not _plans_obs(req):
        return None
    objective = resolve_objective(req.objective, lm.task, None)  # the loss obs weighs
    if resolve_objective(req.objective, lm.task, spec.label_column) != objective \
            or not carries_probe(req.method, objective):
        return None
    return SensitivityProbe(lm.model, lm.adapter)


def _plans_obs(req: PruneRequest) -> bool:
    """Whether `normalizations` will include obs (decided before the scores exist: auto means obs
    whatever the scores are, where it means obs at all)."""
    modes = [m.strip() for m in req.normalize.split(",") if m.strip()]
    return req.auto_is_obs if modes == ["auto"] else "obs" in modes


@dataclass(frozen=True)
class Scored:
    """The scores selection reads, and what renormalizing them needs (raw scores, their method;
    iterative scores follow their removal order and are used as they are)."""

    scores: list[list[float]]
    raw: list[list[float]] | None = None
    normalize: str | None = None
    method: str | None = None
    iterative: bool = False

    @classmethod
    def of(cls, result: ScoreResult) -> Scored:
        return cls(result.scores, result.raw_scores, result.normalize, result.method, bool(result.removal_order))

    def matrix(self, mode: str | None) -> list[list[float]]:
        return self.scores if mode is None or mode == self.normalize else normalize_scores(self.raw, mode)


def normalizations(req: PruneRequest, scored: Scored, spec: DataSpec | None, task: str) -> list[str] | None:
    """The score normalizations to prune with and compare (None: the scores as they are)."""
    modes = [m.strip() for m in req.normalize.split(",") if m.strip()]
    if not modes or any(m not in NORMALIZATIONS for m in modes) or ("auto" in modes and len(modes) > 1):
        raise UsageError(f"--normalize {req.normalize!r}: use auto, or one or more of layer, geometric, none "
                         "separated by commas")
    objective = resolve_objective(req.objective, task, None)
    if modes == ["auto"]:
        modes = _auto_normalizations(req, scored, spec, objective)
        if req.allocation_margin and (modes is None or len(modes) < 2):
            raise UsageError(f"--allocation-margin weighs a comparison of normalizations; --normalize auto is "
                             f"{','.join(modes or ['as scored'])} here: give --normalize with several modes")
        return modes
    modes = list(dict.fromkeys(modes))
    if objective not in ("lm", "mlm") and "obs" in modes:
        raise UsageError(f"--normalize obs weighs errors by the loss's gradient (objective {objective} has no loss "
                         "here)")
    if scored.raw is None and modes != ["obs"]:
        raise UsageError("--normalize needs raw scores (a document from `headtool score`, or scoring now); these "
                         "scores have none")
    if scored.iterative and modes != ["obs"]:
        raise UsageError("iterative scores follow the order in which heads fell; --normalize does not apply to them")
    if len(modes) > 1:
        if spec is None or spec.max_samples is None:
            raise UsageError("comparing normalizations needs held-out blocks of --data: pass --data with "
                             "--max-samples")
        if objective not in ("lm", "mlm"):
            raise UsageError(f"comparing normalizations needs a loss on held-out text (objective {objective} has "
                             "none here): give one --normalize")
    return modes


def _auto_normalizations(req: PruneRequest, scored: Scored, spec: DataSpec | None, objective: str) -> list[str] | None:
    """What --normalize auto means for this prune. With --compensate: obs, the split by what the refit
    cannot repair, which held up best on text the calibration never saw (at 25% and 50% of SmolLM2-135M's
    heads over ten calibration samples: README, Results); where obs cannot run (no refit, a threshold,
    --scope layer) layer,none compared on held-out blocks for loss-based scores. Else the scores as
    scored."""
    if not req.compensate or spec is None or objective not in ("lm", "mlm") or req.threshold is not None:
        return None
    if req.auto_is_obs:
        return ["obs"]
    comparable = (scored.raw is not None and not scored.iterative and scored.method in DATA_METHODS
                  and spec.max_samples is not None)
    return ["layer", "none"] if comparable else None


def _per_layer(selection: Selection, geometry) -> list[int]:
    return [len(r) for r in selection.removed(geometry)]


def _best_allocation(lm: LoadedModel, candidates: dict[str, Selection], run, held: Sequence[dict],
                     eval_batches, objective: str, compared_on: dict, margin: float = 0.0) -> PruneResult:
    """Prune with every candidate selection and keep the first unless a later one does better on the
    held-out blocks: a lower loss than the one kept so far, by more than `margin` standard errors of
    their paired (same-block) difference (0: the lowest loss, the first on a tie). The earlier
    candidates run on copies that share all but the attention (`trial_copy`), the last in place;
    lm.model is the winner afterwards. Every other candidate records how much higher its loss was than
    the kept one's, with the standard error of that difference: a clear choice or a close call."""
    geometry = lm.geometry
    eval_before = evaluate(lm.model, eval_batches, objective, label="eval") if eval_batches else None
    rows: list[dict] = []
    verdicts: dict[str, dict] = {}
    kept: tuple[str, PruneResult, Any] | None = None  # mode, its result, its model
    groups: dict[tuple, list[str]] = {}
    for mode, sel in candidates.items():
        groups.setdefault(sel.kept, []).append(mode)
    distinct = list(groups.values())
    for i, modes in enumerate(distinct):
        trial = lm if i == len(distinct) - 1 else replace(lm, model=trial_copy(lm.model, lm.adapter))
        info(f"layer allocation: heads per layer from {' = '.join(map(normalization_label, modes))}")
        result = run(trial, candidates[modes[0]], None)
        verdict = evaluate(trial.model, held, objective, label=f"held-out {modes[0]}", per_block=True)
        verdicts.update({m: verdict for m in modes})
        rows += [{"normalize": m, "removed_per_layer": _per_layer(candidates[m], geometry),
                  "heldout_loss": verdict["loss"]} for m in modes]
        if kept is None or undercuts(verdict, verdicts[kept[0]], margin):
            kept = (modes[0], result, trial.model)
        del trial, result
    mode, result, model = kept
    record_gaps(rows, [verdicts[row["normalize"]] for row in rows], verdicts[mode])
    lm.model = model
    if eval_batches:
        result.eval_before = eval_before
        result.eval_after = evaluate(model, eval_batches, objective, label="eval")
    result.allocation = {"normalize": mode, "heldout_blocks": sum(len(b["input_ids"]) for b in held),
                         "compared_on": compared_on, "margin_standard_errors": margin, "candidates": rows}
    info(result.allocation_line())
    return result


def undercuts(verdict: dict, kept: dict, margin: float) -> bool:
    """A lower held-out loss than the kept candidate's, by more than `margin` standard errors of the
    paired difference (with no margin, any lower loss: the rule before margins existed, to the bit)."""
    if not verdict["loss"] < kept["loss"]:
        return False
    if margin == 0:
        return True
    diff, se = paired_difference(verdict["block_sums"], kept["block_sums"], verdict["block_weights"])
    return -diff > margin * se


def _reads_data(req: PruneRequest, scores: ScoreResult | list[list[float]] | None) -> bool:
    """Does this prune read --data: to refit (--compensate) or to score now with a data method?"""
    scoring_now = req.heads is None and scores is None and req.scores is None
    return req.compensate or (scoring_now and req.method in DATA_METHODS)


def prune_target(req: PruneRequest, geometry: Sequence[LayerHeads] | None = None) -> Target:
    """The target of req; `geometry`, when known, resolves --protect-layers auto and --unit auto."""
    num_layers = None if geometry is None else len(geometry)
    unit = req.unit if geometry is None else resolve_unit(req.unit, geometry, req.compensate, req.scope)
    return Target(fraction=req.fraction, num_heads=req.num_heads, threshold=req.threshold, scope=req.scope,
                  min_heads_per_layer=req.min_heads_per_layer, unit=unit,
                  protect=parse_protect(req.protect_layers, req.scope, num_layers))


def calib_info(lm, spec) -> dict | None:
    return {"source": spec.source, "max_samples": spec.max_samples, "seq_len": spec.seq_len, "seed": spec.seed} \
        if spec else None


def _scores(lm, scores: str | None, spec, method: str, objective: str, tm, probe=None, *, seed: int = 0
            ) -> tuple[Scored, dict]:
    """The score matrix (from a document, or by scoring now on --data, with `probe` riding along) and
    where it came from. seed: --seed, which --method random draws with; spec is None where no data is
    read (magnitude and random with the default data), and its seed went with it: an internal error."""
    if scores is not None:
        doc = read_scores(scores, lm)
        scored = Scored(doc["scores"], doc.get("raw_scores"), doc.get("normalize"), doc.get("method"),
                        bool(doc.get("removal_order")))
        return scored, {"from": scores, "method": doc.get("method"), "objective": doc.get("objective"),
                        "normalize": doc.get("normalize"), "data": doc.get("data")}
    resolved = None
    batches = None
    if method in DATA_METHODS:
        resolved = resolve_objective(objective, lm.task, spec.label_column)
        batches = make_batches(spec, lm.tokenizer, DATA_TASK[resolved], model=tm).batches
    result = score_heads(lm.model, lm.adapter, batches, method=method, objective=resolved, seed=seed,
                         label="score", probe=probe)
    info(f"scored with {result.estimator}" + (f" ({resolved})" if resolved else ""))
    return Scored.of(result), {"from": "data", "method": method, "estimator": result.estimator,
                               "objective": resolved, "normalize": result.normalize, "data": calib_info(lm, spec)}


@dataclass
class PruneData:
    """The batches one prune reads, cut so that none of them overlaps another."""

    calib: list | None = None  # calibration (the refit's; None without --compensate)
    heldout: list | None = None  # the refit's held-out blocks
    eval_batches: list | None = None  # --eval-data, after everything the prune fitted on
    eval_objective: str | None = None
    eval_info: dict | None = None
    compare_batches: list | None = None  # where candidate allocations are compared (with labels)
    compare_spec: DataSpec | None = None  # ... and the spec they came from


def _data(lm, spec, req: PruneRequest, tm, compare: bool = False) -> PruneData:
    """Calibration, held-out-for-refit and evaluation batches (evaluation disjoint from the others), and
    with `compare` the held-out blocks, with labels, on which candidate allocations are compared (the
    refit's held-out blocks when there are any, else `allocation_spec`'s: self text where the model can
    sample it), and the spec those came from."""
    compensate, eval_data, eval_samples, objective = req.compensate, req.eval_data, req.eval_samples, req.objective
    heldout_samples = req.heldout_samples
    if compensate and req.heldout_data is not None and not heldout_samples:
        heldout_samples = max(4, (spec.max_samples or 16) // 4)
    calib = heldout = eval_batches = held = hspec = None
    eval_objective = eval_info = None
    used = 0
    if compensate:
        if spec.max_samples is None and (heldout_samples or eval_data == spec.source):
            raise UsageError("give --max-samples for the calibration data so that held-out blocks can follow it")
        calib = make_batches(spec, lm.tokenizer, "plain", model=tm).batches
        used = spec.skip_samples + (spec.max_samples or 0)
        if heldout_samples:
            hspec = heldout_spec(spec, req.heldout_data, heldout_samples, used)
            held = make_batches(hspec, lm.tokenizer, "plain", model=tm)
            heldout = held.batches
            if hspec.source == spec.source:
                used += heldout_samples
    elif spec is not None and spec.max_samples is not None:
        used = spec.skip_samples + spec.max_samples
    compare_batches = cspec = espec = None
    task = DATA_TASK[resolve_objective(objective, lm.task, None)]
    if compare and hspec is None:
        sampling = task == "lm" and can_sample(tm.model, lm.tokenizer)
        cspec, taken = allocation_spec(spec, used, sampling, heldout_data=req.heldout_data)
        used += taken
    if eval_data is not None:
        eval_objective = resolve_objective(objective, lm.task, None)
        if eval_objective == "kl":
            raise UsageError("--eval-data needs a model with an LM head (there is no loss to report otherwise)")
        espec, skip = eval_spec(spec, eval_data, eval_samples, used, held)
    if compare:
        if cspec is None:
            cspec = hspec
        elif self_source(cspec.source)[0]:  # after any self text the evaluation reads
            cspec = allocation_spec(spec, used, True, after=espec)[0]
        compare_batches = make_batches(cspec, lm.tokenizer, task, model=tm).batches
    if espec is not None:
        with evaluation_reads():
            eb = make_batches(espec, lm.tokenizer, DATA_TASK[eval_objective], model=tm)
        eval_batches = eb.batches
        eval_info = {**eb.info, "skip_samples": skip}
    return PruneData(calib, heldout, eval_batches, eval_objective, eval_info, compare_batches, cspec)

