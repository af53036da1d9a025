"""In-memory source: records from a Python sequence."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Sequence, TypeVar

import numpy as np

from resumable.errors import ConfigError
from resumable.sources.source import Source

T = TypeVar("T")

LENGTH = "length"


class FromList(Source[T]):
    """Records of an in-memory sequence, by index. The state checks only the length.

    Anything with ``len()`` and integer indexing works (list, tuple, numpy array). An iterator
    or generator is refused with ``ConfigError`` rather than silently materialised: it may be
    endless or huge, and a restore needs the same records again, which an iterator cannot give.
    """

    kind = "FromList"

    def __init__(self, records: Sequence[T]) -> None:
        super().__init__()
        if isinstance(records, (Iterator, Mapping)) or not (
            hasattr(records, "__len__") and hasattr(records, "__getitem__")
        ):
            raise ConfigError(
                f"{self.kind}: from_list needs a sequence (len() and indexing), got {type(records).__name__}; "
                "pass list(records) to read an iterator or generator into memory"
            )
        try:
            len(records)
        except OverflowError as error:  # range(2**63): Python's len() stops at sys.maxsize
            raise ConfigError(f"{self.kind}: the sequence's length is past what len() can return ({error})") from error
        self._records = records

    def __len__(self) -> int:
        return len(self._records)

    def _config(self) -> dict[str, Any]:
        return {LENGTH: len(self._records)}

    def _header_key(self) -> object:
        return len(self._records)  # the caller's sequence, which may grow

    def _raw_range(self, start: int, count: int) -> Sequence[T]:
        return self._records[start : start + count]

    def _raw_at(self, indices: np.ndarray) -> Sequence[T]:
        records = self._records
        return [records[i] for i in indices.tolist()]


def from_list(records: Sequence[T]) -> FromList[T]:
    """A source over an in-memory sequence (list, tuple, or anything with len and indexing);
    an iterator or generator is a ``ConfigError`` (pass ``list(records)``)."""
    return FromList(records)
