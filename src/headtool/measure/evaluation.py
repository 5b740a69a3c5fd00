"""Loss, perplexity and accuracy of models over exactly the same batches."""
from __future__ import annotations

import math
import time
from typing import Any, Sequence

import torch

from ..console import progress
from ..data.batches import to_device
from ..errors import HeadtoolError
from ..model.placement import input_device
from .objectives import model_output, token_losses


@torch.no_grad()
def evaluate(model, batches: Sequence[dict], objective: str, *, label: str = "eval",
             per_block: bool = False) -> dict[str, Any]:
    """Mean loss over weighted positions (and perplexity / accuracy) on `batches`.

    With `per_block`, also every block's (row's) summed loss and weight (`block_sums`,
    `block_weights`, in batch order): what a paired comparison of two models on the same blocks
    needs (`paired_difference`).
    """
    device = input_device(model)
    total, weight, correct, count = 0.0, 0.0, 0, 0
    block_sums: list[float] = []
    block_weights: list[float] = []
    t0 = time.perf_counter()
    with progress() as bar:
        task = bar.add_task(label, total=len(batches), rate="")
        tokens = 0
        for i, batch in enumerate(batches):
            b = to_device(batch, device)
            logits = model_output(model, b)
            losses, w = token_losses(objective, logits, b)
            s = float((losses * w).sum())
            if not math.isfinite(s):
                raise HeadtoolError(f"{label}: the loss is not finite on batch {i}; try --dtype float32")
            total += s
            weight += float(w.sum())
            if per_block:
                block_sums += (losses * w).sum(-1).double().tolist()
                block_weights += w.sum(-1).double().tolist()
            if objective == "classification":
                correct += int((logits.argmax(-1).view(-1) == b["labels"].view(-1)).sum())
                count += b["labels"].numel()
            mask = b.get("attention_mask")  # (classification examples are padded: the padding is no text)
            tokens += int(mask.sum()) if mask is not None else int(b["input_ids"].numel())
            rate = tokens / max(time.perf_counter() - t0, 1e-9)
            bar.update(task, advance=1, rate=f"{rate:,.0f} tok/s")
    loss = total / max(weight, 1.0)
    out: dict[str, Any] = {"loss": loss, "tokens": int(weight) if objective != "classification" else tokens,
                           "elapsed_s": round(time.perf_counter() - t0, 3)}
    if objective in ("lm", "mlm"):
        out["perplexity"] = math.exp(min(loss, 700.0))
    if objective == "classification":
        out["accuracy"] = correct / max(count, 1)
        out["examples"] = count
    if per_block:
        out["block_sums"], out["block_weights"] = block_sums, block_weights
    return out


def paired_difference(sums_a: Sequence[float], sums_b: Sequence[float],
                      weights: Sequence[float]) -> tuple[float, float]:
    """Mean loss of A minus mean loss of B over the same blocks, and its standard error.

    The blocks are the sampling unit (tokens within a block are not independent): the
    difference is a ratio estimator, sum(a - b) / sum(w), whose variance is estimated from the
    per-block residuals (a_i - b_i) - w_i * difference. Two models judged on the same blocks share
    most of their per-block variation, so this error is far smaller than either mean's.
    """
    n = len(weights)
    if not (len(sums_a) == len(sums_b) == n) or n == 0:
        raise ValueError("a paired difference needs the same, non-empty blocks for both")
    total_w = float(sum(weights))
    d = [a - b for a, b in zip(sums_a, sums_b)]
    diff = sum(d) / max(total_w, 1e-30)
    if n < 2:
        return diff, math.inf
    resid = sum((di - wi * diff) ** 2 for di, wi in zip(d, weights))
    se = math.sqrt(n / (n - 1) * resid) / max(total_w, 1e-30)
    return diff, se


#: How a recorded paired gap reads next to a held-out loss (prune's allocation line, convert-gqa's merges).
PAIRED_NOTE = "± one standard error of the paired difference"


def record_gaps(rows: Sequence[dict], verdicts: Sequence[dict], chosen: dict) -> None:
    """Add `difference` (held-out loss above the chosen candidate's) and its `standard_error` to every
    row whose verdict (an `evaluate(..., per_block=True)` result, same order as `rows`) is not the
    chosen one: how close the call between the candidates was."""
    for row, verdict in zip(rows, verdicts):
        if verdict is not chosen:
            row["difference"], row["standard_error"] = paired_difference(
                verdict["block_sums"], chosen["block_sums"], chosen["block_weights"])


def against_text(others: Sequence[tuple[str, dict]], where: str) -> str:
    """`against mean 9.8773 (+4.9691 ± 0.0997), ... (4 blocks of X; ± one standard error ...)`: the other
    candidates' held-out losses (each `(label, row)`), with their recorded gaps, and where they were measured."""
    vs = ", ".join(f"{label} {row['heldout_loss']:.4f}{gap_text(row)}" for label, row in others)
    paired = f"; {PAIRED_NOTE}" if any("standard_error" in row for _, row in others) else ""
    return f"against {vs} ({where}{paired})"


def gap_text(candidate: dict) -> str:
    """` (+0.0073 ± 0.0153)`: how much higher a candidate's held-out loss was than the chosen one's
    (empty where none was recorded: the chosen one, or a document written before gaps were)."""
    if "standard_error" not in candidate:
        return ""
    return f" ({candidate['difference']:+.4f} ± {candidate['standard_error']:.4f})"


@torch.no_grad()
def hidden_states(model, batches: Sequence[dict]) -> list[torch.Tensor]:
    """Final hidden states of a headless model on every batch (the reference for comparisons)."""
    device = input_device(model)
    return [model_output(model, to_device(b, device)).float().cpu() for b in batches]


@torch.no_grad()
def hidden_agreement(model, batches: Sequence[dict], reference: Sequence[torch.Tensor], *,
                     label: str = "eval") -> dict[str, Any]:
    """Agreement of a headless model's outputs with a reference model's on the same batches.

    loss: squared error normalised by the reference's mean squared norm (0 = identical);
    cosine: mean per-token cosine similarity; embedding_cosine: of mean-pooled sentence
    embeddings, the quantity sentence-embedding users care about.
    """
    device = input_device(model)
    se, norm, cos, ecos, n_tok, n_ex = 0.0, 0.0, 0.0, 0.0, 0, 0
    t0 = time.perf_counter()
    with progress() as bar:
        task = bar.add_task(label, total=len(batches), rate="")
        for b, ref in zip(batches, reference):
            b = to_device(b, device)
            out = model_output(model, b).float().cpu()
            mask = b["attention_mask"].float().cpu()[..., None]
            se += float(((out - ref) ** 2 * mask).sum())
            norm += float((ref ** 2 * mask).sum())
            cos += float((torch.nn.functional.cosine_similarity(out, ref, dim=-1) * mask[..., 0]).sum())
            pooled = lambda h: (h * mask).sum(1) / mask.sum(1).clamp_min(1)  # noqa: E731
            ecos += float(torch.nn.functional.cosine_similarity(pooled(out), pooled(ref), dim=-1).sum())
            n_tok += int(mask.sum())
            n_ex += out.shape[0]
            bar.update(task, advance=1)
    return {"loss": se / max(norm, 1e-30), "cosine": cos / max(n_tok, 1),
            "embedding_cosine": ecos / max(n_ex, 1), "tokens": n_tok,
            "elapsed_s": round(time.perf_counter() - t0, 3)}


def tokenizers_agree(a, b) -> bool:
    """Same ids for a probe text: batches made with `a` mean the same to a model that uses `b`."""
    if a is None or b is None:
        return True
    probe = "The quick brown fox jumps over the lazy dog. 1234 naïve café\n\tdef f(x): return x"
    return a(probe)["input_ids"] == b(probe)["input_ids"]


