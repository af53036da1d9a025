"""How a packer reads a document: a record's token ids (and labels) as arrays, and how much of
it goes into rows under the overlong policy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from resumable.core.keys import RecordKey
from resumable.errors import SourceError
from resumable.pack._entries import DOCUMENTS, DROPPED, EMPTY, SPLIT, TRUNCATED
from resumable.pack._pieces import Arrays, key_text

INT64_MAX = int(np.iinfo(np.int64).max)  # rows are int64: larger ids would wrap to negative ones


@dataclass(frozen=True)
class Documents:
    """A packer's reading of its records (its options ``seq_len``, ``overlong``,
    ``input_field`` and ``labels_field``); ``kind`` names the packer in errors. Both modes of
    the packer hold it, so neither holds the packer."""

    kind: str
    seq_len: int
    overlong: str
    input_field: str
    labels_field: str | None

    def cut(self, length: int, counts: dict[str, int]) -> tuple[int, int]:
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

    def read(self, record: Any, key: RecordKey) -> Arrays:
        """The record's token ids (and labels if it has them) as 1-d integer numpy arrays."""
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
        if labels_field is None or labels_field not in record:
            return tokens, None
        labels = self._ids(record[labels_field], key, labels_field)
        if len(labels) != len(tokens):
            raise SourceError(
                f"{self.kind}: record {key_text(key)} has {len(labels)} {labels_field!r} "
                f"for {len(tokens)} {field!r}"
            )
        return tokens, labels

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
        if array.dtype == np.uint64 and array.size and int(array.max()) > INT64_MAX:
            raise SourceError(
                f"{self.kind}: record {key_text(key)} field {field!r} holds id {int(array.max())}, above the "
                f"int64 rows can hold ({INT64_MAX})"
            )
        return array
