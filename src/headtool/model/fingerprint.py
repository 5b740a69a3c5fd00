"""A short, dtype-robust fingerprint of a model's config and weights.

`prune --scores` checks that a score document was made for the same model. Hashing every
byte of a 70B model is too slow, so we hash the architecture keys and every tensor's shape and
a strided sample of its values rounded to bfloat16 (so loading the same checkpoint as float32 or
bfloat16 gives the same fingerprint; a model loaded in float16, whose values would be rounded twice,
takes its fingerprint from the files: `loading._fingerprint_from_files`). Names and order are left out: checkpoints may store
legacy names, and tied copies count once.
"""
from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Iterable, Mapping

import torch

from ..errors import UsageError
from ..io.safetensors_stream import LazyCheckpoint
from .config import load_config

_IGNORED_CONFIG_KEYS = {
    "_name_or_path", "transformers_version", "dtype", "torch_dtype", "quantization_config",
    "use_cache", "_attn_implementation", "_attn_implementation_autoset", "auto_map",
    "architectures", "_commit_hash", "output_attentions", "output_hidden_states", "return_dict",
    "headtool",
}
SAMPLES_PER_TENSOR = 256


def config_digest(config_dict: Mapping) -> str:
    kept = {k: v for k, v in config_dict.items() if k not in _IGNORED_CONFIG_KEYS}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()


def sample_indices(numel: int) -> list[int] | None:
    """Flat positions of the sampled values (None: small tensors are hashed whole)."""
    if numel <= SAMPLES_PER_TENSOR:
        return None
    return torch.linspace(0, numel - 1, SAMPLES_PER_TENSOR, dtype=torch.float64).long().tolist()


def sample_bytes(values: torch.Tensor) -> bytes:
    return values.detach().reshape(-1).to(torch.bfloat16).view(torch.int16).cpu().numpy().tobytes()


def tensor_sample(t: torch.Tensor) -> bytes:
    flat = t.detach().reshape(-1)
    idx = sample_indices(flat.numel())
    return sample_bytes(flat if idx is None else flat[torch.tensor(idx, device=flat.device)])


def fingerprint_parts(config_dict: Mapping, parts: Iterable[tuple[tuple[int, ...], bytes]]) -> str:
    """Hash of the config and of (shape, sampled values) per tensor, in an order of their own."""
    h = hashlib.sha256(config_digest(config_dict).encode())
    for p in sorted(str(tuple(shape)).encode() + b"|" + sample for shape, sample in parts):
        h.update(p)
    return "sha256:" + h.hexdigest()[:32]


def fingerprint_tensors(config_dict: Mapping, tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """Hash of the config and of every tensor's shape and sampled values, independent of the
    tensors' names and order (checkpoints may store legacy names, e.g. GPT-NeoX's embed_out)."""
    return fingerprint_parts(config_dict, ((tuple(t.shape), tensor_sample(t)) for _, t in tensors))


def model_fingerprint(model: torch.nn.Module) -> str:
    """Fingerprint of an in-memory model; a tied tensor counts once (under its first name), as in
    the saved checkpoint, so that the fingerprint of the files equals the loaded model's."""
    seen: set[tuple] = set()
    unique = []
    for name, t in model.state_dict().items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape)) if t.device.type != "meta" \
            else (name,)
        if key in seen:
            continue
        seen.add(key)
        unique.append((name, t))
    return fingerprint_tensors(model.config.to_dict(), unique)


def checkpoint_fingerprint(config_dict: Mapping, lazy: LazyCheckpoint) -> str:
    """The fingerprint of a checkpoint on disk, equal to that of the model it loads into, reading
    only the sampled elements of each tensor (reading whole tensors would read it all again)."""
    def samples():
        for key in lazy.keys():
            e = lazy.index[key]
            idx = sample_indices(math.prod(e.shape))
            values = lazy[key] if idx is None else lazy.elements(key, idx)
            yield e.shape, sample_bytes(values)

    return fingerprint_parts(config_dict, samples())


def folder_fingerprint(path: str) -> str:
    """The fingerprint of the checkpoint in a local folder, from its files (for weights that
    --device-map offloaded, which are not in memory to hash)."""
    if not (Path(path) / "config.json").exists():
        raise UsageError(f"{path}: offloaded weights are fingerprinted from their files, and this is "
                         "not a local model folder")
    return checkpoint_fingerprint(load_config(path, "folder").to_dict(), LazyCheckpoint(path))
