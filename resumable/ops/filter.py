"""Filter: keep the items a predicate accepts, counting the ones it drops."""

from __future__ import annotations

import warnings
from typing import Any, Callable, Sequence, TypeVar

from resumable.core.keys import RecordKey
from resumable.core.node import Node
from resumable.core.state import require_count
from resumable.errors import BarrenEpochWarning, ConfigError, stop_error
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
        self._warned_barren = False

    def _next(self) -> T:
        upstream, predicate = self.upstream, self.predicate
        in_a_row = 0
        barren: BarrenEpochs | None = None
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
            if in_a_row % BARREN_CHECK_EVERY == 0 and not self._warned_barren:
                barren = barren or BarrenEpochs(upstream)
                self._warn_if_barren(barren, in_a_row)

    def _warn_if_barren(self, barren: BarrenEpochs, in_a_row: int) -> None:
        """Warn, once, when a whole epoch of an endless upstream (after ``repeat()``, or a mix
        with ``on_end="restart"``) was dropped: a predicate that keeps nothing would read for
        ever. Not an error: a predicate that keeps rarely, or at random, or a shard whose
        records change with the epoch, may still keep items in later epochs. Without record
        keys (after a batch, say) there is no epoch to tell."""
        key = self.upstream.last_key()
        since = None if key is None else barren.barren_since(key)
        if since is not None:
            epoch, where = since
            warnings.warn(
                BarrenEpochWarning(
                    f"{self.kind}: the predicate kept no item of epoch {epoch}{where} of its endless upstream "
                    f"({in_a_row} dropped in a row); if it keeps nothing at all, this filter reads for ever"
                ),
                stacklevel=2,
            )
            self._warned_barren = True  # once it returned: made an error, it raises again next time

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
