"""Elastic re-split arithmetic: what old consumers left of an epoch, spread over new consumers.

``C`` old consumers read a space of ``M`` positions in strides (consumer ``c`` owns ``c, c + C,
...``) and stopped at cursors ``k_c`` (positions of their own stride read). What is left is

* the *band*: for each ``c``, its positions ``c + p*C`` with ``k_c <= p < min(top, size_c)``,
  where ``top = max k_c``, enumerated consumer by consumer, and
* the *tail*: every position from ``top * C`` to ``M``.

Band then tail form a new, dense space of positions that the new consumers stride over as
usual, so new shards differ in size by at most one. A ``Level`` maps that space back to its
parent; levels stack across rescales. Once every consumer of a level's space has passed its
band, only the tail is ever asked for and the level compacts to an ``Offset``, one integer.

When old consumers read their strides in a shuffled order (a shuffle after the shard), their
cursors count positions of that order: a ``Reorder`` step under the level maps ``c + j*C`` to
``c + order(j)*C`` with the shuffles' keyed bijections (``resumable.order.orders``).
Pure numpy functions over int64 arrays: nothing is materialised per position.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Sequence, TypeGuard, Union

import numpy as np

from resumable.core.state import is_count
from resumable.errors import StateError
from resumable.order import orders

CONSUMERS = "consumers"
TOP = "top"
BEHIND = "behind"
LENGTH = "length"
SHIFT = "shift"
FIRST = "first"
ORDERS = "orders"
MAX_POSITION = 2**62
"""Largest position or size a saved remap may hold, so that sums stay inside int64."""


def shard_sizes(total: int, num_consumers: int) -> np.ndarray:
    """How many of the positions ``[0, total)`` each consumer owns (strides of ``num_consumers``)."""
    consumers = np.arange(num_consumers, dtype=np.int64)
    return np.where(consumers < total, (total - consumers + num_consumers - 1) // num_consumers, 0)


@dataclass(frozen=True)
class Level:
    """The positions left by ``C`` consumers at ``cursors`` in a parent space of ``parent_length``."""

    parent_length: int
    cursors: np.ndarray  # k_c, int64, one per old consumer
    top: int = field(init=False)
    band: int = field(init=False)
    _band_consumers: np.ndarray = field(init=False, repr=False)
    _band_cursors: np.ndarray = field(init=False, repr=False)
    _band_starts: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        cursors = self.cursors
        sizes = shard_sizes(self.parent_length, len(cursors))
        top = int(cursors.max())
        leftovers = np.minimum(top, sizes) - cursors
        owners = np.flatnonzero(leftovers > 0)
        starts = np.zeros(len(owners), dtype=np.int64)
        np.cumsum(leftovers[owners][:-1], out=starts[1:])
        object.__setattr__(self, "top", top)
        object.__setattr__(self, "band", int(leftovers[owners].sum()))
        object.__setattr__(self, "_band_consumers", owners.astype(np.int64))
        object.__setattr__(self, "_band_cursors", cursors[owners])
        object.__setattr__(self, "_band_starts", starts)

    @property
    def consumers(self) -> int:
        return len(self.cursors)

    @property
    def tail_start(self) -> int:
        """The first parent position of the tail (every position from here on is left)."""
        return min(self.top * self.consumers, self.parent_length)

    def __len__(self) -> int:
        return self.band + self.parent_length - self.tail_start

    def to_parent(self, positions: np.ndarray) -> np.ndarray:
        """Parent positions of positions of this level's space."""
        positions = np.asarray(positions, dtype=np.int64)
        parents = positions - self.band + self.tail_start
        in_band = positions < self.band
        if in_band.any():
            band_positions = positions[in_band]
            owner = np.searchsorted(self._band_starts, band_positions, side="right") - 1
            strides = self._band_cursors[owner] + band_positions - self._band_starts[owner]
            parents[in_band] = self._band_consumers[owner] + strides * self.consumers
        return parents

    @cached_property
    def floor(self) -> int:
        """The lowest parent position this level can ask for."""
        if self.band:
            return int((self._band_consumers + self._band_cursors * self.consumers).min())
        return self.tail_start

    def to_json(self) -> dict[str, Any]:
        return self._json

    @cached_property
    def _json(self) -> dict[str, Any]:
        """Built once: a state taken every step shares it (states are read-only values)."""
        return {
            LENGTH: self.parent_length,
            CONSUMERS: self.consumers,
            TOP: self.top,
            BEHIND: (self.top - self.cursors).tolist(),
        }

    def compacted(self) -> Offset:
        """This level for positions in its tail only."""
        return Offset(self.tail_start - self.band)


@dataclass(frozen=True)
class Offset:
    """A compacted level: position ``i`` of this space is ``i + shift`` of the parent."""

    shift: int

    def to_parent(self, positions: np.ndarray) -> np.ndarray:
        return np.asarray(positions, dtype=np.int64) + self.shift

    def to_json(self) -> dict[str, Any]:
        return {SHIFT: self.shift}


@dataclass(frozen=True)
class Reorder:
    """Old consumers' reading orders: position ``c + j*C`` of this space (the ``j``-th position
    consumer ``c`` of ``C`` read) is ``c + order(j)*C`` of the parent, a space of the same size."""

    length: int
    consumers: int
    epoch: int
    orders: tuple[orders.Order, ...]  # top first, as a cursor's position passes through them

    def to_parent(self, positions: np.ndarray) -> np.ndarray:
        positions = np.asarray(positions, dtype=np.int64)
        owners, strides = np.divmod(positions, self.consumers)[::-1]
        sizes = shard_sizes(self.length, self.consumers)[owners]
        # Strides differ in size by at most one: evaluate each size's orders once.
        for size in np.unique(sizes).tolist():
            selected = np.flatnonzero(sizes == size)
            picked = strides[selected]
            for order in self.orders:
                picked = orders.take(order, picked, size, self.epoch)
            strides[selected] = picked
        base: np.ndarray = owners + strides * self.consumers
        return base

    def to_json(self) -> dict[str, Any]:
        saved = [[kind, config] for kind, config in self.orders]
        return {LENGTH: self.length, CONSUMERS: self.consumers, ORDERS: saved}


Step = Union[Level, Offset, Reorder]


@dataclass(frozen=True)
class Remap:
    """The positions of one epoch left over by earlier topologies: ``steps`` from the newest
    space down to the epoch's own positions, and the size ``length`` of the newest space.
    Positions below ``first`` were compacted away (a consumer's state keeps only what lies
    ahead of its cursor) and cannot be mapped."""

    epoch: int
    length: int
    steps: tuple[Step, ...]
    first: int = 0

    def to_base(self, positions: np.ndarray) -> np.ndarray:
        if self.first and len(positions) and int(np.min(positions)) < self.first:
            raise IndexError(
                f"position {int(np.min(positions))} of rescaled epoch {self.epoch} lies before this "
                f"consumer's checkpoint (the remap keeps positions from {self.first} on)"
            )
        for step in self.steps:
            positions = step.to_parent(positions)
        return positions

    def compacted(self, first: int) -> Remap:
        """The same map for positions ``>= first`` only: every level whose band lies wholly
        below what those positions reach becomes an offset. Steps are not merged, so states of
        consumers that compacted different levels still line up (``merge``)."""
        floor, steps, changed = first, [], False
        for step in self.steps:
            if isinstance(step, Level) and floor >= step.band:
                step, changed = step.compacted(), True
            steps.append(step)
            floor = _floor_below(step, floor)
        return Remap(self.epoch, self.length, tuple(steps) if changed else self.steps, first)

    def to_json(self) -> dict[str, Any]:
        value = {"epoch": self.epoch, LENGTH: self.length, "steps": [step.to_json() for step in self.steps]}
        if self.first:
            value[FIRST] = self.first
        return value

    @classmethod
    def from_json(cls, value: Any, path: str, base_length: int | None = None) -> Remap:
        """The remap saved as ``value``; StateError unless it is well formed and its steps chain
        from ``length`` positions down to ``base_length`` (the epoch's positions), when given."""
        if not isinstance(value, dict) or not isinstance(value.get("steps"), list):
            raise StateError(f"{path}: remap entry {str(value)[:80]!r} is not a remap")
        epoch, length, first = value.get("epoch"), value.get(LENGTH), value.get(FIRST, 0)
        if not (_is_count(epoch) and _is_count(length) and _is_count(first)):
            raise StateError(f"{path}: remap epoch, length and first must be ints in [0, {MAX_POSITION}]")
        remap = cls(epoch, length, tuple(_step_from_json(step, epoch, path) for step in value["steps"]), first)
        if base_length is not None and remap.base_length(path) != base_length:
            raise StateError(
                f"{path}: the remap maps {length} positions onto {remap.base_length(path)}, "
                f"this epoch has {base_length}"
            )
        return remap

    def base_length(self, path: str) -> int:
        """Positions of the epoch this remap maps onto: its steps' spaces, newest to oldest, must
        chain (a compacted level's parent is its size plus its shift)."""
        size = self.length
        for step in self.steps:
            if isinstance(step, Level):
                if len(step) != size:
                    raise StateError(f"{path}: a remap level leaves {len(step)} positions where {size} are mapped")
                size = step.parent_length
            elif isinstance(step, Reorder):
                if step.length != size:
                    raise StateError(f"{path}: a remap reorder spans {step.length} positions where {size} are mapped")
            else:
                size += step.shift
        return size


def merge(remaps: Sequence[Remap], path: str) -> Remap:
    """One remap from old consumers' compacted copies of the same remap: at each step, the
    full level if any consumer still had it."""
    head = remaps[0]
    if any((r.epoch, r.length, len(r.steps)) != (head.epoch, head.length, len(head.steps)) for r in remaps):
        raise StateError(f"{path}: old consumers hold different remaps; they come from different checkpoints")
    steps = []
    for index in range(len(head.steps)):
        candidates = [remap.steps[index] for remap in remaps]
        step = next((s for s in candidates if isinstance(s, Level)), candidates[0])
        # A level's copies are the level itself or its compacted offset, nothing else.
        allowed = (step.to_json(), step.compacted().to_json()) if isinstance(step, Level) else (step.to_json(),)
        if any(candidate.to_json() not in allowed for candidate in candidates):
            raise StateError(f"{path}: old consumers hold different remaps; they come from different checkpoints")
        steps.append(step)
    return Remap(head.epoch, head.length, tuple(steps))


def rescale(
    remap: Remap | None,
    epoch: int,
    space_length: int,
    cursors: Sequence[int],
    reading_orders: Sequence[orders.Order] = (),
) -> Remap:
    """The remap after old consumers stopped at ``cursors`` in a space of ``space_length``
    (the newest space of ``remap``, or the epoch's positions when ``remap`` is None), having
    read their strides through ``reading_orders`` (shuffles after the shard, top first)."""
    if remap is not None and (remap.epoch != epoch or remap.length != space_length):
        raise StateError(
            f"remap of epoch {remap.epoch} over {remap.length} positions does not fit epoch {epoch} over {space_length}"
        )
    cursor_array = np.asarray(cursors, dtype=np.int64)
    sizes = shard_sizes(space_length, len(cursor_array))
    bad = np.flatnonzero((cursor_array < 0) | (cursor_array > sizes))
    if len(bad):
        consumer = int(bad[0])
        raise StateError(
            f"consumer {consumer} of {len(cursor_array)} is at position {int(cursor_array[consumer])}, "
            f"its shard has {int(sizes[consumer])}"
        )
    if remap is not None and remap.first:
        remap = Remap(remap.epoch, remap.length, remap.steps)
    level = Level(space_length, cursor_array)
    newest: Step = level if level.band else Offset(level.tail_start)
    floor = level.floor
    steps: list[Step] = [newest]
    if reading_orders:
        steps.append(Reorder(space_length, len(cursor_array), epoch, tuple(reading_orders)))
        floor = 0
    for step in remap.steps if remap is not None else ():
        if isinstance(step, Level) and floor >= step.band:  # every position asked for is in the tail
            step = Offset(step.tail_start - step.band)
        steps.append(step)
        floor = _floor_below(step, floor)
    return Remap(epoch, len(level), _merge_offsets(steps))


def _floor_below(step: Step, floor: int) -> int:
    """The lowest parent position ``step`` asks for, given the lowest of its own space."""
    if isinstance(step, Offset):
        return floor + step.shift
    if isinstance(step, Reorder):
        return 0  # a reading order may send any position anywhere
    return step.floor


def _merge_offsets(steps: list[Step]) -> tuple[Step, ...]:
    merged: list[Step] = []
    for step in steps:
        if isinstance(step, Offset) and merged and isinstance(merged[-1], Offset):
            merged[-1] = Offset(merged[-1].shift + step.shift)
        else:
            merged.append(step)
    return tuple(step for step in merged if not (isinstance(step, Offset) and step.shift == 0))


def _step_from_json(value: Any, epoch: int, path: str) -> Step:
    if isinstance(value, dict) and set(value) == {SHIFT} and _is_count(value[SHIFT]):
        return Offset(value[SHIFT])
    if isinstance(value, dict) and set(value) == {LENGTH, CONSUMERS, ORDERS}:
        length, consumers, saved = value[LENGTH], value[CONSUMERS], value[ORDERS]
        if _is_count(length) and _is_count(consumers) and consumers > 0 and isinstance(saved, list) and saved:
            return Reorder(length, consumers, epoch, tuple(orders.check_order(order, path) for order in saved))
    if isinstance(value, dict) and set(value) == {LENGTH, CONSUMERS, TOP, BEHIND}:
        length, consumers, top, behind = value[LENGTH], value[CONSUMERS], value[TOP], value[BEHIND]
        if (
            _is_count(length)
            and _is_count(top)
            and _is_count(consumers)
            and consumers > 0
            and isinstance(behind, list)
            and len(behind) == consumers
            and all(_is_count(b) and b <= top for b in behind)
            and min(behind) == 0  # top is the furthest cursor
        ):
            cursors = top - np.asarray(behind, dtype=np.int64)
            if (cursors <= shard_sizes(length, consumers)).all():
                return Level(length, cursors)
    raise StateError(f"{path}: remap step {str(value)[:80]!r} is not a level or an offset")


def _is_count(value: Any) -> TypeGuard[int]:
    """An int in ``[0, MAX_POSITION]``: positions and sizes stay exact in int64 arithmetic."""
    return is_count(value, MAX_POSITION)
