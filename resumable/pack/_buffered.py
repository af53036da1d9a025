"""A streaming packer's rows (``greedy``, ``first_fit``, ``best_fit``, and ``bfd`` with
``buffer_size``): documents are taken from the upstream one at a time, cut into pieces that a
bounded strategy groups into rows, and every piece still held is saved by reference."""

from __future__ import annotations

import copy
from collections import deque
from functools import partial
from itertools import chain
from typing import TYPE_CHECKING, Any, Callable, Iterator, cast

import numpy as np

from resumable.core.indexed import IndexedNode
from resumable.core.keys import RecordKey, Stride, saved_prefix
from resumable.core.state import require
from resumable.errors import ConfigError, StateError
from resumable.ops.barren import BarrenEpochs
from resumable.ops.filter import Filter
from resumable.ops.map import Map
from resumable.ops.mix import Mix
from resumable.ops.read_ahead import ReadAhead
from resumable.ops.repeat import Repeat
from resumable.pack._documents import Documents
from resumable.pack._entries import (
    BASE_PROGRESS,
    BUFFER_SIZE,
    COUNTERS,
    EVENT_ORIGINS,
    EVENTS,
    EXHAUSTED,
    INHERITED,
    LENGTH_FN,
    MAX_DOCUMENTS,
    OPEN,
    OPEN_SIZES,
    READY,
    READY_SIZES,
    REFS,
    RESERVED,
    SECTIONS,
    SEQ_LEN,
    SPAN,
    STATS,
    STRATEGY,
)
from resumable.pack._events import (
    FLUSH,
    INHERITED_PULL,
    NEXT_RECORD,
    ROW,
    Event,
    Pulled,
    event_limit,
    next_record,
    parsed_events,
)
from resumable.pack._pieces import (
    Piece,
    Refetcher,
    count_row,
    grouped,
    is_count,
    piece,
    reference_parts,
    untraceable,
)
from resumable.pack._refs import REF_LIMIT, GrowingSlots, RefTable, decode
from resumable.pack.rows import Segment
from resumable.pack.strategies import Packer, Row, make_packer
from resumable.sources.stream import JsonlStream

if TYPE_CHECKING:
    from resumable.core.node import Node
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
        # The last whole progress a state saved (compact form), and what happened since, which
        # a state saves instead of the whole buffer until the log is long (``_events``).
        self._base: dict[str, Any] | None = None
        self._events: list[int] = []
        self._event_limit = event_limit(0)
        self._base_pieces = 0  # the pieces the base holds
        self._event_origins: tuple[int, list[Any]] = (0, [])  # the table's origins saved, by count
        self._last_logged: RecordKey | None = None  # the key of the last document logged
        self._row_run_end = 0  # the log's length after its last run of rows, whose count ends it
        self._reserves = documents.length_fn is not None  # whether states save RESERVED
        self._ready: deque[Row] = deque()
        self._span: int | None = None  # the slot of the whole rows left of a long document
        self._inherited = np.zeros(0, dtype=np.intp)  # slots of the inherited pieces, from
        self._inherited_taken = 0  # this many on: those before are pulled
        self._exhausted = False
        # After a restore: fetches the records of restored pieces as their rows are handed out.
        self._fetcher: Refetcher | None = None
        self._barren = BarrenEpochs(upstream)  # the epochs of the documents without tokens in a row

    # -- iteration ---------------------------------------------------------------------------

    def next_segments(self) -> list[Segment]:
        """The next row's segments, counted; StopIteration once the upstream's epoch is packed."""
        self._changes += 1
        while self._span is None and not self._ready:
            if self._exhausted:
                raise StopIteration
            self._pull()
        segments = self._hand_out(fetch=True)
        self._log_row()
        return segments

    def _hand_out(self, fetch: bool) -> list[Segment]:
        """Let the next row go (the span's next whole row, or the first ready row) and return its
        segments; without ``fetch`` (a replay) its records are neither fetched nor counted."""
        if self._span is not None:
            return self._emit_span(self._span, fetch)
        segments = self._emit(self._ready[0], fetch)  # a failed fetch leaves the row ready
        self._ready_taken += 1
        self._ready_cut += len(self._ready.popleft())
        return segments

    def _pull(self) -> None:
        """Take one document from upstream (or an inherited piece); at its end, flush the open rows."""
        if self._inherited_taken < len(self._inherited):
            self._pull_inherited()
            return
        upstream, documents = self._upstream, self._documents
        try:
            record = next(upstream)
        except StopIteration:
            self._flush()
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
        self._log_document(key, full, end, document.extra)

    def _pull_inherited(self) -> None:
        """Place the next piece inherited in a rescale."""
        slot = int(self._inherited[self._inherited_taken])
        self._inherited_taken += 1
        held = self._pieces[slot]
        self._let_go(slot)
        full = held.start + (held.end - held.start) // self._seq_len * self._seq_len
        added = self._add(held.key, held.start, full, held.end, held.document, held.extra)
        if held.document is None and self._fetcher is not None:  # its pieces wait for the record now
            self._fetcher.hold(held.key, added - 1)
        self._log(INHERITED_PULL)

    def _flush(self) -> None:
        """The upstream's epoch has ended: close the open rows."""
        self._exhausted = True
        self._ready_add(self._packer.flush())
        self._log(FLUSH)

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
        """Warn, once, when a whole epoch of an endless upstream gives no tokens (every document
        empty or dropped): if none ever does, no row comes (``barren.py``)."""
        documents = self._documents
        self._barren.warn_once(
            key,
            f"{documents.kind}: no document of epoch {{epoch}}{{where}} has tokens to pack (all are empty"
            f"{' or dropped as longer than seq_len' if documents.overlong == 'drop' else ''}); if no document "
            "of its endless upstream has any, no row ever comes",
        )

    def _documents_of(self, held: list[Piece]) -> list[Document]:
        """The documents of a row's pieces, fetching those a restore left unfetched."""
        if self._fetcher is None:
            return cast("list[Document]", [part.document for part in held])
        return self._fetcher.documents(held)

    def _emit_span(self, slot: int, fetch: bool) -> list[Segment]:
        """The next whole row of a long document (the piece in ``slot``, let go; what is left of
        it becomes the span)."""
        span = self._pieces[slot]
        document = self._documents_of([span])[0] if fetch else span.document
        stop = span.start + self._seq_len
        self._let_go(slot)
        if stop < span.end:
            self._span = self._hold(piece(span.key, stop, span.end, document, span.extra))
        else:
            self._span = None
            if not fetch:
                self._unfetched_let_go([span])
        if not fetch:
            return []
        segments = [Segment(cast("Document", document), span.start, stop)]
        count_row(self.counts, segments, self._seq_len)
        return segments

    def _emit(self, row: Row, fetch: bool) -> list[Segment]:
        pieces = self._pieces
        first = pieces[row[0]]
        if first.end - first.start > self._seq_len:  # whole rows: the first of them
            return self._emit_span(row[0], fetch)
        held = [pieces[item] for item in row]
        documents = self._documents_of(held) if fetch else []  # before anything changes: a failed fetch leaves the row
        for item in row:
            self._let_go(item)
        if not fetch:
            self._unfetched_let_go(held)
            return []
        segments = [Segment(document, part.start, part.end) for document, part in zip(documents, held)]
        count_row(self.counts, segments, self._seq_len)
        return segments

    def _unfetched_let_go(self, held: list[Piece]) -> None:
        """Pieces a replay handed out: the records of those not fetched are no longer waited for."""
        if self._fetcher is not None:
            for part in held:
                if part.document is None:
                    self._fetcher.hold(part.key, -1)

    # -- the log of what happened since the last whole state (``_events``) ------------------

    def _log(self, *event: int) -> None:
        events = self._events
        events.extend(event)
        if len(events) > self._event_limit:  # no state for a while: the next one is whole
            self._forget_log(None)

    def _log_row(self) -> None:
        """A row handed out: one more in the log's run of rows, or a new run."""
        events = self._events
        if events and len(events) == self._row_run_end:
            events[-1] += 1
        else:
            self._log(ROW, 1)
            self._row_run_end = len(self._events)

    def _log_document(self, key: RecordKey, full: int, end: int, extra: int) -> None:
        follows = not full and not extra and next_record(self._last_logged, key)
        self._last_logged = key  # before logging, which may drop the log (and forget it)
        if follows:
            self._log(NEXT_RECORD - end)
        else:
            self._log(self._table.origin(key[:-2]), key[-2], key[-1], full, end, extra)

    def _rebase(self, progress: dict[str, Any]) -> None:
        """``progress``, a whole one, is what the next states build on."""
        self._forget_log(progress)
        self._base_pieces = sum(progress[SECTIONS])
        self._event_limit = event_limit(self._base_pieces)

    def _forget_log(self, base: dict[str, Any] | None) -> None:
        """An empty log after ``base`` (None: the next state is whole)."""
        self._base, self._events, self._last_logged, self._row_run_end = base, [], None, 0

    def _saved_origins(self) -> list[Any]:
        """The key prefixes the logged documents' origins index, as saved (kept while they do not grow)."""
        origins = self._table.origins
        if self._event_origins[0] != len(origins):
            self._event_origins = (len(origins), [saved_prefix(names) for names in origins])
        return self._event_origins[1]

    def _replay(self, events: Any, origins: Any, path: str) -> None:
        """Do again, by planning alone, what ``events`` logged (``_events``), logging it again;
        StateError naming ``path`` if the log does not fit what this packer holds."""
        where = f"{path} > {EVENTS}"
        for event in parsed_events(events, origins, self._seq_len, where):
            try:
                self._apply(event, where)
            except ValueError as exc:  # the strategy's: a piece longer than a row
                raise StateError(f"{where}: an event does not fit the packing strategy: {exc}") from exc

    def _apply(self, event: Event, where: str) -> None:
        """One event of a replayed log."""
        if isinstance(event, Pulled):
            if self._exhausted or self._inherited_taken < len(self._inherited):
                raise StateError(f"{where}: a document is taken after the epoch's end or before inherited pieces")
            fetcher = self._fetcher
            wrong = fetcher.key_problem(event.key) if fetcher is not None else None
            if wrong is not None:
                raise StateError(f"{where}: a document event names no record: {wrong}")
            added = self._add(event.key, 0, event.full, event.end, None, event.extra)
            if fetcher is not None:
                fetcher.hold(event.key, added)
            self._log_document(event.key, event.full, event.end, event.extra)
        elif event == ROW:
            if self._span is None and not self._ready:
                raise StateError(f"{where}: a row is handed out that the buffer does not hold")
            self._hand_out(fetch=False)
            self._log_row()
        elif event == INHERITED_PULL:
            if self._inherited_taken >= len(self._inherited):
                raise StateError(f"{where}: an inherited piece is placed that the state does not hold")
            self._pull_inherited()
        elif self._exhausted:
            raise StateError(f"{where}: the epoch ends twice")
        else:
            self._flush()

    # -- what is held ------------------------------------------------------------------------

    def pending_keys(self) -> list[RecordKey]:
        """The key of every document held, once each, as its origin (``origin_key``): the
        records a restore fetches again."""
        return list(dict.fromkeys(origin_key(self._upstream, held.key) for held in self._buffered()))

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
        """What a state saves of the buffer: the last whole progress (``whole_progress``) and the
        log of what happened since (``_events``), or a whole progress, on which the next states
        build, when there is none yet, when the log has grown past half its limit, or when the
        buffer holds under three quarters of the base's pieces (a round's rows handed out: the
        base would be mostly pieces gone)."""
        if self._saved is not None and self._saved[0] == self._changes:
            return self._saved[1]
        base, events = self._base, self._events
        if base is None or 2 * len(events) > self._event_limit or 4 * len(self._pieces) < 3 * self._base_pieces:
            progress = self.whole_progress()
            self._rebase(progress)
        elif not events and self.counts == base[STATS]:
            progress = base
        else:
            progress = {
                BASE_PROGRESS: base,
                EVENTS: events.copy(),
                EVENT_ORIGINS: self._saved_origins(),
                STATS: dict(self.counts),
            }
        self._saved = (self._changes, progress)
        return progress

    def whole_progress(self) -> dict[str, Any]:
        """Every piece held, by reference, grouped as the strategy and the ready rows hold them;
        with a ``length_fn``, also the positions each piece's document reserves (``RESERVED``),
        so a restore plans without fetching the records.

        The references, in the order open groups, ready rows, span, inherited, are one compact
        encoding (``REFS``, see ``_refs``) cut by ``SECTIONS`` and the group sizes. Every piece's
        reference was packed when it arrived, and the slots in state order are kept as the
        strategy and the ready rows change, so a state is one gather of packed words by slot and
        its base64, not a pass over the buffer."""
        slots, sections, open_sizes, ready_sizes = self._state_order()
        progress = {
            REFS: self._table.encode(slots),
            SECTIONS: sections,
            OPEN_SIZES: open_sizes,
            READY_SIZES: ready_sizes,
            EXHAUSTED: self._exhausted,
            STATS: dict(self.counts),
        }
        if self._reserves:
            progress[RESERVED] = self._table.extras(slots)
        return progress

    def listed_progress(self) -> dict[str, Any]:
        """``whole_progress`` with the references as lists (``listed``'s form), built from the
        pieces without packing them: what ``resolved`` gives."""
        slots, (opened, ready, span, _), open_sizes, ready_sizes = self._state_order()
        pieces, prefixes = self._pieces, dict[RecordKey, list[Any]]()

        def ref(slot: int) -> list[Any]:
            key = pieces[slot].key
            prefix = prefixes.get(key[:-2])
            if prefix is None:
                prefix = prefixes[key[:-2]] = saved_prefix(key[:-2])
            return [*prefix, *pieces[slot].ref[-4:]]

        refs = [ref(slot) for slot in slots.tolist()]
        progress: dict[str, Any] = {
            OPEN: refs[:opened],
            READY: refs[opened : opened + ready],
            SPAN: refs[opened + ready] if span else [],
            INHERITED: refs[opened + ready + span :],
            OPEN_SIZES: open_sizes,
            READY_SIZES: ready_sizes,
            EXHAUSTED: self._exhausted,
            STATS: dict(self.counts),
        }
        if self._reserves:
            progress[RESERVED] = self._table.extras(slots)
        return progress

    def _state_order(self) -> tuple[np.ndarray, list[int], list[int], list[int]]:
        """The slots of every piece held in state order (open groups, ready rows, span,
        inherited), how many belong to each of the four, the open groups' sizes and the ready
        rows' sizes."""
        order = self._packer.state_order()
        ready_slots, ready_sizes = self._ready_state()
        span = np.array([self._span] if self._span is not None else [], dtype=np.intp)
        inherited = self._inherited[self._inherited_taken :]
        opened = [self._open_slots.of(order.pieces), self._whole_slots.of(order.whole)[order.whole_from :]]
        slots = np.concatenate([*opened, ready_slots, span, inherited])
        sections = [len(opened[0]) + len(opened[1]), len(ready_slots), len(span), len(inherited)]
        return slots, sections, order.sizes, ready_sizes

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
        each time), fetch every record now, in one call, as before. A state saved as a base
        and the events since (``progress``) loads the base, then replays the events by
        planning alone: the documents they took are fetched like the base's."""
        since = _since(state, path)
        whole = state if since is None else since[0]
        fetcher = Refetcher(pack.upstream.fetch_many, pack._documents.read, path, partial(key_problem, pack.upstream))
        listed_whole = listed(whole, path)
        entries = _entries(listed_whole)
        reserved = saved_reserved(listed_whole, len(entries), pack.length_fn is not None, path)
        lazy = reserved is not None and not _reads_streams(pack.upstream)
        extras = iter(reserved or ())
        if not lazy:
            fetcher.fetch(entries)

        def make(entry: Any, where: str) -> Piece:
            return fetcher.lazy(entry, where, next(extras)) if lazy else fetcher.piece(entry, where)

        rows = cls._loaded(pack.upstream, pack._documents, packer, whole, listed_whole, path, dict(counts), make)
        fetcher.parsed_all()
        rows._fetcher = fetcher
        if since is not None:
            rows._replay(since[1], since[2], path)
            if not lazy:
                fetcher.fill(rows._pieces)
        if not lazy or all(held.document is not None for held in rows._pieces.values()):
            rows._fetcher = None
        rows.counts = counts
        return rows

    @classmethod
    def _loaded(
        cls,
        upstream: Node[Any] | None,
        documents: Documents,
        packer: Packer,
        state: dict[str, Any],
        listed_state: dict[str, Any],
        path: str,
        counts: dict[str, int],
        make: Callable[[Any, str], Piece],
        adopt: bool = True,
    ) -> BufferedRows:
        """The rows of a whole ``state`` (no events; ``listed_state`` is its ``listed`` form), each
        saved reference made a piece by ``make``; a compact state becomes the base of the next
        states. Without ``adopt`` (rows that are never saved) the references are not packed."""
        seq_len = documents.seq_len
        compact = state.get(REFS)
        table = RefTable()
        if compact is not None and adopt:  # checked by ``listed``: the pieces are saved again as they were saved
            table.adopt(compact)
        open_groups = grouped(listed_state, OPEN, OPEN_SIZES, path)
        ready_rows = grouped(listed_state, READY, READY_SIZES, path)
        span_ref = require(listed_state, SPAN, list, path)
        exhausted = require(listed_state, EXHAUSTED, bool, path)
        inherited_refs = require(listed_state, INHERITED, list, path)
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
            if not items or (used > seq_len and len(items) > 1) or len(items) > packer.max_items:
                raise StateError(f"{path}: a ready row {row} does not fit a row of seq_len={seq_len}")
            ready.append(items)
        span = load(span_ref, SPAN) if span_ref else None
        inherited = np.array([load(entry, INHERITED) for entry in inherited_refs], dtype=np.intp)

        try:
            packer.restore([[(item, pieces[item].cost) for item in group] for group in groups])
        except ValueError as exc:
            raise StateError(f"{path}: the {OPEN} groups do not fit the packing strategy: {exc}") from exc
        rows = cls(cast("Node[Any]", upstream), documents, packer, counts)
        rows._pieces, rows._table = pieces, table
        rows._ready, rows._span, rows._exhausted = ready, span, exhausted
        rows._inherited = inherited
        if compact is not None:  # a copy: the caller's state may change after set_state
            rows._rebase(copy.deepcopy({key: state[key] for key in PROGRESS_ENTRIES if key in state}))
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
    tools and tests that read them; ``set_state`` takes either form); a base and the log since
    are resolved into the whole state they stand for first."""
    return listed(state, str(state.get("kind", "Pack")))


PROGRESS_ENTRIES = (REFS, SECTIONS, OPEN_SIZES, READY_SIZES, EXHAUSTED, STATS, RESERVED)
"""The entries of a whole progress in the compact form, in the order ``whole_progress`` writes them."""
SINCE_ENTRIES = (BASE_PROGRESS, EVENTS, EVENT_ORIGINS)
"""The entries of a progress saved as a base and the events since."""


def _since(state: dict[str, Any], path: str) -> tuple[dict[str, Any], Any, Any] | None:
    """``(base, events, origins)`` of a state saved as a base and the events since, else None."""
    if not any(key in state for key in SINCE_ENTRIES):
        return None
    base = require(state, BASE_PROGRESS, dict, path)
    if REFS not in base or any(key in base for key in SINCE_ENTRIES):
        raise StateError(f"{path}: state entry {BASE_PROGRESS!r} is not a whole progress in the compact form")
    return base, require(state, EVENTS, list, path), require(state, EVENT_ORIGINS, list, path)


def _entries(state: dict[str, Any]) -> list[tuple[Any, str]]:
    """``(reference, where)`` for every piece of a listed state, in its order (malformed lists skipped:
    loading its rows names them)."""
    lists = {key: state.get(key) for key in (OPEN, READY, SPAN, INHERITED)}
    return [
        (entry, key)
        for key, value in lists.items()
        if isinstance(value, list) and value
        for entry in ([value] if key == SPAN else value)
    ]


def resolved(state: dict[str, Any], path: str) -> dict[str, Any]:
    """A packer state saved as a base and the events since as the whole state it stands for, its
    references as lists (``listed``): the strategy (from the state's options) replays the events
    over the base's pieces by planning alone (no record is read), then lists every piece held,
    as a state taken then would save them."""
    since = _since(state, path)
    if since is None:
        return state
    seq_len, strategy, buffer_size = (require(state, key, kind, path) for key, kind in _PLAN_OPTIONS)
    max_documents = state.get(MAX_DOCUMENTS)
    try:
        packer = make_packer(strategy, seq_len, buffer_size, max_documents)
    except (TypeError, ValueError) as exc:
        raise StateError(f"{path}: the state's packing options are not valid: {exc}") from exc
    documents = Documents(str(state.get("kind", "Pack")), seq_len, "split", "input_ids", None)
    base, events, origins = since
    listed_base = listed(base, path)
    extras = iter(saved_reserved(listed_base, len(_entries(listed_base)), LENGTH_FN in state, path) or [])

    prefixes: dict[tuple[int, ...], RecordKey] = {}  # the base's references share their prefixes

    def make(entry: Any, where: str) -> Piece:
        parts = reference_parts(entry, prefixes)
        if parts is None or parts[1] >= parts[2]:
            raise StateError(f"{path}: {where} entry {entry!r:.80} is not a piece reference")
        return piece(*parts, None, next(extras, 0))

    rows = BufferedRows._loaded(
        None, documents, packer, base, listed_base, path, dict.fromkeys(COUNTERS, 0), make, adopt=False
    )
    rows._replay(events, origins, path)
    rows._reserves = LENGTH_FN in state
    progress = rows.listed_progress()
    lists = {key: progress.pop(key) for key in (OPEN, READY, SPAN, INHERITED)}
    reserved = progress.pop(RESERVED, None)
    whole: dict[str, Any] = {}
    for key, value in state.items():  # in the order ``listed`` gives a whole state's entries
        if key == BASE_PROGRESS:
            whole.update((entry, saved) for entry, saved in progress.items() if entry != STATS)
        elif key == STATS:
            whole[STATS] = value
            if reserved is not None:
                whole[RESERVED] = reserved
        elif key not in SINCE_ENTRIES:
            whole[key] = value
    whole.update(lists)
    return whole


_PLAN_OPTIONS = ((SEQ_LEN, int), (STRATEGY, str), (BUFFER_SIZE, int))


def listed(state: dict[str, Any], path: str) -> dict[str, Any]:
    """``state`` with its references as lists, one per piece, under ``OPEN``, ``READY``,
    ``SPAN`` and ``INHERITED``: the form states took before ``REFS`` (which still load as they
    are), and what ``restored`` and ``rescaled`` read. A state saved as a base and the events
    since is ``resolved`` first."""
    if any(key in state for key in SINCE_ENTRIES):
        return resolved(state, path)
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


def origin_key(upstream: Node[Any], key: RecordKey) -> RecordKey:
    """``key`` as its record's origin (``core.keys``): a stride key ``(Stride(c, C), epoch, k)``
    as ``(epoch, leaf index)`` of the record at that position, behind the names of the mix
    components it came through; other keys as they are."""
    node: Node[Any] | None = upstream
    while isinstance(node, PASS_KEYS):
        node = node.upstream
    if isinstance(node, Mix) and len(key) > 2 and key[0] in node.components:
        return (key[0], *origin_key(node.components[key[0]], key[1:]))
    if isinstance(node, IndexedNode) and len(key) == 3 and isinstance(key[0], Stride):
        return (key[1], node._leaf_records([key])[0])
    return key


def key_problem(upstream: Node[Any], key: RecordKey) -> str | None:
    """What is wrong with ``key``, where ``upstream`` can tell without fetching (None where it
    cannot, or nothing is): an indexed chain knows its leaf's length, a mix its components;
    other nodes leave the check to the fetch when the key's row is due. A module function, so
    that a restored packer holding it (``partial(key_problem, upstream)``) still pickles."""
    node: Node[Any] | None = upstream
    while isinstance(node, PASS_KEYS):
        node = node.upstream
    if isinstance(node, Mix):
        name = key[0] if len(key) > 2 else None
        if name not in node.components:
            return f"{key!r} does not name a component of the mix first"
        return key_problem(node.components[name], key[1:])
    if isinstance(node, IndexedNode) and len(key) == 3 and isinstance(key[0], Stride):
        return node.stride_problem(key[0], key[1], [key[2]])
    if isinstance(node, IndexedNode) and len(key) == 2:
        size = len(node.leaf)
        return None if key[1] < size else f"record index {key[1]} out of range [0, {size})"
    return None
