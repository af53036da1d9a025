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

A level is planned whole (``Level``, one cursor per old consumer) but saved per new consumer
as a ``Share``: the band positions that consumer can ever ask for, with their parents
(``Remap.share_for``), about ``band / C'`` of them instead of ``C`` cursors. A later rescale
merges the old consumers' shares back into one (``merge``): together they hold every band
position still unread. Long integer arrays are saved as text (``encode_ints``).
"""

from __future__ import annotations

import base64
import binascii
import zlib
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, Sequence, TypeGuard, Union

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
BAND = "band"
LOWEST = "lowest"
DIGEST = "digest"
KEYS = "keys"
PARENTS = "parents"
COUNT = "count"
MAX_POSITION = 2**62
"""Largest position or size a saved remap may hold, so that sums stay inside int64."""
MAX_CONSUMERS = 2**24
"""Most old consumers a saved level may name (far beyond any job; bounds what a state allocates)."""
ENCODED_LEVEL_CONSUMERS = 64
"""A level of at least this many old consumers saves its cursors encoded (``encode_ints``)."""
INT_WIDTHS = (1, 2, 4, 8)
"""Byte widths an encoded array may use per value."""
DEFLATE_LEVEL = 6
MAX_INFLATION = 1100
"""Deflate expands its input at most about 1032-fold, so text that claims more is refused
before anything is inflated."""


def encode_ints(values: np.ndarray) -> str:
    """Non-negative int64 ``values`` as ASCII text: ``"<width>:<base64>"`` of the deflated
    zigzag deltas, each in the fewest bytes that hold the largest. Sorted or clustered
    positions take a byte or two each before deflation, far less than their JSON digits."""
    array = np.asarray(values, dtype=np.int64)
    deltas = np.diff(array, prepend=np.int64(0)) if len(array) else array
    zigzag = (deltas.astype(np.uint64) << np.uint64(1)) ^ (deltas >> 63).astype(np.uint64)
    largest = int(zigzag.max()) if len(zigzag) else 0
    width = next(w for w in INT_WIDTHS if largest < 1 << (8 * w))
    packed = zlib.compress(zigzag.astype(f"<u{width}").tobytes(), DEFLATE_LEVEL)
    return f"{width}:{base64.b64encode(packed).decode('ascii')}"


def decode_ints(text: Any, count: int, path: str) -> np.ndarray:
    """The ``count`` values ``encode_ints`` saved as ``text``; StateError unless it decodes to
    exactly that many ints in ``[0, MAX_POSITION]`` (never inflating more than they take)."""
    head, _, body = text.partition(":") if isinstance(text, str) else ("", "", "")
    if head not in {str(w) for w in INT_WIDTHS}:
        raise StateError(f"{path}: encoded integers {str(text)[:40]!r} do not start with a byte width")
    width = int(head)
    if count * width > MAX_INFLATION * (len(body) + 1):
        raise StateError(f"{path}: {len(body)} characters of encoded integers cannot hold {count} values")
    try:
        inflater = zlib.decompressobj()
        raw = inflater.decompress(base64.b64decode(body, validate=True), count * width + 1)
    except (binascii.Error, ValueError, zlib.error) as error:
        raise StateError(f"{path}: encoded integers do not decode ({error})") from error
    if len(raw) != count * width or not inflater.eof:
        raise StateError(f"{path}: encoded integers hold {len(raw) / width:g}+ values, expected {count}")
    zigzag = np.frombuffer(raw, dtype=f"<u{width}").astype(np.uint64)
    deltas = (zigzag >> np.uint64(1)).astype(np.int64) ^ -((zigzag & np.uint64(1)).astype(np.int64))
    values = np.cumsum(deltas, dtype=np.int64)
    if len(values) and (int(values.min()) < 0 or int(values.max()) > MAX_POSITION):
        raise StateError(f"{path}: encoded integers fall outside [0, {MAX_POSITION}]")
    return values


def shard_sizes(total: int, num_consumers: int) -> np.ndarray:
    """How many of the positions ``[0, total)`` each consumer owns (strides of ``num_consumers``)."""
    consumers = np.arange(num_consumers, dtype=np.int64)
    return np.where(consumers < total, (total - consumers + num_consumers - 1) // num_consumers, 0)


class _BandAndTail:
    """What a ``Level`` and a ``Share`` of it both are: a space of ``band`` positions (what old
    consumers left below the fastest cursor, ``top``) followed by the parent's tail (every
    position from ``top`` strides on). Subclasses map the band; the tail maps the same way."""

    parent_length: int
    top: int
    band: int

    if TYPE_CHECKING:  # a Level derives these, a Share holds them as fields

        @property
        def consumers(self) -> int: ...

        @property
        def lowest(self) -> int: ...

        @property
        def digest(self) -> int: ...

    @property
    def tail_start(self) -> int:
        """The first parent position of the tail (every position from here on is left)."""
        return min(self.top * self.consumers, self.parent_length)

    def __len__(self) -> int:
        return self.band + self.parent_length - self.tail_start

    def _tail_parents(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Parent positions of ``positions`` as if all were in the tail, and which are in the
        band (the subclass maps those)."""
        positions = np.asarray(positions, dtype=np.int64)
        return positions - self.band + self.tail_start, positions < self.band

    def header(self) -> tuple[int, int, int, int, int, int]:
        """What a share of this level repeats of it (``Share``'s first fields)."""
        return (self.parent_length, self.consumers, self.top, self.band, self.lowest, self.digest)

    def compacted(self) -> Offset:
        """This level for positions in its tail only."""
        return Offset(self.tail_start - self.band)


@dataclass(frozen=True)
class Level(_BandAndTail):
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

    def to_parent(self, positions: np.ndarray) -> np.ndarray:
        """Parent positions of positions of this level's space."""
        positions = np.asarray(positions, dtype=np.int64)
        parents, in_band = self._tail_parents(positions)
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
        """Built once: a state taken every step shares it (states are read-only values). The
        distances behind ``top`` are a JSON list for a few consumers, encoded text for many."""
        behind = self.top - self.cursors
        return {
            LENGTH: self.parent_length,
            CONSUMERS: self.consumers,
            TOP: self.top,
            BEHIND: encode_ints(behind) if self.consumers >= ENCODED_LEVEL_CONSUMERS else behind.tolist(),
        }

    @property
    def lowest(self) -> int:
        """The slowest old consumer's cursor."""
        return int(self.cursors.min())

    @cached_property
    def digest(self) -> int:
        """CRC-32 of the cursors: shares of levels from different checkpoints never merge."""
        return zlib.crc32(self.cursors.astype("<i8").tobytes())


@dataclass(frozen=True)
class Share(_BandAndTail):
    """The part of a ``Level`` that one new consumer can ask for: the band positions ``keys``
    (sorted) and their ``parents``; the tail maps as in the level. Positions of the band it
    does not hold raise ``IndexError``: they belong to other consumers."""

    parent_length: int
    consumers: int
    top: int
    band: int
    lowest: int
    digest: int  # the whole level's (``Level.digest``)
    keys: np.ndarray
    parents: np.ndarray

    @property
    def cursors(self) -> np.ndarray:
        """The slowest and the fastest old cursor: all a share keeps of them."""
        return np.array([self.lowest, self.top], dtype=np.int64)

    def to_parent(self, positions: np.ndarray) -> np.ndarray:
        positions = np.asarray(positions, dtype=np.int64)
        parents, in_band = self._tail_parents(positions)
        if in_band.any():
            wanted = positions[in_band]
            found = np.minimum(np.searchsorted(self.keys, wanted), max(len(self.keys) - 1, 0))
            missing = wanted if not len(self.keys) else wanted[self.keys[found] != wanted]
            if len(missing):
                raise IndexError(
                    f"band position {int(missing[0])} of a rescale level is not among the {len(self.keys)} "
                    "this consumer's state holds (another consumer's, or a state from another topology)"
                )
            parents[in_band] = self.parents[found]
        return parents

    @cached_property
    def floor(self) -> int:
        return int(self.parents.min()) if len(self.parents) else self.tail_start

    def to_json(self) -> dict[str, Any]:
        return self._json

    @cached_property
    def _json(self) -> dict[str, Any]:
        return {
            LENGTH: self.parent_length,
            CONSUMERS: self.consumers,
            TOP: self.top,
            BAND: self.band,
            LOWEST: self.lowest,
            DIGEST: self.digest,
            COUNT: len(self.keys),
            KEYS: encode_ints(self.keys),
            PARENTS: encode_ints(self.parents),
        }


def _share_of(level: Level | Share, keys: np.ndarray) -> Share:
    """``level`` restricted to the band positions ``keys`` (sorted, unique, below the band)."""
    return Share(*level.header(), keys, level.to_parent(keys))


def _union(shares: Sequence[Share], path: str) -> Share:
    """One share holding what ``shares`` (of the same level) hold; StateError if they disagree."""
    head = shares[0]
    keys = np.concatenate([share.keys for share in shares])
    parents = np.concatenate([share.parents for share in shares])
    order = np.argsort(keys, kind="stable")
    keys, parents = keys[order], parents[order]
    repeated = np.flatnonzero(np.diff(keys) == 0)
    if (parents[repeated] != parents[repeated + 1]).any():
        raise StateError(
            f"{path}: old consumers map the same band position differently; they come from different checkpoints"
        )
    unique = np.ones(len(keys), dtype=bool)
    unique[repeated + 1] = False
    return Share(*head.header(), keys[unique], parents[unique])


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


Step = Union[Level, Share, Offset, Reorder]


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

    def tail_shift(self) -> tuple[int, int] | None:
        """``(start, shift)`` such that every position ``r >= start`` of this space is position
        ``r + shift`` of the epoch's own (each level's tail, past its band, is a shifted copy of
        its parent's); None under a reading order, which sends positions anywhere."""
        start, shift = 0, 0
        for step in self.steps:
            if isinstance(step, Reorder):
                return None
            if isinstance(step, Offset):
                shift += step.shift
                continue
            start = max(start, step.band - shift)
            shift += step.tail_start - step.band
        return start, shift

    def compacted(self, first: int) -> Remap:
        """The same map for positions ``>= first`` only: every level whose band lies wholly
        below what those positions reach becomes an offset. Steps are not merged, so states of
        consumers that compacted different levels still line up (``merge``)."""
        floor, steps, changed = first, [], False
        for step in self.steps:
            if isinstance(step, (Level, Share)) and floor >= step.band:
                step, changed = step.compacted(), True
            steps.append(step)
            floor = _floor_below(step, floor)
        return Remap(self.epoch, self.length, tuple(steps) if changed else self.steps, first)

    def share_for(self, consumer: int, num_consumers: int) -> Remap:
        """This remap as consumer ``consumer`` of ``num_consumers`` saves it: each level cut to the
        band positions it can ever ask for. Its positions in the newest space are its stride
        ``consumer + j*num_consumers``; through a level they become explicit parents (the band)
        and a shifted stride (the tail), and so on down. Steps under a reading order, which may
        send its positions anywhere, stay whole."""
        explicit = np.zeros(0, dtype=np.int64)
        start, stride = consumer, num_consumers  # the positions start + j*stride asked for
        steps: list[Step] = []
        for index, step in enumerate(self.steps):
            if isinstance(step, Reorder):
                steps.extend(self.steps[index:])
                break
            if isinstance(step, Offset):
                explicit, start = explicit + step.shift, start + step.shift
                steps.append(step)
                continue
            strided = np.arange(start, step.band, stride, dtype=np.int64)
            share = _share_of(step, np.union1d(explicit[explicit < step.band], strided))
            steps.append(share)
            shift = step.tail_start - step.band
            explicit = np.concatenate([share.parents, explicit[explicit >= step.band] + shift])
            start += len(strided) * stride + shift
        return Remap(self.epoch, self.length, tuple(steps), self.first)

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
            if isinstance(step, (Level, Share)):
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
    steps = [_merged_step([remap.steps[index] for remap in remaps], path) for index in range(len(head.steps))]
    return Remap(head.epoch, head.length, tuple(steps))


def _merged_step(candidates: list[Step], path: str) -> Step:
    """One step from the old consumers' copies of it. A level's copies are the level itself, a
    share of it or its compacted offset: the whole level if any consumer had it, else the union
    of the shares (together they hold every band position left unread), else the offset."""
    differ = StateError(f"{path}: old consumers hold different remaps; they come from different checkpoints")
    levels = [step for step in candidates if isinstance(step, (Level, Share))]
    if not levels:
        if any(step.to_json() != candidates[0].to_json() for step in candidates):
            raise differ
        return candidates[0]
    if any(isinstance(step, Reorder) for step in candidates):
        raise differ
    head = levels[0]
    header = (head.parent_length, head.consumers, head.top, head.band, head.lowest, head.digest)
    whole = next((step for step in levels if isinstance(step, Level)), None)
    for step in levels:
        if (step.parent_length, step.consumers, step.top, step.band, step.lowest, step.digest) != header:
            raise differ
    offset = head.compacted().to_json()
    if any(isinstance(step, Offset) and step.to_json() != offset for step in candidates):
        raise differ
    shares = [step for step in levels if isinstance(step, Share)]
    if whole is None:
        return _union(shares, path)
    if shares:
        merged = _union(shares, path)
        if not np.array_equal(whole.to_parent(merged.keys), merged.parents):
            raise differ
    return whole


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
    if not (_is_count(epoch) and _is_count(space_length)):
        raise StateError(
            f"an elastic rescale takes epochs of at most {MAX_POSITION:,} positions, numbered up to {MAX_POSITION:,} "
            f"(this one: epoch {epoch:,} over {space_length:,}); resume it on the same ranks and workers"
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
        if isinstance(step, (Level, Share)) and floor >= step.band:  # every position asked for is in the tail
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
        level = _level_from_json(value, path)
        if level is not None:
            return level
    if isinstance(value, dict) and set(value) == {LENGTH, CONSUMERS, TOP, BAND, LOWEST, DIGEST, COUNT, KEYS, PARENTS}:
        share = _share_from_json(value, path)
        if share is not None:
            return share
    raise StateError(f"{path}: remap step {str(value)[:80]!r} is not a level or an offset")


def _level_from_json(value: dict[str, Any], path: str) -> Level | None:
    """A whole level, its distances behind ``top`` a JSON list or encoded; None if malformed."""
    length, consumers, top, behind = value[LENGTH], value[CONSUMERS], value[TOP], value[BEHIND]
    if not (_is_count(length) and _is_count(top) and _is_count(consumers) and 0 < consumers <= MAX_CONSUMERS):
        return None
    if isinstance(behind, str):
        distances = decode_ints(behind, consumers, path)
    elif isinstance(behind, list) and len(behind) == consumers and all(_is_count(b) for b in behind):
        distances = np.asarray(behind, dtype=np.int64)
    else:
        return None
    if int(distances.max()) > top or int(distances.min()) != 0:  # top is the furthest cursor
        return None
    cursors = top - distances
    return Level(length, cursors) if (cursors <= shard_sizes(length, consumers)).all() else None


def _share_from_json(value: dict[str, Any], path: str) -> Share | None:
    """A level's share; None unless its counts are sound, its keys sorted band positions and its
    parents positions the level's band can hold (below its tail, a slow enough stride)."""
    header = [value[key] for key in (LENGTH, CONSUMERS, TOP, BAND, LOWEST, DIGEST, COUNT)]
    if not all(_is_count(number) for number in header):
        return None
    length, consumers, top, band, lowest, digest, count = header
    if not (0 < consumers <= MAX_CONSUMERS and lowest <= top and count <= band <= (top - lowest) * consumers):
        return None
    keys, parents = decode_ints(value[KEYS], count, path), decode_ints(value[PARENTS], count, path)
    share = Share(length, consumers, top, band, lowest, digest, keys, parents)
    if count and (
        (np.diff(keys) <= 0).any()
        or int(keys[-1]) >= band
        or int(parents.max()) >= share.tail_start
        or int((parents // consumers).min()) < lowest
    ):
        return None
    return share


def _is_count(value: Any) -> TypeGuard[int]:
    """An int in ``[0, MAX_POSITION]``: positions and sizes stay exact in int64 arithmetic."""
    return is_count(value, MAX_POSITION)
