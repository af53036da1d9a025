"""ArrowSource: Arrow IPC files in the file and stream formats."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

import resumable as rs
from resumable.sources import files
from resumable.sources.arrow import arrow
from tests.resume import check_resume, take


def table(ids: range) -> pa.Table:
    return pa.table({"id": list(ids), "text": ["x" * (i % 5) for i in ids]})


def write_ipc(path: Path, data: pa.Table, stream: bool, batch_rows: int) -> str:
    with pa.OSFile(str(path), "wb") as sink:
        open_writer = pa.ipc.new_stream if stream else pa.ipc.new_file
        with open_writer(sink, data.schema) as writer:
            for batch in data.to_batches(max_chunksize=batch_rows):
                writer.write_batch(batch)
    return str(path)


def corpus(tmp_path: Path) -> str:
    write_ipc(tmp_path / "a.arrow", table(range(40)), stream=False, batch_rows=7)
    write_ipc(tmp_path / "b.arrow", table(range(40, 75)), stream=True, batch_rows=9)
    write_ipc(tmp_path / "c.arrow", table(range(75, 100)), stream=False, batch_rows=30)
    return str(tmp_path / "*.arrow")


# -- Arrow IPC ------------------------------------------------------------------------------------


def test_reads_file_and_stream_formats_as_one_index_space(tmp_path: Path) -> None:
    source = arrow(corpus(tmp_path))
    assert len(source) == 100
    assert [r["id"] for r in source] == list(range(100))
    assert source[44] == {"id": 44, "text": "xxxx"}
    indices = np.array([99, 0, 41, 5, 98, 40, 74], dtype=np.int64)
    assert [r["id"] for r in source._raw_at(indices)] == indices.tolist()
    assert source.block_bounds()[:3].tolist() == [0, 7, 14]


def test_missing_empty_and_invalid_files_fail_at_construction(tmp_path: Path) -> None:
    with pytest.raises(rs.SourceError, match="no such file"):
        arrow(str(tmp_path / "missing.arrow"))
    with pytest.raises(rs.SourceError, match="no files match"):
        arrow(str(tmp_path / "*.arrow"))
    empty = write_ipc(tmp_path / "empty.arrow", table(range(0)), stream=True, batch_rows=5)
    with pytest.raises(rs.SourceError, match="no rows in .*empty.arrow"):
        arrow(empty)
    (tmp_path / "bad.arrow").write_bytes(b"definitely not arrow")
    with pytest.raises(rs.SourceError, match="neither an Arrow IPC file nor an Arrow IPC stream"):
        arrow(str(tmp_path / "bad.arrow"))


def test_pickles_without_memory_maps(tmp_path: Path) -> None:
    source = arrow(corpus(tmp_path))
    clone = pickle.loads(pickle.dumps(source))
    assert clone._batches is None
    assert [r["id"] for r in clone][:3] == [0, 1, 2] and clone[99]["id"] == 99


def test_changed_file_is_a_state_error_and_a_source_error_after_pickling(tmp_path: Path) -> None:
    path = write_ipc(tmp_path / "a.arrow", table(range(10)), stream=False, batch_rows=4)
    source = arrow(path)
    take(source, 3)
    state = source.get_state()
    blob = pickle.dumps(source)
    write_ipc(tmp_path / "a.arrow", table(range(12)), stream=False, batch_rows=4)
    with pytest.raises(rs.StateError, match="differs from the file the state was taken over"):
        arrow(path).set_state(state)
    with pytest.raises(rs.SourceError, match="changed during the run"):
        pickle.loads(blob)[0]


CHAINS: dict[str, Any] = {
    "plain": lambda s: s,
    "shuffle": lambda s: s.shuffle(seed=3),
    "block_shuffle": lambda s: s.shuffle(seed=3, block_size="row_group", window=2),
    "shard": lambda s: s.shuffle(seed=1).shard(2, 3),
    "map_filter_batch": lambda s: s.map(lambda r: r["id"]).filter(lambda i: i % 4 != 1).batch(3),
    "repeat": lambda s: s.shuffle(seed=5).repeat(),
}


@pytest.mark.parametrize("chain", sorted(CHAINS))
def test_arrow_resume_property(tmp_path: Path, chain: str) -> None:
    pattern = corpus(tmp_path)

    def build() -> rs.Node[Any]:
        return CHAINS[chain](arrow(pattern))

    for k in (0, 1, 50, 99, 100, 101, 170):
        check_resume(build, k, 230)
    check_resume(build, 10, 230, k2=140)


# -- bad inputs and file identity ------------------------------------------------------------------


def words(count: int) -> pa.Table:
    return pa.table({"id": list(range(count)), "text": [f"word{i:04d}" for i in range(count)]})


@pytest.mark.parametrize("stream", [False, True], ids=["file", "stream"])
def test_corrupt_batch_is_a_source_error_naming_the_batch(tmp_path: Path, stream: bool) -> None:
    """Regression: invalid UTF-8 in a batch reached the user as UnicodeDecodeError."""
    path = write_ipc(tmp_path / "a.arrow", words(40), stream=stream, batch_rows=10)
    data = Path(path).read_bytes()
    Path(path).write_bytes(data.replace(b"word0025", b"word\xff\xfe25"))
    source = arrow(path)
    assert [r["id"] for r in take(source, 20)] == list(range(20))
    with pytest.raises(rs.SourceError, match=r"cannot read record batch 2 of .*a\.arrow'.*ArrowInvalid"):
        take(source, 20)
    with pytest.raises(rs.SourceError, match="record batch 2"):
        arrow(path)[25]


def test_file_cut_short_during_the_run_is_a_source_error_not_a_crash(tmp_path: Path) -> None:
    """Reading a memory map past the end of a file cut short kills the process (SIGBUS): the
    file is checked before its batches are read."""
    path = write_ipc(tmp_path / "a.arrow", words(400), stream=False, batch_rows=50)
    source = arrow(path)
    take(source, 10)
    with open(path, "r+b") as data:
        data.truncate(os.path.getsize(path) // 2)
    with pytest.raises(rs.SourceError, match=r"a\.arrow' changed during the run \(its size went from"):
        take(source, 400)


def test_touched_file_restores_and_a_rewritten_one_does_not(tmp_path: Path) -> None:
    path = write_ipc(tmp_path / "a.arrow", words(30), stream=True, batch_rows=7)
    source = arrow(path).shuffle(2)
    take(source, 5)
    state = source.get_state()
    assert state["upstream"]["files"][0][3].startswith("arrow-ipc-metadata-xxh3_64:")
    expected = take(source, 25)
    info = os.stat(path)
    os.utime(path, ns=(info.st_atime_ns, info.st_mtime_ns + 10**10))
    resumed = arrow(path).shuffle(2)
    resumed.set_state(state)
    assert take(resumed, 25) == expected
    write_ipc(tmp_path / "a.arrow", words(30), stream=True, batch_rows=6)  # same rows, other batches
    with pytest.raises(rs.StateError, match="differs from the file the state was taken over"):
        arrow(path).shuffle(2).set_state(state)


def test_file_changed_during_the_run_is_caught_at_get_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(files, "WATCH_INTERVAL", 0)
    first = write_ipc(tmp_path / "a.arrow", words(10), stream=False, batch_rows=5)
    second = write_ipc(tmp_path / "b.arrow", words(10), stream=True, batch_rows=5)
    source = arrow([first, second])
    take(source, 3)
    write_ipc(tmp_path / "b.arrow", words(12), stream=True, batch_rows=5)
    with pytest.raises(rs.SourceError, match=r"b\.arrow' changed during the run"):
        for _ in range(2):
            source.get_state()


def test_removed_file_is_a_source_error_in_a_worker(tmp_path: Path) -> None:
    path = write_ipc(tmp_path / "a.arrow", words(10), stream=False, batch_rows=5)
    blob = pickle.dumps(arrow(path))
    os.remove(path)
    with pytest.raises(rs.SourceError, match=r"cannot stat .*a\.arrow'"):
        pickle.loads(blob)[0]
