"""Reading a model's config: refusing unrequested remote code, offline hub ids, and headtool's
own per-layer head tables (built without running the folder's modeling file)."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Mapping

from ..arch import LAYOUT_KEY, RESIZE_SPEC_KEY, adapter_for
from ..errors import UsageError
from .latent import MLA_KEY
from .refs import _offline, packaged_hint


def quantization_method(config) -> str | None:
    """The checkpoint's quantization method ('bitsandbytes', 'gptq', ...; 'quantized' when its
    config does not name one), None for plain float weights."""
    quant = getattr(config, "quantization_config", None)
    if not quant:
        return None
    method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
    return str(getattr(method, "value", method) or "quantized")


def refuse_quantized(config, ref: str, what: str) -> None:
    """Head surgery slices and refits plain weight matrices: a quantized one packs its values with
    scales and zero points per group, which slicing would leave behind (a broken checkpoint)."""
    method = quantization_method(config)
    if method:
        raise UsageError(f"{ref}: a quantized checkpoint ({method}); {what} rewrites plain weights and would "
                         "leave their scales behind: give a dequantized (float) copy, and quantize the result")


def load_config(path: str, source: str, trust_remote_code: bool = False):
    from transformers import AutoConfig

    os.environ.setdefault("HF_HUB_ETAG_TIMEOUT", "10")
    os.environ.setdefault("HF_HUB_DOWNLOAD_TIMEOUT", "10")
    if source == "hub" and _offline():
        raise UsageError(f"model {path!r} is not a local folder and the hub is offline (HF_HUB_OFFLINE=1); "
                         f"download it first or give a local path{packaged_hint(path)}")
    local = Path(path) / "config.json"
    if local.exists():
        try:
            raw = json.loads(local.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise UsageError(f"{local}: config.json is not valid JSON ({e})") from e
        if MLA_KEY in raw and not trust_remote_code:
            # headtool's latent-attention outputs: built with headtool's own copy of their modeling file
            return config_from_latent_folder(path, raw)
        if raw.get("auto_map") and LAYOUT_KEY not in raw and not trust_remote_code:
            files = sorted({str(v).split(".")[0] + ".py" for v in raw["auto_map"].values() if isinstance(v, str)})
            raise UsageError(f"{path}: config.json names its own code ({', '.join(files) or 'auto_map'}), "
                             "which is not run by default; pass --trust-remote-code if you trust it")
        if LAYOUT_KEY in raw and not trust_remote_code:
            # headtool's own per-layer outputs: build them with headtool's resize, no remote code.
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
                             f"{str(e).splitlines()[0]}{packaged_hint(path)}") from e
        raise UsageError(f"{path}: cannot read the config: {str(e).splitlines()[0]}") from e


def read_layout(raw: Mapping, where: str) -> dict:
    """The per-layer table of a headtool config, checked (a hand-edited table is bad input)."""
    layout = raw.get(LAYOUT_KEY)
    try:
        nq = [int(x) for x in layout["num_heads"]]
        nkv = [int(x) for x in layout["num_kv_heads"]]
        hd = int(layout["head_dim"])
    except (TypeError, KeyError, ValueError) as e:
        raise UsageError(f"{where}: {LAYOUT_KEY} must hold num_heads, num_kv_heads (lists) and head_dim") from e
    sizes = layout.get("group_sizes")
    try:
        sizes = [None] * len(nq) if sizes is None else [None if g is None else [int(x) for x in g] for g in sizes]
    except (TypeError, ValueError) as e:
        raise UsageError(f"{where}: {LAYOUT_KEY}: group_sizes must be a list of per-layer lists (or null)") from e

    def consistent(q: int, k: int, g: list[int] | None) -> bool:
        if g is None:
            return k >= 1 and q >= k and not q % k
        return len(g) == k and sum(g) == q and min(g) >= 1

    if len(nq) != len(nkv) or len(sizes) != len(nq) or hd < 1 or \
            not all(consistent(q, k, g) for q, k, g in zip(nq, nkv, sizes)):
        raise UsageError(f"{where}: {LAYOUT_KEY} is inconsistent (query heads {nq}, KV heads {nkv}"
                         + (f", KV group sizes {sizes})" if any(sizes) else ")"))
    out = {"num_heads": nq, "num_kv_heads": nkv, "head_dim": hd}
    if any(g is not None for g in sizes):
        out["group_sizes"] = sizes
    return out


def config_from_headtool_folder(path: str | Path, raw_config: Mapping):
    """The config of a headtool output folder with a per-layer head table (no remote code run)."""
    where, raw = _output_config(path, raw_config)
    layout = read_layout(raw, where)
    raw[LAYOUT_KEY] = layout
    if RESIZE_SPEC_KEY not in raw:
        raise UsageError(f"{where}: {LAYOUT_KEY} without {RESIZE_SPEC_KEY}; not a headtool output")
    return _family_config(raw, where, LAYOUT_KEY, len(layout["num_heads"]))


def _output_config(path: str | Path, raw_config: Mapping) -> tuple[str, dict]:
    """Where an output folder's config.json is (for messages) and a copy of it, its family known."""
    from transformers import CONFIG_MAPPING

    where = str(Path(path) / "config.json")
    raw = dict(raw_config)
    if raw.get("model_type") not in CONFIG_MAPPING:
        raise UsageError(f"{where}: unknown model_type {raw.get('model_type')!r}")
    return where, raw


def _family_config(raw: dict, where: str, table_key: str, table_layers: int):
    """The family's own config class built from `raw` (a headtool output's config.json), its
    per-layer table (`table_key`, `table_layers` rows) checked against the model's layers."""
    from transformers import CONFIG_MAPPING

    try:
        config = CONFIG_MAPPING[raw["model_type"]].from_dict(raw)
    except Exception as e:  # noqa: BLE001 - config validators raise many types
        raise UsageError(f"{where}: cannot read the config: {str(e).splitlines()[0]}") from e
    layers = adapter_for(config).num_layers(config)
    if table_layers != layers:
        raise UsageError(f"{where}: {table_key} lists {table_layers} layers, the model has {layers}")
    return config


def config_from_latent_folder(path: str | Path, raw_config: Mapping):
    """The config of a convert-mla output folder (no remote code run), its table checked."""
    where, raw = _output_config(path, raw_config)
    spec = raw.get(MLA_KEY)
    keys = ("layers_path", "attention", "num_heads", "qk_nope_dim", "v_head_dim", "rope_dim", "rotary_dim",
            "kv_rank", "rope_planes", "scaling", "hidden_size")
    if not isinstance(spec, dict) or any(k not in spec for k in keys) or \
            len(spec["kv_rank"]) != len(spec["rope_planes"]):
        raise UsageError(f"{where}: {MLA_KEY} must hold {', '.join(keys)} (one kv_rank and rope_planes per layer)")
    return _family_config(raw, where, MLA_KEY, len(spec["kv_rank"]))
