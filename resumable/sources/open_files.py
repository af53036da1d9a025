"""Open files without running out of descriptors: a source over thousands of shards cannot
keep every file open, as each memory map or handle holds a descriptor and a process may hold
1,024 by default.

- ``OpenFiles``: a source's handles by file number (a JSONL file's memory map, a Parquet file).
  All of a process's together hold at most ``budget()`` at once, a quarter of its descriptor
  limit; opening one more lets go of the least recently used. Letting go drops the reference:
  a handle a reader still holds (another thread slicing a memory map) stays valid until that
  reader is done, and closes when the last reference goes.
- ``MappedFile``: a file memory-mapped read-only that holds no descriptor at all (a line index's
  sidecar, a cache block), for maps that are read through numpy or Arrow.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import weakref
from collections import OrderedDict
from typing import Callable, Generic, Iterator, NamedTuple, TypeVar

import pyarrow as pa

from resumable._forks import at_fork

try:
    import resource
except ImportError:  # not on Windows: its C runtime's limit is 8,192 open files
    resource = None  # type: ignore[assignment]

T = TypeVar("T")

SHARE_OF_LIMIT = 4
"""The budget is the process's soft descriptor limit divided by this, the rest left to everything
else the process opens (sockets, pipes to DataLoader workers, other libraries' files)."""
MINIMUM = 16
DEFAULT_LIMIT = 8192
"""The descriptor limit where the process has none it can tell."""
EXHAUSTED = (errno.EMFILE, errno.ENFILE)

# Every open handle of every source in this process, least recently used first.
_OPEN: OrderedDict[tuple[int, int], weakref.ref[OpenFiles[object]]] = OrderedDict()
_LOCK = threading.RLock()


def budget() -> int:
    """How many handles the sources of this process may hold open at once (read at every
    opening, so a limit raised at run time is used at once)."""
    limit = DEFAULT_LIMIT
    if resource is not None:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if soft != resource.RLIM_INFINITY:
            limit = soft
    return max(MINIMUM, limit // SHARE_OF_LIMIT)


class OpenFiles(Generic[T]):
    """One source's open handles by file number, within the process-wide ``budget()``."""

    def __init__(self, count: int) -> None:
        self._handles: list[T | None] = [None] * count

    def get(self, file: int, opener: Callable[[int], T]) -> T:
        """The handle of ``file``, opened by ``opener`` if it is not (letting go of the least
        recently used handles of this process beyond the budget); an opener's error propagates.
        The opener is given at each call, not kept: a source holding its own bound method
        through this would be a cycle only the garbage collector frees."""
        handle = self._handles[file]
        key = (id(self), file)
        if handle is not None:
            with _LOCK:
                if key in _OPEN:
                    _OPEN.move_to_end(key)
            return handle
        with _LOCK:
            _let_go(budget() - 1)
        try:
            handle = opener(file)
        except OSError as error:
            if error.errno not in EXHAUSTED:
                raise
            with _LOCK:  # other code holds the descriptors: let go of every one of ours, once
                _let_go(0)
            handle = opener(file)
        with _LOCK:
            _let_go(budget() - 1)  # threads that opened at once each let go before opening
            self._handles[file] = handle
            _OPEN[key] = weakref.ref(self)  # type: ignore[arg-type]
        return handle

    def opened(self, file: int) -> T | None:
        """The handle of ``file`` if it is open, without opening it."""
        return self._handles[file]

    def close(self) -> None:
        """Let go of every handle (a pickled or closed source)."""
        with _LOCK:
            for file, handle in enumerate(self._handles):
                if handle is not None:
                    _OPEN.pop((id(self), file), None)
            self._handles = [None] * len(self._handles)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001, S110 - at interpreter exit the module's globals may be gone
            pass

    def __getstate__(self) -> dict[str, object]:
        """Pickled without its handles (a DataLoader worker opens its own)."""
        return {"_handles": [None] * len(self._handles)}

    def __len__(self) -> int:
        return len(self._handles)


class MappedFile(NamedTuple):
    """A file memory-mapped read-only without a descriptor (pyarrow maps it and closes the file;
    the map lives as long as ``buffer``), and what was opened (``opened``, its ``os.stat``), so
    that a cut in place is caught before a read: reading a map past the end of its file kills
    the process (SIGBUS)."""

    buffer: pa.Buffer
    path: str
    opened: os.stat_result

    @classmethod
    def of(cls, path: str) -> MappedFile:
        """``path`` mapped whole; OSError if it cannot be opened."""
        with pyarrow_path(path) as name:
            source = pa.memory_map(name, "r")
        try:
            opened = os.fstat(source.fileno())
            buffer = source.read_buffer()
        finally:
            source.close()
        return cls(buffer, path, opened)

    def cut_to(self) -> int | None:
        """The file's size now if its path still names it at another size (changed in place),
        else None: reading the map is safe (a file replaced or removed since stays mapped as it
        was). An ``os.stat``."""
        try:
            now = os.stat(self.path)
        except OSError:
            return None
        if (now.st_dev, now.st_ino) != (self.opened.st_dev, self.opened.st_ino) or now.st_size == self.buffer.size:
            return None
        return now.st_size


@contextlib.contextmanager
def pyarrow_path(path: str) -> Iterator[str]:
    """A name pyarrow opens ``path`` by: itself or, where it is not UTF-8 (bytes a Linux file name
    may hold, which pyarrow cannot pass on), ``/dev/fd/N`` of the file opened here, while pyarrow
    opens it (pyarrow's file or map then holds its own descriptor, or none)."""
    try:
        path.encode()
    except UnicodeEncodeError:
        pass
    else:
        yield path
        return
    if not os.path.isdir("/dev/fd"):
        raise OSError(errno.EINVAL, "pyarrow cannot open a file whose name is not UTF-8 here", path)
    descriptor = os.open(path, os.O_RDONLY)
    try:
        yield f"/dev/fd/{descriptor}"
    finally:
        os.close(descriptor)


def _let_go(keep: int) -> None:
    """Drop the least recently used handles until at most ``keep`` are open (under ``_LOCK``)."""
    while len(_OPEN) > keep:
        (owner_id, file), owner = _OPEN.popitem(last=False)
        holder = owner()
        if holder is not None and id(holder) == owner_id:
            holder._handles[file] = None


def open_count() -> int:
    """How many handles the sources of this process hold open."""
    return len(_OPEN)


def _forget_the_parent() -> None:
    """In a forked child: a lock the parent's thread held stays held for ever; the handles
    themselves (inherited descriptors and maps) stay usable."""
    global _LOCK
    _LOCK = threading.RLock()


at_fork(_forget_the_parent)
