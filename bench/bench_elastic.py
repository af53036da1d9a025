"""Elastic rescale at scale, without data: an epoch of 10^10 documents read by 4096 ranks x 8
workers, stopped at a random point, resumed on 3000 x 6, then again on 1000 x 4 after the new
consumers passed the band. Prints the time to plan each rescale, the state it adds per worker
and per rank, and the cost of mapping positions through it."""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from resumable.order.elastic import rescale, shard_sizes


def state_bytes(remap: object) -> int:
    return len(json.dumps(remap.to_json(), separators=(",", ":")))  # type: ignore[attr-defined]  # a Remap or Reorder, both have to_json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--documents", type=int, default=10**10)
    parser.add_argument("--drift", type=int, default=64, help="how far workers' cursors drift apart")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    topologies = [(4096, 8), (3000, 6), (1000, 4)]

    remap, space = None, args.documents
    for (ranks, workers), (new_ranks, new_workers) in zip(topologies, topologies[1:]):
        consumers = ranks * workers
        sizes = shard_sizes(space, consumers)
        if remap is None:  # a random point, workers a few batches apart
            base = int(rng.integers(0, int(sizes.min()) - args.drift))
            cursors = np.minimum(base + rng.integers(0, args.drift, size=consumers), sizes)
        else:  # every consumer well past the band
            cursors = sizes // 3 + rng.integers(0, args.drift, size=consumers)
        start = time.perf_counter()
        remap = rescale(remap, 0, space, cursors.tolist())
        planned = time.perf_counter() - start
        space = remap.length
        positions = np.arange(4096, dtype=np.int64) * (new_ranks * new_workers)
        start = time.perf_counter()
        for _ in range(100):
            remap.to_base(positions)
        per_chunk = (time.perf_counter() - start) / 100
        per_worker = state_bytes(remap)
        band = getattr(remap.steps[0], "band", 0)
        passed = state_bytes(remap.compacted(band + new_ranks * new_workers))
        print(
            f"{ranks} x {workers} -> {new_ranks} x {new_workers}: plan {planned * 1e3:.1f} ms, "
            f"remap {per_worker:,} bytes per worker = {per_worker * new_workers:,} per rank, "
            f"steps {[type(step).__name__ for step in remap.steps]}, "
            f"mapping a chunk of 4096 positions {per_chunk * 1e6:.0f} us; "
            f"a consumer past the band saves {passed} bytes"
        )


if __name__ == "__main__":
    main()
