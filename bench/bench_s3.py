"""JSONL over S3 against the same file read locally, on a moto S3 server this script starts on
127.0.0.1, in one run.

    python bench/bench_s3.py [--size-mb 50] [--repeats 2] [--block-size 256]

Prints docs/s sequential and block-shuffled (remote, local, ratio), bytes fetched per epoch over
the data size and ranged requests per 1,000 records (from the source's ``stats``), the time to
build the line index by one streamed scan, and resume latency (build the source, ``set_state``,
first record) at 1%, 50% and 99% of the file with the index cached.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import resumable as rs  # noqa: E402
from bench.corpus import make_jsonl_corpus  # noqa: E402
from bench.timing import best_of, drain  # noqa: E402
from tests.s3server import S3Server  # noqa: E402

DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
RESUME_POINTS = (0.01, 0.5, 0.99)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--block-size", type=int, default=256, help="records per shuffled block")
    args = parser.parse_args()
    os.makedirs(DATA_DIR, exist_ok=True)
    path = make_jsonl_corpus(os.path.join(DATA_DIR, f"corpus-{args.size_mb}mb.jsonl"), args.size_mb << 20)
    size = os.path.getsize(path)
    server = S3Server()
    try:
        url = server.upload(path, "bench/corpus.jsonl")
        cache = tempfile.mkdtemp(prefix="resumable-bench-s3-")
        start = time.perf_counter()
        remote = rs.jsonl(url, storage_options=server.options, cache_dir=cache)
        build = time.perf_counter() - start
        records = len(remote)
        print(f"{records} records, {size / 1e6:.1f} MB; index built by one streamed scan in {build:.2f} s")

        def make(where: str) -> rs.nodes.JsonlSource:
            if where == "local":
                return rs.jsonl(path)
            return rs.jsonl(url, storage_options=server.options, cache_dir=cache)

        sources: dict[str, Any] = {}

        def run(where: str, shuffled: bool) -> int:
            source = make(where)
            sources[f"{where} {shuffled}"] = source
            pipe = source.shuffle(seed=0, block_size=args.block_size) if shuffled else source
            return drain(pipe)

        for shuffled in (False, True):
            label = f"block shuffle ({args.block_size})" if shuffled else "sequential"
            best = best_of(args.repeats, {w: (lambda w=w: run(w, shuffled)) for w in ("remote", "local")})
            rates = {where: count / elapsed for where, (elapsed, count) in best.items()}
            stats = sources[f"remote {shuffled}"].stats
            print(
                f"{label:>22}: remote {rates['remote']:,.0f} docs/s, local {rates['local']:,.0f} docs/s "
                f"(ratio {rates['remote'] / rates['local']:.2f}); fetched {stats['bytes_fetched'] / size:.2f}x "
                f"the data, {1000 * stats['requests'] / records:.2f} requests per 1,000 records"
            )

        for point in RESUME_POINTS:
            k = int(point * records)
            cursor = make("remote").shuffle(seed=0, block_size=args.block_size)
            state = _state_after(cursor, k)
            start = time.perf_counter()
            resumed = make("remote").shuffle(seed=0, block_size=args.block_size)
            resumed.set_state(state)
            next(iter(resumed))
            elapsed = 1000 * (time.perf_counter() - start)
            print(f"resume at {point:.0%}: {elapsed:.1f} ms (build + set_state + first record)")
    finally:
        server.stop()


def _state_after(pipe: rs.Node[Any], count: int) -> dict[str, Any]:
    """The state after reading ``count`` records of ``pipe``."""
    iterator = iter(pipe)
    for _ in range(count):
        next(iterator)
    return pipe.get_state()


if __name__ == "__main__":
    main()
