"""Adversary of the marks that read-ahead nodes record (``Node._mark``): a prefetch or a
parallel map, over every source kind and chain, nested, stopped, restarted and restored, saves
exactly the state the same pipeline without them would save after the same items, byte for
byte, and resumes exactly; concurrent ``get_state()`` calls never see a torn state; a failed
``set_state`` leaves the pipeline as it was; elastic restores under a read-ahead deliver every
record exactly once."""

from __future__ import annotations

import functools
import json
from typing import Any, Callable

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import resumable as rs
from resumable import Node
from resumable.elastic import restore
from resumable.pack import expand_references
from tests.resume import plain
from tests.sources import INDEXED_KINDS, STREAM_KINDS, indexed_source, replace_file, stream_source
from tests.watching import wait_until

RECORDS = [{"id": index, "input_ids": list(range(index % 5 + 1))} for index in range(17)]
SEQ_LEN = 8


def keep(record: dict[str, Any]) -> bool:
    return record["id"] % 4 != 1


def ids(record: dict[str, Any]) -> int:
    return record["id"]  # type: ignore[no-any-return]  # records are dicts of ints


def same(item: Any) -> Any:
    """The parallel map's function: the item itself, so its output equals the serial one's."""
    return item


Source = Callable[[], Node[Any]]

CHAINS: dict[str, Callable[[Source], Node[Any]]] = {
    "shuffle_shard": lambda source: source().shuffle(5).shard(1, 2),
    "block_shuffle": lambda source: source().shuffle(3, block_size=4).shard(0, 2),
    "indexed_filter": lambda source: source().filter(keep, index=True, progress=False).shuffle(2),
    "filter_map_batch": lambda source: source().shuffle(2).filter(keep).map(ids).batch(3),
    "inner_repeat": lambda source: source().shuffle(4).shard(0, 1).repeat(3),
    "repeat_batch": lambda source: source().shuffle(1).repeat(2).batch(4),
    "pack": lambda source: source().shuffle(2).pack(SEQ_LEN, buffer_size=3),
    "cache": lambda source: source().cache().shuffle(6).map(ids),
    "mix": lambda source: rs.mix({"a": source(), "b": source().shuffle(1)}, weights={"a": 1.0, "b": 2.0}).map(ids),
}
STREAM_CHAINS: dict[str, Callable[[Source], Node[Any]]] = {
    "stream": lambda source: source(),
    "stream_repeat_filter_batch": lambda source: source().repeat(2).filter(keep).batch(2),
}

READERS: dict[str, Callable[[Node[Any]], Node[Any]]] = {
    "prefetch": lambda node: node.prefetch(2),
    "thread": lambda node: node.map(same, num_workers=2),
    "nested": lambda node: node.prefetch(1).map(same, num_workers=2).prefetch(3),
    "process": lambda node: node.map(same, num_workers=2, mode="process"),  # slow to start: few cases
}
THREADED = ["nested", "prefetch", "thread"]


def cases() -> list[tuple[str, str]]:
    indexed = [(kind, chain) for kind in INDEXED_KINDS for chain in CHAINS]
    return indexed + [(kind, chain) for kind in STREAM_KINDS for chain in STREAM_CHAINS]


def serial(kind: str, chain: str) -> Node[Any]:
    if kind in STREAM_KINDS:
        return STREAM_CHAINS[chain](lambda: stream_source(kind, RECORDS))
    return CHAINS[chain](lambda: indexed_source(kind, RECORDS))


def wrapped(state: dict[str, Any], reader: str, ended: bool) -> dict[str, Any]:
    """What the read-ahead pipeline's state must be, given the serial pipeline's ``state``:
    each read-ahead node adds its kind, version and ended flag around it, nothing else."""
    kinds = {
        "prefetch": ["Prefetch"],
        "thread": ["ParallelMap"],
        "process": ["ParallelMap"],
        "nested": ["Prefetch", "ParallelMap", "Prefetch"],
    }
    for kind in reversed(kinds[reader]):
        state = {"kind": kind, "version": 1, "ended": ended, "upstream": state}
    return state


def dumped(state: dict[str, Any]) -> bytes:
    return orjson.dumps(state)


def comparable(state: Any) -> bytes:
    """A state's bytes with each streaming packer's references as lists: a packer's saved form
    (their layout, a base and the log since) depends on when its earlier states were taken,
    which a read-ahead's marks change (``test_a_packers_state_taken_at_other_times...``);
    the references, and everything else, do not."""
    return dumped(references_listed(state))


def references_listed(state: Any) -> Any:
    if isinstance(state, list):
        return [references_listed(value) for value in state]
    if not isinstance(state, dict):
        return state
    if state.get("kind") == "Pack" and state.get("buffer_size") is not None:
        state = expand_references(state)
    return {key: references_listed(value) for key, value in state.items()}


def roundtrip(state: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(state))


class Twin:
    """The same pipeline twice, serial and under a read-ahead, driven by the same operations;
    after each, the items and states must agree."""

    def __init__(self, build: Callable[[], Node[Any]], reader: str) -> None:
        self.build, self.reader = build, reader
        self.serial = build()
        self.ahead = READERS[reader](build())

    def next(self, count: int) -> None:
        """``count`` items, starting the next epoch (``iter``) where one has ended, as a loop does."""
        for _ in range(count):
            got = []
            for pipe in (self.serial, self.ahead):
                try:
                    got.append(("item", plain(next(iter(pipe)))))
                except StopIteration:
                    got.append(("end", None))
            assert got[0] == got[1]

    def check(self) -> None:
        expected = comparable(wrapped(self.serial.get_state(), self.reader, self.serial.ended))
        state = self.ahead.get_state()
        assert comparable(state) == expected
        assert comparable(self.ahead.get_state()) == expected  # twice in a row

    def close(self) -> None:
        self.serial.close()
        self.ahead.close()

    def next_epoch(self) -> None:
        self.serial.next_epoch()
        self.ahead.next_epoch()

    def restore(self) -> None:
        """Both sides continue in freshly built pipelines from their saved states."""
        serial_state, ahead_state = roundtrip(self.serial.get_state()), roundtrip(self.ahead.get_state())
        self.close()
        self.serial = self.build()
        self.serial.set_state(serial_state)
        self.ahead = READERS[self.reader](self.build())
        self.ahead.set_state(ahead_state)

    def restore_serial_state(self) -> None:
        """The read-ahead pipeline continues from the serial pipeline's state, wrapped."""
        state = roundtrip(wrapped(self.serial.get_state(), self.reader, self.serial.ended))
        self.ahead.close()
        self.ahead = READERS[self.reader](self.build())
        self.ahead.set_state(state)


OPERATIONS = st.lists(
    st.one_of(
        st.tuples(st.just("next"), st.integers(0, 25)),
        st.tuples(st.sampled_from(["close", "next_epoch", "restore", "restore_serial_state"]), st.just(0)),
    ),
    min_size=1,
    max_size=6,
)


def run_twin(kind: str, chain: str, reader: str, operations: list[tuple[str, int]]) -> None:
    run_built_twin(lambda: serial(kind, chain), reader, operations)


def run_built_twin(build: Callable[[], Node[Any]], reader: str, operations: list[tuple[str, int]]) -> None:
    twin = Twin(build, reader)
    try:
        for name, count in operations:
            if name == "next":
                twin.next(count)
            else:
                getattr(twin, name)()
            twin.check()
        twin.next(30)  # what follows agrees too
        twin.check()
    finally:
        twin.close()


@pytest.mark.parametrize(("kind", "chain"), cases())
@settings(max_examples=4, deadline=None)
@given(reader=st.sampled_from(THREADED), operations=OPERATIONS)
def test_read_ahead_state_is_the_serial_state(kind: str, chain: str, reader: str, operations: Any) -> None:
    run_twin(kind, chain, reader, operations)


@pytest.mark.parametrize("reader", THREADED)
@pytest.mark.parametrize("chain", ["inner_repeat", "repeat_batch", "pack", "mix"])
def test_edges_of_an_epoch(chain: str, reader: str) -> None:
    """At the start, at the last item of an epoch, at the step after it (StopIteration), after
    close() and next_epoch() there, across epochs."""
    length = sum(1 for _ in serial("list", chain))
    for stop in (0, length - 1, length, length + 1, 2 * length + 1):
        run_twin("list", chain, reader, [("next", stop), ("close", 0), ("next", 1), ("restore", 0), ("next", 2)])
        run_twin("list", chain, reader, [("next", stop), ("next_epoch", 0), ("restore_serial_state", 0)])


def packed(calls: bool) -> bytes:
    """A packer's state after 7 rows (the last of the epoch), its state taken after every row
    before (``calls``) or only then."""
    pipe = rs.from_list(RECORDS).shuffle(1).pack(SEQ_LEN, buffer_size=3)
    for _ in range(7):
        next(pipe)
        if calls:
            pipe.get_state()
    return dumped(pipe.get_state())


def test_a_packers_state_taken_at_other_times_holds_the_same_references() -> None:
    """A packer refits its references' layout when a state is taken (``resumable.pack._refs``),
    so its bytes may depend on when earlier states were (a read-ahead's marks take its progress
    after every item): the same references under another layout, as docs/parallel.md says."""
    with_calls, without = (orjson.loads(packed(calls)) for calls in (True, False))
    assert expand_references(with_calls) == expand_references(without)
    assert with_calls != without  # the case this test is about: the layouts differ


def test_a_packers_states_taken_at_different_times_resume_alike() -> None:
    """The two byte strings above restore to the same continuation (the difference is of form)."""
    continuations = []
    for calls in (True, False):
        pipe = rs.from_list(RECORDS).shuffle(1).pack(SEQ_LEN, buffer_size=3)
        pipe.set_state(orjson.loads(packed(calls)))
        continuations.append([plain(row) for row in pipe] + [plain(row) for row in pipe])
    assert continuations[0] == continuations[1]


# -- elastic: a read-ahead over a shard that continues a rescaled epoch -----------------------


def consumer_pipe(kind: str, consumer: int, consumers: int, reader: str | None) -> Node[Any]:
    """Consumer ``consumer`` of ``consumers``: two epochs of a shuffled shard, under ``reader``."""
    node = indexed_source(kind, RECORDS).shuffle(3).shard(consumer, consumers).repeat(2).map(ids)
    return node if reader is None else READERS[reader](node)


def old_states(kind: str, taken: list[int], reader: str | None) -> tuple[list[dict[str, Any]], list[int]]:
    """The states of ``len(taken)`` old consumers after ``taken[c]`` items each, and those items."""
    states, seen = [], []
    for consumer, count in enumerate(taken):
        with consumer_pipe(kind, consumer, len(taken), reader) as pipe:
            seen += [item for _, item in zip(range(count), pipe)]
            states.append(roundtrip(pipe.get_state()))
    return states, seen


@pytest.mark.parametrize("kind", INDEXED_KINDS)
@settings(max_examples=6, deadline=None)
@given(
    taken=st.lists(st.integers(0, 12), min_size=1, max_size=4),
    consumers=st.integers(1, 3),
    reader=st.sampled_from(THREADED),
    stop=st.integers(0, 20),
)
def test_elastic_restore_under_a_read_ahead_delivers_each_record_once_per_epoch(
    kind: str, taken: list[int], consumers: int, reader: str, stop: int
) -> None:
    """Old consumers (under the reader) stop anywhere, even in their second epoch; the new ones
    (under the reader) restore, save after ``stop`` items, restore again and read both epochs
    to the end: every record twice in all, never more."""
    olds, seen = old_states(kind, taken, reader)
    for consumer in range(consumers):
        with consumer_pipe(kind, consumer, consumers, reader) as pipe:
            restore(pipe, olds)
            head = [item for _, item in zip(range(stop), pipe)]
            state = roundtrip(pipe.get_state())
        with consumer_pipe(kind, consumer, consumers, reader) as resumed:
            resumed.set_state(state)
            seen += head + ([] if state["ended"] else list(resumed))
    assert sorted(seen) == sorted(2 * [record["id"] for record in RECORDS])


@pytest.mark.parametrize("kind", ["list", "jsonl"])
@settings(max_examples=8, deadline=None)
@given(
    taken=st.lists(st.integers(0, 12), min_size=2, max_size=4),
    consumer=st.integers(0, 1),
    reader=st.sampled_from(THREADED),
    operations=OPERATIONS,
)
def test_a_rescaled_shard_under_a_read_ahead_saves_the_serial_state(
    kind: str, taken: list[int], consumer: int, reader: str, operations: Any
) -> None:
    """The remap is compacted as the cursor moves and dropped at the rescaled epoch's end, which
    the reader crosses ahead of the consumer: the states still equal the serial pipeline's."""
    olds, _ = old_states(kind, taken, None)

    def build() -> Node[Any]:
        node = consumer_pipe(kind, consumer, 2, None)
        restore(node, olds)
        return node

    run_built_twin(build, reader, operations)


# -- concurrency: states taken as fast as possible while the producer runs --------------------


def jsonl_file(tmp_path: Any) -> tuple[Any, bytes]:
    path = tmp_path / "data.jsonl"
    original = b"".join(orjson.dumps(record) + b"\n" for record in RECORDS)
    path.write_bytes(original)
    return path, original


def hammered(path: str, reader: str) -> Node[Any]:
    """Three epochs in batches of 2: the producer crosses the inner epochs' ends ahead of the consumer."""
    node = rs.jsonl(path).shuffle(1).shard(0, 1).repeat(3).batch(2)
    return node if reader is None else READERS[reader](node)


def without_mtimes(state: Any) -> Any:
    """``state`` with the files' mtimes left out (a rewrite and its undoing move them)."""
    if isinstance(state, dict):
        return {key: (value if key != "files" else [f[:2] + f[3:] for f in value]) for key, value in state.items()} | {
            key: without_mtimes(value) for key, value in state.items() if key != "files"
        }
    return state


def serial_run(plain_pipe: Node[Any], reader: str) -> tuple[list[Any], list[bytes]]:
    """The serial pipeline's items over one epoch, and its state before the first and after
    each, as the ``reader``'s pipeline must save them."""
    expected = [dumped(wrapped(plain_pipe.get_state(), reader, False))]
    items = []
    for item in plain_pipe:
        items.append(item)
        expected.append(dumped(wrapped(plain_pipe.get_state(), reader, False)))
    return items, expected


def assert_hammered_states(pipe: Node[Any], items: list[Any], expected: list[bytes], times: int) -> None:
    """Before each item and after the last, ``times`` states taken as fast as the consumer can,
    while the producer runs ahead, are each the serial one; and the items are the serial ones."""
    got = []
    for count in range(len(items) + 1):
        for _ in range(times):
            assert dumped(pipe.get_state()) == expected[count], count
        if count < len(items):
            got.append(next(pipe))
    assert got == items


@pytest.mark.parametrize("reader", THREADED)
def test_states_taken_while_the_producer_runs_are_the_serial_ones(reader: str, tmp_path: Any) -> None:
    path, _ = jsonl_file(tmp_path)
    items, expected = serial_run(hammered(str(path), None), reader)
    with hammered(str(path), reader) as pipe:
        assert_hammered_states(pipe, items, expected, 40)


@pytest.mark.parametrize("reader", ["prefetch", "thread"])
def test_a_file_rewritten_under_a_running_producer(reader: str, tmp_path: Any) -> None:
    """While the file differs, ``get_state()`` raises SourceError naming it or returns the serial
    state, never a torn one; once it is back, the run continues exactly."""
    path, original = jsonl_file(tmp_path)
    plain_pipe = hammered(str(path), None)
    items = list(plain_pipe)
    with hammered(str(path), reader) as pipe:
        got = [next(pipe) for _ in range(3)]
        serial_pipe = hammered(str(path), None)
        for _ in range(3):
            next(serial_pipe)
        expected = without_mtimes(wrapped(serial_pipe.get_state(), reader, False))
        source = next(node for node in pipe._subtree() if isinstance(node, rs.nodes.JsonlSource))
        errors = 0
        try:
            replace_file(path, original.replace(b'"id"', b'"ID"'))  # the same size, another content
            for _ in range(60):
                source._files._last_watch = float("-inf")
                try:
                    state = pipe.get_state()
                except rs.SourceError as error:
                    assert "data.jsonl" in str(error)
                    errors += 1
                    continue
                assert without_mtimes(state) == expected
        finally:
            replace_file(path, original)
        assert errors > 0
        got += list(pipe)
        assert got == items
        assert without_mtimes(pipe.get_state()) == without_mtimes(wrapped(plain_pipe.get_state(), reader, True))


def changed_under(pipe: Node[Any], path: Any, original: bytes) -> list[Any]:
    """Take one item, rewrite the file (same size, other content) with its watch due, take a
    state, put the file back, then iterate to the end: what the state and each ``next()`` gave
    (an item's id, or the type of the exception)."""
    outcomes: list[Any] = [next(pipe)["id"]]
    source = next(node for node in pipe._subtree() if isinstance(node, rs.nodes.JsonlSource))
    for node in pipe._subtree():  # prefetch threads idle (buffers full): none reads the file while it is changed
        producer = getattr(node, "_producer", None)
        if producer is not None:
            wait_until(lambda p=producer: p.queue.full() or not p.thread.is_alive(), "an idle prefetch thread")
    try:
        replace_file(path, original.replace(b'"id"', b'"ID"'))
        source._files._last_watch = float("-inf")
        try:
            pipe.get_state()
        except Exception as error:  # noqa: BLE001 - what the consumer gets is the point
            outcomes.append(type(error))
    finally:
        replace_file(path, original)
    for _ in range(len(RECORDS)):
        try:
            outcomes.append(next(pipe)["id"])
        except StopIteration:
            break
        except Exception as error:  # noqa: BLE001 - what the consumer gets is the point
            outcomes.append(type(error))
    return outcomes


def test_a_file_changed_under_a_prefetch_of_a_mix_is_a_source_error(tmp_path: Any) -> None:
    """The mark of a mix is its whole state; building it never runs the file watch (only
    ``get_state`` does), so the producer thread survives and nothing is lost."""
    path, original = jsonl_file(tmp_path)
    with rs.mix({"a": rs.jsonl(str(path))}).prefetch(2) as pipe:
        outcomes = changed_under(pipe, path, original)
    assert outcomes[1] is rs.SourceError
    assert sorted(outcome for outcome in outcomes if isinstance(outcome, int)) == [record["id"] for record in RECORDS]


@pytest.mark.parametrize("below", ["mix", "prefetch"])
def test_a_parallel_map_loses_no_record_when_a_file_changes(below: str, tmp_path: Any) -> None:
    path, original = jsonl_file(tmp_path)
    source = rs.jsonl(str(path))
    upstream = rs.mix({"a": source}) if below == "mix" else source.prefetch(2)
    with upstream.map(same, num_workers=1) as pipe:
        outcomes = changed_under(pipe, path, original)
    assert outcomes[1] is rs.SourceError
    assert sorted(outcome for outcome in outcomes if isinstance(outcome, int)) == [record["id"] for record in RECORDS]


# -- failure atomicity: a corrupted state leaves the read-ahead pipeline as it was ------------

FUZZED = [
    ("jsonl", "shuffle_shard", "prefetch"),
    ("list", "inner_repeat", "nested"),
    ("parquet", "pack", "thread"),
    ("list", "mix", "prefetch"),
    ("jsonl_stream_gzip", "stream_repeat_filter_batch", "nested"),
    ("arrow", "indexed_filter", "thread"),
]
GARBAGE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 40),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False),
    st.text(max_size=3),
    st.lists(st.integers(-2, 5), max_size=3),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
)


def places(state: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in a nested state: dict keys and list indices, at any depth."""
    found: list[tuple[Any, ...]] = []
    children = state.items() if isinstance(state, dict) else enumerate(state) if isinstance(state, list) else ()
    for key, value in children:
        found.append((*path, key))
        found.extend(places(value, (*path, key)))
    return found


def corrupted(state: dict[str, Any], place: tuple[Any, ...], value: Any, delete: bool) -> dict[str, Any]:
    state = roundtrip(state)
    parent: Any = state
    for key in place[:-1]:
        parent = parent[key]
    if delete:
        del parent[place[-1]]
    else:
        parent[place[-1]] = value
    return state


@pytest.mark.parametrize(("kind", "chain", "reader"), FUZZED)
@settings(max_examples=12, deadline=None)
@given(data=st.data(), before=st.integers(0, 20), delete=st.booleans(), value=GARBAGE)
def test_a_failed_set_state_leaves_the_read_ahead_pipeline_as_it_was(
    kind: str, chain: str, reader: str, data: Any, before: int, delete: bool, value: Any
) -> None:
    with READERS[reader](serial(kind, chain)) as pipe:
        head = [plain(item) for _, item in zip(range(before), pipe)]
        saved = roundtrip(pipe.get_state())
        place = data.draw(st.sampled_from(places(saved)))
        try:
            pipe.set_state(corrupted(saved, place, value, delete))
        except (rs.StateError, rs.ConfigError):
            assert dumped(pipe.get_state()) == dumped(saved)
            reference = serial(kind, chain)
            reference.set_state(saved["upstream"] if reader != "nested" else saved["upstream"]["upstream"]["upstream"])
            with reference:
                expected = [plain(item) for _, item in zip(range(25), reference)]
            assert [plain(item) for _, item in zip(range(25), pipe)] == expected
        else:
            pipe.set_state(saved)  # an accepted change: only the original must still load
        assert len(head) <= before


# -- the Loader, with a read-ahead inside each worker's pipeline ------------------------------


def loader_pipeline(reader: str) -> Node[Any]:
    node = rs.from_list(list(range(41))).shuffle(3).shard().repeat(2)
    return READERS[reader](node).batch(3, collate_fn=np.array)


@pytest.mark.parametrize(
    ("reader", "num_workers"), [("prefetch", 0), ("thread", 0), ("nested", 0), ("prefetch", 2), ("thread", 2)]
)
def test_loader_with_a_read_ahead_inside_resumes_exactly(reader: str, num_workers: int) -> None:
    from resumable.torch import Loader
    from tests.resume import loader_batches

    build = functools.partial(loader_pipeline, reader)
    expected, _ = loader_batches(Loader(build, num_workers=num_workers))
    assert sorted(x for batch in expected for x in batch) == sorted(2 * list(range(41)))
    for stop in (1, len(expected) - 1):  # the first batch, the last but one (across the epoch end)
        head, state = loader_batches(Loader(build, num_workers=num_workers), stop)
        resumed = Loader(build, num_workers=num_workers)
        resumed.load_state_dict(state)
        rest, _ = loader_batches(resumed)
        assert head + rest == expected, stop


def test_a_process_map_saves_the_serial_states_and_resumes() -> None:
    run_built_twin(
        lambda: serial("jsonl", "inner_repeat"),
        "process",
        [("next", 5), ("restore", 0), ("next", 17), ("close", 0), ("next", 30), ("restore_serial_state", 0)],
    )


@pytest.mark.parametrize("reader", ["prefetch", "nested"])
def test_states_hammered_while_the_producer_drops_a_remap_are_the_serial_ones(reader: str) -> None:
    """The producer runs past the rescaled epoch's end (the shard drops its remap, its marks
    turn from whole states into counters) while the consumer takes states as fast as it can."""
    olds, _ = old_states("list", [3, 5, 1], None)

    def build() -> Node[Any]:
        node = consumer_pipe("list", 1, 2, None)
        restore(node, olds)
        return node

    plain_pipe = build()
    assert "remap" in json.dumps(plain_pipe.get_state())
    items, expected = serial_run(plain_pipe, reader)
    assert "remap" not in json.dumps(plain_pipe.get_state())
    with READERS[reader](build()) as pipe:
        assert_hammered_states(pipe, items, expected, 30)
