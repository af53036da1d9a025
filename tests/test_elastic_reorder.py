"""Elastic resume of chains that shuffle after the shard: each consumer reads its stride in a
keyed order, so a rescale names what is left through that order (a remap ``Reorder`` step).
Every document of the interrupted epoch is delivered exactly once, over every source kind."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import resumable as rs
from resumable.elastic import rescaled_state
from resumable.order import orders
from resumable.order.elastic import Remap
from resumable.torch import Loader
from tests.sources import INDEXED_KINDS, indexed_source

DOCUMENTS = 103

AFTER_SHARD: dict[str, Callable[[rs.Node], rs.Node]] = {
    "shuffle": lambda p: p.shuffle(5),
    "block_shuffle": lambda p: p.shuffle(5, block_size=4, window=2),
    "map_block_shuffle_shuffle": lambda p: p.map(lambda d: d).shuffle(5, block_size=3).shuffle(9),
}


def records() -> list[dict[str, Any]]:
    return [{"id": i} for i in range(DOCUMENTS)]


def build(source: rs.Node, after: str, consumer: int, consumers: int, repeat: bool = False) -> rs.Node:
    node = AFTER_SHARD[after](source.shuffle(3).shard(consumer, consumers))
    if repeat:
        node = node.repeat(2)
    return node.map(lambda d: d["id"])


def run(source: Callable[[], rs.Node], after: str, topologies: list[int], steps: list[int], repeat: bool) -> Counter:
    """Documents delivered when ``topologies[0]`` consumers start, each reads ``steps[i] +
    consumer`` items (ragged cursors), and the states continue on the next topology."""
    seen: Counter[int] = Counter()
    pipes = [build(source(), after, c, topologies[0], repeat) for c in range(topologies[0])]
    for stage, consumers in enumerate([*topologies[1:], None]):
        states = []
        for c, pipe in enumerate(pipes):
            for _ in range(steps[stage] + c):
                try:
                    seen[next(pipe)] += 1
                except StopIteration:
                    break
            states.append(json.loads(json.dumps(pipe.get_state())))
        if consumers is None:
            for pipe in pipes:
                if not pipe.ended:
                    seen.update(pipe)
            return seen
        pipes = []
        for c in range(consumers):
            pipe = build(source(), after, c, consumers, repeat)
            pipe.set_state(rescaled_state(pipe, states))
            pipes.append(pipe)
    raise AssertionError("unreachable")


@pytest.mark.parametrize("kind", INDEXED_KINDS)
@pytest.mark.parametrize("after", sorted(AFTER_SHARD))
def test_rescales_deliver_each_document_once(kind: str, after: str) -> None:
    data = records()
    source = indexed_source(kind, data)
    seen = run(lambda: source, after, [2, 3, 1, 4], [7, 5, 9, 0], repeat=False)
    assert seen == Counter(range(DOCUMENTS))


@settings(deadline=None, max_examples=25)
@given(
    after=st.sampled_from(sorted(AFTER_SHARD)),
    topologies=st.lists(st.integers(1, 4), min_size=2, max_size=4),
    steps=st.lists(st.integers(0, 40), min_size=4, max_size=4),
    repeat=st.booleans(),
)
def test_drawn_rescales_deliver_each_document_once(
    after: str, topologies: list[int], steps: list[int], repeat: bool
) -> None:
    """With ``.repeat(2)``, old consumers may straddle the epoch boundary."""
    data = records()
    seen = run(lambda: rs.from_list(data), after, topologies, steps, repeat)
    assert seen == Counter({i: 2 if repeat else 1 for i in range(DOCUMENTS)})


@pytest.mark.parametrize("after", sorted(AFTER_SHARD))
def test_rescaled_state_resumes_exactly_mid_way(after: str) -> None:
    data = records()
    olds = [build(rs.from_list(data), after, c, 2) for c in range(2)]
    for c, pipe in enumerate(olds):
        for _ in range(11 + 3 * c):
            next(pipe)
    states = [pipe.get_state() for pipe in olds]
    fresh = build(rs.from_list(data), after, 1, 3)
    fresh.set_state(rescaled_state(fresh, states))
    expected = list(fresh)
    for k in (0, 4, len(expected) - 1, len(expected)):
        pipe = build(rs.from_list(data), after, 1, 3)
        pipe.set_state(rescaled_state(pipe, states))
        head = [next(pipe) for _ in range(k)]
        saved = json.loads(json.dumps(pipe.get_state()))
        for _ in range(2):  # twice from the same state
            again = build(rs.from_list(data), after, 1, 3)
            again.set_state(saved)
            assert head + list(again) == expected


def test_orders_replay_the_nodes_permutations() -> None:
    """The pure orders a remap records equal what the shuffle nodes read, for any stride size."""
    for size in (0, 1, 7, 50, 51):
        for after, node_of in AFTER_SHARD.items():
            pipe = node_of(rs.from_list(list(range(size))))
            chain, node = [], pipe
            while node.upstream is not None:
                if node.kind in ("Shuffle", "BlockShuffle"):
                    chain.append((node.kind, node._config()))
                node = node.upstream
            positions = np.arange(size, dtype=np.int64)
            for epoch in (0, 3):
                replayed = positions
                for order in chain:
                    replayed = orders.take(order, replayed, size, epoch)
                assert replayed.tolist() == pipe._leaf_indices(positions, epoch).tolist(), (after, size, epoch)


def shard_state(state: dict[str, Any]) -> dict[str, Any]:
    while state["kind"] != "Shard":
        state = state["upstream"]
    return state


def test_reorder_step_round_trips_and_bad_ones_are_state_errors() -> None:
    data = records()
    olds = [build(rs.from_list(data), "block_shuffle", c, 2) for c in range(2)]
    next(olds[0])
    new = build(rs.from_list(data), "block_shuffle", 0, 3)
    state = rescaled_state(new, [pipe.get_state() for pipe in olds])
    remap = shard_state(state)["remap"]
    assert Remap.from_json(json.loads(json.dumps(remap)), "test").to_json() == remap
    reorder = remap["steps"][1]
    assert reorder["orders"] == [["BlockShuffle", {"seed": 5, "block_size": 4, "window": 2, "rounds": 6}]]
    for bad in (
        [["Nope", {}]],
        [["Shuffle", {"seed": -1}]],
        [["BlockShuffle", {"seed": 1, "block_size": 0, "window": 2}]],
        [],
    ):
        corrupt = json.loads(json.dumps(state))
        shard_state(corrupt)["remap"]["steps"][1]["orders"] = bad
        target = build(rs.from_list(data), "block_shuffle", 0, 3)
        before = target.get_state()
        with pytest.raises(rs.StateError):
            target.set_state(corrupt)
        assert target.get_state() == before


def test_inspect_names_the_reading_order(tmp_path: Path) -> None:
    from resumable.inspect import describe

    data = records()
    olds = [build(rs.from_list(data), "shuffle", c, 2) for c in range(2)]
    next(olds[1])
    new = build(rs.from_list(data), "shuffle", 0, 3)
    rs.save_state(rescaled_state(new, [pipe.get_state() for pipe in olds]), tmp_path / "rescaled.json")
    text = describe(str(tmp_path / "rescaled.json"))
    assert "read their strides in the order of Shuffle(seed=5, rounds=6)" in text


def loader_build() -> rs.Node:
    return rs.from_list(list(range(DOCUMENTS))).shuffle(2).shard().shuffle(4, block_size=5).batch(4)


@pytest.mark.parametrize(("old_workers", "new_workers", "taken"), [(2, 3, 5), (3, 0, 11)])
def test_loader_on_another_worker_count(old_workers: int, new_workers: int, taken: int) -> None:
    old = Loader(loader_build, num_workers=old_workers)
    iterator = iter(old)
    head = [next(iterator) for _ in range(taken)]
    state = json.loads(json.dumps(old.state_dict()))
    old.close()
    new = Loader(loader_build, num_workers=new_workers)
    new.load_state_dict([state])
    delivered = [int(x) for batch in head + list(new) for x in batch]
    assert sorted(delivered) == list(range(DOCUMENTS))
