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

from torchdata.stateful_dataloader.stateful_dataloader import (
    _StatefulBaseDataLoaderIter,
    _StatefulMultiProcessingDataLoaderIter,
    _StatefulSingleProcessDataLoaderIter,
)

from resumable.errors import StateError
from resumable.loader_state import MAX_COUNT

PRIVATE_NAMES = {
    _StatefulBaseDataLoaderIter: ("_num_yielded", "_sampler_iter_yielded", "_next_index", "__next__"),
    _StatefulMultiProcessingDataLoaderIter: ("_shutdown_workers",),
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
    """torchdata's iterator over workers, held to ``MAX_COUNT``."""


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
