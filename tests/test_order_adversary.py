"""Adversary of the ordering nodes: ``.shuffle(seed)`` (the keyed LCG permutation),
``.shuffle(seed, block_size=..., window=...)`` (the block shuffle), ``.shard(rank, world_size,
split_workers)`` and the pure functions behind them (resumable/order/).

What an ML engineer does with them, at the edges: datasets of 0, 1, 2, 3 records, primes,
powers of two and their neighbours (where the LCG's domain grows a bit); seeds from numpy,
configuration files and hashes (0, 2**63-1, 2**64, numpy unsigned); block sizes of 1, the
dataset's size and more; windows of 1 and huge; shards with more ranks than records, DataLoader
workers 0-3; the same pipeline in another process with another PYTHONHASHSEED; resuming at every
position of small epochs for every source kind, twice in a row; hand-edited states; and the
statistics of the permutation with fixed seeds (exact, deterministic bounds: nothing flaky).

The existing tests (test_shuffle.py, test_block_shuffle.py, test_lcg.py, test_shard.py) cover the
basic properties; this file does not repeat them.
"""

from __future__ import annotations

import copy
import functools
import itertools
import json
import os
import subprocess
import sys
import warnings
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

import resumable as rs
import resumable.elastic as elastic
from resumable import Node
from resumable.order.block_shuffle import BlockLayout
from resumable.order.lcg import Permutation
from resumable.order.partition import shard_size
from tests.resume import check_resume, roundtrip, take
from tests.sources import INDEXED_KINDS, indexed_source

Build = Callable[[], Node[Any]]

ROOT = Path(__file__).resolve().parent.parent

# Sizes where something changes: empty, tiny, the LCG's smallest domain (16) and the sizes at
# which its domain grows a bit (2**k + 1), primes.
SIZES = (0, 1, 2, 3, 5, 7, 13, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 257, 1021, 1024, 1025)


def ids(items: list[Any]) -> list[int]:
    """Record ids of dict records (file sources) or the items themselves (from_list of ints)."""
    return [item["id"] if isinstance(item, dict) else int(item) for item in items]


def epochs_of(pipe: Node[Any], count: int) -> list[list[Any]]:
    """``count`` whole epochs, one ``for`` loop each, as a training loop reads them."""
    return [list(pipe) for _ in range(count)]


def numbers(n: int) -> Node[int]:
    return rs.from_list(list(range(n)))


# --- options: seeds, block sizes, windows, ranks ------------------------------------------------

GOOD_SEEDS = [0, 1, 2**31, 2**63 - 1, np.int64(5), np.uint64(2**64 - 1), np.int8(3), np.uint32(7)]
BAD_SEEDS = [-1, np.int64(-1), True, False, np.bool_(True), 1.0, np.float64(2.0), "1", None, b"1", [1], 2 + 0j]
SHUFFLES: dict[str, Callable[[Node[Any], Any], Node[Any]]] = {
    "shuffle": lambda source, seed: source.shuffle(seed),
    "block": lambda source, seed: source.shuffle(seed, block_size=3, window=2),
}


@pytest.mark.parametrize("how", sorted(SHUFFLES))
@pytest.mark.parametrize("seed", GOOD_SEEDS, ids=repr)
def test_seeds_of_any_integer_type_are_saved_as_plain_ints_and_resume(how: str, seed: Any) -> None:
    """A numpy seed (from a config or a SeedSequence) is taken as the int it holds: the same
    order as that int, saved as a plain JSON int, restorable into a pipeline built with either."""
    shuffle = SHUFFLES[how]
    pipe = shuffle(numbers(23), seed)
    first = list(pipe)
    assert first == list(shuffle(numbers(23), int(seed)))
    assert sorted(first) == list(range(23))
    state = pipe.get_state()
    assert type(state["seed"]) is int and state["seed"] == int(seed)
    assert roundtrip(state) == state
    resumed = shuffle(numbers(23), int(seed))
    resumed.set_state(roundtrip(state))
    assert list(resumed) == list(pipe)


@pytest.mark.parametrize("how", sorted(SHUFFLES))
@pytest.mark.parametrize("seed", BAD_SEEDS, ids=repr)
def test_seeds_of_other_types_or_negative_are_config_errors_at_construction(how: str, seed: Any) -> None:
    with pytest.raises(rs.ConfigError, match="seed"):
        SHUFFLES[how](numbers(5), seed)


@pytest.mark.parametrize("how", sorted(SHUFFLES))
def test_a_seed_beyond_64_bits_is_refused_or_is_its_own_shuffle(how: str) -> None:
    shuffle = SHUFFLES[how]
    for small in (0, 5):
        big = small + 2**64
        try:
            pipe = shuffle(numbers(50), big)
        except rs.ConfigError:
            continue
        assert list(pipe) != list(shuffle(numbers(50), small)), f"seed {big} gives the order of seed {small}"


def test_numpy_uint64_seed_from_a_seed_sequence_is_a_valid_seed() -> None:
    """What `np.random.SeedSequence(...).generate_state(1, np.uint64)[0]` gives: half of such
    seeds are >= 2**63. Accepted, saved as a JSON int, restored exactly."""
    seed = np.random.SeedSequence(2).generate_state(1, dtype=np.uint64)[0]
    assert int(seed) >= 2**63  # the case that matters; fixed by the entropy above

    def build() -> Node[Any]:
        return numbers(11).shuffle(seed).shard(1, 2).repeat()

    for k in (0, 3, 5, 6, 11):
        check_resume(build, k, 15)


@pytest.mark.parametrize(
    ("block_size", "window"),
    [(1, 1), (1, 4), (10, 1), (10, 3), (11, 1), (1000, 1), (2**40, 2), (1, 2**40), (1, 2**63 - 1), (2**63 - 1, 1)],
)
def test_block_sizes_and_windows_at_their_edges_are_bijections_new_every_epoch(block_size: int, window: int) -> None:
    """block_size 1, equal to the dataset (10), larger than it; window 1 and huge: still an exact
    bijection each epoch, and the order changes between epochs whenever a window can mix."""
    pipe = numbers(10).shuffle(7, block_size=block_size, window=window)
    epochs = epochs_of(pipe, 6)
    for epoch in epochs:
        assert sorted(epoch) == list(range(10))
    assert len({tuple(epoch) for epoch in epochs}) > 1
    # The node reads what the pure layout says.
    layout = BlockLayout(10, window, block_size=block_size)
    for e, epoch in enumerate(epochs):
        assert epoch == layout.take(np.arange(10), 7, e).tolist()


def test_block_size_equal_to_the_dataset_or_larger_is_a_full_shuffle() -> None:
    """One block holding every record: the window's permutation alone mixes them all."""
    for block_size in (40, 41, 10**6):
        orders = epochs_of(numbers(40).shuffle(3, block_size=block_size, window=1), 4)
        assert all(sorted(order) == list(range(40)) for order in orders)
        assert len({tuple(order) for order in orders}) == 4
        assert all(order != list(range(40)) for order in orders)


def test_block_size_one_window_one_is_the_global_shuffle_of_another_key_or_the_same() -> None:
    """Blocks of one record, one per window: a pure permutation of blocks (documented: the block
    permutation is the keyed Permutation of (seed, epoch)), so the node equals it exactly."""
    for n in (1, 2, 17, 100):
        pipe = numbers(n).shuffle(9, block_size=1, window=1)
        for epoch in range(3):
            assert list(pipe) == Permutation(n, 9, epoch).take(np.arange(n)).tolist()


def test_the_last_partial_block_stays_in_the_last_window_as_documented() -> None:
    """block_shuffle.py: "a last partial block, if any, stays in the last slot (its records are
    still mixed with the rest of the last window)". With window=1 the last window is that block."""
    seen_last = set()
    for epoch in epochs_of(numbers(10).shuffle(2, block_size=4, window=1), 8):
        assert sorted(epoch[-2:]) == [8, 9]
        seen_last.add(epoch[-1])
        assert {tuple(sorted(epoch[:4])), tuple(sorted(epoch[4:8]))} == {(0, 1, 2, 3), (4, 5, 6, 7)}
    assert seen_last == {8, 9}  # still mixed within the block


@pytest.mark.parametrize("block_size", ["auto", "row_groups", "", "ROW_GROUP", 0, -1, 1.5, True, np.float32(4), [4]])
def test_bad_block_sizes_are_config_errors_at_construction(block_size: Any) -> None:
    with pytest.raises(rs.ConfigError, match="block_size"):
        numbers(10).shuffle(1, block_size=block_size)


def test_row_group_blocks_over_a_source_without_them_is_a_config_error() -> None:
    with pytest.raises(rs.ConfigError, match="row_group"):
        numbers(10).shuffle(1, block_size="row_group")
    with pytest.raises(rs.ConfigError, match="row_group"):
        numbers(10).shard(0, 2).shuffle(1, block_size="row_group")


@pytest.mark.parametrize("window", [0, -1, True, 2.0, "4", np.float64(2), 2**63])
def test_bad_windows_are_config_errors_at_construction(window: Any) -> None:
    with pytest.raises(rs.ConfigError, match="window"):
        numbers(10).shuffle(1, block_size=2, window=window)
    with pytest.raises(rs.ConfigError, match="window"):
        numbers(10).shuffle(1, window=window)


def test_block_size_times_window_past_int64_is_a_config_error_when_both_are_given() -> None:
    with pytest.raises(rs.ConfigError, match="block_size \\* window"):
        numbers(10).shuffle(1, block_size=2**62, window=2)


@pytest.mark.parametrize("window", [2**53, 2**62, 2**63 - 1])
def test_a_huge_window_with_the_default_block_size_is_refused_or_works(window: int) -> None:
    try:
        pipe = numbers(10).shuffle(1, window=window)
    except rs.ConfigError:
        return
    assert sorted(pipe) == list(range(10))


@pytest.mark.parametrize(
    ("rank", "world_size"),
    [(1, 1), (2, 2), (-1, 2), (0, 0), (0, -1), (1.0, 2), (0, 2.0), (True, 2), (0, True), ("0", 2), (0, 2**63)],
)
def test_bad_ranks_and_world_sizes_are_config_errors_at_construction(rank: Any, world_size: Any) -> None:
    with pytest.raises(rs.ConfigError):
        numbers(4).shard(rank, world_size)
    with pytest.raises(rs.ConfigError):
        numbers(4).shuffle(1).shard(rank, world_size)


@pytest.mark.parametrize("split_workers", [1, 0, "yes", None, "False"])
def test_split_workers_must_be_a_bool(split_workers: Any) -> None:
    with pytest.raises(rs.ConfigError, match="split_workers"):
        numbers(4).shard(0, 1, split_workers=split_workers)


def test_numpy_ranks_are_saved_as_plain_ints() -> None:
    pipe = numbers(9).shuffle(1).shard(np.int64(2), np.uint8(3), split_workers=np.bool_(True))
    assert list(pipe) == list(numbers(9).shuffle(1).shard(2, 3))
    state = pipe.get_state()
    assert roundtrip(state) == state
    assert all(type(state[key]) is int for key in ("rank", "world_size", "worker", "num_workers"))


# --- the permutation at every size: bijection, new every epoch and seed ------------------------


@pytest.mark.parametrize("n", SIZES)
def test_every_epoch_is_a_bijection_and_the_nodes_read_the_pure_functions(n: int) -> None:
    """Node orders equal the pure arithmetic (Permutation, BlockLayout, stride c + j*C), each
    epoch is a permutation of the records, for shuffle, block shuffle and shards of both."""
    for epoch, order in enumerate(epochs_of(numbers(n).shuffle(11), 3)):
        assert order == Permutation(n, 11, epoch).take(np.arange(n)).tolist()
    for epoch, order in enumerate(epochs_of(numbers(n).shuffle(11, block_size=4, window=3), 3)):
        assert order == BlockLayout(n, 3, block_size=4).take(np.arange(n), 11, epoch).tolist()
    for world_size in (1, 2, 3, 7) if n > 65 else (1, 2, 3, n + 2):
        shuffled = [epochs_of(numbers(n).shuffle(11).shard(r, world_size), 2) for r in range(world_size)]
        for epoch in range(2):
            whole = Permutation(n, 11, epoch).take(np.arange(n)).tolist()
            for rank in range(world_size):
                assert shuffled[rank][epoch] == whole[rank::world_size]
        for rank in range(world_size):
            stride = list(range(n))[rank::world_size]
            pipe = numbers(n).shard(rank, world_size).shuffle(11)
            assert len(pipe) == shard_size(n, rank, world_size) == len(stride)
            for epoch, order in enumerate(epochs_of(pipe, 2)):
                assert order == [stride[i] for i in Permutation(len(stride), 11, epoch).take(np.arange(len(stride)))]


@pytest.mark.parametrize("n", [13, 16, 17, 33, 64, 65, 257])
def test_orders_differ_between_epochs_and_between_seeds(n: int) -> None:
    """Fixed seeds, asserted exactly: 12 epochs of 4 seeds are 48 distinct orders, for both
    shuffles; none is the identity."""
    for how in ("shuffle", "block"):
        orders = []
        for seed in (0, 1, 2, 2**63 - 1):
            pipe = numbers(n).shuffle(seed) if how == "shuffle" else numbers(n).shuffle(seed, block_size=2, window=4)
            orders.extend(tuple(order) for order in epochs_of(pipe, 12))
        assert len(set(orders)) == len(orders), how
        assert tuple(range(n)) not in orders


@pytest.mark.parametrize("n", [2, 3, 4])
def test_tiny_datasets_reach_every_order_across_epochs(n: int) -> None:
    """2, 3 and 4 records: every one of the n! orders appears within 200 epochs of one seed."""
    orders = {tuple(order) for order in epochs_of(numbers(n).shuffle(4), 200)}
    assert orders == set(itertools.permutations(range(n)))


def test_a_shuffle_of_a_shuffle_with_the_same_seed_is_not_undone() -> None:
    """The keyed permutation is no involution: shuffling twice with one seed still shuffles."""
    for n in (17, 100, 1025):
        twice = list(numbers(n).shuffle(3).shuffle(3))
        assert sorted(twice) != twice
        assert twice != list(numbers(n).shuffle(3))


def test_start_epoch_and_random_access_agree_with_iteration() -> None:
    """pipe.start_epoch(e) reads epoch e's order; record_at(e, i) is its i-th record."""
    chains: list[Build] = [
        lambda: numbers(29).shuffle(6),
        lambda: numbers(29).shuffle(6, block_size=3, window=2),
        lambda: numbers(29).shuffle(6).shard(2, 3),
        lambda: numbers(29).shard(2, 3).shuffle(6, block_size=2, window=3),
    ]
    for build in chains:
        reference = epochs_of(build(), 5)
        for epoch in (0, 3, 4):
            pipe = build()
            pipe.start_epoch(epoch)
            assert list(pipe) == reference[epoch]
            assert [pipe.record_at(epoch, i) for i in range(len(reference[epoch]))] == reference[epoch]
        pipe = build()
        for bad in (-1, len(pipe), 10**30):
            with pytest.raises(IndexError):
                pipe[bad]
        for bad_epoch in (-1, 1.5, True, "2"):
            with pytest.raises(rs.ConfigError):
                pipe.start_epoch(bad_epoch)


# --- shards: every record once over ranks x workers --------------------------------------------


@pytest.mark.parametrize("n", [0, 1, 2, 5, 7])
def test_more_ranks_than_records_every_record_once_and_empty_ranks_resume(n: int) -> None:
    world_size = 8
    for epoch in range(3):
        seen: list[int] = []
        for rank in range(world_size):
            pipe = numbers(n).shuffle(5).shard(rank, world_size)
            pipe.start_epoch(epoch)
            seen.extend(pipe)
        assert sorted(seen) == list(range(n))
    for rank in (n, world_size - 1):  # ranks that own nothing

        def build(rank: int = rank) -> Node[Any]:
            return numbers(n).shuffle(5).shard(rank, world_size)

        pipe = build()
        assert len(pipe) == 0 and list(pipe) == [] and list(pipe) == []
        state = pipe.get_state()
        resumed = build()
        resumed.set_state(roundtrip(state))
        assert list(resumed) == [] and resumed.get_state()["epoch"] == state["epoch"] + 1


def test_shard_after_shuffle_moves_records_between_ranks_shuffle_after_shard_keeps_them() -> None:
    """The two placements differ as the docs say (orders.py): a global shuffle then a shard gives
    each rank other records each epoch; a shard then a shuffle permutes a fixed stride."""
    n, world_size = 60, 3
    global_sets = [
        [set(e) for e in epochs_of(numbers(n).shuffle(1).shard(r, world_size), 3)] for r in range(world_size)
    ]
    local_sets = [[set(e) for e in epochs_of(numbers(n).shard(r, world_size).shuffle(1), 3)] for r in range(world_size)]
    for rank in range(world_size):
        assert local_sets[rank] == [set(range(rank, n, world_size))] * 3
        assert global_sets[rank][0] != global_sets[rank][1]
    for epoch in range(3):
        for sets in (global_sets, local_sets):
            assert set().union(*(sets[r][epoch] for r in range(world_size))) == set(range(n))
            assert sum(len(sets[r][epoch]) for r in range(world_size)) == n


def _worker_build(rank: int, world_size: int, chain: str, n: int, split_workers: bool = True) -> Node[Any]:
    source = numbers(n)
    if chain == "shuffle_shard":
        return source.shuffle(7).shard(rank, world_size, split_workers=split_workers)
    if chain == "shard_block":
        return source.shard(rank, world_size, split_workers=split_workers).shuffle(7, block_size=2, window=2)
    return source.shard(rank, world_size, split_workers=split_workers).shuffle(7)


def _round_robin(lists: list[list[int]]) -> list[int]:
    """What an in-order DataLoader yields from workers that yield ``lists``: round robin,
    skipping a worker once it is exhausted."""
    out = []
    for i in range(max((len(items) for items in lists), default=0)):
        out.extend(items[i] for items in lists if i < len(items))
    return out


def _expected_consumer(chain: str, n: int, consumer: int, consumers: int, epoch: int) -> list[int]:
    pipe = _worker_build(consumer, consumers, chain, n)
    pipe.start_epoch(epoch)
    return list(pipe)


@pytest.mark.parametrize("chain", ["shuffle_shard", "shard_block"])
@pytest.mark.parametrize("num_workers", [0, 1, 2, 3])
def test_loader_workers_read_consumer_rank_times_workers_plus_worker_every_record_once(
    chain: str, num_workers: int
) -> None:
    """rs.torch.Loader with 0-3 workers on 2 ranks: worker w of rank r reads exactly consumer
    r * W + w of 2 * W (interleaved round robin), and each epoch covers every record once. 11
    records: with 3 workers some consumers have 1 record."""
    import resumable.torch as rst

    n, world_size = 11, 2
    workers = max(num_workers, 1)
    for rank in range(world_size):
        loader = rst.Loader(
            functools.partial(_worker_build, rank, world_size, chain, n), num_workers=num_workers, collate_fn=_same
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # more workers than the 2 cores
            for epoch in range(2):
                got = [int(x) for x in loader]
                expected = _round_robin(
                    [
                        _expected_consumer(chain, n, rank * workers + w, world_size * workers, epoch)
                        for w in range(workers)
                    ]
                )
                assert got == expected, (rank, epoch)


def _same(item: Any) -> Any:
    return item


def test_split_workers_false_gives_every_worker_the_whole_rank_stride() -> None:
    """The documented opposite: without split_workers each DataLoader worker reads its rank's
    whole stride (for pipelines that split by worker themselves)."""
    import resumable.torch as rst

    loader = rst.Loader(
        functools.partial(_worker_build, 1, 2, "shuffle_shard", 11, False), num_workers=2, collate_fn=_same
    )
    got = [int(x) for x in loader]
    stride = list(numbers(11).shuffle(7).shard(1, 2))
    assert got == _round_robin([stride, stride])


def test_loader_resumes_a_shuffle_after_a_shard_mid_epoch_and_across_the_epoch_end() -> None:
    import resumable.torch as rst

    build = functools.partial(_worker_build, 1, 2, "shard_block", 23)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        reference = rst.Loader(build, num_workers=2, collate_fn=_same)
        whole = [[int(x) for x in reference] for _ in range(2)]
        flat = whole[0] + whole[1]
        for stop in (1, 5, len(whole[0])):
            loader = rst.Loader(build, num_workers=2, collate_fn=_same)
            iterator = iter(loader)
            head = [int(next(iterator)) for _ in range(stop)]
            state = roundtrip(loader.state_dict())
            del iterator
            resumed = rst.Loader(build, num_workers=2, collate_fn=_same)
            resumed.load_state_dict(state)
            rest = [int(x) for x in resumed] + [int(x) for x in resumed]
            assert head + rest == flat, stop


# --- the same order in any process -------------------------------------------------------------

_ORDER_SCRIPT = """
import json, sys
import resumable as rs
path = sys.argv[1]
out = {}
for name, pipe in {
    "list": rs.from_list([{"id": i} for i in range(37)]).shuffle(12345).shard(1, 3),
    "jsonl": rs.jsonl(path).shuffle(2**63 - 1),
    "block": rs.jsonl(path).shuffle(8, block_size=3, window=2).shard(0, 2),
    "shard_shuffle": rs.jsonl(path).shard(2, 3).shuffle(9),
}.items():
    out[name] = [[r["id"] for r in pipe] for _ in range(3)]
print(json.dumps(out))
"""


def test_the_same_pipeline_in_other_processes_with_other_hash_seeds_gives_the_same_orders(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"id": i}) + "\n" for i in range(37)))
    results = []
    for hash_seed in ("0", "4242"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed, "PYTHONPATH": str(ROOT)}
        done = subprocess.run(
            [sys.executable, "-c", _ORDER_SCRIPT, str(path)], env=env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr
        results.append(json.loads(done.stdout))
    assert results[0] == results[1]
    here = {
        "list": rs.from_list([{"id": i} for i in range(37)]).shuffle(12345).shard(1, 3),
        "jsonl": rs.jsonl(str(path)).shuffle(2**63 - 1),
        "block": rs.jsonl(str(path)).shuffle(8, block_size=3, window=2).shard(0, 2),
        "shard_shuffle": rs.jsonl(str(path)).shard(2, 3).shuffle(9),
    }
    assert {name: [ids(list(pipe)) for _ in range(3)] for name, pipe in here.items()} == results[0]


# --- resume at every position, every source kind -----------------------------------------------

RECORDS = [{"id": i, "text": "x" * (i % 4)} for i in range(7)]
CHAINS: dict[str, Callable[[Node[Any]], Node[Any]]] = {
    "shuffle": lambda s: s.shuffle(5),
    "block": lambda s: s.shuffle(5, block_size=2, window=2),
    "natural_blocks": lambda s: s.shuffle(5, window=2),  # row groups / record batches where the source has them
    "shuffle_shard": lambda s: s.shuffle(2**63 - 1).shard(1, 2),
    "shard_shuffle": lambda s: s.shard(0, 2).shuffle(5),
    "shard_block": lambda s: s.shard(2, 3).shuffle(0, block_size=1, window=2),
    "many_ranks": lambda s: s.shuffle(5).shard(5, 9),
}


@pytest.mark.parametrize(
    ("kind", "chain"),
    [(kind, chain) for kind in ("list", "jsonl") for chain in sorted(CHAINS)]
    + [
        (kind, chain)
        for kind in INDEXED_KINDS
        if kind not in ("list", "jsonl")
        for chain in ("natural_blocks", "shuffle_shard", "shard_block", "many_ranks")
    ],
)
def test_resume_at_every_position_across_epochs_and_many_times_in_a_row(kind: str, chain: str) -> None:
    """Three epochs read with a save and a restore into a fresh pipeline before every item (every
    position, the last item of each epoch and the step after it, restored again and again), then
    the full check (the original going on after its state was taken, a restore read for many
    items, a second restore later) at the epoch's edges: all equal the uninterrupted run."""

    def build() -> Node[Any]:
        return CHAINS[chain](indexed_source(kind, RECORDS))

    length = len(build())
    total = 3 * max(length, 1) + 1
    expected = ids(take(build(), total))
    pipe, got = build(), []
    for _ in range(total + 2):
        state = roundtrip(pipe.get_state())
        pipe = build()
        pipe.set_state(state)
        got += ids(take(pipe, 1))
    assert got == expected + ids(take(build(), total + 2))[total:]
    edges = {0, 1, length - 1, length, length + 1, 2 * length, 2 * length + 1}
    for k in sorted(k for k in edges if 0 <= k <= total):
        check_resume(build, k, total, k2=min(total, k + max(length, 1)))


@pytest.mark.parametrize("chain", ["shuffle", "shard_block", "natural_blocks"])
@pytest.mark.parametrize("kind", INDEXED_KINDS)
def test_a_state_taken_after_the_epoch_ended_resumes_into_the_next_epoch(kind: str, chain: str) -> None:
    """After the StopIteration (the ``for`` loop finished), the state's next loop is the next epoch."""

    def build() -> Node[Any]:
        return CHAINS[chain](indexed_source(kind, RECORDS))

    reference = [ids(epoch) for epoch in epochs_of(build(), 3)]
    pipe = build()
    assert ids(list(pipe)) == reference[0]
    state = roundtrip(pipe.get_state())
    assert state["ended"] is True
    resumed = build()
    resumed.set_state(state)
    assert [ids(list(resumed)), ids(list(resumed))] == reference[1:]
    again = build()
    again.set_state(roundtrip(resumed.get_state()))
    assert ids(list(again)) == ids(epochs_of(build(), 4)[3])


# --- hand-edited states: only StateError, nothing changed --------------------------------------


def _corruptions(state: dict[str, Any], other_states: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """Edited copies of ``state``: each entry of each nested node changed the ways a hand edit,
    a bad merge or a checkpoint of another job would."""
    edits: list[tuple[str, dict[str, Any]]] = []
    levels: list[tuple[str, ...]] = []
    node: Any = state
    where: tuple[str, ...] = ()
    while isinstance(node, dict):
        levels.append(where)
        node, where = node.get("upstream"), (*where, "upstream")

    def at(copied: dict[str, Any], where: tuple[str, ...]) -> dict[str, Any]:
        for key in where:
            copied = copied[key]
        return copied

    for where in levels:
        entries = at(state, where)
        for key, value in entries.items():
            if key == "upstream":
                continue
            replacements: list[Any] = [None, [], 1.5, -1]
            if isinstance(value, bool):
                replacements += [not value, int(value)]
            elif isinstance(value, int):
                replacements += [value + 1, 2**64, float(value), str(value)]
            elif isinstance(value, str):
                replacements += [value + "x", 1]
            elif isinstance(value, list):
                replacements += [value[:-1], [*value, value[-1] if value else 0]]
            for replacement in replacements:
                edited = copy.deepcopy(state)
                at(edited, where)[key] = replacement
                edits.append((f"{'/'.join(where)}:{key}={replacement!r:.40}", edited))
            edited = copy.deepcopy(state)
            del at(edited, where)[key]
            edits.append((f"{'/'.join(where)}:del {key}", edited))
        edited = copy.deepcopy(state)
        at(edited, where).pop("upstream", None)
        if where or "upstream" in entries:
            edits.append((f"{'/'.join(where)}:del upstream", edited))
    for number, other in enumerate(other_states):
        edits.append((f"another pipeline's state #{number}", copy.deepcopy(other)))
    edits += [
        ("position past the end", {**copy.deepcopy(state), "position": state["length"] + 1}),
        ("position at the end, not ended", {**copy.deepcopy(state), "position": state["length"], "ended": False}),
        ("a list of states", [copy.deepcopy(state)]),  # type: ignore[list-item]  # deliberately wrong
    ]
    return edits


ORDER_CHAINS: dict[str, Callable[[Node[Any]], Node[Any]]] = {
    "shuffle_shard": lambda s: s.shuffle(3).shard(1, 3),
    "shard_shuffle": lambda s: s.shard(1, 3).shuffle(3),
    "block": lambda s: s.shuffle(3, block_size=2, window=2),
    "shard_block": lambda s: s.shard(1, 2).shuffle(3, block_size=2, window=2),
}


@pytest.mark.parametrize(
    ("kind", "chain"),
    [*(("list", chain) for chain in sorted(ORDER_CHAINS))]
    + [("jsonl", "shard_block"), ("parquet", "shuffle_shard"), ("arrow", "block"), ("arrow_stream", "shard_shuffle")],
)
def test_hand_edited_states_are_state_errors_or_continue_exactly_and_a_refused_one_changes_nothing(
    kind: str, chain: str
) -> None:
    records = [{"id": i} for i in range(13)]

    def build(records: list[dict[str, Any]] = records, with_map: bool = False, chain: str = chain) -> Node[Any]:
        source = indexed_source(kind, records)
        if with_map:
            source = source.map(_same)
        return ORDER_CHAINS[chain](source)

    reference = ids(take(build(), 12))
    pipe = build()
    take(pipe, 2)
    state = roundtrip(pipe.get_state())
    others = []
    for other in (
        build([{"id": i} for i in range(14)]),  # another size
        build([{"id": i + 1} for i in range(13)]),  # another content (file kinds), same size
        build(with_map=True),  # a map in between
        *(ORDER_CHAINS[c](indexed_source(kind, records)) for c in sorted(ORDER_CHAINS) if c != chain),
        numbers(13).shuffle(4).shard(0, 3),
        numbers(13).shard(2, 3).shuffle(3),
    ):
        take(other, 2)
        others.append(roundtrip(other.get_state()))

    checked = 0
    for label, edited in _corruptions(state, others):
        victim = build()
        head = ids(take(victim, 3))
        before = json.dumps(victim.get_state(), sort_keys=True)
        try:
            victim.set_state(edited)
        except rs.StateError:
            assert json.dumps(victim.get_state(), sort_keys=True) == before, label
            assert head + ids(take(victim, 9)) == reference, label
            checked += 1
            continue
        except Exception as error:  # noqa: BLE001 - the assertion names it
            pytest.fail(f"{label}: set_state raised {type(error).__name__}: {error}")
        # Accepted: it must then be a state this pipeline could have taken, and read on from it
        # exactly as a fresh pipeline given that state does, with only typed errors.
        twin = build()
        twin.set_state(copy.deepcopy(edited))
        try:
            got = ids(take(victim, 10))
        except rs.ResumableError:
            continue
        assert got == ids(take(twin, 10)), label
        position = victim.get_state()
        assert roundtrip(position) == position, label
    assert checked > 20


def test_a_refused_state_in_the_middle_of_a_for_loop_leaves_the_loop_going() -> None:
    pipe = numbers(20).shuffle(6).shard(0, 2)
    reference = list(numbers(20).shuffle(6).shard(0, 2))
    good = numbers(20).shuffle(6).shard(0, 2)
    take(good, 4)
    wrong = {**good.get_state(), "seed": 7}
    wrong["upstream"] = {**wrong["upstream"], "seed": 7}
    got = []
    for item in pipe:
        got.append(item)
        if len(got) in (1, 5, 10):
            with pytest.raises(rs.StateError, match="seed"):
                pipe.set_state(wrong)
            with pytest.raises(rs.StateError, match="position"):
                pipe.set_state({**good.get_state(), "position": 10**9})
    assert got == reference


# --- statistics with fixed seeds (deterministic, generous bounds) ------------------------------


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8, 16, 17, 33])
def test_each_position_takes_each_record_about_equally_often_over_seeds_and_over_epochs(n: int) -> None:
    """The n x n table (position, record) over 60 n orders: every cell within 0.35x-1.65x of its
    expectation (a random shuffle stays within about 0.6x-1.4x here; the bounds only catch a
    degenerate order, such as a position that never or nearly always takes some record)."""
    count = 60 * n
    expected = count / n
    for orders in (
        (Permutation(n, seed, 0).take(np.arange(n)) for seed in range(count)),
        (Permutation(n, 77, epoch).take(np.arange(n)) for epoch in range(count)),
    ):
        table = np.zeros((n, n))
        for order in orders:
            table[np.arange(n), order] += 1
        assert 0.35 * expected < table.min() and table.max() < 1.65 * expected, (table.min(), table.max())


def test_the_nodes_first_record_over_many_seeds_is_not_degenerate() -> None:
    """Through the nodes: the first record of 1000 seeds' epochs, over 10 records, each record
    first between 50 and 150 times (expected 100), for both shuffles and a shuffled shard."""
    for build in (
        lambda seed: numbers(10).shuffle(seed),
        lambda seed: numbers(10).shuffle(seed, block_size=1, window=10),
        lambda seed: numbers(30).shard(0, 3).shuffle(seed),
    ):
        firsts = Counter(build(seed)[0] for seed in range(1000))
        assert len(firsts) == 10 and min(firsts.values()) > 50 and max(firsts.values()) < 150, firsts


@pytest.mark.parametrize("n", [2**16 - 1, 2**16, 2**16 + 1, 99_991])
def test_no_constant_difference_between_near_neighbours(n: int) -> None:
    """perm(k + m) - perm(k) (mod n) for m = 1, 2, 3, 16: in a random permutation every
    difference occurs about once (Poisson(1): the most common about 8 times in n); a bare LCG
    gives one difference n times. Bound: 30."""
    for seed in (0, 1, 2, 2**63 - 1):
        order = Permutation(n, seed, 1).take(np.arange(n))
        for lag in (1, 2, 3, 16):
            differences = (order[lag:] - order[:-lag]) % n
            assert np.bincount(differences).max() < 30, (seed, lag)
            assert np.bincount(order[lag:] ^ order[:-lag]).max() < 30, (seed, lag)


def test_no_repeated_difference_at_power_of_two_lags() -> None:
    """The design's promise: "no lag correlation a test can find". Counting repeated differences
    at lags 2**15 .. 2**18 over a 2**20-record epoch finds one, for fixed seeds."""
    n = 2**20
    worst = []
    for seed in (20, 103, 146):
        order = Permutation(n, seed, 0).take(np.arange(n))
        for lag in (2**15, 2**16, 2**17, 2**18):
            differences = (order[lag:] - order[:-lag]) % n
            worst.append((int(np.bincount(differences).max()), seed, lag))
    assert max(worst) < (40, 0, 0), sorted(worst, reverse=True)[:4]


def test_block_shuffle_records_within_a_window_are_not_in_a_fixed_stride() -> None:
    """Within each window of 8 blocks of 64 records, consecutive outputs have no dominant
    difference and no block is read in its stored order."""
    total, block_size, window = 64 * 64, 64, 8
    order = BlockLayout(total, window, block_size=block_size).take(np.arange(total), 5, 2)
    span = block_size * window
    for start in range(0, total, span):
        part = order[start : start + span]
        assert np.bincount(np.diff(part) % total).max() < 12
        assert not any(np.all(np.diff(part[i : i + block_size]) == 1) for i in range(0, span, block_size))


# --- elastic rescale of shuffles after a shard (orders.py) ---------------------------------------


def _rescale_once(build: Callable[[int, int], Node[Any]], n: int) -> list[int]:
    """Two old ranks read 5 records each, three new ranks read the rest: all records."""
    olds, seen = [], []
    for rank in range(2):
        pipe = build(rank, 2)
        seen.extend(take(pipe, 5))
        olds.append(roundtrip(pipe.get_state()))
    for rank in range(3):
        pipe = build(rank, 3)
        elastic.restore(pipe, olds)
        seen.extend(pipe)
    return sorted(seen)


def _shard_block(seed: int, n: int, rank: int, world_size: int) -> Node[Any]:
    return numbers(n).shard(rank, world_size).shuffle(seed, block_size=2, window=2)


def _shard_shuffle(seed: int, n: int, rank: int, world_size: int) -> Node[Any]:
    return numbers(n).shard(rank, world_size).shuffle(seed)


def test_elastic_rescale_of_a_shuffle_after_a_shard_sees_every_record_once() -> None:
    # Each seed with its own dataset size: a second seed over strides of the same length meets
    # the bug below.
    for n, seed in ((36, 0), (42, 7), (44, 2**63 - 1)):
        for make in (_shard_block, _shard_shuffle):
            assert _rescale_once(functools.partial(make, seed, n), n) == list(range(n)), (make.__name__, seed)


def test_elastic_rescales_of_two_block_shuffled_pipelines_in_one_process_each_see_every_record_once() -> None:
    """As a process restoring two such pipelines does (two mix components, two jobs' data in one
    evaluation process): the first rescale with seed 1, the second with seed 2."""
    assert _rescale_once(functools.partial(_shard_block, 1, 50), 50) == list(range(50))
    assert _rescale_once(functools.partial(_shard_block, 2, 50), 50) == list(range(50))


@pytest.mark.parametrize("make", [_shard_shuffle, _shard_block])
def test_elastic_rescale_with_a_uint64_seed_sees_every_record_once(make: Callable[..., Node[Any]]) -> None:
    seed = int(np.random.SeedSequence(2).generate_state(1, dtype=np.uint64)[0])
    assert seed >= 2**63
    assert _rescale_once(functools.partial(make, seed, 38), 38) == list(range(38))


def _mixed(n: int, rank: int, world_size: int) -> Node[Any]:
    web = rs.from_list([f"web{i}" for i in range(n)]).shard(rank, world_size).shuffle(1, block_size=2, window=2)
    code = rs.from_list([f"code{i}" for i in range(n)]).shard(rank, world_size).shuffle(2, block_size=2, window=2)
    return rs.mix({"web": web, "code": code}, on_end="drop")


def test_elastic_restore_of_a_mix_of_two_block_shuffled_components_sees_every_record_once() -> None:
    n = 40
    olds, seen = [], []
    for rank in range(2):
        pipe = _mixed(n, rank, 2)
        seen.extend(take(pipe, 10))
        olds.append(roundtrip(pipe.get_state()))
    for rank in range(3):
        pipe = _mixed(n, rank, 3)
        elastic.restore(pipe, olds)
        seen.extend(pipe)
    assert sorted(seen) == sorted([f"web{i}" for i in range(n)] + [f"code{i}" for i in range(n)])
