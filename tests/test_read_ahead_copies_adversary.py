"""Adversarial checks of read-ahead copies (prefetch, parallel map) in other processes: pickled,
deep-copied or forked after the pipeline was read, at every point of an epoch, nested, inside a
mix, under batch, pack, repeat and even, copies of copies, forks of forks, forks and pickles while
the reader is busy, process pools, streams forked mid-file, and DataLoader workers.

The reference is always the same pipeline built without prefetch and parallel maps: a copy (and
the original after it) yields what that pipeline yields from the same point, and its state with
the read-ahead nodes left out is that pipeline's state. The three bugs it found are mended: a
restored packer that did not pickle, a fork while a prefetch thread read a stream's line, a
forkserver inherited by a forked child.
"""

from __future__ import annotations

import copy
import gzip
import itertools
import json
import multiprocessing
import os
import pickle
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

import resumable as rs
from resumable import Node
from resumable.ops.parallel_map import ParallelMap
from resumable.ops.prefetch import Prefetch
from tests.sources import stream_source

RECORDS = [{"id": i, "input_ids": list(range(i % 5 + 1))} for i in range(20)]
LIMIT = 40  # items taken at most from a pipeline that may not end (a restarting mix)
CHILD_TIMEOUT_S = 60.0  # a hang guard for children that should answer, not a speed check
SETTLE_S = 2.0
READ_AHEAD_KINDS = ("Prefetch", "ParallelMap")


# -- helpers ---------------------------------------------------------------------------------------


def identity(record: Any) -> Any:
    return record


def slow_identity(record: Any) -> Any:
    time.sleep(0.03)
    return record


def double(record: dict[str, Any]) -> dict[str, Any]:
    return {"id": record["id"], "twice": 2 * record["id"]}


def fails_on_five(record: dict[str, Any]) -> dict[str, Any]:
    if record["id"] == 5:
        raise ValueError("record 5")
    return record


def norm(item: Any) -> Any:
    """An item as plain comparable data: a record as its id, a packed row as lists."""
    if isinstance(item, dict) and "id" in item:
        return item["id"]
    if isinstance(item, dict):
        return {key: norm(value) for key, value in item.items()}
    if isinstance(item, np.ndarray):
        return item.tolist()
    if isinstance(item, list):
        return [norm(value) for value in item]
    return item


def take(pipe: Node[Any], count: int = LIMIT) -> list[Any]:
    return [norm(item) for item in itertools.islice(pipe, count)]


def below(state: Any) -> Any:
    """``state`` with every read-ahead node's state replaced by its upstream's, anywhere in it
    (mix components included): the state of the pipeline built without them."""
    if isinstance(state, dict):
        if state.get("kind") in READ_AHEAD_KINDS:
            return below(state["upstream"])
        return {key: below(value) for key, value in state.items()}
    if isinstance(state, list):
        return [below(value) for value in state]
    return state


def settle(pipe: Node[Any]) -> None:
    """Give every prefetch thread of the pipeline time to fill its queue (or reach its end), so
    that the readers are as far ahead as they go; correctness must not depend on it."""
    deadline = time.monotonic() + SETTLE_S
    for node in pipe._subtree():
        producer = node._producer if isinstance(node, Prefetch) else None
        while producer is not None and producer.thread.is_alive() and not producer.queue.full():
            if time.monotonic() > deadline:
                return
            time.sleep(0.002)


def source() -> Node[Any]:
    return rs.from_list(RECORDS).shuffle(seed=3)


# (without readers, with readers): the same pipeline twice.
Builder = Callable[[bool], Node[Any]]


def _nested(read: bool) -> Node[Any]:
    if not read:
        return source()
    return source().prefetch(2).map(identity, num_workers=2).prefetch(3)


def _mix(read: bool) -> Node[Any]:
    a = source().prefetch(3) if read else source()
    b = rs.from_list([{"id": 100 + i} for i in range(7)])
    b = b.prefetch(2).map(identity, num_workers=2) if read else b
    return rs.mix({"a": a, "b": b}, on_end="stop")


def _mix_restart(read: bool) -> Node[Any]:
    a = source().prefetch(3) if read else source()
    b = rs.from_list([{"id": 100 + i} for i in range(7)])
    b = b.prefetch(2) if read else b
    mixed = rs.mix({"a": a, "b": b}, on_end="restart")
    return mixed.prefetch(2) if read else mixed


def _batch(read: bool) -> Node[Any]:
    return source().prefetch(2).batch(3).prefetch(2) if read else source().batch(3)


def _pack(read: bool) -> Node[Any]:
    if not read:
        return source().pack(6, buffer_size=4)
    return source().prefetch(3).pack(6, buffer_size=4).prefetch(2)


def _repeat(read: bool) -> Node[Any]:
    return source().prefetch(2).repeat(3).prefetch(4) if read else source().repeat(3)


def _even(read: bool) -> Node[Any]:
    return source().prefetch(3).even(2).prefetch(2) if read else source().even(2)


def _stream_gzip(read: bool) -> Node[Any]:
    stream = stream_source("jsonl_stream_gzip", RECORDS)
    return stream.prefetch(2).map(identity, num_workers=2).prefetch(2) if read else stream


BUILDERS: dict[str, Builder] = {
    "nested": _nested,
    "mix": _mix,
    "mix_restart": _mix_restart,
    "batch": _batch,
    "pack": _pack,
    "repeat": _repeat,
    "even": _even,
    "stream_gzip": _stream_gzip,
}
# A packer saves its state in another form (a base and events) once a reader sits above it, so
# its states are compared by what they continue with, not entry by entry.
SAME_STATES = [name for name in BUILDERS if name != "pack"]


def epoch_length(name: str) -> int:
    return len(take(BUILDERS[name](False), 25))


# Where in the reading a copy is taken: (epochs read whole before, items of the epoch read then).
def points(name: str) -> dict[str, tuple[int, int]]:
    n = epoch_length(name)
    return {
        "start": (0, 0),
        "first": (0, 1),
        "middle": (0, n // 2),
        "last": (0, n - 1),
        "all": (0, n),  # the last item handed out, StopIteration not yet raised
        "after_end": (1, 0),  # StopIteration raised, next epoch not started
        "next_epoch": (1, n // 2),
    }


POINTS = ("start", "first", "middle", "last", "all", "after_end", "next_epoch")


def advance(pipe: Node[Any], where: tuple[int, int]) -> None:
    epochs, count = where
    for _ in range(epochs):
        take(pipe)
    if epochs and count:
        pipe.next_epoch()
    for _ in range(count):
        next(pipe)


def reference(name: str, where: tuple[int, int]) -> tuple[dict[str, Any], list[Any], dict[str, Any]]:
    """The pipeline without readers at ``where``: its state there, what it yields next (the
    rest of this epoch and the next one), and its state after that."""
    plain = BUILDERS[name](False)
    advance(plain, where)
    state = plain.get_state()
    rest = take(plain) + take(plain)
    return state, rest, plain.get_state()


def continues_as_plain(name: str, state: dict[str, Any]) -> list[Any]:
    """What a pipeline without readers yields (two pieces as ``reference``) from ``state``, the
    state of a pipeline with readers with them left out."""
    plain = BUILDERS[name](False)
    plain.set_state(below(state))
    return take(plain) + take(plain)


def pickled(pipe: Node[Any]) -> Node[Any]:
    return pickle.loads(pickle.dumps(pipe))


COPIES: dict[str, Callable[[Node[Any]], Node[Any]]] = {
    "pickle": pickled,
    "deepcopy": copy.deepcopy,
    "copy_of_a_copy": lambda pipe: pickled(copy.deepcopy(pipe)),
    "twice_in_a_row": lambda pipe: (copy.deepcopy(pipe), copy.deepcopy(pipe))[1],
}


# -- pickled and deep-copied copies ------------------------------------------------------------------


def copy_cases() -> list[tuple[str, str, str]]:
    """Every builder at every point, pickled; the other ways of copying at a few points."""
    cases = []
    for name in BUILDERS:
        ways = list(COPIES)
        cases += [(name, ways[0], point) for point in POINTS]
        cases += [(name, how, point) for how in ways[1:] for point in ("first", "after_end", "next_epoch")]
    return cases


@pytest.mark.parametrize(("name", "how", "point"), copy_cases())
def test_a_copy_and_its_original_continue_as_the_pipeline_without_readers(name: str, how: str, point: str) -> None:
    where = points(name)[point]
    state, expected, end_state = reference(name, where)
    pipe = BUILDERS[name](True)
    try:
        advance(pipe, where)
        settle(pipe)
        before = pipe.get_state()
        if name in SAME_STATES:
            assert below(before) == state
        duplicate = COPIES[how](pipe)
        try:
            assert duplicate.get_state() == before
            assert continues_as_plain(name, duplicate.get_state()) == expected
            assert take(duplicate) + take(duplicate) == expected
            if name in SAME_STATES:
                assert below(duplicate.get_state()) == end_state
        finally:
            duplicate.close()
        assert pipe.get_state() == before  # returned to the last item handed out, not moved
        assert take(pipe) + take(pipe) == expected
    finally:
        pipe.close()


def test_a_pickled_pack_under_a_prefetch_that_read_ahead_continues() -> None:
    pipe = rs.from_list(RECORDS).pack(6, buffer_size=4).prefetch(2)
    plain = rs.from_list(RECORDS).pack(6, buffer_size=4)
    next(plain)
    expected = take(plain)
    try:
        next(pipe)
        duplicate = pickle.loads(pickle.dumps(pipe))
        assert take(duplicate) == expected
    finally:
        pipe.close()


def test_a_copy_taken_while_the_reader_is_inside_a_slow_upstream() -> None:
    """Pickled while each prefetch thread is inside a slow ``map`` (nested: prefetch over a thread
    map over prefetch): the copy waits for nothing it must not, and both continue exactly."""

    def build(read: bool) -> Node[Any]:
        slow = rs.from_list(RECORDS).shuffle(seed=2).map(slow_identity)
        return slow.prefetch(3).map(identity, num_workers=2).prefetch(2) if read else slow

    plain = build(False)
    take(plain, 4)
    expected = take(plain)
    pipe = build(True)
    try:
        take(pipe, 4)
        time.sleep(0.04)  # the inner producer is in the middle of a slow item
        duplicate = pickled(pipe)
        assert take(duplicate) == expected
        assert take(pipe) == expected
    finally:
        pipe.close()


@pytest.mark.parametrize("reader", ["prefetch", "thread_map"])
def test_a_copy_taken_right_after_an_upstream_error_continues_after_it(reader: str) -> None:
    def build(read: bool) -> Node[Any]:
        mapped = rs.from_list(RECORDS).map(fails_on_five)
        if not read:
            return mapped
        return mapped.prefetch(3) if reader == "prefetch" else mapped.map(identity, num_workers=2)

    def through_the_error(pipe: Node[Any]) -> list[Any]:
        got = []
        for _ in range(6):
            try:
                got.append(norm(next(pipe)))
            except (ValueError, rs.MapError):
                got.append("error")
        return got

    plain = build(False)
    assert through_the_error(plain) == [0, 1, 2, 3, 4, "error"]
    expected = take(plain)
    pipe = build(True)
    try:
        assert through_the_error(pipe) == [0, 1, 2, 3, 4, "error"]
        settle(pipe)
        duplicate = pickled(pipe)
        assert take(duplicate) == expected
        assert take(pipe) == expected
    finally:
        pipe.close()


# -- forked copies -------------------------------------------------------------------------------------


def _in_child(target: Callable[..., Any], *args: Any, timeout: float = CHILD_TIMEOUT_S) -> tuple[str, Any]:
    """``target(*args)`` in a forked child: ("ok", its result), ("error", its exception's repr), or
    ("hang", None) when it did not answer within ``timeout`` (the child is then killed)."""
    context = multiprocessing.get_context("fork")
    receiver, sender = context.Pipe(duplex=False)

    def run() -> None:
        try:
            sender.send(("ok", target(*args)))
        except BaseException as error:  # noqa: BLE001 - reported to the parent
            sender.send(("error", f"{type(error).__name__}: {error}"))

    child = context.Process(target=run)
    child.start()
    outcome: tuple[str, Any] = ("hang", None)
    try:
        outcome = receiver.recv() if receiver.poll(timeout) else ("hang", None)
    finally:
        child.join(0.0 if outcome[0] == "hang" else 5.0)
        if child.is_alive():
            child.kill()
            child.join()
    return outcome


def _continue(pipe: Node[Any]) -> tuple[list[Any], Any]:
    return take(pipe) + take(pipe), below(pipe.get_state())


def _state_first(pipe: Node[Any]) -> tuple[Any, list[Any]]:
    state = pipe.get_state()
    return below(state), take(pipe) + take(pipe)


def _restore_then_continue(pipe: Node[Any], state: dict[str, Any], foreign: dict[str, Any]) -> list[Any]:
    got = []
    try:
        pipe.set_state(foreign)
    except rs.StateError:
        got.append("StateError")
    pipe.set_state(state)
    return got + take(pipe) + take(pipe)


def _fork_again(pipe: Node[Any]) -> tuple[Any, tuple[str, Any]]:
    first = norm(next(pipe, None))  # this child's own readers start and run ahead
    settle(pipe)
    return first, _in_child(_continue, pipe)


FORK_CASES = [
    (name, point)
    for name in ("nested", "mix", "pack", "repeat", "stream_gzip", "even")
    for point in ("first", "middle", "all", "next_epoch")
]


@pytest.mark.parametrize(("name", "point"), FORK_CASES)
def test_a_forked_child_reads_restores_and_forks_again_as_the_pipeline_without_readers(name: str, point: str) -> None:
    where = points(name)[point]
    state, expected, end_state = reference(name, where)
    pipe = BUILDERS[name](True)
    foreign = rs.from_list([{"id": 0}]).prefetch(2).get_state()
    try:
        advance(pipe, where)
        settle(pipe)
        before = pipe.get_state()

        outcome, got = _in_child(_continue, pipe)
        assert outcome == "ok", got
        assert got[0] == expected
        if name in SAME_STATES:
            assert got[1] == end_state

        outcome, got = _in_child(_state_first, pipe)  # get_state() before reading anything
        assert outcome == "ok", got
        if name in SAME_STATES:
            assert got[0] == state
        assert got[1] == expected

        outcome, got = _in_child(_restore_then_continue, pipe, before, foreign)
        assert outcome == "ok", got
        assert got == ["StateError", *expected]

        after_one = BUILDERS[name](False)
        advance(after_one, where)
        first = norm(next(after_one, None))
        outcome, got = _in_child(_fork_again, pipe)
        assert outcome == "ok", got
        assert got[0] == first
        grandchild_outcome, grandchild = got[1]
        assert grandchild_outcome == "ok", grandchild
        assert grandchild[0] == take(after_one) + take(after_one)

        assert pipe.get_state() == before  # the parent's readers went on undisturbed
        assert take(pipe) + take(pipe) == expected
    finally:
        pipe.close()


def test_a_fork_while_the_prefetch_thread_holds_its_lock_inside_a_slow_upstream() -> None:
    def build(read: bool) -> Node[Any]:
        slow = rs.from_list(RECORDS).shuffle(seed=2).map(slow_identity)
        return slow.prefetch(2) if read else slow

    plain = build(False)
    take(plain, 3)
    expected = take(plain)
    pipe = build(True)
    try:
        take(pipe, 3)
        deadline = time.monotonic() + CHILD_TIMEOUT_S
        while not pipe._lock.locked():  # the producer is inside next(upstream), holding its lock
            assert time.monotonic() < deadline
            time.sleep(0.001)
        time.sleep(0.005)
        outcome, got = _in_child(_read_some, pipe, LIMIT)
        assert (outcome, got) == ("ok", expected)
        assert take(pipe) == expected
    finally:
        pipe.close()


def _read_some(pipe: Node[Any], count: int) -> list[Any]:
    return take(pipe, count)


@pytest.mark.parametrize("reader", ["none", "prefetch"])
def test_a_gzip_stream_forked_mid_file_shares_no_offset_with_its_parent(reader: str) -> None:
    """The child reads a few lines and exits, and then reads to the end; the parent, whose open
    gzip file the child inherited, continues exactly after it, and so does each child."""

    def build(read: bool) -> Node[Any]:
        stream = stream_source("jsonl_stream_gzip", RECORDS, files=2)
        return stream.prefetch(3) if read else stream

    plain = build(False)
    take(plain, 5)
    expected = take(plain)
    pipe = build(reader != "none")
    try:
        take(pipe, 5)
        settle(pipe)
        outcome, got = _in_child(_read_some, pipe, 3)
        assert (outcome, got) == ("ok", expected[:3])
        outcome, got = _in_child(_continue, pipe)
        assert outcome == "ok", got
        assert got[0][: len(expected)] == expected
        assert take(pipe, 2) == expected[:2]
        outcome, got = _in_child(_read_some, pipe, 4)  # forked again, further on
        assert (outcome, got) == ("ok", expected[2:6])
        assert take(pipe) == expected[2:]
    finally:
        pipe.close()


def _big_lines_file(directory: Path, gzipped: bool) -> str:
    """A JSONL file with two small lines, three lines of 4 MB, one small line: a thread reading one
    of the big ones holds its file object's buffer lock for a while."""
    path = directory / ("big.jsonl.gz" if gzipped else "big.jsonl")
    lines = ['{"id": 0}\n', '{"id": 1}\n']
    lines += [json.dumps({"id": i, "text": os.urandom(2_000_000).hex()}) + "\n" for i in (2, 3, 4)]
    lines.append('{"id": 5}\n')
    with gzip.open(path, "wt", compresslevel=1) if gzipped else open(path, "w") as out:
        out.writelines(lines)
    return str(path)


def _ids_to_the_end(pipe: Node[Any]) -> list[int]:
    return [record["id"] for record in pipe]


@pytest.mark.parametrize("gzipped", [True, False], ids=["gzip", "plain"])
def test_a_fork_while_the_prefetch_thread_reads_a_stream_line(tmp_path: Path, gzipped: bool) -> None:
    path = _big_lines_file(tmp_path, gzipped)
    for _ in range(2):  # the thread is inside a big line almost always; twice, to be sure
        pipe = rs.jsonl_stream([path]).prefetch(1)
        try:
            assert next(pipe)["id"] == 0
            time.sleep(0.005)  # item 1 is queued; the thread reads the first big line
            outcome, got = _in_child(_ids_to_the_end, pipe)  # the hang shown never ends: a long guard finds it
            assert outcome != "hang", "the forked child hung"
            assert (outcome, got) == ("ok", [1, 2, 3, 4, 5])
            assert _ids_to_the_end(pipe) == [1, 2, 3, 4, 5]
        finally:
            pipe.close()


# -- process pools ----------------------------------------------------------------------------------------


def test_a_process_map_pickled_after_use_leaves_the_pool_to_the_original() -> None:
    def build(read: bool) -> Node[Any]:
        shuffled = rs.from_list(RECORDS).shuffle(seed=1)
        return shuffled.map(double, num_workers=2, mode="process") if read else shuffled.map(double)

    plain = build(False)
    take(plain, 5)
    expected = take(plain)
    pipe = build(True)
    assert isinstance(pipe, ParallelMap)
    try:
        take(pipe, 5)
        pool = pipe._pool
        assert pool is not None
        duplicate = pickled(pipe)
        assert duplicate._pool is None and pipe._pool is pool  # not shut down, not shared
        assert take(pipe) == expected  # the original's pool still works
        assert pipe._pool is pool
        try:
            assert take(duplicate) == expected  # the copy starts a pool of its own
            assert duplicate._pool is not None and duplicate._pool is not pool
        finally:
            duplicate.close()
    finally:
        pipe.close()


def test_a_process_map_forked_after_use_continues_in_the_child() -> None:
    plain = rs.from_list(RECORDS).map(double)
    take(plain, 5)
    expected = take(plain)
    pipe = rs.from_list(RECORDS).map(double, num_workers=2, mode="process")
    try:
        take(pipe, 5)
        outcome, got = _in_child(_continue, pipe)
        assert take(pipe) == expected  # the parent's pool is untouched
        assert outcome == "ok", got
        assert got[0][: len(expected)] == expected
    finally:
        pipe.close()


# -- DataLoader workers ----------------------------------------------------------------------------------


LOADER_RECORDS = [{"id": i} for i in range(24)]


def _loader_stream(read: bool) -> Node[Any]:
    stream = stream_source("jsonl_stream_gzip", LOADER_RECORDS, files=4)
    return (stream.prefetch(3) if read else stream).batch(2)


def _loader_nested(read: bool) -> Node[Any]:
    sharded = rs.from_list(LOADER_RECORDS).shuffle(seed=3).shard()
    return (sharded.prefetch(2).map(identity, num_workers=2).prefetch(3) if read else sharded).batch(2)


def _loader_mix(read: bool) -> Node[Any]:
    a = rs.from_list(LOADER_RECORDS[:12]).shuffle(seed=3).shard()
    b = rs.from_list(LOADER_RECORDS[12:]).shard()
    if read:
        a, b = a.prefetch(2), b.map(identity, num_workers=2)
    return rs.mix({"a": a, "b": b}, on_end="stop").batch(2)


def _loader_repeat(read: bool) -> Node[Any]:
    repeated = rs.from_list(LOADER_RECORDS).shuffle(seed=3).shard().repeat(2)
    return (repeated.prefetch(3) if read else repeated).batch(2)


LOADER_BUILDERS: dict[str, Builder] = {
    "stream_gzip": _loader_stream,
    "nested": _loader_nested,
    "mix": _loader_mix,
    "repeat": _loader_repeat,
}


def _epoch(loader: rs.torch.Loader) -> list[list[int]]:
    return [[record["id"] for record in batch] for batch in loader]


@pytest.mark.parametrize(
    ("name", "context", "persistent"),
    [
        ("stream_gzip", "fork", True),
        ("nested", "fork", True),
        ("mix", "fork", True),
        ("repeat", "fork", False),
        ("stream_gzip", "spawn", True),
    ],
)
def test_a_pipeline_read_first_then_handed_to_loader_workers(name: str, context: str, persistent: bool) -> None:
    """Read in the main process (its readers far ahead), then iterated by a Loader's workers for
    two epochs, with a state taken midway that resumes a fresh Loader exactly."""

    def make(pipe: Node[Any], how: str = context) -> rs.torch.Loader:
        return rs.torch.Loader(pipe, num_workers=2, multiprocessing_context=how, persistent_workers=persistent)

    reference_loader = make(LOADER_BUILDERS[name](False), "fork")
    try:
        expected = [_epoch(reference_loader), _epoch(reference_loader)]
    finally:
        reference_loader.close()
    pipe = LOADER_BUILDERS[name](True)
    next(pipe)
    next(pipe)
    settle(pipe)
    loader = make(pipe)
    try:
        batches = iter(loader)
        first = [[record["id"] for record in next(batches)] for _ in range(3)]
        state = loader.state_dict()
        first += [[record["id"] for record in batch] for batch in batches]
        second = _epoch(loader)
    finally:
        loader.close()
        pipe.close()
    assert [first, second] == expected
    assert sorted(i for batch in first for i in batch) == sorted(i for batch in expected[0] for i in batch)
    resumed = make(LOADER_BUILDERS[name](True), "fork")
    try:
        resumed.load_state_dict(state)
        assert _epoch(resumed) == expected[0][3:]
        assert _epoch(resumed) == expected[1]
    finally:
        resumed.close()
