"""Objects in object storage read as streams, for ``rs.jsonl_stream`` over ``s3://`` URLs.

An object is read front to back in large ranged reads (``chunk_bytes``, 8 MiB by default) by
a background thread that fetches the next chunk while the consumer parses the current one:
never one request per line. ``open_object`` wraps that read-ahead in an ``io.BufferedReader``
(``readline`` at C speed) and, for ``.gz`` objects, in a ``gzip.GzipFile``. A plain object opens
at any byte offset for the cost of one request (its read starts there); a gzip object opens at
its start and decompresses up to the offset, as a local gzip file does.

The thread holds no reference to its stream, so a stream that is closed, or dropped without
being closed, stops it; it stops within one request. A stream does not pickle (the node that
owns one reopens it where it is read); in a forked child (a DataLoader worker) it reopens the
object and starts a thread of its own at the next chunk. A failed read surfaces in the consumer
as an ``OSError`` naming the object (which the stream node reports as a ``SourceError``).
"""

from __future__ import annotations

import contextlib
import gzip
import io
import os
import queue
import threading
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Union

import xxhash

from resumable.sources.remote import ETAG_PREFIX, Remote

CHUNK_BYTES = 8 << 20
"""Default bytes per ranged read of a streamed object."""
READ_AHEAD_CHUNKS = 1
"""Chunks fetched and waiting for the consumer: with the one it parses and the one being
fetched, a stream holds at most ``READ_AHEAD_CHUNKS + 2`` chunks in memory."""
BUFFER_BYTES = 256 << 10
"""Bytes of the ``io.BufferedReader`` over the read-ahead (what ``readline`` scans)."""
POLL_S = 0.1
"""Seconds the read-ahead thread waits for room in its queue before it checks again whether the
stream was closed: a closed stream's thread ends within one request plus this."""
GZIP_SUFFIX = ".gz"
GZIP_TAIL_BYTES = 64 << 10
"""The bytes at the end of a gzip file a content digest reads (``gzip_tail_digest``)."""
GZIP_DIGESTED_BYTES = 64
"""The bytes before any zero padding that the digest hashes: the last member's trailer (CRC-32
and length of its content) and the compressed bytes before it."""


def gzip_tail_digest(tail: bytes, size: int) -> str | None:
    """The content digest of a gzip file of ``size`` bytes from its last bytes ``tail``: an
    xxh3 of the last ``GZIP_DIGESTED_BYTES`` before any trailing zero padding (which some
    writers add up to a block) and of the padding's length; a constant for an empty file; None
    where ``tail`` is all padding. The trailer alone would be the padding's zeros, the same for
    any padded file of that size."""
    if size == 0:
        return "gzip-tail:empty"
    data = tail.rstrip(b"\0")
    if not data:
        return None
    padding = len(tail) - len(data)
    return f"gzip-tail:{xxhash.xxh3_64_hexdigest(data[-GZIP_DIGESTED_BYTES:] + padding.to_bytes(8, 'little'))}"


@dataclass
class FetchCounts:
    """Ranged reads (``requests``) and ``bytes_fetched`` by the read-ahead threads of one node
    in this process. Thread-safe, forks included; pickles as zeros (a DataLoader worker counts
    its own)."""

    requests: int = 0
    bytes_fetched: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    _pid: int = field(default_factory=os.getpid, repr=False, compare=False)

    def add(self, length: int) -> None:
        """Count one ranged read of ``length`` bytes."""
        if self._pid != os.getpid():  # forked: a thread of the parent may have held the lock
            self._pid, self._lock = os.getpid(), threading.Lock()
        with self._lock:
            self.requests += 1
            self.bytes_fetched += length

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.requests, self.bytes_fetched, self._lock, self._pid = 0, 0, threading.Lock(), os.getpid()


class _End:
    """What the read-ahead thread queues after the last chunk."""


_END = _End()
Fetched = Union[bytes, BaseException, _End]
"""An item of a read-ahead queue: a chunk, the error that ended the reads, or the end."""


class ReadAhead(io.RawIOBase):
    """Bytes ``start`` up to ``end`` of one object, as a raw, non-seekable stream, fetched in
    ranged reads of ``chunk_bytes`` by a background thread one chunk ahead of the consumer."""

    def __init__(
        self, remote: Remote, name: str, kind: str, start: int, end: int, chunk_bytes: int, counts: FetchCounts
    ) -> None:
        super().__init__()
        self.name = name
        self._remote, self._kind = remote, kind
        self._end, self._chunk_bytes, self._counts = end, chunk_bytes, counts
        self._position = start  # the object's byte at which the next byte handed out lies
        self._chunk = memoryview(b"")
        self._at = 0  # position in _chunk of the next byte handed out
        self._taken = start  # the object's byte at which the next chunk to take starts
        self._ended = False
        self._start(start)

    def _start(self, start: int) -> None:
        """Open the object (a ``SourceError`` naming it, here, if it cannot be) and start the
        thread, fetching from byte ``start``."""
        self._pid = os.getpid()
        self._thread: threading.Thread | None = None  # none yet: close() has nothing to stop
        self._file = self._remote.open(self.name, self._kind)
        self._read = partial(self._remote.read_at, self._file, self.name, kind=self._kind)
        self._chunks: queue.Queue[Fetched] = queue.Queue(maxsize=READ_AHEAD_CHUNKS)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=_fetch,
            args=(self._read, start, self._end, self._chunk_bytes, self._counts, self._chunks, self._stop),
            name=f"resumable read-ahead of {self.name}",
            daemon=True,  # never keeps an interpreter from exiting; close() ends it anyway
        )
        self._thread.start()

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def readinto(self, buffer: Any) -> int:
        """Copy the next bytes into ``buffer``; 0 at the end of the range."""
        if self._at == len(self._chunk):
            if self._ended:
                return 0
            item = self._take()
            if isinstance(item, _End):
                self._ended = True
                return 0
            self._chunk, self._at = memoryview(item), 0
            self._taken += len(item)
        count = min(len(buffer), len(self._chunk) - self._at)
        memoryview(buffer).cast("B")[:count] = self._chunk[self._at : self._at + count]
        self._at += count
        self._position += count
        return count

    def _take(self) -> bytes | _End:
        """The next item of the thread, waiting for it; an error of the thread is raised here,
        and again at every later read."""
        if self.closed:
            raise ValueError(f"read-ahead of {self.name!r}: I/O on a closed stream")
        if self._pid != os.getpid():  # a forked child: the parent's thread is not here
            self._start(self._taken)
        while True:
            try:
                item = self._chunks.get(timeout=POLL_S)
                break
            except queue.Empty:
                if (self._thread is None or not self._thread.is_alive()) and self._chunks.empty():
                    item = OSError(f"the read-ahead thread of {self.name!r} ended without a result")
                    break
        if isinstance(item, BaseException):
            self._chunks.put_nowait(item)  # the thread has ended: a later read fails the same way
            raise OSError(f"read-ahead of {self.name!r} at byte {self._position}: {type(item).__name__}: {item}")
        return item

    def close(self) -> None:
        """Stop the thread (within one request) and close the object. In a forked child, which
        has none of the parent's threads, only drop them."""
        if not self.closed and self._thread is not None and self._pid == os.getpid():
            self._stop.set()
            with contextlib.suppress(queue.Empty):
                self._chunks.get_nowait()  # room for a put the thread waits on: it sees the stop at once
            self._thread.join()
            self._file.close()
        self._chunk = memoryview(b"")
        super().close()

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError(f"read-ahead of {self.name!r}: an open stream does not pickle; reopen it where it is read")


def _fetch(
    read: Callable[[int, int], bytes],
    start: int,
    end: int,
    chunk_bytes: int,
    counts: FetchCounts,
    chunks: queue.Queue[Fetched],
    stop: threading.Event,
) -> None:
    """The read-ahead thread: bytes ``start`` up to ``end`` of an object, by ``read(offset,
    length)`` (``Remote.read_at``: one ranged read, retried while it fails transiently) of
    ``chunk_bytes`` each, into ``chunks``, then ``_END``; or the error that stopped it. Returns
    early once ``stop`` is set."""
    position = start
    try:
        while position < end and not stop.is_set():
            length = min(chunk_bytes, end - position)
            data = read(position, length)
            counts.add(len(data))
            position += length
            if not _put(chunks, data, stop):
                return
        _put(chunks, _END, stop)
    except BaseException as error:  # noqa: BLE001 (handed to the consumer, which raises it)
        _put(chunks, error, stop)


def _put(chunks: queue.Queue[Fetched], item: Fetched, stop: threading.Event) -> bool:
    """Queue ``item`` once there is room; False if the stream was closed first."""
    while not stop.is_set():
        try:
            chunks.put(item, timeout=POLL_S)
            return True
        except queue.Full:
            continue
    return False


def is_gzip(name: str) -> bool:
    """Whether an object (or file) is read as gzip: its name ends with ``.gz``."""
    return name.endswith(GZIP_SUFFIX)


def open_object(
    remote: Remote, name: str, size: int, offset: int, kind: str, chunk_bytes: int, counts: FetchCounts
) -> tuple[io.BufferedIOBase, int]:
    """The object ``name`` (``size`` bytes) open for reading at byte ``offset`` of its content,
    and the offset reached: ``offset``, or for gzip less when the content ends before it. A
    plain object's read starts at ``offset``; a gzip one decompresses from its start."""
    if not is_gzip(name):
        raw = ReadAhead(remote, name, kind, min(offset, size), size, chunk_bytes, counts)
        return io.BufferedReader(raw, BUFFER_BYTES), raw.tell()
    buffered = io.BufferedReader(ReadAhead(remote, name, kind, 0, size, chunk_bytes, counts), BUFFER_BYTES)
    handle = _GzipObject(name, buffered)
    try:
        return handle, handle.seek(offset)
    except BaseException:
        handle.close()
        raise


class _GzipObject(gzip.GzipFile):
    """A ``GzipFile`` over a read-ahead that closes it too (``GzipFile`` leaves a ``fileobj``
    it was given open, which would leave the thread running)."""

    def __init__(self, name: str, buffered: io.BufferedReader[ReadAhead]) -> None:
        self._buffered = buffered
        super().__init__(name, "rb", fileobj=buffered)

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._buffered.close()


def gzip_trailer(remote: Remote, kind: str, name: str) -> str | None:
    """A ``Digest`` of objects: a gzip object's ``gzip_tail_digest`` (as ``stream.gzip_digest``
    computes it locally) by one ranged read of its tail; for a plain object its ETag where the
    store reports one (the HEAD that opening it costs), so that an object replaced within the
    same second by one of the same size is still told apart."""
    info, handle = remote.head(name, kind)
    with handle:
        if not is_gzip(name):
            return info.version if info.version.startswith(ETAG_PREFIX) else None
        length = min(info.size, GZIP_TAIL_BYTES)
        tail = remote.read_at(handle, name, info.size - length, length, kind) if length else b""
        return gzip_tail_digest(tail, info.size)
