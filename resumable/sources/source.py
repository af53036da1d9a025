"""Source base: the leaf of an indexed chain, reading records by global index."""

from __future__ import annotations

from functools import partial
from typing import Any, Mapping, Sequence, TypeVar

import numpy as np

from resumable.core.indexed import IndexedNode
from resumable.errors import ConfigError
from resumable.sources.blocks import BlockOptions, BlockReader, Blocks, fetch_pool
from resumable.sources.files import Paths, WatchedFiles, WatchedIdentity
from resumable.sources.remote import Head, Remote, resolve

T = TypeVar("T")


class Source(IndexedNode[T]):
    """A leaf node: ``N`` records addressed by index ``[0, N)``, read contiguously or at random.

    Subclasses return *raw* records (bytes of a JSON line, a row reference, ...) and a decoder
    the cursor applies lazily, one record at a time, as the consumer asks for it.
    """

    _reads_upstream = False

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

    @property
    def skips_malformed(self) -> bool:
        """Whether iteration skips records the decoder rejects (``on_error="skip"``)."""
        return False

    def _decode_failed(self, raw: Any, index: int, error: Exception, may_skip: bool) -> None:
        """Handle a record the decoder rejected: raise a SourceError, or return to skip it
        (only when ``may_skip``: random access never skips)."""
        raise error


class FileSource(WatchedIdentity, Source[T]):
    """A source over files. Their fingerprints are its identity: a state taken over other files
    is refused on restore, and a file that changes during the run is a ``SourceError`` at the
    next epoch start, at the next ``get_state`` (one file per call, round robin) or when it is
    next read (see ``WatchedFiles``). Subclasses set ``_files``."""

    _files: WatchedFiles

    def _enter_epoch(self, epoch: int) -> None:
        self._files.check_all()
        super()._enter_epoch(epoch)


class PathSource(FileSource[T]):
    """A file source over paths or URLs (JSONL, Parquet, Arrow): local files, or objects read
    through the block caches of ``resumable.sources.blocks``. Subclasses call ``_resolve`` and
    implement ``_content_digest``; DataLoader workers open the objects again (pickling drops
    open files and readers)."""

    paths: list[str]
    _remote: Remote | None
    _blocks: Blocks
    _heads: list[Head | None]
    _readers: list[BlockReader | None]

    def _resolve(
        self,
        paths: Paths,
        storage_options: Mapping[str, Any] | None,
        filesystem: Any,
        cache_dir: str | None,
        block_bytes: int,
        cache_bytes: int,
        disk_cache_bytes: int,
    ) -> Remote | None:
        """Check the block options and expand ``paths``; for remote objects, open every one: a
        request each, in parallel, for its size, ETag and an open file (``Remote.head``), which
        key what the source caches and serve its first reads. Returns the ``Remote``, if any."""
        options = BlockOptions.checked(self.kind, block_bytes, cache_bytes, disk_cache_bytes, cache_dir)
        self.paths, remote = resolve(paths, self.kind, storage_options, filesystem)
        self._remote = remote
        self._blocks = Blocks(options)
        self._readers = [None] * len(self.paths)
        self._heads = (
            [None] * len(self.paths)
            if remote is None
            else list(fetch_pool().map(lambda path: remote.head(path, self.kind), self.paths))
        )
        return remote

    def _head(self, file: int) -> Head:
        """Size, version and an open file of remote object ``file`` (one request, made again
        after pickling into a DataLoader worker)."""
        head = self._heads[file]
        if head is None:
            if self._remote is None:
                raise ConfigError(f"{self.kind}: {self.paths[file]!r} is a local file")
            head = self._heads[file] = self._remote.head(self.paths[file], self.kind)
        return head

    def _block_reader(self, file: int, remote: Remote, check: bool = True) -> BlockReader:
        """The block reader of remote file ``file`` over the object as ``_head`` opened it, made
        on first use; with ``check`` (every use but the constructor's, where the fingerprint
        comes from that same request), first checked to be the object the source was built
        on, its ``_content_digest`` computed only when its mtime moved."""
        reader = self._readers[file]
        if reader is None:
            info, handle = self._head(file)
            reader = self._blocks.reader(remote, self.paths[file], info, self.kind, handle)
            if check:
                self._files.confirm(
                    file, info.size, info.mtime_ns, partial(self._content_digest, file, reader, info.version)
                )
            self._readers[file] = reader
        return reader

    def _content_digest(self, file: int, reader: BlockReader, version: str) -> str | None:
        """The fingerprint digest of remote file ``file`` as ``reader`` reads it (``version``: its
        ``ObjectInfo.version``)."""
        raise NotImplementedError

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_heads"] = [None] * len(self.paths)
        state["_readers"] = [None] * len(self.paths)
        return state

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
