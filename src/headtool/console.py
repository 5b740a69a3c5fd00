"""Where output goes: results to stdout (plain), everything for people to stderr through rich.

No colour or progress codes ever reach stdout; NO_COLOR is respected; progress bars are shown
only when stderr is a terminal.
"""
from __future__ import annotations

import json
import os
import sys
from contextlib import contextmanager
from typing import Any, Iterator

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from .errors import UsageError

_err: Console | None = None


def err_console() -> Console:
    global _err
    if _err is None:
        _err = Console(stderr=True, no_color=bool(os.environ.get("NO_COLOR")) or None,
                       highlight=False, soft_wrap=False, emoji=False)  # ":abc:" in a user's text stays
        if not _err.is_terminal and not os.environ.get("COLUMNS"):
            _err.width = 120  # logs and pipes: wide enough for the tables
    return _err


def reset_consoles() -> None:
    """Forget the cached console (tests swap stderr)."""
    global _err
    _err = None


def quiet() -> bool:
    return bool(os.environ.get("HEADTOOL_QUIET"))


def info(msg: str) -> None:
    if not quiet():
        err_console().print(msg)


_held: list[list[str]] = []  # warnings held back by warnings_held(), innermost last


def warn(msg: str) -> None:
    if _held:
        _held[-1].append(msg)
        return
    err_console().print(f"[yellow]warning:[/yellow] {msg}")


@contextmanager
def warnings_held() -> Iterator[None]:
    """Hold warn() back while a step that may still refuse its input runs: the warnings are shown when
    it returns and dropped when it raises (a refusal is one line; a warning about the same input before
    it, e.g. 'asked for 16 blocks but only 9', would make it two)."""
    _held.append([])
    try:
        yield
    except BaseException:
        _held.pop()
        raise
    for msg in _held.pop():
        warn(msg)


def result_stream(what: str = "the result", instead: str = "") -> Any:
    """sys.stdout, where results go. A closed one (`>&-`, a service started without one) is Python's None:
    writing the result there was an internal error, and only after the work (a pruned folder written,
    then exit 1): a one-line usage error instead, which the commands raise before any work."""
    if sys.stdout is None:
        raise UsageError(f"stdout is closed, so {what} has nowhere to go; redirect it (> FILE)"
                         + (f" or {instead}" if instead else ""))
    return sys.stdout


def print_json(obj: Any, stream=None) -> None:
    """One JSON document on stdout (never coloured)."""
    stream = stream or result_stream()
    stream.write(json.dumps(obj, indent=2, allow_nan=False, default=_json_default) + "\n")
    stream.flush()


def _json_default(o: Any):
    try:
        import torch

        if isinstance(o, torch.Tensor):
            return o.tolist()
        if isinstance(o, torch.dtype):
            return str(o).replace("torch.", "")
    except ImportError:  # pragma: no cover
        pass
    if hasattr(o, "__fspath__"):
        return os.fspath(o)
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def show_progress() -> bool:
    c = err_console()
    return c.is_terminal and not quiet() and not os.environ.get("HEADTOOL_NO_PROGRESS")


class _NullProgress:
    def add_task(self, *a, **k) -> int:
        return 0

    def update(self, *a, **k) -> None:
        pass

    def advance(self, *a, **k) -> None:
        pass


@contextmanager
def progress(description: str = "") -> Iterator[Any]:
    """A rich progress display on stderr when it is a terminal, else a silent stand-in."""
    if not show_progress():
        yield _NullProgress()
        return
    p = Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), TimeRemainingColumn(),
        console=err_console(), transient=True,
    )
    with p:
        yield p
