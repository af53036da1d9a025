"""Shard: each rank (and each DataLoader worker) keeps its own stride of positions."""

from __future__ import annotations

from typing import Any, Sequence, TypeVar

import numpy as np

from resumable.core.indexed import IndexedNode
from resumable.core.keys import RecordKey, Stride
from resumable.core.state import check_header, require
from resumable.errors import ConfigError, StateError
from resumable.order.elastic import Remap, Share
from resumable.order.partition import shard_size, shard_to_global
from resumable.order.topology import Consumer, Topology

T = TypeVar("T")

REMAP = "remap"
NEXT_REMAP = "next_remap"
"""The remap of the epoch after ``REMAP``'s, when a rescale cut two epochs short (old consumers
on both sides of an epoch boundary, as after ``.repeat()``)."""


class Shard(IndexedNode[T]):
    """Positions ``c, c + C, ...`` of the upstream, for consumer ``c`` of ``C``.

    ``rank`` and ``world_size`` default to torch.distributed, else RANK/WORLD_SIZE, else (0, 1).
    Inside a torch DataLoader worker the rank's share is split further by worker
    (``c = rank * num_workers + worker``) unless ``split_workers=False``. The topology is
    resolved in the process that iterates, so a pipeline built before the workers start
    still splits correctly.

    After an elastic rescale (``resumable.elastic``) the shard also holds a ``Remap`` for the
    epoch that was cut short: this consumer's stride then runs over the positions that the
    old consumers left, and from the next epoch on over the whole epoch again.
    """

    kind = "Shard"

    upstream: IndexedNode[Any]

    def __init__(
        self,
        upstream: IndexedNode[T],
        rank: int | None = None,
        world_size: int | None = None,
        split_workers: bool = True,
    ) -> None:
        super().__init__(upstream)
        if any(isinstance(node, Shard) for node in upstream._subtree()):
            raise ConfigError(
                f"{self.kind}: {upstream!r} is sharded already; a second .shard() would split each "
                "consumer's stride again and leave the rest of the epoch unread: keep one .shard()"
            )
        self._consumer = Consumer(rank, world_size, split_workers, self.kind)
        self.remap: Remap | None = None
        self.next_remap: Remap | None = None
        self._cursor: tuple[int, int] | None = None  # (epoch, position) of the cursor at get_state
        self._saved_remap: tuple[int, dict[str, Any]] | None = None  # (first, JSON) last saved
        self._own_stride: Stride | None = None  # this consumer's stride, one object for all its keys
        self._tail: tuple[Remap, tuple[int, int] | None] | None = None  # a remap and its tail_shift()

    @property
    def topology(self) -> Topology:
        """This process's consumer; resolved again after a fork (a new DataLoader worker)."""
        return self._consumer.resolve()[0]

    def __len__(self) -> int:
        """This consumer's stride of the epoch being read: over the positions the old consumers
        left while ``remap`` (always the current epoch's) is held."""
        return self._stride(self.remap)

    def _remap_of(self, epoch: int) -> Remap | None:
        for remap in (self.remap, self.next_remap):
            if remap is not None and remap.epoch == epoch:
                return remap
        return None

    def _length(self, epoch: int) -> int:
        return self._stride(self._remap_of(epoch))

    def _stride(self, remap: Remap | None) -> int:
        """This consumer's share of the upstream's positions, or of ``remap``'s space."""
        topology = self.topology
        total = len(self.upstream) if remap is None else remap.length
        return shard_size(total, topology.consumer, topology.num_consumers)

    def _enter_epoch(self, epoch: int) -> None:
        if self.remap is not None and self.remap.epoch != epoch:
            # The rescaled epoch is over: the next one may have been cut short too, any later
            # one is split whole again.
            following = self.next_remap
            self.remap = following if following is not None and following.epoch == epoch else None
            self.next_remap = None
            self._cursor, self._saved_remap = None, None
        super()._enter_epoch(epoch)

    def _leaf_indices(self, positions: np.ndarray, epoch: int) -> np.ndarray:
        topology = self.topology
        parent_positions = shard_to_global(positions, topology.consumer, topology.num_consumers)
        remap = self._remap_of(epoch)
        if remap is not None:
            parent_positions = remap.to_base(parent_positions)
        return self.upstream._leaf_indices(parent_positions, epoch)

    def _stride_base(self) -> IndexedNode[Any]:
        return self.upstream

    def _stride_key(self, epoch: int, position: int) -> RecordKey | None:
        """Position ``position`` as a stride key: of this consumer's stride, or under a remap,
        past the levels' bands where the remap is a shift (``Remap.tail_shift``), of the stride
        of ``C`` that the shifted positions form; None in a band or under a reading order."""
        topology = self.topology
        consumer, consumers = topology.consumer, topology.num_consumers
        remap = self._remap_of(epoch)
        if remap is None:
            stride = self._own_stride
            if stride is None or stride != (consumer, consumers):
                stride = self._own_stride = Stride(consumer, consumers)
            return (stride, epoch, position)
        if self._tail is None or self._tail[0] is not remap:
            self._tail = (remap, remap.tail_shift())
        tail = self._tail[1]
        at = consumer + position * consumers
        if tail is None or at < tail[0]:
            return None
        below = at + tail[1]
        return (Stride(below % consumers, consumers), epoch, below // consumers)

    def _raw_chunk(self, start: int, count: int, epoch: int) -> Sequence[Any]:
        if self.topology.num_consumers == 1 and self._remap_of(epoch) is None:
            return self.upstream._raw_chunk(start, count, epoch)
        return super()._raw_chunk(start, count, epoch)

    def _pass_cursor(self, epoch: int, position: int) -> None:
        self._cursor = (epoch, position)

    def _check_cursor(self, epoch: int, position: int, path: str) -> None:
        remap = self._remap_of(epoch)
        if remap is not None and remap.first > self._first_kept(position):
            raise StateError(
                f"{path}: the remap keeps positions from {remap.first} on, the cursor at {position} needs "
                f"{self._first_kept(position)}"
            )
        if remap is not None:
            self._check_share(remap, self._first_kept(position), path)
        if self.next_remap is not None:
            self._check_share(self.next_remap, 0, path)
        super()._check_cursor(epoch, position, path)

    def _first_kept(self, position: int) -> int:
        """The first position of the remap's space a cursor at ``position`` may still ask for:
        the record before it too, as last_key() names it after a restore."""
        topology = self.topology
        return topology.consumer + max(position - 1, 0) * topology.num_consumers

    def _varies(self) -> bool:
        """A remap is saved compacted for the cursor, and an epoch's end drops it."""
        return self.remap is not None or self.next_remap is not None

    def _state(self, progress: bool) -> dict[str, Any]:
        state = super()._state(progress)
        if self.remap is not None:
            state[REMAP] = self._remap_json(self.remap)
        if self.next_remap is not None:
            state[NEXT_REMAP] = self.next_remap.to_json()
        return state

    def _remap_json(self, remap: Remap) -> dict[str, Any]:
        """``remap`` (this shard's) as saved: compacted for the positions ahead of the cursor, so
        once this consumer has passed a level's band its state keeps one integer for it."""
        cursor = self._cursor
        if cursor is None or cursor[0] != remap.epoch:
            return remap.to_json()
        first = self._first_kept(cursor[1])
        if self._saved_remap is None or self._saved_remap[0] != first:
            self._saved_remap = (first, remap.compacted(first).to_json())
        return self._saved_remap[1]

    def _load(self, state: Any, path: str, progress: bool = True) -> None:
        check_header(state, self.kind, path)
        base = len(self.upstream)
        remap = next_remap = None
        if REMAP in state:
            remap = Remap.from_json(require(state, REMAP, dict, path), path, base_length=base)
        if NEXT_REMAP in state:
            next_remap = Remap.from_json(require(state, NEXT_REMAP, dict, path), path, base_length=base)
            if remap is None or next_remap.epoch != remap.epoch + 1:
                raise StateError(f"{path}: a {NEXT_REMAP!r} must be for the epoch after the {REMAP!r}'s")
        self.remap, self.next_remap = remap, next_remap
        self._cursor, self._saved_remap = None, None
        super()._load(state, path, progress)

    def _check_share(self, remap: Remap, first: int, path: str) -> None:
        """A saved remap whose newest level is a share must hold this consumer's band positions
        from ``first`` on: a share saved by another consumer is refused here, not when its first
        foreign position is read."""
        newest = remap.steps[0] if remap.steps else None
        if not isinstance(newest, Share):
            return
        topology = self.topology
        stride = np.arange(topology.consumer, newest.band, topology.num_consumers, dtype=np.int64)
        if not np.isin(stride[stride >= max(first, remap.first)], newest.keys, assume_unique=True).all():
            raise StateError(
                f"{path}: the remap of epoch {remap.epoch} holds another consumer's share of the rescaled "
                f"positions, not consumer {topology.consumer} of {topology.num_consumers}'s"
            )

    def _config(self) -> dict[str, Any]:
        return self.topology.config()

    def _header_key(self) -> object:
        return self.topology
