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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np

IGNORE_INDEX = -100

INPUT_IDS = "input_ids"
LABELS = "labels"
POSITION_IDS = "position_ids"
DOCUMENT_IDS = "document_ids"
CU_SEQLENS = "cu_seqlens"
CU_SEQLENS_COUNT = "cu_seqlens_count"
ROW_FIELDS = (INPUT_IDS, LABELS, POSITION_IDS, DOCUMENT_IDS, CU_SEQLENS, CU_SEQLENS_COUNT)


class Segment(NamedTuple):
    """Tokens ``[start, end)`` of one document (labels default to the tokens)."""

    tokens: np.ndarray
    labels: np.ndarray | None
    start: int
    end: int


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

    def build(self, segments: Sequence[Segment]) -> dict[str, np.ndarray]:
        """One row from segments whose lengths sum to at most ``seq_len`` (one copy per segment)."""
        seq_len = self.seq_len
        count = len(segments)
        input_ids = np.full(seq_len, self.pad_token_id, dtype=np.int64)
        labels = np.full(seq_len, IGNORE_INDEX, dtype=np.int64)
        lengths = np.empty(count, dtype=np.int64)
        offsets = np.zeros(count, dtype=np.int64)
        used = 0
        for index, (tokens, source_labels, start, end) in enumerate(segments):
            stop = used + end - start
            input_ids[used:stop] = tokens[start:end]
            labels[used:stop] = (tokens if source_labels is None else source_labels)[start:end]
            lengths[index] = end - start
            offsets[index] = start
            used = stop
        padding = seq_len - used

        cu_seqlens = np.full(self.cu_len, seq_len, dtype=np.int32)
        cu_seqlens[0] = 0
        np.cumsum(lengths, out=cu_seqlens[1 : count + 1], dtype=np.int32)
        starts = cu_seqlens[:count].astype(np.int64)

        position_ids = np.arange(seq_len, dtype=np.int64)
        shift = starts - offsets if self.continue_positions else starts
        position_ids[:used] -= np.repeat(shift, lengths)
        position_ids[used:] -= used

        document_ids = np.zeros(seq_len, dtype=np.int32)
        document_ids[:used] = np.repeat(np.arange(1, count + 1, dtype=np.int32), lengths)

        if self.mask_first_token:
            labels[starts] = IGNORE_INDEX
        return {
            INPUT_IDS: input_ids,
            LABELS: labels,
            POSITION_IDS: position_ids,
            DOCUMENT_IDS: document_ids,
            CU_SEQLENS: cu_seqlens,
            CU_SEQLENS_COUNT: np.array(count + 1 + (padding > 0), dtype=np.int32),
        }


def collate_rows(
    rows: Sequence[Mapping[str, np.ndarray]], as_torch: bool = False, flatten: bool = False
) -> dict[str, Any]:
    """Stack packed rows into a batch: ``.batch(8, collate_fn=collate_rows)``.

    By default every field gains a leading batch axis: ``(B, seq_len)`` token fields,
    ``(B, cu_len)`` ``cu_seqlens`` and ``(B,)`` ``cu_seqlens_count``.

    With ``flatten=True`` the batch is one long sequence, the layout flash-attention varlen
    kernels take: token fields of shape ``(1, B * seq_len)``, ``document_ids`` numbered across
    the batch, and ``cu_seqlens`` of fixed length ``B * (cu_len - 1) + 1`` holding every row's
    segments in order (valid count in ``cu_seqlens_count``, unused entries ``B * seq_len``).

    ``as_torch=True`` returns torch tensors (sharing memory with the stacked arrays).
    """
    if not rows:
        raise ValueError("collate_rows needs at least one row")
    batch = {field: np.stack([row[field] for row in rows]) for field in ROW_FIELDS}
    if flatten:
        batch = _flatten(batch)
    if as_torch:
        import torch

        return {field: torch.from_numpy(array) for field, array in batch.items()}
    return batch


def _flatten(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
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

    flat = {field: batch[field].reshape(1, rows * seq_len) for field in (INPUT_IDS, LABELS, POSITION_IDS)}
    flat[DOCUMENT_IDS] = document_ids.reshape(1, rows * seq_len)
    flat[CU_SEQLENS] = cu_seqlens
    flat[CU_SEQLENS_COUNT] = np.array(starts.size + 1, dtype=np.int32)
    return flat
