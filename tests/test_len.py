"""Known length: ``len(pipe)`` is the number of items the current epoch yields for this
consumer, wherever it follows without reading the data; elsewhere a TypeError names the node
that makes it unknown. Every known length here is checked against a count of the items."""

from __future__ import annotations

import json
from typing import Any, Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

import resumable as rs
from resumable import Node
from resumable.elastic import restore
from tests.resume import restored, take
from tests.sources import INDEXED_KINDS, indexed_source, stream_source
from tests.test_chains import IndexedStep, IteratorStep, builder

Chain = Callable[[Node[Any], int, int], Node[Any]]


def ids(record: dict[str, Any]) -> int:
    return record["id"]  # type: ignore[no-any-return]  # records are dicts of ints


def records(count: int) -> list[dict[str, Any]]:
    return [{"id": i, "text": "x" * (i % 7)} for i in range(count)]


# Chains over a source, for consumer c of C: every node whose length is known.
CHAINS: dict[str, Chain] = {
    "source": lambda s, c, n: s,
    "shuffle_shard": lambda s, c, n: s.shuffle(3).shard(c, n),
    "block_shuffle_shard": lambda s, c, n: s.shuffle(3, block_size=4).shard(c, n),
    "map_shard_map": lambda s, c, n: s.map(dict).shuffle(1).shard(c, n).map(ids),
    "cache_shard": lambda s, c, n: s.map(dict).cache().shuffle(2).shard(c, n),
    "parallel_map_prefetch": lambda s, c, n: s.shard(c, n).map(ids, num_workers=2).prefetch(3),
    "batch": lambda s, c, n: s.shuffle(4).shard(c, n).map(ids).batch(3),
    "batch_drop_last": lambda s, c, n: s.shuffle(4).shard(c, n).map(ids).batch(4, drop_last=True),
    "repeat_batch": lambda s, c, n: s.shuffle(5).shard(c, n).repeat(2).map(ids).batch(5),
    "prefetch_batch_drop_last": lambda s, c, n: s.shard(c, n).prefetch(2).batch(2, drop_last=True),
}


def count_epoch(pipe: Node[Any]) -> int:
    """Items of one epoch: the current one's rest, or the next whole one once it has ended."""
    return sum(1 for _ in pipe)


def check_epochs(pipe: Node[Any], epochs: int = 2) -> None:
    """len() equals the count of each epoch, asked before it starts and again at its end."""
    for _ in range(epochs):
        iter(pipe)  # starts the next epoch once the current one has ended
        length = len(pipe)
        assert count_epoch(pipe) == length
        assert len(pipe) == length  # still the epoch's at its end, not what remains


@pytest.mark.parametrize("kind", INDEXED_KINDS)
@pytest.mark.parametrize("chain", sorted(CHAINS))
@pytest.mark.parametrize("size", [24, 25])
def test_len_is_what_an_epoch_yields(chain: str, kind: str, size: int) -> None:
    docs = records(size)
    for consumers in (1, 3):
        lengths = []
        for consumer in range(consumers):
            with CHAINS[chain](indexed_source(kind, docs), consumer, consumers) as pipe:
                check_epochs(pipe)
                lengths.append(len(pipe))
        if chain in ("shuffle_shard", "map_shard_map"):  # every record belongs to one consumer
            assert sum(lengths) == size


@pytest.mark.parametrize("chain", sorted(CHAINS))
def test_len_after_restore_is_the_epochs(chain: str) -> None:
    """Restored (once and twice in a row) at the start, middle, last item and the step after an
    epoch's end: len() is the length of the epoch the restored pipeline is in, never what
    remains of it."""

    def build() -> Node[Any]:
        return CHAINS[chain](rs.from_list(records(25)), 1, 3)

    with build() as probe:
        length = len(probe)
    for k in (0, 1, length // 2, length, length + 1):
        with build() as pipe:
            take(pipe, k)
            state = pipe.get_state()
        with restored(build, state) as resumed:
            with restored(build, resumed.get_state()) as twice:  # restored twice in a row
                assert len(twice) == length
            in_epoch = count_epoch(resumed)
            assert in_epoch <= len(resumed) == length
            if k <= length:
                assert in_epoch == length - k
            check_epochs(resumed)


@pytest.mark.parametrize("batch_size", [1, 2, 3, 5, 6, 7])
@pytest.mark.parametrize("drop_last", [False, True])
def test_batch_len_divides_or_not(batch_size: int, drop_last: bool) -> None:
    pipe = rs.from_list(list(range(30))).batch(batch_size, drop_last=drop_last)
    expected = 30 // batch_size if drop_last else -(-30 // batch_size)
    assert len(pipe) == expected == count_epoch(pipe)


@pytest.mark.parametrize("times", [1, 2, 3])
def test_repeat_n_is_n_epochs(times: int) -> None:
    pipe = rs.from_list(list(range(10))).shuffle(1).shard(0, 3).repeat(times)
    assert len(pipe) == 4 * times == count_epoch(pipe)
    batched = rs.from_list(list(range(10))).shuffle(1).shard(2, 3).repeat(times).batch(2)
    assert len(batched) == -(-3 * times // 2) == count_epoch(batched)  # batches span epochs


def test_mix_drop_is_the_sum_of_what_each_component_gives() -> None:
    def component(start: int, size: int, consumer: int) -> Node[Any]:
        return rs.from_list(list(range(start, start + size))).shuffle(start).shard(consumer, 2)

    for weights in ({"a": 1.0, "b": 1.0}, {"a": 3.0, "b": 0.0}):
        pipe = rs.mix({"a": component(0, 9, 1), "b": component(100, 14, 1)}, weights=weights, on_end="drop")
        check_epochs(pipe)
    # A weight set to zero mid-epoch: that component gave what it gave until then.
    pipe = rs.mix({"a": component(0, 9, 0), "b": component(100, 14, 0)}, on_end="drop")
    take(pipe, 5)
    gave = pipe.counts["b"]
    pipe.set_weights({"a": 1.0, "b": 0.0})
    length = len(pipe)
    assert length == len(pipe.components["a"]) + gave == 5 + count_epoch(pipe)


def unknown_cases() -> dict[str, tuple[Callable[[], Node[Any]], str]]:
    """Pipelines whose length is unknown, with the message their TypeError must carry."""

    def src() -> Node[Any]:
        return rs.from_list(records(12))

    def packed() -> Node[Any]:
        return src().map(lambda r: {"input_ids": list(range(r["id"] % 5 + 1))})

    filtered = "Filter: the number of items a streaming filter keeps is unknown"
    return {
        "filter": (lambda: src().filter(lambda r: r["id"] % 2 == 0), filtered),
        "filter_deep": (lambda: src().shard(0, 2).filter(bool).map(ids).prefetch(2).batch(2), filtered),
        "filter_under_repeat_n": (lambda: src().filter(bool).repeat(3).batch(2), filtered),
        "filter_over_repeat": (lambda: src().repeat().filter(bool), filtered),
        "parallel_map_over_filter": (lambda: src().filter(bool).map(ids, num_workers=2), filtered),
        "endless_repeat": (lambda: src().shuffle(1).repeat().batch(4), "Repeat: repeat() without a count"),
        "stream": (lambda: stream_source("jsonl_stream", records(12)).batch(2), "JsonlStream: "),
        "streaming_pack": (lambda: packed().pack(8, strategy="best_fit").batch(2), "Pack: "),
        "mix_stop": (lambda: rs.mix({"a": src(), "b": src()}).map(ids), "Mix: with on_end='stop'"),
        "mix_restart": (lambda: rs.mix({"a": src(), "b": src()}, on_end="restart"), "Mix: with on_end='restart'"),
        "mix_drop_filtered": (lambda: rs.mix({"a": src(), "b": src().filter(bool)}, on_end="drop"), filtered),
        "repeat_over_mix": (
            lambda: rs.mix({"a": src(), "b": src()}, on_end="drop").repeat(2),
            "Repeat: the length of Mix may change from one epoch to the next",
        ),
        "repeat_over_plan": (
            lambda: packed().shuffle(1).pack(8, strategy="bfd").repeat(2),
            "Pack",
        ),
    }


@pytest.mark.parametrize("case", sorted(unknown_cases()))
def test_unknown_length_is_a_type_error_naming_the_node(case: str) -> None:
    build, message = unknown_cases()[case]
    with build() as pipe:
        with pytest.raises(TypeError, match=message.replace("(", r"\(").replace(")", r"\)")):
            len(pipe)
        assert pipe  # truth-testing never asks for the length
        # list() takes len() as a size hint; an unknown one changes nothing.
        if case not in ("filter_over_repeat", "endless_repeat", "mix_restart"):  # endless
            with build() as other:
                assert len(list(pipe)) == count_epoch(other) > 0


def test_a_node_is_true_whatever_its_length() -> None:
    assert rs.from_list([]) and rs.from_list([]).batch(2) and rs.from_list([1]).filter(bool)
    assert len(rs.from_list([]).shuffle(1).batch(3)) == 0


def test_list_takes_the_rest_whatever_the_length_says() -> None:
    """len() is the epoch's; list() of a pipeline in mid-epoch gets the rest, nothing less."""
    pipe = rs.from_list(list(range(20))).shuffle(3).batch(3)
    head = take(pipe, 2)
    assert len(pipe) == 7
    rest = list(pipe)
    assert len(rest) == 5 and head + rest == list(rs.from_list(list(range(20))).shuffle(3).batch(3))


# -- elastic rescale: the new consumer's epoch is what the old ones left of it ----------------

RESCALED: dict[str, Chain] = {
    "shard": lambda s, c, n: s.shuffle(7).shard(c, n),
    "shard_map_batch": lambda s, c, n: s.shuffle(7).shard(c, n).map(ids).batch(3),
    "parallel_map_prefetch_batch": lambda s, c, n: (
        s.shuffle(7).shard(c, n).map(ids, num_workers=2).prefetch(2).batch(2, drop_last=True)
    ),
}


@pytest.mark.parametrize("kind", INDEXED_KINDS)
@pytest.mark.parametrize("chain", sorted(RESCALED))
def test_len_after_an_elastic_rescale(chain: str, kind: str) -> None:
    docs = records(50)

    def build(consumer: int, consumers: int) -> Node[Any]:
        return RESCALED[chain](indexed_source(kind, docs), consumer, consumers)

    olds = [build(c, 4) for c in range(4)]
    for consumer, pipe in enumerate(olds):
        take(pipe, consumer + 1)
    states = [json.loads(json.dumps(pipe.get_state())) for pipe in olds]
    for pipe in olds:
        pipe.close()
    for consumer in range(3):
        with build(consumer, 3) as pipe:
            restore(pipe, states)
            length = len(pipe)
            with build(consumer, 3) as fresh:
                assert length < len(fresh)  # the old consumers read part of this epoch
            head = take(pipe, 1)
            state = pipe.get_state()
            with build(consumer, 3) as again:
                again.set_state(json.loads(json.dumps(state)))
                assert len(again) == length  # the rescaled epoch's, restored from its state
            assert len(head) + count_epoch(pipe) == length
            check_epochs(pipe)  # later epochs: whole strides of the new topology
            with build(consumer, 3) as fresh:
                assert len(pipe) == len(fresh)


def test_repeat_n_over_a_rescaled_shard_is_a_type_error() -> None:
    def build(consumer: int, consumers: int) -> Node[Any]:
        return rs.from_list(records(30)).shuffle(7).shard(consumer, consumers).repeat(2)

    olds = [build(c, 2) for c in range(2)]
    for pipe in olds:
        take(pipe, 3)
    pipe = build(0, 3)
    restore(pipe, [old.get_state() for old in olds])
    with pytest.raises(TypeError, match="Repeat: Shard was rescaled"):
        len(pipe)


# -- drawn chains --------------------------------------------------------------------------


def culprit(iterated: list[tuple[Any, ...]]) -> str | None:
    """The node a drawn chain's TypeError must name: from the top, the first streaming filter
    or endless repeat (a repeat(n) asks its upstream)."""
    for step in reversed(iterated):
        if step[0] == "filter":
            return "Filter"
        if step[0] == "repeat" and step[1] is None:
            return "Repeat"
    return None


@given(
    size=st.integers(0, 40),
    indexed=st.lists(IndexedStep, max_size=3),
    iterated=st.lists(IteratorStep, max_size=3),
    data=st.data(),
)
def test_any_chain_has_its_count_as_length_or_says_why_not(
    size: int, indexed: list[tuple[Any, ...]], iterated: list[tuple[Any, ...]], data: st.DataObject
) -> None:
    if sum(step[0] == "shard" for step in indexed) > 1 or sum(step[0] == "repeat" for step in iterated) > 1:
        return  # refused at construction (tests/test_composition.py)
    build = builder(size, indexed, iterated)
    pipe = build()
    expected = culprit(iterated)
    if expected is not None:
        with pytest.raises(TypeError, match=f"^{expected}: "):
            len(pipe)
        return
    length = len(pipe)
    assert count_epoch(pipe) == length
    k = data.draw(st.integers(0, length + 1), label="k")
    before = build()
    take(before, k)
    resumed = restored(build, before.get_state())
    assert count_epoch(resumed) <= len(resumed) == length
    check_epochs(resumed)
