"""Streaming JSONL: files that cannot be indexed (gzip), sharded by file, resumed by byte offset.

Consumer ``c`` of ``C`` reads the files at ``c, c + C, ...`` of the epoch's file order (sorted,
or a keyed permutation per epoch with ``shuffle_files``), line by line. Its state is the
queue of files it has left, as ``[file, byte offset, line]`` work items: the head one is the
file being read and where its next line starts (offsets count decompressed bytes). An elastic
rescale deals the old consumers' work items out over the new ones. Resuming inside a gzip file
decompresses up to the offset (gzip has no random access); plain files seek.

Objects in object storage (``s3://`` URLs with ``storage_options``, or paths on a ``pyarrow.fs``
``filesystem``) are read the same way through ``resumable.sources.remote_stream``: large ranged
reads fetched one chunk ahead by a background thread, a plain object opened at an offset by
starting its read there, a gzip one decompressed from its start.
"""

from __future__ import annotations

import gzip
import io
import logging
import os
import weakref
from functools import partial
from typing import Any, Mapping, Sequence

import numpy as np
import orjson

from resumable._forks import InheritedByForks, Settle, inherited
from resumable.core.keys import RecordKey, leaf_key
from resumable.core.node import Node
from resumable.core.options import int_option, seed_option
from resumable.core.state import (
    ENDED,
    check_config,
    epoch_after,
    require,
    require_adjacent_epochs,
    require_epoch,
    short_repr,
)
from resumable.errors import ConfigError, SourceError, StateError
from resumable.order.lcg import ROUNDS_OPTION, Permutation, PermutationRounds
from resumable.order.topology import TOPOLOGY_KEYS, Consumer, Topology
from resumable.sources._line_scan import UTF8_BOM
from resumable.sources.files import (
    READ_ERRORS,
    FileGone,
    Paths,
    WatchedFiles,
    WatchedIdentity,
    read_error,
    reading,
)
from resumable.sources.remote import FRESH_SECONDS, resolve
from resumable.sources.remote_stream import (
    CHUNK_BYTES,
    GZIP_TAIL_BYTES,
    FetchCounts,
    gzip_tail_digest,
    gzip_trailer,
    is_gzip,
    open_object,
)

logger = logging.getLogger("resumable")

ON_ERROR = "on_error"
SHUFFLE_FILES = "shuffle_files"
EPOCH = "epoch"
QUEUE = "queue"
NEXT_QUEUE = "next_queue"
"""Work items of the next epoch, when a rescale cut two epochs short (old consumers on both
sides of an epoch boundary, as after ``.repeat()``); absent otherwise."""

OFFSET_BITS = 40  # a record key packs (file, byte offset): offsets below 1 TiB per file
OFFSET_MAX = (1 << OFFSET_BITS) - 1
"""The largest byte offset of a line a stream reads: a larger file (or gzip content) is refused."""
LOGGED_SKIPS = 10
MAX_DEFLATE_RATIO = 1032
"""Deflate expands a compressed byte into at most this many: a bound on a gzip file's content."""


class JsonlStream(PermutationRounds, WatchedIdentity, Node[Any], InheritedByForks):
    """Records of JSONL files (``.jsonl`` or ``.jsonl.gz``) read as streams, split by file.

    Use it for data that cannot be indexed; ``rs.jsonl`` (indexed: global shuffle, seek-based
    resume anywhere, an even split of records) is better whenever it can be used. With fewer
    files than consumers some consumers read nothing.

    Remote objects (``storage_options``/``filesystem``, see ``resumable.sources.remote``) are
    read in ranged reads of ``chunk_bytes``, one chunk ahead of the parser; ``stats`` then
    counts those reads (``requests``), ``bytes_fetched`` and ``retries`` in this process.
    """

    kind = "JsonlStream"
    _reads_upstream = False

    def __init__(
        self,
        paths: Paths,
        on_error: str = "raise",
        shuffle_files: int | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        split_workers: bool = True,
        storage_options: Mapping[str, Any] | None = None,
        filesystem: Any = None,
        chunk_bytes: int = CHUNK_BYTES,
    ) -> None:
        super().__init__()
        if on_error not in ("raise", "skip"):
            raise ConfigError(f"{self.kind}: on_error must be 'raise' or 'skip', got {on_error!r}")
        shuffle_files = seed_option(self.kind, SHUFFLE_FILES, shuffle_files, optional=True)
        chunk_bytes = int_option(self.kind, "chunk_bytes", chunk_bytes)
        self._consumer = Consumer(rank, world_size, split_workers, self.kind)
        self.paths, self._remote = resolve(paths, self.kind, storage_options, filesystem)
        if self._remote is None:
            self._files = WatchedFiles.of(self.kind, self.paths, gzip_digest)
        else:
            digest = partial(gzip_trailer, self._remote, self.kind)
            self._files = WatchedFiles.of(self.kind, self.paths, digest, self._remote.stat, FRESH_SECONDS)
        for file, path in enumerate(self.paths):
            if not is_gzip(path) and self._files.size(file) > OFFSET_MAX:
                raise SourceError(f"{self.kind}: {path!r} is larger than {OFFSET_MAX + 1:,} bytes; split it")
        self.chunk_bytes = chunk_bytes
        self._fetched = FetchCounts()  # ranged reads of remote objects, in this process
        self.on_error = on_error
        self.shuffle_files = shuffle_files
        self._epoch = 0
        self._queue: list[list[int]] | None = None  # [file, offset, line] work items; None: not yet assigned
        self._next_queue: list[list[int]] | None = None  # the next epoch's, after a rescale; None: its share
        self._handle: io.BufferedIOBase | None = None
        self._handle_pid = 0  # the process that opened it
        # Closes the handle if this node is collected (or the interpreter exits) with it open.
        self._handle_closer: weakref.finalize[..., JsonlStream] | None = None
        self._last: RecordKey | None = None
        self.skipped = 0
        inherited(self)

    @property
    def stats(self) -> dict[str, int]:
        """Malformed records skipped so far; for remote objects also the ranged reads of the
        read-ahead (``requests``), their ``bytes_fetched`` and the requests ``retries`` of this
        process."""
        stats = {"skipped": self.skipped}
        if self._remote is not None:
            stats["requests"] = self._fetched.requests
            stats["bytes_fetched"] = self._fetched.bytes_fetched
            stats["retries"] = self._remote.retries
        return stats

    @property
    def topology(self) -> Topology:
        """This process's consumer; resolved again after a fork (a new DataLoader worker), which
        then gets its own file assignment."""
        topology, fresh = self._consumer.resolve()
        if fresh:
            self._queue = None
        return topology

    @property
    def queue(self) -> list[list[int]]:
        """The work items left, ``[file, byte offset, line]``; by default this consumer's files
        of the epoch (``c, c + C, ...`` of the epoch's file order), from their start."""
        topology = self.topology  # resolved first: in a new process it clears the parent's queue
        if self._queue is None:
            self._queue = self._share(self._epoch, topology.consumer, topology.num_consumers)
        return self._queue

    def _share(self, epoch: int, consumer: int, num_consumers: int) -> list[list[int]]:
        """Consumer ``consumer``'s files of ``epoch`` from their start: ``c, c + C, ...`` of the
        epoch's file order."""
        order = np.arange(len(self.paths), dtype=np.int64)
        if self.shuffle_files is not None:
            order = Permutation(len(self.paths), self.shuffle_files, epoch, self.rounds).take(order)
        return [[file, 0, 0] for file in order[consumer::num_consumers].tolist()]

    # -- iteration ----------------------------------------------------------------------------

    def _next(self) -> Any:
        queue = self._queue if self._queue is not None else self.queue
        while queue:
            file, offset, line = queue[0]
            try:
                handle = self._handle or self._open(file, offset)
                raw = handle.readline()
            except (*READ_ERRORS, FileGone) as error:
                self._close_handle()
                where = f"{self.kind}: cannot read {self.paths[file]}:{line + 1}"
                failure = error if isinstance(error, FileGone) else read_error(where, error)
                if self.on_error != "skip":
                    raise failure from error
                self._skip_unreadable(failure)
                queue.pop(0)  # the rest of the file cannot be read
                continue
            if not raw:
                self._close_handle()
                queue.pop(0)
                continue
            queue[0] = [file, offset + len(raw), line + 1]
            if offset == 0:  # a file's first line; the others pay one comparison
                raw = _without_bom(raw)
            elif offset > OFFSET_MAX:  # a gzip file's content past what a record key holds
                self._close_handle()
                raise SourceError(
                    f"{self.kind}: {self.paths[file]}:{line + 1}: the content is larger than {OFFSET_MAX + 1:,} bytes; "
                    "split the file"
                )
            if not raw.strip():
                continue
            try:
                record = orjson.loads(raw)
            except orjson.JSONDecodeError as error:
                self._reject(file, line + 1, error)
                continue
            self._last = (self._epoch, file << OFFSET_BITS | offset)
            return record
        raise StopIteration

    def _open(self, file: int, offset: int) -> io.BufferedIOBase:
        """Open file ``file`` (checked unchanged) at decompressed byte ``offset``."""
        self._files.check(file)
        path = self.paths[file]
        handle, reached = self._open_at(file, max(offset - 1, 0))  # from the byte before a line
        if self._remote is None:
            try:
                self._files.check_opened(file, handle.fileno())
            except BaseException:
                handle.close()
                raise
        self._handle, self._handle_closer = handle, weakref.finalize(self, handle.close)
        self._handle_pid = os.getpid()
        if offset and reached == offset - 1:
            before = handle.read(1)  # a line starts after a newline (or the content ends)
            reached += len(before)
            if before and before != b"\n" and handle.read(1):
                self._close_handle()
                raise StateError(
                    f"{self.kind}: the state's byte offset {offset} in {path!r} is not the start of a line: the state "
                    "was not taken over this file"
                )
        if reached != offset:
            self._close_handle()
            raise StateError(
                f"{self.kind}: the state's byte offset {offset} is past the end of {path!r} ({reached} bytes "
                "decompressed): the state was not taken over this file"
            )
        return handle

    def _open_at(self, file: int, offset: int) -> tuple[io.BufferedIOBase, int]:
        """File ``file`` open at decompressed byte ``offset``, and the offset reached (less
        than ``offset`` when a gzip file's content ends before it): a local file seeks (gzip:
        decompresses up to the offset); a remote object starts its ranged reads there (gzip: at
        its start, decompressing up to the offset)."""
        path = self.paths[file]
        if self._remote is None:
            handle = _open(path)
            try:
                return handle, handle.seek(offset)
            except BaseException:
                handle.close()
                raise
        return open_object(
            self._remote, path, self._files.size(file), offset, self.kind, self.chunk_bytes, self._fetched
        )

    def _close_handle(self) -> None:
        if self._handle is not None:
            if self._handle_closer is not None:
                self._handle_closer.detach()
            if self._handle_pid == os.getpid():
                self._handle.close()
            else:  # the parent's (see _forget_the_parent): let go, never close
                _INHERITED_HANDLES.append(self._handle)
            self._handle, self._handle_closer = None, None

    def _forget_the_parent(self) -> Settle:
        """In a forked child: an open file shares its offset with the parent's, so the stream
        lets go of its copy and opens the file again at its next work item's offset when it
        reads on."""
        self._close_handle()
        return None

    def _skip_unreadable(self, failure: SourceError) -> None:
        """Count a file whose rest cannot be read (``on_error="skip"``): removed, unreadable, a
        corrupt or truncated gzip stream."""
        self.skipped += 1
        if self.skipped <= LOGGED_SKIPS:
            logger.warning("skipped the rest of a file (%s)", failure)

    def _reject(self, file: int, line: int, error: Exception) -> None:
        where = f"{self.paths[file]}:{line}"
        if self.on_error == "skip":
            self.skipped += 1
            if self.skipped <= LOGGED_SKIPS:
                logger.warning("%s: skipped malformed JSON record (%s)", where, error)
            return
        raise SourceError(f"{where}: malformed JSON record: {error}") from error

    def last_key(self) -> RecordKey | None:
        return self._last

    def fetch_many(self, keys: Sequence[RecordKey]) -> list[Any]:
        """The records whose lines start at the byte offsets packed in ``keys``. Each file is
        opened once and read forward in offset order, so a gzip file is decompressed once up to
        its last offset asked for, however many records are fetched from it."""
        wanted: dict[int, list[tuple[int, int]]] = {}  # file -> [(offset, slot)]
        for slot, key in enumerate(keys):
            packed = leaf_key(key, self.kind)[1]
            file, offset = packed >> OFFSET_BITS, packed & OFFSET_MAX
            if not 0 <= file < len(self.paths):
                raise IndexError(f"{self.kind}: record key {key!r} names no file")
            wanted.setdefault(file, []).append((offset, slot))
        records: list[Any] = [None] * len(keys)
        for file, offsets in wanted.items():
            self._files.check(file)
            path = self.paths[file]
            with reading(f"{self.kind}: cannot read {path!r}"):
                if self._remote is None:
                    with _open(path) as handle:
                        self._files.check_opened(file, handle.fileno())
                        for offset, slot in sorted(offsets):
                            handle.seek(offset)
                            records[slot] = _record(path, offset, handle.readline())
                else:
                    self._fetch_remote(file, sorted(offsets), records)
        return records

    def _fetch_remote(self, file: int, offsets: list[tuple[int, int]], records: list[Any]) -> None:
        """The records at ``offsets`` (``(byte offset, slot)``, sorted) of remote file ``file``
        into their slots of ``records``. One stream reads forward through them; a plain object
        opens a new one where the next offset lies more than a chunk ahead (no fetching of the
        bytes between), a gzip one is decompressed once, up to its last offset."""
        handle: io.BufferedIOBase | None = None
        position = 0  # of the open handle: the decompressed byte its next read returns
        path = self.paths[file]
        try:
            for offset, slot in offsets:
                far = not is_gzip(path) and offset - position > self.chunk_bytes
                if handle is None or far:
                    if handle is not None:
                        handle.close()
                    handle, position = self._open_at(file, offset)
                while position < offset:  # skip forward within the stream (gzip: decompress)
                    skipped = handle.read(min(offset - position, self.chunk_bytes))
                    if not skipped:
                        break
                    position += len(skipped)
                raw = handle.readline()
                position += len(raw)
                records[slot] = _record(path, offset, raw)
        finally:
            if handle is not None:
                handle.close()

    # -- epochs, state, shutdown ----------------------------------------------------------------

    # -- what a stream cannot do, and what to do instead ------------------------------------

    _NO_RANDOM_ACCESS = (
        "rs.jsonl_stream reads its files front to back, without random access; it splits the files over "
        "ranks and workers itself (no .shard() needed) and shuffles their order with shuffle_files=seed. "
        "For a record-level shuffle, a cache or .shard(), read plain JSONL files with rs.jsonl"
    )

    def shuffle(self, seed: int = 0, block_size: int | str | None = None, window: int | None = None) -> Node[Any]:
        raise ConfigError(f"{self.kind}: shuffle(): {self._NO_RANDOM_ACCESS}")

    def shard(self, rank: int | None = None, world_size: int | None = None, split_workers: bool = True) -> Any:
        raise ConfigError(f"{self.kind}: shard(): {self._NO_RANDOM_ACCESS}")

    def cache(self, directory: str | None = None, max_bytes: int = 1 << 30) -> Node[Any]:
        raise ConfigError(f"{self.kind}: cache(): {self._NO_RANDOM_ACCESS}")

    def _begin_epoch(self, epoch: int | None) -> None:
        self._files.check_all()
        following = self._epoch + 1
        self._epoch = epoch_after(self.kind, self._epoch, epoch)
        self._close_handle()
        self._queue = self._next_queue if self._epoch == following else None
        self._next_queue = None
        self._last = None
        self._ended = False
        self._renew_saved_options()

    def _shutdown(self) -> None:
        self._close_handle()

    def _config(self) -> dict[str, Any]:
        return {
            ON_ERROR: self.on_error,
            SHUFFLE_FILES: self.shuffle_files,
            ROUNDS_OPTION: self.rounds,
            **self.topology.config(),
        }

    def _header_key(self) -> object:
        return (self.topology, super()._header_key())

    def _progress(self) -> dict[str, Any]:
        progress = {EPOCH: self._epoch, QUEUE: [list(item) for item in self.queue]}
        if self._next_queue is not None:
            progress[NEXT_QUEUE] = [list(item) for item in self._next_queue]
        return progress

    def _restore(self, state: dict[str, Any], path: str) -> None:
        epoch = require_epoch(state, EPOCH, path)
        queue = self._work_items(require(state, QUEUE, list, path), path)
        next_queue = self._work_items(require(state, NEXT_QUEUE, list, path), path) if NEXT_QUEUE in state else None
        self._close_handle()
        self._epoch, self._queue, self._next_queue, self._last = epoch, queue, next_queue, None

    def _work_items(self, items: list[Any], path: str) -> list[list[int]]:
        """Saved work items, checked: ``[file, byte offset, line]`` within this source's files."""
        for item in items:
            if not (
                isinstance(item, list)
                and len(item) == 3
                and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in item)
                and item[0] < len(self.paths)
            ):
                raise StateError(
                    f"{path}: queue entry {short_repr(item)} is not [file, byte offset, line] of this source"
                )
            limit = self._offset_limit(item[0])
            if item[1] > limit:
                raise StateError(
                    f"{path}: queue entry {item!r} points past the end of {self.paths[item[0]]!r} "
                    f"(byte offsets there are at most {limit})"
                )
        files = [item[0] for item in items]
        if len(set(files)) != len(files):
            raise StateError(f"{path}: the queue names a file twice ({short_repr(items)}); no state of it does")
        return [list(item) for item in items]

    def _offset_limit(self, file: int) -> int:
        """The largest byte offset file ``file`` can hold: its size, or for gzip what its size
        can decompress to; never past what a record key can pack."""
        size = self._files.size(file)
        content = size * MAX_DEFLATE_RATIO if is_gzip(self.paths[file]) else size
        return min(content, OFFSET_MAX)

    def _rescale(self, olds: list[dict[str, Any]], path: str, consumer: int, num_consumers: int) -> dict[str, Any]:
        """A share of every old consumer's work items, dealt out one by one. When old consumers
        straddle an epoch boundary, the next epoch's work items are dealt out too: the queues of
        those already in it, and the whole share of those that are not."""
        config = {key: value for key, value in self._checked_config().items() if key not in TOPOLOGY_KEYS}
        epochs = require_adjacent_epochs(olds, EPOCH, path)
        first = min(epochs)
        straddle = max(epochs) > first or any(NEXT_QUEUE in old for old in olds)
        current: list[Any] = []
        following: list[Any] = []
        for old_consumer, (old, epoch) in enumerate(zip(olds, epochs)):
            check_config(old, config, path)
            self._check_identity(old, path)
            queue = require(old, QUEUE, list, path)
            if epoch > first:
                if NEXT_QUEUE in old:
                    raise StateError(f"{path}: old consumers hold work of more than two epochs")
                following.extend(queue)
                continue
            current.extend(queue)
            if straddle:
                held = require(old, NEXT_QUEUE, list, path) if NEXT_QUEUE in old else None
                following.extend(held if held is not None else self._share(first + 1, old_consumer, len(olds)))
        state = {**self._header(), EPOCH: first, QUEUE: current[consumer::num_consumers], ENDED: False}
        if straddle:
            state[NEXT_QUEUE] = following[consumer::num_consumers]
        return state

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_handle"] = state["_handle_closer"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        inherited(self)


# File objects a forked child inherited and let go of. Never closed nor freed: a thread of the
# parent may have been inside one (a prefetch's readline()) at the fork, and its lock, which no
# thread here will release, would block the close forever.
_INHERITED_HANDLES: list[io.BufferedIOBase] = []


def _without_bom(first_line: bytes) -> bytes:
    """A file's first line without the UTF-8 byte order mark that may open it (skipped, as
    ``rs.jsonl`` skips it)."""
    return first_line[len(UTF8_BOM) :] if first_line.startswith(UTF8_BOM) else first_line


def _record(path: str, offset: int, raw: bytes) -> Any:
    """The JSON record of the line ``raw`` read at byte ``offset`` of ``path``."""
    try:
        return orjson.loads(_without_bom(raw) if offset == 0 else raw)
    except orjson.JSONDecodeError as error:
        raise SourceError(f"{path}: no JSON record at byte {offset}: {error}") from error


def _open(path: str) -> io.BufferedIOBase:
    return gzip.open(path, "rb") if is_gzip(path) else open(path, "rb")


def gzip_digest(path: str) -> str | None:
    """A gzip file's ``gzip_tail_digest`` (its last member's trailer and what precedes it,
    past any zero padding); None for plain files, which have no cheap digest."""
    if not is_gzip(path):
        return None
    with open(path, "rb") as handle:
        size = handle.seek(0, os.SEEK_END)
        handle.seek(max(0, size - GZIP_TAIL_BYTES))
        return gzip_tail_digest(handle.read(), size)


def jsonl_stream(
    paths: Paths,
    on_error: str = "raise",
    shuffle_files: int | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    split_workers: bool = True,
    storage_options: Mapping[str, Any] | None = None,
    filesystem: Any = None,
    chunk_bytes: int = CHUNK_BYTES,
) -> JsonlStream:
    """A streaming, file-sharded source over JSONL files (plain or ``.gz``): local paths and
    globs, or objects in object storage (``s3://`` URLs with ``storage_options``, or paths on a
    ``pyarrow.fs`` ``filesystem``), read in ranged reads of ``chunk_bytes`` fetched ahead."""
    return JsonlStream(
        paths, on_error, shuffle_files, rank, world_size, split_workers, storage_options, filesystem, chunk_bytes
    )
