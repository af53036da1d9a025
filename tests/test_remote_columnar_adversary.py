"""Adversary of the columnar sources over an S3-compatible store (docs/sources.md "Remote data
(S3)", docs/formats.md): ``rs.parquet`` and ``rs.arrow`` over ``s3://`` objects on the loopback
moto server of ``tests/s3server.py``, each compared with the same files read locally.

The data set mixes what row-group arithmetic gets wrong: a file of many small row groups (the
last one partial), a file holding one empty row group, a file with no row group at all, one huge
row group far larger than the memory tier of blocks, and a dataset directory's summaries
(``_metadata``, ``_common_metadata``, ``_SUCCESS``) beside the parts. Over it: globs, column
selections, resume at every row-group edge and across epochs (plain, block-shuffled, sharded,
packed), ranks and ``rs.torch.Loader`` workers (0, 2, persistent), states that must equal the
local ones apart from the location, transient faults of the endpoint while footers and column
chunks are read (the fault proxy of ``tests/s3proxy.py``), the disk tier of blocks, and objects
replaced, cut short or removed between a save and a restore or during a pass: a typed error
naming the object, never rows of another object.

Bugs it found, mended: an object replaced by one of the same size and layout while a pipeline
reads it (mid-epoch, before the next epoch, or before ``set_state`` on the live pipeline) handed
out the replacement's rows (every ranged read is now confirmed by a HEAD); read-ahead picked
column chunks by the first dotted part of their path, so a selected column whose name holds a
dot was never fetched ahead and its undotted twin dragged its chunks along.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import pickle
import shutil
from pathlib import Path
from typing import Any, Callable, Iterator

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given
from hypothesis import strategies as st

import resumable as rs
from resumable.sources import blocks, remote
from resumable.torch import Loader
from tests.resume import loader_head, loader_rest, plain, restored, roundtrip, take
from tests.s3proxy import FaultProxy
from tests.s3server import BUCKET, S3Server

PREFIX = "columnar-adversary"
BLOCK = 512
"""Small blocks: the huge row group spans dozens of them."""
MEMORY = 4 * BLOCK
"""A memory tier of four blocks: far smaller than the huge row group."""


def text(i: int) -> str:
    """Short texts, except in the huge row group (ids 60 to 159), whose rows are ~400 bytes."""
    return f"doc {i} " + "abcdefghij"[i % 10] * ((i * 37) % 150 + (300 if 60 <= i < 160 else 0))


def record(i: int) -> dict[str, Any]:
    return {"id": i, "text": text(i), "tokens": [i + 1] * (1 + i % 5)}


SCHEMA = pa.schema([("id", pa.int64()), ("text", pa.string()), ("tokens", pa.list_(pa.int32()))])


def table(ids: range) -> pa.Table:
    return pa.Table.from_pylist([record(i) for i in ids], schema=SCHEMA)


TOTAL = 167
PARTS: dict[str, tuple[range, int | None]] = {
    "a-many": (range(0, 60), 3),  # twenty row groups of three rows
    "b-empty-group": (range(0), 1),  # one row group of no rows
    "c-no-groups": (range(0), None),  # a footer and no row group at all
    "d-huge": (range(60, 160), 10**6),  # one row group of 100 rows, ~45 kB
    "e-tail": (range(160, 167), 2),  # 2, 2, 2 and a last group of 1
}
"""Parts of the data set by name (sorted as a glob sorts them): their ids and rows per group."""
EDGES = [0, 1, 2, 3, 58, 59, 60, 61, 110, 159, 160, 161, 162, 165, 166, 167, 168, 200]
"""Resume points of a plain pass: the first row, inside and at the end of a small row group, the
last row of the many-group file, the first and the middle and the last row of the huge row group
(after the two empty files), the last group of one row, the last row, after it, the next epoch."""


def write_parquet(path: Path, ids: range, rows_per_group: int | None, collector: list[Any] | None = None) -> None:
    if rows_per_group is None:
        pq.ParquetWriter(str(path), SCHEMA).close()
        return
    pq.write_table(table(ids), str(path), row_group_size=rows_per_group, metadata_collector=collector)


def write_arrow(path: Path, ids: range, rows_per_batch: int | None, stream: bool) -> None:
    """Record batches of ``rows_per_batch`` rows; with no ids, one batch of no rows, or none at
    all where ``rows_per_batch`` is None (as the Parquet parts)."""
    new_writer = pa.ipc.new_stream if stream else pa.ipc.new_file
    with pa.OSFile(str(path), "wb") as sink, new_writer(sink, SCHEMA) as writer:
        if not ids and rows_per_batch is not None:
            writer.write_batch(pa.RecordBatch.from_pylist([], schema=SCHEMA))
        for batch in table(ids).to_batches(max_chunksize=rows_per_batch or 1):
            writer.write_batch(batch)


@pytest.fixture(scope="module")
def data(s3_server: S3Server, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The data set twice, locally and under ``PREFIX`` in the bucket: Parquet parts and summaries
    in ``parquet/``, Arrow IPC files (the file format and the stream format) in ``arrow/``."""
    root = tmp_path_factory.mktemp("columnar")
    (root / "parquet").mkdir()
    (root / "arrow").mkdir()
    collected: list[Any] = []
    for name, (ids, rows) in PARTS.items():
        before = len(collected)
        write_parquet(root / "parquet" / f"{name}.parquet", ids, rows, collected)
        for metadata in collected[before:]:
            metadata.set_file_path(f"{name}.parquet")
        write_arrow(root / "arrow" / f"{name}.arrow", ids, rows, stream=name in ("d-huge", "e-tail"))
    pq.write_metadata(SCHEMA, str(root / "parquet" / "_metadata"), metadata_collector=collected)
    pq.write_metadata(SCHEMA, str(root / "parquet" / "_common_metadata"))
    (root / "parquet" / "_SUCCESS").write_bytes(b"")
    for path in sorted(root.rglob("*")):
        if path.is_file():
            s3_server.upload(str(path), f"{PREFIX}/{path.relative_to(root)}")
    return {"server": s3_server, "root": root, "url": f"s3://{BUCKET}/{PREFIX}"}


def read(kind: str) -> Callable[..., Any]:
    return rs.parquet if kind == "parquet" else rs.arrow


def local(data: dict[str, Any], kind: str, pattern: str = "*", **options: Any) -> Any:
    return read(kind)(str(data["root"] / kind / pattern), **options)


def remote_source(
    data: dict[str, Any],
    kind: str,
    pattern: str = "*",
    disk: bool = False,
    cache: Path | None = None,
    options: dict[str, Any] | None = None,
    **extra: Any,
) -> Any:
    """The source over the uploaded copy: small blocks, a memory tier of four blocks, the disk
    tier off unless ``disk`` (in ``cache``, else the session's cache dir)."""
    return read(kind)(
        f"{data['url']}/{kind}/{pattern}",
        storage_options=options or data["server"].options,
        block_bytes=BLOCK,
        cache_bytes=MEMORY,
        disk_cache_bytes=(1 << 30) if disk else 0,
        cache_dir=str(cache) if cache is not None else None,
        **extra,
    )


def ids(records: list[Any]) -> list[int]:
    return [int(r["id"]) for r in records]


def record_id(r: dict[str, Any]) -> int:
    return int(r["id"])


def as_tokens(r: dict[str, Any]) -> dict[str, Any]:
    return {"input_ids": r["tokens"]}


CHAINS: dict[str, Callable[[Any], Any]] = {
    "plain": lambda s: s,
    "shuffle_shard": lambda s: s.shuffle(seed=4).shard(1, 3).map(record_id),
    "block_row_group": lambda s: s.shuffle(seed=5, block_size="row_group", window=2).map(record_id).batch(3),
    "block_shard_pack": lambda s: (
        s.shuffle(seed=6, block_size="row_group", window=3)
        .shard(0, 2)
        .map(as_tokens)
        .pack(8, strategy="best_fit", buffer_size=4)
        .map(plain)
    ),
}


def normalised(state: Any) -> Any:
    """A state with every file fingerprint reduced to what does not depend on where the file
    lives: its name within the data set, its size and its content digest (a remote digest also
    carries the object's ETag, a remote mtime has one-second resolution)."""
    if isinstance(state, dict):
        return {key: normalised(value) for key, value in state.items()}
    if isinstance(state, list):
        if len(state) == 4 and isinstance(state[0], str) and isinstance(state[1], int) and isinstance(state[2], int):
            name = state[0].rsplit("/", 1)[1]
            digest = state[3].split("|", 1)[0] if isinstance(state[3], str) else state[3]
            return [name, state[1], digest]
        return [normalised(value) for value in state]
    return state


def resume_at(build: Callable[[], Any], expected: list[Any], k: int) -> dict[str, Any]:
    """Save after ``k`` items, restore into a fresh pipeline (through JSON), check the
    continuation against ``expected``; returns the state."""
    pipe = build()
    head = take(pipe, k)
    state = roundtrip(pipe.get_state())
    assert head + take(restored(build, state), len(expected) - k) == expected, k
    return state


# -- the same rows as the local files ---------------------------------------------------------


@pytest.mark.parametrize("kind", ["parquet", "arrow"])
def test_a_remote_glob_reads_the_parts_the_local_glob_reads(data: dict[str, Any], kind: str) -> None:
    """Summaries and markers left out as the local glob leaves them out; empty parts and parts
    without row groups contribute nothing; the row groups (blocks) are those of the local files."""
    names = [f"{name}.{kind}" for name in PARTS]
    for pattern in ("*", "**", "**/*", "[a-e]*", "?-*"):
        here, there = local(data, kind, pattern), remote_source(data, kind, pattern)
        assert [p.rsplit("/", 1)[1] for p in there.paths] == [os.path.basename(p) for p in here.paths] == names
        assert len(there) == len(here) == TOTAL
        assert there.block_bounds().tolist() == here.block_bounds().tolist()
    records = list(there)
    assert records == list(here) == [record(i) for i in range(TOTAL)]
    if kind == "parquet":
        assert there.num_row_groups == here.num_row_groups == 20 + 1 + 0 + 1 + 4
        assert [there.locate(i) for i in (0, 59, 60, 159, 166)] == [
            (f"{data['url']}/parquet/{name}.parquet", group, row)
            for name, group, row in (
                ("a-many", 0, 0), ("a-many", 19, 2), ("d-huge", 0, 0), ("d-huge", 0, 99), ("e-tail", 3, 0),
            )
        ]  # fmt: skip


def test_summaries_named_explicitly_are_refused_naming_them(data: dict[str, Any]) -> None:
    for name, cause in (("_metadata", "summary"), ("_common_metadata", "no rows"), ("_SUCCESS", "as Parquet")):
        url = f"{data['url']}/parquet/{name}"
        with pytest.raises(rs.SourceError, match=cause) as raised:
            rs.parquet(url, storage_options=data["server"].options)
        assert url in str(raised.value)


def test_parts_without_rows_alone_and_objects_that_are_not_parquet(data: dict[str, Any], tmp_path: Path) -> None:
    server: S3Server = data["server"]
    empty = [f"{data['url']}/parquet/{name}.parquet" for name in ("b-empty-group", "c-no-groups")]
    with pytest.raises(rs.SourceError, match="no rows") as raised:
        rs.parquet(empty, storage_options=server.options)
    assert all(url in str(raised.value) for url in empty)
    for name, blob in (("garbage.parquet", b"PAR1" + b"\x00" * 100 + b"PAR1"), ("text.parquet", b'{"id": 1}\n')):
        (tmp_path / name).write_bytes(blob)
        url = server.upload(str(tmp_path / name), f"{PREFIX}-odd/{name}")
        with pytest.raises(rs.SourceError, match="as Parquet") as raised:
            rs.parquet(url, storage_options=server.options)
        assert url in str(raised.value)


@pytest.mark.parametrize("columns", [["id"], ["tokens", "id"], []], ids=lambda c: "+".join(c) or "none")
def test_column_selections_equal_the_local_ones_in_order_at_random_and_in_the_state(
    data: dict[str, Any], columns: list[str]
) -> None:
    here = local(data, "parquet", columns=columns)
    there = remote_source(data, "parquet", columns=columns)
    expected = [{c: r[c] for c in columns} for r in (record(i) for i in range(TOTAL))]
    assert list(there) == list(here) == expected
    assert list(there.shuffle(seed=3, block_size="row_group")) == list(here.shuffle(seed=3, block_size="row_group"))
    saved = there.get_state()
    assert saved["columns"] == columns
    other = remote_source(data, "parquet", columns=columns + ["id"] if "id" not in columns else ["text"])
    with pytest.raises(rs.StateError, match="columns"):
        other.set_state(roundtrip(saved))


def test_a_narrow_column_selection_fetches_only_its_column_chunks(data: dict[str, Any]) -> None:
    """The wide ``text`` column of the huge row group is never fetched when only ``id`` is read."""
    narrow = remote_source(data, "parquet", "d-huge.parquet", columns=["id"])
    opened = narrow.stats["bytes_fetched"]  # the footer (pyarrow reads the object's tail)
    assert ids(list(narrow)) == list(range(60, 160))
    wide = remote_source(data, "parquet", "d-huge.parquet")
    assert list(wide) == [record(i) for i in range(60, 160)]
    size = (data["root"] / "parquet" / "d-huge.parquet").stat().st_size
    assert narrow.stats["bytes_fetched"] - opened < size // 4
    assert wide.stats["bytes_fetched"] >= size // 2


def test_read_ahead_fetches_the_chunks_of_a_selected_column_whose_name_holds_a_dot(
    data: dict[str, Any], tmp_path: Path
) -> None:
    server: S3Server = data["server"]
    path = tmp_path / "dotted.parquet"
    values = [f"{i:06d}" * 30 for i in range(300)]  # ~55 kB per column, uncompressed: twice pyarrow's tail read
    pq.write_table(pa.table({"a.b": values, "a": values}), str(path), row_group_size=30, compression="none")
    url = server.upload(str(path), f"{PREFIX}-dotted/dotted.parquet")
    stats = {}
    for name in ("a.b", "a"):
        source = rs.parquet(
            url, storage_options=server.options, columns=[name], block_bytes=BLOCK, cache_bytes=16 * BLOCK,
            disk_cache_bytes=0,
        )  # fmt: skip
        assert list(source) == [{name: value} for value in values]
        stats[name] = source.stats
    assert stats["a"]["read_ahead_blocks"] > 0
    assert stats["a.b"]["read_ahead_blocks"] > 0  # the twin column is fetched ahead as well
    assert stats["a"]["bytes_fetched"] < 1.1 * stats["a.b"]["bytes_fetched"]  # and nothing of the other column


def test_a_missing_column_is_a_source_error_naming_the_object(data: dict[str, Any]) -> None:
    with pytest.raises(rs.SourceError, match="no column") as raised:
        remote_source(data, "parquet", columns=["id", "absent"])
    assert f"{data['url']}/parquet/a-many.parquet" in str(raised.value)


def test_a_footer_larger_than_the_tail_pyarrow_reads_first(data: dict[str, Any], tmp_path: Path) -> None:
    """400 row groups of one row: a ~100 kB footer, more than the 64 kB tail that opening reads
    and many times the memory tier; the row groups, records and a resume are the local file's."""
    server: S3Server = data["server"]
    path = tmp_path / "tiny-groups.parquet"
    pq.write_table(table(range(400)).select(["id", "tokens"]), str(path), row_group_size=1)
    assert pq.ParquetFile(str(path)).metadata.serialized_size > 80_000
    url = server.upload(str(path), f"{PREFIX}-footer/tiny-groups.parquet")

    def build() -> Any:
        source = rs.parquet(
            url, storage_options=server.options, block_bytes=4096, cache_bytes=4 * 4096, disk_cache_bytes=0
        )
        return source.shuffle(seed=2, block_size=40, window=2).map(record_id)

    here = rs.parquet(str(path))
    assert rs.parquet(url, storage_options=server.options).block_bounds().tolist() == here.block_bounds().tolist()
    expected = list(here.shuffle(seed=2, block_size=40, window=2).map(record_id))
    pipe = build()
    head = take(pipe, 123)
    assert head + list(restored(build, pipe.get_state())) == expected


@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
def test_a_remote_source_copied_mid_epoch_continues_exactly(data: dict[str, Any], how: str) -> None:
    """A copy taken while read-ahead may be in flight (as a DataLoader worker gets it) opens the
    objects again and continues where the original was; the original is undisturbed."""
    pipe = CHAINS["block_row_group"](remote_source(data, "parquet"))
    expected = take(CHAINS["block_row_group"](local(data, "parquet")), 56)
    head = take(pipe, 13)
    copied = pickle.loads(pickle.dumps(pipe)) if how == "pickle" else copy.deepcopy(pipe)
    assert head + take(copied, 43) == expected
    assert head + take(pipe, 43) == expected


# -- exact resume, and states equal to the local ones -------------------------------------------


WINDOW = 25
"""Items compared after each restore: past the next row-group edge, or into the next epoch."""


def states_along(pipe: Any, points: list[int]) -> tuple[list[Any], dict[int, dict[str, Any]]]:
    """Iterate ``pipe`` (across epochs) to the last of ``points``, its state taken at each."""
    items: list[Any] = []
    states = {}
    for point in points:
        items += take(pipe, point - len(items))
        states[point] = roundtrip(pipe.get_state())
    return items, states


@pytest.mark.parametrize("kind", ["parquet", "arrow"])
def test_a_plain_pass_resumes_at_every_row_group_edge_like_the_local_files(data: dict[str, Any], kind: str) -> None:
    """States taken at every edge equal the local ones apart from the location; each, restored
    over the objects (or, every other one, over the local files), continues exactly."""
    expected = take(local(data, kind), max(EDGES) + WINDOW)
    assert ids(expected) == [*range(TOTAL), *range(max(EDGES) + WINDOW - TOTAL)]
    there_items, there_states = states_along(remote_source(data, kind, disk=True), EDGES)
    here_items, here_states = states_along(local(data, kind), EDGES)
    assert there_items == here_items == expected[: max(EDGES)]
    for at, k in enumerate(EDGES):
        assert normalised(there_states[k]) == normalised(here_states[k]), k
        resumed = restored(functools.partial(remote_source, data, kind, disk=True), there_states[k])
        assert take(resumed, WINDOW) == expected[k : k + WINDOW], k
        if at % 2:
            assert take(restored(functools.partial(local, data, kind), there_states[k]), 3) == expected[k : k + 3]


@pytest.mark.parametrize("chain", ["shuffle_shard", "block_row_group", "block_shard_pack"])
def test_chains_resume_at_start_middle_end_and_next_epoch_like_the_local_files(
    data: dict[str, Any], chain: str
) -> None:
    def build() -> Any:
        return CHAINS[chain](remote_source(data, "parquet", disk=True))

    epoch = len(list(CHAINS[chain](local(data, "parquet"))))
    points = sorted({0, 1, epoch // 2, epoch - 1, epoch, epoch + 1})
    expected = take(CHAINS[chain](local(data, "parquet")), epoch + 2 + WINDOW)
    items, states = states_along(build(), points)
    assert items == expected[: points[-1]]
    for k in points:
        assert take(restored(build, states[k]), WINDOW) == expected[k : k + WINDOW], k
    assert expected[epoch : epoch + WINDOW] != expected[:WINDOW]  # a new order in the next epoch


@given(
    chain=st.sampled_from(sorted(CHAINS)),
    kind=st.sampled_from(["parquet", "arrow"]),
    cut=st.floats(0, 1),
    cut2=st.floats(0, 1),
    saved_remotely=st.booleans(),
)
def test_states_move_between_the_local_files_and_the_objects_anywhere(
    data: dict[str, Any], chain: str, kind: str, cut: float, cut2: float, saved_remotely: bool
) -> None:
    """A state taken over either copy equals the other copy's state at that point apart from
    the location, restores over the other copy, and is restored a second time later on."""

    def over_remote() -> Any:
        return CHAINS[chain](remote_source(data, kind, disk=True))

    def over_local() -> Any:
        return CHAINS[chain](local(data, kind))

    epoch = len(list(over_local()))
    total = epoch + epoch // 2 + 1  # into the next epoch
    expected = take(over_local(), total)
    k = int(cut * total)
    k2 = k + int(cut2 * (total - k))
    first, second = (over_remote, over_local) if saved_remotely else (over_local, over_remote)
    pipe, twin = first(), second()
    head = take(pipe, k)
    assert take(twin, k) == head
    state = roundtrip(pipe.get_state())
    assert normalised(state) == normalised(twin.get_state())
    resumed = restored(second, state)
    middle = take(resumed, k2 - k)
    again = restored(first, resumed.get_state())
    assert head + middle + take(again, total - k2) == expected


def test_a_state_with_columns_restores_across_copies_and_other_columns_are_refused(data: dict[str, Any]) -> None:
    def build(remotely: bool, columns: list[str]) -> Any:
        if remotely:
            source = remote_source(data, "parquet", disk=True, columns=columns)
        else:
            source = local(data, "parquet", columns=columns)
        return source.shuffle(seed=1, block_size="row_group", window=2)

    expected = list(build(False, ["id", "tokens"]))
    pipe = build(True, ["id", "tokens"])
    head = take(pipe, 70)
    state = roundtrip(pipe.get_state())
    assert head + list(restored(lambda: build(False, ["id", "tokens"]), state)) == expected
    for columns in (["id"], ["tokens", "id"], ["id", "tokens", "text"]):
        victim = build(True, columns)
        before = take(victim, 5)
        with pytest.raises(rs.StateError, match="columns"):
            victim.set_state(state)
        assert before + list(victim) == list(build(True, columns))  # the failed restore changed nothing


# -- ranks and DataLoader workers -----------------------------------------------------------------


def test_ranks_read_the_objects_as_they_read_the_local_files(data: dict[str, Any]) -> None:
    for world in (2, 3):
        seen: list[int] = []
        for rank in range(world):
            remote_rank = list(
                remote_source(data, "parquet", disk=True).shuffle(seed=8, block_size=4, window=3).shard(rank, world)
            )
            local_rank = list(local(data, "parquet").shuffle(seed=8, block_size=4, window=3).shard(rank, world))
            assert remote_rank == local_rank, (rank, world)
            seen += ids(remote_rank)
        assert sorted(seen) == list(range(TOTAL))


def loader_build(data: dict[str, Any], kind: str, remotely: bool, rank: int, world: int) -> Callable[[], Any]:
    def build() -> Any:
        source = remote_source(data, kind, disk=True) if remotely else local(data, kind)
        return source.shuffle(seed=2, block_size="row_group", window=2).shard(rank, world).map(record_id).batch(4)

    return build


LOADERS = [(0, False), (2, False), (2, True)]


def pipeline_states(state: Any) -> list[Any]:
    """The pipeline states inside a loader's state (JSON strings, one per worker), normalised."""
    if isinstance(state, dict):
        found = []
        for key, value in sorted(state.items()):
            if key == "pipeline" and isinstance(value, str):
                found.append(normalised(json.loads(value)))
            else:
                found += pipeline_states(value)
        return found
    if isinstance(state, list):
        return [found for value in state for found in pipeline_states(value)]
    return []


@pytest.mark.parametrize("num_workers, persistent", LOADERS, ids=["0", "2", "2-persistent"])
def test_loader_over_objects_equals_the_local_loader_and_resumes(
    data: dict[str, Any], num_workers: int, persistent: bool
) -> None:
    """Rank 1 of 2, its share split again between the workers: two epochs equal the local
    loader's, and a loader restored mid-epoch, at its end or in the next epoch continues them."""

    def make(remotely: bool) -> Loader:
        return Loader(
            loader_build(data, "parquet", remotely, 1, 2),
            num_workers=num_workers,
            prefetch_factor=2 if num_workers else None,
            persistent_workers=persistent,
            collate_fn=list,
        )

    def as_list(batch: Any) -> list[int]:
        return [int(x) for x in batch]

    with make(False) as here:
        expected = [[as_list(b) for b in here] for _ in range(2)]
    count = len(expected[0])
    with make(True) as there:
        assert [as_list(b) for b in there] == expected[0]
    consumers = max(1, num_workers)  # rank 1's workers are consumers 1 * W + w of 2 * W
    order = ids(list(local(data, "parquet").shuffle(seed=2, block_size="row_group", window=2)))
    share = [i for p, i in enumerate(order) if p % (2 * consumers) >= consumers]
    assert sorted(x for b in expected[0] for x in b) == sorted(share)
    stops = {0: (0, count // 2, count + 1), 2: (count // 2,) if persistent else (count + 1,)}[num_workers]
    for stop in stops:
        with make(True) as loader:
            head = loader_head(loader, stop, count, as_list)
            state = json.loads(json.dumps(loader.state_dict()))
        if stop == stops[-1]:  # every worker's pipeline state is the local loader's apart from the location
            with make(False) as twin:
                loader_head(twin, stop, count, as_list)
                assert pipeline_states(state) == pipeline_states(twin.state_dict()) != []
        with make(stop % 2 == 0) as resumed:  # restored over the objects, or over the local files
            resumed.load_state_dict(state)
            assert head + loader_rest(resumed, stop, count, as_list) == expected[0] + expected[1], stop


def test_a_loader_packing_arrow_objects_equals_the_local_one(data: dict[str, Any]) -> None:
    def make(remotely: bool) -> Loader:
        def build() -> Any:
            source = remote_source(data, "arrow", disk=True) if remotely else local(data, "arrow")
            packed = source.shuffle(seed=3).shard().map(as_tokens).pack(8, strategy="first_fit", buffer_size=3)
            return packed.batch(2).map(plain)

        return Loader(build, num_workers=2, prefetch_factor=2, collate_fn=list)

    with make(False) as here:
        expected = list(here)
    with make(True) as there:
        head = []
        for batch in there:
            head.append(batch)
            if len(head) == len(expected) // 2:
                break
        state = json.loads(json.dumps(there.state_dict()))
    with make(True) as resumed:
        resumed.load_state_dict(state)
        assert head + list(resumed) == expected


# -- transient faults while footers and column chunks are read ----------------------------------

FAULT_BLOCK = 2048
"""Blocks of the sources behind the fault proxy: each request through it costs ~15 ms, so fewer
and larger ranged reads (one per block) keep these tests short."""


@pytest.fixture(scope="module")
def started_proxy(s3_server: S3Server) -> Iterator[FaultProxy]:
    started = FaultProxy(s3_server.endpoint, fraction=0.5, seed=21)
    yield started
    started.stop()


@pytest.fixture
def proxy(started_proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch) -> FaultProxy:
    """The proxy failing half the requests (never more than three in a row: fewer than the
    retries), its counts at zero; one ranged read per block, retried after 2 ms."""
    monkeypatch.setattr(blocks, "REQUEST_BLOCKS", 1)
    monkeypatch.setattr(remote, "BACKOFF_SECONDS", 0.002)
    started_proxy.fraction = 0.5
    started_proxy.requests = started_proxy.faults = 0
    return started_proxy


def faulty_source(data: dict[str, Any], kind: str, proxy: FaultProxy, pattern: str = "*", **extra: Any) -> Any:
    return read(kind)(
        f"{data['url']}/{kind}/{pattern}",
        storage_options=proxy.options(data["server"].options),
        block_bytes=FAULT_BLOCK,
        cache_bytes=4 * FAULT_BLOCK,
        disk_cache_bytes=0,
        **extra,
    )


@pytest.mark.parametrize("kind", ["parquet", "arrow"])
def test_faults_while_footers_are_read_are_retried(data: dict[str, Any], proxy: FaultProxy, kind: str) -> None:
    """Construction alone (the listing, the HEADs, every footer's ranged reads) through the
    proxy: the same row groups and records, the retries counted."""
    source = faulty_source(data, kind, proxy)
    assert proxy.faults > 0
    assert source.stats["retries"] > 0
    assert source.block_bounds().tolist() == local(data, kind).block_bounds().tolist()
    assert list(source) == [record(i) for i in range(TOTAL)]


def test_faults_while_row_groups_are_read_and_restored(data: dict[str, Any], proxy: FaultProxy) -> None:
    """Built without faults, then half the ranged reads of the column chunks fail: a
    block-shuffled, sharded, packed pass and its restore equal the local ones."""
    chain = CHAINS["block_shard_pack"]
    expected = take(chain(local(data, "parquet", "[ad]-*", columns=["id", "tokens"])), 40)
    proxy.fraction = 0.0
    sources = [faulty_source(data, "parquet", proxy, "[ad]-*", columns=["id", "tokens"]) for _ in range(2)]
    proxy.fraction = 0.5
    pipe = chain(sources[0])
    head = take(pipe, 13)
    resumed = chain(sources[1])
    resumed.set_state(roundtrip(pipe.get_state()))
    assert head + take(resumed, 27) == expected
    assert proxy.faults > 0
    assert sum(source.stats["retries"] for source in sources) > 0


def test_an_endpoint_failing_mid_epoch_is_a_source_error_and_the_last_state_still_restores(
    data: dict[str, Any], proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every request failing after the pipeline was built: a SourceError naming an object within
    the retry bound; once the endpoint recovers, both a fresh pipeline and the failed one
    restored from the last state continue exactly."""
    monkeypatch.setattr(remote, "RETRY_ATTEMPTS", 2)
    chain = CHAINS["block_row_group"]
    proxy.fraction = 0.0
    expected = take(chain(local(data, "parquet", "[ad]-*")), 54)  # an epoch: the huge row group is read
    pipe = chain(faulty_source(data, "parquet", proxy, "[ad]-*"))
    spare = chain(faulty_source(data, "parquet", proxy, "[ad]-*"))
    head = take(pipe, 2)
    state = roundtrip(pipe.get_state())
    proxy.fraction = 1.0
    with pytest.raises(rs.SourceError) as raised:
        take(pipe, 52)
    assert f"{data['url']}/parquet/" in str(raised.value)
    proxy.fraction = 0.0
    spare.set_state(state)
    assert head + take(spare, 52) == expected
    pipe.set_state(state)
    assert head + take(pipe, 52) == expected


# -- the disk tier of blocks --------------------------------------------------------------------


def test_a_second_source_reads_every_block_from_the_disk_tier(data: dict[str, Any], tmp_path: Path) -> None:
    """One pass fills the disk tier; a fresh source (an empty memory tier) then reads the
    objects, footers included, without a single ranged read: block-shuffled and packed,
    restored, and with another column selection."""
    first = remote_source(data, "parquet", disk=True, cache=tmp_path)
    assert list(first) == [record(i) for i in range(TOTAL)]
    assert first.stats["requests"] > 0
    sources: list[Any] = []

    def build() -> Any:
        sources.append(remote_source(data, "parquet", disk=True, cache=tmp_path))
        return CHAINS["block_shard_pack"](sources[-1])

    expected = take(CHAINS["block_shard_pack"](local(data, "parquet")), 60)
    pipe = build()
    head = take(pipe, 20)
    resumed = restored(build, pipe.get_state())
    assert head + take(resumed, 40) == expected
    assert [source.stats["requests"] for source in sources] == [0, 0]
    assert all(source.stats["disk_hits"] > 0 for source in sources)
    narrow = remote_source(data, "parquet", disk=True, cache=tmp_path, columns=["text"])
    assert list(narrow) == [{"text": text(i)} for i in range(TOTAL)]
    assert narrow.stats["requests"] == 0


# -- objects changed between a save and a restore, or during a pass -----------------------------

ONE_FILE = range(0, 600)
"""Rows of the single objects below: ~100 kB, more than the tail pyarrow reads with a footer."""


def upload_table(
    server: S3Server, tmp_path: Path, key: str, offset: int = 0, rows: int = len(ONE_FILE), width: int = 150
) -> str:
    """Upload ``rows`` records whose ids start at ``offset`` (texts of ``width`` characters and
    more), uncompressed, in row groups of 25 rows (~4 kB each), without statistics: two such
    objects of the same row count and width have the same layout and size, byte for byte, apart
    from the values."""
    path = tmp_path / f"upload-{offset}-{rows}-{width}.parquet"
    data = pa.table(
        {
            "id": pa.array(range(offset, offset + rows), pa.int64()),
            "text": [f"row {i:07d} " + "x" * width for i in range(offset, offset + rows)],
        }
    )
    pq.write_table(data, str(path), row_group_size=25, compression="none", write_statistics=False)
    return server.upload(str(path), key)


def changed_object(server: S3Server, tmp_path: Path, key: str, change: str) -> None:
    """Change the object under ``key``: ``replaced`` by one of the same size and layout whose
    ids are 10**6 higher, ``relaid`` (such ids, longer texts: other offsets), ``grown`` to more
    rows, ``cut`` to its first 30,000 bytes (not Parquet any more), ``removed``, or uploaded
    again with ``same_bytes`` (the same ETag)."""
    if change == "replaced":
        upload_table(server, tmp_path, key, offset=10**6)
    elif change == "relaid":
        upload_table(server, tmp_path, key, offset=10**6, width=170)
    elif change == "grown":
        upload_table(server, tmp_path, key, rows=len(ONE_FILE) + 40)
    elif change == "same_bytes":
        upload_table(server, tmp_path, key)
    elif change == "cut":
        url = upload_table(server, tmp_path, key)
        local_copy = tmp_path / f"upload-0-{len(ONE_FILE)}-150.parquet"
        cut = tmp_path / "cut.parquet"
        cut.write_bytes(local_copy.read_bytes()[:30000])
        assert server.upload(str(cut), key) == url
    else:
        server.client.delete_object(Bucket=BUCKET, Key=key)


@pytest.mark.parametrize("change", ["replaced", "grown", "cut", "removed", "added", "same_bytes"])
def test_an_object_changed_between_save_and_restore_is_a_typed_error_naming_it(
    data: dict[str, Any], tmp_path: Path, change: str
) -> None:
    """Over a glob of one object: a state is refused (StateError naming the object) over an
    object replaced, grown or joined by another; one cut short or removed is refused when the
    pipeline is built (SourceError naming it); the same bytes uploaded again restore."""
    server: S3Server = data["server"]
    key = f"{PREFIX}-between/{change}/x.parquet"
    url = upload_table(server, tmp_path, key)

    def build() -> Any:
        source = rs.parquet(
            f"s3://{BUCKET}/{PREFIX}-between/{change}/*.parquet", storage_options=server.options, block_bytes=BLOCK,
            cache_bytes=MEMORY, disk_cache_bytes=0,
        )  # fmt: skip
        return source.shuffle(seed=1, block_size="row_group", window=2).map(record_id)

    pipe = build()
    head = take(pipe, 50)
    state = roundtrip(pipe.get_state())
    if change == "added":
        named = upload_table(server, tmp_path, f"{PREFIX}-between/{change}/y.parquet", offset=5000)
    else:
        named = url
        changed_object(server, tmp_path, key, change)
    if change == "same_bytes":
        assert head + list(restored(build, state)) == list(build())
        return
    if change in ("cut", "removed"):
        with pytest.raises(rs.SourceError) as refused:  # refused at construction: the object, or the empty glob
            build()
        assert (url if change == "cut" else f"s3://{BUCKET}/{PREFIX}-between/removed/*.parquet") in str(refused.value)
        return
    fresh = build()
    before = take(fresh, 3)
    with pytest.raises(rs.StateError) as raised:
        fresh.set_state(state)
    assert named.rsplit("/", 1)[1] in str(raised.value)
    if change != "added":
        assert "differs from the file the state was taken over" in str(raised.value) and url in str(raised.value)
    assert before + list(fresh) == list(build())


def rows_or_error(pipe: Any, url: str, limit: int) -> tuple[list[int], BaseException | None]:
    """Up to ``limit`` more ids, across epochs as ``take`` goes, or as many as came before the
    SourceError that ended them (checked to name ``url``)."""
    got: list[int] = []
    try:
        for _ in range(3):
            for item in pipe:
                got.append(item)
                if len(got) == limit:
                    return got, None
    except rs.SourceError as error:
        assert url in str(error)
        return got, error
    return got, None


@pytest.mark.parametrize(
    "when, disk",
    [
        pytest.param("mid-epoch", False, id="mid-epoch"),
        pytest.param("mid-epoch", True, id="mid-epoch-disk-tier"),
        pytest.param("next-epoch", False, id="next-epoch"),
    ],
)
def test_an_object_replaced_during_a_run_never_yields_rows_of_the_replacement(
    data: dict[str, Any], tmp_path: Path, when: str, disk: bool
) -> None:
    """Replaced 20 rows into the epoch, or once the epoch ended: the rest of the run gives rows
    of the object the pipeline was built on, or a SourceError naming it; never the new rows."""
    server: S3Server = data["server"]
    key = f"{PREFIX}-during/replaced-{when}-{disk}/x.parquet"
    url = upload_table(server, tmp_path, key)
    pipe = rs.parquet(
        url, storage_options=server.options, block_bytes=BLOCK, cache_bytes=MEMORY,
        disk_cache_bytes=(1 << 30) if disk else 0, cache_dir=str(tmp_path / "cache"),
    ).map(record_id)  # fmt: skip
    head = take(pipe, 20 if when == "mid-epoch" else len(ONE_FILE))
    changed_object(server, tmp_path, key, "replaced")
    rest, _ = rows_or_error(pipe, url, len(ONE_FILE))
    assert head + rest == [*ONE_FILE, *ONE_FILE][: len(head) + len(rest)]  # only rows of the object it was built on


def test_a_live_pipeline_restored_after_its_object_was_replaced_never_yields_its_rows(
    data: dict[str, Any], tmp_path: Path
) -> None:
    server: S3Server = data["server"]
    key = f"{PREFIX}-during/restored-live/x.parquet"
    url = upload_table(server, tmp_path, key)
    source = rs.parquet(url, storage_options=server.options, block_bytes=BLOCK, cache_bytes=MEMORY, disk_cache_bytes=0)
    pipe = source.map(record_id)
    take(pipe, 10)
    state = roundtrip(pipe.get_state())
    take(pipe, 5)
    changed_object(server, tmp_path, key, "replaced")
    try:
        pipe.set_state(state)
    except (rs.StateError, rs.SourceError) as error:
        assert url in str(error)
        return
    rest, _ = rows_or_error(pipe, url, len(ONE_FILE))
    assert rest == list(ONE_FILE)[10 : 10 + len(rest)]


@pytest.mark.parametrize("change", ["cut", "removed", "relaid"])
def test_an_object_cut_removed_or_relaid_mid_epoch_is_a_source_error_after_only_its_own_rows(
    data: dict[str, Any], tmp_path: Path, change: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(remote, "BACKOFF_SECONDS", 0.001)
    server: S3Server = data["server"]
    key = f"{PREFIX}-during/{change}/x.parquet"
    url = upload_table(server, tmp_path, key)
    source = rs.parquet(url, storage_options=server.options, block_bytes=BLOCK, cache_bytes=MEMORY, disk_cache_bytes=0)
    pipe = source.map(record_id)
    head = take(pipe, 20)
    changed_object(server, tmp_path, key, change)
    rest, error = rows_or_error(pipe, url, len(ONE_FILE))
    assert head + rest == list(ONE_FILE)[: len(head) + len(rest)]
    assert error is not None


def test_an_object_replaced_then_put_back_restores_and_a_fresh_source_reads_the_replacement(
    data: dict[str, Any], tmp_path: Path
) -> None:
    """The disk tier keys blocks by ETag: a source over the replacement reads its rows (never the
    cached blocks of the original), and the original put back restores the old state."""
    server: S3Server = data["server"]
    key = f"{PREFIX}-disk/x.parquet"
    url = upload_table(server, tmp_path, key)
    cache = tmp_path / "cache"

    def build() -> Any:
        return rs.parquet(
            url, storage_options=server.options, block_bytes=BLOCK, cache_bytes=MEMORY, cache_dir=str(cache)
        ).map(record_id)

    pipe = build()
    head = take(pipe, 150)
    state = roundtrip(pipe.get_state())
    assert head + list(pipe) == list(ONE_FILE)
    changed_object(server, tmp_path, key, "replaced")
    assert list(build()) == [10**6 + i for i in ONE_FILE]
    upload_table(server, tmp_path, key)  # the same bytes again: the same ETag
    assert head + list(restored(build, state)) == list(ONE_FILE)
    shutil.rmtree(cache)


@pytest.mark.parametrize("kind", ["jsonl", "arrow"])
def test_jsonl_and_arrow_objects_replaced_during_a_run_never_yield_rows_of_the_replacement(
    s3_server: S3Server, tmp_path: Path, kind: str
) -> None:
    """The sibling of the Parquet case: JSONL and Arrow objects are read through the same
    blocks; one replaced by an object of the same size mid-epoch gives rows of the object the
    pipeline was built on, or a SourceError naming it."""
    count = 400
    path = tmp_path / f"x.{kind}"
    replacement = tmp_path / f"y.{kind}"
    for target, offset in ((path, 3000), (replacement, 6000)):  # ids and texts of the same widths
        if kind == "jsonl":
            target.write_text("".join(json.dumps({"id": offset + i, "text": "x" * 40}) + "\n" for i in range(count)))
        else:
            write_arrow(target, range(offset, offset + count), 25, stream=False)
    assert path.stat().st_size == replacement.stat().st_size
    key = f"{PREFIX}-during/replaced-{kind}/x.{kind}"
    url = s3_server.upload(str(path), key)
    source = rs.jsonl if kind == "jsonl" else rs.arrow
    options = {"block_bytes": BLOCK, "cache_bytes": MEMORY, "disk_cache_bytes": 0}
    pipe = source(url, storage_options=s3_server.options, **options).map(record_id)
    head = take(pipe, 20)
    s3_server.upload(str(replacement), key)
    rest, error = rows_or_error(pipe, url, count)
    got = head + rest
    assert got == ([*range(3000, 3000 + count)] * 2)[: len(got)]  # the original's rows: never the new ones
    if kind == "jsonl":  # read block by block: a later fetch finds the replacement
        assert error is not None and "changed during the run" in str(error)
    else:  # an Arrow object is read whole at its first batch: the run goes on over the original
        assert error is None or "changed during the run" in str(error)
