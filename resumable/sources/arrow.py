"""Arrow sources: memory-mapped Arrow IPC files and Hugging Face ``datasets.Dataset``.

* ``rs.arrow(paths)`` reads Arrow IPC files in the file format (``.arrow`` / ``.feather`` v2)
  or the streaming format (what Hugging Face ``datasets`` writes) through ``pa.memory_map``:
  record batches are zero-copy views of the page cache, their row offsets are computed once
  at construction, and record ``i`` is ``(batch, row)``, taken by random access in O(1).
  Each batch is fully validated (offsets in bounds, valid UTF-8) the first time it is read, so
  a corrupt file is a ``SourceError``, never a crash.
* ``rs.from_hf(dataset)`` reads a map-style ``datasets.Dataset`` without copying it: the
  dataset's own memory-mapped Arrow table and its indices mapping (after ``select``,
  ``shuffle``, ``filter``), so record ``i`` equals ``dataset[i]`` (as Python objects).

Reading a memory map past the end of a file cut short kills the process (SIGBUS), so every
mapped file is checked (a ``stat``: size and mtime) before its batches are read; a file that
changed is a ``SourceError``.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np
import pyarrow as pa
import xxhash

from resumable.errors import ConfigError, SourceError, StateError
from resumable.sources.blocks import (
    BLOCK_BYTES,
    CACHE_BYTES,
    DISK_CACHE_BYTES,
    BlockReader,
)
from resumable.sources.files import NAME, Paths, WatchedFiles, reading, with_version
from resumable.sources.open_files import MappedFile
from resumable.sources.parquet import ColumnarRows, FailedRow, group_take, python_rows, raise_failed
from resumable.sources.remote import FRESH_SECONDS
from resumable.sources.source import FileSource, PathSource

FINGERPRINT = "fingerprint"
"""State key of a Hugging Face dataset's ``_fingerprint`` (changes with every transform)."""
IPC_FILE_MAGIC = b"ARROW1"
IPC_FILE_PREAMBLE = 8
"""The IPC file format is the magic, padding to 8 bytes, the stream format, then a footer."""


def ipc_digest(path: str) -> str:
    """A digest of the metadata of every message of an Arrow IPC file (either format): the
    schema, and every record batch's row count, null counts and buffer offsets and lengths.
    Any rewrite that changes the layout changes it; an edit of values in place that keeps every
    length does not. Reads the messages' metadata only, not their bodies."""
    return file_ipc_digest(pa.BufferReader(MappedFile.of(path).buffer))


def object_ipc_digest(handle: pa.NativeFile) -> str:
    """``ipc_digest`` of a remote object, read whole by one request (the messages' small reads
    would each be a request)."""
    return file_ipc_digest(pa.BufferReader(handle.read_buffer()))


def file_ipc_digest(source: pa.NativeFile) -> str:
    """``ipc_digest`` of an open file: a memory map, or a buffer."""
    hasher = xxhash.xxh3_64()
    source.seek(IPC_FILE_PREAMBLE if source.read(len(IPC_FILE_MAGIC)) == IPC_FILE_MAGIC else 0)
    for message in pa.ipc.MessageReader.open_stream(source):
        hasher.update(message.metadata)
    return f"arrow-ipc-metadata-xxh3_64:{hasher.hexdigest()}"


def _read_batches(
    path: str, kind: str, data: pa.Buffer | None, opened: Callable[[os.stat_result], None] | None = None
) -> list[pa.RecordBatch]:
    """Record batches of an Arrow IPC file (file or streaming format): memory-mapped for a
    local file, without a descriptor (``opened`` is given the ``os.stat`` of what was mapped),
    from ``data``, its bytes (``_object_buffer``), for a remote object."""
    if data is None:
        with reading(f"{kind}: cannot open {path!r}"):
            mapped = MappedFile.of(path)
        if opened is not None:
            opened(mapped.opened)
        data = mapped.buffer
    source = pa.BufferReader(data)
    with reading(f"{kind}: {path!r} is neither an Arrow IPC file nor an Arrow IPC stream"):
        try:
            reader_ = pa.ipc.open_file(source)
        except pa.ArrowInvalid:
            source.seek(0)
            return list(pa.ipc.open_stream(source))
        return [reader_.get_batch(i) for i in range(reader_.num_record_batches)]


def _versioned_ipc_digest(data: pa.Buffer, reader: BlockReader, version: str) -> str:
    """``ipc_digest`` of the bytes ``data`` of the object ``reader`` reads, with its version."""
    with reading(f"{reader.kind}: {reader.name!r} is neither an Arrow IPC file nor an Arrow IPC stream"):
        return with_version(file_ipc_digest(pa.BufferReader(data)), version)


def _object_buffer(reader: BlockReader) -> pa.Buffer:
    """The whole remote object, in blocks through the memory and disk caches."""
    return pa.py_buffer(reader.read(0, reader.size))


def _offsets(counts: Sequence[int]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(np.asarray(counts, dtype=np.int64))]).astype(np.int64)


def _mapped_files(data: Any, batch_starts: np.ndarray, watched: dict[str, int]) -> list[list[int]]:
    """For each record batch of a ``datasets`` table (rows ``batch_starts[i]:batch_starts[i+1]``),
    the ``watched`` files (by index) its rows are memory-mapped from.

    The table is a ``MemoryMappedTable`` (one file, its ``path``), an ``InMemoryTable`` (none),
    or a ``ConcatenationTable`` whose ``blocks`` are rows stacked vertically, each a horizontal
    concatenation of such tables. Where the rows of blocks do not add up to the table's rows,
    every batch is given every file."""
    rows_of_blocks = getattr(data, "blocks", None) or [[data]]
    row_counts = [blocks[0].num_rows if blocks else 0 for blocks in rows_of_blocks]
    if sum(row_counts) != batch_starts[-1]:
        return [list(watched.values())] * (len(batch_starts) - 1)
    paths = [[getattr(block, "path", None) for block in blocks] for blocks in rows_of_blocks]
    files = [sorted({watched[path] for path in row if path in watched}) for row in paths]
    block_starts = _offsets(row_counts)
    first = np.searchsorted(block_starts, batch_starts[:-1], side="right") - 1
    last = np.searchsorted(block_starts, batch_starts[1:] - 1, side="right") - 1
    return [sorted({f for row in range(a, b + 1) for f in files[row]}) for a, b in zip(first.tolist(), last.tolist())]


class ArrowSource(ColumnarRows, PathSource[dict[str, Any]]):
    """Rows (as dicts) of one or more Arrow IPC files, in file order then row order.

    Both IPC formats are read through memory maps; remote objects (which cannot be mapped) are
    read whole into memory once per process, in blocks through the disk cache shared by the
    machine's processes. Missing files, globs that match nothing,
    files that are not Arrow IPC and a total of zero rows raise ``SourceError`` at
    construction. The state holds each file's name, size, mtime and IPC metadata digest:
    resuming over changed files is a ``StateError``. Pickles without memory maps (reopened
    lazily).
    """

    kind = "ArrowSource"

    def __init__(
        self,
        paths: Paths,
        storage_options: Mapping[str, Any] | None = None,
        filesystem: Any = None,
        cache_dir: str | None = None,
        block_bytes: int = BLOCK_BYTES,
        cache_bytes: int = CACHE_BYTES,
        disk_cache_bytes: int = DISK_CACHE_BYTES,
    ) -> None:
        super().__init__()
        remote = self._resolve(
            paths, storage_options, filesystem, cache_dir, block_bytes, cache_bytes, disk_cache_bytes
        )
        if remote is None:
            per_file = [_read_batches(path, self.kind, None) for path in self.paths]
            self._files = WatchedFiles.of(self.kind, self.paths, ipc_digest)
        else:
            # Each object read whole once (through the block caches): batches and IPC digest
            # come from the same bytes.
            fingerprints = []
            per_file = []
            for file, path in enumerate(self.paths):
                info = self._head(file)[0]
                reader = self._block_reader(file, remote, check=False)
                data = _object_buffer(reader)
                fingerprints.append([path, info.size, info.mtime_ns, _versioned_ipc_digest(data, reader, info.version)])
                per_file.append(_read_batches(path, self.kind, data))
            digest_hook = remote.digest(object_ipc_digest, self.kind)
            self._files = WatchedFiles(self.kind, fingerprints, digest_hook, remote.stat, fresh_for=FRESH_SECONDS)
        self._batch_file = [file for file, batches in enumerate(per_file) for _ in batches]
        self._batch_local = [local for batches in per_file for local in range(len(batches))]
        batches = [batch for batches in per_file for batch in batches]
        self._batch_starts = _offsets([batch.num_rows for batch in batches])
        self._total = int(self._batch_starts[-1])
        if self._total == 0:
            raise SourceError(f"{self.kind}: no rows in {', '.join(self.paths)} (empty files)")
        self._batches: list[pa.RecordBatch] | None = batches
        self._valid = [False] * len(batches)

    def __len__(self) -> int:
        return self._total

    def block_bounds(self) -> np.ndarray:
        """Global index of the first row of every record batch, then the total (empty batches
        dropped): the natural blocks of a block shuffle."""
        return np.unique(self._batch_starts)

    # -- reading ------------------------------------------------------------------------------

    def _batch(self, index: int) -> pa.RecordBatch:
        """Record batch ``index`` (global numbering), validated on first use, after checking
        that its file is unchanged: a file cut short under a memory map would crash the process
        on reading (SIGBUS). Remote objects are read into memory: ``watch`` checks them."""
        file = self._batch_file[index]
        if self._remote is None:
            self._files.check(file)
        batches = self._batches
        if batches is None:  # reopened after pickling into a DataLoader worker
            self._files.check_all()
            batches = self._batches = [
                batch
                for file, path in enumerate(self.paths)
                for batch in _read_batches(path, self.kind, self._object_data(file), self._opened_check(file))
            ]
        batch = batches[index]
        if not self._valid[index]:  # memory-mapped batches are not validated on reading
            with reading(f"{self.kind}: cannot read record batch {self._batch_local[index]} of {self.paths[file]!r}"):
                batch.validate(full=True)  # offsets within bounds, valid UTF-8: what to_pylist trusts
            self._valid[index] = True
        return batch

    def _opened_check(self, file: int) -> Callable[[os.stat_result], None] | None:
        """What ``_read_batches`` runs on local file ``file`` once mapped (``check_stat``)."""
        return None if self._remote is not None else functools.partial(self._files.check_stat, file)

    def _object_data(self, file: int) -> pa.Buffer | None:
        """The bytes of remote file ``file`` (through the block caches); None for a local file."""
        return None if self._remote is None else _object_buffer(self._block_reader(file, self._remote))

    def _content_digest(self, file: int, reader: BlockReader, version: str) -> str:
        return _versioned_ipc_digest(_object_buffer(reader), reader, version)

    def _raw_range(self, start: int, count: int) -> Sequence[dict[str, Any]]:
        index = int(np.searchsorted(self._batch_starts, start, side="right")) - 1
        row = start - int(self._batch_starts[index])
        batch = self._batch(index)
        rows = min(count, batch.num_rows - row)
        return python_rows(batch.slice(row, rows), self._batch_name(index), range(row, row + rows))

    def _raw_at(self, indices: np.ndarray) -> Sequence[dict[str, Any]]:
        return group_take(indices, self._batch_starts, self._batch, self._batch_name)

    def _batch_name(self, index: int) -> str:
        """Record batch ``index`` (global numbering) as errors name it: its file and its number there."""
        return f"{self.kind}: record batch {self._batch_local[index]} of {self.paths[self._batch_file[index]]!r}"

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_batches"] = None
        state["_valid"] = [False] * len(self._valid)
        return state


class HfSource(ColumnarRows, FileSource[dict[str, Any]]):
    """Rows of a map-style Hugging Face ``datasets.Dataset``, read from its Arrow table.

    Record ``i`` equals ``dataset[i]`` with the dataset's format ignored (Python objects;
    features that need decoding, images or audio, are decoded like ``dataset[i]`` does). The
    dataset's indices mapping (``select``, ``shuffle``, ``filter``) is honoured without
    flattening it. The state holds the dataset's fingerprint and its cache files' names, sizes
    and mtimes: resuming over another dataset or changed files is a ``StateError``.
    """

    kind = "HfSource"

    def __init__(self, dataset: Any) -> None:
        super().__init__()
        try:
            import datasets
        except ImportError as error:  # pragma: no cover - datasets is an optional dependency
            raise ConfigError(f"{self.kind}: from_hf needs the 'datasets' package") from error
        if not isinstance(dataset, datasets.Dataset):
            raise ConfigError(
                f"{self.kind}: expected a map-style datasets.Dataset, got {type(dataset).__name__} "
                "(pick a split of a DatasetDict; IterableDataset has no random access)"
            )
        if dataset.format.get("type") == "custom":
            raise ConfigError(
                f"{self.kind}: the dataset has a transform (set_transform or with_transform), which from_hf would "
                "not apply (it reads the Arrow table, as dataset[i] without a format would): apply the function "
                "with .map() on the pipeline instead, on dataset.with_format(None)"
            )
        self.dataset = dataset
        self._fingerprint: str = str(dataset._fingerprint)
        cache_files = [entry["filename"] for entry in dataset.cache_files if os.path.exists(entry["filename"])]
        self._files = WatchedFiles.of(self.kind, cache_files, ipc_digest)
        self._total = len(dataset)
        if self._total == 0:
            raise SourceError(f"{self.kind}: dataset {self._fingerprint} has no rows")
        self._batches: list[pa.RecordBatch] | None = None
        self._valid: list[bool] = []
        self._rows: np.ndarray | None = None
        self._batch_files: list[list[int]] = []
        self._open_table()
        features = dataset.features
        from datasets.features.features import require_decoding

        self._features_decode: Callable[[Any], Any] | None = (
            features.decode_example if any(require_decoding(f) for f in features.values()) else None
        )

    def _open_table(self) -> list[pa.RecordBatch]:
        """Record batches of the dataset's table (zero-copy views), the cache files each is
        mapped from, and its indices mapping (copied: read once, here, after checking the files).
        Returns the batches."""
        self._files.check_all()
        table: pa.Table = self.dataset.data.table
        batches = self._batches = [batch for batch in table.to_batches() if batch.num_rows]
        self._valid = [False] * len(batches)
        self._batch_starts = _offsets([batch.num_rows for batch in batches])
        watched = {fingerprint[NAME]: file for file, fingerprint in enumerate(self._files.fingerprints)}
        self._batch_files = _mapped_files(self.dataset.data, self._batch_starts, watched)
        mapping = self.dataset._indices
        self._rows = None if mapping is None else mapping.column(0).to_numpy().astype(np.int64)
        return batches

    def __len__(self) -> int:
        return self._total

    # -- state --------------------------------------------------------------------------------

    def _config(self) -> dict[str, Any]:
        return {FINGERPRINT: self._fingerprint}

    def _check_config(self, state: dict[str, Any], path: str) -> None:
        saved = state.get(FINGERPRINT)
        if saved != self._fingerprint:
            raise StateError(
                f"{path}: state was saved over dataset fingerprint {saved!r}, this dataset is {self._fingerprint!r}"
            )
        self._check_identity(state, path)

    # -- reading ------------------------------------------------------------------------------

    def _check_files(self, batches: Iterable[int]) -> None:
        """Check, once each, the cache files that record ``batches`` are mapped from (a file cut
        short under a memory map would crash the process on reading)."""
        for file in sorted({file for batch in batches for file in self._batch_files[batch]}):
            self._files.check(file)

    def _batch(self, index: int) -> pa.RecordBatch:
        """Record batch ``index`` of the dataset's table, validated on first use. Its files are
        checked by the caller (``_check_files``)."""
        batches = self._batches if self._batches is not None else self._open_table()
        batch = batches[index]
        if not self._valid[index]:
            with reading(f"{self.kind}: cannot read record batch {index} of dataset {self._fingerprint}"):
                batch.validate(full=True)
            self._valid[index] = True
        return batch

    def _table_rows(self, indices: np.ndarray) -> np.ndarray:
        if self._batches is None:
            self._open_table()
        return indices if self._rows is None else self._rows[indices]

    def _raw_range(self, start: int, count: int) -> Sequence[dict[str, Any]]:
        if self._batches is None:
            self._open_table()
        if self._rows is not None:
            return self._raw_at(np.arange(start, start + count, dtype=np.int64))
        index = int(np.searchsorted(self._batch_starts, start, side="right")) - 1
        row = start - int(self._batch_starts[index])
        self._check_files((index,))
        batch = self._batch(index)
        rows = min(count, batch.num_rows - row)
        return python_rows(batch.slice(row, rows), self._batch_name(index), range(row, row + rows))

    def _raw_at(self, indices: np.ndarray) -> Sequence[dict[str, Any]]:
        rows = self._table_rows(indices)
        self._check_files(np.unique(np.searchsorted(self._batch_starts, rows, side="right") - 1).tolist())
        return group_take(rows, self._batch_starts, self._batch, self._batch_name)

    def _batch_name(self, index: int) -> str:
        """Record batch ``index`` of the dataset's table as errors name it."""
        return f"{self.kind}: record batch {index} of the dataset's table"

    @property  # a ClassVar elsewhere: here it follows the features
    def _decodes_whole_chunks(self) -> bool:  # type: ignore[override]
        """Rows whose features decode (images, audio) are decoded as they are handed out."""
        return self._features_decode is None

    def _decoder(self) -> Callable[[Any], Any] | None:
        decode = self._features_decode
        return raise_failed if decode is None else functools.partial(_decoded_row, decode)

    def _decode_failed(self, raw: Any, index: int, error: Exception, may_skip: bool) -> None:
        if type(raw) is FailedRow:
            raise error
        raise SourceError(
            f"{self.kind}: cannot decode row {index} of dataset {self._fingerprint}: {type(error).__name__}: {error}"
        ) from error

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_batches"] = None
        state["_rows"] = None
        state["_batch_files"] = []
        return state


def _decoded_row(decode: Callable[[Any], Any], record: Any) -> Any:
    """A row of a dataset whose features decode (images, audio): a ``FailedRow`` raised, any
    other row decoded."""
    return decode(raise_failed(record))


def arrow(
    paths: Paths,
    storage_options: Mapping[str, Any] | None = None,
    filesystem: Any = None,
    cache_dir: str | None = None,
    block_bytes: int = BLOCK_BYTES,
    cache_bytes: int = CACHE_BYTES,
    disk_cache_bytes: int = DISK_CACHE_BYTES,
) -> ArrowSource:
    """A source over Arrow IPC files (file or streaming format): a path, a glob, or a list of
    them (globs sorted), local or remote (``s3://`` URLs with ``storage_options``, or paths on a
    ``pyarrow.fs`` ``filesystem``; see ``resumable.sources.remote``; read whole, once per process,
    through the ``disk_cache_bytes`` disk cache in ``cache_dir``). Records are dicts."""
    return ArrowSource(
        paths,
        storage_options=storage_options,
        filesystem=filesystem,
        cache_dir=cache_dir,
        block_bytes=block_bytes,
        cache_bytes=cache_bytes,
        disk_cache_bytes=disk_cache_bytes,
    )


def from_hf(dataset: Any) -> HfSource:
    """A source over a map-style Hugging Face ``datasets.Dataset``, read from its memory-mapped
    Arrow table without copying; record ``i`` equals ``dataset[i]``."""
    return HfSource(dataset)
