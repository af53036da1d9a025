"""File lists: expand paths and globs into a sorted, validated list of files."""

from __future__ import annotations

import glob
import os
from typing import Sequence, Union

from resumable.errors import SourceError

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
