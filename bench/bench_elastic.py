"""Elastic rescale at scale: 4096 ranks x 8 workers -> 3000 x 6, mid-epoch, with a packer.

Two parts, printed side by side:

1. *Remap arithmetic at full scale, no data*: an epoch of 10^10 documents read by 4096 x 8
   consumers stopped at a random point (workers up to ``--drift`` positions apart), resumed on
   3000 x 6, then again on 1000 x 4 after the new consumers passed the band. The time to plan
   a rescale, the remap a new worker saves (its share of the level) and a whole level's size
   beside it, and one new rank's remap restore (plan + six shares) with its time and peak
   Python memory (tracemalloc).
2. *A real pipeline with a packer, scaled down*: ``from_list(range(10^10)) -> shuffle -> shard
   -> map(tokens) -> pack(best_fit, buffer_size=1000)`` on ``--old`` consumers, each a few rows
   into the epoch, rescaled to ``--new`` consumers (the same ratio as 32,768 -> 18,000, so a new
   consumer inherits as many pieces). Per-worker state before and after, the time and peak
   memory of one new rank's restore per old consumer, and both extrapolated linearly to
   32,768 old consumers (a new rank reads every old consumer's state).
"""

from __future__ import annotations

import argparse
import json
import time
import tracemalloc
from typing import Any, Callable

import numpy as np

import resumable as rs
from resumable.elastic import rescaled_state
from resumable.order.elastic import Level, Remap, rescale, shard_sizes

DOCUMENTS = 10**10
OLD_RANKS, OLD_WORKERS = 4096, 8
NEW_RANKS, NEW_WORKERS = 3000, 6
SEQ_LEN = 2048
BUFFER = 1000
KIB = 1024


def json_bytes(value: Any) -> int:
    return len(json.dumps(value, separators=(",", ":")))


def in_loader_bytes(state: dict[str, Any]) -> int:
    """A worker's pipeline state as a Loader state holds it: a JSON string inside JSON."""
    return len(json.dumps(json.dumps(state, separators=(",", ":"))))


def measured(function: Callable[[], Any]) -> tuple[Any, float, int]:
    """``function()``, its wall time, then its peak Python allocation in a second call under
    tracemalloc (which slows allocation-heavy code many times over, so it is not timed)."""
    start = time.perf_counter()
    result = function()
    elapsed = time.perf_counter() - start
    tracemalloc.start()
    function()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return result, elapsed, peak


def arithmetic(drift: int) -> dict[str, float]:
    """Part 1: the remap alone, at full scale."""
    rng = np.random.default_rng(0)
    topologies = [(OLD_RANKS, OLD_WORKERS), (NEW_RANKS, NEW_WORKERS), (1000, 4)]
    remap: Remap | None = None
    space = DOCUMENTS
    figures: dict[str, float] = {}
    for (ranks, workers), (new_ranks, new_workers) in zip(topologies, topologies[1:]):
        consumers, new = ranks * workers, new_ranks * new_workers
        sizes = shard_sizes(space, consumers)
        if remap is None:  # a random point, workers a few batches apart
            base = int(rng.integers(0, int(sizes.min()) - drift))
            cursors = np.minimum(base + rng.integers(0, drift, size=consumers), sizes)
        else:  # every consumer well past the band
            cursors = sizes // 3 + rng.integers(0, drift, size=consumers)
        previous, before = remap, space
        remap, planned, _ = measured(lambda: rescale(previous, 0, before, cursors.tolist()))
        space = remap.length
        newest = remap.steps[0]
        whole = json_bytes(newest.to_json()) if isinstance(newest, Level) else 0
        sample = [0, 1, new // 3, new // 2, new - 1]
        shares = [json_bytes(remap.share_for(c, new).to_json()) for c in sample]
        band = getattr(newest, "band", 0)
        passed = json_bytes(remap.compacted(band + new).to_json())

        def one_rank(previous: Remap | None = previous, before: int = before, cursors: np.ndarray = cursors) -> int:
            # What a new rank computes for its remaps: the plan, then one share per worker.
            again = rescale(previous, 0, before, cursors.tolist())
            return sum(json_bytes(again.share_for(w, new).to_json()) for w in range(new_workers))

        _, restore_s, restore_peak = measured(one_rank)
        print(
            f"{ranks} x {workers} -> {new_ranks} x {new_workers}: plan {planned * 1e3:.1f} ms; "
            f"whole level {whole:,} bytes (encoded); a new worker's share {min(shares):,}-{max(shares):,} bytes, "
            f"x {new_workers} workers = {max(shares) * new_workers:,} per rank; past the band {passed} bytes; "
            f"one new rank's remaps: {restore_s * 1e3:.1f} ms, peak {restore_peak / 2**20:.1f} MiB; "
            f"steps {[type(step).__name__ for step in remap.steps]}"
        )
        if not figures:
            figures = {"share": max(shares), "remap_s": restore_s, "remap_peak": restore_peak}
    return figures


def tokens(index: int) -> dict[str, Any]:
    """A document of 20-919 tokens, a pure function of its index (about 470 on average)."""
    length = 20 + (index * 2654435761) % 900
    return {"input_ids": list(range(1, length + 1))}


def packed(consumer: int, consumers: int) -> rs.Node:
    source = rs.from_list(range(DOCUMENTS)).shuffle(0).shard(consumer, consumers).map(tokens)
    return source.pack(SEQ_LEN, strategy="best_fit", buffer_size=BUFFER)


def pack_part(state: dict[str, Any]) -> int:
    """Bytes of the packer's own entries (everything but its upstream)."""
    return json_bytes({key: value for key, value in state.items() if key != "upstream"})


def with_packer(old: int, new: int, workers: int, remap_share: float, remap: dict[str, float]) -> None:
    """Part 2: a real packed pipeline, scaled down, extrapolated to 32,768 old consumers."""
    rng = np.random.default_rng(1)
    olds = []
    for consumer in range(old):
        pipe = packed(consumer, old)
        for _ in range(int(rng.integers(3, 12))):
            next(pipe)
        olds.append(pipe.get_state())
    before = [in_loader_bytes(state) for state in olds]
    before_pack = [pack_part(state) for state in olds]
    text = [json.dumps(state) for state in olds]
    _, parse_s, parse_peak = measured(lambda: [json.loads(t) for t in text])

    def one_rank() -> list[dict[str, Any]]:
        return [rescaled_state(packed(worker, new), olds) for worker in range(workers)]

    states, restore_s, restore_peak = measured(one_rank)
    after = [in_loader_bytes(state) for state in states]
    after_pack = [pack_part(state) for state in states]
    inherited = [len(state["inherited"]) for state in states]
    scale = OLD_RANKS * OLD_WORKERS / old
    print(
        f"\nreal pipeline, {old} -> {new} consumers (x {scale:.0f} to reach {OLD_RANKS * OLD_WORKERS:,}): "
        f"best_fit({BUFFER}), seq_len {SEQ_LEN}, N = 10^10"
    )
    print(
        f"  before: a worker's state {np.median(before) / KIB:.1f} kB in a Loader state (packer "
        f"{np.median(before_pack) / KIB:.1f} kB); a rank of {OLD_WORKERS} workers "
        f"{np.median(before) * OLD_WORKERS / KIB:.0f} kB"
    )
    print(
        f"  after: a new worker's state {np.median(after) / KIB:.1f} kB (packer {np.median(after_pack) / KIB:.1f} kB, "
        f"{int(np.median(inherited))} inherited pieces; remap at full scale {remap_share / KIB:.1f} kB); "
        f"a rank of {workers} workers {np.median(after) * workers / KIB:.0f} kB"
    )
    print(
        f"  one new rank's restore ({workers} workers): {restore_s * 1e3:.0f} ms, peak {restore_peak / 2**20:.1f} MiB "
        f"for {old} old states; parsing them {parse_s * 1e3:.1f} ms, {parse_peak / 2**20:.1f} MiB"
    )
    print(
        f"  extrapolated to {OLD_RANKS * OLD_WORKERS:,} old states: restore {restore_s * scale:.0f} s "
        f"+ parse {parse_s * scale:.1f} s + remaps {remap['remap_s']:.2f} s; "
        f"memory {(restore_peak + parse_peak) * scale / 2**30:.1f} GiB (old states held whole)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--drift", type=int, default=64, help="how far workers' cursors drift apart")
    parser.add_argument("--old", type=int, default=64, help="old consumers of the real pipeline")
    parser.add_argument("--new", type=int, default=36, help="new consumers of the real pipeline")
    args = parser.parse_args()
    figures = arithmetic(args.drift)
    with_packer(args.old, args.new, NEW_WORKERS, figures["share"], figures)


if __name__ == "__main__":
    main()
