"""The cost of a streaming packer's state taken after every batch, in one process.

A pipeline ``from_list -> shuffle -> shard -> repeat -> map -> pack(best_fit) -> batch(8)``
over documents of a corpus's lengths (log-normal fits, as in ``bench_pack.py``) is iterated
``--batches`` batches; after each, the packer's ``_progress()`` (its own part of the state),
the whole pipeline's ``get_state()`` (which then reuses that progress) and the orjson encoding
of it (what a Loader worker sends with every batch) are timed, and the medians printed with
their sum per batch (``total``: what a worker adds per batch) and the state's size.

With ``--baseline NAME`` the same runs alternate with a copy of the package importable as
``NAME`` (for example an earlier version copied under another name, its imports renamed), so
both are measured under the same load. ``--profile`` prints cProfile's top entries of the
state calls instead.

    python bench/bench_pack_state.py [--batches 400] [--runs 3] [--buffer-size 1000]
        [--corpora UltraChat C4] [--baseline resumable_before] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import os
import pstats
import statistics
import sys
import time
from types import ModuleType
from typing import Any

import numpy as np
import orjson

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.bench_pack import documents, lengths  # noqa: E402

SEQ_LEN = 2048
BATCH = 8
DOCUMENTS = 20_000
SEED = 0


def identity(record: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return record


def build(package: ModuleType, docs: list[dict[str, np.ndarray]], buffer_size: int) -> tuple[Any, Any]:
    """The pipeline and its packer node."""
    pack = (
        package.from_list(docs)
        .shuffle(seed=SEED)
        .shard()
        .repeat()
        .map(identity)
        .pack(SEQ_LEN, strategy="best_fit", buffer_size=buffer_size)
    )
    return pack.batch(BATCH, collate_fn=list), pack


def measure(package: ModuleType, docs: list[dict[str, np.ndarray]], buffer_size: int, batches: int) -> dict[str, float]:
    """Medians over ``batches`` batches: packer progress, pipeline state and orjson (us), and
    the encoded state's median and largest size (kB)."""
    pipe, pack = build(package, docs, buffer_size)
    progress, state, encode, total, sizes = [], [], [], [], []
    for _ in range(batches):
        next(pipe)
        start = time.perf_counter()
        pack._progress()
        progress.append(time.perf_counter() - start)
        start = time.perf_counter()
        saved = pipe.get_state()
        state.append(time.perf_counter() - start)
        start = time.perf_counter()
        data = orjson.dumps(saved)
        encode.append(time.perf_counter() - start)
        total.append(progress[-1] + state[-1] + encode[-1])
        sizes.append(len(data))
    return {
        "progress": 1e6 * statistics.median(progress),
        "state": 1e6 * statistics.median(state),
        "orjson": 1e6 * statistics.median(encode),
        "total": 1e6 * statistics.median(total),
        "kB": statistics.median(sizes) / 1000,
        "max kB": max(sizes) / 1000,
    }


def profile(package: ModuleType, docs: list[dict[str, np.ndarray]], buffer_size: int, batches: int) -> None:
    """cProfile of the packer's ``_progress()`` after each of ``batches`` batches."""
    pipe, pack = build(package, docs, buffer_size)
    profiler = cProfile.Profile()
    for _ in range(batches):
        next(pipe)
        profiler.enable()
        pack._progress()
        profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(15)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=400)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--buffer-size", type=int, default=1000)
    parser.add_argument("--corpora", nargs="+", default=["UltraChat", "C4"])
    parser.add_argument("--baseline", default=None, help="a copy of the package, importable under this name")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    packages = {"current": importlib.import_module("resumable")}
    if args.baseline:
        packages = {"baseline": importlib.import_module(args.baseline), **packages}
    for corpus in args.corpora:
        docs = documents(lengths(corpus, DOCUMENTS, SEED), SEED)
        if args.profile:
            for name, package in packages.items():
                print(f"== {corpus}, {name}")
                profile(package, docs, args.buffer_size, args.batches)
            continue
        results: dict[str, list[dict[str, float]]] = {name: [] for name in packages}
        names = list(packages)
        for run in range(args.runs):
            for name in names if run % 2 == 0 else names[::-1]:
                results[name].append(measure(packages[name], docs, args.buffer_size, args.batches))
        print(
            f"{corpus}, best_fit({args.buffer_size}), seq_len {SEQ_LEN}, {args.batches} batches of {BATCH}, "
            f"{args.runs} alternating runs (per run: median over batches; min-max over runs)"
        )
        print(f"{'':<10}{'progress us':>16}{'get_state us':>16}{'orjson us':>14}{'total us':>12}{'kB':>8}{'max kB':>8}")
        for name, rows in results.items():
            cells = []
            for field, width in (("progress", 16), ("state", 16), ("orjson", 14), ("total", 12)):
                values = [row[field] for row in rows]
                cells.append(f"{f'{min(values):.0f}-{max(values):.0f}':>{width}}")
            print(f"{name:<10}{''.join(cells)}{rows[0]['kB']:>8.1f}{rows[0]['max kB']:>8.1f}", flush=True)


if __name__ == "__main__":
    main()
