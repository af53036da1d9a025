"""``map(fn, num_workers=k, batched=True)``: ``fn`` maps a whole chunk in one call (a list of
records in, one result per record out) and the node behaves as a map of each record alone:
same items, exact resume at any point, errors at their records, packer restores."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import resumable as rs
from resumable import Node
from resumable.ops.parallel_map import MapError
from tests.resume import check_closed_resume, check_resume, loader_batches, take
from tests.sources import INDEXED_KINDS, STREAM_KINDS, indexed_source, stream_source

N = 60
RECORDS = [{"id": i, "text": "w" * (i % 17 + 1)} for i in range(N)]


# Module-level functions: process mode pickles them by reference.
def encode(record: dict[str, Any]) -> dict[str, Any]:
    """What a tokenizer does to one record."""
    return {"id": record["id"], "input_ids": np.arange(len(record["text"]), dtype=np.int64) + 100 * record["id"]}


def encode_batch(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``encode`` over a list, in one call (as ``Tokenizer.encode_batch``)."""
    return [encode(record) for record in records]


def as_plain(item: dict[str, Any]) -> tuple[int, list[int]]:
    return item["id"], np.asarray(item["input_ids"]).tolist()


def columns(records: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """``datasets``' batched form (a dict of columns): not ours."""
    return {"id": [record["id"] for record in records]}


def drops_one(xs: list[int]) -> list[int]:
    return xs[:-1]


def one_result(xs: list[int]) -> int:
    return len(xs)


def batched_chain(kind: str, mode: str = "thread", workers: int = 2, repeat: str = "") -> Node[Any]:
    pipe: Node[Any] = indexed_source(kind, RECORDS).shuffle(11)
    if repeat == "before":
        pipe = pipe.repeat()
    pipe = pipe.map(encode_batch, num_workers=workers, mode=mode, batched=True)
    pipe = pipe.filter(lambda item: item["id"] % 3 != 0).map(as_plain)
    if repeat == "after":
        pipe = pipe.repeat()
    return pipe.batch(4)


@pytest.mark.parametrize("kind", INDEXED_KINDS)
def test_a_batched_map_hands_out_what_a_map_of_each_record_does(kind: str) -> None:
    expected = [as_plain(encode(record)) for record in indexed_source(kind, RECORDS).shuffle(11)]
    for mode in ("thread", "process"):
        pipe = indexed_source(kind, RECORDS).shuffle(11).map(encode_batch, num_workers=2, mode=mode, batched=True)
        assert [as_plain(item) for item in pipe] == expected
        pipe.close()


@pytest.mark.parametrize("kind", STREAM_KINDS)
def test_a_batched_map_over_a_stream_resumes_exactly(kind: str) -> None:
    def build() -> Node[Any]:
        pipe = stream_source(kind, RECORDS).map(encode_batch, num_workers=2, batched=True)
        return pipe.map(as_plain).batch(5)

    total = N // 5
    for k in (0, 1, 7, total - 1, total):
        check_resume(build, k, total + 3)


@pytest.mark.parametrize(
    "kind, repeat", [(kind, "") for kind in INDEXED_KINDS] + [("list", "before"), ("jsonl", "after")]
)
def test_a_batched_thread_map_resumes_exactly_at_any_point(kind: str, repeat: str) -> None:
    # 40 records pass the filter per epoch -> 10 batches; with a repeat, across epochs.
    total = 24 if repeat else 10
    build = functools.partial(batched_chain, kind, repeat=repeat)
    for k in (0, 1, 4, 9, 10, 11, 17):
        if k <= total:
            check_resume(build, k, total)
    check_resume(build, 2, total, k2=total - 1)


def test_a_batched_process_map_resumes_exactly() -> None:
    build = functools.partial(batched_chain, "jsonl", mode="process", repeat="after")
    check_resume(build, 10, 24, k2=13)


def test_a_state_of_a_batched_map_continues_in_an_unbatched_one_and_back() -> None:
    """``batched`` shapes no data: it is not in the state."""
    source = functools.partial(indexed_source, "list", RECORDS)
    batched = source().shuffle(4).map(encode_batch, num_workers=2, batched=True)
    plain = source().shuffle(4).map(encode, num_workers=2)
    expected = [as_plain(encode(record)) for record in source().shuffle(4)]
    head = [as_plain(item) for item in take(batched, 23)]
    plain.set_state(batched.get_state())
    middle = [as_plain(item) for item in take(plain, 20)]
    again = source().shuffle(4).map(encode_batch, num_workers=3, mode="process", batched=True)
    again.set_state(plain.get_state())
    assert head + middle + [as_plain(item) for item in again] == expected
    for pipe in (batched, plain, again):
        pipe.close()


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_a_packer_after_a_batched_map_restores_exactly(mode: str) -> None:
    """The restored packer fetches its buffered records again through the batched ``fn``
    (several at once, and one alone)."""

    def build() -> Node[Any]:
        pipe = indexed_source("jsonl", RECORDS).shuffle(9).map(encode_batch, num_workers=2, mode=mode, batched=True)
        return pipe.pack(24, strategy="best_fit", buffer_size=6)

    check_closed_resume(build, (1, 7, 19) if mode == "thread" else (7,), 30)


def test_fetch_maps_one_record_through_the_batched_fn() -> None:
    pipe = indexed_source("list", RECORDS).shuffle(5).map(encode_batch, num_workers=2, batched=True)
    item = next(pipe)
    key = pipe.last_key()
    assert key is not None and as_plain(pipe.fetch(key)) == as_plain(item)
    assert [as_plain(x) for x in pipe.fetch_many([key, key])] == [as_plain(item)] * 2
    assert pipe.fetch_many([]) == []
    pipe.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_loader_over_a_batched_map_resumes_exactly(workers: int) -> None:
    from resumable.torch import Loader  # here: process pools import this module, and need no torch

    def build() -> Node[Any]:
        pipe = indexed_source("jsonl", RECORDS).shuffle(2).shard()
        return pipe.map(encode_batch, num_workers=1, batched=True).map(lambda item: item["id"]).batch(3)

    whole, _ = loader_batches(Loader(build, num_workers=workers))
    for stop in (1, len(whole) // 2, len(whole)):
        head, state = loader_batches(Loader(build, num_workers=workers), stop=stop)
        resumed = Loader(build, num_workers=workers)
        resumed.load_state_dict(state)
        rest, _ = loader_batches(resumed)
        assert head + rest == whole
    assert sorted(x for batch in whole for x in batch) == list(range(N))


# -- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize("fn", [columns, drops_one, one_result], ids=lambda fn: fn.__name__)
@pytest.mark.parametrize("mode", ["thread", "process"])
def test_a_batched_fn_that_does_not_return_one_result_per_record_is_a_map_error(fn: Any, mode: str) -> None:
    pipe = indexed_source("list", RECORDS).map(fn, num_workers=2, mode=mode, batched=True)
    with pytest.raises(MapError) as info:
        next(pipe)
    assert info.value.key == (0, 0)
    assert isinstance(info.value.__cause__, rs.ConfigError)
    assert "one result per record" in str(info.value.__cause__)
    pipe.close()


@pytest.mark.parametrize("kind", ["list", "jsonl"])
def test_batched_needs_a_pool_and_a_bool(kind: str) -> None:
    source = indexed_source(kind, RECORDS)
    with pytest.raises(rs.ConfigError, match="num_workers >= 1"):
        source.map(encode_batch, batched=True)
    with pytest.raises(rs.ConfigError, match="num_workers >= 1"):
        source.shuffle(1).shard().map(encode_batch, batched=True)  # an iterator node's map too
    for wrong in (1, "yes", None):
        with pytest.raises(rs.ConfigError, match="batched"):
            source.map(encode_batch, num_workers=2, batched=wrong)


@settings(max_examples=25, deadline=None)
@given(
    failing=st.sets(st.integers(0, 199), max_size=6),
    k=st.integers(0, 200),
    workers=st.integers(1, 3),
)
def test_batched_with_failures_resumes_exactly_anywhere(failing: set[int], k: int, workers: int) -> None:
    """Whatever records fail and wherever the state is taken, a batched map hands out what a
    map of each record alone does, errors included, and a restore continues it exactly."""

    def fn(xs: list[int]) -> list[int]:
        if failing.intersection(xs):
            raise ValueError("bad record")
        return [3 * x for x in xs]

    def outcomes(pipe: Node[Any], count: int) -> list[Any]:
        seen: list[Any] = []
        while len(seen) < count:
            try:
                seen.append(next(pipe))
            except MapError as error:
                seen.append(("error", error.key))
            except StopIteration:
                break
        return seen

    def build() -> Node[Any]:
        return rs.from_list(list(range(200))).shuffle(7).map(fn, num_workers=workers, batched=True)

    order = list(rs.from_list(list(range(200))).shuffle(7))
    expected = [("error", (0, x)) if x in failing else 3 * x for x in order]
    first = build()
    head = outcomes(first, k)
    state = first.get_state()
    first.close()
    resumed = build()
    resumed.set_state(state)
    assert head + outcomes(resumed, 200) == expected
    resumed.close()


def empties_and_fails(xs: list[int]) -> list[int]:
    """Changes the list it is given, then fails: the retry record by record must not care."""
    xs.clear()
    raise ValueError("after clearing")


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_a_fn_that_changes_its_list_does_not_change_the_records_retried(mode: str) -> None:
    pipe = rs.from_list(list(range(10))).map(empties_and_fails, num_workers=1, mode=mode, batched=True)
    keys = []
    for _ in range(10):
        with pytest.raises(MapError) as info:
            next(pipe)
        keys.append(info.value.key)
    assert keys == [(0, x) for x in range(10)]
    pipe.close()
