"""ParallelMap: ordered results from a thread or process pool, exact resume with records in
flight, errors naming the record's key, clean pool shutdown."""

from __future__ import annotations

import gc
import multiprocessing
import threading
import time
from typing import Any, Callable

import numpy as np
import pytest

import resumable as rs
from resumable import Node
from resumable.ops.parallel_map import MAX_CHUNK, MapError, ParallelMap
from tests.resume import check_closed_resume, check_resume, take

N = 60


# Module-level functions: process mode pickles them by reference.
def square(x: int) -> int:
    return x * x


def jittery_square(x: int) -> int:
    """Finishes out of order: later records often complete first."""
    time.sleep(0.002 * ((x * 7) % 3))
    return x * x


def odd(x: int) -> bool:
    return x % 2 == 1


def fail_on_13(x: int) -> int:
    if x in FAILING:
        raise KeyError(f"no value for {x}")
    return x


# Records fail_on_13 fails on: one in the first, one-record chunks, three in full chunks (two of
# them in the same chunk).
FAILING = (13, 300, 301, 700)


def fail_on_13_batched(xs: list[int]) -> list[int]:
    """``fail_on_13`` over a chunk, as a batched fn: any failing record fails the whole call."""
    bad = sorted(set(FAILING).intersection(xs))
    if bad:
        raise KeyError(f"no value for {bad}")
    return xs


def lock_on_200(x: int) -> Any:
    """Returns an object that cannot be pickled, for one record."""
    return threading.Lock() if x == 200 else x


class CountedSquare:
    """``square`` that counts how often it is pickled in this process."""

    pickled = 0

    def __reduce__(self) -> tuple[type[CountedSquare], tuple[()]]:
        CountedSquare.pickled += 1
        return (CountedSquare, ())

    def __call__(self, x: int) -> int:
        return x * x


def shifted(record: dict[str, Any]) -> dict[str, Any]:
    return {"input_ids": record["input_ids"] + 1}


def pool_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("resumable-ParallelMap")]


def until_empty(found: Callable[[], list[Any]], limit_s: float = 60.0) -> list[Any]:
    """What ``found()`` returns once it is empty, or after ``limit_s`` seconds."""
    deadline = time.monotonic() + limit_s
    while (left := found()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def chain(mode: str, repeat: str = "", workers: int = 3) -> Node[Any]:
    pipe: Node[Any] = rs.from_list(list(range(N))).shuffle(11)
    if repeat == "before":
        pipe = pipe.repeat()
    pipe = pipe.prefetch(3).map(jittery_square, num_workers=workers, mode=mode).filter(odd)
    if repeat == "after":
        pipe = pipe.repeat()
    return pipe.batch(4)


@pytest.mark.parametrize("repeat", ["", "before", "after"])
def test_thread_map_chain_resumes_exactly(repeat: str) -> None:
    # 30 odd squares per epoch -> 8 batches (the last one short).
    total = 20 if repeat else 8
    for k in (0, 1, 4, 7, 8, 9, 15):
        if k <= total:
            check_resume(lambda: chain("thread", repeat), k, total)
    check_resume(lambda: chain("thread", repeat), 2, total, k2=total - 1)


def test_process_map_chain_resumes_exactly() -> None:
    # Process pools take a fraction of a second to start: one chain, several checkpoints.
    build = lambda: chain("process", "after", workers=2)  # noqa: E731
    check_resume(build, 5, 20, k2=11)
    check_resume(build, 8, 20)
    gc.collect()


def test_results_keep_the_upstream_order() -> None:
    for mode in ("thread", "process"):
        pipe = rs.from_list(list(range(40))).shuffle(2).map(jittery_square, num_workers=4, mode=mode)
        plain = rs.from_list(list(range(40))).shuffle(2).map(jittery_square)
        assert list(pipe) == list(plain)
        pipe.close()


def test_state_is_as_of_the_last_item_handed_out() -> None:
    plain: Node[Any] = rs.from_list(list(range(N))).shuffle(3).filter(odd).repeat()
    mapped = ParallelMap(rs.from_list(list(range(N))).shuffle(3).filter(odd).repeat(), square, num_workers=3)
    assert mapped.get_state()["upstream"] == plain.get_state()
    for count in range(70):
        assert next(mapped) == square(next(plain))
        assert mapped.get_state()["upstream"] == plain.get_state(), count
        assert mapped.last_key() == plain.last_key()
    mapped.close()


def test_in_flight_window_is_bounded() -> None:
    source = rs.from_list(list(range(100)))
    pipe = ParallelMap(source, square, num_workers=3)
    next(pipe)
    assert source.position == 2 * 3  # read ahead by the window, not the whole epoch
    assert pipe.get_state()["upstream"]["position"] == 1
    pipe.close()
    # close() returned the upstream to the last item handed out: nothing is lost.
    assert source.position == 1
    assert take(pipe, 3) == [1, 4, 9]
    pipe.close()


def test_chunks_grow_and_start_again_from_one_record_after_a_restore() -> None:
    source = rs.from_list(list(range(3000)))
    pipe = ParallelMap(source, square, num_workers=3)
    assert take(pipe, 1000) == [x * x for x in range(1000)]
    assert pipe._chunk_size == MAX_CHUNK
    assert 1000 < source.position <= 1000 + 2 * 3 * MAX_CHUNK  # bounded read-ahead
    state = pipe.get_state()
    pipe.close()
    source = rs.from_list(list(range(3000)))
    resumed = ParallelMap(source, square, num_workers=3)
    resumed.set_state(state)
    assert next(resumed) == 1000 * 1000
    # The first record after the restore went out in a chunk of its own; the window read as
    # little ahead as before chunks existed.
    assert source.position == 1000 + 2 * 3
    assert take(resumed, 1999) == [x * x for x in range(1001, 3000)]
    resumed.close()


def test_process_map_resumes_exactly_far_into_the_epoch() -> None:
    def build() -> Node[Any]:
        pipe = rs.from_list(list(range(2000))).shuffle(4).map(square, num_workers=2, mode="process")
        return pipe.filter(odd).batch(7)

    check_resume(build, 90, 143, k2=120)  # past the full chunks, then into the next epoch
    gc.collect()


def test_fn_is_sent_once_per_worker_process() -> None:
    CountedSquare.pickled = 0
    pipe = rs.from_list(list(range(500))).map(CountedSquare(), num_workers=2, mode="process")
    assert list(pipe) == [x * x for x in range(500)]
    pipe.start_epoch(0)
    assert take(pipe, 3) == [0, 1, 4]
    pipe.close()
    assert CountedSquare.pickled <= 1 + 2  # the check at construction, then once per worker


def map_in_a_daemon(results: Any) -> None:
    """In a daemonic process (as a DataLoader worker is): what a process-mode map raises."""
    pipe = rs.from_list([1, 2]).map(square, num_workers=1, mode="process")
    try:
        next(pipe)
        results.put("no error")
    except Exception as error:  # noqa: BLE001 - reported to the test
        results.put(f"{type(error).__name__}: {error}")


def test_a_process_map_in_a_daemonic_process_is_a_config_error() -> None:
    """multiprocessing forbids a daemonic process children (an AssertionError of its own):
    a process-mode map there says so, and what to use instead."""
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    process = context.Process(target=map_in_a_daemon, args=(results,), daemon=True)
    process.start()
    outcome = results.get(timeout=60)
    process.join()
    assert outcome.startswith("ConfigError: ParallelMap over ")
    assert "daemonic process" in outcome and "mode='thread'" in outcome


@pytest.mark.parametrize("then_close", [False, True], ids=["continued", "closed"])
def test_a_pool_that_cannot_take_tasks_raises_its_error_and_recovers(
    monkeypatch: pytest.MonkeyPatch, then_close: bool
) -> None:
    """The submission of the first chunk fails twice (its retry as the read stops, too): that
    error reaches the consumer, and the records read meanwhile are submitted again when they
    are needed; a close() in between forgets them cleanly."""
    submit = ParallelMap._submit
    failures = [OSError("the pool cannot start"), OSError("the pool cannot start")]

    def failing_submit(self: ParallelMap[Any], items: list[Any]) -> Any:
        if failures:
            raise failures.pop()
        return submit(self, items)

    monkeypatch.setattr(ParallelMap, "_submit", failing_submit)
    pipe = rs.from_list(list(range(N))).map(square, num_workers=2)
    with pytest.raises(OSError, match="the pool cannot start"):
        next(pipe)
    if then_close:
        pipe.close()
    else:  # the retry fails too: its own error, as it is
        failures.append(OSError("the pool still cannot start"))
        with pytest.raises(OSError, match="the pool still cannot start"):
            next(pipe)
    assert take(pipe, N) == [x * x for x in range(N)]
    pipe.close()


def test_end_of_epoch_and_next_epoch() -> None:
    pipe = rs.from_list(list(range(10))).shuffle(1).map(square, num_workers=2)
    plain = rs.from_list(list(range(10))).shuffle(1).map(square)
    assert list(pipe) == list(plain)
    assert pipe.get_state()["ended"] is True
    with pytest.raises(StopIteration):
        next(pipe)
    assert list(pipe) == list(plain)  # the next epoch, in a new order
    pipe.start_epoch(0)
    plain.start_epoch(0)
    assert take(pipe, 3) == take(plain, 3)
    pipe.close()


def test_pack_after_parallel_map_resumes_exactly() -> None:
    docs = [{"input_ids": np.arange(n, dtype=np.int64) + 1000 * n} for n in range(1, 50)]

    def build() -> Node[Any]:
        pipe = rs.from_list(docs).shuffle(9).map(shifted, num_workers=3)
        return pipe.filter(lambda r: len(r["input_ids"]) % 4 != 0).pack(24, strategy="best_fit", buffer_size=6)

    check_closed_resume(build, (0, 4, 13, 30), 45)


def test_last_key_and_fetch_apply_fn() -> None:
    pipe = rs.from_list(list(range(20))).shuffle(5).map(square, num_workers=2)
    plain = rs.from_list(list(range(20))).shuffle(5).map(square)
    assert pipe.last_key() is None
    items = take(pipe, 6)
    assert take(plain, 6) == items
    key = pipe.last_key()
    assert key is not None and key == plain.last_key() and key[0] == 0
    assert pipe.fetch(key) == items[-1] == square(key[1])  # keys name records of the source
    assert pipe.fetch((2, 1)) == plain.fetch((2, 1)) == square(1)
    pipe.close()


# -- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_fn_error_arrives_in_order_with_the_record_key(mode: str) -> None:
    pipe = rs.from_list(list(range(20))).map(fail_on_13, num_workers=2, mode=mode)
    assert take(pipe, 13) == list(range(13))
    with pytest.raises(MapError) as info:
        next(pipe)
    error = info.value
    assert isinstance(error, rs.ResumableError)
    assert error.key == (0, 13)
    assert "ParallelMap" in str(error) and "(0, 13)" in str(error) and "KeyError" in str(error)
    assert isinstance(error.__cause__, KeyError)
    # The failed record was consumed, as with a serial map; iteration goes on after it.
    assert pipe.get_state()["upstream"]["position"] == 14
    assert list(pipe) == list(range(14, 20))
    pipe.close()


@pytest.mark.parametrize("mode", ["thread", "process"])
@pytest.mark.parametrize("batched", [False, True], ids=["per-record", "batched"])
def test_fn_errors_inside_full_chunks_arrive_at_their_records(mode: str, batched: bool) -> None:
    """A batched call that fails is retried record by record, so its error too reaches only the
    failing records."""
    if batched:
        pipe = rs.from_list(list(range(1000))).map(fail_on_13_batched, num_workers=2, mode=mode, batched=True)
    else:
        pipe = rs.from_list(list(range(1000))).map(fail_on_13, num_workers=2, mode=mode)
    handed_out: list[int] = []
    failed: list[Any] = []
    while True:
        try:
            handed_out.append(next(pipe))
        except MapError as error:
            failed.append(error.key)
            assert pipe.get_state()["upstream"]["position"] == error.key[1] + 1  # type: ignore[index]  # a (epoch, index) key
            assert isinstance(error.__cause__, KeyError)
            if mode == "process":  # the worker's traceback comes along, as concurrent.futures gives it
                assert "fail_on_13" in str(error.__cause__.__cause__)
        except StopIteration:
            break
    assert failed == [(0, x) for x in FAILING]
    assert handed_out == [x for x in range(1000) if x not in FAILING]
    pipe.close()


def test_a_result_that_cannot_travel_fails_at_its_record_only() -> None:
    pipe = rs.from_list(list(range(400))).map(lock_on_200, num_workers=2, mode="process")
    assert take(pipe, 200) == list(range(200))
    with pytest.raises(MapError) as info:
        next(pipe)
    assert info.value.key == (0, 200)
    assert list(pipe) == list(range(201, 400))
    pipe.close()


def test_upstream_error_arrives_in_order_as_it_is() -> None:
    pipe = rs.from_list(list(range(10))).map(fail_on_13).map(square, num_workers=2)
    pipe2 = rs.from_list(list(range(20))).filter(lambda x: fail_on_13(x) >= 0).map(square, num_workers=2)
    assert list(pipe) == [x * x for x in range(10)]
    assert take(pipe2, 13) == [x * x for x in range(13)]
    with pytest.raises(KeyError):
        next(pipe2)
    assert list(pipe2) == [x * x for x in range(14, 20)]
    pipe.close()
    pipe2.close()


# -- shutdown -------------------------------------------------------------------------------


def test_thread_pool_is_shut_down() -> None:
    pipe = rs.from_list(list(range(100))).map(jittery_square, num_workers=3)
    take(pipe, 5)
    assert pool_threads()
    pipe.close()
    assert pool_threads() == []

    def abandon() -> None:
        take(rs.from_list(list(range(100))).map(square, num_workers=3).batch(2), 2)

    abandon()
    gc.collect()  # the finalizer stops the pool without waiting: its threads end by themselves
    assert until_empty(pool_threads) == []


def new_children(before: set[int]) -> list[int]:
    """Child processes started since ``before`` (pids) that are still alive. Earlier tests
    may leave daemon processes (DataLoader workers) finishing their shutdown; those are not
    this test's."""
    return [p.pid for p in multiprocessing.active_children() if p.pid not in before]


def test_process_pool_is_shut_down() -> None:
    before = {p.pid for p in multiprocessing.active_children()}
    with rs.from_list(list(range(100))).map(square, num_workers=2, mode="process") as pipe:
        take(pipe, 5)
        assert len(new_children(before)) >= 2
    assert new_children(before) == []


def test_process_pool_of_an_abandoned_pipeline_is_shut_down() -> None:
    before = {p.pid for p in multiprocessing.active_children()}

    def abandon() -> None:
        take(rs.from_list(list(range(100))).map(square, num_workers=2, mode="process").batch(2), 2)

    abandon()
    gc.collect()  # the finalizer stops the pool without waiting: its workers end by themselves
    assert until_empty(lambda: new_children(before)) == []


# -- validation -----------------------------------------------------------------------------


@pytest.mark.parametrize("workers", [-1, 1.5, True, "2"])
def test_num_workers_is_validated(workers: Any) -> None:
    with pytest.raises(rs.ConfigError, match="num_workers"):
        ParallelMap(rs.from_list([1]), square, num_workers=workers)


def test_mode_and_fn_are_validated() -> None:
    with pytest.raises(rs.ConfigError, match="mode"):
        rs.from_list([1]).map(square, num_workers=2, mode="gpu")
    with pytest.raises(rs.ConfigError, match="callable"):
        ParallelMap(rs.from_list([1]), None, num_workers=2)  # type: ignore[arg-type]  # deliberately wrong, to test the check
    with pytest.raises(rs.ConfigError, match="picklable"):
        rs.from_list([1]).map(lambda x: x, num_workers=2, mode="process")


def test_num_workers_may_change_across_a_restore() -> None:
    pipe = rs.from_list(list(range(30))).shuffle(3).map(square, num_workers=4)
    head = take(pipe, 7)
    state = pipe.get_state()
    pipe.close()
    other = rs.from_list(list(range(30))).shuffle(3).map(square, num_workers=1)
    other.set_state(state)
    plain = rs.from_list(list(range(30))).shuffle(3).map(square)
    assert head + list(other) == list(plain)
    other.close()
