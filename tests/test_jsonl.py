"""JsonlSource: formats, multi-file index space, errors, fingerprints, resume."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

import resumable as rs
from resumable.sources import _sidecar, files, line_index
from resumable.sources import jsonl as jsonl_module
from tests.resume import check_resume, take


def write(path: Path, text: bytes | str) -> str:
    path.write_bytes(text.encode() if isinstance(text, str) else text)
    return str(path)


def records(n: int, start: int = 0) -> str:
    return "".join(json.dumps({"id": i, "text": "x" * (i % 7)}) + "\n" for i in range(start, start + n))


def test_reads_every_record_in_order(tmp_path: Path) -> None:
    path = write(tmp_path / "a.jsonl", records(100))
    source = rs.jsonl(path)
    assert len(source) == 100
    assert [r["id"] for r in source] == list(range(100))
    assert source[57] == {"id": 57, "text": "x" * 1}


def test_line_format_edge_cases(tmp_path: Path) -> None:
    text = b'\xef\xbb\xbf{"id": 0}\r\n\n  \r\n{"id": 1}\n\t\n{"id": 2, "s": "caf\xc3\xa9"}\r\n{"id": 3}'
    source = rs.jsonl(write(tmp_path / "edge.jsonl", text))
    assert list(source) == [{"id": 0}, {"id": 1}, {"id": 2, "s": "café"}, {"id": 3}]
    assert source.stats == {"records": 4, "files": 1, "blank_lines": 3, "skipped": 0}
    assert [source[i]["id"] for i in (3, 0, 2, 1)] == [3, 0, 2, 1]


def test_small_blocks_cross_record_boundaries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jsonl_module, "BLOCK_BYTES", 40)
    text = records(30) + "\n\n" + '{"id": "long", "text": "' + "y" * 500 + '"}\n' + records(5, 30)
    source = rs.jsonl(write(tmp_path / "a.jsonl", text))
    ids = [r["id"] for r in source]
    assert ids == [*range(30), "long", *range(30, 35)]


def test_many_files_form_one_index_space_in_sorted_glob_order(tmp_path: Path) -> None:
    write(tmp_path / "b.jsonl", records(3, 10))
    write(tmp_path / "a.jsonl", records(5, 0))
    write(tmp_path / "c.jsonl", records(2, 20))
    source = rs.jsonl(str(tmp_path / "*.jsonl"))
    assert [r["id"] for r in source] == [0, 1, 2, 3, 4, 10, 11, 12, 20, 21]
    shuffled = rs.jsonl(str(tmp_path / "*.jsonl")).shuffle(1)
    assert sorted(r["id"] for r in shuffled) == [0, 1, 2, 3, 4, 10, 11, 12, 20, 21]
    explicit = rs.jsonl([str(tmp_path / "c.jsonl"), str(tmp_path / "a.jsonl")])
    assert [r["id"] for r in explicit] == [20, 21, 0, 1, 2, 3, 4]


def test_missing_files_and_empty_globs_fail_at_construction(tmp_path: Path) -> None:
    with pytest.raises(rs.SourceError, match="no such file .*missing.jsonl"):
        rs.jsonl(str(tmp_path / "missing.jsonl"))
    with pytest.raises(rs.SourceError, match="no files match"):
        rs.jsonl(str(tmp_path / "*.jsonl"))
    with pytest.raises(rs.SourceError, match="is a directory"):
        rs.jsonl(str(tmp_path))
    with pytest.raises(rs.SourceError, match="no paths given"):
        rs.jsonl([])


def test_empty_and_blank_files(tmp_path: Path) -> None:
    empty = write(tmp_path / "empty.jsonl", "")
    blank = write(tmp_path / "blank.jsonl", "\n \n\r\n")
    with pytest.raises(rs.SourceError, match="no records in .*empty.jsonl"):
        rs.jsonl(empty)
    with pytest.raises(rs.SourceError, match="no records"):
        rs.jsonl(blank)
    full = write(tmp_path / "full.jsonl", records(2))
    assert [r["id"] for r in rs.jsonl([empty, full, blank])] == [0, 1]


def test_malformed_line_names_file_and_line(tmp_path: Path) -> None:
    path = write(tmp_path / "bad.jsonl", '{"id": 0}\n\n{"id": 1}\n{"id": 2,\n{"id": 3}\n')
    source = rs.jsonl(path)
    assert next(source) == {"id": 0} and next(source) == {"id": 1}
    with pytest.raises(rs.SourceError, match=r"bad\.jsonl:4: malformed JSON"):
        next(source)
    with pytest.raises(rs.SourceError, match=r"bad\.jsonl:4"):
        rs.jsonl(path)[2]


def test_non_utf8_bytes_are_a_source_error(tmp_path: Path) -> None:
    path = write(tmp_path / "latin1.jsonl", b'{"id": 0}\n{"s": "caf\xe9"}\n')
    with pytest.raises(rs.SourceError, match=r"latin1\.jsonl:2"):
        list(rs.jsonl(path))


def test_skip_counts_and_logs_malformed_lines(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = write(tmp_path / "bad.jsonl", '{"id": 0}\nnot json\n{"id": 2}\n\xff\n{"id": 4}\n')
    source = rs.jsonl(path, on_error="skip")
    with caplog.at_level("WARNING", logger="resumable"):
        assert [r["id"] for r in source] == [0, 2, 4]
    assert source.stats["skipped"] == 2
    assert "bad.jsonl:2" in caplog.text and "bad.jsonl:4" in caplog.text


def test_long_runs_of_malformed_lines_are_skipped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = write(tmp_path / "bad.jsonl", '{"id": 0}\n' + "garbage\n" * 5000 + '{"id": 1}\n')
    source = rs.jsonl(path, on_error="skip")
    with caplog.at_level("WARNING", logger="resumable"):
        assert [r["id"] for r in source] == [0, 1]
    assert source.stats["skipped"] == 5000
    assert len(caplog.records) == jsonl_module.LOGGED_SKIPS + 1  # then counted, not logged
    assert "bad.jsonl:2:" in caplog.records[0].getMessage()


def test_skip_resumes_exactly(tmp_path: Path) -> None:
    lines = [json.dumps({"id": i}) if i % 4 else "{broken" for i in range(40)]
    path = write(tmp_path / "bad.jsonl", "\n".join(lines) + "\n")

    def build() -> rs.Node:
        return rs.jsonl(path, on_error="skip").shuffle(3)

    for k in (0, 5, 29, 30, 31, 45, 60):
        check_resume(build, k, 60)


def test_invalid_on_error() -> None:
    with pytest.raises(rs.ConfigError, match="on_error must be one of"):
        rs.jsonl("x.jsonl", on_error="ignore")


def test_changed_file_on_resume_is_a_state_error(tmp_path: Path) -> None:
    path = write(tmp_path / "a.jsonl", records(20))
    source = rs.jsonl(path)
    take(source, 3)
    state = source.get_state()
    write(tmp_path / "a.jsonl", records(21))
    with pytest.raises(rs.StateError, match=r"JsonlSource: file .*a\.jsonl' differs from the file the state was taken"):
        rs.jsonl(path).set_state(state)


def test_other_files_on_resume_is_a_state_error(tmp_path: Path) -> None:
    first = write(tmp_path / "a.jsonl", records(20))
    second = write(tmp_path / "b.jsonl", records(20))
    pipe = rs.jsonl(first).shuffle(0)
    take(pipe, 3)
    with pytest.raises(rs.StateError, match=r"Shuffle > JsonlSource: state was saved over file .*a\.jsonl"):
        rs.jsonl(second).shuffle(0).set_state(pipe.get_state())
    with pytest.raises(rs.StateError, match="saved over 1 files, this source has 2"):
        rs.jsonl([first, second]).shuffle(0).set_state(pipe.get_state())


def test_moved_data_directory_still_resumes(tmp_path: Path) -> None:
    """Fingerprints compare file names, sizes and mtimes, not directories: jobs that stage
    data into a per-job directory (preserving mtimes) still resume."""
    (tmp_path / "old").mkdir()
    path = write(tmp_path / "old" / "a.jsonl", records(30))
    pipe = rs.jsonl(path)
    take(pipe, 4)
    state = pipe.get_state()
    os.rename(tmp_path / "old", tmp_path / "new")
    resumed = rs.jsonl(str(tmp_path / "new" / "a.jsonl"))
    resumed.set_state(state)
    assert next(resumed)["id"] == 4


@pytest.mark.parametrize("chain", ["plain", "shuffle", "shard", "shuffle_shard_map"])
def test_resume_property(tmp_path: Path, chain: str) -> None:
    write(tmp_path / "a.jsonl", records(37))
    write(tmp_path / "b.jsonl", "\n" + records(24, 100) + "\n\n")
    pattern = str(tmp_path / "*.jsonl")

    def build() -> rs.Node:
        source = rs.jsonl(pattern)
        if chain == "shuffle":
            return source.shuffle(5)
        if chain == "shard":
            return source.shard(1, 2)
        if chain == "shuffle_shard_map":
            return source.shuffle(5).shard(0, 3).map(lambda r: r["id"])
        return source

    total = 3 * 61
    for k in (0, 1, 17, 36, 37, 38, 60, 61, 62, 130, total):
        check_resume(build, k, total)
    check_resume(build, 10, total, k2=90)


@given(
    ids=st.lists(st.integers(0, 10**6), min_size=1, max_size=40),
    blank_after=st.lists(st.booleans(), min_size=40, max_size=40),
    crlf=st.booleans(),
    bom=st.booleans(),
    final_newline=st.booleans(),
    block=st.integers(8, 200),
    data=st.data(),
)
def test_any_file_layout_reads_and_resumes(
    tmp_path_factory: pytest.TempPathFactory,
    ids: list[int],
    blank_after: list[bool],
    crlf: bool,
    bom: bool,
    final_newline: bool,
    block: int,
    data: st.DataObject,
) -> None:
    newline = "\r\n" if crlf else "\n"
    parts = []
    for i, value in enumerate(ids):
        parts.append(json.dumps({"id": value}) + newline + (newline if blank_after[i] else ""))
    text = "".join(parts)
    if not final_newline:
        text = text.rstrip("\r\n")
    path = tmp_path_factory.mktemp("layout") / "data.jsonl"
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + text.encode())
    original_block = jsonl_module.BLOCK_BYTES
    jsonl_module.BLOCK_BYTES = block
    try:
        assert [r["id"] for r in rs.jsonl(str(path))] == ids
        k = data.draw(st.integers(0, 2 * len(ids)))
        check_resume(lambda: rs.jsonl(str(path)), k, 2 * len(ids))
    finally:
        jsonl_module.BLOCK_BYTES = original_block


def test_pickles_without_memory_maps_and_reopens(tmp_path: Path) -> None:
    path = write(tmp_path / "a.jsonl", records(50))
    pipe = rs.jsonl(path).shuffle(2)
    head = take(pipe, 10)
    clone = pickle.loads(pickle.dumps(pipe))
    assert take(clone, 40) == take(pipe, 40)
    assert len(head) == 10


def test_read_only_data_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The index goes to the cache directory; a job that resumes there reads it back.
    Tests may run as root, which writes anywhere, so the read-only directory is simulated."""
    data = tmp_path / "data"
    data.mkdir()
    path = write(data / "a.jsonl", records(10))
    cache = tmp_path / "cache"
    monkeypatch.setenv("RESUMABLE_CACHE_DIR", str(cache))
    write_atomically = _sidecar.write_atomically

    def refuse_data_dir(path: str, write: Any) -> None:
        if Path(path).parent.resolve() == data.resolve():
            raise PermissionError(13, "Permission denied", str(data))
        write_atomically(path, write)

    monkeypatch.setattr(_sidecar, "write_atomically", refuse_data_dir)
    pipe = rs.jsonl(path).shuffle(1)
    head = take(pipe, 4)
    assert not (data / "a.jsonl.rsidx").exists()
    assert [p.suffix for p in cache.iterdir()] == [".rsidx"]
    resumed = rs.jsonl(path).shuffle(1)
    resumed.set_state(pipe.get_state())
    assert sorted(r["id"] for r in head + take(resumed, 6)) == list(range(10))


def test_records_are_orjson_values(tmp_path: Path) -> None:
    path = write(tmp_path / "a.jsonl", '[1, 2]\n"text"\n3.5\nnull\n{"nested": {"k": [true]}}\n')
    assert list(rs.jsonl(path)) == [[1, 2], "text", 3.5, None, {"nested": {"k": [True]}}]


# -- file identity: restores over unchanged content, changes during the run ------------------------


def touch(path: str, seconds: int = 10) -> None:
    """Move the mtime ``seconds`` forward, as ``touch`` or a ``cp`` without ``-p`` would."""
    info = os.stat(path)
    os.utime(path, ns=(info.st_atime_ns, info.st_mtime_ns + seconds * 10**9))


def test_touched_or_copied_unchanged_file_still_restores(tmp_path: Path) -> None:
    """Regression: a touch, or a cp without -p, of unchanged data made every checkpoint
    unrestorable. Same size, other mtime: the content digests (stored with the line index)
    are compared, and they match."""
    path = write(tmp_path / "a.jsonl", records(30))
    pipe = rs.jsonl(path).shuffle(1)
    take(pipe, 7)
    state = pipe.get_state()
    expected = take(pipe, 23)
    touch(path)
    touched = rs.jsonl(path).shuffle(1)
    touched.set_state(state)
    assert take(touched, 23) == expected
    (tmp_path / "copy").mkdir()
    copy = str(tmp_path / "copy" / "a.jsonl")
    shutil.copy(path, copy)  # content and permissions, not the mtime
    copied = rs.jsonl(copy).shuffle(1)
    copied.set_state(state)
    assert take(copied, 23) == expected


def test_same_size_other_content_is_a_state_error(tmp_path: Path) -> None:
    path = write(tmp_path / "a.jsonl", records(30))
    pipe = rs.jsonl(path)
    take(pipe, 3)
    state = pipe.get_state()
    write(tmp_path / "a.jsonl", records(30).replace('"id": 1,', '"id": 7,'))
    touch(path)
    with pytest.raises(rs.StateError, match=r"a\.jsonl' differs .*same size, other content digest.*without restoring"):
        rs.jsonl(path).set_state(state)


def test_states_with_three_entry_fingerprints_still_load(tmp_path: Path) -> None:
    path = write(tmp_path / "a.jsonl", records(30))
    pipe = rs.jsonl(path)
    take(pipe, 4)
    state = pipe.get_state()
    assert state["files"][0][:3] == [path, os.path.getsize(path), os.stat(path).st_mtime_ns]
    assert state["files"][0][3].startswith("jsonl-content-xxh3_64:")
    legacy = dict(state, files=[fingerprint[:3] for fingerprint in state["files"]])
    resumed = rs.jsonl(path)
    resumed.set_state(legacy)
    assert next(resumed)["id"] == 4
    touch(path)  # an old state has no digest to excuse another mtime
    with pytest.raises(rs.StateError, match="no content digest to compare"):
        rs.jsonl(path).set_state(legacy)


@pytest.mark.parametrize(
    "fingerprint",
    [["a.jsonl", 1], ["a.jsonl", 1, 2, 3], ["a.jsonl", True, 2, None], ["a.jsonl", 1, 2, None, 5], "a.jsonl"],
)
def test_malformed_fingerprints_are_state_errors(tmp_path: Path, fingerprint: Any) -> None:
    path = write(tmp_path / "a.jsonl", records(5))
    state = rs.jsonl(path).get_state()
    with pytest.raises(rs.StateError, match="malformed file fingerprint"):
        rs.jsonl(path).set_state(dict(state, files=[fingerprint]))


def test_file_appended_during_the_run_is_caught_at_get_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: an append during a run was noticed only at the next resume, whose message
    said the file changed since the state was saved. Now get_state() stats one file per call."""
    monkeypatch.setattr(files, "WATCH_INTERVAL", 0)
    first = write(tmp_path / "a.jsonl", records(10))
    second = write(tmp_path / "b.jsonl", records(10, 10))
    pipe = rs.jsonl([first, second]).shuffle(0)
    take(pipe, 3)
    with open(second, "a") as out:
        out.write(records(1, 20))
    with pytest.raises(rs.SourceError, match=r"b\.jsonl' changed during the run \(its size went from .*; restore"):
        for _ in range(2):  # round robin over the two files
            pipe.get_state()


def test_file_changed_during_the_run_is_caught_at_the_next_epoch_and_read(tmp_path: Path) -> None:
    path = write(tmp_path / "a.jsonl", records(10))
    pipe = rs.jsonl(path)
    assert len(list(pipe)) == 10
    write(tmp_path / "a.jsonl", records(12))
    with pytest.raises(rs.SourceError, match="changed during the run"):
        iter(pipe)  # the next epoch starts
    fresh = rs.jsonl(path)
    write(tmp_path / "a.jsonl", records(11))
    with pytest.raises(rs.SourceError, match="changed during the run"):
        next(fresh)


def test_touch_during_the_run_is_accepted_and_recorded(tmp_path: Path) -> None:
    path = write(tmp_path / "a.jsonl", records(20))
    pipe = rs.jsonl(path)
    head = take(pipe, 5)
    touch(path)
    state = pipe.get_state()
    assert state["files"][0][2] == os.stat(path).st_mtime_ns
    rest = take(pipe, 15)
    resumed = rs.jsonl(path)
    resumed.set_state(state)
    assert head + take(resumed, 15) == head + rest == list(rs.jsonl(path))


def test_removed_or_unreadable_file_is_a_source_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: a file removed after construction gave a bare FileNotFoundError."""
    first = write(tmp_path / "a.jsonl", records(5))
    second = write(tmp_path / "b.jsonl", records(5, 5))
    source = rs.jsonl([first, second])
    take(source, 2)
    os.remove(second)
    with pytest.raises(rs.SourceError, match=r"b\.jsonl"):
        take(source, 10)

    def refuse(path: str, *args: Any) -> Any:
        raise PermissionError(13, "Permission denied", path)

    source = rs.jsonl(first)
    monkeypatch.setattr(jsonl_module, "open", refuse, raising=False)
    with pytest.raises(rs.SourceError, match=r"cannot read .*a\.jsonl'.*PermissionError"):
        next(source)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root reads files whatever their mode")
def test_file_made_unreadable_is_a_source_error(tmp_path: Path) -> None:
    path = write(tmp_path / "a.jsonl", records(5))
    source = rs.jsonl(path)
    os.chmod(path, 0)
    try:
        with pytest.raises(rs.SourceError, match=r"a\.jsonl"):
            next(source)
    finally:
        os.chmod(path, 0o644)


def test_corrupt_sidecar_never_fails_valid_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: one changed offset in the sidecar body made valid data fail as malformed JSON."""
    monkeypatch.setattr(_sidecar, "BLOCK_ENTRIES", 8)
    path = write(tmp_path / "a.jsonl", records(100))
    expected = list(rs.jsonl(path))
    sidecar = Path(path + ".rsidx")
    stored = bytearray(sidecar.read_bytes())
    for entry in (3, 50, 97):
        at = _sidecar.HEADER.size + 8 * entry
        stored[at] ^= 0x05
    sidecar.write_bytes(bytes(stored))
    with pytest.warns(line_index.SidecarWarning, match="is corrupt"):
        assert list(rs.jsonl(path)) == expected
    sidecar.write_bytes(bytes(stored))
    with pytest.warns(line_index.SidecarWarning, match="is corrupt"):
        shuffled = list(rs.jsonl(path).shuffle(4))
    assert sorted(shuffled, key=lambda r: r["id"]) == expected


@given(
    lines=st.lists(
        st.one_of(
            st.integers(0, 10**6).map(lambda value: json.dumps({"id": value})),
            st.sampled_from(["{bad", '{"id": 1', "[1, 2", "nul"]),  # malformed records
            st.sampled_from(["", "  ", "\t", "\r"]),  # blank lines (JSON whitespace only)
        ),
        min_size=1,
        max_size=60,
    ),
    data=st.data(),
)
def test_malformed_records_inside_decode_runs_raise_or_skip_exactly(
    tmp_path_factory: pytest.TempPathFactory, lines: list[str], data: st.DataObject
) -> None:
    """Small records are decoded in runs of up to 128 at once: a malformed record in a run must
    still be raised at its own line, after every record before it, or skipped and counted."""
    path = tmp_path_factory.mktemp("malformed") / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")
    valid, first_bad = [], None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            valid.append(json.loads(line))
        except json.JSONDecodeError:
            first_bad = first_bad or number
    assume(valid or first_bad is not None)  # a file of blank lines has no records (tested elsewhere)
    if first_bad is not None:
        seen = []
        with pytest.raises(rs.SourceError, match=rf"data\.jsonl:{first_bad}: malformed JSON record"):
            for record in rs.jsonl(str(path)):
                seen.append(record)
        assert seen == valid[: len(seen)] and len(seen) == sum(1 for line in lines[: first_bad - 1] if line.strip())
    skipping = rs.jsonl(str(path), on_error="skip")
    assert list(skipping) == valid
    assert skipping.stats["skipped"] == sum(1 for line in lines if line.strip()) - len(valid)
    if valid:
        k = data.draw(st.integers(0, 2 * len(valid)))
        check_resume(lambda: rs.jsonl(str(path), on_error="skip"), k, 2 * len(valid))
