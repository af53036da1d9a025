"""End to end: JSONL -> shuffle -> shard -> byte tokenise -> pack(2048) -> batch(8), through
``rs.torch.Loader`` with 2 workers, against the same pipeline in a plain torch DataLoader over
a plain IterableDataset (no state, no snapshots), in one run.

    python bench/bench_loader.py [--batches 400] [--workers 2] [--repeats 3]

Prints batches/s of both and their ratio, and the cost of taking the loader's state every
step as a fraction of that loop's step time.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import resumable as rs  # noqa: E402
import resumable.torch as rst  # noqa: E402
from bench.corpus import make_jsonl_corpus  # noqa: E402
from resumable.pack import collate_rows  # noqa: E402

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "corpus-100mb.jsonl")
SEQ_LEN = 2048
SPARSE = "rs.torch.Loader, snapshot_every_n_steps=1"
BATCH = 8


def tokenize(record: dict[str, Any]) -> dict[str, np.ndarray]:
    return {"input_ids": np.frombuffer(record["text"].encode(), dtype=np.uint8).astype(np.int32)}


def build() -> rs.Node:
    return (
        rs.jsonl(DATA)
        .shuffle(seed=0)
        .shard()
        .repeat()
        .map(tokenize)
        .pack(SEQ_LEN, strategy="best_fit", buffer_size=1000)
        .batch(BATCH, collate_fn=collate_rows)
    )


class PlainDataset(IterableDataset):  # type: ignore[type-arg]  # torch's generic dataset, over plain dicts
    """The same pipeline as a plain IterableDataset: iterated, never asked for its state."""

    def __iter__(self) -> Iterator[Any]:
        return iter(build())


def time_loop(loader: Any, batches: int, take_state: bool) -> tuple[float, float]:
    """Seconds for ``batches`` batches after a warm-up batch, and seconds spent in state_dict()."""
    iterator = iter(loader)
    next(iterator)  # workers started, buffers primed
    in_state = 0.0
    start = time.perf_counter()
    for _ in range(batches):
        batch = next(iterator)
        if take_state:
            before = time.perf_counter()
            loader.state_dict()
            in_state += time.perf_counter() - before
    elapsed = time.perf_counter() - start
    del iterator, batch
    return elapsed, in_state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=400)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    make_jsonl_corpus(DATA, 100 << 20)
    len(rs.jsonl(DATA))  # index built before timing
    torch.set_num_threads(1)

    best: dict[str, float] = {}
    state_cost = []
    for _ in range(args.repeats):
        plain = DataLoader(PlainDataset(), batch_size=None, num_workers=args.workers, prefetch_factor=4)
        seconds, _ = time_loop(plain, args.batches, take_state=False)
        best["plain DataLoader"] = min(best.get("plain DataLoader", seconds), seconds)
        stateful = rst.Loader(build, num_workers=args.workers, prefetch_factor=4)
        seconds, _ = time_loop(stateful, args.batches, take_state=False)
        best["rs.torch.Loader"] = min(best.get("rs.torch.Loader", seconds), seconds)
        sparse = rst.Loader(build, num_workers=args.workers, prefetch_factor=4, snapshot_every_n_steps=1)
        seconds, _ = time_loop(sparse, args.batches, take_state=False)
        best[SPARSE] = min(best.get(SPARSE, seconds), seconds)
        stateful = rst.Loader(build, num_workers=args.workers, prefetch_factor=4)
        seconds, in_state = time_loop(stateful, args.batches, take_state=True)
        best["rs.torch.Loader + state_dict() every step"] = min(
            best.get("rs.torch.Loader + state_dict() every step", seconds), seconds
        )
        state_cost.append((in_state / args.batches, seconds / args.batches))

    tokens = args.batches * BATCH * SEQ_LEN
    base = best["plain DataLoader"]
    print(f"{args.batches} batches of {BATCH} x {SEQ_LEN} tokens, {args.workers} workers, best of {args.repeats}")
    print(f"{'loop':<46}{'batches/s':>11}{'Mtok/s':>9}{'ratio':>8}")
    for name, seconds in best.items():
        print(f"{name:<46}{args.batches / seconds:>11.1f}{tokens / seconds / 1e6:>9.2f}{base / seconds:>8.2f}")
    per_call, per_step = min(state_cost)
    share = 100 * per_call / per_step
    print(f"\nstate_dict() per step: {per_call * 1e6:.0f} us of a {per_step * 1e3:.2f} ms step = {share:.2f}%")


if __name__ == "__main__":
    main()
