"""JSONL over ``s3://`` URLs against the loopback S3 server (tests/s3server.py): the same records
as the local files, exact resume with shuffle, shard and block shuffle, the line index cached once
per machine and shared by DataLoader workers, blocks read once when reading in order, and every
failure a ``StateError``/``SourceError`` naming the URL."""

from __future__ import annotations

import functools
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import resumable as rs
from resumable.sources._sidecar import SIDECAR_SUFFIX
from resumable.torch import Loader
from tests.resume import check_resume, loader_batches, restored, take
from tests.s3server import BUCKET, S3Server
from tests.sources import _file

RECORDS = [{"id": i, "text": f"line {i} " + "z" * (i % 29)} for i in range(120)]
PARTS = 3
BLOCK = 512
"""Small blocks, so that the files span many."""


@pytest.fixture(scope="module")
def s3(s3_server: S3Server, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The server, the local parts, the glob of their uploaded copies and a cache dir."""
    parts = [_file("jsonl", RECORDS[part::PARTS]) for part in range(PARTS)]
    for part, path in enumerate(parts):
        s3_server.upload(path, f"jsonl/part-{part}.jsonl")
    cache = str(tmp_path_factory.mktemp("index-cache"))
    return {"server": s3_server, "parts": parts, "url": f"s3://{BUCKET}/jsonl/part-*.jsonl", "cache": cache}


def source(s3: dict[str, Any], url: str | None = None, **options: Any) -> rs.nodes.JsonlSource:
    return rs.jsonl(
        url or s3["url"], storage_options=s3["server"].options, cache_dir=s3["cache"], block_bytes=BLOCK, **options
    )


def record_id(record: dict[str, Any]) -> int:
    return int(record["id"])


def test_same_records_as_the_local_files_and_blocks_read_once(s3: dict[str, Any]) -> None:
    remote = source(s3, disk_cache_bytes=0)  # every block from the server, whatever ran before
    assert remote.paths == [f"s3://{BUCKET}/jsonl/part-{part}.jsonl" for part in range(PARTS)]
    assert list(remote) == list(rs.jsonl(s3["parts"]))
    sizes = [os.path.getsize(path) for path in s3["parts"]]
    assert remote.stats["bytes_fetched"] == sum(sizes)  # each block once
    assert remote.stats["requests"] <= sum(math.ceil(size / BLOCK) for size in sizes)
    shuffled = source(s3).shuffle(seed=4)
    assert list(shuffled) == list(rs.jsonl(s3["parts"]).shuffle(seed=4))


@pytest.mark.parametrize("block_size", [None, 8])
def test_resume_with_shuffle_shard_and_block_shuffle(s3: dict[str, Any], block_size: int | None) -> None:
    def build() -> rs.Node[Any]:
        return source(s3).shuffle(seed=3, block_size=block_size).shard(0, 2)

    per_epoch = len(RECORDS) // 2
    total = 2 * per_epoch + 7
    for k in (0, per_epoch // 2, per_epoch, per_epoch + 1):  # start, middle, end, step after
        check_resume(build, k, total)
    check_resume(build, 10, total, k2=per_epoch + 20)  # across epochs, twice in a row


def test_loader_workers_share_the_cached_index(s3: dict[str, Any]) -> None:
    source(s3)  # the index of every part is in the cache dir now
    sidecars = sorted(Path(s3["cache"]).glob(f"part-*{SIDECAR_SUFFIX}"))  # not other tests' objects
    assert len(sidecars) == PARTS
    built = [path.stat().st_mtime_ns for path in sidecars]

    def build() -> rs.Node[Any]:
        return source(s3).shuffle(seed=1).shard(0, 1).map(record_id).batch(4, collate_fn=np.array)

    def make() -> Loader:
        return Loader(build, num_workers=2, prefetch_factor=2)

    expected, _ = loader_batches(make())
    assert sorted(x for batch in expected for x in batch) == list(range(len(RECORDS)))
    head, state = loader_batches(make(), stop=len(expected) // 2)
    resumed = make()
    resumed.load_state_dict(state)
    assert head + loader_batches(resumed)[0] == expected
    assert sorted(Path(s3["cache"]).glob(f"part-*{SIDECAR_SUFFIX}")) == sidecars
    assert [path.stat().st_mtime_ns for path in sidecars] == built  # reused, never rebuilt


def test_object_replaced_between_save_and_restore(s3: dict[str, Any]) -> None:
    server: S3Server = s3["server"]
    url = server.upload(_file("jsonl", RECORDS[:40]), "replaced/data.jsonl")
    build = functools.partial(source, s3, url)
    pipe = build()
    take(pipe, 7)
    state = pipe.get_state()
    other = [{**record, "text": record["text"].upper()} for record in RECORDS[:40]]  # same size
    server.upload(_file("jsonl", other), "replaced/data.jsonl")
    with pytest.raises(rs.StateError, match="differs from the file the state was taken over") as raised:
        restored(build, state)
    assert url in str(raised.value)


def test_malformed_line_names_url_and_line(s3: dict[str, Any], tmp_path: Path) -> None:
    local = tmp_path / "bad.jsonl"
    local.write_text('{"id": 0}\n{"id": 1}\n\n{"id": oops}\n{"id": 3}\n')
    url = s3["server"].upload(str(local), "bad/bad.jsonl")
    with pytest.raises(rs.SourceError, match="malformed JSON") as raised:
        list(source(s3, url))
    assert f"{url}:4" in str(raised.value)
    skipping = source(s3, url, on_error="skip")
    assert [record["id"] for record in skipping] == [0, 1, 3]
    assert skipping.stats["skipped"] == 1


def test_bad_block_options_are_config_errors(s3: dict[str, Any]) -> None:
    with pytest.raises(rs.ConfigError, match="block_bytes"):
        rs.jsonl(s3["url"], storage_options=s3["server"].options, block_bytes=0)
    with pytest.raises(rs.ConfigError, match="cache_bytes"):
        rs.jsonl(s3["url"], storage_options=s3["server"].options, block_bytes=4096, cache_bytes=1024)
