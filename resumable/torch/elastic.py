"""Elastic resume for ``rs.torch.Loader``: every old rank's loader state in, this rank's
workers' pipeline states out.

A Loader state holds each worker's pipeline state as of the last batch handed out (workers hand
it over with every batch), so the old consumers' states are read as they are, with nothing
replayed, and ``resumable.elastic`` splits what is left over this rank's new workers.

States saved by earlier versions, whose workers handed their state over every few batches, may
count batches handed out after it; those are advanced here once (``handed_out_states``), at
most ``snapshot_every_n_steps - 1`` batches per old rank, so such states still rescale exactly.
"""

from __future__ import annotations

import copy
import json
from typing import Any, Callable, Sequence

from resumable.core.node import Node
from resumable.elastic import OldState, as_consumer, rescaled_states
from resumable.errors import StateError
from resumable.loader_state import LoaderState
from resumable.order.topology import Topology


def old_consumer_states(build: Callable[[], Node[Any]], olds: Sequence[LoaderState]) -> list[OldState]:
    """Every old consumer's exact pipeline state, in consumer order (rank-major): the JSON text
    the Loader state holds, parsed by the rescale, or (states of earlier versions that count
    batches after their workers' snapshots) the state of the old worker advanced by them."""
    consumers: list[OldState] = []
    for old in olds:
        consumers.extend(old.texts if not old.steps_since_snapshot else handed_out_states(build, old))
    return consumers


def handed_out_states(build: Callable[[], Node[Any]], old: LoaderState) -> list[dict[str, Any]]:
    """Each worker's pipeline state (one without workers) as of the last batch handed out.

    A state of this version is that already. One saved by an earlier version may count
    ``steps_since_snapshot`` batches after its workers' snapshots: those are advanced here, in
    the DataLoader's round-robin order (an exhausted worker is skipped).
    """
    workers = old.pipelines
    if not old.steps_since_snapshot:
        return workers
    pipelines: dict[int, Node[Any]] = {}
    exhausted: set[int] = set()
    turn = (old.last_yielded_worker + 1) % old.num_workers
    for _ in range(old.steps_since_snapshot):
        while True:
            if len(exhausted) == old.num_workers:
                raise StateError(
                    f"Loader rank {old.rank}: the state counts more batches than its workers hold "
                    f"({old.steps_since_snapshot} since the snapshot)"
                )
            worker, turn = turn, (turn + 1) % old.num_workers
            if worker in exhausted:
                continue
            if worker not in pipelines:
                pipeline = pipelines[worker] = as_consumer(
                    build(), Topology(old.rank, old.world_size, worker, old.num_workers)
                )
                # Replayed with the old options (a rescale may change the batch size).
                pipeline._adopt_elastic_options(workers[worker], pipeline.kind)
                pipeline.set_state(workers[worker])
            try:
                next(pipelines[worker])
                break
            except StopIteration:
                exhausted.add(worker)
    return [
        pipelines[worker].get_state() if worker in pipelines else workers[worker] for worker in range(old.num_workers)
    ]


def rescale_for_rank(
    build: Callable[[], Node[Any]],
    olds: Sequence[LoaderState],
    rank: int,
    world_size: int,
    num_workers: int,
) -> dict[int, str]:
    """The JSON pipeline state each of this rank's workers (0 without workers) continues from."""
    consumers = old_consumer_states(build, olds)
    workers = max(num_workers, 1)
    pipelines = [
        as_consumer(build(), Topology(rank, world_size, worker if num_workers else 0, workers))
        for worker in range(workers)
    ]
    states = rescaled_states(pipelines, consumers)  # the old states read once for every worker
    return {worker: json.dumps(state, separators=(",", ":")) for worker, state in enumerate(states)}


def factory_of(pipeline: Node[Any] | None, factory: Callable[[], Node[Any]] | None) -> Callable[[], Node[Any]]:
    """A function building fresh copies of the loader's pipeline."""
    if factory is not None:
        return factory
    if pipeline is None:
        raise StateError("Loader: its dataset holds neither a pipeline nor a factory")
    template = pipeline
    return lambda: copy.deepcopy(template)
