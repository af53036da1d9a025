"""Elastic rescale at scale: 4096 ranks x 8 workers -> 3000 x 6, mid-epoch, with a packer.

Two parts, printed side by side:

1. *Remap arithmetic at full scale, no data*: an epoch of 10^10 documents read by 4096 x 8
   consumers stopped at a random point (workers up to ``--drift`` positions apart), resumed on
   3000 x 6, then again on 1000 x 4 after the new consumers passed the band. The time to plan
   a rescale, the remap a new worker saves (its share of the level) and a whole level's size
   beside it, and one new rank's remap restore (plan + six shares) with its time and peak
   Python memory (tracemalloc).
2. *A real pipeline with a packer, at full scale*: ``from_list(range(10^10)) -> shuffle ->
   shard -> map(tokens) -> pack(best_fit, buffer_size=1000)`` in ``rs.torch.Loader`` states of
   4096 ranks x 8 workers, each worker a few rows into the epoch. The old workers that the
   measured new rank (``--rank``) inherits from, and ``--sample`` others spread over the old
   ranks, are run for real (in ``--processes`` processes); every other old worker's state is the
   real state of one of those, its shard relabelled (same size, a real run's cursor and buffer).
   Measured: an old rank's Loader state; one new rank's ``Loader.load_state_dict`` of all 4096
   old rank states as ``rs.load_state`` gives them (dicts, each worker's pipeline state JSON
   text inside), its time and peak Python memory (tracemalloc, second call, untimed); its six
   workers' ``set_state`` and first row; the new rank's Loader state then and after that row.

    python bench/bench_elastic.py [--rank 1500] [--sample 256] [--processes 2] [--drift 64] [--state-every-row]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import time
import tracemalloc
from typing import Any, Callable

import numpy as np
import orjson

import resumable as rs
import resumable.loader_state as ls
import resumable.torch as rst
from resumable.elastic import as_consumer
from resumable.order.elastic import Level, Remap, rescale, shard_sizes
from resumable.order.topology import Topology
from resumable.pack import expand_references
from resumable.pack._rescale import inherited_from

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
    figures: dict[str, float] = {}  # of the first rescale
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


def build() -> rs.Node:
    """The pipeline of every rank and worker (the Loader resolves the shard's rank and worker)."""
    source = rs.from_list(range(DOCUMENTS)).shuffle(0).shard().map(tokens)
    return source.pack(SEQ_LEN, strategy="best_fit", buffer_size=BUFFER)


def consumer_pipeline(consumer: int, workers: int, ranks: int) -> rs.Node:
    return as_consumer(build(), Topology(consumer // workers, ranks, consumer % workers, workers))


def old_worker_state(consumer: int) -> str:
    """A real old worker's pipeline state after 3-11 rows, as JSON text (as its Loader holds it);
    with ``STATE_EVERY_ROW``, taken after every row, as a Loader's worker does with every batch."""
    pipe = consumer_pipeline(consumer, OLD_WORKERS, OLD_RANKS)
    for _ in range(3 + consumer * 7919 % 9):
        next(pipe)
        if STATE_EVERY_ROW[0]:
            pipe.get_state()
    return orjson.dumps(pipe.get_state()).decode()


STATE_EVERY_ROW = [False]
"""Set by ``--state-every-row`` (the old workers' processes are forked, so they see it): the old
workers' packers then save a base and the log since (docs/packing.md)."""


def relabelled(text: str, consumer: int) -> str:
    """Another consumer's real state standing for ``consumer``: its shard relabelled, its cursor,
    buffer and counters those of a real run."""
    state = json.loads(text)
    node = state
    while node["kind"] != "Shard":
        node = node["upstream"]
    node.update(rank=consumer // OLD_WORKERS, worker=consumer % OLD_WORKERS)
    return orjson.dumps(state).decode()


def old_texts(real: list[int], processes: int) -> list[str]:
    """Every old consumer's pipeline state: real runs for ``real`` (those the measured rank
    inherits from among them), the others real runs of a consumer of ``real`` relabelled."""
    with multiprocessing.get_context("fork").Pool(processes) as pool:
        runs = dict(zip(real, pool.map(old_worker_state, real, chunksize=4)))
    donors = sorted(runs)
    return [
        runs[c] if c in runs else relabelled(runs[donors[c % len(donors)]], c) for c in range(OLD_RANKS * OLD_WORKERS)
    ]


def loader_state(rank: int, world_size: int, texts: list[str]) -> dict[str, Any]:
    """A Loader state of ``rank`` holding ``texts``, one worker's pipeline state each, as
    ``rs.torch.Loader.state_dict()`` writes it (format 3, a state with every batch)."""
    workers = {
        f"{ls.WORKER_PREFIX}{w}": {
            ls.WORKER_ID: w,
            ls.DATASET_STATE: None,
            ls.FETCHER_STATE: {ls.FETCHER_ENDED: False, ls.ITER_STATE: {ls.PIPELINE: text, ls.PASS_EPOCH: 0}},
        }
        for w, text in enumerate(texts)
    }
    main = {
        ls.MAIN_NUM_WORKERS: len(texts),
        "_sampler_iter_state": None,
        "_index_sampler_state": None,
        ls.SAMPLER_ITER_YIELDED: 8 * len(texts),
        ls.LEN_CALLED: None,
        ls.SHARED_SEED: None,
        ls.BASE_SEED: 1234,
    }
    snapshot = {ls.SNAPSHOT_STEP: 8 * len(texts), ls.LAST_YIELDED: len(texts) - 1, ls.MAIN_SNAPSHOT: main}
    snapshot[ls.WORKER_SNAPSHOTS] = workers
    loader = {ls.SNAPSHOT: snapshot, ls.STEPS_SINCE: 0, ls.ITERATOR_FINISHED: False}
    return {
        ls.FORMAT: ls.FORMAT_NAME,
        ls.EPOCH: 0,
        ls.RANK: rank,
        ls.WORLD_SIZE: world_size,
        ls.NUM_WORKERS: len(texts),
        ls.SNAPSHOT_EVERY: 1,
        ls.LOADER: loader,
    }


def with_packer(rank: int, sample: int, processes: int, rows_later: list[int]) -> None:
    """Part 2: a real packed pipeline at full scale, one new rank's Loader restore."""
    new_consumers = NEW_RANKS * NEW_WORKERS
    mine = [rank * NEW_WORKERS + w for w in range(NEW_WORKERS)]
    inherited = sorted({i for j in mine for i in inherited_from(j, new_consumers, OLD_RANKS * OLD_WORKERS)})
    spread = {i * OLD_RANKS * OLD_WORKERS // sample for i in range(sample)}
    real = sorted(spread | set(inherited))
    start = time.perf_counter()
    texts = old_texts(real, processes)
    made = time.perf_counter() - start
    olds = [loader_state(r, OLD_RANKS, texts[r * OLD_WORKERS : (r + 1) * OLD_WORKERS]) for r in range(OLD_RANKS)]
    del texts
    before = [json_bytes(state) for state in olds]
    print(
        f"\nreal pipeline at full scale: {OLD_RANKS} x {OLD_WORKERS} -> {NEW_RANKS} x {NEW_WORKERS}, "
        f"best_fit({BUFFER}), seq_len {SEQ_LEN}, N = 10^10; {len(real)} old workers run for real "
        f"(the {len(inherited)} that new rank {rank} inherits from among them), the others real runs "
        f"of those relabelled; made in {made:.0f} s"
    )
    print(
        f"  before: an old rank's Loader state {np.median(before) / KIB:.1f} kB median, {max(before) / KIB:.1f} kB max "
        f"({OLD_WORKERS} workers; all {OLD_RANKS:,} ranks {sum(before) / 2**20:.0f} MiB)"
    )

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(NEW_RANKS))

    def restore_rank() -> dict[int, str]:
        loader = rst.Loader(build, num_workers=NEW_WORKERS)
        loader.load_state_dict(olds)  # the old ranks' states as rs.load_state gives them
        rescaled: dict[int, str] = loader.dataset.rescaled
        return rescaled

    rescaled, restore_s, restore_peak = measured(restore_rank)
    cpu = time.process_time()
    restore_rank()
    restore_cpu = time.process_time() - cpu
    after = json_bytes(loader_state(rank, NEW_RANKS, [rescaled[w] for w in range(NEW_WORKERS)]))
    pieces = [json.loads(rescaled[w])["sections"][3] for w in range(NEW_WORKERS)]

    def workers() -> list[str]:
        """What each new worker does with its state: set_state, then its first row."""
        saved = []
        for worker in range(NEW_WORKERS):
            pipe = as_consumer(build(), Topology(rank, NEW_RANKS, worker, NEW_WORKERS))
            pipe.set_state(json.loads(rescaled[worker]))
            next(pipe)
            saved.append(orjson.dumps(pipe.get_state()).decode())
        return saved

    stepped, workers_s, workers_peak = measured(workers)
    after_row = json_bytes(loader_state(rank, NEW_RANKS, stepped))

    def later(rows: int) -> tuple[int, list[int]]:
        """The new rank's Loader state after ``rows`` rows per worker, and each worker's pieces
        held then by key kind (stride keys, leaf keys)."""
        saved, kinds = [], [0, 0]
        for worker in range(NEW_WORKERS):
            pipe = as_consumer(build(), Topology(rank, NEW_RANKS, worker, NEW_WORKERS))
            pipe.set_state(json.loads(rescaled[worker]))
            for _ in range(rows):
                next(pipe)
            state = pipe.get_state()  # the packer's (the outermost node's)
            for ref in expand_references(state)["open"]:
                kinds[0 if len(ref) > 4 and isinstance(ref[-5], dict) else 1] += 1
            saved.append(orjson.dumps(state).decode())
        return json_bytes(loader_state(rank, NEW_RANKS, saved)), kinds

    print(
        f"  one new rank's restore (Loader.load_state_dict of the {OLD_RANKS:,} old rank states, as parsed "
        f"JSON with each worker's pipeline state as JSON text): {restore_s * 1e3:.0f} ms "
        f"(CPU {restore_cpu * 1e3:.0f} ms in a third call), peak {restore_peak / 2**20:.1f} MiB; "
        f"load {os.getloadavg()[0]:.1f}"
    )
    print(
        f"  then its {NEW_WORKERS} workers' set_state + first row, one after the other: {workers_s * 1e3:.0f} ms, "
        f"peak {workers_peak / 2**20:.1f} MiB"
    )
    print(
        f"  after: the new rank's Loader state {after / KIB:.1f} kB ({NEW_WORKERS} workers inheriting "
        f"{min(pieces)}-{max(pieces)} pieces, {sum(pieces)} in all), {after_row / KIB:.1f} kB after each "
        "worker's first row"
    )
    for rows in rows_later:
        size, (stride_keys, leaf_keys) = later(rows)
        print(
            f"  after {rows} rows per worker: the new rank's Loader state {size / KIB:.1f} kB (open pieces with "
            f"stride keys {stride_keys}, with leaf keys {leaf_keys}: the rescaled epoch's own reads)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--state-every-row", action="store_true", help="old workers take a state after every row (a Loader's)"
    )
    parser.add_argument("--drift", type=int, default=64, help="how far workers' cursors drift apart")
    parser.add_argument("--rank", type=int, default=NEW_RANKS // 2, help="the new rank whose restore is measured")
    parser.add_argument("--sample", type=int, default=256, help="old workers run for real besides the inherited ones")
    parser.add_argument("--processes", type=int, default=2, help="processes running the old workers")
    parser.add_argument(
        "--later", type=int, nargs="*", default=[300, 1000], help="rows per new worker before measuring again"
    )
    args = parser.parse_args()
    STATE_EVERY_ROW[0] = args.state_every_row
    arithmetic(args.drift)
    with_packer(args.rank, args.sample, args.processes, args.later)


if __name__ == "__main__":
    main()
