"""``rs.jsonl_stream`` over ``s3://`` URLs against the loopback S3 server (tests/s3server.py):
the same records as the local files, exact resume at any point of plain and gzip objects,
ranks and DataLoader workers, objects read in chunks by a read-ahead thread (each byte fetched
once, a plain object resumed by a read that starts at the offset), and every failure, the
read-ahead thread's included, a ``StateError``/``SourceError``/``ConfigError`` naming the URL."""

from __future__ import annotations

import functools
import gc
import gzip
import json
import math
import multiprocessing
import os
import pickle
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.fs as pafs
import pytest

import resumable as rs
from resumable.sources import remote
from resumable.torch import Loader
from tests.resume import check_resume, loader_batches, restored, roundtrip, take
from tests.s3proxy import FaultProxy
from tests.s3server import BUCKET, KEY_ID, REGION, SECRET, S3Server
from tests.sources import _file
from tests.watching import wait_until

RECORDS = [{"id": i, "text": f"line {i} " + "w" * (i % 31)} for i in range(96)]
PARTS = 4
"""Parts 0 and 2 plain (``.jsonl``), 1 and 3 gzip (``.jsonl.gz``)."""
CHUNK = 200
"""Small chunks, so that every object takes many ranged reads."""
BIG_CHUNK = 64 << 10
"""Chunks of the 1 MiB gzip object of the failure test."""
WAIT_S = 60.0
"""A hang guard for the forked child, not a speed check."""
KINDS = {"plain": "*.jsonl", "gzip": "*.jsonl.gz", "both": "*"}
"""Globs over the uploaded parts: the plain ones, the gzip ones, all of them."""


def part_kind(part: int) -> str:
    return "jsonl_gzip" if part % 2 else "jsonl"


def part_key(part: int) -> str:
    return f"stream/part-{part}.jsonl{'.gz' if part % 2 else ''}"


@pytest.fixture(scope="module")
def s3(s3_server: S3Server) -> dict[str, Any]:
    """The server and the local parts (``RECORDS`` dealt over ``PARTS`` files), uploaded."""
    parts = [_file(part_kind(part), RECORDS[part::PARTS]) for part in range(PARTS)]
    for part, path in enumerate(parts):
        s3_server.upload(path, part_key(part))
    return {"server": s3_server, "parts": parts}


def url(kind: str = "both") -> str:
    return f"s3://{BUCKET}/stream/part-{KINDS[kind]}"


def source(s3: dict[str, Any], where: str | None = None, **options: Any) -> rs.nodes.JsonlStream:
    return rs.jsonl_stream(where or url(), storage_options=s3["server"].options, chunk_bytes=CHUNK, **options)


def record_id(record: dict[str, Any]) -> int:
    return int(record["id"])


def read_ahead_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name.startswith("resumable read-ahead")]


@pytest.fixture(autouse=True)
def no_read_ahead_of_earlier_tests() -> None:
    """Streams that earlier tests (of any file) left in reference cycles are collected first, so
    their read-ahead threads end and the counts here are this test's own."""
    gc.collect()
    wait_until(lambda: not read_ahead_threads(), "the read-ahead threads of earlier tests to end")


def test_same_records_as_the_local_files_each_byte_fetched_once(s3: dict[str, Any]) -> None:
    stream = source(s3)
    assert stream.paths == [f"s3://{BUCKET}/{part_key(part)}" for part in range(PARTS)]
    local = rs.jsonl_stream(s3["parts"])
    assert list(stream) == list(local)
    sizes = [os.path.getsize(path) for path in s3["parts"]]
    assert stream.stats == {
        "skipped": 0,
        "requests": sum(math.ceil(size / CHUNK) for size in sizes),  # one ranged read per chunk
        "bytes_fetched": sum(sizes),
        "retries": 0,
    }
    remote_files, local_files = stream.get_state()["files"], local.get_state()["files"]
    for remote_file, local_file in zip(remote_files, local_files):
        if remote_file[0].endswith(".gz"):
            assert remote_file[3] == local_file[3]  # the gzip trailer, as locally
        else:  # a plain object's ETag; a local plain file has no digest
            assert remote_file[3].startswith("etag:") and local_file[3] is None
    assert [f[1] for f in remote_files] == sizes
    assert not read_ahead_threads()  # each ended with its object


@pytest.mark.parametrize("kind", ["plain", "gzip"])
def test_resume_at_start_middle_last_item_and_after_the_end(s3: dict[str, Any], kind: str) -> None:
    def build() -> rs.Node[Any]:
        return source(s3, url(kind), shuffle_files=5)

    epoch = len(RECORDS) // 2
    for k in (0, epoch // 2, epoch - 1, epoch, epoch + 1):
        check_resume(build, k, epoch + 9)
    check_resume(build, 7, epoch + 9, k2=epoch + 3)  # restored twice, across the epoch boundary


def test_ranks_split_by_object_and_resume(s3: dict[str, Any]) -> None:
    seen: list[int] = []
    for rank in range(3):

        def build(rank: int = rank) -> rs.Node[Any]:
            return source(s3, shuffle_files=1, rank=rank, world_size=3).map(record_id)

        share = list(build())
        seen += share
        check_resume(build, len(share) // 2, len(share) + 4)
    assert sorted(seen) == [record["id"] for record in RECORDS]


def test_a_plain_object_resumes_by_a_read_from_its_offset(s3: dict[str, Any]) -> None:
    """The resumed stream fetches only the bytes from the saved offset on (and the one before
    it, which shows that the offset starts a line), however far in."""
    path = s3["parts"][0]
    where = f"s3://{BUCKET}/{part_key(0)}"
    stream = source(s3, where)
    head = take(stream, 17)
    state = stream.get_state()
    offset = state["queue"][0][1]
    assert offset > 3 * CHUNK
    resumed = source(s3, where)
    resumed.set_state(roundtrip(state))
    assert head + list(resumed) == list(rs.jsonl_stream(path))
    assert resumed.stats["bytes_fetched"] == os.path.getsize(path) - offset + 1
    assert resumed.stats["requests"] == math.ceil((os.path.getsize(path) - offset + 1) / CHUNK)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_workers(s3: dict[str, Any], num_workers: int) -> None:
    def build() -> rs.Node[Any]:
        return source(s3, shuffle_files=3).map(record_id).batch(4, collate_fn=np.array)

    def make() -> Loader:
        return Loader(build, num_workers=num_workers, prefetch_factor=2 if num_workers else None)

    expected, _ = loader_batches(make())
    assert sorted(x for batch in expected for x in batch) == [record["id"] for record in RECORDS]
    head, state = loader_batches(make(), stop=len(expected) // 2 + 1)
    resumed = make()
    resumed.load_state_dict(state)
    assert head + loader_batches(resumed)[0] == expected


def test_pickling_or_closing_stops_the_read_ahead(s3: dict[str, Any]) -> None:
    stream = source(s3, shuffle_files=2)
    head = take(stream, 5)
    assert len(read_ahead_threads()) == 1
    copy = pickle.loads(pickle.dumps(stream))  # a DataLoader worker's copy reopens lazily
    assert copy.stats["requests"] == 0  # and counts its own reads
    rest = take(copy, len(RECORDS) - 5)
    stream.close()
    copy.close()  # the copy's own read-ahead of its last object may still be reading to its end
    assert not read_ahead_threads()
    assert head + rest == list(source(s3, shuffle_files=2))


def test_a_stream_dropped_mid_object_stops_its_read_ahead_when_collected(s3: dict[str, Any]) -> None:
    """The sibling of a dropped local stream closing its open file: the object's handle (a
    read-ahead) is closed with the node, and its thread ends."""
    stream = source(s3)
    take(stream, 5)
    assert len(read_ahead_threads()) == 1
    del stream
    gc.collect()
    assert not read_ahead_threads()


def test_a_forked_child_goes_on_with_a_read_ahead_of_its_own(s3: dict[str, Any]) -> None:
    """A stream forked in the middle of an object (a DataLoader worker forked from a process
    that read) goes on in the child, which has none of the parent's threads: it opens the
    object again at the next chunk it had not taken."""
    stream = source(s3, shuffle_files=2)
    head = [record_id(record) for record in take(stream, 5)]
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=lambda: send.send([record_id(r) for r in take(stream, len(RECORDS) - 5)]))
    child.start()
    try:
        assert receive.poll(WAIT_S), "the forked child sent nothing"
        rest = receive.recv()
    finally:
        child.join(WAIT_S)
        if child.exitcode is None:
            child.kill()
    assert child.exitcode == 0
    assert head + rest == [record_id(record) for record in source(s3, shuffle_files=2)]
    assert [record_id(record) for record in take(stream, len(RECORDS) - 5)] == rest  # the parent's, unchanged
    stream.close()
    assert not read_ahead_threads()


def test_packer_restore_fetches_its_buffer_from_the_objects(s3: dict[str, Any]) -> None:
    def build() -> rs.Node[Any]:
        tokens = source(s3).map(lambda record: {"input_ids": list(range(1, 2 + record["id"] % 7))})
        return tokens.pack(8, buffer_size=6).map(lambda row: row["input_ids"].tolist())

    for k in (3, 20):
        check_resume(build, k, 40)
    assert not read_ahead_threads()


def test_a_pyarrow_filesystem_object(s3: dict[str, Any]) -> None:
    host = s3["server"].endpoint.removeprefix("http://")
    filesystem = pafs.S3FileSystem(
        access_key=KEY_ID, secret_key=SECRET, endpoint_override=host, scheme="http", region=REGION
    )
    names = [f"{BUCKET}/{part_key(part)}" for part in range(PARTS)]
    assert list(rs.jsonl_stream(names, filesystem=filesystem)) == list(rs.jsonl_stream(s3["parts"]))


def test_object_replaced_between_save_and_restore(s3: dict[str, Any]) -> None:
    server: S3Server = s3["server"]
    for kind, key in (("jsonl", "replaced/data.jsonl"), ("jsonl_gzip", "replaced/data.jsonl.gz")):
        where = server.upload(_file(kind, RECORDS[:30]), key)
        build = functools.partial(source, s3, where)
        pipe = build()
        take(pipe, 7)
        state = pipe.get_state()
        server.upload(_file(kind, RECORDS[30:50]), key)
        with pytest.raises(rs.StateError, match="differs from the file the state was taken over") as raised:
            restored(build, state)
        assert where in str(raised.value)


def test_plain_object_replaced_in_the_same_second_by_one_of_the_same_size(s3: dict[str, Any], tmp_path: Path) -> None:
    """Only the ETag tells the objects apart: same size, and S3 keeps last-modified in seconds."""
    server: S3Server = s3["server"]
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    first.write_bytes(b"".join(b'{"id": %d}\n' % i for i in range(10, 40)))
    second.write_bytes(b"".join(b'{"id": %d}\n' % i for i in range(40, 70)))
    key = "replaced/same-size.jsonl"
    where = server.upload(str(first), key)
    build = functools.partial(source, s3, where)
    pipe = build()
    take(pipe, 7)
    state = pipe.get_state()
    server.upload(str(second), key)
    state["files"][0][2] = build().get_state()["files"][0][2]  # as if within the same second
    with pytest.raises(rs.StateError, match="other content digest") as raised:
        restored(build, state)
    assert where in str(raised.value)


def test_missing_objects_and_denied_access_are_source_errors_naming_the_url(s3: dict[str, Any]) -> None:
    server: S3Server = s3["server"]
    cases = {
        f"s3://{BUCKET}/stream/absent.jsonl.gz": "no such object",
        "s3://no-such-bucket/stream/part-0.jsonl": "no such bucket",
        f"s3://{BUCKET}/stream/nothing-*.jsonl": "no objects match",
    }
    for where, cause in cases.items():
        with pytest.raises(rs.SourceError, match=cause) as raised:
            source(s3, where)
        assert where in str(raised.value)
    where = f"s3://{BUCKET}/{part_key(1)}"
    with server.require_auth(), pytest.raises(rs.SourceError, match="ACCESS_DENIED") as raised:
        source(s3, where)
    assert where in str(raised.value)


def test_bad_options_are_config_errors(s3: dict[str, Any]) -> None:
    options = s3["server"].options
    with pytest.raises(rs.ConfigError, match=r"storage_options \['colour'\] are not understood"):
        rs.jsonl_stream(url(), storage_options={**options, "colour": "red"})
    with pytest.raises(rs.ConfigError, match="storage_options apply to URLs"):
        rs.jsonl_stream(s3["parts"], storage_options=options)
    with pytest.raises(rs.ConfigError, match="pass storage_options or filesystem, not both"):
        rs.jsonl_stream(url(), storage_options=options, filesystem=pafs.LocalFileSystem())
    with pytest.raises(rs.ConfigError, match="chunk_bytes must be a positive int"):
        rs.jsonl_stream(url(), storage_options=options, chunk_bytes=0)


def big_gzip(tmp_path: Path) -> str:
    """A gzip file of about 1 MiB (random hex text hardly compresses): far more than the first
    reads of a ``GzipFile`` (128 KiB) take."""
    rng = np.random.default_rng(0)
    path = tmp_path / "big.jsonl.gz"
    with gzip.open(path, "wt") as out:
        out.writelines(json.dumps({"id": i, "text": rng.bytes(512).hex()}) + "\n" for i in range(2000))
    return str(path)


def test_a_failing_read_ahead_is_a_source_error_naming_the_url(
    s3: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(remote, "RETRY_ATTEMPTS", 2)  # the retry shows as well as with five
    server: S3Server = s3["server"]
    plain = f"s3://{BUCKET}/{part_key(0)}"
    compressed = server.upload(big_gzip(tmp_path), "faults/big.jsonl.gz")
    proxy = FaultProxy(server.endpoint, fraction=0)
    try:
        for where, chunk in ((plain, CHUNK), (compressed, BIG_CHUNK)):
            proxy.fraction = 0
            stream = rs.jsonl_stream(where, storage_options=proxy.options(server.options), chunk_bytes=chunk)
            assert take(stream, 1)[0]["id"] == 0
            proxy.fraction = 1  # every request from now on fails: the thread's next ranged read
            with pytest.raises(rs.SourceError, match="read-ahead of") as raised:
                list(stream)
            assert where in str(raised.value)
            stream.close()
            assert not read_ahead_threads()
    finally:
        proxy.stop()
