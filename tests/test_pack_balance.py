"""Length balance over time: a long document's whole rows wait beside the pieces and leave in
step with them, so every stretch of rows keeps the epoch's share of long-document tokens; the
packer's future stays a function of its groups, and states saved before whole rows waited
still continue as they would have."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import resumable as rs
from resumable.elastic import restore
from resumable.pack import expand_references
from resumable.pack._planned import ROW_ORDER
from resumable.pack.epoch import FIRST_PIECE, LONGEST_PIECE, ROW_ORDERS, Plan
from resumable.pack.strategies import BestFit, FirstFit, NextFit, Packer, Row, WindowBFD
from tests.resume import check_resume, roundtrip, take

STREAMING = ["greedy", "first_fit", "best_fit", "bfd"]
SEQ_LEN, BUFFER, DOCUMENTS = 64, 100, 4000
WINDOW_BUFFERS = 2
"""Windows hold the rows that ``WINDOW_BUFFERS * BUFFER`` documents make."""
BOUND = 6.0
"""Largest |window share - epoch share| of long-document tokens, in points. Next-fit, which
keeps the stream order, reaches 3.1 on this corpus; whole rows leaving at once, 8 to 11."""
SHORT, LONG = 1, 2  # every token says whether its document is longer than SEQ_LEN


def balanced_corpus(seed: int = 0) -> list[dict[str, np.ndarray]]:
    """Log-normal lengths (median 1.14 * SEQ_LEN, sigma 0.5), 60% of documents longer than
    SEQ_LEN, six long and four short in every ten (in random order), so that windows of the
    input itself keep the share closely and what a test sees is the packer's reordering."""
    rng = np.random.default_rng(seed)
    sizes = np.maximum(1, np.rint(np.exp(rng.normal(np.log(SEQ_LEN) + 0.13, 0.5, 3 * DOCUMENTS)))).astype(np.int64)
    long = sizes[sizes > SEQ_LEN][: DOCUMENTS * 6 // 10].reshape(-1, 6)
    short = sizes[sizes <= SEQ_LEN][: DOCUMENTS * 4 // 10].reshape(-1, 4)
    sizes = rng.permuted(np.concatenate([long, short], axis=1), axis=1).ravel()
    tokens = np.repeat(np.where(sizes > SEQ_LEN, LONG, SHORT).astype(np.int8), sizes)
    bounds = np.concatenate(([0], np.cumsum(sizes)))
    return [{"input_ids": tokens[start:stop]} for start, stop in zip(bounds[:-1], bounds[1:])]


CORPUS = balanced_corpus()


def drift(pipe: rs.Node[Any]) -> float:
    """Largest |long-token share of a window - the epoch's| over every window of rows, in points."""
    ids = np.stack([row["input_ids"] for row in pipe])
    long_tokens = np.concatenate(([0], np.cumsum((ids == LONG).sum(axis=1))))
    tokens = np.concatenate(([0], np.cumsum((ids > 0).sum(axis=1))))
    window = round(WINDOW_BUFFERS * BUFFER * len(ids) / DOCUMENTS)
    shares = (long_tokens[window:] - long_tokens[:-window]) / (tokens[window:] - tokens[:-window])
    return float(np.abs(shares - long_tokens[-1] / tokens[-1]).max() * 100)


def packed(strategy: str) -> rs.Node[Any]:
    return rs.from_list(CORPUS).pack(SEQ_LEN, strategy=strategy, buffer_size=BUFFER)


def as_before(pipe: rs.Node[Any]) -> rs.Node[Any]:
    """``pipe`` restored from its own fresh state without the group of waiting whole rows, as
    states were saved before: its packer lets whole rows leave at once, for this epoch."""
    state = roundtrip(pipe.get_state())
    pack = state
    while pack["kind"] != "Pack":
        pack = pack["upstream"]
    pack["open_sizes"] = pack["open_sizes"][:-1]
    pipe.set_state(state)
    return pipe


@pytest.mark.parametrize("strategy", STREAMING)
def test_every_window_of_rows_keeps_the_epochs_share_of_long_documents(strategy: str) -> None:
    assert drift(packed(strategy)) <= BOUND


@pytest.mark.parametrize("strategy", ["first_fit", "best_fit"])
def test_whole_rows_leaving_at_once_break_the_bound(strategy: str) -> None:
    """What the bound guards against: the first rows of the epoch hold long documents only."""
    pipe = as_before(packed(strategy))
    first = next(pipe)["input_ids"]
    assert (first == LONG).all()
    assert drift(pipe) > BOUND


# -- the strategies: whole rows in the groups, restored exactly --------------------------------

PACKERS = {
    "greedy": lambda: NextFit(8),
    "first_fit": lambda: FirstFit(8, 4),
    "best_fit": lambda: BestFit(8, 4),
    "bfd": lambda: WindowBFD(8, 4),
}
ARRIVALS = st.lists(st.one_of(st.integers(1, 8), st.integers(1, 3).map(lambda rows: -rows)), max_size=60)
"""Pieces of 1 to 8 tokens, and (negative) whole-row items of 1 to 3 rows."""


def feed(packer: Packer, arrivals: list[int], first: int = 0) -> list[Row]:
    rows: list[Row] = []
    for item, arrival in enumerate(arrivals, start=first):
        rows += packer.add(item, arrival) if arrival > 0 else packer.add_whole(item, -arrival)
    return rows


@pytest.mark.parametrize("name", STREAMING)
@given(arrivals=ARRIVALS, data=st.data())
def test_groups_with_whole_rows_restore_the_same_future(name: str, arrivals: list[int], data: st.DataObject) -> None:
    cut = data.draw(st.integers(0, len(arrivals)), label="cut")
    original = PACKERS[name]()
    head = feed(original, arrivals[:cut])
    assert len(original._whole) <= getattr(original, "buffer_size", 0)
    assert not original._whole or original.pending, "whole rows wait only beside pieces"
    lengths = {item: arrival if arrival > 0 else -arrival * 8 for item, arrival in enumerate(arrivals)}
    restored = PACKERS[name]()
    restored.restore([[(item, lengths[item]) for item in group] for group in original.groups()])
    rest = feed(original, arrivals[cut:], cut) + original.flush()
    assert feed(restored, arrivals[cut:], cut) + restored.flush() == rest
    placed = sorted(item for row in head + rest for item in row)
    assert placed == list(range(len(arrivals))), "every piece and whole-row item leaves once"


# -- the node: exact resume with whole rows waiting, and states saved before ---------------------


SMALL = [
    {"input_ids": (number + 1) * 1000 + np.arange(length)}
    for number, length in enumerate([3, 20, 5, 17, 2, 9, 26, 4, 6, 16, 1, 12, 7, 30, 3])
]


def builder(strategy: str, repeat: bool = False) -> Any:
    def build() -> rs.Node[Any]:
        pipe: rs.Node[Any] = rs.from_list(SMALL).shuffle(5)
        pipe = pipe.repeat() if repeat else pipe
        return pipe.pack(8, strategy=strategy, buffer_size=3).map(lambda row: row["input_ids"].tolist())

    return build


def waiting_whole_rows(pipe: rs.Node[Any]) -> int:
    """Whole-row items held (open, or in rows closed but not handed out); pieces are shorter."""
    state = expand_references(pipe.get_state()["upstream"])
    return sum(end - start >= 8 for *_, start, end in state["open"] + state["ready"])


@pytest.mark.parametrize("strategy", STREAMING)
@pytest.mark.parametrize("repeat", [False, True])
def test_resume_with_whole_rows_waiting(strategy: str, repeat: bool) -> None:
    build = builder(strategy, repeat)
    rows = 40 if repeat else len(list(build()))  # an epoch
    pipe, waited = build(), 0
    for k in range(rows + 1):
        waited += waiting_whole_rows(pipe) > 0
        check_resume(build, k, rows + 8, k2=k + 1)
        take(pipe, 1)
    assert waited or strategy == "greedy", "the scenario needs whole rows waiting at a checkpoint"


@pytest.mark.parametrize("strategy", ["first_fit", "best_fit", "bfd"])
def test_a_state_saved_before_whole_rows_waited_continues_as_it_would_have(strategy: str) -> None:
    """Restored from such a state, the packer lets whole rows leave at once until the epoch
    ends, keeps saving states of that form, and resumes from them exactly; every token comes
    once."""
    build = builder(strategy)
    pipe = as_before(build())
    head = take(pipe, 4)
    state = pipe.get_state()
    rest = list(pipe)  # the rest of the epoch
    resumed = build()
    resumed.set_state(roundtrip(state))
    assert list(resumed) == rest
    tokens = sorted(token for row in head + rest for token in row if token)
    assert tokens == sorted(int(token) for record in SMALL for token in record["input_ids"])


# -- whole-epoch bfd: rows in the order of their longest piece -----------------------------------


def planned() -> rs.Node[Any]:
    return rs.from_list(CORPUS).pack(SEQ_LEN, strategy="bfd")


def in_first_piece_order(pipe: rs.Node[Any]) -> rs.Node[Any]:
    """``pipe`` restored from its own fresh state without ``row_order``, as states were saved
    before: its plan orders this epoch's rows by their first piece."""
    state = roundtrip(pipe.get_state())
    pack = state
    while pack["kind"] != "Pack":
        pack = pack["upstream"]
    del pack[ROW_ORDER]
    pipe.set_state(state)
    return pipe


def test_every_window_of_a_whole_epoch_plans_rows_keeps_the_epochs_share_of_long_documents() -> None:
    assert drift(planned()) <= BOUND


def test_rows_in_the_order_of_their_first_piece_are_the_same_rows_and_break_the_bound() -> None:
    """What the bound guards against: rows holding many short pieces have an early one."""
    balanced = [row["input_ids"].tolist() for row in planned()]
    before = in_first_piece_order(planned())
    assert drift(before) > BOUND
    after_restore = [row["input_ids"].tolist() for row in in_first_piece_order(planned())]
    assert after_restore != balanced
    assert sorted(after_restore) == sorted(balanced), "the same rows: the packing is unchanged"


DOCUMENT_ROWS = st.lists(st.tuples(st.integers(1, 40), st.integers(0, 2), st.booleans()), max_size=40).map(
    lambda drawn: np.array([(index, *piece) for index, piece in enumerate(drawn)], dtype=np.int64).reshape(-1, 4)
)
"""``(record index, tokens, reserved extra, whole rows?)`` per document, made into plan input below."""


@given(drawn=DOCUMENT_ROWS, max_pieces=st.sampled_from([None, 2, 3]))
def test_both_row_orders_plan_the_same_rows_in_their_order(drawn: np.ndarray, max_pieces: int | None) -> None:
    seq_len = 8
    tokens, extra, split = drawn[:, 1], drawn[:, 2], drawn[:, 3].astype(bool)
    extra = np.where(split, 0, extra)  # a document with reserved positions is one piece
    end = np.where(split, tokens, np.minimum(tokens, seq_len - extra))
    documents = np.stack([drawn[:, 0], np.where(split, end // seq_len * seq_len, 0), end, extra], axis=1)
    plans = {order: Plan.pack(documents, seq_len, max_pieces, {}, order) for order in ROW_ORDERS}
    rows = {order: [plan.row(row) for row in range(plan.rows)] for order, plan in plans.items()}
    assert sorted(rows[LONGEST_PIECE]) == sorted(rows[FIRST_PIECE])
    longest_plan = plans[LONGEST_PIECE]
    costs = (longest_plan.ends - longest_plan.starts + np.repeat(extra, _pieces(documents, seq_len))).tolist()
    for order, key in ((FIRST_PIECE, min), (LONGEST_PIECE, lambda row: min(row, key=lambda i: (-costs[i], i)))):
        assert all(row == sorted(row) for row in rows[order]), "a row's pieces come in the upstream's order"
        keys = [key(row) for row in rows[order]]
        assert keys == sorted(keys), order


def _pieces(documents: np.ndarray, seq_len: int) -> np.ndarray:
    """Pieces of each document: its whole rows, and its tail if any."""
    result: np.ndarray = documents[:, 1] // seq_len + (documents[:, 2] > documents[:, 1])
    return result


# -- a whole-epoch bfd state saved by the code before: rows of the first-piece order -------------

OLD = json.loads((Path(__file__).parent / "data" / "states_bfd_first_piece.json").read_text())
"""Written by the code before ``row_order`` existed (commit 431fcaf) with ``recorded`` below:
a state after 5 rows of epoch 0 and the rows it gave for the rest of the epoch; states of 3
consumers after 0, 2 and 4 rows, and the rows 2 consumers gave for the rest of the epoch
after restoring them."""
RECORDS = [{"input_ids": (number + 1) * 1000 + np.arange(1 + number * 7 % 19)} for number in range(40)]


def recorded(consumer: int = 0, consumers: int = 1) -> rs.Node[Any]:
    return rs.from_list(RECORDS).shuffle(5).shard(consumer, consumers).pack(8, strategy="bfd").repeat()


def ids(rows: list[dict[str, Any]]) -> list[list[int]]:
    return [row["input_ids"].tolist() for row in rows]


def from_old_state() -> rs.Node[Any]:
    """The recorded pipeline restored from the old state, rows as lists."""
    pipe = recorded()
    pipe.set_state(roundtrip(OLD["state"]))
    return pipe.map(lambda row: row["input_ids"].tolist())


def test_an_old_state_continues_its_epoch_in_the_first_piece_order_then_plans_by_the_longest() -> None:
    assert ROW_ORDER not in OLD["state"]["upstream"]
    fresh = recorded()
    epoch = len(fresh.upstream)
    balanced = ids(take(fresh, 2 * epoch))
    pipe = from_old_state()
    assert take(pipe, len(OLD["rows"])) == OLD["rows"] != balanced[5:epoch]
    assert take(pipe, epoch) == balanced[epoch:], "the next epoch is planned by the longest piece"


@pytest.mark.parametrize("k", [0, 1, 20, 44, 45])
def test_exact_resume_after_restoring_an_old_state(k: int) -> None:
    """At the start, middle and end of the old-order epoch, the step after, into the next epoch,
    twice in a row: the saved states keep the old order until the epoch ends."""
    check_resume(from_old_state, k, 100, k2=k + 7)


def test_old_consumers_states_rescale_as_they_did() -> None:
    """The rows left by the old consumers keep their plans' order, and the stride no old
    consumer planned is planned in that order too."""
    for consumer, rows in enumerate(OLD["rescaled_rows"]):
        pipe = recorded(consumer, 2)
        restore(pipe, roundtrip(OLD["consumer_states"]))
        assert ids(take(pipe, len(rows))) == rows


def test_old_consumers_states_of_two_row_orders_are_refused() -> None:
    states = roundtrip(OLD["consumer_states"])
    states[1]["upstream"][ROW_ORDER] = LONGEST_PIECE
    with pytest.raises(rs.StateError, match="Pack.*different row_orders"):
        restore(recorded(0, 2), states)


def test_an_unknown_row_order_is_refused() -> None:
    state = roundtrip(OLD["state"])
    state["upstream"][ROW_ORDER] = "shortest_piece"
    with pytest.raises(rs.StateError, match="Pack.*'row_order' is 'shortest_piece'"):
        recorded().set_state(state)
