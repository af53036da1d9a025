"""Benchmark LineIndex: build throughput on a warm page cache, and sidecar load time.

    .venv/bin/python bench/bench_index.py [--path FILE.jsonl] [--size-mb 320] [--repeats 5]

Without ``--path`` a synthetic corpus (see ``bench/corpus.py``) is generated under ``bench/data/``
once and reused. MB are 10**6 bytes. Target: at least 300 MB/s for ``build``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.corpus import make_jsonl_corpus  # noqa: E402
from resumable.sources.line_index import CHUNK_SIZE, SIDECAR_SUFFIX, LineIndex  # noqa: E402

MB = 10**6
READ_BLOCK = 64 << 20
LOADS = 20


def read_all(path: str) -> float:
    """Read the whole file once (this warms the page cache); return the seconds it took."""
    buffer = bytearray(READ_BLOCK)
    began = time.perf_counter()
    with open(path, "rb", buffering=0) as data:
        while data.readinto(buffer):
            pass
    return time.perf_counter() - began


def timed_build(path: str) -> tuple[float, LineIndex]:
    """Seconds taken by one in-memory build, and its index."""
    began = time.perf_counter()
    index = LineIndex.build(path)
    return time.perf_counter() - began, index


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", help="an existing JSONL file (default: generate one under bench/data/)")
    parser.add_argument("--size-mb", type=int, default=320, help="size of the generated corpus, in MB")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=5, help="timed builds; the best and median are shown")
    args = parser.parse_args()
    if args.repeats < 1 or args.size_mb < 1:
        parser.error("--repeats and --size-mb must be at least 1")

    path = args.path
    if path is None:
        target = args.size_mb * MB
        corpus = ROOT / "bench" / "data" / f"corpus_{args.size_mb}mb_seed{args.seed}.jsonl"
        reused = corpus.exists() and corpus.stat().st_size >= target
        began = time.perf_counter()
        path = make_jsonl_corpus(str(corpus), target, args.seed)
        print("corpus reused" if reused else f"corpus generated in {time.perf_counter() - began:.1f} s")
    size = os.path.getsize(path)
    print(f"file: {path} ({size / MB:.1f} MB)")

    read_all(path)
    warm_read = read_all(path)
    print(f"warm read (readinto, 64 MiB blocks): {size / MB / warm_read:8.0f} MB/s")

    runs = [timed_build(path) for _ in range(args.repeats)]
    times = [seconds for seconds, _ in runs]
    index = runs[-1][1]
    best, median = min(times), statistics.median(times)
    print(
        f"LineIndex.build (chunk {CHUNK_SIZE >> 20} MiB): best {best:.3f} s = {size / MB / best:.0f} MB/s, "
        f"median {median:.3f} s = {size / MB / median:.0f} MB/s over {args.repeats} runs"
    )
    print(
        f"  {index.num_records} records ({index.num_records / best / 1e6:.2f} M records/s), "
        f"{index.blank_lines} blank lines, mean record {size / max(index.num_records, 1):.0f} B"
    )

    sidecar = path + SIDECAR_SUFFIX
    if os.path.exists(sidecar):
        os.unlink(sidecar)  # a cache: start from none so the first open builds and stores it
    began = time.perf_counter()
    stored = LineIndex.open(path)
    first_open = time.perf_counter() - began
    print(f"LineIndex.open, no sidecar (build + write): {first_open:.3f} s -> {stored.sidecar}")

    loads = []
    for _ in range(LOADS):
        began = time.perf_counter()
        loaded = LineIndex.open(path)
        loads.append(time.perf_counter() - began)
    if not loaded.mapped or not np.array_equal(loaded.starts, index.starts):
        raise SystemExit("sidecar load did not give the built index")
    print(
        f"LineIndex.open, fresh sidecar (memmap): median {statistics.median(loads) * 1e3:.3f} ms, "
        f"best {min(loads) * 1e3:.3f} ms over {LOADS} loads"
    )


if __name__ == "__main__":
    main()
