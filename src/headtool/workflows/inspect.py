"""`headtool inspect`: per-head attention statistics and redundancy of a model on real batches."""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

from ..console import info
from ..data.batches import make_batches
from ..data.sources import DataSpec
from ..errors import UsageError
from ..measure.inspection import FORMAT, inspect_heads
from ..model.info import model_info
from ..model.loading import LoadedModel, load_model
from ..model.placement import LoadOptions
from ..surgery.selection import HEADS_GRAMMAR, head_pairs, parse_heads
from ..version import __version__

DEFAULT_SAMPLES = 16


@dataclass(frozen=True)
class InspectRequest:
    """The model, the data (default: 16 blocks) and `pattern_heads`, a head list in prune's
    grammar ("3:0,5;7:2"; "3:1,5:0" too) whose attention patterns the caller will draw (checked
    against the model before any work)."""

    model: str
    top: int = 10
    pattern_heads: str | None = None
    data: DataSpec = field(default_factory=DataSpec)
    load: LoadOptions = field(default_factory=LoadOptions)

    def validate(self) -> None:
        if self.top < 0:
            raise UsageError(f"--top must be 0 or more (got {self.top})")


@dataclass
class InspectRun:
    document: dict[str, Any]
    loaded: LoadedModel  # eager attention, for drawing patterns
    batches: list[dict]
    pattern_heads: list[tuple[int, int]] | None


def calibration_spec(spec: DataSpec) -> DataSpec:
    if spec.max_samples is None and spec.num_tokens is None:
        spec = dataclasses.replace(spec, max_samples=DEFAULT_SAMPLES)
    return spec


def run_inspect(req: InspectRequest) -> InspectRun:
    req.validate()
    spec = calibration_spec(req.data)
    t0 = time.perf_counter()
    lm = load_model(req.model, attn_implementation="eager", **req.load.kwargs())
    chosen = None
    if req.pattern_heads is not None:
        chosen = head_pairs(parse_heads(req.pattern_heads, lm.geometry))
        if not chosen:
            raise UsageError(f"--heads {req.pattern_heads!r} lists no heads; write {HEADS_GRAMMAR}")
    if lm.tokenizer is None:
        raise UsageError(f"{req.model}: no tokenizer files beside the model")
    task = "classification" if spec.label_column else "plain"
    batches = make_batches(spec, lm.tokenizer, task, model=lm)
    info(f"inspect: {batches.info.get('samples')} samples, {batches.info.get('tokens')} tokens, eager attention")
    stats = inspect_heads(lm.model, lm.adapter, batches.batches, top=req.top, label=f"inspect {req.model}")
    doc: dict[str, Any] = {
        "format": FORMAT,
        "model": {**model_info(lm.model, lm.adapter), "path": lm.path, "ref": lm.ref, "fingerprint": lm.fingerprint},
        "data": batches.info,
        "attn_implementation": "eager",
        **stats,
        "elapsed_s": round(time.perf_counter() - t0, 3),
        "headtool_version": __version__,
    }
    return InspectRun(doc, lm, batches.batches, chosen)
