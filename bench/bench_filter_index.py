"""Benchmark filter(index=True): index build speed, its size on disk, its load, and the cost of
random access through it.

    .venv/bin/python bench/bench_filter_index.py [--records 10000000] [--num-proc 2] [--repeats 1]

A Parquet file of ``--records`` rows (``id``, ``length``, a short ``text``) is generated under
``bench/data/`` once and reused; the predicate keeps rows whose ``length`` is at most 2048 (73%).
Builds run serial, in ``--num-proc`` processes, and with a batched (numpy) predicate, without a
sidecar; then with ``cache_dir``: first build (scan and write), and a load by a new
node (what a DataLoader worker, rank or later job pays). Random access: mapping shuffled
positions to records through the index, and reading shuffled records with and without it.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import resumable as rs  # noqa: E402
from bench.timing import best_of, drain  # noqa: E402
from resumable.ops.indexed_filter import IndexedFilter  # noqa: E402

MAX_LENGTH = 2048
ROW_GROUP = 1 << 16
WRITE_BATCH = 1 << 20
CHUNK = 4096
RANDOM_READS = 100_000


def make_parquet(path: Path, records: int, seed: int = 0) -> Path:
    """``records`` rows of ``id``, ``length`` (log-uniform 1..32768) and ``text``, written once."""
    if path.exists() and pq.ParquetFile(path).metadata.num_rows == records:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    schema = pa.schema([("id", pa.int64()), ("length", pa.int32()), ("text", pa.string())])
    with pq.ParquetWriter(path, schema) as writer:
        for start in range(0, records, WRITE_BATCH):
            count = min(WRITE_BATCH, records - start)
            lengths = np.exp(rng.uniform(0, np.log(32768), count)).astype(np.int32)
            ids = np.arange(start, start + count, dtype=np.int64)
            text = pa.array([f"doc {i}" for i in ids.tolist()])
            table = pa.table({"id": ids, "length": lengths, "text": text}, schema=schema)
            writer.write_table(table, row_group_size=ROW_GROUP)
    return path


def short(record: dict[str, Any]) -> bool:
    return record["length"] <= MAX_LENGTH  # type: ignore[no-any-return]  # an int comparison


def short_batch(records: list[dict[str, Any]]) -> np.ndarray:
    lengths = np.fromiter((r["length"] for r in records), dtype=np.int64, count=len(records))
    return lengths <= MAX_LENGTH


def timed(build: Callable[[], IndexedFilter[Any]]) -> tuple[float, IndexedFilter[Any]]:
    """Seconds to build a node and its index (``len``), and the node."""
    began = time.perf_counter()
    node = build()
    len(node)
    return time.perf_counter() - began, node


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=10**7)
    parser.add_argument("--num-proc", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1, help="timed builds of each kind; the best is shown")
    args = parser.parse_args()
    if args.records < 1 or args.num_proc < 1 or args.repeats < 1:
        parser.error("--records, --num-proc and --repeats must be at least 1")

    path = make_parquet(ROOT / "bench" / "data" / f"lengths-{args.records}.parquet", args.records)
    groups = -(-args.records // ROW_GROUP)
    print(f"file: {path} ({os.path.getsize(path) / 1e6:.1f} MB, {args.records:,} rows, {groups} row groups)")

    def source() -> rs.Node[Any]:
        return rs.parquet(str(path), cache_row_groups=groups)

    def build(**options: Any) -> Callable[[], IndexedFilter[Any]]:
        return lambda: source().filter(short, index=True, progress=False, **options)  # type: ignore[return-value]  # an IndexedFilter

    def batched() -> IndexedFilter[Any]:
        return source().filter(short_batch, index=True, batched=True, progress=False)  # type: ignore[return-value]  # an IndexedFilter

    kinds = {"serial": build(), f"num_proc={args.num_proc}": build(num_proc=args.num_proc), "batched (numpy)": batched}
    kept = None
    for name, make in kinds.items():
        seconds, node = min((timed(make) for _ in range(args.repeats)), key=lambda pair: pair[0])
        if kept is not None and not np.array_equal(kept, node.kept):
            raise SystemExit(f"{name} gave another index")
        kept = node.kept
        print(f"build {name:>18}: {seconds:7.2f} s = {args.records / seconds / 1e6:5.2f} M records/s")
    assert kept is not None
    print(f"kept {len(kept):,} of {args.records:,} ({kept.dtype}, {kept.nbytes / 1e6:.1f} MB in memory)")

    with tempfile.TemporaryDirectory() as cache_dir:
        first, node = timed(build(cache_dir=cache_dir, num_proc=args.num_proc))
        sidecar = node.sidecar
        assert sidecar is not None
        size = os.path.getsize(sidecar)
        loads = [timed(build(cache_dir=cache_dir))[0] for _ in range(5)]
        print(
            f"with cache_dir: first build (num_proc={args.num_proc}, scan + write) {first:.2f} s; sidecar "
            f"{size / 1e6:.1f} MB ({size / args.records:.2f} bytes per input record); load by a new node "
            f"(open, map, check the digest): best {min(loads) * 1e3:.1f} ms of 5"
        )

        indexed = build(cache_dir=cache_dir)()
        plain = source()
        chunk = np.arange(CHUNK, dtype=np.int64)  # the first chunk of a shuffled epoch
        through, alone = indexed.shuffle(0), plain.shuffle(0)
        mapping = best_of(
            20,
            {
                "through the index": lambda: len(through._leaf_indices(chunk, 0)),
                "source alone": lambda: len(alone._leaf_indices(chunk, 0)),
            },
        )
        for name, (seconds, _) in mapping.items():
            print(f"shuffle(0): map {CHUNK} positions to records, {name}: {seconds * 1e6:.0f} us")

        for leaf in (indexed.leaf, plain.leaf):  # every row group decoded once, into each source's cache
            leaf._raw_at(np.arange(0, args.records, ROW_GROUP, dtype=np.int64))
        reads = best_of(
            3,
            {
                "through the index": lambda: drain(itertools.islice(indexed.shuffle(0), RANDOM_READS)),
                "source alone": lambda: drain(itertools.islice(plain.shuffle(0), RANDOM_READS)),
            },
        )
        for name, (seconds, count) in reads.items():
            print(f"shuffled read of {count:,} records, {name}: {count / seconds / 1e3:.0f} k records/s")


if __name__ == "__main__":
    main()
