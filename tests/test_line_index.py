"""LineIndex against a pure-Python reference, plus sidecar freshness, integrity, fallbacks and errors."""

from __future__ import annotations

import concurrent.futures
import json
import os
import stat
import warnings
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from resumable.errors import ConfigError, SourceError
from resumable.sources import _line_scan, _sidecar, line_index
from resumable.sources._sidecar import BLOCK_ENTRIES, HEADER, SIDECAR_SUFFIX, SidecarWarning
from resumable.sources.line_index import CONTENT_DIGEST, LineIndex

BOM = b"\xef\xbb\xbf"


def reference(data: bytes) -> tuple[list[int], list[int], int, bool]:
    """(starts, 1-based line numbers, blank lines, has_bom) computed the obvious way."""
    has_bom = data.startswith(BOM)
    position = len(BOM) if has_bom else 0
    lines: list[tuple[int, bytes]] = []
    while position < len(data):
        end = data.find(b"\n", position)
        end = len(data) if end < 0 else end
        lines.append((position, data[position:end]))
        position = end + 1
    numbered = [(start, number) for number, (start, text) in enumerate(lines, 1) if text.strip(b" \t\r")]
    starts = [start for start, _ in numbered] + [len(data)]
    return starts, [number for _, number in numbered], len(lines) - len(numbered), has_bom


def write(tmp_path: Path, data: bytes, name: str = "data.jsonl") -> str:
    path = tmp_path / name
    path.write_bytes(data)
    return str(path)


def check(index: LineIndex, data: bytes, *, line_numbers: bool = True) -> None:
    starts, numbers, blank_lines, has_bom = reference(data)
    assert index.offsets(0, len(starts)).tolist() == starts  # verified reads first: they may rebuild
    backwards = np.arange(len(starts) - 1, dtype=np.int64)[::-1]
    assert [bounds.tolist() for bounds in index.spans(backwards)] == [starts[-2::-1], starts[:0:-1]]
    assert index.starts.dtype == np.uint64
    assert index.starts.tolist() == starts
    assert index.num_records == len(index) == len(starts) - 1
    assert index.blank_lines == blank_lines
    assert index.has_bom is has_bom
    assert index.size == len(data)
    assert index.content_digest == f"{CONTENT_DIGEST}:{xxhash.xxh3_64_intdigest(data):016x}"
    if line_numbers:
        assert [index.line_number(i) for i in range(len(index))] == numbers


CASES = {
    "normal": b'{"a": 1}\n{"b": 2}\n{"c": 3}\n',
    "no_final_newline": b'{"a": 1}\n{"b": 2}',
    "blank_start": b'\n\n  \n{"a": 1}\n{"b": 2}\n',
    "blank_middle": b'{"a": 1}\n\n \t \n\r\n{"b": 2}\n',
    "blank_end": b'{"a": 1}\n{"b": 2}\n\n  \n\r\n',
    "blank_end_no_newline": b'{"a": 1}\n \t',
    "crlf": b'{"a": 1}\r\n{"b": 2}\r\n\r\n{"c": 3}',
    "bom": BOM + b'{"a": 1}\n{"b": 2}\n',
    "bom_then_blank": BOM + b'\r\n \n{"a": 1}\n',
    "bom_only": BOM,
    "only_blank": b"\n \n\t\t\n\r\n  \r \n",
    "only_newlines": b"\n\n\n",
    "empty": b"",
    "single_record": b'{"a": 1}',
    "single_record_newline": b'{"a": 1}\n',
    "single_char_records": b"1\n2\n\n3",
    "whitespace_led_records": b'   {"a": 1}\n' + b" " * 40 + b'{"b": 2}\n' + b" " * 40 + b"\n\t1\n",
    "long_blank_lines": b'{"a": 1}\n' + b" \t" * 100 + b"\n" + b"\r" * 17 + b"\n2\n",
    "not_utf8": b"\xff\xfe\x00\n\x80abc\n",
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("chunk_size", [1, 2, 3, 7, 1 << 20])
def test_matches_reference(tmp_path: Path, name: str, chunk_size: int) -> None:
    data = CASES[name]
    check(LineIndex.build(write(tmp_path, data), chunk_size=chunk_size), data)


def test_records_are_json_with_trailing_blank_lines(tmp_path: Path) -> None:
    data = b'\n{"a": 1}\r\n \r\n{"b": [2, 3]}\n\t\n\n{"c": "x"}'
    index = LineIndex.build(write(tmp_path, data), chunk_size=4)
    records = [json.loads(data[index.starts[i] : index.starts[i + 1]]) for i in range(len(index))]
    assert records == [{"a": 1}, {"b": [2, 3]}, {"c": "x"}]


def test_lines_longer_than_chunk(tmp_path: Path) -> None:
    long_record = b'{"text": "' + b"x" * 1000 + b'"}'
    data = long_record + b"\n" + b" " * 500 + b"\n" + long_record + b"\r\n" + long_record
    for chunk_size in (8, 64, 999, 1000, 1001):
        index = LineIndex.build(write(tmp_path, data), chunk_size=chunk_size)
        check(index, data)
        assert index.num_records == 3


def test_crlf_split_across_chunks(tmp_path: Path) -> None:
    data = b'{"a"}\r\n\r\n{"b"}\r\n'
    assert data[5:7] == b"\r\n"
    index = LineIndex.build(write(tmp_path, data), chunk_size=6)  # "\r" ends chunk 1, "\n" starts chunk 2
    check(index, data)
    assert bytes(data[int(index.starts[0]) : int(index.starts[1])]) == b'{"a"}\r\n\r\n'


def test_blank_line_spanning_chunks_after_record(tmp_path: Path) -> None:
    data = b"1\n" + b" " * 10 + b"\n2" + b" " * 10 + b"\n"
    for chunk_size in range(1, len(data) + 1):
        check(LineIndex.build(write(tmp_path, data), chunk_size=chunk_size), data)


@pytest.mark.parametrize("steps", [1, 2, 16])
def test_blank_lines_past_the_vectorised_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, steps: int) -> None:
    monkeypatch.setattr(_line_scan, "BLANK_STEPS", steps)
    data = b"".join([b" \n", b" 1\n", b"\t\r\n", b"  x\r\n", b" " * 30 + b"\n", b" " * 30 + b"y\n"] * 5)
    check(LineIndex.build(write(tmp_path, data), chunk_size=16), data)


def test_progress_reports_every_byte(tmp_path: Path) -> None:
    data = BOM + b'{"a": 1}\n' * 100
    calls: list[int] = []
    LineIndex.build(write(tmp_path, data), progress=calls.append, chunk_size=64)
    assert sum(calls) == len(data)
    assert len(calls) > 1 and all(c > 0 for c in calls)


def test_bom_only_progress(tmp_path: Path) -> None:
    calls: list[int] = []
    LineIndex.build(write(tmp_path, BOM), progress=calls.append)
    assert calls == [3]


def test_default_chunk_size_is_read_at_call_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(line_index, "CHUNK_SIZE", 5)
    data = b'{"a": 1}\n\n{"b": 2}\n'
    calls: list[int] = []
    check(LineIndex.open(write(tmp_path, data), progress=calls.append), data)
    assert len(calls) == 4


@pytest.mark.parametrize("chunk_size", [0, -1, 1.5, True])
def test_bad_chunk_size(tmp_path: Path, chunk_size: object) -> None:
    with pytest.raises(ConfigError):
        LineIndex.build(write(tmp_path, b"1\n"), chunk_size=chunk_size)  # type: ignore[arg-type]  # deliberately wrong, to test the check


def test_benchmark_corpus(tmp_path: Path) -> None:
    from bench.corpus import make_jsonl_corpus

    path = make_jsonl_corpus(str(tmp_path / "corpus.jsonl"), 300_000, seed=3)
    data = Path(path).read_bytes()
    assert len(data) >= 300_000
    index = LineIndex.build(path, chunk_size=4096)
    check(index, data, line_numbers=False)
    records = [json.loads(data[index.starts[i] : index.starts[i + 1]]) for i in range(len(index))]
    assert [record["id"] for record in records] == list(range(len(index)))
    assert all(record["text"] for record in records)
    again = make_jsonl_corpus(str(tmp_path / "again.jsonl"), 300_000, seed=3)
    assert Path(again).read_bytes() == data  # deterministic for a seed


# ---------------------------------------------------------------------------------------------
# Random files.

blank_line = st.one_of(
    st.sampled_from([b"", b" ", b"\t", b"\r", b" \r", b" " * 16, b" " * 17, b"\t" * 40]),
    st.text(alphabet=" \t\r", max_size=24).map(str.encode),
)
record_line = st.tuples(
    st.text(alphabet=" \t\r", max_size=20).map(str.encode),  # leading whitespace, sometimes long
    st.binary(min_size=1, max_size=30).map(lambda b: b.replace(b"\n", b"x")).filter(lambda b: b.strip(b" \t\r") != b""),
).map(b"".join)
line = st.one_of(record_line, blank_line)


@st.composite
def jsonl_files(draw: st.DrawFn) -> bytes:
    lines = draw(st.lists(line, max_size=30))
    endings = draw(st.lists(st.sampled_from([b"\n", b"\r\n"]), min_size=len(lines), max_size=len(lines)))
    data = b"".join(text + ending for text, ending in zip(lines, endings, strict=True))
    if lines and not draw(st.booleans()):  # drop the final line ending
        data = data[: -len(endings[-1])]
    return (BOM if draw(st.booleans()) else b"") + data


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=jsonl_files(), chunk_size=st.integers(1, 40))
def test_random_files_match_reference(tmp_path: Path, data: bytes, chunk_size: int) -> None:
    check(LineIndex.build(write(tmp_path, data), chunk_size=chunk_size), data)


# ---------------------------------------------------------------------------------------------
# Sidecar.

DATA = b'{"a": 1}\n\n{"b": 2}\r\n{"c": 3}\n'


def forbid_build(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: object, **kwargs: object) -> LineIndex:
        raise AssertionError("index was rebuilt")

    monkeypatch.setattr(LineIndex, "build", classmethod(fail))


def count_builds(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    original = LineIndex.build.__func__  # type: ignore[attr-defined]  # the function behind the classmethod, to wrap it

    def counting(cls: type[LineIndex], path: str, *args: object, **kwargs: object) -> LineIndex:
        calls.append(path)
        return original(cls, path, *args, **kwargs)

    monkeypatch.setattr(LineIndex, "build", classmethod(counting))
    return calls


def test_open_writes_sidecar_and_reuses_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path, DATA)
    first = LineIndex.open(path, cache_dir=str(tmp_path / "cache"))
    check(first, DATA)
    assert first.sidecar == path + SIDECAR_SUFFIX
    assert first.mapped
    entries = first.num_records + 1
    assert os.path.getsize(first.sidecar) == HEADER.size + 8 * entries + 8 * -(-entries // BLOCK_ENTRIES)
    assert not (tmp_path / "cache").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith((".tmp", ".partial"))] == []
    mtime = os.stat(first.sidecar).st_mtime_ns

    forbid_build(monkeypatch)
    calls: list[int] = []
    second = LineIndex.open(path, cache_dir=str(tmp_path / "cache"), progress=calls.append)
    assert calls == []  # nothing read
    check(second, DATA)
    assert second.mapped
    assert second.sidecar == first.sidecar
    assert os.stat(second.sidecar).st_mtime_ns == mtime


def test_rebuilt_when_mtime_changes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path, DATA)
    LineIndex.open(path)
    info = os.stat(path)
    os.utime(path, ns=(info.st_atime_ns, info.st_mtime_ns + 1_000_000_000))
    builds = count_builds(monkeypatch)
    index = LineIndex.open(path)
    assert builds == [path]
    assert index.mtime_ns == info.st_mtime_ns + 1_000_000_000
    check(index, DATA)
    assert LineIndex.open(path).mtime_ns == index.mtime_ns and builds == [path]


def test_rebuilt_when_content_changes_same_mtime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path, DATA)
    LineIndex.open(path)
    info = os.stat(path)
    changed = DATA + b'{"d": 4}\n'
    Path(path).write_bytes(changed)
    os.utime(path, ns=(info.st_atime_ns, info.st_mtime_ns))  # only the size tells
    builds = count_builds(monkeypatch)
    check(LineIndex.open(path), changed)
    assert builds == [path]


def corruptions(sidecar: bytes) -> dict[str, bytes]:
    """Damage a sidecar's header or size: caught when it is opened."""
    flipped_header = bytearray(sidecar)
    flipped_header[30] ^= 0xFF  # inside the data mtime: caught by the header checksum
    bad_last = bytearray(sidecar)
    entries = (len(sidecar) - HEADER.size) // 8 - 1  # one block here: entries, then one checksum
    bad_last[HEADER.size + 8 * (entries - 1) : HEADER.size + 8 * entries] = (10**6).to_bytes(8, "little")
    return {
        "empty": b"",
        "short_header": sidecar[:10],
        "header_only": sidecar[: HEADER.size],
        "truncated_body": sidecar[:-3],
        "extra_bytes": sidecar + b"\x00" * 8,
        "bad_magic": b"X" + sidecar[1:],
        "flipped_header": bytes(flipped_header),
        "bad_last_entry": bytes(bad_last),
        "garbage": os.urandom(len(sidecar)),
    }


@pytest.mark.parametrize("kind", sorted(corruptions(b"\x00" * 100)))
def test_corrupt_sidecar_is_rebuilt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    path = write(tmp_path, DATA)
    sidecar = LineIndex.open(path).sidecar
    assert sidecar is not None
    Path(sidecar).write_bytes(corruptions(Path(sidecar).read_bytes())[kind])
    builds = count_builds(monkeypatch)
    with pytest.warns(SidecarWarning, match="is corrupt"):
        index = LineIndex.open(path)
    assert builds == [path]
    check(index, DATA)
    assert index.sidecar == sidecar
    forbid_build(monkeypatch)
    check(LineIndex.open(path), DATA)  # the rebuilt sidecar is good


def rewrite_offsets(sidecar: str, change: Callable[[np.ndarray], None], *, checksums: bool = False) -> None:
    """Apply ``change`` to the stored offsets of ``sidecar`` in place, leaving the header as it
    is; with ``checksums``, store matching block checksums too (a consistent but wrong index)."""
    data = bytearray(Path(sidecar).read_bytes())
    entries = HEADER.unpack_from(data)[5] + 1
    starts = np.frombuffer(data, dtype="<u8", count=entries, offset=HEADER.size).copy()
    change(starts)
    data[HEADER.size : HEADER.size + 8 * entries] = starts.tobytes()
    if checksums:
        data[HEADER.size + 8 * entries :] = _sidecar.block_checksums(starts).tobytes()
    Path(sidecar).write_bytes(bytes(data))


def many_records(count: int) -> bytes:
    return b"".join(b'{"i": %d}\n' % i for i in range(count))


def test_corrupt_offset_in_body_is_rebuilt_not_trusted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: one changed offset in the body passed the header checks, and valid data
    then failed as malformed JSON. Each block has a checksum, verified on first use."""
    data = many_records(40)
    path = write(tmp_path, data)
    sidecar = LineIndex.open(path).sidecar
    assert sidecar is not None

    def shift(starts: np.ndarray) -> None:
        starts[17] += 3

    rewrite_offsets(sidecar, shift)
    builds = count_builds(monkeypatch)
    index = LineIndex.open(path)
    assert builds == []  # opening stays O(1): the body is not read
    with pytest.warns(SidecarWarning, match="block 0 of its offsets fails its checksum"):
        assert index.offsets(17, 19).tolist() == reference(data)[0][17:19]
    assert builds == [path]
    check(index, data)
    forbid_build(monkeypatch)
    check(LineIndex.open(path), data)  # rewritten on disk


@pytest.mark.parametrize("entry", [0, -1], ids=["first_before_the_bom", "last_not_the_size"])
def test_offsets_outside_the_file_are_caught_at_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, entry: int
) -> None:
    """The structural checks at open hold even for a sidecar whose checksums match."""
    data = BOM + many_records(12)
    path = write(tmp_path, data)
    sidecar = LineIndex.open(path).sidecar
    assert sidecar is not None
    outside = 0 if entry == 0 else len(data) + 1
    rewrite_offsets(sidecar, lambda starts: starts.__setitem__(entry, outside), checksums=True)
    builds = count_builds(monkeypatch)
    with pytest.warns(SidecarWarning, match="first or last offset lies outside the data file"):
        check(LineIndex.open(path), data)
    assert builds == [path]


def test_blocks_are_verified_once_and_only_when_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_sidecar, "BLOCK_ENTRIES", 4)
    data = many_records(50)  # 51 entries: 13 blocks
    path = write(tmp_path, data)
    sidecar = LineIndex.open(path).sidecar
    assert sidecar is not None and os.path.getsize(sidecar) == HEADER.size + 8 * 51 + 8 * 13

    def corrupt_block_9(starts: np.ndarray) -> None:
        starts[38] += 1

    rewrite_offsets(sidecar, corrupt_block_9)
    builds = count_builds(monkeypatch)
    index = LineIndex.open(path)
    expected = reference(data)[0]
    assert index._unverified == 13
    assert index.offsets(0, 10).tolist() == expected[:10]  # blocks 0-2
    assert index.spans(np.array([45, 12, 13], dtype=np.int64))[0].tolist() == [expected[i] for i in (45, 12, 13)]
    assert index._unverified == 8 and builds == []
    assert index.offsets(0, 10).tolist() == expected[:10]  # verified blocks are not checked again
    with pytest.warns(SidecarWarning, match="block 9 "):
        assert index.spans(np.array([37, 39], dtype=np.int64))[1].tolist() == [expected[38], expected[40]]
    assert builds == [path] and index._unverified == 0
    check(index, data)


def test_corrupt_block_checksum_is_rebuilt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = many_records(30)
    path = write(tmp_path, data)
    sidecar = LineIndex.open(path).sidecar
    assert sidecar is not None
    stored = bytearray(Path(sidecar).read_bytes())
    stored[-1] ^= 0x01  # the last (only) block checksum
    Path(sidecar).write_bytes(bytes(stored))
    with pytest.warns(SidecarWarning, match="fails its checksum"):
        check(LineIndex.open(path), data)


def test_old_format_sidecar_is_rebuilt_silently(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path, DATA)
    sidecar = LineIndex.open(path).sidecar
    assert sidecar is not None
    stored = bytearray(Path(sidecar).read_bytes())
    stored[8:12] = (1).to_bytes(4, "little")  # format version 1: header CRC-32, no checksums
    Path(sidecar).write_bytes(bytes(stored[:64]) + bytes(stored[HEADER.size : HEADER.size + 8 * 4]))
    builds = count_builds(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        index = LineIndex.open(path)
    assert builds == [path]
    check(index, DATA)
    assert HEADER.unpack_from(Path(sidecar).read_bytes())[1] == _sidecar.FORMAT_VERSION


def test_rebuild_of_a_file_changed_during_the_run_is_a_source_error(tmp_path: Path) -> None:
    data = many_records(20)
    path = write(tmp_path, data)
    sidecar = LineIndex.open(path).sidecar
    assert sidecar is not None
    rewrite_offsets(sidecar, lambda starts: starts.__setitem__(5, starts[5] + 1))
    index = LineIndex.open(path)
    info = os.stat(path)
    Path(path).write_bytes(data.replace(b'"i": 1', b'"j": 1'))  # same size
    os.utime(path, ns=(info.st_atime_ns, info.st_mtime_ns))
    with pytest.warns(SidecarWarning), pytest.raises(SourceError, match="changed during the run"):
        index.offsets(0, 10)


def test_content_digest_is_kept_in_the_sidecar(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = BOM + DATA
    path = write(tmp_path, data)
    built = LineIndex.open(path)
    forbid_build(monkeypatch)
    loaded = LineIndex.open(path)
    assert loaded.content_digest == built.content_digest == line_index.content_digest(path)
    assert loaded.content_digest == f"{CONTENT_DIGEST}:{xxhash.xxh3_64_intdigest(data):016x}"


def test_sidecar_keeps_bom_and_blank_counts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = BOM + b"\n \n" + DATA + b"\n\n"
    path = write(tmp_path, data)
    LineIndex.open(path)
    forbid_build(monkeypatch)
    check(LineIndex.open(path), data)


@pytest.mark.parametrize("data", [b"", b"\n\n \n", BOM])
def test_sidecar_without_records(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, data: bytes) -> None:
    path = write(tmp_path, data)
    check(LineIndex.open(path), data)
    forbid_build(monkeypatch)
    loaded = LineIndex.open(path)
    check(loaded, data)
    assert loaded.num_records == 0 and loaded.sidecar is not None


def refuse_dir(monkeypatch: pytest.MonkeyPatch, refused: list[Path] | None) -> None:
    """Make temp-file creation fail in the ``refused`` dirs (everywhere when None), as if read-only.

    Tests may run as root, which writes into 0o555 directories, so permissions are simulated.
    """
    original = _sidecar.write_atomically

    def write_atomically(path: str, write: Any) -> None:
        directory = Path(path).parent
        if refused is None or directory.resolve() in {r.resolve() for r in refused}:
            raise PermissionError(13, "Permission denied", str(directory))
        original(path, write)

    monkeypatch.setattr(_sidecar, "write_atomically", write_atomically)


def test_read_only_dir_falls_back_to_cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    path = write(data_dir, DATA)
    cache = tmp_path / "cache"
    refuse_dir(monkeypatch, [data_dir])
    index = LineIndex.open(path, cache_dir=str(cache))
    check(index, DATA)
    assert index.sidecar is not None and Path(index.sidecar).parent == cache
    assert Path(index.sidecar).name.startswith("data.jsonl.") and index.sidecar.endswith(SIDECAR_SUFFIX)
    assert not Path(path + SIDECAR_SUFFIX).exists()
    forbid_build(monkeypatch)
    again = LineIndex.open(path, cache_dir=str(cache))
    assert again.sidecar == index.sidecar and again.mapped


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root ignores directory permissions")
def test_read_only_dir_real_permissions(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    path = write(data_dir, DATA)
    data_dir.chmod(0o555)
    try:
        index = LineIndex.open(path, cache_dir=str(tmp_path / "cache"))
    finally:
        data_dir.chmod(stat.S_IRWXU)
    check(index, DATA)
    assert index.sidecar is not None and Path(index.sidecar).parent == tmp_path / "cache"


def test_cache_dir_from_env_then_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    path = write(data_dir, DATA)
    refuse_dir(monkeypatch, [data_dir])
    monkeypatch.setenv("RESUMABLE_CACHE_DIR", str(tmp_path / "env_cache"))
    index = LineIndex.open(path)
    assert index.sidecar is not None and Path(index.sidecar).parent == tmp_path / "env_cache"

    monkeypatch.delenv("RESUMABLE_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    index = LineIndex.open(path)
    assert index.sidecar is not None
    assert Path(index.sidecar).parent == tmp_path / "home" / ".cache" / "resumable" / "index"
    check(index, DATA)


def test_cache_names_differ_per_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = write(tmp_path / "a", DATA)
    second = write(tmp_path / "b", DATA + b"2\n")  # same basename, other directory
    refuse_dir(monkeypatch, [tmp_path / "a", tmp_path / "b"])
    cache = tmp_path / "cache"
    one = LineIndex.open(first, cache_dir=str(cache))
    two = LineIndex.open(second, cache_dir=str(cache))
    assert one.sidecar is not None and two.sidecar is not None and one.sidecar != two.sidecar
    assert sorted(p.name for p in cache.iterdir()) == sorted(Path(s).name for s in (one.sidecar, two.sidecar))
    check(one, DATA)
    check(two, DATA + b"2\n")


def test_fresh_cache_sidecar_wins_over_stale_local_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path, DATA)
    LineIndex.open(path)  # local sidecar, about to go stale
    Path(path).write_bytes(DATA + b"4\n")
    refuse_dir(monkeypatch, [tmp_path])  # the stale local sidecar cannot be replaced
    cache = str(tmp_path / "cache")
    index = LineIndex.open(path, cache_dir=cache)
    assert index.sidecar is not None and index.sidecar.startswith(cache)
    forbid_build(monkeypatch)
    again = LineIndex.open(path, cache_dir=cache)
    assert again.sidecar == index.sidecar
    check(again, DATA + b"4\n")


def test_nothing_writable_keeps_index_in_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path, DATA)
    refuse_dir(monkeypatch, None)
    with pytest.warns(SidecarWarning, match="in memory") as record:
        index = LineIndex.open(path, cache_dir=str(tmp_path / "cache"))
    assert len(record) == 1
    assert index.sidecar is None and not index.mapped
    check(index, DATA)
    assert [p.name for p in tmp_path.rglob("*") if p.is_file()] == ["data.jsonl"]


def test_unwritable_cache_dir_path(tmp_path: Path) -> None:
    path = write(tmp_path, DATA)
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        index = LineIndex.open(path, cache_dir=str(blocker / "cache"))  # data dir is writable
    assert index.sidecar == path + SIDECAR_SUFFIX


def test_concurrent_opens_agree(tmp_path: Path) -> None:
    data = b"".join(b'{"i": %d}\n' % i for i in range(5000))
    path = write(tmp_path, data)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        indexes = list(pool.map(lambda _: LineIndex.open(path), range(8)))
    expected = reference(data)[0]
    assert all(index.starts.tolist() == expected for index in indexes)
    assert LineIndex._load(path, path + SIDECAR_SUFFIX, len(data), os.stat(path).st_mtime_ns) is not None
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith((".tmp", ".partial"))] == []


# ---------------------------------------------------------------------------------------------
# Errors.


def test_missing_file(tmp_path: Path) -> None:
    missing = str(tmp_path / "missing.jsonl")
    for call in (LineIndex.open, LineIndex.build):
        with pytest.raises(SourceError, match=r"missing\.jsonl"):
            call(missing)


def test_directory_is_not_a_data_file(tmp_path: Path) -> None:
    for call in (LineIndex.open, LineIndex.build):
        with pytest.raises(SourceError, match="not a regular file"):
            call(str(tmp_path))


def test_file_changed_while_building(tmp_path: Path) -> None:
    path = write(tmp_path, DATA * 10)

    def append(_: int) -> None:
        with open(path, "ab") as data:
            data.write(b'{"late": 1}\n')

    with pytest.raises(SourceError, match="changed while being indexed"):
        LineIndex.build(path, progress=append, chunk_size=16)


def test_line_number_out_of_range(tmp_path: Path) -> None:
    index = LineIndex.build(write(tmp_path, DATA))
    for bad in (-1, index.num_records):
        with pytest.raises(IndexError):
            index.line_number(bad)
    assert index.line_number(np.int64(1)) == 3


def test_a_killed_builds_temporary_is_removed_by_the_next_build(tmp_path: Path) -> None:
    """The sidecar is written like a checkpoint file: a build killed mid-write leaves its one
    temporary, unlocked, and the next build of that sidecar removes it (no leak per crash)."""
    path = write(tmp_path, DATA)
    left = tmp_path / f".{os.path.basename(path)}{SIDECAR_SUFFIX}.partial"
    left.write_bytes(b"half a sidecar")
    index = LineIndex.open(path)
    check(index, DATA)
    assert not left.exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
