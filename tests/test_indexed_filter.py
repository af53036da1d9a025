"""filter(predicate, index=True): an index of kept positions that keeps random access, so
shuffle, shard, len() and elastic resume work after the filter, and resumes stay exact."""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
from collections import Counter
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import resumable as rs
from resumable.ops import indexed_filter
from resumable.ops.indexed_filter import IndexedFilter
from resumable.sources._sidecar import SidecarWarning
from resumable.torch import Loader
from tests.resume import check_resume, take
from tests.sources import INDEXED_KINDS, indexed_source
from tests.test_elastic import run_topologies

N = 120
RECORDS = [{"id": i, "length": (i * 7919) % 23} for i in range(N)]


def keep(record: dict[str, Any]) -> bool:
    return record["length"] % 3 != 0


KEPT_IDS = [r["id"] for r in RECORDS if keep(r)]


class Counting:
    """The predicate ``keep``, counting the records it is called on."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, record: dict[str, Any]) -> bool:
        self.calls += 1
        return keep(record)


def with_double(record: dict[str, Any]) -> dict[str, Any]:
    return {**record, "double": 2 * record["id"]}


def ids(record: dict[str, Any]) -> int:
    return record["id"]  # type: ignore[no-any-return]  # records are dicts of ints


def filtered(kind: str, **options: Any) -> IndexedFilter[Any]:
    """The indexed filter over ``kind`` with a serial map before it."""
    node = indexed_source(kind, RECORDS).map(with_double).filter(keep, index=True, progress=False, **options)
    assert isinstance(node, IndexedFilter)
    return node


def pipeline(kind: str, rank: int = 0, world_size: int = 2, **options: Any) -> rs.Node[Any]:
    return filtered(kind, **options).shuffle(5).shard(rank, world_size).map(ids)


# -- the resume property ----------------------------------------------------------------------

SHARD = len(KEPT_IDS) // 2  # shard 0 of 2 (the kept count is even)


@pytest.mark.parametrize("kind", INDEXED_KINDS)
@pytest.mark.parametrize(
    "k, k2",
    [(0, None), (SHARD // 2, None), (SHARD, None), (SHARD + 1, None), (2 * SHARD + 3, None), (5, SHARD + 2)],
    ids=["start", "middle", "end", "after-end", "across-epochs", "twice"],
)
def test_resume_equals_the_uninterrupted_run(kind: str, k: int, k2: int | None) -> None:
    assert len(KEPT_IDS) % 2 == 0
    check_resume(lambda: pipeline(kind), k, 3 * SHARD, k2)


@given(
    kind=st.sampled_from(INDEXED_KINDS),
    world_size=st.integers(1, 3),
    modulus=st.integers(1, 5),
    data=st.data(),
)
def test_resume_at_drawn_points(kind: str, world_size: int, modulus: int, data: st.DataObject) -> None:
    rank = data.draw(st.integers(0, world_size - 1))

    def build() -> rs.Node[Any]:
        source = indexed_source(kind, RECORDS)
        kept = source.filter(lambda r: r["length"] % modulus == 0, index=True, progress=False)
        return kept.map(ids).shuffle(modulus).shard(rank, world_size).batch(2)

    total = data.draw(st.integers(0, 60))
    k = data.draw(st.integers(0, total))
    check_resume(build, k, total, data.draw(st.none() | st.integers(k, total)))


# -- the index --------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", INDEXED_KINDS)
def test_len_and_items_equal_a_streaming_filter(kind: str) -> None:
    node = filtered(kind)
    assert len(node) == len(KEPT_IDS) and node.dropped == N - len(KEPT_IDS)
    assert node.kept.dtype == np.uint32 and node.kept.tolist() == KEPT_IDS
    streamed = [r for r in indexed_source(kind, RECORDS).map(with_double).filter(keep)]
    assert list(node) == streamed
    shards = [pipeline(kind, rank, 3) for rank in range(3)]
    assert sum(len(shard) for shard in shards) == len(KEPT_IDS)
    assert sorted(i for shard in shards for i in shard) == KEPT_IDS
    assert node[3] == streamed[3] and node.record_at(0, len(node) - 1) == streamed[-1]


@pytest.mark.parametrize("on_disk", [False, True], ids=["memory", "directory"])
def test_a_cache_after_the_filter_holds_the_kept_records(tmp_path: Path, on_disk: bool) -> None:
    """The cache's positions are the filter's, not the source's: it computes each kept record
    where the filter puts it (it once placed them by source index and ran past its block)."""
    directory = str(tmp_path) if on_disk else None

    def build(rank: int = 0, world_size: int = 1) -> rs.Node[Any]:
        cached = rs.nodes.Cache(filtered("list"), directory, block_size=16)
        return cached.shuffle(5).shard(rank, world_size).map(ids)

    assert [r["id"] for r in filtered("list").cache(directory=directory)] == KEPT_IDS
    assert sorted(build()) == KEPT_IDS
    check_resume(lambda: build(1, 2), SHARD // 2, 3 * SHARD, SHARD + 2)


def test_scanned_once_per_node_lazily() -> None:
    counting = Counting()
    node = rs.from_list(RECORDS).filter(counting, index=True, progress=False)
    assert counting.calls == 0  # nothing is read at construction
    pipe = node.shuffle(1)
    assert len(pipe) == len(KEPT_IDS) and counting.calls == N
    take(pipe, 3 * len(KEPT_IDS))
    pipe.get_state()
    assert counting.calls == N and node.scanned == N


def test_batched_predicate_gives_the_same_index() -> None:
    def lengths_ok(records: list[dict[str, Any]]) -> np.ndarray:
        return np.array([r["length"] for r in records]) % 3 != 0

    batched = rs.from_list(RECORDS).filter(lengths_ok, index=True, batched=True, progress=False)
    assert isinstance(batched, IndexedFilter) and batched.kept.tolist() == KEPT_IDS
    wrong = rs.from_list(RECORDS).filter(lambda rs_: [True], index=True, batched=True, progress=False)
    with pytest.raises(rs.ConfigError, match="one bool per record"):
        len(wrong)


def test_parallel_scan_gives_the_same_index(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(indexed_filter, "TASK_RECORDS", 50)
    records = [{"id": i, "length": (i * 7919) % 23} for i in range(1000)]
    serial = rs.from_list(records).filter(keep, index=True, progress=False)
    parallel = rs.from_list(records).filter(keep, index=True, num_proc=2, progress=False)
    assert isinstance(serial, IndexedFilter) and isinstance(parallel, IndexedFilter)
    assert np.array_equal(serial.kept, parallel.kept) and parallel.kept.dtype == np.uint32


def kept_in_a_daemon(records: list[dict[str, int]], results: Any) -> None:
    """In a daemonic process (as a DataLoader worker is): the index of a two-process scan."""
    try:
        node = rs.from_list(records).filter(keep, index=True, num_proc=2, progress=False)
        results.put(cast(IndexedFilter, node).kept.tolist())
    except Exception as error:  # noqa: BLE001 - reported to the test
        results.put(f"{type(error).__name__}: {error}")


def test_parallel_scan_in_a_daemonic_process_scans_there(monkeypatch: pytest.MonkeyPatch) -> None:
    """A DataLoader worker may not start processes: its scan runs in it, to the same index."""
    monkeypatch.setattr(indexed_filter, "TASK_RECORDS", 50)
    records = [{"id": i, "length": (i * 7919) % 23} for i in range(1000)]
    serial = rs.from_list(records).filter(keep, index=True, progress=False)
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    process = context.Process(target=kept_in_a_daemon, args=(records, results), daemon=True)
    process.start()
    kept = results.get(timeout=60)
    process.join()
    assert kept == cast(IndexedFilter, serial).kept.tolist()


@pytest.mark.parametrize("num_proc", [0, 2])
def test_a_failing_predicate_names_the_position(num_proc: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(indexed_filter, "TASK_RECORDS", 50)
    records = [{"id": i} for i in range(300)] + [{}] + [{"id": 0}] * 20
    node = rs.from_list(records).filter(lambda r: r["id"] > 1, index=True, num_proc=num_proc, progress=False)
    with pytest.raises(rs.SourceError, match="failed on upstream position 300: KeyError"):
        len(node)


def test_malformed_records_a_source_skips_are_not_kept(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    lines = [json.dumps(r) for r in RECORDS[:30]]
    lines[4] = "{not json"
    path.write_text("\n".join(lines) + "\n")
    node = rs.jsonl(str(path), on_error="skip").filter(keep, index=True, progress=False)
    expected = [r["id"] for r in RECORDS[:30] if keep(r) and r["id"] != 4]
    assert len(node) == len(expected) and [r["id"] for r in node.shuffle(2)] != expected
    assert sorted(r["id"] for r in node.shuffle(2)) == expected


# -- the sidecar ------------------------------------------------------------------------------


def sidecar_filter(path: Path, cache_dir: Path, predicate: Any, index_key: str | None = None) -> IndexedFilter[Any]:
    node = rs.jsonl(str(path)).filter(predicate, index=True, cache_dir=str(cache_dir), index_key=index_key)
    assert isinstance(node, IndexedFilter)
    return node


def test_sidecar_is_reused_and_rebuilt_when_the_key_or_files_change(tmp_path: Path) -> None:
    data = Path(str(indexed_source("jsonl", RECORDS).paths[0]))  # type: ignore[attr-defined]  # a JsonlSource
    path = tmp_path / "data.jsonl"
    path.write_bytes(data.read_bytes())
    first = Counting()
    built = sidecar_filter(path, tmp_path / "idx", first)
    assert built.kept.tolist() == KEPT_IDS and first.calls == N and isinstance(built.kept, np.memmap)
    assert built.sidecar is not None and os.path.exists(built.sidecar)
    assert os.path.getsize(built.sidecar) < 4 * N + 200  # uint32 positions and the .npy header

    again = Counting()
    reused = sidecar_filter(path, tmp_path / "idx", again)
    assert reused.kept.tolist() == KEPT_IDS and again.calls == 0 and reused.scanned == 0
    assert reused.get_state() == built.get_state()

    other_key = Counting()
    assert sidecar_filter(path, tmp_path / "idx", other_key, index_key="v2").kept.tolist() == KEPT_IDS
    assert other_key.calls == N

    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # touched: a new mtime
    touched = Counting()
    rebuilt = sidecar_filter(path, tmp_path / "idx", touched)
    assert rebuilt.kept.tolist() == KEPT_IDS and touched.calls == N and rebuilt.sidecar != built.sidecar


def keep_other(record: dict[str, Any]) -> bool:
    """Another predicate that keeps as many records as ``keep``, not the same ones."""
    return record["id"] >= N - len(KEPT_IDS)  # type: ignore[no-any-return]  # records are dicts of ints


def rewrite(sidecar: str, kept: np.ndarray) -> None:
    """Replace the sidecar's positions with ``kept``, its description updated to match (count,
    dtype, digest): damage that only the positions themselves give away."""
    np.save(sidecar, kept)
    description = Path(sidecar[: -len(".npy")] + ".json")
    saved = json.loads(description.read_text())
    saved.update(kept=len(kept), dtype=kept.dtype.str, kept_digest=indexed_filter._digest(kept))
    description.write_text(json.dumps(saved))


@pytest.mark.parametrize(
    "damage",
    ["flip", "truncate", "empty", "description", "other_index", "dtype", "descending", "beyond_the_upstream"],
)
def test_a_damaged_sidecar_is_rebuilt(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    built = sidecar_filter(path, tmp_path, keep)
    sidecar = built.sidecar
    assert len(built) == len(KEPT_IDS) and sidecar is not None and os.path.exists(sidecar)
    kept = np.array(built.kept)
    if damage == "flip":
        with open(sidecar, "r+b") as handle:
            handle.seek(-8, os.SEEK_END)
            handle.write(b"\xff\xff\xff\xff")
    elif damage == "truncate":
        os.truncate(sidecar, os.path.getsize(sidecar) - 12)
    elif damage == "empty":
        os.truncate(sidecar, 0)
    elif damage == "other_index":  # another index's files (same count) renamed over these
        other = sidecar_filter(path, tmp_path, keep_other)
        assert len(other) == len(KEPT_IDS) and other.sidecar is not None and other.sidecar != sidecar
        for suffix in (".npy", ".json"):
            os.replace(other.sidecar[: -len(".npy")] + suffix, sidecar[: -len(".npy")] + suffix)
    elif damage == "dtype":
        rewrite(sidecar, kept.astype(np.int64))
    elif damage == "descending":
        rewrite(sidecar, kept[::-1].copy())
    elif damage == "beyond_the_upstream":
        rewrite(sidecar, np.append(kept[:-1], np.uint32(N)))
    else:
        Path(sidecar[: -len(".npy")] + ".json").write_text("[1, 2")
    with pytest.warns(SidecarWarning, match="damaged or stale"):
        rebuilt = sidecar_filter(path, tmp_path, keep)
        assert rebuilt.kept.tolist() == KEPT_IDS and rebuilt.scanned == N
    reused = sidecar_filter(path, tmp_path, keep)
    assert len(reused) == len(KEPT_IDS) and reused.scanned == 0


def test_unwritable_cache_dir_keeps_the_index_in_memory(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    node = rs.from_list(RECORDS).filter(keep, index=True, cache_dir=str(blocker / "idx"), progress=False)
    with pytest.warns(SidecarWarning, match="stays in memory"):
        assert len(node) == len(KEPT_IDS)


def test_a_directory_in_place_of_the_sidecar_keeps_the_index_in_memory(tmp_path: Path) -> None:
    node = rs.from_list(RECORDS).filter(keep, index=True, cache_dir=str(tmp_path), progress=False)
    assert node.sidecar is not None
    os.mkdir(node.sidecar)
    Path(node.sidecar[: -len(".npy")] + ".json").write_text("{}")
    with pytest.warns(SidecarWarning) as caught:
        assert node.kept.tolist() == KEPT_IDS
    messages = [str(warning.message) for warning in caught]
    assert any("damaged or stale" in message for message in messages)
    assert any("stays in memory" in message for message in messages)


def test_pickled_node_maps_the_sidecar_again(tmp_path: Path) -> None:
    node = rs.from_list(RECORDS).filter(keep, index=True, cache_dir=str(tmp_path), progress=False)
    state = node.shuffle(2).get_state()
    copy = pickle.loads(pickle.dumps(node))
    assert copy._kept is None and copy.kept.tolist() == KEPT_IDS and isinstance(copy.kept, np.memmap)
    assert copy.scanned == node.scanned == N  # mapped again, not scanned again
    assert copy.shuffle(2).get_state() == state


# -- placement and states ---------------------------------------------------------------------


def test_refused_after_shuffle_shard_and_without_random_access() -> None:
    source = rs.from_list(RECORDS)
    for upstream in (source.shuffle(1), source.shuffle(1, block_size=8), source.shard(0, 2)):
        with pytest.raises(rs.ConfigError, match=r"place \.filter\(index=True\) before shuffle and shard"):
            upstream.filter(keep, index=True)
    with pytest.raises(rs.ConfigError, match="needs random access"):
        source.batch(2).filter(keep, index=True)
    with pytest.raises(rs.ConfigError, match="batched=True\\) needs index=True"):
        source.filter(keep, batched=True)
    for bad in ({"num_proc": -1}, {"index_key": 3}, {"cache_dir": 1.5}, {"progress": "no"}):
        with pytest.raises(rs.ConfigError):
            source.filter(keep, index=True, **bad)
    stacked = source.filter(keep, index=True, progress=False).filter(lambda r: r["id"] % 2, index=True)
    assert [r["id"] for r in stacked] == [i for i in KEPT_IDS if i % 2]


def test_a_state_of_another_index_is_refused_naming_the_node() -> None:
    def build(predicate: Any, index_key: str | None) -> rs.Node[Any]:
        node = rs.from_list(RECORDS).filter(predicate, index=True, index_key=index_key, progress=False)
        return node.shuffle(3).shard(0, 2)

    pipe = build(keep, "v1")
    take(pipe, 5)
    state = pipe.get_state()
    build(keep, "v1").set_state(state)
    with pytest.raises(rs.StateError, match="IndexedFilter: state was saved with index_key='v1'"):
        build(keep, "v2").set_state(state)
    with pytest.raises(rs.StateError, match="IndexedFilter: state was saved with kept="):
        build(lambda r: r["length"] % 2 == 0, "v1").set_state(state)
    same_count = [r["id"] for r in RECORDS if not keep(r)][:1]
    swapped = build(lambda r: keep(r) != (r["id"] in same_count or r["id"] == KEPT_IDS[0]), "v1")
    with pytest.raises(rs.StateError, match="IndexedFilter: state was saved with kept_digest="):
        swapped.set_state(state)


# -- elastic resume and DataLoader workers ----------------------------------------------------


@pytest.mark.parametrize("kind", ["list", "parquet"])
def test_each_kept_record_once_across_rescales(kind: str) -> None:
    phases = [(4, [0.3, 0.6]), (3, [0.5, 0.1, 0.8]), (2, [1.0])]
    seen = run_topologies(lambda c, n: pipeline(kind, c, n), phases, lambda item: [item])
    assert seen == Counter(KEPT_IDS)


def loader_pipeline(cache_dir: str) -> rs.Node[Any]:
    node = indexed_source("jsonl", RECORDS).filter(keep, index=True, cache_dir=cache_dir, progress=False)
    return node.shuffle(4).shard().map(ids).batch(4, collate_fn=list)


def test_inside_a_loader_with_two_workers_resume_is_exact(tmp_path: Path) -> None:
    def make() -> Loader:
        return Loader(lambda: loader_pipeline(str(tmp_path)), num_workers=2, collate_fn=lambda b: b)

    uninterrupted = make()
    expected = [batch for _ in range(2) for batch in uninterrupted]
    assert sorted(i for batch in expected[: len(expected) // 2] for i in batch) == KEPT_IDS
    loader = make()
    head = []
    for batch in loader:
        head.append(batch)
        if len(head) == 7:
            break
    state = json.loads(json.dumps(loader.state_dict()))
    resumed = make()
    resumed.load_state_dict(state)
    tail = list(resumed) + list(resumed)
    assert head + tail == expected[: len(head) + len(tail)] and len(head + tail) == len(expected)
