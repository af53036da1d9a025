"""The local chunk cache of remote blocks: round trip, LRU bound, damaged files, a writer killed
mid-write, processes sharing one directory, an unwritable directory, pickling."""

from __future__ import annotations

import fcntl
import multiprocessing
import os
import pickle
import random
import signal
import time
import warnings
from pathlib import Path

import pytest

from resumable.errors import ConfigError
from resumable.sources import chunk_cache
from resumable.sources.chunk_cache import ChunkCache, ChunkCacheWarning

KEY = "0123abcd"
FORK = multiprocessing.get_context("fork")
DEADLINE_S = 60.0
"""How long a test waits for a child process before failing (not a performance bound)."""


def payload(key: str, block: int, size: int) -> bytes:
    """Bytes that name their key and block, so a block read under the wrong name shows."""
    stamp = f"{key}:{block};".encode()
    return (stamp * (size // len(stamp) + 1))[:size]


def files_under(directory: Path) -> list[Path]:
    return [path for path in directory.rglob("*") if path.is_file()]


def disk_bytes(directory: Path) -> int:
    return sum(path.stat().st_size for path in files_under(directory))


def block_files(directory: Path) -> list[Path]:
    return [path for path in files_under(directory) if path.name.isdigit()]


def temp_files(directory: Path) -> list[Path]:
    return [path for path in files_under(directory) if path.name.endswith(chunk_cache.TEMP_SUFFIX)]


def test_round_trip(tmp_path: Path) -> None:
    cache = ChunkCache(str(tmp_path), 1 << 20)
    assert cache.get(KEY, 0) is None
    data = payload(KEY, 3, 1000)
    cache.put(KEY, 3, data)
    cache.put(KEY, 3, data)  # writing a block again replaces it
    assert cache.get(KEY, 3) == data
    assert cache.get(KEY, 4) is None
    assert cache.get("ff", 3) is None
    cache.put(KEY, 5, b"")
    assert cache.get(KEY, 5) == b""
    assert (tmp_path / KEY / "3").stat().st_size == 1000 + chunk_cache.TRAILER.size
    assert cache.stats == {
        "hits": 2,
        "misses": 3,
        "damaged": 0,
        "written_bytes": 2 * (1000 + chunk_cache.TRAILER.size) + chunk_cache.TRAILER.size,
        "evicted_bytes": 0,
        "sweeps": 1,  # the first put learns the directory's usage
    }
    assert temp_files(tmp_path) == []


def test_lru_eviction_and_bound(tmp_path: Path) -> None:
    file_size = 100 + chunk_cache.TRAILER.size
    cache = ChunkCache(str(tmp_path), 1000)  # every put is more than a sweep fraction: each sweeps
    for block in range(7):
        cache.put(KEY, block, payload(KEY, block, 100))
    assert sorted(int(path.name) for path in block_files(tmp_path)) == list(range(7))
    assert cache.get(KEY, 0) is not None  # block 0 is now the most recently used
    cache.put(KEY, 7, payload(KEY, 7, 100))  # 8 files exceed 90% of 1000 bytes: evict one
    assert sorted(int(path.name) for path in block_files(tmp_path)) == [0, 2, 3, 4, 5, 6, 7]
    cache.put(KEY, 8, payload(KEY, 8, 100))
    assert sorted(int(path.name) for path in block_files(tmp_path)) == [0, 3, 4, 5, 6, 7, 8]
    assert cache.stats["evicted_bytes"] == 2 * file_size

    for block in range(9, 60):
        cache.put(KEY, block, payload(KEY, block, 100 + block))
        assert disk_bytes(tmp_path) <= 1000
    stats = cache.stats
    assert stats["written_bytes"] - stats["evicted_bytes"] == disk_bytes(tmp_path)
    for path in block_files(tmp_path):
        block, size = int(path.name), path.stat().st_size - chunk_cache.TRAILER.size
        assert cache.get(KEY, block) == payload(KEY, block, size)


def test_block_read_during_a_sweep_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A block another process reads between a sweep's scan and its deletions is no longer the
    least recently used: the sweep keeps it and evicts the next oldest."""
    for block in range(7):
        ChunkCache(str(tmp_path), 1000).put(KEY, block, payload(KEY, block, 100))
    scan = ChunkCache._scan

    def scan_then_read(self: ChunkCache) -> object:
        found = scan(self)
        assert ChunkCache(str(tmp_path), 1000).get(KEY, 0) is not None
        return found

    monkeypatch.setattr(ChunkCache, "_scan", scan_then_read)
    ChunkCache(str(tmp_path), 1000).put(KEY, 7, payload(KEY, 7, 100))
    assert sorted(int(path.name) for path in block_files(tmp_path)) == [0, 2, 3, 4, 5, 6, 7]


def test_sweep_waits_for_another_process(tmp_path: Path) -> None:
    """A process that finds the sweep lock taken skips its sweep and sweeps at its next put."""
    cache = ChunkCache(str(tmp_path), 1000)
    cache.put(KEY, 0, payload(KEY, 0, 100))
    with open(tmp_path / chunk_cache.LOCK_NAME, "rb") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another open file description: held like another process
        for block in range(1, 12):
            cache.put(KEY, block, payload(KEY, block, 100))
        assert cache.stats["sweeps"] == 1
        assert len(block_files(tmp_path)) == 12
    cache.put(KEY, 12, payload(KEY, 12, 100))
    assert cache.stats["sweeps"] == 2
    assert disk_bytes(tmp_path) <= 900
    assert cache.get(KEY, 12) is not None and cache.get(KEY, 0) is None


def flip_data_byte(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[10] ^= 0x01
    path.write_bytes(bytes(raw))


def flip_trailer_byte(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0x01
    path.write_bytes(bytes(raw))


def cut_last_byte(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-1])


def cut_to_trailer(path: Path) -> None:
    path.write_bytes(path.read_bytes()[-chunk_cache.TRAILER.size :])


def cut_below_trailer(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:5])


def append_byte(path: Path) -> None:
    path.write_bytes(path.read_bytes() + b"x")


@pytest.mark.parametrize(
    "damage", [flip_data_byte, flip_trailer_byte, cut_last_byte, cut_to_trailer, cut_below_trailer, append_byte]
)
def test_damaged_file_is_dropped(tmp_path: Path, damage: object) -> None:
    cache = ChunkCache(str(tmp_path), 1 << 20)
    data = payload(KEY, 1, 500)
    cache.put(KEY, 1, data)
    path = tmp_path / KEY / "1"
    damage(path)  # type: ignore[operator]
    assert cache.get(KEY, 1) is None
    assert not path.exists()
    assert cache.stats["damaged"] == 1 and cache.stats["misses"] == 1 and cache.stats["hits"] == 0
    cache.put(KEY, 1, data)
    assert cache.get(KEY, 1) == data


BIG_BLOCK = 256 << 10
BLOCKS = 48


def write_forever(directory: str, max_bytes: int) -> None:
    """A child process writing large blocks until it is killed."""
    cache = ChunkCache(directory, max_bytes)
    for step in range(1 << 62):
        cache.put(KEY, step % BLOCKS, payload(KEY, step % BLOCKS, BIG_BLOCK + step % BLOCKS))


def test_writer_killed_mid_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGKILL at arbitrary moments of writes and sweeps: every block file left is whole, temp files
    are left only by the killed writes and are removed once old; the sweep lock died with its
    holder. Killed until one kill lands inside a write (most do), at most ``attempts`` times."""
    max_bytes = 16 * BIG_BLOCK
    attempts = 20
    orphans: list[Path] = []
    for attempt in range(attempts):
        directory = tmp_path / str(attempt)
        child = FORK.Process(target=write_forever, args=(str(directory), max_bytes))
        child.start()
        started = time.monotonic()
        target = 4 + attempt % 5
        while len(block_files(directory)) < target and time.monotonic() - started < DEADLINE_S:
            time.sleep(0.001 * (attempt % 7))
        os.kill(child.pid, signal.SIGKILL)  # type: ignore[arg-type]
        child.join()
        assert len(block_files(directory)) >= target, "the writer made no progress"
        orphans = temp_files(directory)
        reader = ChunkCache(str(directory), max_bytes)
        for path in block_files(directory):
            block = int(path.name)
            assert reader.get(KEY, block) == payload(KEY, block, BIG_BLOCK + block)
        assert reader.stats["damaged"] == 0
        if orphans:
            break
    assert orphans, f"no kill out of {attempts} landed inside a write"

    writer = ChunkCache(str(directory), max_bytes)
    writer.put(KEY, 0, payload(KEY, 0, BIG_BLOCK))  # the first put sweeps: the lock is free
    assert writer.stats["sweeps"] == 1
    assert sorted(temp_files(directory)) == sorted(orphans)  # young: perhaps still being written, kept
    monkeypatch.setattr(chunk_cache, "TEMP_MAX_AGE_S", 0.0)
    ChunkCache(str(directory), max_bytes).put(KEY, 1, payload(KEY, 1, BIG_BLOCK))
    assert temp_files(directory) == []
    assert disk_bytes(directory) <= max_bytes


def share(directory: str, max_bytes: int, seed: int, operations: int) -> None:
    """A child process putting and getting random blocks of a small shared space; exit status 1
    when any block read back is not the one written under its name."""
    rng = random.Random(seed)
    cache = ChunkCache(directory, max_bytes)
    wrong = 0
    for _ in range(operations):
        key, block = rng.choice(("aa", "bb", "cc")), rng.randrange(30)
        size = 200 + (block * 97) % 1800
        if rng.random() < 0.5:
            cache.put(key, block, payload(key, block, size))
        else:
            data = cache.get(key, block)
            wrong += data is not None and data != payload(key, block, size)
    os._exit(1 if wrong or cache.stats["damaged"] else 0)


def test_processes_share_a_directory(tmp_path: Path) -> None:
    """Two processes putting, getting and sweeping one small directory never read a wrong byte."""
    max_bytes = 24_000  # about a fifth of the blocks fit: eviction all the time
    children = [FORK.Process(target=share, args=(str(tmp_path), max_bytes, seed, 1500)) for seed in (1, 2)]
    for child in children:
        child.start()
    for child in children:
        child.join(DEADLINE_S)
        assert child.exitcode == 0
    cache = ChunkCache(str(tmp_path), max_bytes)
    cache.put("aa", 0, payload("aa", 0, 200))  # the first put sweeps
    assert disk_bytes(tmp_path) <= max_bytes
    assert temp_files(tmp_path) == []
    for path in block_files(tmp_path):
        key, block = path.parent.name, int(path.name)
        assert cache.get(key, block) == payload(key, block, 200 + (block * 97) % 1800)


def test_unwritable_directory_warns_once(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_bytes(b"not a directory")
    cache = ChunkCache(str(blocker / "cache"), 1 << 20)
    with pytest.warns(ChunkCacheWarning, match="cannot be written"):
        cache.put(KEY, 0, b"data")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cache.put(KEY, 1, b"data")
        assert cache.get(KEY, 0) is None
    assert cache.stats["misses"] == 1 and cache.stats["written_bytes"] == 0


def test_pickle_carries_only_the_configuration(tmp_path: Path) -> None:
    cache = ChunkCache(str(tmp_path), 5000)
    cache.put(KEY, 2, b"abc")
    assert cache.get(KEY, 2) == b"abc"
    clone = pickle.loads(pickle.dumps(cache))
    assert (clone.directory, clone.max_bytes) == (str(tmp_path), 5000)
    assert set(clone.stats.values()) == {0}
    assert clone.get(KEY, 2) == b"abc"
    assert clone.stats["hits"] == 1 and cache.stats["hits"] == 1


@pytest.mark.parametrize("max_bytes", [-1, 0, 1.5, True, "10", None])
def test_invalid_bound(tmp_path: Path, max_bytes: object) -> None:
    with pytest.raises(ConfigError, match="max_bytes"):
        ChunkCache(str(tmp_path), max_bytes)  # type: ignore[arg-type]


@pytest.mark.parametrize("key, block", [("", 0), ("../x", 0), ("xyz", 0), (5, 0), (KEY, -1), (KEY, True), (KEY, 1.0)])
def test_invalid_key_or_block(tmp_path: Path, key: object, block: object) -> None:
    cache = ChunkCache(str(tmp_path), 1000)
    with pytest.raises(ConfigError, match="chunk cache"):
        cache.put(key, block, b"x")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="chunk cache"):
        cache.get(key, block)  # type: ignore[arg-type]
