"""Adversary of the small nodes at their edges: batch, filter, repeat, a map in threads, cache,
and chains of them with shuffle and shard.

Batch: sizes of 1, of the epoch, beyond it, ``drop_last`` with and without a last partial batch,
a ``collate_fn`` that builds dicts, ragged numpy items through the Loader's conversion. Filter:
a predicate that drops everything, all but the last item, the first item, one that raises at
the first or the last record, one that returns values that are not bools. Repeat: of an empty
source, of a shard with nothing to read, of a shard whose epochs differ in length (through a
filter), of a pipeline with an empty epoch between full ones. ``.map(fn, num_workers=k)`` in
threads with 1, 2 and 4 workers. Cache: in memory larger and smaller than the data, on disk,
epoch 2 (read) against epoch 1 (computed) and against no cache at all.

The central property over every source kind the test helpers offer (``rs.from_list``, JSONL,
Parquet, Arrow file and stream format, and the plain and gzip JSONL streams): iterate k items,
``get_state``, JSON, restore into a freshly built pipeline, continue == the uninterrupted run,
epoch for epoch (where each ``for`` loop ends is compared too), at k = 0, 1, the middle, the
last item of the first epoch and those around it, the last item of the run, after the
``StopIteration`` of the first epoch, across 2-3 epochs, restored twice in a row; and through
``rs.torch.Loader`` with 0, 2 and 2 persistent workers for a few chains. Also: ``len()`` where
the README says it is known, a refused ``set_state`` (corrupted states, entry by entry) raises
only the library's typed errors and leaves the pipeline as it was, also right after the end of
an epoch and with a thread pool's records in flight.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

import resumable as rs
import resumable.torch as rst
from resumable import Node
from tests.resume import LOADER_CONFIGS, flat, loader_epoch, loops, plain, roundtrip, scribble
from tests.sources import INDEXED_KINDS, STREAM_KINDS, indexed_source, stream_source

pytestmark = [pytest.mark.filterwarnings("ignore:This DataLoader will create")]

Build = Callable[[], Node[Any]]

SIZE = 13  # records: no epoch length here is a multiple of a batch size or a shard count
RECORDS = [{"x": i, "t": "r" * (i % 4)} for i in range(SIZE)]
ALL_KINDS = INDEXED_KINDS + STREAM_KINDS
TIMEOUT = 60  # seconds: a Loader worker that never answers fails the test instead of hanging it


def source(kind: str) -> Node[Any]:
    """A fresh source of ``kind`` over ``RECORDS``: an indexed one, or a stream over 3 files."""
    if kind in STREAM_KINDS:
        return stream_source(kind, RECORDS)
    return indexed_source(kind, RECORDS)


# -- user functions (module level: Loader workers may unpickle them) ---------------------------


def x_of(record: Any) -> int:
    return int(record["x"])


def mapped(record: Any) -> dict[str, Any]:
    return {"x": x_of(record), "y": 10 * x_of(record)}


def keep_mod3(record: Any) -> bool:
    return x_of(record) % 3 != 1


def keep_last(record: Any) -> bool:
    return x_of(record) == SIZE - 1


def drop_first(record: Any) -> bool:
    return x_of(record) != 0


def nothing(record: Any) -> bool:
    return False


def xs(batch: list[Any]) -> dict[str, Any]:
    """A collate function that builds a dict of columns."""
    return {"x": [x_of(r) for r in batch], "n": len(batch)}


def ragged(record: Any) -> dict[str, Any]:
    """A record with a numpy array whose length varies (0 to 3)."""
    return {"x": x_of(record), "ids": np.arange(x_of(record) % 4, dtype=np.int32)}


# -- the central property ------------------------------------------------------------------------


def merge(head: list[list[Any]], rest: list[list[Any]]) -> list[list[Any]]:
    """The loops of a run cut in two: the rest's first loop finishes the head's last one."""
    if not head or not rest:
        return head + rest
    return [*head[:-1], head[-1] + rest[0], *rest[1:]]


def resumed_run(build: Build, state: dict[str, Any], count: int) -> list[list[Any]]:
    """``count`` items of a fresh pipeline restored from ``state``, as loops: two items, then
    a second restore from the state taken there (restoring twice in a row), then the rest."""
    first = build()
    first.set_state(roundtrip(state))
    middle = loops(first, min(2, count))
    again = roundtrip(first.get_state())
    first.close()
    second = build()
    second.set_state(again)
    rest = loops(second, count - len(flat(middle)))
    second.close()
    return merge(middle, rest)


def check_cuts(build: Build, total: int = 30) -> list[list[Any]]:
    """The central property at every edge that matters; returns the uninterrupted run's loops."""
    with build() as whole:
        expected = loops(whole, total)
    count = len(flat(expected))
    if not count:  # nothing in any epoch: states before and after an epoch restore into nothing
        for epochs in (0, 1):
            pipe = build()
            assert all(list(pipe) == [] for _ in range(epochs))
            state = roundtrip(pipe.get_state())
            assert state["ended"] is bool(epochs)
            assert flat(resumed_run(build, state, 1)) == []
        return expected
    first = len(expected[0])
    for k in sorted({0, 1, count // 2, max(first - 1, 0), first, first + 1, count - 1, count}):
        if k > count:
            continue
        pipe = build()
        head = loops(pipe, k)
        state = roundtrip(pipe.get_state())
        assert roundtrip(pipe.get_state()) == state, "two states in a row differ"
        pipe.close()
        assert merge(head, resumed_run(build, state, count - k)) == expected, f"cut after {k} items"
    if len(expected) > 1:  # the first epoch ended within the run: cut after its StopIteration
        pipe = build()
        epoch = [plain(item) for item in pipe]
        state = roundtrip(pipe.get_state())
        pipe.close()
        assert state["ended"] is True
        assert epoch == expected[0]
        rest = resumed_run(build, state, count - len(epoch))
        assert flat([epoch, *rest]) == flat(expected), "cut after the StopIteration of the first epoch"
    return expected


INDEXED_CHAINS: dict[str, Callable[[Node[Any]], Node[Any]]] = {
    "shuffle-shard-batch3": lambda s: s.shuffle(1).shard(0, 2).batch(3),
    "batch-of-the-epoch": lambda s: s.batch(SIZE),
    "batch-beyond-the-epoch-drop-last-repeat": lambda s: s.batch(SIZE + 1, drop_last=True).repeat(),
    "batch4-drop-last-repeat3": lambda s: s.shuffle(1).batch(4, drop_last=True).repeat(3),
    "repeat3-batch7-drop-last": lambda s: s.shuffle(2).repeat(3).batch(7, drop_last=True),
    "shard-filter-repeat-of-varying-epochs": lambda s: s.shuffle(2).shard(0, 3).filter(keep_mod3).repeat(3),
    "filter-last-only-batch2-repeat2": lambda s: s.filter(keep_last).batch(2).repeat(2),
    "filter-nothing-batch": lambda s: s.shuffle(3).filter(nothing).batch(2),
    "threads2-drop-first-batch3-collate": lambda s: (
        s.map(mapped, num_workers=2).filter(drop_first).batch(3, collate_fn=xs)
    ),
    "threads4-batch4-repeat3": lambda s: s.shuffle(0).map(mapped, num_workers=4).batch(4).repeat(3),
    "cache-smaller-shuffle-shard-threads": lambda s: (
        s.cache(max_bytes=300).shuffle(3).shard(1, 2).map(mapped, num_workers=3).batch(2)
    ),
    "cache-larger-shuffle-repeat2-batch5": lambda s: s.map(mapped).cache().shuffle(5).repeat(2).batch(5),
    "shard-beyond-the-records-repeat": lambda s: s.shard(SIZE + 2, SIZE + 5).repeat(),
}

STREAM_CHAINS: dict[str, Callable[[Node[Any]], Node[Any]]] = {
    "filter-batch3-repeat2": lambda s: s.filter(keep_mod3).batch(3).repeat(2),
    "threads2-batch2-drop-last": lambda s: s.map(mapped, num_workers=2).batch(2, drop_last=True),
    "repeat2-drop-first-batch4": lambda s: s.repeat(2).filter(drop_first).batch(4),
    "last-only-repeat3": lambda s: s.filter(keep_last).repeat(3),
}

DROP_LAST_SIZES = {"batch4-drop-last-repeat3": 4, "repeat3-batch7-drop-last": 7, "threads2-batch2-drop-last": 2}

CASES = [(kind, chain) for kind in INDEXED_KINDS for chain in INDEXED_CHAINS] + [
    (kind, chain) for kind in STREAM_KINDS for chain in STREAM_CHAINS
]


@pytest.mark.parametrize("kind,chain", CASES, ids=[f"{kind}-{chain}" for kind, chain in CASES])
def test_a_cut_at_any_edge_resumes_exactly_over_every_source_kind(kind: str, chain: str) -> None:
    nodes = STREAM_CHAINS[chain] if kind in STREAM_KINDS else INDEXED_CHAINS[chain]
    expected = check_cuts(lambda: nodes(source(kind)))
    items = flat(expected)
    if chain in ("filter-nothing-batch", "shard-beyond-the-records-repeat", "batch-beyond-the-epoch-drop-last-repeat"):
        assert items == []
    elif chain == "batch-of-the-epoch":
        assert [len(batch) for batch in items[:2]] == [SIZE, SIZE] and len(expected) > 1
    elif chain in DROP_LAST_SIZES:
        assert items and all(len(batch) == DROP_LAST_SIZES[chain] for batch in items)
    elif chain.startswith("filter-last-only") or chain.startswith("last-only"):
        assert {x_of(r) for batch in items for r in (batch if isinstance(batch, list) else [batch])} == {SIZE - 1}


def test_a_cut_in_a_pipeline_with_a_disk_cache_resumes_exactly_cold_or_warm(tmp_path: Path) -> None:
    for kind in ("jsonl", "parquet"):
        for warm in (False, True):  # the second round reads the blocks the first one wrote
            expected = check_cuts(
                lambda: source(kind).map(mapped).cache(tmp_path).shuffle(4).shard(1, 2).filter(keep_mod3).batch(16)
            )
            assert len(expected) > 1 and len(flat(expected)[0]) < 16, warm


# -- repeat --------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", INDEXED_KINDS)
def test_repeat_of_a_shard_whose_epochs_differ_in_length_is_those_epochs_back_to_back(kind: str) -> None:
    unrepeated = source(kind).shuffle(2).shard(0, 3).filter(keep_mod3)
    epochs = [[plain(r) for r in unrepeated] for _ in range(6)]
    assert [len(epoch) for epoch in epochs] == [3, 2, 5, 3, 4, 3]  # the lengths differ, none is empty
    repeated = source(kind).shuffle(2).shard(0, 3).filter(keep_mod3).repeat(3)
    assert [plain(r) for r in repeated] == flat(epochs[:3])
    assert [plain(r) for r in repeated] == flat(epochs[3:])  # the next pass: upstream epochs 3 to 5
    with pytest.raises(TypeError, match="Filter"):
        len(repeated)


def below_3(record: Any) -> bool:
    return x_of(record) < 3


@pytest.mark.parametrize("kind", ["list", "jsonl", "arrow", "parquet"])
def test_repeat_ends_at_an_empty_epoch_between_full_ones_and_the_next_loop_goes_on(kind: str) -> None:
    """The Repeat docstring: an upstream epoch that yields nothing ends the iteration."""
    unrepeated = source(kind).shuffle(2).shard(2, 3).filter(below_3)
    epochs = [[plain(r) for r in unrepeated] for _ in range(6)]
    assert [len(epoch) for epoch in epochs] == [1, 0, 1, 2, 2, 1]

    def build() -> Node[Any]:
        return source(kind).shuffle(2).shard(2, 3).filter(below_3).repeat()

    expected = check_cuts(build, 7)
    assert expected[0] == epochs[0]  # the first loop stops at the empty epoch 1
    assert flat(expected[1:]) == flat(epochs[2:])[:6]  # the next goes on with epoch 2


@pytest.mark.parametrize(
    "build",
    [
        lambda: rs.from_list([]).repeat(),
        lambda: rs.from_list([]).repeat(3).batch(2),
        lambda: source("parquet").shard(SIZE, SIZE + 1).repeat(2),
        lambda: source("jsonl").filter(nothing).map(mapped, num_workers=2).repeat(),
        lambda: source("jsonl_stream").filter(nothing).repeat(4),
    ],
    ids=["empty-list", "empty-list-repeat3-batch", "empty-shard-repeat2", "nothing-threads-repeat", "stream-nothing"],
)
def test_repeat_of_nothing_ends_at_once_every_time_and_resumes_ended(build: Build) -> None:
    with build() as pipe:
        assert list(pipe) == [] and list(pipe) == []
        state = roundtrip(pipe.get_state())
        assert state["ended"] is True
    with build() as again:
        again.set_state(state)
        assert list(again) == [] and list(again) == []
        assert roundtrip(again.get_state())["ended"] is True


# -- filter --------------------------------------------------------------------------------------


class Truth:
    """A predicate answering with what ``ANSWERS`` holds for the record: values that are not
    bools, kept or dropped by Python's truth."""

    ANSWERS: list[Any] = [
        np.bool_(True),
        np.array([0]),
        0.0,
        "",
        [],
        None,
        "False",
        np.int64(0),
        np.array([1]),
        (0,),
        float("nan"),
        np.float32(0.0),
        1j,
    ]

    def __call__(self, record: Any) -> Any:
        return self.ANSWERS[x_of(record)]


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_a_predicate_returning_non_bools_keeps_what_python_s_truth_keeps(kind: str) -> None:
    truth = [x for x in range(SIZE) if Truth.ANSWERS[x]]
    assert truth == [0, 6, 8, 9, 10, 12]
    pipe = source(kind).filter(Truth())
    kept = sorted(x_of(r) for r in pipe)
    assert kept == truth
    assert pipe.dropped == SIZE - len(truth)
    if kind in INDEXED_KINDS:
        indexed = source(kind).filter(Truth(), index=True, progress=False)
        assert [x_of(r) for r in indexed] == truth and len(indexed) == len(truth)
    check_cuts(lambda: source(kind).filter(Truth()).batch(2), 12)


class RaiseAt:
    """A predicate raising ``ValueError`` on the records of ``where``, else keeping odd ones."""

    def __init__(self, *where: int) -> None:
        self.where = where

    def __call__(self, record: Any) -> bool:
        if x_of(record) in self.where:
            raise ValueError(f"bad record {x_of(record)}")
        return x_of(record) % 2 == 1


def outcomes(pipe: Node[Any], limit: int = 40) -> list[Any]:
    """What ``next()`` gives until ``StopIteration``: items, "raised", then "end"."""
    seen: list[Any] = []
    while len(seen) < limit:
        try:
            seen.append(x_of(next(pipe)))
        except StopIteration:
            return [*seen, "end"]
        except ValueError:
            seen.append("raised")
    return seen


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_a_predicate_raising_at_the_first_and_last_record_resumes_around_each_error(kind: str) -> None:
    def build() -> Node[Any]:
        return source(kind).filter(RaiseAt(0, SIZE - 1))

    reference = outcomes(build())
    assert reference.count("raised") == 2 and reference[-1] == "end"
    assert sorted(x for x in reference if isinstance(x, int)) == list(range(1, SIZE - 1, 2))
    for cut in range(len(reference)):
        pipe = build()
        head = outcomes(pipe, cut)
        state = roundtrip(pipe.get_state())
        resumed = build()
        resumed.set_state(state)
        assert head + outcomes(resumed) == reference, cut
    assert reference[0] == "raised"  # record 0 comes first: a stream's first file holds it


def test_the_dropped_count_of_a_restored_filter_is_the_uninterrupted_one_s() -> None:
    def build() -> Node[Any]:
        return source("parquet").shuffle(1).filter(keep_mod3).repeat(2)

    whole = build()
    counts = []
    for _ in whole:
        counts.append(whole.upstream.dropped)
    for k in (0, 1, 5, len(counts) - 1):
        pipe = build()
        for _ in range(k):
            next(pipe)
        resumed = build()
        resumed.set_state(roundtrip(pipe.get_state()))
        assert resumed.upstream.dropped == (counts[k - 1] if k else 0)
        assert [resumed.upstream.dropped for _ in resumed] == counts[k:]


# -- batch ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [1, 4, SIZE, SIZE + 1, 10**9])
@pytest.mark.parametrize("drop_last", [False, True])
def test_batches_partition_the_epoch_and_len_counts_them(size: int, drop_last: bool) -> None:
    for kind in ("list", "arrow_stream", "jsonl_stream"):
        pipe = source(kind).batch(size, drop_last=drop_last)
        batches = [[x_of(r) for r in batch] for batch in pipe]
        whole, rest = divmod(SIZE, size)
        assert [len(b) for b in batches] == [size] * whole + ([rest] if rest and not drop_last else [])
        if kind in INDEXED_KINDS:
            assert len(pipe) == len(batches)
            assert flat(batches) == list(range(len(flat(batches))))
        else:
            with pytest.raises(TypeError, match="JsonlStream"):
                len(pipe)


# -- cache ---------------------------------------------------------------------------------------


class Counted:
    """``mapped``, counting its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, record: Any) -> dict[str, Any]:
        self.calls += 1
        return mapped(record)


@pytest.mark.parametrize("kind", INDEXED_KINDS)
@pytest.mark.parametrize("where", ["memory-larger", "memory-smaller", "memory-none", "disk"])
def test_a_cached_epoch_equals_the_computed_one_and_no_cache_at_all(kind: str, where: str, tmp_path: Path) -> None:
    options: dict[str, Any] = {
        "memory-larger": {},
        "memory-smaller": {"max_bytes": 600},
        "memory-none": {"max_bytes": 0},
        "disk": {"directory": str(tmp_path)},
    }[where]
    reference = source(kind).map(mapped).shuffle(7)
    expected = [[plain(r) for r in reference] for _ in range(3)]
    count = Counted()
    cached = source(kind).map(count).cache(**options).shuffle(7)
    assert len(cached) == SIZE
    got = [[plain(r) for r in cached] for _ in range(3)]
    assert got == expected
    if where in ("memory-larger", "disk"):
        assert count.calls == SIZE  # epochs 2 and 3 read what epoch 1 computed
    elif where == "memory-none":
        assert count.calls == 3 * SIZE
    else:
        assert SIZE < count.calls < 3 * SIZE  # some records evicted, some read


def shift_in_place(record: dict[str, Any]) -> dict[str, Any]:
    """A map that edits its record in place, as many tokenising maps do (``record["ids"] = ...``)."""
    record["ids"] = record["ids"] + 1
    return record


def with_ids(record: Any) -> dict[str, Any]:
    return {"x": x_of(record), "ids": np.arange(3, dtype=np.int64) + x_of(record)}


@pytest.mark.parametrize("compared", ["epoch-2-with-epoch-1", "restored-with-uninterrupted"])
def test_a_map_editing_its_record_in_place_after_a_memory_cache_changes_no_later_epoch(compared: str) -> None:
    """docs/cache.md: "cold, warm and half-filled caches produce the same stream"; without the
    cache (or with ``max_bytes=0``) every epoch of this pipeline is the same."""

    def build(**options: Any) -> Node[Any]:
        return source("jsonl").map(with_ids).cache(**options).shuffle(1).map(shift_in_place)

    uncached = build(max_bytes=0)  # nothing kept: every epoch computes its records afresh
    expected = [[plain(r) for r in uncached] for _ in range(2)]
    assert [[r["x"] + 1 for r in epoch] for epoch in expected] == [[r["ids"][0] for r in e] for e in expected]
    pipe = build()
    first = [plain(r) for r in pipe]
    assert first == expected[0]
    if compared == "epoch-2-with-epoch-1":
        assert [plain(r) for r in pipe] == expected[1]
    else:  # the state after epoch 1, restored into a fresh (cold) pipeline, against going on
        resumed = build()
        resumed.set_state(roundtrip(pipe.get_state()))
        assert [plain(r) for r in pipe] == [plain(r) for r in resumed]


LIST_VALUES = {
    "str-and-bytes": [b"a", "b"],
    "dicts-with-other-keys": [{"k": 1}, {"j": 2}],
    "tuples": [(1, 2)],
    "int-and-float": [1, 2.5],
}


@pytest.mark.parametrize("value", list(LIST_VALUES), ids=list(LIST_VALUES))
def test_a_disk_cache_serves_a_list_field_as_computed_or_refuses_it(value: str, tmp_path: Path) -> None:
    """docs/cache.md: "A record that has been cached equals the computed one"; tuples, nested
    dicts and mixed types are refused with a ConfigError when the block is written."""
    records = [{"x": i, "v": LIST_VALUES[value]} for i in range(4)]
    try:
        cached = list(rs.from_list(records).cache(str(tmp_path)))
    except rs.ConfigError:
        return  # refused, as the docs say such values are
    assert repr(cached) == repr(records)


# -- len() ---------------------------------------------------------------------------------------

KNOWN_LENGTHS: dict[str, Callable[[Node[Any]], Node[Any]]] = {
    "batch3": lambda s: s.batch(3),
    "batch3-drop-last": lambda s: s.batch(3, drop_last=True),
    "batch-beyond-drop-last": lambda s: s.batch(50, drop_last=True),
    "shard-threads-batch": lambda s: s.shuffle(1).shard(1, 3).map(mapped, num_workers=2).batch(2),
    "cache-shard-batch-drop-last-repeat3": lambda s: (
        s.cache(max_bytes=100).shuffle(1).shard(0, 2).batch(4, True).repeat(3)
    ),
    "threads-prefetch-repeat2": lambda s: s.map(mapped, num_workers=3).prefetch(2).repeat(2),
    "shard5-of-13-batch2": lambda s: s.shard(4, 5).batch(2),
}


@pytest.mark.parametrize("kind", INDEXED_KINDS)
def test_len_is_what_each_epoch_yields_also_after_a_restore_in_mid_epoch(kind: str) -> None:
    for name, nodes in KNOWN_LENGTHS.items():
        pipe = nodes(source(kind))
        length = len(pipe)
        assert [len(list(pipe)) for _ in range(3)] == [length] * 3, name
        pipe.close()
        cut = nodes(source(kind))
        taken = len([item for _, item in zip(range(max(length // 2, 1)), cut)])
        resumed = nodes(source(kind))
        resumed.set_state(roundtrip(cut.get_state()))
        cut.close()
        assert len(resumed) == length, name
        assert taken + len(list(resumed)) == length, name
        assert len(resumed) == length, name
        resumed.close()


@pytest.mark.parametrize(
    "nodes,names",
    [
        (lambda s: s.filter(keep_mod3).batch(2), "Filter"),
        (lambda s: s.shuffle(1).repeat().batch(2), "Repeat"),
        (lambda s: s.map(mapped, num_workers=2).filter(keep_mod3).repeat(2), "Filter"),
    ],
)
def test_len_of_a_streaming_filter_or_an_endless_repeat_is_a_type_error_naming_it(nodes: Any, names: str) -> None:
    for kind in ("list", "parquet"):
        with pytest.raises(TypeError, match=names):
            len(nodes(source(kind)))


# -- refused states ------------------------------------------------------------------------------

REFUSAL_CHAINS: dict[str, Callable[[Node[Any]], Node[Any]]] = {
    "cache-threads-filter-repeat-batch": lambda s: (
        s.cache(max_bytes=300)
        .shuffle(3)
        .shard(0, 2)
        .map(mapped, num_workers=2)
        .filter(keep_mod3)
        .repeat(3)
        .batch(2, drop_last=True)
    ),
    "filter-threads-batch-repeat": lambda s: s.filter(keep_mod3).map(mapped, num_workers=3).batch(3).repeat(2),
}

ODD_VALUES: list[Any] = [None, "x", -1, 2**70, [], {}, True, 1.5, 10**6]


def entries(value: Any, path: tuple[Any, ...] = ()) -> Any:
    """The path of every entry of a state, nested ones included."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        yield (*path, key)
        yield from entries(item, (*path, key))


def edited(state: dict[str, Any], path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    """A copy of ``state`` with the entry at ``path`` set to ``value`` (removed for ``entries``)."""
    copied = copy.deepcopy(state)
    holder = copied
    for key in path[:-1]:
        holder = holder[key]
    if value is entries:
        del holder[path[-1]]
    else:
        holder[path[-1]] = value
    return copied


@pytest.mark.parametrize("chain", list(REFUSAL_CHAINS))
def test_a_corrupted_state_raises_only_typed_errors_and_a_refused_one_changes_nothing(chain: str) -> None:
    def build() -> Node[Any]:
        return REFUSAL_CHAINS[chain](source("list"))

    with build() as whole:
        expected = [plain(x) for x in whole_run(whole, 12)]
    pipe = build()
    head = [plain(x) for x in whole_run(pipe, 4)]  # a thread pool's records are in flight now
    good = roundtrip(pipe.get_state())
    refused = 0
    for path in list(entries(good)):
        for value in [*ODD_VALUES, entries]:
            bad = edited(good, path, value)
            if bad == good:
                continue
            try:
                pipe.set_state(bad)
            except rs.ResumableError:
                refused += 1
                assert roundtrip(pipe.get_state()) == good, (path, value)
                continue
            pipe.set_state(good)  # accepted: it shapes nothing, or it is a position like another
    assert refused > 20
    assert head + [plain(x) for x in whole_run(pipe, 8)] == expected
    pipe.close()


def whole_run(pipe: Node[Any], count: int) -> list[Any]:
    return flat(loops(pipe, count))


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_a_scribbled_state_refused_after_the_end_or_before_the_start_changes_nothing(kind: str) -> None:
    def build() -> Node[Any]:
        if kind in STREAM_KINDS:
            return source(kind).map(mapped, num_workers=2).filter(keep_mod3).batch(2).repeat(2)
        return source(kind).shuffle(1).shard(1, 2).map(mapped, num_workers=2).filter(keep_mod3).batch(2).repeat(2)

    with build() as whole:
        expected = loops(whole, 20)
    assert len(expected) > 1
    for point in ("fresh", "mid", "ended"):
        pipe = build()
        head = [] if point == "fresh" else loops(pipe, 3) if point == "mid" else [[plain(x) for x in pipe]]
        state = roundtrip(pipe.get_state())
        bad = copy.deepcopy(state)
        scribble(bad)
        with pytest.raises(rs.ResumableError):
            pipe.set_state(bad)
        assert roundtrip(pipe.get_state()) == state, point
        rest = loops(pipe, len(flat(expected)) - len(flat(head)))
        assert flat(head + rest) == flat(expected), point
        pipe.close()


# -- through rs.torch.Loader ---------------------------------------------------------------------


def loader_chain_threads(kind: str = "list") -> Node[Any]:
    return source(kind).cache(max_bytes=300).shuffle(2).shard().map(mapped, num_workers=2).filter(drop_first).batch(2)


def loader_chain_repeat(kind: str = "parquet") -> Node[Any]:
    return source(kind).shuffle(1).shard().map(ragged).repeat(2).batch(3, drop_last=True)


def loader_chain_stream(kind: str = "jsonl_stream") -> Node[Any]:
    return stream_source(kind, RECORDS, files=4, shuffle_files=1).filter(keep_mod3).batch(2, collate_fn=xs)


LOADER_CHAINS = {"threads": loader_chain_threads, "repeat-ragged": loader_chain_repeat, "stream": loader_chain_stream}


@pytest.mark.parametrize("config", list(LOADER_CONFIGS))
@pytest.mark.parametrize("chain", list(LOADER_CHAINS))
def test_a_loader_cut_at_an_edge_resumes_exactly_across_epochs(chain: str, config: str) -> None:
    build, options = LOADER_CHAINS[chain], LOADER_CONFIGS[config]
    with rst.Loader(build, **options) as reference:
        expected = [loader_epoch(reference) for _ in range(3)]
    assert all(expected) and expected[0] != expected[1]
    if chain == "repeat-ragged":  # numpy arrays became tensors; batches hold whole dicts
        assert all(len(batch) == 3 for epoch in expected for batch in epoch)
        first = next(iter(rst.Loader(build, num_workers=0)))
        assert {type(item["ids"]).__name__ for item in first} == {"Tensor"}
    cuts = [(0, 1), (0, len(expected[0])), (0, "ended"), (1, len(expected[1]) // 2)]
    if config != "0-workers":
        cuts = cuts[1:3] if chain == "stream" else cuts[::2]
    for epoch, taken in cuts:
        with rst.Loader(build, **options) as loader:
            for _ in range(epoch):
                loader_epoch(loader)
            iterator = iter(loader)
            if taken == "ended":
                head = [plain(batch) for batch in iterator]
            else:
                head = [plain(next(iterator)) for _ in range(taken)]
            state = json.loads(json.dumps(loader.state_dict()))
            del iterator
        with rst.Loader(build, **options) as resumed:
            resumed.load_state_dict(state)
            rest = [] if taken == "ended" else loader_epoch(resumed)
            assert head + rest == expected[epoch], (epoch, taken)
            nxt = iter(resumed)
            one = plain(next(nxt))
            again = json.loads(json.dumps(resumed.state_dict()))  # restored twice in a row
            del nxt
        with rst.Loader(build, **options) as second:
            second.load_state_dict(again)
            assert [one, *loader_epoch(second)] == expected[epoch + 1], (epoch, taken)
