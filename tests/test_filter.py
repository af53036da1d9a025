from __future__ import annotations

import random
import warnings

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


def keeping_nothing_warns(pipe: rs.Node, match: str) -> str:
    """Take an item with the warning made an error (the filter would read for ever): its message."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", rs.BarrenEpochWarning)
        with pytest.raises(rs.BarrenEpochWarning, match=match) as raised:
            take(pipe, 1)
    return str(raised.value)


def test_a_filter_keeping_nothing_of_an_endless_upstream_warns() -> None:
    pipe = rs.from_list(list(range(10))).shuffle(seed=1).repeat().filter(lambda x: x > 100)
    keeping_nothing_warns(pipe, r"Filter: the predicate kept no item of epoch \d+ of its endless upstream")


def test_below_a_shard_the_warning_names_no_stride() -> None:
    pipe = rs.from_list(list(range(10))).shard(rank=1, world_size=2).repeat().map(lambda x: x).filter(lambda x: False)
    assert "Stride" not in keeping_nothing_warns(pipe, r"kept no item of epoch \d+ of its endless upstream")


def test_the_warning_comes_once_and_the_filter_goes_on() -> None:
    """A predicate keeping at random, now and then a whole epoch without a keep: one warning,
    and the items kept after it."""
    pipe = rs.from_list(list(range(10))).repeat().filter(lambda x: x == 3 and random.random() < 0.0005)
    random.seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert take(pipe, 3) == [3, 3, 3]
    assert [type(warning.message) for warning in caught] == [rs.BarrenEpochWarning]


def test_a_rare_item_of_an_endless_upstream_is_found_epoch_after_epoch_without_a_warning() -> None:
    """Thousands of items dropped in a row, but every epoch keeps one."""
    pipe = rs.from_list(list(range(3000))).shuffle(seed=2).repeat().filter(lambda x: x == 1234)
    with warnings.catch_warnings():
        warnings.simplefilter("error", rs.BarrenEpochWarning)
        assert take(pipe, 4) == [1234] * 4


def test_after_a_restarting_mix_only_every_component_barren_warns() -> None:
    def mix() -> rs.Node:
        return rs.mix({"a": rs.from_list(list(range(10))), "b": rs.from_list(list(range(10, 20)))}, on_end="restart")

    with warnings.catch_warnings():
        warnings.simplefilter("error", rs.BarrenEpochWarning)
        assert take(mix().filter(lambda x: x >= 10), 25) == list(range(10, 20)) * 2 + list(range(10, 15))
    keeping_nothing_warns(mix().filter(lambda x: x > 100), "kept no item of epoch .* of mix component")
