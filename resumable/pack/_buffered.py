"""A streaming packer's rows (``greedy``, ``first_fit``, ``best_fit``, and ``bfd`` with
``buffer_size``): documents are taken from the upstream one at a time, cut into pieces that a
bounded strategy groups into rows, and every piece still held is saved by reference."""

from __future__ import annotations

from collections import deque
from itertools import chain
from typing import TYPE_CHECKING, Any, Callable, Iterator, cast

import numpy as np

from resumable.core.indexed import IndexedNode
from resumable.core.keys import RecordKey, Stride
from resumable.core.state import require
from resumable.errors import ConfigError, SourceError, StateError
from resumable.ops.filter import Filter
from resumable.ops.map import Map
from resumable.ops.mix import Mix
from resumable.ops.read_ahead import ReadAhead
from resumable.ops.repeat import Repeat
from resumable.pack._entries import (
    COUNTERS,
    EXHAUSTED,
    INHERITED,
    OPEN,
    OPEN_SIZES,
    READY,
    READY_SIZES,
    REFS,
    RESERVED,
    SECTIONS,
    SPAN,
    STATS,
)
from resumable.pack._pieces import Piece, Refetcher, count_row, grouped, is_count, piece, untraceable
from resumable.pack._refs import REF_LIMIT, GrowingSlots, RefTable, decode
from resumable.pack.rows import Segment
from resumable.pack.strategies import Packer, Row
from resumable.sources.stream import JsonlStream

if TYPE_CHECKING:
    from resumable.core.node import Node
    from resumable.pack._documents import Documents
    from resumable.pack.node import Pack
    from resumable.pack.rows import Document


class BufferedRows:
    """What a streaming packer holds between its upstream and its rows in one epoch: pieces the
    strategy placed in open groups, closed rows ready to hand out, the whole rows left of a long
    document (``span``), pieces inherited in a rescale (packed before the upstream's), and the
    epoch's counters."""

    def __init__(
        self, upstream: Node[Any], documents: Documents, packer: Packer, counts: dict[str, int] | None = None
    ) -> None:
        self._upstream = upstream
        self._documents = documents
        self._seq_len = documents.seq_len
        self.counts = dict.fromkeys(COUNTERS, 0) if counts is None else counts
        self._packer = packer
        # Every piece held (the strategy's, the ready rows', the span and the inherited ones), by
        # slot of ``_table``, which holds their references packed for the state.
        self._pieces: dict[int, Piece] = {}
        self._table = RefTable()
        # What ``progress`` derived, kept while it holds: the open pieces' slots (their list only
        # grows between a strategy's rounds); the ready rows' slots and sizes, valid from
        # ``_ready_taken`` rows (``_ready_cut`` slots) on while no row is added; and the last
        # progress itself, valid while ``_changes`` (rows asked for) has not moved.
        self._open_slots = GrowingSlots()
        self._whole_slots = GrowingSlots()
        self._ready_slots: tuple[np.ndarray, list[int]] | None = None
        self._ready_taken = self._ready_cut = 0
        self._changes = 0
        self._saved: tuple[int, dict[str, Any]] | None = None
        self._ready: deque[Row] = deque()
        self._span: int | None = None  # the slot of the whole rows left of a long document
        self._inherited = np.zeros(0, dtype=np.intp)  # slots of the inherited pieces, from
        self._inherited_taken = 0  # this many on: those before are pulled
        self._exhausted = False
        # After a restore: fetches the records of restored pieces as their rows are handed out.
        self._fetcher: Refetcher | None = None
        # Per origin (mix components): the epochs where the current run of documents without
        # tokens began and where it is now.
        self._barren: dict[RecordKey, list[int]] = {}

    # -- iteration ---------------------------------------------------------------------------

    def next_segments(self) -> list[Segment]:
        """The next row's segments, counted; StopIteration once the upstream's epoch is packed."""
        self._changes += 1
        while True:
            if self._span is not None:
                return self._emit_span(self._span)
            if self._ready:
                segments = self._emit(self._ready[0])  # a failed fetch leaves the row ready
                self._ready_taken += 1
                self._ready_cut += len(self._ready.popleft())
                return segments
            if self._exhausted:
                raise StopIteration
            self._pull()

    def _pull(self) -> None:
        """Take one document from upstream (or an inherited piece); at its end, flush the open rows."""
        if self._inherited_taken < len(self._inherited):
            slot = int(self._inherited[self._inherited_taken])
            self._inherited_taken += 1
            held = self._pieces[slot]
            self._let_go(slot)
            full = held.start + (held.end - held.start) // self._seq_len * self._seq_len
            added = self._add(held.key, held.start, full, held.end, held.document, held.extra)
            if held.document is None and self._fetcher is not None:  # its pieces wait for the record now
                self._fetcher.hold(held.key, added - 1)
            return
        upstream, documents = self._upstream, self._documents
        try:
            record = next(upstream)
        except StopIteration:
            self._exhausted = True
            self._ready_add(self._packer.flush())
            return
        key = upstream.last_key()
        if key is None:
            raise ConfigError(untraceable(documents.kind, upstream))
        document = documents.read(record, key)
        full, end = documents.cut(document, self.counts)
        if not end:
            self._check_barren(key)
            return
        self._barren.clear()
        self._add(key, 0, full, end, document)

    def _add(
        self, key: RecordKey, start: int, full: int, end: int, document: Document | None, extra: int | None = None
    ) -> int:
        """Tokens ``[start, full)`` of a record make whole rows of their own, ``[full, end)``
        one piece for the strategy (placed by its cost); return how many pieces were made.
        ``document`` is None for an inherited piece not fetched yet, whose ``extra`` is known."""
        if not all(0 <= part < REF_LIMIT for part in key[-2:]):
            raise StateError(
                f"{self._documents.kind}: record key {key!r} holds a number a state cannot save "
                f"(at most {REF_LIMIT - 1}); was the upstream's state damaged?"
            )
        added = 0
        if full > start:  # held by the strategy, which lets them leave in step with the pieces
            item = self._hold(piece(key, start, full, document, extra))
            self._ready_add(self._packer.add_whole(item, (full - start) // self._seq_len))
            added += 1
        if end > full:
            held = piece(key, full, end, document, extra)
            item = self._hold(held)
            self._ready_add(self._packer.add(item, held.cost))
            added += 1
        return added

    def _hold(self, held: Piece) -> int:
        """The slot of a piece now held, its reference in the table."""
        slot = self._table.add(held.key, held.start, held.end, held.extra)
        self._pieces[slot] = held
        return slot

    def _let_go(self, slot: int) -> None:
        """A piece handed out (or replaced) is held no more."""
        del self._pieces[slot]
        self._table.release(slot)

    def _ready_add(self, rows: list[Row]) -> None:
        if rows:
            self._ready.extend(rows)
            self._ready_slots = None

    def _check_barren(self, key: RecordKey) -> None:
        """Fail instead of spinning forever when a whole upstream epoch gives no tokens (every
        document empty or dropped): after ``repeat()`` no row would ever come. After a mix,
        epochs are counted per origin (the components a key names), since components run
        through their epochs independently, and only when every component the mix still
        chooses from is barren can no row come."""
        origin, epoch = key[:-2], key[-2]
        span = self._barren.setdefault(origin, [epoch, epoch])
        span[1] = epoch
        if epoch <= span[0] + 1:
            return
        first = span[0]
        mix = self._upstream_mix()
        if origin and mix is not None:
            barren = {path[0] for path, (start, latest) in self._barren.items() if path and latest > start + 1}
            if not set(mix.eligible) <= barren:
                return
        where = f" of mix component {'/'.join(map(str, origin))}" if origin else ""
        documents = self._documents
        raise SourceError(
            f"{documents.kind}: no document of epoch {first + 1}{where} has tokens to pack (all are empty"
            f"{' or dropped as longer than seq_len' if documents.overlong == 'drop' else ''}), so no row can come"
        )

    def _upstream_mix(self) -> Mix[Any] | None:
        """The mix the packer's documents come from, through pass-through nodes, if any."""
        node: Node[Any] | None = self._upstream
        while node is not None and not isinstance(node, Mix):
            node = node.upstream
        return node

    def _documents_of(self, held: list[Piece]) -> list[Document]:
        """The documents of a row's pieces, fetching those a restore left unfetched."""
        if self._fetcher is None:
            return cast("list[Document]", [part.document for part in held])
        return self._fetcher.documents(held)

    def _emit_span(self, slot: int) -> list[Segment]:
        """The next whole row of a long document (the piece in ``slot``, let go; what is left of
        it becomes the span)."""
        span = self._pieces[slot]
        (document,) = self._documents_of([span])
        stop = span.start + self._seq_len
        self._let_go(slot)
        self._span = self._hold(piece(span.key, stop, span.end, document)) if stop < span.end else None
        segments = [Segment(document, span.start, stop)]
        count_row(self.counts, segments, self._seq_len)
        return segments

    def _emit(self, row: Row) -> list[Segment]:
        pieces = self._pieces
        first = pieces[row[0]]
        if first.end - first.start > self._seq_len:  # whole rows: the first of them
            return self._emit_span(row[0])
        held = [pieces[item] for item in row]
        documents = self._documents_of(held)  # before anything changes: a failed fetch leaves the row
        for item in row:
            self._let_go(item)
        segments = [Segment(document, part.start, part.end) for document, part in zip(documents, held)]
        count_row(self.counts, segments, self._seq_len)
        return segments

    # -- what is held ------------------------------------------------------------------------

    def pending_keys(self) -> list[RecordKey]:
        """The key of every document held, once each: the records a restore fetches again."""
        return list(dict.fromkeys(held.key for held in self._buffered()))

    def _buffered(self) -> Iterator[Piece]:
        pieces = self._pieces
        yield from (pieces[item] for item in self._inherited[self._inherited_taken :].tolist())
        if self._span is not None:
            yield pieces[self._span]
        for row in self._ready:
            yield from (pieces[item] for item in row)
        for group in self._packer.groups():
            yield from (pieces[item] for item in group)

    # -- state -------------------------------------------------------------------------------

    def progress(self) -> dict[str, Any]:
        """Every piece held, by reference, grouped as the strategy and the ready rows hold them;
        with a ``length_fn``, also the positions each piece's document reserves (``RESERVED``),
        so a restore plans without fetching the records.

        The references, in the order open groups, ready rows, span, inherited, are one compact
        encoding (``REFS``, see ``_refs``) cut by ``SECTIONS`` and the group sizes. Every piece's
        reference was packed when it arrived, and the slots in state order are kept as the
        strategy and the ready rows change, so a state is one gather of packed words by slot and
        its base64, not a pass over the buffer."""
        if self._saved is not None and self._saved[0] == self._changes:
            return self._saved[1]
        order = self._packer.state_order()
        ready_slots, ready_sizes = self._ready_state()
        span = np.array([self._span] if self._span is not None else [], dtype=np.intp)
        inherited = self._inherited[self._inherited_taken :]
        opened = [self._open_slots.of(order.pieces), self._whole_slots.of(order.whole)[order.whole_from :]]
        slots = np.concatenate([*opened, ready_slots, span, inherited])
        progress = {
            REFS: self._table.encode(slots),
            SECTIONS: [len(opened[0]) + len(opened[1]), len(ready_slots), len(span), len(inherited)],
            OPEN_SIZES: order.sizes,
            READY_SIZES: ready_sizes,
            EXHAUSTED: self._exhausted,
            STATS: dict(self.counts),
        }
        if self._documents.length_fn is not None:
            progress[RESERVED] = self._table.extras(slots)
        self._saved = (self._changes, progress)
        return progress

    def _ready_state(self) -> tuple[np.ndarray, list[int]]:
        """The slots of the ready rows' pieces, and each row's size."""
        if self._ready_slots is None:
            ready = self._ready
            slots = np.fromiter(chain.from_iterable(ready), dtype=np.intp)
            self._ready_slots = (slots, list(map(len, ready)))
            self._ready_taken = self._ready_cut = 0
        slots, sizes = self._ready_slots
        return slots[self._ready_cut :], sizes[self._ready_taken :]

    @classmethod
    def restored(
        cls, pack: Pack, packer: Packer, state: dict[str, Any], path: str, counts: dict[str, int]
    ) -> BufferedRows:
        """The rows ``state`` saved, its pieces placed in the empty strategy ``packer``.

        Planning needs only each piece's cost: its token range, and with a ``length_fn`` the
        positions saved under ``RESERVED``. So the records are fetched again only as their rows
        are handed out, and a restore costs no map call, whatever the buffer holds. A state
        without ``RESERVED`` from a packer with a ``length_fn`` (saved before it existed), and
        an upstream that reads a stream front to back (a fetch per row would read it again
        each time), fetch every record now, in one call, as before."""
        seq_len = pack.seq_len
        compact = state.get(REFS)
        state = listed(state, path)
        table = RefTable()
        if compact is not None:  # checked by ``listed``: the pieces are saved again as they were saved
            table.adopt(compact)
        open_groups = grouped(state, OPEN, OPEN_SIZES, path)
        ready_rows = grouped(state, READY, READY_SIZES, path)
        span_ref = require(state, SPAN, list, path)
        exhausted = require(state, EXHAUSTED, bool, path)
        inherited_refs = require(state, INHERITED, list, path)
        entries = (
            [(entry, OPEN) for group in open_groups for entry in group]
            + [(entry, READY) for row in ready_rows for entry in row]
            + ([(span_ref, SPAN)] if span_ref else [])
            + [(entry, INHERITED) for entry in inherited_refs]
        )
        fetcher = Refetcher(pack.upstream.fetch_many, pack._documents.read, path, key_checker(pack.upstream))
        reserved = saved_reserved(state, len(entries), pack.length_fn is not None, path)
        lazy = reserved is not None and not _reads_streams(pack.upstream)
        extras = iter(reserved or ())
        if not lazy:
            fetcher.fetch(entries)

        def make(entry: Any, where: str) -> Piece:
            return fetcher.lazy(entry, where, next(extras)) if lazy else fetcher.piece(entry, where)

        pieces: dict[int, Piece] = {}

        def load(entry: Any, where: str) -> int:
            loaded = make(entry, where)
            if where == SPAN and (loaded.end - loaded.start) % seq_len:
                raise StateError(f"{path}: {SPAN} {entry} is not a whole number of rows of {seq_len}")
            if where in (OPEN, READY) and loaded.cost > seq_len and loaded.cost % seq_len:
                raise StateError(f"{path}: {where} piece {entry} is longer than seq_len={seq_len}, not whole rows")
            item = table.add(loaded.key, loaded.start, loaded.end, loaded.extra)
            pieces[item] = loaded
            return item

        groups = [[load(entry, OPEN) for entry in group] for group in open_groups]
        ready: deque[Row] = deque()
        for row in ready_rows:
            items = [load(entry, READY) for entry in row]
            used = sum(pieces[item].cost for item in items)
            if not items or (used > seq_len and len(items) > 1) or len(items) > (pack.max_documents or seq_len):
                raise StateError(f"{path}: a ready row {row} does not fit a row of seq_len={seq_len}")
            ready.append(items)
        span = load(span_ref, SPAN) if span_ref else None
        inherited = np.array([load(entry, INHERITED) for entry in inherited_refs], dtype=np.intp)

        try:
            packer.restore([[(item, pieces[item].cost) for item in group] for group in groups])
        except ValueError as exc:
            raise StateError(f"{path}: the {OPEN} groups do not fit strategy {pack.strategy!r}: {exc}") from exc
        rows = cls(pack.upstream, pack._documents, packer, counts)
        rows._pieces, rows._table = pieces, table
        rows._ready, rows._span, rows._exhausted = ready, span, exhausted
        rows._inherited = inherited
        rows._fetcher = fetcher if lazy and entries else None
        return rows

    @staticmethod
    def rescaled(
        pack: Pack, olds: list[dict[str, Any]], path: str, consumer: int, num_consumers: int
    ) -> dict[str, Any]:
        """A fresh epoch state holding the whole buffers of the old consumers this consumer
        inherits from (``resumable.pack._rescale``: the others' buffers are not read)."""
        from resumable.pack._rescale import rescaled  # not at the top: that module imports this one

        return rescaled(pack, olds, path, consumer, num_consumers)


def expand_references(state: dict[str, Any]) -> dict[str, Any]:
    """A streaming packer's own state (``kind`` Pack) with its piece references as lists
    ``[*mix component names, epoch, record, token_start, token_end]`` under ``open``,
    ``ready``, ``span`` and ``inherited``, as states held them before the compact form (for
    tools and tests that read them; ``set_state`` takes either form)."""
    return listed(state, str(state.get("kind", "Pack")))


def listed(state: dict[str, Any], path: str) -> dict[str, Any]:
    """``state`` with its references as lists, one per piece, under ``OPEN``, ``READY``,
    ``SPAN`` and ``INHERITED``: the form states took before ``REFS`` (which still load as they
    are), and what ``restored`` and ``rescaled`` read."""
    if REFS not in state:
        return state
    refs = decode(state[REFS], path, REFS)
    sections = require(state, SECTIONS, list, path)
    if len(sections) != 4 or not all(is_count(count) for count in sections) or sections[2] > 1:
        raise StateError(
            f"{path}: state entry {SECTIONS!r} is {sections!r}, expected 4 counts (open, ready, span 0/1, inherited)"
        )
    if sum(sections) != len(refs):
        raise StateError(f"{path}: {SECTIONS!r} counts {sum(sections)} pieces, {REFS!r} holds {len(refs)}")
    opened, ready, span, _ = sections
    listed = {key: value for key, value in state.items() if key not in (REFS, SECTIONS)}
    listed[OPEN] = refs[:opened]
    listed[READY] = refs[opened : opened + ready]
    listed[SPAN] = refs[opened + ready] if span else []
    listed[INHERITED] = refs[opened + ready + span :]
    return listed


def saved_reserved(state: dict[str, Any], count: int, length_fn: bool, path: str) -> list[int] | None:
    """The positions each of the ``count`` saved pieces reserves (all 0 without a
    ``length_fn``), or None where the state does not say (saved before ``RESERVED`` existed)."""
    if not length_fn:
        return [0] * count
    if RESERVED not in state:
        return None
    reserved = require(state, RESERVED, list, path)
    if len(reserved) != count or not all(is_count(value) for value in reserved):
        raise StateError(f"{path}: state entry {RESERVED!r} must hold {count} counts >= 0, one per piece")
    return cast("list[int]", reserved)


def _reads_streams(upstream: Node[Any]) -> bool:
    """Whether the records come from a stream source, which reads its files front to back."""
    return any(isinstance(node, JsonlStream) for node in upstream._subtree())


PASS_KEYS = (Filter, Map, Repeat, ReadAhead)
"""Nodes whose items carry their upstream's keys unchanged (``fetch_many`` passes them on)."""


def key_checker(upstream: Node[Any]) -> Callable[[RecordKey], str | None]:
    """What is wrong with a key, where the upstream can tell without fetching (None where it
    cannot, or nothing is): an indexed chain knows its leaf's length, a mix its components;
    other nodes leave the check to the fetch when the key's row is due."""

    def check(key: RecordKey) -> str | None:
        node: Node[Any] | None = upstream
        while isinstance(node, PASS_KEYS):
            node = node.upstream
        if isinstance(node, Mix):
            name = key[0] if len(key) > 2 else None
            if name not in node.components:
                return f"{key!r} does not name a component of the mix first"
            return key_checker(node.components[name])(key[1:])
        if isinstance(node, IndexedNode) and len(key) == 3 and isinstance(key[0], Stride):
            return node.stride_problem(key[0], key[1], [key[2]])
        if isinstance(node, IndexedNode) and len(key) == 2:
            size = len(node.leaf)
            return None if key[1] < size else f"record index {key[1]} out of range [0, {size})"
        return None

    return check
