"""Error types that the CLI maps to exit codes (2 = bad usage/input, 1 = failure while running)."""
from __future__ import annotations


class HeadtoolError(Exception):
    """A failure while running: exit code 1, one line on stderr."""

    exit_code = 1


class UsageError(HeadtoolError):
    """Bad usage or bad input (missing file, wrong shapes, impossible target): exit code 2."""

    exit_code = 2
