"""Streaming JSONL (``rs.jsonl_stream``) against a bare ``orjson`` loop over the same files.

    python bench/bench_stream.py [--size-mb 100] [--files 4] [--repeats 3]

Splits a generated corpus into plain and gzip files and prints docs/s of the stream source
against ``for line in open(f): orjson.loads(line)`` (``gzip.open`` for .gz), and the resume
latency (``set_state`` + first record) at the middle of the last file of each kind.
"""

from __future__ import annotations

import argparse
import gzip
import os
import shutil
import sys
import time

import orjson

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import resumable as rs  # noqa: E402
from bench.corpus import make_jsonl_corpus  # noqa: E402
from bench.timing import best_of, drain  # noqa: E402

DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


def split_corpus(source: str, directory: str, files: int, compress: bool) -> list[str]:
    """``files`` parts of ``source`` (whole lines), plain or gzip, written once."""
    suffix = ".jsonl.gz" if compress else ".jsonl"
    paths = [os.path.join(directory, f"part{i:02d}{suffix}") for i in range(files)]
    if all(os.path.exists(p) for p in paths):
        return paths
    os.makedirs(directory, exist_ok=True)
    with open(source, "rb") as handle:
        lines = handle.readlines()
    per_file = -(-len(lines) // files)
    for i, path in enumerate(paths):
        chunk = b"".join(lines[i * per_file : (i + 1) * per_file])
        with gzip.open(path, "wb", compresslevel=1) if compress else open(path, "wb") as out:
            out.write(chunk)
    return paths


def bare_loop(paths: list[str]) -> int:
    count = 0
    for path in paths:
        with gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb") as handle:
            for line in handle:
                if line.strip():
                    orjson.loads(line)
                    count += 1
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size-mb", type=int, default=100)
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    source = make_jsonl_corpus(os.path.join(DATA_DIR, f"corpus_{args.size_mb}mb.jsonl"), args.size_mb << 20)
    for compress in (False, True):
        directory = os.path.join(DATA_DIR, f"stream_{args.size_mb}mb_{'gz' if compress else 'plain'}")
        paths = split_corpus(source, directory, args.files, compress)
        best = best_of(
            args.repeats,
            {"bare": lambda: bare_loop(paths), "stream": lambda: drain(rs.jsonl_stream(paths))},
        )
        (bare_time, count), (stream_time, stream_count) = best["bare"], best["stream"]
        assert count == stream_count
        kind = "gzip" if compress else "plain"
        print(
            f"{kind:<6} {count:,} docs: bare {count / bare_time:,.0f} docs/s, stream "
            f"{count / stream_time:,.0f} docs/s, ratio {bare_time / stream_time:.2f}"
        )
        probe = rs.jsonl_stream(paths)
        target = count - count // (2 * args.files)  # the middle of the last file
        for _ in range(target):
            next(probe)
        state = probe.get_state()
        start = time.perf_counter()
        resumed = rs.jsonl_stream(paths)
        resumed.set_state(state)
        next(resumed)
        print(f"{kind:<6} resume in the middle of the last file: {(time.perf_counter() - start) * 1e3:.1f} ms")
    if os.environ.get("BENCH_CLEAN"):
        shutil.rmtree(os.path.join(DATA_DIR, f"stream_{args.size_mb}mb_gz"), ignore_errors=True)


if __name__ == "__main__":
    main()
