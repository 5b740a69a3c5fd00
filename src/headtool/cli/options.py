"""Options that many commands share, declared once and injected into command signatures.

Typer reads a command's options from its signature; the decorators below add the model-loading
and data options to a command and hand it one `LoadOptions` / `DataSpec` object instead,
so every command spells them the same way and none repeats the list.
"""
from __future__ import annotations

import functools
import inspect
from typing import Annotated, Callable, Optional

import typer

from ..model.placement import LoadOptions

MODEL_HELP = ("a local Hugging Face folder, a .gguf file, a packaged model "
              "(smollm2-135m, all-minilm-l6-v2) or a hub id")


_MODEL_PARAMS = [
    inspect.Parameter("dtype", inspect.Parameter.KEYWORD_ONLY, default="auto", annotation=Annotated[
        str, typer.Option("--dtype", help="auto | float32 | bfloat16 | float16", rich_help_panel="Model")]),
    inspect.Parameter("device", inspect.Parameter.KEYWORD_ONLY, default="auto", annotation=Annotated[
        str, typer.Option("--device", help="auto | cpu | cuda | mps", rich_help_panel="Model")]),
    inspect.Parameter("trust_remote_code", inspect.Parameter.KEYWORD_ONLY, default=False, annotation=Annotated[
        bool, typer.Option("--trust-remote-code", help="run the model's own code (off by default)",
                           rich_help_panel="Model")]),
    inspect.Parameter("device_map", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Annotated[
        Optional[str], typer.Option("--device-map", help="'auto': spread a model larger than one device over "
                                    "GPUs/CPU with accelerate (offload)", rich_help_panel="Model")]),
    inspect.Parameter("max_memory", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Annotated[
        Optional[str], typer.Option("--max-memory", help="with --device-map: caps per device, e.g. "
                                    "'0=70GiB,cpu=200GiB' (the rest is offloaded to disk)",
                                    rich_help_panel="Model")]),
]


def _data_params(required: bool, default_source: str | None) -> list[inspect.Parameter]:
    P, K = inspect.Parameter, inspect.Parameter.KEYWORD_ONLY
    panel = "Data"
    data_default = ... if required else default_source
    return [
        P("data", K, default=data_default, annotation=Annotated[Optional[str], typer.Option(
            "--data", help="text source: .txt/.jsonl/.json/.csv/.parquet file, save_to_disk folder, "
            "hub name[:config], '-' for stdin, or builtin:pydoc", rich_help_panel=panel)]),
        P("split", K, default=None, annotation=Annotated[Optional[str], typer.Option(
            "--split", help="dataset split (hub / save_to_disk)", rich_help_panel=panel)]),
        P("text_column", K, default=None, annotation=Annotated[Optional[str], typer.Option(
            "--text-column", help="text column (auto-detected when obvious)", rich_help_panel=panel)]),
        P("label_column", K, default=None, annotation=Annotated[Optional[str], typer.Option(
            "--label-column", help="label column: switches to classification", rich_help_panel=panel)]),
        P("seq_len", K, default=128, annotation=Annotated[int, typer.Option(
            "--seq-len", help="tokens per block", rich_help_panel=panel)]),
        P("batch_size", K, default=4, annotation=Annotated[int, typer.Option(
            "--batch-size", help="blocks per batch", rich_help_panel=panel)]),
        P("max_samples", K, default=None, annotation=Annotated[Optional[int], typer.Option(
            "--max-samples", help="number of blocks (or examples) to use", rich_help_panel=panel)]),
        P("num_tokens", K, default=None, annotation=Annotated[Optional[int], typer.Option(
            "--num-tokens", help="cap the data at about this many tokens", rich_help_panel=panel)]),
        P("seed", K, default=0, annotation=Annotated[int, typer.Option(
            "--seed", help="seed for sampling and masking", rich_help_panel=panel)]),
        P("skip_samples", K, default=0, annotation=Annotated[int, typer.Option(
            "--skip-samples", help="skip this many blocks first (held-out data disjoint from calibration)",
            rich_help_panel=panel)]),
    ]


def _inject(fn: Callable, extra: list[inspect.Parameter], pack: Callable[[dict], dict]) -> Callable:
    sig = inspect.signature(fn, eval_str=True)  # resolve string annotations in fn's module
    params = [p for p in sig.parameters.values()]
    names = {p.name for p in params}
    new = params + [p for p in extra if p.name not in names]
    extra_names = {p.name for p in extra} - names

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        taken = {n: kwargs.pop(n) for n in list(kwargs) if n in extra_names}
        kwargs.update(pack(taken))
        return fn(*args, **kwargs)

    # keep the packed parameter out of the CLI signature
    wrapper.__signature__ = sig.replace(parameters=[p for p in new if p.name not in ("load", "data_spec")])
    return wrapper


def model_options(fn: Callable) -> Callable:
    """Add --dtype/--device/--trust-remote-code; the command receives `load: LoadOptions`."""
    return _inject(fn, _MODEL_PARAMS, lambda t: {"load": LoadOptions(**t)})


def data_options(required: bool = False, default: str | None = "builtin:pydoc") -> Callable:
    """Add the data options; the command receives `data_spec: DataSpec | None`."""

    def deco(fn: Callable) -> Callable:
        def pack(t: dict) -> dict:
            from ..data.sources import DataSpec

            if t.get("data") is None:
                return {"data_spec": None}
            return {"data_spec": DataSpec(source=t["data"], split=t["split"], text_column=t["text_column"],
                                          label_column=t["label_column"], seq_len=t["seq_len"],
                                          batch_size=t["batch_size"], max_samples=t["max_samples"],
                                          num_tokens=t["num_tokens"], seed=t["seed"],
                                          skip_samples=t["skip_samples"])}

        return _inject(fn, _data_params(required, default), pack)

    return deco


SequentialOpt = Annotated[bool, typer.Option(
    "--sequential", help="models larger than the device: keep the model on CPU and move one layer at a "
                         "time to --device for calibration (scoring and --eval-data run on CPU)",
    rich_help_panel="Model")]


JsonOpt = Annotated[bool, typer.Option("--json", help="print the result as JSON on stdout")]
