"""Adversary of remote sources over an S3-compatible store (docs/sources.md "Remote data (S3)"):
rs.jsonl, rs.parquet, rs.arrow and rs.jsonl_stream over ``s3://`` keys with spaces, unicode,
``%``, ``=``, ``+``, ``#`` and ``?`` in them, odd JSONL (CRLF, BOM, no trailing newline, blank
lines, lines much longer than a block or a chunk), empty objects, globs; chains with shuffle,
shard, pack and batch resumed anywhere, inside ``rs.torch.Loader``; objects replaced, deleted or
added between a save and a restore or during a pass; the local chunk and index caches damaged or
unwritable; endpoints that refuse connections; hand-corrupted states.

Everything runs against the loopback moto server of ``tests/s3server.py``; each test uploads
under its own keys (``adversary/...``)."""

from __future__ import annotations

import copy
import functools
import gc
import glob
import json
import os
import pathlib
import shutil
import socket
import time
import warnings
from typing import Any, Callable, Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import resumable as rs
from resumable.sources import remote
from resumable.sources.chunk_cache import ChunkCacheWarning
from resumable.sources.line_index import SidecarWarning
from resumable.torch import Loader
from tests.resume import check_resume, loader_head, loader_rest, plain, restored, roundtrip, take
from tests.s3server import BUCKET, S3Server
from tests.sources import _file

PREFIX = "adversary/odd key =+%#é 中/"
"""Every object of the shared data lives under this prefix: a space, '=', '+', '%', '#' and
non-ASCII characters, none of them glob characters."""
RECORDS = [{"id": i, "text": ("long " * 700 if i % 17 == 5 else "w" * (i % 23)) + f" doc {i}"} for i in range(60)]
"""60 documents; every 17th (from 5) about 3.5 kB, far beyond the small blocks and chunks."""
PARTS = 3
BLOCK = 512
"""Small blocks: every object spans many, and the long lines several."""
CHUNK = 1500
"""Small ranged reads for the streams."""
INDEXED = ("jsonl", "parquet", "arrow")
STREAMS = ("stream", "stream_gz")


def jsonl_bytes(records: list[dict[str, Any]], part: int) -> bytes:
    """JSONL of ``records`` in one of three shapes: plain with blank lines; CRLF line ends with
    a BOM; the last line without a newline and a blank (whitespace) line at the start."""
    lines = [json.dumps(record).encode() for record in records]
    if part == 0:
        return b"\n\n".join(lines) + b"\n"
    if part == 1:
        return b"\xef\xbb\xbf" + b"\r\n".join(lines) + b"\r\n"
    return b"  \t\n" + b"\n".join(lines)


def tokens(record: dict[str, Any]) -> dict[str, list[int]]:
    """A record as a short token sequence (its id first, so packed rows name their documents)."""
    return {"input_ids": [record["id"] + 1] + [7] * (len(record["text"]) % 9)}


def record_id(record: dict[str, Any]) -> int:
    return int(record["id"])


@pytest.fixture(scope="module")
def s3(s3_server: S3Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The server, and per kind the local files (``RECORDS`` dealt over ``PARTS``) and the glob
    of their uploaded copies under ``PREFIX``."""
    directory = tmp_path_factory.mktemp("remote-adversary")
    data: dict[str, Any] = {"server": s3_server, "cache": str(tmp_path_factory.mktemp("remote-adversary-cache"))}
    shares = [RECORDS[part::PARTS] for part in range(PARTS)]
    plain_parts = []
    for part, share in enumerate(shares):
        path = directory / f"part-{part}.jsonl"
        path.write_bytes(jsonl_bytes(share, part))
        plain_parts.append(str(path))
    for kind in ("jsonl", "stream"):
        for part, path in enumerate(plain_parts):
            s3_server.upload(path, f"{PREFIX}{kind}/part-{part}.jsonl")
    data["jsonl"] = (plain_parts, f"s3://{BUCKET}/{PREFIX}jsonl/part-*.jsonl")
    data["stream"] = (plain_parts, f"s3://{BUCKET}/{PREFIX}stream/part-*.jsonl")
    gz_parts = []
    for part, share in enumerate(shares):  # named as the objects are, so states move between them
        gz_parts.append(str(directory / f"part-{part}.jsonl.gz"))
        shutil.copyfile(_file("jsonl_gzip", share), gz_parts[-1])
    for part, path in enumerate(gz_parts):
        s3_server.upload(path, f"{PREFIX}stream_gz/part-{part}.jsonl.gz")
    data["stream_gz"] = (gz_parts, f"s3://{BUCKET}/{PREFIX}stream_gz/part-*.jsonl.gz")
    for kind in ("parquet", "arrow"):
        parts = [_file(kind, share) for share in shares]
        for part, path in enumerate(parts):
            s3_server.upload(path, f"{PREFIX}{kind}/part-{part}.{kind}")
        data[kind] = (parts, f"s3://{BUCKET}/{PREFIX}{kind}/part-*.{kind}")
    yield data
    gc.collect()  # streams dropped in reference cycles stop their read-ahead threads now, not in a later module


def remote_source(kind: str, where: Any, options: dict[str, Any], cache: str | None = None, **extra: Any) -> Any:
    """A remote source of ``kind`` over ``where`` with small blocks (indexed kinds) or chunks
    (streams)."""
    if kind in STREAMS:
        return rs.jsonl_stream(where, storage_options=options, chunk_bytes=CHUNK, **extra)
    read = {"jsonl": rs.jsonl, "parquet": rs.parquet, "arrow": rs.arrow}[kind]
    return read(where, storage_options=options, cache_dir=cache, block_bytes=BLOCK, cache_bytes=4 * BLOCK, **extra)


def local_source(kind: str, paths: list[str]) -> Any:
    if kind in STREAMS:
        return rs.jsonl_stream(paths)
    return {"jsonl": rs.jsonl, "parquet": rs.parquet, "arrow": rs.arrow}[kind](paths)


def source_of(s3: dict[str, Any], kind: str, **extra: Any) -> Any:
    return remote_source(kind, s3[kind][1], s3["server"].options, s3["cache"], **extra)


def upload_bytes(server: S3Server, tmp_path: pathlib.Path, key: str, data: bytes) -> str:
    path = tmp_path / "upload"
    path.write_bytes(data)
    return server.upload(str(path), key)


def upload_kind(server: S3Server, kind: str, records: list[dict[str, Any]], key: str) -> str:
    """Upload ``records`` as an object of ``kind`` (``stream``: plain JSONL, ``stream_gz``: gzip)."""
    file_kind = {"stream": "jsonl", "stream_gz": "jsonl_gzip"}.get(kind, kind)
    return server.upload(_file(file_kind, records), key)


def suffix(kind: str) -> str:
    return {"stream": ".jsonl", "stream_gz": ".jsonl.gz"}.get(kind, f".{kind}")


# -- the same records as the local copies ------------------------------------------------------


@pytest.mark.parametrize("kind", INDEXED + STREAMS)
def test_odd_keys_and_odd_jsonl_give_the_local_records(s3: dict[str, Any], kind: str) -> None:
    parts, url = s3[kind]
    source = source_of(s3, kind)
    assert source.paths == [f"s3://{BUCKET}/{PREFIX}{kind}/part-{part}{suffix(kind)}" for part in range(PARTS)]
    records = list(source)
    assert records == list(local_source(kind, parts))
    assert sorted(map(record_id, records)) == list(range(len(RECORDS)))
    assert records == [record for part in range(PARTS) for record in RECORDS[part::PARTS]]


@pytest.mark.parametrize("block_bytes", [64, 700, 5000])
def test_jsonl_long_lines_across_blocks_read_at_random(s3: dict[str, Any], block_bytes: int) -> None:
    """Random access (a shuffle) to records that span many blocks, with a memory tier of two
    blocks and no disk tier: every record whole."""
    _, url = s3["jsonl"]
    source = rs.jsonl(
        url, storage_options=s3["server"].options, block_bytes=block_bytes, cache_bytes=2 * block_bytes,
        disk_cache_bytes=0,
    )  # fmt: skip
    shuffled = list(source.shuffle(seed=9))
    assert sorted(shuffled, key=record_id) == RECORDS
    assert shuffled == list(rs.jsonl(s3["jsonl"][0]).shuffle(seed=9))


@pytest.mark.parametrize("chunk_bytes", [97, 4096])
def test_stream_long_lines_across_chunks(s3: dict[str, Any], chunk_bytes: int) -> None:
    parts, url = s3["stream"]
    stream = rs.jsonl_stream(url, storage_options=s3["server"].options, chunk_bytes=chunk_bytes)
    head = take(stream, 13)
    state = stream.get_state()
    resumed = rs.jsonl_stream(url, storage_options=s3["server"].options, chunk_bytes=chunk_bytes)
    resumed.set_state(roundtrip(state))
    assert head + list(resumed) == list(rs.jsonl_stream(parts))


# -- exact resume of chains ----------------------------------------------------------------------


def indexed_chain(s3: dict[str, Any], kind: str) -> rs.Node[Any]:
    """Shuffled, rank 1 of 2, tokenised, packed, batched, as plain lists."""
    packed = source_of(s3, kind).shuffle(seed=11).shard(1, 2).map(tokens).pack(8, strategy="best_fit", buffer_size=4)
    return packed.batch(3).map(plain)


def stream_chain(s3: dict[str, Any], kind: str) -> rs.Node[Any]:
    packed = source_of(s3, kind, shuffle_files=4).map(tokens).pack(8, strategy="first_fit", buffer_size=5)
    return packed.batch(2).map(plain)


def resume_at(build: Callable[[], rs.Node[Any]], expected: list[Any], k: int) -> None:
    """Save after ``k`` items (through JSON), restore into a fresh pipeline, compare the
    continuation with ``expected`` (an uninterrupted run, computed once for many ``k``)."""
    pipe = build()
    head = take(pipe, k)
    resumed = restored(build, pipe.get_state())
    assert head + take(resumed, len(expected) - k) == expected, k


@pytest.mark.parametrize("kind", INDEXED + STREAMS)
def test_chains_resume_at_start_middle_last_item_step_after_and_next_epoch(s3: dict[str, Any], kind: str) -> None:
    build = functools.partial(stream_chain if kind in STREAMS else indexed_chain, s3, kind)
    epoch = len(list(build()))
    assert epoch > 3
    total = 2 * epoch + 3
    expected = take(build(), total)
    for k in (0, epoch // 2, epoch - 1, epoch, epoch + 1, epoch + epoch // 2):
        resume_at(build, expected, k)
    check_resume(build, 2, total, k2=epoch + 2)  # restored twice, the second time in the next epoch
    assert expected[:epoch] != expected[epoch : 2 * epoch]  # a new order in the next epoch


@settings(max_examples=10)
@given(k=st.integers(0, 35), k2=st.integers(0, 35))
def test_resume_anywhere_property(s3: dict[str, Any], k: int, k2: int) -> None:
    """A shuffled, sharded, batched JSONL pipeline over S3, restored at any two points."""
    k, k2 = min(k, k2), max(k, k2)

    def build() -> rs.Node[Any]:
        return source_of(s3, "jsonl").shuffle(seed=2).shard(0, 3).map(record_id).batch(2)

    check_resume(build, k, 36, k2=k2 if k2 > k else None)


LOADER_CASES = [("jsonl", 0, False), ("jsonl", 2, True), ("stream", 2, True)]


@pytest.mark.parametrize("kind, num_workers, persistent", LOADER_CASES)
def test_loader_resumes_from_its_state_dict(s3: dict[str, Any], kind: str, num_workers: int, persistent: bool) -> None:
    def build() -> rs.Node[Any]:
        if kind in STREAMS:
            pipe = source_of(s3, kind, shuffle_files=1)
        else:
            pipe = source_of(s3, kind).shuffle(seed=8).shard()
        return pipe.map(record_id).batch(3, collate_fn=np.array)

    def make() -> Loader:
        return Loader(
            build,
            num_workers=num_workers,
            prefetch_factor=2 if num_workers else None,
            persistent_workers=persistent,
        )

    def as_list(batch: Any) -> list[int]:
        return [int(x) for x in batch]

    whole = make()
    epochs = [[as_list(b) for b in whole], [as_list(b) for b in whole]]
    count = len(epochs[0])
    assert sorted(x for batch in epochs[0] for x in batch) == list(range(len(RECORDS)))
    assert sorted(x for batch in epochs[1] for x in batch) == list(range(len(RECORDS)))
    stops = (0, count // 2, count - 1, count, count + 1) if num_workers == 0 else (count // 2, count + 1)
    for stop in stops:
        loader = make()
        head = loader_head(loader, stop, count, as_list)
        state = json.loads(json.dumps(loader.state_dict()))
        resumed = make()
        resumed.load_state_dict(state)
        rest = loader_rest(resumed, stop, count, as_list)
        assert head + rest == epochs[0] + epochs[1], stop


def test_a_loader_restored_over_a_replaced_object_raises_a_state_error(s3: dict[str, Any]) -> None:
    server: S3Server = s3["server"]
    key = "adversary/loader-replaced/data.jsonl"
    url = upload_kind(server, "jsonl", CHANGED, key)

    def build() -> rs.Node[Any]:
        return remote_source("jsonl", url, server.options).shuffle(seed=1).shard().map(record_id).batch(4)

    loader = Loader(build, num_workers=2, prefetch_factor=2)
    iterator = iter(loader)
    next(iterator)
    next(iterator)
    state = json.loads(json.dumps(loader.state_dict()))
    del iterator
    upload_kind(server, "jsonl", same_size_other_content(CHANGED), key)
    resumed = Loader(build, num_workers=2, prefetch_factor=2)
    resumed.load_state_dict(state)
    with pytest.raises(rs.StateError) as raised:
        next(iter(resumed))
    assert url in str(raised.value)


# -- empty objects and globs ---------------------------------------------------------------------


def test_an_empty_jsonl_object_among_others_contributes_no_records(s3: dict[str, Any], tmp_path: pathlib.Path) -> None:
    server: S3Server = s3["server"]
    upload_bytes(server, tmp_path, "adversary/empty-among/a.jsonl", b"")
    upload_bytes(server, tmp_path, "adversary/empty-among/b.jsonl", b'{"id": 1}\n{"id": 2}\n')
    (tmp_path / "a.jsonl").write_bytes(b"")
    (tmp_path / "b.jsonl").write_bytes(b'{"id": 1}\n{"id": 2}\n')
    assert list(rs.jsonl([str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")])) == [{"id": 1}, {"id": 2}]
    source = rs.jsonl(f"s3://{BUCKET}/adversary/empty-among/*.jsonl", storage_options=server.options)
    assert list(source) == [{"id": 1}, {"id": 2}]


def test_empty_and_blank_objects(s3: dict[str, Any], tmp_path: pathlib.Path) -> None:
    """What is documented today: a stream skips an empty object; a JSONL source of only blank
    objects, and empty Parquet or Arrow objects, are SourceErrors naming the URL."""
    server: S3Server = s3["server"]
    options = server.options
    empty = upload_bytes(server, tmp_path, "adversary/empty/e.jsonl", b"")
    upload_bytes(server, tmp_path, "adversary/empty/f.jsonl", b'{"id": 1}\n')
    assert list(rs.jsonl_stream(f"s3://{BUCKET}/adversary/empty/*.jsonl", storage_options=options)) == [{"id": 1}]
    assert list(rs.jsonl_stream(empty, storage_options=options)) == []
    empty_gz = upload_bytes(server, tmp_path, "adversary/empty/e.jsonl.gz", b"")
    assert list(rs.jsonl_stream(empty_gz, storage_options=options)) == []
    blank = upload_bytes(server, tmp_path, "adversary/empty/blank.jsonl", b"\n \r\n\t\n")
    with pytest.raises(rs.SourceError, match="no records") as raised:
        rs.jsonl(blank, storage_options=options)
    assert blank in str(raised.value)
    for read, name in ((rs.parquet, "e.parquet"), (rs.arrow, "e.arrow")):
        url = upload_bytes(server, tmp_path, f"adversary/empty/{name}", b"")
        with pytest.raises(rs.SourceError) as raised:
            read(url, storage_options=options)
        assert url in str(raised.value)


def mirrored_layout(server: S3Server, tmp_path: pathlib.Path, prefix: str) -> pathlib.Path:
    """The same nested layout locally and under ``prefix``: a.jsonl, b.jsonl, sub/c.jsonl,
    sub/deeper/d.jsonl."""
    root = tmp_path / "layout"
    for name, first in (("a.jsonl", 0), ("b.jsonl", 10), ("sub/c.jsonl", 20), ("sub/deeper/d.jsonl", 30)):
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"".join(b'{"id": %d}\n' % i for i in range(first, first + 2)))
        server.upload(str(path), prefix + name)
    return root


@pytest.mark.parametrize("pattern", ["*.jsonl", "**/*.jsonl"])
def test_globs_match_the_objects_the_same_local_glob_matches(
    s3: dict[str, Any], tmp_path: pathlib.Path, pattern: str
) -> None:
    server: S3Server = s3["server"]
    prefix = f"adversary/layout-{pattern.count('*')}/"
    root = mirrored_layout(server, tmp_path, prefix)
    local = rs.jsonl(str(root / pattern))
    remote_ = rs.jsonl(f"s3://{BUCKET}/{prefix}{pattern}", storage_options=server.options)
    assert [p.rsplit(prefix, 1)[1] for p in remote_.paths] == [os.path.relpath(p, root) for p in local.paths]
    assert list(remote_) == list(local)


def test_globs_that_agree_with_local_ones(s3: dict[str, Any], tmp_path: pathlib.Path) -> None:
    server: S3Server = s3["server"]
    prefix = "adversary/layout-agree/"
    root = mirrored_layout(server, tmp_path, prefix)
    for pattern in ("?.jsonl", "[ab].jsonl", "sub/*/d.jsonl", "b.jsonl"):
        local = rs.jsonl(str(root / pattern))
        remote_ = rs.jsonl(f"s3://{BUCKET}/{prefix}{pattern}", storage_options=server.options)
        assert [p.rsplit(prefix, 1)[1] for p in remote_.paths] == [os.path.relpath(p, root) for p in local.paths]
        assert list(remote_) == list(local), pattern


def test_keys_with_glob_characters_are_read_by_name_or_through_glob_escape(
    s3: dict[str, Any], tmp_path: pathlib.Path
) -> None:
    server: S3Server = s3["server"]
    odd = "adversary/globchars/what?[1] *.jsonl"
    url = upload_bytes(server, tmp_path, odd, b'{"id": 5}\n')
    upload_bytes(server, tmp_path, "adversary/globchars/other.jsonl", b'{"id": 6}\n')
    escaped = f"s3://{BUCKET}/" + glob.escape(odd)
    for read in (rs.jsonl, rs.jsonl_stream):
        source = read(escaped, storage_options=server.options)
        assert source.paths == [url]
        assert list(source) == [{"id": 5}]
    # unescaped, the name of an existing object is that object (as a local path is), not a glob
    for read in (rs.jsonl, rs.jsonl_stream):
        source = read(url, storage_options=server.options)
        assert source.paths == [url] and list(source) == [{"id": 5}]
    with pytest.raises(rs.SourceError, match="no objects match") as raised:  # no such object: a glob after all
        rs.jsonl(url.replace("what", "which"), storage_options=server.options)
    assert "which" in str(raised.value)


def test_a_glob_reads_what_was_listed_at_construction(s3: dict[str, Any], tmp_path: pathlib.Path) -> None:
    """Objects added under a glob's prefix after construction are not read in this run, and a
    pipeline built after they were added refuses the old state with a StateError."""
    server: S3Server = s3["server"]
    prefix = "adversary/growing/"
    for name in ("a", "b"):
        upload_bytes(
            server,
            tmp_path,
            f"{prefix}{name}.jsonl",
            b"".join(b'{"id": "%s%d"}\n' % (name.encode(), i) for i in range(4)),
        )
    url = f"s3://{BUCKET}/{prefix}*.jsonl"
    for read in (rs.jsonl, rs.jsonl_stream):
        pipe = read(url, storage_options=server.options)
        head = take(pipe, 3)
        state = pipe.get_state()
        upload_bytes(server, tmp_path, f"{prefix}c.jsonl", b'{"id": "c0"}\n')
        assert head + list(pipe) == [{"id": f"{n}{i}"} for n in "ab" for i in range(4)]
        grown = read(url, storage_options=server.options)
        assert len(grown.paths) == 3
        with pytest.raises(rs.StateError, match="saved over 2 files, this source has 3"):
            grown.set_state(roundtrip(state))
        assert list(grown) == [{"id": f"{n}{i}"} for n in "ab" for i in range(4)] + [{"id": "c0"}]
        server.client.delete_object(Bucket=BUCKET, Key=f"{prefix}c.jsonl")


def test_a_glob_in_a_missing_bucket_names_the_missing_bucket(s3: dict[str, Any]) -> None:
    url = "s3://adversary-no-such-bucket/data/*.jsonl"
    with pytest.raises(rs.SourceError, match="no such bucket") as raised:
        rs.jsonl(url, storage_options=s3["server"].options)
    assert url in str(raised.value)


# -- failures at construction: bounded, typed, naming the URL --------------------------------


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.parametrize("kind", INDEXED + ("stream",))
def test_an_endpoint_that_refuses_connections_is_a_source_error_naming_the_url(
    s3: dict[str, Any], kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(remote, "RETRY_ATTEMPTS", 2)  # the library's own retry bound, kept short
    monkeypatch.setattr(remote, "BACKOFF_SECONDS", 0.01)
    options = {**s3["server"].options, "endpoint_url": f"http://127.0.0.1:{closed_port()}"}
    for url in (f"s3://{BUCKET}/{PREFIX}{kind}/part-0{suffix(kind)}", s3[kind][1]):
        with pytest.raises(rs.SourceError) as raised:
            remote_source(kind, url, options)
        message = str(raised.value)
        assert url in message and "connect" in message.lower()


@pytest.mark.parametrize("kind", INDEXED + STREAMS)
def test_a_missing_bucket_or_object_is_a_source_error_naming_the_url(s3: dict[str, Any], kind: str) -> None:
    cases = {
        f"s3://adversary-no-such-bucket/x/part-0{suffix(kind)}": "no such bucket",
        f"s3://{BUCKET}/{PREFIX}{kind}/absent{suffix(kind)}": "no such object",
        f"s3://{BUCKET}/{PREFIX}{kind}": "is a directory",
    }
    for url, cause in cases.items():
        with pytest.raises(rs.SourceError, match=cause) as raised:
            remote_source(kind, url, s3["server"].options)
        assert url in str(raised.value)


# -- objects changed between a save and a restore -----------------------------------------------

CHANGED = [{"id": i, "text": f"changed {i:03d}"} for i in range(30)]


def same_size_other_content(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**record, "text": record["text"].upper()} for record in records]


@pytest.mark.parametrize("kind", INDEXED + STREAMS)
@pytest.mark.parametrize("change", ["same_size", "other_size", "deleted", "same_content"])
def test_object_changed_between_save_and_restore(s3: dict[str, Any], kind: str, change: str) -> None:
    server: S3Server = s3["server"]
    key = f"adversary/between/{change}/data{suffix(kind)}"
    url = upload_kind(server, kind, CHANGED, key)

    def build() -> rs.Node[Any]:
        return remote_source(kind, url, server.options).map(record_id).batch(2)

    pipe = build()
    head = take(pipe, 4)
    state = roundtrip(pipe.get_state())
    if change == "same_size":
        upload_kind(server, kind, same_size_other_content(CHANGED), key)
    elif change == "other_size":
        upload_kind(server, kind, CHANGED[:20], key)
    elif change == "deleted":
        server.client.delete_object(Bucket=BUCKET, Key=key)
        with pytest.raises(rs.SourceError, match="no such object") as raised:
            build()
        assert url in str(raised.value)
        return
    else:
        upload_kind(server, kind, CHANGED, key)  # the same bytes again: same ETag, maybe a new Last-Modified
        resumed = restored(build, state)
        assert head + list(resumed) == list(build())
        return
    fresh = build()
    before = take(fresh, 2)
    with pytest.raises(rs.StateError, match="differs from the file the state was taken over") as raised:
        fresh.set_state(state)
    assert url in str(raised.value)
    other = build()
    assert before + list(fresh) == list(other)  # unchanged by the failed set_state


# -- hand-corrupted states -----------------------------------------------------------------------


def files_of(state: dict[str, Any]) -> list[list[Any]]:
    """The fingerprints of the source at the bottom of a state."""
    while "upstream" in state:
        state = state["upstream"]
    files: list[list[Any]] = state["files"]
    return files


def rename_object(fingerprint: list[Any]) -> None:
    fingerprint[0] = fingerprint[0].rsplit("/", 1)[0] + "/part-9.other"


def grow(fingerprint: list[Any]) -> None:
    fingerprint[1] += 1


def other_etag(fingerprint: list[Any]) -> None:
    digest = fingerprint[3]
    fingerprint[3] = digest[:-4] + ("0000" if not digest.endswith("0000") else "1111")


def other_etag_and_mtime(fingerprint: list[Any]) -> None:
    other_etag(fingerprint)
    fingerprint[2] += 10**9


def size_as_text(fingerprint: list[Any]) -> None:
    fingerprint[1] = str(fingerprint[1])


def drop_a_file(files: list[list[Any]]) -> None:
    files.pop()


def add_a_file(files: list[list[Any]]) -> None:
    files.append(list(files[-1]))


def digest_as_number(fingerprint: list[Any]) -> None:
    fingerprint[3] = 12345


STATE_EDITS: dict[str, Callable[[list[Any]], None]] = {
    "renamed": rename_object,
    "size": grow,
    "etag": other_etag,
    "etag_and_mtime": other_etag_and_mtime,
    "size_as_text": size_as_text,
    "digest_as_number": digest_as_number,
}
LIST_EDITS: dict[str, Callable[[list[list[Any]]], None]] = {"dropped": drop_a_file, "added": add_a_file}


@pytest.mark.parametrize("kind", INDEXED + STREAMS)
def test_hand_corrupted_fingerprints_are_state_errors_and_change_nothing(s3: dict[str, Any], kind: str) -> None:
    """Every edit is refused by the same pipeline, one after another; then it goes on as if
    none of the calls had been made."""

    def build() -> rs.Node[Any]:
        if kind in STREAMS:
            return source_of(s3, kind).map(record_id).batch(4)
        return source_of(s3, kind).shuffle(seed=1).map(record_id).batch(4)

    pipe = build()
    take(pipe, 3)
    good = roundtrip(pipe.get_state())
    victim = build()
    head = take(victim, 5)
    for edit in [*STATE_EDITS, *LIST_EDITS]:
        state = copy.deepcopy(good)
        files = files_of(state)
        if edit in LIST_EDITS:
            LIST_EDITS[edit](files)
        else:
            STATE_EDITS[edit](files[1])
        with pytest.raises(rs.StateError) as raised:
            victim.set_state(state)
        message = str(raised.value)
        assert ("Source" in message or "Stream" in message) and "Batch" in message, edit
        if edit in ("renamed", "size", "etag", "etag_and_mtime"):
            assert "part-1" in message or "part-9" in message, edit
    assert head + list(victim) == list(build())


@pytest.mark.parametrize("kind", INDEXED + STREAMS)
def test_documented_leniencies_of_a_fingerprint(s3: dict[str, Any], kind: str) -> None:
    """Another directory (or bucket) with the same object names, and another mtime with the same
    digest, still restore (docs/sources.md, Fingerprints)."""

    def build() -> rs.Node[Any]:
        return source_of(s3, kind).map(record_id).batch(4)

    pipe = build()
    head = take(pipe, 3)
    state = roundtrip(pipe.get_state())
    for fingerprint in files_of(state):
        fingerprint[0] = fingerprint[0].replace(f"s3://{BUCKET}/", "s3://another-bucket/staged/")
        fingerprint[2] += 5 * 10**9
    resumed = restored(build, state)
    assert head + take(resumed, 40) == take(build(), 43)


@pytest.mark.parametrize("kind", STREAMS)
def test_hand_corrupted_stream_queues_are_state_errors(s3: dict[str, Any], kind: str) -> None:
    def build() -> rs.Node[Any]:
        return source_of(s3, kind).map(record_id)

    pipe = build()
    take(pipe, 5)
    good = roundtrip(pipe.get_state())
    size = files_of(good)[0][1]
    past = size * 1033 if kind == "stream_gz" else size + 1
    for queue in ([[0, past, 0]], [[7, 0, 0]], [[0, -1, 0]], [["0", 0, 0]], [[0, 0]]):
        state = copy.deepcopy(good)
        state["upstream"]["queue"] = queue
        victim = build()
        head = take(victim, 2)
        with pytest.raises(rs.StateError, match="JsonlStream"):
            victim.set_state(state)
        assert head + list(victim) == list(build())


# -- objects changed during a pass ---------------------------------------------------------------

MANY = [{"id": i, "text": "t" * 40} for i in range(200)]


@pytest.mark.parametrize("kind", ("jsonl", "parquet") + STREAMS)
def test_object_deleted_during_a_pass_is_a_source_error_naming_it(
    s3: dict[str, Any], kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(remote, "BACKOFF_SECONDS", 0.001)  # whatever pyarrow calls transient, retried fast
    server: S3Server = s3["server"]
    key = f"adversary/during/deleted{suffix(kind)}"
    url = upload_kind(server, kind, MANY, key)
    extra: dict[str, Any] = {} if kind in STREAMS else {"disk_cache_bytes": 0}
    pipe = remote_source(kind, url, server.options, **extra)
    head = take(pipe, 15)
    assert [record_id(r) for r in head] == list(range(15))
    server.client.delete_object(Bucket=BUCKET, Key=key)
    with pytest.raises(rs.SourceError) as raised:
        take(pipe, len(MANY))
    assert url in str(raised.value)


def test_a_stream_skipping_errors_skips_the_rest_of_an_object_deleted_during_a_pass(
    s3: dict[str, Any], tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Documented for on_error="skip": the records before the failure are kept, the rest of the
    object is skipped and counted once, and the next object is read."""
    monkeypatch.setattr(remote, "BACKOFF_SECONDS", 0.001)
    server: S3Server = s3["server"]
    key = "adversary/skip-deleted/a.jsonl"
    upload_kind(server, "stream", MANY, key)
    upload_bytes(server, tmp_path, "adversary/skip-deleted/b.jsonl", b'{"id": 1000}\n{"id": 1001}\n')
    stream = rs.jsonl_stream(
        f"s3://{BUCKET}/adversary/skip-deleted/*.jsonl", storage_options=server.options, chunk_bytes=256,
        on_error="skip",
    )  # fmt: skip
    head = [record_id(r) for r in take(stream, 10)]
    server.client.delete_object(Bucket=BUCKET, Key=key)
    rest = [record_id(r) for r in stream]
    assert head == list(range(10))
    assert rest[-2:] == [1000, 1001] and rest[:-2] == list(range(10, 10 + len(rest) - 2))
    assert len(rest) - 2 < len(MANY) - 10
    assert stream.stats["skipped"] == 1


def test_an_arrow_object_deleted_during_a_pass_is_read_from_memory(s3: dict[str, Any]) -> None:
    """An Arrow object is read whole once per process (docs): the pass goes on over what it read."""
    server: S3Server = s3["server"]
    key = "adversary/during/deleted.arrow"
    url = upload_kind(server, "arrow", MANY, key)
    pipe = remote_source("arrow", url, server.options)
    head = take(pipe, 15)
    server.client.delete_object(Bucket=BUCKET, Key=key)
    assert head + list(pipe) == MANY


@pytest.mark.parametrize("kind", ["jsonl", "stream"])
def test_object_cut_short_during_a_pass_is_a_source_error(
    s3: dict[str, Any], kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(remote, "BACKOFF_SECONDS", 0.001)
    server: S3Server = s3["server"]
    key = f"adversary/during/shorter{suffix(kind)}"
    url = upload_kind(server, kind, MANY, key)
    extra: dict[str, Any] = {} if kind in STREAMS else {"disk_cache_bytes": 0}
    pipe = remote_source(kind, url, server.options, **extra)
    head = take(pipe, 15)
    assert [record_id(r) for r in head] == list(range(15))
    upload_kind(server, kind, MANY[:30], key)
    with pytest.raises(rs.SourceError) as raised:
        take(pipe, len(MANY))
    assert url in str(raised.value)


def test_the_disk_cache_never_serves_bytes_of_another_version(s3: dict[str, Any], tmp_path: pathlib.Path) -> None:
    """Blocks fetched while the object was another are not stored under its version's key, so
    once the original is back (same ETag) a new source reads the original. The uploads are a
    second apart: an object replaced and put back within the second of its Last-Modified looks
    unchanged to any HEAD (docs/sources.md)."""
    server: S3Server = s3["server"]
    original = [{"id": i, "text": "abc" * 10} for i in range(300)]
    key = "adversary/poison/data.jsonl"
    url = upload_kind(server, "jsonl", original, key)
    options = {"storage_options": server.options, "cache_dir": str(tmp_path), "block_bytes": 512, "cache_bytes": 1024}
    first = rs.jsonl(url, **options)
    take(first, 30)
    time.sleep(1.1)
    upload_kind(server, "jsonl", same_size_other_content(original), key)  # replaced by mistake
    try:
        take(first, len(original))  # the run goes on for a while (no check within 30 s)
    except rs.SourceError:
        pass
    time.sleep(1.1)  # the read-ahead's last fetches are confirmed (and dropped) meanwhile
    upload_kind(server, "jsonl", original, key)  # the original put back: the same ETag again
    assert list(rs.jsonl(url, **options)) == original


# -- the local caches damaged or unwritable ------------------------------------------------------


def block_files(cache: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for p in (cache / "chunks").rglob("*") if p.is_file() and p.name.isdigit())


@pytest.mark.parametrize("kind", INDEXED)
def test_damaged_chunk_cache_blocks_are_fetched_again(s3: dict[str, Any], kind: str, tmp_path: pathlib.Path) -> None:
    server: S3Server = s3["server"]
    url = upload_kind(server, kind, MANY, f"adversary/damaged/data{suffix(kind)}")

    def build() -> rs.Node[Any]:
        return remote_source(kind, url, server.options, str(tmp_path)).shuffle(seed=3).map(record_id).batch(5)

    expected = take(build(), 60)
    files = block_files(tmp_path)
    assert files
    for i, path in enumerate(files):
        data = path.read_bytes()
        path.write_bytes([data[: len(data) // 2], bytes(len(data)), b"", data[:-1] + b"x"][i % 4])
    pipe = build()
    head = take(pipe, 20)
    state = pipe.get_state()
    for path in block_files(tmp_path)[::2]:  # damaged again, under a live pipeline and its restore
        path.write_bytes(path.read_bytes()[:7])
    assert head + take(restored(build, state), 40) == expected
    assert head + take(pipe, 40) == expected


@pytest.mark.parametrize("kind", INDEXED)
def test_unwritable_cache_dirs_read_without_the_disk_tier(
    s3: dict[str, Any], kind: str, tmp_path: pathlib.Path
) -> None:
    """A cache dir whose ``chunks`` is a file, and one that is a file itself: warnings, the same
    records, exact resume."""
    server: S3Server = s3["server"]
    url = upload_kind(server, kind, MANY, f"adversary/unwritable/data{suffix(kind)}")
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / "chunks").write_text("not a directory")
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory")
    expected = [record_id(r) for r in MANY]
    for cache in (blocked, a_file):

        def build(cache: pathlib.Path = cache) -> rs.Node[Any]:
            return remote_source(kind, url, server.options, str(cache)).map(record_id)

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pipe = build()
            head = take(pipe, 77)
            state = pipe.get_state()
            assert head + list(restored(build, state)) == expected
        kinds = {type(w.message) for w in caught}
        assert ChunkCacheWarning in kinds
        if kind == "jsonl" and cache == a_file:
            assert SidecarWarning in kinds


@pytest.mark.parametrize("damage", ["flipped", "truncated", "empty"])
def test_a_damaged_remote_line_index_is_rebuilt(s3: dict[str, Any], tmp_path: pathlib.Path, damage: str) -> None:
    server: S3Server = s3["server"]
    records = [{"id": i, "text": "x" * (i % 50)} for i in range(3000)]  # more than one block of offsets
    url = upload_kind(server, "jsonl", records, f"adversary/index/{damage}.jsonl")

    def build() -> rs.Node[Any]:
        return rs.jsonl(url, storage_options=server.options, cache_dir=str(tmp_path)).shuffle(seed=1).map(record_id)

    expected = take(build(), 3000)
    pipe = build()
    head = take(pipe, 1234)
    state = pipe.get_state()
    (sidecar,) = tmp_path.glob("*.rsidx")
    data = bytearray(sidecar.read_bytes())
    if damage == "flipped":
        data[len(data) // 2] ^= 0xFF
    elif damage == "truncated":
        del data[len(data) // 3 :]
    else:
        data.clear()
    sidecar.write_bytes(bytes(data))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SidecarWarning)
        assert head + take(restored(build, state), 3000 - 1234) == expected
        assert take(build(), 3000) == expected


def test_a_cache_dir_removed_during_a_run(s3: dict[str, Any], tmp_path: pathlib.Path) -> None:
    """The whole cache dir (index and chunks) removed under a running pipeline: it goes on, and
    a restore rebuilds what it needs."""
    server: S3Server = s3["server"]
    url = upload_kind(server, "jsonl", MANY, "adversary/removed-cache/data.jsonl")
    cache = tmp_path / "cache"

    def build() -> rs.Node[Any]:
        return remote_source("jsonl", url, server.options, str(cache)).shuffle(seed=6).map(record_id)

    expected = take(build(), 200)
    pipe = build()
    head = take(pipe, 50)
    state = pipe.get_state()
    shutil.rmtree(cache)
    assert head + take(pipe, 150) == expected
    shutil.rmtree(cache, ignore_errors=True)
    assert head + take(restored(build, state), 150) == expected


def test_a_tiny_disk_cache_evicts_without_losing_records(s3: dict[str, Any], tmp_path: pathlib.Path) -> None:
    """A disk tier bounded below one block: every put sweeps; the records and a resume stay exact."""
    server: S3Server = s3["server"]
    _, url = s3["jsonl"]

    def build() -> rs.Node[Any]:
        source = rs.jsonl(
            url, storage_options=server.options, cache_dir=str(tmp_path), block_bytes=BLOCK,
            cache_bytes=BLOCK, disk_cache_bytes=BLOCK // 2,
        )  # fmt: skip
        return source.shuffle(seed=12).map(record_id)

    expected = [record_id(r) for r in rs.jsonl(s3["jsonl"][0]).shuffle(seed=12)]
    assert list(build()) == expected
    pipe = build()
    head = take(pipe, 31)
    assert head + list(restored(build, pipe.get_state())) == expected


@pytest.mark.parametrize("kind", ["stream_gz", "jsonl"])
def test_a_state_moves_between_a_local_copy_and_the_object(s3: dict[str, Any], kind: str) -> None:
    """gzip streams and indexed JSONL have content digests: a state taken over the local file
    restores over the uploaded object of the same name, and the reverse."""
    parts, url = s3[kind]

    def local() -> rs.Node[Any]:
        return local_source(kind, parts).map(record_id)

    def uploaded() -> rs.Node[Any]:
        return source_of(s3, kind).map(record_id)

    expected = list(local())
    for saved_on, restored_on in ((local, uploaded), (uploaded, local)):
        pipe = saved_on()
        head = take(pipe, 23)
        assert head + list(restored(restored_on, pipe.get_state())) == expected


def test_a_plain_stream_state_does_not_move_between_a_local_copy_and_the_object(s3: dict[str, Any]) -> None:
    """Documented: plain jsonl_stream files have no content digest, so only an equal mtime
    restores; a local copy and the object differ in it: a StateError naming the file."""
    parts, _ = s3["stream"]
    pipe = local_source("stream", parts)
    take(pipe, 5)
    state = pipe.get_state()
    fresh = source_of(s3, "stream")
    head = take(fresh, 3)
    with pytest.raises(rs.StateError, match="no content digest to compare") as raised:
        fresh.set_state(roundtrip(state))
    assert "part-0.jsonl" in str(raised.value)
    assert head + list(fresh) == list(source_of(s3, "stream"))


def test_the_line_index_of_an_object_with_a_long_unicode_name_is_cached(
    s3: dict[str, Any], tmp_path: pathlib.Path
) -> None:
    server: S3Server = s3["server"]
    name = "中文数据集" * 16 + ".jsonl"
    assert len(name.encode()) < 255
    url = upload_bytes(server, tmp_path, f"adversary/long-names/{name}", b'{"id": 1}\n{"id": 2}\n')
    cache = tmp_path / "cache"
    with warnings.catch_warnings():
        warnings.simplefilter("error", SidecarWarning)
        assert list(rs.jsonl(url, storage_options=server.options, cache_dir=str(cache))) == [{"id": 1}, {"id": 2}]
    assert len(list(cache.glob("*.rsidx"))) == 1
