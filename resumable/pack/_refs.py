"""Compact piece references: a streaming packer's state saves the references of the pieces it
holds as one base64 string of bit-packed ints instead of one JSON list per piece, so the state is
a few kB for a 1000-document buffer and ``get_state()`` costs a few numpy calls, not a Python
loop over the buffer.

Each piece is the row ``(origin, epoch, record, start, length)``: ``origin`` indexes the list of
mix-component paths its keys start with (``[[]]`` without a mix), ``length = end - start``. Each
field is saved as ``base + scale * value`` with ``value`` in ``bits`` bits (``scale`` is the gcd
of the field's offsets from ``base``, so split documents' starts, multiples of ``seq_len``, take
a bit or two). The fields of a row are packed into 64-bit words, each word saved in as many
little-endian bytes as its bits need, word by word (all rows' first word, then the second).
"""

from __future__ import annotations

import base64
import binascii
import math
from typing import Any, Sequence

import numpy as np

from resumable.core.state import INT64_MAX, require
from resumable.errors import StateError

FIELDS = ("origin", "epoch", "record", "start", "length")
ORIGIN, EPOCH, RECORD, START, LENGTH = range(len(FIELDS))
WORD_BITS = 64
REF_LIMIT = 1 << WORD_BITS
"""Epochs and record indices a reference can hold are below this (the table's columns are uint64)."""

# Entries of an encoding.
COUNT = "count"
ORIGINS = "origins"
BASE = "base"
SCALE = "scale"
BITS = "bits"
DATA = "data"


class RefTable:
    """The references of the pieces a packer holds, by slot, in numpy columns (``FIELDS``):
    ``get_state`` gathers the rows of the slots it saves in one indexing call. Slots of pieces
    let go are reused, so the table stays as large as the buffer."""

    def __init__(self, capacity: int = 64) -> None:
        self._rows = np.zeros((len(FIELDS), capacity), dtype=np.uint64)  # all >= 0
        self._free: list[int] = list(range(capacity - 1, -1, -1))
        self.origins: list[tuple[Any, ...]] = [()]
        self._origin_ids: dict[tuple[Any, ...], int] = {(): 0}

    def add(self, key: tuple[Any, ...], start: int, end: int) -> int:
        """A slot holding the reference ``[*key, start, end]``."""
        if not self._free:
            capacity = self._rows.shape[1]
            self._rows = np.concatenate([self._rows, np.zeros_like(self._rows)], axis=1)
            self._free = list(range(2 * capacity - 1, capacity - 1, -1))
        slot = self._free.pop()
        rows = self._rows
        rows[ORIGIN, slot] = self.origin(key[:-2])
        rows[EPOCH, slot] = key[-2]
        rows[RECORD, slot] = key[-1]
        rows[START, slot] = start
        rows[LENGTH, slot] = end - start
        return slot

    def origin(self, names: tuple[Any, ...]) -> int:
        """The index of a mix-component path in ``origins``."""
        index = self._origin_ids.get(names)
        if index is None:
            index = self._origin_ids[names] = len(self.origins)
            self.origins.append(names)
        return index

    def release(self, slot: int) -> None:
        self._free.append(slot)

    def rows(self, slots: np.ndarray) -> np.ndarray:
        """The ``(len(FIELDS), len(slots))`` references of ``slots``."""
        return self._rows.take(slots, axis=1)


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


def ref_rows(refs: Sequence[Sequence[Any]], table: RefTable) -> np.ndarray:
    """References ``[*names, epoch, record, start, end]`` as rows of ``table``'s form (a few
    pieces outside the table: a long document's span, inherited pieces)."""
    rows = np.zeros((len(FIELDS), len(refs)), dtype=np.uint64)
    for column, ref in enumerate(refs):
        rows[:, column] = (table.origin(tuple(ref[:-4])), ref[-4], ref[-3], ref[-2], ref[-1] - ref[-2])
    return rows


def encode(rows: np.ndarray, origins: list[tuple[Any, ...]]) -> dict[str, Any]:
    """The compact form of reference rows (``(len(FIELDS), n)`` uint64)."""
    count = rows.shape[1]
    if not count:
        return {COUNT: 0, ORIGINS: [], BASE: [], SCALE: [], BITS: [], DATA: ""}
    base = rows.min(axis=1)
    offsets = rows - base[:, None]
    scale = [1] * len(FIELDS)
    starts = offsets[START]
    split = starts[starts > 0]  # the tails of split documents: multiples of seq_len, the gcd says
    if len(split):
        scale[START] = math.gcd(*split.tolist())
        offsets[START] = starts // np.uint64(scale[START])
    bits = [int(top).bit_length() for top in offsets.max(axis=1).tolist()]
    data = b"".join(_word_bytes(offsets, word, bits) for word in _words(bits))
    return {
        COUNT: count,
        ORIGINS: [list(names) for names in origins[: int(rows[ORIGIN].max()) + 1]],
        BASE: base.tolist(),
        SCALE: scale,
        BITS: bits,
        DATA: base64.b64encode(data).decode("ascii"),
    }


def decode(value: Any, path: str, where: str) -> list[list[Any]]:
    """The references ``[*names, epoch, record, start, end]`` an encoding holds; StateError
    naming ``path`` and ``where`` if it is malformed."""
    if not isinstance(value, dict):
        raise StateError(f"{path}: state entry {where!r} is not an encoding of piece references")
    count = require(value, COUNT, int, f"{path} > {where}")
    origins = require(value, ORIGINS, list, f"{path} > {where}")
    fields = [require(value, name, list, f"{path} > {where}") for name in (BASE, SCALE, BITS)]
    data = require(value, DATA, str, f"{path} > {where}")
    if count < 0 or any(not isinstance(names, list) or not all(isinstance(n, str) for n in names) for names in origins):
        raise StateError(f"{path}: {where} has a negative count or origins that are not lists of names")
    if not count:
        return []
    base, scale, bits = fields
    if any(len(field) != len(FIELDS) or not all(_is_int(v) for v in field) for field in fields) or not all(
        0 <= b <= WORD_BITS and 0 <= s <= INT64_MAX and 0 <= v <= INT64_MAX for v, s, b in zip(base, scale, bits)
    ):
        raise StateError(f"{path}: {where} needs base, scale and bits of {len(FIELDS)} ints in range each")
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


def _words(bits: list[int]) -> list[list[int]]:
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
    return words


def _word_bytes(values: np.ndarray, word: list[int], bits: list[int]) -> bytes:
    """One word of every row, in as many little-endian bytes as its fields' bits need."""
    packed = values[word[0]].copy()
    shift = bits[word[0]]
    for field in word[1:]:
        packed |= values[field] << np.uint64(shift)
        shift += bits[field]
    width = (shift + 7) // 8
    data: bytes = packed.astype("<u8", copy=False).view(np.uint8).reshape(-1, 8)[:, :width].tobytes()
    return data


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
