"""A whole-epoch plan's rows (``strategy="bfd"`` without ``buffer_size``): the consumer's whole
epoch packed ahead when its first row is due, handed out row by row, and in a rescale the rows
old consumers had not handed out, planned again from their states and dealt out whole."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator, cast

import numpy as np

from resumable.core.indexed import EPOCH, MAX_CHUNK, POSITION, IndexedNode, read_ahead_failure
from resumable.core.keys import RecordKey
from resumable.core.state import ENDED, UPSTREAM, require, require_adjacent_epochs, require_count, short_repr
from resumable.errors import ResumableError, StateError
from resumable.pack._entries import (
    COUNTERS,
    DOCUMENT_COUNTERS,
    EMITTED,
    INHERITED,
    INHERITED_SIZES,
    PLANNED,
    STATS,
)
from resumable.pack._pieces import count_row, key_text
from resumable.pack.epoch import (
    FIRST_PIECE,
    LONGEST_PIECE,
    NO_INHERITED_ROWS,
    ROW_ORDERS,
    InheritedRows,
    Plan,
    Stride,
    share,
)
from resumable.pack.rows import Document, Segment

if TYPE_CHECKING:
    from resumable.pack._documents import Documents
    from resumable.pack.node import Pack

PLANNER = "Pack(strategy='bfd')"
"""How errors of a whole-epoch plan's reading name the packer."""
ROW_ORDER = "row_order"
"""State entry: the order of the plan's rows, one of ``ROW_ORDERS``. States saved before it
existed lack it and hold row indices of ``FIRST_PIECE`` plans, so they are planned that way again
until their epoch ends."""


class PlannedRows:
    """One epoch of a whole-epoch plan: the inherited rows of this epoch first (a rescale handed
    them over), then the rows of the consumer's own plan, made when its first row is due; and
    the epoch's counters. The epoch is the indexed upstream's, which is never iterated."""

    def __init__(
        self,
        upstream: IndexedNode[Any],
        documents: Documents,
        max_documents: int | None,
        counts: dict[str, int] | None = None,
        inherited: InheritedRows = NO_INHERITED_ROWS,
        plan: Plan | None = None,
        emitted: int = 0,
        row_order: str = LONGEST_PIECE,
    ) -> None:
        self._upstream = upstream
        self._documents = documents
        self._max_documents = max_documents
        self.row_order = row_order
        self.counts = dict.fromkeys(COUNTERS, 0) if counts is None else counts
        self._plan = plan
        self._emitted = emitted
        self.inherited = inherited
        self._inherited_now = inherited.count(self.epoch)  # the inherited rows of this epoch, the first ones
        self._cached: tuple[RecordKey, Document] | None = None

    @classmethod
    def fresh(
        cls,
        pack: Pack,
        inherited: InheritedRows = NO_INHERITED_ROWS,
        counts: dict[str, int] | None = None,
        plan: Plan | None = None,
        emitted: int = 0,
        row_order: str = LONGEST_PIECE,
    ) -> PlannedRows:
        """``pack``'s rows of the upstream's epoch: none handed out yet unless ``emitted``."""
        return cls(
            indexed_upstream(pack), pack._documents, pack.max_documents, counts, inherited, plan, emitted, row_order
        )

    @property
    def epoch(self) -> int:
        """The epoch this plan packs: the indexed upstream's."""
        return self._upstream.epoch

    def next_segments(self) -> list[Segment]:
        """The next row's segments, counted; StopIteration after the plan's last row."""
        epoch = self.epoch
        if self._emitted < self._inherited_now:
            pieces = self.inherited.row(self._emitted)
        else:
            plan, row = self._own_plan(), self._emitted - self._inherited_now
            if row == plan.rows:
                raise StopIteration
            pieces = [[epoch, int(plan.records[i]), int(plan.starts[i]), int(plan.ends[i])] for i in plan.row(row)]
        segments = [
            Segment(self._fetch_cached((key_epoch, record)), start, end) for key_epoch, record, start, end in pieces
        ]
        self._emitted += 1
        count_row(self.counts, segments, self._documents.seq_len)
        return segments

    def length(self) -> int:
        """Rows of this epoch: the inherited ones, then those of the consumer's own plan (made
        now if it was not yet)."""
        return self._inherited_now + self._own_plan().rows

    def _own_plan(self) -> Plan:
        """The consumer's own plan of the epoch, made (and its documents counted) when first asked for."""
        if self._plan is None:
            epoch = self.epoch
            records = self._own_records(epoch)
            self._plan = make_plan(self._documents, self._max_documents, epoch, records, self.row_order)
            self.counts.update(self._plan.counts)
        return self._plan

    def _own_records(self, epoch: int) -> Iterator[tuple[int, Any]]:
        """``(leaf index, record)`` of this consumer's epoch, read by random access."""
        upstream = self._upstream
        return upstream._scan(0, upstream._length(epoch), epoch, skip=True, failed=read_ahead_failure(PLANNER))

    def _fetch_cached(self, key: RecordKey) -> Document:
        """A record as a ``Document``; the last one is kept, as a long document's rows come in a row."""
        if self._cached is None or self._cached[0] != key:
            self._cached = (key, self._documents.read(self._upstream.fetch(key), key))
        return self._cached[1]

    def pending_keys(self) -> list[RecordKey]:
        """The documents of the rows not yet handed out, once each."""
        inherited = self.inherited
        first_left = inherited.bounds[min(self._emitted, self._inherited_now)]
        keys: list[RecordKey] = [(ref[0], ref[1]) for ref in inherited.refs[first_left:]]
        if self._plan is not None:
            plan, epoch = self._plan, self.epoch
            first = max(self._emitted - self._inherited_now, 0)
            keys.extend((epoch, index) for index in plan.records[plan.order[plan.bounds[first] :]].tolist())
        return list(dict.fromkeys(keys))

    def progress(self) -> dict[str, Any]:
        """Rows handed out, rows planned, and the inherited rows by reference."""
        progress: dict[str, Any] = {EMITTED: self._emitted, STATS: dict(self.counts), ROW_ORDER: self.row_order}
        if self._plan is not None:
            progress[PLANNED] = self._plan.rows
        if len(self.inherited):
            progress[INHERITED], progress[INHERITED_SIZES] = self.inherited.refs, self.inherited.sizes
        return progress

    @classmethod
    def restored(cls, pack: Pack, state: dict[str, Any], path: str, counts: dict[str, int]) -> PlannedRows:
        """Plan the saved epoch again (one pass over its records) if it was planned or rows of
        it were handed out, check the inherited rows still to hand out against their records, and
        skip the rows handed out."""
        fresh = cls.fresh(pack)
        epoch = fresh.epoch
        emitted = require_count(state, EMITTED, path)
        row_order = saved_row_order(state, path)
        inherited = saved_inherited(pack, state, epoch, path)
        now = inherited.count(epoch)
        planned = require_count(state, PLANNED, path) if PLANNED in state else None
        plan = None
        if planned is not None or emitted > now:
            try:
                plan = make_plan(pack._documents, pack.max_documents, epoch, fresh._own_records(epoch), row_order)
            except (IndexError, ResumableError) as exc:
                raise StateError(f"{path}: cannot plan epoch {epoch} again: {exc}") from exc
            check_plan_rows(plan.rows, planned, emitted - now, path)
            counts.update(plan.counts)
        check_inherited(pack, inherited, min(emitted, now), path)
        return cls.fresh(pack, inherited, counts, plan, emitted, row_order)

    @staticmethod
    def rescaled(
        pack: Pack, olds: list[dict[str, Any]], path: str, consumer: int, num_consumers: int
    ) -> dict[str, Any]:
        """A fresh epoch state holding this consumer's share of the rows the old consumers had
        not handed out: per epoch, the rows left by old consumer 0, then 1, ..., cut into
        contiguous blocks of whole rows. An old consumer's plan is made again only when this
        consumer's block holds rows of it, in its own row order; the new consumers plan in the
        old consumers' row order too, so old states rescale as they did."""
        leftovers = [Leftover(pack, old, index, len(olds), path) for index, old in enumerate(olds)]
        row_orders = {leftover.row_order for leftover in leftovers}
        if len(row_orders) > 1:
            raise StateError(
                f"{path}: old consumers' plans have different {ROW_ORDER}s {sorted(row_orders)}; "
                "they come from different checkpoints"
            )
        first = min(require_adjacent_epochs([leftover.upstream for leftover in leftovers], EPOCH, path))
        if any(leftover.last_epoch > first + 1 for leftover in leftovers):
            raise StateError(
                f"{path}: old consumers hold rows of epochs more than one apart; they come from different checkpoints"
            )
        refs: list[list[int]] = []
        sizes: list[int] = []
        for epoch in (first, first + 1):
            counts = [leftover.count(epoch) for leftover in leftovers]
            start, stop = share(sum(counts), consumer, num_consumers)
            offset = 0
            for leftover, count in zip(leftovers, counts):
                if start < offset + count and offset < stop:
                    rows = leftover.references(epoch, max(start - offset, 0), min(stop - offset, count))
                    refs.extend(rows[0])
                    sizes.extend(rows[1])
                offset += count
        state = pack._header()
        state.update({EMITTED: 0, STATS: dict.fromkeys(COUNTERS, 0), ENDED: False})
        if row_orders:
            state[ROW_ORDER] = row_orders.pop()
        if sizes:
            state.update({INHERITED: refs, INHERITED_SIZES: sizes})
        return state

    @staticmethod
    def olds_for_children(pack: Pack, olds: list[dict[str, Any]], path: str) -> list[dict[str, Any]]:
        """A whole-epoch plan takes its whole stride from the upstream at once, but leaves its
        cursor at 0: for the rescale of the indexed chain, an old consumer that handed out rows
        of its plan has read its whole stride (those rows are dealt out by ``rescaled``), one that
        has not has read none of it (the new consumers plan it again)."""
        moved = []
        for index, old in enumerate(olds):
            leftover = Leftover(pack, old, index, len(olds), path)
            position = leftover.stride.length if leftover.taken else 0
            moved.append({**old, UPSTREAM: {**leftover.upstream, POSITION: position}})
        return moved


def indexed_upstream(pack: Pack) -> IndexedNode[Any]:
    """The upstream of a packer that plans whole epochs."""
    return cast("IndexedNode[Any]", pack.upstream)  # Pack refuses a whole-epoch plan over any other


def make_plan(
    documents: Documents, max_documents: int | None, epoch: int, records: Iterator[tuple[int, Any]], row_order: str
) -> Plan:
    """Learn the length (and cost) of every ``(leaf index, record)`` of the epoch and pack them,
    rows in ``row_order``."""
    counts = dict.fromkeys(DOCUMENT_COUNTERS, 0)
    kept: list[tuple[int, int, int, int]] = []  # (record index, full, end, extra) of documents with tokens
    for index, record in records:
        document = documents.read(record, (epoch, index))
        full, end = documents.cut(document, counts)
        if end:
            kept.append((index, full, end, document.extra))
    kept_array = np.array(kept, dtype=np.int64).reshape(-1, 4)
    return Plan.pack(kept_array, documents.seq_len, max_documents, counts, row_order)


def saved_row_order(state: dict[str, Any], path: str) -> str:
    """The row order a state's plan has: ``FIRST_PIECE`` if it was saved before the entry existed."""
    row_order = state.get(ROW_ORDER, FIRST_PIECE)
    if row_order not in ROW_ORDERS:
        raise StateError(
            f"{path}: state entry {ROW_ORDER!r} is {short_repr(row_order)}, expected one of {', '.join(ROW_ORDERS)}"
        )
    return cast("str", row_order)


def saved_inherited(pack: Pack, state: dict[str, Any], epoch: int, path: str) -> InheritedRows:
    """The inherited rows a state saved (none if it has neither entry); StateError unless they
    are well formed rows of ``epoch`` and the next one."""
    if INHERITED not in state and INHERITED_SIZES not in state:
        return NO_INHERITED_ROWS
    rows = InheritedRows.parse(
        state.get(INHERITED), state.get(INHERITED_SIZES), path, pack.seq_len, pack.max_documents or pack.seq_len
    )
    if rows.epochs and not epoch <= rows.epochs[0] <= rows.epochs[-1] <= epoch + 1:
        epochs = short_repr(sorted(set(rows.epochs)))
        raise StateError(f"{path}: {INHERITED} rows of epochs {epochs}, the upstream is in epoch {epoch}")
    return rows


def check_inherited(pack: Pack, rows: InheritedRows, start: int, path: str) -> None:
    """Check that every piece of the inherited rows from ``start`` on lies inside its record:
    each record is fetched once, in chunks, and only its length kept."""
    refs = rows.refs[rows.bounds[start] :]
    keys = list(dict.fromkeys((ref[0], ref[1]) for ref in refs))
    lengths: dict[RecordKey, int] = {}
    try:
        for begin in range(0, len(keys), MAX_CHUNK):
            chunk = keys[begin : begin + MAX_CHUNK]
            for key, record in zip(chunk, pack.upstream.fetch_many(chunk)):
                lengths[key] = len(pack._documents.read(record, key).tokens)
    except (IndexError, ResumableError) as exc:
        raise StateError(f"{path}: the records of the {INHERITED} rows cannot be fetched again: {exc}") from exc
    for ref in refs:
        key = (ref[0], ref[1])
        if ref[3] > lengths[key]:
            raise StateError(
                f"{path}: {INHERITED} piece {ref} is outside record {key_text(key)} of {lengths[key]} tokens "
                "(did the data change?)"
            )


def check_plan_rows(rows: int, planned: int | None, handed_out: int, path: str) -> None:
    """StateError unless a plan of ``rows`` rows has the rows a state says it had (``planned``,
    if saved) and the ``handed_out`` rows it counts as handed out."""
    if planned is not None and planned != rows:
        raise StateError(
            f"{path}: state's plan has {planned} rows, planning the epoch again gives {rows} (did the data change?)"
        )
    if handed_out > rows:
        raise StateError(f"{path}: state has {handed_out} rows handed out, the epoch's plan has {rows}")


class Leftover:
    """What one old consumer of a whole-epoch plan had not handed out, in a rescale: the rows
    it had inherited and not handed out, and, once it had handed out rows of its plan, the rest of that
    plan (made again from its stride only when asked for). A consumer that has handed out no
    row of its plan has not taken its stride: the upstream's rescale leaves it to be planned
    again."""

    def __init__(self, pack: Pack, old: dict[str, Any], consumer: int, num_consumers: int, path: str) -> None:
        pack._check_config(old, path)
        self.upstream = require(old, UPSTREAM, dict, path)
        cursor = indexed_upstream(pack)
        self.stride = Stride.of(cursor, self.upstream, consumer, num_consumers, f"{path} > {cursor.kind}")
        self.epoch = self.stride.epoch
        self.emitted = require_count(old, EMITTED, path)
        self.row_order = saved_row_order(old, path)
        self.inherited = saved_inherited(pack, old, self.epoch, path)
        self.now = self.inherited.count(self.epoch)
        self.taken = self.emitted > self.now
        self.planned = require_count(old, PLANNED, path) if PLANNED in old else None
        self._pack, self._cursor, self._path = pack, cursor, path
        self._plan: Plan | None = None
        if self.taken and self.planned is not None:
            check_plan_rows(self.planned, None, self.emitted - self.now, path)

    @property
    def last_epoch(self) -> int:
        """The latest epoch it holds rows of."""
        return self.epoch + 1 if len(self.inherited) > self.now else self.epoch

    def count(self, epoch: int) -> int:
        """How many rows of ``epoch`` it had not handed out."""
        if epoch == self.epoch + 1:
            return len(self.inherited) - self.now
        if epoch != self.epoch:
            return 0
        if self.taken:
            return self._plan_rows() - (self.emitted - self.now)
        return self.now - self.emitted

    def references(self, epoch: int, start: int, stop: int) -> tuple[list[list[int]], list[int]]:
        """Rows ``[start, stop)`` of those ``count(epoch)`` counts, as piece references."""
        if epoch != self.epoch:
            return self.inherited.references(self.now + start, self.now + stop)
        if self.taken:
            skip = self.emitted - self.now
            return self.plan().references(epoch, skip + start, skip + stop)
        return self.inherited.references(self.emitted + start, self.emitted + stop)

    def _plan_rows(self) -> int:
        return self.planned if self.planned is not None else self.plan().rows

    def plan(self) -> Plan:
        """Its plan, made again over its stride (one pass over the stride's records)."""
        if self._plan is None:
            pack, path = self._pack, self._path
            leaves = self.stride.leaves(path)
            try:
                records = self._cursor._scan_leaves(leaves, skip=True, failed=read_ahead_failure(PLANNER))
                plan = make_plan(pack._documents, pack.max_documents, self.epoch, records, self.row_order)
            except (IndexError, ResumableError) as exc:
                raise StateError(f"{path}: cannot plan epoch {self.epoch} of an old consumer again: {exc}") from exc
            check_plan_rows(plan.rows, self.planned, self.emitted - self.now, path)
            self._plan = plan
        return self._plan
