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
from collections import OrderedDict
from functools import partial
from typing import Any, Callable, Mapping, Optional

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import xxhash

from resumable.errors import ConfigError, SourceError
from resumable.sources.files import URL_SCHEME, Digest, Paths, expand_paths, reading

S3_OPTIONS = ("key", "secret", "token", "endpoint_url", "region", "anon", "client_kwargs")
"""The ``storage_options`` understood for ``s3://`` (fsspec/s3fs names); ``client_kwargs`` may
hold ``endpoint_url`` and ``region_name``."""
S3_CLIENT_OPTIONS = ("endpoint_url", "region_name")
S3_RETRY_ATTEMPTS = 5
"""Attempts per request (pyarrow's ``AwsStandardS3RetryStrategy``: exponential backoff on
connection errors, 5xx answers and throttling) before a read fails: a request fails only after
5 transient errors in a row, and an endpoint that always fails is a ``SourceError`` within
about a second, not a hang."""
EDGE_BYTES = 64 << 10
"""Bytes at each end of an object hashed into its edge digest (``Remote.edge_digest``)."""
BLOCK_BYTES = 1 << 20
"""Default bytes per block of ``BlockReader``: records are read in aligned blocks of this size."""
CACHE_BYTES = 32 << 20
"""Default bytes of blocks a ``BlockReader`` keeps in memory (least recently used evicted)."""
REQUEST_BLOCKS = 16
"""Most consecutive missing blocks fetched by one ranged read."""
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

    def open_stream(self, name: str, kind: str) -> pa.NativeFile:
        """A sequential stream over the object ``name`` (the scan that builds a line index)."""
        with reading(f"{kind}: cannot open {name!r}"):
            return self.filesystem.open_input_stream(object_path(name))

    def edge_digest(self, name: str, size: int, kind: str) -> str:
        """XXH3-64 of the object's size and its first and last ``EDGE_BYTES`` (two ranged reads):
        with size and mtime, the key of a cached line index, so a replaced object is noticed
        even when the store's mtime (one second resolution on S3) and size did not change."""
        digest = xxhash.xxh3_64(size.to_bytes(8, "little"))
        with self.open(name, kind) as handle, reading(f"{kind}: cannot read {name!r}"):
            digest.update(handle.read_at(min(size, EDGE_BYTES), 0))
            if size > EDGE_BYTES:
                tail = min(size - EDGE_BYTES, EDGE_BYTES)
                digest.update(handle.read_at(tail, size - tail))
        return f"{digest.intdigest():016x}"

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


class BlockReader:
    """Byte ranges of one object read in aligned blocks of ``block_bytes`` through a bounded LRU
    of blocks (``cache_bytes``): the ranges of a chunk of records cost one ranged read per run of
    consecutive missing blocks (at most ``REQUEST_BLOCKS`` blocks each), never one per record,
    and sequential reading fetches each block once. ``requests`` and ``bytes_fetched`` count
    the reads. Pickles without its open file and blocks (DataLoader workers)."""

    def __init__(self, remote: Remote, name: str, size: int, kind: str, block_bytes: int, cache_bytes: int) -> None:
        self.remote = remote
        self.name = name
        self.size = size
        self.kind = kind
        self.block_bytes = block_bytes
        self.cache_blocks = max(1, cache_bytes // block_bytes)
        self.requests = 0
        self.bytes_fetched = 0
        self._file: pa.NativeFile | None = None
        self._blocks: OrderedDict[int, bytes] = OrderedDict()

    def ranges(self, starts: np.ndarray, ends: np.ndarray) -> list[bytes]:
        """``object[starts[i]:ends[i]]`` for each ``i`` (non-empty ranges)."""
        width = self.block_bytes
        first = starts.astype(np.int64) // width
        last = (ends.astype(np.int64) - 1) // width
        wide = np.flatnonzero(last - first > 1)
        inner = [np.arange(first[i] + 1, last[i]) for i in wide.tolist()]
        needed = np.unique(np.concatenate([first, last, *inner]))
        blocks = self._fetch(needed.tolist())
        out: list[bytes] = []
        for a, b, f, z in zip(starts.tolist(), ends.tolist(), first.tolist(), last.tolist()):
            if f == z:
                out.append(blocks[f][a - f * width : b - f * width])
            else:
                joined = b"".join(blocks[block] for block in range(f, z + 1))
                out.append(joined[a - f * width : b - f * width])
        return out

    def _fetch(self, needed: list[int]) -> dict[int, bytes]:
        """Blocks ``needed`` (sorted), reading the missing ones in runs of consecutive blocks."""
        cached = self._blocks
        found = {block: cached[block] for block in needed if block in cached}
        for block in found:
            cached.move_to_end(block)
        missing = [block for block in needed if block not in found]
        run_start = 0
        for i in range(1, len(missing) + 1):
            if i < len(missing) and missing[i] == missing[i - 1] + 1 and i - run_start < REQUEST_BLOCKS:
                continue
            found.update(self._read(missing[run_start], missing[i - 1] + 1))
            run_start = i
        return found

    def _read(self, first: int, stop: int) -> dict[int, bytes]:
        """Blocks ``first`` up to ``stop`` in one ranged read, added to the cache."""
        width = self.block_bytes
        offset = first * width
        length = min(stop * width, self.size) - offset
        with reading(f"{self.kind}: cannot read {self.name!r} at bytes {offset}-{offset + length}"):
            if self._file is None:
                self._file = self.remote.open(self.name, self.kind)
            data = self._file.read_at(length, offset)
        if len(data) != length:
            raise SourceError(f"{self.kind}: {self.name!r} changed during the run (shorter than indexed)")
        self.requests += 1
        self.bytes_fetched += length
        blocks = {block: data[(block - first) * width : (block - first + 1) * width] for block in range(first, stop)}
        self._blocks.update(blocks)
        while len(self._blocks) > self.cache_blocks:
            self._blocks.popitem(last=False)
        return blocks

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_file"] = None
        state["_blocks"] = OrderedDict()
        return state


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
