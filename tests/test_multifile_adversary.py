"""Adversary: indexed sources over many files (``rs.jsonl([...])``, ``rs.jsonl("glob*")``,
``rs.parquet([...])``, ``rs.arrow([...])``) and the line-offset index kept beside them or in
``cache_dir``.

What a training job does to a corpus of shards: globs whose order depends on names (``1`` ..
``10``), the same file twice or through a symlink, empty, blank-only and unterminated files in
every position, hundreds of one-record files, relative paths restored from another working
directory or a staging copy, a glob that matches more or fewer files at restore time, a file
renamed or appended to, sidecars deleted, stale, foreign or unwritable, several processes
building one cache dir at once, and ``rs.torch.Loader`` with 0 and 2 workers. Everywhere: the
central property (take k, ``get_state``, JSON round trip, restore into a fresh pipeline, continue
== the uninterrupted run) at every record, across file boundaries and epochs and twice in a
row; keys that name the global index across files; only typed errors, naming the file (and the
line), and a refused state changes nothing.

Bugs it found, mended (each test below its heading "found and mended"): a JSONL source held two
file descriptors per file and a Parquet source one for as long as it lived, so a corpus of a
few hundred (JSONL) or a thousand (Parquet) shards failed with ``Too many open files`` under the
usual 1024 limit; an existing file whose name holds ``[`` was taken for a glob and refused; a
glob silently left out a shard that is a dangling symlink; a ``.jsonl.gz`` given to ``rs.jsonl``
was indexed as if its compressed bytes were lines (with ``on_error="skip"`` the file silently
contributed nothing); a state refused because the glob now finds more or fewer files named
none of them; with nowhere to write indices, one SidecarWarning per file where the docs say one.
"""

from __future__ import annotations

import contextlib
import glob
import gzip
import json
import multiprocessing
import os
import shutil
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given
from hypothesis import strategies as st

import resumable as rs
import resumable.torch as rst
from resumable.sources._sidecar import SidecarWarning
from tests.resume import check_resume, loader_batches, loader_head, loader_rest, roundtrip, take
from tests.watching import descriptor_limit

BOM = b"\xef\xbb\xbf"
Build = Callable[[], rs.Node[Any]]


# -- helpers ------------------------------------------------------------------------------------


def write_jsonl(path: Path, values: list[Any], style: str = "plain") -> str:
    """``values`` as JSONL in one of the legal layouts a corpus holds."""
    lines = [json.dumps(value).encode() for value in values]
    if style == "crlf":
        data = b"".join(line + b"\r\n" for line in lines)
    elif style == "bom":
        data = BOM + b"".join(line + b"\n" for line in lines)
    elif style == "unterminated":  # no newline after the last record
        data = b"\n".join(lines)
    elif style == "blanks":  # blank and whitespace-only lines before, between and after records
        data = b"\n \t\n" + b"".join(line + b"\n\r\n   \n" for line in lines) + b"\t"
    else:
        data = b"".join(line + b"\n" for line in lines)
    path.write_bytes(data)
    return str(path)


def numbered_files(directory: Path, sizes: list[int], style: str = "plain", name: str = "part{}.jsonl") -> list[str]:
    """Files of ``{"g": global id}`` records: file ``j`` holds ``sizes[j]`` of them."""
    directory.mkdir(parents=True, exist_ok=True)
    paths, first = [], 0
    for j, size in enumerate(sizes):
        paths.append(write_jsonl(directory / name.format(j), [{"g": first + i} for i in range(size)], style))
        first += size
    return paths


def ids(records: list[Any]) -> list[int]:
    return [record["g"] for record in records]


def points(n: int) -> list[int]:
    """Resume points: start, second, middle, last record, the epoch's end and the step after."""
    return sorted({0, 1, n // 2, max(n - 1, 0), n, n + 1})


def file_boundaries(sizes: list[int]) -> list[int]:
    """Positions of the last record of each file and of the first record of the next."""
    ends, total = [], 0
    for size in sizes:
        total += size
        ends += [total - 1, total]
    return sorted({point for point in ends if point >= 0})


def check_points(build: Build, ks: list[int], total: int) -> None:
    for k in ks:
        check_resume(build, k, total)
    check_resume(build, ks[len(ks) // 2], total, k2=min(ks[len(ks) // 2] + 3, total))


def block_sidecars(paths: list[str]) -> None:
    """Make the sidecar beside each data file impossible to write (a directory in its place), as
    a read-only data directory would for a user that is not root: the index goes to cache_dir."""
    for path in paths:
        os.mkdir(path + ".rsidx")


def refused_changes_nothing(build: Build, bad_state: Any, k: int, total: int, error: type[Exception]) -> str:
    """Take ``k`` items, try ``set_state(bad_state)`` (must raise ``error``), then the pipeline must
    continue as if the call never happened. Returns the error's message."""
    expected = take(build(), total)
    pipe = build()
    head = take(pipe, k)
    with pytest.raises(error) as raised:
        pipe.set_state(bad_state)
    assert head + take(pipe, total - k) == expected
    return str(raised.value)


@contextlib.contextmanager
def cwd(path: Path) -> Iterator[None]:
    before = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


# -- order of files -------------------------------------------------------------------------------


def test_glob_order_is_by_name_and_explicit_lists_keep_theirs(tmp_path: Path) -> None:
    """Ten files named 1..10: a glob sorts them as strings (1, 10, 2, ..., 9), as documented; an
    explicit list keeps its numeric order; a list of globs keeps the order of its patterns. A
    state saved over the glob restores over an explicit list in the glob's order, and is refused
    over the numeric one, naming the two files that differ."""
    for number in range(1, 11):
        write_jsonl(tmp_path / f"{number}.jsonl", [{"g": number * 100 + i} for i in range(number % 3 + 1)])
    pattern = str(tmp_path / "*.jsonl")
    lexicographic = [1, 10, 2, 3, 4, 5, 6, 7, 8, 9]
    assert [r["g"] // 100 for r in rs.jsonl(pattern)] == [n for n in lexicographic for _ in range(n % 3 + 1)]
    numeric = [str(tmp_path / f"{n}.jsonl") for n in range(1, 11)]
    assert [r["g"] // 100 for r in rs.jsonl(numeric)] == [n for n in range(1, 11) for _ in range(n % 3 + 1)]
    two_globs = [str(tmp_path / "[5-9].jsonl"), str(tmp_path / "1*.jsonl")]
    assert [r["g"] // 100 for r in rs.jsonl(two_globs)] == [n for n in (5, 6, 7, 8, 9, 1, 10) for _ in range(n % 3 + 1)]

    sizes = [n % 3 + 1 for n in lexicographic]
    build = lambda: rs.jsonl(pattern)  # noqa: E731
    check_points(build, file_boundaries(sizes), 2 * sum(sizes) + 1)
    pipe = rs.jsonl(pattern).shuffle(3)
    head = take(pipe, 7)
    state = roundtrip(pipe.get_state())
    as_list = rs.jsonl([str(tmp_path / f"{n}.jsonl") for n in lexicographic]).shuffle(3)
    as_list.set_state(state)
    expected = take(rs.jsonl(pattern).shuffle(3), 30)
    assert head + take(as_list, 23) == expected
    message = refused_changes_nothing(lambda: rs.jsonl(numeric).shuffle(3), state, 5, 20, rs.StateError)
    assert "Shuffle > JsonlSource" in message and "10.jsonl" in message and "2.jsonl" in message


# -- resume at every point over odd layouts -------------------------------------------------------

STYLES = ("plain", "crlf", "bom", "unterminated", "blanks")


@st.composite
def layouts(draw: st.DrawFn) -> list[tuple[int, str]]:
    files = draw(st.lists(st.tuples(st.integers(0, 4), st.sampled_from(STYLES)), min_size=1, max_size=5))
    if all(size == 0 for size, _ in files):
        files[draw(st.integers(0, len(files) - 1))] = (draw(st.integers(1, 3)), files[0][1])
    return files


PIPELINES: dict[str, Callable[[list[str]], rs.Node[Any]]] = {
    "plain": lambda paths: rs.jsonl(paths),
    "shuffle": lambda paths: rs.jsonl(paths).shuffle(7),
    "shard": lambda paths: rs.jsonl(paths).shuffle(5).shard(1, 3).repeat(),
    "batch": lambda paths: rs.jsonl(paths).shuffle(2).shard(0, 2).map(lambda r: r["g"]).batch(2),
}


@given(layout=layouts(), pipeline=st.sampled_from(sorted(PIPELINES)))
def test_every_resume_point_over_empty_blank_and_unterminated_files(
    layout: list[tuple[int, str]], pipeline: str
) -> None:
    """Files of 0 to 4 records in every legal layout, in any order: iteration equals the files'
    records in order, and a resume at every position (every file boundary included, past the
    epoch's end, twice in a row) continues exactly."""
    with tempfile.TemporaryDirectory() as directory:
        paths, first = [], 0
        for j, (size, style) in enumerate(layout):
            paths.append(write_jsonl(Path(directory) / f"f{j}.jsonl", [{"g": first + i} for i in range(size)], style))
            first += size
        assert ids(list(rs.jsonl(paths))) == list(range(first))
        build = lambda: PIPELINES[pipeline](paths)  # noqa: E731
        total = 2 * first + 2
        for k in range(total + 1):
            check_resume(build, k, total)
        check_resume(build, first // 2, total, k2=first + 1)


def test_consumers_restored_at_file_boundaries_still_read_every_record_once(tmp_path: Path) -> None:
    """Three consumers of a shuffled, sharded glob with a recordless file in the middle; each
    consumer stops at another file boundary, is restored in a fresh pipeline, and finishes: the
    epoch holds every record exactly once."""
    sizes = [4, 0, 1, 6, 3]
    numbered_files(tmp_path, sizes, style="blanks")
    (tmp_path / "part5.jsonl").write_text("\n \n")  # blank-only, last
    pattern = str(tmp_path / "part*.jsonl")
    seen: list[int] = []
    for consumer, stop in zip(range(3), (1, 3, 4)):
        build = lambda c=consumer: rs.jsonl(pattern).shuffle(11).shard(c, 3)  # noqa: E731
        pipe = build()
        head = take(pipe, stop)
        resumed = build()
        resumed.set_state(roundtrip(pipe.get_state()))
        seen += ids(head) + ids(list(resumed))
    assert sorted(seen) == list(range(sum(sizes)))


def test_many_one_record_files(tmp_path: Path) -> None:
    """Two hundred one-record files under one glob: reads in name order, shuffles, shards and
    resumes at every kind of point; its state stays small (one fingerprint per file)."""
    count = 200
    for i in range(count):
        (tmp_path / f"{i:04d}.jsonl").write_text(json.dumps({"g": i}))  # unterminated, too
    pattern = str(tmp_path / "*.jsonl")
    assert ids(list(rs.jsonl(pattern))) == list(range(count))
    build = lambda: rs.jsonl(pattern).shuffle(1).shard(1, 2).repeat()  # noqa: E731
    for k in (0, 50, 99, 100, 101, 199):
        check_resume(build, k, 202)
    state = rs.jsonl(pattern).get_state()
    assert len(state["files"]) == count and len(json.dumps(state)) < 200 * count


# -- keys, random access and errors across files ------------------------------------------------


def test_keys_and_random_access_name_the_global_index_across_files(tmp_path: Path) -> None:
    sizes = [3, 0, 2, 1, 4]
    paths = numbered_files(tmp_path, sizes, style="unterminated")
    source = rs.jsonl(paths)
    assert len(source) == 10 and ids([source[i] for i in range(10)]) == list(range(10))
    with pytest.raises(IndexError):
        source[10]
    for build in (
        lambda: rs.jsonl(paths),
        lambda: rs.jsonl(paths).shuffle(4),
        lambda: rs.jsonl(paths).shuffle(4).repeat(2),
        lambda: rs.jsonl(paths).shuffle(4).shard(1, 2),
    ):
        pipe = build()
        assert pipe.last_key() is None
        seen = 0
        for _epoch in range(2):
            for record in pipe:
                key = pipe.last_key()
                assert key is not None and pipe.fetch(key) == record
                if len(key) == 2:  # (epoch, leaf index): the index is the global record index
                    assert source[key[1]] == record
                seen += 1
        assert seen > 0


MALFORMED_LAYOUTS = {
    # file holding the bad line -> (its bytes, the bad line's number)
    "first": (b'{"g": 0}\n{"g": \n', 2),
    "bom_crlf_blanks": (BOM + b'\r\n{"g": 0}\r\n\r\n  \t\r\n{"g": 1,\r\n{"g": 2}\r\n', 5),
    "last_line_unterminated": (b'{"g": 0}\n\n{"g": 1}\nnot json', 4),
}


@pytest.mark.parametrize("position", [0, 1, 2])
@pytest.mark.parametrize("layout", sorted(MALFORMED_LAYOUTS))
def test_a_malformed_line_names_its_file_and_line_however_it_is_reached(
    tmp_path: Path, position: int, layout: str
) -> None:
    """The bad line in the first, middle or last file: sequential reading, a shuffle, random
    access and a resumed pipeline all raise ``SourceError("<file>:<line>: malformed ...")``;
    with ``on_error="skip"`` it is skipped, counted, and a resume past it is exact."""
    data, line = MALFORMED_LAYOUTS[layout]
    paths = [write_jsonl(tmp_path / f"ok{j}.jsonl", [{"g": 10 * j + i} for i in range(3)]) for j in range(2)]
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(data)
    paths.insert(position, str(bad))
    where = f"{bad}:{line}: malformed JSON record"
    for reach in (
        lambda: list(rs.jsonl(paths)),
        lambda: list(rs.jsonl(paths).shuffle(3)),
        lambda: list(rs.jsonl(paths).shuffle(3).shard(0, 2)) + list(rs.jsonl(paths).shuffle(3).shard(1, 2)),
        lambda: [rs.jsonl(paths)[i] for i in range(len(rs.jsonl(paths)))],
    ):
        with pytest.raises(rs.SourceError) as raised:
            reach()
        assert str(raised.value).startswith(where), str(raised.value)
    skipping = rs.jsonl(paths, on_error="skip")
    records = list(skipping)
    assert skipping.stats["skipped"] == 1 and len(records) == len(skipping) - 1
    build = lambda: rs.jsonl(paths, on_error="skip").shuffle(5)  # noqa: E731
    check_points(build, points(len(records)), 2 * len(records) + 1)


# -- paths: relative, staged, symlinked, renamed ---------------------------------------------------


def test_relative_paths_restore_from_another_working_directory_and_a_staging_copy(tmp_path: Path) -> None:
    """A job reads ``data/*.jsonl`` relative to its run directory; its state restores in another
    run directory holding a copy (``cp`` without ``-p``: new mtimes, same content), and over the
    same files named absolutely."""
    run1, run2 = tmp_path / "run1", tmp_path / "run2"
    numbered_files(run1 / "data", [3, 5, 0, 2])
    shutil.copytree(run1 / "data", run2 / "data", copy_function=shutil.copy)  # new mtimes
    for sidecar in glob.glob(str(run2 / "data" / "*.rsidx")):
        os.remove(sidecar)
    relative = lambda: rs.jsonl("data/*.jsonl").shuffle(2).shard(0, 2).repeat()  # noqa: E731
    with cwd(run1):
        expected = take(relative(), 14)
        pipe = relative()
        head = take(pipe, 6)
        state = roundtrip(pipe.get_state())
    assert state["upstream"]["upstream"]["upstream"]["files"][0][0] == os.path.join("data", "part0.jsonl")
    with cwd(run2):
        resumed = relative()
        resumed.set_state(state)
        assert head + take(resumed, 8) == expected
    absolute = rs.jsonl(str(run1 / "data" / "*.jsonl")).shuffle(2).shard(0, 2).repeat()
    absolute.set_state(state)
    assert head + take(absolute, 8) == expected


def test_changing_directory_during_a_run_over_relative_paths(tmp_path: Path) -> None:
    """A run over relative paths whose process changes directory mid-epoch either continues
    exactly (paths resolved when built) or raises a SourceError naming the file: never another
    error, never other records."""
    numbered_files(tmp_path / "data", [2, 3])
    with cwd(tmp_path):
        expected = list(rs.jsonl(["data/part0.jsonl", "data/part1.jsonl"]))
        pipe = rs.jsonl(["data/part0.jsonl", "data/part1.jsonl"])
        iterator = iter(pipe)
        head = [next(iterator)]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    with cwd(elsewhere):
        try:
            rest = list(iterator)
        except rs.SourceError as error:
            assert "part" in str(error)
        else:
            assert head + rest == expected


def test_the_same_file_twice_and_through_symlinks_touched_during_the_run(tmp_path: Path) -> None:
    """``[a, b, a, link to a]``: four files to the source, each record once per listing; the
    symlink's and the real file's sidecars are separate and both restore; a touch of ``a``
    mid-run and of ``b`` before the restore (same content) change nothing."""
    a = write_jsonl(tmp_path / "a.jsonl", [{"g": i} for i in range(5)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"g": 10 + i} for i in range(3)], style="unterminated")
    link = tmp_path / "link.jsonl"
    link.symlink_to(a)
    paths = [a, b, a, str(link)]
    expected = [*range(5), 10, 11, 12, *range(5), *range(5)]
    assert ids(list(rs.jsonl(paths))) == expected
    build = lambda: rs.jsonl(paths).shuffle(4).shard(1, 2).repeat()  # noqa: E731
    full = take(build(), 30)
    pipe = build()
    head = take(pipe, 5)
    os.utime(a, ns=(time.time_ns(), time.time_ns() + 10**9))
    time.sleep(0.11)  # the watch looks at one file per 0.1 s
    middle = take(pipe, 4)
    state = roundtrip(pipe.get_state())
    os.utime(b, ns=(time.time_ns(), time.time_ns() + 2 * 10**9))
    resumed = build()
    resumed.set_state(state)
    assert head + middle + take(resumed, 21) == full


@pytest.mark.parametrize("workers", [0, 2])
def test_loader_over_duplicates_symlinks_and_empty_files_resumes_across_epochs(tmp_path: Path, workers: int) -> None:
    """``rs.torch.Loader`` (0 and 2 workers) over ``[a, empty, b, a, link to a]``: every worker
    reads its part, every listing's records once per epoch; a state taken after the first batch,
    after the epoch's last batch (before and after its StopIteration) and into the next epoch
    continues exactly, with the sidecars deleted before the restore."""
    a = write_jsonl(tmp_path / "a.jsonl", [{"g": i} for i in range(5)], style="crlf")
    empty = write_jsonl(tmp_path / "empty.jsonl", [])
    b = write_jsonl(tmp_path / "b.jsonl", [{"g": 10 + i} for i in range(3)], style="unterminated")
    link = tmp_path / "link.jsonl"
    link.symlink_to(a)
    paths = [a, empty, b, a, str(link)]

    def build() -> rs.Node[Any]:
        return rs.jsonl(paths).shuffle(4).shard().map(lambda r: r["g"]).batch(3, collate_fn=list)

    fresh = rst.Loader(build, num_workers=workers)
    epochs = [list(fresh), list(fresh)]
    assert sorted(x for batch in epochs[0] for x in batch) == sorted([*range(5), 10, 11, 12, *range(5), *range(5)])
    assert epochs[0] != epochs[1]  # a new order every epoch
    count = len(epochs[0])
    for stop in (1, count, count + 1):
        loader = rst.Loader(build, num_workers=workers)
        head = loader_head(loader, stop, count, list)
        state = roundtrip(loader.state_dict())
        del loader
        for sidecar in glob.glob(str(tmp_path / "*.rsidx")):
            os.remove(sidecar)
        resumed = rst.Loader(build, num_workers=workers)
        resumed.load_state_dict(state)
        assert head + loader_rest(resumed, stop, count, list) == epochs[0] + epochs[1], stop


def test_more_fewer_renamed_reordered_or_appended_files_at_restore(tmp_path: Path) -> None:
    """What a glob finds at restore time differs from what it found when the state was saved:
    one more file, one fewer, a file renamed (so the glob's order moved), a file appended to.
    Each is a StateError naming the node (and the file), and the pipeline it was given to
    continues as before the call."""
    data = tmp_path / "data"
    paths = numbered_files(data, [3, 4, 2])
    pattern = str(data / "*.jsonl")
    build = lambda: rs.jsonl(pattern).shuffle(6)  # noqa: E731
    pipe = build()
    take(pipe, 4)
    state = roundtrip(pipe.get_state())
    before = os.stat(paths[1])

    write_jsonl(data / "part3.jsonl", [{"g": 99}])
    message = refused_changes_nothing(build, state, 2, 12, rs.StateError)
    assert "Shuffle > JsonlSource" in message and "3 files" in message and "4" in message
    os.remove(data / "part3.jsonl")

    os.rename(paths[2], data / "moved.txt")
    message = refused_changes_nothing(build, state, 2, 7, rs.StateError)
    assert "Shuffle > JsonlSource" in message and "3 files" in message and "2" in message

    os.rename(data / "moved.txt", data / "a_first.jsonl")  # same count, order moved
    message = refused_changes_nothing(build, state, 2, 12, rs.StateError)
    assert "a_first.jsonl" in message and "part" in message
    os.rename(data / "a_first.jsonl", paths[2])

    with open(paths[1], "a") as out:
        out.write('{"g": 100}\n')
    message = refused_changes_nothing(build, state, 9, 20, rs.StateError)
    assert paths[1] in message and "size" in message

    # the file restored (content and mtime): the old state resumes again
    Path(paths[1]).write_text("".join(json.dumps({"g": 3 + i}) + "\n" for i in range(4)))
    os.utime(paths[1], ns=(before.st_atime_ns, before.st_mtime_ns))
    resumed = build()
    resumed.set_state(state)
    assert take(resumed, 20) == take(build(), 29)[4:24]


def test_files_of_one_name_in_two_directories_swapped_at_restore(tmp_path: Path) -> None:
    """``en/part0.jsonl`` and ``fr/part0.jsonl`` (same size, other content) listed the other way
    round at restore: the names match, the content digest does not: a StateError naming the
    file, and the pipeline continues as before the call."""
    paths = []
    for lang in ("en", "fr"):
        (tmp_path / lang).mkdir()
        paths.append(write_jsonl(tmp_path / lang / "part0.jsonl", [{"lang": lang, "i": i} for i in range(5)]))
    pipe = rs.jsonl(paths).shuffle(1)
    take(pipe, 3)
    state = roundtrip(pipe.get_state())
    message = refused_changes_nothing(lambda: rs.jsonl(paths[::-1]).shuffle(1), state, 4, 10, rs.StateError)
    assert "part0.jsonl" in message and "other content digest" in message


def test_a_file_appended_to_during_the_run_is_a_source_error_naming_it(tmp_path: Path) -> None:
    """A shard still being written (appended to) while the job reads: the next read of it, or
    the next epoch, raises SourceError naming it; the last state saved before the append
    resumes once the file is cut back to its old content and mtime."""
    paths = numbered_files(tmp_path, [3, 3, 3])
    original = Path(paths[2]).read_bytes()
    times = os.stat(paths[2])
    build = lambda: rs.jsonl(paths).repeat()  # noqa: E731
    expected = take(build(), 14)
    pipe = build()
    head = take(pipe, 4)  # in the second file
    state = roundtrip(pipe.get_state())
    with open(paths[2], "ab") as out:
        out.write(b'{"g": 1000}\n')
    with pytest.raises(rs.SourceError) as raised:
        take(pipe, 10)
    assert paths[2] in str(raised.value) and "changed during the run" in str(raised.value)
    Path(paths[2]).write_bytes(original)
    os.utime(paths[2], ns=(times.st_atime_ns, times.st_mtime_ns))
    resumed = build()
    resumed.set_state(state)
    assert head + take(resumed, 10) == expected


# -- the line-offset index: sidecars and cache_dir ------------------------------------------------


def test_sidecars_deleted_stale_or_foreign_between_save_and_restore(tmp_path: Path) -> None:
    """After the save: every sidecar deleted; one replaced by another file's sidecar; one left
    stale by a touch; one cut in half. The restore rebuilds what it must (a SidecarWarning for
    the damaged one) and continues exactly."""
    paths = numbered_files(tmp_path, [40, 1, 25, 7])
    build = lambda: rs.jsonl(paths).shuffle(9).shard(0, 2).repeat()  # noqa: E731
    expected = take(build(), 80)
    pipe = build()
    head = take(pipe, 30)
    state = roundtrip(pipe.get_state())

    for sidecar in glob.glob(str(tmp_path / "*.rsidx")):
        os.remove(sidecar)
    resumed = build()
    resumed.set_state(state)
    assert head + take(resumed, 50) == expected

    shutil.copyfile(paths[0] + ".rsidx", paths[2] + ".rsidx")  # another file's index
    os.utime(paths[3], ns=(time.time_ns(), time.time_ns() + 10**9))  # stale: new mtime
    sidecar = Path(paths[0] + ".rsidx")
    sidecar.write_bytes(sidecar.read_bytes()[: sidecar.stat().st_size // 2])
    with pytest.warns(SidecarWarning, match="part0.jsonl"):
        resumed = build()
    resumed.set_state(state)
    assert head + take(resumed, 50) == expected


def test_cache_dir_holds_the_indices_when_the_data_sidecars_cannot_be_written(tmp_path: Path) -> None:
    """With nowhere to write beside the data, each index goes to ``cache_dir`` (created, a
    ``Path`` accepted), named after its file. cache_dir is not part of the state: a restore with
    another cache dir, or after the cache dir was deleted, continues exactly, and so does a
    Loader whose workers open the indices from it."""
    paths = numbered_files(tmp_path / "data", [6, 0, 3, 5])
    block_sidecars(paths)
    cache = tmp_path / "cache" / "index"
    pattern = str(tmp_path / "data" / "*.jsonl")
    build = lambda cache_dir=cache: rs.jsonl(pattern, cache_dir=cache_dir).shuffle(1).shard(1, 2).repeat()  # noqa: E731
    expected = take(build(), 20)
    names = sorted(os.listdir(cache))
    assert len(names) == 4 and all(name.startswith(f"part{j}.jsonl.") for j, name in enumerate(names))
    pipe = build()
    head = take(pipe, 5)
    state = roundtrip(pipe.get_state())
    shutil.rmtree(cache)
    for other in (tmp_path / "other", cache):
        resumed = build(other)
        resumed.set_state(state)
        assert head + take(resumed, 15) == expected

    def loader_build() -> rs.Node[Any]:
        return (
            rs.jsonl(pattern, cache_dir=str(cache)).shuffle(1).shard().map(lambda r: r["g"]).batch(2, collate_fn=list)
        )

    shutil.rmtree(cache)
    everything, _ = loader_batches(rst.Loader(loader_build, num_workers=2))
    assert sorted(x for batch in everything for x in batch) == list(range(14))
    head_batches, saved = loader_batches(rst.Loader(loader_build(), num_workers=2), 3)
    shutil.rmtree(cache)
    loader = rst.Loader(loader_build, num_workers=2)
    loader.load_state_dict(saved)
    assert head_batches + loader_batches(loader)[0] == everything


def test_nothing_writable_keeps_the_indices_in_memory_and_still_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Neither beside the data, nor cache_dir, nor $RESUMABLE_CACHE_DIR can hold a sidecar (a
    regular file stands where each directory should be): a SidecarWarning, and the source reads,
    resumes and feeds DataLoader workers from indices in memory (each worker builds its own)."""
    paths = numbered_files(tmp_path, [4, 2, 5])
    block_sidecars(paths)
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv("RESUMABLE_CACHE_DIR", str(blocker))

    def build() -> rs.Node[Any]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SidecarWarning)
            return rs.jsonl(paths, cache_dir=str(blocker)).shuffle(3).repeat()

    with pytest.warns(SidecarWarning, match="keeping it in memory"):
        rs.jsonl(paths, cache_dir=str(blocker))
    check_points(build, [0, 4, 6, 10, 11, 12], 24)

    def loader_build() -> rs.Node[Any]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SidecarWarning)
            return (
                rs.jsonl(paths, cache_dir=str(blocker))
                .shuffle(3)
                .shard()
                .map(lambda r: r["g"])
                .batch(2, collate_fn=list)
            )

    everything, _ = loader_batches(rst.Loader(loader_build(), num_workers=2))
    assert sorted(x for batch in everything for x in batch) == list(range(11))
    head_batches, saved = loader_batches(rst.Loader(loader_build(), num_workers=2), 2)
    loader = rst.Loader(loader_build(), num_workers=2)
    loader.load_state_dict(saved)
    assert head_batches + loader_batches(loader)[0] == everything


def _build_in_shared_cache(paths: list[str], cache: str, barrier: Any, results: Any) -> None:
    barrier.wait()
    source = rs.jsonl(paths, cache_dir=cache)
    results.put([len(source), source[0], source[len(source) // 2], source[len(source) - 1]])


def test_processes_building_one_cache_dir_at_once(tmp_path: Path) -> None:
    """Three processes (the ranks of one machine) start at the same moment over the same files
    whose indices must go to one shared cache_dir: each reads the same records, and the cache
    holds one whole sidecar per file and no temporaries."""
    paths = [write_jsonl(tmp_path / f"big{j}.jsonl", [{"f": j, "i": i} for i in range(30_000)]) for j in range(2)]
    block_sidecars(paths)
    cache = str(tmp_path / "shared-cache")
    context = multiprocessing.get_context("fork")
    barrier, results = context.Barrier(3), context.Queue()
    processes = [
        context.Process(target=_build_in_shared_cache, args=(paths, cache, barrier, results)) for _ in range(3)
    ]
    for process in processes:
        process.start()
    answers = [results.get(timeout=60) for _ in processes]
    for process in processes:
        process.join(timeout=60)
        assert process.exitcode == 0
    expected = [60_000, {"f": 0, "i": 0}, {"f": 1, "i": 0}, {"f": 1, "i": 29_999}]
    assert answers == [expected] * 3
    assert sorted(name.split(".")[0] for name in os.listdir(cache)) == ["big0", "big1"]
    source = rs.jsonl(paths, cache_dir=cache)
    assert all(index.sidecar is not None and index.sidecar.startswith(cache) for index in source._indices)


# -- Parquet and Arrow lists -------------------------------------------------------------------


def write_columnar(path: Path, values: list[int], kind: str) -> str:
    table = pa.table({"g": pa.array(values, pa.int64())})
    if kind == "parquet":
        pq.write_table(table, str(path), row_group_size=2)
    else:
        writer = pa.ipc.new_stream if kind == "arrow_stream" else pa.ipc.new_file
        with pa.OSFile(str(path), "wb") as sink, writer(sink, table.schema) as out:
            for batch in table.to_batches(max_chunksize=2):
                out.write_batch(batch)
    return str(path)


@pytest.mark.parametrize("kind", ["parquet", "arrow"])
def test_columnar_lists_with_empty_files_duplicates_and_mixed_formats(tmp_path: Path, kind: str) -> None:
    """A list of Parquet (or Arrow IPC, file and stream formats mixed) files of 5, 0, 1, 4 rows
    and the first one again: rows in list order, every resume point exact under a row-group
    block shuffle and a sharded global shuffle; a glob that finds one more file at restore, or
    a renamed file, is a StateError naming the node; a copy staged elsewhere restores."""
    sizes = [5, 0, 1, 4]
    paths, first = [], 0
    for j, size in enumerate(sizes):
        file_kind = kind if kind == "parquet" else ("arrow_stream" if j % 2 else "arrow")
        paths.append(write_columnar(tmp_path / f"p{j}.{kind}", list(range(first, first + size)), file_kind))
        first += size
    listed = [*paths, paths[0]]
    build_source = rs.parquet if kind == "parquet" else rs.arrow
    assert ids(list(build_source(listed))) == [*range(10), *range(5)]
    n = 15
    for build in (
        lambda: build_source(listed).shuffle(3, block_size="row_group", window=2),
        lambda: build_source(listed).shuffle(3).shard(2, 3).repeat(),
    ):
        check_points(build, sorted({*points(n), *file_boundaries([*sizes, 5])}), 2 * n + 2)

    # a job staging its data into another directory with a plain cp (new mtimes, same content)
    staged = tmp_path / "staged"
    staged.mkdir()
    for path in paths:
        shutil.copy(path, staged)
    staged_list = [str(staged / os.path.basename(path)) for path in listed]
    pipe = build_source(listed).shuffle(3).shard(0, 2)
    head = take(pipe, 4)
    state = roundtrip(pipe.get_state())
    resumed = build_source(staged_list).shuffle(3).shard(0, 2)
    resumed.set_state(state)
    assert head + take(resumed, 4) == take(build_source(listed).shuffle(3).shard(0, 2), 8)

    pattern = str(tmp_path / f"*.{kind}")
    pipe = build_source(pattern).shuffle(1)
    take(pipe, 3)
    state = roundtrip(pipe.get_state())
    extra = write_columnar(tmp_path / f"p9.{kind}", [77], "parquet" if kind == "parquet" else "arrow")
    message = refused_changes_nothing(lambda: build_source(pattern).shuffle(1), state, 2, 8, rs.StateError)
    assert "Shuffle > " in message and "4 files" in message
    os.remove(extra)
    os.rename(paths[3], tmp_path / f"p3b.{kind}")
    message = refused_changes_nothing(lambda: build_source(pattern).shuffle(1), state, 2, 8, rs.StateError)
    assert "p3.{}".format(kind) in message and "p3b.{}".format(kind) in message


# -- found and mended ----------------------------------------------------------------------------


def test_jsonl_over_more_files_than_the_descriptor_limit_allows_pairs_of(tmp_path: Path) -> None:
    count = 120
    for i in range(count):
        (tmp_path / f"{i:04d}.jsonl").write_text(json.dumps({"g": i}) + "\n")
    pattern = str(tmp_path / "*.jsonl")
    rs.jsonl(pattern)  # sidecars built while the limit is the usual one
    with descriptor_limit(count + 40), warnings.catch_warnings():
        warnings.simplefilter("ignore", SidecarWarning)
        source = rs.jsonl(pattern)
        try:
            assert ids(list(source.shuffle(0))) != [] and sorted(ids(list(source))) == list(range(count))
        finally:
            del source


def test_parquet_over_more_files_than_the_descriptor_limit(tmp_path: Path) -> None:
    count = 150
    for i in range(count):
        pq.write_table(pa.table({"g": [i]}), str(tmp_path / f"{i:04d}.parquet"))
    with descriptor_limit(count // 2):
        assert ids(list(rs.parquet(str(tmp_path / "*.parquet")))) == list(range(count))


def test_an_explicit_path_with_brackets_in_its_name_is_read(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "shard[0].jsonl", [{"g": 0}, {"g": 1}])
    assert ids(list(rs.jsonl(glob.escape(path)))) == [0, 1]  # the escaped glob works
    assert ids(list(rs.jsonl([path]))) == [0, 1]


def test_a_glob_matching_a_dangling_symlink_is_a_source_error(tmp_path: Path) -> None:
    numbered_files(tmp_path, [2, 2])
    (tmp_path / "part2.jsonl").symlink_to(tmp_path / "gone" / "part2.jsonl")
    with pytest.raises(rs.SourceError, match="part2.jsonl"):
        rs.jsonl(str(tmp_path / "*.jsonl"))
    with pytest.raises(rs.SourceError, match="part2.jsonl"):
        rs.jsonl([str(tmp_path / "part0.jsonl"), str(tmp_path / "part2.jsonl")])  # (this one passes)


def test_a_gzip_file_given_to_the_indexed_jsonl_source_is_refused_when_built(tmp_path: Path) -> None:
    plain = write_jsonl(tmp_path / "a.jsonl", [{"g": 0}])
    packed = tmp_path / "b.jsonl.gz"
    packed.write_bytes(gzip.compress(b"".join(json.dumps({"g": i}).encode() + b"\n" for i in range(1, 50))))
    for on_error in ("raise", "skip"):
        with pytest.raises(rs.SourceError, match="b.jsonl.gz"):
            rs.jsonl([plain, str(packed)], on_error=on_error)


def test_a_glob_that_finds_more_or_fewer_files_at_restore_names_them(tmp_path: Path) -> None:
    paths = numbered_files(tmp_path / "data", [3, 4, 2])
    pattern = str(tmp_path / "data" / "*.jsonl")
    pipe = rs.jsonl(pattern).shuffle(6)
    take(pipe, 4)
    state = roundtrip(pipe.get_state())
    write_jsonl(tmp_path / "data" / "part3.jsonl", [{"g": 99}])
    with pytest.raises(rs.StateError, match="part3.jsonl"):
        rs.jsonl(pattern).shuffle(6).set_state(state)
    os.remove(tmp_path / "data" / "part3.jsonl")
    os.remove(paths[1])
    with pytest.raises(rs.StateError, match="part1.jsonl"):
        rs.jsonl(pattern).shuffle(6).set_state(state)


def test_nothing_writable_warns_once_not_once_per_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    paths = numbered_files(tmp_path, [1] * 10)
    block_sidecars(paths)
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv("RESUMABLE_CACHE_DIR", str(blocker))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert len(rs.jsonl(paths, cache_dir=str(blocker))) == 10
    assert len([w for w in caught if issubclass(w.category, SidecarWarning)]) == 1
