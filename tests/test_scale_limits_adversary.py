"""Scale and limits: what a job that runs for weeks over a huge corpus on thousands of GPUs
reaches, simulated cheaply.

Huge epochs come from lazy sequences (``range(10**12)``, a sequence object of ``2**63 - 1``
records, a zero-copy numpy view), so positions past ``2**31``, ``2**32`` and far beyond cost
nothing. Far positions are reached by a state whose cursor ``position`` is set within its range
(``set_state`` validates it: docs/state.md) or by the public ``start_epoch(e)``; what comes out is
checked against the permutation's pure-Python arithmetic (``Permutation.__call__``, Python ints
only), which shares no numpy code with the vectorised path the nodes iterate through. World sizes
go up to ``10**6`` (and int64's largest), epochs to the thousands, millions and past int64, seeds
to ``0``, ``2**63`` and ``2**64 - 1``. Elastic rescales start from 2000 old consumers built in
this process (pipelines with explicit ``.shard(c, C)``, and Loaders as ranks through
``RANK``/``WORLD_SIZE``).
"""

from __future__ import annotations

import itertools
import json
import re
import sys
from typing import Any, Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import resumable as rs
from resumable.elastic import rescaled_state, rescaled_states, restore
from resumable.order.lcg import Permutation
from tests.processes import as_rank
from tests.resume import plain, roundtrip, take

Build = Callable[[], rs.Node[Any]]

TERA = 10**12
INT64_MAX = 2**63 - 1
SEED_MAX = 2**64 - 1


class Huge:
    """A lazy sequence of ``n`` records (record ``i`` is ``i``), any length Python's len() allows."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return range(self.n)[index]
        if not 0 <= index < self.n:
            raise IndexError(index)
        return index


def cursor_of(state: dict[str, Any]) -> dict[str, Any]:
    """The node state holding the iterated cursor (``epoch``/``position``/``length``)."""
    node: Any = state
    while isinstance(node, dict):
        if "position" in node and "length" in node:
            return node
        node = node.get("upstream")
    raise AssertionError(f"no cursor in {state}")


def at(build: Build, position: int, epoch: int | None = None) -> rs.Node[Any]:
    """A fresh pipeline restored to ``position`` (of ``epoch``) of its outermost cursor, from a
    state the library made at position 0 with only the counter set (within its range)."""
    state = roundtrip(build().get_state())
    cursor = cursor_of(state)
    assert 0 <= position <= cursor["length"]
    cursor["position"] = position
    if epoch is not None:
        cursor["epoch"] = epoch
    pipe = build()
    pipe.set_state(state)
    return pipe


def first(pipe: rs.Node[Any], count: int) -> list[Any]:
    return [plain(item) for item in itertools.islice(pipe, count)]


def drain(pipe: rs.Node[Any]) -> list[Any]:
    """The rest of the epoch. Not list(pipe): list() preallocates len(pipe), the whole epoch."""
    return [plain(item) for item in pipe]


def check_exact_resume(build: Build, pipe: rs.Node[Any], k: int, m: int) -> list[Any]:
    """From ``pipe`` (as restored): take k, save through JSON, restore into a fresh pipeline,
    take m, twice in a row; equal to an uninterrupted twin, crossing into the next epoch as a
    training loop does. Returns what ``pipe``'s current epoch yields of those k + 2m items."""
    twin = build()
    twin.set_state(roundtrip(pipe.get_state()))
    epoch = cursor_of(pipe.get_state())["epoch"] if "components" not in pipe.get_state() else None
    within = []
    for item in itertools.islice(twin, k + 2 * m):
        within.append(plain(item))
    expected = within + [plain(item) for item in take(twin, k + 2 * m - len(within))]
    head = [plain(item) for item in take(pipe, k)]
    again = build()
    again.set_state(roundtrip(pipe.get_state()))
    middle = [plain(item) for item in take(again, m)]
    third = build()
    third.set_state(roundtrip(again.get_state()))
    tail = [plain(item) for item in take(third, m)]
    assert head + middle + tail == expected
    assert epoch is None or cursor_of(third.get_state())["epoch"] >= epoch
    return within


def state_size(pipe: rs.Node[Any]) -> int:
    return len(json.dumps(pipe.get_state()))


# --- lazy sources of huge length --------------------------------------------------------------


@pytest.mark.parametrize(
    "records",
    [range(TERA), Huge(INT64_MAX), np.broadcast_to(np.int64(7), (2**40,)), tuple(range(50))],
    ids=["range-1e12", "sequence-int64-max", "numpy-view-2^40", "tuple"],
)
def test_from_list_takes_lazy_sequences_of_any_size_and_reads_them_at_both_ends(records: Any) -> None:
    n = len(records)

    def build() -> rs.Node[Any]:
        return rs.from_list(records).shuffle(SEED_MAX)

    pipe = build()
    assert len(pipe) == n
    state = pipe.get_state()
    assert type(cursor_of(state)["length"]) is int and cursor_of(state)["length"] == n
    perm = Permutation(n, SEED_MAX, 0)
    head = first(pipe, 3)
    assert head == [plain(records[perm(k)]) for k in range(3)]
    end = at(build, n - 2)
    assert first(end, 5) == [plain(records[perm(k)]) for k in (n - 2, n - 1)]
    assert end.get_state()["ended"] is True
    assert len(json.dumps(state)) < 400


def test_a_sequence_whose_len_overflows_is_a_config_error_at_construction() -> None:
    """docs/state.md: rs.from_list(range(2**63)) is a ConfigError (Python's len() stops at
    sys.maxsize). At 5bee5e4 it was built, then len() and iteration raised a bare OverflowError."""
    with pytest.raises(rs.ConfigError, match="FromList"):
        rs.from_list(range(2**63))
    with pytest.raises(rs.ConfigError, match="FromList"):
        rs.from_list(Huge(2**64))
    assert len(rs.from_list(range(INT64_MAX))) == INT64_MAX


# --- the permutation past 2**31, 2**32 and up to int64's largest ------------------------------

SIZES = [2**31 - 1, 2**31 + 5, 2**32 - 1, 2**32, 2**32 + 1, 2**33 + 7, TERA, 2**62 + 3, INT64_MAX]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("seed", [0, 2**63, SEED_MAX])
def test_iteration_agrees_with_pure_python_arithmetic_at_both_ends_of_huge_epochs(n: int, seed: int) -> None:
    """The nodes iterate with numpy words (uint32 up to 2**32 records, uint64 above): any
    wrap-around would show as a difference from the Python-int evaluation."""

    def build() -> rs.Node[Any]:
        return rs.from_list(range(n)).shuffle(seed)

    perm = Permutation(n, seed, 0)
    epoch3 = Permutation(n, seed, 3)
    for position in (0, n // 2 - 1, n - 5):
        pipe = at(build, position)
        got = first(pipe, 4)
        assert got == [perm(k) for k in range(position, position + 4)]
        assert all(0 <= x < n for x in got)
        assert [pipe.record_at(0, k) for k in range(position, position + 4)] == got
        assert [pipe.record_at(3, k) for k in range(position, position + 2)] == [epoch3(position), epoch3(position + 1)]
    taken = Permutation(n, seed, 0).take(np.array([0, n - 1, n // 3], dtype=np.int64)).tolist()
    assert taken == [perm(0), perm(n - 1), perm(n // 3)]
    end = at(build, n - 3)
    assert check_exact_resume(build, end, 1, 1) == [perm(n - 3), perm(n - 2), perm(n - 1)]


@pytest.mark.parametrize("n", [2**31 + 5, 2**32 + 1, TERA])
def test_the_last_item_and_the_step_after_it_of_a_huge_epoch_resume_exactly(n: int) -> None:
    def build() -> rs.Node[Any]:
        return rs.from_list(range(n)).shuffle(9).shard(1, 3).map(lambda x: x * 2)

    stride = (n - 1 + 2) // 3
    pipe = at(build, stride - 1)
    assert len(pipe) == stride
    last = first(pipe, 1)
    assert last == [2 * Permutation(n, 9, 0)(1 + (stride - 1) * 3)]
    after_last = roundtrip(pipe.get_state())
    assert drain(pipe) == []
    after_stop = roundtrip(pipe.get_state())
    assert after_stop["ended"] is True
    next_epoch = first(pipe, 2)
    perm1 = Permutation(n, 9, 1)
    assert next_epoch == [2 * perm1(1), 2 * perm1(4)]
    resumed = build()
    resumed.set_state(after_last)  # after the last item: the loop ends empty, then the next epoch
    assert drain(resumed) == []
    assert first(resumed, 2) == next_epoch
    resumed = build()
    resumed.set_state(after_stop)  # after the StopIteration: the next loop is the next epoch
    assert first(resumed, 2) == next_epoch
    assert resumed.get_state()["epoch"] == 1


# --- shards over world sizes of 10**4 .. 10**6 and int64's largest ---------------------------


@pytest.mark.parametrize("world_size", [3, 10**4, 10**5, 10**6])
def test_shards_of_a_huge_epoch_read_their_strides_of_the_permutation(world_size: int) -> None:
    n, seed = TERA + 7, 2**63
    perm = Permutation(n, seed, 0)
    for rank in (0, world_size // 2, world_size - 1):

        def build(rank: int = rank) -> rs.Node[Any]:
            return rs.from_list(range(n)).shuffle(seed).shard(rank, world_size)

        stride = -(-(n - rank) // world_size)
        pipe = build()
        assert len(pipe) == stride
        assert first(pipe, 2) == [perm(rank), perm(rank + world_size)]
        for position in [p for p in (2**31 + 1, 2**32 + 3) if p < stride - 3] + [stride - 2]:
            restored = at(build, position)
            items = check_exact_resume(build, restored, 1, 1)
            assert items == [perm(rank + p * world_size) for p in range(position, min(position + 3, stride))]
        state = build().get_state()
        assert len(json.dumps(state)) < 400


def test_int64_largest_world_size_gives_each_record_to_its_own_rank() -> None:
    n = TERA
    perm = Permutation(n, 4, 0)
    for rank, expected in ((0, [perm(0)]), (n - 1, [perm(n - 1)]), (n, []), (INT64_MAX - 1, [])):
        pipe = rs.from_list(range(n)).shuffle(4).shard(rank, INT64_MAX)
        assert len(pipe) == len(expected)
        assert list(pipe) == expected
        state = roundtrip(pipe.get_state())
        again = rs.from_list(range(n)).shuffle(4).shard(rank, INT64_MAX)
        again.set_state(state)  # taken after the StopIteration: the next loop is epoch 1
        assert list(again) == ([Permutation(n, 4, 1)(rank)] if expected else [])
        assert again.get_state()["epoch"] == 1
    for bad in (INT64_MAX + 1, 2**64):
        with pytest.raises(rs.ConfigError, match="world_size"):
            rs.from_list(range(n)).shard(0, bad)


def test_seven_records_over_twenty_thousand_consumers_each_once_most_empty() -> None:
    world_size = 2 * 10**4
    seen: list[int] = []
    nonempty = 0
    for rank in range(world_size):
        pipe = rs.from_list(range(7)).shuffle(1).shard(rank, world_size)
        items = list(pipe)
        nonempty += bool(items)
        assert len(items) == (1 if rank < 7 else 0)
        seen.extend(items)
    assert sorted(seen) == list(range(7)) and nonempty == 7
    # An epoch in the millions, on 10**4 consumers: still each record once.
    later: list[int] = []
    for rank in range(10**4):
        pipe = rs.from_list(range(7)).shuffle(1).shard(rank, 10**4)
        pipe.start_epoch(10**6)
        later.extend(pipe)
    assert sorted(later) == list(range(7))
    assert later == [Permutation(7, 1, 10**6)(k) for k in range(7)]


@pytest.mark.parametrize(("how", "n", "world_size"), [("shuffle", 3 * 10**4, 3 * 10**3), ("block", 10**4, 10**3)])
def test_ten_records_each_over_thousands_of_consumers_partition_exactly(how: str, n: int, world_size: int) -> None:

    def build(rank: int) -> rs.Node[Any]:
        source = rs.from_list(range(n))
        ordered = source.shuffle(SEED_MAX) if how == "shuffle" else source.shuffle(SEED_MAX, block_size=64, window=3)
        return ordered.shard(rank, world_size)

    seen: list[int] = []
    lengths = []
    for rank in range(world_size):
        pipe = build(rank)
        lengths.append(len(pipe))
        seen.extend(pipe)
    assert sorted(seen) == list(range(n))
    assert set(lengths) == {10}


# --- block shuffle over a huge epoch ----------------------------------------------------------


@pytest.mark.parametrize(("block_size", "window"), [(4096, 4), (2**40, 2**20), (1, 2**62), (2**61, 3), (TERA, 1)])
def test_block_shuffle_of_a_huge_epoch_at_both_ends(block_size: int, window: int) -> None:
    n = TERA

    def build() -> rs.Node[Any]:
        return rs.from_list(range(n)).shuffle(SEED_MAX, block_size=block_size, window=window)

    pipe = build()
    assert len(pipe) == n
    head = first(pipe, 64)
    end = at(build, n - 64)
    tail = first(end, 100)
    assert len(tail) == 64
    both = head + tail
    assert len(set(both)) == 128 and all(0 <= x < n for x in both)
    assert [end.record_at(0, k) for k in (0, n - 1)] == [head[0], tail[-1]]
    middle = at(build, n // 2 + 3)
    check_exact_resume(build, middle, 3, 4)
    assert state_size(middle) < 400


def test_block_size_times_window_past_int64_is_a_config_error() -> None:
    with pytest.raises(rs.ConfigError, match="block_size"):
        rs.from_list(range(10)).shuffle(0, block_size=2**62, window=2)
    with pytest.raises(rs.ConfigError, match="window"):
        rs.from_list(range(10)).shuffle(0, block_size=4, window=2**63)


# --- seeds at their extremes ------------------------------------------------------------------


def test_seeds_at_zero_two_to_the_63_and_the_largest_are_their_own_orders_and_resume() -> None:
    n = 2**32 + 9
    orders = {}
    for seed in (0, 1, 2**63, 2**63 + 1, SEED_MAX - 1, SEED_MAX, np.uint64(SEED_MAX)):
        for name, build in {
            "shuffle": lambda seed=seed: rs.from_list(range(n)).shuffle(seed),
            "block": lambda seed=seed: rs.from_list(range(n)).shuffle(seed, block_size=1000, window=2),
            "mix": lambda seed=seed: rs.mix(
                {"a": rs.from_list(range(n)).shuffle(seed), "b": rs.from_list(range(5)).shuffle(seed)},
                weights={"a": 0.5, "b": 0.5},
                seed=seed,
            ),
        }.items():
            pipe = at(build, 2**32 + 1) if name != "mix" else build()
            state = pipe.get_state()
            text = json.dumps(state)
            assert f'"seed": {int(seed)}' in text, "seeds are saved as plain ints"
            orders[(name, int(seed))] = tuple(check_exact_resume(build, pipe, 3, 3))
    for name in ("shuffle", "block", "mix"):
        distinct = {orders[(name, seed)] for seed in (0, 1, 2**63, 2**63 + 1, SEED_MAX - 1, SEED_MAX)}
        assert len(distinct) == 6, f"{name}: every seed is its own order"
    for bad in (2**64, -1, np.int64(-1)):
        with pytest.raises(rs.ConfigError, match="seed"):
            rs.from_list(range(3)).shuffle(bad)


# --- epochs in the thousands, millions and near the limits ------------------------------------


def tokens(x: int) -> dict[str, Any]:
    return {"input_ids": [x % 97 + 1] * (1 + x % 5)}


CHAINS: dict[str, Build] = {
    "shuffle-shard": lambda: rs.from_list(range(TERA)).shuffle(3).shard(2, 5),
    "block-after-shard": lambda: rs.from_list(range(TERA)).shard(2, 5).shuffle(3, block_size=7, window=3),
    "filter-batch-repeat": lambda: (
        rs.from_list(range(TERA)).shuffle(3).shard(2, 5).filter(lambda x: x % 3).batch(4).repeat(2)
    ),
    "pack": lambda: (
        rs.from_list(range(TERA))
        .shuffle(3)
        .shard(2, 5)
        .map(tokens)
        .pack(seq_len=12, strategy="best_fit", buffer_size=8)
    ),
    "mix": lambda: rs.mix(
        {"a": rs.from_list(range(TERA)).shuffle(3).shard(2, 5), "b": rs.from_list(range(10**9)).shuffle(4).shard(2, 5)},
        weights={"a": 0.6, "b": 0.4},
        seed=5,
    ),
}


@pytest.mark.parametrize("name", list(CHAINS))
@pytest.mark.parametrize("epoch", [1000, 10**6, 2**32 + 1, 2**62])
def test_epochs_in_the_thousands_and_beyond_read_their_own_order_and_resume(name: str, epoch: int) -> None:
    build = CHAINS[name]
    pipe = build()
    pipe.start_epoch(epoch)
    items = check_exact_resume(build, pipe, 3, 2)
    fresh = build()
    fresh.start_epoch(epoch)
    assert first(fresh, len(items)) == items
    assert f'"epoch": {epoch}' in json.dumps(pipe.get_state())
    other = build()
    other.start_epoch(epoch - 1)
    assert first(other, len(items)) != items
    if name == "shuffle-shard":
        perm = Permutation(TERA, 3, epoch)
        assert items == [perm(2 + 5 * k) for k in range(len(items))]
    assert state_size(pipe) < 1500


def test_an_edited_epoch_in_the_millions_continues_that_epochs_order_then_the_next() -> None:
    n = 2**33 + 1

    def build() -> rs.Node[Any]:
        return rs.from_list(range(n)).shuffle(2).shard(1, 4).batch(3).repeat(3)

    pipe = build()
    stride = 2**31  # consumer 1 of 4 over 2**33 + 1 records
    assert len(pipe) == 3 * -(-stride // 3)
    next(iter(pipe))
    state = roundtrip(pipe.get_state())
    cursor = cursor_of(state)
    cursor["epoch"], cursor["position"] = 10**6, cursor["length"] - 4
    resumed = build()
    resumed.set_state(state)
    perm = Permutation(n, 2, 10**6)
    assert cursor["length"] == stride
    ends = [perm(1 + 4 * k) for k in range(stride - 4, stride)]
    following = Permutation(n, 2, 10**6 + 1)
    assert first(resumed, 3) == [ends[:3], ends[3:], [following(1), following(5), following(9)]]
    check_exact_resume(build, resumed, 1, 1)


@pytest.mark.parametrize("epoch", [2**62 + 1, 2**63, 2**64, 2**64 + 1])
def test_an_epoch_past_the_last_is_refused_and_changes_nothing(epoch: int) -> None:
    """docs/state.md: epochs run from 0 to 2**62. Past it, start_epoch is a ConfigError and a
    state a StateError, leaving the pipeline as it was. At 5bee5e4 both were accepted and epoch
    2**64 silently read epoch 0's order again (the key takes the epoch's low 64 bits)."""

    def build() -> rs.Node[Any]:
        return rs.from_list(range(10**6)).shuffle(7).shard(1, 3)

    pipe = build()
    first(pipe, 2)
    before = roundtrip(pipe.get_state())
    with pytest.raises(rs.ConfigError, match="epoch"):
        pipe.start_epoch(epoch)
    state = roundtrip(pipe.get_state())
    cursor_of(state)["epoch"] = epoch
    with pytest.raises(rs.StateError, match="epoch"):
        pipe.set_state(state)
    assert roundtrip(pipe.get_state()) == before
    twin = build()
    twin.set_state(before)
    assert first(pipe, 5) == first(twin, 5)


@pytest.mark.parametrize("name", ["shuffle", "pack", "mix"])
def test_the_last_epoch_resumes_and_iterating_past_it_is_a_state_error(name: str) -> None:
    """Epoch 2**62 itself runs and resumes exactly; the loop after it raises StateError (docs:
    "next_epoch() (or iterating on) past the last"). At 5bee5e4 a packer went on into epoch 2**63
    and handed out states its own set_state refused ('refs needs base, scale and bits')."""
    builds: dict[str, Build] = {
        "shuffle": lambda: rs.from_list(range(40)).shuffle(3).shard(1, 2),
        "pack": lambda: rs.from_list(range(40)).shuffle(3).shard(1, 2).map(tokens).pack(seq_len=8, buffer_size=4),
        "mix": lambda: rs.mix(
            {"a": rs.from_list(range(20)).shuffle(1).shard(1, 2), "b": rs.from_list(range(9)).shuffle(2).shard(1, 2)},
            weights={"a": 0.5, "b": 0.5},
            on_end="drop",
        ),
    }
    build = builds[name]
    last = 2**62
    pipe = build()
    pipe.start_epoch(last)
    head = first(pipe, 2)
    state = roundtrip(pipe.get_state())
    resumed = build()
    resumed.set_state(state)
    rest = drain(resumed)
    twin = build()
    twin.start_epoch(last)
    assert head + rest == drain(twin)
    with pytest.raises(rs.StateError, match="epoch"):
        first(resumed, 1)


# --- len() of every node at these sizes -----------------------------------------------------


def test_len_of_every_known_length_node_at_huge_sizes() -> None:
    n, world = TERA + 3, 10**6
    stride = -(-(n - 17) // world)
    base = rs.from_list(range(n))
    assert len(base) == n
    assert len(rs.from_list(range(n)).shuffle(SEED_MAX)) == n
    assert len(rs.from_list(range(n)).shuffle(1, block_size=4096, window=8)) == n
    sharded = rs.from_list(range(n)).shuffle(1).shard(17, world)
    assert len(sharded) == stride
    assert len(rs.from_list(range(n)).shuffle(1).shard(17, world).map(str)) == stride
    assert len(rs.from_list(range(n)).shuffle(1).shard(17, world).batch(7)) == -(-stride // 7)
    assert len(rs.from_list(range(n)).shuffle(1).shard(17, world).batch(7, drop_last=True)) == stride // 7
    assert len(rs.from_list(range(n)).shuffle(1).shard(17, world).batch(7).repeat(10**6)) == 10**6 * -(-stride // 7)
    assert len(rs.from_list(range(n)).shuffle(1).shard(17, world).prefetch(2)) == stride
    mixed = rs.mix(
        {"a": rs.from_list(range(n)).shuffle(1).shard(17, world), "b": rs.from_list(range(2**40)).shuffle(2)},
        weights={"a": 1.0, "b": 2.0},
        on_end="drop",
    )
    assert len(mixed) == stride + 2**40
    assert len(rs.from_list(Huge(INT64_MAX)).batch(1)) == INT64_MAX
    with pytest.raises(TypeError, match="Filter"):
        len(rs.from_list(range(n)).filter(bool).batch(2))


@pytest.mark.parametrize(
    "build",
    [
        lambda: rs.from_list(range(TERA)).repeat(10**7),
        lambda: rs.from_list(Huge(INT64_MAX)).batch(1).repeat(2),
        lambda: rs.from_list(range(TERA)).shuffle(1).shard(0, 3).batch(8).repeat(10**9),
    ],
    ids=["repeat-1e7", "batch-repeat-int64", "shard-batch-repeat-1e9"],
)
def test_len_past_sys_maxsize_is_a_typed_error_naming_the_node(build: Build) -> None:
    """docs/state.md: a TypeError naming the node, as an unknown length is. At 5bee5e4 it was a
    bare OverflowError from CPython ('cannot fit int into an index-sized integer')."""
    pipe = build()
    assert len(pipe.upstream) <= sys.maxsize  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Repeat"):
        len(pipe)


def test_the_rest_of_a_huge_epoch_after_a_restore_near_its_end_by_a_loop_or_islice() -> None:
    """docs/state.md: list(pipe) preallocates len(pipe), the whole epoch also after a restore near
    its end (a MemoryError over 10**12 records); take the rest with a loop or islice instead."""

    def build() -> rs.Node[Any]:
        return rs.from_list(range(TERA)).shuffle(3).shard(0, 2).batch(3)

    perm = Permutation(TERA, 3, 0)
    stride = TERA // 2
    left = [perm(2 * k) for k in range(stride - 5, stride)]
    assert [x for x in at(build, stride - 5)] == [left[:3], left[3:]]
    assert list(itertools.islice(at(build, stride - 5), 10)) == [left[:3], left[3:]]
    assert list(rs.from_list(range(7)).shuffle(3)) == [Permutation(7, 3, 0)(k) for k in range(7)]


# --- packed references at huge positions ------------------------------------------------------


@pytest.mark.parametrize("strategy", ["greedy", "first_fit", "best_fit"])
@pytest.mark.parametrize("position", [2**31 + 5, 2**32 + 5, 10**11 - 40])
def test_packer_buffers_at_positions_past_32_bits_resume_exactly_and_stay_small(strategy: str, position: int) -> None:
    def build() -> rs.Node[Any]:
        return (
            rs.from_list(range(TERA))
            .shuffle(SEED_MAX)
            .shard(3, 10)
            .map(tokens)
            .pack(seq_len=16, strategy=strategy, buffer_size=16)
            .batch(2)
        )

    pipe = at(build, position)
    items = check_exact_resume(build, pipe, 2, 2)
    assert items
    assert state_size(pipe) < 2500
    if position > 10**10:  # the stride's last records: the rest of the epoch, then nothing
        rest = drain(pipe)
        assert len(items) + len(rest) < 12 and pipe.get_state()["ended"] is True


# --- elastic rescale from thousands of consumers ---------------------------------------------


def old_job(
    build: Callable[[int, int], rs.Node[Any]], world_size: int, takes: Callable[[int], int]
) -> tuple[list[Any], list[Any]]:
    """Every consumer of an old job: reads takes(c) items, saves through JSON."""
    states, consumed = [], []
    for consumer in range(world_size):
        pipe = build(consumer, world_size)
        consumed.extend(plain(item) for item in itertools.islice(pipe, takes(consumer)))
        states.append(roundtrip(pipe.get_state()))
    return states, consumed


@pytest.mark.parametrize("new_world", [1, 3, 7, 503])
def test_two_thousand_consumers_of_a_tiny_source_rescale_each_record_once(new_world: int) -> None:
    n, old_world = 5000, 2000

    def build(consumer: int, world_size: int) -> rs.Node[Any]:
        return rs.from_list(range(n)).shuffle(11).shard(consumer, world_size).batch(2)

    olds, consumed = old_job(build, old_world, lambda c: (c * 7) % 3)
    pipes = [build(j, new_world) for j in range(new_world)]
    states = rescaled_states(pipes, olds)
    delivered: list[int] = []
    for pipe, state in zip(pipes, states):
        assert len(json.dumps(state)) < 2048, "a new consumer's state keeps only its share"
        pipe.set_state(roundtrip(state))
        delivered.extend(x for batch in pipe for x in plain(batch))
    flat = [x for batch in consumed for x in batch]
    assert sorted(flat + delivered) == list(range(n))
    # The next epoch is the new topology's own, whole.
    after = [x for pipe in pipes for batch in pipe for x in plain(batch)]
    assert sorted(after) == list(range(n))
    fresh = [x for j in range(new_world) for batch in build(j, new_world) for x in plain(batch)]
    fresh_epoch_1 = []
    for j in range(new_world):
        pipe = build(j, new_world)
        pipe.start_epoch(1)
        fresh_epoch_1.extend(x for batch in pipe for x in plain(batch))
    assert after == fresh_epoch_1 and sorted(fresh) == list(range(n))


def test_two_thousand_consumers_of_a_huge_epoch_rescale_their_band_once_with_small_states() -> None:
    n, old_world, new_world, seed = TERA, 2000, 3, 2**63 + 5
    perm = Permutation(n, seed, 0)

    def build(consumer: int, world_size: int) -> rs.Node[Any]:
        return rs.from_list(range(n)).shuffle(seed).shard(consumer, world_size)

    olds, consumed = old_job(build, old_world, lambda c: (c * 37) % 50)
    top = max(cursor_of(state)["position"] for state in olds)
    band_end = top * old_world  # every position below it was read or is in the band
    pipes = [build(j, new_world) for j in range(new_world)]
    states = rescaled_states(pipes, olds)
    sizes = [len(json.dumps(state)) for state in states]
    band = band_end - len(consumed)
    assert max(sizes) < 64 * 1024, f"shares of a {band}-position band: {sizes}"
    delivered: list[int] = []
    share = -(-band // new_world) + 2
    for j, (pipe, state) in enumerate(zip(pipes, states)):
        pipe.set_state(roundtrip(state))
        assert len(pipe) == -(-(n - len(consumed) - j) // new_world)
        delivered.extend(first(pipe, share))
        assert state_size(pipe) < 1024, "past the band the remap compacts to offsets"
    assert sum(len(pipe) for pipe in pipes) == n - len(consumed)
    union = consumed + delivered
    assert len(set(union)) == len(union), "nothing read twice"
    below = set(perm.take(np.arange(band_end, dtype=np.int64)).tolist())
    assert below <= set(union), "every position below the fastest cursor once"
    # What the new consumers read past the band is the tail, in their strides.
    past = [x for x in delivered if x not in below]
    tail = set(perm.take(np.arange(band_end, band_end + 3 * share, dtype=np.int64)).tolist())
    assert set(past) <= tail
    # A new consumer restored from its compacted state continues exactly.
    again = build(1, new_world)
    again.set_state(roundtrip(pipes[1].get_state()))
    assert first(again, 5) == first(pipes[1], 5)


@pytest.mark.parametrize(("n", "epoch"), [(2**62, 0), (100, 2**62), (TERA, 10**6), (2**62 + 10, 0), (INT64_MAX, 0)])
def test_rescale_of_huge_epochs_works_up_to_the_documented_limit_and_is_refused_past_it(n: int, epoch: int) -> None:
    """docs/elastic.md: an epoch rescales when it holds at most 2**62 positions and its number is
    at most 2**62; past that, rescaled_state raises StateError naming the limit before any state
    is made, and the same consumers still resume as always. At 5bee5e4, past it, rescaled_state
    returned a state its own pipeline refused ('remap step ... is not a level or an offset'), or
    near int64's largest length ``shard_sizes`` wrapped around and blamed a valid cursor ('consumer
    0 of 4 is at position 1, its shard has -2305843009213693952')."""

    def build(consumer: int, world_size: int) -> rs.Node[Any]:
        return rs.from_list(range(n)).shuffle(5).shard(consumer, world_size)

    olds, heads = [], []
    for consumer in range(4):
        pipe = build(consumer, 4)
        pipe.start_epoch(epoch)
        heads.append(first(pipe, consumer + 1))
        olds.append(roundtrip(pipe.get_state()))
    new = build(0, 3)
    if n > 2**62:
        with pytest.raises(rs.StateError, match="4,611,686,018,427,387,904") as refused:
            rescaled_state(new, olds)
        assert not re.search(r"-\d", str(refused.value)), "no wrapped-around number"
        for consumer, state in enumerate(olds):  # the same topology resumes as always
            same = build(consumer, 4)
            same.set_state(state)
            twin = build(consumer, 4)
            twin.start_epoch(epoch)
            assert first(same, 2) == first(twin, consumer + 3)[consumer + 1 :]
        return
    delivered = []
    for j in range(3):
        new = build(j, 3)
        new.set_state(roundtrip(rescaled_state(new, olds)))
        assert new.get_state()["epoch"] == epoch
        delivered.extend(first(new, 4))
    read = [x for head in heads for x in head]
    assert len(set(read + delivered)) == len(read + delivered) and all(0 <= x < n for x in delivered)
    perm = Permutation(n, 5, epoch)
    top = max(len(head) for head in heads)
    band = {perm(c + k * 4) for c in range(4) for k in range(len(heads[c]), top)}
    assert band <= set(delivered), "the band comes first, each position once"


def test_two_thousand_consumers_near_the_end_of_a_huge_epoch_rescale_what_is_left_exactly_once() -> None:
    """Old cursors 10**9 strides deep (positions past 2**40 of the epoch), 1 to 50 records
    before their ends: the new consumers read exactly the positions left, whatever their count."""
    n, old_world, seed = TERA + 999, 2000, SEED_MAX
    perm = Permutation(n, seed, 0)

    def build(consumer: int, world_size: int) -> rs.Node[Any]:
        return rs.from_list(range(n)).shuffle(seed).shard(consumer, world_size)

    olds, left = [], []
    for consumer in range(old_world):
        state = roundtrip(build(consumer, old_world).get_state())
        stride = state["length"]
        cursor = stride - 1 - (consumer * 37) % 50
        state["position"] = cursor
        olds.append(state)
        left.extend(range(consumer + cursor * old_world, n, old_world))
    expected = sorted(perm.take(np.array(left, dtype=np.int64)).tolist())
    for new_world in (3, 1000):
        pipes = [build(j, new_world) for j in range(new_world)]
        states = rescaled_states(pipes, olds)
        assert max(len(json.dumps(state)) for state in states) < 8192
        delivered: list[int] = []
        for pipe, state in zip(pipes, states):
            pipe.set_state(roundtrip(state))
            assert len(pipe) == -(-(len(left) - pipes.index(pipe)) // new_world)
            delivered.extend(drain(pipe))
        assert sorted(delivered) == expected
    for consumer, count in ((0, 1), (len(left) - 1, 1), (len(left), 0), (10**6 - 1, 0)):
        pipe = build(consumer, 10**6)
        restore(pipe, olds)
        assert len(pipe) == count
        items = drain(pipe)
        assert len(items) == count and set(items) <= set(expected)


def test_two_thousand_loader_ranks_rescale_to_three_each_record_once_and_misuse_is_typed() -> None:
    from resumable.torch import Loader

    n, old_world = 3000, 2000

    def build() -> rs.Node[Any]:
        return rs.from_list(list(range(n))).shuffle(seed=2).shard().batch(2)

    def loader() -> Any:
        return Loader(build, num_workers=0, collate_fn=lambda batch: batch)

    olds, consumed = [], []
    for rank in range(old_world):
        with as_rank(rank, old_world):
            old = loader()
            iterator = iter(old)
            for _ in range(rank % 2):
                consumed.extend(next(iterator))
            olds.append(json.loads(json.dumps(old.state_dict())))
    assert max(len(json.dumps(state)) for state in olds) < 2048

    swapped = list(olds)
    swapped[1000], swapped[1001] = swapped[1001], swapped[1000]
    duplicated = [*olds[:999], olds[1000], *olds[1000:]]
    misuses = {
        "missing the last": olds[:-1],
        "swapped": swapped,
        "duplicated": duplicated,
        "one extra": [*olds, olds[0]],
    }
    delivered: list[int] = []
    for rank in range(3):
        with as_rank(rank, 3):
            new, twin = loader(), loader()
            twin.load_state_dict(olds)
            for name, misuse in misuses.items():
                with pytest.raises(rs.StateError):
                    new.load_state_dict(misuse)
            new.load_state_dict(olds)
            mine = [x for batch in new for x in batch]
            assert mine == [x for batch in twin for x in batch]
            delivered.extend(mine)
    assert sorted(consumed + delivered) == list(range(n))


def test_two_thousand_old_states_with_one_from_another_checkpoint_are_refused_and_change_nothing() -> None:
    n, old_world = 4000, 2000

    def build(consumer: int, world_size: int, seed: int = 11) -> rs.Node[Any]:
        return rs.from_list(range(n)).shuffle(seed).shard(consumer, world_size)

    olds, _ = old_job(build, old_world, lambda c: c % 2)
    far_epoch = [dict(state) for state in olds]
    far_epoch[1234] = dict(olds[1234], epoch=2)
    other_seed = list(olds)
    other_seed[7] = roundtrip(build(7, old_world, seed=12).get_state())
    other_world = list(olds)
    other_world[1999] = roundtrip(build(1999, 2001).get_state())
    target = build(0, 5)
    first(target, 1)
    before = roundtrip(target.get_state())
    for misuse in (far_epoch, other_seed, other_world, olds[:1999], olds[1:]):
        with pytest.raises(rs.StateError):
            restore(target, misuse)
        assert roundtrip(target.get_state()) == before
    twin = build(0, 5)
    twin.set_state(before)
    assert first(target, 10) == first(twin, 10)


# --- any size, seed, epoch and position at once -----------------------------------------------


@settings(max_examples=12, deadline=None)
@given(
    n=st.integers(1, INT64_MAX),
    seed=st.integers(0, SEED_MAX),
    epoch=st.integers(0, 2**62 - 1),
    world_size=st.integers(1, 10**6),
    data=st.data(),
)
def test_any_size_seed_epoch_and_far_position_reads_the_arithmetic_and_resumes(
    n: int, seed: int, epoch: int, world_size: int, data: st.DataObject
) -> None:
    rank = data.draw(st.integers(0, world_size - 1), label="rank")
    stride = -(-(n - rank) // world_size) if rank < n else 0
    position = data.draw(st.integers(0, stride), label="position")

    def build() -> rs.Node[Any]:
        return rs.from_list(range(n)).shuffle(seed).shard(rank, world_size)

    pipe = at(build, position, epoch)
    assert len(pipe) == stride
    perm = Permutation(n, seed, epoch)
    expected = [perm(rank + p * world_size) for p in range(position, min(position + 4, stride))]
    assert check_exact_resume(build, pipe, 2, 1) == expected
    assert state_size(pipe) < 500


@pytest.mark.parametrize(
    ("entry", "value"),
    [("position", TERA // 3 + 1), ("position", 2**63), ("length", TERA), ("epoch", 2**64), ("epoch", -1)],
)
def test_counters_out_of_range_at_huge_sizes_are_state_errors_and_change_nothing(entry: str, value: int) -> None:
    def build() -> rs.Node[Any]:
        return rs.from_list(range(TERA)).shuffle(1).shard(2, 3)

    pipe = at(build, 2**33)
    before = roundtrip(pipe.get_state())
    state = roundtrip(pipe.get_state())
    state[entry] = value
    with pytest.raises(rs.StateError, match="Shard"):
        pipe.set_state(state)
    assert roundtrip(pipe.get_state()) == before
    twin = build()
    twin.set_state(before)
    assert first(pipe, 3) == first(twin, 3)


# --- more consumers: packers, streams, DataLoader workers --------------------------------------


def row_tokens(row: dict[str, Any]) -> list[int]:
    return [token for token in row["input_ids"].tolist() if token != 0]


def test_a_thousand_packers_rescale_to_three_then_back_to_a_thousand_each_token_once() -> None:
    n = 10**4

    def build(consumer: int, world_size: int) -> rs.Node[Any]:
        documents = rs.from_list(range(n)).shuffle(3).shard(consumer, world_size).map(tokens)
        return documents.pack(seq_len=8, strategy="best_fit", buffer_size=4)

    seen: list[int] = []
    olds = []
    for consumer in range(1000):
        pipe = build(consumer, 1000)
        for row in itertools.islice(pipe, consumer % 3):
            seen.extend(row_tokens(row))
        olds.append(roundtrip(pipe.get_state()))
    assert max(len(json.dumps(state)) for state in olds) < 2048
    middles = []
    pipes = [build(j, 3) for j in range(3)]
    for pipe, state in zip(pipes, rescaled_states(pipes, olds)):
        assert len(json.dumps(state)) < 32 * 1024
        pipe.set_state(roundtrip(state))
        for row in itertools.islice(pipe, 300):
            seen.extend(row_tokens(row))
        middles.append(roundtrip(pipe.get_state()))
    pipes = [build(j, 1000) for j in range(1000)]
    for pipe, state in zip(pipes, rescaled_states(pipes, middles)):
        pipe.set_state(roundtrip(state))
        for row in pipe:
            seen.extend(row_tokens(row))
    expected = sorted(token for x in range(n) for token in tokens(x)["input_ids"])
    assert sorted(seen) == expected


def test_a_stream_of_five_files_over_a_thousand_consumers_rescales_each_record_once(tmp_path: Any) -> None:
    for f in range(5):
        lines = "".join(json.dumps({"i": f * 100 + i}) + "\n" for i in range(20))
        (tmp_path / f"part{f}.jsonl").write_text(lines)

    def build(consumer: int, world_size: int) -> rs.Node[Any]:
        return rs.jsonl_stream(str(tmp_path / "*.jsonl"), shuffle_files=SEED_MAX, rank=consumer, world_size=world_size)

    seen: list[int] = []
    olds = []
    for consumer in range(1000):
        pipe = build(consumer, 1000)
        items = [record["i"] for record in itertools.islice(pipe, consumer % 4)]
        assert consumer < 5 or items == []
        seen.extend(items)
        olds.append(roundtrip(pipe.get_state()))
    pipes = [build(j, 3) for j in range(3)]
    for pipe, state in zip(pipes, rescaled_states(pipes, olds)):
        assert len(json.dumps(state)) < 2048
        pipe.set_state(roundtrip(state))
        seen.extend(record["i"] for record in pipe)
    assert sorted(seen) == [f * 100 + i for f in range(5) for i in range(20)]


def test_loader_workers_of_the_last_rank_of_a_million_read_their_strides_and_resume() -> None:
    from resumable.torch import Loader

    def build() -> rs.Node[Any]:
        return rs.from_list(range(TERA)).shuffle(SEED_MAX).shard().batch(2)

    rank, world_size, workers = 10**6 - 1, 10**6, 2
    perm = Permutation(TERA, SEED_MAX, 0)
    consumers = world_size * workers
    with as_rank(rank, world_size):
        loader = Loader(build, num_workers=workers, collate_fn=lambda batch: batch)
        try:
            with pytest.raises(TypeError):
                len(loader)
            iterator = iter(loader)
            head = [next(iterator) for _ in range(4)]
            for worker in range(workers):
                own = [perm(rank * workers + worker + j * consumers) for j in range(4)]
                assert head[worker] + head[worker + 2] == own, "batches alternate between the workers"
            state = json.loads(json.dumps(loader.state_dict()))
            assert len(json.dumps(state)) < 4096
            resumed = Loader(build, num_workers=workers, collate_fn=lambda batch: batch)
            try:
                resumed.load_state_dict(state)
                assert list(itertools.islice(iter(resumed), 3)) == [next(iterator) for _ in range(3)]
            finally:
                resumed.close()
        finally:
            loader.close()


def test_loader_ranks_over_more_than_2_to_the_62_records_refuse_a_rescale_and_resume_in_place() -> None:
    from resumable.torch import Loader

    n = 2**62 + 10

    def build() -> rs.Node[Any]:
        return rs.from_list(range(n)).shuffle(1).shard().batch(2)

    def loader() -> Any:
        return Loader(build, num_workers=0, collate_fn=lambda batch: batch)

    olds, heads = [], []
    for rank in range(2):
        with as_rank(rank, 2):
            old = loader()
            iterator = iter(old)
            heads.append([next(iterator) for _ in range(rank + 1)])
            olds.append(json.loads(json.dumps(old.state_dict())))
    with as_rank(0, 1):
        new, twin = loader(), loader()
        with pytest.raises(rs.StateError, match="4,611,686,018,427,387,904"):
            new.load_state_dict(olds)
        assert list(itertools.islice(iter(new), 2)) == list(itertools.islice(iter(twin), 2))
    with as_rank(1, 2):
        same = loader()
        same.load_state_dict(olds)
        twin = loader()
        expected = list(itertools.islice(iter(twin), 4))
        assert heads[1] + list(itertools.islice(iter(same), 2)) == expected


# --- what `python -m resumable inspect` shows of such a checkpoint -----------------------------


@pytest.mark.parametrize(
    ("n", "world_size", "position", "epoch"),
    [(10**10, 8, 10**8, 0), (TERA, 3, 2**32 + 1, 7), (2**62, 2, 2**61 - 1, 2**62)],
)
def test_inspect_keeps_the_columns_of_a_huge_epoch_apart(
    tmp_path: Any, n: int, world_size: int, position: int, epoch: int
) -> None:
    from resumable.inspect import describe

    def build() -> rs.Node[Any]:
        return rs.from_list(range(n)).shuffle(1).shard(world_size - 1, world_size)

    pipe = at(build, position, epoch)
    length = len(pipe)
    rs.save_state(pipe.get_state(), str(tmp_path / "data.json"))
    report = describe(str(tmp_path / "data.json"))
    row = next(line for line in report.splitlines() if line.startswith("data.json "))
    cells = row.split()
    assert cells[1].replace(",", "") == str(epoch)
    assert f"{position:,}" in cells and f"{length:,}" in cells, row
