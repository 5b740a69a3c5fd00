"""Distillation that wins back what pruning or K/V merging cost: the original teaches the student.

The student (a pruned or converted model) learns to reproduce the teacher's (the original's)
next-token distributions, KL(teacher_T || student_T) * T^2 at temperature T, optionally plus its
own language-model loss and the matching of final hidden states; headless encoders match final
hidden states. Teacher outputs are computed batch by batch on the fly and never stored.

The loop is deterministic given its options and seed: micro-batch k of the run is always the
same block of data (a seeded permutation per pass over the data), and the saved training state
(trainable weights, optimizer, schedule, RNG states, step) lets an interrupted run continue to
the same final weights as an uninterrupted one. Under ``torchrun`` each rank takes every
WORLD_SIZE-th micro-batch of that same sequence and gradients are averaged (DDP), so N ranks
with accumulation A follow the same trajectory as one process with accumulation N*A.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import random
import signal
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ..console import info, progress, warn
from ..data.batches import real_tokens_in, to_device
from ..distributed import World
from ..errors import HeadtoolError, UsageError
from ..measure.objectives import divergence, has_logits, token_losses
from ..model.info import attention_param_names
from .lowrank import add_lowrank, merge_lowrank
from .options import TRAIN_MODES as TRAIN_MODES
from .options import HealOptions, best_figure

STATE_FORMAT = "headtool.heal-state/1"
STATE_FILE = "state.pt"

# Options that may differ between an interrupted run and its resume (they do not change the
# trajectory of the weights); every other option must be the same. Not keep_best: a run interrupted
# under --keep-last saved no best weights, so a resume with --keep-best chose only among the steps
# after the interruption (and wrote weights far from the best the evaluations show).
RESUME_FREE = ("eval_every", "save_every", "gradient_checkpointing")
#: identity facts recorded since a later version: checked when the saved state has them
ADDED_IDENTITY = ("dtype",)


@dataclass
class HealResult:
    """What a heal did: per-step losses, held-out evaluations, the chosen step."""

    steps: int
    total_steps: int
    tokens: int
    elapsed_s: float
    losses: list[float]  # total loss per optimizer step
    distill_losses: list[float]  # the distillation term alone per step
    evals: list[dict[str, Any]]
    best_step: int
    final_step_weights: bool  # False when the best evaluation came before the last step
    trainable_params: int
    kind: str  # "logits" | "hidden"
    best_by: str = "distill"  # the held-out figure keep-best chose on (best_figure); "last" with --keep-last
    resumed_from: int | None = None
    world_size: int = 1
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        before = self.evals[0] if self.evals else None
        best = next((e for e in self.evals if e["step"] == self.best_step), None)
        q = max(1, len(self.losses) // 4)
        return {
            "steps": self.steps, "total_steps": self.total_steps, "tokens": self.tokens,
            "elapsed_s": round(self.elapsed_s, 3), "trainable_params": self.trainable_params,
            "distill_kind": self.kind, "world_size": self.world_size,
            "resumed_from": self.resumed_from, "best_step": self.best_step, "best_by": self.best_by,
            "final_step_weights": self.final_step_weights,
            "before": before, "after": best, "evals": self.evals,
            "train_loss_first_quarter": sum(self.losses[:q]) / q if self.losses else None,
            "train_loss_last_quarter": sum(self.losses[-q:]) / q if self.losses else None,
            "distill_first_quarter": sum(self.distill_losses[:q]) / q if self.distill_losses else None,
            "distill_last_quarter": sum(self.distill_losses[-q:]) / q if self.distill_losses else None,
            "train_losses": [round(x, 6) for x in self.losses],
            "distill_losses": [round(x, 6) for x in self.distill_losses],
            **self.extra,
        }


class HealInterrupted(HeadtoolError):
    """Ctrl-C during training: the state of the last finished step was saved."""

    exit_code = 130


# --------------------------------------------------------------------------- what trains


def trainable_roots(model: nn.Module, adapter) -> list[nn.Module]:
    """The attention block and output projection of every layer (found through the adapter)."""
    roots = []
    for i in range(adapter.num_layers(model.config)):
        roots.append(adapter.attention_module(model, i))
        roots.append(adapter.o_proj_module(model, i))
    return roots


def select_trainable(model: nn.Module, adapter, opts: HealOptions) -> list[str]:
    """Set requires_grad for the chosen mode (wrapping low-rank adapters for lora); returns names."""
    if opts.train == "lora":
        add_lowrank(model, trainable_roots(model, adapter), opts.lora_rank, opts.lora_alpha, seed=opts.seed)
    elif opts.train == "all":
        for p in model.parameters():
            p.requires_grad_(True)
    else:
        chosen = set(attention_param_names(model, adapter))
        for name, p in model.named_parameters():
            p.requires_grad_(name in chosen)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    if not names:
        raise UsageError("nothing to train: the model has no attention parameters the adapter knows")
    return names


def finish_trainable(model: nn.Module) -> None:
    """Fold low-rank adapters into the weights and make every parameter frozen again."""
    merge_lowrank(model)
    for p in model.parameters():
        p.requires_grad_(False)


# --------------------------------------------------------------------------- losses


def _outputs(model: nn.Module, batch: dict, opts: HealOptions) -> tuple[torch.Tensor | None, Any]:
    """(logits or None, hidden states or None) of one forward pass: the final hidden state, or
    with `--hidden-layers all` every layer's output (a tuple) when `--hidden-weight` asks for them."""
    want_hidden = bool(opts.hidden_weight)
    kw: dict[str, Any] = {"input_ids": batch["input_ids"], "attention_mask": batch.get("attention_mask")}
    if want_hidden:
        kw["output_hidden_states"] = True
    out = model(**kw)
    logits = getattr(out, "logits", None)
    if logits is None:
        return None, out.last_hidden_state
    if not want_hidden:
        return logits, None
    return logits, (tuple(out.hidden_states[1:]) if opts.hidden_layers == "all" else out.hidden_states[-1])


def hidden_match(s_hidden: Any, t_hidden: Any, mask: torch.Tensor | None) -> torch.Tensor:
    """Mean normalized squared error of the final hidden state, or of every layer's output (each
    layer normalized by the teacher's own mean squared norm there, so that no layer's scale rules)."""
    s_layers, t_layers = (s_hidden, t_hidden) if isinstance(s_hidden, tuple) else ((s_hidden,), (t_hidden,))
    if len(s_layers) != len(t_layers):
        raise UsageError(f"--hidden-layers all: the student has {len(s_layers)} layers and the teacher "
                         f"{len(t_layers)}; use --hidden-layers last")
    return torch.stack([_mean(*divergence(s, t, mask, False)) for s, t in zip(s_layers, t_layers)]).mean()


def _mean(d: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (d * w).sum() / w.sum().clamp_min(1.0)


def distill_terms(s: tuple, t: tuple, batch: dict, opts: HealOptions, objective: str | None) -> dict[str, torch.Tensor]:
    """The loss terms of one batch: 'distill' (KL or hidden match), 'lm' (with 'lm_tokens', the
    positions it averages), 'hidden', and 'total'."""
    (s_logits, s_hidden), (t_logits, t_hidden) = s, t
    mask = batch.get("attention_mask")
    terms: dict[str, torch.Tensor] = {}
    if s_logits is not None:
        if s_logits.shape != t_logits.shape:
            raise UsageError(f"student and teacher outputs differ in shape ({tuple(s_logits.shape)} vs "
                             f"{tuple(t_logits.shape)}): heal needs the same vocabulary / labels")
        tau = opts.temperature
        d, w = divergence(s_logits / tau, t_logits / tau, mask if s_logits.dim() == 3 else None, True)
        terms["distill"] = _mean(d, w) * tau * tau
        if opts.hidden_weight and s_hidden is not None:
            terms["hidden"] = hidden_match(s_hidden, t_hidden, mask)
        if objective in ("lm", "mlm"):
            losses, w = token_losses(objective, s_logits, batch)
            terms["lm"] = _mean(losses, w)
            terms["lm_tokens"] = w.sum()  # what the mean is over (masked positions for MLM): evaluations weigh by it
    else:
        if s_hidden.shape != t_hidden.shape:
            raise UsageError(f"student and teacher hidden states differ in shape ({tuple(s_hidden.shape)} vs "
                             f"{tuple(t_hidden.shape)})")
        d, w = divergence(s_hidden, t_hidden, mask, False)
        terms["distill"] = _mean(d, w)
    total = opts.kl_weight * terms["distill"]
    if opts.lm_weight and "lm" in terms:
        total = total + opts.lm_weight * terms["lm"]
    if opts.hidden_weight and "hidden" in terms:
        total = total + opts.hidden_weight * terms["hidden"]
    terms["total"] = total
    return terms


# --------------------------------------------------------------------------- schedule, state


def lr_lambda(total: int, warmup: int, min_ratio: float) -> Callable[[int], float]:
    """Linear warmup to 1, then cosine down to `min_ratio` at `total` steps."""

    def f(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        progress_ = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress_))

    return f


def _rng_state() -> dict[str, Any]:
    st: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def _set_rng_state(st: dict[str, Any]) -> None:
    torch.set_rng_state(st["torch"])
    random.setstate(st["python"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


def _atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def save_state(folder: Path, state: dict[str, Any]) -> None:
    """Write the training state atomically (a crash mid-write leaves the previous state intact)."""
    folder.mkdir(parents=True, exist_ok=True)
    _atomic_write(folder / STATE_FILE, lambda p: torch.save(state, p))
    summary = {k: v for k, v in state.items() if k in ("format", "step", "total_steps", "options", "student",
                                                         "teacher", "tokens", "elapsed_s", "best", "evals")}
    summary["best"] = {k: v for k, v in (state.get("best") or {}).items() if k != "weights"}
    _atomic_write(folder / "state.json", lambda p: p.write_text(json.dumps(summary, indent=2, default=str)))


def load_state(folder: Path) -> dict[str, Any]:
    path = folder / STATE_FILE
    if not path.exists():
        raise UsageError(f"--resume: no training state in {folder} (run without --resume to start)")
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file is bad input
        raise UsageError(f"--resume: cannot read {path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}; "
                         "delete the folder to start over") from e
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        raise UsageError(f"--resume: {path} is not a headtool training state")
    return state


def trajectory_options(opts: HealOptions) -> dict[str, Any]:
    return {k: v for k, v in asdict(opts).items() if k not in RESUME_FREE}


def _check_resume(state: dict, opts: HealOptions, identity: dict[str, Any], total: int) -> None:
    want = trajectory_options(opts)
    have = state["options"]
    diff = [k for k in sorted(set(want) | set(have)) if want.get(k) != have.get(k)]
    if diff:
        desc = ", ".join(f"{k}: saved {have.get(k)!r}, now {want.get(k)!r}" for k in diff)
        raise UsageError(f"--resume: the options differ from the interrupted run ({desc}); use the same options "
                         "or start over with --overwrite")
    for key, value in identity.items():
        if key in ADDED_IDENTITY and key not in state:
            continue  # a state saved before headtool recorded it
        if state.get(key) != value:
            raise UsageError(f"--resume: the {key} differs from the interrupted run's "
                             f"({state.get(key)} vs {value}); use the same models and data or --overwrite")
    if state["total_steps"] != total:
        raise UsageError(f"--resume: the run had {state['total_steps']} steps, now {total}; "
                         "use the same data and budget")


# --------------------------------------------------------------------------- the loop


class _StopFlag:
    """SIGINT sets a flag; the loop saves the state after the current step and stops."""

    def __init__(self) -> None:
        self.stop = False
        self._prev = None

    def __enter__(self) -> "_StopFlag":
        if threading.current_thread() is threading.main_thread():
            self._prev = signal.getsignal(signal.SIGINT)

            def handler(signum, frame):  # a second Ctrl-C stops at once
                self.stop = True
                signal.signal(signal.SIGINT, self._prev or signal.default_int_handler)

            signal.signal(signal.SIGINT, handler)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._prev is not None:
            signal.signal(signal.SIGINT, self._prev)


def _autocast(device: torch.device, enabled: bool):
    if enabled:
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def use_bf16(opts: HealOptions, device: torch.device) -> bool:
    if opts.bf16 == "off":
        return False
    if opts.bf16 == "on":
        if device.type != "cuda":
            raise UsageError("--bf16 on needs a CUDA device (bf16 autocast is used on GPUs only)")
        return True
    return device.type == "cuda" and torch.cuda.is_bf16_supported()


@torch.no_grad()
def evaluate_heal(student: nn.Module, teacher: nn.Module, batches: Sequence[dict], opts: HealOptions,
                  objective: str | None, *, bf16: bool = False) -> dict[str, float]:
    """Held-out distillation loss (and the student's LM loss / perplexity where it has one)."""
    was_training = student.training
    student.eval()
    device = next(student.parameters()).device
    sums: dict[str, float] = {}
    weights: dict[str, float] = {}
    try:
        for batch in batches:
            b = to_device(batch, device)
            n = float(real_tokens_in(b))
            with _autocast(device, bf16):
                t = _outputs(teacher, b, opts)
                s = _outputs(student, b, opts)
            terms = distill_terms(s, t, b, opts, objective)
            lm_tokens = terms.pop("lm_tokens", None)
            for k, v in terms.items():
                # the LM / MLM loss per predicted token, as `headtool eval` averages it (an MLM batch's
                # masked positions are not in proportion to its tokens); the other terms per token
                w = float(lm_tokens) if k == "lm" and lm_tokens is not None else n
                sums[k] = sums.get(k, 0.0) + float(v) * w
                weights[k] = weights.get(k, 0.0) + w
    finally:
        student.train(was_training)
    out = {k: v / max(weights[k], 1.0) for k, v in sums.items()}
    # the objective trained, weighed as it is: each held-out term as averaged here (the LM loss per predicted token)
    out["total"] = (opts.kl_weight * out["distill"] + (opts.lm_weight * out["lm"] if "lm" in out else 0.0)
                    + (opts.hidden_weight * out["hidden"] if "hidden" in out else 0.0))
    if "lm" in out:
        out["loss"] = out.pop("lm")
        out["perplexity"] = math.exp(min(out["loss"], 700.0))
    return out


def _batch_index(k: int, n: int, seed: int, cache: dict[int, torch.Tensor]) -> int:
    """Micro-batch k of the run: pass k // n over the data, in that pass's seeded order."""
    epoch = k // n
    if epoch not in cache:
        g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        cache.clear()
        cache[epoch] = torch.randperm(n, generator=g)
    return int(cache[epoch][k % n])


def _checkpointing(model: nn.Module, on: bool) -> None:
    """Activation checkpointing on or off: transformers' own name for it where it has one (its older
    `gradient_checkpointing_*` aliases print a FutureWarning with a source path on stderr)."""
    if hasattr(model, "activation_checkpointing_enable"):
        if on:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.activation_checkpointing_disable()
    elif on:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()


def plan_steps(opts: HealOptions, num_batches: int, world: World) -> int:
    """Optimizer steps of the run: --max-steps, else one pass over the training batches."""
    if opts.max_steps:
        return opts.max_steps
    per_step = opts.grad_accum * world.size
    if num_batches < per_step:
        raise UsageError(f"{num_batches} training batches are fewer than one step needs "
                         f"({opts.grad_accum} accumulation x {world.size} ranks); give more data or --max-steps")
    return num_batches // per_step


def heal_model(
    student: nn.Module,
    teacher: nn.Module,
    adapter,
    train_batches: Sequence[dict],
    eval_batches: Sequence[dict],
    opts: HealOptions,
    *,
    objective: str | None,
    state_dir: Path | None = None,
    resume: bool = False,
    identity: dict[str, Any] | None = None,
    callback: Callable[[int, dict[str, Any]], None] | None = None,
    world: World = World(),
) -> HealResult:
    """Distil `teacher` into `student` in place; returns the history (student weights are the result).

    objective: 'lm' / 'mlm' for models with an LM head (enables --lm-weight and perplexity), else
    None. identity: facts a resumed run must share with the saved one (fingerprints, data).
    callback(step, record) runs after every optimizer step (and after the state was saved).
    """
    opts.validate()
    if not train_batches:
        raise UsageError("no training batches")
    identity = identity or {}
    device = next(student.parameters()).device
    bf16 = use_bf16(opts, device)
    total = plan_steps(opts, len(train_batches), world)
    warmup = opts.warmup_steps if opts.warmup_steps is not None else max(0, round(0.05 * total))
    if warmup >= total > 0 and world.main:
        warn(f"--warmup-steps {warmup} is not below the run's {total} step{'' if total == 1 else 's'}: the learning rate rises for the "
             f"whole run and ends at {total / warmup:.2g} of --lr {opts.learning_rate:g}, never decaying; "
             f"give fewer warmup steps (e.g. {max(0, round(0.05 * total))}, the default's 5%)")
    eval_every = opts.eval_every or max(1, total // 10)
    save_every = opts.save_every or eval_every

    teacher.eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    torch.manual_seed(opts.seed)
    random.seed(opts.seed)
    names = select_trainable(student, adapter, opts)
    params = dict(student.named_parameters())
    trainable = [params[n] for n in names]
    n_trainable = sum(p.numel() for p in trainable)
    if opts.gradient_checkpointing:
        if not getattr(student, "supports_gradient_checkpointing", False):
            raise UsageError("--gradient-checkpointing: this model does not support it")
        _checkpointing(student, True)
    use_cache = {id(m): m.config.use_cache for m in (student, teacher) if hasattr(m.config, "use_cache")}
    for m in (student, teacher):  # no KV cache while training (and no warning about it)
        if id(m) in use_cache:
            m.config.use_cache = False

    optimizer = torch.optim.AdamW(trainable, lr=opts.learning_rate, weight_decay=opts.weight_decay,
                                  betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(total, warmup, opts.min_lr_ratio))
    step, tokens, elapsed0 = 0, 0, 0.0
    losses: list[float] = []
    distill_losses: list[float] = []
    evals: list[dict[str, Any]] = []
    by = best_figure(opts)
    best: dict[str, Any] = {"step": None, "by": by, "value": math.inf, "weights": None}
    resumed_from = None
    if resume:
        if state_dir is None:
            raise UsageError("--resume needs a state folder")
        state = load_state(state_dir)
        _check_resume(state, opts, identity, total)
        missing = [n for n in names if n not in state["trainable"]]
        if missing:
            raise UsageError(f"--resume: the saved state lacks {missing[0]} (another --train mode?)")
        with torch.no_grad():
            for n in names:
                params[n].copy_(state["trainable"][n])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        step, tokens, elapsed0 = state["step"], state["tokens"], state["elapsed_s"]
        losses, evals = list(state["losses"]), list(state["evals"])
        distill_losses = list(state["distill_losses"])
        best = state["best"]
        if "value" not in best:  # a state saved before keep-best chose on the objective trained (on distill)
            value = next((e.get(by) for e in evals if e["step"] == best.get("step")), None)
            best = {**{k: v for k, v in best.items() if k != "distill"}, "by": by,
                    "value": value if value is not None else math.inf}
        rngs = state["rng"]
        if len(rngs) == world.size:
            _set_rng_state(rngs[world.rank])
        else:
            warn(f"--resume: the state was saved by {len(rngs)} ranks, now {world.size}; "
                 "random states (dropout) are re-seeded")
            torch.manual_seed(opts.seed + 7919 * step + world.rank)
        resumed_from = step
        if world.main:
            info(f"resuming from step {step} of {total} ({state_dir})")

    model = student
    if world.size > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(student, device_ids=[device.index] if device.type == "cuda" else None)

    def snapshot() -> dict[str, torch.Tensor]:
        return {n: params[n].detach().to("cpu", copy=True) for n in names}

    def do_eval() -> dict[str, Any]:
        res = {"step": step, **evaluate_heal(student, teacher, eval_batches, opts, objective, bf16=bf16)}
        evals.append(res)
        if opts.keep_best and res[by] < best["value"]:
            best.update(step=step, value=res[by], weights=snapshot())
        elif not opts.keep_best:
            best.update(step=step, value=res[by], weights=None)
        ppl = f"  perplexity {res['perplexity']:.3f}" if "perplexity" in res else ""
        tot = f"  total {res['total']:.5f}" if by == "total" else ""
        info(f"step {step}/{total}: held-out distill {res['distill']:.5f}{tot}{ppl}")
        return res

    def do_save() -> None:
        rngs = [_rng_state()]
        if world.size > 1:
            import torch.distributed as dist

            rngs = [None] * world.size
            dist.all_gather_object(rngs, _rng_state())
        if not world.main or state_dir is None:
            return
        save_state(state_dir, {
            "format": STATE_FORMAT, "step": step, "total_steps": total, "options": trajectory_options(opts),
            "trainable": snapshot(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
            "rng": rngs, "tokens": tokens, "elapsed_s": elapsed0 + (time.perf_counter() - t0),
            "losses": losses, "distill_losses": distill_losses, "evals": evals, "best": best, "world_size": world.size, **identity,
        })

    n = len(train_batches)
    perm_cache: dict[int, torch.Tensor] = {}
    t0 = time.perf_counter()
    if step == 0 and world.main and eval_batches:
        do_eval()
    student.train()
    tokens_run, t_run = 0, time.perf_counter()
    with _StopFlag() as flag, progress() as bar:
        task = bar.add_task("heal", total=total, completed=step, rate="")
        while step < total:
            optimizer.zero_grad(set_to_none=True)
            step_loss = torch.zeros(2, device=device)  # total, distill
            step_tokens = 0
            for a in range(opts.grad_accum):
                k = (step * opts.grad_accum + a) * world.size + world.rank
                batch = to_device(train_batches[_batch_index(k, n, opts.seed, perm_cache)], device)
                sync = a == opts.grad_accum - 1 or world.size == 1
                ctx = contextlib.nullcontext() if sync else model.no_sync()
                with ctx:
                    with torch.no_grad(), _autocast(device, bf16):
                        t_out = _outputs(teacher, batch, opts)
                    with _autocast(device, bf16):
                        s_out = _outputs(model, batch, opts)
                    terms = distill_terms(s_out, t_out, batch, opts, objective)
                    loss = terms["total"] / opts.grad_accum
                    if not torch.isfinite(loss):
                        raise HeadtoolError(f"heal: the loss is not finite at step {step + 1}; "
                                            "try a lower --lr or --bf16 off")
                    loss.backward()
                step_loss += torch.stack([loss.detach(), terms["distill"].detach() / opts.grad_accum])
                step_tokens += real_tokens_in(batch)
            if world.size > 1:
                import torch.distributed as dist

                dist.all_reduce(step_loss)
                step_loss /= world.size
                st = torch.tensor([step_tokens], device=device)
                dist.all_reduce(st)
                step_tokens = int(st)
            grad_norm = None
            if opts.max_grad_norm:
                grad_norm = float(torch.nn.utils.clip_grad_norm_(trainable, opts.max_grad_norm))
            optimizer.step()
            scheduler.step()
            step += 1
            tokens += step_tokens
            tokens_run += step_tokens
            losses.append(float(step_loss[0]))
            distill_losses.append(float(step_loss[1]))
            rate = tokens_run / max(time.perf_counter() - t_run, 1e-9)
            bar.update(task, completed=step, rate=f"loss {losses[-1]:.4f}  {rate:,.0f} tok/s")
            record = {"step": step, "loss": losses[-1], "lr": scheduler.get_last_lr()[0],
                      "grad_norm": grad_norm, "tokens": tokens}
            if world.main and eval_batches and (step % eval_every == 0 or step == total):
                record["eval"] = do_eval()
            stopping = flag.stop
            if world.size > 1:  # every rank stops at the same step (saving is collective)
                import torch.distributed as dist

                f = torch.tensor([int(stopping)], device=device)
                dist.all_reduce(f)
                stopping = bool(int(f))
            if step % save_every == 0 or step == total or stopping:
                do_save()
            if callback is not None:
                callback(step, record)
            if stopping:
                raise HealInterrupted(f"interrupted at step {step} of {total}; the training state is in "
                                      f"{state_dir}: rerun the same command with --resume to continue")
    student.eval()
    if opts.gradient_checkpointing:
        _checkpointing(student, False)
    final_step_weights = True
    if world.main and opts.keep_best and best.get("weights") is not None and best["step"] != step:
        with torch.no_grad():
            for nme in names:
                params[nme].copy_(best["weights"][nme].to(params[nme].device))
        final_step_weights = False
    finish_trainable(student)
    for m in (student, teacher):
        if id(m) in use_cache:
            m.config.use_cache = use_cache[id(m)]
    best_step = best["step"] if best.get("step") is not None else step
    if best_step == 0 and step > 0 and world.main:
        warn(f"no held-out evaluation of the {step} steps beat the student as it came (step 0): the weights kept "
             "are the student's own, unchanged; try a lower --lr, more steps or more data (or --keep-last)")
    return HealResult(steps=step, total_steps=total, tokens=tokens,
                      elapsed_s=elapsed0 + time.perf_counter() - t0, losses=losses,
                      distill_losses=distill_losses, evals=evals, best_step=best_step,
                      final_step_weights=final_step_weights, trainable_params=n_trainable,
                      kind="logits" if has_logits(student) else "hidden", best_by=by if opts.keep_best else "last",
                      resumed_from=resumed_from,
                      world_size=world.size)


# --------------------------------------------------------------------------- checkpoint to checkpoint


def state_folder(out: str | os.PathLike) -> Path:
    """Where the resumable training state of a heal writing OUT lives: OUT.heal-state/ beside it."""
    p = Path(os.path.expanduser(str(out))).resolve()
    return p.with_name(p.name + ".heal-state")


def _param_bytes(model: nn.Module) -> int:
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total


def memory_figures(student: nn.Module, teacher: nn.Module, trainable_params: int, opts: HealOptions) -> dict:
    """Bytes that scale with the models: both sets of weights plus gradients, AdamW moments and the
    best-weights copy of the trainable parameters (fp32); activations come on top."""
    per_trainable = 4 * (3 + (1 if opts.keep_best else 0))
    figures = {"teacher_weights_bytes": _param_bytes(teacher), "student_weights_bytes": _param_bytes(student),
               "training_state_bytes": trainable_params * per_trainable}
    figures["model_bytes_total"] = sum(figures.values())
    try:
        import resource

        figures["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    except (ImportError, OSError):  # pragma: no cover - not on Windows
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        figures["peak_cuda_bytes"] = int(torch.cuda.max_memory_allocated())
    return figures


