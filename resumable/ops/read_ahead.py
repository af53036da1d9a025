"""State as of the last item handed out, for nodes that read their upstream ahead of the consumer.

Prefetch (a producer thread) and ParallelMap (a window of records in a pool) pull items from
their upstream before the consumer asks for them. Each item travels with the upstream's state
and key right after it; when the item is handed out, those become the node's *recorded* state,
which is what ``get_state()`` saves. Whenever the read-ahead is dropped (a new epoch, a
shutdown), the upstream, which ran ahead, is first returned to the recorded state, so that what
follows depends only on what the consumer received, never on how far the reader had got.
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager, TypeVar

from resumable.core.keys import RecordKey
from resumable.core.node import Node

T = TypeVar("T")


class ReadAhead(Node[T]):
    """Base of nodes that read their upstream ahead; subclasses implement ``_drop_ahead``."""

    upstream: Node[Any]

    def __init__(self, upstream: Node[Any]) -> None:
        super().__init__(upstream)
        # Upstream state and key as of the last item handed out; None: the live upstream's
        # (nothing was read ahead since the last restore or epoch start).
        self._recorded: dict[str, Any] | None = None
        self._recorded_key: RecordKey | None = None

    def _upstream_guard(self) -> ContextManager[Any]:
        """Held while the consumer's side reads the upstream (Prefetch: the producer's lock)."""
        return contextlib.nullcontext()

    def _record(self, state: dict[str, Any], key: RecordKey | None) -> None:
        """The item just handed out left the upstream at ``state`` with ``key``."""
        self._recorded, self._recorded_key = state, key

    def _record_live(self) -> None:
        """Record the live upstream before reading ahead of it, if nothing is recorded yet."""
        if self._recorded is None:
            with self._upstream_guard():
                self._record(self.upstream._state(progress=True), self.upstream.last_key())

    def _drop_ahead(self) -> bool:
        """Stop reading ahead and forget what was read; True if the upstream may have moved
        past the last item handed out."""
        raise NotImplementedError

    def _rewind(self) -> None:
        """Drop the read-ahead and return the upstream to the last item handed out."""
        if self._drop_ahead() and self._recorded is not None:
            self.upstream._load(self._recorded, f"{self.kind} > {self.upstream.kind}")

    # -- epochs and provenance ------------------------------------------------------------------

    def _begin_epoch(self, epoch: int | None) -> None:
        # Rewind first: an upstream that read into its next epoch (an inner repeat, a mix
        # component) must start the epoch after the consumer's, not after the reader's.
        self._rewind()
        super()._begin_epoch(epoch)
        self._recorded, self._recorded_key = None, None

    def _known_length(self) -> int:
        """The upstream's: one item handed out per item read (the reader's lead is not counted)."""
        with self._upstream_guard():
            return len(self.upstream)

    def last_key(self) -> RecordKey | None:
        if self._recorded is None:
            return self.upstream.last_key()
        return self._recorded_key

    # -- state ------------------------------------------------------------------------------

    def _child_state(self, child: Node[Any], progress: bool) -> dict[str, Any]:
        """The upstream's state as of the last item handed out, not as of the read-ahead."""
        if progress and self._recorded is not None:
            return self._recorded
        with self._upstream_guard():
            return child._state(progress=progress)

    def _load(self, state: Any, path: str, progress: bool = True) -> None:
        self._drop_ahead()
        self._recorded, self._recorded_key = None, None
        super()._load(state, path, progress)
