"""`headtool score`: the importance of every attention head of a model, as a score document."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from ..console import info
from ..data.batches import make_batches, resolve_auto
from ..distributed import finish, init_from_env, is_main, launched
from ..errors import UsageError
from ..measure.objectives import DATA_TASK, resolve_objective
from ..measure.scores_doc import build_document
from ..measure.scoring import DATA_METHODS, ScoreResult, check_method, resolve_normalize, score_heads
from ..model.loading import LoadedModel, load_model
from .data_plan import with_default_blocks
from .requests import ScoreRequest


@dataclass
class ScoreRun:
    """A finished scoring: the document (None on the ranks of a distributed run other than 0)."""

    document: dict[str, Any] | None
    result: ScoreResult
    objective: str | None
    normalize: str
    data: Any = None  # the DataSpec it read
    batches_info: dict[str, Any] | None = None


def run_score(req: ScoreRequest) -> ScoreRun:
    """Load, score (data-parallel when launched by torchrun/accelerate) and build the document."""
    req.validate()
    resolve_normalize(req.normalize, req.method)
    lm = load_model(req.model, **req.load.kwargs())
    init_from_env(lm.device)
    run = score_loaded(lm, req)
    spec = run.data
    options = {"seed": spec.seed, "iterative": req.iterative, "fraction": req.fraction,
               "iterative_fraction": req.iterative_fraction, "dtype": req.load.dtype, "device": str(lm.device)}
    if launched():
        options["world_size"] = int(os.environ.get("WORLD_SIZE", "1"))
        main_rank = is_main()
        finish()
        if not main_rank:
            return run  # rank 0 alone writes and prints
    run.document = build_document(lm, run.result, run.batches_info, options)
    return run


def score_loaded(lm: LoadedModel, req: ScoreRequest, text_model: LoadedModel | None = None) -> ScoreRun:
    """Score the heads of a loaded model (the document is built by the caller); `headtool score`
    and recipe steps. text_model: the model `--data self` samples from (default lm)."""
    spec = with_default_blocks(req.data, req.default_blocks)
    batches = None
    resolved = None
    if req.method in DATA_METHODS:
        resolved = resolve_objective(req.objective, lm.task, spec.label_column)
        if req.objective == "auto":
            info(f"objective: {resolved} (auto, for a {lm.task} model)")
        if check_method(req.method, resolved) == "fisher" and req.method == "gradient":
            info("kl: scoring with the Fisher form (the gradient of a divergence from the model's own "
                 "outputs is exactly zero at the model)")
        if lm.tokenizer is None:
            raise UsageError(f"{req.model}: no tokenizer files beside the model; scoring needs them to read --data")
        spec = resolve_auto(spec, lm.tokenizer, text_model or lm, DATA_TASK[resolved])
        batches = make_batches(spec, lm.tokenizer, DATA_TASK[resolved], model=text_model or lm)
    elif req.objective != "auto":
        info(f"--objective is not used by --method {req.method} (it needs no data)")
    norm = resolve_normalize(req.normalize, req.method)
    if req.normalize == "auto":
        info(f"normalize: {norm} (auto for {req.method})")
    result = score_heads(lm.model, lm.adapter, batches.batches if batches else None, method=req.method,
                         objective=resolved, normalize=norm, iterative=req.iterative, fraction=req.fraction,
                         iterative_fraction=req.iterative_fraction, seed=spec.seed,
                         ablation_chunk=req.ablation_batch, label=f"score {req.model}")
    return ScoreRun(None, result, resolved, norm, spec, batches.info if batches else None)
