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
from typing import Any, BinaryIO, Callable, ClassVar, Mapping, NamedTuple, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import xxhash

from resumable.core.options import int_option
from resumable.errors import ConfigError, SourceError
from resumable.sources.blocks import (
    BLOCK_BYTES,
    CACHE_BYTES,
    DISK_CACHE_BYTES,
    BlockFile,
    BlockReader,
)
from resumable.sources.files import Paths, WatchedFiles, reading, with_version
from resumable.sources.open_files import OpenFiles, pyarrow_path
from resumable.sources.remote import FRESH_SECONDS
from resumable.sources.source import PathSource

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


class FailedRow(NamedTuple):
    """A row Python cannot hold (a timestamp or date past the year 9999, a duration past
    ``timedelta``'s range), in place of its record: ``ColumnarRows``' decoder raises its error
    where the record is read."""

    error: SourceError


_failed_rows_made = False
"""Whether this process made a ``FailedRow``: until then, runs of rows need no look."""


def python_rows(rows: pa.Table | pa.RecordBatch, where: str, numbers: Sequence[int]) -> list[Any]:
    """``rows`` as Python dicts; a row Python cannot hold is a ``FailedRow`` whose SourceError
    names ``where`` (the file and its row group or record batch) and the row (``numbers``: each
    row's number there)."""
    try:
        converted: list[Any] = rows.to_pylist()
    except (OverflowError, ValueError):
        return [_python_row(rows, index, where, number) for index, number in enumerate(numbers)]
    return converted


def _python_row(rows: pa.Table | pa.RecordBatch, index: int, where: str, number: int) -> Any:
    global _failed_rows_made
    try:
        return rows.slice(index, 1).to_pylist()[0]
    except (OverflowError, ValueError) as error:
        failed = SourceError(
            f"{where}, row {number}: a value has no Python equivalent ({type(error).__name__}: {error})"
        )
        failed.__cause__ = error
        _failed_rows_made = True
        return FailedRow(failed)


def raise_failed(record: Any) -> Any:
    """The columnar sources' decoder: a record as it is, a ``FailedRow``'s error raised."""
    if type(record) is FailedRow:
        raise record.error
    return record


class ColumnarRows:
    """What the columnar sources (Parquet, Arrow, a Hugging Face dataset) decode: rows converted
    by ``python_rows``, among which a ``FailedRow`` is raised at its record, so its error comes
    there and iteration goes on past it, as a malformed JSON line's does. Runs pass in one call
    until the process made a failed row; then each run is looked through."""

    _decodes_whole_chunks: ClassVar[bool] = True

    def _decoder(self) -> Callable[[Any], Any] | None:
        return raise_failed

    def _decode_run(self, raws: Sequence[Any]) -> list[Any]:
        if _failed_rows_made:
            return list(map(raise_failed, raws))
        return raws if type(raws) is list else list(raws)


def _taken(piece: pa.Table | pa.RecordBatch, offsets: np.ndarray, where: str) -> list[Any]:
    """The rows at ``offsets`` of ``piece`` as Python dicts (a table without columns, as
    ``columns=[]`` reads, takes no rows in Arrow: its rows are empty dicts)."""
    if not piece.num_columns:
        return [{} for _ in range(len(offsets))]
    return python_rows(piece.take(offsets), where, offsets.tolist())


def group_take(
    indices: np.ndarray,
    starts: np.ndarray,
    load: Callable[[int], Any],
    name: Callable[[int], str],
    is_cached: Callable[[int], bool] | None = None,
) -> list[Any]:
    """Records (dicts) at global ``indices``, in that order, where piece ``p`` holds records
    ``[starts[p], starts[p+1])``, ``load(p)`` returns it as an Arrow table or record batch and
    ``name(p)`` names it in errors.

    Each needed piece is loaded and taken from once. With ``is_cached`` (the caller's LRU
    membership), pieces already cached are read first, so that loading the missing ones
    cannot evict a cached piece before this call has used it."""
    pieces = np.searchsorted(starts, indices, side="right") - 1
    unique = np.unique(pieces)
    if unique.size == 1:
        piece = int(unique[0])
        return _taken(load(piece), indices - starts[piece], name(piece))
    order = unique.tolist()
    if is_cached is not None:
        order.sort(key=lambda piece: not is_cached(piece))
    out: list[Any] = [None] * len(indices)
    for piece in order:
        slots = np.flatnonzero(pieces == piece)
        for slot, record in zip(slots.tolist(), _taken(load(piece), indices[slots] - starts[piece], name(piece))):
            out[slot] = record
    return out


class ParquetSource(ColumnarRows, PathSource[dict[str, Any]]):
    """Rows (as dicts) of one or more Parquet files, in file order then row order.

    ``columns`` selects columns (all by default). Missing files, globs that match nothing,
    unreadable files and a total of zero rows raise ``SourceError`` at construction. The state
    holds each file's name, size, mtime and footer digest, and the columns: resuming over
    changed files or other columns is a ``StateError``. Remote objects are read by ranged reads
    in blocks through the memory and disk caches of ``resumable.sources.blocks`` (``block_bytes``,
    ``cache_bytes``, ``disk_cache_bytes`` in ``cache_dir``), the column chunks of the row groups
    the cursor reads next fetched ahead. Pickles without open files (DataLoader workers reopen
    them lazily).
    """

    kind = "ParquetSource"

    def __init__(
        self,
        paths: Paths,
        columns: Sequence[str] | None = None,
        cache_row_groups: int = DEFAULT_CACHE_ROW_GROUPS,
        storage_options: Mapping[str, Any] | None = None,
        filesystem: Any = None,
        cache_dir: str | None = None,
        block_bytes: int = BLOCK_BYTES,
        cache_bytes: int = CACHE_BYTES,
        disk_cache_bytes: int = DISK_CACHE_BYTES,
    ) -> None:
        super().__init__()
        if columns is not None:
            if (
                not isinstance(columns, Sequence)
                or isinstance(columns, str)
                or not all(isinstance(c, str) for c in columns)
            ):
                raise ConfigError(f"{self.kind}: columns must be a list of column names, got {columns!r}")
            columns = list(columns)
        cache_row_groups = int_option(self.kind, "cache_row_groups", cache_row_groups)
        remote = self._resolve(
            paths, storage_options, filesystem, cache_dir, block_bytes, cache_bytes, disk_cache_bytes
        )
        self.columns = columns
        self.cache_row_groups = cache_row_groups
        self._handles: OpenFiles[pq.ParquetFile] = OpenFiles(len(self.paths))
        self._metadata: list[pq.FileMetaData | None] = [None] * len(self.paths)  # each file's footer, parsed once
        self._roots: list[list[str] | None] = [None] * len(self.paths)  # each file's leaf_roots, from its footer
        if remote is None:
            self._files = WatchedFiles.of(self.kind, self.paths, footer_digest)
        else:
            # The footer digest reads the footer blocks that ParquetFile then finds cached.
            fingerprints = []
            for file, path in enumerate(self.paths):
                info = self._head(file)[0]
                reader = self._block_reader(file, remote, check=False)
                fingerprints.append([path, info.size, info.mtime_ns, versioned_footer_digest(reader, info.version)])
            digest = remote.digest(file_footer_digest, self.kind)
            self._files = WatchedFiles(self.kind, fingerprints, digest, remote.stat, fresh_for=FRESH_SECONDS)
        counts: list[int] = []
        group_file: list[int] = []
        group_local: list[int] = []
        for file, path in enumerate(self.paths):
            with reading(f"{self.kind}: cannot read {path!r} as Parquet"):
                metadata = self._file(file).metadata
                names = set(metadata.schema.to_arrow_schema().names)
                rows = [metadata.row_group(group).num_rows for group in range(metadata.num_row_groups)]
            if metadata.num_columns and any(
                metadata.row_group(group).column(0).file_path for group in range(metadata.num_row_groups)
            ):
                raise SourceError(
                    f"{self.kind}: {path!r} is a dataset's summary (_metadata) whose row groups lie in other files; "
                    "read the part files (a glob over the directory leaves summaries out)"
                )
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

    def _source(self, file: int) -> pa.NativeFile:
        """What ``pq.ParquetFile`` reads file ``file`` from: the local file opened (and checked
        to be the file checked before: ``check_opened``), or a file over the
        object's blocks (pyarrow reads the footer and each column chunk as byte ranges)."""
        remote = self._remote
        if remote is None:
            opened = _open_local(self.paths[file])  # an OSError as it is: OpenFiles retries when out of descriptors
            try:
                self._files.check_opened(file, opened.fileno())  # what the last check saw
            except BaseException:
                opened.close()
                raise
            return opened
        return pa.PythonFile(BlockFile(self._block_reader(file, remote)), mode="r")

    def _content_digest(self, file: int, reader: BlockReader, version: str) -> str | None:
        return versioned_footer_digest(reader, version)

    def _file(self, file: int) -> pq.ParquetFile:
        """File ``file`` open, within the process's budget of open files (``OpenFiles``)."""
        with reading(f"{self.kind}: cannot read {self.paths[file]!r} as Parquet"):
            return self._handles.get(file, self._open_file)

    def _open_file(self, file: int) -> pq.ParquetFile:
        """Opened lazily, and again after being let go or pickled: it must be the file the
        pipeline was built on. Its footer is parsed once."""
        self._files.check(file)
        handle = pq.ParquetFile(self._source(file), metadata=self._metadata[file])
        self._metadata[file] = handle.metadata
        return handle

    def _leaf_roots(self, file: int) -> list[str]:
        """``leaf_roots`` of file ``file``, built once from its footer (a wide schema takes about
        a millisecond, paid otherwise with every row group decoded or fetched ahead)."""
        roots = self._roots[file]
        if roots is None:
            roots = self._roots[file] = leaf_roots(self._file(file).schema_arrow)
        return roots

    def _read_row_group(self, group: int, private_handle: bool = False) -> pa.Table:
        """Decode row group ``group`` (global numbering) from its file, bypassing the cache.

        A ``ParquetFile`` must not be read from two threads at once: concurrent decodes each
        use a ``private_handle`` (opened with the already parsed footer, so it is cheap)."""
        file = int(self._group_file[group])
        handle = self._file(file)
        with reading(f"{self.kind}: cannot decode row group {int(self._group_local[group])} of {self.paths[file]!r}"):
            if private_handle:
                handle = pq.ParquetFile(self._source(file), metadata=handle.metadata)  # closed when dropped
            table = read_columns(handle, int(self._group_local[group]), self.columns, self._leaf_roots(file))
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
        rows = min(count, table.num_rows - row)
        return python_rows(table.slice(row, rows), self._group_name(group), range(row, row + rows))

    def _raw_at(self, indices: np.ndarray) -> Sequence[dict[str, Any]]:
        groups = np.unique(np.searchsorted(self._group_starts, indices, side="right") - 1).tolist()
        missing = [g for g in groups if g not in self._cache]
        if len(missing) > 1 and len(groups) <= self.cache_row_groups:
            self._decode_concurrently(missing)
        return group_take(indices, self._group_starts, self._row_group, self._group_name, self._cache.__contains__)

    def _group_name(self, group: int) -> str:
        """Row group ``group`` (global numbering) as errors name it: its file and its number there."""
        return f"{self.kind}: row group {int(self._group_local[group])} of {self.paths[int(self._group_file[group])]!r}"

    def _reads_ahead(self) -> bool:
        return self._remote is not None

    def _read_ahead(self, indices: np.ndarray) -> None:
        """Fetch ahead the column chunks (selected columns) of the row groups of ``indices``
        that are not decoded yet."""
        remote = self._remote
        if remote is None:
            return
        groups = np.unique(np.searchsorted(self._group_starts, indices, side="right") - 1).tolist()
        for group in groups:
            if group in self._cache:
                continue
            file = int(self._group_file[group])
            metadata, roots = self._file(file).metadata, self._leaf_roots(file)
            starts, ends = column_chunk_spans(metadata, int(self._group_local[group]), self.columns, roots)
            if len(starts):
                self._block_reader(file, remote).read_ahead(starts, ends)

    def _decode_concurrently(self, groups: list[int]) -> None:
        """Decode several row groups at once, in threads (pyarrow releases the GIL): a resume
        or a block-shuffle window change waits for one row group's decode, not for several."""
        for group in groups:  # open and check the files here, in the calling thread
            self._file(int(self._group_file[group]))
            self._leaf_roots(int(self._group_file[group]))
        workers = min(len(groups), MAX_DECODE_THREADS)
        with ThreadPoolExecutor(max_workers=workers) as pool:
            tables = list(pool.map(lambda group: self._read_row_group(group, private_handle=True), groups))
        for group, table in zip(groups, tables):
            self._cache[group] = table
        while len(self._cache) > self.cache_row_groups:
            self._cache.popitem(last=False)

    # -- pickling (DataLoader workers): files are reopened lazily ------------------------------

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_metadata"] = [None] * len(self.paths)
        state["_roots"] = [None] * len(self.paths)
        state["_cache"] = OrderedDict()
        return state


def column_chunk_spans(
    metadata: pq.FileMetaData, row_group: int, columns: Sequence[str] | None, roots: list[str] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Byte ranges ``(starts, ends)`` of the column chunks of ``row_group`` (of ``columns``, by
    top-level name; all by default): what decoding it reads. ``roots``: the file's
    ``leaf_roots``, built from ``metadata`` when not given."""
    group = metadata.row_group(row_group)
    if roots is None:
        roots = leaf_roots(metadata.schema.to_arrow_schema())
    wanted = None if columns is None or len(roots) != group.num_columns else set(columns)
    starts: list[int] = []
    ends: list[int] = []
    for index in range(group.num_columns):
        chunk = group.column(index)
        if wanted is not None and roots[index] not in wanted:
            continue
        offsets = [chunk.data_page_offset]
        if chunk.has_dictionary_page and chunk.dictionary_page_offset is not None:
            offsets.append(chunk.dictionary_page_offset)
        start = min(offsets)
        starts.append(start)
        ends.append(start + max(1, chunk.total_compressed_size))
    return np.asarray(starts, dtype=np.int64), np.asarray(ends, dtype=np.int64)


def read_columns(handle: pq.ParquetFile, row_group: int, columns: Sequence[str] | None, roots: list[str]) -> pa.Table:
    """Row group ``row_group`` of the top-level ``columns`` (all by default), in that order. Leaves
    are chosen by position (``roots``, the file's ``leaf_roots``): pyarrow takes a name as a
    dotted path too, so ``"a.b"`` would also read field ``b`` of a struct ``a``."""
    if columns is None or len(roots) != handle.metadata.num_columns or not set(columns) <= set(roots):
        return handle.read_row_group(row_group, columns=columns)  # pyarrow's own, and its error for a missing one
    wanted = set(columns)
    indices = [index for index, root in enumerate(roots) if root in wanted]
    table = handle.reader.read_row_group(row_group, column_indices=indices, use_threads=True)
    return table.select(list(dict.fromkeys(columns)))


def leaf_roots(schema: pa.Schema) -> list[str]:
    """The top-level field of each leaf column, in the file's column order (depth first): a
    column chunk's dotted path cannot tell a field named ``a.b`` from field ``b`` of ``a``."""
    return [field.name for field in schema for _ in range(_leaf_count(field.type))]


def _leaf_count(kind: pa.DataType) -> int:
    """How many leaf columns Parquet stores a value of type ``kind`` in."""
    if isinstance(kind, pa.ExtensionType):
        return _leaf_count(kind.storage_type)
    if pa.types.is_struct(kind):
        return sum(_leaf_count(kind.field(index).type) for index in range(kind.num_fields))
    if pa.types.is_map(kind):
        return _leaf_count(kind.key_type) + _leaf_count(kind.item_type)
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        return _leaf_count(kind.value_type)
    return 1


def _open_local(path: str) -> pa.NativeFile:
    """A local file open for pyarrow, whatever bytes its name holds (``pyarrow_path``)."""
    with pyarrow_path(path) as name:
        return pa.OSFile(name, "r")


def footer_digest(path: str) -> str | None:
    """A digest of a Parquet file's footer (schema, and every row group's row count, column
    chunk offsets, sizes and statistics): any rewrite changes it, an edit of data pages in
    place that keeps every size may not. None when the file has no Parquet footer."""
    with open(path, "rb") as handle:
        return file_footer_digest(handle)


def versioned_footer_digest(reader: BlockReader | None, version: str) -> str | None:
    """``footer_digest`` of a remote object, read through its block reader, with its version."""
    if reader is None:
        return None
    with reading(f"{reader.kind}: cannot read {reader.name!r} as Parquet"):
        return with_version(file_footer_digest(BlockFile(reader)), version)


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
    cache_dir: str | None = None,
    block_bytes: int = BLOCK_BYTES,
    cache_bytes: int = CACHE_BYTES,
    disk_cache_bytes: int = DISK_CACHE_BYTES,
) -> ParquetSource:
    """A source over Parquet files: a path, a glob, or a list of them (globs sorted), local or
    remote (``s3://`` URLs with ``storage_options``, or paths on a ``pyarrow.fs`` ``filesystem``;
    see ``resumable.sources.remote``; read in blocks of ``block_bytes`` through a ``cache_bytes``
    memory cache and a ``disk_cache_bytes`` disk cache in ``cache_dir``). Records are dicts of
    the selected ``columns`` (all by default)."""
    return ParquetSource(
        paths,
        columns=columns,
        cache_row_groups=cache_row_groups,
        storage_options=storage_options,
        filesystem=filesystem,
        cache_dir=cache_dir,
        block_bytes=block_bytes,
        cache_bytes=cache_bytes,
        disk_cache_bytes=disk_cache_bytes,
    )
