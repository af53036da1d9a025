"""State as of the last item handed out, for nodes that read their upstream ahead of the consumer.

Prefetch (a producer thread) and ParallelMap (a window of records in a pool) pull items from
their upstream before the consumer asks for them. Each item travels with the upstream's mark
(``Node._mark``: its counters, from which its state is built later) and key right after it;
when the item is handed out, those become the node's *recorded* state, which is what
``get_state()`` saves. Only a recorded mark is ever built into a state, once. Whenever the
read-ahead is dropped (a new epoch, a shutdown), the upstream, which ran ahead, is first
returned to the recorded state, so that what follows depends only on what the consumer
received, never on how far the reader had got.
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager, TypeVar

from resumable.core.keys import RecordKey
from resumable.core.node import Mark, Node

T = TypeVar("T")


class ReadAhead(Node[T]):
    """Base of nodes that read their upstream ahead; subclasses implement ``_drop_ahead``."""

    upstream: Node[Any]

    def __init__(self, upstream: Node[Any]) -> None:
        super().__init__(upstream)
        # Upstream mark and key as of the last item handed out; None: the live upstream's
        # (nothing was read ahead since the last restore or epoch start). The mark's state is
        # built once, when first asked for.
        self._recorded: Mark | None = None
        self._recorded_state: dict[str, Any] | None = None
        self._recorded_key: RecordKey | None = None

    def _upstream_guard(self) -> ContextManager[Any]:
        """Held while the consumer's side reads the upstream (Prefetch: the producer's lock)."""
        return contextlib.nullcontext()

    def _record(self, mark: Mark, key: RecordKey | None) -> None:
        """The item just handed out left the upstream at ``mark`` with ``key``."""
        self._recorded, self._recorded_state, self._recorded_key = mark, None, key

    def _record_live(self) -> None:
        """Record the live upstream before reading ahead of it, if nothing is recorded yet."""
        if self._recorded is None:
            with self._upstream_guard():
                self._record(self.upstream._mark(), self.upstream.last_key())

    def _recorded_upstream_state(self, recorded: Mark) -> dict[str, Any]:
        """The upstream's state as of the last item handed out (``recorded``, its mark)."""
        state = self._recorded_state
        if state is None:
            # Without the reader's lock: a prefetch's consumer must not wait for the item being
            # produced, and what the state reads of the live nodes (their options and file
            # fingerprints) does not change as they are read.
            state = self._recorded_state = self.upstream._marked_state(recorded)
        return state

    def _drop_ahead(self) -> bool:
        """Stop reading ahead and forget what was read; True if the upstream may have moved
        past the last item handed out."""
        raise NotImplementedError

    def _rewind(self) -> None:
        """Drop the read-ahead and return the upstream to the last item handed out."""
        recorded = self._recorded
        if self._drop_ahead() and recorded is not None:
            self.upstream._load(self._recorded_upstream_state(recorded), f"{self.kind} > {self.upstream.kind}")

    # -- epochs and provenance ------------------------------------------------------------------

    def _begin_epoch(self, epoch: int | None) -> None:
        # Rewind first: an upstream that read into its next epoch (an inner repeat, a mix
        # component) must start the epoch after the consumer's, not after the reader's.
        self._rewind()
        super()._begin_epoch(epoch)
        self._record_none()

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
        recorded = self._recorded
        if progress and recorded is not None:
            return self._recorded_upstream_state(recorded)
        with self._upstream_guard():
            return child._state(progress=progress)

    def _load(self, state: Any, path: str, progress: bool = True) -> None:
        self._drop_ahead()
        self._record_none()
        super()._load(state, path, progress)

    def _record_none(self) -> None:
        """Nothing read ahead: the live upstream is the state (after a restore, at an epoch start)."""
        self._recorded, self._recorded_state, self._recorded_key = None, None, None
