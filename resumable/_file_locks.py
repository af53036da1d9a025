"""Exclusive file locks (``flock``) that a forked child lets go of.

A flock belongs to the open file, which a fork shares: a child forked while this process holds
one (a DataLoader worker started during a save, a pool forked by a scan under its lock) would
keep it held until the child exits, and every process waiting on it would wait as long (for
ever, if the holder dies meanwhile). So each lock's descriptor is recorded while it is open, and
a forked child closes its copies first thing (``_forks.at_fork``), which leaves the parent's
lock as it is.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from typing import Iterator

from resumable._forks import at_fork

NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS}
"""flock's errors where the file system has no locks."""

_OPEN: set[int] = set()
"""This process's descriptors opened to hold a lock."""


def open_for_lock(path: str, flags: int, mode: int = 0o666) -> int:
    """``os.open(path, flags)`` (close-on-exec), recorded as a lock's descriptor until
    ``close_lock``."""
    handle = os.open(path, flags | os.O_CLOEXEC, mode)
    _OPEN.add(handle)
    return handle


def close_lock(handle: int) -> None:
    """Close a descriptor from ``open_for_lock``, which drops its lock; nothing if a fork
    closed it already (in a child)."""
    if handle in _OPEN:
        _OPEN.discard(handle)
        os.close(handle)


def lock(handle: int, wait: bool = True) -> bool:
    """Lock ``handle`` exclusively, waiting for its holder (``BlockingIOError`` if it is held and
    not ``wait``); False where the file system has no locks."""
    try:
        fcntl.flock(handle, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        if error.errno not in NO_LOCKS:
            raise
        return False
    return True


@contextlib.contextmanager
def held(path: str) -> Iterator[bool]:
    """Hold an exclusive lock on ``path`` (created, directories included): the processes of a
    machine that need the same missing file build it one at a time, and those that wait find
    it built. Yields whether it is locked: not where the directory cannot be written or the
    file system has no locks (each process builds, the last rename wins)."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        handle: int | None = open_for_lock(path, os.O_RDWR | os.O_CREAT)
    except OSError:
        handle = None
    if handle is None:
        yield False
        return
    try:
        yield lock(handle)
    finally:
        close_lock(handle)


def _close_in_child() -> None:
    for handle in _OPEN:
        with contextlib.suppress(OSError):
            os.close(handle)
    _OPEN.clear()


at_fork(_close_in_child)
