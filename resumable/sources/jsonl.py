"""JSONL source: many files as one global index space, read sequentially or at random.

Each file has a line-offset index (``LineIndex``, kept in a sidecar file), so record ``i`` is
one slice of a memory map: sequential reading takes large contiguous blocks and a resume seeks
straight to the record's byte offset, at the same cost anywhere in a 100 GB file.

Objects in object storage (``s3://`` URLs, or paths on a ``pyarrow.fs`` filesystem) are indexed
by one streamed scan into the cache dir (``LineIndex.open_remote``) and read by ranged reads in
aligned blocks through a memory and a disk cache, the cursor's next chunk read ahead
(``resumable.sources.blocks``).
"""

from __future__ import annotations

import logging
import mmap
from functools import partial
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import orjson

from resumable.errors import ConfigError, SourceError
from resumable.sources.blocks import BLOCK_BYTES as REMOTE_BLOCK_BYTES
from resumable.sources.blocks import CACHE_BYTES, DISK_CACHE_BYTES, BlockReader
from resumable.sources.files import Paths, WatchedFiles, reading
from resumable.sources.line_index import LineIndex, content_digest_in, remote_content_digest
from resumable.sources.open_files import OpenFiles
from resumable.sources.remote import FRESH_SECONDS
from resumable.sources.source import PathSource

logger = logging.getLogger("resumable")

ON_ERROR = "on_error"
ON_ERROR_CHOICES = ("raise", "skip")

# Malformed records skipped with on_error="skip" are logged one by one up to this many.
LOGGED_SKIPS = 10

# A sequential read takes whole records up to about this many bytes (at least one record).
BLOCK_BYTES = 4 << 20

# A sequential read of records this long on average or shorter copies its block once and splits
# it at newlines in one C call; longer records are sliced one by one (the extra copy of the
# block would cost more than the per-record slicing it saves).
SPLIT_RECORD_BYTES = 1024

# Random reads of at least this many records touch every record's bytes in one numpy gather
# before slicing them (see ``JsonlSource._slices``).
TOUCHED_READS = 64

# A run of at least JOINED_RUN records of at most about JOINED_RECORD_BYTES (judged by its first)
# is decoded by one ``orjson.loads`` of the records joined into one JSON array, when that is sure
# to give what decoding them one by one gives (see ``decode_run``). Shorter runs (the first
# records after a resume) and longer records, where the call per record costs less than copying
# them into the array, are decoded one by one.
JOINED_RUN = 8
JOINED_RECORD_BYTES = 512
_RUN_SEPARATOR = b"\n,0,"
"""Between two records in a joined run. The newline keeps a JSON string from running on into the
next record (a raw newline is not allowed inside a string); ``,0,`` is a separate value, which
is an error inside an object (a key must follow a comma there)."""
_RUN_OPEN, _RUN_CLOSE = b"[", b"\n]"


def decode_run(raws: Sequence[bytes]) -> list[Any]:
    """The records of ``raws``, decoded in one C call where that is exact, else one by one.

    One call parses ``[r1\\n,0,r2\\n,0,...,rn\\n]`` when no ``[`` occurs in the run, and
    keeps every other value if there are exactly 2n - 1. That is the same as decoding each
    record: no string can run past a record (a raw newline), no object either (``,0`` is
    an error inside one), and without ``[`` no array is open; so each separator stands
    between top-level values, and 2n - 1 of them means no record holds a top-level comma
    of its own: value 2i is record i. A run with ``[`` (in a string or not) or a malformed
    record is decoded one record at a time, which raises that record's own error."""
    count = len(raws)
    if count >= JOINED_RUN and len(raws[0]) <= JOINED_RECORD_BYTES:
        body = _RUN_SEPARATOR.join(raws)
        if b"[" not in body:
            try:
                values: list[Any] = orjson.loads(b"".join((_RUN_OPEN, body, _RUN_CLOSE)))
            except orjson.JSONDecodeError:
                pass
            else:
                if len(values) == 2 * count - 1:
                    return values[::2]
    return list(map(orjson.loads, raws))


class JsonlSource(PathSource[Any]):
    """Records (one JSON value per non-blank line) of one or more JSONL files.

    Blank lines are not records. A malformed line raises ``SourceError`` naming the file and
    line, or with ``on_error="skip"`` is skipped, counted in ``stats`` and logged. The state
    holds each file's name, size, mtime and content digest (from its line index): resuming on
    changed files is a ``StateError``, a file changed during the run a ``SourceError``.

    Remote objects (``storage_options``/``filesystem``, see ``resumable.sources.remote``) are read
    in aligned blocks of ``block_bytes`` through a memory LRU of ``cache_bytes`` (per source and
    process) and a disk cache of ``disk_cache_bytes`` in ``cache_dir`` shared by the machine's
    processes (0: none), the blocks of the cursor's next chunk fetched ahead; ``stats`` then
    counts the ranged reads, bytes fetched, disk hits and retries (``resumable.sources.blocks``).
    """

    kind = "JsonlSource"
    _decodes_whole_chunks = True

    def __init__(
        self,
        paths: Paths,
        on_error: str = "raise",
        cache_dir: str | None = None,
        storage_options: Mapping[str, Any] | None = None,
        filesystem: Any = None,
        block_bytes: int = REMOTE_BLOCK_BYTES,
        cache_bytes: int = CACHE_BYTES,
        disk_cache_bytes: int = DISK_CACHE_BYTES,
    ) -> None:
        super().__init__()
        if on_error not in ON_ERROR_CHOICES:
            raise ConfigError(f"{self.kind}: on_error must be one of {ON_ERROR_CHOICES}, got {on_error!r}")
        remote = self._resolve(
            paths, storage_options, filesystem, cache_dir, block_bytes, cache_bytes, disk_cache_bytes
        )
        self.on_error = on_error
        self.cache_dir = cache_dir
        indices = [self._open_index(file) for file in range(len(self.paths))]
        self._indices: list[LineIndex | None] = list(indices)
        fingerprints = [[p, index.size, index.mtime_ns, index.content_digest] for p, index in zip(self.paths, indices)]
        if remote is None:
            self._files = WatchedFiles(self.kind, fingerprints, content_digest_in(cache_dir))
        else:
            digest = partial(remote_content_digest, remote, self.kind, cache_dir)
            self._files = WatchedFiles(self.kind, fingerprints, digest, remote.stat, fresh_for=FRESH_SECONDS)
        counts = [index.num_records for index in self._live_indices()]
        self._offsets = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        self._total = int(self._offsets[-1])
        if self._total == 0:
            raise SourceError(f"{self.kind}: no records in {', '.join(self.paths)} (empty or blank files)")
        self._blank_lines = sum(index.blank_lines for index in self._live_indices())
        self._maps: OpenFiles[mmap.mmap] = OpenFiles(len(self.paths))
        self.skipped = 0

    def _live_indices(self) -> list[LineIndex]:
        return [self._index(f) for f in range(len(self.paths))]

    def __len__(self) -> int:
        return self._total

    @property
    def stats(self) -> dict[str, int]:
        """``FileSource.stats``, and blank lines ignored and malformed records skipped so far."""
        return {**super().stats, "blank_lines": self._blank_lines, "skipped": self.skipped}

    # -- state --------------------------------------------------------------------------------

    @property
    def skips_malformed(self) -> bool:
        return self.on_error == "skip"

    def _config(self) -> dict[str, Any]:
        return {ON_ERROR: self.on_error}

    # -- reading ------------------------------------------------------------------------------

    def _open_index(self, file: int) -> LineIndex:
        path = self.paths[file]
        if self._remote is None:
            return LineIndex.open(path, cache_dir=self.cache_dir)
        return LineIndex.open_remote(self._remote, path, self.kind, self.cache_dir, self._head(file))

    def _index(self, file: int) -> LineIndex:
        index = self._indices[file]
        if index is None:  # reopened after pickling into a DataLoader worker
            opened = self._open_index(file)
            self._files.confirm(file, opened.size, opened.mtime_ns, lambda: opened.content_digest)
            index = self._indices[file] = opened
        return index

    def _map(self, file: int) -> mmap.mmap:
        """The memory map of file ``file``, after checking that the file is unchanged: a file
        cut short under a memory map would crash the process on reading (SIGBUS). Maps are
        opened within the process's budget of open files (``OpenFiles``)."""
        self._files.check(file)
        with reading(f"{self.kind}: cannot read {self.paths[file]!r}"):
            return self._maps.get(file, self._open_map)

    def _open_map(self, file: int) -> mmap.mmap:
        with open(self.paths[file], "rb") as handle:
            self._files.check_opened(file, handle.fileno())
            return mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)

    def _content_digest(self, file: int, reader: BlockReader, version: str) -> str:
        return self._index(file).content_digest

    def _reads_ahead(self) -> bool:
        return self._remote is not None

    def _read_ahead(self, indices: np.ndarray) -> None:
        remote = self._remote
        if remote is None:
            return
        files = np.searchsorted(self._offsets, indices, side="right") - 1
        for file in np.unique(files).tolist():
            local = indices[files == file] - self._offsets[file]
            self._block_reader(file, remote).read_ahead(*self._index(file).spans(local))

    def _locate(self, index: int) -> tuple[int, int]:
        """``(file, record within file)`` of a global record index."""
        file = int(np.searchsorted(self._offsets, index, side="right")) - 1
        return file, index - int(self._offsets[file])

    def _raw_range(self, start: int, count: int) -> Sequence[bytes]:
        file, first = self._locate(start)
        if self._remote is not None:
            return self._slices(file, np.arange(first, min(first + count, self._index(file).num_records)))
        mapped = self._map(file)
        index = self._index(file)
        span = index.offsets(first, min(first + count, index.num_records) + 1)
        byte_limit = int(span[0]) + BLOCK_BYTES
        end = max(1, int(np.searchsorted(span[1:], byte_limit, side="right")))
        first_byte, end_byte = int(span[0]), int(span[end])
        if end_byte - first_byte <= SPLIT_RECORD_BYTES * end:
            lines = _one_line_each(mapped[first_byte:end_byte], end)
            if lines is not None:
                return lines
        bounds = span[: end + 1].tolist()
        return [mapped[a:b] for a, b in zip(bounds[:-1], bounds[1:])]

    def _raw_at(self, indices: np.ndarray) -> Sequence[bytes]:
        if len(self.paths) == 1:
            return self._slices(0, indices)
        files = np.searchsorted(self._offsets, indices, side="right") - 1
        out: list[bytes] = [b""] * len(indices)
        for file in np.unique(files).tolist():
            selected = np.flatnonzero(files == file)
            for slot, raw in zip(selected.tolist(), self._slices(file, indices[selected] - self._offsets[file])):
                out[slot] = raw
        return out

    def _slices(self, file: int, local: np.ndarray) -> list[bytes]:
        remote = self._remote
        if remote is not None:
            return self._block_reader(file, remote).ranges(*self._index(file).spans(local))
        mapped = self._map(file)
        index = self._index(file)
        starts, ends = index.spans(local)
        if len(local) >= TOUCHED_READS:
            # Scattered records miss the CPU caches one after another when sliced one by one; a
            # numpy gather of each record's first and last byte has those misses overlap.
            np.frombuffer(mapped, dtype=np.uint8).take(np.concatenate((starts, ends - 1)))
        return [mapped[a:b] for a, b in zip(starts.tolist(), ends.tolist())]

    def _decoder(self) -> Callable[[Any], Any]:
        return orjson.loads

    _decode_run = staticmethod(decode_run)

    def _decode_failed(self, raw: Any, index: int, error: Exception, may_skip: bool) -> None:
        if not isinstance(error, orjson.JSONDecodeError):
            raise error
        file, local = self._locate(index)
        line = self._index(file).line_number(local)
        where = f"{self.paths[file]}:{line}"
        if self.on_error == "skip" and may_skip:
            self.skipped += 1
            if self.skipped <= LOGGED_SKIPS:
                logger.warning("%s: skipped malformed JSON record (%s)", where, error)
                if self.skipped == LOGGED_SKIPS:
                    logger.warning("%s: further malformed records are counted in stats, not logged", self.kind)
            return
        raise SourceError(f"{where}: malformed JSON record: {error}") from error

    # -- pickling (DataLoader workers): memory maps (``OpenFiles``) and indices are reopened lazily

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_indices"] = [None] * len(self.paths)
        return state


def _one_line_each(block: bytes, records: int) -> list[bytes] | None:
    """The ``records`` consecutive records that make up ``block``, split at newlines in one C call
    (each without its newline: JSON whitespace), or None when blank lines lie between them.

    Every record but the file's last ends with a newline, so ``records`` lines (after dropping
    the empty piece behind a final newline) mean exactly one newline per record."""
    lines = block.split(b"\n")
    if not lines[-1]:
        lines.pop()
    return lines if len(lines) == records else None


def jsonl(
    paths: Paths,
    on_error: str = "raise",
    cache_dir: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
    filesystem: Any = None,
    block_bytes: int = REMOTE_BLOCK_BYTES,
    cache_bytes: int = CACHE_BYTES,
    disk_cache_bytes: int = DISK_CACHE_BYTES,
) -> JsonlSource:
    """A source over JSONL files: a path, a glob, or a list of them (globs sorted); or objects
    in object storage (``s3://`` URLs with ``storage_options``, or paths on a ``pyarrow.fs``
    ``filesystem``), read in blocks of ``block_bytes`` through a ``cache_bytes`` memory cache
    and a ``disk_cache_bytes`` disk cache in ``cache_dir``."""
    return JsonlSource(
        paths,
        on_error=on_error,
        cache_dir=cache_dir,
        storage_options=storage_options,
        filesystem=filesystem,
        block_bytes=block_bytes,
        cache_bytes=cache_bytes,
        disk_cache_bytes=disk_cache_bytes,
    )
