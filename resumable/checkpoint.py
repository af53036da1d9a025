"""Checkpoint files written atomically, and states saved as plain JSON.

A crash (SIGKILL, power loss) during a save leaves the previous file intact: the new content
goes to a temporary file in the same directory, is flushed and fsynced, then renamed over the
old one, and the directory is fsynced so the rename itself is durable.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import IO, Any, Callable

from resumable.errors import StateError
from resumable.state import check_json


def write_atomically(path: str | os.PathLike[str], write: Callable[[IO[bytes]], object]) -> None:
    """Call ``write`` on a temporary file, then put it at ``path`` in one atomic rename."""
    target = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(target))
    handle, temp = tempfile.mkstemp(prefix=f".{os.path.basename(target)}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(handle, "wb") as out:
            write(out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temp, target)
    except BaseException:
        if os.path.exists(temp):
            os.unlink(temp)
        raise
    directory_handle = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(directory_handle)
    finally:
        os.close(directory_handle)


def save_state(state: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """Write a pipeline or loader state as JSON, atomically."""
    check_json(state, os.fspath(path))
    payload = json.dumps(state, separators=(",", ":")).encode()
    write_atomically(path, lambda out: out.write(payload))


def load_state(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a state saved by ``save_state`` (plain JSON: nothing is unpickled or run)."""
    try:
        with open(path, "rb") as handle:
            state = json.loads(handle.read())
    except (OSError, ValueError) as error:
        raise StateError(f"{os.fspath(path)}: cannot read a state: {error}") from error
    if not isinstance(state, dict):
        raise StateError(f"{os.fspath(path)}: a state is a JSON object, got {type(state).__name__}")
    return state
