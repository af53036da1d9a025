from __future__ import annotations

import numpy as np
import pytest

import resumable as rs
from tests.resume import check_resume


def test_batches_and_last_partial_batch() -> None:
    assert list(rs.from_list(list(range(7))).batch(3)) == [[0, 1, 2], [3, 4, 5], [6]]
    assert list(rs.from_list(list(range(7))).batch(3, drop_last=True)) == [[0, 1, 2], [3, 4, 5]]
    assert list(rs.from_list(list(range(6))).batch(3, drop_last=True)) == [[0, 1, 2], [3, 4, 5]]


def test_collate_fn() -> None:
    batches = list(rs.from_list(list(range(4))).batch(2, collate_fn=np.array))
    assert [b.tolist() for b in batches] == [[0, 1], [2, 3]]


def test_batch_resumes_across_epochs() -> None:
    for drop_last in (False, True):

        def build(drop_last: bool = drop_last) -> rs.Node:
            return rs.from_list(list(range(23))).shuffle(1).batch(5, drop_last=drop_last)

        for k in (0, 1, 4, 5, 6, 9, 10, 11, 14):
            check_resume(build, k, 14)


@pytest.mark.parametrize("size", [0, -1, 2.5, True, None])
def test_invalid_batch_size(size) -> None:
    with pytest.raises(rs.ConfigError, match="batch_size must be a positive int"):
        rs.from_list([1]).batch(size)
