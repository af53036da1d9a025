"""Timing helpers shared by the benchmark scripts."""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable


def drain(items: Iterable[Any]) -> int:
    """Consume an iterable; return how many items it gave."""
    count = 0
    for _ in items:
        count += 1
    return count


def best_of(repeats: int, runs: dict[str, Callable[[], int]]) -> dict[str, tuple[float, int]]:
    """Best wall time of each run, interleaved so machine noise hits all of them alike."""
    best: dict[str, tuple[float, int]] = {}
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            count = run()
            elapsed = time.perf_counter() - start
            if name not in best or elapsed < best[name][0]:
                best[name] = (elapsed, count)
    return best
