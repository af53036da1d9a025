"""A DataLoader whose state covers every worker and restores exactly."""

from __future__ import annotations

import atexit
import functools
import warnings
import weakref
from typing import Any, Callable, Sequence

from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.stateful_dataloader import (
    _ITERATOR_FINISHED,
    _StatefulMultiProcessingDataLoaderIter,
)

from resumable.errors import ConfigError, StateError
from resumable.order.topology import distributed_rank
from resumable.state import check_json, require, require_count
from resumable.torch._worker_signals import init_worker
from resumable.torch.dataset import PipelineDataset, PipelineOrFactory
from resumable.torch.elastic import factory_of, rescale_for_rank

FORMAT = "format"
FORMAT_NAME = "resumable.Loader/1"
EPOCH = "epoch"
RANK = "rank"
WORLD_SIZE = "world_size"
NUM_WORKERS = "num_workers"
LOADER = "loader"
SNAPSHOT_EVERY = 16


class Loader(StatefulDataLoader):
    """``torchdata.stateful_dataloader.StatefulDataLoader`` over a pipeline that batches itself.

    Each worker iterates its own partition of the pipeline (``.shard()`` splits by worker).
    ``state_dict()`` holds, for every worker, the pipeline state as of the last batch *handed
    to you*: batches prefetched by workers but not yet consumed are produced again after a
    restore. The state is plain JSON data, in which each worker's pipeline state is one JSON
    string: StatefulDataLoader diffs and copies worker states with every batch, and a string
    makes that cost nothing (``python -m resumable inspect`` decodes them). Each ``iter()`` that does not follow a
    ``load_state_dict`` starts a new epoch (a new shuffle order in every worker).

    Workers send their pipeline state with every ``snapshot_every_n_steps``-th batch (16 by
    default: taking it with every batch cost about 15% of throughput on 2 cores). A restore
    starts from the last snapshot and replays the batches handed out since (at most 15),
    so it is still exact and its cost stays bounded; 1 makes restores replay nothing.

    Workers ignore a SIGTERM that does not come from the trainer (``workers_ignore_sigterm``,
    Linux): a scheduler that preempts a job sends it to every process, and the trainer, not
    its workers, decides when to stop, typically after saving a checkpoint. Workers still
    exit when the loader shuts them down (its SIGTERM is obeyed) or when the trainer dies.
    """

    def __init__(
        self,
        pipeline: PipelineOrFactory | PipelineDataset,
        num_workers: int = 0,
        *,
        collate_fn: Callable[[Any], Any] | None = None,
        pin_memory: bool = False,
        timeout: float = 0,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        multiprocessing_context: Any = None,
        worker_init_fn: Callable[[int], None] | None = None,
        workers_ignore_sigterm: bool = True,
        snapshot_every_n_steps: int = SNAPSHOT_EVERY,
    ) -> None:
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise ConfigError(f"Loader: num_workers must be a non-negative int, got {num_workers!r}")
        dataset = pipeline if isinstance(pipeline, PipelineDataset) else PipelineDataset(pipeline)
        if workers_ignore_sigterm:
            worker_init_fn = functools.partial(init_worker, worker_init_fn)
        with warnings.catch_warnings():  # torchdata calls a deprecated torch function here
            warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
            super().__init__(
                dataset,
                batch_size=None,
                num_workers=num_workers,
                collate_fn=collate_fn,
                pin_memory=pin_memory,
                timeout=timeout,
                prefetch_factor=prefetch_factor,
                persistent_workers=persistent_workers,
                multiprocessing_context=multiprocessing_context,
                worker_init_fn=worker_init_fn,
                snapshot_every_n_steps=snapshot_every_n_steps,
            )
        self._epoch = -1  # the epoch being iterated; -1 before the first iter()
        _OPEN_LOADERS.add(self)

    def __iter__(self) -> Any:
        restored = self.next_iter_state
        rescaled = self.dataset.rescaled is not None  # type: ignore[attr-defined]
        if not rescaled and (restored is None or restored.get(_ITERATOR_FINISHED, False)):
            self._epoch += 1  # a new epoch, not the continuation of a restored one
        self.dataset.set_epoch(max(self._epoch, 0))  # type: ignore[attr-defined]
        try:
            iterator = super().__iter__()
        except BaseException as error:
            _shut_down_half_built_iterators(error)
            raise
        if rescaled and self.num_workers:
            self.dataset.rescaled = None  # type: ignore[attr-defined]  # the workers have their copies
        return iterator

    def close(self) -> None:
        """Stop the workers now. The next ``iter()`` starts new ones where this one stopped."""
        if self._iterator is None:
            return
        state = self.state_dict()
        self._stop_workers()
        self.load_state_dict(state)

    def _stop_workers(self) -> None:
        iterator: object = self._iterator  # type: ignore[has-type]
        self._iterator = None
        if isinstance(iterator, _StatefulMultiProcessingDataLoaderIter):
            iterator._shutdown_workers()

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def epoch(self) -> int:
        return max(self._epoch, 0)

    def state_dict(self) -> dict[str, Any]:
        """Every worker's position as of the last batch handed out, as JSON data."""
        rank, world_size = distributed_rank()
        if self._iterator is None and self.next_iter_state is not None:
            loader_state = self.next_iter_state  # loaded but not iterated yet: nothing moved
        else:
            self.dataset.set_epoch(self.epoch)  # type: ignore[attr-defined]
            loader_state = super().state_dict()
        state = {
            FORMAT: FORMAT_NAME,
            EPOCH: self.epoch,
            RANK: rank,
            WORLD_SIZE: world_size,
            NUM_WORKERS: self.num_workers,
            LOADER: loader_state,
        }
        return state

    def load_state_dict(self, state_dict: dict[str, Any] | Sequence[dict[str, Any]]) -> None:
        """Continue exactly after the last batch handed out when ``state_dict`` was taken.

        Given the states of *every* rank of the old job (a list, in rank order), continue
        its epoch on this job's ranks and workers, however many: see ``resumable.elastic``.
        """
        if isinstance(state_dict, dict):
            self._load_own(state_dict)
        else:
            self._load_all_ranks(state_dict)

    def _load_all_ranks(self, states: Sequence[dict[str, Any]]) -> None:
        path = "Loader"
        check_json(list(states), path)
        if not states:
            raise StateError(f"{path}: no rank states to resume from")
        for index, state in enumerate(states):
            where = f"{path} (old rank {index})"
            if not isinstance(state, dict) or state.get(FORMAT) != FORMAT_NAME:
                raise StateError(f"{where}: not a resumable Loader state (format {FORMAT_NAME!r} expected)")
            saved = (require(state, RANK, int, where), require(state, WORLD_SIZE, int, where))
            if saved != (index, len(states)):
                raise StateError(
                    f"{path}: give every old rank's state in rank order; entry {index} of {len(states)} is "
                    f"rank {saved[0]} of {saved[1]}"
                )
            require(state, NUM_WORKERS, int, where)
            require(state, LOADER, dict, where)
        epochs = {require_count(state, EPOCH, path) for state in states}
        if len(epochs) != 1:
            raise StateError(f"{path}: old ranks were in different epochs {sorted(epochs)}")
        rank, world_size = distributed_rank()
        same = len(states) == world_size and all(state[NUM_WORKERS] == self.num_workers for state in states)
        if same:
            self._load_own(states[rank])
            return
        epoch = epochs.pop()
        self.next_iter_state, self._iterator = None, None
        self._epoch = epoch
        if all(state[LOADER].get(_ITERATOR_FINISHED, False) for state in states):
            return  # taken between epochs: the next iter() starts the next epoch on this topology
        dataset: PipelineDataset = self.dataset  # type: ignore[assignment]
        build = factory_of(dataset._pipeline, dataset._factory)
        dataset.rescaled = rescale_for_rank(build, states, rank, world_size, self.num_workers)

    def _load_own(self, state_dict: dict[str, Any]) -> None:
        path = "Loader"
        check_json(state_dict, path)
        if not isinstance(state_dict, dict) or state_dict.get(FORMAT) != FORMAT_NAME:
            raise StateError(f"{path}: not a resumable Loader state (format {FORMAT_NAME!r} expected)")
        rank, world_size = distributed_rank()
        for key, current in ((RANK, rank), (WORLD_SIZE, world_size), (NUM_WORKERS, self.num_workers)):
            saved = require(state_dict, key, int, path)
            if saved != current:
                raise StateError(f"{path}: state was saved with {key}={saved}, this loader has {key}={current}")
        epoch = require_count(state_dict, EPOCH, path)
        self._epoch = epoch
        self.dataset.rescaled = None  # type: ignore[attr-defined]
        super().load_state_dict(require(state_dict, LOADER, dict, path))


_OPEN_LOADERS: weakref.WeakSet[Loader] = weakref.WeakSet()


@atexit.register
def _close_open_loaders() -> None:
    """Stop every loader's workers the orderly way before Python's exit hooks terminate them.

    Registered after torch's and multiprocessing's own hooks, so it runs before them.
    """
    for loader in list(_OPEN_LOADERS):
        loader._stop_workers()


def _shut_down_half_built_iterators(error: BaseException) -> None:
    """Stop the workers of an iterator whose start-up raised (a worker failed to restore).

    The half-built iterator stays reachable from the traceback, and when it is finally
    collected its workers no longer answer the shutdown request: each one costs a join timeout.
    """
    traceback = error.__traceback__
    while traceback is not None:
        candidate = traceback.tb_frame.f_locals.get("self")
        if isinstance(candidate, _StatefulMultiProcessingDataLoaderIter):
            candidate._shutdown_workers()
        traceback = traceback.tb_next
