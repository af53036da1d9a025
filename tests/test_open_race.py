"""A file replaced between its check and its opening, then put back with its size and mtime
before the next check: the source must not keep what it opened (the replaced bytes, which every
later check of the path would pass), but report a SourceError and open the file again, so every
record comes once the file is back. Forced here by swapping the file (for a valid file of the
same kind holding other records) right after the check that precedes an opening, and putting it
back right before the check of what was opened; every local
file kind, each at the place it opens files (a JSONL map, a Parquet handle, a stream's handle
and its fetches, the Arrow maps of a pickled copy)."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import pytest

import resumable as rs
from resumable.sources import files
from tests.sources import replace_file
from tests.test_watch_adversary import COUNT, file_source, write


class Swapper:
    """Swaps ``path`` for ``other`` (a valid file of the same kind holding other records) once
    its next check has passed, and puts it back (same bytes, same times) when what was opened is
    checked."""

    def __init__(self, path: Path, other: bytes) -> None:
        self.path, self.other = path, other
        self.original, info = path.read_bytes(), os.stat(path)
        self.times = (info.st_atime_ns, info.st_mtime_ns)
        self.armed = True
        self.swapped = False

    def after_check(self, checked: str) -> None:
        if self.armed and checked == str(self.path):
            self.armed = False
            self.swapped = True
            replace_file(self.path, self.other)

    def before_opened_check(self, opened: str) -> None:
        if self.swapped and opened == str(self.path):
            self.swapped = False
            replace_file(self.path, self.original, self.times)


@pytest.fixture
def swapper(monkeypatch: pytest.MonkeyPatch) -> list[Swapper]:
    holder: list[Swapper] = []
    check, check_stat = files.WatchedFiles.check, files.WatchedFiles.check_stat

    def checked(self: files.WatchedFiles, file: int) -> None:
        check(self, file)
        for each in holder:
            each.after_check(self.fingerprints[file][files.NAME])

    def opened_checked(self: files.WatchedFiles, file: int, opened: os.stat_result) -> None:
        for each in holder:
            each.before_opened_check(self.fingerprints[file][files.NAME])
        check_stat(self, file, opened)

    # check_opened (a descriptor) and a mapped file's check both come through check_stat
    monkeypatch.setattr(files.WatchedFiles, "check", checked)
    monkeypatch.setattr(files.WatchedFiles, "check_stat", opened_checked)
    return holder


def other_file(directory: Path, kind: str) -> bytes:
    """The bytes of a file of ``kind`` holding other records (ids from 1000)."""
    folder = directory / "other"
    folder.mkdir(exist_ok=True)
    return write(folder / kind, kind, [{"id": 1000 + index} for index in range(COUNT // 2)]).read_bytes()


def read_all(pipe: rs.Node[Any]) -> tuple[list[int], list[Exception]]:
    got: list[int] = []
    errors: list[Exception] = []
    while len(errors) < 100:
        try:
            got.append(next(pipe)["id"])
        except StopIteration:
            break
        except Exception as error:  # noqa: BLE001 - the type is what is checked
            errors.append(error)
    return got, errors


@pytest.mark.parametrize("kind", ["jsonl", "jsonl_stream", "jsonl_stream_gzip"])
def test_a_file_swapped_between_its_check_and_its_opening_is_opened_again(
    kind: str, tmp_path: Path, swapper: list[Swapper]
) -> None:
    source, paths, expected = file_source(tmp_path, kind)
    first = next(iter(source))["id"]
    swapper.append(Swapper(paths[1], other_file(tmp_path, kind)))  # the second file is not open yet
    got, errors = read_all(source)
    assert swapper[0].armed is False, "the second file was never checked before its opening"
    assert errors and all(type(error) is rs.SourceError for error in errors), errors
    assert "replaced while it was opened" in str(errors[0])
    assert sorted([first, *got]) == sorted(expected)


def test_a_stream_fetch_opens_a_swapped_file_again(tmp_path: Path, swapper: list[Swapper]) -> None:
    """A stream's random-access fetch (what a restoring packer asks) opens the file for the call."""
    kind = "jsonl_stream"
    source, paths, expected = file_source(tmp_path, kind)
    keys = []
    for _ in expected:
        next(source)
        keys.append(source.last_key())
    swapper.append(Swapper(paths[1], other_file(tmp_path, kind)))
    with pytest.raises(rs.SourceError, match="replaced while it was opened"):
        source.fetch_many(keys)
    assert sorted(record["id"] for record in source.fetch_many(keys)) == sorted(expected)


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "arrow", "arrow_stream", "jsonl_stream"])
def test_a_pickled_source_opens_a_swapped_file_again(kind: str, tmp_path: Path, swapper: list[Swapper]) -> None:
    """A pickled copy (a DataLoader worker's) opens its files again on first use: the Arrow and
    Parquet sources only then, since they open every file as they are built."""
    source, paths, expected = file_source(tmp_path, kind)
    copy = pickle.loads(pickle.dumps(source))
    swapper.append(Swapper(paths[1], other_file(tmp_path, kind)))
    got, errors = read_all(copy)
    assert errors and all(type(error) is rs.SourceError for error in errors), errors
    assert sorted(got) == sorted(expected)
