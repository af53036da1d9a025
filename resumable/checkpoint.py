"""Checkpoint files written atomically, and states saved as plain JSON.

A crash (SIGKILL, power loss) during a save leaves the previous file intact: the new content
goes to a temporary file in the same directory, is flushed and fsynced, then renamed over the
old one, and the directory is fsynced so the rename itself is durable.

Each target has one temporary, ``.NAME.partial`` beside it, which its writer holds locked
(``flock``) until the rename. A save that finds it unlocked knows its writer died and removes
it first, so a crash never leaves more than one behind, and only until the next save; a save
that finds it locked waits its turn. The lock lives with the open file, so the kernel drops it
whenever its writer dies (a process forked meanwhile closes its copy: ``_file_locks``). Where
the file system has no locks, each save writes a temporary of its own
(``.NAME.<random>.partial``) and crashed saves' temporaries stay.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import secrets
from typing import IO, Any, Callable

from resumable._file_locks import close_lock, lock, open_for_lock
from resumable.core.state import check_json
from resumable.errors import StateError

TEMP_SUFFIX = ".partial"
NEW_FILE_MODE = 0o666  # what the umask leaves of it, as for open() and torch.save


def write_atomically(path: str | os.PathLike[str], write: Callable[[IO[bytes]], object]) -> None:
    """Call ``write`` on a temporary file, then put it at ``path`` in one atomic rename.

    Missing directories are created. The file's mode is what the umask leaves of 0o666.
    """
    given = os.fsdecode(os.fspath(path))  # bytes paths too, decoded as the OS does
    if given.endswith((os.sep, os.altsep or os.sep)):  # names a directory, as open(path, "w") says
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), given)
    target = os.path.abspath(given)
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
        close_lock(handle)
    _fsync_directory(directory)


def _claim_temp(directory: str, name: str) -> tuple[int, str]:
    """Create this save's temporary for the target ``name`` and lock it: ``(descriptor, path)``.

    Whoever holds the lock on the file *at the path* owns it. A file found there and locked by
    nobody belongs to a writer that died, or to one that has not locked it yet: either way it
    is removed, and that writer, seeing its file gone from the path, starts again.
    """
    temp = os.path.join(directory, _temp_name(directory, name, ""))
    while True:
        try:
            handle, created = _create(temp), True
        except FileExistsError:
            try:  # only to lock it; a symbolic link is never a save's temporary
                handle, created = open_for_lock(temp, os.O_RDONLY | os.O_NOFOLLOW), False
            except FileNotFoundError:
                continue  # renamed into place or removed meanwhile
            except OSError as error:
                if error.errno != errno.ELOOP:
                    raise
                os.unlink(temp)  # the link itself (dangling or not), never what it names
                continue
        try:
            locked = lock(handle)  # waits while another save of the target writes
            if locked and _is_at(handle, temp):
                if created:
                    return handle, temp
                os.unlink(temp)  # left by a writer that died: a live one would hold the lock
        except BaseException:
            close_lock(handle)  # never left open and locked: the next save of this target would wait for ever
            raise
        close_lock(handle)
        if not locked:  # a file system without locks
            if created:
                os.unlink(temp)
            return _claim_unique_temp(directory, name)


def _temp_name(directory: str, name: str, unique: str) -> str:
    """The name of a temporary for the target ``name`` (``unique`` after it, if any): hidden
    beside it, or, where that would be longer than the directory allows, named by a digest of
    ``name`` (the same for every save of the target)."""
    tail = f".{unique}{TEMP_SUFFIX}" if unique else TEMP_SUFFIX
    temp = f".{name}{tail}"
    try:
        longest = os.pathconf(directory, "PC_NAME_MAX")
    except (OSError, ValueError):
        longest = 255
    if len(os.fsencode(temp)) <= longest:
        return temp
    return f".{hashlib.sha256(os.fsencode(name)).hexdigest()[:32]}{tail}"


def _claim_unique_temp(directory: str, name: str) -> tuple[int, str]:
    """A temporary nobody else can name, for file systems without locks (never swept)."""
    while True:
        temp = os.path.join(directory, _temp_name(directory, name, secrets.token_hex(4)))
        try:
            return _create(temp), temp
        except FileExistsError:
            continue


def _create(path: str) -> int:
    return open_for_lock(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, NEW_FILE_MODE)


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
    where = os.fsdecode(os.fspath(path))
    if not isinstance(state, dict):  # what load_state would refuse is never written over a good file
        raise StateError(f"{where}: a state is a JSON object, got {type(state).__name__}")
    check_json(state, where)
    try:  # NaN and Infinity are not JSON (other readers of the file would refuse it), nor is an
        # int past Python's digit limit for str()
        payload = json.dumps(state, separators=(",", ":"), allow_nan=False).encode()
    except ValueError as error:
        raise StateError(f"{where}: JSON cannot write this state ({error})") from error
    write_atomically(path, lambda out: out.write(payload))


def load_state(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a state saved by ``save_state`` (plain JSON: nothing is unpickled or run)."""
    if not isinstance(path, (str, bytes, os.PathLike)):  # an int would be read, and closed, as a descriptor
        raise TypeError(f"load_state: expected a path, got {type(path).__name__}")
    where = os.fsdecode(os.fspath(path))
    try:
        with open(path, "rb") as handle:
            state = json.loads(handle.read())
    except (OSError, ValueError, RecursionError) as error:
        raise StateError(f"{where}: cannot read a state: {type(error).__name__}: {error}") from error
    if not isinstance(state, dict):
        raise StateError(f"{where}: a state is a JSON object, got {type(state).__name__}")
    check_json(state, where)
    return state
