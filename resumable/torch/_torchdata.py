"""Every use of torchdata's (and torch's DataLoader's) private names, in one place, but for
one read of the DataLoader's ``_iterator`` in ``Loader.state_dict()``, which a training loop
calls with every step: a call to ``current_iterator`` there costs a fifth of the whole call.

``rs.torch.Loader`` builds on ``torchdata.stateful_dataloader.StatefulDataLoader``'s public API
(``state_dict``, ``load_state_dict``, ``next_iter_state``), and on these private parts, which a
torchdata release may change: its iterator classes (subclassed to bound their counters), the
DataLoader's ``_iterator`` attribute and ``_get_iterator`` hook, the workers' shutdown. The
names of torchdata's state keys live in ``resumable.loader_state``. ``tests/test_torchdata_private.py``
checks that every name used here still exists with the expected shape, so an incompatible
torchdata fails there, loudly, rather than deep inside a training job.
"""

from __future__ import annotations

import os
from types import FunctionType
from typing import Any, NamedTuple, cast

from torch._utils import ExceptionWrapper
from torch.utils.data.dataloader import _DatasetKind
from torchdata.stateful_dataloader import Stateful
from torchdata.stateful_dataloader.incremental_state import (
    _DATASET_ITER_STATE,
    _DATASET_STATE,
    _FETCHER_ENDED,
    _FETCHER_STATE,
)
from torchdata.stateful_dataloader.stateful_dataloader import (
    _INDEX_SAMPLER_STATE,
    _ITERABLEDATASET_LEN_CALLED,
    _ITERATOR_FINISHED,
    _SAMPLER_ITER_STATE,
    _SAMPLER_ITER_YIELDED,
    _SHARED_SEED,
    _StatefulBaseDataLoaderIter,
    _StatefulMultiProcessingDataLoaderIter,
    _StatefulSingleProcessDataLoaderIter,
)

from resumable.errors import ConfigError, StateError
from resumable.loader_state import MAX_COUNT
from resumable.torch.dataset import BatchWithState

NEVER = 2**63
"""The snapshot interval the Loader gives torchdata: past any count a state holds
(``MAX_COUNT``), so torchdata never asks its workers for a snapshot; the states ride along
with the batches instead (``_MultiProcessIterator``)."""

PRIVATE_NAMES = {
    _StatefulBaseDataLoaderIter: ("_next_index", "__next__"),
    _StatefulMultiProcessingDataLoaderIter: (
        "_shutdown_workers",
        "_get_main_state",
        "_reset",
        "_process_data",
        "_update_worker_snapshot",
        "_worker_key",
    ),
}
"""Private methods used here, by class; the test checks them."""
PRIVATE_ATTRIBUTES = {
    _StatefulBaseDataLoaderIter: (
        "_num_yielded",
        "_sampler_iter_yielded",
        "_finished",
        "_dataset_kind",
        "_index_sampler",
        "_sampler_iter",
        "_IterableDataset_len_called",
        "_shared_seed",
    ),
    _StatefulSingleProcessDataLoaderIter: ("_dataset_fetcher",),
    _StatefulMultiProcessingDataLoaderIter: (
        "_send_idx",
        "_rcvd_idx",
        "_worker_snapshots",
        "_snapshot_interval",
        "_index_queues",
        "_worker_result_queue",
        "_shutdown",
    ),
}
"""Private attributes of a live iterator used here, by class (set by ``__init__``); the test
checks them, with the snapshot's entry names (``_SNAPSHOT`` ... ``_STEPS_SINCE_SNAPSHOT``)."""
LOADER_HOOKS = ("_iterator", "_get_iterator")
"""Private DataLoader attribute and hook ``rs.torch.Loader`` uses."""


class _Bounded(_StatefulBaseDataLoaderIter):  # type: ignore[misc]  # torchdata is untyped (Any)
    """Stops with a StateError rather than count a pass's batches (or the indices torchdata
    sends ahead) past ``MAX_COUNT``: every state the Loader saves then loads again."""

    latest: dict[str, Any] | None = None
    """``state_dict()`` as of the last batch handed out, built as that batch arrived, or None
    where ``state_dict()`` must build it (no batch yet, the pass ended, no workers)."""

    def __next__(self) -> Any:
        if self._num_yielded >= MAX_COUNT:
            raise StateError(
                f"Loader: {self._num_yielded:,} batches handed out in this pass, the most a state can count"
            )
        return super().__next__()

    def _next_index(self) -> Any:
        if self._sampler_iter_yielded >= MAX_COUNT:
            raise StateError(
                f"Loader: {self._sampler_iter_yielded:,} batches requested in this pass, the most a state can count"
            )
        return super()._next_index()


class _SingleProcessIterator(_Bounded, _StatefulSingleProcessDataLoaderIter):  # type: ignore[misc]  # torchdata is untyped (Any)
    """torchdata's iterator without workers, held to ``MAX_COUNT``, whose ``state_dict()``
    asks whether the sampler, its iterator, the dataset and the dataset's iterator are
    ``Stateful`` once per class: torchdata asks at every call, a runtime ``Protocol`` check
    of 10-20 us each, two thirds of a call that a training loop makes with every step."""

    def state_dict(self) -> dict[str, Any]:
        """torchdata's entries (``tests/test_torchdata_private.py`` compares)."""
        fetcher = self._dataset_fetcher
        if self._dataset_kind == _DatasetKind.Iterable:
            fetcher_state = {_DATASET_ITER_STATE: _state_of(fetcher.dataset_iter), _FETCHER_ENDED: fetcher.ended}
            dataset_state = None if fetcher.dataset_iter is fetcher.dataset else _state_of(fetcher.dataset)
        else:
            fetcher_state, dataset_state = None, _state_of(fetcher.dataset)
        return {
            _INDEX_SAMPLER_STATE: _state_of(self._index_sampler),
            _SAMPLER_ITER_STATE: _state_of(self._sampler_iter),
            _SAMPLER_ITER_YIELDED: self._sampler_iter_yielded,
            self._NUM_YIELDED: self._num_yielded,
            _ITERABLEDATASET_LEN_CALLED: self._IterableDataset_len_called,
            _SHARED_SEED: self._shared_seed,
            _FETCHER_STATE: fetcher_state,
            _DATASET_STATE: dataset_state,
            _ITERATOR_FINISHED: self._finished,
        }


_QUEUES_OF_LIVE_ITERATORS: dict[int, tuple[Any, Any]] = {}
"""Each live iterator's queues to its workers (and from them), by the iterator's id, until its
workers are shut down.

An iterator stops its workers in ``__del__`` by putting ``None`` on each worker's index queue;
a queue's feeder thread then writes it to the worker. When the iterator is in a reference
cycle (a traceback that holds the training loop's frame, for one), the cyclic garbage collector
runs every weakref callback of the garbage before any ``__del__``, and ``multiprocessing``'s
finalizer of each queue is one: it stops the queue's feeder thread. ``__del__`` then puts
``None`` where nothing sends it, and torch waits 5 s for each worker before it terminates it.
Held here, the queues are not garbage while the iterator is, so they are finalized only after
its ``__del__`` has stopped the workers."""


class _MultiProcessIterator(_Bounded, _StatefulMultiProcessingDataLoaderIter):  # type: ignore[misc]  # torchdata is untyped (Any)
    """torchdata's iterator over workers, held to ``MAX_COUNT``, whose state is as of the last
    batch handed out without torchdata's per-batch snapshots.

    With a snapshot at every batch, torchdata's workers build a state dict around the
    pipeline's, diff it against the previous one and ship the difference, and the main process
    applies it and rebuilds every worker's state, per batch (in a first measurement, with a
    constant state, as much CPU as the Loader's whole overhead: docs/benchmarks.md). Here the
    Loader's workers yield ``BatchWithState`` (the batch and the pipeline state right after it)
    and torchdata's interval is ``NEVER``; this iterator keeps, as each batch is handed out,
    what torchdata's snapshot would then hold (the step, the worker, the sampler count sent
    with that batch's index, each worker's latest state: a few dicts per batch), and
    ``state_dict()`` wraps them. The states are torchdata's own, entry for entry
    (``tests/test_loader_every_batch.py`` compares them with a ``StatefulDataLoader`` that
    snapshots every batch), so they load as before.

    Its main-process snapshot asks whether the sampler and the sampler's iterator are
    ``Stateful``: a runtime ``Protocol`` check, about 10-20 us each on Python 3.11. The answer
    depends only on their classes, so it is asked once per class here; the entries are
    torchdata's (``tests/test_torchdata_private.py`` compares). Unless a sampler is
    ``Stateful``, every entry but the sampler count stays the same for a whole pass (torchdata
    sets them as the pass starts and as a restoring iterator starts), so they are read once per pass.
    """

    # The registry, reached through the class: an iterator still alive when the interpreter
    # exits (a script's global) is deleted after the module's globals are cleared.
    _live_queues = _QUEUES_OF_LIVE_ITERATORS
    _getpid = staticmethod(os.getpid)  # likewise

    def _shutdown_workers(self) -> None:
        pid = self._getpid()
        if pid != getattr(self, "_owner_pid", pid):  # a copy in a forked child
            self._shutdown = True  # the workers, queues and threads are the parent's to stop
            return
        try:
            super()._shutdown_workers()
        finally:
            self._live_queues.pop(id(self), None)

    def _reset(self, loader: Any, first_iter: bool = False, prime_prefetch: bool = True) -> None:
        self._owner_pid = self._getpid()
        # torchdata's __init__ resets once its workers have started, before it restores
        self._live_queues[id(self)] = (self._index_queues, self._worker_result_queue)
        # Before torchdata's reset, which sends the first indices of the pass.
        self._sampler_counts: dict[int, int] = {}  # send index -> _sampler_iter_yielded when it was sent
        self._as_of_batch: _AsOfBatch | None = None  # what the snapshot holds as of the last batch handed out
        self._as_of_batch_before: _AsOfBatch | None = None  # the one before (a batch interrupted on its way)
        self._pass_main_state: dict[str, Any] | None = None  # the main snapshot's entries read this pass
        self.latest = None
        super()._reset(loader, first_iter, prime_prefetch)
        # Each worker's state as a snapshot would hold it now, by worker key: torchdata's as the
        # pass starts, then the one shipped with its latest batch, or torchdata's again when its
        # pass ends. Its id and dataset state do not change until then.
        self._latest_states = {key: incremental.get_state() for key, incremental in self._worker_snapshots.items()}

    def _next_index(self) -> Any:
        index = super()._next_index()
        self._sampler_counts[self._send_idx] = self._sampler_iter_yielded  # torchdata's main snapshot entry
        return index

    def _process_data(self, data: Any, worker_id: int, state_dict: Any) -> Any:
        if type(data) is not BatchWithState:
            # an exception from the worker (torchdata raises it), or a loader whose torchdata
            # snapshots were switched back on (an interval set after construction)
            if isinstance(data, ExceptionWrapper) or self._snapshot_interval != NEVER:
                return super()._process_data(data, worker_id, state_dict)
            raise ConfigError(
                "Loader: a worker handed a batch over without its state: its collate_fn was replaced after "
                "construction; pass collate_fn=... to rs.torch.Loader instead"
            )
        data, shipped = data
        key = self._worker_key(worker_id)
        fetcher = {_FETCHER_ENDED: False, _DATASET_ITER_STATE: shipped}
        self._latest_states[key] = {**self._latest_states[key], _FETCHER_STATE: fetcher}
        self._as_of_batch_before = self._as_of_batch
        # torchdata counts a batch after this call, and not an error (which it raises here)
        step = self._num_yielded + (not isinstance(data, ExceptionWrapper))
        snapshot = {  # built once per batch, not per state_dict() call
            self._SNAPSHOT_STEP: step,
            self._LAST_YIELDED_WORKER_ID: worker_id,
            self._MAIN_SNAPSHOT: self._main_state_as_of(self._sampler_counts.pop(self._rcvd_idx - 1)),
            self._WORKER_SNAPSHOTS: dict(self._latest_states),
        }
        self._as_of_batch = _AsOfBatch(step, snapshot)
        return super()._process_data(data, worker_id, state_dict)

    def __next__(self) -> Any:
        """The next batch, and ``latest``: the state as of it, once torchdata has counted it as
        handed out (not after an error, an interruption or the pass's end)."""
        self.latest = None
        batch = super().__next__()
        as_of_batch = self._as_of_batch
        if as_of_batch is not None and as_of_batch.step == self._num_yielded:
            self.latest = self._state_as_of(as_of_batch)
        return batch

    def _update_worker_snapshot(self, worker_key: str, state_dict: Any) -> None:
        """torchdata's news of a worker (its last state, as its pass ends) is its latest."""
        super()._update_worker_snapshot(worker_key, state_dict)
        if state_dict is not None:
            self._latest_states[worker_key] = self._worker_snapshots[worker_key].get_state()

    def _main_state_as_of(self, sampler_count: int) -> dict[str, Any]:
        """The main snapshot as of a batch whose index was sent at ``sampler_count``: torchdata's
        entries, read at the pass's first batch (after any restore, which torchdata makes as the
        iterator starts) unless a sampler is ``Stateful`` (its state moves)."""
        entries = self._pass_main_state
        if entries is None:
            entries = self._get_main_state()
            if not (_is_stateful(self._sampler_iter) or _is_stateful(self._index_sampler)):
                self._pass_main_state = entries
        return {**entries, _SAMPLER_ITER_YIELDED: sampler_count}

    def state_dict(self) -> dict[str, Any]:
        if self.latest is not None:
            return self.latest.copy()  # its snapshot shared, as in torchdata's
        as_of_batch = self._as_of_batch
        if as_of_batch is not None and as_of_batch.step > self._num_yielded:
            # interrupted (Ctrl-C) between this call and torch counting the batch: never handed out
            as_of_batch = self._as_of_batch_before
        if as_of_batch is None:  # no batch since the pass started or was restored: torchdata's own
            return cast("dict[str, Any]", super().state_dict())
        return self._state_as_of(as_of_batch)

    def _state_as_of(self, as_of_batch: _AsOfBatch) -> dict[str, Any]:
        """torchdata's state with ``as_of_batch``'s snapshot, the batches handed out since counted."""
        return {
            self._SNAPSHOT: dict(as_of_batch.snapshot),  # its entries shared, as in torchdata's
            self._STEPS_SINCE_SNAPSHOT: self._num_yielded - as_of_batch.step,
            _ITERATOR_FINISHED: self._finished,
        }

    def _get_main_state(self) -> dict[str, Any]:
        return {
            self._NUM_WORKERS: self._num_workers,
            _SAMPLER_ITER_STATE: _state_of(self._sampler_iter),
            _INDEX_SAMPLER_STATE: _state_of(self._index_sampler),
            _SAMPLER_ITER_YIELDED: self._sampler_iter_yielded,
            _ITERABLEDATASET_LEN_CALLED: self._IterableDataset_len_called,
            _SHARED_SEED: self._shared_seed,
            self._BASE_SEED: self._base_seed,
        }


class _AsOfBatch(NamedTuple):
    """What a torchdata snapshot taken as the last batch was handed out would hold."""

    step: int
    snapshot: dict[str, Any]  # torchdata's snapshot entries: the step, the worker, the main and worker states


_stateful_classes: dict[type, bool] = {}
"""Whether instances of a class are torchdata ``Stateful``, by class, as first found."""


def _is_stateful(value: Any) -> bool:
    """Whether ``value`` is torchdata ``Stateful``, the ``Protocol`` check made once per class."""
    stateful = _stateful_classes.get(type(value))
    if stateful is None:
        stateful = _stateful_classes[type(value)] = isinstance(value, Stateful)
    return stateful


def _state_of(value: Any) -> dict[str, Any] | None:
    """``value.state_dict()`` if ``value`` is ``Stateful``, else None (torchdata's
    ``try_to_serialize``)."""
    return value.state_dict() if _is_stateful(value) else None


def new_iterator(loader: Any, state: dict[str, Any] | None) -> Any:
    """The iterator torchdata's ``_get_iterator`` would build for ``loader``, held to ``MAX_COUNT``."""
    if loader.num_workers == 0:
        return _SingleProcessIterator(loader, state)
    loader.check_worker_number_rationality()
    return _MultiProcessIterator(loader, state)


def current_iterator(loader: Any) -> Any:
    """The loader's live iterator (None between passes)."""
    return loader._iterator


def stop_iterator(loader: Any) -> None:
    """Drop the loader's iterator and stop its workers now."""
    iterator, loader._iterator = loader._iterator, None
    shut_down(iterator)


def shut_down(iterator: Any) -> None:
    """Stop ``iterator``'s workers now (if it has any)."""
    if isinstance(iterator, _StatefulMultiProcessingDataLoaderIter):
        iterator._shutdown_workers()


_ITERATOR_INIT_CODES = frozenset(
    init.__code__
    for init in (vars(cls).get("__init__") for cls in _MultiProcessIterator.__mro__)
    if isinstance(init, FunctionType)
)
"""The code of every ``__init__`` an iterator over workers runs while it starts."""


def shut_down_half_built_iterators(error: BaseException) -> None:
    """Stop the workers of an iterator whose start-up raised (a worker failed to restore), now
    rather than when the traceback that holds the half-built iterator is collected.

    Only the frames of the iterator's own ``__init__`` are searched: reading another frame's
    locals keeps them in the frame, and the frame that caught ``error`` holds ``error``, whose
    traceback holds that frame, a cycle that would leave everything those frames hold (other
    loaders' live iterators too) to the cyclic garbage collector.
    """
    traceback = error.__traceback__
    while traceback is not None:
        frame = traceback.tb_frame
        if frame.f_code in _ITERATOR_INIT_CODES:
            candidate = frame.f_locals.get("self")
            # one that failed before it set _shutdown has no workers yet
            if isinstance(candidate, _StatefulMultiProcessingDataLoaderIter) and hasattr(candidate, "_shutdown"):
                candidate._shutdown_workers()
        traceback = traceback.tb_next
