"""`headtool info`: a model's attention geometry, sizes and KV-cache bytes per token."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..model.info import model_info
from ..model.loading import load_model
from ..model.placement import LoadOptions


@dataclass(frozen=True)
class InfoRequest:
    model: str
    load: LoadOptions = field(default_factory=LoadOptions)


def run_info(req: InfoRequest) -> dict[str, Any]:
    """The `info --json` figures (model_info plus the resolved local path)."""
    lm = load_model(req.model, **req.load.kwargs())
    return {**model_info(lm.model, lm.adapter), "path": lm.path}
