"""Adversary: user code and its errors inside the transformation nodes.

A user function that raises on the k-th record (``ValueError``, ``KeyError``, ``StopIteration``,
``SystemExit``, ``KeyboardInterrupt``, ``GeneratorExit``, an exception that cannot be pickled, one
whose ``__init__`` takes two arguments, one with a huge message) in ``.map(fn)`` with 0, 1, 2 and
4 workers in threads and processes, in a filter's predicate and a batch's ``collate_fn``, under
``.prefetch()``, ``.repeat()`` and ``.cache()``, and through ``rs.torch.Loader`` with 0 and 2
workers; functions that return ``None``, generators, numpy scalars, objects that cannot be pickled
and big arrays; filters that drop everything (with and without ``.repeat()``) or everything but
the last record; ``repeat`` over an empty source; batch sizes of 1 and beyond the epoch; prefetch
buffers of 1 and 10^9; pools larger than the epoch; ``next()`` after ``StopIteration``.

The contract (README "Transformations", docs/parallel.md "Exceptions"): an error of ``fn`` in a
pool reaches the consumer at its record as ``rs.MapError`` naming the node and the record's key,
with the original as ``__cause__``; the records before and after it are handed out, as with a
serial map; the record that failed counts as consumed, so iterating on continues after it, and a
state taken anywhere around the error (before it, at it, after it, with items in flight) restores
into a fresh pipeline, or into the same one, and continues exactly as the uninterrupted run;
no thread or process outlives a pipeline closed or dropped after an error.

The six bugs it found are mended (a StopIteration of user code ended the epoch silently; a
BaseException of fn in a pool stuck; MapError did not unpickle, nor cross a DataLoader worker; a
Loader state right after a worker's error replayed it; an error below a cache stuck)."""

from __future__ import annotations

import builtins
import gc
import json
import multiprocessing
import pickle
import threading
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import resumable as rs
from resumable import Node
from resumable.core.keys import Stride
from tests.resume import plain, roundtrip, take
from tests.watching import wait_until

pytestmark = [pytest.mark.filterwarnings("ignore:This DataLoader will create")]

N = 24
END = "END"
STUCK = "STUCK"
RAISED = "raised"


# -- user functions (module level: process pools pickle them by reference) ---------------------


class Unpicklable(Exception):
    """An exception holding a lock: it cannot travel back from a worker process."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.lock = threading.Lock()


class TwoArgs(Exception):
    """An exception whose ``__init__`` takes two arguments: it pickles but does not unpickle."""

    def __init__(self, text: str, reason: str) -> None:
        super().__init__(f"{reason}: {text}")
        self.text, self.reason = text, reason


class Huge(Exception):
    """An exception with a message of megabytes."""


HUGE_MESSAGE = 2_000_000


def make_error(name: str) -> BaseException:
    if name == "Unpicklable":
        return Unpicklable("holds a lock")
    if name == "TwoArgs":
        return TwoArgs("abc", "too long")
    if name == "Huge":
        return Huge("x" * HUGE_MESSAGE)
    error: BaseException = getattr(builtins, name)(f"{name} from fn")
    return error


class FailAt:
    """``10 * x``, raising ``error`` on record ``at``; with ``batched``, the same over a list."""

    def __init__(self, error: str, at: int, batched: bool = False) -> None:
        self.error, self.at, self.batched = error, at, batched

    def __call__(self, x: Any) -> Any:
        if self.batched:
            if self.at in x:
                raise make_error(self.error)
            return [10 * v for v in x]
        if x == self.at:
            raise make_error(self.error)
        return 10 * x


class KeepIf:
    """A predicate keeping ``x % 3 != 0``, raising ``error`` on record ``at``."""

    def __init__(self, error: str, at: int) -> None:
        self.error, self.at = error, at

    def __call__(self, x: int) -> bool:
        if x == self.at:
            raise make_error(self.error)
        return x % 3 != 0


class CollateFailAt:
    """A collate function summing a batch, raising ``error`` on the batch holding record ``at``."""

    def __init__(self, error: str, at: int) -> None:
        self.error, self.at = error, at

    def __call__(self, batch: list[int]) -> Any:
        if self.at in batch:
            raise make_error(self.error)
        return [sum(batch), len(batch)]


def odd_results(x: int) -> Any:
    """Every odd kind of outcome, one per record."""
    if x == 3:
        raise Unpicklable("holds a lock")
    if x == 6:
        raise TwoArgs("abc", "too long")
    if x == 9:
        raise Huge("x" * HUGE_MESSAGE)
    if x == 12:
        return (i for i in range(3))
    if x == 15:
        return threading.Lock()
    if x == 18:
        return None
    if x == 21:
        return np.arange(1_000_000, dtype=np.int64) + x
    return np.float32(x) / 2


def identity(x: Any) -> Any:
    return x


def as_is(batch: Any) -> Any:
    return batch


# -- helpers -----------------------------------------------------------------------------------


def outcomes(pipe: Any, limit: int = 200) -> list[Any]:
    """What ``limit`` calls of ``next()`` give: the items (as plain data), ``(RAISED, type name)``
    for an exception, ``END`` at ``StopIteration`` (then stop), ``STUCK`` once the same exception
    comes three times in a row (no function here fails on two records in a row)."""
    seen: list[Any] = []
    while len(seen) < limit:
        try:
            item = next(pipe)
        except StopIteration:
            seen.append(END)
            return seen
        except BaseException as error:  # noqa: BLE001 - which exception is the point
            seen.append((RAISED, type(error).__name__))
            if len(seen) >= 3 and seen[-3] == seen[-2] == seen[-1]:
                seen.append(STUCK)
                return seen
            continue
        seen.append(plain(item))
    return seen


def raised_any(seen: list[Any]) -> list[Any]:
    """``seen`` with every exception's type name left out (the serial and pool types differ)."""
    return [RAISED if isinstance(x, tuple) and x[:1] == (RAISED,) else x for x in seen]


def serial_outcomes(values: list[Any], at: int) -> list[Any]:
    """What a serial map gives over ``values`` failing at record ``at``: every other record, the
    error at its place, then the end."""
    return [RAISED if i == at else value for i, value in enumerate(values)] + [END]


def reader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("resumable-")]


def children() -> set[int]:
    return {p.pid for p in multiprocessing.active_children() if p.pid is not None}


def check_states_around(build: Callable[[], Node[Any]], points: tuple[int, ...], limit: int = 200) -> list[Any]:
    """For each point ``j`` (a count of ``next()`` calls, errors included): take the state there,
    restore it into a fresh pipeline and, after reading two more items, into the same one; both
    continue as the uninterrupted run does after ``j`` calls. Returns the uninterrupted run."""
    with build() as whole:
        reference = outcomes(whole, limit)
    assert STUCK not in reference, reference
    for j in points:
        pipe = build()
        head = outcomes(pipe, j)
        assert head == reference[: len(head)]
        state = roundtrip(pipe.get_state())
        frozen = json.dumps(state, sort_keys=True)
        outcomes(pipe, 2)  # the reader runs on, items and errors in flight
        fresh = build()
        fresh.set_state(state)
        # an ended state keeps stopping, as the ended pipeline does
        rest = reference[len(head) :] if head[-1:] != [END] else [END]
        assert outcomes(fresh, limit) == rest, f"restored after {j} calls into a fresh pipeline"
        pipe.set_state(state)
        assert outcomes(pipe, limit) == rest, f"restored after {j} calls into the same pipeline"
        assert json.dumps(state, sort_keys=True) == frozen
        fresh.close()
        pipe.close()
    return reference


def source(n: int = N) -> Node[Any]:
    return rs.from_list(list(range(n)))


# -- an exception of fn in every map mode and worker count -------------------------------------

# Where fn fails: the first record (a chunk of one), inside a full chunk, the last record. Process
# pools cost a start each (seconds on a loaded machine): one place per worker count.
MAPS = [
    *[
        pytest.param(workers, mode, at, id=f"{name}-at-{at}")
        for workers, mode, name in ((0, "thread", "serial"), (1, "thread", "thread-1"), (2, "thread", "thread-2"))
        for at in (0, 9, N - 1)
    ],
    pytest.param(4, "thread", 9, id="thread-4-at-9"),
    pytest.param(1, "process", N - 1, id="process-1-at-23"),
    pytest.param(2, "process", 9, id="process-2-at-9"),
    pytest.param(4, "process", 0, id="process-4-at-0"),
]


@pytest.mark.parametrize(("workers", "mode", "at"), MAPS)
def test_an_error_of_fn_comes_at_its_record_and_every_state_around_it_resumes(workers: int, mode: str, at: int) -> None:
    error = "KeyError" if at == 9 else "ValueError"

    def build() -> Node[Any]:
        return source().map(FailAt(error, at), num_workers=workers, mode=mode)

    with build() as pipe:
        assert [next(pipe) for _ in range(at)] == [10 * x for x in range(at)]
        with pytest.raises(BaseException) as info:  # noqa: PT011 - checked below
            next(pipe)
        if workers == 0:  # a serial map lets the exception through as it is
            assert type(info.value).__name__ == error
        else:
            mapped = info.value
            assert isinstance(mapped, rs.MapError) and isinstance(mapped, rs.ResumableError)
            assert mapped.key == (0, at)
            assert "ParallelMap" in str(mapped) and f"(0, {at})" in str(mapped) and error in str(mapped)
            assert type(mapped.__cause__).__name__ == error
        # the failed record counts as consumed: the state and iterating on are after it
        state = pipe.get_state()
        assert (state["upstream"] if workers else state)["position"] == at + 1
        assert list(pipe) == [10 * x for x in range(at + 1, N)]
    points = (at, at + 1) if mode == "process" else (0, at, at + 1, min(at + 2, N + 1))
    reference = check_states_around(build, points)
    assert raised_any(reference) == serial_outcomes([10 * x for x in range(N)], at)


@pytest.mark.parametrize(
    "where",
    [
        "map",
        "map-after-filter",
        "filter",
        "collate",
        "prefetch",
        "repeat",
        "loader-2-workers",
        "thread-pool",
        "process-pool",
    ],
)
def test_stop_iteration_raised_by_user_code_is_an_error_at_its_record_not_an_end_of_epoch(where: str) -> None:
    """User code that calls ``next()`` on an exhausted iterator (``next(x for x in ... if ...)``)
    raises ``StopIteration``. A pool reports it as a ``MapError`` at its record; everywhere else it
    must not pass for the end of the epoch either (PEP 479 turns it into a RuntimeError inside
    generators for this reason): silently losing the rest of the epoch is the worst outcome."""
    at = 5
    fn = FailAt("StopIteration", at)
    values = [10 * x for x in range(N)]
    expected = serial_outcomes(values, at)
    if where == "map":
        pipe = source().map(fn)
    elif where == "map-after-filter":
        pipe = source().filter(bool).map(fn)
        expected = serial_outcomes(values[1:], at - 1)
    elif where == "filter":
        pipe = source().filter(KeepIf("StopIteration", at))
        kept = [x for x in range(N) if x % 3 != 0 or x == at]
        expected = serial_outcomes(kept, kept.index(at))
    elif where == "collate":
        pipe = source().batch(2, collate_fn=CollateFailAt("StopIteration", at))
        sums = [[2 * b + 2 * b + 1, 2] for b in range(N // 2)]
        expected = serial_outcomes(sums, at // 2)
    elif where == "prefetch":
        pipe = source().map(fn).prefetch(2)
    elif where == "repeat":
        pipe = source().map(fn).repeat(2)
        expected = serial_outcomes(values, at)[:-1] + serial_outcomes(values, at)
    elif where == "loader-2-workers":  # batches of one record, handed out in order from both workers
        loader = loader_module().Loader(
            lambda: source().shard().map(fn).batch(1), num_workers=2, collate_fn=as_is, timeout=60
        )
        try:
            seen = outcomes(iter(loader))
        finally:
            loader.close()
        assert raised_any(seen) == serial_outcomes([[v] for v in values], at)
        return
    else:
        pipe = source().map(fn, num_workers=2, mode=where.partition("-")[0])
    with pipe:
        assert raised_any(outcomes(pipe)) == expected


BASE_EXCEPTIONS = ("SystemExit", "KeyboardInterrupt", "GeneratorExit")


@pytest.mark.parametrize(
    ("error", "chain"),
    [
        *[pytest.param(error, "serial", id=f"{error}-serial") for error in BASE_EXCEPTIONS],
        *[pytest.param(error, "prefetch", id=f"{error}-prefetch") for error in BASE_EXCEPTIONS],
        *[pytest.param(error, "thread-2", id=f"{error}-thread-2") for error in BASE_EXCEPTIONS],
        pytest.param("SystemExit", "thread-1"),
        pytest.param("SystemExit", "batched-1"),
        pytest.param("KeyboardInterrupt", "process-2"),
    ],
)
def test_a_base_exception_of_fn_comes_once_at_its_record_and_iteration_goes_on(error: str, chain: str) -> None:
    at = 9
    if chain == "serial":
        pipe = source().map(FailAt(error, at))
    elif chain == "prefetch":
        pipe = source().map(FailAt(error, at)).prefetch(3)
    elif chain == "batched-1":
        pipe = source().map(FailAt(error, at, batched=True), num_workers=1, batched=True)
    else:
        mode, _, workers = chain.partition("-")
        pipe = source().map(FailAt(error, at), num_workers=int(workers), mode=mode)
    with pipe:
        seen = outcomes(pipe)
        assert seen == [10 * x for x in range(at)] + [(RAISED, error)] + [10 * x for x in range(at + 1, N)] + [END]


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_after_a_base_exception_in_a_pool_the_state_is_what_was_handed_out_and_an_earlier_one_loads(mode: str) -> None:
    """Whatever happens after it, the pipeline that raised a BaseException still reports the
    state of the last item handed out, and loading an earlier state into it continues exactly as a
    fresh pipeline restored from that state."""

    def build() -> Node[Any]:
        return source().map(FailAt("SystemExit", 9), num_workers=2, mode=mode)

    pipe = build()
    head = outcomes(pipe, 4)
    before = roundtrip(pipe.get_state())
    seen = outcomes(pipe, 12)
    handed = [x for x in head + seen if not isinstance(x, (tuple, str))]
    assert handed == [10 * x for x in range(len(handed) + 1) if x != 9]  # the failed record counts as read
    assert pipe.get_state()["upstream"]["position"] == len(handed) + 1
    pipe.set_state(before)
    fresh = build()
    fresh.set_state(before)
    assert outcomes(pipe, 12) == outcomes(fresh, 12)
    pipe.close()
    fresh.close()


# -- odd exceptions and odd results ------------------------------------------------------------


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_odd_exceptions_and_odd_results_reach_their_records(mode: str) -> None:
    """Exceptions that cannot be pickled, that do not unpickle, that are huge; results that are
    None, numpy scalars, generators, locks and megabytes of array. In a process pool, what cannot
    travel is a MapError of its record only (docs/parallel.md), with the worker's traceback."""

    def build() -> Node[Any]:
        return source().map(odd_results, num_workers=2, mode=mode)

    pipe = build()
    errors: dict[int, rs.MapError] = {}
    items: dict[int, Any] = {}
    for x in range(N):
        try:
            items[x] = next(pipe)
        except rs.MapError as error:
            errors[x] = error
    with pytest.raises(StopIteration):
        next(pipe)
    failing = {3, 6, 9} | ({12, 15} if mode == "process" else set())
    assert set(errors) == failing
    assert all(errors[x].key == (0, x) for x in failing)
    assert items[18] is None
    assert items[1] == np.float32(0.5) and type(items[1]) is np.float32
    assert np.array_equal(items[21], np.arange(1_000_000) + 21)
    huge = errors[9].__cause__
    assert isinstance(huge, Huge) and len(huge.args[0]) == HUGE_MESSAGE
    if mode == "thread":
        assert isinstance(errors[3].__cause__, Unpicklable) and isinstance(errors[6].__cause__, TwoArgs)
        assert next(iter(items[12])) == 0 and type(items[15]) is type(threading.Lock())
    else:
        for x in (3, 6, 12, 15):
            assert isinstance(errors[x].__cause__, Exception)
        # the worker's traceback names where fn failed, even where its exception could not travel
        for x, name in ((3, "Unpicklable"), (6, "TwoArgs")):
            text = str(errors[x].__cause__.__cause__)
            assert "odd_results" in text and name in text, text[-500:]
    pipe.close()
    if mode == "process":  # thread mode hands out the generator and the lock themselves: no equality
        check_states_around(build, (4, 10, 16))


def test_a_map_error_pickles_with_its_key() -> None:
    """What a DataLoader worker, a multiprocessing pool or a logging handler does with an
    exception: pickle it."""
    pipe = source().map(FailAt("ValueError", 2), num_workers=1)
    with pipe:
        outcomes(pipe, 2)
        with pytest.raises(rs.MapError) as info:
            next(pipe)
    error = info.value
    copy = pickle.loads(pickle.dumps(error))
    assert isinstance(copy, rs.MapError) and copy.key == error.key and str(copy) == str(error)


# -- through rs.torch.Loader -------------------------------------------------------------------


def loader_build() -> Node[Any]:
    return source().shard().map(FailAt("ValueError", 7), num_workers=2).batch(2)


def serial_loader_build() -> Node[Any]:
    return source().shard().map(FailAt("ValueError", 7)).batch(2)


def collate_stopping_at_7(batch: list[int]) -> list[int]:
    if 70 in batch:
        raise StopIteration  # next() on an exhausted iterator, in a collate function
    return batch


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stop_iteration_of_the_loaders_collate_fn_is_a_map_error_and_the_pass_goes_on(workers: int) -> None:
    """torch takes a StopIteration out of collate_fn for the end of the pass (the worker's, or
    the loop's): the Loader makes it a MapError at its batch; the other batches all come."""
    rst = loader_module()

    def build() -> Node[Any]:
        return source().shard().map(lambda x: 10 * x).batch(2)

    loader = rst.Loader(build, num_workers=workers, collate_fn=collate_stopping_at_7, timeout=60 if workers else 0)
    with loader:
        seen = outcomes(iter(loader))
    assert seen.count((RAISED, "MapError")) == 1 and seen[-1] == END
    batches = [batch for batch in seen if isinstance(batch, list)]
    handed = sorted(x for batch in batches for x in batch)  # all but the failed batch of two: 70 and another
    assert len(handed) == N - 2 and 70 not in handed and set(handed) < {10 * x for x in range(N)}


def loader_module() -> Any:
    """``resumable.torch``, imported here: process pools' workers import this module to unpickle
    its functions, and importing torch costs seconds there."""
    import resumable.torch as rst

    return rst


def loader_outcomes(iterator: Any, limit: int = 40) -> list[Any]:
    seen: list[Any] = []
    for _ in range(limit):
        try:
            batch = next(iterator)
        except StopIteration:
            seen.append(END)
            return seen
        except Exception as error:  # noqa: BLE001 - which exception is the point
            seen.append((RAISED, type(error).__name__))
            continue
        seen.append([int(x) for x in batch])
    return seen


@pytest.mark.parametrize(
    "workers",
    [
        0,
        2,
    ],
)
def test_a_map_error_in_a_loader_arrives_as_a_map_error(workers: int) -> None:
    rst = loader_module()
    loader = rst.Loader(loader_build, num_workers=workers, collate_fn=as_is, timeout=60 if workers else 0)
    caught: list[BaseException] = []
    try:
        for _ in range(20):
            try:
                for _batch in loader:
                    pass
                break
            except Exception as error:  # noqa: BLE001 - which exception is the point
                caught.append(error)
                break
    finally:
        loader.close()
    assert len(caught) == 1
    assert isinstance(caught[0], rs.MapError), f"{type(caught[0]).__name__}: {str(caught[0])[:200]}"
    assert "ParallelMap" in str(caught[0])
    # the key of record 7 comes along from a worker too (torch would raise MapError(message) alone)
    consumers = max(workers, 1)
    assert caught[0].key == (Stride(consumer=7 % consumers, consumers=consumers), 0, 7 // consumers)
    assert ("DataLoader worker process" in str(caught[0])) == bool(workers)


@pytest.mark.parametrize("build", [serial_loader_build, loader_build], ids=["serial", "thread-map"])
@pytest.mark.parametrize(
    ("workers", "taken"),
    [
        pytest.param(0, 2, id="0-workers-before"),
        pytest.param(2, 2, id="2-workers-before"),
        pytest.param(0, 4, id="0-workers-after"),
        pytest.param(2, 4, id="2-workers-after"),
    ],
)
def test_a_loader_state_taken_around_a_worker_error_resumes_as_iterating_on(
    build: Callable[[], Node[Any]], workers: int, taken: int
) -> None:
    """The error is the fourth outcome (the batch holding record 7). A state taken before it
    restores to the same error at the same place; one taken right after it continues as the
    loader that raised it goes on."""
    rst = loader_module()
    timeout = 60 if workers else 0
    before = children()
    loader = rst.Loader(build, num_workers=workers, collate_fn=as_is, timeout=timeout)
    iterator = iter(loader)
    head = loader_outcomes(iterator, taken)
    state = roundtrip(loader.state_dict())
    rest = loader_outcomes(iterator)
    loader.close()
    assert (head + rest)[3][0] == RAISED and (head + rest)[-1] == END
    again = rst.Loader(build, num_workers=workers, collate_fn=as_is, timeout=timeout)
    again.load_state_dict(state)
    resumed = loader_outcomes(iter(again))
    again.close()
    wait_until(lambda: children() <= before, "the loader's workers to exit after the error")
    assert resumed == rest


# -- a map below a cache -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "where",
    [
        "memory",
        "disk",
        "memory-shuffled",
        "map-after-cache",
    ],
)
def test_an_error_of_a_map_below_a_cache_comes_at_its_record_and_iteration_goes_on(where: str, tmp_path: Path) -> None:
    """docs/cache.md: cold, warm and half-filled caches produce the same stream as no cache."""
    fn = FailAt("ValueError", 7)
    if where == "map-after-cache":
        pipe, plain_pipe = source(40).cache().map(fn), source(40).map(fn)
    elif where == "memory-shuffled":
        pipe, plain_pipe = source(40).map(fn).cache().shuffle(3), source(40).map(fn).shuffle(3)
    else:
        pipe = source(40).map(fn).cache(str(tmp_path) if where == "disk" else None)
        plain_pipe = source(40).map(fn)
    expected = outcomes(plain_pipe)
    assert (RAISED, "ValueError") in expected and expected[-1] == END
    assert outcomes(pipe) == expected


# -- errors in filter, batch, repeat and prefetch: every state around them ----------------------

ERROR_CHAINS: dict[str, Callable[[], Node[Any]]] = {
    "filter": lambda: source().filter(KeepIf("ValueError", 10)),
    "filter-after-pool": lambda: source().map(identity, num_workers=2).filter(KeepIf("ValueError", 10)),
    "filter-then-pool": lambda: source().filter(KeepIf("KeyError", 10)).map(identity, num_workers=2),
    "collate": lambda: source().shuffle(1).batch(3, collate_fn=CollateFailAt("ValueError", 10)),
    "collate-prefetch": lambda: source().batch(3, collate_fn=CollateFailAt("ValueError", 10)).prefetch(1),
    "batch-over-failing-map": lambda: source().map(FailAt("ValueError", 10)).batch(4),
    "batch-over-failing-pool": lambda: source().map(FailAt("ValueError", 10), num_workers=2).batch(4),
    "prefetch-over-failing-map": lambda: source().shuffle(2).map(FailAt("KeyError", 10)).prefetch(2),
    "prefetch-over-failing-pool": lambda: source().map(FailAt("KeyError", 10), num_workers=4).prefetch(4),
    "repeat-over-failing-map": lambda: source(9).shuffle(1).map(FailAt("ValueError", 4)).repeat(3),
    "repeat-over-failing-pool": lambda: source(9).shuffle(1).map(FailAt("ValueError", 4), num_workers=2).repeat(3),
    "repeat-filter-batch": lambda: source(12).shuffle(5).repeat(2).filter(KeepIf("ValueError", 5)).batch(2),
}


@pytest.mark.parametrize("chain", list(ERROR_CHAINS))
def test_every_state_around_an_error_in_a_chain_resumes_exactly(chain: str) -> None:
    build = ERROR_CHAINS[chain]
    with build() as pipe:
        reference = outcomes(pipe, 60)
    errors = [i for i, x in enumerate(reference) if isinstance(x, tuple)]
    assert errors, reference
    first = errors[0]
    check_states_around(build, (first, first + 1, first + 2, errors[-1] + 1, len(reference) - 1), limit=60)


@given(
    n=st.integers(1, 30),
    at=st.integers(0, 29),
    workers=st.sampled_from([0, 1, 2, 4]),
    size=st.integers(1, 5),
    drop_last=st.booleans(),
    j=st.integers(0, 20),
)
def test_errors_anywhere_under_batches_resume_exactly(
    n: int, at: int, workers: int, size: int, drop_last: bool, j: int
) -> None:
    def build() -> Node[Any]:
        return source(n).map(FailAt("ValueError", at), num_workers=workers).batch(size, drop_last=drop_last).repeat(2)

    with build() as whole:
        reference = outcomes(whole, 100)
    pipe = build()
    head = outcomes(pipe, j)
    state = roundtrip(pipe.get_state())
    ended = head[-1:] == [END]  # then iterating on, or a restored pipeline, keeps stopping
    rest = outcomes(pipe, 100)
    pipe.close()
    assert head + ([] if ended else rest) == reference, "get_state() disturbed the iteration"
    resumed = build()
    resumed.set_state(state)
    assert head + ([] if ended else outcomes(resumed, 100)) == reference
    if ended:
        assert rest == outcomes(resumed, 100) == [END]
    resumed.close()


# -- filters that drop everything, or all but the last record -----------------------------------

DROP_ALL: dict[str, Callable[[], Node[Any]]] = {
    "filter": lambda: source().filter(lambda x: x < 0),
    "repeat-1-empty": lambda: rs.from_list([]).repeat(1),
    "repeat-none-empty": lambda: rs.from_list([]).repeat(),
    "repeat-3-empty-pool": lambda: rs.from_list([]).map(identity, num_workers=2).repeat(3),
    "repeat-empty-prefetch": lambda: rs.from_list([]).repeat().prefetch(1),
    "filter-repeat": lambda: source().shuffle(0).filter(lambda x: x < 0).repeat(),
    "filter-repeat-3": lambda: source().filter(lambda x: x < 0).repeat(3),
    "filter-pool-repeat": lambda: source().filter(lambda x: x < 0).map(identity, num_workers=2).repeat(),
    "filter-prefetch-repeat": lambda: source().filter(lambda x: x < 0).repeat().prefetch(2),
    "filter-batch-repeat": lambda: source().filter(lambda x: x < 0).batch(4).repeat(),
    "pool-filter-repeat": lambda: source().map(identity, num_workers=4).filter(lambda x: x < 0).repeat(),
}


@pytest.mark.parametrize("chain", list(DROP_ALL))
def test_a_filter_that_drops_everything_ends_every_epoch_at_once_and_resumes(chain: str) -> None:
    """README: an upstream epoch that yields nothing ends a .repeat() instead of spinning."""
    build = DROP_ALL[chain]
    with build() as pipe:
        assert list(pipe) == []
        state = roundtrip(pipe.get_state())
        assert state["ended"] is True
        assert list(pipe) == []  # the next epoch, as empty
    with build() as again:
        again.set_state(state)
        assert outcomes(again) == [END]
        assert list(again) == []
    with build() as fresh:
        fresh.set_state(roundtrip(build().get_state()))
        assert outcomes(fresh) == [END]


def check_at_every_point(build: Callable[[], Node[Any]], total: int, points: Any = None) -> list[Any]:
    """Exact resume after each of ``points`` items (all of ``0..total`` by default), crossing
    epochs as a training loop does (``tests.resume.take``), and a second restore two items later;
    everything closed."""
    with build() as whole:
        expected = [plain(x) for x in take(whole, total)]
    for k in range(total + 1) if points is None else points:
        pipe = build()
        head = [plain(x) for x in take(pipe, k)]
        state = roundtrip(pipe.get_state())
        pipe.close()
        resumed = build()
        resumed.set_state(state)
        middle = [plain(x) for x in take(resumed, min(2, total - k))]
        second = roundtrip(resumed.get_state())
        resumed.close()
        again = build()
        again.set_state(second)
        rest = [plain(x) for x in take(again, total - k - len(middle))]
        again.close()
        assert head + middle + rest == expected, f"resumed after {k} items"
    return expected


KEEP_LAST: dict[str, Callable[[], Node[Any]]] = {
    "filter": lambda: source(10).filter(lambda x: x == 9),
    "filter-prefetch-1": lambda: source(10).filter(lambda x: x == 9).prefetch(1),
    "filter-pool": lambda: source(10).filter(lambda x: x == 9).map(identity, num_workers=4),
    "pool-filter": lambda: source(10).map(identity, num_workers=2).filter(lambda x: x == 9),
    "filter-batch": lambda: source(10).filter(lambda x: x == 9).batch(2),
    "repeat-filter": lambda: source(10).repeat(3).filter(lambda x: x == 9),
    "filter-repeat-prefetch": lambda: source(10).filter(lambda x: x == 9).repeat(3).prefetch(2),
}


@pytest.mark.parametrize("chain", list(KEEP_LAST))
def test_a_filter_that_keeps_only_the_last_record_resumes_at_every_point(chain: str) -> None:
    expected = check_at_every_point(KEEP_LAST[chain], 3)
    assert [x[0] if isinstance(x, list) else x for x in expected] == [9, 9, 9]


# -- odd sizes: batch, repeat, prefetch, pools larger than the epoch ----------------------------

ODD_SIZES: dict[str, tuple[Callable[[], Node[Any]], int]] = {
    "batch-1": (lambda: source(10).shuffle(1).batch(1), 20),
    "batch-3": (lambda: source(10).shuffle(1).batch(3), 8),
    "batch-3-drop-last": (lambda: source(10).shuffle(1).batch(3, drop_last=True), 6),
    "batch-11": (lambda: source(10).shuffle(1).batch(11), 2),
    "batch-11-drop-last-repeat": (lambda: source(10).shuffle(1).batch(11, drop_last=True).repeat(), 0),
    "batch-3-repeat-2": (lambda: source(10).shuffle(1).repeat(2).batch(3), 7),
    "batch-3-drop-last-prefetch": (lambda: source(10).shuffle(1).batch(3, drop_last=True).prefetch(2), 6),
    "prefetch-1": (lambda: source(7).shuffle(1).prefetch(1), 14),
    "prefetch-huge": (lambda: source(7).shuffle(1).prefetch(10**9), 14),
    "pool-8-over-3": (lambda: source(3).shuffle(1).map(identity, num_workers=8), 6),
    "pool-8-over-1": (lambda: source(1).map(identity, num_workers=8).repeat(4), 4),
    "batched-pool-4-over-3": (lambda: source(3).map(FailAt("ValueError", -1, True), num_workers=4, batched=True), 6),
}


@pytest.mark.parametrize("chain", list(ODD_SIZES))
def test_odd_sizes_resume_at_every_point(chain: str) -> None:
    build, total = ODD_SIZES[chain]
    expected = check_at_every_point(build, total)
    assert len(expected) == total
    if chain.startswith("batch-3-drop-last"):
        assert all(len(batch) == 3 for batch in expected)


def test_a_process_pool_larger_than_the_epoch_resumes_at_its_ends() -> None:
    def build() -> Node[Any]:
        return source(3).shuffle(2).map(FailAt("ValueError", 1), num_workers=4, mode="process").repeat(2)

    reference = check_states_around(build, (0, 3, 5), limit=20)
    assert raised_any(reference).count(RAISED) == 2 and reference[-1] == END


# -- next() after the end, iter() twice ---------------------------------------------------------


@pytest.mark.parametrize("chain", ["serial", "thread", "process", "prefetch", "pool-prefetch"])
def test_after_an_error_at_the_last_record_the_epoch_ends_stays_ended_and_the_next_begins(chain: str) -> None:
    fn = FailAt("ValueError", 5)
    pipe: Node[Any]
    if chain in ("thread", "process"):
        pipe = source(6).map(fn, num_workers=2, mode=chain)
    elif chain == "prefetch":
        pipe = source(6).map(fn).prefetch(2)
    elif chain == "pool-prefetch":
        pipe = source(6).map(fn, num_workers=2).prefetch(2)
    else:
        pipe = source(6).map(fn)
    with pipe:
        epoch = [10 * x for x in range(5)]
        assert raised_any(outcomes(pipe)) == [*epoch, RAISED, END]
        for _ in range(3):
            with pytest.raises(StopIteration):
                next(pipe)
        state = roundtrip(pipe.get_state())
        assert state["ended"] is True
        assert iter(pipe) is pipe and iter(pipe) is pipe
        assert raised_any(outcomes(pipe)) == [*epoch, RAISED, END]


# -- nothing left behind -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "chain",
    ["prefetch", "thread", "process", "thread-base-exception", "prefetch-over-pool", "process-unpicklable"],
)
@pytest.mark.parametrize("how", ["close", "drop"])
def test_no_thread_or_process_outlives_a_pipeline_after_an_error(chain: str, how: str) -> None:
    threads_before = {t.ident for t in reader_threads()}
    processes_before = children()

    def build() -> Node[Any]:
        if chain == "prefetch":
            return source().map(FailAt("ValueError", 5)).prefetch(2)
        if chain == "prefetch-over-pool":
            return source().map(FailAt("ValueError", 5), num_workers=2).prefetch(2)
        if chain == "thread-base-exception":
            return source().map(FailAt("SystemExit", 5), num_workers=2)
        if chain == "process-unpicklable":
            return source().map(FailAt("Unpicklable", 5), num_workers=2, mode="process")
        return source().map(FailAt("ValueError", 5), num_workers=2, mode=chain)

    def run() -> None:
        pipe = build()
        seen = outcomes(pipe, 8)
        assert any(isinstance(x, tuple) for x in seen)
        if how == "close":
            pipe.close()
        # "drop": the pipeline goes out of scope here, its reader running or stopped by the error

    run()
    gc.collect()
    wait_until(lambda: {t.ident for t in reader_threads()} <= threads_before, "the reader threads to stop")
    wait_until(lambda: children() <= processes_before, "the pool's processes to exit")
