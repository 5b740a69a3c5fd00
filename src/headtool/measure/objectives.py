"""Losses that scoring and evaluation share: one place that knows how each task is measured."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import UsageError

OBJECTIVES = ("auto", "lm", "mlm", "classification", "kl")

# which batches each objective needs (see data.make_batches)
DATA_TASK = {"lm": "lm", "mlm": "mlm", "classification": "classification", "kl": "plain"}


def at_least_float32(t: torch.Tensor) -> torch.Tensor:
    """float16/bfloat16 -> float32 for losses; float64 stays float64 (exact checks run in fp64)."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def resolve_objective(objective: str, task: str, label_column: str | None = None) -> str:
    """The natural objective for a model task ('auto'), or a check that the asked one fits."""
    if objective not in OBJECTIVES:
        raise UsageError(f"unknown objective {objective!r}; use one of {', '.join(OBJECTIVES)}")
    if objective == "auto":
        natural = {"causal-lm": "lm", "masked-lm": "mlm", "classification": "classification"}.get(task, "kl")
        if label_column and natural != "classification":  # the labels would meet a head that predicts tokens
            raise UsageError(f"--label-column {label_column}: labels are scored by a classification model, but this "
                             f"model is {task!r}; leave --label-column out (objective {natural}) or use a "
                             "sequence-classification model")
        return natural
    needs = {"lm": "causal-lm", "mlm": "masked-lm", "classification": "classification"}
    if objective in needs and task != needs[objective]:
        raise UsageError(f"objective {objective!r} needs a {needs[objective]} model, but this model is "
                         f"{task!r}; use --objective kl (works for any model) or another model")
    if objective == "classification" and not label_column:
        raise UsageError("objective 'classification' needs --label-column")
    return objective


def model_output(model, batch: dict) -> torch.Tensor:
    """Logits of a model with a head, or the final hidden states of a headless one."""
    out = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"))
    if hasattr(out, "logits") and out.logits is not None:
        return out.logits
    return out.last_hidden_state


def token_losses(objective: str, logits: torch.Tensor, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position losses [B, T'] (float32) and a 0/1 weight mask of the same shape.

    lm: next-token cross entropy; mlm: masked positions only; classification: one per example.
    """
    logits = at_least_float32(logits)
    if objective == "lm":
        labels = batch["input_ids"][:, 1:]
        lg = logits[:, :-1]
        mask = batch.get("attention_mask")
        w = torch.ones_like(labels, dtype=torch.float32) if mask is None else mask[:, 1:].float()
        if "labels" in batch and batch["labels"].dim() == 2:
            lab = batch["labels"][:, 1:]
            w = w * (lab != -100).float()
            labels = lab.clamp_min(0)
        loss = F.cross_entropy(lg.reshape(-1, lg.shape[-1]), labels.reshape(-1), reduction="none")
        return loss.view(labels.shape), w
    if objective == "mlm":
        labels = batch["labels"]
        w = (labels != -100).float()
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.clamp_min(0).reshape(-1),
                               reduction="none")
        return loss.view(labels.shape), w
    if objective == "classification":
        labels = batch["labels"].view(-1)
        loss = F.cross_entropy(logits, labels, reduction="none")
        return loss[:, None], torch.ones_like(loss)[:, None]
    raise ValueError(f"token_losses does not handle {objective!r}")


def divergence(objective_output: torch.Tensor, reference: torch.Tensor, mask: torch.Tensor | None,
               is_logits: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position divergence from the unpruned model's own outputs [B, T] and weights.

    Logits: KL(reference || model) over the vocabulary; hidden states: squared error
    normalised by the reference's mean squared norm (scale-free, needs no head).
    """
    out = at_least_float32(objective_output)
    ref = at_least_float32(reference)
    if is_logits:
        lp = F.log_softmax(out, -1)
        lq = F.log_softmax(ref, -1)
        d = (lq.exp() * (lq - lp)).sum(-1)
    else:
        scale = ref.pow(2).sum(-1).mean().clamp_min(1e-12)
        d = (out - ref).pow(2).sum(-1) / scale
    w = torch.ones_like(d) if mask is None else mask.float()
    return d, w


def has_logits(model) -> bool:
    return hasattr(model, "get_output_embeddings") and model.get_output_embeddings() is not None \
        or type(model).__name__.endswith("ForSequenceClassification")


# --------------------------------------------------------------------------- scoring helpers


def forward_output(model, batch: dict) -> tuple[torch.Tensor, bool]:
    """(logits or final hidden states, is_logits) of one forward, without building a KV cache.

    Scoring runs many forwards whose cache would only cost memory, so `use_cache=False` is
    passed to models that take it.
    """
    import inspect

    kwargs = {"input_ids": batch["input_ids"], "attention_mask": batch.get("attention_mask")}
    if "use_cache" in inspect.signature(model.forward).parameters:
        kwargs["use_cache"] = False
    out = model(**kwargs)
    logits = getattr(out, "logits", None)
    if logits is not None:
        return logits, True
    return out.last_hidden_state, False


def objective_losses(objective: str, output: torch.Tensor, batch: dict, reference: torch.Tensor | None = None,
                     is_logits: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position losses [B, T'] and weights for any objective; `kl` compares with `reference`.

    A pooled output ([B, C], a classifier) counts as one position per example.
    """
    if objective != "kl":
        return token_losses(objective, output, batch)
    if reference is None:
        raise ValueError("objective 'kl' needs the reference output")
    if output.dim() == 2:
        return divergence(output[:, None], reference[:, None], None, is_logits)
    return divergence(output, reference, batch.get("attention_mask"), is_logits)


def fisher_sample_losses(output: torch.Tensor, batch: dict, is_logits: bool,
                         generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position losses whose squared gradient estimates the Fisher of the `kl` objective.

    The gradient of a divergence from the model's own outputs is exactly zero at the model
    itself; its curvature is not. Drawing targets from the model's own predictive distribution
    (Kwon et al. 2022) gives per-example gradients whose expected square is the diagonal of that
    curvature (the Fisher, equal to the Hessian of the summed KL at its minimum):
    - logits: labels sampled from softmax(output), loss = cross entropy on them;
    - hidden states (headless models): the divergence is |o - r|^2 / s, a Gaussian model with
      Fisher (2/s) J^T J; the loss sqrt(2/s) * <eps, o> with eps ~ N(0, I) has exactly that
      expected squared gradient (Hutchinson).
    Samples are drawn on the CPU with `generator`, so a seed gives the same numbers on any device.
    """
    out = at_least_float32(output)
    if out.dim() == 2:
        out = out[:, None]
        mask = None
    else:
        mask = batch.get("attention_mask")
    w = torch.ones(out.shape[:2], dtype=torch.float32, device=out.device) if mask is None else mask.float()
    ref = out.detach()
    if is_logits:
        probs = torch.softmax(ref.reshape(-1, ref.shape[-1]).float(), -1).cpu()
        labels = torch.multinomial(probs, 1, generator=generator).view(out.shape[:2]).to(out.device)
        loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), labels.reshape(-1), reduction="none")
        return loss.view(out.shape[:2]), w
    scale = ref.pow(2).sum(-1).mean().clamp_min(1e-12)
    eps = torch.randn(out.shape, generator=generator, dtype=torch.float64).to(device=out.device, dtype=out.dtype)
    return (eps * out).sum(-1) * torch.sqrt(2.0 / scale), w
