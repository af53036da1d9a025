"""Partition arithmetic: consumer ``c`` of ``C`` owns positions ``c, c + C, c + 2C, ...``.

Pure functions over ints and numpy arrays, so shard sizes differ by at most one and every
position belongs to exactly one consumer.
"""

from __future__ import annotations

import numpy as np


def shard_size(total: int, consumer: int, num_consumers: int) -> int:
    """How many of the positions ``[0, total)`` consumer ``consumer`` owns."""
    if consumer >= total:
        return 0
    return (total - consumer + num_consumers - 1) // num_consumers


def shard_to_global(positions: np.ndarray, consumer: int, num_consumers: int) -> np.ndarray:
    """Global positions of a consumer's local positions."""
    return consumer + positions * num_consumers
