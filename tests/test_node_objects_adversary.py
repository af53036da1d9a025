"""Pipelines handled the way Python users handle objects.

A pipeline pickled (fresh, in the middle of an epoch, after its end, with a prefetch thread, a
thread pool or a process pool running, a packer or a mix inside, restored but not yet read) and
unpickled in a fresh interpreter; ``copy.copy`` and ``copy.deepcopy`` in the middle of an epoch;
one node object under several pipelines (read by position from several threads, reused after the
pipeline that read it was closed, shared by mix components); ``iter()`` twice without finishing;
``close()`` twice, ``get_state()`` after it, iterating on, ``with`` blocks reused (one
pipeline read from two threads at once is a documented limit, README "Threads and pools");
``set_state`` with the state of an equal pipeline built with other
parameters while its reader runs; a pipeline dropped with its thread or pool running.

What must hold: exactness (the copy, the unpickled pipeline and the original each continue as
the pipeline would have), or a typed ``rs.ResumableError`` naming the node that leaves the
pipeline as it was; never a crash, a hang, a silent wrong record or a bare Python exception.
"""

from __future__ import annotations

import copy
import gc
import json
import os
import pickle
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from concurrent import futures
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

import resumable as rs
from resumable import Node
from resumable.ops.prefetch import Prefetch
from tests.resume import plain
from tests.sources import INDEXED_KINDS, _file, indexed_source, stream_source

REPO = Path(__file__).resolve().parent.parent
RECORDS = [{"id": i, "text": "x" * (i % 5)} for i in range(24)]
CHILD_LIMIT_S = 120.0  # only a hang guard: each child runs in about a second


def identity(record: dict[str, Any]) -> dict[str, Any]:
    return record


def keep(record: dict[str, Any]) -> bool:
    return bool(record["id"] % 3)


def tokens(record: dict[str, Any]) -> dict[str, Any]:
    return {"input_ids": np.arange(100 * record["id"], 100 * record["id"] + record["id"] % 6 + 1, dtype=np.int32)}


def source(kind: str, records: list[dict[str, Any]] = RECORDS) -> Node[Any]:
    if kind.startswith("jsonl_stream"):
        return stream_source(kind, records)
    return indexed_source(kind, records)


def loops(pipe: Node[Any], count: int = 2) -> list[list[Any]]:
    """``count`` for-loops over ``pipe`` (the rest of its epoch, then whole epochs), as plain data."""
    return [[plain(item) for item in pipe] for _ in range(count)]


def wait_for_readers(pipe: Node[Any]) -> None:
    """Let every prefetch thread of ``pipe`` fill its queue (or reach its epoch's end), so that a
    copy is taken while the reader is as far ahead as it goes."""
    for node in pipe._subtree():
        producer = getattr(node, "_producer", None) if isinstance(node, Prefetch) else None
        deadline = time.monotonic() + CHILD_LIMIT_S
        while producer is not None and producer.thread.is_alive() and not producer.queue.full():
            assert time.monotonic() < deadline, "the prefetch thread never filled its queue"
            time.sleep(0.005)


def advanced(build: Callable[[], Node[Any]], count: int) -> Node[Any]:
    """``build()`` after ``count`` items (``count`` < 0: after its whole epoch and its
    StopIteration), its readers as far ahead as they go."""
    pipe = build()
    if count < 0:
        list(pipe)
        assert next(pipe, "ended") == "ended"
    else:
        for _ in range(count):
            next(pipe)
    wait_for_readers(pipe)
    return pipe


# -- pickled into a fresh interpreter ----------------------------------------------------------


def _restored_thread_map() -> Node[Any]:
    """A thread map restored to its state after 3 items, not read since."""
    first = _PICKLED["thread_map"][0]()
    for _ in range(3):
        next(first)
    state = json.loads(json.dumps(first.get_state()))
    first.close()
    pipe = _PICKLED["thread_map"][0]()
    pipe.set_state(state)
    return pipe


_PICKLED: dict[str, tuple[Callable[[], Node[Any]], int]] = {
    "fresh": (lambda: source("jsonl").shuffle(3).batch(4), 0),
    "middle": (lambda: source("parquet").shuffle(3).filter(keep).batch(3), 2),
    "ended": (lambda: source("arrow").shuffle(3).batch(5), -1),
    "prefetch": (lambda: source("jsonl_stream_gzip").map(identity).batch(2).prefetch(3), 3),
    "thread_map": (lambda: source("list").shuffle(3).map(identity, num_workers=2).batch(2), 3),
    "process_map": (lambda: source("jsonl").shuffle(3).map(identity, num_workers=2, mode="process").batch(2), 3),
    "pack": (
        lambda: source("parquet").shuffle(1).map(tokens).pack(8, strategy="best_fit", buffer_size=4).prefetch(2),
        3,
    ),
    "mix": (
        lambda: (
            rs.mix(
                {"a": source("arrow_stream").shuffle(1), "b": source("jsonl_stream").map(identity, num_workers=2)},
                seed=2,
                on_end="drop",
            )
            .batch(3)
            .prefetch(2)
        ),
        2,
    ),
    "restored": (_restored_thread_map, 0),
}

_CHILD = """
import json, pickle, sys
from tests.resume import plain
with open(sys.argv[1], "rb") as blob:
    pipes = pickle.load(blob)
found = {}
for name, pipe in pipes.items():
    state = pipe.get_state()
    found[name] = [state, [[plain(item) for item in pipe] for _ in range(2)]]
    pipe.close()
print(json.dumps(found))
"""


def test_pipelines_pickled_in_every_condition_continue_exactly_in_a_fresh_interpreter(tmp_path: Path) -> None:
    """One fresh interpreter unpickles them all: each starts with the state the original had
    when pickled and yields what the original yields after it (the rest of the epoch, then the
    next), which is also what a pipeline restored from that state yields."""
    pipes = {name: advanced(build, count) for name, (build, count) in _PICKLED.items()}
    try:
        states = {name: json.loads(json.dumps(pipe.get_state())) for name, pipe in pipes.items()}
        (tmp_path / "pipes.pickle").write_bytes(pickle.dumps(pipes))
        child = subprocess.run(
            [sys.executable, "-c", _CHILD, str(tmp_path / "pipes.pickle")],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=CHILD_LIMIT_S,
        )
        assert child.returncode == 0, child.stderr[-3000:]
        found = json.loads(child.stdout)
        for name, pipe in pipes.items():
            expected = json.loads(json.dumps(loops(pipe)))
            with _PICKLED[name][0]() as restored:
                restored.set_state(states[name])
                assert json.loads(json.dumps(loops(restored))) == expected, name
            assert found[name][0] == states[name], name
            assert found[name][1] == expected, name
    finally:
        for pipe in pipes.values():
            pipe.close()


# -- copies in this process -------------------------------------------------------------------

_COPIED: dict[str, Callable[[], Node[Any]]] = {
    "batch": lambda: source("jsonl").shuffle(3).batch(2),
    "filter": lambda: source("parquet").shuffle(3).filter(keep),
    "pack": lambda: source("arrow").shuffle(1).map(tokens).pack(8, strategy="best_fit", buffer_size=4),
    "mix": lambda: rs.mix({"a": source("list").shuffle(1), "b": source("jsonl")}, seed=2, on_end="drop"),
    "stream": lambda: source("jsonl_stream_gzip"),
    "prefetch": lambda: source("jsonl").shuffle(3).batch(2).prefetch(2),
    "thread_map": lambda: source("parquet").shuffle(3).map(identity, num_workers=2),
}
_INDEXED_COPIED: dict[str, Callable[[str], Node[Any]]] = {
    "source": lambda kind: source(kind),
    "shuffle": lambda kind: source(kind).shuffle(3),
    "shard": lambda kind: source(kind).shuffle(3).shard(1, 3),
    "map": lambda kind: source(kind).shuffle(3).map(identity),
    "indexed_filter": lambda kind: source(kind).filter(keep, index=True, progress=False).shuffle(2),
}


def side_by_side(first: Node[Any], second: Node[Any]) -> tuple[list[Any], list[Any]]:
    """The rest of both epochs, read alternately, one item of each at a time."""
    got: tuple[list[Any], list[Any]] = ([], [])
    running = [True, True]
    while any(running):
        for index, pipe in enumerate((first, second)):
            if running[index]:
                item = next(pipe, StopIteration)
                if item is StopIteration:
                    running[index] = False
                else:
                    got[index].append(plain(item))
    return got


def check_copy_continues(build: Callable[[], Node[Any]], make_copy: Callable[[Node[Any]], Node[Any]]) -> None:
    with build() as whole:
        expected = [plain(item) for item in whole]
    for count in (0, 3, len(expected) - 1):
        pipe = advanced(build, count)
        try:
            try:
                copied = make_copy(pipe)
            except rs.ResumableError:
                continue  # refused, typed: acceptable
            with copied:
                got_original, got_copy = side_by_side(pipe, copied)
        finally:
            pipe.close()
        assert expected[:count] + got_copy == expected, ("copy", count)
        assert expected[:count] + got_original == expected, ("original", count)


@pytest.mark.parametrize("name", sorted(_COPIED))
def test_a_deep_copy_in_mid_epoch_and_its_original_each_continue_exactly(name: str) -> None:
    check_copy_continues(_COPIED[name], copy.deepcopy)


@pytest.mark.parametrize("kind", INDEXED_KINDS)
@pytest.mark.parametrize("name", sorted(_INDEXED_COPIED))
def test_a_shallow_copy_of_an_indexed_pipeline_reads_on_by_itself(name: str, kind: str) -> None:
    check_copy_continues(lambda: _INDEXED_COPIED[name](kind), copy.copy)


@pytest.mark.parametrize("name", sorted(_COPIED))
def test_a_shallow_copy_in_mid_epoch_and_its_original_each_continue_exactly(name: str) -> None:
    check_copy_continues(_COPIED[name], copy.copy)


# -- one node object under several pipelines --------------------------------------------------


@pytest.mark.parametrize("kind", INDEXED_KINDS)
def test_one_source_read_by_position_under_three_running_readers_gives_each_its_epoch(kind: str) -> None:
    """A source below three shuffles or maps, each read ahead by its own thread or pool at the
    same time: nodes read by position may be shared (docs/state.md), threads included."""
    records = [{"id": i, "text": "y" * (i % 11)} for i in range(600)]
    alone = [
        [r["id"] for r in source(kind, records).shuffle(1)],
        [r["id"] for r in source(kind, records).shuffle(2)],
        [r["id"] for r in source(kind, records)],
    ]
    shared = source(kind, records)
    pipes = [shared.shuffle(1).prefetch(2), shared.shuffle(2).map(identity, num_workers=2).prefetch(3)]
    pipes.append(shared.map(identity).prefetch(1))
    got: list[list[int]] = [[], [], []]
    try:
        running = [True, True, True]
        while any(running):
            for index, pipe in enumerate(pipes):
                item = next(pipe, None) if running[index] else None
                if item is None:
                    running[index] = False
                else:
                    got[index].append(item["id"])
    finally:
        for pipe in pipes:
            pipe.close()
    assert got == alone


@pytest.mark.parametrize("kind", ["list", "jsonl", "jsonl_stream"])
@pytest.mark.parametrize("reader", ["prefetch", "thread_map"])
def test_a_node_reused_after_its_reading_pipeline_was_closed_continues_after_the_last_item_handed_out(
    kind: str, reader: str
) -> None:
    """The reader had read ahead; closing it returned the node it read to the last item handed
    out, so a second pipeline built on that node continues there, and resumes exactly."""

    def shared_node() -> Node[Any]:
        return source(kind) if kind == "jsonl_stream" else source(kind).shuffle(5)

    def second(node: Node[Any]) -> Node[Any]:
        return node.batch(2)

    alone = [plain(item) for item in shared_node()]
    node = shared_node()
    first = node.prefetch(3) if reader == "prefetch" else node.map(identity, num_workers=2)
    head = [plain(next(first)) for _ in range(5)]
    wait_for_readers(first)
    first.close()
    assert head == alone[:5]
    with second(node) as pipe:
        batches = [plain(next(pipe)) for _ in range(3)]
        state = json.loads(json.dumps(pipe.get_state()))
        rest = [plain(batch) for batch in pipe]
    assert sum(batches + rest, []) == alone[5:]
    with second(shared_node()) as again:
        again.set_state(state)
        assert [plain(batch) for batch in again] == rest


@pytest.mark.parametrize(
    "components",
    [
        lambda t: {"a": t.prefetch(2), "b": t.map(identity, num_workers=2)},
        lambda t: {"a": t, "b": t.prefetch(2)},
        lambda t: {"a": rs.mix({"x": t.batch(2)}, seed=1), "b": t.filter(keep)},
    ],
    ids=["prefetch_and_thread_map", "node_and_its_prefetch", "nested_mix"],
)
def test_mix_components_sharing_a_node_read_item_by_item_through_readers_are_refused(
    components: Callable[[Node[Any]], dict[str, Node[Any]]],
) -> None:
    with pytest.raises(rs.ConfigError, match=r"Mix\[b\]: its Shuffle is also read by component 'a'"):
        rs.mix(components(source("jsonl").shuffle(1)), on_end="drop")


def test_mix_components_sharing_a_node_read_by_position_under_readers_each_read_it_whole() -> None:
    def build() -> Node[Any]:
        shared = source("jsonl")
        return rs.mix(
            {"a": shared.shuffle(1).prefetch(2), "b": shared.shuffle(2).map(tokens, num_workers=2)},
            seed=0,
            on_end="drop",
        )

    with build() as mixed:
        items = [plain(item) for item in mixed]
    assert sorted(item["id"] for item in items if "id" in item) == list(range(len(RECORDS)))
    assert len([item for item in items if "input_ids" in item]) == len(RECORDS)
    with build() as pipe:
        head = [plain(next(pipe)) for _ in range(9)]
        state = json.loads(json.dumps(pipe.get_state()))
    with build() as again:
        again.set_state(state)
        assert head + [plain(item) for item in again] == items


# -- iter(), close() ----------------------------------------------------------------------------

_READERS: dict[str, Callable[[], Node[Any]]] = {
    "prefetch": lambda: source("jsonl").shuffle(3).batch(2).prefetch(2),
    "thread_map": lambda: source("parquet").shuffle(3).map(identity, num_workers=2).batch(2),
    "mix_of_readers": lambda: rs.mix(
        {"a": source("arrow").shuffle(1).prefetch(2), "b": source("jsonl_stream").map(identity, num_workers=2)},
        seed=1,
        on_end="drop",
    ),
    "pack_over_thread_map": lambda: (
        source("jsonl").shuffle(1).map(tokens, num_workers=2).pack(8, strategy="best_fit", buffer_size=4).prefetch(2)
    ),
}


@pytest.mark.parametrize("name", sorted(_READERS))
def test_iter_twice_without_finishing_is_one_iterator_that_neither_restarts_nor_skips(name: str) -> None:
    with _READERS[name]() as whole:
        expected = loops(whole)
    with _READERS[name]() as pipe:
        first = iter(pipe)
        got = [plain(next(first)) for _ in range(2)]
        wait_for_readers(pipe)
        second = iter(pipe)
        assert second is first is pipe
        got += [plain(next(second)) for _ in range(2)]
        got += [plain(item) for item in iter(pipe)]  # a third, finishing the epoch
        assert got == expected[0]
        assert loops(pipe, 1) == expected[1:]


@pytest.mark.parametrize("name", sorted(_READERS))
def test_close_twice_get_state_after_close_and_iterating_on_in_reused_with_blocks(name: str) -> None:
    with _READERS[name]() as whole:
        expected = loops(whole)
    pipe = _READERS[name]()
    pipe.close()  # never iterated: nothing to stop
    with pipe:
        got = [plain(next(pipe)) for _ in range(3)]
        wait_for_readers(pipe)
    state = pipe.get_state()
    pipe.close()
    assert pipe.get_state() == state
    with pipe:  # a second block continues after the last item handed out
        got += [plain(next(pipe)) for _ in range(2)]
    with _READERS[name]() as again:
        again.set_state(json.loads(json.dumps(state)))
        assert got[:3] + [plain(next(again)) for _ in range(2)] == got
    got += [plain(item) for item in pipe]
    assert pipe.ended
    pipe.close()
    pipe.close()
    assert got == expected[0]
    assert loops(pipe, 1) == expected[1:]  # closed at the epoch's end: the next for-loop is the next epoch
    pipe.close()
    pipe.set_state(json.loads(json.dumps(state)))  # restored after close(): its readers start again
    assert [plain(item) for item in pipe] == expected[0][3:]
    pipe.close()


@pytest.mark.parametrize(
    "build",
    [
        lambda: source("jsonl").shuffle(1).map(lambda r: r).batch(2).prefetch(2),
        lambda: source("parquet").shuffle(1).map(lambda r: r, num_workers=2).batch(2),
        lambda: source("jsonl_stream").batch(2, collate_fn=lambda items: items).prefetch(2),
    ],
    ids=["prefetch", "thread_map", "collate_under_prefetch"],
)
def test_a_pickle_that_fails_on_a_lambda_leaves_the_original_continuing_exactly(
    build: Callable[[], Node[Any]],
) -> None:
    """Pickling stops the readers first (as close() does); when it then fails on a function
    that cannot pickle, the original still continues after the last item handed out."""
    with build() as whole:
        expected = [plain(item) for item in whole]
    with build() as pipe:
        head = [plain(next(pipe)) for _ in range(3)]
        wait_for_readers(pipe)
        with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
            pickle.dumps(pipe)
        state = json.loads(json.dumps(pipe.get_state()))
        assert head + [plain(item) for item in pipe] == expected
    with build() as again:
        again.set_state(state)
        assert head + [plain(item) for item in again] == expected


# -- set_state with the state of an equal pipeline built with other parameters ------------------

_JSONL_A = _file("jsonl", RECORDS[:12])
_JSONL_B = _file("jsonl", RECORDS[12:])
_PARQUET_A = _file("parquet", RECORDS[:12])
_PARQUET_B = _file("parquet", RECORDS[12:])


def _packed(seq_len: int = 8, strategy: str = "best_fit", buffer_size: int = 4) -> Node[Any]:
    return (
        rs.jsonl([_JSONL_A, _JSONL_B])
        .map(tokens, num_workers=2)
        .pack(seq_len, strategy=strategy, buffer_size=buffer_size)
        .prefetch(2)
    )


def _mixed(seed: int = 1, schedule: str = "smooth", swap: bool = False) -> Node[Any]:
    a, b = (_JSONL_B, _JSONL_A) if swap else (_JSONL_A, _JSONL_B)
    return rs.mix({"a": rs.jsonl(a).prefetch(2), "b": rs.jsonl(b)}, seed=seed, schedule=schedule).batch(2)


_OTHER_PARAMETERS: dict[str, tuple[Callable[[], Node[Any]], Callable[[], Node[Any]], str]] = {
    "jsonl files order": (
        lambda: rs.jsonl([_JSONL_A, _JSONL_B]).shuffle(1).batch(2).prefetch(2),
        lambda: rs.jsonl([_JSONL_B, _JSONL_A]).shuffle(1).batch(2).prefetch(2),
        r"Prefetch > Batch > Shuffle > JsonlSource: state was saved over file .*0\.jsonl",
    ),
    "parquet files order": (
        lambda: rs.parquet([_PARQUET_A, _PARQUET_B]).shuffle(1).map(identity, num_workers=2),
        lambda: rs.parquet([_PARQUET_B, _PARQUET_A]).shuffle(1).map(identity, num_workers=2),
        r"ParallelMap > Shuffle > ParquetSource: state was saved over file",
    ),
    "stream files order": (
        lambda: rs.jsonl_stream([_JSONL_A, _JSONL_B]).batch(2).prefetch(2),
        lambda: rs.jsonl_stream([_JSONL_B, _JSONL_A]).batch(2).prefetch(2),
        r"Prefetch > Batch > JsonlStream: state was saved over file",
    ),
    "stream shuffle_files": (
        lambda: rs.jsonl_stream([_JSONL_A, _JSONL_B], shuffle_files=1).map(identity, num_workers=2),
        lambda: rs.jsonl_stream([_JSONL_A, _JSONL_B], shuffle_files=2).map(identity, num_workers=2),
        r"ParallelMap > JsonlStream: state was saved with shuffle_files=1, this pipeline has shuffle_files=2",
    ),
    "seed under a thread map": (
        lambda: rs.jsonl([_JSONL_A, _JSONL_B]).shuffle(1).map(identity, num_workers=2).batch(2),
        lambda: rs.jsonl([_JSONL_A, _JSONL_B]).shuffle(2).map(identity, num_workers=2).batch(2),
        r"Batch > ParallelMap > Shuffle: state was saved with seed=1, this pipeline has seed=2",
    ),
    "batch size under a prefetch": (
        lambda: rs.parquet(_PARQUET_A).shuffle(1).batch(2).prefetch(2),
        lambda: rs.parquet(_PARQUET_A).shuffle(1).batch(3).prefetch(2),
        r"Prefetch > Batch: state was saved with batch_size=2, this pipeline has batch_size=3",
    ),
    "block size": (
        lambda: rs.jsonl([_JSONL_A, _JSONL_B]).shuffle(1, block_size=4).batch(2).prefetch(2),
        lambda: rs.jsonl([_JSONL_A, _JSONL_B]).shuffle(1, block_size=5).batch(2).prefetch(2),
        r"Prefetch > Batch > BlockShuffle: state was saved with block_size=4, this pipeline has block_size=5",
    ),
    "pack seq_len": (_packed, lambda: _packed(seq_len=9), r"Prefetch > Pack: state was saved with seq_len=8"),
    "pack strategy": (
        _packed,
        lambda: _packed(strategy="first_fit"),
        r"Prefetch > Pack: state was saved with strategy='best_fit', this pipeline has strategy='first_fit'",
    ),
    "pack buffer_size": (
        _packed,
        lambda: _packed(buffer_size=5),
        r"Prefetch > Pack: state was saved with buffer_size=4, this pipeline has buffer_size=5",
    ),
    "mix seed": (_mixed, lambda: _mixed(seed=2), r"Batch > Mix: state was saved with seed=1, this pipeline has seed=2"),
    "mix schedule": (_mixed, lambda: _mixed(schedule="random"), r"Batch > Mix: state was saved with schedule="),
    "mix components swapped": (
        _mixed,
        lambda: _mixed(swap=True),
        r"Batch > Mix\[a\] > Prefetch > JsonlSource: state was saved over file",
    ),
    "on_error": (
        lambda: rs.jsonl([_JSONL_A, _JSONL_B], on_error="skip").batch(2).prefetch(2),
        lambda: rs.jsonl([_JSONL_A, _JSONL_B]).batch(2).prefetch(2),
        r"Prefetch > Batch > JsonlSource: state was saved with on_error='skip', this pipeline has on_error='raise'",
    ),
}


@pytest.mark.parametrize("case", sorted(_OTHER_PARAMETERS))
def test_a_state_of_the_pipeline_built_with_other_parameters_is_refused_while_its_reader_runs(case: str) -> None:
    saved_by, build, message = _OTHER_PARAMETERS[case]
    with saved_by() as other:
        for _ in range(3):
            next(other)
        state = json.loads(json.dumps(other.get_state()))
    with build() as whole:
        expected = [plain(item) for item in whole]
    with build() as pipe:
        head = [plain(next(pipe)) for _ in range(2)]
        wait_for_readers(pipe)
        before = pipe.get_state()
        with pytest.raises(rs.StateError, match=message):
            pipe.set_state(state)
        assert pipe.get_state() == before
        assert head + [plain(item) for item in pipe] == expected


# -- dropped with the reader running ---------------------------------------------------------


def _reader_threads() -> set[threading.Thread]:
    return {thread for thread in threading.enumerate() if thread is not threading.current_thread()}


def test_a_dropped_pipeline_and_its_copies_in_mid_epoch_leave_no_thread() -> None:
    """A prefetch over a thread map, its deep copy and its pickled copy, all read in the middle
    of an epoch and dropped: every thread they started ends once the collector has run."""
    before = _reader_threads()
    pipes = [source("jsonl").shuffle(1).map(identity, num_workers=2).batch(2).prefetch(2)]
    for _ in range(3):
        next(pipes[0])
    pipes += [copy.deepcopy(pipes[0]), pickle.loads(pickle.dumps(pipes[0]))]
    for pipe in pipes:
        next(pipe)
        wait_for_readers(pipe)
    assert len(_reader_threads() - before) >= 3
    refs = [weakref.ref(pipe) for pipe in pipes]
    del pipe, pipes
    gc.collect()
    assert [ref() for ref in refs] == [None, None, None]
    deadline = time.monotonic() + CHILD_LIMIT_S
    while _reader_threads() - before:
        assert time.monotonic() < deadline, f"threads left: {_reader_threads() - before}"
        time.sleep(0.01)


class Trainer:
    """What a training script often is: an object that owns its pipeline, built with its own
    method as the map's function (a reference cycle through the pipeline)."""

    def __init__(self, reader: str) -> None:
        records = rs.from_list(list(range(200)))
        if reader == "prefetch":
            self.pipe: Node[Any] = records.map(self.step).batch(2).prefetch(2)
        elif reader == "thread_map":
            self.pipe = records.map(self.step, num_workers=2).batch(2)
        else:
            self.pipe = records.map(self.step, num_workers=1, mode="process").batch(2)

    def step(self, value: int) -> int:
        return value + 1

    def __getstate__(self) -> dict[str, Any]:
        return {}  # what a process pool's worker needs of it: nothing


@pytest.mark.parametrize(
    "reader",
    ["prefetch", "thread_map", "process_map"],
)
def test_a_dropped_owner_whose_method_maps_the_pipeline_stops_its_reader(reader: str) -> None:
    trainer = Trainer(reader)
    assert next(trainer.pipe) == [1, 2]
    wait_for_readers(trainer.pipe)
    for node in trainer.pipe._subtree():  # a task running in a pool holds the function until it returns
        futures.wait([chunk.future for _, chunk, *_ in getattr(node, "_window", ()) if getattr(chunk, "future", None)])
    owner = weakref.ref(trainer)
    del trainer
    gc.collect()
    leaked = owner()
    if leaked is not None:
        leaked.pipe.close()  # stop what the test started, then report it
    assert leaked is None, "the dropped pipeline is still alive, with its reader"


def test_a_script_that_drops_pipelines_in_mid_epoch_exits_without_threads_or_processes(tmp_path: Path) -> None:
    """A fresh interpreter drops pipelines with a prefetch thread, a thread pool and a process
    pool in the middle of an epoch (and a copy of each): after the collector has run no thread
    and no child process is left, and it exits at once with status 0."""
    script = textwrap.dedent(
        """
        import gc, json, multiprocessing, pickle, threading, time
        from tests.test_node_objects_adversary import identity, source

        def main():
            before = set(threading.enumerate())
            pipes = [
                source("jsonl").shuffle(1).batch(2).prefetch(2),
                source("parquet").shuffle(1).map(identity, num_workers=2).batch(2),
                source("jsonl_stream").map(identity, num_workers=2, mode="process").batch(2).prefetch(2),
            ]
            for pipe in pipes:
                next(pipe)
            pipes += [pickle.loads(pickle.dumps(pipe)) for pipe in pipes]
            for pipe in pipes:
                next(pipe)
            started = len(set(threading.enumerate()) - before), len(multiprocessing.active_children())
            del pipe, pipes
            gc.collect()
            deadline = time.monotonic() + 60
            while set(threading.enumerate()) - before or multiprocessing.active_children():
                if time.monotonic() > deadline:
                    break
                time.sleep(0.01)
            left = sorted(thread.name for thread in set(threading.enumerate()) - before)
            print(json.dumps([started, left, len(multiprocessing.active_children())]))

        if __name__ == "__main__":
            main()
        """
    )
    (tmp_path / "job.py").write_text(script)
    child = subprocess.run(
        [sys.executable, str(tmp_path / "job.py")],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=CHILD_LIMIT_S,
    )
    assert child.returncode == 0, child.stderr[-3000:]
    assert child.stderr == ""
    (threads_started, processes_started), left, processes_left = json.loads(child.stdout)
    assert threads_started >= 4 and processes_started >= 2
    assert (left, processes_left) == ([], 0)
