"""Where a model is loaded and where its layers run: shared by the CLI's Model options and by
recipes' top-level keys. Kept free of torch so that `headtool --help` starts fast."""
from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any, ClassVar

from ..errors import UsageError
from ..io.sizes import parse_size
from ..optionspec import RECIPE, option
from .refs import cache_dir

if TYPE_CHECKING:
    import torch


DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class LoadOptions:
    """How a model is loaded and placed. Declared once: every command's Model options and a
    recipe's top-level keys of the same names are derived from these fields."""

    dtype: str = option("auto", " | ".join(DTYPES), panel="Model", choices=DTYPES, where=RECIPE)
    device: str = option("auto", "auto | cpu | cuda | mps", panel="Model", where=RECIPE)
    trust_remote_code: bool = option(False, "run the model's own code (off by default)", panel="Model",
                                     flags=("--trust-remote-code",), where=RECIPE)
    device_map: str | None = option(None, "'auto': spread a model larger than one device over GPUs/CPU with "
                                    "accelerate (offload)", panel="Model", where=RECIPE)
    max_memory: str | None = option(None, "with --device-map: caps per device, e.g. '0=70GiB,cpu=200GiB' (the rest "
                                    "is offloaded to disk)", panel="Model", where=RECIPE)

    #: optionspec.check skips these: loading checks them (resolve_dtype also takes fp32, bf16 and fp16)
    checked_apart: ClassVar[bool] = True

    def kwargs(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def sequential_placement(load: LoadOptions, sequential: bool) -> tuple[LoadOptions, Any]:
    """(how to load, the device each layer visits during calibration or None) for --sequential."""
    if not sequential:
        return load, None
    if load.device_map:
        raise UsageError("--sequential places layers itself: leave out --device-map")
    return replace(load, device="cpu"), resolve_device(load.device)


def has_offloaded_weights(model) -> bool:
    """True when --device-map left parameters off-memory (accelerate keeps them on 'meta' and
    streams them in from CPU or disk for each forward)."""
    return any(p.device.type == "meta" for p in model.parameters())


def require_resident_weights(model, what: str, instead: str) -> None:
    """Surgery and training rewrite weights in place: offloaded ones are not there to rewrite, and
    quantized ones are packed with scales that slicing would leave behind."""
    from .config import refuse_quantized

    refuse_quantized(model.config, getattr(model.config, "_name_or_path", "") or "the model", what)
    if has_offloaded_weights(model):
        raise UsageError(f"{what} rewrites weights that --device-map offloaded to CPU or disk: {instead}")


def offload_folder() -> str:
    """A folder of this process's own for weights --device-map offloads to disk, removed at exit
    (a shared one would let two runs overwrite each other's offloaded weights)."""
    import atexit
    import shutil
    import tempfile

    root = cache_dir() / "offload"
    root.mkdir(parents=True, exist_ok=True)
    folder = tempfile.mkdtemp(prefix=f"{os.getpid()}-", dir=root)
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def resolve_device(device: str) -> torch.device:
    import torch

    if device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device {device}: CUDA is not available on this machine")
    if device == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise UsageError("--device mps: MPS is not available on this machine")
    try:
        return torch.device(device)
    except RuntimeError as e:
        raise UsageError(f"--device {device!r} is not a device: use auto, cpu, cuda or mps") from e


def parse_max_memory(spec: str) -> dict[int | str, str]:
    """'0=70GiB,1=70GiB,cpu=200GiB' -> {0: '70GiB', 1: '70GiB', 'cpu': '200GiB'} (accelerate's form)."""
    caps: dict[int | str, str] = {}
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        dev, sep, size = part.partition("=")
        dev, size = dev.strip().lower(), size.strip()
        if not sep or not dev or not size:
            raise UsageError(f"--max-memory: expected DEVICE=SIZE items like 0=70GiB,cpu=200GiB, got {part!r}")
        if not (dev.isdigit() or dev in ("cpu", "mps", "disk")):
            raise UsageError(f"--max-memory: unknown device {dev!r} (a GPU index, cpu, mps or disk)")
        try:
            parse_size(size)
        except UsageError:
            raise UsageError(f"--max-memory {part!r}: not a size (use e.g. 70GiB or 500MB)") from None
        caps[int(dev) if dev.isdigit() else dev] = size
    if not caps:
        raise UsageError("--max-memory is empty")
    return caps
