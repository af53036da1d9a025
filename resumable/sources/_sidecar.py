"""The sidecar file of a line index: its format, where it lives, and how it is read and written.

A sidecar holds a header (magic, format version, flags, the data file's size and mtime the index
is keyed on, counts, the data's content digest and a checksum of the header), the offsets
(``starts``) and a checksum of every block of ``BLOCK_ENTRIES`` offsets. It is never trusted
blindly: ``read`` checks the header's checksum, that the file's size fits the header and that
the first and last offsets fit the data file; ``resumable.sources.line_index.LineIndex`` checks
each block the first time it is used. Writes are atomic, so readers never see a partial file.
"""

from __future__ import annotations

import hashlib
import os
import struct
import warnings
from typing import IO, TYPE_CHECKING, NamedTuple

import numpy as np
import numpy.typing as npt
import xxhash

from resumable.checkpoint import write_atomically
from resumable.errors import SidecarWarning
from resumable.sources._line_scan import UTF8_BOM
from resumable.sources.open_files import MappedFile

if TYPE_CHECKING:
    from resumable.sources.line_index import LineIndex

SIDECAR_SUFFIX = ".rsidx"
LOCK_SUFFIX = ".lock"
"""Suffix of the lock file beside a remote object's sidecar while it is built."""
CACHE_DIR_ENV = "RESUMABLE_CACHE_DIR"
DEFAULT_CACHE_DIR = os.path.join("~", ".cache", "resumable", "index")
CACHE_NAME_BYTES = 80
"""Longest piece (in bytes, whole characters) of the data file's basename kept in a cache
sidecar's name, for readability: with the hash and suffixes, the name stays under the 255 bytes
a file name may have, whatever the script."""
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


def checksum(data: bytes | memoryview) -> int:
    """XXH3-64 of a contiguous buffer: the sidecar header, or a block of offsets."""
    return xxhash.xxh3_64_intdigest(data)


class CorruptSidecar(Exception):
    """A sidecar failed a check; the message says which."""


def warn_corrupt(sidecar: str | None, path: str, reason: str) -> None:
    """Say that the line index ``sidecar`` of ``path`` is corrupt and will be rebuilt."""
    warnings.warn(f"line index {sidecar!r} of {path!r} is corrupt ({reason}); rebuilding it", SidecarWarning, 4)


class Contents(NamedTuple):
    """What an intact sidecar holds besides its key: the offsets and block checksums view one
    read-only memory map of it, kept so that its size can be checked before each read."""

    has_bom: bool
    blank_lines: int
    content: int
    starts: npt.NDArray[np.uint64]
    block_checksums: npt.NDArray[np.uint64]
    mapping: MappedFile


def read(sidecar: str, size: int, mtime_ns: int) -> Contents | None:
    """The index stored in ``sidecar`` if it is keyed on ``(size, mtime_ns)``: None when stale or
    of another format version, ``CorruptSidecar`` when a check fails (``OSError`` or
    ``ValueError`` when it cannot be read at all)."""
    mapping = MappedFile.of(sidecar)  # checked as mapped: a file replaced meanwhile is not read half
    stored_size = mapping.buffer.size
    header = mapping.buffer.slice(0, min(HEADER.size, stored_size)).to_pybytes()
    version = header[len(SIDECAR_MAGIC) : len(SIDECAR_MAGIC) + 4]
    if len(version) < 4 or header[: len(SIDECAR_MAGIC)] != SIDECAR_MAGIC:
        raise CorruptSidecar("no line index header")
    if int.from_bytes(version, "little") != FORMAT_VERSION:
        return None
    if len(header) != HEADER.size or checksum(header[:HEADER_CHECKSUM_SPAN]) != HEADER.unpack(header)[-1]:
        raise CorruptSidecar("its header fails its checksum")
    _, _, flags, key_size, key_mtime, num_records, blank_lines, content, _ = HEADER.unpack(header)
    if (key_size, key_mtime) != (size, mtime_ns):
        return None
    entries = num_records + 1
    blocks = -(-entries // BLOCK_ENTRIES)
    expected = HEADER.size + OFFSET_DTYPE.itemsize * entries + CHECKSUM_DTYPE.itemsize * blocks
    if flags & ~FLAG_HAS_BOM or stored_size != expected:
        raise CorruptSidecar(f"{stored_size} bytes where its header implies {expected}")
    body = _body(mapping, entries + blocks)
    starts, block_checksums = body[:entries], body[entries:].view(CHECKSUM_DTYPE)  # one memory map
    has_bom = bool(flags & FLAG_HAS_BOM)
    first_allowed = len(UTF8_BOM) if has_bom else 0
    if int(starts[-1]) != size or not first_allowed <= int(starts[0]) <= size:
        raise CorruptSidecar("its first or last offset lies outside the data file")
    return Contents(has_bom, blank_lines, content, starts, block_checksums, mapping)


def cache_path(path: str, cache_dir: str | None) -> str:
    """The sidecar path in the cache dir: basename (for people) plus a hash of the absolute path."""
    root = os.path.expanduser(cache_dir or os.environ.get(CACHE_DIR_ENV) or DEFAULT_CACHE_DIR)
    absolute = os.path.realpath(path)
    digest = hashlib.sha256(os.fsencode(absolute)).hexdigest()[:CACHE_HASH_CHARS]
    return os.path.join(root, f"{_readable(os.path.basename(absolute))}.{digest}{SIDECAR_SUFFIX}")


def remote_cache_path(url: str, edge_digest: str, cache_dir: str | None) -> str:
    """The sidecar path of a remote object in the cache dir: its basename plus a hash of the URL
    and the object's edge digest, so a replaced object gets a sidecar of its own."""
    root = os.path.expanduser(cache_dir or os.environ.get(CACHE_DIR_ENV) or DEFAULT_CACHE_DIR)
    digest = hashlib.sha256(f"{url}\0{edge_digest}".encode()).hexdigest()[:CACHE_HASH_CHARS]
    return os.path.join(root, f"{_readable(url.rstrip('/').rpartition('/')[2])}.{digest}{SIDECAR_SUFFIX}")


def _readable(name: str) -> str:
    """The first ``CACHE_NAME_BYTES`` bytes of ``name``, cut at a character boundary."""
    return os.fsencode(name)[:CACHE_NAME_BYTES].decode("utf-8", "ignore")


def pack_header(index: LineIndex) -> bytes:
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


def block_checksums(starts: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """The checksum of every block of ``BLOCK_ENTRIES`` offsets (the last one may be shorter)."""
    return np.array(
        [checksum(starts[first : first + BLOCK_ENTRIES].data) for first in range(0, len(starts), BLOCK_ENTRIES)],
        dtype=CHECKSUM_DTYPE,
    )


def _body(mapping: MappedFile, count: int) -> npt.NDArray[np.uint64]:
    """The ``count`` values after the header of a mapped sidecar (offsets, then checksums)."""
    return np.frombuffer(mapping.buffer, dtype=OFFSET_DTYPE, count=count, offset=HEADER.size)


def write(sidecar: str, index: LineIndex) -> tuple[npt.NDArray[np.uint64], MappedFile]:
    """Store ``index`` at ``sidecar`` atomically (``write_atomically``: a temporary, fsync, rename,
    and a killed build's temporary removed by the next one); return its offsets, memory-mapped,
    and the map.

    Concurrent writers each rename a complete file, so readers never see a partial one.
    """
    starts = np.ascontiguousarray(index.starts, dtype=OFFSET_DTYPE)

    def fill(stored: IO[bytes]) -> None:
        stored.write(pack_header(index))
        stored.write(starts.view(np.uint8).data)
        stored.write(block_checksums(starts).view(np.uint8).data)

    write_atomically(sidecar, fill)
    mapping = MappedFile.of(sidecar)
    return _body(mapping, len(starts)), mapping
