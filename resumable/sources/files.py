"""Files of a source: expanding paths and globs, fingerprints, and the checks that a file is still
the one a pipeline was built on (during a run) and the one a state was taken over (on restore).

A fingerprint is ``[path, size, mtime_ns, digest]``. The digest is a cheap content digest where
the format has one (``None`` where it has not): it lets a file whose mtime changed but whose
content did not (``touch``, a ``cp`` without ``-p``) still restore. States saved before digests
existed hold ``[path, size, mtime_ns]`` and still load when size and mtime match.
"""

from __future__ import annotations

import contextlib
import glob
import math
import os
import re
import time
import zlib
from collections import Counter
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import pyarrow as pa

from resumable.core.state import require, short_repr
from resumable.errors import ConfigError, SourceError, StateError
from resumable.sources._sidecar import LOCK_SUFFIX, SIDECAR_SUFFIX

PathLike = Union[str, "os.PathLike[str]"]
Paths = Union[PathLike, Sequence[PathLike]]

URL_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
"""A path that starts with a scheme (``s3://``, ``gs://``) is a URL, not a local path."""

FILES = "files"
"""State key of a source's fingerprints."""

Fingerprint = list[Any]
"""``[path, size, mtime_ns, digest or None]``: a list, as a JSON state holds it."""
Digest = Callable[[str], Optional[str]]
"""The content digest of the file at a path, or None where the format has no cheap one."""
Stat = Callable[[str, str], tuple[int, int]]
"""``(size, mtime_ns)`` of the file at a path (the second argument: the source kind, for errors);
``SourceError`` when it is gone or unreadable. Local files by default, objects for remote ones."""

VERSION_SEPARATOR = "|"
"""In a remote object's digest, between the content digest and the object's version (its ETag):
``content|etag:...``. Two remote digests must agree whole; a local one and a remote one only on
the content (a state saved over a local copy restores over the uploaded object)."""

NAME, SIZE, MTIME_NS, DIGEST = range(4)
"""Positions of a fingerprint's entries."""
LEGACY_FINGERPRINT_LENGTH = 3
"""``[path, size, mtime_ns]``: the fingerprints of states saved before content digests."""

READ_ERRORS = (OSError, EOFError, zlib.error, pa.ArrowException, UnicodeDecodeError)
"""What reading a data file can raise (I/O, truncated or corrupt compression, corrupt Arrow or
Parquet data, invalid UTF-8); ``reading`` turns them into ``SourceError``."""

WATCH_INTERVAL = 0.1
"""Least seconds between two files checked by ``watch``: a training loop's ``get_state()``
checks one file per call, and a read-ahead (prefetch, a parallel map), which takes a state after
every item, one file ten times a second at most."""

REMEDY = (
    "restore the file's content (the last state saved before the change resumes over it), or start "
    "a new run over the new data by building the pipeline without restoring a state"
)


def path_patterns(paths: Any, kind: str) -> list[str]:
    """``paths`` (a path or glob, or a list or tuple of them) as a list of strings; anything
    else (None, a number, bytes, a list holding one) is a ``ConfigError``."""
    items = [paths] if isinstance(paths, (str, os.PathLike)) else paths
    if isinstance(items, (list, tuple)):
        patterns = [os.fspath(item) if isinstance(item, (str, os.PathLike)) else item for item in items]
        if all(isinstance(pattern, str) for pattern in patterns):
            return patterns
    raise ConfigError(f"{kind}: paths must be a path or glob, or a list of them (str or os.PathLike), got {paths!r}")


OWN_FILES = (SIDECAR_SUFFIX, SIDECAR_SUFFIX + LOCK_SUFFIX)
DATASET_SUMMARIES = ("_metadata", "_common_metadata", "_SUCCESS")
"""Files a dataset directory holds beside its parts (Spark, Dask and pyarrow write them): Parquet
summaries of the other files' footers and Spark's empty success marker, no data of their own."""


def globbed(name: str) -> bool:
    """Whether a glob's match is read: not a file this library writes beside data files, nor
    a dataset directory's summary (``DATASET_SUMMARIES``), as pyarrow's own discovery skips."""
    return not name.endswith(OWN_FILES) and name.rpartition("/")[2] not in DATASET_SUMMARIES


"""Endings of the files this library writes beside data files (line indices): never data, so
a glob such as ``data/*`` leaves them out."""


def expand_paths(paths: Paths, kind: str) -> list[str]:
    """Expand globs (sorted, so every process agrees on the order; the line indices this library
    writes beside data files left out) and check each file exists.

    Explicit paths keep the order given; globs leave out a Parquet dataset's summary files
    and Spark's success marker (``DATASET_SUMMARIES``). A glob that matches nothing, a missing file or a
    directory raises SourceError naming it, and so does a match that is a symbolic link to a
    missing file (a shard on a volume that is not mounted: left out, the epoch would silently
    lack it). A path that names an existing file is that file, even where its name reads as a
    glob (``shard[0].jsonl``).
    """
    patterns = path_patterns(paths, kind)
    if not patterns:
        raise SourceError(f"{kind}: no paths given")
    files: list[str] = []
    for pattern in patterns:
        if URL_SCHEME.match(pattern):
            raise ConfigError(
                f"{kind}: {pattern!r} is a URL; remote files are read by rs.jsonl, rs.jsonl_stream, rs.parquet "
                "and rs.arrow (with storage_options= or filesystem=)"
            )
        if os.path.isfile(pattern):
            files.append(pattern)
        elif glob.has_magic(pattern):
            found = sorted(glob.glob(pattern, recursive=True))
            dangling = [match for match in found if os.path.islink(match) and not os.path.exists(match)]
            if dangling:
                raise SourceError(
                    f"{kind}: {dangling[0]!r}, which {pattern!r} matches, is a symbolic link to a missing file"
                )
            matches = [match for match in found if os.path.isfile(match) and globbed(match)]
            if not matches:
                raise SourceError(f"{kind}: no files match {pattern!r}")
            files.extend(matches)
        elif os.path.isdir(pattern):
            raise SourceError(f"{kind}: {pattern!r} is a directory; pass a file or a glob such as '{pattern}/*'")
        else:
            raise SourceError(f"{kind}: no such file {pattern!r}")
    return files


def read_error(where: str, error: BaseException) -> SourceError:
    """The ``SourceError`` for ``error`` (one of ``READ_ERRORS``), prefixed by ``where``: what
    could not be read, naming the file and the line, row group or batch where known."""
    return SourceError(f"{where}: {type(error).__name__}: {error}")


@contextlib.contextmanager
def reading(where: str) -> Iterator[None]:
    """Turn an I/O or format error raised while reading a data file into ``read_error``."""
    try:
        yield
    except READ_ERRORS as error:
        raise read_error(where, error) from error


class FileGone(SourceError):
    """A data file that can no longer be stat'ed (removed, or its directory unreadable): a
    source that skips what it cannot read (``on_error="skip"``) skips it too."""


def stat(path: str, kind: str) -> os.stat_result:
    """``os.stat(path)``, or ``FileGone`` naming the file when it is gone or unreadable."""
    try:
        return os.stat(path)
    except OSError as error:
        raise FileGone(f"{kind}: cannot stat {path!r}: {error}") from error


def local_stat(path: str, kind: str) -> tuple[int, int]:
    """``(size, mtime_ns)`` of a local file: the default ``Stat``."""
    info = stat(path, kind)
    return info.st_size, info.st_mtime_ns


def fingerprint(path: str, digest: Digest, kind: str, size_mtime: Stat = local_stat) -> Fingerprint:
    """``[path, size, mtime_ns, digest]`` of the file at ``path``."""
    size, mtime_ns = size_mtime(path, kind)
    with reading(f"{kind}: cannot read {path!r}"):
        content = digest(path)
    return [path, size, mtime_ns, content]


class WatchedFiles:
    """The files a source reads, fingerprinted when the pipeline was built, and the checks that
    they stay those files.

    * ``check_state``: on restore, each file must be the one the state was taken over: same name,
      size and mtime, or same size and content digest (``StateError`` otherwise).
    * ``watch`` (``get_state``: one file, round robin, a ``stat``, at most every
      ``WATCH_INTERVAL`` seconds), ``check_all`` (every epoch start) and ``check`` (before reading
      a file): a file that changed during the run is a ``SourceError``. A changed mtime alone
      is accepted when the digest still matches, and the new mtime is recorded so that the
      digest is computed once per change.
    """

    def __init__(
        self,
        kind: str,
        fingerprints: list[Fingerprint],
        digest: Digest,
        size_mtime: Stat = local_stat,
        fresh_for: float = 0.0,
    ) -> None:
        self.kind = kind
        self.fingerprints = fingerprints
        self._digest = digest
        self._stat = size_mtime
        self._fresh_for = fresh_for
        """Seconds during which a file checked (or fingerprinted) is not checked again: 0 for
        local files (a ``stat`` is cheap), more for remote objects (a request each)."""
        self._checked = [time.monotonic()] * len(fingerprints)
        self._next_watched = 0
        self._last_watch = -math.inf

    @classmethod
    def of(
        cls, kind: str, paths: Sequence[str], digest: Digest, size_mtime: Stat = local_stat, fresh_for: float = 0.0
    ) -> WatchedFiles:
        """Fingerprint ``paths`` now (local files, or through ``size_mtime`` and ``digest``)."""
        fingerprints = [fingerprint(path, digest, kind, size_mtime) for path in paths]
        return cls(kind, fingerprints, digest, size_mtime, fresh_for)

    def size(self, file: int) -> int:
        """The size of file ``file`` when the pipeline was built."""
        return int(self.fingerprints[file][SIZE])

    # -- during the run: SourceError ------------------------------------------------------------

    def watch(self) -> None:
        """Check one file (round robin; none if one was checked less than ``WATCH_INTERVAL``
        seconds ago), as a state is taken."""
        now = time.monotonic()
        if self.fingerprints and now - self._last_watch >= WATCH_INTERVAL:
            self._last_watch = now
            file = self._next_watched
            self._next_watched = (file + 1) % len(self.fingerprints)
            self.check(file)

    def check_all(self) -> None:
        """Check every file (at an epoch start)."""
        for file in range(len(self.fingerprints)):
            self.check(file)

    def check(self, file: int) -> None:
        """Raise ``SourceError`` if file ``file`` changed since the pipeline was built (unless it
        was checked less than ``fresh_for`` seconds ago)."""
        now = time.monotonic()
        if self._fresh_for and now - self._checked[file] < self._fresh_for:
            return
        recorded = self.fingerprints[file]
        path = recorded[NAME]
        size, mtime_ns = self._stat(path, self.kind)
        if size != recorded[SIZE] or mtime_ns != recorded[MTIME_NS]:
            self.confirm(file, size, mtime_ns, lambda: self._digest(path))
        self._checked[file] = now

    def check_opened(self, file: int, descriptor: int) -> None:
        """After opening local file ``file`` (``descriptor``, checked before the open): raise
        ``SourceError`` unless what was opened is what the path names now, unchanged. A file
        replaced between the check and the open, then put back with its size and mtime, would
        otherwise leave the reader with the replaced bytes while every later check passes."""
        self.check_stat(file, os.fstat(descriptor))

    def check_stat(self, file: int, opened: os.stat_result) -> None:
        """``check_opened`` given the ``os.stat_result`` of what was opened (a ``MappedFile``'s)."""
        path = self.fingerprints[file][NAME]
        with reading(f"{self.kind}: cannot read {path!r}"):
            current = os.stat(path)
        if (opened.st_dev, opened.st_ino) != (current.st_dev, current.st_ino):
            raise SourceError(f"{self.kind}: file {path!r} was replaced while it was opened; {REMEDY}")
        self.confirm(file, opened.st_size, opened.st_mtime_ns, lambda: self._digest(path))

    def confirm(self, file: int, size: int, mtime_ns: int, digest: Callable[[], str | None]) -> None:
        """Raise ``SourceError`` unless ``size``, ``mtime_ns`` (and, when only the mtime differs,
        ``digest()``) describe the file ``file`` the pipeline was built on."""
        recorded = self.fingerprints[file]
        if size == recorded[SIZE] and mtime_ns == recorded[MTIME_NS]:
            return
        if size != recorded[SIZE]:
            change = f"its size went from {recorded[SIZE]} to {size} bytes"
        elif recorded[DIGEST] is None:
            change = f"its mtime went from {recorded[MTIME_NS]} to {mtime_ns} ns and this format has no content digest"
        else:
            with reading(f"{self.kind}: cannot read {recorded[NAME]!r}"):
                current = digest()
            if current == recorded[DIGEST]:
                self._record_mtime(file, mtime_ns)
                return
            change = f"its mtime went from {recorded[MTIME_NS]} to {mtime_ns} ns and its content differs"
        raise SourceError(f"{self.kind}: file {recorded[NAME]!r} changed during the run ({change}); {REMEDY}")

    def _record_mtime(self, file: int, mtime_ns: int) -> None:
        """Accept a new mtime for unchanged content. Copy on write: states already handed out
        keep the list they were given."""
        updated = list(self.fingerprints[file])
        updated[MTIME_NS] = mtime_ns
        fingerprints = list(self.fingerprints)
        fingerprints[file] = updated
        self.fingerprints = fingerprints

    # -- on restore: StateError -----------------------------------------------------------------

    def check_state(self, saved: Any, path: str) -> None:
        """Reject a state saved over other files. Names must match (directories may differ, so
        a job that stages its data into a per-job directory still resumes), and so must sizes;
        mtimes too, unless both fingerprints hold the same content digest."""
        current = self.fingerprints
        if saved == current:  # the common case, at the cost of one comparison
            return
        if not isinstance(saved, list):
            raise StateError(f"{path}: malformed file fingerprints {short_repr(saved)}")
        if len(saved) != len(current):
            names = [os.path.basename(_parse(entry, path)[NAME]) for entry in saved]
            raise StateError(
                f"{path}: state was saved over {len(saved)} files, this source has {len(current)}"
                f"{_files_apart(names, [os.path.basename(now[NAME]) for now in current])}"
            )
        for saved_file, now in zip(saved, current):
            old = _parse(saved_file, path)
            if os.path.basename(old[NAME]) != os.path.basename(now[NAME]):
                raise StateError(f"{path}: state was saved over file {old[NAME]!r} where this source has {now[NAME]!r}")
            old_digest, new_digest = comparable(old[DIGEST], now[DIGEST])
            same_digest = same_content(old_digest, new_digest)
            known_other = old_digest is not None and new_digest is not None and not same_digest
            if old[SIZE] == now[SIZE] and not known_other and (old[MTIME_NS] == now[MTIME_NS] or same_digest):
                continue
            if old[SIZE] != now[SIZE]:
                change = f"size {old[SIZE]} -> {now[SIZE]} bytes"
            elif known_other:
                change = "same size, other content digest"
            else:
                change = f"same size, mtime_ns {old[MTIME_NS]} -> {now[MTIME_NS]} and no content digest to compare"
            raise StateError(
                f"{path}: file {now[NAME]!r} differs from the file the state was taken over ({change}); "
                "restore that file (cp -p and rsync -a keep mtimes), or build the pipeline over the new data "
                "without restoring this state"
            )


def with_version(content: str | None, version: str) -> str:
    """A remote object's digest: its content digest and its version (``VERSION_SEPARATOR``)."""
    return f"{content}{VERSION_SEPARATOR}{version}"


RETIRED_DIGESTS = ("gzip-trailer:",)
"""Digest kinds states saved by earlier versions may hold that this version no longer makes (a
gzip file's bare trailer: the padding's zeros, for a zero-padded file)."""


def comparable(old: str | None, new: str | None) -> tuple[str | None, str | None]:
    """Two digests as they compare: as they are, or neither where the saved one is of a kind
    this version no longer makes (as if the state held none: the mtime must match)."""
    if old is not None and old.startswith(RETIRED_DIGESTS):
        return None, new
    return old, new


def same_content(old: str | None, new: str | None) -> bool:
    """Whether two digests name the same content: equal, or, where only one of them carries an
    object version, equal content digests."""
    if old is None or new is None:
        return False
    if (VERSION_SEPARATOR in old) == (VERSION_SEPARATOR in new):
        return old == new
    return old.split(VERSION_SEPARATOR, 1)[0] == new.split(VERSION_SEPARATOR, 1)[0]


FILES_NAMED = 5
"""How many of the files a restore finds added or missing its error names."""


def _files_apart(saved: list[str], current: list[str]) -> str:
    """What differs between the file names a state was saved over and those of this source: the
    files missing and those new, a few of each by name (a glob over thousands of shards that
    found one more or one fewer)."""
    parts = []
    for what, names in (
        ("missing here", Counter(saved) - Counter(current)),
        ("new here", Counter(current) - Counter(saved)),
    ):
        listed = sorted(names.elements())
        if listed:
            more = f" and {len(listed) - FILES_NAMED} more" if len(listed) > FILES_NAMED else ""
            parts.append(f"{what}: {', '.join(map(repr, listed[:FILES_NAMED]))}{more}")
    return f" ({'; '.join(parts)})" if parts else ""


def _parse(saved: Any, path: str) -> Fingerprint:
    """A saved fingerprint as ``[path, size, mtime_ns, digest]``; StateError if malformed."""
    if (
        isinstance(saved, list)
        and len(saved) in (LEGACY_FINGERPRINT_LENGTH, DIGEST + 1)
        and isinstance(saved[NAME], str)
        and all(isinstance(v, int) and not isinstance(v, bool) for v in saved[SIZE : MTIME_NS + 1])
        and (len(saved) == LEGACY_FINGERPRINT_LENGTH or saved[DIGEST] is None or isinstance(saved[DIGEST], str))
    ):
        return saved if len(saved) > LEGACY_FINGERPRINT_LENGTH else [*saved, None]
    raise StateError(f"{path}: malformed file fingerprint {short_repr(saved)}")


class WatchedIdentity:
    """What a node over ``_files`` saves as its identity (their fingerprints), checks on a
    restore and watches as states are taken (``Node._watch``): one mechanism for the indexed
    file sources and the streams. A mixin, placed before the node class it completes."""

    _files: WatchedFiles

    def _identity(self) -> dict[str, Any]:
        return {FILES: self._files.fingerprints}

    def _header_key(self) -> object:
        return self._files.fingerprints  # a new list when a recorded mtime changes

    def _watch(self) -> None:
        self._files.watch()

    def _check_identity(self, state: dict[str, Any], path: str) -> None:
        self._files.check_state(require(state, FILES, list, path), path)
