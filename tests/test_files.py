"""WatchedFiles: the one mechanism behind every file source's fingerprints and file checks."""

from __future__ import annotations

import gzip
import os
import zlib
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

import resumable as rs
from resumable.sources import files
from resumable.sources.files import WatchedFiles


def digest_of(path: str) -> str:
    return "test:" + Path(path).read_bytes().hex()


def watched(tmp_path: Path, count: int = 3) -> WatchedFiles:
    paths = []
    for n in range(count):
        path = tmp_path / f"{n}.txt"
        path.write_text(f"file {n}\n")
        paths.append(str(path))
    return WatchedFiles.of("Test", paths, digest_of)


def touch(path: str) -> None:
    info = os.stat(path)
    os.utime(path, ns=(info.st_atime_ns, info.st_mtime_ns + 10**10))


def count_stats(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    seen: list[str] = []
    original = files.stat

    def counting(path: str, kind: str) -> os.stat_result:
        seen.append(os.path.basename(path))
        return original(path, kind)

    monkeypatch.setattr(files, "stat", counting)
    return seen


def test_watch_checks_one_file_per_call_round_robin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(files, "WATCH_INTERVAL", 0)
    files_ = watched(tmp_path)
    seen = count_stats(monkeypatch)
    for _ in range(4):
        files_.watch()
    assert seen == ["0.txt", "1.txt", "2.txt", "0.txt"]
    files_.check_all()
    assert seen[4:] == ["0.txt", "1.txt", "2.txt"]


def test_watch_checks_at_most_once_per_interval(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Loader worker takes a state after every batch: those states must not each cost a stat."""
    monkeypatch.setattr(files, "WATCH_INTERVAL", 3600)
    files_ = watched(tmp_path)
    seen = count_stats(monkeypatch)
    for _ in range(100):
        files_.watch()
    assert seen == ["0.txt"]


def test_changed_files_during_the_run(tmp_path: Path) -> None:
    files_ = watched(tmp_path)
    first, second, third = (f[0] for f in files_.fingerprints)
    before = files_.fingerprints
    touch(first)  # same content: accepted, and the new mtime recorded in a new list
    files_.check(0)
    assert files_.fingerprints[0][2] == os.stat(first).st_mtime_ns
    assert before[0][2] != files_.fingerprints[0][2] and before is not files_.fingerprints
    Path(second).write_text("file 1!\n")
    with pytest.raises(rs.SourceError, match=r"Test: file .*1\.txt. changed during the run \(its size went from 7"):
        files_.check(1)
    Path(third).write_text("file X\n")
    touch(third)
    with pytest.raises(rs.SourceError, match=r"2\.txt' changed during the run \(its mtime .* its content differs\)"):
        files_.check(2)
    os.remove(first)
    with pytest.raises(rs.SourceError, match=r"Test: cannot stat .*0\.txt'"):
        files_.check_all()


def test_restore_checks(tmp_path: Path) -> None:
    saved = watched(tmp_path).fingerprints
    copy = [list(f) for f in saved]
    files_ = WatchedFiles("Test", copy, digest_of)
    files_.check_state(saved, "Node")
    files_.check_state([f[:3] for f in saved], "Node")  # states saved before digests
    copy[0] = [copy[0][0], copy[0][1], copy[0][2] + 1, copy[0][3]]  # another mtime, same digest
    files_.check_state(saved, "Node")
    with pytest.raises(rs.StateError, match="no content digest to compare"):
        files_.check_state([f[:3] for f in saved], "Node")
    copy[1] = [copy[1][0], copy[1][1], copy[1][2], "test:other"]  # same mtime, known other content
    with pytest.raises(rs.StateError, match=r"1\.txt' differs .*same size, other content digest"):
        files_.check_state(saved, "Node")
    copy[1] = list(saved[1])
    copy[2] = [copy[2][0], copy[2][1] + 1, copy[2][2], copy[2][3]]
    with pytest.raises(rs.StateError, match=r"2\.txt' differs .*size 7 -> 8 bytes.*without restoring this state"):
        files_.check_state(saved, "Node")
    with pytest.raises(rs.StateError, match="saved over 2 files, this source has 3"):
        files_.check_state(saved[:2], "Node")


@pytest.mark.parametrize(
    "error",
    [
        OSError(5, "Input/output error"),
        PermissionError(13, "Permission denied"),
        EOFError("Compressed file ended before the end-of-stream marker was reached"),
        gzip.BadGzipFile("Not a gzipped file"),
        zlib.error("Error -3 while decompressing data"),
        pa.ArrowInvalid("Invalid UTF8 sequence"),
        UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"),
    ],
    ids=lambda error: type(error).__name__,
)
def test_read_errors_become_source_errors(error: Exception) -> None:
    with pytest.raises(rs.SourceError, match=rf"where: {type(error).__name__}: ") as raised:
        with files.reading("where"):
            raise error
    assert raised.value.__cause__ is error


def test_other_errors_are_not_read_errors() -> None:
    with pytest.raises(KeyError), files.reading("where"):
        raise KeyError("a bug, not a damaged file")


def test_fingerprint_of_a_missing_file_or_a_failing_digest(tmp_path: Path) -> None:
    with pytest.raises(rs.SourceError, match="cannot stat"):
        files.fingerprint(str(tmp_path / "missing"), digest_of, "Test")

    def failing(path: str) -> Any:
        raise OSError(5, "Input/output error", path)

    (tmp_path / "a").write_text("x")
    with pytest.raises(rs.SourceError, match=r"Test: cannot read .*a'.*OSError"):
        files.fingerprint(str(tmp_path / "a"), failing, "Test")
