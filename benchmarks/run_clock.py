"""The clock of one benchmark run: its timestamped progress lines on stderr and the run's seconds
(the JSON's total_seconds), shared by the quality benchmarks."""
from __future__ import annotations

import sys
import time


class RunClock:
    """Started when made; `log` prints `[  12.3s] message` to stderr, `seconds` the time so far."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    def seconds(self) -> float:
        return round(time.perf_counter() - self.start, 1)

    def log(self, msg: str) -> None:
        print(f"[{time.perf_counter() - self.start:7.1f}s] {msg}", file=sys.stderr, flush=True)
