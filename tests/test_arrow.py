"""ArrowSource: Arrow IPC files in the file and stream formats."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

import resumable as rs
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
