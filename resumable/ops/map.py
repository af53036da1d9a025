"""Map: apply a function to every item."""

from __future__ import annotations

from typing import Any, Callable, Sequence, TypeVar

import numpy as np

from resumable.core.indexed import IndexedNode
from resumable.core.keys import RecordKey
from resumable.core.node import Node
from resumable.errors import ConfigError, stop_error

T = TypeVar("T")
U = TypeVar("U")


def _check_callable(kind: str, fn: Any) -> None:
    if not callable(fn):
        raise ConfigError(f"{kind}: expected a callable, got {type(fn).__name__}")


class Map(Node[U]):
    """Apply ``fn`` to each item of any upstream. Holds no state of its own."""

    kind = "Map"

    upstream: Node[Any]

    def __init__(self, upstream: Node[T], fn: Callable[[T], U]) -> None:
        super().__init__(upstream)
        _check_callable(self.kind, fn)
        self.fn = fn

    def _next(self) -> U:
        item = next(self.upstream)
        try:
            return self.fn(item)
        except StopIteration as stop:
            raise stop_error(f"{self.kind}: fn", self.upstream.last_key(), stop) from stop

    def _known_length(self) -> int:
        return len(self.upstream)

    def last_key(self) -> RecordKey | None:
        return self.upstream.last_key()

    def fetch_many(self, keys: Sequence[RecordKey]) -> list[U]:
        items = self.upstream.fetch_many(keys)
        try:
            return [self.fn(item) for item in items]
        except StopIteration as stop:
            raise stop_error(f"{self.kind}: fn", None, stop) from stop


class IndexedMap(IndexedNode[U]):
    """Apply a pure ``fn`` to each record of an indexed upstream, keeping random access.

    Record ``i`` is ``fn(upstream[i])``, so shuffle and shard may come after the map and a
    resume never re-runs ``fn`` on records before the cursor.
    """

    kind = "IndexedMap"
    _same_positions = True

    upstream: IndexedNode[Any]

    def __init__(self, upstream: IndexedNode[T], fn: Callable[[T], U]) -> None:
        super().__init__(upstream)
        _check_callable(self.kind, fn)
        self.fn = fn

    def __len__(self) -> int:
        return len(self.upstream)

    def _raw_chunk(self, start: int, count: int, epoch: int) -> Sequence[Any]:
        return self.upstream._raw_chunk(start, count, epoch)

    def _leaf_indices(self, positions: np.ndarray, epoch: int) -> np.ndarray:
        return self.upstream._leaf_indices(positions, epoch)

    def _record_fns(self) -> tuple[Callable[[Any], Any], ...]:
        return (*self.upstream._record_fns(), self.fn)
