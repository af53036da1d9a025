"""State as of the last item handed out, for nodes that read their upstream ahead of the consumer.

Prefetch (a producer thread) and ParallelMap (a window of records in a pool) pull items from
their upstream before the consumer asks for them. Each item travels with the upstream's mark
(``Node._mark``: its counters, from which its state is built later) and key right after it;
when the item is handed out, those become the node's *recorded* state, which is what
``get_state()`` saves. Only a recorded mark is ever built into a state, with the headers the
live nodes have when it is built (a file's mtime recorded since, a grown list). Whenever the
read-ahead is dropped (a new epoch, a shutdown), the upstream, which ran ahead, is first
returned to the recorded state, so that what follows depends only on what the consumer
received, never on how far the reader had got.

The reader belongs to the process that started it. A copy of the node in another process (a
forked DataLoader worker, an unpickled copy) starts without it, with its upstream returned to the
recorded state first: a pickled node is returned before it is pickled, as ``close()`` would; a
forked one right after the fork, as its parent's consumer was (see ``as_in_parent``), since the
fork's own DataLoader worker number is not known yet.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, ClassVar, ContextManager, TypeVar

from resumable._forks import InheritedByForks, Settle, inherited
from resumable.core.keys import RecordKey
from resumable.core.node import Mark, Node
from resumable.order.topology import as_in_parent

T = TypeVar("T")


class ReadAhead(Node[T], InheritedByForks):
    """Base of nodes that read their upstream ahead; subclasses implement ``_drop_ahead``."""

    upstream: Node[Any]
    # Attributes that belong to the process running the reader (its thread, pool, locks): left
    # out of a pickled copy, replaced in a forked one by ``_fresh_reader``.
    _reader_attributes: ClassVar[tuple[str, ...]] = ("_finalizer",)

    def __init__(self, upstream: Node[Any]) -> None:
        super().__init__(upstream)
        self._fresh_reader()
        inherited(self)
        # Upstream mark and key as of the last item handed out; None: the live upstream's
        # (nothing was read ahead since the last restore or epoch start).
        self._recorded: Mark | None = None
        self._recorded_key: RecordKey | None = None

    def _upstream_guard(self) -> ContextManager[Any]:
        """Held while the consumer's side reads the upstream (Prefetch: the producer's lock)."""
        return contextlib.nullcontext()

    def _record(self, mark: Mark, key: RecordKey | None) -> None:
        """The item just handed out left the upstream at ``mark`` with ``key``."""
        self._recorded, self._recorded_key = mark, key

    def _record_live(self) -> None:
        """Record the live upstream before reading ahead of it, if nothing is recorded yet."""
        if self._recorded is None:
            with self._upstream_guard():
                self._record(self.upstream._mark(), self.upstream.last_key())

    def _recorded_upstream_state(self, recorded: Mark) -> dict[str, Any]:
        """The upstream's state as of the last item handed out (``recorded``, its mark), built
        now: without the reader's lock, since a prefetch's consumer must not wait for the item
        being produced, and what the state reads of the live nodes (their headers) does not
        change as they are read."""
        return self.upstream._marked_state(recorded)

    def _drop_ahead(self) -> bool:
        """Stop reading ahead and forget what was read; True if the upstream may have moved
        past the last item handed out."""
        raise NotImplementedError

    def _rewind(self) -> None:
        """Drop the read-ahead and return the upstream to the last item handed out."""
        if self._drop_ahead():
            self._return_to_record()

    def _return_to_record(self) -> None:
        """Load the recorded state into the upstream (nothing recorded: it is the live one)."""
        recorded = self._recorded
        if recorded is not None:
            self.upstream._load(self._recorded_upstream_state(recorded), f"{self.kind} > {self.upstream.kind}")

    # -- copies in other processes ----------------------------------------------------------

    def _fresh_reader(self) -> None:
        """Set ``_reader_attributes`` as before the first item, without touching their old
        values (in a fork they are the parent's: a lock its thread may hold, its pool)."""
        self._finalizer: weakref.finalize[..., ReadAhead[T]] | None = None  # stops the reader when dropped

    def _reads_ahead(self) -> bool:
        """Hook: whether a reader runs and may have moved the upstream past the record."""
        raise NotImplementedError

    def __getstate__(self) -> dict[str, Any]:
        """What pickles: the node returned to its last item handed out (its reader stopped, as
        by ``close()``; it restarts on the next item), without the reader."""
        self._rewind()
        return {name: value for name, value in self.__dict__.items() if name not in self._reader_attributes}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._fresh_reader()
        inherited(self)

    def _forget_the_parent(self) -> Settle:
        """In a forked child: the reader stayed with the parent (its thread is not here, its
        lock may be held, its pool is the parent's), so the node forgets it without touching
        it; once every node has, the upstream returns to the last item handed out, read as the
        parent's consumer, before torch tells this process which worker it is."""
        if self._finalizer is not None:
            self._finalizer.detach()  # it would stop the parent's reader
        moved = self._reads_ahead()
        self._fresh_reader()
        return self._return_as_in_parent if moved else None

    def _return_as_in_parent(self) -> None:
        with as_in_parent():
            self._return_to_record()

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
        self._recorded, self._recorded_key = None, None
