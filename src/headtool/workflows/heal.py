"""`headtool heal`: distil the original model back into a pruned or converted one and write it
in the student's own format (the training loop itself is `train.healing`)."""
from __future__ import annotations

import json
import math
import shutil
from contextlib import contextmanager
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Callable

import torch

from ..console import warn, warnings_held
from ..data.batches import blocks_read, evaluation_reads, make_batches, resolve_auto
from ..distributed import World, barrier, world_from_env
from ..errors import UsageError
from ..io.output import check_output_target, write_output
from ..io.provenance import RECORD, folder_meta, original_heads_kept_as_is, written_record
from ..measure.evaluation import tokenizers_agree
from ..model.loading import LoadedModel, load_model
from ..model.placement import require_resident_weights
from ..model.refs import resolve_ref
from ..train.healing import (
    STATE_FILE,
    HealOptions,
    HealResult,
    evaluate_heal,
    heal_model,
    memory_figures,
    state_folder,
    use_bf16,
)
from ..train.options import best_figure, objective_text
from .data_plan import blocks_all_read, part_blocks, same_source_name
from .requests import HealRequest


OBJECTIVE_OF_TASK = {"causal-lm": "lm", "masked-lm": "mlm"}


DATA_TASK_OF_TASK = {"causal-lm": "lm", "masked-lm": "mlm"}


def _data_specs(data, eval_data, eval_samples: int, opts: HealOptions, world: World):
    """(training spec, held-out spec): --eval-data (a source or a DataSpec), else the first
    `eval_samples` blocks of --data, which training then skips (the block order is prefix-stable,
    so the two never overlap)."""
    if eval_data is not None and not isinstance(eval_data, str):  # a DataSpec (recipes)
        held = eval_data
        if held.max_samples is None and held.num_tokens is None:
            held = replace(held, max_samples=eval_samples)
        train = data
    elif eval_data:
        held = replace(data, source=eval_data, label_column=None, max_samples=eval_samples, num_tokens=None,
                       skip_samples=0)
        if not same_source_name(eval_data, data.source):  # another source: its own split and columns
            held = replace(held, split=None, text_column=None)
        train = data
    else:
        held = replace(data, max_samples=eval_samples, num_tokens=None)
        train = replace(data, skip_samples=data.skip_samples + eval_samples)
    if opts.max_steps and train.max_samples is None and train.num_tokens is None:
        # tokenize no more than the run reads (the same blocks either way: selection is prefix-stable)
        train = replace(train, max_samples=opts.max_steps * opts.grad_accum * world.size * train.batch_size)
    same = same_source_name(held.source, data.source) and held.split == data.split
    if eval_data and held.skip_samples == 0 and (same or part_blocks(data, held.source, 0) is not None):
        # --data itself or a source of its mixture: evaluate on its blocks after the ones training reads
        caps = [c for c in (train.max_samples, train.num_tokens and train.num_tokens // train.seq_len) if c]
        if not caps:
            what = "the same source as" if same else "a source of"
            raise UsageError(f"--eval-data {held.source} is {what} --data {data.source}: give --max-steps "
                             "or --max-samples so the evaluation blocks can be held out from training")
        read = train.skip_samples + min(caps)
        held = replace(held, skip_samples=read if same else part_blocks(data, held.source, read))
    return train, held


def heal_batches(req: HealRequest, tokenizer: Any, task: str, teacher: Any, world: World | None = None):
    """(training, held-out) batches of a heal; `headtool heal` and recipe steps. `--data self`
    samples from the teacher (the original model)."""
    data_task = DATA_TASK_OF_TASK.get(task, "plain")
    data = resolve_auto(req.data, tokenizer, teacher, data_task)
    train_spec, held_spec = _data_specs(data, req.eval_data, req.eval_samples, req.opts, world or World())
    # 'only 9 of 16 blocks' is dropped where the line below refuses the same text; the held-out blocks are
    # only evaluated on (keep-best's choice), not fitted: data_read records them so, and `eval` need not skip them
    with warnings_held(), evaluation_reads():
        held = _held_out_batches(held_spec, tokenizer, data_task, teacher, req, data, train_spec)
    return make_batches(train_spec, tokenizer, data_task, model=teacher), held


def _held_out_batches(held_spec, tokenizer, data_task: str, teacher, req: HealRequest, data, train_spec):
    """The held-out batches, or a usage error where they leave no training text."""
    held = make_batches(held_spec, tokenizer, data_task, model=teacher)
    short = held.info.get("samples", 0) < (held_spec.max_samples or 0)  # the text ran out within them
    read_whole = blocks_all_read(held.info, train_spec.skip_samples)
    if req.eval_data is None and (short or read_whole is not None):
        # training skips the held-out blocks: make_batches would blame a --skip-samples nobody gave
        available = held.info.get("available_samples")
        available = available if isinstance(available, int) else data.skip_samples + held.info.get("samples", 0)
        skipped = f" after --skip-samples {data.skip_samples}" if data.skip_samples else ""
        raise UsageError(f"--data {data.source} gives {available} blocks of {data.seq_len} tokens, and the "
                         f"{req.eval_samples} held-out ones (--eval-samples){skipped} leave none to train on: "
                         "give more text, a lower --eval-samples or --seq-len, or held-out text with --eval-data")
    return held


def check_loss_options(req: HealRequest, task: str) -> None:
    """Options that the student's kind would silently ignore: --lm-weight without a language-model
    head (no LM loss to weigh), --temperature and --hidden-weight on a headless model (its distillation is the match of
    the final hidden states already, weighed by --kl-weight; --hidden-layers all was not applied)."""
    if req.opts.lm_weight and task not in OBJECTIVE_OF_TASK:
        raise UsageError(f"--lm-weight {req.opts.lm_weight:g}: the student is {task!r}, without a language-model "
                         "head, so it has no LM loss to weigh; leave --lm-weight out (heal distils its outputs)")
    if req.opts.temperature != 1.0 and task == "base":
        raise UsageError(f"--temperature {req.opts.temperature:g}: the student is headless, so there is no softmax "
                         "to soften (its distillation matches final hidden states); leave --temperature out")
    if req.opts.hidden_weight and task == "base":
        raise UsageError(f"--hidden-weight {req.opts.hidden_weight:g}: the student is headless, and its "
                         "distillation already matches its final hidden states (weighed by --kl-weight); leave "
                         "--hidden-weight and --hidden-layers out")


def heal_loaded(student: LoadedModel, teacher: LoadedModel, req: HealRequest):
    """Heal a model in memory towards `teacher` (a recipe step: no training state on disk)."""
    req.validate()
    check_loss_options(req, student.task)
    if student.tokenizer is None:
        raise UsageError("heal needs the model's tokenizer to read --data")
    train, held = heal_batches(req, student.tokenizer, student.task, teacher)
    objective = OBJECTIVE_OF_TASK.get(student.task)
    res = heal_in_float32(student.model, teacher.model, held.batches, req.opts, objective,
                          lambda: heal_model(student.model, teacher.model, student.adapter, train.batches,
                                             held.batches, req.opts, objective=objective))
    res.extra.setdefault("data_source", train.info.get("source"))
    return res


@contextmanager
def float32_master_weights(model: torch.nn.Module):
    """Train `model` in float32 and give its parameters their own dtype back after (rounded): AdamW
    steps of about the learning rate (2e-4) are below a bfloat16 weight's resolution and would be lost.
    Parameters only: buffers (RoPE frequencies, kept float32 on loading) are left as they are."""
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                p.data = p.data.float()
    try:
        yield model
    finally:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name in dtypes:
                    p.data = p.data.to(dtypes[name])


def heal_in_float32(student: torch.nn.Module, teacher: torch.nn.Module, held_batches, opts: HealOptions,
                    objective: str | None, train: Callable[[], HealResult], *, main: bool = True) -> HealResult:
    """Run `train` (heal_model on `student`) on float32 master weights and give the student its own
    dtype back, rounded; `headtool heal` and recipe heal steps alike. Where that rounds (a bfloat16 or
    float16 student), the figures after the heal are measured again on the rounded weights, the ones
    that are kept and written (what `headtool eval` of the output measures): `after` are theirs, with
    `weights_dtype`, and `after_unrounded` the float32 weights' (main: the rank that evaluates)."""
    out_dtype = next(student.parameters()).dtype
    dtypes = {name: p.dtype for name, p in student.named_parameters()}
    rounds = any(d in (torch.bfloat16, torch.float16) for d in dtypes.values())
    with float32_master_weights(student):
        result = train()
        if main and rounds and held_batches:
            unrounded = result.to_json()["after"]
            with torch.no_grad():  # the values only, still float32: evaluated as `eval --dtype float32` does
                for name, p in student.named_parameters():
                    if dtypes.get(name) in (torch.bfloat16, torch.float16):
                        p.copy_(p.to(dtypes[name]))
            rounded = evaluate_heal(student, teacher, held_batches, opts, objective,
                                    bf16=use_bf16(opts, next(student.parameters()).device))
            result.extra["after"] = {"step": result.best_step, **rounded, "weights_dtype": _dtype_name(out_dtype)}
            result.extra["after_unrounded"] = unrounded
            _warn_rounding_undid(result, best_figure(opts), _dtype_name(out_dtype))
    return result


def _warn_rounding_undid(result: HealResult, figure: str, dtype: str) -> None:
    """Keep-best chose on the float32 weights; rounded to `dtype` they may end worse held-out than the
    student as it came: say so, with both figures, rather than let the table's arrow say it alone."""
    before, after = result.to_json().get("before"), result.extra["after"]
    if before and result.best_step and figure in before and after.get(figure, -math.inf) > before[figure]:
        warn(f"rounded to {dtype}, the kept weights (step {result.best_step}) are worse held-out than the "
             f"student as it came ({figure} {after[figure]:.4f} against {before[figure]:.4f}): the heal's gain "
             "is below the rounding; train longer or at a higher --lr, or heal a float32 copy")


def _dtype_name(of) -> str:
    dtype = of if isinstance(of, torch.dtype) else next(of.parameters()).dtype
    return str(dtype).replace("torch.", "")


def run_heal(req: HealRequest, *, callback: Callable[[int, dict[str, Any]], None] | None = None
             ) -> dict[str, Any]:
    """Load STUDENT and TEACHER, heal, and write OUTPUT in the student's own format; returns the result.

    The training state is saved every `save_every` steps. Safe to call from every rank of a torchrun job.
    """
    req.validate()
    if req.eval_samples < 1:
        raise UsageError(f"--eval-samples must be at least 1 (got {req.eval_samples})")
    if req.data.label_column:
        raise UsageError(f"--label-column {req.data.label_column}: heal distils the teacher's outputs and reads no "
                         "labels; leave --label-column out")
    world = world_from_env(req.load.device)
    load_kwargs = req.load.kwargs()
    state_dir = state_folder(req.output)
    check_output_beside_inputs(req)
    if req.resume and not (state_dir / STATE_FILE).exists():
        raise UsageError(f"--resume: no training state in {state_dir} (run without --resume to start)")
    if state_dir.exists() and not req.resume:
        if not is_state_folder(state_dir):
            raise UsageError(f"{state_dir} is where heal keeps its training state for -o {req.output}, and it holds "
                             "other files; move it away or choose another -o (it is never deleted)")
        if not req.overwrite:
            raise UsageError(f"{state_dir} holds the training state of an earlier run (unfinished, or kept by "
                             "--keep-state); pass --resume to continue it or --overwrite to start over")
        if world.main:
            shutil.rmtree(state_dir)
    if world.size > 1 and torch.cuda.is_available() and load_kwargs.get("device", "auto") in ("auto", "cuda"):
        load_kwargs["device"] = f"cuda:{world.local_rank}"

    student = load_model(req.student, rewrites="heal", **load_kwargs)
    require_resident_weights(student.model, "heal", "the student is trained in place, so it must fit in memory "
                             "without offload (drop --max-memory or raise its caps)")
    teacher = load_model(req.teacher, **load_kwargs)
    tok = student.tokenizer or teacher.tokenizer
    if tok is None:
        raise UsageError(f"{req.student}: no tokenizer files beside the model (nor beside the teacher)")
    if not tokenizers_agree(student.tokenizer, teacher.tokenizer):
        raise UsageError(f"{req.student} and {req.teacher} use different tokenizers; heal distils on the same "
                         "tokens, so the student must keep the teacher's tokenizer")
    if (student.task == "base") != (teacher.task == "base"):
        raise UsageError(f"the student is {student.task!r} and the teacher {teacher.task!r}: heal needs both with "
                         "the same head (or both headless)")
    if student.fingerprint == teacher.fingerprint and not req.opts.lm_weight:
        raise UsageError(f"{req.student} and --teacher {req.teacher} are the same model (the same weights): the "
                         "distillation loss is 0 already, so there is nothing to heal; the teacher is the original "
                         "the student was pruned or converted from")
    check_loss_options(req, student.task)
    objective = OBJECTIVE_OF_TASK.get(student.task)
    same_source = teacher_is_recorded_source(student.path, teacher.fingerprint)
    if same_source is False and world.main:
        warn("--teacher is not the model the student was made from (the fingerprints differ); "
             "healing towards it anyway")
    with blocks_read() as seen:
        train, held = heal_batches(req, tok, student.task, teacher, world)
    out_dtype = next(student.model.parameters()).dtype
    identity = {"student": student.fingerprint, "teacher": teacher.fingerprint,
                "train_data": train.info.get("fingerprint"), "eval_data": held.info.get("fingerprint"),
                # the teacher's logits and the written weights are in the loaded dtype (the fingerprints,
                # rounded to bf16, do not tell float32 from bfloat16)
                "dtype": f"student {_dtype_name(out_dtype)}, teacher {_dtype_name(teacher.model)}"}
    memory: dict[str, Any] = {}

    def train_student() -> HealResult:  # on float32 master weights; bf16 autocast on GPUs does the fast math
        res = heal_model(student.model, teacher.model, student.adapter, train.batches, held.batches, req.opts,
                         objective=objective, state_dir=state_dir, resume=req.resume, identity=identity,
                         callback=callback, world=world)
        memory.update(memory_figures(student.model, teacher.model, res.trainable_params, req.opts))  # as trained
        return res

    result = heal_in_float32(student.model, teacher.model, held.batches, req.opts, objective, train_student,
                             main=world.main)
    doc: dict[str, Any] = {
        "format": "headtool.heal/1",
        "student": {"ref": req.student, "path": student.path, "fingerprint": student.fingerprint,
                    "task": student.task},
        "teacher": {"ref": req.teacher, "path": teacher.path, "fingerprint": teacher.fingerprint,
                    "matches_student_source": same_source},
        "objective": objective or "hidden",
        "options": {**asdict(req.opts), "learning_rate": req.opts.learning_rate, "eval_samples": req.eval_samples},
        "data": train.info, "eval_data": held.info,
        **result.to_json(),
        "memory": memory,
    }
    if world.main:
        meta = {k: v for k, v in doc.items() if k not in ("format", "train_losses", "distill_losses")}
        meta["operation"] = "heal"
        meta["heal_format"] = doc["format"]
        meta[RECORD] = written_record(seen, student.path)
        meta.update(original_heads_kept_as_is(student.path, [g.num_heads for g in student.geometry]))
        prior = Path(student.path) / "headtool.json"
        if prior.is_file():
            try:
                meta["healed_from"] = json.loads(prior.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError):
                pass
        written = write_output(req.output, model=student.model, tokenizer=tok, source=student, meta=meta,
                               card_table=card_table(doc), overwrite=req.overwrite)
        doc["output"] = written
        if not req.keep_state:
            shutil.rmtree(state_dir, ignore_errors=True)
    barrier(world)
    return doc


def is_state_folder(folder: Path) -> bool:
    """Does `folder` hold only what heal's training state writes (state.pt, state.json and their
    temporary files), so that --overwrite may delete it? A folder of the user's that happens to bear
    the name (a model called OUT.heal-state) is not."""
    return folder.is_dir() and all(p.name in (STATE_FILE, "state.json") or
                                   (p.name.startswith(".state.") and ".tmp-" in p.name) for p in folder.iterdir())


def check_output_beside_inputs(req: HealRequest) -> None:
    """Refuse an -o inside, on or around the student or the teacher: both are the user's models,
    which heal never modifies."""
    for ref in (req.student, req.teacher):
        check_output_target(req.output, resolve_ref(ref)[0], req.overwrite)


#: how many headtool.json records back a student's sources are followed (prune -> convert -> heal)
_MAX_RECORDS = 8


def recorded_sources(folder: str | Path, depth: int = 0) -> set[str]:
    """Fingerprints of the models a headtool output was made from, as its headtool.json records
    them: the source of each step back through the local folders it names, and the teachers
    of earlier heals. Empty when nothing is recorded (not a headtool output)."""
    doc = folder_meta(folder)
    return _sources_of(doc, depth) if doc is not None else set()


def _sources_of(doc: dict[str, Any], depth: int) -> set[str]:
    """The source fingerprints one headtool.json document records (see recorded_sources)."""
    if depth >= _MAX_RECORDS:
        return set()
    if doc.get("operation") == "heal":  # its `source` is the unhealed student: look past it
        prior, teacher = doc.get("healed_from"), _entry(doc, "teacher")
        found = _sources_of(prior, depth + 1) if isinstance(prior, dict) else set()
        return found | {fp for fp in [teacher.get("fingerprint")] if isinstance(fp, str)}
    source = _entry(doc, "source")
    found = {fp for fp in (source.get("fingerprint"), doc.get("source_fingerprint")) if isinstance(fp, str)}
    path = source.get("path")
    if isinstance(path, str) and Path(path).is_dir():
        found |= recorded_sources(path, depth + 1)
    return found


def _entry(doc: dict[str, Any], key: str) -> dict[str, Any]:
    """A sub-document of headtool.json, {} when absent or malformed (the file is the user's to edit)."""
    value = doc.get(key)
    return value if isinstance(value, dict) else {}


def teacher_is_recorded_source(student_path: str, teacher_fingerprint: str) -> bool | None:
    """Whether the teacher is a model the student's headtool.json says it was made from (None: no
    record). Another teacher can be deliberate (a larger model), so a mismatch is a warning only."""
    sources = recorded_sources(student_path)
    return (teacher_fingerprint in sources) if sources else None


def card_table(doc: dict[str, Any]) -> str:
    """Markdown before/after table for the model card."""
    before, after = doc.get("before") or {}, doc.get("after") or {}
    ppl = "perplexity" in before
    head = "| | held-out distillation loss |" + (" perplexity |" if ppl else "")
    rows = [head, "|---|---|" + ("---|" if ppl else "")]
    for name, e in (("before heal", before), (f"after heal (step {doc.get('best_step')})", after)):
        if e:
            rows.append(f"| {name} | {e['distill']:.5f} |" + (f" {e['perplexity']:.3f} |" if ppl else ""))
    rows.append("")
    kept = ("the last step's weights (--keep-last)" if doc.get("best_by") == "last" else
            f"the weights of the lowest {objective_text(doc['options'])}")
    rows.append(f"Teacher: `{doc['teacher']['ref']}`; {doc['steps']} steps, {doc['tokens']:,} tokens, "
                f"--train {doc['options']['train']}; kept {kept}.")
    return "\n".join(rows)
