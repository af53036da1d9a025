"""Protocols that nodes implement beyond the ``Node`` base class."""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Protocol, Sequence, runtime_checkable

import numpy as np


class Leaf(Protocol):
    """The bottom of an indexed chain, from which the chain's cursor reads raw records by leaf
    index: a source, or a cache standing in for the chain below it."""

    def __len__(self) -> int: ...

    def _raw_at(self, indices: np.ndarray) -> Sequence[Any]:
        """Raw records at ``indices`` (an int64 array), in that order."""
        ...

    def _decoder(self) -> Callable[[Any], Any] | None:
        """The function turning a raw record into a record; None when raw records are final."""
        ...

    def _decode_run(self, raws: Sequence[Any]) -> list[Any]:
        """A run of raw records decoded ahead (when ``_decodes_whole_chunks``), raising the
        decoder's error on a malformed one."""
        ...

    _decodes_whole_chunks: ClassVar[bool]
    """Whether the cursor may decode a run of this leaf's raw records in one call, ahead of
    handing them out (cheap decoders such as ``orjson.loads``)."""

    def _reads_ahead(self) -> bool:
        """Whether ``_read_ahead`` does anything (a remote source)."""
        ...

    def _read_ahead(self, indices: np.ndarray) -> None:
        """The records at ``indices`` will be read next: start fetching them."""
        ...

    def _reserve_span(self, fraction: float) -> None:
        """Readers go back and forth over about ``fraction`` of the records: keep them cached."""
        ...

    @property
    def skips_malformed(self) -> bool:
        """Whether iteration skips records the decoder rejects."""
        ...

    def _decode_failed(self, raw: Any, index: int, error: Exception, may_skip: bool) -> None:
        """Raise the error for a record the decoder rejected, or return to skip it."""
        ...


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
