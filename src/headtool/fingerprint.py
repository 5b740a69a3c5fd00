"""A short, dtype-robust fingerprint of a model's config and weights.

`prune --scores` checks that a score document was made for the same model. Hashing every
byte of a 70B model is too slow, so we hash the architecture keys, every tensor's name and
shape, and a strided sample of its values rounded to bfloat16 (so loading the same checkpoint
as float32 or bfloat16 gives the same fingerprint).
"""
from __future__ import annotations

import hashlib
import json
from typing import Iterable, Mapping

import torch

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


def tensor_sample(t: torch.Tensor) -> bytes:
    flat = t.detach().reshape(-1)
    n = flat.numel()
    if n > SAMPLES_PER_TENSOR:
        idx = torch.linspace(0, n - 1, SAMPLES_PER_TENSOR, dtype=torch.float64, device=flat.device).long()
        flat = flat[idx]
    return flat.to(torch.bfloat16).view(torch.int16).cpu().numpy().tobytes()


def fingerprint_tensors(config_dict: Mapping, tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    h = hashlib.sha256(config_digest(config_dict).encode())
    for name, t in sorted(tensors, key=lambda kv: kv[0]):
        h.update(name.encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(tensor_sample(t))
    return "sha256:" + h.hexdigest()[:32]


def model_fingerprint(model: torch.nn.Module) -> str:
    """Fingerprint of an in-memory model (tied weights counted once by name)."""
    sd = model.state_dict()
    return fingerprint_tensors(model.config.to_dict(), sd.items())
