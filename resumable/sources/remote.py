"""Remote files: resolve URLs (``s3://bucket/key``, globs included) or paths on a given filesystem
to a ``pyarrow.fs.FileSystem`` and the objects a source reads on it.

``s3://`` URLs are read by pyarrow's own ``S3FileSystem`` (no dependency beyond pyarrow),
configured from ``storage_options`` (fsspec's names, ``S3_OPTIONS``) over the standard AWS
environment (``AWS_ENDPOINT_URL``, ``AWS_DEFAULT_REGION``; credentials from
``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY`` or the usual AWS profile chain), with pyarrow's
standard retry strategy for transient errors. Other schemes go through fsspec (the ``s3`` extra)
and the scheme's own package. Any ``pyarrow.fs.FileSystem`` (an fsspec filesystem wrapped in
``PyFileSystem(FSSpecHandler(fs))``) may be passed as ``filesystem=`` instead.

Every failure to list, stat or open an object (missing object or bucket, denied access, bad
credentials) is a ``SourceError`` naming the URL and the cause.
"""

from __future__ import annotations

import fnmatch
import glob
import os
from functools import partial
from typing import Any, Callable, Mapping, Optional

import pyarrow as pa
import pyarrow.fs as pafs

from resumable.errors import ConfigError, SourceError
from resumable.sources.files import URL_SCHEME, Digest, Paths, expand_paths, reading

S3_OPTIONS = ("key", "secret", "token", "endpoint_url", "region", "anon", "client_kwargs")
"""The ``storage_options`` understood for ``s3://`` (fsspec/s3fs names); ``client_kwargs`` may
hold ``endpoint_url`` and ``region_name``."""
S3_CLIENT_OPTIONS = ("endpoint_url", "region_name")
S3_RETRY_ATTEMPTS = 5
"""Attempts per request (pyarrow's ``AwsStandardS3RetryStrategy``: exponential backoff on
connection errors, 5xx answers and throttling) before a read fails."""
EXTRA = "pip install 'resumable[s3]'"


class Remote:
    """The filesystem that a source's objects live on, and how to stat and open them by the name
    the source knows them by (a URL, or a path on the given filesystem). Pickles (workers)."""

    def __init__(self, filesystem: pafs.FileSystem) -> None:
        self.filesystem = filesystem

    def stat(self, name: str, kind: str) -> tuple[int, int]:
        """``(size, mtime_ns or 0)`` of the object ``name``: a ``Stat`` for ``WatchedFiles``."""
        info = self._info(name, kind)
        mtime_ns = info.mtime_ns
        return int(info.size), int(mtime_ns) if mtime_ns is not None else 0

    def open(self, name: str, kind: str) -> pa.NativeFile:
        """A random-access file over the object ``name`` (ranged reads)."""
        with reading(f"{kind}: cannot open {name!r}"):
            return self.filesystem.open_input_file(object_path(name))

    def digest(self, file_digest: Callable[[pa.NativeFile], Optional[str]], kind: str) -> Digest:
        """The ``Digest`` hook reading objects of this filesystem with ``file_digest``."""
        return partial(_object_digest, self, file_digest, kind)

    def _info(self, name: str, kind: str) -> pafs.FileInfo:
        with reading(f"{kind}: cannot stat {name!r}"):
            info = self.filesystem.get_file_info(object_path(name))
        if info.type == pafs.FileType.NotFound:
            bucket = object_path(name).split("/", 1)[0]
            with reading(f"{kind}: cannot stat {name!r}"):
                missing = self.filesystem.get_file_info(bucket).type == pafs.FileType.NotFound
            cause = f"no such bucket (or top directory) {bucket!r}" if missing else "no such object"
            raise SourceError(f"{kind}: cannot read {name!r}: {cause}")
        if info.type != pafs.FileType.File:
            raise SourceError(f"{kind}: {name!r} is a directory; pass an object or a glob such as '{name}/*'")
        return info

    def expand(self, patterns: list[str], kind: str) -> list[str]:
        """Names of the objects ``patterns`` mean: each glob listed once and sorted, each
        explicit name checked to exist."""
        names: list[str] = []
        for pattern in patterns:
            if not glob.has_magic(pattern):
                self._info(pattern, kind)
                names.append(pattern)
                continue
            match = URL_SCHEME.match(pattern)
            scheme = match.group(0) if match else ""
            path = object_path(pattern)
            base = path[: min(path.find(c) for c in "*?[" if c in path)].rpartition("/")[0]
            with reading(f"{kind}: cannot list {pattern!r}"):
                infos = self.filesystem.get_file_info(pafs.FileSelector(base, allow_not_found=True, recursive=True))
            matches = sorted(
                scheme + info.path
                for info in infos
                if info.type == pafs.FileType.File and fnmatch.fnmatchcase(info.path, path)
            )
            if not matches:
                raise SourceError(f"{kind}: no objects match {pattern!r}")
            names.extend(matches)
        return names


def _object_digest(
    remote: Remote, file_digest: Callable[[pa.NativeFile], Optional[str]], kind: str, name: str
) -> Optional[str]:
    with remote.open(name, kind) as handle:
        return file_digest(handle)


def object_path(name: str) -> str:
    """The path of a URL on its filesystem (``s3://bucket/key`` -> ``bucket/key``)."""
    match = URL_SCHEME.match(name)
    return name[match.end() :] if match else name


def resolve(
    paths: Paths, kind: str, storage_options: Mapping[str, Any] | None, filesystem: Any
) -> tuple[list[str], Remote | None]:
    """The files of a source and, for remote ones, their ``Remote``: local paths (no URL, no
    ``filesystem``) are expanded as before and get None."""
    patterns = [os.fspath(paths)] if isinstance(paths, (str, os.PathLike)) else [os.fspath(p) for p in paths]
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
    settings: dict[str, Any] = {"retry_strategy": pafs.AwsStandardS3RetryStrategy(max_attempts=S3_RETRY_ATTEMPTS)}
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
