"""Open files within the process's descriptors (resumable/sources/open_files.py): a source over
more files than the process may hold open reads them all, exactly, and resumes; sidecars and
cache blocks are mapped without descriptors, and a map cut short in place is still caught."""

from __future__ import annotations

import json
import os
import pickle
import warnings
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import resumable as rs
from resumable.ops.cache import Cache
from resumable.sources import open_files
from resumable.sources.open_files import MappedFile, OpenFiles
from tests.resume import roundtrip, take
from tests.watching import descriptor_limit, open_descriptors

FILES = 40


def jsonl_files(root: Path) -> str:
    for file in range(FILES):
        (root / f"{file:03d}.jsonl").write_text("".join(json.dumps({"id": file * 3 + i}) + "\n" for i in range(3)))
    return str(root / "*.jsonl")


def parquet_files(root: Path) -> str:
    for file in range(FILES):
        pq.write_table(pa.table({"id": [file * 3 + i for i in range(3)]}), str(root / f"{file:03d}.parquet"))
    return str(root / "*.parquet")


SOURCES: dict[str, tuple[Callable[[Path], str], Callable[[str], rs.Node[Any]]]] = {
    "jsonl": (jsonl_files, rs.jsonl),
    "parquet": (parquet_files, rs.parquet),
}


def listed(file: int) -> list[int]:
    return [file]


@pytest.fixture
def small_budget(monkeypatch: pytest.MonkeyPatch) -> int:
    """A budget of 4 open files for the whole process."""
    monkeypatch.setattr(open_files, "budget", lambda: 4)
    return 4


@pytest.mark.parametrize("kind", list(SOURCES))
def test_a_shuffled_epoch_over_more_files_than_the_budget_is_exact(
    kind: str, tmp_path: Path, small_budget: int
) -> None:
    make, read = SOURCES[kind]
    pattern = make(tmp_path)

    def build() -> rs.Node[Any]:
        return read(pattern).shuffle(seed=5).repeat(2)

    expected = list(build())
    assert sorted(record["id"] for record in expected) == sorted(2 * list(range(3 * FILES)))
    assert open_files.open_count() <= small_budget
    for k in (0, 1, 3 * FILES - 1, 3 * FILES, 3 * FILES + 7):
        pipe = build()
        head = take(pipe, k)
        assert open_files.open_count() <= small_budget
        restored = build()
        restored.set_state(roundtrip(pipe.get_state()))
        assert head + list(restored) == expected, k


@pytest.mark.parametrize("kind", list(SOURCES))
def test_more_files_than_the_descriptor_limit_allows(kind: str, tmp_path: Path) -> None:
    """With the usual budget (a quarter of the limit) and a limit below the number of files."""
    make, read = SOURCES[kind]
    pattern = make(tmp_path)
    read(pattern)  # sidecars written while the limit is the usual one
    with descriptor_limit(FILES // 2), warnings.catch_warnings():
        warnings.simplefilter("error")  # no SidecarWarning: every index loads
        source = read(pattern)
        assert sorted(record["id"] for record in source.shuffle(seed=1)) == list(range(3 * FILES))
        assert open_files.open_count() <= open_files.budget()
        del source


def test_out_of_descriptors_lets_go_of_every_handle_and_tries_again(tmp_path: Path) -> None:
    opened: list[int] = []

    def opener(file: int) -> int:
        if not opened:
            opened.append(file)
            raise OSError(24, "Too many open files")
        opened.append(file)
        return file

    other: OpenFiles[int] = OpenFiles(1)
    other.get(0, int)
    handles: OpenFiles[int] = OpenFiles(2)
    assert handles.get(1, opener) == 1 and opened == [1, 1]
    assert other.opened(0) is None  # let go so that this one could open
    with pytest.raises(OSError, match="No space"):
        OpenFiles[int](1).get(0, lambda file: (_ for _ in ()).throw(OSError(28, "No space left on device")))


def test_open_files_pickle_without_their_handles() -> None:
    handles: OpenFiles[list[int]] = OpenFiles(3)
    assert handles.get(2, listed) == [2]
    clone = pickle.loads(pickle.dumps(handles))
    assert [clone.opened(file) for file in range(3)] == [None, None, None]
    assert clone.get(2, listed) == [2] and len(clone) == 3
    handles.close()
    assert handles.opened(2) is None


def test_a_mapped_file_holds_no_descriptor_and_sees_a_cut_in_place(tmp_path: Path) -> None:
    path = tmp_path / "sidecar"
    path.write_bytes(b"x" * 100)
    before = open_descriptors()
    maps = [MappedFile.of(str(path)) for _ in range(50)]
    assert open_descriptors() == before
    mapped = maps[0]
    assert mapped.buffer.to_pybytes() == b"x" * 100 and mapped.cut_to() is None
    replacement = tmp_path / "new"
    replacement.write_bytes(b"y" * 10)
    os.replace(replacement, path)  # replaced: the map keeps the old file, safe to read
    assert mapped.cut_to() is None and mapped.buffer.to_pybytes() == b"x" * 100
    fresh = MappedFile.of(str(path))
    os.truncate(path, 4)  # cut in place: reading past 4 bytes would be a SIGBUS
    assert fresh.cut_to() == 4
    os.remove(path)
    assert fresh.cut_to() is None  # removed: the map holds the file as it is


def test_a_disk_cache_of_more_blocks_than_the_descriptor_limit_reads_from_disk(tmp_path: Path) -> None:
    blocks = 60
    cache_dir = str(tmp_path / "cache")

    def build() -> Cache[Any]:
        return Cache(rs.from_list(list(range(blocks * 2))), cache_dir, block_size=2)

    first = build()
    assert list(first) == list(range(blocks * 2))
    assert len(os.listdir(cache_dir)) > 0
    with descriptor_limit(blocks // 3):
        cached = build()
        shuffled = list(cached.shuffle(seed=2))
        assert sorted(shuffled) == list(range(blocks * 2))
        assert cached.computed == 0  # every block came from its file, none computed again


@pytest.mark.parametrize(
    ("magic", "remedy"), [(b"\x1f\x8b\x08\x00", "rs.jsonl_stream"), (b"\x28\xb5\x2f\xfd", "decompress")]
)
def test_a_compressed_file_is_refused_by_the_indexed_source(tmp_path: Path, magic: bytes, remedy: str) -> None:
    plain_file = tmp_path / "a.jsonl"
    plain_file.write_text('{"id": 0}\n')
    packed = tmp_path / "b.jsonl.zz"
    packed.write_bytes(magic + b"\x00" * 30)
    for on_error in ("raise", "skip"):
        with pytest.raises(rs.SourceError, match=f"b.jsonl.zz.*{remedy}"):
            rs.jsonl([str(plain_file), str(packed)], on_error=on_error)
