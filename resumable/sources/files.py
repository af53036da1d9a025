"""File lists: expand paths and globs into a sorted, validated list of files."""

from __future__ import annotations

import glob
import os
from typing import Any, Sequence, Union

from resumable.errors import SourceError, StateError

PathLike = Union[str, "os.PathLike[str]"]
Paths = Union[PathLike, Sequence[PathLike]]


def expand_paths(paths: Paths, kind: str) -> list[str]:
    """Expand globs (sorted, so every process agrees on the order) and check each file exists.

    Explicit paths keep the order given; a glob that matches nothing, a missing file or a
    directory raises SourceError naming it.
    """
    patterns = [os.fspath(paths)] if isinstance(paths, (str, os.PathLike)) else [os.fspath(p) for p in paths]
    if not patterns:
        raise SourceError(f"{kind}: no paths given")
    files: list[str] = []
    for pattern in patterns:
        if glob.has_magic(pattern):
            matches = sorted(match for match in glob.glob(pattern, recursive=True) if os.path.isfile(match))
            if not matches:
                raise SourceError(f"{kind}: no files match {pattern!r}")
            files.extend(matches)
        elif os.path.isdir(pattern):
            raise SourceError(f"{kind}: {pattern!r} is a directory; pass a file or a glob such as '{pattern}/*'")
        elif not os.path.isfile(pattern):
            raise SourceError(f"{kind}: no such file {pattern!r}")
        else:
            files.append(pattern)
    return files


Fingerprint = list  # [path, size, mtime_ns], JSON-friendly


def fingerprint(path: str) -> Fingerprint:
    """``[path, size, mtime_ns]``: identifies a file's content cheaply."""
    info = os.stat(path)
    return [path, info.st_size, info.st_mtime_ns]


def check_fingerprints(saved: Any, current: list[Fingerprint], path: str) -> None:
    """Reject a state saved over other files. Names, sizes and mtimes must match; directories
    may differ, so a job that stages its data into a per-job directory still resumes."""
    if not isinstance(saved, list) or len(saved) != len(current):
        count = len(saved) if isinstance(saved, list) else saved
        raise StateError(f"{path}: state was saved over {count} files, this source has {len(current)}")
    for saved_file, (name, size, mtime_ns) in zip(saved, current):
        if not (isinstance(saved_file, list) and len(saved_file) == 3 and isinstance(saved_file[0], str)):
            raise StateError(f"{path}: malformed file fingerprint {saved_file!r}")
        if os.path.basename(saved_file[0]) != os.path.basename(name):
            raise StateError(f"{path}: state was saved over file {saved_file[0]!r} where this source has {name!r}")
        if (saved_file[1], saved_file[2]) != (size, mtime_ns):
            raise StateError(
                f"{path}: file {name!r} changed since the state was saved "
                f"(size {saved_file[1]} -> {size}, mtime_ns {saved_file[2]} -> {mtime_ns})"
            )
