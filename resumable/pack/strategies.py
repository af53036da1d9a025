"""Bin packing on plain ints: which pieces of token sequences share a row of ``seq_len`` tokens.

Nothing here knows about nodes, records or tokens. A piece is an opaque int id with a length;
a row is the list of ids placed in it, in placement order. The streaming packers keep a bounded
set of open rows (or, for ``WindowBFD``, a window of pieces) and say which rows are closed by
each ``add``; the node turns those ids back into token slices.

Every decision of a streaming packer is a function of its open groups (in canonical order) and
the incoming lengths, so ``groups()`` followed by ``restore()`` on a fresh packer reproduces the
same future exactly: this is what makes the packer's checkpoint a list of references.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from bisect import bisect_left, insort
from collections import OrderedDict
from typing import Sequence

import numpy as np

Row = list[int]
"""Ids of the pieces in one output row, in placement order."""

Group = Sequence[tuple[int, int]]
"""``(id, length)`` pairs of one open group, as passed to ``restore``."""

STRATEGIES = ("greedy", "first_fit", "best_fit", "bfd")

# best_fit: a buffered piece that has waited this many planning rounds leaves at the next one.
MAX_ROUNDS = 4


class Packer(ABC):
    """A streaming packer: pieces go in one at a time, closed rows come out.

    ``max_items`` bounds the pieces per row (a row holding that many is closed as if full).
    """

    def __init__(self, seq_len: int, max_items: int | None = None) -> None:
        if seq_len <= 0:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        if max_items is not None and max_items <= 0:
            raise ValueError(f"max_items must be positive, got {max_items}")
        self.seq_len = seq_len
        self.max_items = max_items if max_items is not None else seq_len

    @abstractmethod
    def add(self, item: int, length: int) -> list[Row]:
        """Place a piece of ``0 < length <= seq_len``; return the rows this closed, in order."""

    @abstractmethod
    def flush(self) -> list[Row]:
        """Close every open row (end of the stream), in a canonical order; leave the packer empty."""

    @abstractmethod
    def groups(self) -> list[Row]:
        """The open groups, in the canonical order that ``restore`` expects.

        The lists may be the packer's own (``get_state`` calls this often): read, never modify.
        """

    @abstractmethod
    def restore(self, groups: Sequence[Group]) -> None:
        """Rebuild an empty packer from ``groups()`` of another one (ids may be renamed).

        Raises ValueError if the groups cannot come from this packer's configuration.
        """

    @property
    @abstractmethod
    def pending(self) -> int:
        """Pieces held in open groups."""

    def _check_length(self, length: int) -> None:
        if not 0 < length <= self.seq_len:
            raise ValueError(f"piece length {length} outside (0, {self.seq_len}]")

    def _check_row(self, group: Group) -> int:
        """Validate one restored open row; return the tokens it uses."""
        if not group:
            raise ValueError("an open row is empty")
        if len(group) >= self.max_items:
            raise ValueError(f"an open row holds {len(group)} pieces, at most {self.max_items - 1} stay open")
        used = 0
        for _, length in group:
            self._check_length(length)
            used += length
        if used >= self.seq_len:
            raise ValueError(f"an open row uses {used} tokens, an open row has fewer than {self.seq_len}")
        return used


class NextFit(Packer):
    """``greedy``: one open row; a piece that does not fit closes it and opens the next."""

    def __init__(self, seq_len: int, max_items: int | None = None) -> None:
        super().__init__(seq_len, max_items)
        self._row: Row = []
        self._used = 0

    def add(self, item: int, length: int) -> list[Row]:
        self._check_length(length)
        closed: list[Row] = []
        if self._row and self._used + length > self.seq_len:
            closed.append(self._row)
            self._row, self._used = [], 0
        self._row.append(item)
        self._used += length
        if self._used == self.seq_len or len(self._row) == self.max_items:
            closed.append(self._row)
            self._row, self._used = [], 0
        return closed

    def flush(self) -> list[Row]:
        rows = [self._row] if self._row else []
        self._row, self._used = [], 0
        return rows

    def groups(self) -> list[Row]:
        return [self._row] if self._row else []

    def restore(self, groups: Sequence[Group]) -> None:
        if len(groups) > 1:
            raise ValueError(f"greedy keeps one open row, the state has {len(groups)}")
        self._row, self._used = [], 0
        for group in groups:
            self._used = self._check_row(group)
            self._row = [item for item, _ in group]

    @property
    def pending(self) -> int:
        return len(self._row)


class FirstFit(Packer):
    """``first_fit``: a piece goes to the oldest open row with room; when the open rows hold
    more than ``buffer_size`` pieces, the oldest open row is closed. Full rows close at once.

    Open rows sit in slots numbered in opening order; a max-segment-tree over the slots'
    remaining capacities finds the leftmost slot with room in O(log buffer_size). Slots are
    renumbered (order kept) when they run out, which amortises to O(1) per row. Open groups
    are the open rows, oldest first.
    """

    def __init__(self, seq_len: int, buffer_size: int, max_items: int | None = None) -> None:
        super().__init__(seq_len, max_items)
        self.buffer_size = _check_buffer(buffer_size)
        size = 1
        while size < 2 * (buffer_size + 1):  # open rows never exceed buffer_size + 1
            size *= 2
        self._size = size
        self._clear()

    def _clear(self) -> None:
        self._tree = [-1] * (2 * self._size)  # -1: an empty slot fits nothing
        self._rows: OrderedDict[int, tuple[Row, int]] = OrderedDict()  # slot -> (items, capacity)
        self._next_slot = 0
        self._pending = 0

    @property
    def pending(self) -> int:
        return self._pending

    def restore(self, groups: Sequence[Group]) -> None:
        self._clear()
        pieces = sum(len(group) for group in groups)
        if pieces > self.buffer_size:
            raise ValueError(f"open rows hold {pieces} pieces, more than buffer_size={self.buffer_size}")
        for group in groups:
            used = self._check_row(group)
            self._open([item for item, _ in group], self.seq_len - used)
        self._pending = pieces

    def _set(self, slot: int, capacity: int) -> None:
        tree = self._tree
        node = slot + self._size
        tree[node] = capacity
        node >>= 1
        while node:
            left, right = tree[2 * node], tree[2 * node + 1]
            best = left if left > right else right
            if tree[node] == best:
                break
            tree[node] = best
            node >>= 1

    def _leftmost(self, length: int) -> int:
        """The smallest open slot whose capacity is at least ``length``, or -1."""
        tree = self._tree
        if tree[1] < length:
            return -1
        node = 1
        size = self._size
        while node < size:
            node = 2 * node if tree[2 * node] >= length else 2 * node + 1
        return node - size

    def _open(self, items: Row, capacity: int) -> None:
        if self._next_slot == self._size:
            self._renumber()
        slot = self._next_slot
        self._next_slot += 1
        self._rows[slot] = (items, capacity)
        self._set(slot, capacity)

    def _renumber(self) -> None:
        rows = list(self._rows.values())
        self._tree = [-1] * (2 * self._size)
        self._rows = OrderedDict()
        self._next_slot = 0
        for items, capacity in rows:
            slot = self._next_slot
            self._next_slot += 1
            self._rows[slot] = (items, capacity)
            self._tree[slot + self._size] = capacity
        tree = self._tree
        for node in range(self._size - 1, 0, -1):
            tree[node] = max(tree[2 * node], tree[2 * node + 1])

    def _close(self, slot: int) -> Row:
        items, _ = self._rows.pop(slot)
        self._set(slot, -1)
        self._pending -= len(items)
        return items

    def add(self, item: int, length: int) -> list[Row]:
        self._check_length(length)
        self._pending += 1
        slot = self._leftmost(length)
        if slot < 0:
            if length == self.seq_len or self.max_items == 1:
                self._pending -= 1
                return [[item]]
            self._open([item], self.seq_len - length)
        else:
            items, capacity = self._rows[slot]
            items.append(item)
            capacity -= length
            if capacity == 0 or len(items) == self.max_items:
                return [self._close(slot)]
            self._rows[slot] = (items, capacity)
            self._set(slot, capacity)
        if self._pending > self.buffer_size:
            return [self._close(next(iter(self._rows)))]
        return []

    def flush(self) -> list[Row]:
        rows = [items for items, _ in self._rows.values()]
        self._clear()
        return rows

    def groups(self) -> list[Row]:
        return [items for items, _ in self._rows.values()]


class BestFit(Packer):
    """``best_fit``: documents wait in a buffer of ``buffer_size`` pieces; when it overflows, the
    buffer is planned by best-fit-decreasing (longest piece first, each into the fullest row it
    fits), and the best rows of the plan are emitted while the rest wait for more documents.

    A round emits every planned row holding a piece that already waited ``MAX_ROUNDS`` rounds
    (so no document waits more than ``MAX_ROUNDS + 1`` rounds, about ``3 * buffer_size``
    documents), then the fullest remaining rows until at least half of the buffer is free.
    Placing pieces in arrival order instead (classic online best fit) cannot use the buffer:
    closing the fullest open row never forces a new row open, so it packs no better than with
    unbounded open rows (about 97% on chat-like lengths at 2048, against 99% here).

    Open groups are the buffered pieces by rounds waited, most first; within and across groups,
    arrival order.
    """

    def __init__(self, seq_len: int, buffer_size: int, max_items: int | None = None) -> None:
        super().__init__(seq_len, max_items)
        self.buffer_size = _check_buffer(buffer_size)
        self._clear()

    def _clear(self) -> None:
        self._items: list[int] = []
        self._lengths: list[int] = []
        self._rounds: list[int] = []

    def add(self, item: int, length: int) -> list[Row]:
        self._check_length(length)
        if length == self.seq_len or self.max_items == 1:
            return [[item]]
        self._items.append(item)
        self._lengths.append(length)
        self._rounds.append(0)
        return self._round() if len(self._items) > self.buffer_size else []

    def _round(self) -> list[Row]:
        """Plan the buffer, emit the rows due or fullest, keep the other pieces waiting."""
        lengths, rounds = self._lengths, self._rounds
        plan = best_fit_decreasing(np.array(lengths, dtype=np.int64), self.seq_len, self.max_items)
        # Rows are ordered by their oldest piece and rounds never grow with arrival order,
        # so a row's first piece is its longest-waiting one.
        chosen = [rounds[row[0]] >= MAX_ROUNDS for row in plan]
        freed = sum(len(row) for row, due in zip(plan, chosen) if due)
        wanted = (len(lengths) + 1) // 2
        if freed < wanted:
            fills = [sum(lengths[i] for i in row) for row in plan]
            for r in sorted((r for r in range(len(plan)) if not chosen[r]), key=lambda r: -fills[r]):
                chosen[r] = True
                freed += len(plan[r])
                if freed >= wanted:
                    break
        items = self._items
        left = [True] * len(items)
        rows: list[Row] = []
        for row, due in zip(plan, chosen):
            if due:
                rows.append([items[i] for i in row])
                for i in row:
                    left[i] = False
        keep = [i for i, stays in enumerate(left) if stays]
        self._items = [items[i] for i in keep]
        self._lengths = [lengths[i] for i in keep]
        self._rounds = [rounds[i] + 1 for i in keep]
        return rows

    def flush(self) -> list[Row]:
        plan = best_fit_decreasing(np.array(self._lengths, dtype=np.int64), self.seq_len, self.max_items)
        items = self._items
        self._clear()
        return [[items[i] for i in row] for row in plan]

    def groups(self) -> list[Row]:
        if not self._items:
            return []
        groups: list[Row] = [[] for _ in range(MAX_ROUNDS + 1)]
        for item, waited in zip(self._items, self._rounds):
            groups[MAX_ROUNDS - waited].append(item)
        return groups

    def restore(self, groups: Sequence[Group]) -> None:
        self._clear()
        if not groups:
            return
        if len(groups) != MAX_ROUNDS + 1:
            raise ValueError(f"best_fit keeps {MAX_ROUNDS + 1} groups of waiting pieces, the state has {len(groups)}")
        pieces = sum(len(group) for group in groups)
        if not 0 < pieces <= self.buffer_size:
            raise ValueError(f"the buffer holds {pieces} pieces, expected 1 to buffer_size={self.buffer_size}")
        for index, group in enumerate(groups):
            for item, length in group:
                if length == self.seq_len:
                    raise ValueError(f"a full piece of {length} tokens never waits in the buffer")
                self._check_length(length)
                self._items.append(item)
                self._lengths.append(length)
                self._rounds.append(MAX_ROUNDS - index)

    @property
    def pending(self) -> int:
        return len(self._items)


class WindowBFD(Packer):
    """``bfd`` over a stream: collect ``buffer_size`` pieces, pack the window with
    ``best_fit_decreasing`` and close all its rows at once."""

    def __init__(self, seq_len: int, buffer_size: int, max_items: int | None = None) -> None:
        super().__init__(seq_len, max_items)
        self.buffer_size = _check_buffer(buffer_size)
        self._items: list[int] = []
        self._lengths: list[int] = []

    def add(self, item: int, length: int) -> list[Row]:
        self._check_length(length)
        self._items.append(item)
        self._lengths.append(length)
        return self.flush() if len(self._items) == self.buffer_size else []

    def flush(self) -> list[Row]:
        items = self._items
        rows = best_fit_decreasing(np.array(self._lengths, dtype=np.int64), self.seq_len, self.max_items)
        self._items, self._lengths = [], []
        return [[items[i] for i in row] for row in rows]

    def groups(self) -> list[Row]:
        return [self._items] if self._items else []

    def restore(self, groups: Sequence[Group]) -> None:
        if len(groups) > 1:
            raise ValueError(f"bfd keeps one window of pieces, the state has {len(groups)}")
        self._items, self._lengths = [], []
        for group in groups:
            if not 0 < len(group) < self.buffer_size:
                raise ValueError(f"a window holds {len(group)} pieces, expected 1 to {self.buffer_size - 1}")
            for item, length in group:
                self._check_length(length)
                self._items.append(item)
                self._lengths.append(length)

    @property
    def pending(self) -> int:
        return len(self._items)


def _check_buffer(buffer_size: int) -> int:
    if buffer_size <= 0:
        raise ValueError(f"buffer_size must be positive, got {buffer_size}")
    return buffer_size


def best_fit_decreasing(lengths: np.ndarray, seq_len: int, max_items: int | None = None) -> list[Row]:
    """Offline best-fit-decreasing: rows of indices into ``lengths`` (each in ``(0, seq_len]``).

    Pieces are placed longest first, each into the fullest row it fits in. Open rows sit in
    buckets by remaining capacity; a sorted list of the non-empty capacities finds the best
    bucket with one ``bisect``, so the cost is O(n log seq_len) whatever the number of rows.
    Rows come out ordered by their smallest index, so with a shuffled input the row order
    stays shuffled instead of running from long to short documents. Within a row, indices
    are ascending.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size and (lengths.min() <= 0 or lengths.max() > seq_len):
        raise ValueError(f"piece lengths must lie in (0, {seq_len}]")
    limit = max_items if max_items is not None else seq_len
    order = np.argsort(-lengths, kind="stable").tolist()
    sizes = lengths.tolist()
    rows: list[Row] = []
    buckets: dict[int, list[int]] = {}  # remaining capacity -> open rows with it
    capacities: list[int] = []  # sorted keys of ``buckets``
    for index in order:
        length = sizes[index]
        at = bisect_left(capacities, length)
        if at == len(capacities):
            row_id, capacity = len(rows), seq_len - length
            rows.append([index])
        else:
            capacity = capacities[at]
            bucket = buckets[capacity]
            row_id = bucket.pop()
            if not bucket:
                del buckets[capacity]
                del capacities[at]
            rows[row_id].append(index)
            capacity -= length
        if capacity and len(rows[row_id]) < limit:
            if capacity in buckets:
                buckets[capacity].append(row_id)
            else:
                buckets[capacity] = [row_id]
                insort(capacities, capacity)
    for row in rows:
        row.sort()
    rows.sort(key=lambda row: row[0])
    return rows


def make_packer(strategy: str, seq_len: int, buffer_size: int, max_items: int | None = None) -> Packer:
    """The streaming packer for ``strategy`` (``bfd`` here means a window of ``buffer_size``)."""
    if strategy == "greedy":
        return NextFit(seq_len, max_items)
    if strategy == "first_fit":
        return FirstFit(seq_len, buffer_size, max_items)
    if strategy == "best_fit":
        return BestFit(seq_len, buffer_size, max_items)
    if strategy == "bfd":
        return WindowBFD(seq_len, buffer_size, max_items)
    raise ValueError(f"unknown strategy {strategy!r}, expected one of {', '.join(STRATEGIES)}")
