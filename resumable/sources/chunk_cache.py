"""Local chunk cache: blocks of remote objects on local disk, shared by every process of the
machine (ranks, DataLoader workers, later jobs), bounded in bytes and safe against SIGKILL.

Layout::

    <directory>/.sweep.lock                         held (flock) by the process sweeping
    <directory>/<key>/<block>                       a block's bytes, then a trailer
    <directory>/<key>/.<block>.<pid>.<random>.tmp   a write in progress, or left by a killed one

``key`` is a hex string the caller derives from what identifies an object's bytes (URL, size,
ETag, block size), ``block`` a block number. The trailer holds the data's length, its XXH3-64
digest and a format tag; ``get`` checks all three, so a damaged or truncated file is unlinked
and answered as a miss (counted in ``stats["damaged"]``).

Crash safety: a block is written to a temp file of a unique name in its key's folder and renamed
over its final name (``os.replace``), so a reader finds no file, an old whole one or the new
whole one. A process killed mid-write leaves only a temp file, removed by a later sweep once it
is older than ``TEMP_MAX_AGE_S``. Nothing is fsynced: a file garbled by a power loss fails its
digest and is dropped like any damaged one.

Sharing: a file unlinked by another process's sweep while this one reads it is read whole (the
open inode lives on) or not found (a miss). Two processes that write the same block write the
same bytes, each through its own temp file, and both succeed; the last rename wins.

Bound: each process counts the bytes it wrote since its last sweep; the first ``put`` of a
process and then every ``SWEEP_FRACTION * max_bytes`` bytes it writes, it sweeps: under a
non-blocking ``flock`` of ``.sweep.lock`` (a process that finds it taken skips and tries again at
its next ``put``), it scans the sizes and mtimes of all block files and deletes the least
recently used (oldest mtime; a hit touches its file) until at most ``SWEEP_TARGET * max_bytes``
remain. Between two sweeps each writing process adds at most ``SWEEP_FRACTION * max_bytes`` plus
one block, so the bytes on disk stay under about ``max_bytes * (SWEEP_TARGET + P * SWEEP_FRACTION)``
for ``P`` processes writing at once: within ``max_bytes`` for up to two, overshooting it by up to
one sweep fraction for each further writer. A process that runs with a smaller ``max_bytes``
than the others trims the shared directory to its own bound.
"""

from __future__ import annotations

import os
import re
import secrets
import struct
import threading
import time
import warnings
from typing import NamedTuple

import xxhash

from resumable._file_locks import close_lock, lock, open_for_lock
from resumable.core.options import is_int
from resumable.errors import ChunkCacheWarning, ConfigError

SWEEP_FRACTION = 0.05
"""A process sweeps after writing this fraction of ``max_bytes`` since its last sweep."""
SWEEP_TARGET = 0.9
"""A sweep deletes least recently used blocks until at most this fraction of ``max_bytes`` is left,
so that the writes before the next sweeps fit under ``max_bytes``."""
TEMP_MAX_AGE_S = 300.0
"""A temp file older than this (seconds since its last write) was left by a killed writer: the sweep
removes it. Younger ones may still be written and only count towards the total."""

LOCK_NAME = ".sweep.lock"
TEMP_SUFFIX = ".tmp"
KEY_NAME = re.compile(r"[0-9a-fA-F]{1,128}")
BLOCK_NAME = re.compile(r"[0-9]+")
TEMP_NAME = re.compile(r"\.[0-9]+\.[0-9]+\.[0-9a-f]+" + re.escape(TEMP_SUFFIX))
TRAILER = struct.Struct("<QQ4s")
"""After the data: its length, its XXH3-64 digest, ``FORMAT_TAG``."""
FORMAT_TAG = b"RCC1"
FILE_MODE = 0o666
"""Block files, temp files and the lock are created readable by the machine's other processes
(the umask applies)."""

HITS = "hits"
MISSES = "misses"
DAMAGED = "damaged"
WRITTEN_BYTES = "written_bytes"
EVICTED_BYTES = "evicted_bytes"
SWEEPS = "sweeps"
STATS = (HITS, MISSES, DAMAGED, WRITTEN_BYTES, EVICTED_BYTES, SWEEPS)


class _Entry(NamedTuple):
    """A block file seen by a sweep; sorts oldest first."""

    mtime_ns: int
    path: str
    size: int


class ChunkCache:
    """Blocks of remote objects on local disk, shared by every process of the machine.

    ``max_bytes`` bounds the bytes of all block files under ``directory`` (see the module's
    docstring for how closely). ``stats`` counts this process's hits, misses, damaged files
    dropped, bytes written, bytes evicted by its sweeps and its sweeps. A pickled cache (sent to a
    DataLoader worker) carries only the directory and the bound; its counters start at zero.
    """

    def __init__(self, directory: str | os.PathLike[str], max_bytes: int) -> None:
        if not is_int(max_bytes) or max_bytes <= 0:
            raise ConfigError(
                f"chunk cache {os.fspath(directory)!r}: max_bytes must be a positive int, got {max_bytes!r} "
                "(to read without a disk cache, build none)"
            )
        self.directory = os.fspath(directory)
        self.max_bytes = int(max_bytes)
        self._sweep_every = max(1, int(max_bytes * SWEEP_FRACTION))
        self._lock = threading.Lock()  # counters and the sweep schedule, shared by a process's threads
        self._stats = dict.fromkeys(STATS, 0)
        self._unswept = 0
        self._swept = False
        self._disabled = False

    def __reduce__(self) -> tuple[type[ChunkCache], tuple[str, int]]:
        return ChunkCache, (self.directory, self.max_bytes)

    def __repr__(self) -> str:
        return f"ChunkCache({self.directory!r}, max_bytes={self.max_bytes})"

    @property
    def stats(self) -> dict[str, int]:
        """This process's counters (a copy): hits, misses, damaged, written_bytes, evicted_bytes, sweeps."""
        with self._lock:
            return dict(self._stats)

    def get(self, key: str, block: int) -> bytes | None:
        """The data of ``block`` of the object ``key``, or None when it is not cached (a damaged
        file is unlinked and counted, then also answered None). A hit marks the block as used."""
        path = self._path(key, block)
        data = None if self._disabled else self._read(path)
        with self._lock:
            self._stats[MISSES if data is None else HITS] += 1
        if data is not None:
            now = time.time_ns()
            try:
                os.utime(path, ns=(now, now))
            except OSError:
                pass  # evicted or replaced meanwhile, or not ours to touch: the data read is whole
        return data

    def put(self, key: str, block: int, data: bytes) -> None:
        """Store ``data`` as ``block`` of the object ``key``, then sweep when due. A directory
        that cannot be written turns the disk tier off in this process with one warning."""
        path = self._path(key, block)
        if self._disabled:
            return
        try:
            size = self._write(path, block, data)
            with self._lock:
                self._stats[WRITTEN_BYTES] += size
                self._unswept += size
                due = not self._swept or self._unswept >= self._sweep_every
            if due:
                self._sweep()
        except OSError as error:
            self._disable(error)

    # -- files -------------------------------------------------------------------------------

    def _path(self, key: str, block: int) -> str:
        if not isinstance(key, str) or not KEY_NAME.fullmatch(key):
            raise ConfigError(f"chunk cache {self.directory!r}: key must be 1 to 128 hex digits, got {key!r}")
        if isinstance(block, bool) or not isinstance(block, int) or block < 0:
            raise ConfigError(f"chunk cache {self.directory!r}: block must be an int >= 0, got {block!r}")
        return os.path.join(self.directory, key, str(block))

    def _read(self, path: str) -> bytes | None:
        """The verified data of the block file ``path``; None when it is missing or unreadable.
        A file that fails a check is unlinked and counted as damaged."""
        try:
            with open(path, "rb") as file:
                size = os.fstat(file.fileno()).st_size
                data = file.read(size - TRAILER.size) if size >= TRAILER.size else b""
                tail = file.read()
        except OSError:
            return None  # not cached, evicted meanwhile, or unreadable: a miss either way
        if len(tail) == TRAILER.size:
            length, digest, tag = TRAILER.unpack(tail)
            if tag == FORMAT_TAG and length == len(data) and digest == xxhash.xxh3_64_intdigest(data):
                return data
        try:
            _unlink(path)
        except OSError:
            pass  # not this process's to remove (a read-only cache): still a miss
        with self._lock:
            self._stats[DAMAGED] += 1
        return None

    def _write(self, path: str, block: int, data: bytes) -> int:
        """Write ``data`` and its trailer to a temp file and rename it to ``path``; its size."""
        folder = os.path.dirname(path)
        trailer = TRAILER.pack(len(data), xxhash.xxh3_64_intdigest(data), FORMAT_TAG)
        temp = os.path.join(folder, f".{block}.{os.getpid()}.{secrets.token_hex(4)}{TEMP_SUFFIX}")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        os.makedirs(folder, exist_ok=True)
        try:
            descriptor = os.open(temp, flags, FILE_MODE)
        except FileNotFoundError:  # a sweep removed the folder, empty, in between: make it again
            os.makedirs(folder, exist_ok=True)
            descriptor = os.open(temp, flags, FILE_MODE)
        try:
            with open(descriptor, "wb") as file:
                file.write(data)
                file.write(trailer)
            now = time.time_ns()  # finer than the kernel's file clock, so the LRU order is exact
            os.utime(temp, ns=(now, now))
            os.replace(temp, path)
        except BaseException:
            _unlink(temp)
            raise
        return len(data) + TRAILER.size

    def _disable(self, error: OSError) -> None:
        with self._lock:
            if self._disabled:
                return
            self._disabled = True
        warnings.warn(
            f"chunk cache {self.directory!r} cannot be written ({error}); "
            "this process reads remote blocks without the disk cache",
            ChunkCacheWarning,
            stacklevel=3,
        )

    # -- eviction ----------------------------------------------------------------------------

    def _sweep(self) -> None:
        """Evict least recently used blocks down to ``SWEEP_TARGET * max_bytes`` and remove stale
        temp files, unless another process is sweeping."""
        handle = open_for_lock(os.path.join(self.directory, LOCK_NAME), os.O_RDONLY | os.O_CREAT, FILE_MODE)
        try:
            try:
                lock(handle, wait=False)
            except BlockingIOError:
                return  # another process is sweeping; this one tries again at its next put
            entries, total, freed = self._scan()
            target = int(self.max_bytes * SWEEP_TARGET)
            if total > target:
                for entry in sorted(entries):
                    if total <= target:
                        break
                    if _used_since(entry):
                        continue
                    freed += entry.size if _unlink(entry.path) else 0
                    total -= entry.size
        finally:
            close_lock(handle)  # releases the flock
        with self._lock:
            self._stats[EVICTED_BYTES] += freed
            self._stats[SWEEPS] += 1
            self._unswept = 0
            self._swept = True

    def _scan(self) -> tuple[list[_Entry], int, int]:
        """The block files under the directory, the bytes they and young temp files hold, and the
        bytes of the stale temp files removed. Key folders found empty are removed."""
        stale_before = time.time_ns() - int(TEMP_MAX_AGE_S * 1e9)
        entries: list[_Entry] = []
        total = freed = 0
        with os.scandir(self.directory) as keys:
            for key in keys:
                if not KEY_NAME.fullmatch(key.name) or not key.is_dir(follow_symlinks=False):
                    continue
                seen = 0
                try:
                    with os.scandir(key.path) as files:
                        for file in files:
                            seen += 1
                            try:
                                status = file.stat(follow_symlinks=False)
                            except FileNotFoundError:
                                continue  # evicted or renamed meanwhile
                            if BLOCK_NAME.fullmatch(file.name):
                                entries.append(_Entry(status.st_mtime_ns, file.path, status.st_size))
                                total += status.st_size
                            elif TEMP_NAME.fullmatch(file.name) and status.st_mtime_ns < stale_before:
                                freed += status.st_size if _unlink(file.path) else 0
                            elif TEMP_NAME.fullmatch(file.name):
                                total += status.st_size
                except FileNotFoundError:
                    continue  # removed by another sweep before this one got the lock
                if not seen:
                    _remove_empty(key.path)
        return entries, total, freed


def _used_since(entry: _Entry) -> bool:
    """Whether a block file was read (touched) or written again since the scan saw it."""
    try:
        return os.stat(entry.path).st_mtime_ns != entry.mtime_ns
    except FileNotFoundError:
        return False


def _unlink(path: str) -> bool:
    """Remove ``path``; False when it was already gone."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def _remove_empty(folder: str) -> None:
    """Remove a key folder if it is still empty (a ``put`` that races this makes it again)."""
    try:
        os.rmdir(folder)
    except OSError:
        pass  # filled or removed meanwhile
