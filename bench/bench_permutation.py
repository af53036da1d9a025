"""Benchmark: keyed global shuffle vs ``numpy.random.default_rng(0).permutation``.

Measures the time to produce a whole shuffled order of [0, N) and the peak extra
memory each needs. Ours streams the order chunk by chunk with ``permutation_chunks``
and consumes every chunk (sums it, and checks the total so the work cannot be skipped);
numpy materialises an int64 array of N elements and shuffles it in place.

Peak memory is the ``tracemalloc`` peak (numpy reports its data buffers to
tracemalloc), measured in a separate run so tracing does not perturb the timings.

Usage: python bench/bench_permutation.py [--n 100000000] [--chunk 65536] [--repeats 1]
"""

from __future__ import annotations

import argparse
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from resumable.order import lcg  # noqa: E402


def ours(n: int, chunk: int) -> None:
    """Stream perm(0..n-1) and consume it; the sum of any permutation of [0, n) is fixed."""
    total = 0
    for block in lcg.permutation_chunks(n, seed=0, epoch=0, chunk_size=chunk):
        total += int(block.sum())
    if total != n * (n - 1) // 2:
        raise RuntimeError("permutation_chunks did not produce a permutation")


def numpy_permutation(n: int) -> None:
    """The materialised baseline."""
    np.random.default_rng(0).permutation(n)


def best_seconds(fn: Callable[[], None], repeats: int) -> float:
    """Best wall-clock time of ``repeats`` runs."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def peak_mb(fn: Callable[[], None]) -> float:
    """Peak traced allocation of one run, in MB (10**6 bytes)."""
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1] / 1e6
    finally:
        tracemalloc.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=10**8, help="permutation length N")
    parser.add_argument("--chunk", type=int, default=1 << 16, help="elements per chunk for ours")
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per method (best is kept)")
    args = parser.parse_args()
    n, chunk = args.n, args.chunk

    rows = [
        ("resumable permutation_chunks", lambda: ours(n, chunk)),
        ("numpy default_rng.permutation", lambda: numpy_permutation(n)),
    ]
    results = [(name, best_seconds(fn, args.repeats), peak_mb(fn)) for name, fn in rows]

    print(f"N = {n:,}   chunk = {chunk:,}   rounds = {lcg.ROUNDS}   numpy {np.__version__}")
    print(f"{'method':<32}{'seconds':>10}{'Melem/s':>10}{'peak MB':>10}")
    for name, seconds, mb in results:
        print(f"{name:<32}{seconds:>10.3f}{n / seconds / 1e6:>10.1f}{mb:>10.1f}")
    (_, ours_s, _), (_, numpy_s, _) = results
    print(f"ratio ours/numpy (elements per second): {numpy_s / ours_s:.2f}x")


if __name__ == "__main__":
    main()
