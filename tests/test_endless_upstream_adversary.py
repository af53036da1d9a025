"""Nodes that keep nothing of an endless upstream: a streaming filter, and the packer.

After ``repeat()`` or a mix with ``on_end="restart"``, a streaming filter that dropped a whole
upstream epoch in a row warns once with ``rs.BarrenEpochWarning`` (made an error, it stops the run
instead of reading for ever), and so does the packer when a whole epoch has no tokens
(docs/filter.md, docs/packing.md). Here: pipelines that keep rarely but surely must never
fail, and must not warn where every epoch keeps something; pipelines that can keep nothing must
stop (the filter with its warning made an error), never hang: each run is guarded by a thread
with a join timeout, and a predicate or map that ends the run once the guard gave up. Messages
name the node and no internal key part. A state taken between kept items, restored into a fresh
pipeline, continues as the uninterrupted run, up to the same items or the same error.

Items without a record key (a filter after ``batch()`` or ``pack()``) are documented as
unchecked and are not tried here.
"""

from __future__ import annotations

import json
import re
import threading
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

import resumable as rs
from resumable.torch import Loader
from tests.resume import check_resume, restored, take
from tests.sources import INDEXED_KINDS, STREAM_KINDS, indexed_source, stream_source

GUARD_SECONDS = 60.0
"""How long a run may take before it counts as reading for ever (each takes well under 2 s)."""

RARE = 7
"""The one record a rare filter keeps."""

_STOP = threading.Event()


class _Stopped(Exception):
    """Raised inside a run the guard gave up on, so that its thread ends."""


def _watch() -> None:
    if _STOP.is_set():
        raise _Stopped


def never(item: Any) -> bool:
    _watch()
    return False


class Never:
    """A predicate keeping nothing that gives up (raises ``_Stopped``) after ``calls`` calls: a
    run stopped by it read on where the filter should have stopped it, counted, not timed.
    Loader workers use it too, so that one that reads on stops and shuts down at once."""

    def __init__(self, calls: int = 20_000) -> None:
        self.calls = calls
        self.left = calls

    def __call__(self, item: Any) -> bool:
        _watch()
        self.left -= 1
        if self.left < 0:
            raise _Stopped(f"the predicate gave up after {self.calls} calls")
        return False


def value(item: Any) -> int:
    return int(item["x"]) if isinstance(item, dict) else int(item)


def is_rare(item: Any) -> bool:
    _watch()
    return value(item) == RARE


def watched(item: Any) -> Any:
    """A map that lets a guarded packer run be stopped."""
    _watch()
    return item


def same(item: Any) -> Any:
    return item


def outcome(run: Callable[[], Any]) -> dict[str, Any]:
    """``{"value": ...}`` or ``{"error": ...}`` of ``run()``; fails the test when it has not
    finished within ``GUARD_SECONDS`` (the run is then stopped through ``_watch``)."""
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["value"] = run()
        except BaseException as error:  # noqa: BLE001  # handed to the test thread
            result["error"] = error

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(GUARD_SECONDS)
    if thread.is_alive():
        _STOP.set()
        thread.join(10)
        _STOP.clear()
        pytest.fail(f"still reading after {GUARD_SECONDS:.0f} s: the endless upstream is read for ever")
    return result


@contextmanager
def barren_filters_fail() -> Iterator[None]:
    """The documented way to stop a filter that keeps nothing: its warning made an error."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", rs.BarrenEpochWarning)
        yield


def failure(run: Callable[[], Any], kind: type[BaseException] = rs.BarrenEpochWarning) -> str:
    """The message of the ``kind`` that ``run()`` raises, the barren-epoch warning made an
    error (fails if it hangs, raises something else or returns)."""
    with barren_filters_fail():
        result = outcome(run)
    error = result.get("error")
    assert isinstance(error, kind), f"expected {kind.__name__}, got {result!r}"
    return str(error)


def filter_failure(run: Callable[[], Any]) -> str:
    """The message of the ``rs.BarrenEpochWarning`` that ``run()`` raises, the warning made an error."""
    with barren_filters_fail():
        return failure(run, rs.BarrenEpochWarning)


def kept(run: Callable[[], list[Any]]) -> tuple[list[int], int]:
    """``run()``'s items as ints and how many ``rs.BarrenEpochWarning`` it gave, failing on any error
    or a hang."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", rs.BarrenEpochWarning)
        result = outcome(run)
    assert "error" not in result, f"raised {result['error']!r}"
    return [value(item) for item in result["value"]], sum(isinstance(w.message, rs.BarrenEpochWarning) for w in caught)


def values(run: Callable[[], list[Any]]) -> list[int]:
    """``run()``'s items as ints; fails on any error, a hang or a ``rs.BarrenEpochWarning``: every
    epoch of these pipelines keeps an item."""
    items, warned = kept(run)
    assert warned == 0, "a filter whose every epoch keeps an item warned"
    return items


def assert_names_no_internals(message: str) -> None:
    for internal in ("Stride", "consumer=", "consumers=", "RecordKey", "BarrenEpochs", "(('"):
        assert internal not in message, message


def numbers(count: int, start: int = 0) -> rs.Node[Any]:
    return rs.from_list(list(range(start, start + count)))


def records(count: int) -> list[dict[str, int]]:
    return [{"x": index} for index in range(count)]


def documents(count: int, with_tokens: Callable[[int], bool]) -> list[dict[str, list[int]]]:
    """Documents of 4 tokens (a whole row of ``pack(4)``, handed out at once) or none."""
    return [{"input_ids": [1, 2, 3, 4] if with_tokens(index) else []} for index in range(count)]


def row_ids(row: dict[str, Any]) -> list[int]:
    return [int(x) for x in row["input_ids"]]


# -- true positives: nothing can come, so a stop (the filter's warning made an error), not a hang -----


FILTER_MESSAGE = r"^Filter: the predicate kept no item of epoch \d+"


@pytest.mark.parametrize("kind", INDEXED_KINDS + STREAM_KINDS)
def test_every_source_kind_dropped_whole_warns(kind: str) -> None:
    data = records(30)
    source = indexed_source(kind, data) if kind in INDEXED_KINDS else stream_source(kind, data)
    pipe = source.repeat().filter(never)
    message = filter_failure(lambda: take(pipe, 1))
    assert_names_no_internals(message)
    assert re.match(FILTER_MESSAGE, message), message
    # it looks every 1024 drops in a row, and the message counts them as the node does
    in_a_row = int(re.search(r"\((\d+) dropped in a row\)", message).group(1))  # type: ignore[union-attr]
    assert in_a_row % 1024 == 0 and in_a_row == pipe.dropped


BELOW = {
    "shuffle+shard": lambda: numbers(40).shuffle(seed=1).shard(1, 3).repeat(),
    "shard": lambda: numbers(40).shard(0, 3).repeat(),
    "block shuffle+shard": lambda: numbers(40).shuffle(seed=2, block_size=4).shard(2, 3).repeat(),
    "map": lambda: numbers(40).repeat().map(same),
    "map below repeat": lambda: numbers(40).map(same).shuffle(seed=3).repeat(),
    "prefetch": lambda: numbers(40).repeat().prefetch(4),
    "prefetch below repeat": lambda: numbers(40).prefetch(2).repeat(),
    "thread map": lambda: numbers(40).repeat().map(same, num_workers=2),
    "process map": lambda: numbers(40).repeat().map(same, num_workers=2, mode="process"),
    "cache": lambda: numbers(40).cache().shuffle(seed=4).repeat(),
    "filter": lambda: numbers(40).repeat().filter(lambda x: x % 2 == 0),
    "stream shuffle_files": lambda: stream_source("jsonl_stream", records(40), shuffle_files=5).repeat(),
}


def dropped_whole(upstream: rs.Node[Any]) -> str:
    """The message of the warning (made an error) of a filter keeping nothing of ``upstream``."""
    pipe = upstream.filter(never)
    try:
        message = filter_failure(lambda: take(pipe, 1))
    finally:
        pipe.close()
    assert_names_no_internals(message)
    assert message.startswith("Filter: the predicate kept no item of epoch"), message
    return message


@pytest.mark.parametrize("below", list(BELOW))
def test_below_any_node_dropped_whole_warns(below: str) -> None:
    dropped_whole(BELOW[below]())


def nested_restart() -> rs.Node[Any]:
    inner = rs.mix({"c": numbers(30).shuffle(seed=1), "d": numbers(7, 100)}, on_end="restart", seed=1)
    return rs.mix({"x": inner, "y": numbers(11, 200).shard(0, 2)}, on_end="restart", seed=2)


MIXES = {
    "flat restart": lambda: rs.mix({"a": numbers(30), "b": numbers(9, 100)}, on_end="restart"),
    "flat restart of shards": lambda: rs.mix(
        {"a": numbers(30).shuffle(seed=0).shard(0, 2), "b": numbers(9, 100).shard(1, 2)}, on_end="restart"
    ),
    "restart in restart": nested_restart,
    "stop in restart": lambda: rs.mix(
        {"x": rs.mix({"c": numbers(30), "d": numbers(7, 100)}), "y": numbers(11, 200)}, on_end="restart"
    ),
    "drop in restart": lambda: rs.mix(
        {"x": rs.mix({"c": numbers(30), "d": numbers(7, 100)}, on_end="drop"), "y": numbers(11, 200)},
        on_end="restart",
    ),
    "three deep": lambda: rs.mix(
        {"x": rs.mix({"m": nested_restart(), "n": numbers(5, 300)}, on_end="restart"), "y": numbers(3, 400)},
        on_end="restart",
    ),
    "stop, repeated": lambda: rs.mix({"a": numbers(30), "b": numbers(9, 100)}).repeat(),
    "drop, repeated": lambda: rs.mix({"a": numbers(30), "b": numbers(9, 100)}, on_end="drop").repeat(),
    "of repeats": lambda: rs.mix({"a": numbers(30).repeat(), "b": numbers(9, 100).repeat()}),
    "of repeat(2)s": lambda: rs.mix({"a": numbers(30).repeat(2), "b": numbers(9, 100)}, on_end="restart"),
    "restart, prefetched": lambda: rs.mix({"a": numbers(300), "b": numbers(90, 1000)}, on_end="restart").prefetch(),
}


@pytest.mark.parametrize("name", list(MIXES))
def test_a_mix_dropped_whole_warns_naming_a_component(name: str) -> None:
    message = dropped_whole(MIXES[name]())
    assert " of mix component " in message, message


def test_a_mix_whose_only_keeping_component_has_no_weight_warns() -> None:
    """Only the components the mix still chooses from count."""
    pipe = rs.mix({"a": numbers(30), "b": numbers(9, 100)}, weights={"a": 0.0, "b": 1.0}, on_end="restart")
    message = filter_failure(lambda: take(pipe.filter(lambda x: x < 100), 1))
    assert "of mix component b" in message


PACKED_BARREN = {
    "list": lambda: rs.from_list(documents(20, lambda i: False)).repeat(),
    "jsonl": lambda: indexed_source("jsonl", documents(20, lambda i: False)).repeat(),
    "stream": lambda: stream_source("jsonl_stream", documents(20, lambda i: False)).repeat(),
    "shuffle+shard": lambda: rs.from_list(documents(20, lambda i: False)).shuffle(seed=0).shard(1, 2).repeat(),
    "nested mixes": lambda: rs.mix(
        {
            "x": rs.mix(
                {
                    "c": rs.from_list(documents(5, lambda i: False)).shard(0, 2),
                    "d": rs.from_list(documents(3, lambda i: False)),
                },
                on_end="restart",
            ),
            "y": rs.from_list(documents(4, lambda i: False)),
        },
        on_end="restart",
    ),
}


@pytest.mark.parametrize("name", list(PACKED_BARREN))
@pytest.mark.parametrize("strategy", ["greedy", "best_fit"])
def test_a_packer_given_no_tokens_is_an_error(name: str, strategy: str) -> None:
    pipe = PACKED_BARREN[name]().map(watched).pack(8, strategy=strategy)
    message = failure(lambda: take(pipe, 1))
    assert_names_no_internals(message)
    assert message.startswith("Pack: no document of epoch"), message
    assert ("of mix component x/" in message) == (name == "nested mixes"), message


def test_a_packer_dropping_every_overlong_document_is_an_error() -> None:
    pipe = rs.from_list([{"input_ids": list(range(20))}] * 5).repeat().map(watched).pack(8, overlong="drop")
    message = failure(lambda: take(pipe, 1))
    assert "dropped as longer than seq_len" in message


def loader_barren() -> rs.Node[Any]:
    return numbers(40).shuffle(seed=0).shard().repeat().filter(Never())


def loader_barren_mix() -> rs.Node[Any]:
    inner = rs.mix({"c": numbers(30).shard(), "d": numbers(6, 100).shard()}, on_end="restart")
    return rs.mix({"x": inner, "y": numbers(20, 200).shard()}, on_end="restart").filter(Never())


def loader_barren_pack() -> rs.Node[Any]:
    return rs.from_list(documents(40, lambda i: False)).shard().repeat().map(watched).pack(8)


@pytest.mark.parametrize(
    "build, start, num_workers",
    [
        (loader_barren, "Filter: ", 0),
        (loader_barren, "Filter: ", 2),
        (loader_barren_mix, "Filter: ", 0),
        (loader_barren_mix, "Filter: ", 2),
        (loader_barren_pack, "Pack: ", 0),
    ],
)
def test_through_the_loader_dropped_whole_stops(
    build: Callable[[], rs.Node[Any]], start: str, num_workers: int
) -> None:
    """Forked workers inherit the warning made an error (spawned ones would not)."""
    options: dict[str, Any] = {"timeout": GUARD_SECONDS} if num_workers else {}
    with barren_filters_fail():
        loader = Loader(build, num_workers=num_workers, **options)
        message = failure(lambda: next(iter(loader)), rs.BarrenEpochWarning)
    assert_names_no_internals(message.split("Original Traceback")[-1].splitlines()[-1])
    assert start + ("the predicate kept no item" if start == "Filter: " else "no document of epoch") in message


def test_a_filter_stopped_by_its_warning_stops_again_when_called_again() -> None:
    pipe = numbers(40).repeat().filter(Never())
    with barren_filters_fail():
        first = failure(lambda: take(pipe, 1), rs.BarrenEpochWarning)
        again = failure(lambda: next(pipe), rs.BarrenEpochWarning)
    assert first.startswith("Filter: the predicate kept no item") and again.startswith(first[:30])


def test_a_filter_warns_once_and_reads_on() -> None:
    """The warning itself, not made an error: given once, and the filter goes on reading (here
    until its predicate gives up)."""
    pipe = numbers(40).repeat().filter(Never())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", rs.BarrenEpochWarning)
        result = outcome(lambda: take(pipe, 1))
    assert isinstance(result.get("error"), _Stopped), result
    messages = [str(w.message) for w in caught if isinstance(w.message, rs.BarrenEpochWarning)]
    assert len(messages) == 1 and messages[0].startswith("Filter: the predicate kept no item of epoch"), messages
    assert_names_no_internals(messages[0])


# -- false positives: rare but sure keeps never fail, and never warn where every epoch keeps --------


def test_one_record_of_5000_kept_each_epoch_is_found_epoch_after_epoch() -> None:
    for build in (
        lambda: numbers(5000).shuffle(seed=5).repeat().filter(is_rare),
        lambda: numbers(5000).shuffle(seed=6).repeat().prefetch(3).filter(is_rare),
        lambda: numbers(5000).shuffle(seed=7).repeat().map(same, num_workers=2).filter(is_rare),
        lambda: indexed_source("parquet", records(5000)).shuffle(seed=8).repeat().filter(is_rare),
    ):
        pipe = build()
        assert values(lambda: take(pipe, 4)) == [RARE] * 4
        pipe.close()


def test_a_record_kept_early_in_one_epoch_then_late_in_the_next_is_no_error() -> None:
    """The longest legitimate run: nearly two whole epochs dropped in a row (the kept record at
    position 176 of epoch 1, then at 2934 of epoch 2, of 3000)."""
    source = numbers(3000).shuffle(seed=11)
    positions = [list(source).index(RARE) for _ in range(3)]
    assert positions[1:] == [176, 2934]
    pipe = numbers(3000).shuffle(seed=11).repeat().filter(is_rare)
    assert values(lambda: take(pipe, 4)) == [RARE] * 4


def test_epochs_of_one_record() -> None:
    assert values(lambda: take(numbers(1, RARE).repeat().filter(is_rare), 3)) == [RARE] * 3
    mix = rs.mix({"a": numbers(1), "b": numbers(1, RARE), "c": numbers(1, 50)}, on_end="restart")
    assert values(lambda: take(mix.filter(is_rare), 3)) == [RARE] * 3
    # a one-record component that is always dropped, restarted thousands of times meanwhile
    mix = rs.mix({"a": numbers(1, 10_000), "b": numbers(3000).shuffle(seed=1)}, on_end="restart")
    assert values(lambda: take(mix.filter(is_rare), 3)) == [RARE] * 3


@pytest.mark.parametrize("schedule", ["smooth", "random"])
def test_a_mix_with_one_component_all_dropped_and_another_keeping_rarely(schedule: str) -> None:
    mix = rs.mix(
        {"dropped": numbers(10, 10_000), "rare": numbers(500).shuffle(seed=2)},
        weights={"dropped": 0.9, "rare": 0.1},
        on_end="restart",
        schedule=schedule,
        seed=3,
    )
    pipe = mix.filter(is_rare)
    assert values(lambda: take(pipe, 2)) == [RARE] * 2
    # weights that change between items: the rare component scarcer, then back
    mix.set_weights({"dropped": 0.98, "rare": 0.02})
    assert values(lambda: take(pipe, 2)) == [RARE] * 2
    mix.set_weights({"dropped": 0.5, "rare": 0.5})
    assert values(lambda: take(pipe, 2)) == [RARE] * 2


def test_a_mix_whose_barren_component_leaves_keeps_the_rest() -> None:
    """A barren component of a restarting mix that runs out (drop) leaves; the other keeps."""
    inner = rs.mix({"gone": numbers(40, 10_000), "rare": numbers(700).shuffle(seed=4)}, on_end="drop")
    pipe = rs.mix({"x": inner, "y": numbers(5, 20_000)}, weights={"x": 3, "y": 1}, on_end="restart").filter(is_rare)
    assert values(lambda: take(pipe, 3)) == [RARE] * 3


def test_a_consumer_with_no_records_ends_its_epochs_and_raises_nothing(tmp_path: Path) -> None:
    pipe = numbers(3).shuffle(seed=0).shard(3, 4).repeat().filter(is_rare)
    assert values(lambda: take(pipe, 1)) == []
    # a stream whose consumer gets a file without records in some epochs only
    (tmp_path / "a.jsonl").write_text("\n\n")
    (tmp_path / "b.jsonl").write_text("".join(json.dumps({"x": x}) + "\n" for x in range(1500)))
    for rank in (0, 1):
        stream = rs.jsonl_stream(str(tmp_path / "*.jsonl"), shuffle_files=1, rank=rank, world_size=2)
        pipe = stream.repeat().filter(is_rare)
        assert set(values(lambda: take(pipe, 3))) <= {RARE}


def test_a_packer_with_rare_tokens_packs_them() -> None:
    docs = documents(3000, lambda i: i == RARE)
    for build in (
        lambda: rs.from_list(docs).shuffle(seed=1).repeat(),
        lambda: rs.mix(
            {"empty": rs.from_list(documents(10, lambda i: False)), "rare": rs.from_list(docs).shuffle(seed=2)},
            weights={"empty": 0.8, "rare": 0.2},
            on_end="restart",
        ),
    ):
        for strategy in ("greedy", "best_fit"):
            rows = outcome(lambda: take(build().map(watched).pack(4, strategy=strategy), 3))
            assert "error" not in rows, rows
            assert [row_ids(row) for row in rows["value"]] == [[1, 2, 3, 4]] * 3


# -- consumers whose epochs change: the kept record reaches them now and then -------------------------


def sharded_rare(rank: int) -> rs.Node[Any]:
    return numbers(3000).shuffle(seed=0).shard(rank, 4).repeat()


def stream_rare(rank: int) -> rs.Node[Any]:
    return stream_source("jsonl_stream", records(1200), files=12, shuffle_files=0, rank=rank, world_size=4).repeat()


def stopping_mix_rare(rank: int) -> rs.Node[Any]:
    return rs.mix({"a": numbers(3000).shuffle(seed=0), "b": numbers(10, 10_000)}).repeat()


RESHUFFLED = {
    # consumer 0 of 4 gets record 7 in epochs 10 and 11 of the first 12, consumer 2 in 1, 2 and 7
    "shuffle+shard, rank 0": (sharded_rare, 0),
    "shuffle+shard, rank 2": (sharded_rare, 2),
    # file 1 (holding record 7) goes to consumer 1 in epochs 2 and 10, to consumer 2 in 4 and 5
    "stream shuffle_files, rank 1": (stream_rare, 1),
    "stream shuffle_files, rank 2": (stream_rare, 2),
    # each mix epoch reads about 10 records of a's new shuffle
    "stopping mix, repeated": (stopping_mix_rare, 0),
}


@pytest.mark.parametrize("name", list(RESHUFFLED))
def test_the_rare_record_reaches_the_consumer_in_some_epochs_only(name: str) -> None:
    """The premise of the cases below: the kept record does come again, after epochs of this
    consumer that lacked it."""
    build, rank = RESHUFFLED[name]
    pipe = build(rank)
    epochs = []
    for _ in range(30_000):
        item = next(pipe)
        if value(item) == RARE:
            epochs.append(pipe.last_key()[-2])  # type: ignore[index]
    epochs = sorted(set(epochs))
    assert len(epochs) >= 2 and epochs != list(range(epochs[0], epochs[-1] + 1)), epochs


@pytest.mark.parametrize("name", list(RESHUFFLED))
def test_a_rare_record_that_moves_between_consumers_is_kept_with_one_warning_at_most(name: str) -> None:
    """Documented: such a consumer may warn, once, and goes on keeping (several barren runs)."""
    build, rank = RESHUFFLED[name]
    items, warned = kept(lambda: take(build(rank).filter(is_rare), 4))
    assert items == [RARE] * 4
    assert warned <= 1


def test_a_packer_on_a_consumer_with_tokens_in_some_epochs_only() -> None:
    docs = documents(3000, lambda i: i == RARE)
    pipe = rs.from_list(docs).shuffle(seed=0).shard(0, 4).repeat().map(watched).pack(4)
    rows = outcome(lambda: take(pipe, 2))
    assert "error" not in rows, rows


def test_a_packer_on_a_stream_consumer_with_tokens_in_some_epochs_only() -> None:
    docs = documents(1200, lambda i: i == RARE)
    stream = stream_source("jsonl_stream", docs, files=12, shuffle_files=0, rank=1, world_size=4)
    rows = outcome(lambda: take(stream.repeat().map(watched).pack(4), 2))
    assert "error" not in rows, rows


def loader_rare() -> rs.Node[Any]:
    return numbers(3000).shuffle(seed=0).shard().repeat().filter(is_rare)


def test_a_loader_with_two_workers_over_a_rare_filter() -> None:
    """Worker 1 (a consumer of the shuffled epoch) lacks the record for epochs in a row."""
    loader = Loader(loader_rare, num_workers=2, timeout=GUARD_SECONDS)
    iterator = iter(loader)
    items, _ = kept(lambda: [next(iterator) for _ in range(4)])
    assert items == [RARE] * 4


def loader_rare_pack() -> rs.Node[Any]:
    return rs.from_list(documents(3000, lambda i: i == RARE)).shuffle(seed=0).shard().repeat().pack(4)


def test_a_loader_with_two_workers_over_rare_tokens() -> None:
    loader = Loader(loader_rare_pack, num_workers=2, timeout=GUARD_SECONDS)
    iterator = iter(loader)
    rows = outcome(lambda: [next(iterator) for _ in range(4)])
    assert "error" not in rows, rows


# -- nested mixes: an outer component is barren only when all it chooses from is -----------------------


def nested_rare() -> rs.Node[Any]:
    inner = rs.mix({"c": numbers(10, 10_000), "d": numbers(3000).shuffle(seed=3)}, on_end="restart")
    return rs.mix({"x": inner, "y": numbers(10, 20_000)}, on_end="restart")


def test_without_the_outer_mix_the_nested_rare_record_is_found_without_a_warning() -> None:
    inner = rs.mix({"c": numbers(10, 10_000), "d": numbers(3000).shuffle(seed=3)}, on_end="restart")
    assert values(lambda: take(inner.filter(is_rare), 3)) == [RARE] * 3


def test_nested_mixes_whose_inner_component_keeps_rarely_keep_it() -> None:
    items, _ = kept(lambda: take(nested_rare().filter(is_rare), 3))
    assert items == [RARE] * 3


def test_nested_mixes_whose_inner_component_keeps_every_epoch_do_not_warn() -> None:
    with barren_filters_fail():
        assert values(lambda: take(nested_rare().filter(is_rare), 3)) == [RARE] * 3


def test_a_packer_after_nested_mixes_whose_inner_component_has_rare_tokens() -> None:
    docs = documents(3000, lambda i: i == RARE)
    empty = documents(10, lambda i: False)
    inner = rs.mix({"c": rs.from_list(empty), "d": rs.from_list(docs).shuffle(seed=3)}, on_end="restart")
    pipe = rs.mix({"x": inner, "y": rs.from_list(empty)}, on_end="restart").map(watched).pack(4)
    rows = outcome(lambda: take(pipe, 2))
    assert "error" not in rows, rows


# -- resume: the same items, or the same error ----------------------------------------------------------


@pytest.mark.parametrize(
    "build",
    [
        lambda: numbers(3000).shuffle(seed=9).repeat().filter(lambda x: x in (RARE, 1234)),
        lambda: numbers(3000).shuffle(seed=9).repeat().prefetch(2).filter(lambda x: x in (RARE, 1234)).prefetch(2),
        lambda: rs.mix(
            {"a": numbers(20, 10_000), "b": numbers(2500).shuffle(seed=1)}, on_end="restart", weights={"a": 3, "b": 1}
        ).filter(lambda x: x in (RARE, 1234)),
        lambda: (
            rs.from_list(documents(3000, lambda i: i in (RARE, 1234))).shuffle(seed=2).repeat().pack(4).map(row_ids)
        ),
    ],
    ids=["filter", "prefetched", "mix", "pack"],
)
def test_a_state_between_rare_keeps_resumes_exactly(build: Callable[[], rs.Node[Any]]) -> None:
    for k in (0, 1, 3):
        check_resume(build, k, 5)


def weighted_barren_later(pack: bool) -> rs.Node[Any]:
    """A restarting mix whose keeping component can be given no weight, leaving a barren one."""
    if pack:
        # 3 tokens in rows of 4: rows stay open in the packer's buffer
        keeps = rs.from_list([{"input_ids": [1, 2, 3][: i % 4]} for i in range(50)]).shuffle(seed=1)
        barren = rs.from_list(documents(7, lambda i: False))
        return rs.mix({"a": keeps, "b": barren}, on_end="restart", seed=3).pack(4)
    mix = rs.mix({"a": numbers(50).shuffle(seed=1), "b": numbers(7, 1000)}, on_end="restart", seed=3)
    return mix.filter(lambda x: x < 1000 and x % 5 == 0)


def mix_of(pipe: rs.Node[Any]) -> Any:
    node: Any = pipe
    while not isinstance(node, rs.nodes.Mix):
        node = node.upstream
    return node


def until_error(pipe: rs.Node[Any], pack: bool) -> tuple[list[Any], str]:
    """The items ``pipe`` hands out before it stops (the packer's ``rs.SourceError``, the
    filter's warning made an error), and the message."""
    items: list[Any] = []

    def run() -> None:
        while True:
            item = next(pipe)
            items.append(row_ids(item) if isinstance(item, dict) else item)

    return items, failure(run) if pack else filter_failure(run)


@pytest.mark.parametrize("pack", [False, True], ids=["filter", "pack"])
@pytest.mark.parametrize("k", [0, 2, 9])
def test_a_restored_pipeline_stops_with_the_same_error(pack: bool, k: int) -> None:
    """Save after k items, go on until only the barren component is left: the restored pipeline
    hands out the same items (rows still buffered) and raises exactly the same error."""
    pipe = weighted_barren_later(pack)
    take(pipe, k)
    state = json.loads(json.dumps(pipe.get_state()))
    mix_of(pipe).set_weights({"a": 0.0, "b": 1.0})
    expected = until_error(pipe, pack)
    again = restored(lambda: weighted_barren_later(pack), state)
    mix_of(again).set_weights({"a": 0.0, "b": 1.0})
    assert until_error(again, pack) == expected
    assert "mix component b" in expected[1]


def loader_keeps_one_per_consumer_epoch() -> rs.Node[Any]:
    """Without a shuffle, each of two workers reads the same 1500 records every epoch and
    keeps one of them: runs of about 1500 drops, checked, never barren."""
    return numbers(3000).shard().repeat().filter(lambda x: x in (RARE, 1234))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_loader_resumes_between_rare_keeps(num_workers: int) -> None:
    options: dict[str, Any] = {"timeout": GUARD_SECONDS} if num_workers else {}

    def head(loader: Loader, count: int) -> list[int]:
        iterator = iter(loader)
        return [value(next(iterator)) for _ in range(count)]

    expected = values(lambda: head(Loader(loader_keeps_one_per_consumer_epoch, num_workers, **options), 6))
    assert sorted(set(expected)) == [RARE, 1234]
    loader = Loader(loader_keeps_one_per_consumer_epoch, num_workers, **options)
    first = head(loader, 3)
    state = json.loads(json.dumps(loader.state_dict()))
    resumed = Loader(loader_keeps_one_per_consumer_epoch, num_workers, **options)
    resumed.load_state_dict(state)
    assert first + values(lambda: head(resumed, 3)) == expected
