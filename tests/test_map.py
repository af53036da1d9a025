from __future__ import annotations

import pytest

import resumable as rs
from resumable.nodes import IndexedMap, Map
from tests.resume import check_resume, take


def test_fluent_map_keeps_random_access_on_indexed_nodes() -> None:
    pipe = rs.from_list(list(range(10))).map(lambda x: x * x)
    assert isinstance(pipe, IndexedMap)
    assert len(pipe) == 10 and pipe[3] == 9
    assert list(pipe.shuffle(0)) != list(range(10))  # shuffle may follow a map
    assert sorted(rs.from_list(list(range(10))).map(lambda x: x * x).shuffle(4)) == [x * x for x in range(10)]


def test_map_after_iterator_node_is_a_plain_map() -> None:
    pipe = rs.from_list(list(range(10))).filter(lambda x: x % 2).map(str)
    assert isinstance(pipe, Map)
    assert list(pipe) == ["1", "3", "5", "7", "9"]


def test_map_resumes() -> None:
    for build in (
        lambda: rs.from_list(list(range(30))).shuffle(2).map(lambda x: -x),
        lambda: Map(rs.from_list(list(range(30))).shuffle(2), lambda x: -x),
    ):
        for k in (0, 1, 15, 29, 30, 45):
            check_resume(build, k, 60)


def test_map_runs_only_on_items_handed_out() -> None:
    calls: list[int] = []
    pipe = rs.from_list(list(range(100))).map(lambda x: calls.append(x) or x)
    take(pipe, 3)
    assert calls == [0, 1, 2]
    resumed = rs.from_list(list(range(100))).map(lambda x: calls.append(x) or x)
    resumed.set_state(pipe.get_state())
    calls.clear()
    take(resumed, 2)
    assert calls == [3, 4]  # a resume never re-runs fn on earlier records


def test_map_rejects_non_callable() -> None:
    with pytest.raises(rs.ConfigError, match="IndexedMap: expected a callable"):
        rs.from_list([1]).map(3)  # type: ignore[arg-type]  # deliberately wrong, to test the check
