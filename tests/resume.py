"""The central property: iterate k items, save, restore into a freshly built pipeline,
continue; the result equals the uninterrupted run.

A pipeline's "run" crosses epochs the way a training loop does: when an epoch ends, iterating
again starts the next one.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Callable

import numpy as np

from resumable import Node

Build = Callable[[], Node[Any]]


# A pipeline that yields nothing for this many epochs in a row is taken to be empty. Some
# epochs of a small shard after a filter may be empty, but never this many in a row, so
# where a run is cut into calls does not change what it yields.
EMPTY_EPOCHS = 50


def plain(item: Any) -> Any:
    """The item as comparable plain data (packed rows hold numpy arrays)."""
    torch = sys.modules.get("torch")  # not imported here: a process pool's workers import this module
    if isinstance(item, np.ndarray) or (torch is not None and isinstance(item, torch.Tensor)):
        return item.tolist()
    if isinstance(item, dict):
        return {key: plain(value) for key, value in item.items()}
    if isinstance(item, (list, tuple)):
        return [plain(x) for x in item]
    if isinstance(item, np.generic):
        return item.item()
    return item


def take(pipe: Node[Any], count: int) -> list[Any]:
    """The next ``count`` items, starting new epochs as a training loop would; fewer if the
    pipeline is empty (``EMPTY_EPOCHS`` empty epochs in a row)."""
    items: list[Any] = []
    empty_epochs = 0
    while len(items) < count and empty_epochs < EMPTY_EPOCHS:
        before = len(items)
        for item in pipe:
            items.append(item)
            if len(items) == count:
                break
        empty_epochs = empty_epochs + 1 if len(items) == before else 0
    return items


def roundtrip(state: dict[str, Any]) -> dict[str, Any]:
    """Send a state through JSON, as a checkpoint file would; fails on non-JSON types."""
    return json.loads(json.dumps(state))


def scribble(value: Any) -> None:
    """Edit a state in place everywhere, as a caller reusing its dict would: every flag flipped,
    number moved and text changed, an entry added to every dict and an item to every list."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in list(items):
        if isinstance(item, (dict, list)):
            scribble(item)
        elif isinstance(item, bool):
            value[key] = not item
        elif isinstance(item, int):
            value[key] = item + 1
        elif isinstance(item, str):
            value[key] = item + "x"
    if isinstance(value, dict):
        value["junk"] = 1
    elif isinstance(value, list):
        value.append(7)


def restored(build: Build, state: dict[str, Any]) -> Node[Any]:
    pipe = build()
    pipe.set_state(roundtrip(state))
    return pipe


def check_resume(build: Build, k: int, total: int, k2: int | None = None) -> None:
    """Save after ``k`` items and compare the continuation with an uninterrupted run of
    ``total`` items. With ``k2``, restore a second time after ``k2`` items (restoring twice
    in a row). Also checks that a state is a value: iterating on after taking it changes
    nothing in it."""
    expected = take(build(), total)

    pipe = build()
    head = take(pipe, k)
    state = pipe.get_state()
    frozen = json.dumps(state, sort_keys=True)
    rest_of_original = take(pipe, total - k)
    assert head + rest_of_original == expected, "get_state() disturbed the iteration"
    assert json.dumps(state, sort_keys=True) == frozen, "the state changed after it was taken"

    resumed = restored(build, state)
    if k2 is None:
        assert head + take(resumed, total - k) == expected
        return
    middle = take(resumed, k2 - k)
    again = restored(build, resumed.get_state())
    assert head + middle + take(again, total - k2) == expected


LOADER_TIMEOUT = 60
"""Seconds: a Loader worker that never answers fails the test instead of hanging it."""

LOADER_CONFIGS: dict[str, dict[str, Any]] = {
    "0-workers": {"num_workers": 0},
    "2-workers": {"num_workers": 2, "timeout": LOADER_TIMEOUT},
    "2-persistent": {"num_workers": 2, "persistent_workers": True, "timeout": LOADER_TIMEOUT},
}
"""``rs.torch.Loader`` options by name: no workers, fresh workers and persistent ones."""


def loader_epoch(loader: Any) -> list[Any]:
    """One pass of ``loader`` (an ``rs.torch.Loader``), its batches as plain data."""
    return [plain(batch) for batch in loader]


def loader_batches(loader: Any, stop: int | None = None) -> tuple[list[list[int]], Any]:
    """The batches of ``loader`` (an ``rs.torch.Loader``) as lists of ints, until the epoch ends
    or ``stop`` batches were taken; with ``stop``, also the loader's state then, through JSON."""
    seen: list[list[int]] = []
    for batch in loader:
        seen.append([int(x) for x in batch])
        if len(seen) == stop:
            return seen, json.loads(json.dumps(loader.state_dict()))
    return seen, None


def loader_head(loader: Any, stop: int, count: int, convert: Callable[[Any], Any]) -> list[Any]:
    """The first ``stop`` batches of a loader whose epoch holds ``count``, converted: up to the
    epoch's end, then its StopIteration (checked) once ``stop`` reaches ``count``, then the first
    batch of the next epoch when ``stop`` passes it."""
    taken = []
    iterator = iter(loader)
    for _ in range(min(stop, count)):
        taken.append(convert(next(iterator)))
    if stop >= count:
        assert next(iterator, "ended") == "ended"
    if stop > count:
        taken.append(convert(next(iter(loader))))
    return taken


def loader_rest(loader: Any, stop: int, count: int, convert: Callable[[Any], Any]) -> list[Any]:
    """What a loader resumed after ``loader_head(..., stop, count, ...)`` yields until the end of
    the epoch after the first: the rest of it, and the next epoch whole when it was within it."""
    rest = [convert(batch) for batch in loader]
    if stop < count:
        rest += [convert(batch) for batch in loader]
    return rest


def row_lists(row: dict[str, Any]) -> dict[str, list[Any]]:
    """A packed row (or any dict of arrays) as plain lists, to compare with ``==``."""
    return {name: np.asarray(value).tolist() for name, value in row.items()}


def check_closed_resume(build: Build, ks: tuple[int, ...], total: int, plain: Callable[[Any], Any] = row_lists) -> None:
    """``check_resume`` for pipelines that own threads or pools: for each ``k`` in ``ks``, save
    after ``k`` items, ``close()`` the pipeline, restore into a fresh one and compare its
    continuation (every item through ``plain``) with an uninterrupted run of ``total`` items."""
    whole = build()
    expected = [plain(item) for item in take(whole, total)]
    whole.close()
    for k in ks:
        pipe = build()
        head = [plain(item) for item in take(pipe, k)]
        state = pipe.get_state()
        pipe.close()
        resumed = restored(build, state)
        assert head + [plain(item) for item in take(resumed, total - k)] == expected, k
        resumed.close()


def loops(pipe: Node[Any], count: int) -> list[list[Any]]:
    """The next ``count`` items as a training loop sees them: one list per ``for`` loop over
    the pipeline (an epoch, or the rest of one), so where epochs end is compared too; fewer
    items if the pipeline is empty (``EMPTY_EPOCHS`` empty loops in a row)."""
    found: list[list[Any]] = []
    items = empty = 0
    while items < count and empty < EMPTY_EPOCHS:
        loop = []
        for item in pipe:
            loop.append(plain(item))
            items += 1
            if items == count:
                break
        found.append(loop)
        empty = 0 if loop else empty + 1
    return found


def flat(found: list[list[Any]]) -> list[Any]:
    return [item for loop in found for item in loop]
