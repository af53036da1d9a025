"""ParquetSource: metadata index over many files, row-group reads, errors, fingerprints, resume."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given
from hypothesis import strategies as st

import resumable as rs
from resumable.sources.parquet import ParquetSource, footer_digest, parquet
from tests.resume import check_resume, take


def write(path: Path, ids: list[int], row_group_size: int = 7) -> str:
    table = pa.table({"id": ids, "text": ["x" * (i % 5) for i in ids], "score": [i / 2 for i in ids]})
    pq.write_table(table, str(path), row_group_size=row_group_size)
    return str(path)


def corpus(tmp_path: Path) -> str:
    write(tmp_path / "a.parquet", list(range(0, 40)), row_group_size=7)
    write(tmp_path / "b.parquet", list(range(40, 65)), row_group_size=10)
    write(tmp_path / "c.parquet", list(range(65, 100)), row_group_size=16)
    return str(tmp_path / "*.parquet")


def test_reads_every_row_in_order_as_dicts(tmp_path: Path) -> None:
    source = parquet(corpus(tmp_path))
    assert len(source) == 100
    assert source.num_row_groups == 6 + 3 + 3
    assert [r["id"] for r in source] == list(range(100))
    assert source[57] == {"id": 57, "text": "xx", "score": 28.5}
    assert source.locate(57) == (str(tmp_path / "b.parquet"), 1, 7)


def test_columns_select_and_unknown_column_fails(tmp_path: Path) -> None:
    pattern = corpus(tmp_path)
    assert parquet(pattern, columns=["id"])[3] == {"id": 3}
    with pytest.raises(rs.SourceError, match=r"no column\(s\) \['nope'\]"):
        parquet(pattern, columns=["id", "nope"])
    with pytest.raises(rs.ConfigError, match="columns"):
        parquet(pattern, columns="id")  # type: ignore[arg-type]  # deliberately wrong, to test the check
    with pytest.raises(rs.ConfigError, match="cache_row_groups"):
        parquet(pattern, cache_row_groups=0)


def test_random_access_groups_by_row_group_and_keeps_order(tmp_path: Path) -> None:
    source = parquet(corpus(tmp_path), cache_row_groups=2)
    indices = np.array([99, 0, 41, 5, 98, 40, 6, 64], dtype=np.int64)
    assert [r["id"] for r in source._raw_at(indices)] == indices.tolist()
    assert len(source._cache) <= 2


def test_sequential_read_never_decodes_earlier_row_groups(tmp_path: Path) -> None:
    pattern = corpus(tmp_path)
    source = parquet(pattern)
    decoded: list[int] = []
    original = source._read_row_group

    def spy(group: int, private_handle: bool = False) -> pa.Table:
        decoded.append(group)
        return original(group, private_handle)

    source._read_row_group = spy  # type: ignore[method-assign]  # a spy on the source
    state = parquet(pattern).get_state()
    state["position"] = 70
    source.set_state(state)
    assert [r["id"] for r in source] == list(range(70, 100))
    assert decoded == [9, 10, 11]  # c.parquet: groups 9 (65..80), 10 (81..96), 11 (97..99)


def test_empty_row_groups_and_files_are_skipped(tmp_path: Path) -> None:
    schema = pa.schema([("id", pa.int64()), ("text", pa.string()), ("score", pa.float64())])
    with pq.ParquetWriter(str(tmp_path / "a.parquet"), schema) as writer:
        writer.write_table(pa.table({"id": [0, 1], "text": ["", "x"], "score": [0.0, 0.5]}, schema=schema))
        writer.write_table(schema.empty_table())
        writer.write_table(pa.table({"id": [2], "text": ["xx"], "score": [1.0]}, schema=schema))
    pq.write_table(schema.empty_table(), str(tmp_path / "b.parquet"))
    write(tmp_path / "c.parquet", [3, 4])
    source = parquet(str(tmp_path / "*.parquet"))
    assert [r["id"] for r in source] == [0, 1, 2, 3, 4]
    assert [source[i]["id"] for i in (4, 2, 0)] == [4, 2, 0]
    assert source.block_bounds().tolist() == [0, 2, 3, 5]


def test_missing_empty_and_invalid_files_fail_at_construction(tmp_path: Path) -> None:
    with pytest.raises(rs.SourceError, match="no such file .*missing.parquet"):
        parquet(str(tmp_path / "missing.parquet"))
    with pytest.raises(rs.SourceError, match="no files match"):
        parquet(str(tmp_path / "*.parquet"))
    pq.write_table(pa.table({"id": pa.array([], pa.int64())}), str(tmp_path / "empty.parquet"))
    with pytest.raises(rs.SourceError, match="no rows in .*empty.parquet"):
        parquet(str(tmp_path / "empty.parquet"))
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(rs.SourceError, match="cannot read .*bad.parquet. as Parquet"):
        parquet(str(tmp_path / "bad.parquet"))


def test_pickles_without_open_files(tmp_path: Path) -> None:
    source = parquet(corpus(tmp_path))
    assert source[3]["id"] == 3
    assert source._handles.opened(0) is not None and source._cache
    clone = pickle.loads(pickle.dumps(source))
    assert [clone._handles.opened(f) for f in range(3)] == [None, None, None] and not clone._cache
    assert [r["id"] for r in clone] == list(range(100))


def test_changed_file_after_pickling_is_a_source_error(tmp_path: Path) -> None:
    path = write(tmp_path / "a.parquet", list(range(10)))
    blob = pickle.dumps(parquet(path))
    write(tmp_path / "a.parquet", list(range(12)))
    clone = pickle.loads(blob)
    with pytest.raises(rs.SourceError, match="changed during the run"):
        clone[0]


def test_changed_file_on_resume_is_a_state_error(tmp_path: Path) -> None:
    path = write(tmp_path / "a.parquet", list(range(10)))
    source = parquet(path)
    take(source, 3)
    state = source.get_state()
    assert state["files"] == [[path, os.path.getsize(path), os.stat(path).st_mtime_ns, footer_digest(path)]]
    write(tmp_path / "a.parquet", list(range(10, 20)))
    os.utime(path, ns=(1, 1))
    with pytest.raises(rs.StateError, match="differs from the file the state was taken over"):
        parquet(path).set_state(state)


def test_other_files_or_columns_on_resume_are_state_errors(tmp_path: Path) -> None:
    pattern = corpus(tmp_path)
    state = parquet(pattern).get_state()
    with pytest.raises(rs.StateError, match="saved over 3 files"):
        parquet(str(tmp_path / "a.parquet")).set_state(state)
    with pytest.raises(rs.StateError, match="columns"):
        parquet(pattern, columns=["id"]).set_state(state)
    renamed = dict(state, files=[["z.parquet", *f[1:]] for f in state["files"]])
    with pytest.raises(rs.StateError, match="saved over file 'z.parquet'"):
        parquet(pattern).set_state(renamed)


def test_moved_data_directory_still_resumes(tmp_path: Path) -> None:
    old = tmp_path / "old"
    old.mkdir()
    path = write(old / "a.parquet", list(range(30)))
    source = parquet(path)
    take(source, 11)
    state = source.get_state()
    os.rename(old, tmp_path / "new")
    moved = parquet(str(tmp_path / "new" / "a.parquet"))
    moved.set_state(state)
    assert [r["id"] for r in moved] == list(range(11, 30))


CHAINS: dict[str, Any] = {
    "plain": lambda s: s,
    "shuffle": lambda s: s.shuffle(seed=3),
    "block_shuffle": lambda s: s.shuffle(seed=3, block_size="row_group", window=2),
    "shard": lambda s: s.shuffle(seed=1).shard(1, 3),
    "map_filter_batch": lambda s: s.map(lambda r: r["id"]).filter(lambda i: i % 3 != 0).batch(4),
    "repeat": lambda s: s.shuffle(seed=2).repeat(),
}


@pytest.mark.parametrize("chain", sorted(CHAINS))
def test_resume_property(tmp_path: Path, chain: str) -> None:
    pattern = corpus(tmp_path)

    def build() -> rs.Node[Any]:
        return CHAINS[chain](parquet(pattern))

    total = 250
    for k in (0, 1, 37, 99, 100, 101, 180):
        check_resume(build, k, total)
    check_resume(build, 10, total, k2=120)


@given(
    sizes=st.lists(st.integers(0, 30), min_size=1, max_size=4).filter(lambda s: sum(s) > 0),
    row_group_size=st.integers(1, 12),
    cut=st.floats(0, 1),
)
def test_any_file_layout_reads_and_resumes(
    tmp_path_factory: pytest.TempPathFactory, sizes: list[int], row_group_size: int, cut: float
) -> None:
    directory = tmp_path_factory.mktemp("layout")
    start = 0
    paths = []
    for n, size in enumerate(sizes):
        paths.append(write(directory / f"{n:02d}.parquet", list(range(start, start + size)), row_group_size))
        start += size

    def build() -> ParquetSource:
        return parquet(paths)

    assert [r["id"] for r in build()] == list(range(start))
    check_resume(build, int(cut * start), start + 5)


def test_a_read_needing_several_row_groups_decodes_them_concurrently(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pattern = corpus(tmp_path)
    source = parquet(pattern, cache_row_groups=6)
    indices = np.array([99, 0, 41, 5, 70], dtype=np.int64)  # groups 11, 0, 6, 0, 9
    assert [r["id"] for r in source._raw_at(indices)] == indices.tolist()
    assert sorted(source._cache) == [0, 6, 9, 11]

    def broken(self: pq.ParquetFile, *args: Any, **kwargs: Any) -> pa.Table:
        raise pa.ArrowInvalid("corrupt page")

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", broken)
    with pytest.raises(rs.SourceError, match="cannot decode row group 0 of .*a.parquet.: ArrowInvalid: corrupt page"):
        parquet(pattern)._raw_at(np.array([0, 99], dtype=np.int64))


# -- bad inputs and file identity ------------------------------------------------------------------


def test_touched_file_restores_by_its_footer_digest(tmp_path: Path) -> None:
    path = write(tmp_path / "a.parquet", list(range(30)))
    source = parquet(path).shuffle(1)
    take(source, 6)
    state = source.get_state()
    assert state["upstream"]["files"][0][3] == footer_digest(path)
    expected = take(source, 24)
    info = os.stat(path)
    os.utime(path, ns=(info.st_atime_ns, info.st_mtime_ns + 10**10))
    resumed = parquet(path).shuffle(1)
    resumed.set_state(state)
    assert take(resumed, 24) == expected


def test_footer_digest_tells_rewrites_apart(tmp_path: Path) -> None:
    first = write(tmp_path / "a.parquet", list(range(30)))
    again = write(tmp_path / "b.parquet", list(range(30)))
    other = write(tmp_path / "c.parquet", list(range(1, 31)))
    assert footer_digest(first) == footer_digest(again) != footer_digest(other)
    (tmp_path / "short").write_bytes(b"PAR")
    assert footer_digest(str(tmp_path / "short")) is None


def test_file_changed_during_the_run_is_caught_at_get_state_and_epoch_start(tmp_path: Path) -> None:
    path = write(tmp_path / "a.parquet", list(range(10)))
    source = parquet(path)
    take(source, 3)
    write(tmp_path / "a.parquet", list(range(11)))
    with pytest.raises(rs.SourceError, match=r"a\.parquet' changed during the run"):
        source.get_state()
    epochs = parquet(write(tmp_path / "b.parquet", list(range(4))))
    assert len(list(epochs)) == 4
    os.remove(tmp_path / "b.parquet")
    with pytest.raises(rs.SourceError, match=r"cannot stat .*b\.parquet'"):
        iter(epochs)


def test_corrupt_data_page_is_a_source_error_naming_the_row_group(tmp_path: Path) -> None:
    table = pa.table({"text": [f"word{i:04d}" for i in range(40)]})
    path = str(tmp_path / "a.parquet")
    pq.write_table(table, path, row_group_size=10, compression="none", use_dictionary=False, write_statistics=False)
    data = Path(path).read_bytes()
    Path(path).write_bytes(data.replace(b"word0025", b"word\xff\xfe25"))
    source = parquet(path)
    assert [r["text"] for r in take(source, 20)] == [f"word{i:04d}" for i in range(20)]
    with pytest.raises(rs.SourceError, match=r"cannot decode row group 2 of .*a\.parquet'"):
        take(source, 20)
