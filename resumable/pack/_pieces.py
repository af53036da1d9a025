"""Pieces and their references: a packer's state saves ``[*key, token_start, token_end]`` for
every piece it holds, never tokens, and a restore fetches the records again to cut the same
pieces."""

from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple, Sequence

from resumable.core.keys import RecordKey
from resumable.core.state import require, short_repr
from resumable.errors import ResumableError, StateError
from resumable.pack._entries import PADDING, ROWS
from resumable.pack.rows import Document, Segment

PIECE_FIELDS = 4
"""Ints that end a piece reference ``[*component names, epoch, record, token_start, token_end]``."""


class Piece(NamedTuple):
    """Tokens ``[start, end)`` of a buffered record, and its reference for the state."""

    start: int
    end: int
    document: Document
    ref: list[Any]  # [*key, start, end], built once: get_state shares it, nothing changes it

    @property
    def key(self) -> RecordKey:
        return tuple(self.ref[:-2])

    @property
    def cost(self) -> int:
        """Positions the piece takes in a row: its tokens and its document's reserved ones."""
        return self.end - self.start + self.document.extra

    def segment(self) -> Segment:
        return Segment(self.document, self.start, self.end)


def piece(key: RecordKey, start: int, end: int, document: Document) -> Piece:
    """Tokens ``[start, end)`` of the record ``key``, with its reference."""
    return Piece(start, end, document, [*key, start, end])


def count_row(counts: dict[str, int], segments: list[Segment], seq_len: int) -> None:
    """Count a row handed out, and its padding (reserved positions are not padding)."""
    counts[ROWS] += 1
    counts[PADDING] += seq_len - sum(segment.cost for segment in segments)


class Refetcher:
    """Turns saved piece references back into pieces, fetching each record once, all of them in
    one ``fetch_many`` call (a stream then reads each file once, in offset order); ``read`` turns
    a record into a ``Document``."""

    def __init__(
        self,
        fetch_many: Callable[[Sequence[RecordKey]], list[Any]],
        read: Callable[[Any, RecordKey], Document],
        path: str,
    ) -> None:
        self._fetch_many = fetch_many
        self._read = read
        self._path = path
        self._records: dict[RecordKey, Document] = {}

    def _ref(self, entry: Any, where: str) -> tuple[RecordKey, int, int]:
        """``(key, token_start, token_end)`` of a saved reference ``[*key, start, end]``: the key
        is an epoch and a record index, behind the names of the mix components it came through."""
        if (
            isinstance(entry, list)
            and len(entry) >= PIECE_FIELDS
            and all(is_count(value) for value in entry[-PIECE_FIELDS:])
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
        try:
            records = self._fetch_many(keys)
            for key, record in zip(keys, records):
                self._records[key] = self._read(record, key)
        except (IndexError, ResumableError) as exc:
            raise StateError(f"{self._path}: the buffered records cannot be fetched again: {exc}") from exc

    def piece(self, entry: Any, where: str) -> Piece:
        key, start, end = self._ref(entry, where)
        self.fetch([(entry, where)])
        document = self._records[key]
        if not start < end <= len(document.tokens):
            raise StateError(
                f"{self._path}: {where} entry {entry} is outside record {key_text(key)} of "
                f"{len(document.tokens)} tokens (did the data change?)"
            )
        return piece(key, start, end, document)


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


def key_text(key: RecordKey) -> str:
    """A record key as messages name it: ``(mix component web, epoch 0, record 12)``."""
    components = "".join(f"mix component {name}, " for name in key[:-2])
    return f"({components}epoch {key[-2]}, record {key[-1]})"


def is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def untraceable(kind: str, upstream: Any) -> str:
    """Why a packer cannot follow ``upstream``."""
    return (
        f"{kind}: the upstream {upstream!r} cannot trace its items back to indexed records "
        "(last_key() is None), so the packer cannot checkpoint its buffer by reference; build "
        "the pipeline from an indexed source with shuffle/shard/map, then filter/repeat, then pack()"
    )
