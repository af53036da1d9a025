"""``map(fn, num_workers=k, batched=True)`` attacked as a user would: the batched map at every
place of a chain (after shuffle, shard, filter, repeat, mix, prefetch, cache; before every
packer, a batch, a second batched map; inside an ``rs.torch.Loader``), resumed at every kind of
point; ``fn`` results of odd shapes; ``fn`` that fails only on whole chunks, raises a
``BaseException``, is slow, or changes its records; states loaded elsewhere, damaged, or
rescaled to more consumers. Its first run found three mistakes, fixed since: results that were not
one per record slipping through, an interrupt while waiting for a chunk losing its record, and
records a failed call changed being retried changed."""

from __future__ import annotations

import collections
import json
import random
import signal
import sys
import threading
import time
from collections import Counter
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import resumable as rs
from resumable import Node
from resumable.elastic import rescaled_states
from resumable.ops.parallel_map import MAX_CHUNK, MapError
from tests.resume import check_resume, restored, row_lists, take
from tests.sources import indexed_source
from tests.test_state_fuzz import OPERATIONS, REPLACEMENTS, check_corrupted_state, corrupt, paths

Build = Callable[[], Node[Any]]

N = 48
RECORDS: list[dict[str, Any]] = [{"id": i, "text": "t" * (i % 11 + 1)} for i in range(N)]
SEQ_LEN = 16
# Token values are 100 * id + position: unique per token, since no text reaches 100 characters.
TOKEN_BASE = 100


# Module-level functions: process mode pickles them by reference.
def encode(record: dict[str, Any]) -> dict[str, Any]:
    """What a tokenizer does to one record."""
    ids = np.arange(len(record["text"]), dtype=np.int64) + TOKEN_BASE * record["id"]
    return {"id": record["id"], "input_ids": ids}


def encode_batch(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [encode(record) for record in records]


def shift_batch(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A second batched map, over what the first one returned."""
    return [{"id": item["id"], "input_ids": item["input_ids"] + 1} for item in items]


def plain(item: dict[str, Any]) -> tuple[int, list[int]]:
    return item["id"], np.asarray(item["input_ids"]).tolist()


def batched(node: Node[Any], fn: Callable[[list[Any]], Any] = encode_batch, workers: int = 2) -> Node[Any]:
    return node.map(fn, num_workers=workers, batched=True)


def outcomes(pipe: Node[Any], count: int | None = None) -> list[Any]:
    """Items handed out, a ``MapError`` as ``("error", key, type of its cause)``, until the epoch
    ends or ``count`` outcomes were seen."""
    seen: list[Any] = []
    while count is None or len(seen) < count:
        try:
            seen.append(next(pipe))
        except MapError as error:
            seen.append(("error", error.key, type(error.__cause__)))
        except StopIteration:
            break
    return seen


# -- every place in a chain ---------------------------------------------------------------------


def mixed() -> Node[Any]:
    """A batched map inside a mix component, and one after the mix."""
    head = batched(rs.from_list(RECORDS[:30]).shuffle(1))
    tail = rs.from_list(RECORDS[30:]).shuffle(2).map(encode)
    return batched(rs.mix({"head": head, "tail": tail}, weights={"head": 2, "tail": 1}, seed=3), shift_batch)


def encode_alone(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``encode_batch`` that fails on any list of more than one record: every chunk, and every
    restored packer's fetch of several records, is mapped again one record at a time."""
    if len(records) > 1:
        raise RuntimeError("the batch is too long for the device")
    return encode_batch(records)


def packed(strategy: str, fn: Callable[[list[Any]], Any] = encode_batch) -> Build:
    def build() -> Node[Any]:
        pipe = batched(rs.from_list(RECORDS).shuffle(7).repeat(2), fn)
        return pipe.pack(SEQ_LEN, strategy=strategy, buffer_size=5).map(row_lists)

    return build


CHAINS: dict[str, Build] = {
    "shard_repeat": lambda: batched(rs.from_list(RECORDS).shuffle(3).shard(1, 2).repeat(3)).map(plain),
    "filter_second_bmap_batch": lambda: (
        batched(batched(rs.from_list(RECORDS).shuffle(4)).filter(lambda item: item["id"] % 4 != 1), shift_batch, 1)
        .map(plain)
        .batch(3)
    ),
    "repeat_prefetch_before": lambda: batched(rs.from_list(RECORDS).shuffle(5).repeat(2).prefetch(3)).map(plain),
    "prefetch_after": lambda: batched(indexed_source("jsonl", RECORDS).shuffle(6)).prefetch(2).map(plain),
    "cache_before": lambda: batched(rs.from_list(RECORDS).cache().shuffle(8).repeat(2), workers=3).map(plain),
    "mix": lambda: mixed().map(plain).repeat(2),
    **{f"pack_{strategy}": packed(strategy) for strategy in ("greedy", "first_fit", "best_fit", "bfd")},
    "pack_best_fit_fn_fails_on_chunks": packed("best_fit", encode_alone),
}


@pytest.mark.parametrize("chain", sorted(CHAINS))
def test_a_batched_map_anywhere_in_a_chain_resumes_exactly_at_every_kind_of_point(chain: str) -> None:
    """After the first item, the middle, the last item but one and the last of a pass, its end
    (StopIteration handed out), the first item of the next pass and deep into it; twice in a row
    across the boundary."""
    build = CHAINS[chain]
    whole = build()
    first_pass = list(whole)
    at_end = json.loads(json.dumps(whole.get_state()))
    length = len(first_pass)
    total = 2 * length + 2
    expected = take(build(), total)
    assert take(restored(build, at_end), total - length) == expected[length:], "restored at the end of a pass"
    for k in sorted({1, length // 2, length - 1, length, length + 1, 2 * length - 1}):
        check_resume(build, k, total)
    check_resume(build, length - 1, total, k2=length + 1)


# -- inside the Loader --------------------------------------------------------------------------


def real_tokens(row: dict[str, Any]) -> list[int]:
    """The tokens of a packed row, without its padding."""
    tokens: list[int] = np.asarray(row["input_ids"])[np.asarray(row["document_ids"]) > 0].tolist()
    return tokens


def loader_pipeline() -> Node[Any]:
    """A shard per Loader worker, a batched thread map and a packer inside each worker."""
    pipe = batched(indexed_source("jsonl", RECORDS).shuffle(2).shard(), workers=1)
    return pipe.pack(SEQ_LEN, strategy="best_fit", buffer_size=4).map(real_tokens).batch(2)


def loader_pass(loader: Any, stop: int | None = None) -> list[Any]:
    """The batches of one pass (plain lists), or its first ``stop``."""
    seen = []
    for batch in loader:
        seen.append([[int(t) for t in row] for row in batch])
        if len(seen) == stop:
            break
    return seen


def tokens_of(batches: list[Any]) -> Counter[int]:
    return Counter(t for batch in batches for row in batch for t in row)


ALL_TOKENS = Counter(t for record in RECORDS for t in encode(record)["input_ids"].tolist())


@pytest.mark.parametrize("workers, persistent", [(0, False), (2, True)], ids=["in_process", "2_persistent"])
def test_a_loader_over_a_batched_map_and_a_packer_resumes_across_passes(workers: int, persistent: bool) -> None:
    """States taken mid first pass, at its last batch (the rest of the pass is then empty and
    the next pass follows), and mid second pass, each restored into a fresh Loader."""
    from resumable.torch import Loader  # here: process-pool workers import this module, and need no torch

    def loader() -> Any:
        return Loader(loader_pipeline, num_workers=workers, persistent_workers=persistent)

    whole = loader()
    first, second = loader_pass(whole), loader_pass(whole)
    whole.close()
    assert tokens_of(first) == tokens_of(second) == ALL_TOKENS
    for passes_before, stop in ((0, 2), (0, len(first)), (1, 3)):
        old = loader()
        if passes_before:
            loader_pass(old)
        head = loader_pass(old, stop)
        state = json.loads(json.dumps(old.state_dict()))
        old.close()
        new = loader()
        new.load_state_dict(state)
        rest = loader_pass(new)
        if passes_before:
            assert head + rest == second
        else:
            assert head + rest == first
        if stop == len(first):
            assert rest == [] and loader_pass(new) == second
        new.close()


def ids_batch(xs: list[int]) -> list[int]:
    return [10 * x for x in xs]


def test_a_loader_rescaled_from_two_to_three_workers_over_a_batched_map_delivers_each_record_once() -> None:
    from resumable.torch import Loader

    def build() -> Node[Any]:
        pipe = rs.from_list(list(range(61))).shuffle(4).shard()
        return batched(pipe, ids_batch, workers=1).filter(lambda x: x % 7 != 0).batch(3)

    old = Loader(build, num_workers=2)
    iterator = iter(old)
    head = [next(iterator) for _ in range(5)]
    state = json.loads(json.dumps(old.state_dict()))
    old.close()
    new = Loader(build, num_workers=3)
    new.load_state_dict([state])
    delivered = [int(x) for batch in head + list(new) for x in batch]
    new.close()
    assert sorted(delivered) == [10 * x for x in range(61) if (10 * x) % 7 != 0]


def test_a_packer_over_a_batched_map_rescaled_from_two_to_three_consumers_delivers_each_token_once() -> None:
    """The new consumers refetch the old buffers' records through the batched ``fn``."""

    def build(consumer: int, consumers: int) -> Node[Any]:
        pipe = batched(rs.from_list(RECORDS).shuffle(5).shard(consumer, consumers))
        return pipe.pack(SEQ_LEN, strategy="best_fit", buffer_size=4)

    def tokens(rows: Sequence[dict[str, Any]]) -> Counter[int]:
        return Counter(int(t) for row in rows for t in row["input_ids"][row["document_ids"] > 0])

    seen: Counter[int] = Counter()
    olds = []
    for consumer, taken in ((0, 3), (1, 5)):
        pipe = build(consumer, 2)
        seen += tokens(take(pipe, taken))
        olds.append(json.loads(json.dumps(pipe.get_state())))
        pipe.close()
    news = [build(consumer, 3) for consumer in range(3)]
    for pipe, state in zip(news, rescaled_states(news, olds)):
        pipe.set_state(state)
        seen += tokens(list(pipe))
        pipe.close()
    assert seen == ALL_TOKENS


# -- results of odd shapes ----------------------------------------------------------------------


class Results(list):  # type: ignore[type-arg]
    """A list subclass, as some libraries return."""


def as_2d_array(xs: list[int]) -> np.ndarray:
    return np.array([[x, -x] for x in xs])  # len() is its rows


def as_tuple(xs: list[int]) -> tuple[int, ...]:
    return tuple(x + 1 for x in xs)


def as_list_subclass(xs: list[int]) -> Results:
    return Results(x + 2 for x in xs)


def as_nones(xs: list[int]) -> list[None]:
    return [None] * len(xs)


SHAPES: dict[str, tuple[Callable[[list[int]], Any], Callable[[Any], Any]]] = {
    "2d_array": (as_2d_array, lambda x: [x, -x]),
    "tuple": (as_tuple, lambda x: x + 1),
    "list_subclass": (as_list_subclass, lambda x: x + 2),
    "nones": (as_nones, lambda x: None),
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_results_of_any_sequence_shape_reach_their_records_and_resume(shape: str) -> None:
    fn, expected_of = SHAPES[shape]

    def build() -> Node[Any]:
        pipe = rs.from_list(list(range(40))).shuffle(3).map(fn, num_workers=2, batched=True)
        return pipe.map(lambda x: x.tolist() if isinstance(x, np.ndarray) else x)

    order = list(rs.from_list(list(range(40))).shuffle(3))
    assert list(build()) == [expected_of(x) for x in order]
    check_resume(build, 17, 50)


def passes_items(items: list[Any]) -> list[Any]:
    return list(items)


def test_none_records_go_through() -> None:
    records = [None if i % 3 == 0 else i for i in range(20)]
    assert list(rs.from_list(records).map(passes_items, num_workers=2, batched=True)) == records


def as_generator(xs: list[int]) -> Iterator[int]:
    return (x for x in xs)


def test_a_generator_of_results_is_a_map_error_of_every_record() -> None:
    """A generator has no length to check against the chunk: refused, record by record."""
    source = rs.from_list(list(range(9)))
    seen = outcomes(source.map(as_generator, num_workers=2, batched=True))  # type: ignore[call-overload]  # wrong on purpose
    assert seen == [("error", (0, x), rs.ConfigError) for x in range(9)]


def test_chunks_never_exceed_max_chunk_and_big_results_are_kept_whole() -> None:
    sizes: list[int] = []
    lock = threading.Lock()

    def fn(xs: list[int]) -> list[np.ndarray]:
        with lock:
            sizes.append(len(xs))
        return [np.full(4096, x, dtype=np.int64) for x in xs]

    rows = list(rs.from_list(list(range(600))).map(fn, num_workers=2, batched=True))
    assert all(row.shape == (4096,) and (row == row[0]).all() for row in rows)
    assert [int(row[0]) for row in rows] == list(range(600))
    assert max(sizes) == MAX_CHUNK


def columns_as_user_dict(xs: list[int]) -> collections.UserDict[str, list[int]]:
    """What a Hugging Face tokenizer's ``__call__`` returns: a mapping of columns
    (``BatchEncoding`` is a ``UserDict``); two columns, so ``len()`` is 2."""
    return collections.UserDict({"input_ids": [x * 3 for x in xs], "attention_mask": [1 for _ in xs]})


def as_set(xs: list[int]) -> set[int]:
    return {x * 3 for x in xs}


class LyingSequence:
    """``len()`` says one result per record; iterating gives one fewer."""

    def __init__(self, values: list[int]) -> None:
        self.values = values

    def __len__(self) -> int:
        return len(self.values)

    def __getitem__(self, index: int) -> int:
        if index >= len(self.values) - 1:
            raise IndexError(index)
        return self.values[index]


def as_lying_sequence(xs: list[int]) -> LyingSequence:
    return LyingSequence([x * 3 for x in xs])


class FrameLike:
    """What a pandas DataFrame does: ``len()`` is its rows, iterating gives its column names."""

    def __init__(self, columns: dict[str, list[int]]) -> None:
        self.columns = columns

    def __len__(self) -> int:
        return len(next(iter(self.columns.values())))

    def __iter__(self) -> Iterator[str]:
        return iter(self.columns)


def as_data_frame(xs: list[int]) -> FrameLike:
    return FrameLike({"input_ids": [x * 3 for x in xs], "length": [1 for _ in xs]})


def as_0d_array(xs: list[int]) -> np.ndarray:
    return np.asarray(len(xs))


NOT_ONE_PER_RECORD = {
    # a Mapping (a tokenizer's BatchEncoding): its records would come out as the column names
    "user_dict_of_columns": columns_as_user_dict,
    "set": as_set,  # its order is not the records'
    "lying_len": as_lying_sequence,  # iterating it gives fewer results than len() says
    "data_frame": as_data_frame,  # len() counts rows, iterating gives the column names
    "0d_array": as_0d_array,  # len() raises TypeError
}


@pytest.mark.parametrize("fn", [pytest.param(fn, id=name) for name, fn in NOT_ONE_PER_RECORD.items()])
def test_results_that_are_not_a_sequence_of_one_per_record_are_config_errors_of_every_record(fn: Any) -> None:
    """Anything but a sequence (or an array along its first axis) of exactly one result per
    record, in order, is a ConfigError of every record, never results handed out wrongly or a
    raw error escaping ``next()``."""
    pipe = rs.from_list(list(range(12))).map(fn, num_workers=1, batched=True)
    try:
        seen = outcomes(pipe)
    except IndexError as error:
        pytest.fail(f"a raw {error!r} escaped next()")
    assert seen == [("error", (0, index), rs.ConfigError) for index in range(12)]


def unpicklable_at_5(xs: list[int]) -> list[Any]:
    """Record 5's result is a lock, which cannot travel back from the worker process."""
    return [threading.Lock() if x == 5 else x for x in xs]


def test_a_result_that_cannot_be_pickled_fails_its_record_only() -> None:
    """The chunk holding it cannot come back from the worker process: its records are mapped
    again one by one, so only record 5 is an error."""
    pipe = rs.from_list(list(range(24))).map(unpicklable_at_5, num_workers=2, mode="process", batched=True)
    seen = outcomes(pipe)
    pipe.close()
    assert [x for x in seen if not isinstance(x, tuple)] == [x for x in range(24) if x != 5]
    assert [x[1] for x in seen if isinstance(x, tuple)] == [(0, 5)]


# -- functions that fail, stall or change their records -----------------------------------------


def fails_on_chunks(xs: list[int]) -> list[int]:
    """A batched call that fails on any list of more than one record, never on one alone."""
    if len(xs) > 1:
        raise RuntimeError("the batch is too long for the device")
    return [x * 7 for x in xs]


def test_a_fn_that_fails_on_every_chunk_but_not_on_one_record_hands_out_every_record() -> None:
    def build() -> Node[Any]:
        return rs.from_list(list(range(30))).shuffle(2).map(fails_on_chunks, num_workers=2, batched=True)

    order = list(rs.from_list(list(range(30))).shuffle(2))
    pipe = build()
    head = take(pipe, 11)
    state = pipe.get_state()
    pipe.close()
    resumed = restored(build, state)
    assert head + outcomes(resumed) == [7 * x for x in order]
    resumed.close()


class Stop(BaseException):
    """Like ``KeyboardInterrupt`` or ``SystemExit``: not an error of a record."""


def stops_at_9(xs: list[int]) -> list[int]:
    if 9 in xs:
        raise Stop("stopped")
    return xs


def test_a_base_exception_of_fn_reaches_the_consumer_as_itself() -> None:
    """Not turned into a MapError, which a loop that skips bad records would swallow."""
    pipe = rs.from_list(list(range(20))).map(stops_at_9, num_workers=1, batched=True)
    assert take(pipe, 8) == list(range(8))
    with pytest.raises(Stop):
        for _ in range(20):
            next(pipe)
    pipe.close()


def main_thread_waits_in_resolve(main: int) -> bool:
    frame = sys._current_frames().get(main)
    names = []
    while frame is not None:
        names.append(frame.f_code.co_name)
        frame = frame.f_back
    return bool(names) and names[0] == "wait" and "_resolve" in names


class Interrupted(BaseException):
    """Raised by the SIGINT handler of the test, as Ctrl-C raises KeyboardInterrupt."""


def raise_interrupted(signum: int, frame: Any) -> None:
    raise Interrupted


def test_ctrl_c_while_waiting_for_a_slow_chunk_loses_no_record() -> None:
    """The training loop catches the interrupt and saves ``get_state()``: the record the
    consumer was waiting for was not handed out, so it must come after a restore (and when the
    same pipeline iterates on)."""
    started, release = threading.Event(), threading.Event()
    main = threading.get_ident()

    def fn(xs: list[int]) -> list[int]:
        if 9 in xs:
            started.set()
            release.wait(10)
        return [2 * x for x in xs]

    def build() -> Node[Any]:
        return rs.from_list(list(range(20))).map(fn, num_workers=1, batched=True)

    def interrupt_when_waiting() -> None:
        started.wait(10)
        deadline = time.monotonic() + 10
        while not main_thread_waits_in_resolve(main) and time.monotonic() < deadline:
            time.sleep(0.002)
        signal.pthread_kill(main, signal.SIGINT)

    release.set()
    expected = list(build())
    started.clear()
    release.clear()
    previous = signal.signal(signal.SIGINT, raise_interrupted)
    pipe = build()
    head: list[int] = []
    watcher = threading.Thread(target=interrupt_when_waiting)
    watcher.start()
    try:
        with pytest.raises(Interrupted):
            for item in pipe:
                head.append(item)
    finally:
        release.set()
        watcher.join()
        signal.signal(signal.SIGINT, previous)
    state = pipe.get_state()
    resumed = restored(build, state)
    assert head + list(resumed) == expected, "restored from the state saved at the interrupt"
    assert head + list(pipe) == expected, "the same pipeline iterating on"
    pipe.close()
    resumed.close()


def test_a_slow_uneven_fn_keeps_the_order() -> None:
    delays = random.Random(0)
    lock = threading.Lock()

    def fn(xs: list[int]) -> list[int]:
        with lock:
            delay = delays.random() * 0.004
        time.sleep(delay)
        return [x + 1 for x in xs]

    pipe = rs.from_list(list(range(150))).shuffle(9).map(fn, num_workers=3, batched=True)
    assert list(pipe) == [x + 1 for x in rs.from_list(list(range(150))).shuffle(9)]


def bumps_then_fails(records: list[dict[str, Any]]) -> list[int]:
    """Changes its records in place (as ``record["x"] += 1`` in a tokenising loop), then
    fails on record 5."""
    for record in records:
        record["text"] = record["text"] + "!"
    if any(record["id"] == 5 for record in records):
        raise ValueError("record 5")
    return [len(record["text"]) for record in records]


@pytest.mark.parametrize(
    "mode",
    ["thread", "process"],
)
def test_the_records_retried_one_by_one_are_as_read_even_if_the_failed_call_changed_them(mode: str) -> None:
    """The docs say the others are handed out "as without batched": each record once through
    ``fn``, so each text gains one "!"."""
    source = indexed_source("jsonl", RECORDS[:12])
    pipe = source.map(bumps_then_fails, num_workers=1, mode=mode, batched=True)
    seen = outcomes(pipe)
    pipe.close()
    expected: list[Any] = [len(record["text"]) + 1 for record in RECORDS[:12]]
    expected[5] = ("error", (0, 5), ValueError)
    assert seen == expected


# -- states -------------------------------------------------------------------------------------


def test_a_batched_state_loaded_into_a_serial_map_is_a_state_error_that_changes_nothing() -> None:
    """A serial map over an indexed node is an IndexedMap: another node, a typed error."""
    pipe = rs.from_list(RECORDS).shuffle(4).map(encode_batch, num_workers=2, batched=True)
    take(pipe, 5)
    state = json.loads(json.dumps(pipe.get_state()))
    pipe.close()
    serial = rs.from_list(RECORDS).shuffle(4).map(encode)
    take(serial, 3)
    with pytest.raises(rs.StateError, match="ParallelMap"):
        serial.set_state(state)
    reference = rs.from_list(RECORDS).shuffle(4).map(encode)
    take(reference, 3)
    assert [plain(x) for x in take(serial, 4)] == [plain(x) for x in take(reference, 4)]


def fuzzed_pipeline() -> Node[Any]:
    pipe = batched(rs.from_list(RECORDS).shuffle(3).shard(0, 2).repeat(2)).filter(lambda item: item["id"] % 5 != 0)
    return batched(pipe, shift_batch, 1).pack(SEQ_LEN, strategy="best_fit", buffer_size=4).map(row_lists).batch(2)


@settings(max_examples=30, deadline=None)
@given(taken=st.integers(0, 14), data=st.data())
def test_a_damaged_state_over_batched_maps_is_a_state_error_or_a_valid_state(taken: int, data: st.DataObject) -> None:
    """Only typed errors come out, and a refused state leaves the pipeline as it was."""
    pipe = fuzzed_pipeline()
    take(pipe, taken)
    state = json.loads(json.dumps(pipe.get_state()))
    pipe.close()
    where = data.draw(st.sampled_from(paths(state)), label="where")
    operation = data.draw(st.sampled_from(OPERATIONS), label="operation")
    replacement = data.draw(st.sampled_from(REPLACEMENTS), label="replacement")
    check_corrupted_state(fuzzed_pipeline, state, corrupt(state, where, operation, replacement))
