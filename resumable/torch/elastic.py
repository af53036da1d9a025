"""Elastic resume for ``rs.torch.Loader``: every old rank's loader state in, this rank's
workers' pipeline states out.

A Loader state holds each worker's pipeline state as of its last *snapshot* and the number of
batches handed out since (``snapshot_every_n_steps``). To know exactly where each old worker
stopped, the old workers are replayed here from their snapshots, in the DataLoader's
round-robin order (an exhausted worker is skipped), at most ``snapshot_every_n_steps - 1``
batches in all per old rank. Then ``resumable.elastic`` splits what is left over this rank's
new workers.
"""

from __future__ import annotations

import copy
import json
from typing import Any, Callable, Sequence

from resumable.elastic import rescaled_state
from resumable.errors import StateError
from resumable.node import Node
from resumable.order.topology import Topology, assume
from resumable.torch.dataset import PIPELINE

LoaderState = dict[str, Any]

# Keys of torchdata's StatefulDataLoader state.
SNAPSHOT = "_snapshot"
WORKER_SNAPSHOTS = "_worker_snapshots"
LAST_YIELDED = "_last_yielded_worker_id"
STEPS_SINCE = "_steps_since_snapshot"
FETCHER_STATE = "fetcher_state"
ITER_STATE = "dataset_iter_state"


def old_consumer_states(build: Callable[[], Node[Any]], old: Sequence[LoaderState]) -> list[dict[str, Any]]:
    """Every old consumer's exact pipeline state, in consumer order (rank-major)."""
    states: list[dict[str, Any]] = []
    world_size = len(old)
    for rank, state in enumerate(old):
        num_workers = state["num_workers"]
        loader = state["loader"]
        if num_workers == 0:
            states.append(_pipeline_state(loader, f"Loader rank {rank}"))
            continue
        snapshot = loader[SNAPSHOT]
        workers = [
            _pipeline_state(snapshot[WORKER_SNAPSHOTS][f"worker_{w}"], f"Loader rank {rank} worker {w}")
            for w in range(num_workers)
        ]
        steps = loader[STEPS_SINCE]
        if steps:
            workers = _replay(build, workers, rank, world_size, snapshot[LAST_YIELDED], steps)
        states.extend(workers)
    return states


def _pipeline_state(holder: dict[str, Any], where: str) -> dict[str, Any]:
    try:
        encoded = holder[FETCHER_STATE][ITER_STATE][PIPELINE]
        return json.loads(encoded)  # type: ignore[no-any-return]
    except (KeyError, TypeError, ValueError) as exc:
        raise StateError(f"{where}: no pipeline state in the saved loader state ({exc})") from exc


def _replay(
    build: Callable[[], Node[Any]],
    snapshots: list[dict[str, Any]],
    rank: int,
    world_size: int,
    last_yielded: int,
    steps: int,
) -> list[dict[str, Any]]:
    """Advance the workers of one old rank by ``steps`` batches handed out round-robin."""
    num_workers = len(snapshots)
    pipelines: dict[int, Node[Any]] = {}
    exhausted: set[int] = set()
    turn = (last_yielded + 1) % num_workers
    for _ in range(steps):
        while True:
            if len(exhausted) == num_workers:
                raise StateError(f"Loader rank {rank}: the state counts more batches than its workers hold")
            worker, turn = turn, (turn + 1) % num_workers
            if worker in exhausted:
                continue
            with assume(Topology(rank, world_size, worker, num_workers)):
                if worker not in pipelines:
                    pipelines[worker] = build()
                    pipelines[worker].set_state(snapshots[worker])
                try:
                    next(pipelines[worker])
                    break
                except StopIteration:
                    exhausted.add(worker)
    return [
        pipelines[worker].get_state() if worker in pipelines else snapshots[worker] for worker in range(num_workers)
    ]


def rescale_for_rank(
    build: Callable[[], Node[Any]],
    old: Sequence[LoaderState],
    rank: int,
    world_size: int,
    num_workers: int,
) -> dict[int, str]:
    """The JSON pipeline state each of this rank's workers (0 without workers) continues from."""
    consumers = old_consumer_states(build, old)
    workers = max(num_workers, 1)
    rescaled = {}
    for worker in range(workers):
        with assume(Topology(rank, world_size, worker if num_workers else 0, workers)):
            pipeline = build()
            rescaled[worker] = json.dumps(rescaled_state(pipeline, consumers), separators=(",", ":"))
    return rescaled


def factory_of(pipeline: Node[Any] | None, factory: Callable[[], Node[Any]] | None) -> Callable[[], Node[Any]]:
    """A function building fresh copies of the loader's pipeline."""
    if factory is not None:
        return factory
    if pipeline is None:
        raise StateError("Loader: its dataset holds neither a pipeline nor a factory")
    template = pipeline
    return lambda: copy.deepcopy(template)
