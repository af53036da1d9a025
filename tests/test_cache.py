from __future__ import annotations

import functools
import json
import multiprocessing
import os
import pickle
import threading
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import resumable as rs
from resumable.ops.cache import _MISSING, LRU, Cache, CacheWarning, cache
from resumable.ops.disk_cache import block_name
from tests.resume import check_resume, take

N = 300
BLOCK = 64


class Counter:
    """A tokeniser-like map that counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, x: int) -> dict[str, Any]:
        self.calls += 1
        return {"input_ids": np.arange(x % 11, dtype=np.int32) + x, "text": f"doc {x}", "n": x}


def same(a: Any, b: Any) -> bool:
    """Deep equality of records holding numpy arrays (dtype included)."""
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def plain(item: Any) -> Any:
    """Records made comparable with ``==`` (check_resume compares lists of items)."""
    if isinstance(item, np.ndarray):
        return (str(item.dtype), item.tolist())
    if isinstance(item, dict):
        return {k: plain(v) for k, v in item.items()}
    if isinstance(item, list):
        return [plain(v) for v in item]
    return item


def disk_pipe(directory: Path | None, counter: Counter | None = None, n: int = N) -> Cache[Any]:
    return cache(rs.from_list(list(range(n))).map(counter or Counter()), directory, block_size=BLOCK)


# -- in memory --------------------------------------------------------------------------------


def test_memory_cache_computes_each_record_once() -> None:
    counter = Counter()
    pipe = rs.from_list(list(range(N))).map(counter).cache().shuffle(3)
    first = take(pipe, N)
    assert counter.calls == N
    second = take(pipe, N)  # next epoch, another order, no recomputation
    assert counter.calls == N
    assert sorted(r["n"] for r in second) == list(range(N))
    assert [r["n"] for r in first] != [r["n"] for r in second]


def test_memory_cache_is_bounded_and_evicts_least_recent() -> None:
    lru = LRU(max_bytes=1000)
    for i in range(50):
        lru.put(i, np.zeros(10, dtype=np.int64))  # 80 bytes + overhead each
    assert lru.bytes <= 1000 and 0 < len(lru) < 50
    assert lru.get(49) is not _MISSING and lru.get(0) is _MISSING  # the oldest was evicted
    lru.put(100, np.zeros(1000, dtype=np.int64))  # bigger than the whole budget: not kept
    assert len(lru) < 50 and lru.bytes <= 1000
    counter = Counter()
    pipe = rs.from_list(list(range(N))).map(counter).cache(max_bytes=0)
    take(pipe, 2 * N)
    assert counter.calls == 2 * N  # max_bytes=0 caches nothing, results are unchanged


def test_memory_cache_estimates_sizes_and_hands_out_new_objects() -> None:
    lru = LRU(max_bytes=1 << 20)
    record = {"ids": np.arange(100, dtype=np.int32), "text": "x" * 1000, "nested": [[1, 2], {"a": [3]}]}
    lru.put(0, record)
    assert 1400 <= lru.bytes <= 2400  # 400 + 1000 bytes of data, the keys and the objects' overhead
    record["nested"][1]["a"].append(4)  # the computed record edited after it was kept
    assert lru.get(0)["nested"] == [[1, 2], {"a": [3]}]
    first, second = lru.get(0), lru.get(0)
    assert first is not record and first is not second and first["ids"] is not second["ids"]
    first["ids"] += 1
    assert np.array_equal(lru.get(0)["ids"], record["ids"])
    pair = (np.zeros(1000, dtype=np.int64), 3)  # a tuple holding an array: counted, and copied whole
    small = LRU(max_bytes=4000)
    small.put(1, pair)
    assert len(small) == 0  # bigger than the whole budget: not kept
    large = LRU(max_bytes=1 << 20)
    large.put(1, pair)
    assert large.bytes >= 8000 and large.get(1)[0] is not pair[0]
    with pytest.raises(rs.ConfigError, match=r"Cache: the record at position 7 cannot be kept in memory"):
        lru.put(7, {"lock": threading.Lock()})


# -- on disk ----------------------------------------------------------------------------------


def test_disk_cache_second_epoch_and_restarted_job_do_not_recompute(tmp_path: Path) -> None:
    counter = Counter()
    pipe = disk_pipe(tmp_path, counter)
    first = take(pipe, N)
    assert counter.calls == N
    second = take(pipe, N)
    assert counter.calls == N
    assert all(same(a, b) for a, b in zip(first, second))
    again = Counter()
    restarted = disk_pipe(tmp_path, again).shuffle(5)
    assert sorted(r["n"] for r in take(restarted, N)) == list(range(N))
    assert again.calls == 0
    files = sorted(os.listdir(pipe.path))
    assert files[0] == block_name(0, BLOCK) and block_name(256, N) in files and "config.json" in files
    assert json.loads(Path(pipe.path, "config.json").read_text())["upstream"]["kind"] == "IndexedMap"


def test_half_filled_cache_computes_only_missing_blocks(tmp_path: Path) -> None:
    counter = Counter()
    take(disk_pipe(tmp_path, counter), 100)  # blocks 0 and 1 are complete
    assert counter.calls == 2 * BLOCK
    again = Counter()
    records = take(disk_pipe(tmp_path, again), N)
    assert again.calls == N - 2 * BLOCK
    assert [r["n"] for r in records] == list(range(N))


def test_cached_records_equal_computed_ones(tmp_path: Path) -> None:
    computed = take(rs.from_list(list(range(N))).map(Counter()), N)
    cold = take(disk_pipe(tmp_path), N)
    warm = take(disk_pipe(tmp_path), N)
    assert all(same(a, b) and same(a, c) for a, b, c in zip(computed, cold, warm))
    assert warm[5]["input_ids"].flags.writeable  # fresh arrays, like the map's


def test_value_types_round_trip(tmp_path: Path) -> None:
    def make(x: int) -> dict[str, Any]:
        return {
            "ids": np.arange(x, dtype=np.int64),
            "mask": np.ones(x, dtype=np.bool_),
            "weights": np.full(x, 0.5, dtype=np.float32),
            "length": np.int32(x),
            "flag": x % 2 == 0,
            "score": float(x) / 3,
            "raw": bytes([x]),
            "maybe": None if x % 3 else f"s{x}",
            "tags": [x, x + 1],
        }

    expected = [make(x) for x in range(40)]
    for _ in range(2):  # cold, then warm
        got = take(rs.from_list(list(range(40))).map(make).cache(tmp_path), 40)
        assert all(same(a, b) for a, b in zip(expected, got))
    for values in (["a", "bb", "ccc"], [np.arange(i, dtype=np.int16) for i in range(3)], [1, 2, 3]):
        directory = tmp_path / f"plain{len(str(values))}"
        for _ in range(2):
            got = take(rs.from_list(values).cache(directory), 3)
            assert all(same(a, b) for a, b in zip(values, got))


@pytest.mark.parametrize(
    ("record", "match"),
    [
        ({"x": np.zeros((2, 2))}, "2-d array"),
        ({"x": (1, 2)}, "tuples"),
        ({"x": {"y": 1}}, "nested dicts"),
        ({"x": object()}, "type object"),
        ({1: 2}, "keys must be strings"),
    ],
)
def test_unstorable_records_raise_config_error(tmp_path: Path, record: Any, match: str) -> None:
    pipe = rs.from_list([record]).cache(tmp_path)
    with pytest.raises(rs.ConfigError, match=match):
        next(iter(pipe))


def test_mixed_fields_raise_config_error(tmp_path: Path) -> None:
    with pytest.raises(rs.ConfigError, match="mixes value types"):
        take(rs.from_list([{"x": 1}, {"x": "a"}]).cache(tmp_path), 2)
    with pytest.raises(rs.ConfigError, match="different fields"):
        take(rs.from_list([{"x": 1}, {"y": 1}]).cache(tmp_path / "b"), 2)


def test_fingerprint_separates_pipelines(tmp_path: Path) -> None:
    base = disk_pipe(tmp_path)
    assert disk_pipe(tmp_path).fingerprint == base.fingerprint
    assert disk_pipe(tmp_path, n=N + 1).fingerprint != base.fingerprint  # other source
    other_fn = rs.from_list(list(range(N))).map(lambda x: x).cache(tmp_path)
    assert other_fn.fingerprint != base.fingerprint  # other map code
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"i": i}) + "\n" for i in range(10)))
    before = rs.jsonl(str(data)).cache(tmp_path).fingerprint
    data.write_text("".join(json.dumps({"i": i}) + "\n" for i in range(10, 20)))
    os.utime(data, ns=(1, 1))
    assert rs.jsonl(str(data)).cache(tmp_path).fingerprint != before  # the file changed


def add(record: int, offset: int = 1, table: Any = None) -> int:
    return record + offset


class Vocabulary:
    """An object a map is configured with (a tokenizer): its repr names its address."""


def test_fingerprint_hashes_plain_arguments_and_only_the_type_of_objects(tmp_path: Path) -> None:
    """Defaults and a partial's bound arguments that are plain data are hashed; an object's repr
    differs from process to process, so of an object only its type is, and every DataLoader
    worker, rank and later job finds the same cache."""

    def fingerprint(fn: Any) -> str:
        return rs.from_list(list(range(N))).map(fn).cache(tmp_path).fingerprint

    base = fingerprint(add)
    assert fingerprint(functools.partial(add, offset=2)) != fingerprint(functools.partial(add, offset=3)) != base
    assert fingerprint(functools.partial(add, offset=2)) == fingerprint(functools.partial(add, offset=2))
    assert fingerprint(functools.partial(add, table=Vocabulary())) == fingerprint(
        functools.partial(add, table=Vocabulary())
    )
    assert fingerprint(functools.partial(add, table=[1, (2, 3)])) != fingerprint(
        functools.partial(add, table=[1, (2, 4)])
    )
    add.__defaults__ = (5, None)
    try:
        assert fingerprint(add) != base  # a default edited
    finally:
        add.__defaults__ = (1, None)
    assert fingerprint(add) == base


def test_stray_temp_and_corrupt_blocks_are_ignored(tmp_path: Path) -> None:
    first = take(disk_pipe(tmp_path), N)
    root = Path(disk_pipe(tmp_path).path)  # type: ignore[arg-type]  # a disk cache: its path is set
    (root / f".{block_name(0, BLOCK)}.abc.tmp").write_bytes(b"partial")
    (root / block_name(BLOCK, 2 * BLOCK)).write_bytes(b"not arrow")  # a damaged block
    counter = Counter()
    again = take(disk_pipe(tmp_path, counter), N)
    assert counter.calls == BLOCK  # only the damaged block is computed (and rewritten)
    assert all(same(a, b) for a, b in zip(first, again))
    counter = Counter()
    take(disk_pipe(tmp_path, counter), N)
    assert counter.calls == 0


def test_a_cache_that_has_read_blocks_pickles_without_them(tmp_path: Path) -> None:
    """Regression: open blocks (memory maps, Arrow getters) went into the pickle, which failed
    once any block had been read; DataLoader workers map the files again instead."""
    pipe = disk_pipe(tmp_path).shuffle(1)
    first = take(pipe, N)
    counter = Counter()
    copied = pickle.loads(pickle.dumps(pipe))
    copied.upstream.upstream.fn = counter  # the copy's map: counts what is computed again
    assert all(same(a, b) for a, b in zip(take(copied, N), take(pipe, N)))
    assert counter.calls == 0 and sorted(record["n"] for record in first) == list(range(N))


def test_unwritable_directory_falls_back_to_memory_with_one_warning(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    counter = Counter()
    with pytest.warns(CacheWarning, match="in memory only") as caught:
        pipe = disk_pipe(blocker / "cache", counter)
    assert len(caught) == 1 and pipe.path is None
    take(pipe, 2 * N)
    assert counter.calls == N


def _fill(directory: str, queue: Any) -> None:
    counter = Counter()
    records = take(disk_pipe(Path(directory), counter).shuffle(os.getpid() % 7), N)
    queue.put(sorted(r["n"] for r in records))


def test_two_processes_filling_one_cache(tmp_path: Path) -> None:
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    workers = [context.Process(target=_fill, args=(str(tmp_path), queue)) for _ in range(2)]
    for worker in workers:
        worker.start()
    results = [queue.get(timeout=60) for _ in workers]
    for worker in workers:
        worker.join(60)
        assert worker.exitcode == 0
    assert results == [list(range(N))] * 2
    counter = Counter()
    assert [r["n"] for r in take(disk_pipe(tmp_path, counter), N)] == list(range(N))
    assert counter.calls == 0
    assert not [name for name in os.listdir(disk_pipe(tmp_path).path) if name.endswith(".tmp")]


# -- placement and options --------------------------------------------------------------------


def test_cache_must_sit_below_shuffle_and_shard_and_filter() -> None:
    source = rs.from_list(list(range(10)))
    with pytest.raises(rs.ConfigError, match="contains Shuffle"):
        source.shuffle(0).cache()
    with pytest.raises(rs.ConfigError, match="contains Shard"):
        source.shard(0, 2).cache()
    with pytest.raises(rs.ConfigError, match="not indexed"):
        source.filter(lambda x: True).cache()
    with pytest.raises(rs.ConfigError, match="max_bytes"):
        source.cache(max_bytes=-1)
    with pytest.raises(rs.ConfigError, match="block_size"):
        Cache(source, block_size=0)


def test_maps_after_the_cache_still_apply_and_random_access_works(tmp_path: Path) -> None:
    counter = Counter()
    pipe = rs.from_list(list(range(N))).map(counter).cache(tmp_path).map(lambda r: r["n"] * 2)
    assert take(pipe, N) == [2 * i for i in range(N)]
    assert pipe[7] == 14 and pipe.fetch((3, 9)) == 18
    assert counter.calls == N


def test_jsonl_source_through_cache(tmp_path: Path) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": "x" * i}) + "\n" for i in range(50)))

    def build() -> rs.Node[Any]:
        return rs.jsonl(str(data)).map(lambda r: {"n": len(r["text"])}).cache(tmp_path / "c").shuffle(1).batch(4)

    check_resume(build, 5, 30, k2=20)
    assert sorted(r["n"] for b in take(build(), 13) for r in b) == list(range(50))  # 12 batches of 4, one of 2


# -- resume -----------------------------------------------------------------------------------


def _wipe(directory: Path, keep_every: int) -> None:
    """Delete block files: all of them (``keep_every=0``) or all but every ``keep_every``-th."""
    if not directory.exists():
        return
    for name in os.listdir(directory):
        blocks = sorted(n for n in os.listdir(directory / name) if n.endswith(".arrow"))
        for index, block in enumerate(blocks):
            if keep_every == 0 or index % keep_every:
                os.unlink(directory / name / block)


def _chains(directory: Path | None, before_build: Any = None) -> list[Any]:
    def cached(world: int, rank: int, batch: int) -> Any:
        def build() -> rs.Node[Any]:
            if before_build is not None:
                before_build()
            node = cache(rs.from_list(list(range(N))).map(Counter()), directory, block_size=BLOCK)
            return node.shuffle(7).shard(rank, world).map(plain).batch(batch)

        return build

    return [cached(1, 0, 1), cached(2, 1, 8), cached(3, 0, 5)]


@pytest.mark.parametrize("fill", ["cold", "warm", "half"])
def test_resume_is_exact_whatever_the_cache_holds(tmp_path: Path, fill: str) -> None:
    """Every pipeline check_resume builds (the uninterrupted run, the resumed ones) meets a
    cache in the given state: emptied, full, or with every other block deleted."""
    directory = tmp_path / "cache"

    def prepare() -> None:
        if fill == "cold":
            _wipe(directory, 0)
        elif fill == "half":
            take(disk_pipe(directory), N)
            _wipe(directory, 2)
        else:
            take(disk_pipe(directory), N)

    for build in _chains(directory, prepare):
        for k, k2 in ((0, None), (3, 10), (17, 40), (29, 31)):
            check_resume(build, k, 60, k2=k2)


def test_resume_with_memory_cache_and_state_layout() -> None:
    (build,) = _chains(None)[1:2]
    check_resume(build, 7, 50, k2=30)
    pipe = rs.from_list(list(range(N))).map(Counter()).cache()
    take(pipe, 5)
    state = pipe.get_state()
    assert state["kind"] == "Cache" and state["position"] == 5
    assert state["directory"] is None and state["max_bytes"] == 1 << 30 and len(state["fingerprint"]) == 32
    json.dumps(state)


def test_state_moves_between_cache_locations(tmp_path: Path) -> None:
    def build(directory: Path | None) -> rs.Node[Any]:
        return rs.from_list(list(range(N))).map(Counter()).cache(directory).shuffle(2).map(plain)

    expected = take(build(None), 2 * N)
    pipe = build(None)
    head = take(pipe, 120)
    moved = build(tmp_path)
    moved.set_state(json.loads(json.dumps(pipe.get_state())))
    assert head + take(moved, 2 * N - 120) == expected


def test_other_upstream_state_is_rejected(tmp_path: Path) -> None:
    pipe = disk_pipe(tmp_path)
    take(pipe, 3)
    with pytest.raises(rs.StateError):
        disk_pipe(tmp_path, n=N + 1).set_state(pipe.get_state())


def test_warnings_are_not_raised_on_normal_use(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        take(disk_pipe(tmp_path), N)


def tokenize_line(record: dict[str, Any]) -> dict[str, Any]:
    return {"id": record["id"], "input_ids": np.arange(1, 2 + record["id"] % 5, dtype=np.int64)}


@pytest.mark.parametrize("on_disk", [False, True])
def test_malformed_records_skipped_by_the_source_are_skipped_through_the_cache(tmp_path: Path, on_disk: bool) -> None:
    """With on_error="skip" the cache keeps a stand-in for each malformed record, so every
    epoch (computed or read from the cache) skips exactly what iterating the source skips; a
    block made only of malformed records too."""
    lines = [json.dumps({"id": i}) for i in range(30)]
    for bad in (0, 1, 2, 3, 11, 29):  # the first block of 4 is all malformed
        lines[bad] = '{"id": '
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(lines) + "\n")
    directory = tmp_path / "cache" if on_disk else None

    def build(cached: bool, rank: int = 0) -> rs.Node[Any]:
        pipe = rs.jsonl(str(path), on_error="skip").map(tokenize_line)
        if cached:
            pipe = cache(pipe, directory, block_size=4)
        return pipe.shuffle(3).shard(rank, 2).map(plain)

    expected = take(build(False), 30)
    assert take(build(True), 30) == expected  # cold: computed, the stand-ins stored
    assert take(build(True), 30) == expected  # warm: read from memory or disk
    one_epoch = [item["id"] for rank in (0, 1) for item in build(True, rank)]
    assert sorted(one_epoch) == [i for i in range(30) if i not in (0, 1, 2, 3, 11, 29)]
    for k in (0, 3, 11, 12, 20):
        check_resume(lambda: build(True), k, 30)
    with pytest.raises(rs.SourceError, match="skipped as malformed"):
        cache(rs.jsonl(str(path), on_error="skip"), directory, block_size=4).record_at(0, 11)
    if on_disk:
        assert any(name.endswith(".arrow") for _, _, files in os.walk(tmp_path / "cache") for name in files)


def test_the_whole_epoch_packer_over_a_cache_skips_malformed_records(tmp_path: Path) -> None:
    lines = [json.dumps({"id": i}) for i in range(20)]
    lines[5] = "not json"
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(lines) + "\n")
    pipe = rs.jsonl(str(path), on_error="skip").map(tokenize_line).cache().shuffle(1).pack(6, strategy="bfd")
    tokens = sum(int((row["document_ids"] > 0).sum()) for row in pipe)
    assert tokens == sum(1 + i % 5 for i in range(20) if i != 5)
