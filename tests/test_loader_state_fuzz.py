"""Corrupted rs.torch.Loader states: load_state_dict and the iteration after it raise only
rs.ResumableError subclasses, never hang, and a rejected state leaves the loader as it was."""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import signal
from typing import Any, Iterator

from hypothesis import event, given, settings
from hypothesis import strategies as st

import resumable as rs
from resumable.torch import Loader
from tests.test_state_fuzz import paths

# Guards against hangs, not timing checks: a worker silent this long, or a load and two
# epochs of 10 batches taking this long, fail the test instead of stalling it.
WORKER_TIMEOUT_S = 120
HANG_GUARD_S = 300
ITEMS = 20
# More batches than any state can lead to: iterating further would be a loop, not an epoch.
BATCH_LIMIT = 3 * ITEMS


def build() -> rs.Node:
    return rs.from_list(list(range(ITEMS))).shuffle(3).shard().batch(2)


def make(num_workers: int) -> Loader:
    timeout = WORKER_TIMEOUT_S if num_workers else 0
    return Loader(build, num_workers=num_workers, timeout=timeout)


def contents(loader: Loader) -> list[list[int]]:
    return [[int(x) for x in batch] for batch in itertools.islice(loader, BATCH_LIMIT)]


@functools.cache
def real_states(num_workers: int) -> list[dict[str, Any]]:
    """States taken mid-epoch (after 3 and 5 batches) and after the epoch ended."""
    loader = make(num_workers)
    iterator = iter(loader)
    states = []
    for taken in range(1, 6):
        next(iterator)
        if taken in (3, 5):
            states.append(json.loads(json.dumps(loader.state_dict())))
    list(iterator)
    states.append(json.loads(json.dumps(loader.state_dict())))
    return states


def holder_of(state: Any, path: tuple[Any, ...]) -> Any:
    for key in path[:-1]:
        state = state[key]
    return state


REPLACEMENTS = [None, True, -1, 10**12, 10**30, 2**63, -(10**30), 1.5, "", "x", [], {}]


@st.composite
def corrupted(draw: st.DrawFn, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with one entry deleted, replaced, truncated, or two workers swapped."""
    state = json.loads(json.dumps(state))
    path = draw(st.sampled_from(paths(state)))
    holder, key = holder_of(state, path), path[-1]
    action = draw(st.sampled_from(["delete", "replace", "truncate", "swap"]))
    workers = state["loader"].get("_snapshot", {}).get("_worker_snapshots", {})
    if action == "swap" and len(workers) > 1:
        swap_whole = draw(st.booleans())
        first, second = workers["worker_0"], workers["worker_1"]
        if swap_whole:
            workers["worker_0"], workers["worker_1"] = second, first
        else:
            inner = ("fetcher_state", "dataset_iter_state", "pipeline")
            a, b = holder_of(first, inner), holder_of(second, inner)
            a["pipeline"], b["pipeline"] = b["pipeline"], a["pipeline"]
    elif action == "truncate" and isinstance(holder[key], str):
        holder[key] = holder[key][: draw(st.integers(0, max(len(holder[key]) - 1, 0)))]
    elif action == "delete" and isinstance(holder, dict):
        del holder[key]
    else:
        holder[key] = draw(st.sampled_from(REPLACEMENTS))
    return state


class Hang(Exception):
    """Loading or iterating a state did not finish: it would have hung."""


@contextlib.contextmanager
def hang_guard() -> Iterator[None]:
    def interrupt(signum: int, frame: Any) -> None:
        raise Hang(f"no result after {HANG_GUARD_S} s")

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.alarm(HANG_GUARD_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def make_loaded(num_workers: int, state: dict[str, Any]) -> Loader:
    loader = make(num_workers)
    loader.load_state_dict(state)
    return loader


def loads(loader: Loader, state: Any) -> bool:
    """Load ``state``: False if it was rejected with a ResumableError, leaving ``loader`` as it was."""
    before = loader.state_dict()
    try:
        loader.load_state_dict(state)
    except rs.ResumableError:
        assert loader.state_dict() == before
        event("rejected by load_state_dict")
        return False
    return True


def iterate_two_epochs(loader: Loader) -> None:
    """Iterate the loaded state's epoch and the next: either works or raises a ResumableError."""
    try:
        contents(loader)
        contents(loader)
        event("loaded and iterated")
    except rs.ResumableError as error:
        event(f"rejected while iterating: {type(error).__name__}")


@settings(max_examples=30)
@given(data=st.data(), num_workers=st.sampled_from([0, 1, 2]))
def test_a_corrupted_state_raises_only_resumable_errors(data: st.DataObject, num_workers: int) -> None:
    states = real_states(num_workers)
    bad = data.draw(corrupted(data.draw(st.sampled_from(states))))
    loader = make_loaded(num_workers, states[0])
    with hang_guard():
        if loads(loader, bad):
            iterate_two_epochs(loader)
        else:
            assert contents(loader) == contents(make_loaded(num_workers, states[0]))


@settings(max_examples=20)
@given(data=st.data(), old_workers=st.sampled_from([0, 2]), new_workers=st.sampled_from([0, 1, 2]))
def test_a_corrupted_list_of_rank_states_raises_only_resumable_errors(
    data: st.DataObject, old_workers: int, new_workers: int
) -> None:
    bad = data.draw(corrupted(data.draw(st.sampled_from(real_states(old_workers)))))
    loader = make(new_workers)
    with hang_guard():
        if loads(loader, [bad]):
            iterate_two_epochs(loader)
