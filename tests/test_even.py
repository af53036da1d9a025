"""Even in one process: ranks simulated by threads that agree through a stand-in for
``all_reduce(MIN)``, or one rank against a fixed world (another rank always offers ``q``
items). Each even-epoch has the same size on every rank, every item of a rank's stream
is yielded once or counted as leftover, and the resume property holds at every step."""

from __future__ import annotations

import json
import threading
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any, Callable, Iterator
from unittest import mock

import pytest
import torch.utils.data
from hypothesis import given
from hypothesis import strategies as st

import resumable as rs
from resumable.ops import even
from resumable.ops.even import Even
from tests.resume import check_resume, take
from tests.sources import INDEXED_KINDS, indexed_source


class Lockstep:
    """``agree_min`` across threads, one per simulated rank: each waits for the others' offers."""

    def __init__(self, ranks: int) -> None:
        self.offers: list[int] = []
        self.result = 0
        self.lock = threading.Lock()
        self.agreed = threading.Barrier(ranks, action=self._reduce, timeout=10)
        self.read = threading.Barrier(ranks, timeout=10)

    def _reduce(self) -> None:
        self.result, self.offers = min(self.offers), []

    def agree_min(self, offer: int, group: Any = None) -> int:
        with self.lock:
            self.offers.append(offer)
        self.agreed.wait()
        result = self.result
        self.read.wait()  # every rank has read it before the next agreement starts
        return result


@contextmanager
def elsewhere(q: int) -> Iterator[None]:
    """One rank in a world where another rank offers ``q`` items every epoch."""
    with mock.patch.object(even, "agree_min", lambda offer, group=None: min(offer, q)):
        yield


def run_ranks(pipes: list[Even], epochs: int) -> list[list[list[Any]]]:
    """Each rank's items per even-epoch over ``epochs`` even-epochs, ranks in threads."""
    lockstep = Lockstep(len(pipes))
    results: list[list[list[Any]]] = [[] for _ in pipes]
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            results[r] = [list(pipes[r]) for _ in range(epochs)]
        except BaseException as error:  # re-raised in the test's thread
            errors.append(error)
            lockstep.agreed.abort()

    with mock.patch.object(even, "agree_min", lockstep.agree_min):
        threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(pipes))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    if errors:
        raise errors[0]
    return results


def upstream_stream(build: Callable[[], rs.Node], epochs: int) -> list[Any]:
    """The items of ``epochs`` upstream epochs back to back, as one rank's stream."""
    pipe = build()
    return [item for _ in range(epochs) for item in pipe]


def test_one_rank_yields_each_upstream_epoch_whole() -> None:
    def build() -> rs.Node:
        return rs.from_list(list(range(11))).shuffle(4).batch(3)

    pipe = build().even(times=3)
    assert isinstance(pipe, rs.nodes.Even)
    epochs = [list(pipe) for _ in range(4)]
    assert [len(epoch) for epoch in epochs] == [4, 4, 4, 0]
    assert [item for epoch in epochs for item in epoch] == upstream_stream(build, 3)
    assert pipe.leftover == 0 and pipe.ended


def test_surplus_is_carried_into_the_next_epochs() -> None:
    """Against a rank that offers 4 items per epoch, this rank's surplus grows by 3 per epoch
    of 7 and soon spans more than one upstream epoch: each epoch still continues the stream."""
    build = lambda: rs.from_list(list(range(7))).shuffle(1)  # noqa: E731
    with elsewhere(4):
        pipe = Even(build(), times=5)
        epochs = [list(pipe) for _ in range(5)]
        assert list(pipe) == []
    assert [len(epoch) for epoch in epochs] == [4] * 5
    assert [item for epoch in epochs for item in epoch] == upstream_stream(build, 5)[:20]
    assert pipe.leftover == 5 * (7 - 4)


def test_times_ends_the_run_and_leftover_reports_what_was_not_yielded() -> None:
    pipes = [Even(rs.from_list(list(range(100 * r, 100 * r + n))).shuffle(r), times=2) for r, n in enumerate([5, 9])]
    first, second = run_ranks(pipes, 3)
    assert [len(epoch) for epoch in first] == [len(epoch) for epoch in second] == [5, 5, 0]
    assert [pipe.leftover for pipe in pipes] == [0, 2 * 9 - 10]


@given(
    lengths=st.lists(st.integers(0, 12), min_size=2, max_size=3),
    batch_size=st.integers(1, 3),
    epochs=st.integers(1, 4),
)
def test_every_rank_yields_the_agreed_count_and_nothing_is_lost(
    lengths: list[int], batch_size: int, epochs: int
) -> None:
    """Ranks with uneven data: every even-epoch has the same size on every rank, the minimum
    of what the ranks hold; each rank yields a prefix of its stream over upstream epochs and
    the rest of the run's items are its leftover."""
    builds = [
        (lambda r=r, n=n: rs.from_list(list(range(100 * r, 100 * r + n))).shuffle(r).batch(batch_size))
        for r, n in enumerate(lengths)
    ]
    pipes = [Even(build(), times=epochs) for build in builds]
    results = run_ranks(pipes, epochs + 1)
    per_epoch = -(-min(lengths) // batch_size) if min(lengths) else 0  # batches of the smallest rank
    carries = [0] * len(lengths)
    for k in range(epochs + 1):
        sizes = {len(rank[k]) for rank in results}
        assert len(sizes) == 1, f"even-epoch {k}: ranks yielded {sizes}"
        offers = [carry + -(-n // batch_size) for carry, n in zip(carries, lengths)]
        expected = min(offers) if k < epochs else 0
        assert sizes == {expected}
        carries = [offer - expected for offer in offers] if k < epochs else carries
    assert carries[lengths.index(min(lengths))] == 0 and min(len(r[0]) for r in results) == per_epoch
    for build, rank, pipe in zip(builds, results, pipes):
        stream = upstream_stream(build, epochs)
        yielded = [item for epoch in rank for item in epoch]
        assert yielded == stream[: len(yielded)], "each rank continues its own stream"
        assert len(yielded) + pipe.leftover == len(stream), "every item yielded once or left over"


def test_resume_at_every_step_of_three_even_epochs() -> None:
    """Against a rank offering 3 batches (this one has 5): save after every item (0, mid-epoch, the last item of an
    epoch, the step after it, the end of the run and after), restore once and twice in a row."""

    def build() -> rs.Node:
        return Even(rs.from_list(list(range(13))).shuffle(2).batch(3), times=3)

    with elsewhere(3):
        total = len(take(build(), 100))
        assert total == 3 * 3
        for k in range(total + 1):
            check_resume(build, k, total)
            check_resume(build, k, total, k2=min(total, k + 4))


@pytest.mark.parametrize("kind", INDEXED_KINDS)
def test_resume_over_every_source_kind(kind: str) -> None:
    records = [{"id": i, "input_ids": list(range(i % 5 + 1))} for i in range(23)]

    def build() -> rs.Node:
        return Even(indexed_source(kind, records).shuffle(5).shard(1, 2).batch(2))

    with elsewhere(4):
        for k in (0, 5, 6, 7, 12, 19):
            check_resume(build, k, 22, k2=k + 3)


def test_whole_epoch_packing_carries_rows_across_epochs() -> None:
    records = [{"input_ids": list(range(1 + (i * 7) % 23))} for i in range(40)]

    def build() -> rs.Node:
        rows = rs.from_list(records).shuffle(3).shard(0, 2).pack(16, strategy="bfd")
        return Even(rows.batch(2, collate_fn=lambda batch: [row["input_ids"].tolist() for row in batch]))

    with elsewhere(2):
        check_resume(build, 3, 14, k2=9)


def test_a_restored_state_keeps_its_count_and_takes_part_in_the_agreement_once_more() -> None:
    """A state taken mid-epoch holds the agreed count, which it keeps; at its next item it takes
    part in its epoch's agreement once more, offering what it offered (9: its count 7 and the
    carry 2), so that a consumer restored from before the agreement (a DataLoader worker that
    had handed out nothing yet) finds every consumer's offer instead of waiting for ever."""
    with elsewhere(7):
        pipe = Even(rs.from_list(list(range(9))).shuffle(0))
        take(pipe, 3)
        state = json.loads(json.dumps(pipe.get_state()))
    resumed = Even(rs.from_list(list(range(9))).shuffle(0))
    resumed.set_state(state)
    offers: list[int] = []
    with mock.patch.object(even, "agree_min", lambda offer, group=None: offers.append(offer) or min(offer, 7)):
        assert resumed.get_state() == state  # nothing happens before its next item
        assert len(list(resumed)) == 7 - 3
        assert offers == [9] and resumed.quota == 7 and resumed.leftover == 2
        assert len(list(resumed)) == 7 and offers == [9, 11]  # the next epoch agrees as usual: 2 carried + 9


RECORDS = [{"id": i, "input_ids": list(range(i % 5 + 1))} for i in range(8)]


def both(*components: rs.Node, on_end: str = "stop") -> rs.Node:
    """A mix of two components, one item of each in turn."""
    return rs.mix(dict(zip("ab", components)), weights={"a": 1, "b": 1}, on_end=on_end)


@pytest.mark.parametrize(
    "build, culprit",
    [
        (lambda: rs.from_list(RECORDS).filter(bool), "Filter"),
        (lambda: rs.from_list(RECORDS).shuffle(0).map(len, num_workers=2).filter(bool).batch(2), "Filter"),
        (lambda: rs.from_list(RECORDS).pack(4, buffer_size=2), "Pack"),
        (lambda: both(rs.from_list(RECORDS), rs.from_list(RECORDS)), "Mix"),
        (lambda: both(rs.from_list(RECORDS).filter(bool), rs.from_list(RECORDS), on_end="drop"), "Filter"),
    ],
)
def test_unknown_length_is_refused_at_construction_naming_the_node(build: Callable[[], rs.Node], culprit: str) -> None:
    """A chain whose epochs' lengths cannot be known is refused when the pipeline is built, not
    at its first item (the composition table has no third verdict)."""
    with pytest.raises(rs.ConfigError, match=f"Even: needs the number of items.*{culprit}"):
        build().even()


def test_known_lengths_are_accepted_without_reading_a_record() -> None:
    """Whole-epoch plans, maps, read-ahead, batches and mixes that drop are accepted, and
    telling so reads no record; each even-epoch is then the upstream's (a single rank)."""
    reads: list[int] = []

    def seen(record: dict[str, Any]) -> dict[str, Any]:
        reads.append(record["id"])
        return record

    def source() -> rs.Node:
        return rs.from_list(RECORDS).shuffle(0).map(seen)

    builds = [
        lambda: source().pack(4, strategy="bfd").batch(2),
        lambda: both(source().prefetch(2), rs.from_list(RECORDS), on_end="drop").batch(3),
    ]
    pipes = [build().even() for build in builds]
    assert reads == []
    assert [len(list(pipe)) for pipe in pipes] == [len(list(build())) for build in builds]


def test_refused_options_and_chains() -> None:
    source = rs.from_list(list(range(5)))
    for times in (0, -1, 1.5, True):
        with pytest.raises(rs.ConfigError, match="times"):
            Even(source, times=times)  # type: ignore[arg-type]  # invalid on purpose
    with pytest.raises(rs.ConfigError, match="repeats already"):
        Even(source.repeat(2).batch(2))
    with pytest.raises(rs.ConfigError, match="repeats already"):
        Even(Even(source))
    with pytest.raises(rs.ConfigError, match=r"use \.even\(times=n\) instead of \.even\(\)\.repeat\(n\)"):
        Even(source).batch(2).repeat(2)  # a rescale could not continue ranks in different epochs


def test_refused_in_a_dataloader_worker_of_a_multi_rank_job_without_a_store(monkeypatch: pytest.MonkeyPatch) -> None:
    """No store handed down (a plain DataLoader, or a dataset built before the process group):
    the worker cannot agree with the other ranks. With a single rank, each worker is alone."""
    monkeypatch.setattr(torch.utils.data, "get_worker_info", lambda: SimpleNamespace(id=1, num_workers=2))
    monkeypatch.setattr(even, "_inherited_store", None)
    assert len(list(Even(rs.from_list(list(range(5)))))) == 5
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(rs.ConfigError, match="no process group store.*num_workers=0"):
        next(Even(rs.from_list(list(range(5)))))


def test_bad_states_are_state_errors() -> None:
    pipe = Even(rs.from_list(list(range(5))), times=2)
    next(pipe)
    good = pipe.get_state()
    for key, value in (("quota", -1), ("quota", True), ("yielded", 9), ("carry", "x"), ("started_epochs", 7)):
        with pytest.raises(rs.StateError, match=key):
            pipe.set_state({**good, key: value})
    with pytest.raises(rs.StateError, match="times"):
        Even(rs.from_list(list(range(5))), times=3).set_state(good)
    assert pipe.get_state() == good


def test_epochs_counted_ahead_beyond_the_items_owed_are_a_state_error() -> None:
    """Each upstream epoch counted ahead of the one being read would cost a next_epoch() at the
    next agreement, so a damaged count (more of them than items owed) is refused, not looped over."""
    build = lambda: Even(rs.from_list(list(range(7))).shuffle(1))  # noqa: E731
    with elsewhere(4):
        pipe = build()
        take(pipe, 15)
        good = json.loads(json.dumps(pipe.get_state()))
    assert good["carry"] > 0 and good["counted_epochs"] > good["started_epochs"]
    owed = good["carry"] + good["quota"] - good["yielded"]
    fresh = build()
    fresh.set_state({**good, "counted_epochs": good["started_epochs"] + owed})
    for value in (good["started_epochs"] + owed + 1, 10**9, 2**63 - 1):
        with pytest.raises(rs.StateError, match="counted_epochs"):
            fresh.set_state({**good, "counted_epochs": value})
    for key in ("carry", "quota"):
        with pytest.raises(rs.StateError, match=key):
            fresh.set_state({**good, key: 2**63})
