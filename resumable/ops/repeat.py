"""Repeat: run epochs back to back."""

from __future__ import annotations

from typing import Any, Sequence, TypeVar

from resumable.core.indexed import IndexedNode
from resumable.core.keys import RecordKey
from resumable.core.node import Node
from resumable.core.options import int_option
from resumable.core.state import require, require_count
from resumable.errors import ConfigError, StateError
from resumable.ops.batch import Batch
from resumable.ops.map import Map
from resumable.ops.read_ahead import ReadAhead
from resumable.order.shard import Shard

T = TypeVar("T")

TIMES = "times"
EPOCHS_DONE = "epochs_done"
YIELDED = "yielded"


class Repeat(Node[T]):
    """Start the upstream's next epoch (a new shuffle order) each time it ends.

    Runs forever when ``times`` is None, else for ``times`` epochs. An upstream epoch that
    yields nothing ends the iteration instead of spinning forever.
    """

    kind = "Repeat"

    upstream: Node[Any]

    def __init__(self, upstream: Node[T], times: int | None = None) -> None:
        super().__init__(upstream)
        times = int_option(self.kind, TIMES, times, optional=True)
        _refuse_inner_repeat(upstream)
        self.times = times
        self.epochs_done = 0
        self._yielded = False

    def _config(self) -> dict[str, Any]:
        return {TIMES: self.times}

    def _next(self) -> T:
        upstream = self.upstream
        while True:
            try:
                item: T = next(upstream)
            except StopIteration:
                self.epochs_done += 1
                if not self._yielded or (self.times is not None and self.epochs_done >= self.times):
                    raise
                upstream.next_epoch()
                self._yielded = False
                continue
            self._yielded = True
            return item

    def _known_length(self) -> int:
        """``times`` upstream epochs, known when each has as many items as the current one."""
        if self.times is None:
            raise TypeError(f"{self.kind}: repeat() without a count runs forever; use .repeat(n) for a known length")
        length = len(self.upstream)
        varying = _varying_length(self.upstream)
        if varying is not None:
            raise TypeError(f"{self.kind}: {varying}, so {self.times} epochs of it have no single length")
        return self.times * length

    def _on_epoch_start(self) -> None:
        self.epochs_done = 0
        self._yielded = False

    def last_key(self) -> RecordKey | None:
        return self.upstream.last_key()

    def fetch_many(self, keys: Sequence[RecordKey]) -> list[T]:
        return self.upstream.fetch_many(keys)

    def _progress(self) -> dict[str, Any]:
        return {EPOCHS_DONE: self.epochs_done, YIELDED: self._yielded}

    def _restore(self, state: dict[str, Any], path: str) -> None:
        self.epochs_done = require_count(state, EPOCHS_DONE, path)
        self._yielded = require(state, YIELDED, bool, path)

    def _rescale(self, olds: list[dict[str, Any]], path: str, consumer: int, num_consumers: int) -> dict[str, Any]:
        state = self._fresh_rescaled(olds, path)
        # A consumer that finished its last epoch counts it as done while its cursor stays in
        # it, so counts may span two epochs where the cursors (checked by the rescale) span one.
        done = [require_count(old, EPOCHS_DONE, path) for old in olds]
        if max(done) - min(done) > 2:
            raise StateError(f"{path}: old consumers are more than one epoch apart ({EPOCHS_DONE} {sorted(set(done))})")
        state[EPOCHS_DONE] = min(done)
        # The epoch being continued gave items if any old consumer had any, or moved past it.
        state[YIELDED] = any(require(old, YIELDED, bool, path) or epochs > min(done) for old, epochs in zip(olds, done))
        return state


def _varying_length(upstream: Node[Any]) -> str | None:
    """Why the upstream's epochs may differ in length (naming the node), or None when each has
    as many items as the current one: records by random access (no shard rescaled this epoch),
    through maps, read-ahead and batches."""
    for node in upstream._subtree():
        if isinstance(node, Shard) and node.remap is not None:
            return (
                f"{node.kind} was rescaled: this epoch holds what the old consumers left of it, the next ones "
                "a whole stride"
            )
        if not isinstance(node, (IndexedNode, Map, ReadAhead, Batch)):
            return f"the length of {node.kind} may change from one epoch to the next"
    return None


def _refuse_inner_repeat(upstream: Node[Any]) -> None:
    """Raise ConfigError if ``upstream`` repeats already: the inner repeat restarts its count on
    every outer pass, so a rescale of consumers in different outer passes could not tell which
    pass of each to continue."""
    if any(isinstance(node, Repeat) for node in upstream._subtree()):
        raise ConfigError(
            f"Repeat: its upstream {upstream!r} already repeats; use a single .repeat(n * m) "
            "(.repeat() to run endlessly), and with a mix, repeat the components or the mix, not both"
        )
    from resumable.ops.even import Even  # even.py imports this module

    if any(isinstance(node, Even) for node in upstream._subtree()):
        raise ConfigError(
            f"Repeat: its upstream {upstream!r} holds an Even, which runs the epochs itself; "
            "use .even(times=n) instead of .even().repeat(n)"
        )
