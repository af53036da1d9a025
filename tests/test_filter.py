from __future__ import annotations

import pytest

import resumable as rs
from tests.resume import check_resume, take


def build() -> rs.Node:
    return rs.from_list(list(range(40))).shuffle(5).filter(lambda x: x % 3 == 0)


def test_filter_keeps_matching_items_and_counts_the_rest() -> None:
    pipe = rs.from_list(list(range(10))).filter(lambda x: x % 3 == 0)
    assert list(pipe) == [0, 3, 6, 9]
    assert pipe.dropped == 6


def test_filter_resumes_with_its_counter() -> None:
    for k in (0, 1, 7, 13, 14, 20, 28):
        check_resume(build, k, 28)
    pipe = build()
    take(pipe, 5)
    resumed = build()
    resumed.set_state(pipe.get_state())
    assert resumed.dropped == pipe.dropped


def test_dropped_resets_each_epoch() -> None:
    pipe = build()
    list(pipe)
    assert pipe.dropped == 26
    list(pipe)
    assert pipe.dropped == 26


def test_filter_rejects_non_callable() -> None:
    with pytest.raises(rs.ConfigError):
        rs.from_list([1]).filter(None)  # type: ignore[arg-type]  # deliberately wrong, to test the check
