"""Packing figures over every rank, ready to log: real tokens per row and per batch, and
efficiency, gathered with one ``all_gather`` of a few integers per rank."""

from __future__ import annotations

from typing import Any, Mapping, Sequence, Union

import numpy as np
import torch
import torch.distributed as dist

from resumable.errors import ConfigError
from resumable.ops.even import collective_device
from resumable.pack.node import PackStats
from resumable.pack.rows import DOCUMENT_IDS

Batch = Union[Mapping[str, Any], Sequence[Mapping[str, Any]]]

# One rank's entry in the gathered table: what its batch and its stats hold.
HAS_BATCH, ROWS, TOKENS, ROW_MIN, ROW_MAX, SLOTS = range(6)
HAS_STATS, EPOCH_ROWS, EPOCH_TOKENS, EPOCH_SLOTS = range(6, 10)
ENTRIES = 10


def pack_figures(batch: Batch | None = None, stats: PackStats | None = None, group: Any = None) -> dict[str, float]:
    """Figures of this step's packed batches, or of the epoch so far, over every rank of ``group``.

    ``batch`` is this rank's batch from ``Pack.collate`` (or its list of rows): a token is real
    where ``document_ids != 0``, a row is one entry of the leading axis (a flattened batch
    counts as one row). It gives ``seq_len_min`` / ``seq_len_avg`` / ``seq_len_max`` (real tokens
    per row over every rank's rows), ``batch_tokens_min`` / ``batch_tokens_avg`` /
    ``batch_tokens_max`` (real tokens per rank's batch) and ``efficiency`` (real tokens over all
    positions). ``stats`` is this rank's ``Pack.stats``: it gives ``epoch_rows_min`` /
    ``epoch_rows_max`` (rows per rank this epoch: how uneven the ranks are) and
    ``epoch_efficiency``. Every rank must call it at the same step (it is collective when
    ``torch.distributed`` is initialised); ranks that pass no batch are left out of its figures.
    """
    if batch is None and stats is None:
        raise ConfigError("pack_figures: give this rank's batch, its Pack.stats, or both")
    mine = np.zeros(ENTRIES, dtype=np.int64)
    if batch is not None:
        ids = _document_ids(batch)
        per_row = np.count_nonzero(ids, axis=1)
        mine[[HAS_BATCH, ROWS, TOKENS, ROW_MIN, ROW_MAX, SLOTS]] = [
            1,
            per_row.size,
            per_row.sum(),
            per_row.min(),
            per_row.max(),
            ids.size,
        ]
    if stats is not None:
        mine[[HAS_STATS, EPOCH_ROWS, EPOCH_TOKENS, EPOCH_SLOTS]] = [
            1,
            stats.rows,
            stats.tokens,
            stats.rows * stats.seq_len,
        ]
    return _figures(_gather(mine, group))


def _document_ids(batch: Batch) -> np.ndarray:
    """``document_ids`` of the batch as a 2-D array (rows x positions)."""
    if isinstance(batch, Mapping):
        ids = _numpy(_field(batch, "the batch"))
    else:
        if not batch:
            raise ConfigError("pack_figures: the batch has no rows")
        rows = [_numpy(_field(row, f"row {index}")) for index, row in enumerate(batch)]
        if len({row.shape for row in rows}) > 1:
            shapes = sorted({row.shape for row in rows})
            raise ConfigError(f"pack_figures: the rows' {DOCUMENT_IDS!r} differ in shape: {shapes}")
        ids = np.stack(rows)
    if ids.ndim not in (1, 2) or ids.size == 0:
        raise ConfigError(
            f"pack_figures: {DOCUMENT_IDS!r} has shape {ids.shape}, expected (rows, seq_len) or (seq_len,)"
        )
    return ids.reshape(-1, ids.shape[-1])


def _field(row: Any, name: str) -> Any:
    """The ``document_ids`` of a batch or row (a mapping), else a ConfigError naming ``name``."""
    if not isinstance(row, Mapping):
        raise ConfigError(f"pack_figures: {name} is a {type(row).__name__}, expected a mapping of packed fields")
    if DOCUMENT_IDS not in row:
        raise ConfigError(f"pack_figures: {name} has no {DOCUMENT_IDS!r} field (fields {sorted(row)})")
    return row[DOCUMENT_IDS]


def _numpy(array: Any) -> np.ndarray:
    """A numpy view of an array or tensor (a GPU tensor is copied to the host)."""
    if isinstance(array, torch.Tensor):
        return array.detach().cpu().numpy()
    try:
        return np.asarray(array)
    except ValueError as error:  # ragged nested lists
        raise ConfigError(f"pack_figures: {DOCUMENT_IDS!r} is not an array: {error}") from error


def _gather(mine: np.ndarray, group: Any) -> np.ndarray:
    """Every rank's entries, one row per rank: one ``all_gather``, none on a single process."""
    if not (dist.is_available() and dist.is_initialized()):
        return mine[None, :]
    tensor = torch.from_numpy(mine).to(collective_device(group))
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, tensor, group=group)
    return np.stack([part.cpu().numpy() for part in gathered])


def _figures(table: np.ndarray) -> dict[str, float]:
    figures: dict[str, float] = {}
    batches = table[table[:, HAS_BATCH] == 1]
    if len(batches):
        tokens = batches[:, TOKENS]
        figures.update(
            {
                "seq_len_min": float(batches[:, ROW_MIN].min()),
                "seq_len_avg": float(tokens.sum() / batches[:, ROWS].sum()),
                "seq_len_max": float(batches[:, ROW_MAX].max()),
                "batch_tokens_min": float(tokens.min()),
                "batch_tokens_avg": float(tokens.mean()),
                "batch_tokens_max": float(tokens.max()),
                "efficiency": float(tokens.sum() / batches[:, SLOTS].sum()),
            }
        )
    epochs = table[table[:, HAS_STATS] == 1]
    if len(epochs):
        slots = int(epochs[:, EPOCH_SLOTS].sum())
        figures.update(
            {
                "epoch_rows_min": float(epochs[:, EPOCH_ROWS].min()),
                "epoch_rows_max": float(epochs[:, EPOCH_ROWS].max()),
                "epoch_efficiency": float(epochs[:, EPOCH_TOKENS].sum() / slots) if slots else 0.0,
            }
        )
    return figures
