"""The Shuffle node (the permutation itself is tested in test_lcg.py)."""

from __future__ import annotations

import pytest

import resumable as rs
from tests.resume import check_resume


def test_shuffle_is_a_permutation_new_every_epoch_and_deterministic_per_seed() -> None:
    pipe = rs.from_list(list(range(1000))).shuffle(seed=11)
    epoch0, epoch1 = list(pipe), list(pipe)
    assert sorted(epoch0) == sorted(epoch1) == list(range(1000))
    assert epoch0 != epoch1
    assert list(rs.from_list(list(range(1000))).shuffle(seed=11)) == epoch0
    assert list(rs.from_list(list(range(1000))).shuffle(seed=12)) != epoch0


def test_random_access_matches_iteration() -> None:
    pipe = rs.from_list(list(range(300))).shuffle(seed=5)
    assert [pipe[i] for i in range(300)] == list(rs.from_list(list(range(300))).shuffle(seed=5))


def test_shuffle_resumes_in_any_epoch() -> None:
    def build() -> rs.Node:
        return rs.from_list(list(range(97))).shuffle(seed=3)

    for k in (0, 1, 50, 96, 97, 98, 150, 194):
        check_resume(build, k, 194)


def test_shuffle_state_is_the_cursor_only() -> None:
    pipe = rs.from_list(list(range(10**6))).shuffle(seed=1)
    next(iter(pipe))
    assert pipe.get_state() == {
        "kind": "Shuffle",
        "version": 1,
        "seed": 1,
        "rounds": 6,
        "epoch": 0,
        "position": 1,
        "length": 10**6,
        "ended": False,
        "upstream": {"kind": "FromList", "version": 1, "length": 10**6},
    }


def test_shuffle_needs_random_access() -> None:
    with pytest.raises(rs.ConfigError, match="Filter: shuffle\\(\\) needs random access"):
        rs.from_list([1, 2]).filter(bool).shuffle(0)


@pytest.mark.parametrize("seed", [-1, 1.5, "0", True])
def test_invalid_seed(seed) -> None:
    with pytest.raises(rs.ConfigError, match="seed must be a non-negative int"):
        rs.from_list([1]).shuffle(seed)
