"""Record keys: where an item came from, so buffers can save references instead of contents."""

from __future__ import annotations

from typing import Any

import numpy as np

RecordKey = tuple[Any, ...]
"""A record's provenance: ``(epoch, index)``, its epoch and its index in the leaf source (for a
stream, its file and byte offset packed into one int), the same whatever the shuffle and however
the epoch is sharded, so buffers keep references that survive a rescale. Each mix the record
came through puts the name of its component in front: ``("web", epoch, index)``."""


def leaf_key(key: Any, kind: str) -> tuple[int, int]:
    """``key`` as the ``(epoch, index)`` of a leaf record; IndexError if it is not one (a state
    whose references were damaged or belong to another pipeline)."""
    if (
        not isinstance(key, tuple)
        or len(key) != 2
        or not all(isinstance(part, (int, np.integer)) and not isinstance(part, bool) for part in key)
    ):
        raise IndexError(f"{kind}: {key!r} is not the (epoch, index) key of one of its records")
    return int(key[0]), int(key[1])
