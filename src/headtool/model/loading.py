"""Load models (folder, .gguf, short name of a packaged model, hub id) and their tokenizers."""
from __future__ import annotations

import importlib.util
import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

from ..arch import LAYOUT_KEY, Adapter, adapter_for
from ..console import warn
from ..errors import HeadtoolError, UsageError
from .classes import auto_class, pick_task
from .config import load_config, refuse_quantized
from .fingerprint import folder_fingerprint, model_fingerprint
from .latent import MLA_KEY, load_latent_folder, refuse_latent_surgery
from .placement import (
    has_offloaded_weights,
    input_device,
    offload_folder,
    parse_max_memory,
    resolve_device,
)
from .refs import resolve_ref
from .resize import load_headtool_folder

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


@dataclass
class LoadedModel:
    """A model ready for headtool: the model, its tokenizer, adapter and provenance."""

    model: Any
    tokenizer: Any
    adapter: Adapter
    ref: str  # what the user typed
    path: str  # resolved local folder (a converted cache folder for GGUF)
    source: str  # "folder" | "gguf" | "packaged" | "hub"
    task: str  # "causal-lm" | "masked-lm" | "classification" | "base"
    _fingerprint: str | None = field(default=None, repr=False)

    @property
    def config(self):
        return self.model.config

    @property
    def geometry(self):
        return self.adapter.geometry(self.model.config)

    @property
    def fingerprint(self) -> str:
        if self._fingerprint is None:
            if has_offloaded_weights(self.model):
                # the weights --device-map offloaded are not in memory; the files give the same value
                self._fingerprint = folder_fingerprint(self.path)
            else:
                self._fingerprint = model_fingerprint(self.model)
        return self._fingerprint

    @property
    def device(self) -> torch.device:
        return input_device(self.model)


def resolve_dtype(dtype: str) -> torch.dtype | str:
    if dtype == "auto":
        return "auto"
    if dtype not in DTYPES:
        raise UsageError(f"--dtype {dtype!r}: use auto, float32, bfloat16 or float16")
    return DTYPES[dtype]


def cast_dtype(dtype: str) -> torch.dtype | None:
    """What --dtype casts a checkpoint's floating tensors to when no model is built (--streaming):
    None for auto, the checkpoint's own."""
    return None if dtype == "auto" else resolve_dtype(dtype)  # type: ignore[return-value]


def load_tokenizer(path: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception:  # noqa: BLE001 - a model without tokenizer files is still a model
        return None


def _check_missing(ref: str, missing: list[str]) -> None:
    """Weights of a transformer layer absent from the checkpoint: refuse (transformers would init them randomly)."""
    in_layers = [k for k in missing if re.search(r"\.\d+\.", k)]
    if in_layers:
        raise UsageError(f"{ref}: the checkpoint is missing {len(in_layers)} layer weight(s), e.g. {in_layers[0]}; "
                         "the weights file is incomplete")
    if missing:
        warn(f"{ref}: not in the checkpoint, initialized randomly: {', '.join(missing[:4])}"
             + (" ..." if len(missing) > 4 else ""))


def load_model(
    ref: str,
    *,
    dtype: str = "auto",
    device: str = "auto",
    trust_remote_code: bool = False,
    task: str = "auto",
    attn_implementation: str | None = None,
    tokenizer: str | None = None,
    device_map: str | None = None,
    max_memory: str | None = None,
    rewrites: str | None = None,
) -> LoadedModel:
    """Load MODEL for headtool; bad references are a UsageError with one clear line.

    max_memory ('0=70GiB,cpu=120GiB'): accelerate's per-device caps for device_map; what does
    not fit goes to disk (offload folder in headtool's cache). rewrites: the command that will
    rewrite the weights ('prune', ...): a quantized checkpoint is refused from its config, before
    its quantization package is needed to load it."""
    if max_memory and not device_map:
        raise UsageError("--max-memory caps devices for --device-map: add --device-map auto")
    caps = parse_max_memory(max_memory) if max_memory else None
    path, source = resolve_ref(ref)
    config = load_config(path, source, trust_remote_code)
    if rewrites:
        refuse_quantized(config, ref, rewrites)
        refuse_latent_surgery(config, ref, rewrites)
    adapter = adapter_for(config)
    task = pick_task(config, task)
    torch_dtype = resolve_dtype(dtype)
    dev = resolve_device(device)
    kwargs: dict[str, Any] = {"dtype": torch_dtype}
    if device_map:
        # accelerate places layers across GPUs / CPU (offload) for models larger than one device
        if importlib.util.find_spec("accelerate") is None:
            raise UsageError("--device-map needs the accelerate package: pip install accelerate")
        kwargs["device_map"] = device_map
        kwargs["offload_folder"] = offload_folder()
        if caps:
            kwargs["max_memory"] = caps
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        if getattr(config, MLA_KEY, None) and not trust_remote_code:
            model, loading_info = load_latent_folder(path, config, task, output_loading_info=True, **kwargs)
        elif getattr(config, LAYOUT_KEY, None) and not trust_remote_code:
            model, loading_info = load_headtool_folder(path, config, task, output_loading_info=True, **kwargs)
        else:
            model, loading_info = auto_class(task).from_pretrained(
                path, config=config, trust_remote_code=trust_remote_code, output_loading_info=True, **kwargs
            )
        _check_missing(ref, sorted(loading_info.get("missing_keys") or ()))
    except (UsageError, HeadtoolError):
        raise
    except pickle.UnpicklingError as e:
        raise UsageError(f"{ref}: the pickled weights hold more than tensors and are refused (loaded with "
                         "weights_only); convert them to safetensors from a trusted copy") from e
    except SafetensorError as e:
        raise UsageError(f"{ref}: cannot load weights: the safetensors file is corrupt or truncated "
                         f"({str(e).splitlines()[0]})") from e
    except OSError as e:
        raise UsageError(f"{ref}: cannot load weights: {str(e).splitlines()[0]}") from e
    except (ValueError, RuntimeError, KeyError, ImportError) as e:  # ImportError: a package the checkpoint needs
        raise UsageError(f"{ref}: cannot load the model: {str(e).splitlines()[0]}") from e
    finally:
        hf_logging.set_verbosity(verbosity)
    if not device_map:
        model.to(dev)
    model.eval()
    tok = load_tokenizer(tokenizer or path, trust_remote_code)
    return LoadedModel(model=model, tokenizer=tok, adapter=adapter, ref=ref, path=path,
                       source=source, task=task, _fingerprint=_fingerprint_from_files(model, path))


def _fingerprint_from_files(model, path: str) -> str | None:
    """The checkpoint's fingerprint read from its files, for a model loaded in float16: its values,
    rounded twice (to float16, then to the fingerprint's bfloat16), differ from the same checkpoint
    loaded in float32 or bfloat16, so that a score document made at one precision was refused at the
    other as 'made for another model'. None: the loaded model's own fingerprint serves."""
    if next(model.parameters()).dtype != torch.float16 or not any(Path(path).glob("*.safetensors")):
        return None
    try:
        return folder_fingerprint(path)
    except UsageError:
        return None


def model_from_object(model, tokenizer=None, ref: str = "<memory>") -> LoadedModel:
    """Wrap an in-memory transformers model (library use, recipes)."""
    return LoadedModel(model=model, tokenizer=tokenizer, adapter=adapter_for(model.config), ref=ref,
                       path=ref, source="memory", task=pick_task(model.config))
