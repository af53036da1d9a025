"""A run of JSONL records decoded in one ``orjson.loads`` call (``decode_run``) gives exactly what
decoding each record gives, and raises whenever one of them is malformed, also for records
that are malformed alone but would join into valid JSON (an object or array spanning records,
top-level commas); iteration over such files raises or skips at each record's own line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

import resumable as rs
from resumable.sources.jsonl import JOINED_RUN, decode_run

# Pieces that are malformed alone but may join with their neighbours into valid JSON.
SPANNING = [
    '{"a": 1',
    '"b": 2}',
    "3, 4",
    '1}, {"x": 2',
    '{"a": {"b": 1',
    "}}",
    "[1",
    "2]",
    '[{"a": 1',
    '{"c": 3}]',
    '"str',
    'ing"',
    "0,",
    ",0",
    "0, 0",
    "5, 6, 7",
    '1\n,0,"b"',
    "",
    "  ",
]
# Valid records of every kind: objects (flat, nested, with brackets in strings), scalars, arrays.
VALID = [
    "{}",
    '{"id": 7, "text": "plain words"}',
    '{"t": "a [b] {c} \\" ,0, \\\\"}',
    '{"k": {"n": {"m": null}}}',
    '{"k": [1, {"a": 2}]}',
    "1",
    '"s"',
    "null",
    "[]",
    '  {"a": 1}  ',
    '{"a": 1}\r',
    '{"a": "\\u00e9"}',
]


def decoded_one_by_one(raws: list[bytes]) -> list[Any] | None:
    """What decoding each raw record gives, or None when one of them is malformed."""
    try:
        return [orjson.loads(raw) for raw in raws]
    except orjson.JSONDecodeError:
        return None


def raw_records(pieces: list[str], newlines: list[bool]) -> list[bytes]:
    """Raw records as the source hands them to the decoder: a line, with or without its
    newline and blank lines after it (sliced records keep them, split ones do not)."""
    return [p.encode() + (b"\n \n" if nl else b"") for p, nl in zip(pieces, newlines)]


@given(
    pieces=st.lists(st.sampled_from(VALID + SPANNING), min_size=1, max_size=3 * JOINED_RUN),
    newlines=st.lists(st.booleans(), min_size=3 * JOINED_RUN, max_size=3 * JOINED_RUN),
)
def test_a_run_decodes_as_its_records_would_one_by_one(pieces: list[str], newlines: list[bool]) -> None:
    raws = raw_records(pieces, newlines)
    expected = decoded_one_by_one(raws)
    if expected is None:
        with pytest.raises(orjson.JSONDecodeError):
            decode_run(raws)
    else:
        assert decode_run(raws) == expected


@pytest.mark.parametrize(
    "pieces",
    [
        ['{"a": 1', '"b": 2}', "3, 4"],  # an object spanning two records, a comma making up the count
        ["[1", "2]", "3, 4"],  # the same with an array
        ["[1", "2]", "3, 4, 5"],  # an array taking in a separator's own value
        ['1}, {"x": 2', '{"a": {"b": 1', "}}"],  # a record closing and opening objects
        ['"str', 'ing"', "0, 0"],  # a string spanning two records
        ["0,", "1", "2"],
    ],
)
def test_records_that_join_into_valid_json_still_raise(pieces: list[str]) -> None:
    raws = [b'{"id": 1}'] * JOINED_RUN + [p.encode() for p in pieces] + [b'{"id": 2}'] * JOINED_RUN
    with pytest.raises(orjson.JSONDecodeError):
        decode_run(raws)


def test_runs_with_brackets_or_other_values_decode_exactly() -> None:
    raws = [json.dumps({"id": i, "tags": [i, {"x": "]"}]}).encode() for i in range(3 * JOINED_RUN)]
    assert decode_run(raws) == [orjson.loads(raw) for raw in raws]
    scalars = [b"1", b'"a"', b"null", b"true", b"2.5", b"{}"] * JOINED_RUN
    assert decode_run(scalars) == [orjson.loads(raw) for raw in scalars]


@given(
    lines=st.lists(
        st.one_of(
            st.integers(0, 10**6).map(lambda value: json.dumps({"id": value})),
            st.sampled_from(VALID + SPANNING[:-2]),  # blank lines: see test_jsonl
        ),
        min_size=1,
        max_size=80,
    ),
    seed=st.integers(0, 3),
)
def test_iteration_raises_or_skips_spanning_records_at_their_own_line(
    tmp_path_factory: pytest.TempPathFactory, lines: list[str], seed: int
) -> None:
    """Sequential and shuffled: with ``on_error="skip"`` exactly the valid records come out,
    in order; with ``"raise"`` the first malformed record raises, naming its line, after
    every record before it."""
    records = [line.replace("\n", " ") for line in lines]
    path = tmp_path_factory.mktemp("spanning") / "data.jsonl"
    path.write_text("\n".join(records) + "\n")
    decoded: list[Any] = []
    bad: list[int] = []  # line numbers of malformed records
    for number, line in enumerate(records, start=1):
        try:
            decoded.append(orjson.loads(line))
        except orjson.JSONDecodeError:
            decoded.append(None)
            bad.append(number)
    assume(len(bad) < len(records))
    valid = [decoded[i] for i in range(len(records)) if i + 1 not in bad]
    if bad:
        seen = []
        with pytest.raises(rs.SourceError, match=rf"data\.jsonl:{bad[0]}: malformed JSON record"):
            for record in rs.jsonl(str(path)):
                seen.append(record)
        assert seen == valid[: bad[0] - 1]
    skipping = rs.jsonl(str(path), on_error="skip")
    assert list(skipping) == valid
    assert skipping.stats["skipped"] == len(bad)
    shuffled = rs.jsonl(str(path), on_error="skip").shuffle(seed)
    order = shuffled._leaf_indices(np.arange(len(records), dtype=np.int64), 0).tolist()
    assert list(shuffled) == [decoded[i] for i in order if i + 1 not in bad]


def test_bulk_decoding_keeps_raw_record_errors(tmp_path: Path) -> None:
    """A run that cannot be decoded in one call names the malformed record's own line."""
    lines = [json.dumps({"id": i}) for i in range(300)]
    lines[200] = '{"id": 200'
    lines[201] = '"x": 1}, 5'
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(rs.SourceError, match=r"data\.jsonl:201: malformed JSON record"):
        list(rs.jsonl(str(path)))
    skipping = rs.jsonl(str(path), on_error="skip")
    assert [r["id"] for r in skipping] == [i for i in range(300) if i not in (200, 201)]
    assert skipping.stats["skipped"] == 2
