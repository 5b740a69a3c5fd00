"""Options that many commands share, declared once and injected into command signatures.

Typer reads a command's options from its signature; the decorators below add the model-loading
and data options to a command and hand it one `LoadOptions` / `DataSpec` object instead,
so every command spells them the same way and none repeats the list.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from typing import Annotated, Any, Callable, Optional

import typer
from rich.markup import escape

from ..model.placement import LoadOptions
from ..optionspec import Opt, options_of
from ..workflows.requests import MODEL_HELP as MODEL_HELP
from ..workflows.requests import SEQUENTIAL_HELP

_UNSET = object()
PACKED = ("load", "data_spec", "fields")  # what the decorators hand the command instead of its options


def option_param(opt: Opt, *, default_override: Any = _UNSET) -> inspect.Parameter:
    """One declared option (headtool.optionspec) as a Typer parameter: flags, help, panel, default."""
    t = opt.type
    if isinstance(t, tuple):  # e.g. str | DataSpec: the command line gives the string form
        t = str
    if typing.get_origin(t) is tuple:
        t = list[typing.get_args(t)[0]]
    default = opt.default if default_override is _UNSET else default_override
    if default is dataclasses.MISSING:
        default = ...
    if opt.optional or default is None:
        t = Optional[t]
    m = opt.meta
    help_text = escape(m["help"])  # "[default: 2e-4; ...]" is text, not rich markup (it vanished from --help)
    if m["positional"]:
        info = typer.Argument(help=help_text, show_default=m["show_default"])
    else:
        info = typer.Option(*opt.flags, help=help_text, rich_help_panel=m["panel"], show_default=m["show_default"])
    if isinstance(default, tuple):
        default = list(default) or ...
    return inspect.Parameter(opt.name, inspect.Parameter.KEYWORD_ONLY, default=default,
                             annotation=Annotated[t, info])


def _data_params(required: bool, default_source: str | None) -> list[inspect.Parameter]:
    from ..data.sources import DataSpec

    params = []
    for opt in options_of(DataSpec):
        params.append(option_param(opt, default_override=(... if required else default_source)
                                   if opt.name == "source" else _UNSET))
    return params


def _inject(fn: Callable, extra: list[inspect.Parameter], pack: Callable[[dict], dict], first: bool = False
            ) -> Callable:
    """Add `extra` parameters to fn's command-line signature; the wrapper packs their values with
    `pack` into the keyword arguments fn really takes (which stay out of the CLI signature)."""
    sig = inspect.signature(fn, eval_str=True)  # resolve string annotations in fn's module
    params = [p for p in sig.parameters.values()]
    names = {p.name for p in params}
    added = [p for p in extra if p.name not in names]
    new = added + params if first else params + added
    extra_names = {p.name for p in extra} - names

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        taken = {n: kwargs.pop(n) for n in list(kwargs) if n in extra_names}
        kwargs.update(pack(taken))
        return fn(*args, **kwargs)

    # keep the packed parameter out of the CLI signature
    # Typer passes everything by keyword: keyword-only lets required options follow defaulted ones
    wrapper.__signature__ = sig.replace(parameters=[p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
                                                    for p in new if p.name not in PACKED])
    return wrapper


_MODEL_PARAMS = [option_param(o) for o in options_of(LoadOptions)]


def model_options(fn: Callable) -> Callable:
    """Add --dtype/--device/--trust-remote-code; the command receives `load: LoadOptions`."""
    return _inject(fn, _MODEL_PARAMS, lambda t: {"load": LoadOptions(**t)})


def data_options(required: bool = False, default: str | None = "builtin:pydoc") -> Callable:
    """Add the data options; the command receives `data_spec: DataSpec | None`."""

    def deco(fn: Callable) -> Callable:
        def pack(t: dict) -> dict:
            from ..data.sources import DataSpec

            if t.get("source") is None:
                return {"data_spec": None}
            return {"data_spec": DataSpec(**t)}

        return _inject(fn, _data_params(required, default), pack)

    return deco


def given_options(ctx: typer.Context, names: set[str]) -> list[str]:
    """The long flags of the parameters among `names` that the command line set (its parameter
    source, so an option typed with its default value counts as given too)."""
    flags = []
    for param in ctx.command.params:
        source = ctx.get_parameter_source(param.name) if param.name in names else None
        if source is not None and source.name not in ("DEFAULT", "DEFAULT_MAP"):
            flags.append(next((o for o in param.opts if o.startswith("--")), param.opts[0]))
    return flags


def command_inputs(model: str, data) -> list[str]:
    """What a command reads that an output of it must never land on: the model, and each source of its
    --data (`data`: a DataSpec or None); io.files.check_output_path keeps those that are local paths."""
    from ..data.sources import parse_sources

    return [model, *(part.source for part in parse_sources(data.source))] if data is not None else [model]


def data_option_names() -> set[str]:
    """The parameter names of the data options (`data_options`)."""
    from ..data.sources import DataSpec

    return {o.name for o in options_of(DataSpec)}


SequentialOpt = Annotated[bool, typer.Option("--sequential", help=SEQUENTIAL_HELP, rich_help_panel="Model")]


def command_options(request: type, *, nested: dict[str, type] | None = None, skip: tuple[str, ...] = ()) -> Callable:
    """Add a request's declared options (headtool.workflows.requests) to a command; the command
    receives `fields`, a dict of those values ready for `request(**fields, ...)`.

    nested: fields of the request that are dataclasses of their own (heal's `opts`): their
    options are added too and packed into an instance. skip: names the command declares itself.
    """
    nested = nested or {}
    own = [o for o in options_of(request) if o.name not in skip]
    inner = {name: [o for o in options_of(cls) if o.name not in skip] for name, cls in nested.items()}
    params = [option_param(o) for o in own] + [option_param(o) for opts in inner.values() for o in opts]

    def pack(t: dict) -> dict:
        fields = {o.name: t[o.name] for o in own}
        for name, opts in inner.items():
            fields[name] = {o.name: t[o.name] for o in opts}
        for k, v in fields.items():
            if isinstance(v, list):
                fields[k] = tuple(v)
        return {"fields": fields}

    def deco(fn: Callable) -> Callable:
        return _inject(fn, params, pack, first=True)

    return deco


def _stdout_for_json(value: bool) -> bool:
    """--json with stdout closed is refused as the command line is read, before any work."""
    if value:
        from ..console import result_stream

        result_stream("--json", "leave --json out")
    return value


JsonOpt = Annotated[bool, typer.Option("--json", help="print the result as JSON on stdout", callback=_stdout_for_json)]
