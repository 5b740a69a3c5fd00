"""Options declared once, on the fields of a request dataclass.

A step's options (score, prune, convert-gqa, eval, heal) live in one frozen dataclass of its
workflow; each field carries its help text, flag, allowed values and range as metadata made by
:func:`option`. The command-line options (`headtool.cli.options`) and the recipe keys
(`headtool.workflows.recipe_schema`) are both derived from these fields, and both check values
with :func:`problem`, so a new option is one edit and the CLI and recipes cannot drift apart.

Torch-free: the CLI reads these declarations at start-up.
"""
from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, Callable, Iterator

# Where a field is set in a recipe: a key of the step ("step"), a whole-recipe key ("recipe":
# model loading, output and writing), or nowhere ("cli": only meaningful for one command run;
# each such field says why in `why`).
STEP, RECIPE, CLI_ONLY = "step", "recipe", "cli"


def option(default: Any = dataclasses.MISSING, help: str = "", *, flags: tuple[str, ...] = (),
           panel: str | None = None, choices: tuple[str, ...] = (), multiple: bool = False,
           min: float | None = None, above: float | None = None, below: float | None = None,
           max: float | None = None, where: str = STEP, why: str = "", factory: Any = None, positional: bool = False,
           show_default: bool | str = True, parse: Callable[[Any], Any] | None = None) -> Any:
    """A dataclass field with the metadata the CLI and the recipe schema derive from.

    flags: the CLI spelling ("--x", "-x" or "--on/--off"); default "--<name with dashes>".
    choices: allowed values (multiple: a comma list of them). min and max (inclusive), above and
    below (exclusive): the range of a number. where: STEP, RECIPE or CLI_ONLY (then `why` says why).
    parse: for a value that the command line gives as text (a str | number field), the function
    that reads it, raising ValueError with what is allowed; the recipe check runs it too.
    """
    meta = {"help": help, "flags": flags, "panel": panel, "choices": tuple(choices), "multiple": multiple,
            "min": min, "above": above, "below": below, "max": max, "where": where, "why": why, "positional": positional,
            "show_default": show_default, "parse": parse, "option": True}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass(frozen=True)
class Opt:
    """One declared option: the field's name, resolved type and metadata."""

    name: str
    type: Any  # the base type (int, float, str, bool), without None
    optional: bool  # None is allowed
    default: Any  # dataclasses.MISSING when required
    meta: dict[str, Any]

    @property
    def flags(self) -> tuple[str, ...]:
        return self.meta["flags"] or ("--" + self.name.replace("_", "-"),)

    @property
    def flag(self) -> str:
        """The long flag as users read it in messages (--keep-best for --keep-best/--keep-last)."""
        return next(f for f in self.flags if f.startswith("--")).split("/")[0]

    @property
    def where(self) -> str:
        return self.meta["where"]

    @property
    def required(self) -> bool:
        return self.default is dataclasses.MISSING


def _base_type(hint: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return (args[0] if len(args) == 1 else tuple(args)), len(args) < len(typing.get_args(hint))
    return hint, False


def options_of(cls: type) -> Iterator[Opt]:
    """The declared options of a request class, in field order (fields without metadata skipped)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.metadata.get("option"):
            continue
        base, optional = _base_type(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING)
        yield Opt(f.name, base, optional, default, dict(f.metadata))


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def problem(opt: Opt, value: Any) -> str | None:
    """What is wrong with `value` for `opt` (type, allowed values, range), or None."""
    if value is None:
        return None if opt.optional else "must be given"
    t = opt.type
    m = opt.meta
    if m.get("parse") is not None:
        try:
            m["parse"](value)
        except ValueError as e:
            return f"{e}, got {value!r}"
        return None
    if t is bool:
        return None if isinstance(value, bool) else f"must be true or false, got {value!r}"
    if t is int:
        if not isinstance(value, int) or isinstance(value, bool):
            return f"must be an integer, got {value!r}"
    elif t is float:
        if not _number(value):
            return f"must be a number, got {value!r}"
        if not math.isfinite(value):  # nan and inf pass every range test below, then break the maths
            return f"must be a finite number, got {value!r}"
    elif t is str:
        if not isinstance(value, str) and not (m["multiple"] and isinstance(value, list)):
            return f"must be a string, got {value!r}"
    if m["choices"]:
        items = value if isinstance(value, list) else [x.strip() for x in str(value).split(",")] \
            if m["multiple"] else [value]
        bad = [x for x in items if x not in m["choices"]]
        if bad or not items:
            what = "one or more of" if m["multiple"] else "one of"
            return f"must be {what} {', '.join(m['choices'])}, got {value!r}"
    if _number(value):
        if m["above"] is not None and m["below"] is not None and not m["above"] < value < m["below"]:
            return f"must be a number in ({m['above']:g}, {m['below']:g}), got {value!r}"
        if m["above"] is not None and m.get("max") is not None and not m["above"] < value <= m["max"]:
            return f"must be a number in ({m['above']:g}, {m['max']:g}], got {value!r}"
        what = "an integer" if t is int else "a number"
        if m["min"] is not None and value < m["min"]:
            return f"must be {what} >= {m['min']:g}, got {value!r}"
        if m["above"] is not None and value <= m["above"]:
            return ("must be a positive number" if m["above"] == 0 else f"must be {what} > {m['above']:g}") + \
                f", got {value!r}"
        if m["below"] is not None and value >= m["below"]:
            return f"must be less than {m['below']:g}, got {value!r}"
        if m.get("max") is not None and value > m["max"]:
            return f"must be {what} <= {m['max']:g}, got {value!r}"
    return None


def check(obj: Any) -> None:
    """Raise UsageError for the first option of a request whose value is not allowed, including
    the options of the dataclasses it holds (heal's `opts`, every step's `data`): the command
    line builds those separately, and only this check sees them before any work starts."""
    from .errors import UsageError

    for opt in options_of(type(obj)):
        if opt.type not in (bool, int, float, str):
            continue
        msg = problem(opt, getattr(obj, opt.name))
        if msg:
            raise UsageError(f"{opt.flag} {msg}")
    for part in _nested(obj):
        check(part)


def _nested(obj: Any) -> Iterator[Any]:
    """The option dataclasses a request holds, except those that opt out (`checked_apart`: checked
    where they are used, e.g. LoadOptions, whose --dtype also takes spellings its choices omit)."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if (dataclasses.is_dataclass(value) and not isinstance(value, type)
                and not getattr(value, "checked_apart", False)):
            yield value
