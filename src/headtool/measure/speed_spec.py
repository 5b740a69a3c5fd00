"""What `eval --speed` measures (torch-free: the CLI reads its defaults for --help at start-up)."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import UsageError


@dataclass(frozen=True)
class SpeedSpec:
    """What to measure: batch x context prompt tokens, then new_tokens decode steps."""

    batch: int = 1
    context: int = 1024
    new_tokens: int = 32
    repeats: int = 5
    warmup: int = 1

    def check(self) -> None:
        for name, low in (("batch", 1), ("context", 1), ("new_tokens", 1), ("repeats", 1), ("warmup", 0)):
            v = getattr(self, name)
            if not isinstance(v, int) or v < low:
                flag = "--" + name.replace("_", "-")
                raise UsageError(f"{flag} must be at least {low} (got {v})")
