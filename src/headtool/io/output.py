"""Write output folders of prune / convert-gqa: whole or not at all, never over the input.

A folder is written into a temporary folder beside the target and renamed at the end, so an
interrupted run leaves nothing half-written. It holds safetensors weights (sharded above the
shard size, with an index), the config (the family's own when it can express the new heads,
else the per-layer table plus a self-contained modeling file named in `auto_map`), the input's
tokenizer files and generation config, `headtool.json` (what was done and why) and a README
model card.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..arch import LAYOUT_KEY, RESIZE_SPEC_KEY
from ..errors import HeadtoolError, UsageError
from ..templates import modeling_file_source
from ..templates.modeling_headtool_mla import MLA_KEY
from ..version import __version__
from .files import converted_from, inside, open_up, probe_writable, safetensors_os_errors
from .provenance import ORIGINAL_KEPT, ORIGINAL_SOURCE, RECORD, card_lines
from .sizes import parse_size

FORMAT = "headtool.surgery/1"
MODELING_FILE = "modeling_headtool.py"
STANDARD = "standard"
REMOTE_CODE = "headtool-remote-code"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt",
                   "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json", "spiece.model",
                   "sentencepiece.bpe.model", "chat_template.jinja", "chat_template.json")
# named chat templates beside the default one (transformers writes one NAME.jinja each: tool_use, rag, ...)
CHAT_TEMPLATE_DIR = "additional_chat_templates"
# auto classes whose mapping may name the saved model's class (most specific first)
_AUTO_CLASSES = ("AutoModelForCausalLM", "AutoModelForMaskedLM", "AutoModelForSequenceClassification",
                 "AutoModelForTokenClassification", "AutoModelForQuestionAnswering", "AutoModelForPreTraining",
                 "AutoModel")


def _local_dir(path: str | os.PathLike | None) -> Path | None:
    if not path:
        return None
    p = Path(os.path.expanduser(str(path)))
    return p.resolve() if p.is_dir() else None


def check_output_target(out: str | os.PathLike, source_path: str | os.PathLike | None, overwrite: bool) -> Path:
    """The resolved output folder, or a UsageError naming what is wrong (call before any work)."""
    target = Path(os.path.expanduser(str(out))).resolve()
    src = _local_dir(source_path)
    if src is not None and inside(target, src):
        raise UsageError(f"-o {out}: the output lies inside the input model folder {src}; "
                         "choose a folder outside it (the input is never modified)")
    if target.exists() or target.is_symlink():
        if not target.is_dir():
            raise UsageError(f"-o {out}: exists and is not a folder")
        if not overwrite:
            raise UsageError(f"-o {out}: the folder already exists; pass --overwrite to replace it")
        if src is not None and inside(src, target):
            raise UsageError(f"-o {out}: replacing it would delete the input model folder {src}")
        origin = converted_from(src)  # a .gguf MODEL: its copy in the cache is `src`, the user's file is here
        if origin is not None and inside(origin, target):
            raise UsageError(f"-o {out}: replacing it would delete the input model {origin}")
        if any(target.iterdir()) and not ((target / "config.json").exists() or (target / "headtool.json").exists()):
            raise UsageError(f"-o {out}: --overwrite replaces model folders only, and this non-empty folder "
                             "holds no model (no config.json); choose another folder")
    for parent in target.parents:
        if parent.exists():
            if not parent.is_dir():
                raise UsageError(f"-o {out}: {parent} is not a folder")
            probe_writable(parent, f"-o {out}")
            break
    return target


def _transformers_class(model) -> type:
    """The transformers class a (possibly headtool-subclassed) model is built from."""
    for cls in type(model).__mro__:
        if cls.__module__.startswith("transformers.models."):
            return cls
    return type(model)


def _auto_map(model) -> dict[str, str]:
    """auto_map entries of the modeling file: the model's own class and its base model."""
    import transformers

    cls = _transformers_class(model)
    config_type = type(model.config)
    out: dict[str, str] = {}
    for auto_name in _AUTO_CLASSES:
        mapping = getattr(transformers, auto_name)._model_mapping
        target = mapping[config_type] if config_type in mapping else None
        if target is None:
            continue
        if target is cls or (auto_name == "AutoModel" and target is type(model.base_model)):
            out[auto_name] = target.__name__
    if not out:
        raise HeadtoolError(f"no auto class loads {cls.__name__}; cannot write a remote-code folder")
    return out


def _copy_inputs(source, tokenizer, folder: Path) -> list[str]:
    """Tokenizer files (named chat templates included) and generation config of the input, copied as
    they are."""
    src = _local_dir(getattr(source, "path", None))
    copied = []
    if src is not None:
        for name in TOKENIZER_FILES + ("generation_config.json",):
            if (src / name).is_file():
                shutil.copy2(src / name, folder / name)
                copied.append(name)
        if (src / CHAT_TEMPLATE_DIR).is_dir():
            shutil.copytree(src / CHAT_TEMPLATE_DIR, folder / CHAT_TEMPLATE_DIR)
            copied.append(CHAT_TEMPLATE_DIR)
    if tokenizer is not None and not any(n in copied for n in TOKENIZER_FILES):
        tokenizer.save_pretrained(folder)
    return copied


def _fix_config(folder: Path, model, kind: str) -> None:
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    cls = _transformers_class(model)
    cfg["architectures"] = [cls.__name__]
    cfg.pop("auto_map", None)
    if kind == STANDARD:
        cfg.pop(LAYOUT_KEY, None)
        cfg.pop(RESIZE_SPEC_KEY, None)
        (folder / MODELING_FILE).unlink(missing_ok=True)
    else:
        names = _auto_map(model)
        exported = {auto: f"Headtool{base}" for auto, base in names.items()}
        (folder / MODELING_FILE).write_text(modeling_file_source(
            {exported[a]: names[a] for a in names}, latent=bool(cfg.get(MLA_KEY))))
        cfg["auto_map"] = {auto: f"{MODELING_FILE[:-3]}.{exp}" for auto, exp in exported.items()}
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def model_card(meta: dict, kind: str, card_table: str, auto_name: str) -> str:
    op = meta.get("operation", "surgery")
    src = meta.get("source", {})
    load = (f"from transformers import {auto_name}\n"
            f"model = {auto_name}.from_pretrained(\"path/to/this/folder\""
            + (", trust_remote_code=True)" if kind == REMOTE_CODE else ")"))
    why = ("The heads per layer are expressed by the family's standard config: this folder loads in "
           "every runtime that reads this family." if kind == STANDARD else
           f"The heads per layer differ from what the family's standard config can express, so the "
           f"config carries a per-layer table (`{LAYOUT_KEY}`) and `{MODELING_FILE}` builds the model "
           "(it needs only torch and transformers): load with `trust_remote_code=True`. Without it transformers "
           "builds the family's stock class, which stops on a size mismatch: never pass "
           "`ignore_mismatched_sizes=True`, which would re-initialise the resized projections at random.")
    if op == "convert-mla" or meta.get("kv_rank") is not None:  # also a recipe with a convert_mla step
        rotary = meta.get("rope_dim") != 0
        holds = ("one latent vector and one shared rotary key" if rotary else
                 "one latent vector (the family's positions are learned, so there is no rotary key)")
        why = (f"Its attention layers are multi-head latent attention: the KV cache holds {holds} per token and "
               f"layer. `{MODELING_FILE}` builds the family's model with "
               f"those layers from the table `{MLA_KEY}` in config.json (it needs only torch and transformers): "
               "load with `trust_remote_code=True`. A stock DeepSeek-V2/V3 config cannot express the layout "
               "exactly: DeepSeek normalizes the latent (RMSNorm, `kv_a_layernorm`) before the up-projection, "
               "which no weights can undo, and "
               + ("its rotary key turns with the frequencies of its own `qk_rope_head_dim`, whereas these rotary "
                  "slots keep the planes of the original heads." if rotary else
                  "its layers are Llama's (RMSNorm, gated MLP, RoPE), not this family's.")
               + (" Each head's rotary query is stored as a map of that head's own query (`q_rope_proj`, "
                  "rope_dim x head_dim weights), where DeepSeek's q_proj would hold it multiplied out (rope_dim x "
                  "hidden)." if rotary else ""))
    lines = [
        "---", "library_name: transformers", "tags:", "- headtool", f"- {op}", "---", "",
        f"# {op} of {src.get('ref') or src.get('path') or 'a model'}", "",
        f"Written by headtool {__version__} (`{op}`). Config kind: **{kind}**. {why}", "",
        "```python", load, "```", "",
    ]
    if card_table:
        lines += ["## Summary", "", card_table.strip(), ""]
    lines += card_lines(meta.get(RECORD))
    # kept_heads only where the operation chose heads (prune, convert-gqa's order): not for heal or convert-mla
    kept = (", and the query heads kept in every layer (`kept_heads`: indices of the source model)"
            if meta.get("kept_heads") is not None else "")
    if meta.get(ORIGINAL_KEPT) is not None:  # the source was itself pruned (or converted) by headtool
        first = meta.get(ORIGINAL_SOURCE) or {}
        kept += (f"; the source was itself cut from {first.get('ref') or first.get('path') or 'another model'}, "
                 f"whose indices the same heads have under `{ORIGINAL_KEPT}`")
    lines += [f"`headtool.json` records the source fingerprint, the method and options{kept}.", ""]
    return "\n".join(lines)


def output_kind(model) -> str:
    """'standard' when the family's own config expresses the heads, else headtool's remote code."""
    remote = getattr(model.config, LAYOUT_KEY, None) or getattr(model.config, MLA_KEY, None)
    return REMOTE_CODE if remote else STANDARD


@contextmanager
def _sigint_held():
    """Hold Ctrl-C (SIGINT) back for a short critical step and deliver it right after.

    A KeyboardInterrupt can otherwise land between creating a folder and recording it for
    cleanup, or between the two renames that swap an output into place. Only the main thread
    receives KeyboardInterrupt (and may set handlers); elsewhere this does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler if previous is None else previous)
        if held:
            signal.raise_signal(signal.SIGINT)  # now, with the handler that was in place


@contextmanager
def temp_folder(target: Path):
    """A hidden temporary folder beside `target`, removed again if anything fails (Ctrl-C
    included: the folder is created and recorded, and removed, with SIGINT held back)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp: Path | None = None
    try:
        with _sigint_held():
            tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        yield tmp
    except BaseException:
        if tmp is not None:
            with _sigint_held():
                shutil.rmtree(tmp, ignore_errors=True)
        raise
    if tmp.exists():  # not moved into place
        shutil.rmtree(tmp, ignore_errors=True)


def finish_folder(tmp: Path, target: Path, *, model, source, tokenizer, meta: dict, card_table: str,
                  kind: str) -> dict[str, Any]:
    """Config fix-up, tokenizer, headtool.json and card into `tmp` (weights and config.json
    already there), then the atomic move to `target`."""
    _fix_config(tmp, model, kind)
    _copy_inputs(source, tokenizer, tmp)
    # the source as the user named it (`ref`: a packaged name, hub id or path as typed), then the
    # folder it resolved to (`path`: for GGUF and packaged models a converted copy in the cache)
    doc = {"format": FORMAT, **meta,
           "source": {"ref": getattr(source, "ref", None), "path": getattr(source, "path", None),
                      "fingerprint": getattr(source, "fingerprint", None), **meta.get("source", {})},
           "config_kind": kind, "headtool_version": __version__}
    (tmp / "headtool.json").write_text(json.dumps(doc, indent=2, allow_nan=False) + "\n")
    (tmp / "README.md").write_text(model_card(doc, kind, card_table, _auto_name(model)))
    files = sorted(p.name for p in tmp.iterdir())
    open_up(tmp)
    _replace(tmp, target)
    return {"path": str(target), "config_kind": kind, "files": files}


def write_output(out: str | os.PathLike, *, model, tokenizer, source, meta: dict, card_table: str = "",
                 overwrite: bool = False, shard_size: str | int = "5GB") -> dict[str, Any]:
    """Write `model` (already resized in memory) as a folder at `out`, atomically.

    `source` is the LoadedModel of the input (its reference as typed, resolved path and
    fingerprint go into headtool.json, the reference names it in the model card; its tokenizer
    files and generation config are copied). Returns {"path", "config_kind", "files"}.
    """
    target = check_output_target(out, getattr(source, "path", None), overwrite)
    shard_bytes = parse_size(shard_size)
    if shard_bytes < 1:
        raise UsageError(f"--shard-size must be positive (got {shard_size!r})")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own progress goes to stderr; no tqdm bars
    with temp_folder(target) as tmp:
        with safetensors_os_errors(target.parent):
            model.save_pretrained(tmp, max_shard_size=shard_bytes)
        return finish_folder(tmp, target, model=model, source=source, tokenizer=tokenizer, meta=meta,
                             card_table=card_table, kind=output_kind(model))


def _auto_name(model) -> str:
    """The auto class that loads this model's class (for the card's example)."""
    try:
        return next(iter(_auto_map(model)))
    except HeadtoolError:
        return "AutoModel"


def _replace(tmp: Path, target: Path) -> None:
    """Move the finished folder into place; an old folder (with --overwrite) goes only then.

    Ctrl-C is held back until the swap is done, so that it never leaves the old folder parked
    in a hidden `.NAME.old-*` folder with nothing at `target`."""
    with _sigint_held():
        _swap(tmp, target)


def _swap(tmp: Path, target: Path) -> None:
    if target.exists():
        trash = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
        os.replace(target, trash / "old")
        try:
            os.replace(tmp, target)
        except BaseException:
            os.replace(trash / "old", target)
            raise
        finally:
            shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(tmp, target)
