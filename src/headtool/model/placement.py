"""Where a model is loaded and where its layers run: shared by the CLI's Model options and by
recipes' top-level keys. Kept free of torch so that `headtool --help` starts fast."""
from __future__ import annotations

import itertools
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


def input_device(model) -> "torch.device":
    """The device a forward takes its inputs on. For a model in one place, its parameters'; for one
    --device-map dispatched, the execution device accelerate gives the input embedding, because
    weights offloaded to disk sit on 'meta', which holds no data to compute with."""
    import torch

    try:
        embedding = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        embedding = None
    hook = getattr(embedding, "_hf_hook", None)
    if getattr(hook, "execution_device", None) is not None:
        return torch.device(hook.execution_device)
    first = embedding.parameters() if embedding is not None else ()  # the embedding's first, then any
    return next((p.device for p in itertools.chain(first, model.parameters()) if p.device.type != "meta"),
                torch.device("cpu"))


def readable_weights(model) -> dict[str, "torch.Tensor"]:
    """The model's state dict with every tensor readable: those --device-map offloaded (on 'meta')
    are read, one at a time when asked for, from the CPU or disk copy accelerate streams them from."""
    state = model.state_dict()
    if not has_offloaded_weights(model):
        return state
    return _OffloadedStateDict(model, state)


def readable_tensor(module, name: str = "weight") -> "torch.Tensor":
    """module.<name>, read from accelerate's CPU or disk copy when --device-map offloaded it."""
    t = getattr(module, name)
    if t is None or t.device.type != "meta":
        return t
    weights = getattr(getattr(module, "_hf_hook", None), "weights_map", None)
    if weights is None or name not in weights:
        raise UsageError(f"{type(module).__name__}.{name}: offloaded, and accelerate keeps no copy of it to read")
    return weights[name]


class _OffloadedStateDict(dict):
    """A state dict whose offloaded entries are fetched on access through their module's hook."""

    def __init__(self, model, state: dict) -> None:
        super().__init__(state)
        self._model = model

    def __getitem__(self, key: str):
        t = super().__getitem__(key)
        if t.device.type != "meta":
            return t
        owner, _, name = key.rpartition(".")
        return readable_tensor(self._model.get_submodule(owner), name)

    def items(self):  # noqa: D102 - dict's, reading each value through __getitem__
        return ((k, self[k]) for k in self.keys())

    def values(self):  # noqa: D102
        return (self[k] for k in self.keys())


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
    parts = [p.strip() for p in spec.split(",")]
    if any(not p for p in parts) and any(parts):
        raise UsageError(f"--max-memory {spec!r}: an empty item between commas; write DEVICE=SIZE items like "
                         "0=70GiB,cpu=200GiB")
    for part in (p for p in parts if p):
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
