"""Source base: the leaf of an indexed chain, reading records by global index."""

from __future__ import annotations

from typing import Any, Callable, Sequence, TypeVar

import numpy as np

from resumable.core.indexed import IndexedNode
from resumable.core.state import require
from resumable.sources.blocks import Blocks
from resumable.sources.files import FILES, WatchedFiles
from resumable.sources.remote import Remote

T = TypeVar("T")


class Source(IndexedNode[T]):
    """A leaf node: ``N`` records addressed by index ``[0, N)``, read contiguously or at random.

    Subclasses return *raw* records (bytes of a JSON line, a row reference, ...) and a decoder
    the cursor applies lazily, one record at a time, as the consumer asks for it.
    """

    def __init__(self) -> None:
        super().__init__(None)

    @property
    def leaf(self) -> Source[T]:
        return self

    def _leaf_indices(self, positions: np.ndarray, epoch: int) -> np.ndarray:
        return positions

    def _raw_chunk(self, start: int, count: int, epoch: int) -> Sequence[Any]:
        return self._raw_range(start, count)

    def _raw_range(self, start: int, count: int) -> Sequence[Any]:
        """Raw records ``start, start + 1, ...``: at least one, at most ``count``."""
        return self._raw_at(np.arange(start, start + count, dtype=np.int64))

    def _raw_at(self, indices: np.ndarray) -> Sequence[Any]:
        """Raw records at arbitrary ``indices`` (an int64 array), in that order."""
        raise NotImplementedError

    def _decoder(self) -> Callable[[Any], Any] | None:
        """The function turning a raw record into a record; None when raw records are final."""
        return None

    @property
    def skips_malformed(self) -> bool:
        """Whether iteration skips records the decoder rejects (``on_error="skip"``)."""
        return False

    def _decode_failed(self, raw: Any, index: int, error: Exception, may_skip: bool) -> None:
        """Handle a record the decoder rejected: raise a SourceError, or return to skip it
        (only when ``may_skip``: random access never skips)."""
        raise error


class FileSource(Source[T]):
    """A source over files. Their fingerprints are its identity: a state taken over other files
    is refused on restore, and a file that changes during the run is a ``SourceError`` at the
    next epoch start, at the next ``get_state`` (one file per call, round robin) or when it is
    next read (see ``WatchedFiles``). Subclasses set ``_files``."""

    _files: WatchedFiles

    def _identity(self) -> dict[str, Any]:
        return {FILES: self._files.watch()}

    def _check_identity(self, state: dict[str, Any], path: str) -> None:
        self._files.check_state(require(state, FILES, list, path), path)

    def _enter_epoch(self, epoch: int) -> None:
        self._files.check_all()
        super()._enter_epoch(epoch)


class PathSource(FileSource[T]):
    """A file source over paths or URLs (JSONL, Parquet, Arrow): local files, or objects read
    through the block caches of ``resumable.sources.blocks``. Subclasses set ``paths``,
    ``_remote`` (None for local files) and ``_blocks``."""

    paths: list[str]
    _remote: Remote | None
    _blocks: Blocks

    @property
    def stats(self) -> dict[str, int]:
        """Records and files; for remote objects also what this process read and how: ranged
        reads (``requests``), ``bytes_fetched``, blocks found in the disk cache (``disk_hits``),
        blocks fetched ahead of the cursor, and retried requests."""
        stats = {"records": len(self), "files": len(self.paths)}
        if self._remote is not None:
            stats.update(self._blocks.stats, retries=self._remote.retries)
        return stats

    def _reserve_span(self, fraction: float) -> None:
        if self._remote is not None:
            total = sum(self._files.size(file) for file in range(len(self.paths)))
            self._blocks.reserve(int(fraction * total) + 2 * len(self.paths) * self._blocks.options.block_bytes)
