"""Bin packing on plain ints: which pieces of token sequences share a row of ``seq_len`` tokens.

Nothing here knows about nodes, records or tokens. A piece is an opaque int id with a length;
a row is the list of ids placed in it, in placement order. The streaming packers keep a bounded
set of open rows (or, for ``WindowBFD``, a window of pieces) and say which rows are closed by
each ``add``; the node turns those ids back into token slices.

A long document's whole rows need no packing, but if they left at once they would run ahead of
the pieces that came with them, which wait for their rows to fill: the first rows of an epoch
would hold long documents only. So the buffered packers hold them too (``add_whole``: one item
for all of a document's whole rows) and let them leave in step with the pieces: when closed
rows take a share of the piece tokens held, about the same share of the whole rows held leaves
with them, oldest first, spread evenly among them. Over any stretch of rows, long and short
documents then keep their shares of the stream, and the pieces' rows are exactly those of a
packer without whole rows, so the packing efficiency is unchanged.

Every decision of a streaming packer is a function of its open groups (in canonical order) and
the incoming lengths, so ``groups()`` followed by ``restore()`` on a fresh packer reproduces the
same future exactly: this is what makes the packer's checkpoint a list of references.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from bisect import bisect_left, insort
from collections import OrderedDict, deque
from itertools import chain
from typing import NamedTuple, Sequence

import numpy as np

Row = list[int]
"""Ids of the pieces in one output row, in placement order; ``[item]`` for whole rows from
``add_whole`` stands for all of that item's rows, one after the other."""

Group = Sequence[tuple[int, int]]
"""``(id, length)`` pairs of one open group, as passed to ``restore``."""

STRATEGIES = ("greedy", "first_fit", "best_fit", "bfd")

# first_fit: the slots its tree starts with (it doubles as open rows need more).
FIRST_FIT_SLOTS = 64
# best_fit: a buffered piece that has waited this many planning rounds leaves at the next one.
MAX_ROUNDS = 4
# The whole-row items that left are dropped from the front of their list once they are this
# many and at least half of it (so the list is copied in amortised O(1) per item).
WHOLE_COMPACT = 64


class StateOrder(NamedTuple):
    """The items of ``groups()`` back to back, as a state saves them: the pieces' items, the
    whole rows' items (``whole[whole_from:]``), and the size of each group. The two lists may
    be the packer's own: read, never modify; while either is the same object as at an earlier
    call, it has only grown at its end since (so a caller may keep what it derived from the
    items it saw), and ``whole_from`` only grown."""

    pieces: list[int]
    whole: list[int]
    whole_from: int
    sizes: list[int]


class Packer(ABC):
    """A streaming packer: pieces go in one at a time, closed rows come out.

    ``max_items`` bounds the pieces per row (a row holding that many is closed as if full).
    ``max_whole`` bounds the whole-row items held (see the module docstring); with 0, or while
    no piece is held, whole rows leave at once.

    Subclasses place pieces (``_place``, ``_flush``, ``_piece_groups``, ``_restore``) and keep
    ``_tokens``, the tokens of the pieces they hold; this class holds the whole rows. A packer
    that may hold whole rows ends ``groups()`` with one group of them (oldest first), even
    empty. Groups without it were saved before whole rows waited: the restored packer then
    lets them leave at once, so an old checkpoint continues as it would have.
    """

    def __init__(self, seq_len: int, max_items: int | None = None, max_whole: int = 0) -> None:
        if seq_len <= 0:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        if max_items is not None and max_items <= 0:
            raise ValueError(f"max_items must be positive, got {max_items}")
        self.seq_len = seq_len
        self.max_items = max_items if max_items is not None else seq_len
        self.max_whole = max_whole
        self._whole_limit = max_whole  # 0 after restoring groups saved without whole rows
        self._whole: deque[tuple[int, int]] = deque()  # (id, rows), oldest first
        self._whole_rows = 0
        self._whole_items: list[int] = []  # the ids of ``_whole`` from ``_whole_from`` on (``state_order``)
        self._whole_from = 0
        self._tokens = 0

    def add(self, item: int, length: int) -> list[Row]:
        """Place a piece of ``0 < length <= seq_len``; return the rows this closed, in order."""
        self._check_length(length)
        held = self._tokens + length
        rows = self._place(item, length)
        return self._with_whole(rows, held - self._tokens, held) if self._whole else rows

    def add_whole(self, item: int, rows: int) -> list[Row]:
        """Hold ``rows > 0`` whole rows as one item; return the rows this released, in order."""
        if rows <= 0:
            raise ValueError(f"whole rows must be a positive count, got {rows}")
        if not self._tokens or not self._whole_limit:
            return [[item]]
        self._whole.append((item, rows))
        self._whole_items.append(item)
        self._whole_rows += rows
        if len(self._whole) > self._whole_limit:
            return [[self._pop_whole()[0]]]
        return []

    def flush(self) -> list[Row]:
        """Close every open row (end of the stream), in a canonical order; leave the packer empty."""
        rows = self._flush()
        return _interleave(rows, [self._pop_whole() for _ in range(len(self._whole))])

    def groups(self) -> list[Row]:
        """The open groups, in the canonical order that ``restore`` expects.

        The lists may be the packer's own (``get_state`` calls this often): read, never modify.
        """
        groups = self._piece_groups()
        return [*groups, [item for item, _ in self._whole]] if self._whole_limit else groups

    def state_order(self) -> StateOrder:
        """What a state saves of ``groups()``, built without a list per group or per whole-row
        item (``get_state`` calls this with every batch)."""
        items, sizes = self._piece_order()
        if not self._whole_limit:
            return StateOrder(items, [], 0, sizes)
        return StateOrder(items, self._whole_items, self._whole_from, [*sizes, len(self._whole)])

    def _piece_order(self) -> tuple[list[int], list[int]]:
        """The items of ``_piece_groups()`` back to back, and the size of each group."""
        groups = self._piece_groups()
        return list(chain.from_iterable(groups)), [len(group) for group in groups]

    def restore(self, groups: Sequence[Group]) -> None:
        """Rebuild an empty packer from ``groups()`` of another one (ids may be renamed).

        Raises ValueError if the groups cannot come from this packer's configuration.
        """
        whole: Group | None = None
        if self.max_whole and self._ends_with_whole(groups):
            groups, whole = groups[:-1], groups[-1]
        self._restore(groups)
        self._whole_limit = self.max_whole if whole is not None else 0
        self._whole.clear()
        self._whole_rows = 0
        for item, length in whole or ():
            if length <= 0 or length % self.seq_len:
                raise ValueError(f"whole rows of {length} tokens are not a multiple of seq_len={self.seq_len}")
            self._whole.append((item, length // self.seq_len))
            self._whole_rows += length // self.seq_len
        self._whole_items, self._whole_from = [item for item, _ in self._whole], 0
        if len(self._whole) > self.max_whole:
            raise ValueError(f"{len(self._whole)} whole-row items wait, at most {self.max_whole} do")
        if self._whole and not self._tokens:
            raise ValueError("whole rows wait only beside pieces, and no piece is held")

    @property
    @abstractmethod
    def pending(self) -> int:
        """Pieces held in open groups."""

    @abstractmethod
    def _place(self, item: int, length: int) -> list[Row]:
        """Place a piece (``add`` checked it); return the rows this closed, in order."""

    @abstractmethod
    def _flush(self) -> list[Row]:
        """Close every open row of pieces, in a canonical order."""

    @abstractmethod
    def _piece_groups(self) -> list[Row]:
        """The groups of pieces, in canonical order."""

    @abstractmethod
    def _restore(self, groups: Sequence[Group]) -> None:
        """Rebuild the pieces from ``_piece_groups()`` of another packer, and ``_tokens``."""

    def _ends_with_whole(self, groups: Sequence[Group]) -> bool:
        """Whether the last group holds whole rows: empty, or of lengths no piece group holds."""
        return bool(groups) and (not groups[-1] or groups[-1][0][1] >= self.seq_len)

    def _with_whole(self, rows: list[Row], closed: int, held: int) -> list[Row]:
        """``rows``, which took ``closed`` of the ``held`` piece tokens, with the oldest whole
        rows due: the same share, ``whole rows * closed / held``. That share is rarely a whole
        number of items, and always rounding one way would drift; so the oldest item leaves
        when what is due covers a pseudo-random fraction of it, drawn from the held counts:
        right on average, and a function of the held groups like every other decision."""
        if not closed:
            return rows
        due = self._whole_rows * closed  # rows due, times ``held``
        whole = self._whole
        released: list[tuple[int, int]] = []
        while whole and due << 32 >= _threshold(self._whole_rows, self._tokens, due) * whole[0][1] * held:
            released.append(self._pop_whole())
            due -= released[-1][1] * held
        return _interleave(rows, released)

    def _pop_whole(self) -> tuple[int, int]:
        """The oldest whole-row item and its rows, no longer held."""
        item, rows = self._whole.popleft()
        self._whole_rows -= rows
        self._whole_from += 1
        if self._whole_from >= WHOLE_COMPACT and 2 * self._whole_from >= len(self._whole_items):
            self._whole_items, self._whole_from = self._whole_items[self._whole_from :], 0
        return item, rows

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
    """``greedy``: one open row; a piece that does not fit closes it and opens the next. Its
    pieces wait for one row at most, so whole rows leave at once."""

    def __init__(self, seq_len: int, max_items: int | None = None) -> None:
        super().__init__(seq_len, max_items)
        self._row: Row = []

    def _place(self, item: int, length: int) -> list[Row]:
        closed: list[Row] = []
        if self._row and self._tokens + length > self.seq_len:
            closed.append(self._row)
            self._row, self._tokens = [], 0
        self._row.append(item)
        self._tokens += length
        if self._tokens == self.seq_len or len(self._row) == self.max_items:
            closed.append(self._row)
            self._row, self._tokens = [], 0
        return closed

    def _flush(self) -> list[Row]:
        rows = [self._row] if self._row else []
        self._row, self._tokens = [], 0
        return rows

    def _piece_groups(self) -> list[Row]:
        return [self._row] if self._row else []

    def _restore(self, groups: Sequence[Group]) -> None:
        if len(groups) > 1:
            raise ValueError(f"greedy keeps one open row, the state has {len(groups)}")
        self._row, self._tokens = [], 0
        for group in groups:
            self._tokens = self._check_row(group)
            self._row = [item for item, _ in group]

    @property
    def pending(self) -> int:
        return len(self._row)


class FirstFit(Packer):
    """``first_fit``: a piece goes to the oldest open row with room; when the open rows hold
    more than ``buffer_size`` pieces, the oldest open row is closed. Full rows close at once.

    Open rows sit in slots numbered in opening order; a max-segment-tree over the slots'
    remaining capacities finds the leftmost slot with room in O(log open rows). Slots are
    renumbered (order kept) when they run out, the tree doubling when the open rows fill half
    of it, which amortises to O(1) per row: the tree grows with the rows actually open, not
    with ``buffer_size`` (a bound, which may be huge). Open groups are the open rows, oldest
    first.
    """

    def __init__(self, seq_len: int, buffer_size: int, max_items: int | None = None) -> None:
        super().__init__(seq_len, max_items, _check_buffer(buffer_size))
        self.buffer_size = buffer_size
        self._clear()

    def _clear(self) -> None:
        self._size = FIRST_FIT_SLOTS
        self._tree = [-1] * (2 * self._size)  # -1: an empty slot fits nothing
        self._rows: OrderedDict[int, tuple[Row, int]] = OrderedDict()  # slot -> (items, capacity)
        self._next_slot = 0
        self._pending = 0
        self._tokens = 0

    @property
    def pending(self) -> int:
        return self._pending

    def _restore(self, groups: Sequence[Group]) -> None:
        self._clear()
        pieces = sum(len(group) for group in groups)
        if pieces > self.buffer_size:
            raise ValueError(f"open rows hold {pieces} pieces, more than buffer_size={self.buffer_size}")
        for group in groups:
            used = self._check_row(group)
            self._open([item for item, _ in group], self.seq_len - used)
            self._tokens += used
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
        if 2 * len(rows) > self._size:
            self._size *= 2
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
        items, capacity = self._rows.pop(slot)
        self._set(slot, -1)
        self._pending -= len(items)
        self._tokens -= self.seq_len - capacity
        return items

    def _place(self, item: int, length: int) -> list[Row]:
        slot = self._leftmost(length)
        if slot < 0 and (length == self.seq_len or self.max_items == 1):
            return [[item]]
        self._pending += 1
        self._tokens += length
        if slot < 0:
            self._open([item], self.seq_len - length)
        else:
            items, capacity = self._rows[slot]
            items.append(item)
            capacity -= length
            self._rows[slot] = (items, capacity)
            if capacity == 0 or len(items) == self.max_items:
                return [self._close(slot)]
            self._set(slot, capacity)
        if self._pending > self.buffer_size:
            return [self._close(next(iter(self._rows)))]
        return []

    def _flush(self) -> list[Row]:
        rows = [items for items, _ in self._rows.values()]
        self._clear()
        return rows

    def _piece_groups(self) -> list[Row]:
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

    Open groups are the buffered pieces by rounds waited, most first (``MAX_ROUNDS + 1``
    groups, some maybe empty; none when no piece waits); within and across groups, arrival order.
    """

    def __init__(self, seq_len: int, buffer_size: int, max_items: int | None = None) -> None:
        super().__init__(seq_len, max_items, _check_buffer(buffer_size))
        self.buffer_size = buffer_size
        self._clear()

    def _clear(self) -> None:
        self._items: list[int] = []
        self._lengths: list[int] = []
        self._rounds: list[int] = []
        # Pieces that waited MAX_ROUNDS, ..., 1 rounds: the first groups, set by each round;
        # the pieces after them in ``_items`` arrived since and wait in the last group.
        self._settled: list[int] = [0] * MAX_ROUNDS
        self._tokens = 0

    def _place(self, item: int, length: int) -> list[Row]:
        if length == self.seq_len or self.max_items == 1:
            return [[item]]
        self._items.append(item)
        self._lengths.append(length)
        self._rounds.append(0)
        self._tokens += length
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
        self._settled = [self._rounds.count(MAX_ROUNDS - index) for index in range(MAX_ROUNDS)]
        self._tokens = sum(self._lengths)
        return rows

    def _flush(self) -> list[Row]:
        plan = best_fit_decreasing(np.array(self._lengths, dtype=np.int64), self.seq_len, self.max_items)
        items = self._items
        self._clear()
        return [[items[i] for i in row] for row in plan]

    def _piece_groups(self) -> list[Row]:
        items, sizes = self._piece_order()
        groups, start = [], 0
        for size in sizes:
            groups.append(items[start : start + size])
            start += size
        return groups

    def _piece_order(self) -> tuple[list[int], list[int]]:
        """``_items`` as they are: rounds waited never grow with arrival order, so the groups
        (most rounds first, arrival order within) are consecutive runs of it. Between rounds
        the list only grows; a round, a flush and a restore replace it."""
        items = self._items
        if not items:
            return [], []
        return items, [*self._settled, len(items) - sum(self._settled)]

    def _ends_with_whole(self, groups: Sequence[Group]) -> bool:
        return len(groups) in (1, MAX_ROUNDS + 2)

    def _restore(self, groups: Sequence[Group]) -> None:
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
        self._settled = [len(group) for group in groups[:MAX_ROUNDS]]
        self._tokens = sum(self._lengths)

    @property
    def pending(self) -> int:
        return len(self._items)


class WindowBFD(Packer):
    """``bfd`` over a stream: collect ``buffer_size`` pieces, pack the window with
    ``best_fit_decreasing`` and close all its rows at once. The open group is the window
    (maybe empty)."""

    def __init__(self, seq_len: int, buffer_size: int, max_items: int | None = None) -> None:
        super().__init__(seq_len, max_items, _check_buffer(buffer_size))
        self.buffer_size = buffer_size
        self._items: list[int] = []
        self._lengths: list[int] = []

    def _place(self, item: int, length: int) -> list[Row]:
        self._items.append(item)
        self._lengths.append(length)
        self._tokens += length
        return self._flush() if len(self._items) == self.buffer_size else []

    def _flush(self) -> list[Row]:
        items = self._items
        rows = best_fit_decreasing(np.array(self._lengths, dtype=np.int64), self.seq_len, self.max_items)
        self._items, self._lengths, self._tokens = [], [], 0
        return [[items[i] for i in row] for row in rows]

    def _piece_groups(self) -> list[Row]:
        return [self._items]

    def _ends_with_whole(self, groups: Sequence[Group]) -> bool:
        return len(groups) == 2

    def _restore(self, groups: Sequence[Group]) -> None:
        if len(groups) > 1:
            raise ValueError(f"bfd keeps one window of pieces, the state has {len(groups)}")
        self._items, self._lengths = [], []
        for group in groups:
            if len(group) >= self.buffer_size:
                raise ValueError(f"a window holds {len(group)} pieces, at most {self.buffer_size - 1} wait")
            for item, length in group:
                self._check_length(length)
                self._items.append(item)
                self._lengths.append(length)
        self._tokens = sum(self._lengths)

    @property
    def pending(self) -> int:
        return len(self._items)


def _threshold(*values: int) -> int:
    """A pseudo-random int in ``[0, 2**32)`` from ``values`` (splitmix64 steps): the same
    values always draw the same, so a restored packer decides as the original did."""
    mixed = 0x9E3779B97F4A7C15
    for value in values:
        mixed = ((mixed ^ value) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        mixed = ((mixed ^ mixed >> 31) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return mixed >> 32


def _interleave(rows: list[Row], whole: list[tuple[int, int]]) -> list[Row]:
    """``rows`` with the whole-row items ``(id, rows)`` spread evenly among them, each where its
    middle row falls, so that no stretch of the output holds only whole rows."""
    if not whole:
        return rows
    total = sum(count for _, count in whole)
    merged: list[Row] = []
    at, done = 0, 0
    for item, count in whole:
        # the item's middle lies at (done + count / 2) / total; row ``at``'s at (at + 1 / 2) / len(rows)
        while at < len(rows) and (2 * at + 1) * total <= (2 * done + count) * len(rows):
            merged.append(rows[at])
            at += 1
        merged.append([item])
        done += count
    merged.extend(rows[at:])
    return merged


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
