"""A DataLoader whose state covers every worker and restores exactly."""

from __future__ import annotations

import atexit
import copy
import json
import re
import sys
import threading
import warnings
import weakref
from typing import Any, Callable, Sequence, cast

from torch.utils.data import get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader

from resumable._worker_signals import init_worker
from resumable.core.options import finite_float, flag_option, int_option
from resumable.core.state import check_json
from resumable.errors import ConfigError, ResumableWarning, SourceError, StateError
from resumable.loader_state import (
    EPOCH,
    FORMAT,
    FORMAT_NAME,
    LOADER,
    MAX_COUNT,
    NUM_WORKERS,
    RANK,
    SNAPSHOT,
    SNAPSHOT_EVERY,
    SNAPSHOT_STEP,
    STEPS_SINCE,
    WORLD_SIZE,
    LoaderState,
    parse_loader_state,
)
from resumable.order.topology import distributed_rank
from resumable.torch import _torchdata
from resumable.torch.dataset import CollateBatch, PipelineDataset, PipelineOrFactory, UserCollate
from resumable.torch.elastic import factory_of, rescale_for_rank

EVERY_BATCH = 1
"""The snapshot interval states record: workers hand their pipeline state over with every
batch, so a restore never replays batches and the state is exact at once."""


class Loader(StatefulDataLoader):  # type: ignore[misc]  # torchdata is untyped (Any)
    """``torchdata.stateful_dataloader.StatefulDataLoader`` over a pipeline that batches itself.

    Each worker iterates its own partition of the pipeline (``.shard()`` splits by worker).
    ``state_dict()`` holds, for every worker, the pipeline state as of the last batch *handed
    to you*: batches prefetched by workers but not yet consumed are produced again after a
    restore. The state is plain JSON data, in which each worker's pipeline state is one JSON
    string (``python -m resumable inspect`` decodes them). Each ``iter()`` that does not follow
    a ``load_state_dict`` starts a new epoch (a new shuffle order in every worker); after
    loading a state taken once an epoch had ended, ``iter()`` starts the next.

    Workers send their pipeline state with every batch, riding with the batch rather than in
    torchdata's snapshots (``_torchdata._MultiProcessIterator``), so the state is exact as it
    is: a restore replays nothing, and ``python -m resumable inspect`` shows every worker's
    position as of the last batch. ``snapshot_every_n_steps`` is deprecated: 1 is accepted, any other count
    warns (``FutureWarning``) and is ignored.

    Workers ignore a SIGTERM that does not come from the trainer (``workers_ignore_sigterm``,
    Linux): a scheduler that preempts a job sends it to every process, and the trainer, not
    its workers, decides when to stop, typically after saving a checkpoint. Workers still
    exit when the loader shuts them down (its SIGTERM is obeyed) or when the trainer dies.
    They ignore SIGINT (a terminal's Ctrl-C reaches the whole process group): the trainer alone
    is interrupted, and iterating on afterwards continues exactly.
    """

    next_iter_state: dict[str, Any] | None  # torchdata's: the state the next iterator restores
    dataset: PipelineDataset  # torchdata's, set to the PipelineDataset built here

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
        snapshot_every_n_steps: int = EVERY_BATCH,
    ) -> None:
        num_workers = int_option(LOADER_KIND, "num_workers", num_workers, least=0)
        timeout, prefetch_factor = _check_worker_options(
            num_workers, collate_fn, worker_init_fn, timeout, prefetch_factor
        )
        pin_memory, persistent_workers, workers_ignore_sigterm = (
            flag_option(LOADER_KIND, name, flag)
            for name, flag in (
                ("pin_memory", pin_memory),
                ("persistent_workers", persistent_workers),
                ("workers_ignore_sigterm", workers_ignore_sigterm),
            )
        )
        _check_snapshot_every(snapshot_every_n_steps)
        dataset = pipeline if isinstance(pipeline, PipelineDataset) else PipelineDataset(pipeline)
        if collate_fn is not None:
            collate_fn = UserCollate(collate_fn)
        if num_workers:  # each batch comes with its state (_torchdata._MultiProcessIterator)
            collate_fn = CollateBatch(collate_fn)
        worker_init_fn = WorkerStart(worker_init_fn, workers_ignore_sigterm)
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
                snapshot_every_n_steps=_torchdata.NEVER if num_workers else EVERY_BATCH,
            )
        self._epoch = 0  # the epoch of the current pass, or of the next one before any
        self._next_iter_advances = False  # whether the next iter() starts epoch _epoch + 1
        self._loaded: dict[str, Any] | None = None  # the state loaded, until the next iter()
        self._pass_header: dict[str, Any] = {}  # the current pass's (_header), set by iter()
        _OPEN_LOADERS.add(self)
        self._built = True

    def __setattr__(self, name: str, value: Any) -> None:
        """Refuse the options the workers are built with once the Loader is: torch reads them at
        the next ``iter()``, past the checks above and the wrapping of ``collate_fn`` that makes
        each batch carry its worker's state."""
        if name in FIXED_OPTIONS and getattr(self, "_built", False):
            raise ConfigError(f"Loader: {name} cannot be changed once the Loader is built; build another")
        super().__setattr__(name, value)

    def __iter__(self) -> Any:
        # Persistent workers start the next pass in place: if that fails (a Ctrl-C while they
        # restart, an error of a pipeline as it starts), the loader goes back to this state.
        before = None
        if self.persistent_workers and self._loaded is None and _torchdata.current_iterator(self) is not None:
            before = parse_loader_state(self.state_dict())
        if self._next_iter_advances:
            self.dataset.carried = self._carried()
        epoch = self._next_epoch() if self._next_iter_advances else self._epoch
        rescaled = self.dataset.rescaled is not None
        self.dataset.set_epoch(epoch)
        cast("WorkerStart", self.worker_init_fn).warning_filters = own_warning_filters()  # for workers it starts
        try:
            iterator = super().__iter__()
        except StopIteration as error:  # an old state's batches since its snapshot ran out (_legacy_overrun)
            _torchdata.shut_down_half_built_iterators(error)
            raise self._legacy_overrun() from None
        except BaseException as error:
            if before is not None:  # the pass did not start: as if iter() had not been called
                # first: a worker that dies of it may raise in this process at any moment
                # (torch's SIGCHLD handler), and the state must be the one before by then
                restarting = _torchdata.current_iterator(self)
                self._resume(before)
                _torchdata.shut_down(restarting)
            _torchdata.shut_down_half_built_iterators(error)
            raise
        self._epoch, self._next_iter_advances, self._loaded = epoch, True, None
        self._pass_header = self._header()
        if rescaled and self.num_workers:
            self.dataset.rescaled = None  # the workers have their copies
        if self.num_workers:
            self.dataset.carried = None
        return iterator

    def __len__(self) -> int:
        """Batches per pass without workers: ``len()`` of the pipeline (this rank's, the current
        epoch's; a TypeError naming the node where it is unknown), of the epoch a loaded state
        is in before the next ``iter()`` applies it. With workers, a TypeError: each worker's
        share is resolved inside that worker."""
        if self.num_workers:
            raise TypeError(
                "Loader: len() is unknown with DataLoader workers (each worker's share of the pipeline is resolved "
                "inside it); without workers it is len() of the pipeline"
            )
        pipeline = self.dataset.pipeline
        pending = self._pending_pipeline_state()
        started = self.dataset.started_epoch
        behind = pending is None and (started or 0) != self._epoch
        if pending is None and not behind:
            return len(pipeline)
        current = pipeline.get_state()  # a loaded state is applied at the next iter(): visit it
        try:
            if pending is not None:
                pipeline.set_state(pending)
            else:  # every old rank's states of an ended epoch: the pipeline is still as built
                pipeline.start_epoch(self._epoch)
            return len(pipeline)
        finally:
            pipeline.set_state(current)

    def _pending_pipeline_state(self) -> dict[str, Any] | None:
        """Without workers, the pipeline state a loaded Loader state (own or rescaled) holds until
        the next ``iter()`` applies it; None when nothing is pending."""
        if self._loaded is not None:
            return parse_loader_state(self._loaded).pipelines[0]
        if self.dataset.rescaled is not None:
            return cast("dict[str, Any]", json.loads(self.dataset.rescaled[0]))
        return None

    def _carried(self) -> dict[int, str] | None:
        """Each worker's final pipeline state of the epoch that ended, when the processes that
        held it are gone (fresh workers, or a loaded state); None when no epoch ended there.

        The next pass's pipelines take it before they start their epoch, as persistent workers'
        pipelines go on from theirs: a node whose next epoch continues from the one that ended
        (``.even()``'s carry, a torchdata graph's next pass) continues, and a file that changed
        since the state was taken is found (``set_state`` checks the fingerprints), where a
        pipeline built afresh would fingerprint the new file and read it."""
        if self._loaded is not None:
            state = self._loaded
        elif self.num_workers and not self.persistent_workers and _torchdata.current_iterator(self) is not None:
            state = self.state_dict()
        else:
            return None
        ended = parse_loader_state(state)
        if not ended.finished:
            return None
        return {worker: json.dumps(pipeline) for worker, pipeline in enumerate(ended.pipelines)}

    def _next_epoch(self) -> int:
        """The epoch after this one, if a Loader state can count it."""
        if self._epoch >= MAX_COUNT:
            raise StateError(f"Loader: epoch {self._epoch:,} is the last one a Loader state can count")
        return self._epoch + 1

    def _legacy_overrun(self) -> StateError:
        """The error for a loaded state that counts more batches since its snapshot than the
        workers hold. Only a state saved by an earlier version, which took worker states every
        few batches, counts any: torchdata advances the workers by those batches on restore, and
        here they ran out. The loaded state stays as it was (the half-started workers are stopped)."""
        loaded = cast("dict[str, Any]", self._loaded)  # only a resumed state advances
        steps, snapshot = loaded[LOADER][STEPS_SINCE], loaded[LOADER][SNAPSHOT][SNAPSHOT_STEP]
        return StateError(
            f"Loader rank {loaded[RANK]}/{loaded[WORLD_SIZE]} at {LOADER}: the state counts more batches than its "
            f"workers hold (state entry {STEPS_SINCE!r} is {steps}, but the workers' snapshot at batch {snapshot} "
            "is followed by fewer)"
        )

    def _get_iterator(self) -> Any:
        """torchdata's iterator, held to ``MAX_COUNT`` (``_torchdata.new_iterator``)."""
        iterator = _torchdata.new_iterator(self, self.next_iter_state)
        self.next_iter_state = None
        return iterator

    def close(self) -> None:
        """Stop the workers now. The next ``iter()`` starts new ones where this one stopped, or,
        where no state can be taken (a file changed under a pipeline without workers: its state
        check raises ``SourceError``), the next epoch: closing never fails on the data."""
        if _torchdata.current_iterator(self) is None:
            return
        try:
            state: dict[str, Any] | None = self.state_dict()
        except SourceError:
            state = None
        self._stop_workers()
        if state is not None:
            self.load_state_dict(state)

    def _stop_workers(self) -> None:
        _torchdata.stop_iterator(self)

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def epoch(self) -> int:
        """The epoch being iterated (or last iterated, or restored)."""
        return self._epoch

    def state_dict(self) -> dict[str, Any]:
        """Every worker's position as of the last batch handed out, as JSON data."""
        iterator = self._iterator  # _torchdata.current_iterator(self), inlined (see _torchdata)
        latest = None if iterator is None else iterator.latest
        if latest is not None:  # per training step: the state built as the last batch arrived
            state = self._pass_header.copy()
            state[LOADER] = latest.copy()
            return state
        if self._loaded is not None:
            return copy.deepcopy(self._loaded)  # loaded but not iterated yet: nothing moved
        if iterator is None:  # torchdata starts the next pass to read its initial state
            if self._next_iter_advances:
                self._epoch, self._next_iter_advances = self._next_epoch(), False
            self.dataset.set_epoch(self._epoch)
            loader_state = super().state_dict()
        else:  # what StatefulDataLoader.state_dict() returns then, one call shorter (per training step)
            loader_state = iterator.state_dict()
        return {**self._header(), LOADER: loader_state}

    def _header(self) -> dict[str, Any]:
        """Every entry of a state but torchdata's: the same through a pass."""
        rank, world_size = self.dataset.rank  # read when this pass started: the rank its workers inherited
        return {
            FORMAT: FORMAT_NAME,
            EPOCH: self._epoch,
            RANK: rank,
            WORLD_SIZE: world_size,
            NUM_WORKERS: self.num_workers,
            SNAPSHOT_EVERY: EVERY_BATCH,  # kept, so that the previous version still reads these states
        }

    def load_state_dict(self, state_dict: dict[str, Any] | Sequence[dict[str, Any]]) -> None:
        """Continue exactly after the last batch handed out when ``state_dict`` was taken.

        Given the states of *every* rank of the old job (a list, in rank order), continue
        its epoch on this job's ranks and workers, however many: see ``resumable.elastic``.
        The whole state is validated first: on a ``StateError`` the loader is left as it was.
        """
        if isinstance(state_dict, dict):
            self._resume(self._own(parse_loader_state(state_dict)))
        elif isinstance(state_dict, (list, tuple)):
            self._load_all_ranks(state_dict)
        else:
            raise StateError(
                f"Loader: expected a Loader state or a list of every old rank's, got {type(state_dict).__name__}"
            )

    def _own(self, state: LoaderState) -> LoaderState:
        """``state``, if this loader's rank, world size and worker count saved it."""
        rank, world_size = distributed_rank()
        for key, saved, current in (
            (RANK, state.rank, rank),
            (WORLD_SIZE, state.world_size, world_size),
            (NUM_WORKERS, state.num_workers, self.num_workers),
        ):
            if saved != current:
                raise StateError(f"Loader: state was saved with {key}={saved}, this loader has {key}={current}")
        return state

    def _load_all_ranks(self, states: Sequence[Any]) -> None:
        if not states:
            raise StateError("Loader: no rank states to resume from")
        # The workers' pipeline states stay JSON text: a rescale parses them once, keeping little.
        olds = [
            parse_loader_state(state, f"Loader (old rank {index})", lazy=True) for index, state in enumerate(states)
        ]
        for index, old in enumerate(olds):
            if (old.rank, old.world_size) != (index, len(olds)):
                raise StateError(
                    f"Loader: give every old rank's state in rank order; entry {index} of {len(olds)} is "
                    f"rank {old.rank} of {old.world_size}"
                )
        rank, world_size = distributed_rank()
        if len(olds) == world_size and all(old.num_workers == self.num_workers for old in olds):
            # this rank's own state, as it would load alone (the ranks may be an epoch apart: a
            # rank with fewer batches per epoch starts its next one first)
            check_json(olds[rank].state, f"Loader (old rank {rank})")  # checked whole, as a single state is
            olds[rank].pipelines  # noqa: B018
            self._resume(olds[rank])
            return
        epochs = sorted({old.epoch for old in olds})
        if len(epochs) != 1:
            raise StateError(f"Loader: old ranks were in different epochs {epochs}")
        finished = all(old.finished for old in olds)  # then the next iter() starts the next epoch afresh
        rescaled = None
        if not finished:
            build = factory_of(self.dataset._pipeline, self.dataset._factory)
            rescaled = rescale_for_rank(build, olds, rank, world_size, self.num_workers)
        self._set_position(epochs[0], finished, None, rescaled, None)

    def _resume(self, state: LoaderState) -> None:
        """Continue this rank's own state; one taken after its epoch ended starts the next afresh."""
        loaded = copy.deepcopy(state.state)
        self._set_position(state.epoch, state.finished, None if state.finished else loaded[LOADER], None, loaded)

    def _set_position(
        self,
        epoch: int,
        next_iter_advances: bool,
        resume: dict[str, Any] | None,
        rescaled: dict[int, str] | None,
        loaded: dict[str, Any] | None,
    ) -> None:
        """Where the next ``iter()`` goes: set every piece at once (the loaded state first, which
        ``state_dict()`` returns from then on), then drop the current pass."""
        self._epoch, self._next_iter_advances, self._loaded = epoch, next_iter_advances, loaded
        self.dataset.rescaled = rescaled
        super().load_state_dict(resume if resume is not None else {})  # {} only drops the current pass
        self.next_iter_state = resume


LOADER_KIND = "Loader"
"""How errors about the Loader's own options name it."""
FIXED_OPTIONS = frozenset(
    {"num_workers", "collate_fn", "worker_init_fn", "timeout", "prefetch_factor", "multiprocessing_context", "in_order"}
)
"""Options a built Loader refuses to change (torch itself guards ``batch_size``, ``sampler``...)."""


def _check_worker_options(
    num_workers: int, collate_fn: Any, worker_init_fn: Any, timeout: Any, prefetch_factor: Any
) -> tuple[float, int | None]:
    """``(timeout, prefetch_factor)`` as torch takes them, or a ConfigError for options that
    torch would only refuse at the first ``iter()``, deep in an iterator or a worker (a bare
    assertion, a call of something not callable, a wait longer than a lock can wait)."""
    for name, function in (("collate_fn", collate_fn), ("worker_init_fn", worker_init_fn)):
        if function is not None and not callable(function):
            raise ConfigError(f"Loader: {name} must be callable or None, got {function!r}")
    seconds = finite_float(timeout)
    if seconds is None or not 0 <= seconds <= threading.TIMEOUT_MAX:
        raise ConfigError(
            f"Loader: timeout must be a number of seconds from 0 to {threading.TIMEOUT_MAX:.0f}, got {timeout!r}"
        )
    if seconds and not num_workers:
        raise ConfigError(f"Loader: timeout={timeout!r} waits for workers; with num_workers=0 there are none")
    if num_workers:
        prefetch_factor = int_option(LOADER_KIND, "prefetch_factor", prefetch_factor, optional=True)
    return seconds, prefetch_factor


WarningFilter = tuple[str, "re.Pattern[str] | None", Any, "re.Pattern[str] | None", int]
"""An entry of ``warnings.filters``: action, message pattern, category, module pattern, line."""


class WorkerStart:
    """A Loader worker's start (its ``worker_init_fn``): its dataset (the worker's own copy)
    hands errors over with the state after them (``dataset.Failure``); the main process's
    filters on resumable's warnings apply there too; then ``init_worker`` (signals, and the
    user's ``worker_init_fn``). A class, so that it pickles into spawned workers.

    A forked worker inherits the main process's warning filters; one started by ``spawn`` or
    ``forkserver`` (macOS's default) does not, so a ``BarrenEpochWarning`` made an error in the
    training script would only be printed there. The filters on ``rs.ResumableWarning`` and its
    subclasses are read as each pass's workers start (``Loader.__iter__``) and applied in each
    worker, ahead of its own, unless it has them already (forked)."""

    def __init__(self, user_init: Callable[[int], None] | None, ignore_others_sigterm: bool) -> None:
        self.user_init = user_init
        self.ignore_others_sigterm = ignore_others_sigterm
        self.warning_filters: tuple[WarningFilter, ...] = ()

    def __call__(self, worker_id: int) -> None:
        cast("Any", get_worker_info()).dataset.ships_failures = True
        missing = [entry for entry in self.warning_filters if entry not in warnings.filters]
        for action, message, category, module, lineno in reversed(missing):  # each goes first: keep their order
            warnings.filterwarnings(
                action,  # type: ignore[arg-type]  # an action warnings itself stored
                message.pattern if message is not None else "",
                category,
                module.pattern if module is not None else "",
                lineno,
            )
        init_worker(self.user_init, worker_id, ignore_others_sigterm=self.ignore_others_sigterm)


def own_warning_filters() -> tuple[WarningFilter, ...]:
    """This process's warning filters on ``rs.ResumableWarning`` and its subclasses, in
    ``warnings.filters``' order (the first that matches wins), but for categories a spawned
    worker could not import by name (a subclass defined in a function): they would not pickle."""
    return tuple(
        entry
        for entry in warnings.filters
        if isinstance(entry[2], type) and issubclass(entry[2], ResumableWarning) and _importable(entry[2])
    )


def _importable(cls: type) -> bool:
    """Whether ``cls`` is found again by its module and qualified name, as pickle finds it."""
    found: Any = sys.modules.get(cls.__module__)
    for name in cls.__qualname__.split("."):
        found = getattr(found, name, None)
    return found is cls


def _check_snapshot_every(every: Any) -> None:
    """Accept the deprecated ``snapshot_every_n_steps``: 1 silently, another count with a
    ``FutureWarning`` (a state now comes with every batch); anything else is a ConfigError."""
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ConfigError(f"Loader: snapshot_every_n_steps must be an int >= 1 (and is deprecated), got {every!r}")
    if every != EVERY_BATCH:
        warnings.warn(
            f"Loader: snapshot_every_n_steps={every} is ignored and deprecated: workers now hand their state over "
            "with every batch, so restores replay nothing; drop the argument",
            FutureWarning,
            stacklevel=3,
        )


_OPEN_LOADERS: weakref.WeakSet[Loader] = weakref.WeakSet()


@atexit.register
def _close_open_loaders() -> None:
    """Stop every loader's workers the orderly way before Python's exit hooks terminate them.

    Registered after torch's and multiprocessing's own hooks, so it runs before them.
    """
    for loader in list(_OPEN_LOADERS):
        loader._stop_workers()
