"""Adversary: sources over odd but legal (or slightly broken) input files.

JSONL with CRLF, a BOM, no final newline, blank and whitespace-only lines (long ones too),
blank-only and empty files in every position of a multi-file list, non-object values, raw
U+2028/U+2029/U+0085 inside strings, escaped NULs, duplicate keys, a single line of several MB;
gzip streams made of several members, with trailing zero padding or garbage, empty ones;
Parquet with zero row groups, one-row row groups, nested/struct/list/map/dictionary columns,
different schemas in one list; Arrow IPC (file and stream) with zero batches, zero-length
batches between others, dictionary replacement and deltas, large types. For each: iteration
equals a Python reference parse, and the central resume property holds at k = 0, the middle,
the last item and past the epoch's end (with ``.shuffle().shard()`` where the source is
indexed). Malformed input raises only ``rs.ResumableError`` subclasses (or is skipped).

The two bugs it found are mended: ``rs.jsonl_stream(on_error="skip")`` raised on a file it
could not read (a corrupt gzip stream) instead of skipping its rest, and the stream did not
skip a UTF-8 byte order mark that ``rs.jsonl`` skips.
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import resumable as rs
from tests.resume import check_resume, take

BOM = b"\xef\xbb\xbf"


def write(path: Path, data: bytes | str) -> str:
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    return str(path)


def reference_lines(data: bytes) -> list[Any]:
    """What a careful Python reader makes of a JSONL file: a BOM at the start dropped, lines
    split at b"\\n" only, lines of only spaces, tabs and CRs skipped, every other line decoded."""
    if data.startswith(BOM):
        data = data[len(BOM) :]
    return [json.loads(line.decode("utf-8")) for line in data.split(b"\n") if line.strip(b" \t\r")]


def key(record: Any) -> str:
    return json.dumps(record, sort_keys=True)


def points(n: int) -> list[int]:
    """Resume points: start, middle, last item, the epoch's end, and into the next epoch."""
    return sorted({0, 1, n // 2, max(n - 1, 0), n, n + 1})


def check_all_resumes(build: Callable[[], rs.Node[Any]], n: int) -> None:
    total = 2 * n + 2
    for k in points(n):
        check_resume(build, k, total)


# -- JSONL (indexed) --------------------------------------------------------------------------

ODD_JSONL = (
    BOM
    + b'{"id": 0, "dup": 1, "dup": 2}\r\n'
    + b"\r\n"
    + b"   \t  \r\n"
    + b" " * 40
    + b"\n"  # a blank line longer than the scanner's vectorised steps
    + b" \t" * 30
    + b'{"id": 1}\n'  # a record after a long run of leading blanks
    + '{"id": 2, "s": "a\u2028b\u2029c\u0085d"}\n'.encode()
    + b'{"id": 3, "nul": "x\\u0000y", "esc": "\\ud83d\\ude00"}\n'
    + b"7\n"
    + b'"a string"\n'
    + b'[1, 2, {"k": [3]}]\n'
    + b"null\n"
    + b"true\n"
    + b"\n\n\n"
    + b"-0.5\n"
    + b'{"id": 4, "nested": {"a": [1, {"b": null}]}}\r\n'
    + b"\t\r\n"
    + b'{"id": 5}'  # no final newline
)


def test_odd_jsonl_lines_read_as_a_reference_parse(tmp_path: Path) -> None:
    path = write(tmp_path / "odd.jsonl", ODD_JSONL)
    expected = reference_lines(ODD_JSONL)
    source = rs.jsonl(path)
    assert list(source) == expected
    assert len(source) == len(expected)
    assert [source[i] for i in reversed(range(len(expected)))] == expected[::-1]
    lines = ODD_JSONL[len(BOM) :].split(b"\n")
    assert source.stats["blank_lines"] == sum(1 for line in lines if not line.strip(b" \t\r")) == 7
    check_all_resumes(lambda: rs.jsonl(path), len(expected))


def test_runs_of_scalars_and_strings_decode_exactly(tmp_path: Path) -> None:
    """Long runs of short records (decoded in joined runs) whose values are not objects, hold
    commas and colons inside strings, or look like the run separator."""
    lines = []
    for i in range(64):
        lines += [str(i), json.dumps(f"a,0,{i}\n]"), json.dumps({"k": "\n,0,"}), json.dumps(None), "{}", '""']
    data = "\n".join(lines).encode()
    path = write(tmp_path / "runs.jsonl", data)
    expected = reference_lines(data)
    assert list(rs.jsonl(path)) == expected
    check_resume(lambda: rs.jsonl(path).shuffle(2).shard(1, 3), 40, 300)


def test_invalid_records_inside_a_run_never_combine_into_valid_ones(tmp_path: Path) -> None:
    """Each of these lines is invalid alone; in a run joined with the others they must not pass."""
    bad = ["1,2", "{", "}", '"a":1', "1 2", "]", ",", "0,", '{"a":1', "NaN", "'x'", "\x0c"]
    for index, line in enumerate(bad):
        lines = ["1"] * 10 + [line] + ["2"] * 10
        path = write(tmp_path / f"bad{index}.jsonl", "\n".join(lines) + "\n")
        with pytest.raises(rs.SourceError, match=rf"bad{index}\.jsonl:11: malformed JSON"):
            list(rs.jsonl(path))
        skipping = rs.jsonl(path, on_error="skip")
        assert list(skipping) == [1] * 10 + [2] * 10, line
        assert skipping.stats["skipped"] == 1


def test_a_single_line_of_several_megabytes(tmp_path: Path) -> None:
    big = {"id": 1, "text": "é" * (3 << 20)}  # 6 MiB of UTF-8, past the 4 MB read block
    data = (json.dumps({"id": 0}) + "\n" + json.dumps(big, ensure_ascii=False) + "\n" + '{"id": 2}').encode()
    path = write(tmp_path / "huge.jsonl", data)
    source = rs.jsonl(path)
    assert [r["id"] for r in source] == [0, 1, 2]
    assert source[1] == big
    for k in (1, 2, 3):
        pipe = rs.jsonl(path)
        take(pipe, k)
        resumed = rs.jsonl(path)
        resumed.set_state(json.loads(json.dumps(pipe.get_state())))
        assert [r["id"] for r in take(resumed, 3 - k + 1)] == [*range(k, 3), 0]
    stream = rs.jsonl_stream(path)
    assert [r["id"] for r in stream] == [0, 1, 2]


ODD_FILES: dict[str, bytes] = {
    "empty": b"",
    "bom_only": BOM,
    "blank_only": b"\n \n\t\r\n\r\n" + b" " * 50,
    "bom_blank": BOM + b"\r\n\n",
}


def many_files(tmp_path: Path, odd: str, position: str) -> list[str]:
    """Three record files and one odd (recordless) file at ``position``."""
    plain = [
        write(tmp_path / "r0.jsonl", "".join(json.dumps({"id": i}) + "\n" for i in range(7))),
        write(tmp_path / "r1.jsonl", BOM + "".join(json.dumps({"id": 10 + i}) + "\r\n" for i in range(5)).encode()),
        write(tmp_path / "r2.jsonl", "\n".join(json.dumps({"id": 20 + i}) for i in range(6))),  # no final newline
    ]
    odd_path = write(tmp_path / f"odd_{odd}.jsonl", ODD_FILES[odd])
    at = {"first": 0, "middle": 1, "last": 3, "between_all": 2}[position]
    return plain[:at] + [odd_path] + plain[at:]


ALL_IDS = [*range(7), *range(10, 15), *range(20, 26)]


@pytest.mark.parametrize("odd", sorted(ODD_FILES))
@pytest.mark.parametrize("position", ["first", "middle", "between_all", "last"])
def test_recordless_files_in_any_position_read_and_resume(tmp_path: Path, odd: str, position: str) -> None:
    paths = many_files(tmp_path, odd, position)
    source = rs.jsonl(paths)
    assert sorted(r["id"] for r in source) == sorted(ALL_IDS)
    assert len(source) == len(ALL_IDS)
    assert sorted(source[i]["id"] for i in range(len(ALL_IDS))) == sorted(ALL_IDS)

    shards = [list(rs.jsonl(paths).shuffle(11).shard(rank, 3)) for rank in range(3)]
    assert sorted(r["id"] for shard in shards for r in shard) == sorted(ALL_IDS)

    check_all_resumes(lambda: rs.jsonl(paths), len(ALL_IDS))
    check_all_resumes(lambda: rs.jsonl(paths).shuffle(11).shard(1, 3), len(shards[1]))


def test_recordless_files_in_a_stream_in_any_position(tmp_path: Path) -> None:
    plain = [
        write(tmp_path / f"p{i}.jsonl", "".join(json.dumps({"id": 10 * i + j}) + "\r\n" for j in range(4)))
        for i in range(3)
    ]
    empty = write(tmp_path / "e.jsonl", b"")
    blank = write(tmp_path / "b.jsonl", b"\n\r\n  \t\n")
    empty_gz = write(tmp_path / "e.jsonl.gz", b"")  # zero bytes: no gzip member at all
    empty_member = write(tmp_path / "m.jsonl.gz", gzip.compress(b""))
    blank_gz = write(tmp_path / "b.jsonl.gz", gzip.compress(b"\n\n \r\n"))
    paths = [empty, plain[0], blank, empty_gz, plain[1], empty_member, plain[2], blank_gz]
    expected = [10 * i + j for i in range(3) for j in range(4)]
    assert [r["id"] for r in rs.jsonl_stream(paths)] == expected
    check_all_resumes(lambda: rs.jsonl_stream(paths), len(expected))
    check_all_resumes(lambda: rs.jsonl_stream(paths, shuffle_files=3), len(expected))
    consumers = [list(rs.jsonl_stream(paths, rank=r, world_size=3)) for r in range(3)]
    assert sorted(x["id"] for c in consumers for x in c) == expected
    check_all_resumes(lambda: rs.jsonl_stream(paths, rank=1, world_size=3), len(consumers[1]))


@pytest.mark.parametrize(
    "kind", ["raw_nul", "latin1", "overlong", "lone_surrogate", "bare_cr", "form_feed", "two_values"]
)
def test_malformed_lines_are_typed_errors_or_skipped_in_both_jsonl_sources(tmp_path: Path, kind: str) -> None:
    bad = {
        "raw_nul": b'{"a": "x\x00y"}',
        "latin1": b'{"a": "caf\xe9"}',
        "overlong": b'{"a": "\xc0\xaf"}',
        "lone_surrogate": b'{"a": "\\ud800"}',
        "bare_cr": b'{"a": 1}\r{"a": 2}',
        "form_feed": b'\x0c{"a": 1}\x0c',
        "two_values": b'{"a": 1} {"b": 2}',
    }[kind]
    data = b'{"id": 0}\n' + bad + b'\n{"id": 2}\n'
    path = write(tmp_path / "bad.jsonl", data)
    with pytest.raises(rs.SourceError, match=r"bad\.jsonl:2"):
        list(rs.jsonl(path))
    with pytest.raises(rs.SourceError, match=r"bad\.jsonl:2"):
        rs.jsonl(path)[1]
    skipping = rs.jsonl(path, on_error="skip")
    assert list(skipping) == [{"id": 0}, {"id": 2}]
    check_all_resumes(lambda: rs.jsonl(path, on_error="skip").shuffle(1), 2)
    for name, payload in (("bad_stream.jsonl", data), ("bad_stream.jsonl.gz", gzip.compress(data))):
        stream_path = write(tmp_path / name, payload)
        with pytest.raises(rs.SourceError, match=rf"{name.replace('.', '[.]')}:2"):
            list(rs.jsonl_stream(stream_path))
        skipping_stream = rs.jsonl_stream(stream_path, on_error="skip")
        assert list(skipping_stream) == [{"id": 0}, {"id": 2}] and skipping_stream.skipped == 1


def test_a_form_feed_only_line_is_read_alike_by_both_jsonl_sources(tmp_path: Path) -> None:
    """A line of only a form feed is not blank for ``rs.jsonl`` (docs: spaces, tabs, CR); the
    stream must at least not yield a record for it (it skips it as blank: bytes.strip())."""
    path = write(tmp_path / "ff.jsonl", b'{"id": 0}\n\x0c\n{"id": 2}\n')
    with pytest.raises(rs.SourceError, match=r"ff\.jsonl:2"):
        list(rs.jsonl(path))
    assert [r["id"] for r in rs.jsonl_stream(path, on_error="skip")] == [0, 2]


# -- streams: gzip oddities, BOM, line ends ----------------------------------------------------

STREAM_TEXT = b"".join(
    json.dumps({"id": i, "t": "x" * (i % 13)}).encode() + (b"\r\n" if i % 2 else b"\n") for i in range(40)
)


def test_concatenated_gzip_members_read_and_resume_mid_member(tmp_path: Path) -> None:
    """Members cut in the middle of a line, an empty member, then the rest without a final newline."""
    cuts = [0, 101, 102, 500, len(STREAM_TEXT) - 3, len(STREAM_TEXT)]
    members = [gzip.compress(STREAM_TEXT[a:b]) for a, b in zip(cuts, cuts[1:])]
    path = write(tmp_path / "multi.jsonl.gz", b"".join(members) + gzip.compress(b"\n\n") + gzip.compress(b'{"id": 40}'))
    expected = reference_lines(STREAM_TEXT + b'\n\n{"id": 40}')
    assert list(rs.jsonl_stream(path)) == expected
    for k in range(0, len(expected) + 2, 3):
        check_resume(lambda: rs.jsonl_stream(path), k, 2 * len(expected) + 2)


def test_gzip_with_trailing_zero_padding_reads_and_resumes(tmp_path: Path) -> None:
    path = write(tmp_path / "padded.jsonl.gz", gzip.compress(STREAM_TEXT) + b"\x00" * 64)
    expected = reference_lines(STREAM_TEXT)
    assert list(rs.jsonl_stream(path)) == expected
    check_all_resumes(lambda: rs.jsonl_stream(path), len(expected))


def test_gzip_with_trailing_garbage_is_a_source_error_after_every_record(tmp_path: Path) -> None:
    path = write(tmp_path / "garbage.jsonl.gz", gzip.compress(STREAM_TEXT) + b"garbage after the end")
    stream = rs.jsonl_stream(path)
    got = []
    with pytest.raises(rs.SourceError, match=r"garbage\.jsonl\.gz"):
        for record in stream:
            got.append(record)
    assert got == reference_lines(STREAM_TEXT)[: len(got)]


def test_corrupt_gzip_is_skipped_with_on_error_skip(tmp_path: Path) -> None:
    bad = write(tmp_path / "a.jsonl.gz", gzip.compress(b'{"id": 0}\n{"id": 1}\n') + b"garbage")
    good = write(tmp_path / "b.jsonl", b'{"id": 2}\n')
    stream = rs.jsonl_stream([bad, good], on_error="skip")
    assert [r["id"] for r in stream] == [0, 1, 2]
    assert stream.skipped == 1
    check_all_resumes(lambda: rs.jsonl_stream([bad, good], on_error="skip"), 3)
    with pytest.raises(rs.SourceError, match="a.jsonl.gz:3"):
        list(rs.jsonl_stream([bad, good]))


def test_gzip_that_is_not_gzip_or_cut_in_its_header_is_a_source_error(tmp_path: Path) -> None:
    for name, payload in (
        ("plain.jsonl.gz", b'{"id": 0}\n'),
        ("header.jsonl.gz", b"\x1f\x8b\x08"),
        ("magic.jsonl.gz", b"\x1f\x8b"),
        ("one.jsonl.gz", b"\x1f"),
    ):
        path = write(tmp_path / name, payload)
        with pytest.raises(rs.SourceError, match=name.replace(".", "[.]")):
            list(rs.jsonl_stream(path))


@pytest.mark.parametrize("compressed", [False, True])
def test_stream_skips_a_utf8_bom_like_the_indexed_source(tmp_path: Path, compressed: bool) -> None:
    data = BOM + b'{"id": 0}\r\n{"id": 1}\n'
    assert list(rs.jsonl(write(tmp_path / "indexed.jsonl", data))) == [{"id": 0}, {"id": 1}]
    path = write(tmp_path / ("s.jsonl.gz" if compressed else "s.jsonl"), gzip.compress(data) if compressed else data)
    assert list(rs.jsonl_stream(path)) == [{"id": 0}, {"id": 1}]
    check_all_resumes(lambda: rs.jsonl_stream(path), 2)
    stream = rs.jsonl_stream(path)
    next(stream)
    assert stream.fetch(stream.last_key()) == {"id": 0}  # a packer's refetch of the first line


def test_stream_odd_lines_match_the_reference_and_resume(tmp_path: Path) -> None:
    body = ODD_JSONL[len(BOM) :]  # the stream's BOM handling is tested on its own
    for name, payload in (("odd.jsonl", body), ("odd.jsonl.gz", gzip.compress(body))):
        path = write(tmp_path / name, payload)
        expected = reference_lines(body)
        assert list(rs.jsonl_stream(path)) == expected
        check_all_resumes(lambda: rs.jsonl_stream(path), len(expected))


# -- Parquet ----------------------------------------------------------------------------------

NESTED = pa.table(
    {
        "id": pa.array(range(6), pa.int64()),
        "s": [{"x": 1, "y": "a"}, None, {"x": None, "y": "c"}, {"x": 4, "y": ""}, None, {"x": 6, "y": "é"}],
        "l": [[1, 2], [], None, [None], [3], []],
        "m": pa.array(
            [[("k", 1)], [], None, [("a", 2), ("b", 3)], [], [("z", None)]], pa.map_(pa.string(), pa.int64())
        ),
        "d": pa.array(["a", "b", "a", None, "b", "a"]).dictionary_encode(),
        "ls": pa.array(["x", "yy", None, "", "\u2028", "zzz"], pa.large_string()),
        "ll": pa.array([[1], [2, 3], [], None, [4], [5]], pa.large_list(pa.int32())),
        "b": pa.array([b"\x00\xff", b"", None, b"\n", b"x", b"yy"], pa.binary()),
    }
)


def test_parquet_nested_dictionary_and_large_columns_equal_pyarrow(tmp_path: Path) -> None:
    path = str(tmp_path / "nested.parquet")
    pq.write_table(NESTED, path, row_group_size=1, use_dictionary=True)
    expected = pq.read_table(path).to_pylist()
    assert list(rs.parquet(path)) == expected
    source = rs.parquet(path)
    assert [source[i] for i in (5, 0, 3, 1)] == [expected[i] for i in (5, 0, 3, 1)]
    assert list(rs.parquet(path, columns=["m", "s"])) == [{"m": r["m"], "s": r["s"]} for r in expected]
    check_all_resumes(lambda: rs.parquet(path), len(expected))
    check_all_resumes(lambda: rs.parquet(path).shuffle(4).shard(0, 2), 3)
    check_all_resumes(lambda: rs.parquet(path).shuffle(4, block_size="row_group", window=2), 6)


def test_parquet_zero_row_group_files_and_tiny_row_groups_in_any_position(tmp_path: Path) -> None:
    schema = pa.schema([("id", pa.int64())])
    pq.ParquetWriter(str(tmp_path / "zero.parquet"), schema).close()  # a footer and no row group
    assert pq.ParquetFile(str(tmp_path / "zero.parquet")).metadata.num_row_groups == 0
    with pq.ParquetWriter(str(tmp_path / "tiny.parquet"), schema) as writer:  # one row per group, empty groups between
        for i in range(9):
            writer.write_table(pa.table({"id": [i]}, schema=schema))
            if i % 3 == 0:
                writer.write_table(schema.empty_table())
    pq.write_table(pa.table({"id": pa.array([], pa.int64())}), str(tmp_path / "empty.parquet"))
    zero, tiny, empty = (str(tmp_path / n) for n in ("zero.parquet", "tiny.parquet", "empty.parquet"))
    paths = [zero, tiny, empty, tiny, zero]
    expected = [*range(9), *range(9)]
    assert [r["id"] for r in rs.parquet(paths)] == expected
    for build in (
        lambda: rs.parquet(paths),
        lambda: rs.parquet(paths).shuffle(5).shard(1, 2),
        lambda: rs.parquet(paths).shuffle(5, block_size="row_group", window=3),
        lambda: rs.parquet(paths, columns=["id"]).shuffle(5, block_size="row_group", window=1).shard(0, 4),
    ):
        n = len(list(build()))
        check_all_resumes(build, n)
    assert sorted(r["id"] for r in rs.parquet(paths).shuffle(5, block_size="row_group", window=3)) == sorted(expected)
    with pytest.raises(rs.SourceError, match="no rows"):
        rs.parquet([zero, empty, zero])


def test_parquet_files_with_different_schemas_in_one_list(tmp_path: Path) -> None:
    pq.write_table(pa.table({"id": [0, 1, 2]}), str(tmp_path / "a.parquet"), row_group_size=2)
    pq.write_table(pa.table({"id": ["s3", "s4"], "extra": [1.5, None]}), str(tmp_path / "b.parquet"))
    pq.write_table(pa.table({"other": [[5], []]}), str(tmp_path / "c.parquet"))
    paths = sorted(str(p) for p in tmp_path.glob("*.parquet"))
    expected = [
        {"id": 0},
        {"id": 1},
        {"id": 2},
        {"id": "s3", "extra": 1.5},
        {"id": "s4", "extra": None},
        {"other": [5]},
        {"other": []},
    ]
    assert list(rs.parquet(paths)) == expected
    source = rs.parquet(paths)
    assert [source[i] for i in (6, 3, 0, 5)] == [expected[i] for i in (6, 3, 0, 5)]
    check_all_resumes(lambda: rs.parquet(paths).shuffle(9), len(expected))
    with pytest.raises(rs.SourceError, match=r"c\.parquet' has no column\(s\) \['id'\]"):
        rs.parquet(paths, columns=["id"])
    with pytest.raises(rs.SourceError, match=r"has no column\(s\) \['s\.x'\]"):
        rs.parquet(paths[:1], columns=["s.x"])


@pytest.mark.parametrize("columns", ["id", [1], [None], ("id", 2)])
def test_parquet_bad_column_selections_are_config_errors(tmp_path: Path, columns: Any) -> None:
    pq.write_table(pa.table({"id": [0]}), str(tmp_path / "a.parquet"))
    with pytest.raises(rs.ConfigError):
        rs.parquet(str(tmp_path / "a.parquet"), columns=columns)


def test_parquet_restore_with_other_columns_over_different_schemas_is_a_state_error(tmp_path: Path) -> None:
    pq.write_table(pa.table({"id": [0, 1], "t": ["a", "b"]}), str(tmp_path / "a.parquet"))
    path = str(tmp_path / "a.parquet")
    pipe = rs.parquet(path, columns=["id"])
    next(pipe)
    state = json.loads(json.dumps(pipe.get_state()))
    with pytest.raises(rs.StateError):
        rs.parquet(path, columns=["t"]).set_state(state)
    with pytest.raises(rs.StateError):
        rs.parquet(path).set_state(state)


# -- Arrow IPC --------------------------------------------------------------------------------


def write_ipc(path: Path, batches: list[pa.RecordBatch], schema: pa.Schema, stream: bool, **options: Any) -> str:
    new_writer = pa.ipc.new_stream if stream else pa.ipc.new_file
    kwargs = {"options": pa.ipc.IpcWriteOptions(**options)} if options else {}
    with pa.OSFile(str(path), "wb") as sink, new_writer(sink, schema, **kwargs) as writer:
        for batch in batches:
            writer.write_batch(batch)
    return str(path)


@pytest.mark.parametrize("stream", [False, True])
def test_arrow_zero_batch_files_and_zero_length_batches_between_others(tmp_path: Path, stream: bool) -> None:
    schema = pa.schema([("id", pa.int64()), ("t", pa.large_string())])

    def batch(ids: list[int]) -> pa.RecordBatch:
        return pa.record_batch(
            [pa.array(ids, pa.int64()), pa.array(["t" * i for i in ids], pa.large_string())], schema=schema
        )

    zero = write_ipc(tmp_path / "zero.arrow", [], schema, stream)
    gaps = write_ipc(
        tmp_path / "gaps.arrow",
        [batch([]), batch([0, 1]), batch([]), batch([]), batch([2]), batch([3, 4, 5]), batch([])],
        schema,
        stream,
    )
    paths = [zero, gaps, zero, gaps, zero]
    expected = [{"id": i, "t": "t" * i} for i in range(6)] * 2
    assert list(rs.arrow(paths)) == expected
    source = rs.arrow(paths)
    assert [source[i] for i in (11, 0, 6, 5)] == [expected[i] for i in (11, 0, 6, 5)]
    assert source.block_bounds().tolist() == [0, 2, 3, 6, 8, 9, 12]
    for build in (
        lambda: rs.arrow(paths),
        lambda: rs.arrow(paths).shuffle(2).shard(1, 3),
        lambda: rs.arrow(paths).shuffle(2, block_size="row_group", window=2),
    ):
        check_all_resumes(build, len(list(build())))
    with pytest.raises(rs.SourceError, match="no rows"):
        rs.arrow([zero, zero])


@pytest.mark.parametrize("stream", [False, True])
def test_arrow_nested_dictionary_and_large_types_equal_pyarrow(tmp_path: Path, stream: bool) -> None:
    path = write_ipc(tmp_path / "nested.arrow", NESTED.to_batches(max_chunksize=2), NESTED.schema, stream)
    expected = NESTED.to_pylist()
    assert list(rs.arrow(path)) == expected
    source = rs.arrow(path)
    assert [source[i] for i in (5, 2, 0)] == [expected[i] for i in (5, 2, 0)]
    check_all_resumes(lambda: rs.arrow(path).shuffle(3).shard(0, 2), 3)


@pytest.mark.parametrize("deltas", [False, True])
def test_arrow_stream_dictionary_replacement_and_deltas(tmp_path: Path, deltas: bool) -> None:
    schema = pa.schema([("d", pa.dictionary(pa.int32(), pa.string()))])

    def batch(indices: list[int], values: list[str]) -> pa.RecordBatch:
        return pa.record_batch(
            {"d": pa.DictionaryArray.from_arrays(pa.array(indices, pa.int32()), pa.array(values))}, schema=schema
        )

    if deltas:  # the dictionary grows: ["a", "b"] then ["a", "b", "c"]
        batches = [batch([0, 1], ["a", "b"]), batch([2, 0], ["a", "b", "c"]), batch([2, 2, 1], ["a", "b", "c"])]
        path = write_ipc(tmp_path / "d.arrow", batches, schema, True, emit_dictionary_deltas=True)
    else:  # the dictionary is replaced
        batches = [batch([0, 1], ["a", "b"]), batch([1, 0], ["x", "y"]), batch([0], ["q"])]
        path = write_ipc(tmp_path / "d.arrow", batches, schema, True)
    expected = pa.Table.from_batches(batches).to_pylist()
    assert expected == pa.ipc.open_stream(path).read_all().to_pylist()
    assert list(rs.arrow(path)) == expected
    source = rs.arrow(path)
    order = list(reversed(range(len(expected))))
    assert [source[i] for i in order] == [expected[i] for i in order]
    check_all_resumes(lambda: rs.arrow(path).shuffle(6), len(expected))


@pytest.mark.parametrize(
    "payload", [b"", b"ARROW1", b"ARROW1\x00\x00", b"\xff\xff\xff\xff\x00\x00\x00\x00", b"\xff\xff\xff\xff"]
)
def test_arrow_files_of_only_magic_or_end_markers_are_source_errors(tmp_path: Path, payload: bytes) -> None:
    path = write(tmp_path / "odd.arrow", payload)
    with pytest.raises(rs.SourceError, match=r"odd\.arrow"):
        list(rs.arrow(path))


def test_arrow_stream_cut_after_its_schema_has_no_rows(tmp_path: Path) -> None:
    schema = pa.schema([("id", pa.int64())])
    path = write_ipc(tmp_path / "s.arrow", [pa.record_batch({"id": [1, 2]}, schema=schema)], schema, True)
    data = Path(path).read_bytes()
    schema_only = write(tmp_path / "schema_only.arrow", data[: len(data) // 3])
    with pytest.raises(rs.SourceError, match=r"schema_only\.arrow"):
        list(rs.arrow(schema_only))


# -- in memory --------------------------------------------------------------------------------


def test_from_list_of_odd_values_reads_and_resumes() -> None:
    values: list[Any] = [None, 0, "", [], {}, {"a": {"b": [1]}}, (1, 2), "\u2028", b"\x00", -0.0, True]
    assert list(rs.from_list(values)) == values
    n = len(values)
    check_all_resumes(lambda: rs.from_list(values).map(repr), n)
    check_all_resumes(
        lambda: rs.from_list(values).shuffle(3).shard(1, 2).map(repr),
        len(list(rs.from_list(values).shuffle(3).shard(1, 2))),
    )


def test_from_list_refuses_iterators_and_other_lengths() -> None:
    with pytest.raises(rs.ConfigError):
        rs.from_list(iter([1, 2]))
    with pytest.raises(rs.ConfigError):
        rs.from_list(x for x in range(3))
    pipe = rs.from_list(list(range(5)))
    next(pipe)
    state = json.loads(json.dumps(pipe.get_state()))
    with pytest.raises(rs.StateError):
        rs.from_list(list(range(6))).set_state(state)


def test_from_list_of_a_single_record_and_an_empty_list() -> None:
    check_all_resumes(lambda: rs.from_list([{"only": 1}]).shuffle(1), 1)
    try:
        empty = rs.from_list([])
    except rs.ResumableError:
        return
    assert take(empty, 5) == []


# -- every file kind together: the same odd records through each source --------------------


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "arrow", "arrow_stream"])
def test_one_record_files_in_a_long_list(tmp_path: Path, kind: str) -> None:
    """Thirty one-record files (a degenerate layout: every record is its own file and block)."""
    paths = []
    for i in range(30):
        path = tmp_path / f"{i:02d}.{kind}"
        if kind == "jsonl":
            write(path, json.dumps({"id": i}))
        elif kind == "parquet":
            pq.write_table(pa.table({"id": [i]}), str(path))
        else:
            table = pa.table({"id": [i]})
            write_ipc(path, table.to_batches(), table.schema, kind == "arrow_stream")
        paths.append(str(path))
    build_source = {"jsonl": rs.jsonl, "parquet": rs.parquet}.get(kind, rs.arrow)
    assert [r["id"] for r in build_source(paths)] == list(range(30))
    check_all_resumes(lambda: build_source(paths).shuffle(8).shard(2, 3), 10)
    pattern = str(tmp_path / f"*.{kind}")
    assert [r["id"] for r in build_source(pattern)] == list(range(30))
    if kind != "jsonl":
        check_all_resumes(lambda: build_source(pattern).shuffle(8, block_size="row_group", window=4), 30)
    assert os.path.exists(paths[0])


# -- the same file twice, a symlink, huge blank runs, every line bad, damaged footers ----------


def test_the_same_file_listed_twice_or_through_a_symlink(tmp_path: Path) -> None:
    path = write(tmp_path / "a.jsonl", "".join(json.dumps({"id": i}) + "\n" for i in range(5)))
    link = tmp_path / "link.jsonl"
    link.symlink_to(path)
    pq.write_table(pa.table({"id": [0, 1, 2]}), str(tmp_path / "a.parquet"), row_group_size=1)
    twice = [*range(5), *range(5)]
    for build, expected in (
        (lambda: rs.jsonl([path, path]), twice),
        (lambda: rs.jsonl([path, str(link)]), twice),
        (lambda: rs.jsonl_stream([path, path]), twice),
        (lambda: rs.parquet([str(tmp_path / "a.parquet")] * 3), [0, 1, 2] * 3),
    ):
        assert [r["id"] for r in build()] == expected
        check_all_resumes(build, len(expected))
    check_all_resumes(lambda: rs.jsonl([path, str(link)]).shuffle(1).shard(0, 2), 5)
    check_all_resumes(lambda: rs.parquet([str(tmp_path / "a.parquet")] * 3).shuffle(1, block_size="row_group"), 9)


def test_a_record_followed_by_two_hundred_thousand_blank_lines(tmp_path: Path) -> None:
    """A record's bytes run up to the next record: here 200 KB of newlines."""
    path = write(tmp_path / "blanks.jsonl", '{"id": 0}\n' + "\n" * 200_000 + '{"id": 1}\n' + "  \r\n" * 1000)
    source = rs.jsonl(path)
    assert list(source) == [{"id": 0}, {"id": 1}]
    assert source.stats["blank_lines"] == 201_000
    check_all_resumes(lambda: rs.jsonl(path), 2)
    check_all_resumes(lambda: rs.jsonl_stream(path), 2)


def test_every_line_bad_with_skip_yields_nothing_and_resumes(tmp_path: Path) -> None:
    path = write(tmp_path / "allbad.jsonl", "x\ny\n{\n")
    assert list(rs.jsonl(path, on_error="skip")) == []
    assert list(rs.jsonl_stream(path, on_error="skip")) == []
    for build in (lambda: rs.jsonl(path, on_error="skip").shuffle(2), lambda: rs.jsonl_stream(path, on_error="skip")):
        pipe = build()
        assert take(pipe, 3) == []
        resumed = build()
        resumed.set_state(json.loads(json.dumps(pipe.get_state())))
        assert take(resumed, 3) == []


def test_arrow_stream_without_its_end_marker_or_with_bytes_after_it(tmp_path: Path) -> None:
    """pyarrow reads a stream up to its end-of-stream marker, or to the end of the file without one."""
    schema = pa.schema([("id", pa.int64())])
    batches = [pa.record_batch({"id": [2 * i, 2 * i + 1]}, schema=schema) for i in range(3)]
    data = Path(write_ipc(tmp_path / "s.arrow", batches, schema, True)).read_bytes()
    assert data.endswith(b"\xff\xff\xff\xff\x00\x00\x00\x00")
    for name, payload in (("no_eos.arrow", data[:-8]), ("after_eos.arrow", data + b"garbage after the end")):
        path = write(tmp_path / name, payload)
        assert [r["id"] for r in rs.arrow(path)] == list(range(6))
        check_all_resumes(lambda: rs.arrow(path).shuffle(1, block_size="row_group", window=2), 6)


@pytest.mark.parametrize(
    "payload",
    [
        b"PAR1",
        b"PAR1PAR1",
        b"PAR1\x00\x00\x00\x00PAR1",
        b"PAR1\xff\xff\xff\x7fPAR1",
        b"PAR1" + b"\x00" * 100 + b"\x08\x00\x00\x00PAR1",
    ],
)
def test_parquet_damaged_footers_are_source_errors(tmp_path: Path, payload: bytes) -> None:
    path = write(tmp_path / "odd.parquet", payload)
    with pytest.raises(rs.SourceError, match=r"odd\.parquet"):
        list(rs.parquet(path))


def test_parquet_and_arrow_files_with_bytes_appended_are_source_errors(tmp_path: Path) -> None:
    pq.write_table(pa.table({"id": [0, 1]}), str(tmp_path / "a.parquet"))
    table = pa.table({"id": [0, 1]})
    arrow_path = write_ipc(tmp_path / "a.arrow", table.to_batches(), table.schema, False)
    for path in (str(tmp_path / "a.parquet"), arrow_path):
        with open(path, "ab") as out:
            out.write(b"appended")
        with pytest.raises(rs.SourceError, match=os.path.basename(path).replace(".", "[.]")):
            list(rs.parquet(path) if path.endswith(".parquet") else rs.arrow(path))
