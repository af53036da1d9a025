"""Prefetch: exact resume with a producer thread running ahead, state as of the last item
handed out, exceptions in order, clean shutdown."""

from __future__ import annotations

import gc
import threading
import time
from typing import Any

import pytest

import resumable as rs
from resumable import Node
from resumable.ops.prefetch import Prefetch
from tests.resume import check_closed_resume, check_resume, take

N = 60


def double(x: int) -> int:
    return 2 * x


def not_div_5(x: int) -> bool:
    return x % 5 != 0


def prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("resumable-Prefetch")]


def wait_for_no_prefetch_threads() -> None:
    """Threads end asynchronously after a stop; give them a moment, then report."""
    gc.collect()
    for _ in range(200):
        if not prefetch_threads():
            return
        time.sleep(0.01)
    assert prefetch_threads() == []


def chain(prefetch: bool, repeat: str = "", buffer_size: int = 3, batch: int = 4) -> Node[Any]:
    pipe: Node[Any] = rs.from_list(list(range(N))).shuffle(7)
    if repeat == "before":
        pipe = pipe.repeat()
    if prefetch:
        pipe = pipe.prefetch(buffer_size)
    pipe = pipe.map(double).filter(not_div_5)
    if repeat == "after":
        pipe = pipe.repeat()
    return pipe.batch(batch)


@pytest.mark.parametrize("repeat", ["", "before", "after"])
def test_prefetch_chain_resumes_exactly(repeat: str) -> None:
    # 48 items per epoch -> 12 batches: mid-epoch, at the end, across epochs.
    total = 30 if repeat else 12
    points = (0, 1, 5, 11, 12, 13, 25) if repeat else (0, 1, 5, 11, 12)
    for k in points:
        if k > total:
            continue
        check_resume(lambda: chain(True, repeat), k, total)
    check_resume(lambda: chain(True, repeat), 3, total, k2=9)
    check_resume(lambda: chain(True, repeat), 0, total, k2=total)


def test_prefetch_yields_what_the_plain_pipeline_yields() -> None:
    for repeat in ("", "before", "after"):
        total = 30 if repeat else 12
        assert take(chain(True, repeat, buffer_size=1), total) == take(chain(False, repeat), total)


def test_state_is_as_of_the_last_item_handed_out() -> None:
    """At every item count, the nested upstream state equals the state of the same pipeline
    without prefetch, although the producer thread has run ahead."""
    for repeat in ("", "before"):
        plain: Node[Any] = rs.from_list(list(range(N))).shuffle(3).filter(not_div_5)
        fetched: Node[Any] = rs.from_list(list(range(N))).shuffle(3).filter(not_div_5)
        if repeat:
            plain, fetched = plain.repeat(), fetched.repeat()
        fetched = fetched.prefetch(4)
        assert fetched.get_state()["upstream"] == plain.get_state()
        for count in range(70):
            item = next(fetched, None)
            assert item == next(plain, None)
            if count == 5:
                time.sleep(0.05)  # let the producer fill its queue
            assert fetched.get_state()["upstream"] == plain.get_state(), count
            assert fetched.last_key() == plain.last_key()
        fetched.close()


def test_items_in_flight_are_produced_again_after_restore() -> None:
    pipe = rs.from_list(list(range(N))).prefetch(8)
    head = take(pipe, 3)
    time.sleep(0.05)  # the producer is now up to 8 items ahead
    state = pipe.get_state()
    pipe.close()
    resumed = rs.from_list(list(range(N))).prefetch(8)
    resumed.set_state(state)
    assert head + list(resumed) == list(range(N))


def test_end_of_epoch_and_next_epoch() -> None:
    pipe = rs.from_list(list(range(10))).shuffle(1).prefetch(2)
    plain = rs.from_list(list(range(10))).shuffle(1)
    assert list(pipe) == list(plain)
    assert pipe.get_state()["upstream"] == plain.get_state()
    assert pipe.get_state()["ended"] is True
    with pytest.raises(StopIteration):
        next(pipe)
    # Iterating again starts the next epoch, in a new order.
    assert list(pipe) == list(plain)
    pipe.start_epoch(0)
    plain.start_epoch(0)
    assert take(pipe, 4) == take(plain, 4)
    pipe.next_epoch()
    plain.next_epoch()
    assert list(pipe) == list(plain)
    wait_for_no_prefetch_threads()


def test_restore_while_running_and_restore_ended_state() -> None:
    pipe = rs.from_list(list(range(20))).prefetch(3)
    take(pipe, 15)
    state = pipe.get_state()
    pipe.close()
    other = rs.from_list(list(range(20))).prefetch(3)
    take(other, 2)  # running: set_state must stop its thread first
    other.set_state(state)
    assert list(other) == list(range(15, 20))
    ended = other.get_state()
    again = rs.from_list(list(range(20))).prefetch(3)
    again.set_state(ended)
    assert list(again) == list(range(20))  # an ended epoch: iterating starts the next one
    wait_for_no_prefetch_threads()


def test_fetch_and_last_key_pass_through() -> None:
    pipe = rs.from_list(list(range(20))).shuffle(2).map(double).prefetch(3)
    plain = rs.from_list(list(range(20))).shuffle(2).map(double)
    assert pipe.last_key() is None
    for _ in range(5):
        item = next(pipe)
        assert next(plain) == item
    key = pipe.last_key()
    assert key is not None and key == plain.last_key() and key[0] == 0
    assert pipe.fetch(key) == item == double(key[1])  # keys name records of the source
    assert pipe.fetch((1, 0)) == plain.fetch((1, 0)) == double(0)
    pipe.close()


def test_pack_after_prefetch_resumes_exactly() -> None:
    import numpy as np

    docs = [{"input_ids": np.arange(n, dtype=np.int64) + 100 * n} for n in range(1, 40)]

    def build() -> Node[Any]:
        return rs.from_list(docs).shuffle(4).prefetch(3).pack(16, strategy="best_fit", buffer_size=5)

    check_closed_resume(build, (0, 3, 11), 40)


# -- exceptions -----------------------------------------------------------------------------


class Boom(Exception):
    pass


def explode_at(positions: set[int]) -> Any:
    def fn(x: int) -> int:
        if x in positions:
            raise Boom(f"bad record {x}")
        return x

    return fn


def test_upstream_exception_arrives_after_the_items_before_it() -> None:
    pipe = rs.from_list(list(range(10))).map(explode_at({4, 7})).prefetch(5)
    plain = rs.from_list(list(range(10))).map(explode_at({4, 7}))
    assert take(pipe, 4) == [0, 1, 2, 3]
    with pytest.raises(Boom, match="bad record 4") as info:
        next(pipe)
    assert any("Prefetch thread" in note for note in info.value.__notes__)
    take(plain, 4)
    with pytest.raises(Boom):
        next(plain)
    # After the error, iteration goes on as it does without prefetch.
    assert take(pipe, 2) == take(plain, 2) == [5, 6]
    assert pipe.get_state()["upstream"] == plain.get_state()
    with pytest.raises(Boom, match="bad record 7"):
        next(pipe)
    assert list(pipe) == [8, 9]
    wait_for_no_prefetch_threads()


def test_exception_from_a_generator_upstream() -> None:
    class Broken(Node[int]):
        """A stream that fails for good after three items."""

        _reads_upstream = False

        def __init__(self) -> None:
            super().__init__()
            self.count = 0

        def _next(self) -> int:
            self.count += 1
            if self.count > 3:
                raise RuntimeError("connection lost")
            return self.count

    pipe = Broken().prefetch(2)
    assert take(pipe, 3) == [1, 2, 3]
    with pytest.raises(RuntimeError, match="connection lost"):
        next(pipe)
    pipe.close()
    wait_for_no_prefetch_threads()


# -- shutdown -------------------------------------------------------------------------------


def test_close_stops_the_thread_and_iteration_can_go_on() -> None:
    pipe = rs.from_list(list(range(N))).prefetch(2)
    assert take(pipe, 5) == [0, 1, 2, 3, 4]
    assert len(prefetch_threads()) == 1
    pipe.close()
    wait_for_no_prefetch_threads()
    # The queued items were dropped, the upstream was returned to the last item handed out.
    assert take(pipe, 3) == [5, 6, 7]
    pipe.close()
    wait_for_no_prefetch_threads()


def test_context_manager_and_close_of_a_whole_chain() -> None:
    with rs.from_list(list(range(N))).prefetch(2) as pipe:
        take(pipe, 3)
    wait_for_no_prefetch_threads()
    nested = rs.from_list(list(range(N))).prefetch(2).map(double).prefetch(2).batch(3)
    take(nested, 2)
    assert len(prefetch_threads()) == 2
    nested.close()
    wait_for_no_prefetch_threads()


def test_abandoned_pipeline_leaves_no_thread() -> None:
    def run() -> None:
        pipe = rs.from_list(list(range(1000))).prefetch(2).batch(2)
        take(pipe, 3)  # the producer is blocked on a full queue

    run()
    gc.collect()
    wait_for_no_prefetch_threads()


def test_early_break_then_close_with_a_blocking_slow_upstream() -> None:
    def slow(x: int) -> int:
        time.sleep(0.005)
        return x

    pipe = rs.from_list(list(range(1000))).map(slow).prefetch(4)
    for item in pipe:
        if item == 2:
            break
    pipe.close()
    wait_for_no_prefetch_threads()


def test_threads_are_daemons() -> None:
    pipe = rs.from_list(list(range(100))).prefetch(2)
    next(pipe)
    assert all(t.daemon for t in prefetch_threads())
    pipe.close()


# -- validation -----------------------------------------------------------------------------


@pytest.mark.parametrize("size", [0, -1, 1.5, True, "4", None])
def test_buffer_size_is_validated(size: Any) -> None:
    with pytest.raises(rs.ConfigError, match="buffer_size"):
        rs.from_list([1]).prefetch(size)


def test_upstream_must_be_a_node() -> None:
    with pytest.raises(rs.ConfigError):
        Prefetch(iter([1, 2]), 2)  # type: ignore[arg-type]  # deliberately wrong, to test the check


def test_state_from_another_pipeline_is_rejected_and_leaves_node_usable() -> None:
    pipe = rs.from_list(list(range(10))).prefetch(2)
    other = rs.from_list(list(range(10))).batch(2)
    take(pipe, 2)
    with pytest.raises(rs.StateError):
        pipe.set_state(other.get_state())
    assert take(pipe, 3) == [2, 3, 4]
    pipe.close()


def test_get_state_is_json_and_repeatable() -> None:
    pipe = rs.from_list(list(range(10))).prefetch(2)
    take(pipe, 3)
    first = pipe.get_state()
    assert pipe.get_state() == first
    assert first["kind"] == "Prefetch" and first["upstream"]["position"] == 3
    pipe.close()
