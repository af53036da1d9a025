"""RowFormat.build against a plain reference: every field of every row bit-identical, over
random rows of one to many segments (both ways of writing positions and document ids), split
documents, reserved positions, labels, payload fields and every row option."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from resumable.pack import rows as row_module
from resumable.pack.rows import (
    CU_SEQLENS,
    CU_SEQLENS_COUNT,
    DOCUMENT_IDS,
    IGNORE_INDEX,
    INPUT_IDS,
    LABELS,
    POSITION_IDS,
    Document,
    RowFormat,
    Segment,
    cu_seqlens_length,
)


def reference_row(form: RowFormat, segments: Sequence[Segment]) -> dict[str, Any]:
    """The row format written out the plain way: fill, then one vectorised pass per field."""
    seq_len, count = form.seq_len, len(segments)
    input_ids = np.full(seq_len, form.pad_token_id, dtype=np.int64)
    labels = np.full(seq_len, IGNORE_INDEX, dtype=np.int64)
    lengths = np.array([end - start + document.extra for document, start, end in segments], dtype=np.int64)
    offsets = np.array([start for _, start, _ in segments], dtype=np.int64)
    used = 0
    for document, start, end in segments:
        stop = used + end - start
        input_ids[used:stop] = document.tokens[start:end]
        labels[used:stop] = (document.tokens if document.labels is None else document.labels)[start:end]
        used = stop + document.extra
    cu_seqlens = np.full(form.cu_len, seq_len, dtype=np.int32)
    cu_seqlens[0] = 0
    cu_seqlens[1 : count + 1] = np.cumsum(lengths)
    starts = cu_seqlens[:count].astype(np.int64)
    position_ids = np.arange(seq_len, dtype=np.int64)
    position_ids[:used] -= np.repeat(starts - offsets if form.continue_positions else starts, lengths)
    position_ids[used:] -= used
    document_ids = np.zeros(seq_len, dtype=np.int32)
    document_ids[:used] = np.repeat(np.arange(1, count + 1, dtype=np.int32), lengths)
    if form.mask_first_token:
        labels[starts] = IGNORE_INDEX
    row: dict[str, Any] = {
        INPUT_IDS: input_ids,
        LABELS: labels,
        POSITION_IDS: position_ids,
        DOCUMENT_IDS: document_ids,
        CU_SEQLENS: cu_seqlens,
        CU_SEQLENS_COUNT: np.array(count + 1 + (used < seq_len), dtype=np.int32),
    }
    for column, (name, pad) in enumerate(form.token_fields):
        values = np.full(seq_len, pad, dtype=np.result_type(*[document.fields[column] for document, _, _ in segments]))
        for (document, start, end), at in zip(segments, starts.tolist()):
            values[at : at + end - start] = document.fields[column][start:end]
        row[name] = values
    for column, name in enumerate(form.document_fields):
        row[name] = [
            (at, document.payloads[column] if start == 0 else None)
            for (document, start, _), at in zip(segments, starts.tolist())
        ]
    return row


@st.composite
def rows(draw: st.DrawFn) -> tuple[RowFormat, list[Segment]]:
    """A row format and segments whose costs fit it: up to 96 positions and 48 segments."""
    seq_len = draw(st.integers(1, 96))
    payloads = draw(st.booleans())
    form = RowFormat(
        seq_len,
        cu_seqlens_length(seq_len, draw(st.sampled_from([None, 64]))),
        pad_token_id=draw(st.integers(-3, 3)),
        mask_first_token=draw(st.booleans()),
        continue_positions=draw(st.booleans()),
        token_fields=(("weights", 0.5),) if payloads else (),
        document_fields=("source",) if payloads else (),
    )
    segments: list[Segment] = []
    left, wanted, longest = seq_len, draw(st.integers(1, 48)), draw(st.sampled_from([1, 2, 8, 64]))
    while left and len(segments) < wanted:
        length = draw(st.integers(1, min(left, longest)))
        whole = draw(st.booleans())
        extra = draw(st.integers(0, min(3, left - length))) if whole else 0
        start = 0 if whole else draw(st.integers(0, 5))
        size = start + length + draw(st.integers(0, 3))
        tokens = np.arange(size, dtype=np.int32) * 7 + len(segments)
        labels = -tokens if draw(st.booleans()) else None
        fields = (np.linspace(0, 1, size, dtype=np.float32),) if payloads else ()
        document = Document(tokens, labels, fields, (f"doc{len(segments)}",) if payloads else (), extra)
        segments.append(Segment(document, start, start + length))
        left -= length + extra
    return form, segments


@given(rows())
def test_built_rows_equal_the_reference(case: tuple[RowFormat, list[Segment]]) -> None:
    form, segments = case
    built, expected = form.build(segments), reference_row(form, segments)
    assert list(built) == list(expected)
    for name, value in expected.items():
        if isinstance(value, np.ndarray):
            assert built[name].dtype == value.dtype and np.array_equal(built[name], value), name
        else:
            assert built[name] == value, name


def test_rows_of_many_segments_take_the_vectorised_way() -> None:
    """Both ways are covered: a row of one-token segments past the threshold."""
    count = row_module.VECTORISED_FROM + 8
    form = RowFormat(count + 3, cu_seqlens_length(count + 3, None), continue_positions=True)
    segments = [Segment(Document(np.arange(4, dtype=np.int32) + n, None), n % 3, n % 3 + 1) for n in range(count)]
    built, expected = form.build(segments), reference_row(form, segments)
    for name in (POSITION_IDS, DOCUMENT_IDS, CU_SEQLENS, INPUT_IDS):
        assert np.array_equal(built[name], expected[name]), name
