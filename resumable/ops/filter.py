"""Filter: keep the items a predicate accepts, counting the ones it drops."""

from __future__ import annotations

from typing import Any, Callable, Sequence, TypeVar

from resumable.core.keys import RecordKey
from resumable.core.node import Node
from resumable.core.state import require_count
from resumable.errors import ConfigError, stop_error
from resumable.ops.barren import BarrenEpochs

T = TypeVar("T")

DROPPED = "dropped"

BARREN_CHECK_EVERY = 1024
"""Dropped items in a row between two looks at their epoch (a key lookup, kept off the hot path)."""


class Filter(Node[T]):
    """Keep items for which ``predicate(item)`` is true; ``dropped`` counts the others this epoch."""

    kind = "Filter"
    _unknown_length = (
        "the number of items a streaming filter keeps is unknown until it has read them; "
        "use .filter(predicate, index=True) for a known length"
    )

    upstream: Node[Any]

    def __init__(self, upstream: Node[T], predicate: Callable[[T], bool]) -> None:
        super().__init__(upstream)
        if not callable(predicate):
            raise ConfigError(f"{self.kind}: expected a callable predicate, got {type(predicate).__name__}")
        self.predicate = predicate
        self.dropped = 0
        self._barren = BarrenEpochs(self.upstream)  # the epochs of the items dropped in a row

    def _next(self) -> T:
        upstream, predicate = self.upstream, self.predicate
        in_a_row = 0
        while True:
            item: T = next(upstream)
            try:
                kept = predicate(item)
            except StopIteration as stop:
                raise stop_error(f"{self.kind}: predicate", upstream.last_key(), stop) from stop
            if kept:
                return item
            self.dropped += 1
            in_a_row += 1
            if in_a_row % BARREN_CHECK_EVERY == 0:
                self._check_barren(in_a_row)

    def _check_barren(self, in_a_row: int) -> None:
        """Warn, once, when a whole epoch of an endless upstream (after ``repeat()``, or a mix
        with ``on_end="restart"``) was dropped in a row: a predicate that keeps nothing would
        read for ever (``barren.py``). Looked at every ``BARREN_CHECK_EVERY`` drops in a row, so
        a kept item costs nothing here; without record keys (after a batch, say) there is no
        epoch to tell."""
        if in_a_row == BARREN_CHECK_EVERY:  # a new run of dropped items
            self._barren.clear()
        key = self.upstream.last_key()
        if key is not None:
            self._barren.warn_once(
                key,
                f"{self.kind}: the predicate kept no item of epoch {{epoch}}{{where}} of its endless upstream "
                f"({in_a_row} dropped in a row); if it keeps nothing at all, this filter reads for ever",
            )

    def _on_epoch_start(self) -> None:
        self.dropped = 0

    def last_key(self) -> RecordKey | None:
        return self.upstream.last_key()

    def fetch_many(self, keys: Sequence[RecordKey]) -> list[T]:
        return self.upstream.fetch_many(keys)

    def _progress(self) -> dict[str, Any]:
        return {DROPPED: self.dropped}

    def _restore(self, state: dict[str, Any], path: str) -> None:
        self.dropped = require_count(state, DROPPED, path)
