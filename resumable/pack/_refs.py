"""Compact piece references: a streaming packer's state saves the references of the pieces it
holds as one base64 string of bit-packed ints instead of one JSON list per piece, so the state is
a few kB for a 1000-document buffer, and ``get_state()`` after every batch costs one gather of
codes packed when each piece arrived, not a pass over the buffer.

Each piece is the row ``(origin, epoch, record, start, length)``: ``origin`` indexes the list of
prefixes its keys start with (mix component names, then for a stride key the shard's stride
``{"consumer": c, "of": C}``; ``[[]]`` for leaf keys without a mix), ``length = end - start``.
Below a shard, ``record`` is the position in the consumer's stride (``core.keys.Stride``): the
pieces a consumer holds were read close together, so it takes about ``log2(buffer)`` bits where
a leaf index takes ``log2(source)`` (12-14 bits instead of 34 at 10^10 documents). Each
field is saved as ``base + scale * value`` with ``value`` in ``bits`` bits (``scale`` divides the
field's offsets from ``base``; it is above 1 only for ``start``, where split documents' starts
are multiples of ``seq_len`` and so take a bit or two). The fields of a row are packed into
64-bit words, each word saved in as many little-endian bytes as its bits need, word by word
(all rows' first word, then the second).

``RefTable`` keeps every held piece's words packed under one ``Layout`` (base, scale and bits
per field), so a state is the packed words of the saved slots, gathered in one call. A piece
that the layout cannot hold (a record below its base, a new epoch, a longer piece) makes the
table refit: the smallest layout holding every held piece, and every piece packed again, once,
at the next state. A restore adopts the saved layout, so a restored packer saves exactly the
state it was given, and then the same states as the packer it continues where both take their
states at the same rows: a refit fits the pieces held when a state is taken, so two packers at
one row that took earlier states at other rows may save other layouts of the same references
(refitting on arrival instead would cost every packer, saving or not, about 1-2% of its time).
"""

from __future__ import annotations

import base64
import binascii
import math
from typing import Any, NamedTuple

import numpy as np

from resumable.core.keys import loaded_prefix, saved_prefix
from resumable.core.state import INT64_MAX, require
from resumable.errors import StateError

FIELDS = ("origin", "epoch", "record", "start", "length")
ORIGIN, EPOCH, RECORD, START, LENGTH = range(len(FIELDS))
WORD_BITS = 64
REF_LIMIT = 1 << WORD_BITS
"""Epochs and record indices a reference can hold are below this (the table's columns are uint64)."""
INITIAL_CAPACITY = 64

# Entries of an encoding.
COUNT = "count"
ORIGINS = "origins"
BASE = "base"
SCALE = "scale"
BITS = "bits"
DATA = "data"


def _words(bits: list[int] | tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """The fields packed into each 64-bit word, in field order (fields of 0 bits take none)."""
    words: list[list[int]] = []
    used = WORD_BITS
    for field, width in enumerate(bits):
        if not width:
            continue
        if used + width > WORD_BITS:
            words.append([])
            used = 0
        words[-1].append(field)
        used += width
    return tuple(map(tuple, words))


class Layout(NamedTuple):
    """How references are packed: each field's ``base``, ``scale`` and ``bits``; the fields of
    each 64-bit word (``words``, see ``_words``), each field's word and shift in it, and each
    word's bytes (``widths``). A reference packed is its words' bytes back to back (a cell)."""

    base: tuple[int, ...]
    scale: tuple[int, ...]
    bits: tuple[int, ...]
    words: tuple[tuple[int, ...], ...]
    word_of: tuple[int, ...]
    shift: tuple[int, ...]
    widths: tuple[int, ...]
    limit: tuple[int, ...]  # a field's offset from its base is below this (``scale << bits``)

    @classmethod
    def of(cls, base: list[int], scale: list[int], bits: list[int]) -> Layout:
        words = _words(bits)
        word_of, shift = [0] * len(FIELDS), [0] * len(FIELDS)
        widths = []
        for index, word in enumerate(words):
            at = 0
            for field in word:
                word_of[field], shift[field] = index, at
                at += bits[field]
            widths.append((at + 7) // 8)
        limit = tuple(s << b for s, b in zip(scale, bits))
        return cls(tuple(base), tuple(scale), tuple(bits), words, tuple(word_of), tuple(shift), tuple(widths), limit)

    @classmethod
    def fitting(cls, rows: np.ndarray) -> Layout:
        """The smallest layout that holds every row of ``rows`` (``(len(FIELDS), n)``, n > 0)."""
        base = rows.min(axis=1)
        top = rows.max(axis=1) - base
        scale = [1] * len(FIELDS)
        starts = rows[START] - base[START]
        split = starts[starts > 0]  # the tails of split documents: multiples of seq_len, the gcd says
        if len(split):
            scale[START] = math.gcd(*split.tolist())
        bits = [int(value) // factor for value, factor in zip(top.tolist(), scale)]
        return cls.of(base.tolist(), scale, [value.bit_length() for value in bits])

    @property
    def width(self) -> int:
        """Bytes of one packed reference."""
        return sum(self.widths)

    def cell(self, values: tuple[int, ...]) -> bytes | None:
        """One reference packed, or None if this layout cannot hold it."""
        words = [0] * len(self.words)
        for field, value in enumerate(values):
            offset = value - self.base[field]
            scale = self.scale[field]
            if offset < 0 or offset >= self.limit[field] or offset % scale:
                return None
            if offset:
                words[self.word_of[field]] |= offset // scale << self.shift[field]
        return b"".join(word.to_bytes(width, "little") for word, width in zip(words, self.widths))

    def cells(self, rows: np.ndarray) -> np.ndarray:
        """Every row of ``rows`` (which this layout holds) packed: ``(n, width)`` bytes."""
        offsets = rows - np.array(self.base, dtype=np.uint64)[:, None]
        if self.scale[START] > 1:
            offsets[START] //= np.uint64(self.scale[START])
        cells = np.zeros((rows.shape[1], self.width), dtype=np.uint8)
        at = 0
        for word, width in zip(self.words, self.widths):
            packed = np.zeros(rows.shape[1], dtype=np.uint64)
            for field in word:
                packed |= offsets[field] << np.uint64(self.shift[field])
            cells[:, at : at + width] = packed.astype("<u8", copy=False).view(np.uint8).reshape(-1, 8)[:, :width]
            at += width
        return cells

    def encoding(self, cells: np.ndarray, origins: list[tuple[Any, ...]]) -> dict[str, Any]:
        """The saved form of references packed in ``cells`` (``(n, width)`` bytes): word by
        word, each word of every reference (a copy per word only when there are several)."""
        if len(self.widths) == 1:
            data = cells.tobytes()
        else:
            bounds = np.cumsum([0, *self.widths]).tolist()
            data = b"".join(cells[:, start:stop].tobytes() for start, stop in zip(bounds[:-1], bounds[1:]))
        return {
            COUNT: len(cells),
            ORIGINS: [saved_prefix(names) for names in origins],
            BASE: list(self.base),
            SCALE: list(self.scale),
            BITS: list(self.bits),
            DATA: base64.b64encode(data).decode("ascii"),
        }


NO_LAYOUT = Layout.of([0] * len(FIELDS), [1] * len(FIELDS), [0] * len(FIELDS))._replace(limit=(0,) * len(FIELDS))
"""The layout of a table that holds no piece yet: it holds none, so the first piece refits."""


class RefTable:
    """The references of the pieces a packer holds, by slot: numpy columns (``FIELDS``), each
    piece's reserved positions (``length_fn``), and its reference packed under ``layout`` when
    it arrived (a cell of bytes), so ``encode`` gathers the saved slots' cells in one indexing
    call. Slots of pieces let go are reused, so the table stays as large as the buffer."""

    def __init__(self, capacity: int = INITIAL_CAPACITY) -> None:
        self._rows = np.zeros((len(FIELDS), capacity), dtype=np.uint64)  # all >= 0
        self._extra = np.zeros(capacity, dtype=np.int64)
        self._held = np.zeros(capacity, dtype=bool)
        self._free: list[int] = list(range(capacity - 1, -1, -1))
        self.origins: list[tuple[Any, ...]] = [()]
        self._origin_ids: dict[tuple[Any, ...], int] = {(): 0}
        self._set_layout(NO_LAYOUT)
        self._stale = False  # a held piece is not packed: refit at the next encode

    def _set_layout(self, layout: Layout) -> None:
        """Pack under ``layout`` from now on (the cells packed so far mean nothing under it)."""
        self._layout = layout
        self._cells = np.zeros((self._rows.shape[1], layout.width), dtype=np.uint8)
        # each slot's cell as one item, so that a gather copies a cell per slot
        self._items = self._cells.view(np.dtype((np.void, layout.width))).reshape(-1) if layout.width else None

    def add(self, key: tuple[Any, ...], start: int, end: int, extra: int = 0) -> int:
        """A slot holding the reference ``[*key, start, end]`` (and ``extra`` reserved positions)."""
        if not self._free:
            self._grow()
        slot = self._free.pop()
        values = (self.origin(key[:-2]), key[-2], key[-1], start, end - start)
        self._rows[:, slot] = values
        self._extra[slot] = extra
        self._held[slot] = True
        if not self._stale:
            cell = self._layout.cell(values)
            if cell is None:
                self._stale = True
            elif self._items is not None:
                self._items[slot] = cell
        return slot

    def _grow(self) -> None:
        capacity = self._rows.shape[1]
        self._rows = np.concatenate([self._rows, np.zeros_like(self._rows)], axis=1)
        self._extra = np.concatenate([self._extra, np.zeros_like(self._extra)])
        self._held = np.concatenate([self._held, np.zeros_like(self._held)])
        cells = self._cells
        self._set_layout(self._layout)
        self._cells[:capacity] = cells
        self._free = list(range(2 * capacity - 1, capacity - 1, -1))

    def origin(self, names: tuple[Any, ...]) -> int:
        """The index of a mix-component path in ``origins``."""
        index = self._origin_ids.get(names)
        if index is None:
            index = self._origin_ids[names] = len(self.origins)
            self.origins.append(names)
        return index

    def release(self, slot: int) -> None:
        self._held[slot] = False
        self._free.append(slot)

    def extras(self, slots: np.ndarray) -> list[int]:
        """The reserved positions of the pieces in ``slots``."""
        extras: list[int] = self._extra.take(slots).tolist()
        return extras

    def encode(self, slots: np.ndarray) -> dict[str, Any]:
        """The saved form of the references in ``slots``, in that order."""
        if self._stale:
            self._refit()
        if self._items is None:
            cells = np.zeros((len(slots), 0), dtype=np.uint8)
        else:
            cells = self._items.take(slots).view(np.uint8).reshape(len(slots), self._layout.width)
        return self._layout.encoding(cells, self.origins)

    def _refit(self) -> None:
        """The smallest layout holding every held piece, and every held piece packed under it."""
        held = np.flatnonzero(self._held)
        if not len(held):
            self._set_layout(NO_LAYOUT)
        else:
            rows = self._rows.take(held, axis=1)
            self._set_layout(Layout.fitting(rows))
            self._cells[held] = self._layout.cells(rows)
        self._stale = False

    def adopt(self, encoding: dict[str, Any]) -> None:
        """Pack the pieces about to be added under the layout and origins of a saved ``encoding``
        (checked by ``decode``), so that this table saves them as they were saved. Call on an
        empty table, before any ``add``."""
        self.origins = [loaded_prefix(names) or () for names in encoding[ORIGINS]]
        self._origin_ids = {names: index for index, names in reversed(list(enumerate(self.origins)))}
        base, scale, bits = encoding[BASE], encoding[SCALE], encoding[BITS]
        if base:  # else the previous version's empty encoding: no layout
            self._set_layout(Layout.of(base, scale, bits))


class GrowingSlots:
    """The slots of a list of items as an int array, converted once per item: a list that is
    the same object as at the last call has only grown since (the contract of
    ``Packer.state_order``), so only its new items are converted."""

    def __init__(self) -> None:
        self._items: list[int] | None = None
        self._array = np.zeros(0, dtype=np.intp)
        self._count = 0

    def of(self, items: list[int]) -> np.ndarray:
        count = len(items)
        if items is not self._items or count < self._count:
            self._items, self._count = items, 0
        if count > self._count:
            if count > len(self._array):
                grown = np.zeros(max(count, 2 * len(self._array)), dtype=np.intp)
                grown[: self._count] = self._array[: self._count]
                self._array = grown
            self._array[self._count : count] = items[self._count : count]
            self._count = count
        return self._array[:count]


def decode(value: Any, path: str, where: str) -> list[list[Any]]:
    """The references ``[*names, epoch, record, start, end]`` an encoding holds; StateError
    naming ``path`` and ``where`` if it is malformed (its layout is checked even when it holds
    no reference, since a restore adopts it)."""
    if not isinstance(value, dict):
        raise StateError(f"{path}: state entry {where!r} is not an encoding of piece references")
    count = require(value, COUNT, int, f"{path} > {where}")
    origins = require(value, ORIGINS, list, f"{path} > {where}")
    fields = [require(value, name, list, f"{path} > {where}") for name in (BASE, SCALE, BITS)]
    data = require(value, DATA, str, f"{path} > {where}")
    if count < 0 or any(loaded_prefix(names) is None for names in origins):
        raise StateError(f"{path}: {where} has a negative count or origins that are not lists of names (and a stride)")
    base, scale, bits = fields
    if not count and not any(fields):  # an empty encoding of a table without a layout
        return []
    if any(len(field) != len(FIELDS) or not all(_is_int(v) for v in field) for field in fields) or not all(
        0 <= b <= WORD_BITS and 1 <= s <= INT64_MAX and 0 <= v <= INT64_MAX for v, s, b in zip(base, scale, bits)
    ):  # a scale of 0 is never written: it would read every reference's field as its base
        raise StateError(f"{path}: {where} needs base, scale and bits of {len(FIELDS)} ints in range each (scale >= 1)")
    if not count:
        return []
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise StateError(f"{path}: {where} data is not base64: {exc}") from exc
    words = _words(bits)
    if not words and count > 1:  # every reference the same: no two pieces held are
        raise StateError(f"{path}: {where} holds {count} copies of one reference")
    if len(raw) != count * sum((sum(bits[f] for f in word) + 7) // 8 for word in words):
        raise StateError(f"{path}: {where} data holds {len(raw)} bytes, not {count} references")
    columns = [[value] * count for value in base]  # a field of 0 bits is its base
    at = 0
    for word in words:
        width = (sum(bits[f] for f in word) + 7) // 8
        padded = np.zeros((count, 8), dtype=np.uint8)
        padded[:, :width] = np.frombuffer(raw, dtype=np.uint8, count=count * width, offset=at).reshape(count, width)
        at += count * width
        packed = padded.view("<u8")[:, 0]
        shift = 0
        for field in word:
            mask = np.uint64((1 << bits[field]) - 1)
            values = (packed >> np.uint64(shift)) & mask
            top = base[field] + scale[field] * int(values.max())
            if top > INT64_MAX:
                raise StateError(f"{path}: {where} holds a {FIELDS[field]} above {INT64_MAX}")
            columns[field] = (base[field] + scale[field] * values.astype(np.int64)).tolist()
            shift += bits[field]
    refs = []
    for origin, epoch, record, start, length in zip(*columns):
        if origin >= len(origins) or length <= 0:
            raise StateError(f"{path}: {where} holds an unknown origin or an empty token range")
        refs.append([*origins[origin], epoch, record, start, start + length])
    return refs


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
