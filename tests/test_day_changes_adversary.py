"""Adversary of the day's changes (0afe805..): the process-wide budget of open files and the
maps without descriptors, globs, safe checkpoint reading, ``.even()`` restores and errors, and
the whole-epoch readers' and columnar sources' new errors, attacked the way a training job
stresses them: many shards read at once in threads, workers and forks, tiny budgets and
descriptor limits, names that are not UTF-8, files cut or swapped while mapped, restores at
every step.

The seven bugs it found are mended and their tests pass: parquet over names that are not UTF-8,
maps of such names holding descriptors, a gzip file beside an earlier version's sidecar, one
unconvertible value blocking its chunk for ever, ``.even()`` counting a retried read error, a
map's StopIteration at a run's edge dropped silently, threads opening files past the budget.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import gc
import gzip
import json
import multiprocessing
import os
import pickle
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import resumable as rs
import resumable.torch as rst
from resumable.cli import main as cli_main
from resumable.ops.cache import Cache
from resumable.sources import line_index, open_files
from resumable.sources.open_files import OpenFiles
from tests.processes import free_port
from tests.resume import roundtrip, take
from tests.watching import descriptor_limit, open_descriptors

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------
# helpers


@pytest.fixture
def tiny_budget(monkeypatch: pytest.MonkeyPatch) -> int:
    """A budget of 3 open files for the whole process (forked workers inherit it)."""
    monkeypatch.setattr(open_files, "budget", lambda: 3)
    return 3


def odd_name(directory: Path, name: str) -> str:
    """A path in ``directory`` whose file name is not UTF-8 (legal on Linux), as Python sees it."""
    return os.fsdecode(os.fsencode(str(directory)) + b"/caf\xe9" + name.encode())


def write_jsonl(path: str, ids: list[Any]) -> str:
    with open(path, "w") as out:
        out.writelines(json.dumps({"id": i}) + "\n" for i in ids)
    return path


def write_arrow(path: str, table: pa.Table, chunk: int = 4) -> str:
    staged = os.path.join(os.path.dirname(path), "staged.arrow")  # pyarrow takes UTF-8 names only
    with pa.OSFile(staged, "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=chunk):
            writer.write_batch(batch)
    os.replace(staged, path)
    return path


def write_parquet(path: str, table: pa.Table, group: int = 4) -> str:
    staged = os.path.join(os.path.dirname(path), "staged.parquet")
    pq.write_table(table, staged, row_group_size=group)
    os.replace(staged, path)
    return path


def ids(records: list[Any]) -> list[Any]:
    return [record["id"] for record in records]


def outcomes(pipe: Any, count: int, errors: tuple[type[BaseException], ...] = (Exception,)) -> list[Any]:
    """What ``count`` calls of ``next()`` give, starting the next epoch after each end as a
    training loop does: items (their ``id`` for dicts), ``END``, and errors by type name, with
    the record's last key part for a ``MapError``; stops after 3 ends in a row."""
    found: list[Any] = []
    ends = 0
    iterator = iter(pipe)
    while len(found) < count and ends < 3:
        try:
            item = next(iterator)
            found.append(item["id"] if isinstance(item, dict) else item)
            ends = 0
        except StopIteration:
            found.append("END")
            ends += 1
            iterator = iter(pipe)
        except rs.MapError as error:
            found.append(("MapError", None if error.key is None else error.key[-1]))
        except errors as error:
            found.append((type(error).__name__,))
    return found


# ---------------------------------------------------------------------------------------------
# OpenFiles: the process's budget under threads, workers, copies and forks


def many_shards(root: Path, files: int = 12) -> dict[str, str]:
    """Three JSONL corpora and one Parquet corpus of ``files`` shards of 3 records each."""
    globs = {}
    for corpus in "abc":
        for file in range(files):
            write_jsonl(str(root / f"{corpus}{file:03d}.jsonl"), [f"{corpus}{file}-{i}" for i in range(3)])
        globs[corpus] = str(root / f"{corpus}*.jsonl")
    for file in range(files):
        table = pa.table({"id": [f"p{file}-{i}" for i in range(3)]})
        pq.write_table(table, str(root / f"p{file:03d}.parquet"), row_group_size=1)
    globs["p"] = str(root / "p*.parquet")
    return globs


def record_id(record: dict[str, Any]) -> Any:
    return record["id"]


def mixed_threads(globs: dict[str, str]) -> rs.Node[Any]:
    """Every corpus read in its own prefetch thread (two through a thread-pool map) at once."""
    components: dict[str, rs.Node[Any]] = {}
    for index, (name, pattern) in enumerate(sorted(globs.items())):
        source = rs.parquet(pattern) if name == "p" else rs.jsonl(pattern)
        shuffled = source.shuffle(seed=index)
        mapped = shuffled.map(record_id, num_workers=2) if index % 2 else shuffled.map(record_id)
        components[name] = mapped.prefetch(2)
    return rs.mix(components, seed=1, on_end="drop").batch(4).prefetch(2)


def test_threads_opening_at_once_stay_within_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(open_files, "budget", lambda: 2)
    threads = 3
    barrier = threading.Barrier(threads)

    def slow_opener(file: int) -> list[int]:
        barrier.wait(10)  # every thread is between its letting go and its adding
        return [file]

    owners: list[OpenFiles[list[int]]] = [OpenFiles(1) for _ in range(threads)]
    workers = [threading.Thread(target=owner.get, args=(0, slow_opener)) for owner in owners]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(20)
    try:
        assert open_files.open_count() <= 2
    finally:
        for owner in owners:
            owner.close()


def test_corpora_read_at_once_in_threads_under_a_tiny_budget_are_exact_and_resume(
    tmp_path: Path, tiny_budget: int
) -> None:
    globs = many_shards(tmp_path)
    before = open_descriptors()
    monkeypatched = open_files.budget
    with pytest.MonkeyPatch.context() as unlimited:
        unlimited.setattr(open_files, "budget", lambda: 10_000)
        whole = mixed_threads(globs)
        expected = list(whole)
        whole.close()
        del whole
    assert open_files.budget is monkeypatched
    assert sorted(x for batch in expected for x in batch) == sorted(
        f"{c}{f}-{i}" for c in "abcp" for f in range(12) for i in range(3)
    )
    for k in (0, 5, len(expected) - 1, len(expected)):
        pipe = mixed_threads(globs)
        head = take(pipe, k)
        assert open_files.open_count() <= tiny_budget + 4  # at most one more per reading thread
        state = roundtrip(pipe.get_state())
        pipe.close()
        resumed = mixed_threads(globs)
        resumed.set_state(state)
        assert head + list(resumed) == expected, k
        resumed.close()
    del pipe, resumed
    gc.collect()
    assert open_descriptors() <= before + 2  # every map and Parquet file let go with its source


def build_worker_pipe(pattern: str) -> rs.Node[Any]:
    return rs.jsonl(pattern).shuffle(seed=2).shard().map(record_id).batch(2)


@pytest.mark.parametrize(("workers", "persistent"), [(0, False), (2, False), (2, True)])
def test_loader_workers_under_a_tiny_budget_resume_exactly_twice(
    tmp_path: Path, tiny_budget: int, workers: int, persistent: bool
) -> None:
    pattern = many_shards(tmp_path, files=8)["a"]
    build = lambda: build_worker_pipe(pattern)  # noqa: E731 - forked workers take a closure
    options = {"num_workers": workers, "persistent_workers": persistent, "collate_fn": list}
    with rst.Loader(build, **options) as whole:
        expected = [list(batch) for batch in whole]
    assert sorted(x for batch in expected for x in batch) == sorted(f"a{f}-{i}" for f in range(8) for i in range(3))
    loader = rst.Loader(build, **options)
    iterator = iter(loader)
    head = [list(next(iterator)) for _ in range(3)]
    state = roundtrip(loader.state_dict())
    loader.close()
    second = rst.Loader(build, **options)
    second.load_state_dict(state)
    iterator = iter(second)
    middle = [list(next(iterator)) for _ in range(2)]
    again = roundtrip(second.state_dict())
    second.close()
    third = rst.Loader(build, **options)
    third.load_state_dict(again)
    assert head + middle + [list(batch) for batch in third] == expected
    third.close()


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_copies_pickles_and_a_fork_with_the_lock_held_read_on_exactly(
    tmp_path: Path, tiny_budget: int, kind: str
) -> None:
    pattern = many_shards(tmp_path, files=8)["a" if kind == "jsonl" else "p"]
    read = rs.jsonl if kind == "jsonl" else rs.parquet

    def build() -> rs.Node[Any]:
        return read(pattern).shuffle(seed=4).repeat(2)

    expected = ids(list(build()))
    pipe = build()
    head = ids(take(pipe, 7))
    clones = {"deepcopy": copy.deepcopy(pipe), "pickle": pickle.loads(pickle.dumps(pipe))}
    readers = {"original": pipe, **clones}
    got: dict[str, list[Any]] = {name: [] for name in readers}
    alive = set(readers)
    while alive:  # interleaved, each opening and letting go of the others' handles
        for name in sorted(alive):
            record = next(readers[name], None)
            if record is None:
                alive.discard(name)
            else:
                got[name].append(record["id"])
    assert {name: head + rest == expected for name, rest in got.items()} == dict.fromkeys(readers, True)
    assert open_files.open_count() <= tiny_budget

    # a fork while another thread of the parent holds the module's lock: the child reads on
    child_pipe = build()
    child_head = ids(take(child_pipe, 3))
    holding, release = threading.Event(), threading.Event()

    def hold_the_lock() -> None:
        with open_files._LOCK:
            holding.set()
            release.wait(20)

    holder = threading.Thread(target=hold_the_lock)
    holder.start()
    holding.wait(5)
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    child = context.Process(target=lambda: results.put(ids(list(child_pipe))))
    try:
        child.start()
        rest = results.get(timeout=20)
    finally:
        release.set()
        holder.join(5)
        child.join(5)
    assert child_head + rest == expected


def test_a_source_collected_while_another_reads_lets_go_of_its_handles(tmp_path: Path, tiny_budget: int) -> None:
    globs = many_shards(tmp_path, files=6)
    first = rs.jsonl(globs["a"]).shuffle(seed=1)
    second = rs.parquet(globs["p"]).shuffle(seed=1)
    take(first, 5)
    partial = take(second, 4)
    del first
    assert open_files.open_count() <= tiny_budget
    rest = list(second)
    assert sorted(ids(partial + rest)) == sorted(f"p{f}-{i}" for f in range(6) for i in range(3))
    del second
    gc.collect()
    assert all(owner() is not None for owner in open_files._OPEN.values())  # no dead source's entry counts


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_out_of_descriptors_lets_go_and_retries_for_real(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """The budget thinks many files may stay open, but the process's limit says otherwise: each
    EMFILE lets go of every handle and opens again; the epoch is whole."""
    files = 40
    for file in range(files):
        if kind == "jsonl":
            write_jsonl(str(tmp_path / f"{file:03d}.jsonl"), [file])
        else:
            pq.write_table(pa.table({"id": [file]}), str(tmp_path / f"{file:03d}.parquet"))
    read = rs.jsonl if kind == "jsonl" else rs.parquet
    source = pickle.loads(pickle.dumps(read(str(tmp_path / f"*.{kind}"))))  # indexed; nothing open
    monkeypatch.setattr(open_files, "budget", lambda: 10_000)
    with descriptor_limit(10):
        assert sorted(ids(list(source.shuffle(seed=3)))) == list(range(files))
        assert open_files.open_count() <= 10  # never more handles than descriptors free


# ---------------------------------------------------------------------------------------------
# file names that are not UTF-8


def test_parquet_reads_a_file_whose_name_is_not_utf8(tmp_path: Path) -> None:
    path = write_parquet(odd_name(tmp_path, ".parquet"), pa.table({"id": list(range(10))}), 3)
    assert ids(list(rs.parquet(path).shuffle(seed=1))) == ids(list(rs.parquet(path).shuffle(seed=1)))
    assert sorted(ids(list(rs.parquet(path)))) == list(range(10))


def test_names_not_utf8_through_state_json_checkpoint_and_loader_workers(tmp_path: Path) -> None:
    jsonl = write_jsonl(odd_name(tmp_path, ".jsonl"), list(range(9)))
    arrow = write_arrow(odd_name(tmp_path, ".arrow"), pa.table({"id": list(range(9, 15))}), 2)
    cache_dir = odd_name(tmp_path, "cache")

    def build() -> rs.Node[Any]:
        return rs.jsonl(jsonl).map(record_id).cache(cache_dir).shuffle(seed=3).shard()

    expected = list(build())
    assert sorted(expected) == list(range(9))
    pipe = build()
    head = take(pipe, 4)
    state = pipe.get_state()
    rst.save({"data": state}, str(tmp_path / "ck.pt"))
    loaded = rst.load(str(tmp_path / "ck.pt"))["data"]
    assert loaded == roundtrip(state)
    resumed = build()
    resumed.set_state(loaded)
    assert head + list(resumed) == expected
    assert sorted(ids(list(rs.arrow(arrow).shuffle(seed=1)))) == list(range(9, 15))
    with rst.Loader(lambda: build().batch(2), num_workers=2, collate_fn=list) as loader:
        iterator = iter(loader)
        first = [list(next(iterator)) for _ in range(2)]
        loader_state = roundtrip(loader.state_dict())
    with rst.Loader(lambda: build().batch(2), num_workers=2, collate_fn=list) as again:
        again.load_state_dict(loader_state)
        rest = [list(batch) for batch in again]
    assert sorted(x for batch in first + rest for x in batch) == list(range(9))


NOT_UTF8_KINDS = ["jsonl", "arrow", "cache"]


@pytest.mark.parametrize("kind", NOT_UTF8_KINDS)
def test_names_not_utf8_hold_no_descriptor_per_map(tmp_path: Path, kind: str) -> None:
    files = 40
    if kind == "cache":
        cache_dir = odd_name(tmp_path, "cache")

        def build() -> Cache[Any]:
            return Cache(rs.from_list(list(range(2 * files))), cache_dir, block_size=2)

        assert list(build()) == list(range(2 * files))
        with descriptor_limit(files // 2):
            cached = build()
            assert sorted(cached.shuffle(seed=2)) == list(range(2 * files))
            assert cached.computed == 0  # every block read from its file (as with a UTF-8 directory)
        return
    paths = []
    for file in range(files):
        path = odd_name(tmp_path, f"{file:03d}.{kind}")
        if kind == "jsonl":
            write_jsonl(path, [file])
        else:
            write_arrow(path, pa.table({"id": [file]}))
        paths.append(path)
    read = rs.jsonl if kind == "jsonl" else rs.arrow
    read(paths)  # sidecars written beside the data
    with descriptor_limit(files // 2):
        source = read(paths)
        assert sorted(ids(list(source.shuffle(seed=1)))) == list(range(files))


def test_names_not_utf8_cut_in_place_while_mapped_never_crash(tmp_path: Path) -> None:
    """In a child (a SIGBUS would kill it): a sidecar cut in place is rebuilt, an Arrow file cut in
    place is a SourceError naming it, a cache block cut in place is computed again."""
    script = textwrap.dedent(
        """
        import glob, json, os, sys, warnings
        import pyarrow as pa
        import resumable as rs
        from resumable.ops.cache import Cache
        from resumable.sources.line_index import SIDECAR_SUFFIX
        base = os.fsencode(sys.argv[1])
        odd = lambda name: os.fsdecode(base + b"/caf\\xe9" + name.encode())
        def cut(path, size):
            with open(path, "r+b") as handle:
                handle.truncate(size)
        out = {}
        path = odd(".jsonl")
        with open(path, "w") as handle:
            handle.writelines(json.dumps({"i": i}) + "\\n" for i in range(5000))
        rs.jsonl(path)
        source = rs.jsonl(path)
        source[0]
        cut(path + SIDECAR_SUFFIX, 100)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out["sidecar"] = source[4000]["i"]
        out["warned"] = len(caught)
        arrow = odd(".arrow")
        table = pa.table({"i": list(range(4000)), "text": ["x" * 50] * 4000})
        staged = os.path.join(sys.argv[1], "staged.arrow")
        with pa.OSFile(staged, "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            for batch in table.to_batches(max_chunksize=500):
                writer.write_batch(batch)
        os.replace(staged, arrow)
        source = rs.arrow(arrow)
        source[0]
        cut(arrow, 1000)
        try:
            source[3900]
        except rs.SourceError as error:
            out["arrow"] = "changed during the run" in str(error) and "caf" in str(error)
        directory = odd("cache")
        build = lambda: Cache(rs.from_list(list(range(300))), directory, block_size=100)
        list(build())
        cache = build()
        iterator = iter(cache)
        next(iterator)
        for block in glob.glob(os.path.join(glob.escape(cache.path), "*.arrow")):
            cut(block, 100)
        out["cache"] = [record for record in iterator] == list(range(1, 300))
        print(json.dumps(out))
        """
    )
    child = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert child.returncode == 0, child.stderr[-2000:]
    out = json.loads(child.stdout.strip().splitlines()[-1])
    assert out == {"sidecar": 4000, "warned": 1, "arrow": True, "cache": True}


# ---------------------------------------------------------------------------------------------
# globs, compressed files, files added or missing at restore


def test_glob_characters_dangling_links_and_dataset_summaries(tmp_path: Path) -> None:
    # a name that reads as a glob is that file, locally and through a filesystem object
    for index in range(3):
        write_parquet(str(tmp_path / f"shard[{index}].parquet"), pa.table({"id": [index]}), 1)
    pq.write_metadata(pa.schema([("id", pa.int64())]), str(tmp_path / "_common_metadata"))
    pq.write_metadata(
        pq.read_table(str(tmp_path / "shard[0].parquet")).schema, str(tmp_path / "_metadata")
    )  # a summary without row groups of its own
    local = pafs.LocalFileSystem()
    for options in ({}, {"filesystem": local}):
        assert ids(list(rs.parquet(str(tmp_path / "shard[1].parquet"), **options))) == [1]
        assert ids(list(rs.parquet(str(tmp_path / "*"), **options))) == [0, 1, 2]  # summaries left out
    # a dangling link deep in a recursive glob names itself; an explicit one is a missing file
    deep = tmp_path / "corpus" / "part" / "sub"
    deep.mkdir(parents=True)
    write_jsonl(str(tmp_path / "corpus" / "a.jsonl"), [0, 1])
    write_jsonl(str(deep / "b.jsonl"), [2])
    (deep / "c.jsonl").symlink_to(tmp_path / "unmounted" / "c.jsonl")
    with pytest.raises(rs.SourceError, match=r"c\.jsonl.*symbolic link to a missing file"):
        rs.jsonl(str(tmp_path / "corpus" / "**" / "*.jsonl"))
    with pytest.raises(rs.SourceError, match=r"c\.jsonl"):
        rs.jsonl(str(deep / "c.jsonl"))
    (deep / "c.jsonl").unlink()
    assert ids(list(rs.jsonl(str(tmp_path / "corpus" / "**" / "*.jsonl")))) == [0, 1, 2]


def test_a_gzip_file_with_a_sidecar_from_before_is_still_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain = write_jsonl(str(tmp_path / "a.jsonl"), [0])
    packed = tmp_path / "b.jsonl"
    with gzip.open(packed, "wt") as out:
        out.writelines(json.dumps({"id": i}) + "\n" for i in range(50))
    with monkeypatch.context() as before:  # as the previous version indexed it
        before.setattr(line_index, "_refuse_compressed", lambda path, head: None)
        rs.jsonl([plain, str(packed)], on_error="skip")
    assert os.path.exists(str(packed) + line_index.SIDECAR_SUFFIX)
    for on_error in ("skip", "raise"):
        with pytest.raises(rs.SourceError, match=r"b\.jsonl.*gzip"):
            rs.jsonl([plain, str(packed)], on_error=on_error)


def test_a_glob_that_finds_more_or_fewer_files_names_them_and_changes_nothing(tmp_path: Path) -> None:
    for file in range(4):
        write_jsonl(str(tmp_path / f"s{file:02d}.jsonl"), [file * 2, file * 2 + 1])
    pattern = str(tmp_path / "*.jsonl")

    def build() -> rs.Node[Any]:
        return rs.jsonl(pattern).shuffle(seed=1)

    pipe = build()
    take(pipe, 3)
    state = roundtrip(pipe.get_state())
    for file in range(4, 12):
        write_jsonl(str(tmp_path / f"s{file:02d}.jsonl"), [100 + file])
    bigger = build()
    head = take(bigger, 2)
    before = roundtrip(bigger.get_state())
    with pytest.raises(rs.StateError, match=r"new here: 's04\.jsonl'.*'s08\.jsonl' and 3 more") as raised:
        bigger.set_state(state)
    assert "missing here" not in str(raised.value)
    assert roundtrip(bigger.get_state()) == before
    fresh = build()
    fresh.set_state(before)
    assert head + list(bigger) == head + list(fresh)
    for file in range(1, 12):
        os.remove(tmp_path / f"s{file:02d}.jsonl")
    with pytest.raises(rs.StateError, match=r"missing here: 's01\.jsonl', 's02\.jsonl', 's03\.jsonl'\)"):
        build().set_state(state)


# ---------------------------------------------------------------------------------------------
# torch: checkpoints read safely, MapError keys from workers


class Settings:
    """An object a trainer might save beside the data state (not plain data)."""

    def __init__(self) -> None:
        self.lr = 0.1


def test_load_all_ranks_and_inspect_beside_other_entries_and_damaged_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pipe = rs.from_list(list(range(10))).shuffle(seed=0)
    take(pipe, 3)
    expected = roundtrip(pipe.get_state())
    for name, extra in [
        ("plain", {"step": 5, "lr": 0.1}),
        ("datetime", {"when": datetime.datetime(2020, 1, 1)}),
        ("object", {"settings": Settings()}),
    ]:
        checkpoint = str(tmp_path / name)
        dcp.save({"data": rst.PerRank(pipe), "extra": extra}, checkpoint_id=checkpoint)
        assert rst.load_all_ranks(checkpoint) == [expected]  # the other entries are not read
        assert cli_main(["inspect", checkpoint]) == 0  # the other entries read as stand-ins, not run
        assert "Shuffle" in capsys.readouterr().out
    checkpoint = tmp_path / "plain"
    data_files = sorted(checkpoint.glob("*.distcp"))
    assert data_files
    original = data_files[0].read_bytes()
    for cut in range(0, len(original), max(1, len(original) // 7)):
        data_files[0].write_bytes(original[:cut])
        try:  # the entries read whole (the cut spares the data entry) or a StateError naming the checkpoint
            assert rst.load_all_ranks(checkpoint) == [expected], cut
        except rs.StateError as error:
            assert "plain" in str(error)
    for damaged in (b"", original[:10], b"\x80\x04garbage" * 10, bytes(len(original))):
        data_files[0].write_bytes(damaged)
        with pytest.raises(rs.StateError, match="plain"):
            rst.load_all_ranks(checkpoint)
        assert cli_main(["inspect", str(checkpoint)]) != 0
        assert "Traceback" not in capsys.readouterr().err
    data_files[0].unlink()
    with pytest.raises(rs.StateError, match="plain"):
        rst.load_all_ranks(checkpoint)


def fail_on_six(x: int) -> int:
    if x == 6:
        raise ValueError("six")
    return x


def build_failing_loader_pipe() -> rs.Node[Any]:
    return rs.from_list(list(range(12))).shard().map(fail_on_six, num_workers=2).batch(1)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_worker_s_map_error_keeps_its_key_and_a_state_after_it_resumes(workers: int) -> None:
    def first(batch: Any) -> int:
        return int(batch[0])

    def run(loader: Any, count: int) -> list[Any]:
        found: list[Any] = []
        iterator = iter(loader)
        while len(found) < count:
            try:
                found.append(first(next(iterator)))
            except StopIteration:
                found.append("END")
                break
            except rs.MapError as error:
                assert error.key is not None
                found.append(("MapError", error.key[-1], type(error.key[0]).__name__))
        return found

    with rst.Loader(build_failing_loader_pipe, num_workers=workers) as loader:
        expected = run(loader, 50)
    assert sum(isinstance(found, tuple) for found in expected) == 1 and expected[-1] == "END"
    for k in (5, 6, 7):
        with rst.Loader(build_failing_loader_pipe, num_workers=workers) as loader:
            head = run(loader, k)
            state = roundtrip(loader.state_dict())
        with rst.Loader(build_failing_loader_pipe, num_workers=workers) as resumed:
            resumed.load_state_dict(state)
            assert head + run(resumed, 50) == expected, k


def stop_on(bad: int) -> Callable[[int], int]:
    def fn(x: int) -> int:
        if x == bad:
            raise StopIteration(f"record {bad}")
        return x

    return fn


@pytest.mark.parametrize("where", ["first", "last", "after_restore"])
def test_stop_iteration_of_a_map_on_the_edge_of_a_run_is_a_map_error(where: str) -> None:
    bad = {"first": 0, "last": 8, "after_restore": 5}[where]

    def build() -> rs.Node[Any]:
        return rs.from_list(list(range(9))).map(stop_on(bad))

    pipe = build()
    if where == "after_restore":
        take(pipe, 5)
        resumed = build()
        resumed.set_state(roundtrip(pipe.get_state()))
        pipe = resumed
    found = outcomes(pipe, 20)
    assert ("MapError", bad) in found[: found.index("END")], found


# ---------------------------------------------------------------------------------------------
# .even(): restores around the agreement, errors counted against the quota


BAD_IDS = frozenset({3, 11})


def fail_on_bad(x: int) -> int:
    if x in BAD_IDS:
        raise KeyError(x)
    return x


def build_even(times: int | None = 3) -> rs.Node[Any]:
    return rs.from_list(list(range(7))).shuffle(seed=1).map(fail_on_bad).even(times=times)


def test_even_restored_at_every_call_and_twice_in_a_row_with_errors() -> None:
    expected = outcomes(build_even(), 60)
    assert expected.count(("KeyError",)) == 3 and expected[-3:] == ["END"] * 3
    for k in range(len(expected) - 1):
        pipe = build_even()
        head = outcomes(pipe, k) if k else []
        state = roundtrip(pipe.get_state())
        once = build_even()
        once.set_state(state)
        again = build_even()
        again.set_state(roundtrip(once.get_state()))  # a state taken twice in a row, nothing read between
        rest = outcomes(again, 60)
        assert head + rest[: len(expected) - k] == expected, k


def build_even_in_workers() -> rs.Node[Any]:
    return rs.from_list(list(range(9))).shuffle(seed=3).shard().map(fail_on_bad).batch(1).even(times=2)


@contextlib.contextmanager
def group_of_one(timeout_s: float = 10) -> Iterator[None]:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1, timeout=timedelta(seconds=timeout_s)
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def loader_outcomes(loader: Any, count: int) -> list[Any]:
    found: list[Any] = []
    ends = 0
    iterator = iter(loader)
    while len(found) < count and ends < 2:
        try:
            found.append(int(next(iterator)[0]))
            ends = 0
        except StopIteration:
            found.append("END")
            ends += 1
            iterator = iter(loader)
        except KeyError:
            found.append("KeyError")
    return found


def test_even_in_persistent_loader_workers_restored_around_the_agreement() -> None:
    with group_of_one(timeout_s=5):
        with rst.Loader(build_even_in_workers, num_workers=2, persistent_workers=True) as loader:
            expected = loader_outcomes(loader, 60)
        first_end = expected.index("END")
        assert "KeyError" in expected
        for k in (0, 1, first_end - 1, first_end, first_end + 1, len(expected) - 2):
            with rst.Loader(build_even_in_workers, num_workers=2, persistent_workers=True) as loader:
                head = loader_outcomes(loader, k) if k else []
                state = roundtrip(loader.state_dict())
            with rst.Loader(build_even_in_workers, num_workers=2, persistent_workers=True) as resumed:
                resumed.load_state_dict(state)
                assert head + loader_outcomes(resumed, len(expected) - k) == expected, k


def test_even_loses_no_record_to_an_error_the_next_call_retries(tmp_path: Path) -> None:
    path = write_jsonl(str(tmp_path / "a.jsonl"), list(range(6)))

    def epochs(pipe: rs.Node[Any]) -> list[list[Any]]:
        seen: list[list[Any]] = []
        for epoch in range(2):
            iterator, found = iter(pipe), []
            if epoch == 0:
                os.rename(path, path + ".away")  # the volume hiccups
            while True:
                try:
                    found.append(next(iterator)["id"])
                except StopIteration:
                    break
                except rs.SourceError:
                    found.append("error")
                    if os.path.exists(path + ".away"):
                        os.rename(path + ".away", path)
            seen.append(found)
        return seen

    every = [["error", 0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5]]
    assert epochs(rs.jsonl(path)) == every
    assert epochs(rs.jsonl(path).even(times=2)) == every


# ---------------------------------------------------------------------------------------------
# whole-epoch readers, empty column selections, values out of Python's range, from_hf


def test_whole_epoch_readers_name_the_leaf_of_a_failing_record_and_store_nothing(tmp_path: Path) -> None:
    for file in range(3):
        write_jsonl(str(tmp_path / f"{file}.jsonl"), [{"t": [1] * (file + 1)} for _ in range(5)])
    pattern = str(tmp_path / "*.jsonl")
    mended = {"yes": False}

    def tokens(record: dict[str, Any]) -> dict[str, Any]:
        if record["id"] == {"t": [1, 1]} and not mended["yes"]:  # the leaves of file 1: 5..9
            raise KeyError("bad")
        return {"input_ids": record["id"]["t"]}

    planned = rs.jsonl(pattern).shuffle(seed=2).shard(1, 2).map(tokens).pack(4, strategy="bfd")
    for _ in range(2):
        with pytest.raises(rs.SourceError, match=r"Pack\(strategy='bfd'\).*position [5-9] of the source") as raised:
            next(planned)
        assert isinstance(raised.value.__cause__, KeyError)
    cache = tmp_path / "kept"
    for num_proc in (0, 2):
        indexed = (
            rs.jsonl(pattern)
            .map(tokens)
            .filter(
                lambda r: len(r["input_ids"]) > 1, index=True, cache_dir=str(cache), num_proc=num_proc, progress=False
            )
        )
        with pytest.raises(rs.SourceError, match=r"IndexedFilter.*position 5 of the source"):
            len(indexed)
        assert not list(cache.glob("*.npy"))  # nothing stored: the next use tries again
    mended["yes"] = True
    indexed = (
        rs.jsonl(pattern)
        .map(tokens)
        .filter(lambda r: len(r["input_ids"]) > 1, index=True, cache_dir=str(cache), progress=False)
    )
    assert len(indexed) == 10
    assert sum(len(row["input_ids"]) for row in planned) > 0


def test_parquet_without_columns_over_files_with_no_rows_resumes_anywhere(tmp_path: Path) -> None:
    for file, rows in enumerate([5, 0, 3, 7]):
        write_parquet(str(tmp_path / f"{file}.parquet"), pa.table({"id": pa.array(range(rows), pa.int64())}), 2)
    pattern = str(tmp_path / "*.parquet")

    def build() -> rs.Node[Any]:
        return rs.parquet(pattern, columns=[]).shuffle(seed=1).shard(0, 2).repeat(2)

    expected = list(build())
    assert expected == [{}] * 16 and len(rs.parquet(pattern, columns=[])) == 15
    for k in (0, 1, 7, 8, 9, 15, 16):
        pipe = build()
        head = take(pipe, k)
        resumed = build()
        resumed.set_state(roundtrip(pipe.get_state()))
        assert len(head) + len(list(resumed)) == 16, k
    blocks = rs.parquet(pattern, columns=[]).shuffle(seed=2, block_size="row_group")
    assert list(blocks) == [{}] * 15


FAR_VALUES = {
    "timestamp": pa.array([0, 1, 10**12], pa.timestamp("s")),
    "date": pa.array([0, 1, 3_000_000], pa.date32()),
    "duration": pa.array([0, 1, 10**18], pa.duration("s")),
    "nested": pa.array([[0], [1], [10**12]], pa.list_(pa.timestamp("s"))),
    "zone": pa.array([0, 1, 2], pa.timestamp("s", tz="Not/AZone")),
}


@pytest.mark.parametrize("kind", ["parquet", "arrow"])
def test_values_python_cannot_hold_are_source_errors_naming_the_file_however_read(tmp_path: Path, kind: str) -> None:
    for name, column in FAR_VALUES.items():
        table = pa.table({"id": [0, 1, 2], "v": column})
        path = str(tmp_path / f"{name}.{kind}")
        if kind == "parquet":
            write_parquet(path, table, 2)
        else:
            write_arrow(path, table, 2)
        read = rs.parquet if kind == "parquet" else rs.arrow
        for access in (list, lambda source: source[2], lambda source: list(source.shuffle(seed=0))):
            with pytest.raises(rs.SourceError, match=rf"(row group|record batch) \d+ of .*{name}\.{kind}'"):
                access(read(path))


@pytest.mark.parametrize("kind", ["parquet", "arrow"])
def test_a_value_python_cannot_hold_is_an_error_at_its_record_and_iteration_goes_on(tmp_path: Path, kind: str) -> None:
    table = pa.table({"id": list(range(12)), "when": pa.array([0] * 7 + [10**12] + [0] * 4, pa.timestamp("s"))})
    path = str(tmp_path / f"far.{kind}")
    if kind == "parquet":
        write_parquet(path, table, 6)
    else:
        write_arrow(path, table, 6)
    read = rs.parquet if kind == "parquet" else rs.arrow
    for pipe in (read(path), read(path).shuffle(seed=0)):
        found = outcomes(pipe, 30, errors=(rs.SourceError,))
        assert "END" in found, found
        got = [x for x in found[: found.index("END")] if isinstance(x, int)]
        assert sorted(got) == [i for i in range(12) if i != 7]


def test_from_hf_refuses_a_transform_and_takes_the_dataset_without_it() -> None:
    datasets = pytest.importorskip("datasets")
    dataset = datasets.Dataset.from_dict({"id": list(range(6))})
    for transformed in (dataset.with_transform(lambda batch: {"id": [x * 10 for x in batch["id"]]}),):
        with pytest.raises(rs.ConfigError, match="transform"):
            rs.from_hf(transformed)
    dataset.set_transform(lambda batch: batch)
    with pytest.raises(rs.ConfigError, match=r"\.map\(\)"):
        rs.from_hf(dataset)
    plain = dataset.with_format(None)
    source = rs.from_hf(plain).shuffle(seed=1)
    head = take(source, 2)
    resumed = rs.from_hf(plain).shuffle(seed=1)
    resumed.set_state(roundtrip(source.get_state()))
    assert sorted(ids(head + list(resumed))) == list(range(6))
