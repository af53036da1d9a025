"""Pieces and their references: a packer's state saves ``[*key, token_start, token_end]`` for
every piece it holds, never tokens, and a restore fetches the records again to cut the same
pieces."""

from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple, Sequence

from resumable.core.keys import RecordKey, Stride, loaded_prefix
from resumable.core.state import require, short_repr
from resumable.errors import ResumableError, StateError
from resumable.pack._entries import PADDING, ROWS
from resumable.pack.rows import Document, Segment

PIECE_FIELDS = 4
"""Ints that end a piece reference ``[*component names, epoch, record, token_start, token_end]``."""


class Piece(NamedTuple):
    """Tokens ``[start, end)`` of a buffered record, and its reference for the state.

    ``document`` is None for a piece restored from a state until its row is handed out (the
    record is fetched again then, see ``Refetcher``): planning needs only the piece's cost,
    which the reference and ``extra`` give."""

    start: int
    end: int
    document: Document | None
    ref: list[Any]  # [*key, start, end], built once: get_state shares it, nothing changes it
    extra: int = 0  # positions the document reserves beyond its tokens (``length_fn``)

    @property
    def key(self) -> RecordKey:
        return tuple(self.ref[:-2])

    @property
    def cost(self) -> int:
        """Positions the piece takes in a row: its tokens and its document's reserved ones."""
        return self.end - self.start + self.extra


def piece(key: RecordKey, start: int, end: int, document: Document | None, extra: int | None = None) -> Piece:
    """Tokens ``[start, end)`` of the record ``key``, with its reference; ``extra`` defaults to
    the document's reserved positions (it must be given for a piece not fetched yet)."""
    reserved = extra if extra is not None else document.extra if document is not None else 0
    return Piece(start, end, document, [*key, start, end], reserved)


def count_row(counts: dict[str, int], segments: list[Segment], seq_len: int) -> None:
    """Count a row handed out, and its padding (reserved positions are not padding)."""
    counts[ROWS] += 1
    counts[PADDING] += seq_len - sum(segment.cost for segment in segments)


class Refetcher:
    """Turns saved piece references back into pieces and fetches their records again, each
    record once per call of ``fetch_many`` (a stream then reads each file once, in offset
    order); ``read`` turns a record into a ``Document``.

    Eagerly (``piece``), every record is fetched in one call while the state is loaded. Lazily
    (``hold``, then ``documents`` as rows are handed out), only the records of the row about to
    be handed out are fetched, each checked against its pieces then; a record is kept only
    while a piece not handed out still needs it."""

    def __init__(
        self,
        fetch_many: Callable[[Sequence[RecordKey]], list[Any]],
        read: Callable[[Any, RecordKey], Document],
        path: str,
        check: Callable[[RecordKey], str | None] | None = None,
    ) -> None:
        self._fetch_many = fetch_many
        self._read = read
        self._path = path
        self._check_key = check
        self._records: dict[RecordKey, Document] = {}
        self._waiting: dict[RecordKey, int] = {}  # pieces not fetched yet, per record
        # While one state's references are parsed: their prefixes read so far (``reference_parts``).
        self._prefixes: dict[tuple[int, ...], RecordKey] | None = {}

    def parse(self, entry: Any, where: str) -> tuple[RecordKey, int, int]:
        """``(key, token_start, token_end)`` of a saved reference ``[*key, start, end]``: the key
        is an epoch and a record index, behind the names of the mix components it came through."""
        parts = reference_parts(entry, self._prefixes)
        if parts is not None:
            key, start, end = parts
            if start < end:
                return key, start, end
            raise StateError(f"{self._path}: {where} entry {entry} is an empty token range")
        raise StateError(
            f"{self._path}: {where} entry {short_repr(entry)} is not "
            "[epoch, record, token_start, token_end] of ints >= 0 (behind mix component names, after a mix, "
            'and a shard\'s stride {"consumer": c, "of": C}, below a shard)'
        )

    def fetch(self, entries: list[tuple[Any, str]]) -> None:
        """Fetch the records of ``(entry, where)`` references not fetched yet, in one call."""
        self._fetch([self.parse(entry, where)[0] for entry, where in entries])

    def _fetch(self, wanted: Sequence[RecordKey]) -> None:
        keys = [key for key in dict.fromkeys(wanted) if key not in self._records]
        if not keys:
            return
        try:
            records = self._fetch_many(keys)
            for key, record in zip(keys, records):
                self._records[key] = self._read(record, key)
        except (IndexError, ResumableError) as exc:
            raise StateError(f"{self._path}: the buffered records cannot be fetched again: {exc}") from exc

    def piece(self, entry: Any, where: str) -> Piece:
        """The piece ``entry`` names, its record fetched now and checked."""
        key, start, end = self.parse(entry, where)
        self._fetch([key])
        document = self._records[key]
        self._check(key, start, end, document, document.extra, where)
        return piece(key, start, end, document)

    def parsed_all(self) -> None:
        """The saved references are all parsed: forget their prefixes (their objects may go)."""
        self._prefixes = None

    def key_problem(self, key: RecordKey) -> str | None:
        """What is wrong with ``key``, where the upstream can tell without fetching (else None)."""
        return self._check_key(key) if self._check_key is not None else None

    def lazy(self, entry: Any, where: str, extra: int) -> Piece:
        """The piece ``entry`` names, reserving ``extra`` positions, its record not fetched yet;
        a key the upstream can tell is out of range without fetching is refused now."""
        key, start, end = self.parse(entry, where)
        wrong = self.key_problem(key)
        if wrong is not None:
            raise StateError(f"{self._path}: {where} entry {entry} names no record: {wrong}")
        self.hold(key)
        return piece(key, start, end, None, extra)

    def fill(self, pieces: dict[int, Piece]) -> None:
        """Fetch now, in one call, the records of the pieces not fetched yet, and put them in."""
        waiting = {slot: held for slot, held in pieces.items() if held.document is None}
        self._fetch([held.key for held in waiting.values()])
        for slot, held in waiting.items():
            document = self._records[held.key]
            self._check(held.key, held.start, held.end, document, held.extra, "a replayed")
            pieces[slot] = held._replace(document=document)
        self._records.clear()
        self._waiting.clear()

    def hold(self, key: RecordKey, count: int = 1) -> None:
        """``count`` more pieces of record ``key`` (or fewer, if negative) wait for it."""
        waiting = self._waiting.get(key, 0) + count
        if waiting > 0:
            self._waiting[key] = waiting
        else:
            self._waiting.pop(key, None)
            self._records.pop(key, None)

    def documents(self, pieces: Sequence[Piece]) -> list[Document]:
        """The documents of ``pieces`` (a row about to be handed out): those not fetched yet in one
        call, checked against their pieces (a record that changed since the state was saved is a
        StateError); a record no other piece waits for is then let go."""
        self._fetch([held.key for held in pieces if held.document is None])
        documents = []
        for held in pieces:
            document = held.document
            if document is None:
                document = self._records[held.key]
                self._check(held.key, held.start, held.end, document, held.extra, "a buffered")
            documents.append(document)
        for held in pieces:
            if held.document is None:
                self.hold(held.key, -1)
        return documents

    def _check(self, key: RecordKey, start: int, end: int, document: Document, extra: int, where: str) -> None:
        if end > len(document.tokens):
            raise StateError(
                f"{self._path}: {where} entry {[*key, start, end]} is outside record {key_text(key)} of "
                f"{len(document.tokens)} tokens (did the data change?)"
            )
        if document.extra != extra:
            raise StateError(
                f"{self._path}: record {key_text(key)} reserves {document.extra} positions, the state "
                f"saved {extra} (did the data change?)"
            )


def grouped(state: Mapping[str, Any], key: str, sizes_key: str, path: str) -> list[list[Any]]:
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


def reference_parts(
    entry: Any, prefixes: dict[tuple[int, ...], RecordKey] | None = None
) -> tuple[RecordKey, int, int] | None:
    """``(key, start, end)`` of a saved reference ``[*prefix, epoch, record, start, end]``
    (``loaded_prefix``: mix component names, then a stride) of ints >= 0; None where ``entry``
    is not one. Whether ``start < end`` is left to the caller. ``prefixes`` memoizes the prefixes
    read, by the identity of their parts: for the references of one state, all alive meanwhile,
    whose prefixes a decoded encoding shares (``_refs.decode``)."""
    if not isinstance(entry, list) or len(entry) < PIECE_FIELDS:
        return None
    if not all(is_count(value) for value in entry[-PIECE_FIELDS:]):
        return None
    parts = entry[:-PIECE_FIELDS]
    if prefixes is None:
        prefix = loaded_prefix(parts)
    else:
        identity = tuple(map(id, parts))
        prefix = prefixes.get(identity)
        if prefix is None:
            prefix = loaded_prefix(parts)
            if prefix is not None:
                prefixes[identity] = prefix
    if prefix is None:
        return None
    return (*prefix, *entry[-PIECE_FIELDS:-2]), entry[-2], entry[-1]


def key_text(key: RecordKey) -> str:
    """A record key as messages name it: ``(mix component web, epoch 0, record 12)``, or
    ``(consumer 3 of 8, epoch 0, position 12)`` for a stride key."""
    parts = [
        f"consumer {part.consumer} of {part.consumers}" if isinstance(part, Stride) else f"mix component {part}"
        for part in key[:-2]
    ]
    record = "position" if key[:-2] and isinstance(key[-3], Stride) else "record"
    return f"({', '.join([*parts, f'epoch {key[-2]}'])}, {record} {key[-1]})"


def is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def untraceable(kind: str, upstream: Any) -> str:
    """Why a packer cannot follow ``upstream``."""
    return (
        f"{kind}: the upstream {upstream!r} cannot trace its items back to indexed records "
        "(last_key() is None), so the packer cannot checkpoint its buffer by reference; build "
        "the pipeline from an indexed source with shuffle/shard/map, then filter/repeat, then pack()"
    )
