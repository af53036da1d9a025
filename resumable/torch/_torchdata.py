"""Every use of torchdata's (and torch's DataLoader's) private names, in one place.

``rs.torch.Loader`` builds on ``torchdata.stateful_dataloader.StatefulDataLoader``'s public API
(``state_dict``, ``load_state_dict``, ``next_iter_state``), and on these private parts, which a
torchdata release may change: its iterator classes (subclassed to bound their counters), the
DataLoader's ``_iterator`` attribute and ``_get_iterator`` hook, the workers' shutdown. The
names of torchdata's state keys live in ``resumable.loader_state``. ``tests/test_torchdata_private.py``
checks that every name used here still exists with the expected shape, so an incompatible
torchdata fails there, loudly, rather than deep inside a training job.
"""

from __future__ import annotations

from typing import Any

from torchdata.stateful_dataloader import Stateful
from torchdata.stateful_dataloader.stateful_dataloader import (
    _INDEX_SAMPLER_STATE,
    _ITERABLEDATASET_LEN_CALLED,
    _SAMPLER_ITER_STATE,
    _SAMPLER_ITER_YIELDED,
    _SHARED_SEED,
    _StatefulBaseDataLoaderIter,
    _StatefulMultiProcessingDataLoaderIter,
    _StatefulSingleProcessDataLoaderIter,
)

from resumable.errors import StateError
from resumable.loader_state import MAX_COUNT

PRIVATE_NAMES = {
    _StatefulBaseDataLoaderIter: ("_num_yielded", "_sampler_iter_yielded", "_next_index", "__next__"),
    _StatefulMultiProcessingDataLoaderIter: ("_shutdown_workers", "_get_main_state"),
}
"""Private attributes used here, by class (``_num_yielded`` and ``_sampler_iter_yielded`` are set
by ``__init__``, the others are methods); the test checks them."""
LOADER_HOOKS = ("_iterator", "_get_iterator")
"""Private DataLoader attribute and hook ``rs.torch.Loader`` uses."""


class _Bounded(_StatefulBaseDataLoaderIter):  # type: ignore[misc]  # torchdata is untyped (Any)
    """Stops with a StateError rather than count a pass's batches (or the indices torchdata
    sends ahead) past ``MAX_COUNT``: every state the Loader saves then loads again."""

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
    """torchdata's iterator without workers, held to ``MAX_COUNT``."""


class _MultiProcessIterator(_Bounded, _StatefulMultiProcessingDataLoaderIter):  # type: ignore[misc]  # torchdata is untyped (Any)
    """torchdata's iterator over workers, held to ``MAX_COUNT``.

    Its main-process snapshot, taken with every batch, asks whether the sampler and the
    sampler's iterator are ``Stateful``: a runtime ``Protocol`` check, about 10-20 us each on
    Python 3.11, twice per batch. The answer depends only on their classes, so it is asked once
    per class here; the entries are torchdata's (``tests/test_torchdata_private.py`` compares).
    """

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


_stateful_classes: dict[type, bool] = {}
"""Whether instances of a class are torchdata ``Stateful``, by class, as first found."""


def _state_of(value: Any) -> dict[str, Any] | None:
    """``value.state_dict()`` if ``value`` is ``Stateful``, else None (torchdata's
    ``try_to_serialize``), with the ``Protocol`` check made once per class."""
    stateful = _stateful_classes.get(type(value))
    if stateful is None:
        stateful = _stateful_classes[type(value)] = isinstance(value, Stateful)
    return value.state_dict() if stateful else None


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
    if isinstance(iterator, _StatefulMultiProcessingDataLoaderIter):
        iterator._shutdown_workers()


def shut_down_half_built_iterators(error: BaseException) -> None:
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
