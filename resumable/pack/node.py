"""Pack: token sequences into fixed-length rows, checkpointed by reference.

The packer holds documents in a bounded buffer, but its state never holds tokens: every
buffered piece is saved as ``[*key, token_start, token_end]``: the provenance key of the record
it came from (``upstream.last_key()``: ``(epoch, index in the leaf source)``, the same on every
rank, so pieces can move between consumers in an elastic rescale, behind the names of the mix
components it came through) plus a token range. A restore fetches the whole buffer again in one
``upstream.fetch_many(keys)`` call, so its cost is bounded by the buffer, never by the position
in the epoch.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, NamedTuple

import numpy as np

from resumable.core.indexed import EPOCH, MAX_CHUNK, POSITION, IndexedNode
from resumable.core.keys import RecordKey
from resumable.core.node import Node
from resumable.core.state import ENDED, UPSTREAM, require, require_adjacent_epochs, require_count, short_repr
from resumable.errors import ConfigError, ResumableError, SourceError, StateError
from resumable.ops.mix import Mix
from resumable.pack.epoch import NO_INHERITED_ROWS, InheritedRows, Plan, Stride, share
from resumable.pack.rows import RowFormat, Segment, collate_rows, cu_seqlens_length
from resumable.pack.strategies import STRATEGIES, NextFit, Packer, Row, best_fit_decreasing, make_packer

DEFAULT_BUFFER_SIZE = 1000
OVERLONG_POLICIES = ("split", "truncate", "drop")
POSITION_MODES = ("restart", "continue")

# Options that shape the rows (``_config``): a state saved with other values is rejected.
SEQ_LEN = "seq_len"
STRATEGY = "strategy"
BUFFER_SIZE = "buffer_size"
OVERLONG = "overlong"
SPLIT_POSITIONS = "split_positions"
MASK_FIRST_TOKEN = "mask_first_token"
MAX_DOCUMENTS = "max_documents"
INPUT_FIELD = "input_field"
LABELS_FIELD = "labels_field"
PAD_TOKEN_ID = "pad_token_id"

# Progress of a streaming packer: piece references, flat, and how many of them form each group.
OPEN = "open"
OPEN_SIZES = "open_sizes"
READY = "ready"
READY_SIZES = "ready_sizes"
SPAN = "span"
EXHAUSTED = "exhausted"
# Pieces handed over by other consumers in an elastic rescale, packed before the upstream's.
INHERITED = "inherited"
# Progress of a whole-epoch plan (``strategy="bfd"`` without ``buffer_size``); the epoch is the
# indexed upstream's, saved in its state. Rows handed out this epoch (inherited ones first), the
# plan's rows once it is made, and after a rescale the inherited rows: whole rows of old
# consumers' plans, as piece references under INHERITED cut into rows by INHERITED_SIZES.
EMITTED = "emitted"
PLANNED = "planned"
INHERITED_SIZES = "inherited_sizes"
# Counters, in both modes.
STATS = "stats"

DOCUMENTS = "documents"
SPLIT = "split"
TRUNCATED = "truncated"
DROPPED = "dropped"
EMPTY = "empty"
ROWS = "rows"
PADDING = "padding"
COUNTERS = (DOCUMENTS, SPLIT, TRUNCATED, DROPPED, EMPTY, ROWS, PADDING)
DOCUMENT_COUNTERS = (DOCUMENTS, SPLIT, TRUNCATED, DROPPED, EMPTY)

INT64_MAX = int(np.iinfo(np.int64).max)  # rows are int64: larger ids would wrap to negative ones
PIECE_FIELDS = 4
"""Ints that end a piece reference ``[*component names, epoch, record, token_start, token_end]``."""


@dataclass(frozen=True)
class PackStats:
    """What the packer did this epoch.

    ``documents`` counts documents with tokens in the rows (``split`` and ``truncated`` ones
    included), ``dropped`` overlong documents left out, ``empty`` documents without tokens.
    Document counters grow when the packer takes a document (it may still be buffered);
    ``rows`` and ``padding`` (tokens) grow when a row is handed out.
    """

    seq_len: int
    documents: int = 0
    split: int = 0
    truncated: int = 0
    dropped: int = 0
    empty: int = 0
    rows: int = 0
    padding: int = 0

    @property
    def tokens(self) -> int:
        """Non-padding tokens handed out."""
        return self.rows * self.seq_len - self.padding

    @property
    def efficiency(self) -> float:
        """Non-padding tokens / (rows * seq_len); 0.0 before the first row."""
        return self.tokens / (self.rows * self.seq_len) if self.rows else 0.0


class Piece(NamedTuple):
    """Tokens ``[start, end)`` of a buffered record, and its reference for the state."""

    start: int
    end: int
    tokens: np.ndarray
    labels: np.ndarray | None
    ref: list[Any]  # [*key, start, end], built once: get_state shares it, nothing changes it

    @property
    def key(self) -> RecordKey:
        return tuple(self.ref[:-2])

    def segment(self) -> Segment:
        return Segment(self.tokens, self.labels, self.start, self.end)


def _piece(key: RecordKey, start: int, end: int, tokens: np.ndarray, labels: np.ndarray | None) -> Piece:
    return Piece(start, end, tokens, labels, [*key, start, end])


class Pack(Node[dict[str, np.ndarray]]):
    """Pack documents' token ids into rows of exactly ``seq_len`` tokens.

    Options:

    - ``strategy``: ``"best_fit"`` (default; best-fit-decreasing rounds over a buffer of
      ``buffer_size`` documents), ``"first_fit"`` (each document into the oldest open row with
      room; at most ``buffer_size`` documents in open rows), ``"greedy"`` (next-fit: one open row,
      closed when the next document does not fit) or ``"bfd"`` (best-fit-decreasing: over the whole
      epoch of an indexed upstream when ``buffer_size`` is not given, else over consecutive
      windows of ``buffer_size`` documents).
    - ``buffer_size``: documents the packer may hold (default 1000; see ``strategy`` for bfd).
    - ``overlong``: documents longer than ``seq_len`` are ``"split"`` (full rows of ``seq_len``,
      then the tail packed like any document), ``"truncate"`` (first ``seq_len`` tokens) or
      ``"drop"``.
    - ``split_positions``: ``"restart"`` (a split tail's positions start at 0) or ``"continue"``
      (they continue from the tail's offset in the document).
    - ``mask_first_token``: labels -100 at the first token of every piece, so no token is
      trained to follow the previous document.
    - ``max_documents``: pieces per row at most (bounds the length of ``cu_seqlens``).
    - ``input_field`` / ``labels_field``: record fields holding the token ids and optional labels
      (``labels_field=None``: labels are always the token ids).
    - ``pad_token_id``: ``input_ids`` value at padding.

    Rows are dicts of numpy arrays (see ``resumable.pack.rows``); ``Pack.collate`` stacks them
    into batches. ``stats`` reports what the packer did. Once the upstream ends, the open rows
    are flushed, so an epoch's last rows come before its StopIteration; after ``.repeat()`` the
    stream never ends and documents of consecutive epochs share rows.
    """

    kind = "Pack"

    collate = staticmethod(collate_rows)

    def __init__(
        self,
        upstream: Node[Any],
        seq_len: int,
        *,
        strategy: str = "best_fit",
        buffer_size: int | None = None,
        overlong: str = "split",
        split_positions: str = "restart",
        mask_first_token: bool = False,
        max_documents: int | None = None,
        input_field: str = "input_ids",
        labels_field: str | None = "labels",
        pad_token_id: int = 0,
    ) -> None:
        super().__init__(upstream)
        kind = self.kind
        _check_positive_int(kind, SEQ_LEN, seq_len)
        _check_choice(kind, STRATEGY, strategy, STRATEGIES)
        _check_choice(kind, OVERLONG, overlong, OVERLONG_POLICIES)
        _check_choice(kind, SPLIT_POSITIONS, split_positions, POSITION_MODES)
        if buffer_size is not None:
            _check_positive_int(kind, BUFFER_SIZE, buffer_size)
        if max_documents is not None:
            _check_positive_int(kind, MAX_DOCUMENTS, max_documents)
        if not isinstance(mask_first_token, bool):
            raise ConfigError(f"{kind}: mask_first_token must be a bool, got {mask_first_token!r}")
        if not isinstance(input_field, str):
            raise ConfigError(f"{kind}: input_field must be a str, got {input_field!r}")
        if labels_field is not None and not isinstance(labels_field, str):
            raise ConfigError(f"{kind}: labels_field must be a str or None, got {labels_field!r}")
        if isinstance(pad_token_id, bool) or not isinstance(pad_token_id, int):
            raise ConfigError(f"{kind}: pad_token_id must be an int, got {pad_token_id!r}")

        if not upstream._traceable():
            raise ConfigError(_untraceable(kind, upstream))
        self._whole_epoch = strategy == "bfd" and buffer_size is None
        if self._whole_epoch and not isinstance(upstream, IndexedNode):
            raise ConfigError(
                f"{kind}: strategy='bfd' without buffer_size plans the whole epoch and needs random "
                f"access, but the upstream {upstream!r} is not indexed (filter, repeat and batch are "
                "not); give buffer_size=N to pack windows of N documents instead"
            )
        self.seq_len = seq_len
        self.strategy = strategy
        self.buffer_size = None if self._whole_epoch else (buffer_size or DEFAULT_BUFFER_SIZE)
        self.overlong = overlong
        self.split_positions = split_positions
        self.mask_first_token = mask_first_token
        self.max_documents = max_documents
        self.input_field = input_field
        self.labels_field = labels_field
        self.pad_token_id = pad_token_id
        self._format = RowFormat(
            seq_len=seq_len,
            cu_len=cu_seqlens_length(seq_len, max_documents),
            pad_token_id=pad_token_id,
            mask_first_token=mask_first_token,
            continue_positions=split_positions == "continue",
        )
        self._reset()

    def _reset(self) -> None:
        """Empty buffers and counters: a new epoch."""
        self._packer = self._new_packer()
        self._pieces: dict[int, Piece] = {}
        self._next_id = 0
        self._ready: deque[Row] = deque()
        self._span: Piece | None = None
        self._inherited: deque[Piece] = deque()
        self._exhausted = False
        # Per origin (mix components): the epochs where the current run of documents without
        # tokens began and where it is now.
        self._barren: dict[RecordKey, list[int]] = {}
        self._counts = dict.fromkeys(COUNTERS, 0)
        self._plan: Plan | None = None
        self._emitted = 0
        self._inherited_rows = NO_INHERITED_ROWS
        self._inherited_now = 0  # the inherited rows of the epoch being read, the first ones
        self._cached: tuple[RecordKey, tuple[np.ndarray, np.ndarray | None]] | None = None

    def _new_packer(self) -> Packer:
        """The streaming strategy. A whole-epoch plan packs in ``_make_plan``; its packer stays empty."""
        if self.buffer_size is None:
            return NextFit(self.seq_len)
        return make_packer(self.strategy, self.seq_len, self.buffer_size, self.max_documents)

    # -- public views ------------------------------------------------------------------------

    @property
    def stats(self) -> PackStats:
        """Counters of this epoch (a snapshot)."""
        return PackStats(self.seq_len, **self._counts)

    def pending_keys(self) -> list[RecordKey]:
        """``(epoch, record)`` of every document taken from upstream but not fully handed out,
        once each: exactly the records a restore fetches again. For a whole-epoch plan, the
        documents of the rows not yet handed out."""
        if self._whole_epoch:
            inherited = self._inherited_rows
            first_left = inherited.bounds[min(self._emitted, self._inherited_now)]
            keys = [(ref[0], ref[1]) for ref in inherited.refs[first_left:]]
            if self._plan is not None:
                plan, epoch = self._plan, self._plan_epoch()
                first = max(self._emitted - self._inherited_now, 0)
                keys.extend((epoch, index) for index in plan.records[plan.order[plan.bounds[first] :]].tolist())
            return list(dict.fromkeys(keys))
        return list(dict.fromkeys(piece.key for piece in self._buffered()))

    def _buffered(self) -> Iterator[Piece]:
        pieces = self._pieces
        yield from self._inherited
        if self._span is not None:
            yield self._span
        for row in self._ready:
            yield from (pieces[item] for item in row)
        for group in self._packer.groups():
            yield from (pieces[item] for item in group)

    # -- iteration ---------------------------------------------------------------------------

    def _next(self) -> dict[str, np.ndarray]:
        if self._whole_epoch:
            return self._next_planned()
        while True:
            if self._span is not None:
                return self._emit_span()
            if self._ready:
                return self._emit(self._ready.popleft())
            if self._exhausted:
                raise StopIteration
            self._pull()

    def _pull(self) -> None:
        """Take one document from upstream (or an inherited piece); at its end, flush the open rows."""
        if self._inherited:
            piece = self._inherited.popleft()
            full = piece.start + (piece.end - piece.start) // self.seq_len * self.seq_len
            self._add(piece.key, piece.start, full, piece.end, piece.tokens, piece.labels)
            return
        upstream = self.upstream
        try:
            record = next(upstream)  # type: ignore[call-overload,arg-type]
        except StopIteration:
            self._exhausted = True
            self._ready.extend(self._packer.flush())
            return
        key = upstream.last_key()  # type: ignore[union-attr]
        if key is None:
            raise ConfigError(_untraceable(self.kind, upstream))
        tokens, labels = self._read(record, key)
        full, end = self._cut(len(tokens), self._counts)
        if not end:
            self._check_barren(key)
            return
        self._barren.clear()
        self._add(key, 0, full, end, tokens, labels)

    def _add(
        self, key: RecordKey, start: int, full: int, end: int, tokens: np.ndarray, labels: np.ndarray | None
    ) -> None:
        """Tokens ``[start, full)`` of a record make whole rows of their own, ``[full, end)``
        one piece for the strategy."""
        if full > start:
            self._span = _piece(key, start, full, tokens, labels)
        if end > full:
            item = self._next_id
            self._next_id = item + 1
            self._pieces[item] = _piece(key, full, end, tokens, labels)
            self._ready.extend(self._packer.add(item, end - full))

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
        raise SourceError(
            f"{self.kind}: no document of epoch {first + 1}{where} has tokens to pack (all are empty"
            f"{' or dropped as longer than seq_len' if self.overlong == 'drop' else ''}), so no row can come"
        )

    def _upstream_mix(self) -> Mix[Any] | None:
        """The mix this packer's documents come from, through pass-through nodes, if any."""
        node = self.upstream
        while node is not None and not isinstance(node, Mix):
            node = node.upstream
        return node

    def _cut(self, length: int, counts: dict[str, int]) -> tuple[int, int]:
        """Apply the overlong policy to a document of ``length`` tokens and count it.

        Returns ``(full, end)``: tokens ``[0, full)`` make whole rows of their own (a multiple
        of ``seq_len``), tokens ``[full, end)`` are one piece to pack; ``(0, 0)`` keeps nothing.
        """
        seq_len = self.seq_len
        if length == 0:
            counts[EMPTY] += 1
            return 0, 0
        if length <= seq_len:
            counts[DOCUMENTS] += 1
            return (length, length) if length == seq_len else (0, length)
        if self.overlong == "drop":
            counts[DROPPED] += 1
            return 0, 0
        counts[DOCUMENTS] += 1
        if self.overlong == "truncate":
            counts[TRUNCATED] += 1
            return seq_len, seq_len
        counts[SPLIT] += 1
        return length - length % seq_len, length

    def _read(self, record: Any, key: RecordKey) -> tuple[np.ndarray, np.ndarray | None]:
        """The record's token ids (and labels if it has them) as 1-d integer numpy arrays."""
        field = self.input_field
        if not isinstance(record, Mapping):
            raise SourceError(
                f"{self.kind}: record {_key_text(key)} is a {type(record).__name__}, "
                f"expected a mapping with a {field!r} field"
            )
        if field not in record:
            names = ", ".join(repr(name) for name in list(record)[:8])
            raise SourceError(
                f"{self.kind}: record {_key_text(key)} has no {field!r} field (it has {names or 'none'}); "
                "tokenize before pack(), or set input_field"
            )
        tokens = self._ids(record[field], key, field)
        labels_field = self.labels_field
        if labels_field is None or labels_field not in record:
            return tokens, None
        labels = self._ids(record[labels_field], key, labels_field)
        if len(labels) != len(tokens):
            raise SourceError(
                f"{self.kind}: record {_key_text(key)} has {len(labels)} {labels_field!r} "
                f"for {len(tokens)} {field!r}"
            )
        return tokens, labels

    def _ids(self, value: Any, key: RecordKey, field: str) -> np.ndarray:
        try:
            array = value if isinstance(value, np.ndarray) else np.asarray(value)
        except (TypeError, ValueError) as exc:
            raise SourceError(f"{self.kind}: record {_key_text(key)} field {field!r} is not an array: {exc}") from exc
        if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
            raise SourceError(
                f"{self.kind}: record {_key_text(key)} field {field!r} must be a 1-d sequence of integer ids, "
                f"got shape {array.shape} of {array.dtype}"
            )
        if array.dtype == np.uint64 and array.size and int(array.max()) > INT64_MAX:
            raise SourceError(
                f"{self.kind}: record {_key_text(key)} field {field!r} holds id {int(array.max())}, above the "
                f"int64 rows can hold ({INT64_MAX})"
            )
        return array

    def _emit_span(self) -> dict[str, np.ndarray]:
        """The next whole row of a long document."""
        span: Piece = self._span  # type: ignore[assignment]
        stop = span.start + self.seq_len
        self._span = _piece(span.key, stop, span.end, span.tokens, span.labels) if stop < span.end else None
        self._counts[ROWS] += 1
        return self._format.build([Segment(span.tokens, span.labels, span.start, stop)])

    def _emit(self, row: Row) -> dict[str, np.ndarray]:
        pieces = self._pieces
        segments = [pieces.pop(item).segment() for item in row]
        self._count_row(segments)
        return self._format.build(segments)

    def _count_row(self, segments: list[Segment]) -> None:
        counts = self._counts
        counts[ROWS] += 1
        counts[PADDING] += self.seq_len - sum(segment.end - segment.start for segment in segments)

    # -- whole-epoch plan (strategy="bfd" without buffer_size) -----------------------------

    def _next_planned(self) -> dict[str, np.ndarray]:
        """The next row of this epoch: the inherited rows first (a rescale handed them over), then
        the plan of the epoch, made when its first row is due."""
        epoch = self._plan_epoch()
        if self._emitted < self._inherited_now:
            pieces = self._inherited_rows.row(self._emitted)
        else:
            if self._plan is None:
                self._plan = self._make_plan(epoch, self._own_records(epoch))
                self._counts.update(self._plan.counts)
            plan, row = self._plan, self._emitted - self._inherited_now
            if row == plan.rows:
                raise StopIteration
            pieces = [[epoch, int(plan.records[i]), int(plan.starts[i]), int(plan.ends[i])] for i in plan.row(row)]
        segments = []
        for key_epoch, record, start, end in pieces:
            tokens, labels = self._fetch_cached((key_epoch, record))
            segments.append(Segment(tokens, labels, start, end))
        self._emitted += 1
        self._count_row(segments)
        return self._format.build(segments)

    def _plan_epoch(self) -> int:
        """The epoch a whole-epoch plan packs: the indexed upstream's (it is never iterated)."""
        return self.upstream.epoch  # type: ignore[union-attr]

    def _own_records(self, epoch: int) -> Iterator[tuple[int, Any]]:
        """``(leaf index, record)`` of this consumer's epoch, read by random access."""
        upstream: IndexedNode[Any] = self.upstream  # type: ignore[assignment]
        return upstream._scan(0, upstream._length(epoch), epoch, skip=True)

    def _fetch_cached(self, key: RecordKey) -> tuple[np.ndarray, np.ndarray | None]:
        """A record's arrays; the last one is kept, as a long document's rows come in a row."""
        if self._cached is None or self._cached[0] != key:
            self._cached = (key, self._read(self.upstream.fetch(key), key))  # type: ignore[union-attr]
        return self._cached[1]

    def _make_plan(self, epoch: int, records: Iterator[tuple[int, Any]]) -> Plan:
        """Learn the length of every ``(leaf index, record)`` of the epoch and pack them."""
        seq_len = self.seq_len
        counts = dict.fromkeys(DOCUMENT_COUNTERS, 0)
        kept: list[tuple[int, int, int]] = []  # (record index, full, end) of documents with tokens
        for index, record in records:
            tokens, _ = self._read(record, (epoch, index))
            full, end = self._cut(len(tokens), counts)
            if end:
                kept.append((index, full, end))
        documents = np.array(kept, dtype=np.int64).reshape(-1, 3)
        # A document gives full // seq_len whole rows, then its tail if any: piece r starts at r * seq_len.
        pieces = documents[:, 1] // seq_len + (documents[:, 2] > documents[:, 1])
        first = np.repeat(np.cumsum(pieces) - pieces, pieces)
        starts = (np.arange(int(pieces.sum()), dtype=np.int64) - first) * seq_len
        ends = np.minimum(starts + seq_len, np.repeat(documents[:, 2], pieces))
        indices = np.repeat(documents[:, 0], pieces)

        lengths = ends - starts
        packed = np.flatnonzero(lengths < seq_len)
        rows = [[index] for index in np.flatnonzero(lengths == seq_len).tolist()]
        for row in best_fit_decreasing(lengths[packed], seq_len, self.max_documents):
            rows.append(packed[row].tolist())
        rows.sort(key=lambda row: row[0])  # the order of the (shuffled) upstream
        order = np.fromiter((index for row in rows for index in row), dtype=np.int64, count=len(lengths))
        bounds = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum([len(row) for row in rows], out=bounds[1:])
        return Plan(indices, starts, ends, order, bounds, counts)

    # -- epochs and state --------------------------------------------------------------------

    def _on_epoch_start(self) -> None:
        inherited = self._inherited_rows
        self._reset()
        if len(inherited):  # a rescale across an epoch boundary handed over rows of the epoch now starting
            self._set_inherited(inherited.of_epoch(self._plan_epoch()))

    def _set_inherited(self, rows: InheritedRows) -> None:
        self._inherited_rows, self._inherited_now = rows, rows.count(self._plan_epoch())

    def _config(self) -> dict[str, Any]:
        return {
            SEQ_LEN: self.seq_len,
            STRATEGY: self.strategy,
            BUFFER_SIZE: self.buffer_size,
            OVERLONG: self.overlong,
            SPLIT_POSITIONS: self.split_positions,
            MASK_FIRST_TOKEN: self.mask_first_token,
            MAX_DOCUMENTS: self.max_documents,
            INPUT_FIELD: self.input_field,
            LABELS_FIELD: self.labels_field,
            PAD_TOKEN_ID: self.pad_token_id,
        }

    def _progress(self) -> dict[str, Any]:
        if self._whole_epoch:
            progress: dict[str, Any] = {EMITTED: self._emitted, STATS: dict(self._counts)}
            if self._plan is not None:
                progress[PLANNED] = self._plan.rows
            if len(self._inherited_rows):
                progress[INHERITED], progress[INHERITED_SIZES] = self._inherited_rows.refs, self._inherited_rows.sizes
            return progress
        pieces = self._pieces
        groups = self._packer.groups()
        return {
            OPEN: [pieces[item].ref for group in groups for item in group],
            OPEN_SIZES: [len(group) for group in groups],
            READY: [pieces[item].ref for row in self._ready for item in row],
            READY_SIZES: [len(row) for row in self._ready],
            SPAN: self._span.ref if self._span is not None else [],
            INHERITED: [piece.ref for piece in self._inherited],
            EXHAUSTED: self._exhausted,
            STATS: dict(self._counts),
        }

    def _restore(self, state: dict[str, Any], path: str) -> None:
        saved = require(state, STATS, dict, path)
        counts = {name: require_count(saved, name, f"{path} > {STATS}") for name in COUNTERS}
        if self._whole_epoch:
            self._restore_plan(state, path, counts)
            return
        open_groups = _grouped(state, OPEN, OPEN_SIZES, path)
        ready_rows = _grouped(state, READY, READY_SIZES, path)
        span_ref = require(state, SPAN, list, path)
        exhausted = require(state, EXHAUSTED, bool, path)

        inherited_refs = require(state, INHERITED, list, path)
        fetcher = _Refetcher(self, path)
        fetcher.fetch(
            [(entry, OPEN) for group in open_groups for entry in group]
            + [(entry, READY) for row in ready_rows for entry in row]
            + ([(span_ref, SPAN)] if span_ref else [])
            + [(entry, INHERITED) for entry in inherited_refs]
        )
        pieces: dict[int, Piece] = {}

        def load(entry: Any, where: str) -> int:
            piece = fetcher.piece(entry, where)
            if piece.end - piece.start > self.seq_len:
                raise StateError(f"{path}: {where} piece {entry} is longer than seq_len={self.seq_len}")
            item = len(pieces)
            pieces[item] = piece
            return item

        groups = [[load(entry, OPEN) for entry in group] for group in open_groups]
        ready: deque[Row] = deque()
        for row in ready_rows:
            items = [load(entry, READY) for entry in row]
            used = sum(pieces[item].end - pieces[item].start for item in items)
            if not items or used > self.seq_len or len(items) > (self.max_documents or self.seq_len):
                raise StateError(f"{path}: a ready row {row} does not fit a row of seq_len={self.seq_len}")
            ready.append(items)
        span = None
        if span_ref:
            span = fetcher.piece(span_ref, SPAN)
            if (span.end - span.start) % self.seq_len:
                raise StateError(f"{path}: {SPAN} {span_ref} is not a whole number of rows of {self.seq_len}")
        inherited = deque(fetcher.piece(entry, INHERITED) for entry in inherited_refs)

        packer = self._new_packer()
        try:
            packer.restore([[(item, pieces[item].end - pieces[item].start) for item in group] for group in groups])
        except ValueError as exc:
            raise StateError(f"{path}: the {OPEN} groups do not fit strategy {self.strategy!r}: {exc}") from exc
        self._reset()
        self._packer, self._pieces, self._next_id = packer, pieces, len(pieces)
        self._ready, self._span, self._exhausted, self._counts = ready, span, exhausted, counts
        self._inherited = inherited

    def _rescale(self, olds: list[dict[str, Any]], path: str, consumer: int, num_consumers: int) -> dict[str, Any]:
        """A fresh epoch state holding this consumer's share of every old consumer's pieces."""
        if self._whole_epoch:
            return self._rescale_plan(olds, path, consumer, num_consumers)
        pieces: list[Any] = []
        for old in olds:
            self._check_config(old, path)
            pieces.extend(require(old, INHERITED, list, path))
            span = require(old, SPAN, list, path)
            if span:
                pieces.append(span)
            pieces.extend(require(old, READY, list, path))
            pieces.extend(require(old, OPEN, list, path))
        state = self._header()
        state.update({OPEN: [], OPEN_SIZES: [], READY: [], READY_SIZES: [], SPAN: [], EXHAUSTED: False})
        state.update({INHERITED: pieces[consumer::num_consumers], STATS: dict.fromkeys(COUNTERS, 0), ENDED: False})
        return state

    def _rescale_plan(self, olds: list[dict[str, Any]], path: str, consumer: int, num_consumers: int) -> dict[str, Any]:
        """A fresh epoch state holding this consumer's share of the rows the old consumers had
        not handed out: per epoch, the rows left by old consumer 0, then 1, ..., cut into
        contiguous blocks of whole rows. An old consumer's plan is made again only when this
        consumer's block holds rows of it."""
        leftovers = [_Leftover(self, old, index, len(olds), path) for index, old in enumerate(olds)]
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
        state = self._header()
        state.update({EMITTED: 0, STATS: dict.fromkeys(COUNTERS, 0), ENDED: False})
        if sizes:
            state.update({INHERITED: refs, INHERITED_SIZES: sizes})
        return state

    def _olds_for_children(self, olds: list[dict[str, Any]], path: str) -> list[dict[str, Any]]:
        """A whole-epoch plan takes its whole stride from the upstream at once, but leaves its
        cursor at 0: for the rescale of the indexed chain, an old consumer that handed out rows
        of its plan has read its whole stride (those rows are dealt out here), one that has not
        has read none of it (the new consumers plan it again)."""
        if not self._whole_epoch:
            return olds
        moved = []
        for index, old in enumerate(olds):
            leftover = _Leftover(self, old, index, len(olds), path)
            position = leftover.stride.length if leftover.taken else 0
            moved.append({**old, UPSTREAM: {**leftover.upstream, POSITION: position}})
        return moved

    def _restore_plan(self, state: dict[str, Any], path: str, counts: dict[str, int]) -> None:
        """Plan the saved epoch again (one pass over its records) if it was planned or rows of
        it were handed out, check the inherited rows still to hand out against their records, and
        skip the rows handed out."""
        epoch = self._plan_epoch()
        emitted = require_count(state, EMITTED, path)
        inherited = self._saved_inherited(state, epoch, path)
        now = inherited.count(epoch)
        planned = require_count(state, PLANNED, path) if PLANNED in state else None
        plan = None
        if planned is not None or emitted > now:
            try:
                plan = self._make_plan(epoch, self._own_records(epoch))
            except (IndexError, ResumableError) as exc:
                raise StateError(f"{path}: cannot plan epoch {epoch} again: {exc}") from exc
            _check_plan_rows(plan.rows, planned, emitted - now, path)
            counts.update(plan.counts)
        self._check_inherited(inherited, min(emitted, now), path)
        self._reset()
        self._emitted, self._plan, self._counts = emitted, plan, counts
        self._set_inherited(inherited)

    def _saved_inherited(self, state: dict[str, Any], epoch: int, path: str) -> InheritedRows:
        """The inherited rows a state saved (none if it has neither entry); StateError unless
        they are well formed rows of ``epoch`` and the next one."""
        if INHERITED not in state and INHERITED_SIZES not in state:
            return NO_INHERITED_ROWS
        rows = InheritedRows.parse(
            state.get(INHERITED), state.get(INHERITED_SIZES), path, self.seq_len, self.max_documents or self.seq_len
        )
        if rows.epochs and not epoch <= rows.epochs[0] <= rows.epochs[-1] <= epoch + 1:
            epochs = short_repr(sorted(set(rows.epochs)))
            raise StateError(f"{path}: {INHERITED} rows of epochs {epochs}, the upstream is in epoch {epoch}")
        return rows

    def _check_inherited(self, rows: InheritedRows, start: int, path: str) -> None:
        """Check that every piece of the inherited rows from ``start`` on lies inside its record:
        each record is fetched once, in chunks, and only its length kept."""
        refs = rows.refs[rows.bounds[start] :]
        keys = list(dict.fromkeys((ref[0], ref[1]) for ref in refs))
        lengths: dict[RecordKey, int] = {}
        try:
            for begin in range(0, len(keys), MAX_CHUNK):
                chunk = keys[begin : begin + MAX_CHUNK]
                for key, record in zip(chunk, self.upstream.fetch_many(chunk)):  # type: ignore[union-attr]
                    lengths[key] = len(self._read(record, key)[0])
        except (IndexError, ResumableError) as exc:
            raise StateError(f"{path}: the records of the {INHERITED} rows cannot be fetched again: {exc}") from exc
        for ref in refs:
            key = (ref[0], ref[1])
            if ref[3] > lengths[key]:
                raise StateError(
                    f"{path}: {INHERITED} piece {ref} is outside record {_key_text(key)} of {lengths[key]} tokens "
                    "(did the data change?)"
                )


class _Leftover:
    """What one old consumer of a whole-epoch plan had not handed out, in a rescale: the rows
    it had inherited and not handed out, and, once it had handed out rows of its plan, the rest of that
    plan (made again from its stride only when asked for). A consumer that has handed out no
    row of its plan has not taken its stride: the upstream's rescale leaves it to be planned
    again."""

    def __init__(self, pack: Pack, old: dict[str, Any], consumer: int, num_consumers: int, path: str) -> None:
        pack._check_config(old, path)
        self.upstream = require(old, UPSTREAM, dict, path)
        cursor: IndexedNode[Any] = pack.upstream  # type: ignore[assignment]
        self.stride = Stride.of(cursor, self.upstream, consumer, num_consumers, f"{path} > {cursor.kind}")
        self.epoch = self.stride.epoch
        self.emitted = require_count(old, EMITTED, path)
        self.inherited = pack._saved_inherited(old, self.epoch, path)
        self.now = self.inherited.count(self.epoch)
        self.taken = self.emitted > self.now
        self.planned = require_count(old, PLANNED, path) if PLANNED in old else None
        self._pack, self._path = pack, path
        self._plan: Plan | None = None
        if self.taken and self.planned is not None:
            _check_plan_rows(self.planned, None, self.emitted - self.now, path)

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
                plan = pack._make_plan(self.epoch, pack.upstream._scan_leaves(leaves, skip=True))  # type: ignore[union-attr]
            except (IndexError, ResumableError) as exc:
                raise StateError(f"{path}: cannot plan epoch {self.epoch} of an old consumer again: {exc}") from exc
            _check_plan_rows(plan.rows, self.planned, self.emitted - self.now, path)
            self._plan = plan
        return self._plan


class _Refetcher:
    """Turns saved piece references back into pieces, fetching each record once, all of them in
    one ``fetch_many`` call (a stream then reads each file once, in offset order)."""

    def __init__(self, pack: Pack, path: str) -> None:
        self._pack = pack
        self._path = path
        self._records: dict[RecordKey, tuple[np.ndarray, np.ndarray | None]] = {}

    def _ref(self, entry: Any, where: str) -> tuple[RecordKey, int, int]:
        """``(key, token_start, token_end)`` of a saved reference ``[*key, start, end]``: the key
        is an epoch and a record index, behind the names of the mix components it came through."""
        if (
            isinstance(entry, list)
            and len(entry) >= PIECE_FIELDS
            and all(_is_count(value) for value in entry[-PIECE_FIELDS:])
            and all(isinstance(name, str) for name in entry[:-PIECE_FIELDS])
        ):
            return tuple(entry[:-2]), entry[-2], entry[-1]
        raise StateError(
            f"{self._path}: {where} entry {short_repr(entry)} is not "
            "[epoch, record, token_start, token_end] of ints >= 0 (behind mix component names, after a mix)"
        )

    def fetch(self, entries: list[tuple[Any, str]]) -> None:
        """Fetch the records of ``(entry, where)`` references not fetched yet, in one call."""
        keys = list(dict.fromkeys(self._ref(entry, where)[0] for entry, where in entries))
        keys = [key for key in keys if key not in self._records]
        if not keys:
            return
        pack = self._pack
        try:
            records = pack.upstream.fetch_many(keys)  # type: ignore[union-attr]
            for key, record in zip(keys, records):
                self._records[key] = pack._read(record, key)
        except (IndexError, ResumableError) as exc:
            raise StateError(f"{self._path}: the buffered records cannot be fetched again: {exc}") from exc

    def piece(self, entry: Any, where: str) -> Piece:
        key, start, end = self._ref(entry, where)
        self.fetch([(entry, where)])
        tokens, labels = self._records[key]
        if not start < end <= len(tokens):
            raise StateError(
                f"{self._path}: {where} entry {entry} is outside record {_key_text(key)} of {len(tokens)} tokens "
                "(did the data change?)"
            )
        return _piece(key, start, end, tokens, labels)


def _check_plan_rows(rows: int, planned: int | None, handed_out: int, path: str) -> None:
    """StateError unless a plan of ``rows`` rows has the rows a state says it had (``planned``,
    if saved) and the ``handed_out`` rows it counts as handed out."""
    if planned is not None and planned != rows:
        raise StateError(
            f"{path}: state's plan has {planned} rows, planning the epoch again gives {rows} (did the data change?)"
        )
    if handed_out > rows:
        raise StateError(f"{path}: state has {handed_out} rows handed out, the epoch's plan has {rows}")


def _grouped(state: Mapping[str, Any], key: str, sizes_key: str, path: str) -> list[list[Any]]:
    """The piece references under ``key``, cut into groups by the counts under ``sizes_key``."""
    entries = require(state, key, list, path)
    sizes = require(state, sizes_key, list, path)
    if any(isinstance(size, bool) or not isinstance(size, int) or size < 0 for size in sizes):
        raise StateError(f"{path}: state entry {sizes_key!r} is {sizes!r}, expected counts >= 0")
    if sum(sizes) != len(entries):
        raise StateError(f"{path}: {sizes_key!r} counts {sum(sizes)} pieces, {key!r} holds {len(entries)}")
    groups, start = [], 0
    for size in sizes:
        groups.append(entries[start : start + size])
        start += size
    return groups


def _key_text(key: RecordKey) -> str:
    components = "".join(f"mix component {name}, " for name in key[:-2])
    return f"({components}epoch {key[-2]}, record {key[-1]})"


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _untraceable(kind: str, upstream: Any) -> str:
    return (
        f"{kind}: the upstream {upstream!r} cannot trace its items back to indexed records "
        "(last_key() is None), so the packer cannot checkpoint its buffer by reference; build "
        "the pipeline from an indexed source with shuffle/shard/map, then filter/repeat, then pack()"
    )


def _check_positive_int(kind: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{kind}: {name} must be a positive int, got {value!r}")


def _check_choice(kind: str, name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{kind}: unknown {name} {value!r}, expected one of {', '.join(map(repr, choices))}")
