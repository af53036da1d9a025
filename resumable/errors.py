"""Typed errors. Validation never uses ``assert``: asserts vanish under ``python -O``."""

from __future__ import annotations

from typing import Any


class ResumableError(Exception):
    """Base class of every error raised by resumable."""


class ConfigError(ResumableError, ValueError):
    """A node was built with invalid options (raised at construction, not during iteration)."""


class SourceError(ResumableError):
    """A data file is missing, empty, changed or holds a malformed record."""


class StateError(ResumableError):
    """A state does not belong to this pipeline: other node kind, version, options or files."""


class ResumableWarning(UserWarning):
    """Base class of every warning resumable issues: a file it keeps beside the data or in a
    cache directory cannot be used, and it goes on without (``warnings.filterwarnings`` can
    silence or raise them all)."""


class SidecarWarning(ResumableWarning):
    """A sidecar could not be used: none was writable (the index lives in memory and is rebuilt
    next time), or one was corrupt (it was rebuilt)."""


class CacheWarning(ResumableWarning):
    """The cache directory cannot be written: records are cached in memory only."""


class ChunkCacheWarning(ResumableWarning):
    """The chunk cache directory cannot be written: this process reads without the disk tier."""


class BarrenEpochWarning(ResumableWarning):
    """A streaming filter or a packer has kept nothing of a whole epoch of an endless upstream
    (``repeat()``, a restarting mix): if it keeps nothing at all, it reads for ever."""


class MapError(ResumableError):
    """A function given to the pipeline (a map's ``fn``, a filter's predicate, a batch's
    ``collate_fn``) raised on a record where its exception cannot reach the caller as it is: in
    a parallel map's pool, or a ``StopIteration``, which would read as the end of the epoch.
    Names the node and the record's key (``key``, None where unknown) and chains the original
    exception (``__cause__``)."""

    def __init__(self, message: str, key: Any = None) -> None:
        super().__init__(message)
        self.key = key

    def __reduce__(self) -> tuple[type[MapError], tuple[str, Any]]:
        """Pickled with its key (a DataLoader worker or a process pool sends it back)."""
        return type(self), (str(self), self.key)


def stop_error(where: str, key: Any, stop: StopIteration) -> MapError:
    """The ``MapError`` that replaces ``stop``, a ``StopIteration`` raised by a user function
    (``where``: the node and which function) on the record with ``key``: raised as it is, it
    would end the epoch silently (the reason of PEP 479 for generators)."""
    record = "" if key is None else f" on the record with key {key}"
    error = MapError(
        f"{where} raised StopIteration{record}; it is raised as this error, as it would otherwise end "
        "the epoch silently",
        key,
    )
    error.__cause__ = stop
    return error
