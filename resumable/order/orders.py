"""The orders a consumer reads its shard in, as pure functions a remap can replay.

A shuffle placed after ``.shard()`` permutes each consumer's stride: consumer ``c`` reads its
``j``-th position at stride position ``order(j)``, where ``order`` is the same keyed bijection of
``[0, n_c)`` for every consumer with ``n_c`` positions. An elastic rescale records these orders
(``[kind, config]`` of each shuffle between the shard and the cursor, top first) so that the
positions the old consumers left can be named without their pipelines.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import numpy as np

from resumable.core.options import SEED_MAX
from resumable.core.state import INT64_MAX, is_count
from resumable.errors import StateError
from resumable.order.block_shuffle import BLOCK_SIZE, SEED, WINDOW, BlockLayout, BlockShuffle
from resumable.order.lcg import LEGACY_ROUNDS, ROUNDS_OPTION, Permutation, saved_rounds
from resumable.order.shuffle import Shuffle

Order = tuple[str, dict[str, Any]]
"""``(node kind, node config)`` of a shuffle after the shard."""

_CONFIG_KEYS = {Shuffle.kind: {SEED}, BlockShuffle.kind: {SEED, BLOCK_SIZE, WINDOW}}


def check_order(value: Any, path: str) -> Order:
    """The order saved as ``value`` (``[kind, config]``); StateError unless well formed. One
    saved before orders named their rounds is of ``LEGACY_ROUNDS``."""
    if isinstance(value, list) and len(value) == 2 and isinstance(value[1], dict):
        kind, config = value
        keys = _CONFIG_KEYS.get(kind) if isinstance(kind, str) else None
        if keys is not None and ROUNDS_OPTION not in config:
            config = {**config, ROUNDS_OPTION: LEGACY_ROUNDS}
        if (
            keys is not None
            and set(config) == keys | {ROUNDS_OPTION}
            and all(is_count(v, SEED_MAX if name == SEED else INT64_MAX) for name, v in config.items())
        ):
            saved_rounds(config[ROUNDS_OPTION], path)
            if kind == Shuffle.kind or (config[BLOCK_SIZE] >= 1 and config[WINDOW] >= 1):
                return kind, config
    raise StateError(f"{path}: reorder entry {str(value)[:80]!r} is not a shuffle's [kind, config]")


def take(order: Order, positions: np.ndarray, length: int, epoch: int) -> np.ndarray:
    """Stride positions read at ``positions`` of a consumer with ``length`` positions in ``epoch``."""
    kind, config = order
    seed, rounds = config[SEED], config[ROUNDS_OPTION]
    if kind == Shuffle.kind:
        return Permutation(length, seed, epoch, rounds).take(positions)
    return _layout(length, config[WINDOW], config[BLOCK_SIZE]).take(positions, seed, epoch, rounds)


@lru_cache(maxsize=8)
def _layout(length: int, window: int, block_size: int) -> BlockLayout:
    """Layouts are pure and keep a small cache of permutations keyed by seed and epoch: share them."""
    return BlockLayout(length, window, block_size=block_size)
