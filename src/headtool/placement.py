"""Where a model is loaded and where its layers run: shared by the CLI's Model options and by
recipes' top-level keys. Kept free of torch so that `headtool --help` starts fast."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from .errors import UsageError


@dataclass(frozen=True)
class LoadOptions:
    dtype: str = "auto"
    device: str = "auto"
    trust_remote_code: bool = False
    device_map: str | None = None
    max_memory: str | None = None

    def kwargs(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "device": self.device, "trust_remote_code": self.trust_remote_code,
                "device_map": self.device_map, "max_memory": self.max_memory}


def sequential_placement(load: LoadOptions, sequential: bool) -> tuple[LoadOptions, Any]:
    """(how to load, the device each layer visits during calibration or None) for --sequential."""
    if not sequential:
        return load, None
    from .loading import resolve_device

    if load.device_map:
        raise UsageError("--sequential places layers itself: leave out --device-map")
    return replace(load, device="cpu"), resolve_device(load.device)
