"""Remote objects read in aligned blocks, through two cache tiers, with read-ahead.

A source reads byte ranges of an object (JSONL records, Parquet column chunks, a whole Arrow
file) through a ``BlockReader``: the ranges are widened to aligned blocks of ``block_bytes``,
and each missing block is looked up in the memory tier (an LRU of ``cache_bytes`` shared by
the source's objects, per process), then in the disk tier (a ``ChunkCache`` of
``disk_cache_bytes`` shared by every process of the machine), and only then fetched: one
ranged read per run of consecutive missing blocks (at most ``REQUEST_BLOCKS``), never one per
record, the runs of one call fetched in parallel threads.

``read_ahead`` starts fetching, in background threads, blocks a consumer will need next: the
cursor of a pipeline knows the leaf records of its next chunk (the order of an epoch is a pure
function of its position), so it reads exactly those blocks ahead, never a guess. A read that
needs a block already being fetched waits for that fetch instead of issuing its own; a failed
read-ahead is forgotten and the read that needs the block fetches it again (and reports its
error).
"""

from __future__ import annotations

import io
import os
import threading
import weakref
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import xxhash

from resumable._forks import InheritedByForks, Settle, at_fork, inherited
from resumable.core.options import directory_option, int_option
from resumable.errors import ConfigError, SourceError
from resumable.sources import _sidecar
from resumable.sources.chunk_cache import ChunkCache
from resumable.sources.files import REMEDY
from resumable.sources.remote import ObjectInfo, Remote

BLOCK_BYTES = 1 << 20
"""Default bytes per block: records are read in aligned blocks of this size."""
CACHE_BYTES = 32 << 20
"""Default bytes of blocks a source keeps in memory per process (least recently used evicted)."""
DISK_CACHE_BYTES = 4 << 30
"""Default bound of the disk tier shared by the processes of a machine (0 switches it off)."""
CHUNKS_DIR = "chunks"
"""Directory of the disk tier inside ``cache_dir`` (or inside ``~/.cache/resumable``)."""
DEFAULT_CHUNKS_ROOT = os.path.join("~", ".cache", "resumable")
REQUEST_BLOCKS = 16
"""Most consecutive missing blocks fetched by one ranged read."""
FETCH_THREADS = 8
"""Threads per process fetching blocks (reads of one call in parallel, and read-ahead)."""
MAX_RESERVED_BYTES = 256 << 20
"""Most bytes a block shuffle may make the memory tier of a source hold (``Blocks.reserve``)."""
READ_AHEAD_SHARE = 2
"""Read-ahead keeps at most ``1 / READ_AHEAD_SHARE`` of the memory tier in flight, so that the
blocks it fetches are still cached when the consumer reaches them."""


@dataclass(frozen=True)
class BlockOptions:
    """How a source reads its remote objects: block size and the bounds of both cache tiers."""

    block_bytes: int = BLOCK_BYTES
    cache_bytes: int = CACHE_BYTES
    disk_cache_bytes: int = DISK_CACHE_BYTES
    cache_dir: str | None = None

    @classmethod
    def checked(
        cls, kind: str, block_bytes: int, cache_bytes: int, disk_cache_bytes: int, cache_dir: str | None
    ) -> BlockOptions:
        """The options, or a ``ConfigError`` naming the source and the bad value."""
        block_bytes = int_option(kind, "block_bytes", block_bytes)
        cache_bytes = int_option(kind, "cache_bytes", cache_bytes)
        disk_cache_bytes = int_option(kind, "disk_cache_bytes", disk_cache_bytes, least=0)
        if cache_bytes < block_bytes:
            raise ConfigError(f"{kind}: cache_bytes ({cache_bytes}) must hold a block ({block_bytes} bytes)")
        return cls(block_bytes, cache_bytes, disk_cache_bytes, directory_option(kind, "cache_dir", cache_dir))

    @property
    def chunks_dir(self) -> str:
        """Where the disk tier lives: ``<cache_dir>/chunks``, else under ``$RESUMABLE_CACHE_DIR``
        or ``~/.cache/resumable``."""
        root = self.cache_dir or os.environ.get(_sidecar.CACHE_DIR_ENV) or DEFAULT_CHUNKS_ROOT
        return os.path.join(os.path.expanduser(root), CHUNKS_DIR)


class Blocks(InheritedByForks):
    """The blocks of one source's remote objects in this process: the memory tier shared by its
    objects, the disk tier, the fetches in flight, and counters of what was read how. Pickles
    empty (DataLoader workers fill their own)."""

    def __init__(self, options: BlockOptions) -> None:
        self.options = options
        self.capacity = max(1, options.cache_bytes // options.block_bytes)
        self._lock = threading.Lock()
        self._memory: OrderedDict[tuple[str, int], bytes] = OrderedDict()
        self._inflight: dict[tuple[str, int], Future[dict[int, bytes]]] = {}
        self._readers: weakref.WeakSet[BlockReader] = weakref.WeakSet()
        inherited(self)
        self.disk = ChunkCache(options.chunks_dir, options.disk_cache_bytes) if options.disk_cache_bytes else None
        self.requests = 0
        self.bytes_fetched = 0
        self.disk_hits = 0
        self.read_ahead = 0

    @property
    def stats(self) -> dict[str, int]:
        """Ranged reads and bytes fetched from the store, blocks found in the disk tier, blocks
        fetched ahead of the consumer (this process)."""
        return {
            "requests": self.requests,
            "bytes_fetched": self.bytes_fetched,
            "disk_hits": self.disk_hits,
            "read_ahead_blocks": self.read_ahead,
        }

    def reader(
        self, remote: Remote, name: str, info: ObjectInfo, kind: str, handle: pa.NativeFile | None = None
    ) -> BlockReader:
        """A reader of the object ``name`` (``info`` as when the source was built); ``handle``, an
        open file over it, saves the request that opening costs."""
        reader = BlockReader(self, remote, name, info, kind, handle)
        self._readers.add(reader)
        return reader

    def reserve(self, nbytes: int) -> None:
        """Let the memory tier grow to hold ``nbytes`` (at most ``MAX_RESERVED_BYTES``): a block
        shuffle reserves two windows of its reads, so that the blocks of a window, touched by
        several chunks of the cursor, are fetched once."""
        wanted = min(nbytes, MAX_RESERVED_BYTES) // self.options.block_bytes + 1
        self.capacity = max(self.capacity, wanted)

    def _trim(self) -> None:
        """Evict least recently used blocks beyond the capacity (the lock held)."""
        while len(self._memory) > self.capacity:
            self._memory.popitem(last=False)

    def _forget_the_parent(self) -> Settle:
        """In a forked child: no thread of the parent runs here, so its locks may be held for
        ever and its fetches never finish; the parent's open files are not to be shared."""
        self._lock = threading.Lock()
        self._inflight.clear()
        if self.disk is not None:
            self.disk = ChunkCache(self.options.chunks_dir, self.options.disk_cache_bytes)
        for reader in self._readers:
            reader._handle = None
            reader._open_lock = threading.Lock()
        return None

    def __getstate__(self) -> dict[str, Any]:
        return {"options": self.options, "capacity": self.capacity}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["options"])  # type: ignore[misc]
        self.capacity = state["capacity"]


class BlockReader:
    """Byte ranges of one remote object, read in aligned blocks through the tiers of ``Blocks``."""

    def __init__(
        self, blocks: Blocks, remote: Remote, name: str, info: ObjectInfo, kind: str, handle: pa.NativeFile | None
    ) -> None:
        self.blocks = blocks
        self.remote = remote
        self.name = name
        self.size = info.size
        self.kind = kind
        self.width = blocks.options.block_bytes
        identity = f"{name}\0{info.size}\0{info.bytes_key}\0{self.width}"
        self.key = xxhash.xxh3_128_hexdigest(identity.encode())
        self.info = info
        self._handle = handle
        self._open_lock = threading.Lock()

    def ranges(self, starts: np.ndarray, ends: np.ndarray) -> list[bytes]:
        """``object[starts[i]:ends[i]]`` for each ``i`` (non-empty ranges)."""
        width = self.width
        first = starts.astype(np.int64) // width
        last = (ends.astype(np.int64) - 1) // width
        blocks = self._get(self._needed(first, last), wait=True)
        out: list[bytes] = []
        for a, b, f, z in zip(starts.tolist(), ends.tolist(), first.tolist(), last.tolist()):
            if f == z:
                out.append(blocks[f][a - f * width : b - f * width])
            else:
                joined = b"".join(blocks[block] for block in range(f, z + 1))
                out.append(joined[a - f * width : b - f * width])
        return out

    def read(self, offset: int, length: int) -> bytes:
        """``object[offset:offset + length]`` (clipped to the object)."""
        stop = min(offset + length, self.size)
        if stop <= offset:
            return b""
        return self.ranges(np.array([offset], dtype=np.int64), np.array([stop], dtype=np.int64))[0]

    def read_ahead(self, starts: np.ndarray, ends: np.ndarray) -> None:
        """Start fetching, in the background, the blocks of these ranges that are not cached."""
        width = self.width
        first = starts.astype(np.int64) // width
        last = np.maximum(ends.astype(np.int64) - 1, 0) // width
        self._get(self._needed(first, last), wait=False)

    @staticmethod
    def _needed(first: np.ndarray, last: np.ndarray) -> list[int]:
        """The blocks from ``first[i]`` to ``last[i]`` for every ``i``, sorted and unique."""
        wide = np.flatnonzero(last - first > 1)
        inner = [np.arange(first[i] + 1, last[i]) for i in wide.tolist()]
        needed: list[int] = np.unique(np.concatenate([first, last, *inner])).tolist()
        return needed

    def _get(self, needed: list[int], wait: bool) -> dict[int, bytes]:
        """The ``needed`` blocks: from memory, from fetches in flight, else fetched (runs of
        consecutive blocks, in parallel; the first in this thread). Without ``wait``, only start
        the fetches of missing blocks (within the read-ahead budget) and return nothing."""
        tiers = self.blocks
        found: dict[int, bytes] = {}
        waits: list[Future[dict[int, bytes]]] = []
        missing: list[int] = []
        with tiers._lock:
            for block in needed:
                key = (self.key, block)
                data = tiers._memory.get(key)
                if data is not None:
                    tiers._memory.move_to_end(key)
                    found[block] = data
                elif key in tiers._inflight:
                    if tiers._inflight[key] not in waits:
                        waits.append(tiers._inflight[key])
                else:
                    missing.append(block)
            if not wait:
                budget = tiers.capacity // READ_AHEAD_SHARE - len(tiers._inflight)
                missing = missing[: max(0, budget)]
                tiers.read_ahead += len(missing)
            runs = _runs(missing)
            fetches: list[tuple[int, int, Future[dict[int, bytes]]]] = []
            for first, stop in runs:
                future: Future[dict[int, bytes]] = Future()
                for block in range(first, stop):
                    tiers._inflight[(self.key, block)] = future
                fetches.append((first, stop, future))
        pool = fetch_pool()
        inline = fetches[:1] if wait else []
        for first, stop, future in fetches[len(inline) :]:
            pool.submit(self._load, first, stop, future)
        for first, stop, future in inline:
            self._load(first, stop, future)
        if not wait:
            return {}
        for future in [fetch[2] for fetch in fetches] + waits:
            found.update(future.result())
        self._touch_in_order(needed, found)
        return found

    def _touch_in_order(self, needed: list[int], found: dict[int, bytes]) -> None:
        """Make the blocks of a read the most recently used, in file order, whatever order its
        parallel runs finished in: the last blocks of a sequential read, where the next read
        starts, are then the last to be evicted."""
        tiers = self.blocks
        with tiers._lock:
            for block in needed[-tiers.capacity :]:
                tiers._memory[(self.key, block)] = found[block]
                tiers._memory.move_to_end((self.key, block))
            tiers._trim()

    def _load(self, first: int, stop: int, future: Future[dict[int, bytes]]) -> None:
        """Blocks ``first`` up to ``stop``: from the disk tier, the rest by ranged reads (stored
        in the disk tier); all into the memory tier; ``future`` gets them or the error."""
        tiers = self.blocks
        try:
            loaded: dict[int, bytes] = {}
            fetched_blocks: dict[int, bytes] = {}
            if tiers.disk is not None:
                for block in range(first, stop):
                    data = tiers.disk.get(self.key, block)
                    if data is not None:
                        loaded[block] = data
            hits = len(loaded)
            fetched = requests = 0
            for a, b in _runs([block for block in range(first, stop) if block not in loaded]):
                offset = a * self.width
                length = min(b * self.width, self.size) - offset
                data = self.remote.read_at(self._open(), self.name, offset, length, self.kind)
                fetched += len(data)
                requests += 1
                for block in range(a, b):
                    loaded[block] = fetched_blocks[block] = data[
                        (block - a) * self.width : (block - a + 1) * self.width
                    ]
            if fetched_blocks:  # before the load completes: no reader sees them unconfirmed
                self._confirm()
                if tiers.disk is not None:
                    for block, data in fetched_blocks.items():
                        tiers.disk.put(self.key, block, data)
        except BaseException as error:
            self._settle(first, stop, future, None)
            future.set_exception(error)
            return
        self._settle(first, stop, future, loaded, hits, fetched, requests)
        future.set_result(loaded)

    def _confirm(self) -> None:
        """SourceError unless a HEAD made after a fetch finds the object still the version (size
        and modification time) this reader opened: a ranged read returns whatever the object is
        when it runs, and a replacement's bytes must reach neither the reader nor the disk tier
        under the old version's key. A HEAD per ranged read; reading from the tiers costs none."""
        now, handle = self.remote.head(self.name, self.kind)
        handle.close()
        opened = (self.info.bytes_key, self.info.size)
        if (now.bytes_key, now.size) != opened:  # the same ETag put back later is the same bytes
            raise SourceError(
                f"{self.kind}: {self.name!r} changed during the run (opened as {opened[0]}, {opened[1]} bytes, "
                f"now {now.bytes_key}, {now.size} bytes); {REMEDY}"
            )

    def _settle(
        self,
        first: int,
        stop: int,
        future: Future[dict[int, bytes]],
        loaded: dict[int, bytes] | None,
        hits: int = 0,
        fetched: int = 0,
        requests: int = 0,
    ) -> None:
        """Drop the fetch of blocks ``first`` up to ``stop`` from the fetches in flight, and add
        what it loaded to the memory tier and the counters."""
        tiers = self.blocks
        with tiers._lock:
            for block in range(first, stop):
                if tiers._inflight.get((self.key, block)) is future:
                    del tiers._inflight[(self.key, block)]
            if loaded is None:
                return
            for block, data in loaded.items():
                tiers._memory[(self.key, block)] = data
                tiers._memory.move_to_end((self.key, block))
            tiers._trim()
            tiers.disk_hits += hits
            tiers.bytes_fetched += fetched
            tiers.requests += requests

    def _open(self) -> pa.NativeFile:
        """The open file over the object (opened once per process, shared by the fetch threads:
        pyarrow's ranged reads are thread-safe)."""
        with self._open_lock:
            if self._handle is None:
                self._handle = self.remote.open(self.name, self.kind)
            return self._handle


class BlockFile(io.RawIOBase):
    """A read-only, seekable file over a ``BlockReader``, for readers that take a file (pyarrow's
    Parquet reader, through ``pa.PythonFile``): every read goes through the block tiers."""

    def __init__(self, reader: BlockReader) -> None:
        super().__init__()
        self.reader = reader
        self._position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self.reader.size}[whence]
        self._position = max(0, base + offset)
        return self._position

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        data = self.reader.read(self._position, len(view))
        view[: len(data)] = data
        self._position += len(data)
        return len(data)

    def read(self, size: int = -1) -> bytes:
        length = self.reader.size - self._position if size is None or size < 0 else size
        data = self.reader.read(self._position, length)
        self._position += len(data)
        return data


def _runs(blocks: list[int]) -> list[tuple[int, int]]:
    """Sorted ``blocks`` as ``(first, stop)`` runs of consecutive blocks, at most
    ``REQUEST_BLOCKS`` each."""
    runs: list[tuple[int, int]] = []
    start = 0
    for i in range(1, len(blocks) + 1):
        if i < len(blocks) and blocks[i] == blocks[i - 1] + 1 and i - start < REQUEST_BLOCKS:
            continue
        runs.append((blocks[start], blocks[i - 1] + 1))
        start = i
    return runs


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def fetch_pool() -> ThreadPoolExecutor:
    """The process's fetch threads, started on first use."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=FETCH_THREADS, thread_name_prefix="resumable-fetch")
        return _pool


def _forget_the_parents_pool() -> None:
    """A forked child (a DataLoader worker) inherits no threads: it starts its own pool (each
    ``Blocks`` forgets the fetches and locks of the parent's threads itself)."""
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


at_fork(_forget_the_parents_pool)
