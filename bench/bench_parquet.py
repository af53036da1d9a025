"""Parquet source against a bare ``pyarrow`` loop on the same file, in one run.

    python bench/bench_parquet.py [--size-mb 320] [--row-group 16384] [--repeats 3]

Writes (once) a synthetic Parquet corpus into ``bench/data/`` (``id``, ``text`` of log-normal
length, ``score``; row groups of ``--row-group`` rows), then prints records/s of

* a bare ``ParquetFile(path).iter_batches(batch_size=4096)`` loop converting every batch to
  Python dicts with ``batch.to_pylist()`` (the baseline),
* sequential ``rs.parquet(path)``,
* block-shuffled ``rs.parquet(path).shuffle(seed=0, block_size="row_group", window=4)``,

and the resume latency (``set_state`` + first record, on a freshly built pipeline whose row
group cache is cold) at 1%, 50% and 99% of the file, sequential and block-shuffled.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.timing import best_of, drain  # noqa: E402
from resumable.sources.parquet import parquet  # noqa: E402

DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
RESUME_POINTS = (0.01, 0.5, 0.99)
BASELINE_BATCH = 4096
TEXT_MU = 6.4
"""Log-normal text length in characters: median exp(6.4) ~ 600, mean ~ 770."""
TEXT_SIGMA = 0.7
WINDOW = 4


def make_parquet_corpus(path: str, target_bytes: int, row_group: int, seed: int = 0) -> str:
    """Write a Parquet file of at least ``target_bytes`` at ``path`` (reused if it exists)."""
    if os.path.exists(path) and os.path.getsize(path) >= target_bytes:
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    rng = np.random.default_rng(seed)
    schema = pa.schema([("id", pa.int64()), ("text", pa.string()), ("score", pa.float64())])
    temp = f"{path}.{os.getpid()}.tmp"
    next_id = 0
    with pq.ParquetWriter(temp, schema, compression="snappy") as writer:
        while True:
            lengths = np.clip(rng.lognormal(TEXT_MU, TEXT_SIGMA, row_group), 1, 20_000).astype(np.int32)
            letters = rng.integers(97, 123, int(lengths.sum()), dtype=np.uint8)
            letters[rng.random(letters.size) < 0.16] = 32  # spaces: words of ~6 letters
            offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
            text = pa.StringArray.from_buffers(row_group, pa.py_buffer(offsets), pa.py_buffer(letters))
            ids = pa.array(np.arange(next_id, next_id + row_group, dtype=np.int64))
            scores = pa.array(rng.random(row_group))
            writer.write_table(pa.Table.from_arrays([ids, text, scores], schema=schema), row_group_size=row_group)
            next_id += row_group
            writer_bytes = os.path.getsize(temp)
            if writer_bytes >= target_bytes:
                break
    os.replace(temp, path)
    return path


def bare_loop(path: str) -> int:
    """The baseline: pyarrow's batch iterator, every batch converted to Python dicts."""
    count = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=BASELINE_BATCH):
        for _ in batch.to_pylist():
            count += 1
    return count


def resume_latency(build: Callable[[], Any], position: int) -> float:
    """Seconds for ``set_state`` + the first record on a freshly built pipeline (cold cache)."""
    reference = build()
    state = reference.get_state()
    state["position"] = position
    best = float("inf")
    for _ in range(3):
        pipe = build()
        start = time.perf_counter()
        pipe.set_state(state)
        next(iter(pipe))
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=int, default=320)
    parser.add_argument("--row-group", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    path = os.path.join(DATA_DIR, f"corpus-{args.size_mb}mb-rg{args.row_group}.parquet")
    make_parquet_corpus(path, args.size_mb << 20, args.row_group)

    start = time.perf_counter()
    source = parquet(path)
    open_ms = (time.perf_counter() - start) * 1e3
    total = len(source)
    print(
        f"corpus: {path}: {os.path.getsize(path) / 2**20:.0f} MiB, {total} rows, "
        f"{source.num_row_groups} row groups of {args.row_group} rows; rs.parquet opens it in {open_ms:.1f} ms"
    )

    def sequential() -> Any:
        return parquet(path)

    def block_shuffled() -> Any:
        return parquet(path).shuffle(seed=0, block_size="row_group", window=WINDOW)

    results = best_of(
        args.repeats,
        {
            "pyarrow iter_batches + to_pylist": lambda: bare_loop(path),
            "rs.parquet sequential": lambda: drain(sequential()),
            f"rs.parquet block shuffle (row groups, window {WINDOW})": lambda: drain(block_shuffled()),
        },
    )
    baseline = results["pyarrow iter_batches + to_pylist"][0]
    sequential_time = results["rs.parquet sequential"][0]
    title = f"run (best of {args.repeats})"
    print(f"\n{title:<52} {'records':>9} {'seconds':>8} {'records/s':>11} {'vs bare':>8} {'vs seq':>7}")
    for name, (elapsed, count) in results.items():
        if count != total:
            raise SystemExit(f"{name}: read {count} records, expected {total}")
        print(
            f"{name:<52} {count:>9} {elapsed:>8.3f} {count / elapsed:>11,.0f} "
            f"{baseline / elapsed:>8.2f} {sequential_time / elapsed:>7.2f}"
        )

    title = "resume latency (set_state + first record), best of 3"
    print(f"\n{title:<52} " + " ".join(f"{p:>8.0%}" for p in RESUME_POINTS))
    for name, build in (("rs.parquet sequential", sequential), ("rs.parquet block shuffle", block_shuffled)):
        latencies = [resume_latency(build, int(p * total)) * 1e3 for p in RESUME_POINTS]
        print(f"{name:<52} " + " ".join(f"{ms:>6.1f}ms" for ms in latencies))


if __name__ == "__main__":
    main()
