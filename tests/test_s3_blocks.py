"""The remote block layer (``resumable.sources.blocks``) under attack, over JSONL, Parquet and
Arrow objects on the loopback S3 server (tests/s3server.py): tiny blocks and memory tiers so that
read-ahead, eviction and records spanning blocks all happen; the disk tier shared by processes,
a reader SIGKILLed mid-fetch and damaged chunk files; forked DataLoader workers while read-ahead
is in flight; an object replaced by one that only its ETag tells apart; faults retried and
counted; invalid block options. Every check compares with the records of the local file."""

from __future__ import annotations

import multiprocessing
import os
import queue
import shutil
import signal
from pathlib import Path
from typing import Any, Callable, Iterator

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import resumable as rs
from resumable.sources._sidecar import SIDECAR_SUFFIX
from resumable.sources.blocks import CHUNKS_DIR
from resumable.sources.remote import EDGE_BYTES
from resumable.torch import PipelineDataset
from tests.s3proxy import FaultProxy
from tests.s3server import BUCKET, S3Server
from tests.sources import _file

KINDS = ("jsonl", "parquet", "arrow")
READERS: dict[str, Callable[..., rs.Node[Any]]] = {"jsonl": rs.jsonl, "parquet": rs.parquet, "arrow": rs.arrow}
SEED = 7
SHUFFLE_BLOCK = 16
"""Records per block of the block shuffles below."""
CHILD_TIMEOUT_S = 60.0
"""Longest wait for a child process or a DataLoader batch: a hang fails, never blocks the run."""


def _text(i: int) -> str:
    """Text of record ``i``: mostly short, every 37th over 2 kB, so records span several blocks."""
    length = 2500 if i % 37 == 0 else 10 + (i * 53) % 200
    return f"doc {i} " + "abcdefghijklmnopqrstuvwxyz"[i % 26] * length


RECORDS = [{"id": i, "text": _text(i)} for i in range(600)]
"""About 100 kB as JSONL; Parquet in five row groups, Arrow in four record batches."""


@pytest.fixture(scope="module")
def objects(s3_server: S3Server) -> dict[str, tuple[str, str]]:
    """Per kind: the local file of ``RECORDS`` and the URL of its uploaded copy."""
    files = {}
    for kind in KINDS:
        path = _file(kind, RECORDS)
        files[kind] = (path, s3_server.upload(path, f"blocks/data.{kind}"))
    return files


def remote_source(kind: str, url: str, options: dict[str, Any], cache_dir: Path | str, **blocks: Any) -> Any:
    """A ``kind`` source over ``url`` with its line index and disk tier in ``cache_dir``."""
    return READERS[kind](url, storage_options=options, cache_dir=str(cache_dir), **blocks)


def ids(records: list[dict[str, Any]]) -> list[int]:
    return [int(record["id"]) for record in records]


def _cost_records() -> list[dict[str, Any]]:
    """8,000 records of about 200 bytes (1.6 MB as JSONL): fifty times the memory tier below."""
    return [{"id": i, "text": f"doc {i} " + "abcdefghij"[i % 10] * (20 + (i * 37) % 300)} for i in range(8000)]


# -- 1. exactness under read-ahead and eviction --------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("block_bytes", [512, 4096])
def test_sequential_and_block_shuffled_reads_equal_the_local_file(
    s3_server: S3Server, objects: dict[str, tuple[str, str]], kind: str, block_bytes: int, tmp_path: Path
) -> None:
    path, url = objects[kind]
    local = READERS[kind](path)
    tiny = {"block_bytes": block_bytes, "cache_bytes": 3 * block_bytes}
    sequential = remote_source(kind, url, s3_server.options, tmp_path, **tiny, disk_cache_bytes=0)
    assert list(sequential) == list(local) == RECORDS
    shuffled = remote_source(kind, url, s3_server.options, tmp_path, **tiny, disk_cache_bytes=0)
    expected = list(READERS[kind](path).shuffle(SEED, block_size=SHUFFLE_BLOCK))
    assert list(shuffled.shuffle(SEED, block_size=SHUFFLE_BLOCK)) == expected
    assert sorted(ids(expected)) == list(range(len(RECORDS)))
    if kind != "arrow":  # an Arrow object is read whole when the source is built: nothing ahead
        assert sequential.stats["read_ahead_blocks"] > 0
        assert shuffled.stats["read_ahead_blocks"] > 0
    if kind == "parquet":
        assert pq.ParquetFile(path).metadata.num_row_groups > 1


@pytest.mark.parametrize("block_bytes", [512, 4096])
def test_sequential_jsonl_fetches_each_byte_once(s3_server: S3Server, block_bytes: int, tmp_path: Path) -> None:
    records = _cost_records()
    path = _file("jsonl", records)
    url = s3_server.upload(path, "blocks/cost.jsonl")
    source = remote_source(
        "jsonl",
        url,
        s3_server.options,
        tmp_path,
        block_bytes=block_bytes,
        cache_bytes=4 * block_bytes,
        disk_cache_bytes=0,
    )
    assert list(source) == records
    assert source.stats["read_ahead_blocks"] > 0
    assert source.stats["bytes_fetched"] == os.path.getsize(path)


# -- 2. what a block-shuffled epoch costs --------------------------------------------------------


@pytest.mark.parametrize(
    "shuffle_block, disk_cache_bytes",
    [
        pytest.param(40, 0, id="window-fits-memory"),
        # A window (4 x 256 records, ~200 kB) wider than the 32-block memory tier: the block
        # shuffle reserves two windows of memory, so its blocks are fetched once.
        pytest.param(256, 0, id="window-wider-than-memory"),
        # Shuffle blocks of ~2 kB over 1 kB blocks share their edge blocks with file neighbours
        # that come up in other windows: the disk tier serves those again (with it off, an epoch
        # costs about 1 + block_bytes / shuffle-block bytes, 1.33x here; docs/sources.md).
        pytest.param(10, 64 << 20, id="shuffle-block-of-two-blocks-disk-tier"),
    ],
)
def test_block_shuffled_jsonl_epoch_fetches_at_most_1_2x_the_data(
    s3_server: S3Server, tmp_path: Path, shuffle_block: int, disk_cache_bytes: int
) -> None:
    """Default settings scaled down by 1024 (1 kB blocks, 32-block memory tier): every byte
    counted in ``bytes_fetched`` came from the server."""
    records = _cost_records()
    path = _file("jsonl", records)
    url = s3_server.upload(path, "blocks/cost.jsonl")
    source = remote_source(
        "jsonl",
        url,
        s3_server.options,
        tmp_path,
        block_bytes=1024,
        cache_bytes=32 << 10,
        disk_cache_bytes=disk_cache_bytes,
    )
    assert sorted(ids(list(source.shuffle(SEED, block_size=shuffle_block)))) == list(range(len(records)))
    ratio = source.stats["bytes_fetched"] / os.path.getsize(path)
    assert ratio <= 1.2, f"a block-shuffled epoch fetched {ratio:.3f}x the data"


# -- 3. the disk tier, shared by processes -------------------------------------------------------


def _in_child(work: Callable[[], Any]) -> Any:
    """``work()`` run in a forked child process; its result, or its error re-raised here."""
    context = multiprocessing.get_context("fork")
    results: multiprocessing.Queue[tuple[bool, Any]] = context.Queue()

    def run() -> None:
        try:
            results.put((True, work()))
        except BaseException as error:  # noqa: BLE001 - reported to the parent
            results.put((False, f"{type(error).__name__}: {error}"))

    child = context.Process(target=run)
    child.start()
    try:
        ok, value = results.get(timeout=CHILD_TIMEOUT_S)
    except queue.Empty:
        child.kill()
        pytest.fail("the child process did not answer in time (hung)")
    child.join(CHILD_TIMEOUT_S)
    if not ok:
        pytest.fail(f"the child process failed: {value}")
    return value


@pytest.mark.parametrize("kind", KINDS)
def test_a_second_process_reads_everything_from_the_disk_tier(
    s3_server: S3Server, objects: dict[str, tuple[str, str]], kind: str, tmp_path: Path
) -> None:
    _, url = objects[kind]
    options = {"block_bytes": 1024, "cache_bytes": 4096}
    assert list(remote_source(kind, url, s3_server.options, tmp_path, **options)) == RECORDS

    def read_again() -> tuple[bool, dict[str, int]]:
        source = remote_source(kind, url, s3_server.options, tmp_path, **options)
        return list(source) == RECORDS, source.stats

    same, stats = _in_child(read_again)
    assert same
    assert stats["requests"] == 0 and stats["bytes_fetched"] == 0
    assert stats["disk_hits"] > 0


@pytest.mark.parametrize("kind", KINDS)
def test_no_disk_tier_writes_no_chunks(
    s3_server: S3Server, objects: dict[str, tuple[str, str]], kind: str, tmp_path: Path
) -> None:
    _, url = objects[kind]
    source = remote_source(kind, url, s3_server.options, tmp_path, block_bytes=1024, disk_cache_bytes=0)
    assert list(source) == RECORDS
    assert source.stats["disk_hits"] == 0
    assert not (tmp_path / CHUNKS_DIR).exists()


# -- 4. a reader SIGKILLed mid-fetch ------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_a_reader_killed_mid_epoch_leaves_a_usable_disk_tier(
    s3_server: S3Server, objects: dict[str, tuple[str, str]], kind: str, tmp_path: Path
) -> None:
    _, url = objects[kind]
    options = {"block_bytes": 512, "cache_bytes": 2048}
    context = multiprocessing.get_context("fork")
    started = context.Event()

    def read_for_ever() -> None:
        source = remote_source(kind, url, s3_server.options, tmp_path, **options)
        pipe = source.shuffle(SEED, block_size=SHUFFLE_BLOCK)
        for epoch in range(10**6):  # new blocks keep coming: epochs reshuffle, the memory tier is tiny
            for count, _ in enumerate(pipe):
                if epoch == 0 and count == 40:
                    started.set()

    child = context.Process(target=read_for_ever)
    child.start()
    try:
        assert started.wait(CHILD_TIMEOUT_S), "the child did not start reading"
    finally:
        os.kill(child.pid, signal.SIGKILL)  # type: ignore[arg-type]
        child.join(CHILD_TIMEOUT_S)
    assert child.exitcode == -signal.SIGKILL
    chunks = tmp_path / CHUNKS_DIR
    assert any(path.is_file() for path in chunks.rglob("*"))
    source = remote_source(kind, url, s3_server.options, tmp_path, **options)
    assert list(source) == RECORDS
    assert list(source.shuffle(SEED, block_size=SHUFFLE_BLOCK)) == list(
        READERS[kind](objects[kind][0]).shuffle(SEED, block_size=SHUFFLE_BLOCK)
    )
    assert source.stats["disk_hits"] > 0


# -- 5. damaged chunk files ---------------------------------------------------------------------

DAMAGES = ("flip", "truncate", "delete", "empty", "append")


def _damage(path: Path, how: str, where: float) -> None:
    """Damage the file at ``path``: flip a byte, cut it short, remove it, empty it or append
    bytes; ``where`` (0 to 1) picks the byte."""
    data = path.read_bytes()
    at = min(len(data) - 1, int(where * len(data))) if data else 0
    if how == "delete":
        path.unlink()
    elif how == "flip" and data:
        path.write_bytes(data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1 :])
    elif how == "truncate":
        path.write_bytes(data[:at])
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "append":
        path.write_bytes(data + b"\x00garbage")


@pytest.fixture(scope="module")
def populated(
    s3_server: S3Server, objects: dict[str, tuple[str, str]], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """Per kind: a cache dir whose disk tier and line index a full read filled."""
    dirs = {}
    for kind in KINDS:
        cache = tmp_path_factory.mktemp(f"populated-{kind}")
        assert list(remote_source(kind, objects[kind][1], s3_server.options, cache, block_bytes=2048)) == RECORDS
        dirs[kind] = cache
    return dirs


@settings(max_examples=30)
@given(
    kind=st.sampled_from(KINDS),
    damages=st.lists(
        st.tuples(st.integers(0, 10**6), st.sampled_from(DAMAGES), st.floats(0, 1)), min_size=1, max_size=12
    ),
)
def test_damaged_chunk_files_are_never_served(
    s3_server: S3Server,
    objects: dict[str, tuple[str, str]],
    populated: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
    kind: str,
    damages: list[tuple[int, str, float]],
) -> None:
    cache = tmp_path_factory.mktemp("damaged") / "cache"
    shutil.copytree(populated[kind], cache)
    files = sorted(path for path in (cache / CHUNKS_DIR).rglob("*") if path.is_file() and path.name.isdigit())
    assert files
    for pick, how, where in damages:
        path = files[pick % len(files)]
        if path.exists():
            _damage(path, how, where)
    try:
        source = remote_source(kind, objects[kind][1], s3_server.options, cache, block_bytes=2048)
        assert list(source) == RECORDS
        assert list(source.shuffle(SEED, block_size=SHUFFLE_BLOCK)) == list(
            READERS[kind](objects[kind][0]).shuffle(SEED, block_size=SHUFFLE_BLOCK)
        )
    except (rs.SourceError, rs.StateError, rs.ConfigError) as error:
        pytest.fail(f"damaged chunk files are misses, not errors: {error}")
    finally:
        shutil.rmtree(cache.parent, ignore_errors=True)


# -- 6. forked DataLoader workers while read-ahead is in flight ---------------------------------


def _worker_ids(dataset: PipelineDataset) -> list[int]:
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=None, num_workers=2, multiprocessing_context="fork", timeout=CHILD_TIMEOUT_S
    )
    return [int(record["id"]) for record in loader]


@pytest.mark.parametrize("kind", KINDS)
def test_forked_workers_after_a_partial_read_neither_hang_nor_misread(
    s3_server: S3Server, objects: dict[str, tuple[str, str]], kind: str, tmp_path: Path
) -> None:
    _, url = objects[kind]

    def build(cache: Path) -> rs.Node[Any]:
        source = remote_source(kind, url, s3_server.options, cache, block_bytes=512, cache_bytes=8192)
        return source.shuffle(SEED, block_size=SHUFFLE_BLOCK).shard()

    expected = _worker_ids(PipelineDataset(build(tmp_path / "fresh")))
    assert sorted(expected) == list(range(len(RECORDS)))
    pipe = build(tmp_path / "busy")
    iterator = iter(pipe)
    for _ in range(100):  # the cursor's next chunks are being fetched ahead now
        next(iterator)
    assert _worker_ids(PipelineDataset(pipe)) == expected


# -- 7. an object replaced by one that only its ETag tells apart --------------------------------


def _replacement(kind: str, directory: Path) -> tuple[list[dict[str, Any]], str]:
    """Records of the same lengths as ``RECORDS_7`` with the middle third upper-cased, and a
    file of ``kind`` in ``directory`` holding them."""
    changed = [
        {**record, "text": record["text"].upper()} if len(RECORDS_7) // 3 <= i < 2 * len(RECORDS_7) // 3 else record
        for i, record in enumerate(RECORDS_7)
    ]
    out = str(directory / f"replaced.{kind}")
    _write_plain(kind, changed, out)
    return changed, out


RECORDS_7 = [{"id": i, "text": f"line {i:05d} " + "q" * 200} for i in range(2400)]
"""About 500 kB: the middle third lies well inside the first and last ``EDGE_BYTES``."""


def _write_plain(kind: str, records: list[dict[str, Any]], path: str) -> None:
    """Write ``records`` so that same-length values give the same bytes outside the values:
    JSONL lines; Parquet without compression, dictionaries or statistics; Arrow IPC uncompressed."""
    if kind == "jsonl":
        Path(path).write_text("".join(f'{{"id": {r["id"]}, "text": "{r["text"]}"}}\n' for r in records))
        return
    table = pa.Table.from_pylist(records)
    if kind == "parquet":
        pq.write_table(
            table, path, row_group_size=600, compression="none", use_dictionary=False, write_statistics=False
        )
    else:
        with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            for batch in table.to_batches(max_chunksize=600):
                writer.write_batch(batch)


def _same_last_modified(server: S3Server, key: str, last_modified: Any) -> None:
    """Give the object ``key`` the Last-Modified of the object it replaced: an upload within the
    same second (the header's resolution), so that only the ETag differs."""
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends

    s3_backends[DEFAULT_ACCOUNT_ID]["global"].buckets[BUCKET].keys[key].last_modified = last_modified


def _last_modified(key: str) -> Any:
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends

    return s3_backends[DEFAULT_ACCOUNT_ID]["global"].buckets[BUCKET].keys[key].last_modified


@pytest.mark.parametrize("kind", KINDS)
def test_an_object_replaced_with_the_same_size_and_edges_is_refused_on_restore(
    s3_server: S3Server, kind: str, tmp_path: Path
) -> None:
    original = str(tmp_path / f"original.{kind}")
    _write_plain(kind, RECORDS_7, original)
    changed, replacement = _replacement(kind, tmp_path)
    before, after = Path(original).read_bytes(), Path(replacement).read_bytes()
    assert len(before) == len(after) > 3 * EDGE_BYTES
    assert before[:EDGE_BYTES] == after[:EDGE_BYTES] and before[-EDGE_BYTES:] == after[-EDGE_BYTES:]
    assert before != after
    key = f"etag-only/data.{kind}"
    url = s3_server.upload(original, key)
    cache = tmp_path / "cache"
    pipe = remote_source(kind, url, s3_server.options, cache, block_bytes=4096)
    iterator = iter(pipe)
    for _ in range(7):
        next(iterator)
    state = pipe.get_state()
    modified = _last_modified(key)
    s3_server.upload(replacement, key)
    _same_last_modified(s3_server, key, modified)
    rebuilt = remote_source(kind, url, s3_server.options, cache, block_bytes=4096)
    with pytest.raises(rs.StateError) as raised:
        rebuilt.set_state(state)
    assert url in str(raised.value)
    assert list(rebuilt) == changed  # the new object's records: no stale index, no stale block
    if kind == "jsonl":
        assert len(list(cache.glob(f"data.jsonl.*{SIDECAR_SUFFIX}"))) == 2  # a new index, the old one kept


# -- 8. faults retried and counted --------------------------------------------------------------


@pytest.fixture
def proxy(s3_server: S3Server) -> Iterator[FaultProxy]:
    started = FaultProxy(s3_server.endpoint, fraction=0.2, seed=5)
    yield started
    started.stop()


@pytest.mark.parametrize("kind", KINDS)
def test_faults_are_retried_counted_and_the_records_exact(
    s3_server: S3Server, objects: dict[str, tuple[str, str]], proxy: FaultProxy, kind: str, tmp_path: Path
) -> None:
    path, url = objects[kind]
    source = remote_source(
        kind, url, proxy.options(s3_server.options), tmp_path, block_bytes=1024, cache_bytes=4096, disk_cache_bytes=0
    )
    assert list(source.shuffle(SEED, block_size=SHUFFLE_BLOCK)) == list(
        READERS[kind](path).shuffle(SEED, block_size=SHUFFLE_BLOCK)
    )
    assert list(source) == RECORDS
    assert proxy.faults > 0
    assert source.stats["retries"] > 0


# -- 9. invalid block options -------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"block_bytes": 0}, "block_bytes"),
        ({"block_bytes": -1}, "block_bytes"),
        ({"block_bytes": True}, "block_bytes"),
        ({"block_bytes": 1024.0}, "block_bytes"),
        ({"block_bytes": 4096, "cache_bytes": 1024}, "cache_bytes"),
        ({"cache_bytes": 0}, "cache_bytes"),
        ({"cache_bytes": False}, "cache_bytes"),
        ({"disk_cache_bytes": -1}, "disk_cache_bytes"),
        ({"disk_cache_bytes": True}, "disk_cache_bytes"),
        ({"disk_cache_bytes": "1GB"}, "disk_cache_bytes"),
    ],
)
def test_invalid_block_options_are_config_errors_naming_the_option(
    s3_server: S3Server, objects: dict[str, tuple[str, str]], kind: str, options: dict[str, Any], named: str
) -> None:
    with pytest.raises(rs.ConfigError, match=named) as raised:
        READERS[kind](objects[kind][1], storage_options=s3_server.options, **options)
    assert READERS[kind](objects[kind][0]).kind in str(raised.value)  # type: ignore[attr-defined]
