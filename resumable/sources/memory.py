"""In-memory source: records from a Python sequence."""

from __future__ import annotations

from typing import Any, Sequence, TypeVar

import numpy as np

from resumable.sources.source import Source

T = TypeVar("T")

LENGTH = "length"


class FromList(Source[T]):
    """Records of an in-memory sequence, by index. The state checks only the length."""

    def __init__(self, records: Sequence[T]) -> None:
        super().__init__()
        self._records = records

    def __len__(self) -> int:
        return len(self._records)

    def _config(self) -> dict[str, Any]:
        return {LENGTH: len(self._records)}

    def _raw_range(self, start: int, count: int) -> Sequence[T]:
        return self._records[start : start + count]

    def _raw_at(self, indices: np.ndarray) -> Sequence[T]:
        records = self._records
        return [records[i] for i in indices.tolist()]


def from_list(records: Sequence[T]) -> FromList[T]:
    """A source over an in-memory sequence (list, tuple, or anything with len and indexing)."""
    return FromList(records)
