"""Loss, perplexity and accuracy of models over exactly the same batches."""
from __future__ import annotations

import math
import time
from typing import Any, Sequence

import torch

from .console import progress
from .errors import HeadtoolError
from .objectives import model_output, token_losses


def to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


@torch.no_grad()
def evaluate(model, batches: Sequence[dict], objective: str, *, label: str = "eval") -> dict[str, Any]:
    """Mean loss over weighted positions (and perplexity / accuracy) on `batches`."""
    device = next(model.parameters()).device
    total, weight, correct, count = 0.0, 0.0, 0, 0
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
            if objective == "classification":
                correct += int((logits.argmax(-1).view(-1) == b["labels"].view(-1)).sum())
                count += b["labels"].numel()
            tokens += int(b["input_ids"].numel())
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
    return out


def tokenizers_agree(a, b) -> bool:
    """Same ids for a probe text: batches made with `a` mean the same to a model that uses `b`."""
    if a is None or b is None:
        return True
    probe = "The quick brown fox jumps over the lazy dog. 1234 naïve café\n\tdef f(x): return x"
    return a(probe)["input_ids"] == b(probe)["input_ids"]


def compare_models(refs: Sequence[str], spec, objective: str, load_kwargs: dict) -> dict[str, Any]:
    """Evaluate every model on the batches built once with the first model's tokenizer.

    Models are loaded one at a time so that only one is in memory.
    """
    from .data import make_batches
    from .errors import UsageError
    from .loading import load_model
    from .modelinfo import model_info
    from .objectives import DATA_TASK, resolve_objective

    if not refs:
        raise UsageError("eval needs at least one MODEL")
    results: list[dict[str, Any]] = []
    batches = None
    first_tok = None
    resolved = objective
    for ref in refs:
        lm = load_model(ref, **load_kwargs)
        if batches is None:
            resolved = resolve_objective(objective, lm.task, spec.label_column)
            if resolved == "kl":
                raise UsageError(f"{ref} has no LM or classification head, so there is no loss to report; "
                                 "eval needs a causal-LM, masked-LM or classifier")
            if lm.tokenizer is None:
                raise UsageError(f"{ref}: no tokenizer files beside the model")
            first_tok = lm.tokenizer
            batches = make_batches(spec, lm.tokenizer, DATA_TASK[resolved])
        elif not tokenizers_agree(first_tok, lm.tokenizer):
            raise UsageError(f"{ref} uses another tokenizer than {refs[0]}; eval compares models on the "
                             "same token batches, so they must share a tokenizer")
        else:
            resolve_objective(resolved, lm.task, spec.label_column)
        res = evaluate(lm.model, batches.batches, resolved, label=f"eval {ref}")
        figures = model_info(lm.model, lm.adapter)
        results.append({"model": ref, "path": lm.path, **res, "params": figures["params"],
                        "total_heads": figures["total_heads"], "total_kv_heads": figures["total_kv_heads"],
                        "kv_cache_bytes_per_token": figures["kv_cache_bytes_per_token"]})
        del lm
    return {"objective": resolved, "data": batches.info, "results": results}
