"""Remote files: resolve URLs (``s3://bucket/key``, globs included) or paths on a given filesystem
to a ``pyarrow.fs.FileSystem`` and the objects a source reads on it.

``s3://`` URLs are read by pyarrow's own ``S3FileSystem`` (no dependency beyond pyarrow),
configured from ``storage_options`` (fsspec's names, ``S3_OPTIONS``) over the standard AWS
environment (``AWS_ENDPOINT_URL``, ``AWS_DEFAULT_REGION``; credentials from
``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY`` or the usual AWS profile chain). Other schemes
go through fsspec (the ``s3`` extra) and the scheme's own package. Any ``pyarrow.fs.FileSystem``
(an fsspec filesystem wrapped in ``PyFileSystem(FSSpecHandler(fs))``) may be passed as
``filesystem=`` instead.

Every request goes through ``Remote.call``: transient failures (connection errors, 5xx answers,
throttling) are retried with exponential backoff and counted (``Remote.retries``), whatever the
filesystem; pyarrow's own S3 retries are switched off so that each one is seen and counted.
Every failure that is not transient, or that persists (missing object or bucket, denied access,
bad credentials), is a ``SourceError`` naming the URL and the cause.
"""

from __future__ import annotations

import calendar
import glob
import os
import random
import re
import time
from functools import partial
from typing import Any, Callable, Mapping, NamedTuple, Optional, TypeVar

import pyarrow as pa
import pyarrow.fs as pafs
import xxhash

from resumable.errors import ConfigError, SourceError
from resumable.sources.files import (
    READ_ERRORS,
    URL_SCHEME,
    Digest,
    Paths,
    expand_paths,
    globbed,
    path_patterns,
    read_error,
    with_version,
)

R = TypeVar("R")

S3_OPTIONS = ("key", "secret", "token", "endpoint_url", "region", "anon", "client_kwargs")
"""The ``storage_options`` understood for ``s3://`` (fsspec/s3fs names); ``client_kwargs`` may
hold ``endpoint_url`` and ``region_name``."""
S3_CLIENT_OPTIONS = ("endpoint_url", "region_name")
RETRY_ATTEMPTS = 6
"""Attempts per request before a transient failure becomes a ``SourceError``: with
``BACKOFF_SECONDS`` doubling, a request gives up after about 1.5 s of failures in a row, so an
endpoint that always fails is an error within seconds, not a hang."""
BACKOFF_SECONDS = 0.05
"""Wait before the first retry; doubled for each further one (with jitter), up to ``BACKOFF_CAP``."""
BACKOFF_CAP = 2.0
PERMANENT_HTTP = re.compile(r"HTTP (?:status|response code):? ?4(?!08|29)\d\d")
"""A 4xx answer other than 408 (timeout) and 429 (throttling) will not change on a retry."""
PERMANENT_MARKS = (
    "ACCESS_DENIED",
    "AccessDenied",
    "NO_SUCH",
    "NoSuch",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "INVALID_ACCESS_KEY_ID",
    "Path does not exist",
)
"""Words of pyarrow's and the stores' error messages that name a failure a retry cannot fix."""
FRESH_SECONDS = 30.0
"""Seconds during which a remote object, once checked unchanged (a request), is not checked again
(``WatchedFiles.fresh_for``): epoch starts and states taken every step cost no request each."""
EDGE_BYTES = 64 << 10
"""Bytes at each end of an object hashed into its edge digest (``Remote.edge_digest``), the
version of an object on a filesystem that reports no ETag."""
EXTRA = "pip install 'resumable[s3]'"
ETAG_PREFIX = "etag:"
"""``ObjectInfo.version`` of an object whose store reports an ETag."""


class ObjectInfo(NamedTuple):
    """What a source keys an object's index and cached blocks on."""

    size: int
    mtime_ns: int
    version: str
    """``etag:<ETag>`` where the store reports one (S3), else ``edge:<edge digest>``."""

    @property
    def bytes_key(self) -> str:
        """What identifies the object's bytes, for the blocks cached from it and the check after
        each fetch: its ETag; else its edge digest with its modification time (a rewrite of the
        middle of a file keeps its size and edges)."""
        return self.version if self.version.startswith(ETAG_PREFIX) else f"{self.version}@{self.mtime_ns}"


Head = tuple[ObjectInfo, pa.NativeFile]
"""What ``Remote.head`` returns: an object's ``ObjectInfo`` and an open file over it."""


def is_transient(error: BaseException) -> bool:
    """Whether a retry may succeed: connection errors, timeouts, 5xx, 408 and 429 answers and
    throttling are transient; missing objects, denied access and bad credentials are not."""
    if isinstance(error, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
        return False
    if not isinstance(error, (OSError, pa.ArrowException)):
        return False
    message = str(error)
    return not (PERMANENT_HTTP.search(message) or any(mark in message for mark in PERMANENT_MARKS))


class Remote:
    """The filesystem that a source's objects live on, and how to list, stat, open and read them
    by the name the source knows them by (a URL, or a path on the given filesystem), every
    request retried by ``call``. Pickles (DataLoader workers; the retry count restarts there)."""

    def __init__(self, filesystem: pafs.FileSystem) -> None:
        self.filesystem = filesystem
        self.retries = 0

    def call(self, where: str, request: Callable[[], R]) -> R:
        """``request()``, retried with backoff while it fails transiently; a ``SourceError``
        prefixed by ``where`` when it fails otherwise or ``RETRY_ATTEMPTS`` times in a row."""
        failures = 0
        while True:
            try:
                return request()
            except READ_ERRORS as error:
                failures += 1
                if failures == RETRY_ATTEMPTS or not is_transient(error):
                    raise read_error(where, error) from error
            self.retries += 1
            delay = min(BACKOFF_CAP, BACKOFF_SECONDS * 2 ** (failures - 1))
            time.sleep(delay * (0.5 + random.random() / 2))

    def stat(self, name: str, kind: str) -> tuple[int, int]:
        """``(size, mtime_ns or 0)`` of the object ``name``: a ``Stat`` for ``WatchedFiles``."""
        info = self._info(name, kind)
        mtime_ns = info.mtime_ns
        return int(info.size), int(mtime_ns) if mtime_ns is not None else 0

    def open(self, name: str, kind: str) -> pa.NativeFile:
        """A random-access file over the object ``name`` (ranged reads; on S3, opening it costs
        one HEAD request)."""
        try:
            return self.call(
                f"{kind}: cannot open {name!r}", lambda: self.filesystem.open_input_file(object_path(name))
            )
        except SourceError:
            self._info(name, kind)  # a missing bucket, object or a directory: say which
            raise

    def head(self, name: str, kind: str) -> Head:
        """The object's ``ObjectInfo`` and a random-access file over it. On S3 one request (the
        HEAD that opening costs gives size, ETag and Last-Modified); elsewhere a stat and the
        two reads of the edge digest."""
        handle = self.open(name, kind)
        metadata = handle.metadata() if hasattr(handle, "metadata") else {}
        etag, modified = metadata.get("ETag"), metadata.get("Last-Modified")
        if etag and modified:
            mtime_ns = calendar.timegm(time.strptime(modified.decode(), "%Y-%m-%dT%H:%M:%SZ")) * 10**9
            return ObjectInfo(int(handle.size()), mtime_ns, ETAG_PREFIX + etag.decode().strip('"')), handle
        size, mtime_ns = self.stat(name, kind)
        return ObjectInfo(size, mtime_ns, f"edge:{self.edge_digest(name, size, kind, handle)}"), handle

    def read_at(self, handle: pa.NativeFile, name: str, offset: int, length: int, kind: str) -> bytes:
        """``length`` bytes of the object at ``offset`` by one ranged read (retried); a
        ``SourceError`` when the object is shorter than that now."""
        data: bytes = self.call(
            f"{kind}: cannot read {name!r} at bytes {offset}-{offset + length}",
            lambda: handle.read_at(length, offset),
        )
        if len(data) != length:
            raise SourceError(f"{kind}: {name!r} changed during the run (shorter than when it was opened)")
        return data

    def open_stream(self, name: str, kind: str) -> pa.NativeFile:
        """A sequential stream over the object ``name``."""
        try:
            return self.call(
                f"{kind}: cannot open {name!r}", lambda: self.filesystem.open_input_stream(object_path(name))
            )
        except SourceError:
            self._info(name, kind)
            raise

    def edge_digest(self, name: str, size: int, kind: str, handle: pa.NativeFile | None = None) -> str:
        """XXH3-64 of the object's size and its first and last ``EDGE_BYTES`` (two ranged reads):
        with size and mtime, the version of an object on a filesystem that reports no ETag, so a
        replaced object is noticed even when its mtime (one second resolution) and size did not
        change."""
        handle = handle or self.open(name, kind)
        digest = xxhash.xxh3_64(size.to_bytes(8, "little"))
        digest.update(self.read_at(handle, name, 0, min(size, EDGE_BYTES), kind))
        if size > EDGE_BYTES:
            tail = min(size - EDGE_BYTES, EDGE_BYTES)
            digest.update(self.read_at(handle, name, size - tail, tail, kind))
        return f"{digest.intdigest():016x}"

    def digest(self, file_digest: Callable[[pa.NativeFile], Optional[str]], kind: str) -> Digest:
        """The ``Digest`` hook reading objects of this filesystem with ``file_digest``, each
        digest carrying the object's version (``files.with_version``)."""
        return partial(_object_digest, self, file_digest, kind)

    def _info(self, name: str, kind: str) -> pafs.FileInfo:
        where = f"{kind}: cannot stat {name!r}"
        info = self.call(where, lambda: self.filesystem.get_file_info(object_path(name)))
        if info.type == pafs.FileType.NotFound:
            bucket = object_path(name).split("/", 1)[0]
            found = self.call(where, lambda: self.filesystem.get_file_info(bucket))
            cause = "no such object" if found.type != pafs.FileType.NotFound else f"no such bucket {bucket!r}"
            raise SourceError(f"{kind}: cannot read {name!r}: {cause}")
        if info.type != pafs.FileType.File:
            raise SourceError(f"{kind}: {name!r} is a directory; pass an object or a glob such as '{name}/*'")
        return info

    def expand(self, patterns: list[str], kind: str) -> list[str]:
        """Names of the objects ``patterns`` mean: each glob listed once and sorted, or the one
        object a pattern names exactly (``shard[0].jsonl``), as for local files. Explicit names
        are checked when the source opens them (one request fewer per object)."""
        names: list[str] = []
        for pattern in patterns:
            if not glob.has_magic(pattern):
                names.append(pattern)
                continue
            match = URL_SCHEME.match(pattern)
            scheme = match.group(0) if match else ""
            path = object_path(pattern)
            base = path[: min(path.find(c) for c in "*?[" if c in path)].rpartition("/")[0]
            selector = pafs.FileSelector(base, allow_not_found=True, recursive=True)
            infos = self.call(f"{kind}: cannot list {pattern!r}", lambda: self.filesystem.get_file_info(selector))
            files = [info.path for info in infos if info.type == pafs.FileType.File and globbed(info.path)]
            wanted = glob_regex(path)
            matches = [path] if path in files else sorted(name for name in files if wanted.fullmatch(name))
            matches = [scheme + name for name in matches]
            if not matches:
                bucket = path.split("/", 1)[0]
                found = self.call(f"{kind}: cannot list {pattern!r}", lambda: self.filesystem.get_file_info(bucket))
                cause = f": no such bucket {bucket!r}" if found.type == pafs.FileType.NotFound else ""
                raise SourceError(f"{kind}: no objects match {pattern!r}{cause}")
            names.extend(matches)
        return names

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["retries"] = 0
        return state


def _object_digest(
    remote: Remote, file_digest: Callable[[pa.NativeFile], Optional[str]], kind: str, name: str
) -> Optional[str]:
    """``file_digest`` of the object with its version (``with_version``)."""
    info, handle = remote.head(name, kind)
    with handle:
        return with_version(file_digest(handle), info.version)


def glob_regex(pattern: str) -> re.Pattern[str]:
    """``pattern`` as a regular expression over object paths, with the meaning a local
    ``glob.glob(pattern, recursive=True)`` gives it: ``*``, ``?`` and ``[...]`` within one path
    segment, ``**`` as a whole segment for any number of directories (none included), and no
    wildcard matching a name that starts with a dot."""
    parts = pattern.split("/")
    regex = ""
    for at, part in enumerate(parts):
        last = at == len(parts) - 1
        if part == "**":
            regex += r"(?:(?!\.)[^/]+/)*" + (r"(?!\.)[^/]+" if last else "")
            continue
        regex += _segment_regex(part) + ("" if last else "/")
    return re.compile(regex)


def _segment_regex(part: str) -> str:
    """One path segment of a glob as a regular expression (``fnmatch`` rules, within ``/``)."""
    out = r"(?!\.)" if part[:1] in ("*", "?", "[") else ""
    at = 0
    while at < len(part):
        char = part[at]
        at += 1
        if char == "*":
            out += "[^/]*"
        elif char == "?":
            out += "[^/]"
        elif char == "[" and (end := part.find("]", at + (part[at : at + 1] in ("!", "]")))) != -1:
            negated = part[at] == "!"
            inner = re.sub(r"([\\\[&~|^])", r"\\\1", part[at + negated : end])  # literal in the class
            out += "[" + ("^" if negated else "") + inner + "]"
            at = end + 1
        else:
            out += re.escape(char)
    return out


def object_path(name: str) -> str:
    """The path of a URL on its filesystem (``s3://bucket/key`` -> ``bucket/key``)."""
    match = URL_SCHEME.match(name)
    return name[match.end() :] if match else name


def resolve(
    paths: Paths, kind: str, storage_options: Mapping[str, Any] | None, filesystem: Any
) -> tuple[list[str], Remote | None]:
    """The files of a source and, for remote ones, their ``Remote``: local paths (no URL, no
    ``filesystem``) are expanded as before and get None."""
    patterns = path_patterns(paths, kind)
    schemes = {match.group(0).lower() for match in map(URL_SCHEME.match, patterns) if match}
    if filesystem is None and not schemes:
        if storage_options is not None:
            raise ConfigError(f"{kind}: storage_options apply to URLs (s3://...), got local paths")
        return expand_paths(paths, kind), None
    if not patterns:
        raise SourceError(f"{kind}: no paths given")
    if filesystem is not None:
        if storage_options is not None:
            raise ConfigError(f"{kind}: pass storage_options or filesystem, not both")
        if not isinstance(filesystem, pafs.FileSystem):
            raise ConfigError(
                f"{kind}: filesystem must be a pyarrow.fs.FileSystem (wrap an fsspec filesystem in "
                f"pyarrow.fs.PyFileSystem(pyarrow.fs.FSSpecHandler(fs))), got {type(filesystem).__name__}"
            )
        remote = Remote(filesystem)
    else:
        if len(schemes) != 1 or not all(URL_SCHEME.match(pattern) for pattern in patterns):
            raise ConfigError(f"{kind}: paths mix URL schemes or URLs and local paths: {patterns!r}")
        remote = Remote(url_filesystem(schemes.pop()[: -len("://")], dict(storage_options or {}), kind))
    return remote.expand(patterns, kind), remote


def url_filesystem(scheme: str, options: dict[str, Any], kind: str) -> pafs.FileSystem:
    """The filesystem for URLs of ``scheme``: pyarrow's S3 for ``s3``, fsspec's otherwise."""
    if scheme == "s3":
        return s3_filesystem(options, kind)
    try:
        import fsspec

        handler = pafs.FSSpecHandler(fsspec.filesystem(scheme, **options))
    except ImportError as error:
        raise ConfigError(
            f"{kind}: {scheme}:// URLs need fsspec and its {scheme!r} implementation ({EXTRA}, then the "
            f"package fsspec names): {error}"
        ) from error
    except ValueError as error:  # fsspec: unknown protocol
        raise ConfigError(f"{kind}: no filesystem for {scheme}:// URLs: {error}") from error
    return pafs.PyFileSystem(handler)


def s3_filesystem(options: dict[str, Any], kind: str) -> pafs.S3FileSystem:
    """pyarrow's ``S3FileSystem`` from fsspec-named ``options`` over the AWS environment."""
    unknown = sorted(set(options) - set(S3_OPTIONS))
    client = dict(options.pop("client_kwargs", None) or {})
    unknown += sorted(f"client_kwargs.{name}" for name in set(client) - set(S3_CLIENT_OPTIONS))
    if unknown:
        raise ConfigError(f"{kind}: storage_options {unknown} are not understood for s3://; use {S3_OPTIONS}")
    environ = os.environ
    endpoint = (
        options.get("endpoint_url")
        or client.get("endpoint_url")
        or environ.get("AWS_ENDPOINT_URL_S3")
        or environ.get("AWS_ENDPOINT_URL")
    )
    region = options.get("region") or client.get("region_name")
    region = region or environ.get("AWS_REGION") or environ.get("AWS_DEFAULT_REGION")
    # One attempt per request: Remote.call retries, counts and backs off (pyarrow's own
    # strategy would hide the retries, and does not retry every transient answer).
    settings: dict[str, Any] = {"retry_strategy": pafs.AwsStandardS3RetryStrategy(max_attempts=1)}
    if endpoint:
        scheme, _, host = str(endpoint).rpartition("://")
        settings["endpoint_override"] = host or str(endpoint)
        settings["scheme"] = scheme or "https"
    if region:
        settings["region"] = str(region)
    if options.get("anon"):
        settings["anonymous"] = True
    for name, setting in (("key", "access_key"), ("secret", "secret_key"), ("token", "session_token")):
        if options.get(name) is not None:
            settings[setting] = str(options[name])
    try:
        return pafs.S3FileSystem(**settings)
    except (ValueError, TypeError, pa.ArrowException) as error:
        raise ConfigError(f"{kind}: bad storage_options for s3://: {error}") from error
