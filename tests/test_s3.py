"""Parquet and Arrow sources over ``s3://`` URLs, against a real S3 server on loopback (moto,
tests/s3server.py): exact resume, the same records as the local files, DataLoader workers, the
AWS environment, fsspec filesystems, and every failure a ``SourceError``/``StateError`` naming
the URL."""

from __future__ import annotations

import functools
import os
from typing import Any

import numpy as np
import pyarrow.fs as pafs
import pytest

import resumable as rs
from resumable.torch import Loader
from tests.resume import check_resume, loader_batches, restored, take
from tests.s3server import BUCKET, KEY_ID, REGION, SECRET, S3Server
from tests.sources import _file

RECORDS = [{"id": i, "text": f"document {i} " + "x" * (i % 13)} for i in range(90)]
PARTS = 3
KINDS = ("parquet", "arrow", "arrow_stream")


@pytest.fixture(scope="module")
def s3(s3_server: S3Server) -> dict[str, Any]:
    """The server, and per kind: the local files (``RECORDS`` in ``PARTS`` files) and the glob
    of their uploaded copies."""
    files: dict[str, Any] = {"server": s3_server}
    for kind in KINDS:
        parts = [_file(kind, RECORDS[part::PARTS]) for part in range(PARTS)]
        for part, path in enumerate(parts):
            s3_server.upload(path, f"{kind}/part-{part}.{kind}")
        files[kind] = (parts, f"s3://{BUCKET}/{kind}/part-*.{kind}")
    return files


def source(kind: str, url: Any, options: dict[str, Any] | None) -> rs.Node[Any]:
    read = rs.parquet if kind == "parquet" else rs.arrow
    return read(url, storage_options=options)


def pipeline(kind: str, url: Any, options: dict[str, Any] | None, world_size: int = 2) -> rs.Node[Any]:
    """Shuffled, and rank 0's share of ``world_size`` (split again between DataLoader workers)."""
    return source(kind, url, options).shuffle(seed=3).shard(0, world_size)


def record_id(record: dict[str, Any]) -> int:
    return int(record["id"])


@pytest.mark.parametrize("kind", KINDS)
def test_same_records_as_the_local_files(s3: dict[str, Any], kind: str) -> None:
    parts, url = s3[kind]
    remote = source(kind, url, s3["server"].options)
    assert remote.paths == [f"s3://{BUCKET}/{kind}/part-{part}.{kind}" for part in range(PARTS)]  # type: ignore[attr-defined]
    assert list(remote) == list(source(kind, parts, None))
    assert sorted(record["id"] for record in remote) == list(range(len(RECORDS)))


@pytest.mark.parametrize("kind", KINDS)
def test_resume_over_s3_with_shuffle_and_shard(s3: dict[str, Any], kind: str) -> None:
    _, url = s3[kind]
    build = functools.partial(pipeline, kind, url, s3["server"].options)
    per_epoch = len(RECORDS) // 2
    total = 2 * per_epoch + 7
    for k in (0, per_epoch // 2, per_epoch, per_epoch + 1):  # start, middle, end, step after
        check_resume(build, k, total)
    check_resume(build, 10, total, k2=per_epoch + 20)  # across epochs, twice in a row
    assert take(build(), per_epoch) != take(build(), 2 * per_epoch)[per_epoch:]  # reshuffled


@pytest.mark.parametrize("kind", ["parquet", "arrow"])
def test_loader_with_two_workers_resumes_exactly(s3: dict[str, Any], kind: str) -> None:
    _, url = s3[kind]
    build = functools.partial(pipeline, kind, url, s3["server"].options, world_size=1)

    def make() -> Loader:
        return Loader(lambda: build().map(record_id).batch(4, collate_fn=np.array), num_workers=2, prefetch_factor=2)

    expected, _ = loader_batches(make())
    assert sorted(x for batch in expected for x in batch) == list(range(len(RECORDS)))
    head, state = loader_batches(make(), stop=len(expected) // 2)
    resumed = make()
    resumed.load_state_dict(state)
    tail, _ = loader_batches(resumed)
    assert head + tail == expected


def test_aws_environment_is_honoured(s3: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    server: S3Server = s3["server"]
    parts, url = s3["parquet"]
    monkeypatch.setenv("AWS_ENDPOINT_URL", server.endpoint)  # plain http on 127.0.0.1
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEY_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    assert list(rs.parquet(url)) == list(rs.parquet(parts))


def test_a_pyarrow_or_fsspec_filesystem_object(s3: dict[str, Any]) -> None:
    server: S3Server = s3["server"]
    parts, _ = s3["arrow"]
    host = server.endpoint.removeprefix("http://")
    filesystem = pafs.S3FileSystem(
        access_key=KEY_ID, secret_key=SECRET, endpoint_override=host, scheme="http", region=REGION
    )
    names = [f"{BUCKET}/arrow/part-{part}.arrow" for part in range(PARTS)]
    assert list(rs.arrow(names, filesystem=filesystem)) == list(rs.arrow(parts))
    local = pafs.PyFileSystem(pafs.FSSpecHandler(pytest.importorskip("fsspec").filesystem("file")))
    assert list(rs.parquet(s3["parquet"][0], filesystem=local)) == list(rs.parquet(s3["parquet"][0]))


@pytest.mark.parametrize("kind", ["parquet", "arrow"])
def test_missing_objects_and_denied_access_name_the_url(s3: dict[str, Any], kind: str) -> None:
    server: S3Server = s3["server"]
    cases = {
        f"s3://{BUCKET}/{kind}/absent.{kind}": "no such object",
        f"s3://no-such-bucket/{kind}/part-0.{kind}": "no such bucket",
        f"s3://{BUCKET}/{kind}/nothing-*.{kind}": "no objects match",
    }
    for url, cause in cases.items():
        with pytest.raises(rs.SourceError, match=cause) as raised:
            source(kind, url, server.options)
        assert url in str(raised.value)
    url = f"s3://{BUCKET}/{kind}/part-0.{kind}"
    with server.require_auth(), pytest.raises(rs.SourceError, match="ACCESS_DENIED") as raised:
        source(kind, url, server.options)
    assert url in str(raised.value)


@pytest.mark.parametrize("kind", ["parquet", "arrow"])
def test_object_replaced_between_save_and_restore(s3: dict[str, Any], kind: str) -> None:
    server: S3Server = s3["server"]
    url = server.upload(_file(kind, RECORDS[:40]), f"replaced/data.{kind}")
    build = functools.partial(source, kind, url, server.options)
    pipe = build()
    take(pipe, 7)
    state = pipe.get_state()
    server.upload(_file(kind, RECORDS[40:80]), f"replaced/data.{kind}")  # other content under the same URL
    with pytest.raises(rs.StateError, match="differs from the file the state was taken over") as raised:
        restored(build, state)
    assert url in str(raised.value)


def test_bad_options_are_config_errors(s3: dict[str, Any]) -> None:
    _, url = s3["parquet"]
    with pytest.raises(rs.ConfigError, match="not understood"):
        rs.parquet(url, storage_options={"bogus": 1})
    with pytest.raises(rs.ConfigError, match="mix"):
        rs.parquet([url, s3["parquet"][0][0]], storage_options=s3["server"].options)


def test_client_kwargs_and_anonymous_access_to_a_private_bucket(s3: dict[str, Any]) -> None:
    server: S3Server = s3["server"]
    parts, url = s3["parquet"]
    options = {
        "key": KEY_ID,
        "secret": SECRET,
        "client_kwargs": {"endpoint_url": server.endpoint, "region_name": REGION},
    }
    assert list(rs.parquet(url, storage_options=options)) == list(rs.parquet(parts))
    anonymous = {"anon": True, "endpoint_url": server.endpoint, "region": REGION}  # unsigned requests
    with pytest.raises(rs.SourceError, match="ACCESS_DENIED") as raised:  # the bucket is private
        rs.parquet(url, storage_options=anonymous)
    assert "part-0.parquet" in str(raised.value)
    with pytest.raises(rs.ConfigError, match="client_kwargs.verify"):
        rs.parquet(url, storage_options={"client_kwargs": {"verify": False}})


@pytest.mark.parametrize("kind", ["parquet", "arrow", "jsonl"])
def test_a_state_moves_between_a_local_copy_and_the_uploaded_object(s3: dict[str, Any], kind: str) -> None:
    """Remote digests carry the ETag, local ones do not: across the two only the content digest
    is compared, so a job may stage its data locally or read it from the bucket."""
    server: S3Server = s3["server"]
    path = _file(kind, RECORDS)
    url = server.upload(path, f"portable/{path.rsplit('/', 1)[1]}")
    read = {"parquet": rs.parquet, "arrow": rs.arrow, "jsonl": rs.jsonl}[kind]

    def local() -> rs.Node[Any]:
        return read(path).shuffle(seed=5)

    def remote() -> rs.Node[Any]:
        return read(url, storage_options=server.options).shuffle(seed=5)

    for saved_on, restored_on in ((local, remote), (remote, local)):
        pipe = saved_on()
        head = take(pipe, 20)
        resumed = restored(restored_on, pipe.get_state())
        assert head + take(resumed, len(RECORDS) - 20) == take(saved_on(), len(RECORDS))


@pytest.mark.parametrize("kind", ["arrow", "arrow_stream"])
def test_an_arrow_object_is_fetched_once_to_build_the_source(s3: dict[str, Any], kind: str, tmp_path: Any) -> None:
    """Its batches and its fingerprint's IPC digest come from the same bytes, even when the
    memory tier cannot hold the object and the disk tier is off."""
    server: S3Server = s3["server"]
    path = _file(kind, [{"id": i, "text": "w" * 200} for i in range(300)])  # ~60 kB
    url = server.upload(path, f"fetched-once/data.{kind}")
    tiny = {"block_bytes": 1024, "cache_bytes": 4096, "disk_cache_bytes": 0, "cache_dir": str(tmp_path)}
    remote = rs.arrow(url, storage_options=server.options, **tiny)
    assert os.path.getsize(path) > 10 * 4096
    assert remote.stats["bytes_fetched"] == os.path.getsize(path)
    assert list(remote) == list(rs.arrow(path))
