"""How a packer reads a document: a record's token ids, labels and payload fields as a
``Document``, its packing cost, and how much of it goes into rows under the overlong policy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

from resumable.core.keys import RecordKey
from resumable.errors import SourceError
from resumable.pack._entries import DOCUMENTS, DROPPED, EMPTY, SPLIT, TRUNCATED
from resumable.pack._pieces import key_text
from resumable.pack.rows import Document

INT64_MAX = int(np.iinfo(np.int64).max)  # rows are int64: larger ids would wrap to negative ones
TOKEN_FIELD_KINDS = "biuf"  # bool, ints, floats: what a per-token field may hold


@dataclass(frozen=True)
class Documents:
    """A packer's reading of its records (its options ``seq_len``, ``overlong``,
    ``input_field``, ``labels_field``, the payload fields and ``length_fn``); ``kind`` names
    the packer in errors. Both modes of the packer hold it, so neither holds the packer."""

    kind: str
    seq_len: int
    overlong: str
    input_field: str
    labels_field: str | None
    token_fields: tuple[str, ...] = ()
    document_fields: tuple[str, ...] = ()
    length_fn: Callable[[Any], int] | None = None

    def cut(self, document: Document, counts: dict[str, int]) -> tuple[int, int]:
        """Apply the overlong policy to ``document`` (by its cost: tokens and reserved
        positions) and count it.

        Returns ``(full, end)``: tokens ``[0, full)`` make whole rows of their own (a multiple
        of ``seq_len``), tokens ``[full, end)`` are one piece to pack; ``(0, 0)`` keeps nothing.
        A document with reserved positions is never split (``Pack`` refuses ``split`` with a
        ``length_fn``); truncated, it keeps the tokens that fit beside them, and is dropped if
        none do.
        """
        seq_len, length, extra = self.seq_len, len(document.tokens), document.extra
        if length == 0:
            counts[EMPTY] += 1
            return 0, 0
        if length + extra <= seq_len:
            counts[DOCUMENTS] += 1
            return (length, length) if length == seq_len else (0, length)
        if self.overlong == "drop" or (self.overlong == "truncate" and extra >= seq_len):
            counts[DROPPED] += 1
            return 0, 0
        counts[DOCUMENTS] += 1
        if self.overlong == "truncate":
            counts[TRUNCATED] += 1
            keep = seq_len - extra
            return (keep, keep) if keep == seq_len else (0, keep)
        counts[SPLIT] += 1
        return length - length % seq_len, length

    def read(self, record: Any, key: RecordKey) -> Document:
        """The record's token ids (and labels if it has them) as 1-d integer numpy arrays, its
        token fields and document fields, and the positions ``length_fn`` reserves."""
        field = self.input_field
        if not isinstance(record, Mapping):
            raise SourceError(
                f"{self.kind}: record {key_text(key)} is a {type(record).__name__}, "
                f"expected a mapping with a {field!r} field"
            )
        if field not in record:
            names = ", ".join(repr(name) for name in list(record)[:8])
            raise SourceError(
                f"{self.kind}: record {key_text(key)} has no {field!r} field (it has {names or 'none'}); "
                "tokenize before pack(), or set input_field"
            )
        tokens = self._ids(record[field], key, field)
        labels_field = self.labels_field
        labels = None
        # a null is a missing field: Parquet and Arrow rows without labels beside rows with them
        if labels_field is not None and (given := record.get(labels_field)) is not None:
            labels = self._ids(given, key, labels_field)
            self._check_length(labels, len(tokens), key, labels_field)
        if not (self.token_fields or self.document_fields or self.length_fn):
            return Document(tokens, labels)
        fields = tuple(self._token_field(record, key, name, len(tokens)) for name in self.token_fields)
        payloads = tuple(self._field(record, key, name) for name in self.document_fields)
        return Document(tokens, labels, fields, payloads, self._extra(record, key, len(tokens)))

    def _check_length(self, array: np.ndarray, length: int, key: RecordKey, name: str) -> None:
        if len(array) != length:
            raise SourceError(
                f"{self.kind}: record {key_text(key)} has {len(array)} {name!r} for {length} {self.input_field!r}"
            )

    def _field(self, record: Mapping[str, Any], key: RecordKey, name: str) -> Any:
        if name not in record:
            raise SourceError(f"{self.kind}: record {key_text(key)} has no {name!r} field")
        return record[name]

    def _token_field(self, record: Mapping[str, Any], key: RecordKey, name: str, length: int) -> np.ndarray:
        """A per-token field: a 1-d array of bools, ints or floats, one per token."""
        value = self._field(record, key, name)
        try:
            array = value if isinstance(value, np.ndarray) else np.asarray(value)
        except (TypeError, ValueError) as exc:
            raise SourceError(f"{self.kind}: record {key_text(key)} field {name!r} is not an array: {exc}") from exc
        if array.ndim != 1 or array.dtype.kind not in TOKEN_FIELD_KINDS:
            raise SourceError(
                f"{self.kind}: record {key_text(key)} token field {name!r} must be a 1-d sequence of bools, "
                f"ints or floats, got shape {array.shape} of {array.dtype}"
            )
        self._check_length(array, length, key, name)
        return array

    def _extra(self, record: Mapping[str, Any], key: RecordKey, length: int) -> int:
        """Positions ``length_fn`` reserves beyond the record's ``length`` tokens (0 without it)."""
        if self.length_fn is None:
            return 0
        try:
            cost = self.length_fn(record)
        except Exception as error:  # noqa: BLE001 - the user's function, reported with the record
            raise SourceError(f"{self.kind}: length_fn failed on record {key_text(key)}: {error!r}") from error
        if isinstance(cost, (int, np.integer)) and not isinstance(cost, bool) and cost >= length:
            return int(cost) - length
        raise SourceError(
            f"{self.kind}: length_fn gave {cost!r} for record {key_text(key)} of {length} tokens; "
            "expected an int >= its token count"
        )

    def _ids(self, value: Any, key: RecordKey, field: str) -> np.ndarray:
        try:
            array = value if isinstance(value, np.ndarray) else np.asarray(value)
        except (TypeError, ValueError) as exc:
            raise SourceError(f"{self.kind}: record {key_text(key)} field {field!r} is not an array: {exc}") from exc
        if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
            raise SourceError(
                f"{self.kind}: record {key_text(key)} field {field!r} must be a 1-d sequence of integer ids, "
                f"got shape {array.shape} of {array.dtype}"
            )
        if array.dtype.kind == "u" and array.dtype.itemsize == 8 and array.size and int(array.max()) > INT64_MAX:
            raise SourceError(
                f"{self.kind}: record {key_text(key)} field {field!r} holds id {int(array.max())}, above the "
                f"int64 rows can hold ({INT64_MAX})"
            )
        return array
