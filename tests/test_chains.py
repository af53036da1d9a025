"""The resume property over randomly drawn pipelines (hypothesis): every chain of nodes,
every checkpoint point, across epochs and restoring twice in a row."""

from __future__ import annotations

from typing import Any, Callable

from hypothesis import assume, given
from hypothesis import strategies as st

import resumable as rs
from resumable import Node
from tests.resume import check_resume, take

IndexedStep = st.one_of(
    st.tuples(st.just("shuffle"), st.integers(0, 2**40)),
    st.integers(1, 4).flatmap(lambda world: st.tuples(st.just("shard"), st.integers(0, world - 1), st.just(world))),
    st.tuples(st.just("map"), st.integers(1, 7)),
)
IteratorStep = st.one_of(
    st.tuples(st.just("filter"), st.integers(2, 5)),
    st.tuples(st.just("map"), st.integers(1, 7)),
    st.tuples(st.just("batch"), st.integers(1, 5), st.booleans()),
    st.tuples(st.just("repeat"), st.sampled_from([None, 2, 3])),
)


def apply_step(pipe: Node[Any], step: tuple[Any, ...]) -> Node[Any]:
    name = step[0]
    if name == "shuffle":
        return pipe.shuffle(step[1])
    if name == "shard":
        return pipe.shard(step[1], step[2])
    if name == "map":
        factor = step[1]
        return pipe.map(lambda x: _scale(x, factor))
    if name == "filter":
        modulus = step[1]
        return pipe.filter(lambda x: _key(x) % modulus != 0)
    if name == "batch":
        return pipe.batch(step[1], drop_last=step[2])
    return pipe.repeat(step[1])


def _scale(item: Any, factor: int) -> Any:
    return [_scale(x, factor) for x in item] if isinstance(item, list) else item * factor + 1


def _key(item: Any) -> int:
    return sum(_key(x) for x in item) if isinstance(item, list) else int(item)


def builder(size: int, indexed: list[tuple[Any, ...]], iterated: list[tuple[Any, ...]]) -> Callable[[], Node[Any]]:
    def build() -> Node[Any]:
        pipe: Node[Any] = rs.from_list(list(range(size)))
        for step in [*indexed, *iterated]:
            pipe = apply_step(pipe, step)
        return pipe

    return build


@given(
    size=st.integers(0, 60),
    indexed=st.lists(IndexedStep, max_size=3),
    iterated=st.lists(IteratorStep, max_size=3),
    data=st.data(),
)
def test_any_chain_resumes_exactly(size: int, indexed: list, iterated: list, data: st.DataObject) -> None:
    # A second shard or repeat is refused at construction (tests/test_composition.py).
    assume(sum(step[0] == "shard" for step in indexed) <= 1 and sum(step[0] == "repeat" for step in iterated) <= 1)
    build = builder(size, indexed, iterated)
    total = len(take(build(), 150))
    k = data.draw(st.integers(0, total), label="k")
    k2 = data.draw(st.one_of(st.none(), st.integers(k, total)), label="k2")
    check_resume(build, k, total, k2)


def test_shuffle_shard_repeat_map_filter_batch_across_epochs() -> None:
    """The design's example chain, checkpointed at the start, middle and end of an epoch and
    in later epochs, restoring twice in a row."""

    def build() -> Node[Any]:
        return (
            rs.from_list(list(range(101)))
            .shuffle(seed=7)
            .shard(1, 3)
            .repeat()
            .map(lambda x: x * 2)
            .filter(lambda x: x % 3 != 0)
            .batch(4)
        )

    per_epoch = 34 * 2 // 3  # rough: batches per epoch are ~6; exact count does not matter
    total = 40
    for k in (0, 1, per_epoch // 2, 6, 7, 13, 25, total):
        check_resume(build, k, total)
    check_resume(build, 3, total, k2=20)
