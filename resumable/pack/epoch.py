"""Whole-epoch plans (``strategy="bfd"`` without ``buffer_size``) and what a rescale hands over.

A plan packs every document of one consumer's epoch ahead, into numpy arrays. It is a pure
function of the epoch and of the consumer's stride, so an elastic rescale can plan any old
consumer's epoch again from that consumer's state alone (``Stride``). The rows the old
consumers had not handed out are dealt out whole, as piece references, over the new
consumers (``share``): each new consumer hands out its ``InheritedRows`` before it plans what no old
consumer had planned.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from itertools import chain
from typing import Any, NamedTuple

import numpy as np

from resumable.core.indexed import EPOCH, LENGTH, IndexedNode
from resumable.core.state import UPSTREAM, check_header, is_count, require, require_count, require_epoch, short_repr
from resumable.elastic import _shard_and_orders
from resumable.errors import StateError
from resumable.order.elastic import MAX_POSITION, Remap
from resumable.order.orders import Order, take
from resumable.order.partition import shard_size, shard_to_global
from resumable.order.shard import NEXT_REMAP, REMAP
from resumable.pack.strategies import best_fit_decreasing

REF_FIELDS = 4
"""An inherited piece is ``[epoch, record, token_start, token_end]``: the upstream is indexed, so no
mix component names come before the key."""

LONGEST_PIECE = "longest_piece"
"""Rows in the upstream's order of their longest piece (the earliest of equals), the one that
opened the row in best-fit-decreasing: what fills a row is drawn from the whole epoch and does
not move it, so every stretch of rows keeps the epoch's share of long and short documents."""
FIRST_PIECE = "first_piece"
"""Rows in the upstream's order of their first piece: the order of plans made before
``LONGEST_PIECE``. Rows holding many small pieces have an early one, so the first rows of an
epoch held too many short documents."""
ROW_ORDERS = (LONGEST_PIECE, FIRST_PIECE)


class Plan(NamedTuple):
    """A whole epoch packed ahead, in numpy arrays (about 40 bytes per piece).

    Piece ``i`` is tokens ``[starts[i], ends[i])`` of leaf record ``records[i]``; row ``r``
    holds pieces ``order[bounds[r]:bounds[r + 1]]``.
    """

    records: np.ndarray
    starts: np.ndarray
    ends: np.ndarray
    order: np.ndarray
    bounds: np.ndarray
    counts: dict[str, int]

    @classmethod
    def pack(
        cls, documents: np.ndarray, seq_len: int, max_pieces: int | None, counts: dict[str, int], row_order: str
    ) -> Plan:
        """Pack ``documents`` (rows of ``(record index, full, end, extra)`` in the upstream's
        order: tokens ``[0, full)`` make whole rows, ``[full, end)`` one piece, which takes
        ``extra`` reserved positions more; a document with any is one piece) by
        best-fit-decreasing; rows come in ``row_order`` (``ROW_ORDERS``), pieces in a row in
        the upstream's order."""
        # A document gives full // seq_len whole rows, then its tail if any: piece r starts at r * seq_len.
        pieces = documents[:, 1] // seq_len + (documents[:, 2] > documents[:, 1])
        first = np.repeat(np.cumsum(pieces) - pieces, pieces)
        starts = (np.arange(int(pieces.sum()), dtype=np.int64) - first) * seq_len
        ends = np.minimum(starts + seq_len, np.repeat(documents[:, 2], pieces))
        indices = np.repeat(documents[:, 0], pieces)

        lengths = ends - starts + np.repeat(documents[:, 3], pieces)  # what each piece costs in its row
        packed = np.flatnonzero(lengths < seq_len)
        packed_rows = best_fit_decreasing(lengths[packed], seq_len, max_pieces)
        order = np.concatenate(
            [
                np.flatnonzero(lengths == seq_len),  # whole rows, one piece each
                packed[np.fromiter(chain.from_iterable(packed_rows), dtype=np.int64, count=len(packed))],
            ]
        )
        sizes = np.concatenate(
            [np.ones(len(order) - len(packed), dtype=np.int64), np.fromiter(map(len, packed_rows), dtype=np.int64)]
        )
        bounds = _bounds(sizes)
        rank = np.argsort(_row_keys(order, bounds, lengths, row_order), kind="stable")
        sizes = sizes[rank]
        ordered = _bounds(sizes)
        # piece j of the new order is piece j - ordered[row] + bounds[rank[row]] of the old one
        order = order[np.arange(len(order)) + np.repeat(bounds[:-1][rank] - ordered[:-1], sizes)]
        return cls(indices, starts, ends, order, ordered, counts)

    @property
    def rows(self) -> int:
        return len(self.bounds) - 1

    def row(self, index: int) -> list[int]:
        """The pieces of row ``index``."""
        pieces: list[int] = self.order[self.bounds[index] : self.bounds[index + 1]].tolist()
        return pieces

    def references(self, epoch: int, start: int, stop: int) -> tuple[list[list[int]], list[int]]:
        """Rows ``[start, stop)`` as piece references of ``epoch``, flat, and pieces per row."""
        pieces = self.order[self.bounds[start] : self.bounds[stop]]
        refs = np.stack(
            [np.full(len(pieces), epoch, dtype=np.int64), self.records[pieces], self.starts[pieces], self.ends[pieces]],
            axis=1,
        )
        return refs.tolist(), np.diff(self.bounds[start : stop + 1]).tolist()


@dataclass(frozen=True)
class InheritedRows:
    """Whole rows handed over by old consumers in a rescale, kept by reference: ``refs`` holds
    every row's pieces back to back (the lists a state saves, shared with it), ``sizes`` the
    pieces of each row. Rows run in epoch order: those of the epoch being read come first,
    then (after a rescale across an epoch boundary) those of the next one."""

    refs: list[list[int]]
    sizes: list[int]
    bounds: list[int]  # offsets of each row's first piece in refs, and len(refs)
    epochs: list[int]  # of each row

    @classmethod
    def of(cls, refs: list[list[int]], sizes: list[int]) -> InheritedRows:
        bounds = _bounds(np.asarray(sizes, dtype=np.int64))
        starts = bounds[:-1].tolist()
        return cls(refs, sizes, bounds.tolist(), [refs[start][0] for start in starts])

    @classmethod
    def parse(cls, refs: Any, sizes: Any, path: str, seq_len: int, max_pieces: int) -> InheritedRows:
        """Saved rows, checked as far as the state alone can tell: references of ints, rows
        that fit ``seq_len`` and ``max_pieces``, each row's pieces of one epoch, rows in
        epoch order; StateError naming ``path`` otherwise."""
        if not isinstance(refs, list) or not isinstance(sizes, list):
            raise StateError(
                f"{path}: inherited rows {short_repr(refs)} cut by sizes {short_repr(sizes)}: expected two lists"
            )
        if any(not _is_count(size) or not 0 < size <= max_pieces for size in sizes):
            raise StateError(f"{path}: inherited row sizes {short_repr(sizes)} must be ints in [1, {max_pieces}]")
        if sum(sizes) != len(refs):
            raise StateError(f"{path}: inherited row sizes count {sum(sizes)} pieces, there are {len(refs)}")
        for ref in refs:
            if not (isinstance(ref, list) and len(ref) == REF_FIELDS and all(map(_is_count, ref)) and ref[2] < ref[3]):
                raise StateError(
                    f"{path}: inherited piece {short_repr(ref)} is not [epoch, record, token_start, token_end] "
                    "of ints >= 0 with token_start < token_end"
                )
        rows = cls.of(refs, sizes)
        for row, epoch in enumerate(rows.epochs):
            pieces = refs[rows.bounds[row] : rows.bounds[row + 1]]
            if any(piece[0] != epoch for piece in pieces) or sum(piece[3] - piece[2] for piece in pieces) > seq_len:
                raise StateError(
                    f"{path}: inherited row {short_repr(pieces)} is not one epoch's row of seq_len={seq_len}"
                )
        if rows.epochs != sorted(rows.epochs):
            raise StateError(f"{path}: inherited rows are not in epoch order (epochs {short_repr(rows.epochs)})")
        return rows

    def __len__(self) -> int:
        return len(self.sizes)

    def count(self, epoch: int) -> int:
        """How many rows belong to ``epoch``."""
        return bisect_right(self.epochs, epoch) - bisect_left(self.epochs, epoch)

    def row(self, index: int) -> list[list[int]]:
        return self.refs[self.bounds[index] : self.bounds[index + 1]]

    def references(self, start: int, stop: int) -> tuple[list[list[int]], list[int]]:
        """Rows ``[start, stop)``: their pieces, flat, and pieces per row."""
        return self.refs[self.bounds[start] : self.bounds[stop]], self.sizes[start:stop]

    def of_epoch(self, epoch: int) -> InheritedRows:
        """The rows of ``epoch`` alone."""
        start = bisect_left(self.epochs, epoch)
        return InheritedRows.of(*self.references(start, start + self.count(epoch)))


NO_INHERITED_ROWS = InheritedRows([], [], [0], [])


def share(total: int, consumer: int, num_consumers: int) -> tuple[int, int]:
    """The contiguous block ``[start, stop)`` of ``total`` rows that ``consumer`` gets: blocks
    differ in size by at most one, and whole rows stay whole."""
    return total * consumer // num_consumers, total * (consumer + 1) // num_consumers


class Stride(NamedTuple):
    """The positions an old consumer's whole-epoch plan read, named from its state alone: its
    stride of the shard (through the shard's remap of that epoch, if a rescale left one),
    read in the order of the shuffles between the shard and the packer."""

    epoch: int
    length: int
    consumer: int
    num_consumers: int
    reading_orders: list[Order]
    remap: Remap | None
    parent: IndexedNode[Any]  # the shard's upstream

    @classmethod
    def of(
        cls, cursor: IndexedNode[Any], state: dict[str, Any], consumer: int, num_consumers: int, path: str
    ) -> Stride:
        """The stride of old consumer ``consumer`` of ``num_consumers``, whose packer's upstream
        ``cursor`` saved ``state``; StateError if the state's cursor disagrees with it."""
        epoch = require_epoch(state, EPOCH, path)
        length = require_count(state, LENGTH, path)
        shard, reading_orders = _shard_and_orders(cursor)
        node, where = cursor, path
        while node is not shard:  # the shard's state, along the serial maps and shuffles above it
            node = node._parent
            state = require(state, UPSTREAM, dict, where)
            where = f"{where} > {node.kind}"
            check_header(state, node.kind, where)
        parent = shard._parent
        remap = _remap_of(state, epoch, len(parent), where)
        size = shard_size(remap.length if remap is not None else len(parent), consumer, num_consumers)
        if size != length:
            raise StateError(f"{path}: the state's cursor runs over {length} positions, its stride has {size}")
        return cls(epoch, length, consumer, num_consumers, reading_orders, remap, parent)

    def leaves(self, path: str) -> np.ndarray:
        """The leaf indices of the stride, in the order the consumer read them."""
        positions = np.arange(self.length, dtype=np.int64)
        for order in self.reading_orders:
            positions = take(order, positions, self.length, self.epoch)
        positions = shard_to_global(positions, self.consumer, self.num_consumers)
        if self.remap is not None:
            try:
                positions = self.remap.to_base(positions)
            except IndexError as error:
                raise StateError(f"{path}: {error}") from error
        return self.parent._leaf_indices(positions, self.epoch)


def _remap_of(state: dict[str, Any], epoch: int, base_length: int, path: str) -> Remap | None:
    """The remap a shard's state holds for ``epoch``, if any."""
    for key in (REMAP, NEXT_REMAP):
        if key in state:
            remap = Remap.from_json(state[key], path, base_length=base_length)
            if remap.epoch == epoch:
                return remap
    return None


def _bounds(sizes: np.ndarray) -> np.ndarray:
    """Offsets of each row's first piece, and the total, for rows of ``sizes`` pieces."""
    bounds = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(sizes, out=bounds[1:])
    return bounds


def _row_keys(order: np.ndarray, bounds: np.ndarray, lengths: np.ndarray, row_order: str) -> np.ndarray:
    """One distinct key per row (``order[bounds[r]:bounds[r + 1]]``, ascending) that sorts the
    rows in ``row_order``: the index of its first piece, or of its longest (earliest of equals)."""
    if not len(order) or row_order == FIRST_PIECE:
        first: np.ndarray = order[bounds[:-1]]
        return first
    count = len(lengths)
    longest = np.maximum.reduceat(lengths[order] * count + (count - 1 - order), bounds[:-1])
    keys: np.ndarray = count - 1 - longest % count
    return keys


def _is_count(value: Any) -> bool:
    """An int in ``[0, MAX_POSITION]``, so references stay exact in int64 arrays."""
    return is_count(value, MAX_POSITION)
