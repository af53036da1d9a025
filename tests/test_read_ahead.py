"""Nodes that read ahead (prefetch, parallel map): what follows a new epoch, a shutdown or a
restore depends only on what the consumer received, never on how far the reader had got, even
when the read-ahead crossed an inner ``repeat()`` boundary."""

from __future__ import annotations

import time
from typing import Any, Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import resumable as rs
from resumable import Node
from resumable.ops.prefetch import Prefetch

EPOCH = 10
WAIT_LIMIT_S = 60.0  # a hang guard, not a speed check


def identity(x: int) -> int:
    return x


def inner(times: int = 4) -> Node[int]:
    return rs.from_list(list(range(EPOCH))).shuffle(1).repeat(times)


READERS: dict[str, Callable[[Node[int], int], Node[int]]] = {
    "prefetch": lambda upstream, ahead: upstream.prefetch(ahead),
    "thread_map": lambda upstream, ahead: upstream.map(identity, num_workers=max(1, ahead // 2)),
}


def read_ahead_fully(pipe: Node[Any]) -> None:
    """Let a prefetch thread fill its queue (or reach the end) before going on."""
    node: Node[Any] | None = pipe
    while node is not None and not isinstance(node, Prefetch):
        node = node.upstream
    producer = node._producer if node is not None else None
    deadline = time.monotonic() + WAIT_LIMIT_S
    while producer is not None and producer.thread.is_alive() and not producer.queue.full():
        if time.monotonic() > deadline:
            pytest.fail("the prefetch thread did not fill its queue")
        time.sleep(0.005)


@pytest.mark.parametrize("reader", sorted(READERS))
def test_next_epoch_after_reading_across_an_inner_repeat(reader: str) -> None:
    plain = inner()
    [next(plain) for _ in range(8)]
    plain.next_epoch()
    expected = [next(plain) for _ in range(EPOCH)]

    pipe = READERS[reader](inner(), 8)
    [next(pipe) for _ in range(8)]
    read_ahead_fully(pipe)  # the reader is now in the inner repeat's next epoch
    pipe.next_epoch()
    assert [next(pipe) for _ in range(EPOCH)] == expected


@pytest.mark.parametrize("reader", sorted(READERS))
def test_a_mix_that_stops_starts_every_component_after_what_it_handed_out(reader: str) -> None:
    def build(read: bool) -> Node[int]:
        first = READERS[reader](inner(), 8) if read else inner()
        return rs.mix({"a": first, "b": rs.from_list(list(range(3)))}, on_end="stop")

    plain = build(False)
    expected = [list(plain), list(plain)]
    pipe = build(True)
    first = list(pipe)
    read_ahead_fully(pipe.components["a"])
    assert [first, list(pipe)] == expected


@settings(deadline=None, max_examples=25)
@given(
    reader=st.sampled_from(sorted(READERS)),
    taken=st.integers(0, 3 * EPOCH),
    ahead=st.integers(1, 2 * EPOCH),
    then=st.sampled_from(["next_epoch", "close", "restore"]),
)
def test_continuation_ignores_how_far_the_reader_got(reader: str, taken: int, ahead: int, then: str) -> None:
    plain = inner()
    head = [next(plain) for _ in range(taken)]
    if then == "next_epoch":
        plain.next_epoch()
    expected = [next(plain) for _ in range(EPOCH)]

    pipe = READERS[reader](inner(), ahead)
    assert [next(pipe) for _ in range(taken)] == head
    read_ahead_fully(pipe)
    if then == "next_epoch":
        pipe.next_epoch()
    elif then == "close":
        pipe.close()
    else:
        state = pipe.get_state()
        pipe.close()
        pipe = READERS[reader](inner(), ahead)
        pipe.set_state(state)
    assert [next(pipe) for _ in range(EPOCH)] == expected
    pipe.close()
