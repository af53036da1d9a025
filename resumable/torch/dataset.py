"""A pipeline as a ``torch.utils.data.IterableDataset``."""

from __future__ import annotations

import copy
import json
import os
import sys
from typing import Any, Callable, NamedTuple, Union, cast

import orjson
from torch._utils import ExceptionWrapper
from torch.utils.data import IterableDataset, default_convert, get_worker_info

from resumable.core.node import Node
from resumable.core.options import int_option
from resumable.core.state import MAX_EPOCH
from resumable.errors import ConfigError, ResumableError, StateError, stop_error
from resumable.loader_state import PASS_EPOCH, PIPELINE
from resumable.ops.even import StoreRef, default_store, inherit_store, new_namespace
from resumable.order.topology import distributed_rank, inherit_rank
from resumable.torch.transport import for_transport

PipelineOrFactory = Union[Node[Any], Callable[[], Node[Any]]]


def encode_state(state: dict[str, Any]) -> str:
    """``state`` as compact JSON, through orjson: the worker encodes it with every batch, and
    orjson takes a tenth of the time ``json.dumps`` does. Integers beyond 64 bits, which
    orjson refuses, go through ``json.dumps``; both give JSON that loads to the same values."""
    try:
        return orjson.dumps(state).decode()
    except orjson.JSONEncodeError:
        return json.dumps(state, separators=(",", ":"))


class WorkerIterator:
    """What ``iter(PipelineDataset)`` returns: the pipeline, whose state it reports as one
    JSON string, so that copying or shipping it is O(1) however large the state (packer
    references).

    The state also names the epoch this pass started (``epoch``), so that a Loader state
    can check that every worker's pipeline state belongs to the epoch the Loader records."""

    def __init__(
        self,
        pipeline: Node[Any],
        epoch: int,
        restored: Callable[[int], None] | None = None,
        ships_failures: bool = False,
    ) -> None:
        self.pipeline = pipeline
        self.epoch = epoch
        self._restored = restored  # told the epoch of a loaded pass (its dataset counts the next from it)
        self._ships_failures = ships_failures

    def __iter__(self) -> WorkerIterator:
        return self

    def __next__(self) -> Any:
        try:
            return next(self.pipeline)
        except StopIteration:
            raise
        except Exception:
            if not self._ships_failures:
                raise
            # A Loader's worker: hand the error over as its batch, so that it comes with the
            # state right after it (``CollateBatch``), as a batch would.
            return Failure(_handled_error())

    def state_dict(self) -> dict[str, Any]:
        return {PIPELINE: encode_state(self.pipeline.get_state()), PASS_EPOCH: self.epoch}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue the saved pass: its pipeline state, and the epoch that pass started."""
        encoded = state_dict.get(PIPELINE) if isinstance(state_dict, dict) else None
        epoch = state_dict.get(PASS_EPOCH) if isinstance(state_dict, dict) else None
        if not isinstance(encoded, str) or isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise StateError(
                f"PipelineDataset: expected {{{PIPELINE!r}: <JSON string>, {PASS_EPOCH!r}: <epoch>}}, "
                f"got {state_dict!r:.200}"
            )
        try:
            state = json.loads(encoded)
        except (ValueError, RecursionError) as error:
            raise StateError(f"PipelineDataset: the pipeline state is not valid JSON ({error})") from error
        self.pipeline.set_state(state)
        self.epoch = epoch
        if self._restored is not None:
            self._restored(epoch)


def _handled_error() -> ExceptionWrapper:
    """The exception being handled in this worker, wrapped as torch's worker loop wraps it
    (the library's own errors as ``OwnError``, so that they keep their attributes)."""
    where = f"in DataLoader worker process {cast('Any', get_worker_info()).id}"
    error = sys.exc_info()[1]
    if isinstance(error, ResumableError):
        return OwnError(error, where)
    return ExceptionWrapper(where=where)  # type: ignore[no-untyped-call]


class OwnError(ExceptionWrapper):
    """A worker's ``ResumableError`` on its way to the main process. torch raises a worker's
    exception again as ``type(message)``, which keeps the type but drops every attribute (a
    ``MapError``'s ``key``); this raises a copy of the error itself, its message torch's (the
    worker and its traceback)."""

    def __init__(self, error: ResumableError, where: str) -> None:
        super().__init__(where=where)  # type: ignore[no-untyped-call]
        self.error = error

    def reraise(self) -> None:
        error = copy.copy(self.error)
        error.args = (f"Caught {type(error).__name__} {self.where}.\nOriginal {self.exc_msg}",)
        raise error


class Failure(NamedTuple):
    """What a Loader worker's iterator returns in place of a batch whose pipeline raised: the
    exception, as torch wraps it to raise again in the main process."""

    error: ExceptionWrapper


class BatchWithState(NamedTuple):
    """What a Loader worker hands over: a batch and its iterator's state right after it
    (``WorkerIterator.state_dict()``). The state rides along with the batch, so the Loader needs
    none of torchdata's per-batch snapshot traffic (``resumable.torch._torchdata``). A batch
    whose pipeline or ``collate_fn`` raised is the ``ExceptionWrapper`` torch raises again: the
    state after the failure rides along the same way, so a state taken then is exact."""

    batch: Any
    state: dict[str, Any]


class UserCollate:
    """A Loader's ``collate_fn`` as the user gave it, but for a ``StopIteration``, which torch
    would take for the end of the pass (a worker's, or the loop's without workers): it is a
    ``MapError`` instead. A class, so that it pickles into spawned workers."""

    def __init__(self, collate_fn: Callable[[Any], Any]) -> None:
        self.collate_fn = collate_fn

    def __call__(self, batch: Any) -> Any:
        try:
            return self.collate_fn(batch)
        except StopIteration as stop:
            raise stop_error("Loader: collate_fn", None, stop) from stop


class CollateBatch:
    """A Loader worker's ``collate_fn``: ``collate_fn`` (torch's ``default_convert`` when None,
    as a DataLoader without batching applies) on the batch, and the state of the worker's
    pipeline right after it, as one ``BatchWithState``. torch's fetcher calls it in the worker
    right after taking the batch from the dataset's iterator, so that is the state as of this
    batch. The batch's tensors travel inline or in one shared-memory segment (``transport``).
    Only the Loader installs it, so a plain DataLoader over the same ``PipelineDataset`` gets
    plain batches. A class, so that it pickles into spawned workers."""

    def __init__(self, collate_fn: Callable[[Any], Any] | None) -> None:
        self.collate_fn: Callable[[Any], Any] = default_convert if collate_fn is None else collate_fn

    def __call__(self, batch: Any) -> BatchWithState:
        info = cast("Any", get_worker_info())  # only ever called in workers
        iterator = cast("WorkerIterator", info.dataset.iterator)
        if type(batch) is Failure:
            return BatchWithState(batch.error, iterator.state_dict())
        try:
            collated = for_transport(self.collate_fn(batch))
        except Exception:  # noqa: BLE001 - handed over with the state, as a batch would be
            collated = _handled_error()
        return BatchWithState(collated, iterator.state_dict())


class PipelineDataset(IterableDataset[Any]):
    """Each DataLoader worker iterates its own copy of the pipeline, which reads a disjoint
    partition: ``.shard()`` resolves ``rank * num_workers + worker`` inside the worker.

    The rank is read in the main process (torch.distributed is not initialised inside
    workers) when the dataset is built and at each ``set_epoch``, and handed to the workers,
    with the address of the process group's store, through which ``.even()`` agrees in them.

    Epochs: the first ``iter()`` in a process starts epoch ``epoch`` (set in the main process
    before workers start, by ``rs.torch.Loader`` or by ``set_epoch``); each later ``iter()``
    starts the epoch set by a ``set_epoch`` call since (even the same number again), or else
    the next one. So fresh workers, persistent workers (which keep their own copy of this
    object) and the main process all shuffle anew each epoch, and a Loader that goes back to
    an epoch (by loading a state) gets that epoch.
    ``iter()`` returns a ``WorkerIterator`` over the pipeline: its ``state_dict()`` is what a
    ``StatefulDataLoader`` snapshots in each worker, and what a ``rs.torch.Loader``'s workers
    hand over with each batch (``CollateBatch``).
    """

    def __init__(self, pipeline: PipelineOrFactory) -> None:
        super().__init__()
        if isinstance(pipeline, Node):
            self._pipeline: Node[Any] | None = pipeline
            self._factory: Callable[[], Node[Any]] | None = None
        elif callable(pipeline):
            self._pipeline, self._factory = None, pipeline
        else:
            raise ConfigError(f"PipelineDataset: expected a pipeline or a function building one, got {pipeline!r}")
        self.epoch = 0
        self.rank = distributed_rank()
        self._namespace = new_namespace()
        self.store = self._store()
        self._told = 0  # set_epoch calls so far: each one is an order for the next iter()
        self.ships_failures = False  # set in a Loader's workers (their iterators hand errors over)
        # In the process that iterates: (process id, set_epoch calls then, epoch started).
        self._started: tuple[int, int, int] | None = None
        # After an elastic rescale: the JSON pipeline state each worker (0 without workers)
        # continues the epoch from, applied at the next iter() (see rs.torch.Loader).
        self.rescaled: dict[int, str] | None = None
        # After an epoch that ended in processes that are gone (fresh workers, a loaded state):
        # the JSON pipeline state each worker ended it with, continued at the next iter() so
        # that .even() keeps its carry (see rs.torch.Loader).
        self.carried: dict[int, str] | None = None
        # This process's latest iterator: the Loader's collate wrapper ships its state.
        self.iterator: WorkerIterator | None = None

    def _store(self) -> StoreRef | None:
        found = default_store()
        return None if found is None else StoreRef(*found, namespace=self._namespace)

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next ``iter()`` starts (in every worker); also re-reads the rank."""
        self.epoch = int_option("PipelineDataset", "epoch", epoch, least=0, most=MAX_EPOCH)
        self._told += 1
        self.rank = distributed_rank()
        self.store = self._store()

    @property
    def pipeline(self) -> Node[Any]:
        """This process's pipeline, built on first use when a factory was given."""
        if self._pipeline is None:
            built = cast("Callable[[], Node[Any]]", self._factory)()  # set whenever no pipeline was given
            if not isinstance(built, Node):
                raise ConfigError(f"PipelineDataset: the factory returned {type(built).__name__}, not a pipeline")
            self._pipeline = built
        return self._pipeline

    @property
    def started_epoch(self) -> int | None:
        """The epoch this process's pipeline was last started in (None before its first
        ``iter()``), as a restore of its iterator moved it."""
        return None if self._started is None else self._started[2]

    def __iter__(self) -> WorkerIterator:
        if get_worker_info() is not None:
            inherit_rank(*self.rank)
            inherit_store(self.store)
        pipe = self.pipeline
        if self.carried is not None:
            info = get_worker_info()
            pipe.set_state(json.loads(self.carried[info.id if info is not None else 0]))
            self.carried = None
        pid, started = os.getpid(), self._started
        if started is None or started[0] != pid or started[1] != self._told:
            epoch = self.epoch
        else:
            epoch = started[2] + 1
        pipe.start_epoch(epoch)
        self._started = (pid, self._told, epoch)
        if self.rescaled is not None:
            info = get_worker_info()
            pipe.set_state(json.loads(self.rescaled[info.id if info is not None else 0]))
            self.rescaled = None  # later epochs start whole
        self.iterator = WorkerIterator(pipe, epoch, self._restored_pass, self.ships_failures)
        return self.iterator

    def _restored_pass(self, epoch: int) -> None:
        """A state loaded into this process's iterator (torchdata's restore) continues a pass of
        ``epoch``: the next ``iter()`` here starts the epoch after it."""
        pid, told, _ = cast("tuple[int, int, int]", self._started)  # set by the iter() that built the iterator
        self._started = (pid, told, epoch)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        if self._factory is not None:
            state["_pipeline"] = None  # each process builds its own
        state["iterator"] = None
        return state
