"""Parquet source: many files as one global index space, read by row group.

The index is built from the files' metadata alone (row counts of every row group), so a
source over terabytes opens in milliseconds. Record ``i`` lives at ``(file, row group, row)``:
a sequential read decodes one row group and hands out slices of it; a random read groups
the wanted indices by row group and decodes each needed group once. A few decoded row
groups stay in a small LRU so that block-shuffled reading (``shuffle(block_size="row_group")``)
decodes every row group about once per epoch. A resume decodes only the row group it lands
in, at the same cost at the first and at the last record of a file.
"""

from __future__ import annotations

import os
import struct
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any, BinaryIO, Callable, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import xxhash

from resumable.errors import ConfigError, SourceError
from resumable.sources.files import Paths, WatchedFiles, reading
from resumable.sources.remote import resolve
from resumable.sources.source import FileSource

COLUMNS = "columns"

DEFAULT_CACHE_ROW_GROUPS = 4
"""Decoded row groups kept in memory (an LRU). A row-group block shuffle raises it to twice
its window, so that a read straddling two windows decodes no row group twice."""

MAX_DECODE_THREADS = 8
"""Row groups decoded at once when one read needs several that are not cached."""

FOOTER_TAIL = struct.Struct("<I4s")
"""A Parquet file ends with the length of its footer (the file metadata) and a magic number."""
PARQUET_MAGICS = (b"PAR1", b"PARE")
"""The magic numbers of plain and of encrypted-footer Parquet files."""


def group_take(
    indices: np.ndarray,
    starts: np.ndarray,
    load: Callable[[int], Any],
    is_cached: Callable[[int], bool] | None = None,
) -> list[Any]:
    """Records (dicts) at global ``indices``, in that order, where piece ``p`` holds records
    ``[starts[p], starts[p+1])`` and ``load(p)`` returns it as an Arrow table or record batch.

    Each needed piece is loaded and taken from once. With ``is_cached`` (the caller's LRU
    membership), pieces already cached are read first, so that loading the missing ones
    cannot evict a cached piece before this call has used it."""
    pieces = np.searchsorted(starts, indices, side="right") - 1
    unique = np.unique(pieces)
    if unique.size == 1:
        piece = int(unique[0])
        rows: list[dict[str, Any]] = load(piece).take(indices - starts[piece]).to_pylist()
        return rows
    order = unique.tolist()
    if is_cached is not None:
        order.sort(key=lambda piece: not is_cached(piece))
    out: list[Any] = [None] * len(indices)
    for piece in order:
        slots = np.flatnonzero(pieces == piece)
        rows = load(piece).take(indices[slots] - starts[piece]).to_pylist()
        for slot, record in zip(slots.tolist(), rows):
            out[slot] = record
    return out


class ParquetSource(FileSource[dict[str, Any]]):
    """Rows (as dicts) of one or more Parquet files, in file order then row order.

    ``columns`` selects columns (all by default). Missing files, globs that match nothing,
    unreadable files and a total of zero rows raise ``SourceError`` at construction. The state
    holds each file's name, size, mtime and footer digest, and the columns: resuming over
    changed files or other columns is a ``StateError``. Remote objects are read by ranged reads,
    a row group at a time, through their filesystem. Pickles without open files (DataLoader
    workers reopen them lazily).
    """

    kind = "ParquetSource"

    def __init__(
        self,
        paths: Paths,
        columns: Sequence[str] | None = None,
        cache_row_groups: int = DEFAULT_CACHE_ROW_GROUPS,
        storage_options: Mapping[str, Any] | None = None,
        filesystem: Any = None,
    ) -> None:
        super().__init__()
        if columns is not None:
            if isinstance(columns, str) or not all(isinstance(c, str) for c in columns):
                raise ConfigError(f"{self.kind}: columns must be a list of column names, got {columns!r}")
            columns = list(columns)
        if isinstance(cache_row_groups, bool) or not isinstance(cache_row_groups, int) or cache_row_groups < 1:
            raise ConfigError(f"{self.kind}: cache_row_groups must be an int >= 1, got {cache_row_groups!r}")
        self.paths, self._remote = resolve(paths, self.kind, storage_options, filesystem)
        self.columns = columns
        self.cache_row_groups = cache_row_groups
        remote = self._remote
        self._files = (
            WatchedFiles.of(self.kind, self.paths, footer_digest)
            if remote is None
            else WatchedFiles.of(self.kind, self.paths, remote.digest(file_footer_digest, self.kind), remote.stat)
        )
        self._handles: list[pq.ParquetFile | None] = [None] * len(self.paths)
        counts: list[int] = []
        group_file: list[int] = []
        group_local: list[int] = []
        for file, path in enumerate(self.paths):
            with reading(f"{self.kind}: cannot read {path!r} as Parquet"):
                metadata = self._file(file).metadata
                names = set(metadata.schema.to_arrow_schema().names)
                rows = [metadata.row_group(group).num_rows for group in range(metadata.num_row_groups)]
            missing = [c for c in columns or () if c not in names]
            if missing:
                raise SourceError(f"{self.kind}: {path!r} has no column(s) {missing}; it has {sorted(names)}")
            counts.extend(rows)
            group_file.extend([file] * len(rows))
            group_local.extend(range(len(rows)))
        self._group_starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).astype(np.int64)
        self._group_file = np.asarray(group_file, dtype=np.int64)
        self._group_local = np.asarray(group_local, dtype=np.int64)
        self._total = int(self._group_starts[-1])
        if self._total == 0:
            raise SourceError(f"{self.kind}: no rows in {', '.join(self.paths)} (empty files)")
        self._cache: OrderedDict[int, pa.Table] = OrderedDict()

    def __len__(self) -> int:
        return self._total

    @property
    def num_row_groups(self) -> int:
        return len(self._group_file)

    def block_bounds(self) -> np.ndarray:
        """Global index of the first row of every row group, then the total: the natural
        blocks of a block shuffle (``shuffle(block_size="row_group")``). Empty row groups
        are dropped."""
        return np.unique(self._group_starts)

    def reserve_cache(self, row_groups: int) -> None:
        """Keep at least ``row_groups`` decoded row groups (twice a block shuffle's window)."""
        self.cache_row_groups = max(self.cache_row_groups, int(row_groups))

    # -- state --------------------------------------------------------------------------------

    def _config(self) -> dict[str, Any]:
        return {COLUMNS: self.columns}

    # -- reading ------------------------------------------------------------------------------

    def _source(self, file: int) -> str | pa.NativeFile:
        """What ``pq.ParquetFile`` reads file ``file`` from: its path, or a random-access file
        over the object (pyarrow reads the footer and each column chunk by ranged reads)."""
        path = self.paths[file]
        return path if self._remote is None else self._remote.open(path, self.kind)

    def _file(self, file: int) -> pq.ParquetFile:
        handle = self._handles[file]
        if handle is None:
            # Opened lazily (again after pickling): it must be the file the pipeline was built on.
            self._files.check(file)
            with reading(f"{self.kind}: cannot read {self.paths[file]!r} as Parquet"):
                handle = pq.ParquetFile(self._source(file))
            self._handles[file] = handle
        return handle

    def _read_row_group(self, group: int, private_handle: bool = False) -> pa.Table:
        """Decode row group ``group`` (global numbering) from its file, bypassing the cache.

        A ``ParquetFile`` must not be read from two threads at once: concurrent decodes each
        use a ``private_handle`` (opened with the already parsed footer, so it is cheap)."""
        file = int(self._group_file[group])
        handle = self._file(file)
        with reading(f"{self.kind}: cannot decode row group {int(self._group_local[group])} of {self.paths[file]!r}"):
            if private_handle:
                handle = pq.ParquetFile(self._source(file), metadata=handle.metadata)
            table = handle.read_row_group(int(self._group_local[group]), columns=self.columns)
            table.validate(full=True)  # what to_pylist will trust: offsets in bounds, valid UTF-8
        return table

    def _row_group(self, group: int) -> pa.Table:
        """Decoded row group ``group`` (global numbering), through the LRU."""
        cache = self._cache
        table = cache.get(group)
        if table is not None:
            cache.move_to_end(group)
            return table
        table = self._read_row_group(group)
        cache[group] = table
        while len(cache) > self.cache_row_groups:
            cache.popitem(last=False)
        return table

    def locate(self, index: int) -> tuple[str, int, int]:
        """``(file path, row group, row within the row group)`` of global record ``index``."""
        if not 0 <= index < self._total:
            raise IndexError(f"{self.kind}: index {index} out of range [0, {self._total})")
        group = int(np.searchsorted(self._group_starts, index, side="right")) - 1
        file = int(self._group_file[group])
        return self.paths[file], int(self._group_local[group]), index - int(self._group_starts[group])

    def _raw_range(self, start: int, count: int) -> Sequence[dict[str, Any]]:
        group = int(np.searchsorted(self._group_starts, start, side="right")) - 1
        row = start - int(self._group_starts[group])
        table = self._row_group(group)
        rows: list[dict[str, Any]] = table.slice(row, min(count, table.num_rows - row)).to_pylist()
        return rows

    def _raw_at(self, indices: np.ndarray) -> Sequence[dict[str, Any]]:
        groups = np.unique(np.searchsorted(self._group_starts, indices, side="right") - 1).tolist()
        missing = [g for g in groups if g not in self._cache]
        if len(missing) > 1 and len(groups) <= self.cache_row_groups:
            self._decode_concurrently(missing)
        return group_take(indices, self._group_starts, self._row_group, self._cache.__contains__)

    def _decode_concurrently(self, groups: list[int]) -> None:
        """Decode several row groups at once, in threads (pyarrow releases the GIL): a resume
        or a block-shuffle window change waits for one row group's decode, not for several."""
        for group in groups:  # open and check the files here, in the calling thread
            self._file(int(self._group_file[group]))
        workers = min(len(groups), MAX_DECODE_THREADS)
        with ThreadPoolExecutor(max_workers=workers) as pool:
            tables = list(pool.map(lambda group: self._read_row_group(group, private_handle=True), groups))
        for group, table in zip(groups, tables):
            self._cache[group] = table
        while len(self._cache) > self.cache_row_groups:
            self._cache.popitem(last=False)

    # -- pickling (DataLoader workers): files are reopened lazily ------------------------------

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_handles"] = [None] * len(self.paths)
        state["_cache"] = OrderedDict()
        return state


def footer_digest(path: str) -> str | None:
    """A digest of a Parquet file's footer (schema, and every row group's row count, column
    chunk offsets, sizes and statistics): any rewrite changes it, an edit of data pages in
    place that keeps every size may not. None when the file has no Parquet footer."""
    with open(path, "rb") as handle:
        return file_footer_digest(handle)


def file_footer_digest(handle: BinaryIO | pa.NativeFile) -> str | None:
    """``footer_digest`` of an open file (local, or an object read by two ranged reads)."""
    size = handle.seek(0, os.SEEK_END)
    if size < FOOTER_TAIL.size:
        return None
    handle.seek(size - FOOTER_TAIL.size)
    length, magic = FOOTER_TAIL.unpack(handle.read(FOOTER_TAIL.size))
    if magic not in PARQUET_MAGICS or length > size - FOOTER_TAIL.size:
        return None
    handle.seek(size - FOOTER_TAIL.size - length)
    footer = handle.read(length + FOOTER_TAIL.size)
    return f"parquet-footer-xxh3_64:{xxhash.xxh3_64_hexdigest(footer)}"


def parquet(
    paths: Paths,
    columns: Sequence[str] | None = None,
    cache_row_groups: int = DEFAULT_CACHE_ROW_GROUPS,
    storage_options: Mapping[str, Any] | None = None,
    filesystem: Any = None,
) -> ParquetSource:
    """A source over Parquet files: a path, a glob, or a list of them (globs sorted), local or
    remote (``s3://`` URLs with ``storage_options``, or paths on a ``pyarrow.fs`` ``filesystem``;
    see ``resumable.sources.remote``). Records are dicts of the selected ``columns`` (all by
    default)."""
    return ParquetSource(
        paths,
        columns=columns,
        cache_row_groups=cache_row_groups,
        storage_options=storage_options,
        filesystem=filesystem,
    )
