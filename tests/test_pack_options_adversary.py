"""Adversary of the packer's options and payloads (``.pack(seq_len, **options)``, docs/packing.md):
every documented option at its edges (seq_len 1, 2 and SEQ_LEN_MAX; buffer sizes 1, 2 and far past
the data; every strategy, overlong policy, position mode, max_documents, mask_first_token and
pad_token_id) over documents of 0, 1, seq_len, seq_len + 1 and many times seq_len tokens, with
labels, a token field and a document field, every row checked against the records it came from
(cu_seqlens, positions, document ids, padding, labels, payloads) and every token of an epoch
accounted for once; the counters (``pack.stats``) against the rows actually handed out; token
ids of every numpy dtype and of odd Python types; key options naming missing fields or fields of
another type; exact resume with a map before and a batch after over lists, JSONL and Parquet and
in ``rs.torch.Loader``; hand-corrupted states refused with ``rs.StateError`` only, leaving the
pipeline as it was. The five bugs it found are mended (pad values a field's dtype cannot hold, a
first_fit tree sized by buffer_size, numpy pad values, null labels, stride keys from pending_keys)."""

from __future__ import annotations

import copy
import json
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import resumable as rs
import resumable.torch as rst
from resumable.pack import IGNORE_INDEX, Pack, collate_rows, expand_references
from resumable.pack.node import SEQ_LEN_MAX
from tests.resume import check_resume, loader_head, loader_rest, plain, take

STRIDE = 1_000_000  # token = number * STRIDE + offset in the document: every token names its place
LABEL_SHIFT = 7  # labels = tokens + LABEL_SHIFT, so a label never equals its token
MASK_PAD = 5
STRATEGIES: list[tuple[str, int | None]] = [
    ("greedy", None),
    ("first_fit", 1),
    ("first_fit", 2),
    ("best_fit", 1),
    ("best_fit", 2),
    ("best_fit", 2**63),
    ("bfd", 1),
    ("bfd", 2),
    ("bfd", None),
]
POLICIES = ["split", "truncate", "drop"]
INT64_EDGES = [2**40, -5, 2**31, -(2**63), 2**63 - 1]


def lengths_for(seq_len: int) -> list[int]:
    """Documents of every awkward length for ``seq_len``, with empty ones between them."""
    lengths = [0, 1, seq_len, seq_len + 1, 0, 3 * seq_len, 3 * seq_len + 1, 2, max(seq_len - 1, 1), 0]
    return lengths + [1, seq_len + 2, 2 * seq_len, 1, 1, 5 * seq_len - 1]


def record(number: int, length: int) -> dict[str, Any]:
    """Document ``number`` (from 1): tokens name it, labels differ from them, a per-token mask and
    a per-document value name it too."""
    offsets = np.arange(length, dtype=np.int64)
    tokens = number * STRIDE + offsets
    return {
        "input_ids": tokens.tolist(),
        "labels": (tokens + LABEL_SHIFT).tolist(),
        "mask": ((offsets + number) % 2).tolist(),
        "meta": {"number": number},
    }


def corpus(lengths: list[int]) -> list[dict[str, Any]]:
    return [record(number, length) for number, length in enumerate(lengths, start=1)]


def kept_tokens(length: int, seq_len: int, overlong: str) -> int:
    """Tokens of a document of ``length`` the policy keeps."""
    if length <= seq_len or overlong == "split":
        return length
    return seq_len if overlong == "truncate" else 0


def check_row(
    row: dict[str, Any],
    seq_len: int,
    options: dict[str, Any],
    payloads: bool = True,
    labelled: bool = True,
) -> list[tuple[int, int, int]]:
    """Check one row against the documents its tokens name; return ``(number, start, end)`` of
    each piece. Every field: shapes, dtypes, segments, positions, labels, padding, payloads."""
    max_documents = options.get("max_documents")
    cu_len = seq_len + 1 if max_documents is None else min(max_documents + 2, seq_len + 1)
    pad = options.get("pad_token_id", 0)
    expected = {"input_ids", "labels", "position_ids", "document_ids", "cu_seqlens", "cu_seqlens_count"}
    if payloads:
        expected |= {"mask", "meta"}
    assert set(row) == expected
    for name in ("input_ids", "labels", "position_ids", "document_ids"):
        assert row[name].shape == (seq_len,), name
    assert row["input_ids"].dtype == row["labels"].dtype == row["position_ids"].dtype == np.int64
    assert row["document_ids"].dtype == row["cu_seqlens"].dtype == row["cu_seqlens_count"].dtype == np.int32
    assert row["cu_seqlens"].shape == (cu_len,) and row["cu_seqlens_count"].shape == ()

    document_ids = row["document_ids"]
    pieces_in_row = int(document_ids.max())
    assert pieces_in_row >= 1, "a row without any document"
    used = int(np.count_nonzero(document_ids))
    assert (document_ids[:used] > 0).all() and (document_ids[used:] == 0).all(), "padding only at the end"
    count = int(row["cu_seqlens_count"])
    cu = row["cu_seqlens"]
    assert count == pieces_in_row + 1 + (used < seq_len)
    assert cu[0] == 0 and cu[count - 1] == seq_len and (cu[count:] == seq_len).all()
    assert (np.diff(cu[:count]) > 0).all(), "an empty valid segment"
    assert int(np.diff(cu[:count]).sum()) == seq_len
    if max_documents is not None:
        assert pieces_in_row <= max_documents

    pieces = []
    for index in range(pieces_in_row):
        at, stop = int(cu[index]), int(cu[index + 1])
        assert (document_ids[at:stop] == index + 1).all()
        tokens = row["input_ids"][at:stop]
        number, start = divmod(int(tokens[0]), STRIDE)
        end = start + stop - at
        assert tokens.tolist() == list(range(number * STRIDE + start, number * STRIDE + end)), "not one slice"
        labels = row["labels"][at:stop]
        want = (tokens + LABEL_SHIFT) if labelled else tokens
        if options.get("mask_first_token"):
            assert labels[0] == IGNORE_INDEX
            assert labels[1:].tolist() == want[1:].tolist()
        else:
            assert labels.tolist() == want.tolist()
        shift = start if options.get("split_positions") == "continue" else 0
        assert row["position_ids"][at:stop].tolist() == list(range(shift, shift + stop - at))
        if payloads:
            assert row["mask"][at:stop].tolist() == [(offset + number) % 2 for offset in range(start, end)]
            offset, value = row["meta"][index]
            assert offset == at
            assert value == ({"number": number} if start == 0 else None)
        pieces.append((number, start, end))
    assert (row["input_ids"][used:] == pad).all()
    assert (row["labels"][used:] == IGNORE_INDEX).all()
    assert row["position_ids"][used:].tolist() == list(range(seq_len - used))
    if payloads:
        assert (row["mask"][used:] == MASK_PAD).all()
        assert len(row["meta"]) == pieces_in_row
    return pieces


def check_epoch(
    rows: list[dict[str, Any]],
    lengths: list[int],
    seq_len: int,
    options: dict[str, Any],
    stats: Any,
    payloads: bool = True,
) -> list[tuple[int, int, int]]:
    """Every row well formed, every kept token once, the counters those of the rows."""
    overlong = options.get("overlong", "split")
    pieces = [piece for row in rows for piece in check_row(row, seq_len, options, payloads)]
    tokens = Counter((number, offset) for number, start, end in pieces for offset in range(start, end))
    want = Counter(
        (number, offset)
        for number, length in enumerate(lengths, start=1)
        for offset in range(kept_tokens(length, seq_len, overlong))
    )
    assert tokens == want, "a token lost or duplicated"
    # every piece of a split document is a whole row or the tail
    for number, start, end in pieces:
        assert start % seq_len == 0 or overlong != "split"
        assert end - start == seq_len or end == kept_tokens(lengths[number - 1], seq_len, overlong)

    used = sum(int(np.count_nonzero(row["document_ids"])) for row in rows)
    assert stats.rows == len(rows)
    assert stats.padding == len(rows) * seq_len - used
    assert stats.tokens == used == sum(want.values())
    assert stats.efficiency == (used / (len(rows) * seq_len) if rows else 0.0)
    assert stats.empty == lengths.count(0)
    long = [length for length in lengths if length > seq_len]
    assert stats.split == (len(long) if overlong == "split" else 0)
    assert stats.truncated == (len(long) if overlong == "truncate" else 0)
    assert stats.dropped == (len(long) if overlong == "drop" else 0)
    assert stats.documents == sum(1 for length in lengths if 0 < kept_tokens(length, seq_len, overlong))
    return pieces


def option_sets(seq_len: int) -> list[dict[str, Any]]:
    """A few combinations of the row options, so every one meets every strategy and policy."""
    return [
        {},
        {"split_positions": "continue", "mask_first_token": True, "pad_token_id": -1},
        {"max_documents": 1, "pad_token_id": 2**63 - 1},
        {"max_documents": 2, "split_positions": "continue", "pad_token_id": -(2**63)},
    ]


def packed(
    lengths: list[int], seq_len: int, strategy: str, buffer_size: int | None, seed: int = 0, **options: Any
) -> Pack:
    return (
        rs.from_list(corpus(lengths))
        .shuffle(seed)
        .pack(
            seq_len,
            strategy=strategy,
            buffer_size=buffer_size,
            token_fields={"mask": MASK_PAD},
            document_fields=["meta"],
            **options,
        )
    )


# -- every option at its edges, every row checked ---------------------------------------------


@pytest.mark.parametrize("seq_len", [1, 2, 5])
@pytest.mark.parametrize("overlong", POLICIES)
@pytest.mark.parametrize(("strategy", "buffer_size"), STRATEGIES)
def test_every_row_is_consistent_and_every_token_comes_once(
    strategy: str, buffer_size: int | None, overlong: str, seq_len: int
) -> None:
    lengths = lengths_for(seq_len)
    for number, options in enumerate(option_sets(seq_len)):
        options = {**options, "overlong": overlong}
        pack = packed(lengths, seq_len, strategy, buffer_size, seed=number, **options)
        for epoch in range(2):  # the counters restart, the rows are consistent in the next order too
            rows = list(pack)
            check_epoch(rows, lengths, seq_len, options, pack.stats)
            if strategy == "greedy" and overlong == "split":
                whole_rows_of_a_document_are_consecutive(rows, lengths, seq_len)
            assert epoch == 0 or pack.stats.rows == len(rows)


def whole_rows_of_a_document_are_consecutive(rows: list[dict[str, Any]], lengths: list[int], seq_len: int) -> None:
    """``greedy`` hands a long document's whole rows out at once: one after the other, in order."""
    placed: dict[int, list[tuple[int, int]]] = {}
    for index, row in enumerate(rows):
        number, start = divmod(int(row["input_ids"][0]), STRIDE)
        length = lengths[number - 1]
        if length > seq_len and start < length - length % seq_len:  # a whole row of a long document
            placed.setdefault(number, []).append((index, start))
    assert placed, "the corpus has long documents"
    for number, whole in placed.items():
        first = whole[0][0]
        assert whole == [(first + step, step * seq_len) for step in range(lengths[number - 1] // seq_len)]


def test_rows_handed_out_are_the_callers_to_change() -> None:
    """A trainer may edit a row in place (mask tokens, shift labels): later rows and the
    source's own arrays stay as they were."""
    lengths = [3, 12, 5, 2, 8, 1, 20, 4]
    docs = [{**doc, "input_ids": np.asarray(doc["input_ids"])} for doc in corpus(lengths)]
    saved = copy.deepcopy(docs)
    for strategy, buffer_size in STRATEGIES:
        options = {"strategy": strategy, "buffer_size": buffer_size, "token_fields": {"mask": MASK_PAD}}
        expected = [plain(row) for row in rs.from_list(saved).pack(8, document_fields=["meta"], **options)]
        got = []
        for row in rs.from_list(docs).pack(8, document_fields=["meta"], **options):
            got.append(plain(row))
            for name, value in row.items():
                if isinstance(value, np.ndarray):
                    value[...] = 3
                else:
                    value.clear()  # the list is the row's (its values are the records', documented)
        assert got == expected, strategy
        assert all(np.array_equal(a["input_ids"], b["input_ids"]) for a, b in zip(docs, saved))


# -- token ids of every kind -----------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype", [np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64, ">i4", "<u2"]
)
def test_integer_arrays_of_every_dtype_pack_their_values(dtype: Any) -> None:
    info = np.iinfo(np.dtype(dtype))
    values = [int(info.min), int(info.max), 0, 1, int(info.max) - 1, int(info.min) + 1, 5]
    if np.dtype(dtype) == np.uint64:
        values = [0, 2**63 - 1, 1, 2**40, 5]
    docs = [
        {"input_ids": np.asarray(values, dtype=dtype), "labels": np.asarray(values[::-1], dtype=dtype)},
        {"input_ids": np.asarray(values[:3], dtype=dtype)[::-1]},  # a negative-stride view
        {"input_ids": np.asarray(values * 3, dtype=dtype)[::3]},  # a strided view
    ]
    for strategy, buffer_size in [("greedy", None), ("best_fit", 2), ("bfd", None)]:
        rows = list(rs.from_list(docs).pack(4, strategy=strategy, buffer_size=buffer_size))
        got = sorted(int(t) for row in rows for t in row["input_ids"][row["document_ids"] > 0])
        assert got == sorted(values + values[:3] + values)
        labels = sorted(int(t) for row in rows for t in row["labels"][row["document_ids"] > 0])
        assert labels == got  # each document's labels are a permutation of its tokens here


@pytest.mark.parametrize(
    "tokens",
    [
        pytest.param(np.arange(4, dtype=np.float32), id="float32"),
        pytest.param(np.arange(4, dtype=np.float64), id="float64"),
        pytest.param(np.ones(3, dtype=bool), id="bool-array"),
        pytest.param([True, False], id="bool-list"),
        pytest.param(np.zeros((2, 3), dtype=np.int64), id="2-d"),
        pytest.param(np.zeros((1, 3), dtype=np.int64), id="batch-of-one"),
        pytest.param(np.zeros((0, 3), dtype=np.int64), id="empty-2-d"),
        pytest.param(None, id="None"),
        pytest.param("hello world", id="str"),
        pytest.param(b"\x01\x02", id="bytes"),
        pytest.param(7, id="int"),
        pytest.param(np.int64(7), id="numpy-scalar"),
        pytest.param({"a": 1}, id="dict"),
        pytest.param([1, "2"], id="mixed"),
        pytest.param([1, 2.5], id="float-list"),
        pytest.param([[1, 2], [3]], id="ragged"),
        pytest.param(np.array([1, 2], dtype=object), id="object-array"),
        pytest.param([2**64], id="past-uint64"),
        pytest.param([-(2**63) - 1], id="below-int64"),
    ],
)
def test_token_ids_that_are_not_a_1d_integer_sequence_are_source_errors_naming_the_record(tokens: Any) -> None:
    docs = [{"input_ids": [1, 2]}, {"input_ids": [3]}, {"input_ids": tokens}, {"input_ids": [4, 5]}]
    for strategy, buffer_size in [("greedy", None), ("first_fit", 2), ("best_fit", 1), ("bfd", 2), ("bfd", None)]:
        pipe = rs.from_list(docs).pack(4, strategy=strategy, buffer_size=buffer_size)
        with pytest.raises(rs.SourceError, match=r"Pack: record \(epoch 0, record 2\)") as error:
            list(pipe)
        assert "'input_ids'" in str(error.value)


@pytest.mark.parametrize(
    "tokens, expected",
    [
        pytest.param(range(3, 6), [3, 4, 5], id="range"),
        pytest.param((9, 8), [9, 8], id="tuple"),
        pytest.param(
            [2**40, -5, 2**31, -(2**63), 2**63 - 1], [2**40, -5, 2**31, -(2**63), 2**63 - 1], id="int64-edges"
        ),
        pytest.param([np.int16(-3), np.uint32(2**32 - 1)], [-3, 2**32 - 1], id="numpy-scalars"),
        pytest.param([], [], id="empty-list"),
        pytest.param(np.zeros(0, dtype=np.float32), [], id="empty-float-array"),
    ],
)
def test_token_sequences_of_other_python_types_pack_their_values(tokens: Any, expected: list[int]) -> None:
    docs = [{"input_ids": tokens}, {"input_ids": [1]}]
    pack = rs.from_list(docs).pack(8, strategy="greedy")
    rows = list(pack)
    assert rows[0]["input_ids"][: len(expected) + 1].tolist() == expected + [1]
    assert pack.stats.empty == (0 if expected else 1)


def test_ids_past_int32_and_negative_ones_survive_jsonl_and_parquet_and_resume(tmp_path: Path) -> None:
    lengths = [3, 9, 1, 4, 17, 2, 6]
    docs = [
        {"input_ids": [(-1) ** offset * (2**40 + number * 1000 + offset) for offset in range(length)]}
        for number, length in enumerate(lengths)
    ]
    jsonl = tmp_path / "ids.jsonl"
    jsonl.write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    parquet = tmp_path / "ids.parquet"
    pq.write_table(pa.Table.from_pylist(docs), parquet, row_group_size=3)
    expected = sorted(t for doc in docs for t in doc["input_ids"])
    for make in (lambda: rs.jsonl(str(jsonl)), lambda: rs.parquet(str(parquet)), lambda: rs.from_list(docs)):

        def build() -> rs.Node[Any]:
            return make().shuffle(1).pack(4, strategy="best_fit", buffer_size=2).map(plain)

        rows = list(build())
        assert sorted(t for row in rows for t, d in zip(row["input_ids"], row["document_ids"]) if d) == expected
        for k in (0, 3, len(rows) - 1, len(rows), len(rows) + 2):
            check_resume(build, k, 2 * len(rows) + 3)


# -- the key options naming missing fields or fields of another type -----------------------


@pytest.mark.parametrize(
    "options, record, match",
    [
        ({"input_field": "tokens"}, {"input_ids": [1]}, r"has no 'tokens' field \(it has 'input_ids'\)"),
        ({"input_field": "meta"}, {"meta": {"a": 1}}, "field 'meta' must be a 1-d sequence of integer ids"),
        ({"input_field": "text"}, {"text": "some words"}, "field 'text' must be a 1-d sequence of integer ids"),
        ({"labels_field": "target"}, {"input_ids": [1, 2], "target": "ab"}, "field 'target' must be a 1-d"),
        ({"labels_field": "target"}, {"input_ids": [1, 2], "target": [1.0, 2.0]}, "field 'target' must be a 1-d"),
        ({"labels_field": "target"}, {"input_ids": [1, 2], "target": [1, 2, 3]}, "has 3 'target' for 2 'input_ids'"),
        ({"token_fields": ["w"]}, {"input_ids": [1, 2]}, "has no 'w' field"),
        ({"token_fields": ["w"]}, {"input_ids": [1, 2], "w": "ab"}, "token field 'w' must be a 1-d"),
        ({"token_fields": ["w"]}, {"input_ids": [1, 2], "w": [1, 2, 3]}, "has 3 'w' for 2 'input_ids'"),
        ({"token_fields": ["w"]}, {"input_ids": [1, 2], "w": [[1, 2]]}, "token field 'w' must be a 1-d"),
        ({"document_fields": ["img"]}, {"input_ids": [1, 2]}, "has no 'img' field"),
        ({}, "input_ids", "is a str, expected a mapping"),
        ({}, None, "is a NoneType, expected a mapping"),
    ],
)
def test_a_key_option_naming_a_missing_field_or_one_of_another_type_is_a_source_error(
    options: dict[str, Any], record: Any, match: str
) -> None:
    good = {"input_ids": [1, 2], "target": [3, 4], "w": [0, 1], "img": 0, "tokens": [5, 6], "meta": [1], "text": [2]}
    docs = [good, good, record]
    for strategy, buffer_size in [("greedy", None), ("first_fit", 1), ("best_fit", 2), ("bfd", 2), ("bfd", None)]:
        pipe = rs.from_list(docs).pack(4, strategy=strategy, buffer_size=buffer_size, **options)
        with pytest.raises(rs.SourceError, match=match) as error:
            list(pipe)
        assert "record (epoch 0, record 2)" in str(error.value)


def test_labels_from_another_field_or_none_and_records_with_and_without_labels() -> None:
    docs = [
        {"input_ids": [1, 2, 3], "labels": [-100, 20, 30], "mask": [7, 8, 9]},
        {"input_ids": [4, 5]},  # no labels: its tokens
        {"input_ids": [6], "labels": [np.int64(-100)], "mask": [0]},
    ]
    docs[1]["mask"] = [1, 1]
    (row,) = list(rs.from_list(docs).pack(8, strategy="greedy"))
    assert row["labels"].tolist() == [-100, 20, 30, 4, 5, -100, -100, -100]
    (row,) = list(rs.from_list(docs).pack(8, strategy="greedy", labels_field=None))
    assert row["labels"].tolist() == [1, 2, 3, 4, 5, 6, -100, -100]
    (row,) = list(rs.from_list(docs).pack(8, strategy="greedy", labels_field="mask"))
    assert row["labels"].tolist() == [7, 8, 9, 1, 1, 0, -100, -100]
    (row,) = list(rs.from_list(docs).pack(8, strategy="greedy", labels_field="input_ids", mask_first_token=True))
    assert row["labels"].tolist() == [-100, 2, 3, -100, 5, -100, -100, -100]
    (row,) = list(rs.from_list(docs).pack(8, strategy="greedy", input_field="mask", labels_field="input_ids"))
    assert row["input_ids"].tolist() == [7, 8, 9, 1, 1, 0, 0, 0] and row["labels"][:6].tolist() == [1, 2, 3, 4, 5, 6]


# -- payload pad values ----------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize(
    "values, pad",
    [
        pytest.param([1, 0, 1], 0.5, id="float-pad-int-field"),
        pytest.param(np.array([True, False, True]), 7, id="int-pad-bool-field"),
        pytest.param(np.array([1.0, 2.0, 3.0], dtype=np.float16), 1e10, id="huge-pad-float16-field"),
        pytest.param(np.array([1, 2, 3], dtype=np.int8), 2.5, id="float-pad-int8-field"),
    ],
)
def test_a_pad_value_the_token_field_cannot_hold_is_kept_or_refused(values: Any, pad: float) -> None:
    docs = [{"input_ids": [1, 2, 3], "weight": values}]
    try:
        (row,) = list(rs.from_list(docs).pack(8, token_fields={"weight": pad}))
    except (rs.SourceError, rs.ConfigError) as error:
        assert "weight" in str(error)
        return
    assert row["weight"][3:].tolist() == [pad] * 5


@pytest.mark.parametrize(
    "values, pad",
    [
        pytest.param(np.array([1, 2, 3], dtype=np.uint8), -1, id="negative-uint8"),
        pytest.param(np.array([1, 2, 3], dtype=np.int8), 300, id="300-int8"),
        pytest.param([1, 2, 3], 2**63, id="past-int64"),
    ],
)
def test_an_integer_pad_value_out_of_the_fields_range_is_a_source_error(values: Any, pad: int) -> None:
    docs = [{"input_ids": [1, 2, 3], "weight": values}]
    with pytest.raises(rs.SourceError, match="token field 'weight' .* cannot hold its pad value"):
        list(rs.from_list(docs).pack(8, token_fields={"weight": pad}))


def test_pad_values_the_fields_hold_fill_padding_and_reserved_positions_in_the_fields_dtype() -> None:
    docs = [
        {"input_ids": [1, 2, 3], "f": np.array([0.25, 0.5, 0.75], dtype=np.float32), "b": np.array([1, 0, 1], bool)},
        {"input_ids": [4], "f": np.array([1.0], dtype=np.float32), "b": np.array([0], bool)},
    ]
    pipe = rs.from_list(docs).pack(
        8,
        strategy="greedy",
        token_fields={"f": -1.5, "b": True},
        length_fn=lambda r: len(r["input_ids"]) + 1,
        overlong="drop",
    )
    (row,) = list(pipe)
    assert row["f"].dtype == np.float32 and row["b"].dtype == np.bool_
    assert row["f"].tolist() == [0.25, 0.5, 0.75, -1.5, 1.0, -1.5, -1.5, -1.5]
    assert row["b"].tolist() == [True, False, True, True, False, True, True, True]
    assert row["cu_seqlens"][: int(row["cu_seqlens_count"])].tolist() == [0, 4, 6, 8]
    assert pipe.stats.tokens == 6 and pipe.stats.padding == 2


# -- sizes at their edges --------------------------------------------------------------------


def test_the_longest_row_builds_and_saves_and_one_more_is_refused() -> None:
    """``seq_len=SEQ_LEN_MAX`` (a row int32 cu_seqlens can describe) is accepted and its state
    restores (no row of it is built here: it would take tens of GB); one more is a ConfigError."""
    docs = corpus([3, 4])
    for strategy in ("greedy", "first_fit", "best_fit", "bfd"):
        pipe = rs.from_list(docs).pack(SEQ_LEN_MAX, strategy=strategy, max_documents=4)
        state = json.loads(json.dumps(pipe.get_state()))
        assert state["seq_len"] == SEQ_LEN_MAX
        rs.from_list(docs).pack(SEQ_LEN_MAX, strategy=strategy, max_documents=4).set_state(state)
        with pytest.raises(rs.StateError, match="seq_len"):
            rs.from_list(docs).pack(SEQ_LEN_MAX - 1, strategy=strategy, max_documents=4).set_state(state)
        with pytest.raises(rs.ConfigError, match="seq_len"):
            rs.from_list(docs).pack(SEQ_LEN_MAX + 1, strategy=strategy)


def test_a_long_row_of_one_token_documents_has_every_boundary() -> None:
    """seq_len 4096 of one-token documents: cu_seqlens holds all 4097 boundaries (the
    vectorised numbering), positions are all 0, and max_documents cuts the rows short."""
    docs = [{"input_ids": [number]} for number in range(1, 4097 + 3)]
    rows = list(rs.from_list(docs).pack(4096, strategy="greedy"))
    assert len(rows) == 2
    assert rows[0]["cu_seqlens"].tolist() == list(range(4097)) and int(rows[0]["cu_seqlens_count"]) == 4097
    assert (rows[0]["position_ids"] == 0).all() and rows[0]["document_ids"].tolist() == list(range(1, 4097))
    assert rows[1]["cu_seqlens"][:5].tolist() == [0, 1, 2, 3, 4096] and int(rows[1]["cu_seqlens_count"]) == 5
    rows = list(rs.from_list(docs).pack(4096, strategy="bfd", max_documents=1000))
    assert [int(row["document_ids"].max()) for row in rows] == [1000] * 4 + [99]
    assert all(row["cu_seqlens"].shape == (1002,) for row in rows)


@pytest.mark.parametrize("buffer_size", [2**45, 2**62, 2**63])
def test_first_fit_takes_a_buffer_size_far_past_the_data_as_a_bound(buffer_size: int) -> None:
    docs = corpus([3, 5, 2, 7, 1])
    small = [plain(row) for row in rs.from_list(docs).pack(8, strategy="first_fit", buffer_size=100)]
    try:
        pipe = rs.from_list(docs).pack(8, strategy="first_fit", buffer_size=buffer_size)
    except rs.ConfigError:
        return  # refusing it by name would do too
    assert [plain(row) for row in pipe] == small


# -- exact resume: a map before, a batch after, over every source kind ----------------------

RESUME_LENGTHS = [5, 0, 1, 8, 9, 17, 3, 24, 2, 7, 0, 6, 33, 1, 4, 8, 12, 2]


def tokenize(record: dict[str, Any]) -> dict[str, Any]:
    """The map before the packer: tokens from a text, a mask and an image path."""
    number, length = record["number"], record["length"]
    tokens = [number * STRIDE + offset for offset in range(length)]
    return {
        "input_ids": tokens,
        "labels": [token + LABEL_SHIFT for token in tokens],
        "mask": [(offset + number) % 2 for offset in range(length)],
        "meta": {"number": number},
    }


def raw_records() -> list[dict[str, Any]]:
    return [{"number": number, "length": length} for number, length in enumerate(RESUME_LENGTHS, start=1)]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    directory = tmp_path_factory.mktemp("pack-options")
    records = raw_records()
    jsonl = directory / "docs.jsonl"
    jsonl.write_text("".join(json.dumps(item) + "\n" for item in records))
    parquet = directory / "docs.parquet"
    pq.write_table(pa.Table.from_pylist(records), parquet, row_group_size=4)
    return {"jsonl": str(jsonl), "parquet": str(parquet)}


def source_of(kind: str, files: dict[str, str]) -> rs.Node[Any]:
    if kind == "list":
        return rs.from_list(raw_records())
    return rs.jsonl(files["jsonl"]) if kind == "jsonl" else rs.parquet(files["parquet"])


RESUME_CASES: list[tuple[str, str, int | None, dict[str, Any]]] = [
    ("list", "greedy", None, {"split_positions": "continue"}),
    ("jsonl", "first_fit", 1, {"mask_first_token": True}),
    ("parquet", "best_fit", 2, {"max_documents": 2}),
    ("list", "bfd", 2, {"overlong": "truncate", "pad_token_id": -7}),
    ("jsonl", "bfd", None, {"max_documents": 3}),
    ("parquet", "first_fit", 1000, {"overlong": "drop"}),
    ("list", "best_fit", 1, {"overlong": "truncate", "length_fn": lambda r: len(r["input_ids"]) + 1}),
    ("parquet", "greedy", None, {"overlong": "drop", "length_fn": lambda r: len(r["input_ids"]) * 2}),
]


@pytest.mark.parametrize(("kind", "strategy", "buffer_size", "options"), RESUME_CASES)
def test_resume_with_a_map_before_and_a_batch_after_at_every_kind_of_point(
    kind: str, strategy: str, buffer_size: int | None, options: dict[str, Any], files: dict[str, str]
) -> None:
    def build() -> rs.Node[Any]:
        return (
            source_of(kind, files)
            .shuffle(11)
            .map(tokenize)
            .pack(
                8,
                strategy=strategy,
                buffer_size=buffer_size,
                token_fields={"mask": MASK_PAD},
                document_fields=["meta"],
                **options,
            )
            .batch(3, collate_fn=collate_rows)
            .map(plain)
        )

    per_epoch = len(list(build()))
    assert per_epoch >= 2
    total = 2 * per_epoch + 2
    for k in (0, 1, per_epoch // 2, per_epoch - 1, per_epoch, per_epoch + 1):
        check_resume(build, k, total)
    check_resume(build, 1, total, k2=per_epoch + 1)  # twice in a row, across the epoch
    check_resume(build, per_epoch - 1, total, k2=per_epoch)  # the last batch, then the step after


def test_the_counters_of_a_restored_packer_are_those_of_the_run_it_continues() -> None:
    """``pack.stats`` and ``pending_keys()`` after a restore at any row equal the original's,
    and stay equal to the end of the epoch."""
    for _, strategy, buffer_size, options in RESUME_CASES:

        def build() -> Pack:
            return (
                rs.from_list(raw_records())
                .shuffle(3)
                .map(tokenize)
                .pack(5, strategy=strategy, buffer_size=buffer_size, **options)
            )

        rows = len(list(build()))
        for k in range(rows + 1):
            pipe = build()
            take(pipe, k)
            resumed = build()
            resumed.set_state(json.loads(json.dumps(pipe.get_state())))
            assert resumed.stats == pipe.stats, (strategy, k)
            assert sorted(resumed.pending_keys()) == sorted(pipe.pending_keys()), (strategy, k)
            list(pipe)
            list(resumed)
            assert resumed.stats == pipe.stats and resumed.stats.rows == rows, (strategy, k)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_loader_resumes_packed_batches_at_the_end_of_an_epoch_and_after_it(
    workers: int, files: dict[str, str]
) -> None:
    """Packed rows through ``rs.torch.Loader`` (collated to tensors): a state taken after the
    middle batch, the last one, and the first of the next epoch resumes exactly."""

    def build() -> rs.Node[Any]:
        return (
            rs.jsonl(files["jsonl"])
            .shuffle(5)
            .shard()
            .map(tokenize)
            .pack(8, strategy="best_fit" if workers else "bfd", buffer_size=2 if workers else None, max_documents=3)
            .batch(2, collate_fn=collate_rows)
        )

    def convert(batch: dict[str, Any]) -> Any:
        return {name: value.tolist() for name, value in batch.items()}

    with rst.Loader(build, num_workers=workers) as loader:
        first = [convert(batch) for batch in loader]
        second = [convert(batch) for batch in loader]
    count = len(first)
    assert count >= 3 and first != second
    for stop in (count // 2, count, count + 1):
        with rst.Loader(build, num_workers=workers) as loader:
            head = loader_head(loader, stop, count, convert)
            state = json.loads(json.dumps(loader.state_dict()))
        with rst.Loader(build, num_workers=workers) as loader:
            loader.load_state_dict(state)
            rest = loader_rest(loader, stop, count, convert)
        assert head + rest == first + second, stop


# -- hand-corrupted states -------------------------------------------------------------------

STATE_LENGTHS = lengths_for(4) * 2
ROW_OPTIONS: dict[str, Any] = {
    "overlong": "split",
    "split_positions": "restart",
    "mask_first_token": False,
    "max_documents": 2,
    "input_field": "input_ids",
    "labels_field": "labels",
    "pad_token_id": 0,
    "token_fields": {"mask": MASK_PAD},
    "document_fields": ["meta"],
}


def state_pipe(strategy: str, buffer_size: int | None, **changes: Any) -> Pack:
    docs = corpus(STATE_LENGTHS)
    for doc in docs:
        doc["ids"], doc["extra"] = doc["input_ids"], 1
    options = {**ROW_OPTIONS, **changes}
    return rs.from_list(docs).shuffle(3).pack(4, strategy=strategy, buffer_size=buffer_size, **options)


def check_refused_and_unchanged(build: Callable[[], rs.Node[Any]], state: dict[str, Any], match: str) -> None:
    """``state`` is refused with a StateError naming the packer and ``match``; the pipeline,
    two rows in, then saves the same state and continues as a run that never saw the call."""
    expected = [plain(row) for row in take(build(), 200)]
    pipe = build()
    head = [plain(row) for row in take(pipe, 2)]
    before = json.dumps(pipe.get_state(), sort_keys=True)
    with pytest.raises(rs.StateError, match=match) as error:
        pipe.set_state(state)
    assert str(error.value).startswith("Pack")
    assert json.dumps(pipe.get_state(), sort_keys=True) == before
    assert head + [plain(row) for row in take(pipe, 198)] == expected


@pytest.mark.parametrize(("strategy", "buffer_size"), [("best_fit", 3), ("bfd", None)])
@pytest.mark.parametrize(
    "change",
    [
        {"strategy": "first_fit"},
        {"buffer_size": 4},
        {"overlong": "truncate"},
        {"split_positions": "continue"},
        {"mask_first_token": True},
        {"max_documents": None},
        {"max_documents": 3},
        {"input_field": "ids"},
        {"labels_field": None},
        {"pad_token_id": -1},
        {"token_fields": {"mask": 0}},
        {"token_fields": ["mask"]},
        {"token_fields": None},
        {"document_fields": None},
        {"document_fields": ["meta", "extra"]},
    ],
    ids=lambda change: "-".join(f"{key}={value}" for key, value in change.items()),
)
def test_a_state_saved_with_other_row_options_is_refused_and_changes_nothing(
    strategy: str, buffer_size: int | None, change: dict[str, Any]
) -> None:
    """Every option that shapes the rows is part of the state: a checkpoint resumed after an
    option changed is refused by name, not continued into rows of another shape."""
    pipe = state_pipe(strategy, buffer_size)
    take(pipe, 3)
    state = json.loads(json.dumps(pipe.get_state()))
    (name,) = change
    if name == "buffer_size" and buffer_size is None:
        change = {"strategy": "bfd", "buffer_size": 4}
    options = {"strategy": strategy, "buffer_size": buffer_size, **change}
    strategy, buffer_size = options.pop("strategy"), options.pop("buffer_size")
    check_refused_and_unchanged(lambda: state_pipe(strategy, buffer_size, **options), state, name)


def bfd_state() -> dict[str, Any]:
    pipe = state_pipe("bfd", None)
    take(pipe, 3)
    state: dict[str, Any] = json.loads(json.dumps(pipe.get_state()))
    return state


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda s: s.update(emitted=-1), "'emitted'"),
        (lambda s: s.update(emitted=3.0), "'emitted'"),
        (lambda s: s.update(emitted=True), "'emitted'"),
        (lambda s: s.update(emitted=2**70), "rows handed out"),
        (lambda s: s.update(planned=s["planned"] + 1), "planning the epoch again gives"),
        (lambda s: s.update(planned="9"), "'planned'"),
        (lambda s: s.update(planned=None), "'planned'"),
        (lambda s: s.update(row_order="shortest"), "'row_order'"),
        (lambda s: s.update(row_order=None), "'row_order'"),
        (lambda s: s.update(inherited=[[0, 1, 0, 1]]), "inherited"),
        (lambda s: s.update(inherited_sizes=[1]), "inherited"),
        (lambda s: s.update(inherited=[[0, 1, 0, 1]], inherited_sizes=[2]), "inherited"),
        (lambda s: s.update(inherited=[[0, 1, 0, 1]] * 3, inherited_sizes=[3], emitted=0), "inherited"),
        (lambda s: s.update(inherited=[[0, 5, 0, 5]], inherited_sizes=[1]), "inherited"),
        (lambda s: s.update(inherited=[[5, 1, 0, 1]], inherited_sizes=[1]), "epoch"),
        (lambda s: s.update(inherited=[[0, 2**70, 0, 1]], inherited_sizes=[1]), "inherited"),
        (lambda s: s.update(inherited=[[0, 1, 0, 3]], inherited_sizes=[1], emitted=0), "outside record"),
        (lambda s: s.update(inherited=[[0, 999, 0, 1]], inherited_sizes=[1], emitted=0), "inherited"),
        (lambda s: s["stats"].pop("rows"), "'rows'"),
        (lambda s: s["stats"].update(padding=1.5), "'padding'"),
        (lambda s: s["stats"].update(documents=-1), "'documents'"),
        (lambda s: s.update(ended="no"), "'ended'"),
    ],
)
def test_a_damaged_whole_epoch_plan_state_is_refused_and_changes_nothing(edit: Any, match: str) -> None:
    state = bfd_state()
    edit(state)
    check_refused_and_unchanged(lambda: state_pipe("bfd", None), state, match)


def listed_state(strategy: str, buffer_size: int) -> dict[str, Any]:
    pipe = state_pipe(strategy, buffer_size)
    take(pipe, 5)
    return expand_references(json.loads(json.dumps(pipe.get_state())))


def long_record() -> int:
    """The index of a record of 12 tokens (three whole rows of 4)."""
    return STATE_LENGTHS.index(12)


@pytest.mark.parametrize(("strategy", "buffer_size"), [("greedy", 3), ("first_fit", 3), ("best_fit", 3), ("bfd", 3)])
@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda s: s.update(ready=[[0, 1, 0, 1], [0, 7, 0, 1], [0, 10, 0, 1]], ready_sizes=[3]), "ready row"),
        (lambda s: s.update(ready=[[0, 3, 0, 3], [0, 7, 0, 2]], ready_sizes=[2]), "ready row"),
        (lambda s: s.update(ready=[[0, long_record(), 0, 8], [0, 1, 0, 1]], ready_sizes=[2]), "ready row"),
        (lambda s: s.update(ready=[], ready_sizes=[0]), "does not fit"),
        (lambda s: s.update(span=[0, long_record(), 0, 6]), "whole number of rows"),
        (lambda s: s.update(open_sizes=[*s["open_sizes"], 0, 0, 0, 0, 0, 0, 0]), "open groups"),
        (lambda s: s.update(inherited=[[0, 5, 3, 3]]), "empty token range"),
        (lambda s: s.update(inherited=[[-1, 5, 0, 2]]), "inherited entry"),
        (lambda s: s.update(inherited=[[0, 2**64, 0, 2]]), "inherited entry"),
        (lambda s: s.update(exhausted=1), "'exhausted'"),
        (lambda s: s["stats"].update(rows=None), "'rows'"),
    ],
)
def test_a_damaged_streaming_state_is_refused_and_changes_nothing(
    strategy: str, buffer_size: int, edit: Any, match: str
) -> None:
    state = listed_state(strategy, buffer_size)
    edit(state)
    check_refused_and_unchanged(lambda: state_pipe(strategy, buffer_size), state, match)


@pytest.mark.parametrize("strategy", ["greedy", "first_fit", "bfd"])
def test_an_open_row_past_max_documents_is_refused(strategy: str) -> None:
    state = listed_state(strategy, 3)
    groups = len(state["open_sizes"])
    state.update(
        open=[[0, 1, 0, 1], [0, 7, 0, 1], [0, 10, 0, 1]],
        open_sizes=[3] + [0] * (groups - 1 if strategy != "greedy" else 0),
        ready=[],
        ready_sizes=[],
        span=[],
    )
    check_refused_and_unchanged(lambda: state_pipe(strategy, 3), state, "open")


@pytest.mark.parametrize(("strategy", "buffer_size"), [("greedy", 3), ("best_fit", 3)])
def test_a_span_beyond_its_record_is_refused_when_due_and_the_row_stays_due(strategy: str, buffer_size: int) -> None:
    state = listed_state(strategy, buffer_size)
    state.update(span=[0, long_record(), 8, 16])
    pipe = state_pipe(strategy, buffer_size)
    pipe.set_state(state)
    for _ in range(2):
        with pytest.raises(rs.StateError, match="outside record") as error:
            next(pipe)
        assert str(error.value).startswith("Pack")


@pytest.mark.parametrize(
    "pad",
    [np.int64(3), np.uint8(3), np.bool_(True), np.float32(0.5), np.float64(0.5)],
    ids=lambda pad: type(pad).__name__,
)
def test_a_numpy_scalar_pad_value_is_taken_as_the_number_it_holds_and_saved_as_plain_json(pad: Any) -> None:
    docs = [{"input_ids": [1, 2, 3], "w": np.array([0.0, 1.0, 1.0])}]
    pipe = rs.from_list(docs).pack(8, token_fields={"w": pad})
    (row,) = list(pipe)
    assert row["w"][3:].tolist() == [pad.item()] * 5
    saved = pipe.get_state()["token_fields"]["w"]
    assert type(saved) is type(pad.item()) and saved == pad.item()


# -- any options, any lengths: consistent rows and exact resume ------------------------------


@given(
    lengths=st.lists(st.integers(0, 14), min_size=1, max_size=14),
    seq_len=st.sampled_from([1, 2, 3, 4]),
    strategy=st.sampled_from(STRATEGIES),
    overlong=st.sampled_from(POLICIES),
    options=st.fixed_dictionaries(
        {
            "split_positions": st.sampled_from(["restart", "continue"]),
            "mask_first_token": st.booleans(),
            "max_documents": st.sampled_from([None, 1, 2, 3]),
            "pad_token_id": st.sampled_from([0, -1, 2**40]),
        }
    ),
    cut=st.floats(0, 1.2),
    seed=st.integers(0, 3),
)
@settings(deadline=None)
def test_any_options_give_consistent_rows_and_resume_exactly(
    lengths: list[int],
    seq_len: int,
    strategy: tuple[str, int | None],
    overlong: str,
    options: dict[str, Any],
    cut: float,
    seed: int,
) -> None:
    options = {**options, "overlong": overlong}

    def build() -> Pack:
        return packed(lengths, seq_len, *strategy, seed=seed, **options)

    pack = build()
    rows = list(pack)
    check_epoch(rows, lengths, seq_len, options, pack.stats)

    def rows_as_data() -> rs.Node[Any]:
        return build().map(plain)

    k = int(cut * len(rows))
    check_resume(rows_as_data, k, 2 * len(rows) + 1, k2=min(k + 2, 2 * len(rows)))


# -- what documentation promises about fields and keys ----------------------------------------


@pytest.mark.parametrize("kind", ["parquet", "jsonl"])
def test_a_null_labels_value_falls_back_to_the_token_ids(kind: str, tmp_path: Path) -> None:
    records = [
        {"input_ids": [1, 2, 3], "labels": [-100, 2, 3]},
        {"input_ids": [4, 5], "labels": None},
        {"input_ids": [6], "labels": [60]},
    ]
    path = tmp_path / f"sft.{kind}"
    source: rs.Node[Any]
    if kind == "parquet":
        pq.write_table(pa.Table.from_pylist(records), path)
        source = rs.parquet(str(path))
    else:
        path.write_text("".join(json.dumps(item) + "\n" for item in records))
        source = rs.jsonl(str(path))
    (row,) = list(source.pack(8, strategy="greedy"))
    assert row["labels"].tolist() == [-100, 2, 3, 4, 5, 60, -100, -100]


def held_documents(pipe: rs.Node[Any], stream: list[int]) -> set[tuple[int, int]]:
    """``(epoch, leaf record)`` of the documents a packer holds: pulled from upstream (the first
    ``position`` of ``stream``, its document numbers) and not fully handed out yet."""
    position = pipe.get_state()["upstream"]["position"]
    later = set()
    for row in copy.deepcopy(pipe):
        bounds = row["cu_seqlens"]
        later |= {int(row["input_ids"][int(bounds[i])]) // STRIDE for i in range(int(row["document_ids"].max()))}
    return {(0, number - 1) for number in later & set(stream[:position])}


@pytest.mark.parametrize("shard", [False, True])
@pytest.mark.parametrize(("strategy", "buffer_size"), [("greedy", None), ("first_fit", 3), ("best_fit", 3)])
def test_pending_keys_are_the_epoch_and_record_of_every_document_held(
    strategy: str, buffer_size: int | None, shard: bool
) -> None:
    docs = corpus([3, 5, 9, 2, 7, 1, 4, 6, 12, 3] * 2)

    def upstream() -> rs.Node[Any]:
        source = rs.from_list(docs).shuffle(1)
        return source.shard(1, 2) if shard else source

    stream = [item["input_ids"][0] // STRIDE for item in upstream()]
    pipe = upstream().pack(8, strategy=strategy, buffer_size=buffer_size)
    take(pipe, 2)
    while not pipe.pending_keys():  # on to a row after which documents are held (the order decides)
        take(pipe, 1)
    assert set(pipe.pending_keys()) == held_documents(pipe, stream)


def test_torch_tensors_from_a_tokenizer_pack_like_arrays_and_a_batch_of_one_is_refused() -> None:
    torch = pytest.importorskip("torch")
    docs = [
        {"input_ids": torch.arange(5, dtype=torch.int32), "mask": torch.ones(5, dtype=torch.float16)},
        {"input_ids": torch.arange(10, 13), "mask": torch.zeros(3, dtype=torch.float16)},
    ]
    (row,) = list(rs.from_list(docs).pack(8, strategy="greedy", token_fields=["mask"]))
    assert row["input_ids"].tolist() == [0, 1, 2, 3, 4, 10, 11, 12] and row["mask"].dtype == np.float16
    docs.append({"input_ids": torch.arange(4).reshape(1, 4), "mask": torch.ones(4)})  # return_tensors="pt"
    with pytest.raises(rs.SourceError, match=r"record \(epoch 0, record 2\) field 'input_ids' .* shape \(1, 4\)"):
        list(rs.from_list(docs).pack(8, strategy="greedy", token_fields=["mask"]))


@pytest.mark.parametrize(("strategy", "buffer_size"), [("first_fit", 2), ("bfd", 2)])
def test_pack_after_repeat_resumes_exactly_where_epochs_share_rows(strategy: str, buffer_size: int) -> None:
    def build() -> rs.Node[Any]:
        return (
            rs.from_list(raw_records())
            .shuffle(4)
            .map(tokenize)
            .repeat(3)
            .pack(
                8,
                strategy=strategy,
                buffer_size=buffer_size,
                overlong="truncate",
                max_documents=2,
                token_fields={"mask": MASK_PAD},
                document_fields=["meta"],
                length_fn=lambda record: len(record["input_ids"]) + 1,
            )
            .map(plain)
        )

    rows = len(list(build()))
    for k in (0, rows // 3, rows // 2, rows - 1, rows, rows + 1):
        check_resume(build, k, rows + 3)
