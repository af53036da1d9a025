"""Checkpoint files written atomically, and states saved as plain JSON.

A crash (SIGKILL, power loss) during a save leaves the previous file intact: the new content
goes to a temporary file in the same directory, is flushed and fsynced, then renamed over the
old one, and the directory is fsynced so the rename itself is durable.

Each target has one temporary, ``.NAME.partial`` beside it, which its writer holds locked
(``flock``) until the rename. A save that finds it unlocked knows its writer died and removes
it first, so a crash never leaves more than one behind, and only until the next save; a save
that finds it locked waits its turn. The lock lives with the open file, so the kernel drops it
whenever its writer dies. Where the file system has no locks, each save writes a temporary of
its own (``.NAME.<random>.partial``) and crashed saves' temporaries stay.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import secrets
from typing import IO, Any, Callable

from resumable.core.state import check_json
from resumable.errors import StateError

TEMP_SUFFIX = ".partial"
NEW_FILE_MODE = 0o666  # what the umask leaves of it, as for open() and torch.save
NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS}  # flock's errors where the file system has no locks


def write_atomically(path: str | os.PathLike[str], write: Callable[[IO[bytes]], object]) -> None:
    """Call ``write`` on a temporary file, then put it at ``path`` in one atomic rename.

    Missing directories are created. The file's mode is what the umask leaves of 0o666.
    """
    target = os.path.abspath(os.fspath(path))
    directory = os.path.dirname(target)
    _make_directories(directory)
    handle, temp = _claim_temp(directory, os.path.basename(target))
    try:  # the temporary is removed and the lock dropped in this order: nobody can claim it between
        with os.fdopen(handle, "wb", closefd=False) as out:
            write(out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temp, target)
    except BaseException:
        os.unlink(temp)
        raise
    finally:
        os.close(handle)
    _fsync_directory(directory)


def _claim_temp(directory: str, name: str) -> tuple[int, str]:
    """Create this save's temporary for the target ``name`` and lock it: ``(descriptor, path)``.

    Whoever holds the lock on the file *at the path* owns it. A file found there and locked by
    nobody belongs to a writer that died, or to one that has not locked it yet: either way it
    is removed, and that writer, seeing its file gone from the path, starts again.
    """
    temp = os.path.join(directory, f".{name}{TEMP_SUFFIX}")
    while True:
        try:
            handle, created = _create(temp), True
        except FileExistsError:
            try:
                handle, created = os.open(temp, os.O_RDONLY | os.O_CLOEXEC), False  # only to lock it
            except FileNotFoundError:
                continue  # renamed into place or removed meanwhile
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)  # waits while another save of this target writes
        except BaseException as error:
            os.close(handle)
            if not isinstance(error, OSError) or error.errno not in NO_LOCKS:
                raise
            if created:
                os.unlink(temp)
            return _claim_unique_temp(directory, name)
        if _is_at(handle, temp):
            if created:
                return handle, temp
            os.unlink(temp)  # left by a writer that died: a live one would hold the lock
        os.close(handle)


def _claim_unique_temp(directory: str, name: str) -> tuple[int, str]:
    """A temporary nobody else can name, for file systems without locks (never swept)."""
    while True:
        temp = os.path.join(directory, f".{name}.{secrets.token_hex(4)}{TEMP_SUFFIX}")
        try:
            return _create(temp), temp
        except FileExistsError:
            continue


def _create(path: str) -> int:
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, NEW_FILE_MODE)


def _is_at(handle: int, path: str) -> bool:
    """Whether the open file ``handle`` is still the one at ``path``."""
    try:
        found = os.stat(path)
    except FileNotFoundError:
        return False
    opened = os.fstat(handle)
    return (found.st_dev, found.st_ino) == (opened.st_dev, opened.st_ino)


def _make_directories(directory: str) -> None:
    """Create ``directory`` and its missing parents, each made durable in its own parent."""
    if os.path.isdir(directory):
        return
    parent = os.path.dirname(directory)
    _make_directories(parent)
    try:
        os.mkdir(directory)
    except FileExistsError:
        return  # made meanwhile by another save (or a file: creating the temporary says so)
    _fsync_directory(parent)


def _fsync_directory(directory: str) -> None:
    handle = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def save_state(state: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """Write a pipeline or loader state as JSON, atomically (directories created as needed)."""
    check_json(state, os.fspath(path))
    payload = json.dumps(state, separators=(",", ":")).encode()
    write_atomically(path, lambda out: out.write(payload))


def load_state(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a state saved by ``save_state`` (plain JSON: nothing is unpickled or run)."""
    try:
        with open(path, "rb") as handle:
            state = json.loads(handle.read())
    except (OSError, ValueError, RecursionError) as error:
        raise StateError(f"{os.fspath(path)}: cannot read a state: {type(error).__name__}: {error}") from error
    if not isinstance(state, dict):
        raise StateError(f"{os.fspath(path)}: a state is a JSON object, got {type(state).__name__}")
    check_json(state, os.fspath(path))
    return state
