"""pack_figures on one process (no process group): the figures of this rank's batch and its
packer's stats. tests/test_even_distributed.py checks them over real gloo ranks."""

from __future__ import annotations

import numpy as np
import pytest

import resumable as rs
from resumable.torch import pack_figures

SEQ_LEN = 16


def packer() -> rs.nodes.Pack:
    lengths = [5, 9, 14, 3, 20, 7, 1]
    return rs.from_list([{"input_ids": list(range(1, n + 1))} for n in lengths]).pack(SEQ_LEN, strategy="bfd")


def test_figures_of_one_rank_batch_and_stats() -> None:
    pack = packer()
    rows = [next(pack) for _ in range(3)]
    real = [int(np.count_nonzero(row["document_ids"])) for row in rows]
    figures = pack_figures(pack.collate(rows), stats=pack.stats)
    assert figures == {
        "seq_len_min": min(real),
        "seq_len_avg": sum(real) / 3,
        "seq_len_max": max(real),
        "batch_tokens_min": sum(real),
        "batch_tokens_avg": sum(real),
        "batch_tokens_max": sum(real),
        "efficiency": sum(real) / (3 * SEQ_LEN),
        "epoch_rows_min": 3,
        "epoch_rows_max": 3,
        "epoch_efficiency": pack.stats.efficiency,
    }
    assert len(set(real)) > 1, "rows of different fill"


def test_rows_tensors_and_flattened_batches_give_the_same_tokens() -> None:
    pack = packer()
    rows = [next(pack) for _ in range(2)]
    from_rows = pack_figures(rows)
    assert pack_figures(pack.collate(rows, as_torch=True)) == from_rows
    flat = pack_figures(pack.collate(rows, flatten=True))
    assert flat["batch_tokens_avg"] == from_rows["batch_tokens_avg"] and flat["efficiency"] == from_rows["efficiency"]
    assert flat["seq_len_max"] == from_rows["batch_tokens_max"], "a flattened batch is one row"
    assert set(pack_figures(stats=pack.stats)) == {"epoch_rows_min", "epoch_rows_max", "epoch_efficiency"}


def test_bad_input_is_a_config_error() -> None:
    with pytest.raises(rs.ConfigError, match="batch, its Pack.stats"):
        pack_figures()
    with pytest.raises(rs.ConfigError, match="document_ids"):
        pack_figures({"input_ids": np.zeros((2, 4))})
    with pytest.raises(rs.ConfigError, match="no rows"):
        pack_figures([])
    with pytest.raises(rs.ConfigError, match="shape"):
        pack_figures({"document_ids": np.zeros((2, 2, 2))})
    with pytest.raises(rs.ConfigError, match="differ in shape"):
        pack_figures([{"document_ids": np.ones(4)}, {"document_ids": np.ones(5)}])
    with pytest.raises(rs.ConfigError, match="row 1 has no 'document_ids'"):
        pack_figures([{"document_ids": np.ones(4)}, {"input_ids": np.ones(4)}])
    with pytest.raises(rs.ConfigError, match="row 0 is a list"):
        pack_figures([[1, 2]])  # type: ignore[list-item]  # what the test is about
    with pytest.raises(rs.ConfigError, match="not an array"):
        pack_figures({"document_ids": [[1, 2], [1]]})
