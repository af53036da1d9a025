"""Marks (``Node._mark``): what a read-ahead node records for every item it reads ahead, from
which the state of that moment is built later. The state built from a mark equals, byte for
byte, the state taken when the mark was, however far the node has moved on since: into the
next epoch, past its end, over every source kind, through every node a read-ahead can sit on,
with a rescaled shard (whose remap changes as it is read, so its mark is the state itself)."""

from __future__ import annotations

import pickle
from typing import Any, Callable

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import resumable as rs
from resumable import Node
from resumable.elastic import restore
from resumable.order.shard import Shard
from tests.sources import INDEXED_KINDS, STREAM_KINDS, indexed_source, replace_file, stream_source
from tests.watching import assert_freed_at_once

RECORDS = [{"id": index, "input_ids": list(range(index % 7 + 1))} for index in range(23)]
SEQ_LEN = 8


def keep(record: dict[str, Any]) -> bool:
    return record["id"] % 4 != 1


def same(item: Any) -> Any:
    return item


def ids(record: dict[str, Any]) -> int:
    return record["id"]  # type: ignore[no-any-return]  # records are dicts of ints


def with_remap(source: Callable[[], Node[Any]]) -> Node[Any]:
    """A shard of consumer 0 of 2 continuing three old consumers' epoch: it holds a remap."""
    olds = []
    for rank in range(3):
        old = source().shuffle(3).shard(rank, 3)
        for _ in range(rank + 1):
            next(old)
        olds.append(old.get_state())
    shard = source().shuffle(3).shard(0, 2)
    restore(shard, olds)
    return shard


CHAINS: dict[str, Callable[[Callable[[], Node[Any]]], Node[Any]]] = {
    "source": lambda source: source(),
    "shuffle_shard": lambda source: source().shuffle(5).shard(1, 2),
    "shard_shuffle": lambda source: source().shard(0, 2).shuffle(5),
    "repeat": lambda source: source().shuffle(5).shard(0, 1).repeat(),
    "filter_map_batch": lambda source: source().shuffle(2).filter(keep).map(ids).batch(3),
    "repeat_filter_batch": lambda source: source().repeat().filter(keep).batch(2),
    "pack": lambda source: source().shuffle(2).pack(SEQ_LEN, buffer_size=3).repeat(),
    "cache": lambda source: source().cache().map(ids),
    "prefetch_below": lambda source: source().prefetch(2).map(ids),
    "mix": lambda source: rs.mix({"a": source(), "b": source().shuffle(1)}, weights={"a": 1.0, "b": 2.0}).map(ids),
    "remap": lambda source: with_remap(source).map(ids),
    "remap_repeat": lambda source: with_remap(source).repeat(2),
    "remap_below": lambda source: with_remap(source).shuffle(4),
}
STREAM_CHAINS = ("source", "repeat_filter_batch", "prefetch_below")


def sources() -> list[tuple[str, str]]:
    indexed = [(kind, chain) for kind in INDEXED_KINDS for chain in CHAINS]
    return indexed + [(kind, chain) for kind in STREAM_KINDS for chain in STREAM_CHAINS]


def build(kind: str, chain: str) -> Node[Any]:
    if kind in STREAM_KINDS:
        return CHAINS[chain](lambda: stream_source(kind, RECORDS))
    return CHAINS[chain](lambda: indexed_source(kind, RECORDS))


def advance(node: Node[Any], count: int) -> None:
    """``count`` items on, into the next epoch where one ends."""
    for _ in range(count):
        try:
            next(node)
        except StopIteration:
            node.next_epoch()


@pytest.mark.parametrize(("kind", "chain"), sources())
@settings(max_examples=8, deadline=None)
@given(before=st.integers(0, 60), after=st.integers(0, 60))
def test_a_mark_builds_the_state_of_its_moment(kind: str, chain: str, before: int, after: int) -> None:
    node = build(kind, chain)
    try:
        advance(node, before)
        mark, state = node._mark(), node._state(progress=True)
        advance(node, after)
        built = node._marked_state(mark)
    finally:
        node.close()
    assert orjson.dumps(built) == orjson.dumps(state)


@pytest.mark.parametrize("chain", ["remap", "remap_repeat", "remap_below"])
def test_a_shard_holding_a_remap_is_marked_by_its_state(chain: str) -> None:
    """Its remap is compacted as the cursor moves and dropped at the epoch's end, so a mark
    cannot leave it to be built later."""
    node = build("list", chain)
    assert any(isinstance(child, Shard) and child._varies() for child in node._subtree())
    assert isinstance(node._mark(), dict)


def test_marks_without_a_remap_hold_no_header() -> None:
    node = build("jsonl", "shuffle_shard")
    next(node)
    progress, ended, below = node._mark()
    assert (set(progress), ended, below) == ({"epoch", "position", "length"}, False, None)


def test_a_node_that_adds_to_its_state_must_say_when_marks_cannot_defer_it() -> None:
    with pytest.raises(TypeError, match="_varies"):

        class Tagged(rs.nodes.Map):  # type: ignore[type-arg]  # a subclass made to fail
            def _state(self, progress: bool) -> dict[str, Any]:
                return {**super()._state(progress), "tag": 1}


@pytest.mark.parametrize("reader", ["prefetch", "thread_map"])
def test_a_changed_file_is_reported_when_the_state_is_taken(reader: str, tmp_path: Any) -> None:
    """The headers are built when a state is asked for, so the file watch runs then: a file
    rewritten under a read-ahead is reported by ``get_state()``, naming it."""
    path = tmp_path / "data.jsonl"
    original = b"".join(orjson.dumps(record) + b"\n" for record in RECORDS)
    path.write_bytes(original)
    source = rs.jsonl(str(path))
    node = source.prefetch(4) if reader == "prefetch" else source.map(ids, num_workers=2)
    try:
        next(node)
        replace_file(path, b"".join(orjson.dumps({"id": -1}) + b"\n" for _ in RECORDS))
        source._files._last_watch = float("-inf")  # the watch's interval has passed
        source._files._fresh_for = 0.0
        with pytest.raises(rs.SourceError, match="data.jsonl"):
            node.get_state()
    finally:
        replace_file(path, original)  # closing returns the source to the last item handed out
        node.close()


@pytest.mark.parametrize("reader", [None, "prefetch", "thread_map"])
@pytest.mark.parametrize(("kind", "chain"), sources())
def test_states_and_marks_leave_no_reference_cycle(kind: str, chain: str, reader: str | None) -> None:
    """No node keeps a reference to itself: not the nodes a state or a mark asks
    (``Node._overriding``), not a source's own decoders (``IndexedNode._held_weakly``). So a
    dropped pipeline is freed at once (a stream's read-ahead thread stops, memory maps and
    files close), not when the cyclic collector runs."""
    node = build(kind, chain)
    if reader is not None:
        node = node.prefetch(3) if reader == "prefetch" else node.map(same, num_workers=2)
    next(node)
    node.get_state()
    node._mark()
    next(node)
    pipeline = [node]
    del node
    assert_freed_at_once(pipeline)


@pytest.mark.parametrize("kind", INDEXED_KINDS)
def test_a_source_pickled_mid_epoch_continues_with_its_own_decoders(kind: str) -> None:
    """A DataLoader worker under spawn receives a pickled pipeline: the decoders the source
    keeps, held weakly, come along bound to the copy, not to another copy of the source."""
    source = indexed_source(kind, RECORDS)
    head = [next(source) for _ in range(5)]
    copy = pickle.loads(pickle.dumps(source))
    kept = [fn for fn in (copy._decode, copy._run_decoder) if hasattr(fn, "_node")]
    assert all(fn._node() is copy for fn in kept)
    assert head + list(copy) == RECORDS
