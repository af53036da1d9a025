"""Line-offset index of a JSONL file: record ``i`` is ``data[starts[i]:starts[i + 1]]``.

A record is a non-blank line. The index is built once with numpy at disk speed and kept in a
sidecar file keyed by the data file's size and mtime, so a source reaches any record with one
seek instead of rescanning the file on every run, and reloading the index costs O(1) (memmap).
Building it also computes a digest of the file's content (it reads every byte anyway), which
lets a file whose mtime changed but whose content did not be recognised as the same file.

A sidecar is never trusted blindly: its header carries a checksum, its size and first and last
offsets must fit the header and the data file, and every block of ``BLOCK_ENTRIES`` offsets has
its own checksum, verified the first time the block is used (so opening stays O(1) however large
the index). A sidecar that fails a check is rebuilt, with a warning. So is one cut short in place
while it is memory-mapped: its size is checked (an ``fstat``) before every read of the map, since
reading a map past the end of its file kills the process (SIGBUS).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import mmap
import operator
import os
import stat
import struct
import warnings
from collections.abc import Callable
from typing import IO, SupportsIndex

import numpy as np
import numpy.typing as npt
import xxhash

from resumable.checkpoint import write_atomically
from resumable.errors import ConfigError, SourceError
from resumable.sources.files import REMEDY, reading

Progress = Callable[[int], None]
"""Called with the number of bytes processed since the previous call (e.g. ``tqdm.update``)."""

CHUNK_SIZE = 4 << 20
"""Bytes read per ``readinto`` while building: big enough to amortise numpy's per-call cost, small
enough for the buffer and its newline mask to stay in cache (4 MiB measured faster than 16-64 MiB)."""
BLANK_STEPS = 16
"""Leading bytes of possibly-blank lines checked by vectorised steps (one byte column per step);
only a line starting with more blank bytes than that is finished on its own (practically never)."""

NEWLINE = 0x0A
UTF8_BOM = b"\xef\xbb\xbf"
BLANK_BYTES = b" \t\r"
"""Bytes a blank line may hold: JSON whitespace, less the newline that ends the line."""
_IS_BLANK_BYTE = np.zeros(256, dtype=np.bool_)
_IS_BLANK_BYTE[list(BLANK_BYTES)] = True
_MAY_START_BLANK = _IS_BLANK_BYTE.copy()
_MAY_START_BLANK[NEWLINE] = True  # an empty line's first byte is its newline

SIDECAR_SUFFIX = ".rsidx"
CACHE_DIR_ENV = "RESUMABLE_CACHE_DIR"
DEFAULT_CACHE_DIR = os.path.join("~", ".cache", "resumable", "index")
CACHE_NAME_CHARS = 80
"""Longest piece of the data file's basename kept in a cache sidecar's name (readability only)."""
CACHE_HASH_CHARS = 16

SIDECAR_MAGIC = b"RSLNIDX\x00"
FORMAT_VERSION = 2
"""Version 2 added the content digest and the per-block checksums; older sidecars are rebuilt."""
FLAG_HAS_BOM = 1
HEADER = struct.Struct("<8sIIQqQQQQ")
"""Sidecar header: magic, format version, flags, data size, data mtime_ns, num_records,
blank_lines, content digest of the data file, checksum of the preceding header bytes."""
HEADER_CHECKSUM_SPAN = HEADER.size - 8
"""Header bytes covered by the header checksum: every field before it."""
OFFSET_DTYPE = np.dtype("<u8")
"""On-disk dtype of ``starts``; equal to ``np.uint64`` on little-endian machines."""
CHECKSUM_DTYPE = np.dtype("<u8")
"""On-disk dtype of the block checksums, stored after ``starts``."""
BLOCK_ENTRIES = 1024
"""Offsets per checksummed block (8 KiB): verifying one costs about a microsecond, so a resume
or a random read pays almost nothing, and the checksums add 0.1% to the sidecar."""
CONTENT_DIGEST = "jsonl-content-xxh3_64"
"""Names the content digest in a fingerprint: XXH3-64 of every byte of the data file."""


def checksum(data: bytes | memoryview) -> int:
    """XXH3-64 of a contiguous buffer: the sidecar header, or a block of offsets."""
    return xxhash.xxh3_64_intdigest(data)


class SidecarWarning(UserWarning):
    """A sidecar could not be used: none was writable (the index lives in memory and is rebuilt
    next time), or one was corrupt (it was rebuilt)."""


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
        mapping: mmap.mmap | None = None,
    ) -> None:
        self.path = path
        self.size = size
        self.mtime_ns = mtime_ns
        self.num_records = len(starts) - 1
        self.blank_lines = blank_lines
        self.has_bom = has_bom
        self.content = content
        self.sidecar = sidecar
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
        sidecars = (path + SIDECAR_SUFFIX, _cache_sidecar(path, cache_dir))
        for sidecar in sidecars:
            loaded = cls._load(path, sidecar, info.st_size, info.st_mtime_ns)
            if loaded is not None:
                return loaded
        built = cls.build(path, progress)
        for sidecar in sidecars:
            try:
                built._use(*_write_sidecar(sidecar, built), None)
            except OSError:
                continue
            built.sidecar = sidecar
            return built
        warnings.warn(
            f"cannot write a line index for {path!r} next to it nor in {os.path.dirname(sidecars[1])!r}; "
            "keeping it in memory (it will be rebuilt next time)",
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
            has_bom = size >= len(UTF8_BOM) and data.read(len(UTF8_BOM)) == UTF8_BOM
            position = len(UTF8_BOM) if has_bom else 0
            if has_bom:
                content.update(UTF8_BOM)
            data.seek(position)
            buffer = bytearray(chunk)
            view = memoryview(buffer)
            array = np.frombuffer(buffer, dtype=np.uint8)
            is_newline = np.empty(chunk, dtype=np.bool_)
            scanner = _Scanner(position)
            reported = 0
            while position < size:
                n = data.readinto(view[: min(chunk, size - position)])
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
        mapping: mmap.mmap | None,
        block_checksums: npt.NDArray[np.uint64] | None,
    ) -> None:
        """Read offsets from ``starts``, each block verified against ``block_checksums`` before
        its first use; None: every block is trusted (an index built by this process).
        ``mapping`` is the sidecar's memory map that ``starts`` views, None when in memory."""
        self.starts = starts
        self._mapping = mapping
        self._block_checksums = block_checksums
        self._block_entries = BLOCK_ENTRIES
        blocks = 0 if block_checksums is None else len(block_checksums)
        self._verified = np.zeros(blocks, dtype=np.bool_)
        self._unverified = blocks

    def _verify(self, block: int) -> None:
        """Check block ``block`` against its checksum, once; rebuild the index if it fails."""
        checksums = self._block_checksums
        if checksums is None or self._verified[block]:
            return
        entries = self._block_entries
        if checksum(self.starts[block * entries : (block + 1) * entries].data) != int(checksums[block]):
            self._rebuild(f"block {block} of its offsets fails its checksum")
            return
        self._verified[block] = True
        self._unverified -= 1

    def _check_mapping(self, mapping: mmap.mmap) -> None:
        """Rebuild the index if its sidecar changed size in place while memory-mapped: reading a
        map past the end of its file kills the process (SIGBUS). ``mmap.size`` is an ``fstat``."""
        size = mapping.size()
        if size != len(mapping):
            self._rebuild(f"its size went from {len(mapping)} to {size} bytes while in use")

    def _rebuild(self, reason: str) -> None:
        """Replace a corrupt sidecar's offsets by a fresh build of the same data file."""
        _warn_corrupt(self.sidecar, self.path, reason)
        built = LineIndex.build(self.path)
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
                built._use(*_write_sidecar(self.sidecar, built), None)
        self._use(built.starts, built._mapping, None)

    def line_number(self, record: SupportsIndex) -> int:
        """The 1-based line of ``record`` in the file, for error messages (reads up to the record)."""
        index = operator.index(record)
        if not 0 <= index < self.num_records:
            raise IndexError(f"record {index} out of range: {self.path!r} has {self.num_records} records")
        remaining = int(self.offsets(index, index + 1)[0])
        newlines = 0
        with reading(f"cannot read data file {self.path!r}"), open(self.path, "rb") as data:
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
        except _CorruptSidecar as corrupt:
            _warn_corrupt(sidecar, path, str(corrupt))
        except (OSError, ValueError):
            pass
        return None

    @classmethod
    def _read_sidecar(cls, path: str, sidecar: str, size: int, mtime_ns: int) -> LineIndex | None:
        """``_load`` without the fallbacks: None when stale or of another format version,
        ``_CorruptSidecar`` when a check fails."""
        with open(sidecar, "rb") as stored:
            header = stored.read(HEADER.size)
            stored_size = os.fstat(stored.fileno()).st_size
            version = header[len(SIDECAR_MAGIC) : len(SIDECAR_MAGIC) + 4]
            if len(version) < 4 or header[: len(SIDECAR_MAGIC)] != SIDECAR_MAGIC:
                raise _CorruptSidecar("no line index header")
            if int.from_bytes(version, "little") != FORMAT_VERSION:
                return None
            if len(header) != HEADER.size or checksum(header[:HEADER_CHECKSUM_SPAN]) != HEADER.unpack(header)[-1]:
                raise _CorruptSidecar("its header fails its checksum")
            _, _, flags, key_size, key_mtime, num_records, blank_lines, content, _ = HEADER.unpack(header)
            if (key_size, key_mtime) != (size, mtime_ns):
                return None
            entries = num_records + 1
            blocks = -(-entries // BLOCK_ENTRIES)
            expected = HEADER.size + OFFSET_DTYPE.itemsize * entries + CHECKSUM_DTYPE.itemsize * blocks
            if flags & ~FLAG_HAS_BOM or stored_size != expected:
                raise _CorruptSidecar(f"{stored_size} bytes where its header implies {expected}")
            body, mapping = _map_body(stored, entries + blocks)
            starts, block_checksums = body[:entries], body[entries:].view(CHECKSUM_DTYPE)  # one memory map
        has_bom = bool(flags & FLAG_HAS_BOM)
        first_allowed = len(UTF8_BOM) if has_bom else 0
        if int(starts[-1]) != size or not first_allowed <= int(starts[0]) <= size:
            raise _CorruptSidecar("its first or last offset lies outside the data file")
        return cls(
            path=path,
            size=size,
            mtime_ns=mtime_ns,
            blank_lines=blank_lines,
            has_bom=has_bom,
            content=content,
            starts=starts,
            sidecar=sidecar,
            block_checksums=block_checksums,
            mapping=mapping,
        )


class _CorruptSidecar(Exception):
    """A sidecar failed a check; the message says which."""


def content_digest(path: str, cache_dir: str | None = None) -> str:
    """The content digest of the JSONL file at ``path``, from its line index (built if stale)."""
    return LineIndex.open(path, cache_dir=cache_dir).content_digest


def content_digest_in(cache_dir: str | None) -> Callable[[str], str]:
    """``content_digest`` with sidecars falling back to ``cache_dir`` (picklable)."""
    return functools.partial(content_digest, cache_dir=cache_dir)


def _warn_corrupt(sidecar: str | None, path: str, reason: str) -> None:
    """Say that the line index ``sidecar`` of ``path`` is corrupt and will be rebuilt."""
    warnings.warn(f"line index {sidecar!r} of {path!r} is corrupt ({reason}); rebuilding it", SidecarWarning, 4)


class _Scanner:
    """Turns consecutive chunks of a file into record starts, carrying the unfinished line over."""

    def __init__(self, first_byte: int) -> None:
        self.line_start = first_byte  # absolute offset of the line not yet ended by a newline
        self.line_blank = True  # whether every byte of that line seen so far is blank
        self.blank_lines = 0
        self._parts: list[npt.NDArray[np.int64]] = []

    def feed(self, chunk: npt.NDArray[np.uint8], is_newline: npt.NDArray[np.bool_], offset: int) -> None:
        """Scan ``chunk``, the file's bytes at ``offset``; ``is_newline`` is scratch space as long."""
        mask = is_newline[: chunk.size]
        np.equal(chunk, NEWLINE, out=mask)
        newlines = np.flatnonzero(mask)
        if newlines.size == 0:
            self.line_blank = self.line_blank and _all_blank(chunk)
            return
        carried_is_record = not (self.line_blank and _all_blank(chunk[: newlines[0]]))
        starts = newlines[:-1] + 1  # lines that begin and end in this chunk
        blank = _blank_lines(chunk, starts, newlines[1:])
        records = np.delete(starts, blank) if blank.size else starts
        records += offset
        if carried_is_record:
            records = np.concatenate(([self.line_start], records))
        self._parts.append(records)
        self.blank_lines += blank.size + (not carried_is_record)
        tail = int(newlines[-1]) + 1
        self.line_start = offset + tail
        self.line_blank = _all_blank(chunk[tail:])

    def finish(self, size: int) -> npt.NDArray[np.uint64]:
        """The ``starts`` array, once the whole file (``size`` bytes) has been fed."""
        if self.line_start < size:  # a last line without a newline
            if self.line_blank:
                self.blank_lines += 1
            else:
                self._parts.append(np.array([self.line_start], dtype=np.int64))
        self._parts.append(np.array([size], dtype=np.int64))
        return np.concatenate(self._parts).view(np.uint64)  # offsets are never negative


def _all_blank(line: npt.NDArray[np.uint8]) -> bool:
    """Whether every byte is a blank byte; looks at the first byte alone in the common case."""
    return line.size == 0 or (bool(_IS_BLANK_BYTE[line[0]]) and bool(_IS_BLANK_BYTE[line].all()))


def _blank_lines(
    chunk: npt.NDArray[np.uint8], starts: npt.NDArray[np.int64], ends: npt.NDArray[np.int64]
) -> npt.NDArray[np.int64]:
    """Indices of the blank lines among those at ``starts`` (each ended by the newline at ``ends``).

    Only lines whose first byte is blank or the newline can be blank; of those, the ones shorter
    than two bytes are. The rest are followed one byte column per vectorised step until they reach
    their newline (blank) or a non-blank byte (a record); the rare lines still undecided after
    ``BLANK_STEPS`` bytes are finished one by one.
    """
    live = np.flatnonzero(_MAY_START_BLANK[chunk[starts]])
    if live.size == 0:
        return live
    position = starts[live]
    short = ends[live] - position < 2
    found = [live[short]]
    live, position = live[~short], position[~short] + 1
    for _ in range(BLANK_STEPS):
        if live.size == 0:
            return np.concatenate(found)
        byte = chunk[position]
        found.append(live[byte == NEWLINE])
        going = _IS_BLANK_BYTE[byte]
        live, position = live[going], position[going] + 1
    undecided = zip(live.tolist(), position.tolist(), ends[live].tolist(), strict=True)
    found.append(np.array([line for line, begin, end in undecided if _all_blank(chunk[begin:end])], dtype=np.int64))
    return np.concatenate(found)


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


def _cache_sidecar(path: str, cache_dir: str | None) -> str:
    """The sidecar path in the cache dir: basename (for people) plus a hash of the absolute path."""
    root = os.path.expanduser(cache_dir or os.environ.get(CACHE_DIR_ENV) or DEFAULT_CACHE_DIR)
    absolute = os.path.realpath(path)
    digest = hashlib.sha256(os.fsencode(absolute)).hexdigest()[:CACHE_HASH_CHARS]
    name = os.path.basename(absolute)[:CACHE_NAME_CHARS]
    return os.path.join(root, f"{name}.{digest}{SIDECAR_SUFFIX}")


def _pack_header(index: LineIndex) -> bytes:
    """The sidecar header of ``index``, checksum included."""
    flags = FLAG_HAS_BOM if index.has_bom else 0
    fields = (
        SIDECAR_MAGIC,
        FORMAT_VERSION,
        flags,
        index.size,
        index.mtime_ns,
        index.num_records,
        index.blank_lines,
        index.content,
    )
    unsigned = HEADER.pack(*fields, 0)
    return HEADER.pack(*fields, checksum(unsigned[:HEADER_CHECKSUM_SPAN]))


def _block_checksums(starts: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """The checksum of every block of ``BLOCK_ENTRIES`` offsets (the last one may be shorter)."""
    return np.array(
        [checksum(starts[first : first + BLOCK_ENTRIES].data) for first in range(0, len(starts), BLOCK_ENTRIES)],
        dtype=CHECKSUM_DTYPE,
    )


def _map_body(stored: IO[bytes], count: int) -> tuple[npt.NDArray[np.uint64], mmap.mmap]:
    """The ``count`` values after the header of the open sidecar ``stored`` (offsets, then
    checksums), read-only through a memory map, and the map: kept so that its file's size can be
    checked (``mmap.size`` is an ``fstat``) before each read."""
    mapping = mmap.mmap(stored.fileno(), 0, access=mmap.ACCESS_READ)
    return np.frombuffer(mapping, dtype=OFFSET_DTYPE, count=count, offset=HEADER.size), mapping


def _write_sidecar(sidecar: str, index: LineIndex) -> tuple[npt.NDArray[np.uint64], mmap.mmap]:
    """Store ``index`` at ``sidecar`` atomically (``write_atomically``: a temporary, fsync, rename,
    and a killed build's temporary removed by the next one); return its offsets, memory-mapped,
    and the map.

    Concurrent writers each rename a complete file, so readers never see a partial one.
    """
    starts = np.ascontiguousarray(index.starts, dtype=OFFSET_DTYPE)

    def write(stored: IO[bytes]) -> None:
        stored.write(_pack_header(index))
        stored.write(starts.view(np.uint8).data)
        stored.write(_block_checksums(starts).view(np.uint8).data)

    write_atomically(sidecar, write)
    with open(sidecar, "rb") as stored:
        return _map_body(stored, len(starts))
