"""Sizes as people write them ('5GB', '500MiB', 1000000): shard sizes and memory caps."""
from __future__ import annotations

from ..errors import UsageError


def parse_size(size: str | int) -> int:
    """'5GB', '500MB', '2GiB' or a number of bytes."""
    if isinstance(size, int):
        return size
    s = str(size).strip().upper().replace(" ", "")
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "KB": 10**3, "MB": 10**6, "GB": 10**9,
             "TB": 10**12, "B": 1}
    n = None
    for u, mult in units.items():
        if s.endswith(u):
            try:
                n = int(float(s[: -len(u)]) * mult)
            except (ValueError, OverflowError):  # nan, inf
                pass
            break
    else:
        try:
            n = int(s)
        except ValueError:
            pass
    if n is None or n < 1:
        raise UsageError(f"--shard-size {size!r}: use e.g. 5GB, 500MB or a number of bytes") from None
    return n


def check_size(size: str | int) -> None:
    """parse_size for an option's declared check (ValueError saying what is allowed), so every command
    refuses a bad --shard-size before its work rather than when it writes."""
    try:
        parse_size(size)
    except UsageError:
        raise ValueError("must be a size such as 5GB, 500MB or a number of bytes") from None
