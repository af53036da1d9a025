"""Adversary of ``.cache()`` at its edges, in memory and on disk.

Memory: ``max_bytes`` of nothing, below one record, exactly one record, two records and all of
them, so that records are evicted at every point of an epoch; the central property (iterate k
items, ``get_state``, JSON, a fresh pipeline, ``set_state``, continue == the uninterrupted run)
at k = 0, 1, the middle, the last item of the first epoch, after its ``StopIteration``, the last
item of the run, across 3 epochs, restored twice in a row, with the cache before shuffle, shard,
map, filter, batch and pack, and over an indexed filter. Disk: block sizes of 1, of the epoch and
beyond it, an empty source, cold and warm. A state moves between cache configurations (docs:
not checked), but not between a pipeline with a cache and one without. Corrupted states: only
typed errors, and a refused one changes nothing.

Storage under attack: block files cut short, grown, zeroed, deleted, replaced by a directory, the
fingerprint directory replaced by a file, between epochs, mid-epoch and before a fresh run;
blocks whose Arrow offsets point past their buffers or whose text is not UTF-8; the process
SIGKILLed while writing a block or while computing one, then a fresh run; one directory shared
by pipelines over other files, predicates and map constants; the data file rewritten, appended,
truncated and touched between runs; a nondeterministic map; the cache under ``rs.torch.Loader``
with 0, 2 and 2 persistent workers.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import random
import signal
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st

import resumable as rs
import resumable.torch as rst
from resumable import Node
from resumable.ops import disk_cache
from resumable.ops.cache import LRU, Cache, CacheWarning, _survey, cache
from tests.resume import LOADER_CONFIGS, flat, loader_epoch, loops, plain, roundtrip, take

pytestmark = [pytest.mark.filterwarnings("ignore:This DataLoader will create")]

Build = Callable[[], Node[Any]]

SIZE = 11  # records: no block size, batch size or shard count here divides it
TIMEOUT = 60  # seconds: a Loader worker that never answers fails the test instead of hanging it
REPO = Path(__file__).resolve().parent.parent


# -- user functions (module level: Loader workers unpickle them) --------------------------------


class Counted:
    """A tokenising map that counts its calls: every record has the same estimated size."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, x: Any) -> dict[str, Any]:
        self.calls += 1
        return tokens(x)


def tokens(x: Any) -> dict[str, Any]:
    x = x["x"] if isinstance(x, dict) else x
    return {"x": x, "input_ids": np.arange(3, dtype=np.int64) + 10 * x + 1}


def x_only(record: dict[str, Any]) -> int:
    return int(record["x"])


def not_mod3(record: dict[str, Any]) -> bool:
    return record["x"] % 3 != 1


def not_3_mod_4(x: int) -> bool:
    return x % 4 != 3


def even_x(record: Any) -> bool:
    return record["x"] % 2 == 0


def noisy(x: int) -> dict[str, Any]:
    """A nondeterministic map: a fresh random number every call."""
    return {"x": x, "noise": random.random()}


ONE = _survey(tokens(0))[0]
"""The estimated size of every ``tokens`` record."""


def source() -> Node[Any]:
    return rs.from_list(list(range(SIZE)))


# -- the central property ---------------------------------------------------------------------


def merge(head: list[list[Any]], rest: list[list[Any]]) -> list[list[Any]]:
    """The loops of a run cut in two: the rest's first loop finishes the head's last one."""
    if not head or not rest:
        return head + rest
    return [*head[:-1], head[-1] + rest[0], *rest[1:]]


def restored_twice(build: Build, state: dict[str, Any], count: int) -> list[list[Any]]:
    """``count`` items of a fresh pipeline restored from ``state``: one item, then the state
    there restored into another fresh pipeline (restoring twice in a row), then the rest."""
    first = build()
    first.set_state(roundtrip(state))
    middle = loops(first, min(1, count))
    again = roundtrip(first.get_state())
    second = build()
    second.set_state(again)
    return merge(middle, loops(second, count - len(flat(middle))))


def check_cuts(build: Build, total: int) -> list[list[Any]]:
    """The central property at every edge of a run over several epochs; the run's loops."""
    expected = loops(build(), total)
    count = len(flat(expected))
    assert count == total and len(expected) >= 3, "the run must cross 3 epochs"
    first = len(expected[0])
    for k in sorted({0, 1, first // 2, first - 1, first, first + 1, count - 1, count}):
        pipe = build()
        head = loops(pipe, k)
        state = roundtrip(pipe.get_state())
        assert merge(head, restored_twice(build, state, count - k)) == expected, f"cut after {k} items"
    pipe = build()
    epoch = [plain(item) for item in pipe]
    state = roundtrip(pipe.get_state())
    assert state["ended"] is True and epoch == expected[0]
    rest = restored_twice(build, state, count - len(epoch))
    assert flat([epoch, *rest]) == flat(expected), "cut after the StopIteration of the first epoch"
    return expected


MEMORY_SIZES = {"nothing": 0, "below-one-record": ONE - 1, "one-record": ONE, "two-records": 2 * ONE, "all": 1 << 30}

CHAINS: dict[str, Callable[[Node[Any]], Node[Any]]] = {
    "shuffle-shard-batch": lambda cached: cached.shuffle(1).shard(1, 2).batch(2),
    "map-filter-batch": lambda cached: cached.map(x_only).filter(lambda x: x % 3 != 1).batch(3),
    "shuffle-pack-batch": lambda cached: cached.shuffle(2).pack(8, strategy="best_fit", buffer_size=3).batch(2),
}


def without_cache(chain: str) -> Build:
    return lambda: CHAINS[chain](source().map(tokens))


def with_cache(chain: str, counter: Counted | None = None, **options: Any) -> Build:
    return lambda: CHAINS[chain](cache(source().map(counter or Counted()), **options))


@pytest.mark.parametrize("where", list(MEMORY_SIZES))
@pytest.mark.parametrize("chain", list(CHAINS))
def test_a_memory_cache_of_any_size_resumes_exactly_at_every_cut(chain: str, where: str) -> None:
    expected = loops(without_cache(chain)(), 40)
    got = check_cuts(with_cache(chain, max_bytes=MEMORY_SIZES[where]), 40)
    assert got == expected  # the cache changes no record, evicting or not


@pytest.mark.parametrize("where", list(MEMORY_SIZES))
def test_what_a_memory_cache_keeps_follows_max_bytes(where: str) -> None:
    """Read in order over 3 epochs: a record bigger than ``max_bytes`` is never kept, one record
    keeps only the last one, all of them are computed once."""
    counter = Counted()
    pipe = cache(source().map(counter), max_bytes=MEMORY_SIZES[where])
    epochs = [[plain(record) for record in pipe] for _ in range(3)]
    assert epochs == [[plain(tokens(x)) for x in range(SIZE)]] * 3
    kept = len(pipe._memory)
    assert pipe._memory.bytes <= pipe.max_bytes
    if where in ("nothing", "below-one-record"):
        assert kept == 0 and counter.calls == 3 * SIZE
    elif where == "all":
        assert kept == SIZE and counter.calls == SIZE
    else:
        assert kept == MEMORY_SIZES[where] // ONE
        assert SIZE < counter.calls <= 3 * SIZE


@pytest.mark.parametrize("block", [1, 4, SIZE, SIZE + 5])
def test_a_disk_cache_of_any_block_size_resumes_exactly_cold_and_warm(block: int, tmp_path: Path) -> None:
    """Every pipeline of the first round meets a cold directory (each build wipes it), every one
    of the second the blocks the first round left."""
    chain = "shuffle-pack-batch"
    expected = loops(without_cache(chain)(), 40)

    def wiped() -> Node[Any]:
        for path in tmp_path.glob("*/*.arrow"):
            path.unlink()
        return with_cache(chain, directory=tmp_path, block_size=block)()

    assert check_cuts(wiped, 40) == expected
    assert check_cuts(with_cache(chain, directory=tmp_path, block_size=block), 40) == expected
    counter = Counted()
    take(with_cache(chain, counter, directory=tmp_path, block_size=block)(), 40)
    assert counter.calls == 0
    assert len(list(tmp_path.glob("*/*.arrow"))) == -(-SIZE // block)


def test_a_cache_over_an_indexed_filter_and_over_another_cache_resumes_exactly(tmp_path: Path) -> None:
    def build() -> Node[Any]:
        kept = source().map(tokens).filter(even_x, index=True, cache_dir=str(tmp_path / "index"), progress=False)
        return kept.cache(max_bytes=ONE).map(lambda r: {**r, "y": 1}).cache(str(tmp_path / "c")).shuffle(3)

    reference = source().map(tokens).filter(even_x).map(lambda r: {**r, "y": 1})
    got = check_cuts(build, 20)
    assert sorted(item["x"] for item in got[0]) == [item["x"] for item in reference]


@pytest.mark.parametrize(
    "nodes", [lambda s: s.batch(2), lambda s: s.pack(4), lambda s: s.filter(even_x), lambda s: s.shuffle(0, window=4)]
)
def test_a_cache_after_a_node_without_stable_positions_is_refused(nodes: Any) -> None:
    with pytest.raises(rs.ConfigError, match=r"place \.cache\(\) before"):
        nodes(source().map(tokens)).cache()


def test_an_empty_source_through_a_cache_resumes_into_nothing(tmp_path: Path) -> None:
    for directory in (None, tmp_path):
        pipe = rs.from_list([]).cache(directory).shuffle(1).batch(2)
        assert list(pipe) == [] and list(pipe) == []
        state = roundtrip(pipe.get_state())
        again = rs.from_list([]).cache(directory).shuffle(1).batch(2)
        again.set_state(state)
        assert list(again) == [] and list(again) == []


# -- states between cache configurations ------------------------------------------------------


CONFIGURATIONS: dict[str, dict[str, Any]] = {
    "memory": {},
    "memory-one-record": {"max_bytes": ONE},
    "memory-nothing": {"max_bytes": 0},
    "disk": {"directory": "a"},
    "disk-other-dir-and-block": {"directory": "b", "block_size": 2},
}


@pytest.mark.parametrize("saved", list(CONFIGURATIONS))
def test_a_state_resumes_under_any_other_cache_configuration(saved: str, tmp_path: Path) -> None:
    """docs/cache.md: the cache's own entries are recorded but not checked on restore; a state
    resumes in a pipeline that caches elsewhere, in memory, or with a cold cache."""

    def build(name: str) -> Node[Any]:
        options = dict(CONFIGURATIONS[name])
        if "directory" in options:
            options["directory"] = tmp_path / options["directory"]
        return cache(source().map(tokens), **options).shuffle(4).shard(0, 2).map(plain)

    expected = take(build(saved), 20)
    for other in CONFIGURATIONS:
        pipe = build(saved)
        head = take(pipe, 7)
        resumed = build(other)
        resumed.set_state(roundtrip(pipe.get_state()))
        assert head + take(resumed, 13) == expected, other


def test_a_state_with_a_cache_and_one_without_are_refused_by_each_other_and_change_nothing() -> None:
    def cached() -> Node[Any]:
        return source().map(tokens).cache(max_bytes=ONE).shuffle(1).map(plain)

    def uncached() -> Node[Any]:
        return source().map(tokens).shuffle(1).map(plain)

    for build, other in ((cached, uncached), (uncached, cached)):
        expected = take(build(), 25)
        donor = other()
        take(donor, 6)
        foreign = roundtrip(donor.get_state())
        pipe = build()
        head = take(pipe, 8)
        before = roundtrip(pipe.get_state())
        with pytest.raises(rs.StateError):
            pipe.set_state(foreign)
        assert roundtrip(pipe.get_state()) == before
        assert head + take(pipe, 17) == expected


def entries(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """The path of every entry of a state, nested ones included."""
    found: list[tuple[Any, ...]] = []
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found.append((*path, key))
        found.extend(entries(item, (*path, key)))
    return found


DELETE = object()
ODD_VALUES = st.sampled_from([None, "x", -1, 0, 2**70, [], {}, True, 1.5, float("nan"), 10**6, [1, 2], DELETE])


def fuzz_pipeline(directory: str | None) -> Node[Any]:
    return (
        cache(source().map(tokens), directory, max_bytes=2 * ONE, block_size=3).map(x_only).filter(lambda x: x % 3 != 1)
    )


@given(data=st.data(), on_disk=st.booleans(), taken=st.integers(0, 10))
def test_a_corrupted_state_raises_only_typed_errors_and_a_refused_one_changes_nothing(
    data: st.DataObject, on_disk: bool, taken: int, tmp_path_factory: pytest.TempPathFactory
) -> None:
    directory = str(tmp_path_factory.mktemp("fuzz")) if on_disk else None
    expected = take(fuzz_pipeline(None), 20)
    pipe = fuzz_pipeline(directory)
    head = take(pipe, taken)
    good = roundtrip(pipe.get_state())
    paths = entries(good)
    for _ in range(8):
        bad = copy.deepcopy(good)
        for path in data.draw(st.lists(st.sampled_from(paths), min_size=1, max_size=3)):
            holder = bad
            try:
                for key in path[:-1]:
                    holder = holder[key]
                value = data.draw(ODD_VALUES)
                if value is DELETE:
                    del holder[path[-1]]
                else:
                    holder[path[-1]] = value
            except (KeyError, IndexError, TypeError):
                continue  # an earlier edit removed or replaced this entry's holder
        try:
            pipe.set_state(bad)
        except rs.ResumableError:
            assert roundtrip(pipe.get_state()) == good
            continue
        take(pipe, 5)  # accepted: whatever it is, iterating it raises nothing untyped
        pipe.set_state(good)
    assert head + take(pipe, 20 - taken) == expected


# -- the storage under attack -----------------------------------------------------------------


def records(pipe: Node[Any]) -> list[Any]:
    return [plain(record) for record in pipe]


def damage(root: Path, how: str) -> None:
    """Do ``how`` to every block file of a fingerprint directory (or to the directory)."""
    if how == "root-replaced-by-a-file":
        for path in root.iterdir():
            path.unlink()
        root.rmdir()
        root.write_text("in the way")
        return
    for path in sorted(root.glob("*.arrow")):
        size = path.stat().st_size
        if how == "cut-short":
            os.truncate(path, size // 2)
        elif how == "grown":
            with open(path, "ab") as out:
                out.write(b"junk")
        elif how == "zeroed-new-file":
            path.unlink()
            path.write_bytes(bytes(size))
        elif how == "deleted":
            path.unlink()
        elif how == "replaced-by-a-directory":
            path.unlink()
            path.mkdir()


DAMAGES = ["cut-short", "grown", "zeroed-new-file", "deleted", "replaced-by-a-directory", "root-replaced-by-a-file"]


@pytest.mark.parametrize("when", ["between-epochs", "mid-epoch", "before-a-fresh-run"])
@pytest.mark.parametrize("how", DAMAGES)
def test_damaged_blocks_never_change_a_record_nor_stop_iteration(how: str, when: str, tmp_path: Path) -> None:
    """docs/cache.md: damaged blocks are treated as missing, a block cut short or grown in place
    while mapped is computed again, one replaced or removed while mapped stays mapped as it was,
    an unwritable directory falls back to memory with one CacheWarning: "Iteration never fails
    because of the cache's storage". A warm directory read in order by a fresh pipeline, so that
    mid-epoch the blocks after the cursor's first chunk are not mapped yet."""
    count = 40

    def build(counter: Counted | None = None) -> Cache[Any]:
        return cache(rs.from_list(list(range(count))).map(counter or Counted()), tmp_path, block_size=4)

    expected = [[plain(tokens(x)) for x in range(count)]] * 3
    assert records(build()) == expected[0]  # fills the directory
    counter = Counted()
    pipe = build(counter)
    root = Path(pipe.path)  # type: ignore[arg-type]  # a writable directory: on disk
    disk = pipe._disk
    assert disk is not None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if when == "before-a-fresh-run":
            damage(root, how)
            pipe = build(counter)
            got = [records(pipe) for _ in range(3)]
        elif when == "between-epochs":
            got = [records(pipe)]
            damage(root, how)
            got += [records(pipe), records(pipe)]
        else:
            iterator = iter(pipe)
            head = [plain(next(iterator)) for _ in range(5)]
            mapped = len(disk._views)
            assert 0 < mapped < count // 4
            damage(root, how)
            got = [head + [plain(record) for record in iterator], records(pipe), records(pipe)]
    assert got == expected
    assert all(issubclass(w.category, CacheWarning) for w in caught)
    fell_back = how in ("replaced-by-a-directory", "root-replaced-by-a-file") and when != "between-epochs"
    assert len(caught) == fell_back  # between epochs every block is mapped already
    in_place = how in ("cut-short", "grown")
    if when == "before-a-fresh-run":
        assert counter.calls == count  # every block computed again once, then kept (on disk or in memory)
    elif when == "between-epochs":
        assert counter.calls == (count if in_place else 0)  # only a change in place drops a mapped block
    elif how in ("zeroed-new-file", "deleted"):
        assert counter.calls == count - 4 * mapped  # the mapped blocks stay mapped as they were
    else:
        assert counter.calls == count  # in place: all; fallen back: the mapped ones in the next epoch


READER = """
import json, sys
import resumable as rs
from resumable.ops.cache import cache
pipe = cache(rs.jsonl(sys.argv[1]), sys.argv[2], block_size=4)
print(json.dumps([record for record in pipe]))
print(pipe.computed)
"""


def jsonl_records(count: int) -> list[dict[str, Any]]:
    return [{"x": i, "t": "ab" * (i % 4 + 1), "ids": list(range(i % 5 + 1))} for i in range(count)]


def overwrite(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as out:
        out.seek(offset)
        out.write(data)


def buffer_offset(path: Path, column: str, buffer: int) -> int:
    """Where in ``path`` (an Arrow IPC file) buffer ``buffer`` of ``column`` begins."""
    with pa.memory_map(str(path)) as mapped:
        whole = mapped.read_buffer()
        found = pa.ipc.open_file(whole).read_all().column(column).chunk(0).buffers()[buffer]
        return int(found.address - whole.address)


@pytest.mark.parametrize("how", ["text-offset-past-the-end", "list-offset-past-the-end", "text-not-utf8"])
def test_a_block_whose_arrow_buffers_are_damaged_is_computed_again(how: str, tmp_path: Path) -> None:
    """docs/cache.md: a block file damaged some other way is treated as missing and computed
    again, and iteration never fails because of the cache's storage; the Arrow and Parquet
    sources validate their batches fully for the same reason (docs/sources.md)."""
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(record) + "\n" for record in jsonl_records(10)))
    directory = tmp_path / "c"
    node = cache(rs.jsonl(str(data)), directory, block_size=4)
    assert list(node) == jsonl_records(10)
    block = Path(node.path, disk_cache.block_name(0, 4))  # type: ignore[arg-type]  # on disk
    if how == "text-offset-past-the-end":
        overwrite(block, buffer_offset(block, "t", 1) + 4, (2**31 - 1).to_bytes(4, "little"))
    elif how == "list-offset-past-the-end":
        overwrite(block, buffer_offset(block, "ids", 1) + 4, (2**20).to_bytes(4, "little"))
    else:
        overwrite(block, buffer_offset(block, "t", 2), b"\xff")
    run = subprocess.run(  # noqa: S603 - this interpreter, a script of this file
        [sys.executable, "-c", READER, str(data), str(directory)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
        cwd=REPO,
    )
    assert run.returncode == 0, run.stderr[-500:]
    lines = run.stdout.splitlines()
    assert json.loads(lines[0]) == jsonl_records(10)
    assert lines[1] == "4"  # the damaged block alone was computed again


KILLER = """
import os, signal, sys
import resumable as rs
from resumable.ops import disk_cache
from resumable.ops.cache import cache
data, directory, where = sys.argv[1:]
real = disk_cache.write_atomically
writes = []

def dying(path, write):  # the second block's write: half its bytes reach the disk, then SIGKILL
    if not str(path).endswith("000000000004-000000000008.arrow"):
        return real(path, write)

    class Half:
        def __init__(self, out):
            self.out = out

        def write(self, payload):
            self.out.write(bytes(payload)[: len(payload) // 2])
            self.out.flush()
            os.fsync(self.out.fileno())
            os.kill(os.getpid(), signal.SIGKILL)

    return real(path, lambda out: write(Half(out)))

if where == "writing":
    disk_cache.write_atomically = dying
from resumable.ops.cache import Cache
compute = Cache._compute

def dying_compute(self, start, stop):  # the second block computed: SIGKILL before its write
    records = compute(self, start, stop)
    writes.append(start)
    if len(writes) == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    return records

if where == "computing":
    Cache._compute = dying_compute
for record in cache(rs.jsonl(data), directory, block_size=4).shuffle(0):
    pass
"""


@pytest.mark.parametrize("where", ["writing", "computing"])
def test_a_process_killed_while_filling_the_cache_leaves_what_a_fresh_run_completes(where: str, tmp_path: Path) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(record) + "\n" for record in jsonl_records(SIZE)))
    directory = tmp_path / "c"
    run = subprocess.run(  # noqa: S603 - this interpreter, a script of this file
        [sys.executable, "-c", KILLER, str(data), str(directory), where], timeout=TIMEOUT, check=False, cwd=REPO
    )
    assert run.returncode == -signal.SIGKILL
    (root,) = directory.iterdir()
    left = sorted(path.name for path in root.iterdir())
    assert "config.json" in left
    assert any(name.startswith(".") for name in left) is (where == "writing")
    expected_order = records(rs.jsonl(str(data)).shuffle(0))
    pipe = cache(rs.jsonl(str(data)), directory, block_size=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert records(pipe.shuffle(0)) == expected_order
    kept = sum(
        min(start + 4, SIZE) - start
        for start in range(0, SIZE, 4)
        if disk_cache.block_name(start, min(start + 4, SIZE)) in left
    )
    assert 0 < kept < SIZE
    assert pipe.computed == SIZE - kept  # complete blocks are read, the rest computed
    assert sorted(path.name for path in root.iterdir()) == [
        *(disk_cache.block_name(start, min(start + 4, SIZE)) for start in range(0, SIZE, 4)),
        "config.json",
    ]  # the partial file of the killed write is gone with its block written


def write_jsonl(path: Path, values: list[int]) -> None:
    path.write_text("".join(json.dumps({"x": v, "t": "w" * (v % 3)}) + "\n" for v in values))


CHANGES = ["rewritten", "appended", "truncated", "touched"]


@pytest.mark.parametrize("change", CHANGES)
def test_a_data_file_changed_between_runs_is_never_served_from_the_old_cache(change: str, tmp_path: Path) -> None:
    """docs/cache.md: a pipeline whose data changed never reads a stale cache; a state saved
    over the old file restores only where docs/sources.md accepts the file (a touch)."""
    data = tmp_path / "d.jsonl"
    write_jsonl(data, list(range(SIZE)))

    def build() -> Node[Any]:
        return cache(rs.jsonl(str(data)).map(tokens), tmp_path / "c", block_size=4).shuffle(2).map(plain)

    old = build()
    head = take(old, 6)
    state = roundtrip(old.get_state())
    rest_before = take(old, SIZE - 6)
    if change == "rewritten":
        write_jsonl(data, [v + 100 for v in range(SIZE)][::-1])  # other records, another size
    elif change == "appended":
        write_jsonl(data, list(range(SIZE + 2)))
    elif change == "truncated":
        write_jsonl(data, list(range(SIZE - 3)))
    else:
        os.utime(data, ns=(10**18, 10**18))
    reference = rs.jsonl(str(data)).map(tokens).shuffle(2).map(plain)
    uncached = [records(reference) for _ in range(2)]
    fresh = build()
    assert [records(fresh) for _ in range(2)] == uncached
    warm = cache(rs.jsonl(str(data)).map(tokens), tmp_path / "c", block_size=4)
    assert records(warm) == [plain(tokens(record)) for record in rs.jsonl(str(data))]
    assert warm.computed == 0  # the new file's blocks were written by the fresh run
    assert len(list((tmp_path / "c").iterdir())) == 2  # the old file's fingerprint directory and the new one's
    resumed = build()
    if change == "touched":
        resumed.set_state(state)
        assert head + take(resumed, SIZE - 6) == head + rest_before
        return
    with pytest.raises(rs.StateError, match="differs from the file the state was taken over"):
        resumed.set_state(state)
    assert records(resumed) == uncached[0]  # the refused state changed nothing


def test_one_directory_shared_by_pipelines_over_other_data_serves_each_its_own_records(tmp_path: Path) -> None:
    """Files of one name, size and mtime in two directories, two indexed-filter predicates, two
    maps differing in a constant, interleaved half epochs over one cache directory."""
    for sub, shift in (("a", 0), ("b", 50)):
        (tmp_path / sub).mkdir()
        write_jsonl(tmp_path / sub / "d.jsonl", [v + shift for v in range(SIZE)])
        os.utime(tmp_path / sub / "d.jsonl", ns=(10**18, 10**18))
    shared = tmp_path / "cache"
    index = str(tmp_path / "index")
    a, b = str(tmp_path / "a" / "d.jsonl"), str(tmp_path / "b" / "d.jsonl")
    upstreams: list[Build] = [
        lambda: rs.jsonl(a),
        lambda: rs.jsonl(b),
        lambda: rs.jsonl(a).filter(even_x, index=True, cache_dir=index, progress=False),
        lambda: rs.jsonl(a).filter(not_mod3, index=True, cache_dir=index, progress=False),
        lambda: rs.jsonl(a).map(lambda r: {"x": r["x"] + 1}),
        lambda: rs.jsonl(a).map(lambda r: {"x": r["x"] + 2}),
    ]
    expected = [records(upstream().shuffle(1)) for upstream in upstreams]
    assert len({json.dumps(e) for e in expected}) == len(upstreams)
    pipes = [cache(upstream(), shared, block_size=3).shuffle(1) for upstream in upstreams]
    iterators = [iter(pipe) for pipe in pipes]
    heads = [[plain(next(iterator)) for _ in range(3)] for iterator in iterators]  # each fills a block or two
    got = [head + [plain(record) for record in iterator] for head, iterator in zip(heads, iterators)]
    assert got == expected
    warm = [cache(upstream(), shared, block_size=3) for upstream in upstreams]
    assert [records(node.shuffle(1)) for node in warm] == expected
    assert all(node.computed == 0 for node in warm)
    assert len({node.path for node in warm}) == len(upstreams)


def test_runs_with_other_block_sizes_share_one_directory_and_each_reuses_its_own_blocks(tmp_path: Path) -> None:
    """The block size is not fingerprinted: the fingerprint directory holds the blocks of every
    size, each named by its range, whose content does not depend on the size."""
    expected = [plain(tokens(x)) for x in range(SIZE)]
    for block, computed in ((4, SIZE), (3, SIZE), (SIZE, SIZE), (4, 0), (3, 0), (1, SIZE), (SIZE, 0)):
        node = cache(source().map(tokens), tmp_path, block_size=block)
        assert [records(node) for _ in range(2)] == [expected, expected]
        assert node.computed == computed, block
    assert len(list(tmp_path.glob("*/*.arrow"))) == 3 + 4 + 1 + SIZE


def test_a_nondeterministic_map_is_frozen_by_a_disk_cache_at_its_first_computation(tmp_path: Path) -> None:
    """docs/cache.md: with a directory the map runs once per record, ever, and a record is
    always served from its block, even in the epoch that wrote it: so later epochs, a restarted
    job and a resume all see the values the first computation drew. In memory the values hold
    while the record stays cached; evicted, it is drawn again (nothing is promised there)."""

    def build() -> Node[Any]:
        return cache(rs.from_list(list(range(SIZE))).map(noisy), tmp_path, block_size=4).shuffle(3).map(plain)

    pipe = build()
    first = [records(pipe) for _ in range(2)]
    assert sorted(r["x"] for r in first[0]) == list(range(SIZE))
    by_x = {r["x"]: r["noise"] for r in first[0]}
    assert {r["x"]: r["noise"] for r in first[1]} == by_x
    again = build()
    assert [records(again) for _ in range(2)] == first  # a restarted job: same order, same values
    pipe = build()
    head = take(pipe, 4)
    resumed = build()
    resumed.set_state(roundtrip(pipe.get_state()))
    assert head + take(resumed, 2 * SIZE - 4) == flat(first)
    memory = rs.from_list(list(range(SIZE))).map(noisy).cache()
    assert records(memory) == records(memory)
    nothing = rs.from_list(list(range(SIZE))).map(noisy).cache(max_bytes=0)
    assert records(nothing) != records(nothing)


# -- under rs.torch.Loader --------------------------------------------------------------------


def loader_pipeline(directory: str | None, max_bytes: int) -> Node[Any]:
    return (
        cache(rs.from_list(list(range(SIZE))).map(tokens), directory, max_bytes=max_bytes, block_size=2)
        .shuffle(6)
        .shard()
        .map(x_only)
        .filter(not_3_mod_4)
        .batch(2)
    )


def loader_reference() -> Node[Any]:
    return rs.from_list(list(range(SIZE))).map(tokens).shuffle(6).shard().map(x_only).filter(not_3_mod_4).batch(2)


@pytest.mark.parametrize("config", list(LOADER_CONFIGS))
def test_a_cache_under_a_loader_resumes_exactly_across_epochs(config: str, tmp_path: Path) -> None:
    """A disk cache that the workers fill together (cold, then warm) and a memory cache of one
    record in each worker: three epochs equal the uncached loader's, and a cut in the second
    epoch, restored twice, continues them."""
    options = LOADER_CONFIGS[config]
    with rst.Loader(loader_reference, **options) as reference:
        expected = [loader_epoch(reference) for _ in range(3)]
    assert all(expected) and expected[0] != expected[1]
    directory = str(tmp_path / "c")
    builds = {
        "disk": functools.partial(loader_pipeline, directory, 1 << 30),
        "memory-one-record": functools.partial(loader_pipeline, None, ONE),
    }
    for name, build in builds.items():
        with rst.Loader(build, **options) as loader:
            assert [loader_epoch(loader) for _ in range(3)] == expected, name
        with rst.Loader(build, **options) as loader:
            loader_epoch(loader)
            iterator = iter(loader)
            head = [plain(next(iterator)) for _ in range(2)]
            state = json.loads(json.dumps(loader.state_dict()))
            del iterator
        with rst.Loader(build, **options) as resumed:
            resumed.load_state_dict(state)
            nxt = iter(resumed)
            one = plain(next(nxt))
            again = json.loads(json.dumps(resumed.state_dict()))
            del nxt
        with rst.Loader(build, **options) as second:
            second.load_state_dict(again)
            assert [*head, one, *loader_epoch(second)] == expected[1], name
            assert loader_epoch(second) == expected[2], name
    warm = cache(rs.from_list(list(range(SIZE))).map(tokens), directory, block_size=2)
    assert records(warm) == [plain(tokens(x)) for x in range(SIZE)]
    assert warm.computed == 0  # the workers wrote every block
    assert not [p for p in Path(warm.path).iterdir() if p.name.startswith(".")]  # type: ignore[arg-type]


def test_lru_keeps_a_record_of_exactly_max_bytes_and_not_one_byte_more() -> None:
    record = tokens(3)
    for budget, kept in ((ONE - 1, 0), (ONE, 1), (2 * ONE - 1, 1), (2 * ONE, 2)):
        lru = LRU(budget)
        for position in range(3):
            lru.put(position, tokens(position))
        assert len(lru) == kept and lru.bytes == kept * ONE <= budget
    lru = LRU(ONE)
    lru.put(3, record)
    record["input_ids"][0] = -1  # the caller edits what it gave
    assert plain(lru.get(3)) == plain(tokens(3))
