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
    """The `info --json` figures: model_info, the resolved local path and the model as typed (for a
    packaged model or a .gguf the path is a converted copy in the cache)."""
    lm = load_model(req.model, **req.load.kwargs())
    return {**model_info(lm.model, lm.adapter), "path": lm.path, "ref": lm.ref}
