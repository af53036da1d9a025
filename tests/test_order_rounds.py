"""Orders keep the rounds they were made with (``resumable.order.lcg``: ``ROUNDS`` now,
``LEGACY_ROUNDS`` before states named them). A state saved by a version whose shuffles made 4
rounds holds no ``rounds`` entry: restored, it finishes its epoch in that order, and the next
epoch is shuffled with this version's rounds, in every node whose order is a permutation (a
shuffle, a block shuffle over fixed or natural blocks, a stream's file order) and in an elastic
rescale of such states. A ``rounds`` this library does not make is a ``StateError``."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Callable

import pytest

import resumable as rs
import resumable.elastic as elastic
from resumable import Node
from resumable.order.lcg import LEGACY_ROUNDS, ROUNDS, ROUNDS_OPTION
from tests.legacy_orders import built, legacy, rounds_in, without_rounds
from tests.resume import roundtrip, take
from tests.sources import indexed_source

N = 40


def records(n: int = N) -> list[dict[str, int]]:
    return [{"id": i} for i in range(n)]


def stream(tmp_path: Path) -> Callable[[], Node[Any]]:
    paths = []
    for file in range(6):
        path = tmp_path / f"part{file}.jsonl"
        path.write_text("".join(f'{{"id": {file * 10 + line}}}\n' for line in range(3)))
        paths.append(str(path))
    return lambda: rs.jsonl_stream(paths, shuffle_files=7)


BUILDS: dict[str, Callable[[Path], Callable[[], Node[Any]]]] = {
    "shuffle": lambda _: lambda: rs.from_list(records()).shuffle(3),
    "block": lambda _: lambda: rs.from_list(records()).shuffle(3, block_size=4, window=3),
    "natural blocks": lambda _: lambda: indexed_source("parquet", records()).shuffle(3),
    "shard then shuffle": lambda _: lambda: rs.from_list(records()).shard(1, 2).shuffle(3),
    "stream files": stream,
}


def ids(items: list[Any]) -> list[int]:
    return [item["id"] for item in items]


@pytest.mark.parametrize("kind", list(BUILDS))
@pytest.mark.parametrize("cut", [0, 1, 7, 17])  # 17: the last but one of the smallest epoch
def test_a_legacy_state_finishes_its_epoch_in_its_order_and_the_next_epoch_takes_this_versions(
    kind: str, cut: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    build = BUILDS[kind](tmp_path)
    fresh = build()
    this_version = [ids(list(fresh)) for _ in range(2)]  # whole epochs 0 and 1
    with monkeypatch.context() as patch:
        legacy(patch)
        old = built(build)
        head = ids(take(old, cut))
        state = without_rounds(roundtrip(old.get_state()))
        rest = ids(list(old))
    assert head + rest != this_version[0] or len(head + rest) < 3  # the two orders differ
    pipe = build()
    pipe.set_state(state)
    assert rounds_in(pipe.get_state()) == {LEGACY_ROUNDS}
    assert ids(list(pipe)) == rest
    assert ids(list(pipe)) == this_version[1]
    assert rounds_in(pipe.get_state()) == {ROUNDS}


@pytest.mark.parametrize("kind", ["shuffle", "block", "stream files"])
def test_a_state_taken_in_the_legacy_rest_of_an_epoch_keeps_its_order_when_restored_again(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    build = BUILDS[kind](tmp_path)
    with monkeypatch.context() as patch:
        legacy(patch)
        old = built(build)
        take(old, 3)
        state = without_rounds(roundtrip(old.get_state()))
        rest = ids(list(old))
    once = build()
    once.set_state(state)
    head = ids(take(once, 4))
    again = build()
    again.set_state(roundtrip(once.get_state()))
    assert head + ids(list(again)) == rest


@pytest.mark.parametrize("value", [5, 0, -4, "4", 4.0, True, None])
def test_rounds_this_library_does_not_make_are_a_state_error_and_leave_the_pipeline_as_it_was(value: Any) -> None:
    pipe = rs.from_list(records()).shuffle(3, block_size=4)
    take(pipe, 5)
    expected = ids(list(copy.copy(pipe)))
    state = roundtrip(pipe.get_state())
    state[ROUNDS_OPTION] = value
    with pytest.raises(rs.StateError, match=ROUNDS_OPTION):
        pipe.set_state(state)
    assert pipe.get_state()[ROUNDS_OPTION] == ROUNDS
    assert ids(list(pipe)) == expected


def legacy_old_ranks(build: Callable[[int, int], Node[Any]], patch: pytest.MonkeyPatch) -> tuple[list[int], list[Any]]:
    """Two old ranks of a legacy version read 7 and 4 records: what they read, their states."""
    seen, olds = [], []
    with patch.context() as legacy_patch:
        legacy(legacy_patch)
        for rank, count in enumerate((7, 4)):
            pipe = built(lambda: build(rank, 2))
            seen.extend(ids(take(pipe, count)))
            olds.append(without_rounds(roundtrip(pipe.get_state())))
    return seen, olds


@pytest.mark.parametrize("block", [False, True])
def test_an_elastic_restore_of_legacy_states_reads_the_rest_of_the_epoch_exactly_once(
    block: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    def build(rank: int, world_size: int) -> Node[Any]:
        sharded = rs.from_list(records()).shard(rank, world_size)
        return sharded.shuffle(5, block_size=3, window=2) if block else sharded.shuffle(5)

    seen, olds = legacy_old_ranks(build, monkeypatch)
    for rank in range(3):
        pipe = build(rank, 3)
        elastic.restore(pipe, olds)
        seen.extend(ids(list(pipe)))
    assert sorted(seen) == list(range(N))


def test_old_consumers_of_different_rounds_are_refused_by_an_elastic_restore(monkeypatch: pytest.MonkeyPatch) -> None:
    def build(rank: int, world_size: int) -> Node[Any]:
        return rs.from_list(records()).shard(rank, world_size).shuffle(5)

    _, olds = legacy_old_ranks(build, monkeypatch)
    newer = build(1, 2)
    take(newer, 4)
    with pytest.raises(rs.StateError, match="different rounds"):
        elastic.restore(build(0, 3), [olds[0], roundtrip(newer.get_state())])
