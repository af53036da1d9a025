"""Stride keys (``resumable.core.keys.Stride``): below a shard, a record's key is its position in
the consumer's stride, so a packer's state holds a few bits per piece where a leaf index takes
``log2(source)``. Over every indexed source kind: the key names the record it came with (fetched
again, and as its leaf key would); a packer over it resumes exactly at any row; its state is
smaller than with leaf keys; under a remap the key is a leaf key; and damaged strides, or strides
that name no record of the pipeline restored, are ``StateError``s that leave the pipeline as it
was."""

from __future__ import annotations

import copy
import json
from typing import Any, Callable

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import resumable as rs
from resumable.core.keys import Stride, loaded_prefix, saved_prefix
from resumable.elastic import restore
from resumable.pack import expand_references
from resumable.pack._refs import RECORD, RefTable, decode
from tests.sources import INDEXED_KINDS, indexed_source

SEQ_LEN = 32


def documents(count: int) -> list[dict[str, Any]]:
    """Documents of 1-40 tokens, each token naming its document."""
    return [{"id": i, "input_ids": [i] * (1 + i * 7 % 40)} for i in range(count)]


def packed(kind: str, docs: list[dict[str, Any]], consumer: int, consumers: int, buffer: int = 8) -> rs.Node:
    source = indexed_source(kind, docs)
    return source.shuffle(3).shard(consumer, consumers).map(dict).pack(SEQ_LEN, buffer_size=buffer)


def rows(pipe: rs.Node, count: int | None = None) -> list[list[int]]:
    """The token rows ``pipe`` hands out: ``count`` of them, or to the end of the epoch."""
    taken: list[list[int]] = []
    if count == 0:
        return taken
    for row in pipe:
        taken.append(np.asarray(row["input_ids"]).tolist())
        if count is not None and len(taken) == count:
            break
    return taken


def pack_state(state: dict[str, Any]) -> dict[str, Any]:
    node = state
    while node["kind"] != "Pack":
        node = node["upstream"]
    return node


@pytest.mark.parametrize("kind", INDEXED_KINDS)
def test_a_stride_key_names_the_record_it_came_with(kind: str) -> None:
    docs = documents(50)
    pipe = indexed_source(kind, docs).shuffle(5).shard(2, 3).map(dict)
    unsharded = indexed_source(kind, docs).shuffle(5)
    for position, record in enumerate(pipe):
        key = pipe.last_key()
        assert key == (Stride(2, 3), 0, position)
        assert pipe.fetch(key) == record
        assert unsharded[2 + position * 3] == record  # position 2 + 3k of the shard's upstream
    assert pipe.fetch_many([(Stride(0, 3), 0, 0), (0, 7), (Stride(2, 3), 0, 1)]) == [
        unsharded[0],
        dict(indexed_source(kind, docs)[7]),
        unsharded[5],
    ]


def test_without_a_shard_keys_are_leaf_keys() -> None:
    docs = documents(40)
    pipe = rs.from_list(docs).shuffle(1).map(dict)
    next(pipe)
    assert pipe.last_key() == (0, int(pipe.upstream.permutation(0).take(np.array([0]))[0]))


@pytest.mark.parametrize("new_consumers", [1, 2, 3, 5])
def test_under_a_remap_keys_are_leaf_keys_in_the_band_and_stride_keys_past_it(new_consumers: int) -> None:
    """The epoch a rescale cut short: a position in the band (left below the fastest old
    cursor) has a leaf key; past it the remap is a shift, and the key a stride key of the new
    topology's consumers; every key fetches the record it came with."""
    docs = documents(120)
    old = [rs.from_list(docs).shuffle(1).shard(c, 4).map(dict) for c in range(4)]
    for consumer, node in enumerate(old):
        for _ in range(3 + consumer * 2):  # cursors 3, 5, 7, 9: a band of 6 + 4 + 2 positions
            next(node)
    states = [node.get_state() for node in old]
    kinds = []
    for consumer in range(new_consumers):
        new = rs.from_list(docs).shuffle(1).shard(consumer, new_consumers).map(dict)
        restore(new, states)
        for record in new:
            key = new.last_key()
            assert key is not None and new.fetch(key) == record
            kinds.append("stride" if isinstance(key[0], Stride) else "leaf")
            if isinstance(key[0], Stride):
                assert key[0].consumers == new_consumers
    assert kinds.count("leaf") == 12  # the band, whoever reads it
    assert kinds.count("stride") == 120 - 12 - (3 + 5 + 7 + 9)


@pytest.mark.parametrize("kind", INDEXED_KINDS)
@given(st.integers(0, 40), st.sampled_from([(0, 1), (1, 3), (2, 3)]))
def test_a_packer_over_stride_keys_resumes_exactly_at_any_row(kind: str, taken: int, topology: tuple[int, int]) -> None:
    """Restored at any row of the first epoch (its last and the step after it included), then
    again two rows later: the rows equal two uninterrupted epochs."""
    docs = documents(90)
    fresh = packed(kind, docs, *topology)
    whole = rows(fresh) + rows(fresh)
    first = packed(kind, docs, *topology)
    head = rows(first, min(taken, len(whole) // 2))
    state = json.loads(json.dumps(first.get_state()))
    resumed = packed(kind, docs, *topology)
    resumed.set_state(state)
    assert (head + rows(resumed) + rows(resumed) + rows(resumed))[: len(whole)] == whole
    again = packed(kind, docs, *topology)  # a state taken right after a restore, restored again
    again.set_state(state)
    mid = rows(again, 2)
    twice = packed(kind, docs, *topology)
    twice.set_state(json.loads(json.dumps(again.get_state())))
    assert (head + mid + rows(twice) + rows(twice) + rows(twice))[: len(whole)] == whole


def test_across_epochs_a_packer_keeps_both_epochs_stride_keys_exactly() -> None:
    docs = documents(60)

    def build() -> rs.Node:
        return rs.from_list(docs).shuffle(2).shard(1, 2).repeat(3).map(dict).pack(SEQ_LEN, buffer_size=16)

    whole = rows(build())
    for taken in range(0, len(whole) + 1, 3):
        first = build()
        head = rows(first, taken)
        resumed = build()
        resumed.set_state(json.loads(json.dumps(first.get_state())))
        assert head + rows(resumed) == whole


def test_stride_keys_take_a_few_bits_where_leaf_keys_take_log2_of_the_source() -> None:
    docs = documents(20_000)
    strided = rs.from_list(docs).shuffle(4).shard(3, 8).map(dict).pack(SEQ_LEN, buffer_size=64)
    unsharded = rs.from_list(docs).shuffle(4).map(dict).pack(SEQ_LEN, buffer_size=64)  # leaf keys
    for pipe in (strided, unsharded):
        rows(pipe, 200)
    strided_refs, leaf_refs = (pack_state(p.get_state())["refs"] for p in (strided, unsharded))
    assert strided_refs["origins"] == [[], [{"consumer": 3, "of": 8}]]
    assert strided_refs["bits"][RECORD] <= 10  # positions of a 64-piece buffer read ~1,600 records in
    assert leaf_refs["bits"][RECORD] >= 13  # leaf indices spread over 20,000 records
    assert len(strided_refs["data"]) < len(leaf_refs["data"])
    listed = expand_references(pack_state(strided.get_state()))
    assert all(ref[0] == {"consumer": 3, "of": 8} for ref in listed["open"])


def test_a_mix_of_sharded_components_keeps_names_before_the_stride() -> None:
    docs = documents(60)

    def build() -> rs.Node:
        parts = {name: rs.from_list(docs).shuffle(seed).shard(0, 2).map(dict) for seed, name in enumerate(["a", "b"])}
        return rs.mix(parts, weights={"a": 1.0, "b": 2.0}, seed=3).pack(SEQ_LEN, buffer_size=8)

    whole = rows(build())
    first = build()
    head = rows(first, 5)
    state = json.loads(json.dumps(first.get_state()))
    assert {tuple(json.dumps(part) for part in ref[:-4]) for ref in expand_references(pack_state(state))["open"]} <= {
        ('"a"', json.dumps({"consumer": 0, "of": 2})),
        ('"b"', json.dumps({"consumer": 0, "of": 2})),
    }
    resumed = build()
    resumed.set_state(state)
    assert head + rows(resumed) == whole


STRIDES = st.one_of(
    st.builds(Stride, st.integers(0, 5), st.integers(6, 9)),
    st.builds(Stride, st.just(2**63 - 2), st.just(2**63 - 1)),
)


@given(st.lists(st.tuples(st.lists(st.sampled_from(["web", "x"]), max_size=2), STRIDES), max_size=6))
def test_saved_prefixes_load_as_they_were(prefixes: list[tuple[list[str], Stride]]) -> None:
    for names, stride in prefixes:
        prefix = (*names, stride)
        assert loaded_prefix(json.loads(json.dumps(saved_prefix(prefix)))) == prefix
        assert loaded_prefix(names) == tuple(names)


@pytest.mark.parametrize(
    "bad",
    [
        [{"consumer": 3, "of": 3}],
        [{"consumer": -1, "of": 3}],
        [{"consumer": True, "of": 3}],
        [{"consumer": 0, "of": 2**63}],
        [{"consumer": 0}],
        [{"consumer": 0, "of": 2, "x": 1}],
        [{"consumer": 0.0, "of": 2}],
        [{"consumer": 0, "of": 2}, "web"],
        [{"consumer": 0, "of": 2}, {"consumer": 0, "of": 2}],
        [3],
        "web",
    ],
)
def test_malformed_prefixes_load_as_none(bad: Any) -> None:
    assert loaded_prefix(bad) is None


def damaged(mutate: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], dict[str, Any]]:
    def apply(state: dict[str, Any]) -> dict[str, Any]:
        state = copy.deepcopy(state)
        mutate(pack_state(state)["refs"])
        return state

    return apply


def _set_origin(refs: dict[str, Any], origin: Any) -> None:
    refs["origins"][-1] = origin


DAMAGES = {
    "consumer past the stride": damaged(lambda refs: _set_origin(refs, [{"consumer": 9, "of": 9}])),
    "stride not a dict of two ints": damaged(lambda refs: _set_origin(refs, [{"consumer": "1", "of": 3}])),
    "names after the stride": damaged(lambda refs: _set_origin(refs, [{"consumer": 1, "of": 3}, "web"])),
    "another stride, past the upstream": damaged(lambda refs: _set_origin(refs, [{"consumer": 1, "of": 10**9}])),
    "positions past the stride": damaged(lambda refs: refs["base"].__setitem__(RECORD, 10**6)),
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_damaged_strides_are_state_errors_that_leave_the_pipeline_as_it_was(damage: str) -> None:
    docs = documents(90)
    pipe = packed("list", docs, 1, 3)
    rows(pipe, 3)
    good = pipe.get_state()
    bad = DAMAGES[damage](good)
    target = packed("list", docs, 1, 3)
    rows(target, 1)
    before = target.get_state()
    with pytest.raises(rs.StateError):
        target.set_state(bad)
        rows(target)  # a wrong key may only show when its row is fetched; it must still be a StateError
    if target.get_state() != before:  # the error came from a row: the state was loaded, a fresh restore works
        target = packed("list", docs, 1, 3)
    target.set_state(good)
    expected = packed("list", docs, 1, 3)
    expected.set_state(good)
    assert rows(target) == rows(expected)


def test_stride_keys_restored_into_a_pipeline_without_a_shard_are_state_errors() -> None:
    docs = documents(90)
    pipe = packed("list", docs, 0, 1)
    rows(pipe, 3)
    state = json.loads(json.dumps(pipe.get_state()))
    unsharded = rs.from_list(docs).shuffle(3).map(dict).pack(SEQ_LEN, buffer_size=8)
    with pytest.raises(rs.StateError):  # the shard's own state is missing too, but the keys say it first or after
        unsharded.set_state(state)


@given(
    st.lists(
        st.tuples(
            st.sampled_from([(Stride(1, 3),), ("web", Stride(0, 2)), ()]),
            st.integers(0, 2),
            st.integers(0, 10**6),
            st.integers(1, 3 * SEQ_LEN),
        ),
        min_size=1,
        max_size=30,
        unique_by=lambda piece: (piece[0], piece[1], piece[2]),
    )
)
def test_tables_of_stride_and_leaf_keys_decode_to_the_keys_added(pieces: list[tuple[Any, ...]]) -> None:
    table = RefTable(capacity=1)
    slots = [table.add((*prefix, epoch, record), 0, length) for prefix, epoch, record, length in pieces]
    encoding = json.loads(json.dumps(table.encode(np.array(slots, dtype=np.intp))))
    expected = [[*saved_prefix(prefix), epoch, record, 0, length] for prefix, epoch, record, length in pieces]
    assert decode(encoding, "Pack", "refs") == expected
