"""The bin-packing strategies on plain ints: capacity, completeness, the choice each one makes,
and that ``groups()`` + ``restore()`` reproduce a packer's future exactly."""

from __future__ import annotations

from typing import Callable

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from resumable.pack.strategies import (
    MAX_ROUNDS,
    BestFit,
    FirstFit,
    NextFit,
    Packer,
    Row,
    WindowBFD,
    best_fit_decreasing,
    make_packer,
)

SEQ_LEN = 16


def lengths_strategy(seq_len: int = SEQ_LEN, max_size: int = 80) -> st.SearchStrategy[list[int]]:
    edge = st.sampled_from([1, 2, seq_len - 1, seq_len])
    return st.lists(st.one_of(edge, st.integers(1, seq_len)), max_size=max_size)


def run(packer: Packer, lengths: list[int]) -> list[Row]:
    rows: list[Row] = []
    for item, length in enumerate(lengths):
        rows += packer.add(item, length)
        check_buffer_bound(packer)
    return rows + packer.flush()


def check_buffer_bound(packer: Packer) -> None:
    buffer_size = getattr(packer, "buffer_size", None)
    if buffer_size is not None:
        assert packer.pending <= buffer_size


def check_rows(rows: list[Row], lengths: list[int], seq_len: int, max_items: int | None) -> None:
    """Capacity never exceeded, every piece placed exactly once."""
    assert sorted(item for row in rows for item in row) == list(range(len(lengths)))
    for row in rows:
        assert row, "an empty row"
        assert sum(lengths[item] for item in row) <= seq_len
        if max_items is not None:
            assert len(row) <= max_items


Factory = Callable[[int, int | None], Packer]
FACTORIES: dict[str, Factory] = {
    "greedy": lambda buffer, limit: NextFit(SEQ_LEN, limit),
    "first_fit": lambda buffer, limit: FirstFit(SEQ_LEN, buffer, limit),
    "best_fit": lambda buffer, limit: BestFit(SEQ_LEN, buffer, limit),
    "bfd": lambda buffer, limit: WindowBFD(SEQ_LEN, buffer, limit),
}


@pytest.mark.parametrize("name", sorted(FACTORIES))
@given(
    lengths=lengths_strategy(),
    buffer_size=st.integers(1, 12),
    max_items=st.one_of(st.none(), st.integers(1, 5)),
)
def test_every_piece_placed_once_within_capacity(
    name: str, lengths: list[int], buffer_size: int, max_items: int | None
) -> None:
    packer = FACTORIES[name](buffer_size, max_items)
    rows = run(packer, lengths)
    check_rows(rows, lengths, SEQ_LEN, max_items)
    assert packer.pending == 0 and not any(packer.groups())


@pytest.mark.parametrize("name", sorted(FACTORIES))
@given(
    lengths=lengths_strategy(),
    buffer_size=st.integers(1, 12),
    max_items=st.one_of(st.none(), st.integers(1, 5)),
    data=st.data(),
)
def test_groups_and_restore_reproduce_the_future(
    name: str, lengths: list[int], buffer_size: int, max_items: int | None, data: st.DataObject
) -> None:
    """The checkpoint contract: a fresh packer restored from ``groups()`` (with renamed ids)
    closes exactly the same rows from then on."""
    cut = data.draw(st.integers(0, len(lengths)), label="cut")
    original = FACTORIES[name](buffer_size, max_items)
    for item, length in enumerate(lengths[:cut]):
        original.add(item, length)
    rename = 1000  # the restored packer knows the buffered pieces as item + rename

    def unrename(rows: list[Row]) -> list[Row]:
        return [[item - rename if item >= rename else item for item in row] for row in rows]

    restored = FACTORIES[name](buffer_size, max_items)
    restored.restore([[(item + rename, lengths[item]) for item in group] for group in original.groups()])
    assert restored.pending == original.pending
    for item in range(cut, len(lengths)):
        assert unrename(restored.add(item, lengths[item])) == original.add(item, lengths[item])
    assert unrename(restored.flush()) == original.flush()


# -- greedy: next-fit --------------------------------------------------------------------------


@given(lengths=lengths_strategy(), max_items=st.one_of(st.none(), st.integers(1, 5)))
def test_greedy_closes_the_row_when_the_next_piece_does_not_fit(lengths: list[int], max_items: int | None) -> None:
    rows = run(NextFit(SEQ_LEN, max_items), lengths)
    assert [item for row in rows for item in row] == list(range(len(lengths))), "rows keep the arrival order"
    limit = max_items or SEQ_LEN
    for row, following in zip(rows, rows[1:]):
        used = sum(lengths[item] for item in row)
        assert used == SEQ_LEN or len(row) == limit or used + lengths[following[0]] > SEQ_LEN


# -- first_fit: the earliest open row with room -----------------------------------------------


def first_fit_by_scan(lengths: list[int], seq_len: int, buffer_size: int, max_items: int | None) -> list[Row]:
    """Reference: scan the open rows in opening order; close the oldest on overflow."""
    limit = max_items or seq_len
    open_rows: list[tuple[Row, int]] = []  # (items, used), oldest first
    rows: list[Row] = []
    for item, length in enumerate(lengths):
        for index, (items, used) in enumerate(open_rows):
            if used + length <= seq_len:
                items.append(item)
                open_rows[index] = (items, used + length)
                if used + length == seq_len or len(items) == limit:
                    rows.append(open_rows.pop(index)[0])
                break
        else:
            if length == seq_len or limit == 1:
                rows.append([item])
                continue
            open_rows.append(([item], length))
        if sum(len(items) for items, _ in open_rows) > buffer_size:
            rows.append(open_rows.pop(0)[0])
    return rows + [items for items, _ in open_rows]


@given(
    lengths=lengths_strategy(max_size=120),
    buffer_size=st.integers(1, 12),
    max_items=st.one_of(st.none(), st.integers(1, 5)),
)
def test_first_fit_picks_the_earliest_row_with_room(
    lengths: list[int], buffer_size: int, max_items: int | None
) -> None:
    assert run(FirstFit(SEQ_LEN, buffer_size, max_items), lengths) == first_fit_by_scan(
        lengths, SEQ_LEN, buffer_size, max_items
    )


def test_first_fit_renumbers_slots_without_changing_the_order() -> None:
    """Many rows opened and closed while an old row stays open: the slots run out and are
    renumbered; the result still equals the scan."""
    lengths = [1] + [SEQ_LEN - 1, 1] * 200 + [3, 5, 15]
    assert run(FirstFit(SEQ_LEN, 3), lengths) == first_fit_by_scan(lengths, SEQ_LEN, 3, None)


def test_first_fit_tree_grows_with_the_open_rows_not_the_buffer_size() -> None:
    """Hundreds of rows open at once (pieces over half a row each, then small ones that fill
    the oldest first) double the slot tree several times; the result still equals the scan,
    and a buffer_size far past any memory builds at once (the tree follows the open rows)."""
    lengths = [SEQ_LEN // 2 + 1 + i % 3 for i in range(700)] + [1, 2, 3] * 300
    assert run(FirstFit(SEQ_LEN, 600), lengths) == first_fit_by_scan(lengths, SEQ_LEN, 600, None)
    assert run(FirstFit(SEQ_LEN, 2**62), lengths[:50]) == first_fit_by_scan(lengths[:50], SEQ_LEN, 2**62, None)


# -- best-fit-decreasing and the best_fit rounds ----------------------------------------------


def bfd_fills_by_scan(lengths: list[int], seq_len: int) -> list[int]:
    """Reference BFD: longest first, each into the open row with the least room that fits."""
    used: list[int] = []
    for length in sorted(lengths, reverse=True):
        fitting = [index for index, fill in enumerate(used) if fill + length <= seq_len]
        if fitting:
            best = max(fitting, key=lambda index: used[index])
            used[best] += length
        else:
            used.append(length)
    return sorted(used)


@given(lengths=lengths_strategy(max_size=120))
def test_bfd_puts_each_piece_into_the_fullest_row_that_fits(lengths: list[int]) -> None:
    """Rows with equal room are interchangeable, so the fills match the scan's exactly."""
    rows = best_fit_decreasing(np.array(lengths, dtype=np.int64), SEQ_LEN)
    check_rows(rows, lengths, SEQ_LEN, None)
    assert sorted(sum(lengths[i] for i in row) for row in rows) == bfd_fills_by_scan(lengths, SEQ_LEN)


@given(lengths=lengths_strategy(max_size=120), max_items=st.one_of(st.none(), st.integers(1, 5)))
def test_bfd_rows_follow_the_input_order(lengths: list[int], max_items: int | None) -> None:
    rows = best_fit_decreasing(np.array(lengths, dtype=np.int64), SEQ_LEN, max_items)
    check_rows(rows, lengths, SEQ_LEN, max_items)
    assert all(row == sorted(row) for row in rows)
    assert [row[0] for row in rows] == sorted(row[0] for row in rows)


def test_bfd_beats_next_fit_on_a_hard_mix() -> None:
    lengths = [9, 9, 9, 9, 7, 7, 7, 7]
    assert len(best_fit_decreasing(np.array(lengths), SEQ_LEN)) == 4
    assert len(run(NextFit(SEQ_LEN), lengths)) == 6  # 9 | 9 | 9 | 9 7 | 7 7 | 7


def test_bfd_rejects_bad_lengths() -> None:
    with pytest.raises(ValueError):
        best_fit_decreasing(np.array([0, 3]), SEQ_LEN)
    with pytest.raises(ValueError):
        best_fit_decreasing(np.array([SEQ_LEN + 1]), SEQ_LEN)


@given(lengths=lengths_strategy(max_size=150), buffer_size=st.integers(1, 12))
def test_best_fit_rounds_emit_rows_of_the_plan_and_bound_the_wait(lengths: list[int], buffer_size: int) -> None:
    packer = BestFit(SEQ_LEN, buffer_size)
    arrival: dict[int, int] = {}
    for item, length in enumerate(lengths):
        before = [(i, lengths[i]) for group in packer.groups() for i in group]
        arrival[item] = item
        closed = packer.add(item, length)
        if length == SEQ_LEN:
            assert closed == [[item]]
            continue
        if closed:  # a planning round: its rows are rows of the BFD plan of the buffer
            buffered = [*before, (item, length)]
            plan = best_fit_decreasing(np.array([length for _, length in buffered]), SEQ_LEN)
            planned = [[buffered[i][0] for i in row] for row in plan]
            assert all(row in planned for row in closed)
            assert sum(len(row) for row in closed) >= (len(buffered) + 1) // 2
        for row in closed:
            for done in row:
                assert item - arrival[done] <= (MAX_ROUNDS + 1) * (buffer_size + 1)
        assert packer.pending <= buffer_size


def test_best_fit_fills_rows_from_a_buffer_better_than_arrival_order() -> None:
    """In arrival order, [3, 3, 13, 13] needs three rows (3+3, 13, 13); planned longest first
    from a buffer, two full ones."""
    lengths = [3, 3, 13, 13]
    rows = run(BestFit(SEQ_LEN, 4), lengths)
    assert len(rows) == 2 and all(sum(lengths[i] for i in row) == SEQ_LEN for row in rows)


# -- construction and restore errors -----------------------------------------------------------


def test_make_packer_and_bad_options() -> None:
    assert isinstance(make_packer("best_fit", 8, 4), BestFit)
    with pytest.raises(ValueError, match="unknown strategy"):
        make_packer("worst_fit", 8, 4)
    with pytest.raises(ValueError):
        FirstFit(8, 0)
    with pytest.raises(ValueError):
        NextFit(0)
    with pytest.raises(ValueError):
        NextFit(8, 0)
    with pytest.raises(ValueError):
        NextFit(8).add(0, 9)
    with pytest.raises(ValueError):
        NextFit(8).add(0, 0)


@pytest.mark.parametrize(
    "name, groups",
    [
        ("greedy", [[(0, 3)], [(1, 3)]]),
        ("greedy", [[(0, SEQ_LEN)]]),
        ("first_fit", [[(0, 9), (1, 9)]]),
        ("first_fit", [[], []]),
        ("first_fit", [[(i, 1)] for i in range(5)]),
        ("best_fit", [[(0, 3)]]),
        ("best_fit", [[] for _ in range(MAX_ROUNDS)] + [[(0, SEQ_LEN)]]),
        ("bfd", [[(0, 3)], [(1, 3)]]),
        ("bfd", [[(i, 1) for i in range(4)]]),
    ],
)
def test_restore_rejects_groups_this_packer_cannot_hold(name: str, groups: list) -> None:
    with pytest.raises(ValueError):
        FACTORIES[name](4, None).restore(groups)


@pytest.mark.parametrize("cut", range(0, 24))
def test_a_piece_that_fits_nowhere_well_leaves_after_max_rounds_even_across_a_restore(cut: int) -> None:
    """A 9 never shares a row of 16 with 8s, and full rows of two 8s are always fuller: the 9
    waits until it has seen MAX_ROUNDS rounds, then is forced out at the next one."""
    lengths = [9] + [8] * 40
    packer = BestFit(SEQ_LEN, 4)
    rounds = 0
    for item, length in enumerate(lengths):
        if item == cut:  # restore into a fresh packer half-way: the rounds waited are kept
            restored = BestFit(SEQ_LEN, 4)
            restored.restore([[(i, lengths[i]) for i in group] for group in packer.groups()])
            packer = restored
        closed = packer.add(item, length)
        rounds += bool(closed)
        if [0] in closed:
            assert rounds == MAX_ROUNDS + 1
            return
    raise AssertionError("the 9 never left")
