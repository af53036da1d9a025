"""Output rows: fixed-shape numpy arrays assembled from token slices, and the batch collate.

A row is a dict of numpy arrays, every shape fixed by ``seq_len`` and the row format, so a
compiled model sees one shape for the whole run:

- ``input_ids`` (int64, ``seq_len``): the pieces' tokens back to back, then ``pad_token_id``.
- ``labels`` (int64, ``seq_len``): the pieces' labels (their tokens unless the record has labels),
  ``-100`` at padding and, with ``mask_first_token``, at the first token of every piece.
- ``position_ids`` (int64, ``seq_len``): restart at 0 for every piece (a split document's tail
  may continue from its offset instead) and for the padding.
- ``document_ids`` (int32, ``seq_len``): 1, 2, ... per piece in the row; 0 at padding.
- ``cu_seqlens`` (int32, ``cu_len``): segment boundaries for flash-attention varlen. The padding
  is a segment of its own, so the boundaries always end at ``seq_len``; unused entries repeat
  ``seq_len`` (empty segments, which varlen kernels accept).
- ``cu_seqlens_count`` (int32, scalar): how many leading entries of ``cu_seqlens`` are valid.

With payload options, a row also holds each token field (``seq_len``, the dtype of its pieces'
arrays: their slices, then the field's pad value) and each document field (a list with one
``(offset in the row, value)`` per piece, in piece order: entry ``i`` belongs to document id
``i + 1``; later pieces of a split document carry ``None``). A document whose packing cost
exceeds its tokens (``length_fn``) occupies ``cost`` positions: its tokens, then reserved
positions (``pad_token_id``, labels -100, the token fields' pad values) inside its segment, so
``position_ids``, ``document_ids`` and ``cu_seqlens`` already describe the row once a processor
expands the document (an image placeholder into image tokens) within its segment.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np

from resumable.errors import SourceError

IGNORE_INDEX = -100

INPUT_IDS = "input_ids"
LABELS = "labels"
POSITION_IDS = "position_ids"
DOCUMENT_IDS = "document_ids"
CU_SEQLENS = "cu_seqlens"
CU_SEQLENS_COUNT = "cu_seqlens_count"
ROW_FIELDS = (INPUT_IDS, LABELS, POSITION_IDS, DOCUMENT_IDS, CU_SEQLENS, CU_SEQLENS_COUNT)

PadValue = int | float | bool
"""A token field's value at padding and at reserved positions."""

VECTORISED_FROM = 24
"""Segments in a row from which ``position_ids`` and ``document_ids`` are written in two
vectorised passes rather than a slice per segment (each way's cost per row crosses near here)."""


@functools.lru_cache(maxsize=16)
def _ramp(length: int) -> np.ndarray:
    """``0, 1, ..., length - 1`` (int64, read-only): the positions every segment's slice copies."""
    ramp = np.arange(length, dtype=np.int64)
    ramp.flags.writeable = False
    return ramp


class Document(NamedTuple):
    """A record as the packer reads it: token ids, labels (None: the token ids), the token
    fields' arrays and the document fields' values (in the order of the packer's options),
    and ``extra``: positions its packing cost reserves beyond its tokens (0 without
    ``length_fn``; such a document is never split, so only a piece starting at 0 has any)."""

    tokens: np.ndarray
    labels: np.ndarray | None
    fields: tuple[np.ndarray, ...] = ()
    payloads: tuple[Any, ...] = ()
    extra: int = 0


class Segment(NamedTuple):
    """Tokens ``[start, end)`` of one document."""

    document: Document
    start: int
    end: int

    @property
    def cost(self) -> int:
        """Positions the segment takes in its row: its tokens and the document's reserved ones."""
        return self.end - self.start + self.document.extra


def cu_seqlens_length(seq_len: int, max_documents: int | None) -> int:
    """Entries of ``cu_seqlens``: room for every piece, a padding segment and the leading 0.

    Without a bound on pieces per row, a row holds at most ``seq_len`` one-token segments.
    """
    if max_documents is None:
        return seq_len + 1
    return min(max_documents + 2, seq_len + 1)


@dataclass(frozen=True)
class RowFormat:
    """How segments become a row; see the module docstring for the fields."""

    seq_len: int
    cu_len: int
    pad_token_id: int = 0
    mask_first_token: bool = False
    continue_positions: bool = False
    token_fields: tuple[tuple[str, PadValue], ...] = ()
    """``(name, pad value)`` of every token field, in the order of ``Document.fields``."""
    document_fields: tuple[str, ...] = ()
    """Names of the document fields, in the order of ``Document.payloads``."""

    def build(self, segments: Sequence[Segment]) -> dict[str, Any]:
        """One row from segments whose costs sum to at most ``seq_len``: each field written
        once, segment by segment (slices, no per-row temporaries); ``position_ids`` and
        ``document_ids`` of rows of many segments in two vectorised passes instead."""
        seq_len, pad = self.seq_len, self.pad_token_id
        count = len(segments)
        input_ids = np.empty(seq_len, dtype=np.int64)
        labels = np.empty(seq_len, dtype=np.int64)
        position_ids = np.empty(seq_len, dtype=np.int64)
        document_ids = np.empty(seq_len, dtype=np.int32)
        ramp = _ramp(seq_len)
        per_segment = count < VECTORISED_FROM
        starts: list[int] = []
        used = 0
        for number, (document, start, end) in enumerate(segments, 1):
            tokens, source_labels = document.tokens, document.labels
            stop = used + end - start
            cost_end = stop + document.extra
            input_ids[used:stop] = tokens[start:end]
            labels[used:stop] = (tokens if source_labels is None else source_labels)[start:end]
            if cost_end > stop:  # reserved positions
                input_ids[stop:cost_end] = pad
                labels[stop:cost_end] = IGNORE_INDEX
            if per_segment:
                if start and self.continue_positions:
                    np.add(ramp[: cost_end - used], start, out=position_ids[used:cost_end])
                else:
                    position_ids[used:cost_end] = ramp[: cost_end - used]
                document_ids[used:cost_end] = number
            starts.append(used)
            used = cost_end
        if not per_segment:
            self._number_segments(segments, starts, used, ramp, position_ids, document_ids)
        padding = seq_len - used
        input_ids[used:] = pad
        labels[used:] = IGNORE_INDEX
        position_ids[used:] = ramp[:padding]
        document_ids[used:] = 0

        cu_seqlens = np.empty(self.cu_len, dtype=np.int32)
        cu_seqlens[:count] = starts
        cu_seqlens[count:] = seq_len
        cu_seqlens[count] = used
        if self.mask_first_token:
            labels[starts] = IGNORE_INDEX
        row: dict[str, Any] = {
            INPUT_IDS: input_ids,
            LABELS: labels,
            POSITION_IDS: position_ids,
            DOCUMENT_IDS: document_ids,
            CU_SEQLENS: cu_seqlens,
            CU_SEQLENS_COUNT: np.array(count + 1 + (padding > 0), dtype=np.int32),
        }
        if self.token_fields or self.document_fields:
            row.update(self._payloads(segments, starts))
        return row

    def _number_segments(
        self,
        segments: Sequence[Segment],
        starts: list[int],
        used: int,
        ramp: np.ndarray,
        position_ids: np.ndarray,
        document_ids: np.ndarray,
    ) -> None:
        """``position_ids`` and ``document_ids`` of the first ``used`` positions of a row of
        many segments (which begin at ``starts``), each in one pass over the row (``ramp``:
        ``_ramp(seq_len)``)."""
        count = len(segments)
        bounds = np.array([*starts, used], dtype=np.int64)
        lengths = np.diff(bounds)
        shift = bounds[:-1]
        if self.continue_positions:
            shift = shift - np.fromiter((start for _, start, _ in segments), dtype=np.int64, count=count)
        np.subtract(ramp[:used], np.repeat(shift, lengths), out=position_ids[:used])
        document_ids[:used] = np.repeat(np.arange(1, count + 1, dtype=np.int32), lengths)

    def _payloads(self, segments: Sequence[Segment], starts: list[int]) -> dict[str, Any]:
        """The token fields (sliced like the tokens) and document fields of a row whose
        segments start at ``starts``."""
        payloads: dict[str, Any] = {}
        for column, (name, pad) in enumerate(self.token_fields):
            arrays = [document.fields[column] for document, _, _ in segments]
            dtype = np.result_type(*arrays)
            values = _filled(self.seq_len, pad, dtype, name)
            for array, (_, start, end), at in zip(arrays, segments, starts):
                values[at : at + end - start] = array[start:end]
            payloads[name] = values
        for column, name in enumerate(self.document_fields):
            payloads[name] = [
                (at, document.payloads[column] if start == 0 else None)
                for (document, start, _), at in zip(segments, starts)
            ]
        return payloads


def _filled(size: int, pad: PadValue, dtype: np.dtype[Any], name: str) -> np.ndarray:
    """``size`` copies of token field ``name``'s pad value in the field's dtype, or a
    ``SourceError`` if the dtype cannot hold it: an integer or bool field takes only a value it
    holds exactly (0.5 is no int, 7 no bool), a float field any value short of its overflow (0.1
    rounds in float32 as every float does)."""
    try:
        with np.errstate(over="ignore", invalid="ignore"):
            values = np.full(size, pad, dtype=dtype)
        held = values[0]
        fits = bool(np.isfinite(held) if np.issubdtype(dtype, np.inexact) else held == pad)
    except (OverflowError, ValueError, TypeError):
        fits = False
    if not fits:
        raise SourceError(f"Pack: token field {name!r} of dtype {dtype} cannot hold its pad value {pad!r}")
    return values


def collate_rows(rows: Sequence[Mapping[str, Any]], as_torch: bool = False, flatten: bool = False) -> dict[str, Any]:
    """Stack packed rows into a batch: ``.batch(8, collate_fn=collate_rows)``.

    By default every array field gains a leading batch axis: ``(B, seq_len)`` token fields,
    ``(B, cu_len)`` ``cu_seqlens`` and ``(B,)`` ``cu_seqlens_count``; a document field becomes
    a list of the rows' lists.

    With ``flatten=True`` the batch is one long sequence, the layout flash-attention varlen
    kernels take: token fields of shape ``(1, B * seq_len)``, ``document_ids`` numbered across
    the batch, and ``cu_seqlens`` of fixed length ``B * (cu_len - 1) + 1`` holding every row's
    segments in order (valid count in ``cu_seqlens_count``, unused entries ``B * seq_len``);
    a document field is one list, its offsets counted from the start of the batch.

    ``as_torch=True`` returns torch tensors (sharing memory with the stacked arrays).
    """
    if not rows:
        raise ValueError("collate_rows needs at least one row")
    batch: dict[str, Any] = {
        field: np.stack([row[field] for row in rows]) if isinstance(value, np.ndarray) else [row[field] for row in rows]
        for field, value in rows[0].items()
    }
    if flatten:
        batch = _flatten(batch)
    if as_torch:
        import torch

        return {
            field: torch.from_numpy(value) if isinstance(value, np.ndarray) else value for field, value in batch.items()
        }
    return batch


def _flatten(batch: dict[str, Any]) -> dict[str, Any]:
    rows, seq_len = batch[INPUT_IDS].shape
    cu_len = batch[CU_SEQLENS].shape[1]
    segments = batch[CU_SEQLENS_COUNT].astype(np.int64) - 1
    row_starts = np.arange(rows, dtype=np.int64) * seq_len
    valid = np.arange(cu_len - 1)[None, :] < segments[:, None]
    starts = (batch[CU_SEQLENS][:, :-1] + row_starts[:, None])[valid]
    cu_seqlens = np.full(rows * (cu_len - 1) + 1, rows * seq_len, dtype=np.int32)
    cu_seqlens[: starts.size] = starts

    document_ids = batch[DOCUMENT_IDS]
    earlier = np.concatenate(([0], np.cumsum(document_ids.max(axis=1))[:-1])).astype(np.int32)
    document_ids = np.where(document_ids > 0, document_ids + earlier[:, None], 0).astype(np.int32)

    flat: dict[str, Any] = {
        DOCUMENT_IDS: document_ids.reshape(1, rows * seq_len),
        CU_SEQLENS: cu_seqlens,
        CU_SEQLENS_COUNT: np.array(starts.size + 1, dtype=np.int32),
    }
    for field, value in batch.items():  # in the batch's order
        if field in flat:
            flat[field] = flat.pop(field)
        elif isinstance(value, np.ndarray):  # a per-token field
            flat[field] = value.reshape(1, rows * seq_len)
        else:  # a document field: (offset, value) lists, offsets counted from the batch's start
            flat[field] = [(at + row * seq_len, item) for row, entries in enumerate(value) for at, item in entries]
    return flat
