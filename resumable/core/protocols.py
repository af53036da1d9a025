"""Protocols that nodes implement beyond the ``Node`` base class."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Rescalable(Protocol):
    """A node that holds something per consumer beyond its upstream's cursor (a packer's pieces,
    a stream's work items, a mix's schedule, a repeat's epoch count), so a new topology cannot
    start it as a fresh epoch. The indexed chain (cursor and shard) is rescaled by
    ``resumable.elastic``; every other node starts its part of the epoch afresh
    (``Node._fresh_rescaled``)."""

    def _rescale(self, olds: list[dict[str, Any]], path: str, consumer: int, num_consumers: int) -> dict[str, Any]:
        """This node's own state entries (no children) for new consumer ``consumer`` of
        ``num_consumers``, continuing the epoch that the old consumers' states ``olds`` were in."""
        ...
