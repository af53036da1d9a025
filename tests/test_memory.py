"""FromList: sequences are read by index; iterators and generators are refused at construction."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import resumable as rs
from tests.resume import check_resume


@pytest.mark.parametrize(
    "records",
    [(i for i in range(5)), iter([1, 2]), map(str, range(3)), {"a": 1}, {1, 2}, 7],
    ids=["generator", "iterator", "map", "dict", "set", "int"],
)
def test_non_sequences_are_refused_at_construction(records: Any) -> None:
    """Regression: a generator was accepted and failed at iteration with a bare TypeError."""
    with pytest.raises(rs.ConfigError, match=r"from_list needs a sequence .* pass list\(records\)"):
        rs.from_list(records)


@pytest.mark.parametrize("records", [[3, 1, 2], (3, 1, 2), range(3, 6), np.array([3, 1, 2])], ids=repr)
def test_sequences_are_read_in_order_and_resume(records: Any) -> None:
    assert list(rs.from_list(records)) == list(records)
    check_resume(lambda: rs.from_list(records).shuffle(1), 2, 7)
