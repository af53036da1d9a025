"""Batch: group consecutive items."""

from __future__ import annotations

from typing import Any, Callable, Generic, TypeVar

from resumable.core.node import Node
from resumable.core.options import flag_option, int_option
from resumable.errors import ConfigError, StateError, stop_error

T = TypeVar("T")

BATCH_SIZE = "batch_size"
DROP_LAST = "drop_last"


class Batch(Node[Any], Generic[T]):
    """Lists of ``batch_size`` items, collated by ``collate_fn`` if given.

    A batch is assembled within one ``next()`` call, so between calls nothing is buffered and
    the state is the upstream's. The last, shorter batch of an epoch is kept unless ``drop_last``.
    """

    kind = "Batch"
    # A batch holds nothing between calls, so its size may change on an elastic resume: going
    # from 4 ranks to 3, a job keeps its global batch by taking 8 per rank instead of 6.
    _elastic_options = (BATCH_SIZE,)

    upstream: Node[Any]

    def __init__(
        self,
        upstream: Node[T],
        batch_size: int,
        drop_last: bool = False,
        collate_fn: Callable[[list[T]], Any] | None = None,
    ) -> None:
        super().__init__(upstream)
        batch_size = int_option(self.kind, BATCH_SIZE, batch_size)
        drop_last = flag_option(self.kind, DROP_LAST, drop_last)
        if collate_fn is not None and not callable(collate_fn):
            raise ConfigError(f"{self.kind}: collate_fn must be callable, got {type(collate_fn).__name__}")
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.collate_fn = collate_fn

    def _set_elastic_option(self, key: str, value: Any, path: str) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise StateError(f"{path}: state entry {key!r} is {value!r}, expected a positive int")
        self.batch_size = value

    def _config(self) -> dict[str, Any]:
        return {BATCH_SIZE: self.batch_size, DROP_LAST: self.drop_last}

    def _header_key(self) -> object:
        return self.batch_size  # an elastic option

    def _known_length(self) -> int:
        """Whole batches of the upstream's epoch, and the last, shorter one unless ``drop_last``."""
        whole, rest = divmod(len(self.upstream), self.batch_size)
        return whole + (1 if rest and not self.drop_last else 0)

    def _next(self) -> Any:
        items: list[T] = []
        upstream = self.upstream
        for _ in range(self.batch_size):
            try:
                items.append(next(upstream))
            except StopIteration:
                break
        if not items or (self.drop_last and len(items) < self.batch_size):
            raise StopIteration
        if self.collate_fn is None:
            return items
        try:
            return self.collate_fn(items)
        except StopIteration as stop:
            where = f"{self.kind}: collate_fn, on the batch that ends at the record with key {upstream.last_key()},"
            raise stop_error(where, None, stop) from stop
