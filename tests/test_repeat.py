from __future__ import annotations

import pytest

import resumable as rs
from tests.resume import check_resume, take


def test_repeat_runs_epochs_with_a_new_order_each_time() -> None:
    items = list(rs.from_list(list(range(20))).shuffle(3).repeat(3))
    epochs = [items[0:20], items[20:40], items[40:60]]
    assert len(items) == 60
    assert all(sorted(epoch) == list(range(20)) for epoch in epochs)
    assert epochs[0] != epochs[1] != epochs[2]


def test_endless_repeat() -> None:
    pipe = rs.from_list([1, 2]).repeat()
    assert take(pipe, 7) == [1, 2, 1, 2, 1, 2, 1]


def test_epoch_is_part_of_the_state() -> None:
    pipe = rs.from_list(list(range(10))).shuffle(0).repeat()
    take(pipe, 25)
    assert pipe.get_state()["upstream"]["epoch"] == 2


def test_repeat_resumes_at_and_across_epoch_boundaries() -> None:
    def build() -> rs.Node:
        return rs.from_list(list(range(10))).shuffle(9).repeat(4)

    for k in (0, 9, 10, 11, 20, 39, 40):
        check_resume(build, k, 40)
    check_resume(build, 5, 40, k2=25)


def test_empty_upstream_ends_instead_of_spinning() -> None:
    assert list(rs.from_list([]).repeat()) == []
    assert list(rs.from_list(list(range(10))).filter(lambda x: False).repeat()) == []


def test_reiterating_a_finished_pipeline_starts_the_next_epoch() -> None:
    pipe = rs.from_list(list(range(8))).shuffle(1)
    first, second = list(pipe), list(pipe)
    assert sorted(first) == sorted(second) == list(range(8)) and first != second


def test_restored_end_of_epoch_finishes_that_epoch_first() -> None:
    """A state taken after the last item of an epoch resumes into the end of that epoch,
    so a loop `for epoch ...: for batch in pipe` stays aligned."""
    pipe = rs.from_list(list(range(4))).shuffle(2)
    items = [next(iter(pipe)) for _ in range(4)]
    state = pipe.get_state()
    resumed = rs.from_list(list(range(4))).shuffle(2)
    resumed.set_state(state)
    assert not resumed.ended and not pipe.ended
    assert list(resumed) == [] and list(pipe) == []
    assert resumed.ended and pipe.ended
    assert list(resumed) == list(pipe)
    assert sorted(items) == [0, 1, 2, 3]


@pytest.mark.parametrize("times", [0, -2, 1.5, True])
def test_invalid_times(times) -> None:
    with pytest.raises(rs.ConfigError):
        rs.from_list([1]).repeat(times)


def test_start_epoch_jumps_to_the_beginning_of_any_epoch() -> None:
    def build() -> rs.Node:
        return rs.from_list(list(range(30))).shuffle(4).filter(lambda x: x % 4).batch(4)

    pipe = build()
    epochs = [list(pipe) for _ in range(4)]
    fresh = build()
    fresh.start_epoch(2)
    assert list(fresh) == epochs[2]
    midway = build()
    take(midway, 3)
    midway.start_epoch(1)  # abandons the current epoch
    assert list(midway) == epochs[1]
    assert midway.upstream.dropped == epochs_dropped(build, 1)
    with pytest.raises(rs.ConfigError, match="epoch must be a non-negative int"):
        build().start_epoch(-1)


def epochs_dropped(build, epoch: int) -> int:
    pipe = build()
    pipe.start_epoch(epoch)
    list(pipe)
    return pipe.upstream.dropped


def test_a_repeat_over_a_repeat_is_refused_at_construction() -> None:
    """An inner repeat restarts its count every outer pass, so a rescale could not tell which
    pass of each to continue: refused, through other nodes and mix components too."""
    with pytest.raises(rs.ConfigError, match=r"use a single \.repeat\(n \* m\)"):
        rs.from_list([1, 2]).repeat(2).filter(bool).repeat(2)
    with pytest.raises(rs.ConfigError, match="repeat the components or the mix, not both"):
        rs.mix({"a": rs.from_list([1]).repeat(), "b": rs.from_list([2])}).repeat(2)
    rs.mix({"a": rs.from_list([1]).repeat(), "b": rs.from_list([2])})  # one level is fine
