"""Block shuffle: a locality-aware global shuffle for sources read in blocks (Parquet row groups).

An epoch's order is built in two keyed steps, both bijections computed by arithmetic:

1. **Blocks.** The upstream positions ``[0, N)`` are cut into blocks of consecutive records
   (fixed ``block_size``, or the source's natural blocks, Parquet row groups). The blocks are
   permuted with the keyed ``Permutation`` of ``(seed, epoch)``.
2. **Windows.** The permuted blocks are grouped ``window`` at a time; the records of one
   window (``window`` blocks, concatenated in permuted order) are permuted again with a
   ``Permutation`` keyed by ``(seed, epoch, window index)``.

Position ``p`` maps to ``(window, offset)``, the offset through the window's permutation to
a record of one of the window's blocks, and the block back to its upstream records: O(1)
random access, no array of size N. Reading a window touches only ``window`` blocks, so a
Parquet source decodes each row group about once per epoch.

With a fixed ``block_size`` the layout is pure arithmetic (O(1) memory): the full blocks are
permuted and a last partial block, if any, stays in the last slot (its records are still
mixed with the rest of the last window). With variable blocks (row groups) the permuted
block starts are a table of one int per block, computed once per epoch.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, TypeVar, cast

import numpy as np

from resumable.core.indexed import IndexedNode
from resumable.core.options import int64_option, is_int, seed_option
from resumable.core.state import INT64_MAX
from resumable.errors import ConfigError
from resumable.order.lcg import ROUNDS, ROUNDS_OPTION, Permutation, PermutationRounds, _splitmix64

T = TypeVar("T")

SEED = "seed"
BLOCK_SIZE = "block_size"
WINDOW = "window"

ROW_GROUP = "row_group"
"""``block_size`` value meaning the source's natural blocks (Parquet row groups)."""
DEFAULT_BLOCK_SIZE = 1024
"""Block size (records) for sources without natural blocks when none is given."""
DEFAULT_WINDOW = 4
"""Blocks whose records are mixed together when ``window`` is not given."""

_WINDOW_CACHE = 8
"""Per-window permutations kept (a chunk of positions spans one or two windows)."""
_M63 = (1 << 63) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _window_seed(seed: int, window: int) -> int:
    """Seed of window ``window``'s permutation: a hash of ``(seed, window)``, distinct from
    the block permutation's key."""
    return _splitmix64((_splitmix64(seed) + (window + 1) * _GOLDEN) & ((1 << 64) - 1)) & _M63


class BlockLayout:
    """The block/window bijection of ``[0, N)`` for one ``seed``, evaluated per epoch.

    Built either from a fixed ``block_size`` or from ``bounds`` (ascending block starts from 0,
    ending with N, every block non-empty).
    """

    def __init__(
        self, total: int, window: int, block_size: int | None = None, bounds: np.ndarray | None = None
    ) -> None:
        if (block_size is None) == (bounds is None):
            raise ConfigError("BlockLayout: give exactly one of block_size and bounds")
        self.total = total
        self.window = window
        self.block_size = block_size or 0  # 0: blocks given by ``bounds``
        if bounds is not None:
            bounds = np.asarray(bounds, dtype=np.int64)
            if bounds.size < 2 or bounds[0] != 0 or bounds[-1] != total or np.any(np.diff(bounds) <= 0):
                raise ConfigError(f"BlockLayout: block bounds must rise strictly from 0 to {total}")
        self.bounds = bounds
        # Both caches are keyed by seed and epoch: a layout may be shared by shuffles of
        # different seeds (an elastic rescale's orders share layouts of one shape).
        self._epoch_table: tuple[tuple[int, int, int], np.ndarray, np.ndarray, np.ndarray] | None = None
        self._windows: OrderedDict[tuple[int, int, int, int], Permutation] = OrderedDict()

    @property
    def num_blocks(self) -> int:
        if self.bounds is not None:
            return len(self.bounds) - 1
        return -(-self.total // self.block_size)

    # -- variable blocks: a per-epoch table of permuted block starts --------------------------

    def _table(self, seed: int, epoch: int, rounds: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(block starts in permuted order, slot starts, window starts)`` of ``epoch``."""
        cached = self._epoch_table
        if cached is not None and cached[0] == (seed, epoch, rounds):
            return cached[1], cached[2], cached[3]
        bounds = cast(np.ndarray, self.bounds)
        blocks = len(bounds) - 1
        order = Permutation(blocks, seed, epoch, rounds).take(np.arange(blocks, dtype=np.int64))
        sizes = np.diff(bounds)[order]
        slot_starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        window_starts = slot_starts[:: self.window]
        if window_starts[-1] != self.total:
            window_starts = np.append(window_starts, self.total)
        block_starts = bounds[order]
        self._epoch_table = ((seed, epoch, rounds), block_starts, slot_starts, window_starts)
        return block_starts, slot_starts, window_starts

    # -- the bijection --------------------------------------------------------------------------

    def _window_permutation(self, seed: int, epoch: int, rounds: int, window: int, size: int) -> Permutation:
        key = (seed, epoch, rounds, window)
        perm = self._windows.get(key)
        if perm is None:
            perm = Permutation(size, _window_seed(seed, window), epoch, rounds)
            self._windows[key] = perm
            while len(self._windows) > _WINDOW_CACHE:
                self._windows.popitem(last=False)
        else:
            self._windows.move_to_end(key)
        return perm

    def take(self, positions: np.ndarray, seed: int, epoch: int, rounds: int = ROUNDS) -> np.ndarray:
        """Upstream positions of ``positions`` (int64 array in ``[0, N)``) in ``epoch``, with
        permutations of ``rounds`` rounds."""
        positions = np.asarray(positions, dtype=np.int64)
        if positions.size == 0:
            empty: np.ndarray = positions.copy()
            return empty
        if self.bounds is None:
            span = self.block_size * self.window
            windows = positions // span
            window_starts = None
        else:
            block_starts, slot_starts, window_starts = self._table(seed, epoch, rounds)
            windows = np.searchsorted(window_starts, positions, side="right") - 1
        within = np.empty_like(positions)
        for w in np.unique(windows).tolist():
            if window_starts is None:
                start = w * span
                size = min(span, self.total - start)
            else:
                start = int(window_starts[w])
                size = int(window_starts[w + 1]) - start
            selected = np.flatnonzero(windows == w)
            perm = self._window_permutation(seed, epoch, rounds, w, size)
            within[selected] = start + perm.take(positions[selected] - start)
        # ``within`` is now an offset into the concatenation of the permuted blocks.
        if self.bounds is None:
            size = self.block_size
            full = self.total // size
            slots, rows = np.divmod(within, size)
            blocks = slots.copy()
            permuted = slots < full
            if full:
                blocks[permuted] = Permutation(full, seed, epoch, rounds).take(slots[permuted])
            regular: np.ndarray = blocks * size + rows
            return regular
        slots = np.searchsorted(slot_starts, within, side="right") - 1
        ragged: np.ndarray = block_starts[slots] + (within - slot_starts[slots])
        return ragged


def _natural_bounds(upstream: IndexedNode[Any]) -> np.ndarray | None:
    """The source's natural block bounds when ``upstream``'s positions are the source's
    indices (the source itself, or serial maps over it); None otherwise."""
    from resumable.ops.map import IndexedMap
    from resumable.sources.source import Source

    node: IndexedNode[Any] | None = upstream
    while isinstance(node, IndexedMap):
        node = node.upstream
    if isinstance(node, Source):
        bounds = getattr(node, "block_bounds", None)
        if callable(bounds):
            return np.asarray(bounds(), dtype=np.int64)
    return None


class BlockShuffle(PermutationRounds, IndexedNode[T]):
    """Shuffle blocks of consecutive records, then records within windows of ``window`` blocks.

    ``block_size``: records per block (int), or ``"row_group"`` / None for the source's natural
    blocks (Parquet row groups; sources without natural blocks use ``DEFAULT_BLOCK_SIZE``,
    and ``"row_group"`` over such a source is a ``ConfigError``). ``window``: blocks mixed
    together (default ``DEFAULT_WINDOW``). A new order every epoch; the state is the options
    and the cursor.
    """

    kind = "BlockShuffle"

    def __init__(
        self, upstream: IndexedNode[T], seed: int = 0, block_size: int | str | None = None, window: int | None = None
    ) -> None:
        super().__init__(upstream)
        seed = seed_option(self.kind, SEED, seed)
        window = DEFAULT_WINDOW if window is None else int64_option(self.kind, "window", window)
        bounds = None
        if block_size is None or block_size == ROW_GROUP:
            bounds = _natural_bounds(upstream)
            if bounds is None:
                if block_size == ROW_GROUP:
                    raise ConfigError(
                        f"{self.kind}: block_size='row_group' needs a source with row groups directly "
                        f"upstream (Parquet row groups, Arrow record batches; maps may come between), got {upstream!r}"
                    )
                block_size = DEFAULT_BLOCK_SIZE
            else:
                block_size = ROW_GROUP
        elif not is_int(block_size) or block_size < 1:
            raise ConfigError(f"{self.kind}: block_size must be a positive int or 'row_group', got {block_size!r}")
        else:
            block_size = int(block_size)
        if isinstance(block_size, int) and block_size * window > INT64_MAX:  # a window's positions are int64
            raise ConfigError(
                f"{self.kind}: block_size * window must be at most {INT64_MAX:,}, got {block_size} * {window}"
            )
        self.seed = seed
        self.block_size: int | str = block_size
        self.window = window
        # Natural blocks belong to a source, whose length is fixed. Fixed-size blocks are laid
        # over the epoch's length, resolved at use: after a shard it is the consumer's stride,
        # known only in the process that reads (a DataLoader worker) and changed by a rescale.
        self._natural = BlockLayout(len(upstream), window, bounds=bounds) if bounds is not None else None
        self._sized: BlockLayout | None = None
        reserve = getattr(upstream.leaf, "reserve_cache", None)
        if bounds is not None and callable(reserve):
            # A chunk of positions may straddle two windows: keep both windows' blocks, decoded
            # and (remote sources) as fetched bytes.
            reserve(2 * window)
        if bounds is not None:
            upstream.leaf._reserve_span(min(1.0, 2 * window / max(1, len(bounds) - 1)))

    def __len__(self) -> int:
        return len(self._parent)

    def layout(self, epoch: int) -> BlockLayout:
        """The block layout over ``epoch``'s positions."""
        if self._natural is not None:
            return self._natural
        total = self._length(epoch)
        if self._sized is None or self._sized.total != total:
            self._sized = BlockLayout(total, self.window, block_size=int(self.block_size))
            # A chunk of positions may straddle two windows: keep both windows' data cached. A
            # window spans this fraction of the leaf's data even over a shard's stride.
            self.leaf._reserve_span(min(1.0, 2 * self.window * int(self.block_size) / max(1, total)))
        return self._sized

    @property
    def num_blocks(self) -> int:
        return self.layout(self._epoch).num_blocks

    def _leaf_indices(self, positions: np.ndarray, epoch: int) -> np.ndarray:
        upstream_positions = self.layout(epoch).take(positions, self.seed, epoch, self.rounds)
        return self._parent._leaf_indices(upstream_positions, epoch)

    def _config(self) -> dict[str, Any]:
        return {SEED: self.seed, BLOCK_SIZE: self.block_size, WINDOW: self.window, ROUNDS_OPTION: self.rounds}
