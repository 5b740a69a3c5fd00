"""`headtool eval`: loss / perplexity (or accuracy) of models side by side, or with --speed their
inference speed and memory, always on exactly the same tokens."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ..console import info, warn
from ..data.batches import make_batches, resolve_auto
from ..errors import UsageError
from ..io.provenance import fitted_sources, folder_record
from ..measure.evaluation import (
    evaluate,
    hidden_agreement,
    hidden_states,
    paired_difference,
    tokenizers_agree,
)
from ..measure.objectives import DATA_TASK, resolve_objective
from ..measure.speed import (
    FORMAT,
    MEMORY_METHOD,
    SpeedSpec,
    max_positions,
    measure_models,
    speed_input_ids,
)
from ..model.info import model_info
from ..model.loading import LoadedModel, load_model
from ..model.placement import LoadOptions
from .data_plan import EvalCut, evaluation_cut
from .requests import EvalRequest


@dataclass(frozen=True)
class SpeedRequest:
    """Models to time, interleaved on the same real-text tokens from `source`."""

    models: tuple[str, ...]
    speed: SpeedSpec = field(default_factory=SpeedSpec)
    source: str = "builtin:pydoc"
    seed: int = 0
    load: LoadOptions = field(default_factory=LoadOptions)
    new_tokens_given: bool = False  # --new-tokens was typed (refused where no model decodes)


def run_eval(req: EvalRequest, *, skip_given: bool = False) -> dict[str, Any]:
    """Evaluate every model on the batches built once with the first model's tokenizer; skip_given:
    --skip-samples was typed, so the blocks start where it says even at 0 (evaluation_cut).

    Models are loaded one at a time so that only one is in memory.
    """
    req.validate()
    refs, spec, objective, load_kwargs = req.models, req.data, req.objective, req.load.kwargs()
    if not refs:
        raise UsageError("eval needs at least one MODEL")
    results: list[dict[str, Any]] = []
    batches = None
    first_tok = None
    reference: list[torch.Tensor] | None = None
    first_blocks: list[float] | None = None  # the first model's summed loss per block
    resolved = objective
    records = {ref: folder_record(ref) for ref in refs}
    cut = None
    for ref in refs:
        lm = load_model(ref, **load_kwargs)
        if batches is None:
            resolved = resolve_objective(objective, lm.task, spec.label_column)
            if lm.tokenizer is None:
                raise UsageError(f"{ref}: no tokenizer files beside the model")
            first_tok = lm.tokenizer
            cut = evaluation_cut(resolve_auto(spec, lm.tokenizer, lm, DATA_TASK[resolved]), records,
                                 skip_given=skip_given)
            _say_cut(cut)
            batches = make_batches(cut.spec, lm.tokenizer, DATA_TASK[resolved], model=lm)  # self: the first model's
        elif not tokenizers_agree(first_tok, lm.tokenizer):
            raise UsageError(f"{ref} uses another tokenizer than {refs[0]}; eval compares models on the "
                             "same token batches, so they must share a tokenizer")
        else:
            resolve_objective(resolved, lm.task, spec.label_column)
        if resolved == "kl":  # headless: how far each model's hidden states are from the first's
            if reference is None:
                reference = hidden_states(lm.model, batches.batches)
            res = hidden_agreement(lm.model, batches.batches, reference, label=f"eval {ref}")
        else:
            res = evaluate(lm.model, batches.batches, resolved, label=f"eval {ref}", per_block=True)
            sums, weights = res.pop("block_sums"), res.pop("block_weights")
            if first_blocks is None:
                first_blocks = sums
            elif len(sums) > 1:  # how far the evaluated blocks alone could move the gap from the first model
                res["loss_delta_se"] = paired_difference(sums, first_blocks, weights)[1]
        figures = model_info(lm.model, lm.adapter)
        record = records[ref]
        results.append({"model": ref, "path": lm.path, **res, "params": figures["params"],
                        "fitted_on": fitted_sources(record) if record is not None else None,
                        "in_domain": cut.in_domain[ref],
                        "total_heads": figures["total_heads"], "total_kv_heads": figures["total_kv_heads"],
                        "kv_cache_bytes_per_token": figures["kv_cache_bytes_per_token"],
                        **{k: figures[k] for k in ("kv_rank", "rope_dim") if k in figures}})
        del lm
    return {"objective": resolved, "data": batches.info, "results": results}


def _say_cut(cut: EvalCut) -> None:
    """Where the evaluation starts and why, and what it cannot rule out, on stderr (the table marks
    the in-domain models)."""
    source, models = cut.spec.source, ", ".join(cut.read_by)
    were = "was" if len(cut.read_by) == 1 else "were"
    if cut.overlaps:
        warn(f"--skip-samples {cut.spec.skip_samples}: the evaluation reads blocks of {source} that {models} "
             f"{were} fitted on (the first {cut.needed}): a figure on them flatters; --skip-samples {cut.needed} "
             "starts after them")
    elif cut.needed and cut.spec.skip_samples == cut.needed:
        info(f"eval: starting after the first {cut.needed} blocks of {source}: {models} {were} fitted on them")
    if cut.other_cut:
        warn(f"{', '.join(cut.other_cut)} read {source} in blocks of another --seq-len or --seed: the evaluated "
             "text may overlap what they were fitted on (give the --seq-len and --seed they used, recorded in "
             "their headtool.json under data_read, to start after it)")


def eval_loaded(lm: LoadedModel, req: EvalRequest, original: torch.nn.Module | None = None,
                text_model: LoadedModel | None = None) -> dict[str, Any]:
    """Loss / perplexity of a model in memory (and of `original`, its state before the recipe's
    steps, on the same batches); the recipe's eval step."""
    objective = resolve_objective(req.objective, lm.task, req.data.label_column)
    if objective == "kl":
        raise UsageError("an eval step needs a model with an LM or classification head")
    if lm.tokenizer is None:
        raise UsageError(f"{req.models[0] if req.models else 'the model'}: no tokenizer files beside the model")
    b = make_batches(req.data, lm.tokenizer, DATA_TASK[objective], model=text_model or lm)
    paired = original is not None
    before = evaluate(original, b.batches, objective, label="eval original", per_block=True) if paired else None
    after = evaluate(lm.model, b.batches, objective, label="eval", per_block=paired)
    out = {"objective": objective, "data": b.info, "before": before, "after": after}
    if paired:  # the gap's standard error over the blocks, as `headtool eval` gives it
        sums, first = after.pop("block_sums"), before.pop("block_sums")
        weights = after.pop("block_weights")
        del before["block_weights"]
        if len(sums) > 1:
            out["loss_delta_se"] = paired_difference(sums, first, weights)[1]
    return out


def run_speed(req: SpeedRequest) -> dict[str, Any]:
    """Load every model, measure them interleaved on the same tokens; a `headtool.speed/1` document."""
    refs, spec, load_kwargs, source, seed = req.models, req.speed, req.load.kwargs(), req.source, req.seed
    spec.check()
    if not refs:
        raise UsageError("eval --speed needs at least one MODEL")
    loaded = [load_model(r, **load_kwargs) for r in refs]
    first = loaded[0]
    if first.tokenizer is None:
        raise UsageError(f"{refs[0]}: no tokenizer files beside the model")
    for lm in loaded[1:]:
        if not tokenizers_agree(first.tokenizer, lm.tokenizer):
            raise UsageError(f"{lm.ref} uses another tokenizer than {refs[0]}; --speed runs every model on the "
                             "same tokens, so they must share a tokenizer")
    decoders = [lm.task == "causal-lm" for lm in loaded]
    if req.new_tokens_given and not all(decoders):
        lm = loaded[decoders.index(False)]
        raise UsageError(f"--new-tokens {spec.new_tokens}: {lm.ref} is a {lm.task} model, which does not generate "
                         "(eval --speed times its prefill only, decode n/a); leave --new-tokens out")
    for lm in loaded:
        # learned positions: what the model takes (RoBERTa's start after the padding index: 514 -> 512)
        mp = lm.adapter.max_positions(lm.config) or max_positions(lm.config)
        need = spec.context + (spec.new_tokens if lm.task == "causal-lm" else 0)
        if mp is not None and need > mp:
            plus = f" + --new-tokens {spec.new_tokens}" if lm.task == "causal-lm" else ""  # (an encoder: none)
            raise UsageError(f"{lm.ref}: --context {spec.context}{plus} exceeds the "
                             f"model's {mp} positions; lower --context")
    ids = speed_input_ids(first.tokenizer, spec, source, seed)
    decode = f"{spec.new_tokens} decode steps" if any(decoders) else "prefill only (no decode: no KV cache)"
    info(f"speed: {len(refs)} model(s), batch {spec.batch} x context {spec.context}, {decode}, "
         f"{spec.warmup} warm-up + {spec.repeats} timed runs each, {torch.get_num_threads()} threads")
    results = measure_models([(lm.ref, lm.model, lm.task == "causal-lm") for lm in loaded], ids, spec,
                             on_round=lambda r: info(f"  round {r + 1}/{spec.repeats} done"))
    for lm, res in zip(loaded, results):
        figures = model_info(lm.model, lm.adapter)
        res.update(path=lm.path, params=figures["params"], total_heads=figures["total_heads"],
                   total_kv_heads=figures["total_kv_heads"], dtype=figures["dtype"],
                   kv_cache_bytes_per_token=figures["kv_cache_bytes_per_token"],
                   attn_implementation=getattr(lm.config, "_attn_implementation", None),
                   **{k: figures[k] for k in ("kv_rank", "rope_dim") if k in figures})
    return {
        "format": FORMAT,
        "settings": {**asdict(spec), **({} if any(decoders) else {"new_tokens": None}), "source": source, "seed": seed, "threads": torch.get_num_threads(),
                     "device": str(first.device), "torch": torch.__version__,
                     "order": "interleaved rounds, order rotated each round; median of the timed runs"},
        "memory_method": MEMORY_METHOD,
        "results": results,
    }
