"""Record keys: where an item came from, so buffers can save references instead of contents."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

RecordKey = tuple[Any, ...]
"""A record's provenance: ``(epoch, index)``, its epoch and its index in the leaf source (for a
stream, its file and byte offset packed into one int), the same whatever the shuffle and however
the epoch is sharded, so buffers keep references that survive a rescale. Each mix the record
came through puts the name of its component in front: ``("web", epoch, index)``. Below a shard,
the record is named by the consumer's stride instead (``Stride``): ``(Stride(c, C), epoch, k)``."""


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


class Stride(NamedTuple):
    """A key prefix naming the record by where a shard's consumer read it: ``(Stride(c, C),
    epoch, k)`` is position ``k`` of consumer ``c`` of ``C``'s stride, that is position
    ``c + k * C`` of the shard's upstream in that epoch. The same record as its leaf key, in
    numbers a packer's state holds in a few bits (``k`` moves by one per record a consumer
    reads, where leaf indices are spread over the whole source); valid in any pipeline with the
    same nodes below the shard, so it survives a rescale as leaf keys do."""

    consumer: int
    consumers: int


STRIDE_CONSUMER = "consumer"
STRIDE_OF = "of"
"""Entries of a stride as states save it: ``{"consumer": c, "of": C}``."""


def saved_prefix(prefix: tuple[Any, ...]) -> list[Any]:
    """A key's prefix as a state saves it: mix component names, a stride as a dict."""
    return [
        {STRIDE_CONSUMER: part.consumer, STRIDE_OF: part.consumers} if isinstance(part, Stride) else part
        for part in prefix
    ]


def loaded_prefix(saved: Any) -> tuple[Any, ...] | None:
    """A saved key prefix (``saved_prefix``) as key parts: mix component names, then at most
    one stride, last; None where ``saved`` is not one."""
    if not isinstance(saved, list):
        return None
    names = saved[:-1] if saved and isinstance(saved[-1], dict) else saved
    if not all(isinstance(name, str) for name in names):
        return None
    if len(names) == len(saved):
        return tuple(saved)
    stride = saved[-1]
    consumer, consumers = stride.get(STRIDE_CONSUMER), stride.get(STRIDE_OF)
    if (
        len(stride) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in (consumer, consumers))
        or not 0 <= consumer < consumers < 1 << 63
    ):
        return None
    return (*names, Stride(consumer, consumers))
