"""Line-offset index of a JSONL file: record ``i`` is ``data[starts[i]:starts[i + 1]]``.

A record is a non-blank line. The index is built once with numpy at disk speed and kept in a
sidecar file keyed by the data file's size and mtime, so a source reaches any record with one
seek instead of rescanning the file on every run, and reloading the index costs O(1) (memmap).
Building it also computes a digest of the file's content (it reads every byte anyway), which
lets a file whose mtime changed but whose content did not be recognised as the same file.

A sidecar (its format: ``resumable.sources._sidecar``) is never trusted blindly: it is checked
when loaded, and every block of its offsets is verified the first time it is used (so opening
stays O(1) however large the index). A sidecar that fails a check is rebuilt, with a warning.
So is one cut short in place while it is memory-mapped: its size is checked (an ``os.stat``;
the map holds no descriptor, so a thousand indices do not use up the process's) before every
read of the map, since reading a map past the end of its file kills the process
(SIGBUS). The scan that builds an index is in ``resumable.sources._line_scan``.
"""

from __future__ import annotations

import contextlib
import functools
import io
import operator
import os
import stat
import warnings
from collections.abc import Callable, Iterator
from typing import SupportsIndex

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import xxhash

from resumable._file_locks import held
from resumable.errors import ConfigError, SidecarWarning, SourceError
from resumable.sources import _sidecar
from resumable.sources._line_scan import UTF8_BOM, Scanner
from resumable.sources._sidecar import SIDECAR_SUFFIX
from resumable.sources.blocks import fetch_pool
from resumable.sources.files import REMEDY, reading
from resumable.sources.open_files import MappedFile
from resumable.sources.remote import Head, ObjectInfo, Remote

Progress = Callable[[int], None]
"""Called with the number of bytes processed since the previous call (e.g. ``tqdm.update``)."""

CHUNK_SIZE = 4 << 20
"""Bytes read per ``readinto`` while building: big enough to amortise numpy's per-call cost, small
enough for the buffer and its newline mask to stay in cache (4 MiB measured faster than 16-64 MiB)."""
CONTENT_DIGEST = "jsonl-content-xxh3_64"
"""Names the content digest in a fingerprint: XXH3-64 of every byte of the data file."""


class LineIndex:
    """Byte offsets of the records of a JSONL file, with the facts the index was keyed on.

    ``starts`` has ``num_records + 1`` entries; record ``i`` is ``data[starts[i]:starts[i+1]]``,
    which includes its newline and any blank lines after it (JSON whitespace), and the last
    entry is the file size. Blank lines before the first record and a UTF-8 BOM are skipped.
    Readers go through ``offsets`` and ``spans``, which verify a loaded sidecar's blocks.
    """

    def __init__(
        self,
        *,
        path: str,
        size: int,
        mtime_ns: int,
        blank_lines: int,
        has_bom: bool,
        content: int,
        starts: npt.NDArray[np.uint64],
        sidecar: str | None,
        block_checksums: npt.NDArray[np.uint64] | None = None,
        mapping: MappedFile | None = None,
    ) -> None:
        self.path = path
        self.size = size
        self.mtime_ns = mtime_ns
        self.num_records = len(starts) - 1
        self.blank_lines = blank_lines
        self.has_bom = has_bom
        self.content = content
        self.sidecar = sidecar
        self.remote: Remote | None = None
        """The filesystem of a remote data file (``path`` is then its URL), else None."""
        self._use(starts, mapping, block_checksums)

    def __len__(self) -> int:
        return self.num_records

    def __repr__(self) -> str:
        return (
            f"LineIndex(path={self.path!r}, num_records={self.num_records}, "
            f"blank_lines={self.blank_lines}, has_bom={self.has_bom}, sidecar={self.sidecar!r})"
        )

    @property
    def mapped(self) -> bool:
        """Whether the offsets are read through a memory map of the sidecar (else from memory)."""
        return self._mapping is not None

    @property
    def content_digest(self) -> str:
        """The data file's content digest as a fingerprint holds it."""
        return f"{CONTENT_DIGEST}:{self.content:016x}"

    @classmethod
    def open(cls, path: str, cache_dir: str | None = None, progress: Progress | None = None) -> LineIndex:
        """Load a fresh sidecar (next to the data, else in the cache dir), else build and store one.

        The sidecar goes next to the data when that directory is writable, else to ``cache_dir``,
        ``$RESUMABLE_CACHE_DIR`` or ``~/.cache/resumable/index/``; when neither is writable the
        index stays in memory and a ``SidecarWarning`` says so.
        """
        path = os.fspath(path)
        info = _stat_data(path)
        if info.st_size:  # a sidecar an earlier version wrote over a compressed file is no reason to read it
            with _open_data(path) as data, reading(f"cannot read data file {path!r}"):
                _refuse_compressed(path, data.read(max(map(len, COMPRESSED))))
        sidecars = (path + SIDECAR_SUFFIX, _sidecar.cache_path(path, cache_dir))
        for sidecar in sidecars:
            loaded = cls._load(path, sidecar, info.st_size, info.st_mtime_ns)
            if loaded is not None:
                return loaded
        built = cls.build(path, progress)
        for sidecar in sidecars:
            try:
                built._use(*_sidecar.write(sidecar, built), None)
            except OSError:
                continue
            built.sidecar = sidecar
            return built
        fallback = os.path.dirname(sidecars[1])
        if fallback not in _WARNED_UNWRITABLE:  # once per directory: not once per file of a thousand shards
            _WARNED_UNWRITABLE.add(fallback)
            warnings.warn(
                f"cannot write a line index for {path!r} next to it nor in {fallback!r}; keeping it in memory "
                "(it will be rebuilt next time; said once per process for the other files that cannot either)",
                SidecarWarning,
                stacklevel=2,
            )
        return built

    @classmethod
    def build(cls, path: str, progress: Progress | None = None, *, chunk_size: int | None = None) -> LineIndex:
        """Scan the file and return its index, in memory only (``sidecar`` is None).

        Reads ``chunk_size`` bytes at a time (default ``CHUNK_SIZE``) into one reused buffer;
        raises ``SourceError`` when the file is missing, unreadable or changes during the scan.
        """
        path = os.fspath(path)
        chunk = CHUNK_SIZE if chunk_size is None else chunk_size
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ConfigError(f"chunk_size must be a positive int, got {chunk_size!r}")
        content = xxhash.xxh3_64()
        with _open_data(path) as data, reading(f"cannot read data file {path!r}"):
            before = os.fstat(data.fileno())
            _check_regular(path, before)
            size = before.st_size
            head = data.read(max(map(len, COMPRESSED)))
            _refuse_compressed(path, head)
            has_bom = head.startswith(UTF8_BOM)
            position = len(UTF8_BOM) if has_bom else 0
            if has_bom:
                content.update(UTF8_BOM)
            data.seek(position)
            scanner = _scan(data.readinto, path, size, position, chunk, content, progress)
            after = os.fstat(data.fileno())
        if (after.st_size, after.st_mtime_ns) != (size, before.st_mtime_ns):
            raise SourceError(f"data file {path!r} changed while being indexed")
        starts = scanner.finish(size)  # counts a blank last line, so before reading blank_lines
        return cls(
            path=path,
            size=size,
            mtime_ns=before.st_mtime_ns,
            blank_lines=scanner.blank_lines,
            has_bom=has_bom,
            content=content.intdigest(),
            starts=starts,
            sidecar=None,
        )

    @classmethod
    def open_remote(
        cls, remote: Remote, url: str, kind: str, cache_dir: str | None = None, head: Head | None = None
    ) -> LineIndex:
        """The index of the object ``url``: loaded from the cache dir when one is keyed on the
        object's URL, size and version (its ETag), else built by one streamed scan and stored
        there (under a lock, so the processes of a machine build it once; atomic rename).
        ``head``: the object's ``Remote.head``, when the caller has it (saves a request)."""
        info, handle = head or remote.head(url, kind)
        sidecar = _sidecar.remote_cache_path(url, info.version, cache_dir)
        loaded = cls._load(url, sidecar, info.size, info.mtime_ns)
        if loaded is None:
            with held(sidecar + _sidecar.LOCK_SUFFIX):  # the machine's processes build it once
                loaded = cls._load(url, sidecar, info.size, info.mtime_ns)  # built by another process meanwhile
                if loaded is None:
                    loaded = cls.build_remote(remote, url, info, handle, kind)
                    try:
                        loaded._use(*_sidecar.write(sidecar, loaded), None)
                        loaded.sidecar = sidecar
                    except OSError:
                        warnings.warn(
                            f"cannot write the line index of {url!r} to {sidecar!r}; keeping it in memory "
                            "(it will be rebuilt next time)",
                            SidecarWarning,
                            stacklevel=2,
                        )
        loaded.remote = remote
        return loaded

    @classmethod
    def build_remote(cls, remote: Remote, url: str, info: ObjectInfo, handle: pa.NativeFile, kind: str) -> LineIndex:
        """Scan the object ``url`` sequentially, by ranged reads of ``CHUNK_SIZE`` (each retried,
        the next one fetched while this one is scanned)."""
        size = info.size
        content = xxhash.xxh3_64()
        chunks = _read_ahead_chunks(remote, handle, url, size, kind)
        first = next(chunks, b"")
        _refuse_compressed(url, first)
        has_bom = first.startswith(UTF8_BOM)
        position = len(UTF8_BOM) if has_bom else 0
        content.update(first[:position])
        pending = [memoryview(first)[position:]]

        def read_into(view: memoryview) -> int:
            if not pending:
                pending.append(memoryview(next(chunks, b"")))
            piece = pending.pop()
            n = min(len(view), len(piece))
            view[:n] = piece[:n]
            if n < len(piece):
                pending.append(piece[n:])
            return n

        scanner = _scan(read_into, url, size, position, CHUNK_SIZE, content, None)
        starts = scanner.finish(size)  # counts a blank last line, so before reading blank_lines
        index = cls(
            path=url,
            size=size,
            mtime_ns=info.mtime_ns,
            blank_lines=scanner.blank_lines,
            has_bom=has_bom,
            content=content.intdigest(),
            starts=starts,
            sidecar=None,
        )
        index.remote = remote
        return index

    # -- verified reads -------------------------------------------------------------------------

    def offsets(self, first: int, stop: int) -> npt.NDArray[np.uint64]:
        """``starts[first:stop]``, its blocks verified."""
        if self._mapping is not None:
            self._check_mapping(self._mapping)
        if self._unverified and stop > first:
            entries = self._block_entries
            for block in range(first // entries, (stop - 1) // entries + 1):
                self._verify(block)
        return self.starts[first:stop]

    def spans(self, records: npt.NDArray[np.int64]) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]]:
        """``(starts[records], starts[records + 1])``: where each record begins and ends, the
        blocks of both verified."""
        if self._mapping is not None:
            self._check_mapping(self._mapping)
        ends = records + 1
        if self._unverified:
            blocks = np.concatenate((records, ends)) // self._block_entries
            for block in sorted(set(blocks[~self._verified[blocks]].tolist())):
                self._verify(block)
        return self.starts[records], self.starts[ends]

    def _use(
        self,
        starts: npt.NDArray[np.uint64],
        mapping: MappedFile | None,
        block_checksums: npt.NDArray[np.uint64] | None,
    ) -> None:
        """Read offsets from ``starts``, each block verified against ``block_checksums`` before
        its first use; None: every block is trusted (an index built by this process).
        ``mapping`` is the sidecar's memory map that ``starts`` views, None when in memory."""
        self.starts = starts
        self._mapping = mapping
        self._block_checksums = block_checksums
        self._block_entries = _sidecar.BLOCK_ENTRIES
        blocks = 0 if block_checksums is None else len(block_checksums)
        self._verified = np.zeros(blocks, dtype=np.bool_)
        self._unverified = blocks

    def _verify(self, block: int) -> None:
        """Check block ``block`` against its checksum, once; rebuild the index if it fails."""
        checksums = self._block_checksums
        if checksums is None or self._verified[block]:
            return
        entries = self._block_entries
        if _sidecar.checksum(self.starts[block * entries : (block + 1) * entries].data) != int(checksums[block]):
            self._rebuild(f"block {block} of its offsets fails its checksum")
            return
        self._verified[block] = True
        self._unverified -= 1

    def _check_mapping(self, mapping: MappedFile) -> None:
        """Rebuild the index if its sidecar changed size in place while memory-mapped: reading a
        map past the end of its file kills the process (SIGBUS)."""
        size = mapping.cut_to()
        if size is not None:
            self._rebuild(f"its size went from {mapping.buffer.size} to {size} bytes while in use")

    def _rebuild(self, reason: str) -> None:
        """Replace a corrupt sidecar's offsets by a fresh build of the same data file."""
        _sidecar.warn_corrupt(self.sidecar, self.path, reason)
        remote = self.remote
        built = (
            LineIndex.build(self.path)
            if remote is None
            else LineIndex.build_remote(remote, self.path, *remote.head(self.path, "JsonlSource"), "JsonlSource")
        )
        if (built.size, built.mtime_ns, built.num_records, built.content) != (
            self.size,
            self.mtime_ns,
            self.num_records,
            self.content,
        ):
            raise SourceError(
                f"data file {self.path!r} changed during the run (found while rebuilding its corrupt line index); "
                f"{REMEDY}"
            )
        if self.sidecar is not None:
            with contextlib.suppress(OSError):
                built._use(*_sidecar.write(self.sidecar, built), None)
        self._use(built.starts, built._mapping, None)

    def line_number(self, record: SupportsIndex) -> int:
        """The 1-based line of ``record`` in the file, for error messages (reads up to the record)."""
        index = operator.index(record)
        if not 0 <= index < self.num_records:
            raise IndexError(f"record {index} out of range: {self.path!r} has {self.num_records} records")
        remaining = int(self.offsets(index, index + 1)[0])
        newlines = 0
        remote = self.remote
        opened = open(self.path, "rb") if remote is None else remote.open_stream(self.path, "JsonlSource")
        with reading(f"cannot read data file {self.path!r}"), opened as data:
            while remaining > 0:
                block = data.read(min(CHUNK_SIZE, remaining))
                if not block:
                    break
                newlines += block.count(b"\n")
                remaining -= len(block)
        return newlines + 1

    @classmethod
    def _load(cls, path: str, sidecar: str, size: int, mtime_ns: int) -> LineIndex | None:
        """The index stored in ``sidecar`` if it is intact and keyed on (size, mtime_ns), else None.

        A missing, stale (other size or mtime) or older-format sidecar is silently replaced;
        one that fails a check is replaced with a ``SidecarWarning``."""
        try:
            return cls._read_sidecar(path, sidecar, size, mtime_ns)
        except _sidecar.CorruptSidecar as corrupt:
            _sidecar.warn_corrupt(sidecar, path, str(corrupt))
        except (OSError, ValueError):
            pass
        return None

    @classmethod
    def _read_sidecar(cls, path: str, sidecar: str, size: int, mtime_ns: int) -> LineIndex | None:
        """``_load`` without the fallbacks: None when stale or of another format version,
        ``CorruptSidecar`` when a check fails."""
        stored = _sidecar.read(sidecar, size, mtime_ns)
        if stored is None:
            return None
        return cls(
            path=path,
            size=size,
            mtime_ns=mtime_ns,
            blank_lines=stored.blank_lines,
            has_bom=stored.has_bom,
            content=stored.content,
            starts=stored.starts,
            sidecar=sidecar,
            block_checksums=stored.block_checksums,
            mapping=stored.mapping,
        )


def content_digest(path: str, cache_dir: str | None = None) -> str:
    """The content digest of the JSONL file at ``path``, from its line index (built if stale)."""
    return LineIndex.open(path, cache_dir=cache_dir).content_digest


def content_digest_in(cache_dir: str | None) -> Callable[[str], str]:
    """``content_digest`` with sidecars falling back to ``cache_dir`` (picklable)."""
    return functools.partial(content_digest, cache_dir=cache_dir)


def _read_ahead_chunks(remote: Remote, handle: pa.NativeFile, url: str, size: int, kind: str) -> Iterator[bytes]:
    """The object's bytes in ``CHUNK_SIZE`` ranged reads, each started while the previous one is
    consumed (a thread of the fetch pool), so scanning overlaps the network."""
    if size == 0:  # an empty object: no reads (its index is empty, as a local empty file's)
        return
    pool = fetch_pool()
    offsets = range(0, size, CHUNK_SIZE)
    ahead = [
        pool.submit(remote.read_at, handle, url, offset, min(CHUNK_SIZE, size - offset), kind) for offset in offsets[:1]
    ]
    for next_offset in [*offsets[1:], None]:
        if next_offset is not None:
            ahead.append(
                pool.submit(remote.read_at, handle, url, next_offset, min(CHUNK_SIZE, size - next_offset), kind)
            )
        yield ahead.pop(0).result()


def remote_content_digest(remote: Remote, kind: str, cache_dir: str | None, url: str) -> str:
    """The content digest of the JSONL object ``url``, from its cached line index (built if stale)."""
    return LineIndex.open_remote(remote, url, kind, cache_dir).content_digest


_WARNED_UNWRITABLE: set[str] = set()
"""The cache directories this process has warned it could not write line indices into."""

COMPRESSED = {b"\x1f\x8b": "gzip", b"\x28\xb5\x2f\xfd": "zstd"}
"""The magic bytes that begin compressed files, which have no line offsets to index (a JSON
line never begins with these bytes)."""


def _refuse_compressed(path: str, head: bytes) -> None:
    """SourceError if the data file that begins with ``head`` is compressed: indexed, its bytes
    would be read as lines, each one a malformed record (or, with ``on_error="skip"``, the file
    silently skipped)."""
    for magic, name in COMPRESSED.items():
        if head.startswith(magic):
            remedy = "read it with rs.jsonl_stream" if name == "gzip" else "decompress it first"
            raise SourceError(f"data file {path!r} is {name}-compressed and cannot be indexed; {remedy}")


def _scan(
    read_into: Callable[[memoryview], int | None],
    path: str,
    size: int,
    position: int,
    chunk: int,
    content: xxhash.xxh3_64,
    progress: Progress | None,
    scanner: Scanner | None = None,
) -> Scanner:
    """Feed the data file's bytes from ``position`` to ``size`` to a ``Scanner`` (a new one
    unless given) and to ``content``, ``chunk`` bytes per ``read_into`` into one reused buffer."""
    buffer = bytearray(chunk)
    view = memoryview(buffer)
    array = np.frombuffer(buffer, dtype=np.uint8)
    is_newline = np.empty(chunk, dtype=np.bool_)
    scanner = Scanner(position) if scanner is None else scanner
    reported = 0
    while position < size:
        n = read_into(view[: min(chunk, size - position)])
        if not n:
            raise SourceError(f"data file {path!r} shrank while being indexed")
        scanner.feed(array[:n], is_newline, position)
        content.update(view[:n])
        position += n
        if progress is not None:
            progress(position - reported)
            reported = position
    if progress is not None and position > reported:
        progress(position - reported)
    return scanner


def _check_regular(path: str, info: os.stat_result) -> None:
    """Raise ``SourceError`` unless ``path`` is a regular file (not a directory, pipe, device)."""
    if not stat.S_ISREG(info.st_mode):
        raise SourceError(f"data file {path!r} is not a regular file")


def _stat_data(path: str) -> os.stat_result:
    """The data file's stat, or ``SourceError`` naming the path."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise SourceError(f"data file not found: {path!r}") from None
    except OSError as error:
        raise SourceError(f"cannot stat data file {path!r}: {error}") from error
    _check_regular(path, info)
    return info


def _open_data(path: str) -> io.FileIO:
    """The data file opened unbuffered for ``readinto``, or ``SourceError`` naming the path."""
    try:
        return open(path, "rb", buffering=0)
    except OSError as error:
        _stat_data(path)  # names the usual causes: missing, a directory
        raise SourceError(f"cannot read data file {path!r}: {error}") from error
