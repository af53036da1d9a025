"""The format of an ``rs.torch.Loader`` state, and its one validation.

A Loader state is ``{"format", "epoch", "rank", "world_size", "num_workers",
"snapshot_every_n_steps", "loader"}``, where ``loader`` is torchdata's StatefulDataLoader
state: each worker's pipeline state (one JSON string, with the epoch of the worker's pass)
as of its last snapshot, and the batches handed out since. The Loader takes a snapshot with
every batch, so its states count none and ``snapshot_every_n_steps`` is always 1; states saved
by earlier versions, which snapshotted every few batches (16 by default), may count up to that
interval minus one, and still load: torchdata advances the workers by them on restore,
``resumable.torch.elastic`` before a rescale. torchdata reads that part with
``assert`` and bare indexing, so every field it or the Loader reads is checked here first,
and a bad one raises ``StateError`` naming the rank, worker and field.

This module imports neither torch nor torchdata, so ``python -m resumable inspect`` reads
Loader states without loading them; the tests check the key names against torchdata's.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from resumable.core.state import INT64_MAX, LOADER_FORMAT, LOADER_FORMAT_PREFIX, check_json, require
from resumable.errors import StateError

# Keys of the Loader state.
FORMAT = LOADER_FORMAT
FORMAT_NAME = f"{LOADER_FORMAT_PREFIX}3"
LEGACY_FORMATS = (f"{LOADER_FORMAT_PREFIX}1", f"{LOADER_FORMAT_PREFIX}2")
"""Earlier formats, read by upgrading them (``upgraded``)."""
LEGACY_SNAPSHOT_EVERY = 16
EPOCH = "epoch"
RANK = "rank"
WORLD_SIZE = "world_size"
NUM_WORKERS = "num_workers"
SNAPSHOT_EVERY = "snapshot_every_n_steps"
LOADER = "loader"

# Keys of torchdata's StatefulDataLoader state (private names of torchdata 0.11).
ITERATOR_FINISHED = "_iterator_finished"
NUM_YIELDED = "_num_yielded"  # without workers: batches handed out in this pass
SAMPLER_ITER_YIELDED = "_sampler_iter_yielded"
LEN_CALLED = "_IterableDataset_len_called"
SHARED_SEED = "_shared_seed"
SNAPSHOT = "_snapshot"
SNAPSHOT_STEP = "_snapshot_step"
LAST_YIELDED = "_last_yielded_worker_id"
MAIN_SNAPSHOT = "_main_snapshot"
WORKER_SNAPSHOTS = "_worker_snapshots"
STEPS_SINCE = "_steps_since_snapshot"
MAIN_NUM_WORKERS = "_num_workers"
BASE_SEED = "_base_seed"
WORKER_ID = "worker_id"
FETCHER_STATE = "fetcher_state"
FETCHER_ENDED = "fetcher_ended"
DATASET_STATE = "dataset_state"
ITER_STATE = "dataset_iter_state"
WORKER_PREFIX = "worker_"

# Keys of what a worker reports (rs.torch.PipelineDataset): its JSON-encoded pipeline state,
# and the epoch its pass started, which must be the Loader state's epoch.
PIPELINE = "pipeline"
PASS_EPOCH = "epoch"

# Seeds are int64 in torch (INT64_MAX); larger values are corrupt.
# Epochs and batch counts a Loader state may hold. The Loader stops with a StateError rather
# than count past it, so every state it saves loads again: far above any real run, and far
# below int64, so that torch never overflows either.
MAX_COUNT = 2**62
# The largest snapshot interval an earlier version's state may record (it refused more).
MAX_SNAPSHOT_EVERY = 10_000


@dataclass(frozen=True)
class LoaderState:
    """One rank's Loader state, validated.

    ``pipelines`` holds each worker's pipeline state (one, the main process's, without
    workers) as of its last snapshot; ``steps_since_snapshot`` batches were handed out after
    it, round-robin from the worker after ``last_yielded_worker``: none in a state of this
    version, which snapshots with every batch, up to ``snapshot_every - 1`` in one saved by an
    earlier version. Without workers the pipeline state is that of the last batch handed out.
    """

    state: dict[str, Any]
    epoch: int
    rank: int
    world_size: int
    num_workers: int
    snapshot_every: int
    finished: bool
    texts: list[str]
    snapshot_step: int
    steps_since_snapshot: int
    last_yielded_worker: int
    where: str

    @property
    def handed_out(self) -> int:
        """Batches of this pass handed out when the state was taken."""
        return self.snapshot_step + self.steps_since_snapshot

    @cached_property
    def pipelines(self) -> list[dict[str, Any]]:
        """Each worker's pipeline state, parsed from ``texts`` (the JSON text the Loader state
        holds) on first use: an elastic resume parses most old workers' states itself and keeps
        only what it reads of them."""
        if not self.num_workers:
            return [parse_pipeline(self.texts[0], f"{self.where} at {LOADER}")]
        at = f"{LOADER}.{SNAPSHOT}.{WORKER_SNAPSHOTS}.{WORKER_PREFIX}"
        return [parse_pipeline(text, f"{self.where} worker {w} at {at}{w}") for w, text in enumerate(self.texts)]


def upgraded(state: Any) -> Any:
    """``state`` in this format if it was saved in an earlier one (0.1.0 wrote format 1), else
    as it is. Format 2 added ``snapshot_every_n_steps`` (earlier loaders took a snapshot every
    16 batches unless told otherwise; the bound it sets is only widened to what the state
    counts), format 3 the epoch of the pass each worker's pipeline state comes from (the
    Loader's epoch: earlier loaders recorded no other)."""
    if not isinstance(state, dict) or state.get(FORMAT) not in LEGACY_FORMATS:
        return state
    copied = copy.deepcopy(state)
    copied[FORMAT] = FORMAT_NAME
    loader, epoch = copied.get(LOADER), copied.get(EPOCH)
    if isinstance(loader, dict) and SNAPSHOT_EVERY not in copied:
        steps = loader.get(STEPS_SINCE, 0)
        copied[SNAPSHOT_EVERY] = max(LEGACY_SNAPSHOT_EVERY, steps + 1 if isinstance(steps, int) else 0)
    holders = [loader]
    if isinstance(loader, dict) and isinstance(loader.get(SNAPSHOT), dict):
        workers = loader[SNAPSHOT].get(WORKER_SNAPSHOTS)
        holders = list(workers.values()) if isinstance(workers, dict) else []
    for holder in holders:
        fetcher = holder.get(FETCHER_STATE) if isinstance(holder, dict) else None
        iterator = fetcher.get(ITER_STATE) if isinstance(fetcher, dict) else None
        if isinstance(iterator, dict):
            iterator.setdefault(PASS_EPOCH, epoch)
    return copied


def parse_loader_state(state: Any, where: str = "Loader", lazy: bool = False) -> LoaderState:
    """Validate a whole Loader state (StateError naming rank, worker and field) and read it;
    a state in an earlier format is read as ``upgraded`` gives it. With ``lazy``, the workers'
    pipeline states are left as JSON text until ``pipelines`` is read, and the state is not
    walked whole to check its types (an elastic resume reads thousands of them, only the fields
    checked here and the pipeline states, which it parses itself); ``check_json(state.state)``
    checks the rest before the state is handed to torchdata."""
    if lazy:  # only the fields read below are used, each checked as it is read
        return _parsed_loader_state(state, where)
    check_json(state, where)
    parsed = _parsed_loader_state(state, where)
    parsed.pipelines  # noqa: B018  # parsed and checked now
    return parsed


def _parsed_loader_state(state: Any, where: str) -> LoaderState:
    state = upgraded(state)
    if not isinstance(state, dict) or state.get(FORMAT) != FORMAT_NAME:
        saved = state.get(FORMAT) if isinstance(state, dict) else type(state).__name__
        raise StateError(f"{where}: not a resumable Loader state (format {FORMAT_NAME!r} expected, got {saved!r})")
    world_size = _count(state, WORLD_SIZE, where, low=1)
    rank = _count(state, RANK, where, high=world_size - 1)
    where = f"{where} rank {rank}/{world_size}"
    epoch = _count(state, EPOCH, where)
    num_workers = _count(state, NUM_WORKERS, where)
    snapshot_every = _count(state, SNAPSHOT_EVERY, where, low=1, high=MAX_SNAPSHOT_EVERY)
    loader = require(state, LOADER, dict, where)
    at_loader = f"{where} at {LOADER}"
    finished = require(loader, ITERATOR_FINISHED, bool, at_loader)
    if num_workers == 0:
        _main_counters(loader, at_loader)
        return LoaderState(
            state=state,
            epoch=epoch,
            rank=rank,
            world_size=world_size,
            num_workers=num_workers,
            snapshot_every=snapshot_every,
            finished=finished,
            texts=[_pipeline(loader, at_loader, epoch)],
            snapshot_step=_count(loader, NUM_YIELDED, at_loader),
            steps_since_snapshot=0,
            last_yielded_worker=0,
            where=where,
        )
    steps = _count(loader, STEPS_SINCE, at_loader, high=snapshot_every - 1)
    snapshot = require(loader, SNAPSHOT, dict, at_loader)
    at_snapshot = f"{at_loader}.{SNAPSHOT}"
    main = require(snapshot, MAIN_SNAPSHOT, dict, at_snapshot)
    at_main = f"{at_snapshot}.{MAIN_SNAPSHOT}"
    _count(main, MAIN_NUM_WORKERS, at_main, low=num_workers, high=num_workers)
    _main_counters(main, at_main)
    _count(main, BASE_SEED, at_main, high=INT64_MAX)
    workers = require(snapshot, WORKER_SNAPSHOTS, dict, at_snapshot)
    # The length first: the expected names are built only for as many workers as are there.
    if len(workers) != num_workers or set(workers) != {f"{WORKER_PREFIX}{w}" for w in range(num_workers)}:
        raise StateError(
            f"{at_snapshot}: state entry {WORKER_SNAPSHOTS!r} holds {sorted(workers)}, expected "
            f"{WORKER_PREFIX}0 to {WORKER_PREFIX}{num_workers - 1} for num_workers={num_workers}"
        )
    texts = []
    for w in range(num_workers):
        key = f"{WORKER_PREFIX}{w}"
        at_worker = f"{where} worker {w} at {LOADER}.{SNAPSHOT}.{WORKER_SNAPSHOTS}.{key}"
        worker = require(workers, key, dict, at_snapshot)
        _count(worker, WORKER_ID, at_worker, low=w, high=w)
        texts.append(_pipeline(worker, at_worker, epoch))
    # Batches handed out when the state was taken: the snapshot's and the ones since.
    snapshot_step = _count(snapshot, SNAPSHOT_STEP, at_snapshot, high=MAX_COUNT - steps)
    return LoaderState(
        state=state,
        epoch=epoch,
        rank=rank,
        world_size=world_size,
        num_workers=num_workers,
        snapshot_every=snapshot_every,
        finished=finished,
        texts=texts,
        snapshot_step=snapshot_step,
        steps_since_snapshot=steps,
        last_yielded_worker=_count(snapshot, LAST_YIELDED, at_snapshot, high=num_workers - 1),
        where=where,
    )


def _count(holder: dict[str, Any], key: str, where: str, low: int = 0, high: int = MAX_COUNT) -> int:
    """An int entry in ``[low, high]`` (by default a count the Loader can continue from)."""
    value: int = require(holder, key, int, where)
    if not low <= value <= high:
        expected = str(low) if low == high else f"an int in [{low}, {high}]"
        raise StateError(f"{where}: state entry {key!r} is {value}, expected {expected}")
    return value


def _main_counters(holder: dict[str, Any], where: str) -> None:
    """The sampler counter and seeds that torchdata restores in the main process."""
    _count(holder, SAMPLER_ITER_YIELDED, where)
    for key in (LEN_CALLED, SHARED_SEED):
        if require(holder, key, (int, type(None)), where) is not None:
            _count(holder, key, where, high=INT64_MAX)


def _pipeline(holder: dict[str, Any], where: str, epoch: int) -> str:
    """The pipeline state's JSON text inside a worker's (or the single process's) fetcher state,
    which must come from a pass of the Loader state's ``epoch`` (not grafted from another epoch)."""
    if require(holder, DATASET_STATE, (dict, type(None)), where) is not None:
        raise StateError(f"{where}: state entry {DATASET_STATE!r} is not null: not saved by rs.torch.Loader")
    fetcher = require(holder, FETCHER_STATE, dict, where)
    at_fetcher = f"{where}.{FETCHER_STATE}"
    require(fetcher, FETCHER_ENDED, bool, at_fetcher)
    iterator = require(fetcher, ITER_STATE, dict, at_fetcher)
    at_iterator = f"{at_fetcher}.{ITER_STATE}"
    pass_epoch = require(iterator, PASS_EPOCH, int, at_iterator)
    if pass_epoch != epoch:
        raise StateError(
            f"{at_iterator}: state entry {PASS_EPOCH!r} is {pass_epoch}, expected {epoch}: this pipeline state "
            f"comes from a pass of epoch {pass_epoch}, the Loader state is at epoch {epoch}"
        )
    text: str = require(iterator, PIPELINE, str, at_iterator)
    return text


def parse_pipeline(text: str, where: str) -> dict[str, Any]:
    """A worker's pipeline state from its JSON text; StateError naming ``where`` if it is not a
    JSON object of JSON types."""
    try:
        pipeline = json.loads(text)
    except (ValueError, RecursionError) as error:
        raise StateError(f"{where}: the pipeline state is not valid JSON ({error})") from error
    if not isinstance(pipeline, dict):
        raise StateError(f"{where}: the pipeline state is a {type(pipeline).__name__}, expected a JSON object")
    check_json(pipeline, where)
    return pipeline
