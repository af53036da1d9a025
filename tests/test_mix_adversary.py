"""Adversarial tests of ``rs.mix``: the resume property under odd mixes (one component, empty
components, a 1-record component beside a 1000-record one, tiny, huge and zero weights, every
``on_end`` and schedule, every source kind, nodes inside and around the mix, mixes of mixes, a
state at 0, in the middle, exactly where a component runs out, at the last item, in the next
epoch, restored twice), ``set_weights`` mid-epoch with a checkpoint after it, invalid weights,
hand-corrupted and fuzzed states, the realised proportions against the weights, and a mix inside
``rs.torch.Loader`` with and without workers.
"""

from __future__ import annotations

import copy
import functools
import json
import math
from itertools import islice
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import resumable as rs
from resumable import Node
from resumable.ops.mix import Mix
from tests.resume import check_closed_resume, check_resume, plain, restored, roundtrip, take

Build = Callable[[], Node[Any]]
ON_END = ("stop", "drop", "restart")
SCHEDULES = ("smooth", "random")
KINDS = ("list", "jsonl", "parquet", "arrow", "jsonl_stream")
STATS = ("epoch", "step", "counts", "proportions", "active", "eligible", "restarts", "last_component", "weights")


# -- data ----------------------------------------------------------------------------------------


def documents(tag: int, count: int) -> list[dict[str, Any]]:
    """``count`` documents of 1 to 5 tokens; ids and tokens tell the component and the record."""
    return [
        {"id": tag * 100_000 + i, "input_ids": [tag * 100_000 + i * 10 + t for t in range(1 + (i * 7 + tag) % 5)]}
        for i in range(count)
    ]


class Files:
    """Sources of every kind over ``documents(tag, count)``, written once into a directory."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.written: dict[tuple[str, int, int], list[str]] = {}

    def paths(self, kind: str, tag: int, count: int) -> list[str]:
        key = (kind, tag, count)
        if key not in self.written:
            records = documents(tag, count)
            if kind == "jsonl_stream":
                parts = [records[0::2], records[1::2]]
                paths = [self.root / f"s{tag}-{count}-{part}.jsonl" for part in range(2) if parts[part]]
                for path, part in zip(paths, parts):
                    path.write_text("".join(json.dumps(record) + "\n" for record in part))
            else:
                path = self.root / f"{tag}-{count}.{kind}"
                if kind == "jsonl":
                    path.write_text("".join(json.dumps(record) + "\n" for record in records))
                else:
                    table = pa.Table.from_pylist(records)
                    if kind == "parquet":
                        pq.write_table(table, path, row_group_size=max(1, count // 4))
                    else:
                        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
                            for batch in table.to_batches(max_chunksize=max(1, count // 3)):
                                writer.write_batch(batch)
                paths = [path]
            self.written[key] = [str(path) for path in paths]
        return self.written[key]

    def source(self, kind: str, tag: int, count: int) -> Node[Any]:
        """A fresh source node of ``kind``; ``count == 0`` is one record filtered out (a file
        may not be empty)."""
        if count == 0:
            return self.source(kind, tag, 1).filter(lambda record: False)
        if kind == "list":
            return rs.from_list(documents(tag, count))
        paths = self.paths(kind, tag, count)
        if kind == "jsonl":
            return rs.jsonl(paths[0])
        if kind == "parquet":
            return rs.parquet(paths[0])
        if kind == "arrow":
            return rs.arrow(paths[0])
        return rs.jsonl_stream(paths, shuffle_files=tag)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Files:
    return Files(tmp_path_factory.mktemp("mix-adversary"))


def stats(mix: Mix[Any]) -> dict[str, Any]:
    return {name: getattr(mix, name) for name in STATS}


def ints(start: int, count: int) -> Node[Any]:
    return rs.from_list(list(range(start, start + count)))


def run_out_step(build: Build, sizes: dict[str, int], cap: int) -> int | None:
    """The step at which the first component with records hands out its last one (its count
    reaches its size), or None if none does within ``cap`` items of the first epoch."""
    pipe = build()
    assert isinstance(pipe, Mix)
    for step, _ in enumerate(islice(pipe, cap), start=1):
        name = pipe.last_component
        assert name is not None
        if pipe.counts[name] == sizes[name]:
            return step
    return None


# -- 1. the resume property under odd mixes --------------------------------------------------------

SIZES = (0, 1, 2, 5, 1000)
WEIGHTS = (0.0, 1e-12, 1.0, 2.5, 1e12)
TOTAL = 45


def odd_builder(spec: list[tuple[int, float]], on_end: str, schedule: str, seed: int) -> tuple[Build, dict[str, int]]:
    names = [f"c{i}" for i in range(len(spec))]
    weights = {name: weight for name, (_, weight) in zip(names, spec)}
    if not any(weights.values()):
        weights[names[0]] = 1.0
    sizes = {name: size for name, (size, _) in zip(names, spec)}

    def build() -> Node[Any]:
        parts = {name: ints(1000 * (i + 1), sizes[name]).shuffle(seed + i) for i, name in enumerate(names)}
        return rs.mix(parts, weights=weights, seed=seed, on_end=on_end, schedule=schedule)

    return build, sizes


@settings(max_examples=20, deadline=None)
@given(
    spec=st.lists(st.tuples(st.sampled_from(SIZES), st.sampled_from(WEIGHTS)), min_size=1, max_size=3),
    on_end=st.sampled_from(ON_END),
    schedule=st.sampled_from(SCHEDULES),
    seed=st.integers(0, 2**20),
    data=st.data(),
)
def test_resume_property_under_odd_mixes(
    spec: list[tuple[int, float]], on_end: str, schedule: str, seed: int, data: st.DataObject
) -> None:
    build, sizes = odd_builder(spec, on_end, schedule, seed)
    first_epoch = len(list(islice(build(), TOTAL + 1)))
    expected = take(build(), TOTAL)
    total = len(expected)
    points = {0, first_epoch // 2, first_epoch, first_epoch + 1, total, data.draw(st.integers(0, total), label="k")}
    ran_out = run_out_step(build, sizes, TOTAL)
    if ran_out is not None:
        points |= {ran_out - 1, ran_out, ran_out + 1}
    for k in sorted(point for point in points if 0 <= point <= total):
        check_resume(build, k, total, k2=data.draw(st.integers(k, total), label="k2"))
        # the statistics a restored mix reports are the ones the original had at that point
        original = build()
        take(original, k)
        resumed = restored(build, original.get_state())
        assert isinstance(original, Mix) and isinstance(resumed, Mix)
        assert stats(resumed) == stats(original), k


@pytest.mark.parametrize("on_end", ON_END)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_single_component_mix_is_that_component(on_end: str, schedule: str) -> None:
    def build() -> Node[Any]:
        return rs.mix({"only": ints(0, 7).shuffle(3)}, weights={"only": 1e-12}, on_end=on_end, schedule=schedule)

    alone = ints(0, 7).shuffle(3)
    pipe = build()
    first = take(pipe, 7) if on_end == "restart" else list(pipe)
    assert first == list(alone)
    assert pipe.proportions == {"only": 1.0}
    for k in (0, 3, 6, 7, 8, 15):
        check_resume(build, k, 21, k2=min(k + 4, 21))


@pytest.mark.parametrize("on_end", ON_END)
def test_a_one_record_component_beside_a_thousand_record_one(on_end: str) -> None:
    def build() -> Node[Any]:
        return rs.mix(
            {"tiny": ints(0, 1), "big": ints(10_000, 1000).shuffle(9)},
            weights={"tiny": 1, "big": 1},
            seed=5,
            on_end=on_end,
        )

    head = take(build(), 6)
    assert 0 in head[:2]  # equal weights: the one record comes first or second
    if on_end == "stop":
        assert len(list(build())) <= 3  # the tiny one runs out at once and stops the epoch
    if on_end == "drop":
        pipe = build()
        assert len(list(pipe)) == 1001 and pipe.active == [] and len(build()) == 1001
    if on_end == "restart":
        pipe = build()
        items = take(pipe, 200)
        assert items.count(0) == 100 and pipe.restarts == {"tiny": 99, "big": 0}
    for k in (0, 1, 2, 3, 4, 500, 1000, 1001, 1002):
        check_resume(build, k, 1010, k2=min(k + 3, 1010))


@pytest.mark.parametrize("on_end", ON_END)
def test_an_empty_component_with_a_positive_weight(on_end: str) -> None:
    def build() -> Node[Any]:
        return rs.mix({"empty": ints(0, 0), "full": ints(100, 6)}, weights={"empty": 3, "full": 1}, on_end=on_end)

    pipe = build()
    items = take(pipe, 12)
    if on_end == "stop":
        assert items == []  # the empty component is chosen first and ends every epoch at once
    else:
        assert items == [100 + i % 6 for i in range(12)]
        assert pipe.active == ["full"] and pipe.eligible == ["full"]
    for k in {0, 1, 5, 6, 7, len(items)}:
        if k <= len(items):
            check_resume(build, k, len(items), k2=len(items))


def test_a_zero_weight_component_is_never_read_and_survives_restores() -> None:
    reads: list[int] = []

    def build() -> Node[Any]:
        def spy(x: int) -> int:
            reads.append(x)
            return x

        return rs.mix(
            {"never": ints(0, 3).map(spy), "a": ints(100, 4), "b": ints(200, 5)},
            weights={"never": 0, "a": 1, "b": 1},
            on_end="drop",
        )

    for k in (0, 3, 8, 9, 10):
        check_resume(build, k, 27, k2=min(k + 5, 27))
    pipe = build()
    assert sorted(pipe) == list(range(100, 104)) + list(range(200, 205))
    assert pipe.active == ["never"] and pipe.eligible == [] and pipe.counts["never"] == 0
    assert len(pipe) == 9
    assert reads == []


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_tiny_and_huge_weights_do_not_starve_or_flood_the_schedule(schedule: str) -> None:
    def build() -> Node[Any]:
        return rs.mix(
            {"tiny": ints(0, 50), "huge": ints(1000, 30), "unit": ints(5000, 30)},
            weights={"tiny": 1e-12, "huge": 1e12, "unit": 1.0},
            seed=2,
            on_end="drop",
            schedule=schedule,
        )

    items = list(build())
    # huge first (all of it), then unit, the tiny one only once both are gone
    assert items[:30] == list(range(1000, 1030))
    assert items[-50:] == list(range(50))
    for k in (0, 29, 30, 31, 59, 60, 61, 110):
        check_resume(build, k, 115, k2=min(k + 7, 115))


# -- every source kind, nodes inside and around -----------------------------------------------------


def kind_builder(files: Files, kind: str, on_end: str, around: str = "") -> Build:
    def inside(tag: int, count: int) -> Node[Any]:
        part = files.source(kind, tag, max(count, 1))  # 0 records: one, filtered out below
        if kind != "jsonl_stream":
            part = part.shuffle(tag).shard(0, 1)
        part = part.filter(lambda record: count > 0 and record["id"] % 4 != 1)
        return part.map(lambda record: {**record, "via": tag})

    def build() -> Node[Any]:
        pipe: Node[Any] = rs.mix(
            {"web": inside(1, 13), "code": inside(2, 5), "math": inside(3, 8).prefetch(2), "empty": inside(4, 0)},
            weights={"web": 3, "code": 1, "math": 2, "empty": 0.5},
            seed=11,
            on_end=on_end,
        )
        if around == "pack":
            pipe = pipe.pack(6, strategy="best_fit", buffer_size=3).batch(2)
        elif around == "threads":
            pipe = pipe.map(lambda record: {**record, "n": len(record["input_ids"])}, num_workers=2).prefetch(3)
        elif around == "repeat":
            pipe = pipe.repeat(2).filter(lambda record: record["id"] % 3 != 0).batch(3)
        return pipe

    return build


@pytest.mark.parametrize("on_end", ON_END)
@pytest.mark.parametrize("kind", KINDS)
def test_components_of_every_source_kind_resume_exactly(files: Files, kind: str, on_end: str) -> None:
    build = kind_builder(files, kind, on_end)
    with build() as pipe:
        first_epoch = len(list(islice(pipe, 40)))
    ks = tuple(k for k in (0, first_epoch // 2, first_epoch, first_epoch + 1, 30) if k <= 30)
    check_closed_resume(build, ks, 30, plain=plain)
    with build() as pipe:
        take(pipe, first_epoch // 2)
        state = roundtrip(pipe.get_state())
        expected = [plain(item) for item in take(pipe, 10)]
    with build() as twice:  # a restore of a restore
        twice.set_state(state)
        twice.set_state(state)
        take(twice, 3)
        again = restored(build, twice.get_state())
        assert [plain(item) for item in take(again, 7)] == expected[3:]
        again.close()


@pytest.mark.parametrize("around", ["pack", "threads", "repeat"])
@pytest.mark.parametrize("kind", ["jsonl_stream", "parquet"])
def test_nodes_around_a_mix_of_files_resume_exactly(files: Files, kind: str, around: str) -> None:
    build = kind_builder(files, kind, "restart", around)
    check_closed_resume(build, (0, 1, 4, 9, 17), 25, plain=plain)


@pytest.mark.parametrize("outer_end", ON_END)
@pytest.mark.parametrize("inner_end", ON_END)
def test_a_mix_of_mixes_resumes_exactly(inner_end: str, outer_end: str) -> None:
    def build() -> Node[Any]:
        inner = rs.mix(
            {"a": ints(0, 4).shuffle(1), "b": ints(100, 9).shuffle(2)},
            weights={"a": 1, "b": 2},
            seed=3,
            on_end=inner_end,
            schedule="random",
        )
        other = rs.mix({"c": ints(200, 3), "d": ints(300, 2)}, seed=8, on_end=inner_end)
        return rs.mix({"inner": inner, "other": other, "e": ints(400, 6)}, seed=4, on_end=outer_end)

    first_epoch = len(list(islice(build(), 60)))
    for k in sorted({0, 1, first_epoch // 2, first_epoch - 1, first_epoch, first_epoch + 1, 40}):
        if k <= 40:
            check_resume(build, k, 40, k2=min(k + 9, 40))


# -- 2. set_weights --------------------------------------------------------------------------------


def three(on_end: str, weights: dict[str, float] | None = None, schedule: str = "smooth") -> Mix[Any]:
    weights = weights or {"a": 1.0, "b": 1.0, "c": 1.0}
    parts = {"a": ints(0, 40).shuffle(1), "b": ints(1000, 25).shuffle(2), "c": ints(2000, 6).shuffle(3)}
    return rs.mix(parts, weights=weights, seed=6, on_end=on_end, schedule=schedule)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("on_end", ON_END)
def test_set_weights_mid_epoch_then_a_checkpoint_continues_under_the_new_weights(on_end: str, schedule: str) -> None:
    old = {"a": 1.0, "b": 1.0, "c": 1.0}
    new = {"a": 0.0, "b": 3.0, "c": 1.0}
    pipe = three(on_end, old, schedule)
    head = take(pipe, 10)
    pipe.set_weights(new)
    assert pipe.weights == new and "a" not in pipe.eligible
    middle = take(pipe, 5)
    assert all(item >= 1000 for item in middle)
    state = roundtrip(pipe.get_state())
    assert state["weights"] == new
    at_state = stats(pipe)
    rest = take(pipe, 30)

    with_new = three(on_end, new, schedule)
    with_new.set_state(state)
    assert stats(with_new) == at_state
    assert take(with_new, 30) == rest
    # the same state in a pipeline built with the old weights: weights are not part of the state,
    # so it continues under the old ones, exactly like the original given them back
    with_old = three(on_end, old, schedule)
    with_old.set_state(state)
    back = three(on_end, old, schedule)
    take(back, 10)
    back.set_weights(new)
    take(back, 5)
    back.set_weights(old)
    assert take(with_old, 30) == take(back, 30)
    # and the whole run equals one that changed its weights at the same step, uninterrupted
    whole = three(on_end, old, schedule)
    take(whole, 10)
    whole.set_weights(new)
    assert head + middle + rest == take(three(on_end, old, schedule), 10) + take(whole, 35)


def test_statistics_after_set_weights_and_a_restore_are_the_original_s() -> None:
    new = {"a": 1.0, "b": 0.0, "c": 5.0}
    pipe = three("drop")
    take(pipe, 9)
    pipe.set_weights(new)
    take(pipe, 4)
    resumed = three("drop", new)
    resumed.set_state(roundtrip(pipe.get_state()))
    assert stats(resumed) == stats(pipe)
    assert resumed.eligible == ["a", "c"]
    assert sum(resumed.counts.values()) == resumed.step == 13
    assert resumed.proportions == {name: count / 13 for name, count in resumed.counts.items()}


def test_set_weights_on_a_dropped_component_does_not_bring_it_back() -> None:
    pipe = three("drop", {"a": 0.0, "b": 0.0, "c": 1.0})
    assert sorted(take(pipe, 6)) == list(range(2000, 2006))
    assert next(pipe, None) is None and pipe.active == ["a", "b"]
    pipe.set_weights({"a": 1.0, "b": 1.0, "c": 100.0})
    assert pipe.eligible == ["a", "b"]


def test_set_weights_to_only_exhausted_or_zero_components_ends_a_drop_mix() -> None:
    pipe = three("drop")
    items = take(pipe, 20)
    assert pipe.active == ["a", "b"]  # c (6 records) is gone
    pipe.set_weights({"a": 0.0, "b": 0.0, "c": 1.0})
    assert pipe.eligible == []
    assert list(pipe) == []
    state = roundtrip(pipe.get_state())
    resumed = three("drop", {"a": 0.0, "b": 0.0, "c": 1.0})
    resumed.set_state(state)
    assert resumed.ended and stats(resumed) == stats(pipe)
    assert len(items) == 20


INVALID_WEIGHTS = [
    pytest.param({"a": -1.0, "b": 1.0, "c": 1.0}, id="negative"),
    pytest.param({"a": -0.0001, "b": 1.0, "c": 1.0}, id="slightly-negative"),
    pytest.param({"a": float("nan"), "b": 1.0, "c": 1.0}, id="nan"),
    pytest.param({"a": float("inf"), "b": 1.0, "c": 1.0}, id="inf"),
    pytest.param({"a": float("-inf"), "b": 1.0, "c": 1.0}, id="-inf"),
    pytest.param({"a": 1.0, "b": 1.0, "c": 1.0, "d": 1.0}, id="unknown-name"),
    pytest.param({"a": 1.0, "b": 1.0}, id="missing-name"),
    pytest.param({}, id="empty"),
    pytest.param({"a": 0, "b": 0.0, "c": 0}, id="all-zero"),
    pytest.param({"a": "1", "b": 1.0, "c": 1.0}, id="string"),
    pytest.param({"a": None, "b": 1.0, "c": 1.0}, id="none"),
    pytest.param({"a": [1], "b": 1.0, "c": 1.0}, id="list"),
    pytest.param({"a": 1j, "b": 1.0, "c": 1.0}, id="complex"),
    pytest.param({"a": True, "b": 1.0, "c": 1.0}, id="bool-true"),
    pytest.param({"a": False, "b": 1.0, "c": 1.0}, id="bool-false"),
    pytest.param({1: 1.0, "b": 1.0, "c": 1.0}, id="int-name"),
    pytest.param([("a", 1.0), ("b", 1.0), ("c", 1.0)], id="pairs"),
    pytest.param("abc", id="str"),
    pytest.param(3, id="int"),
]


@pytest.mark.parametrize("weights", INVALID_WEIGHTS)
@pytest.mark.parametrize("on_end", ["drop", "restart"])
def test_invalid_set_weights_is_a_config_error_that_changes_nothing(weights: Any, on_end: str) -> None:
    start = {"a": 2.0, "b": 1.0, "c": 1.0}
    pipe, twin = three(on_end, start), three(on_end, start)
    assert take(pipe, 11) == take(twin, 11)
    before = stats(pipe)
    with pytest.raises(rs.ConfigError):
        pipe.set_weights(weights)
    assert stats(pipe) == before and pipe.weights == start
    assert pipe.get_state() == twin.get_state()
    assert take(pipe, 40) == take(twin, 40)
    with pytest.raises(rs.ConfigError):  # and the constructor says the same
        three(on_end, weights) if weights else rs.mix({"a": ints(0, 1)}, weights=weights)


def test_an_int_weight_too_large_for_a_float_is_a_config_error() -> None:
    pipe, twin = three("drop"), three("drop")
    take(pipe, 4), take(twin, 4)
    try:
        pipe.set_weights({"a": 10**400, "b": 1, "c": 1})
    except rs.ConfigError:
        pass
    finally:
        assert take(pipe, 20) == take(twin, 20)  # unchanged, whatever was raised
    with pytest.raises(rs.ConfigError):
        three("drop", {"a": 10**400, "b": 1, "c": 1})


@pytest.mark.parametrize("scalar", [np.float32, np.int64], ids=["float32", "int64"])
def test_numpy_scalar_weights_are_numbers(scalar: Any) -> None:
    weights = {"a": scalar(3), "b": scalar(1), "c": scalar(0)}
    pipe = three("drop", weights)
    reference = three("drop", {"a": 3.0, "b": 1.0, "c": 0.0})
    assert take(pipe, 30) == take(reference, 30)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_huge_finite_weights_still_mix_in_proportion(schedule: str) -> None:
    pipe = rs.mix(
        {"a": ints(0, 1000), "b": ints(5000, 1000)}, weights={"a": 1.5e308, "b": 0.5e308}, seed=1, schedule=schedule
    )
    items = take(pipe, 400)
    from_a = sum(item < 5000 for item in items)
    # the weights say 3/4 from a: binomial(400, 3/4) has a standard deviation of about 8.7
    assert 250 < from_a < 350, from_a


# -- 3. corrupted and fuzzed states ----------------------------------------------------------------


def fuzz_build(on_end: str) -> Build:
    def build() -> Node[Any]:
        parts = {
            "a": ints(0, 12).shuffle(1),
            "b": ints(100, 9).filter(lambda x: x % 2 == 1).map(lambda x: x * 10),
            "c": ints(500, 7).batch(2),
        }
        return rs.mix(parts, weights={"a": 3, "b": 2, "c": 1}, seed=3, on_end=on_end)

    return build


REPLACEMENTS = st.sampled_from(["x", "", [], {}, None, True, False, 1.5, -1, 0, 2**62, 1e300, -1e300, [1, 2], {"a": 1}])


def all_paths(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found = [path]
    if isinstance(value, dict):
        for key, child in value.items():
            found += all_paths(child, (*path, key))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            found += all_paths(child, (*path, index))
    return found


def at(state: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        state = state[key]
    return state


@st.composite
def corrupted(draw: st.DrawFn, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with one to three drawn corruptions."""
    state = copy.deepcopy(state)
    for _ in range(draw(st.integers(1, 3))):
        how = draw(st.sampled_from(["delete", "replace", "number", "rename", "swap", "mix-entry"]))
        paths = [path for path in all_paths(state) if path]
        if how == "delete":
            path = draw(st.sampled_from(paths))
            parent = at(state, path[:-1])
            del parent[path[-1]]
        elif how == "replace":
            path = draw(st.sampled_from(paths))
            at(state, path[:-1])[path[-1]] = draw(REPLACEMENTS)
        elif how == "number":
            numbers = [
                p for p in paths if isinstance(at(state, p), (int, float)) and not isinstance(at(state, p), bool)
            ]
            if numbers:
                path = draw(st.sampled_from(numbers))
                old = at(state, path)
                at(state, path[:-1])[path[-1]] = draw(
                    st.sampled_from([-old - 1, old + 1, old * 1000 + 7, old + 0.5, float(old), 2**63, -(2**40)])
                )
        elif how == "rename":
            old_name = draw(st.sampled_from(["a", "b", "c"]))
            new_name = draw(st.sampled_from(["a", "b", "c", "z", ""]))
            for entry in ("counts", "credits", "active", "restarts", "fresh", "weights", "components"):
                if draw(st.booleans()) and isinstance(state.get(entry), dict) and old_name in state[entry]:
                    state[entry][new_name] = state[entry].pop(old_name)
            if draw(st.booleans()) and isinstance(state.get("names"), list) and old_name in state["names"]:
                state["names"][state["names"].index(old_name)] = new_name
        elif how == "swap":
            entry = draw(st.sampled_from(["components", "counts", "credits", "active", "restarts", "fresh"]))
            first, second = draw(st.permutations(["a", "b", "c"]))[:2]
            value = state.get(entry)
            if isinstance(value, dict) and first in value and second in value:
                value[first], value[second] = value[second], value[first]
        else:  # a mix entry set to an odd but well-typed value
            entry = draw(st.sampled_from(["step", "epoch", "counts", "credits", "active", "restarts", "last", "ended"]))
            name = draw(st.sampled_from(["a", "b", "c"]))
            odd: Any = {
                "step": draw(st.integers(-3, 2**64)),
                "epoch": draw(st.integers(-3, 2**64)),
                "counts": draw(st.integers(-3, 50)),
                "credits": draw(
                    st.floats(allow_nan=True, allow_infinity=True, width=64) | st.integers(-(2**62), 2**62)
                ),
                "active": draw(st.booleans()),
                "restarts": draw(st.integers(-3, 2**62)),
                "last": draw(st.sampled_from(["a", "b", "c", "z", None])),
                "ended": draw(st.booleans()),
            }[entry]
            if entry in ("step", "epoch", "last", "ended"):
                state[entry] = odd
            elif isinstance(state.get(entry), dict):
                state[entry][name] = odd
    return state


@settings(max_examples=30, deadline=None)
@given(on_end=st.sampled_from(ON_END), k=st.integers(0, 25), j=st.integers(0, 25), data=st.data())
def test_fuzzed_states_are_refused_with_a_typed_error_and_leave_the_mix_as_it_was(
    on_end: str, k: int, j: int, data: st.DataObject
) -> None:
    build = fuzz_build(on_end)
    source = build()
    take(source, k)
    good = roundtrip(source.get_state())
    bad = data.draw(corrupted(good), label="state")
    frozen = json.dumps(bad, sort_keys=True, default=repr)

    pipe, twin = build(), build()
    assert plain(take(pipe, j)) == plain(take(twin, j))
    before = pipe.get_state()
    try:
        pipe.set_state(bad)
    except (rs.StateError, rs.ConfigError):
        assert pipe.get_state() == before
        assert plain(take(pipe, 20)) == plain(take(twin, 20))
    else:
        # accepted: it is a position this pipeline can hold, so its own state restores exactly
        again = restored(build, pipe.get_state())
        assert plain(take(again, 20)) == plain(take(pipe, 20))
    assert json.dumps(bad, sort_keys=True, default=repr) == frozen, "set_state changed the state it was given"


@pytest.mark.parametrize(
    ("entry", "value"),
    [
        ("step", -1),
        ("step", 1.0),
        ("step", True),
        ("epoch", -1),
        ("epoch", "0"),
        ("counts", {"a": 1, "b": 1}),
        ("counts", {"a": 1.0, "b": 0, "c": 0}),
        ("counts", {"a": -1, "b": 2, "c": 0}),
        ("counts", {"a": True, "b": 0, "c": 0}),
        ("credits", {"a": float("nan"), "b": 0.0, "c": 0.0}),
        ("credits", {"a": float("inf"), "b": 0.0, "c": 0.0}),
        ("credits", {"a": "0", "b": 0.0, "c": 0.0}),
        ("active", {"a": 1, "b": True, "c": True}),
        ("active", {"a": True, "b": True}),
        ("restarts", {"a": -1, "b": 0, "c": 0}),
        ("restarts", {"a": 0.0, "b": 0, "c": 0}),
        ("fresh", {"a": None, "b": False, "c": False}),
        ("fresh", "no"),
        ("last", "z"),
        ("last", 0),
        ("names", ["a", "b"]),
        ("names", ["c", "b", "a"]),
        ("on_end", "sometimes"),
        ("schedule", "smooth-ish"),
        ("seed", 4),
        ("seed", -3),
        ("kind", "Batch"),
        ("version", 99),
        ("components", {"a": {}, "b": {}, "c": {}}),
        ("components", []),
        ("ended", "yes"),
    ],
)
def test_hand_corrupted_mix_entries_are_state_errors(entry: str, value: Any) -> None:
    build = fuzz_build("restart")
    source = build()
    take(source, 1)
    good = roundtrip(source.get_state())
    bad = {**good, entry: value}
    pipe, twin = build(), build()
    take(pipe, 17), take(twin, 17)
    before = pipe.get_state()
    with pytest.raises(rs.StateError):
        pipe.set_state(bad)
    assert pipe.get_state() == before
    assert plain(take(pipe, 30)) == plain(take(twin, 30))


def test_weights_in_a_state_are_informational_even_when_garbage() -> None:
    build = fuzz_build("drop")
    source = build()
    take(source, 7)
    state = roundtrip(source.get_state())
    expected = plain(take(source, 10))
    for weights in ({"a": -1}, "heavy", None, {"a": 0, "b": 0, "c": 0}):
        assert plain(take(restored(build, {**state, "weights": weights}), 10)) == expected
    del state["weights"]
    assert plain(take(restored(build, state), 10)) == expected


def test_a_credit_too_large_for_a_float_is_a_state_error() -> None:
    build = fuzz_build("drop")
    source = build()
    take(source, 5)
    state = roundtrip(source.get_state())
    state["credits"]["a"] = 10**400
    pipe, twin = build(), build()
    take(pipe, 3), take(twin, 3)
    try:
        with pytest.raises(rs.StateError):
            pipe.set_state(state)
    finally:
        assert plain(take(pipe, 20)) == plain(take(twin, 20))


# -- 4. proportions -------------------------------------------------------------------------------


def long_mix(weights: dict[str, float], schedule: str, seed: int = 12) -> Build:
    def build() -> Node[Any]:
        parts = {name: ints(100_000 * i, 50_000) for i, name in enumerate(weights)}
        return rs.mix(parts, weights=weights, seed=seed, schedule=schedule, on_end="stop")

    return build


@pytest.mark.parametrize("seed", [0, 12, 99])
def test_random_schedule_counts_are_binomial_also_after_a_restore(seed: int) -> None:
    """Counts after t = 20,000 draws against a binomial(t, p): within 5 standard deviations
    (a chance below 6e-7 per component for a fair sampler; the seeds are fixed, so the test is
    deterministic). The restored run's counts are the uninterrupted run's, exactly."""
    weights = {"a": 0.5, "b": 0.3, "c": 0.15, "d": 0.05}
    build = long_mix(weights, "random", seed)
    steps = 20_000
    whole = build()
    take(whole, steps)
    for name, weight in weights.items():
        sd = math.sqrt(steps * weight * (1 - weight))
        assert abs(whole.counts[name] - steps * weight) < 5 * sd, (name, whole.counts)
    half = build()
    take(half, 7_777)
    resumed = restored(build, half.get_state())
    take(resumed, steps - 7_777)
    assert isinstance(resumed, Mix)
    assert resumed.counts == whole.counts and resumed.proportions == whole.proportions
    # and a long stretch after the restore on its own follows the weights too
    stretch = take(resumed, 10_000)
    for index, (name, weight) in enumerate(weights.items()):
        seen = sum(100_000 * index <= item < 100_000 * (index + 1) for item in stretch)
        assert abs(seen - 10_000 * weight) < 5 * math.sqrt(10_000 * weight * (1 - weight)), name


@pytest.mark.parametrize(
    "weights",
    [
        {"a": 5, "b": 3, "c": 2},
        {"a": 1, "b": 1, "c": 1, "d": 1, "e": 1, "f": 1, "g": 1},
        {"a": 0.001, "b": 0.999},
        {"a": 1e12, "b": 1, "c": 1e-12},
        {"a": 7, "b": 11, "c": 13, "d": 17, "e": 19, "f": 23, "g": 29, "h": 31},
    ],
    ids=["5-3-2", "seven-equal", "skewed", "extremes", "eight-primes"],
)
def test_smooth_schedule_stays_within_the_number_of_components_at_every_step_across_a_restore(
    weights: dict[str, float],
) -> None:
    build = long_mix(weights, "smooth", seed=5)
    total = sum(weights.values())
    pipe = build()
    assert isinstance(pipe, Mix)
    bound = 2 if len(weights) <= 3 else len(weights)  # docs: "< 2 items at every step for three components"
    for step in range(1, 3001):
        next(pipe)
        if step == 1500:  # continue in a restored pipeline
            pipe = restored(build, pipe.get_state())
            assert isinstance(pipe, Mix)
        counts = pipe.counts
        for name, weight in weights.items():
            assert abs(counts[name] - step * weight / total) < bound, (step, counts)
    assert pipe.step == 3000


def test_after_set_weights_the_items_since_follow_the_new_weights_without_a_burst() -> None:
    build = long_mix({"a": 1, "b": 1, "c": 1}, "smooth")
    pipe = build()
    assert isinstance(pipe, Mix)
    take(pipe, 1000)
    new = {"a": 6.0, "b": 3.0, "c": 1.0}
    pipe.set_weights(new)
    before = pipe.counts
    pipe = restored(lambda: long_mix(new, "smooth")(), pipe.get_state())
    assert isinstance(pipe, Mix)
    for step in range(1, 2001):
        next(pipe)
        since = {name: pipe.counts[name] - before[name] for name in new}
        for name, weight in new.items():
            assert abs(since[name] - step * weight / 10) < 3, (step, since)
    # proportions count from the start of the epoch: the blend of 1000 items at 1/3 each and
    # 2000 at the new weights
    blend = {name: (1000 / 3 + 2000 * weight / 10) / 3000 for name, weight in new.items()}
    assert pipe.proportions == {name: count / 3000 for name, count in pipe.counts.items()}
    assert all(abs(pipe.proportions[name] - blend[name]) < 2 / 3000 for name in new), pipe.proportions


def test_drop_shares_a_dropped_component_s_weight_in_proportion() -> None:
    def build() -> Node[Any]:
        parts = {"a": ints(0, 5000), "b": ints(10_000, 5000), "c": ints(20_000, 60)}
        return rs.mix(parts, weights={"a": 3, "b": 1, "c": 4}, seed=2, on_end="drop")

    pipe = build()
    assert isinstance(pipe, Mix)
    while pipe.counts["c"] < 60:
        next(pipe)
    assert 115 <= pipe.step <= 125 and pipe.active == ["a", "b", "c"]  # c's last record; its end not seen yet
    before = pipe.counts
    pipe = restored(build, pipe.get_state())
    assert isinstance(pipe, Mix)
    for step in range(1, 2001):
        next(pipe)
        if step == 1:
            assert pipe.active == ["a", "b"]
        since_a = pipe.counts["a"] - before["a"]
        assert abs(since_a - step * 0.75) < 2, step


# -- 5. inside rs.torch.Loader ----------------------------------------------------------------------


def loader_pipeline(on_end: str) -> Node[Any]:
    a = rs.from_list(list(range(30))).shuffle(1).shard()
    b = rs.from_list(list(range(1000, 1011))).shuffle(2).shard().filter(lambda x: x % 3 != 0)
    c = rs.from_list(list(range(5000, 5004))).shard()
    mixed = rs.mix({"a": a, "b": b, "c": c}, weights={"a": 3, "b": 2, "c": 1}, seed=4, on_end=on_end)
    return mixed.batch(3, collate_fn=np.array)


LOADER_CONFIGS = [
    {"num_workers": 0},
    {"num_workers": 2},
    {"num_workers": 2, "persistent_workers": True},
]


def loader_epochs(loader: Any, epochs: int, stop: int | None = None) -> tuple[list[list[int]], Any]:
    seen: list[list[int]] = []
    for _ in range(epochs):
        for batch in loader:
            seen.append([int(x) for x in batch])
            if len(seen) == stop:
                return seen, json.loads(json.dumps(loader.state_dict()))
    return seen, None


@pytest.mark.parametrize("config", LOADER_CONFIGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_a_mix_inside_a_loader_resumes_from_its_state_dict(config: dict[str, Any]) -> None:
    factory = functools.partial(loader_pipeline, "drop")
    reference = rs.torch.Loader(factory, **config)
    per_epoch = len(loader_epochs(reference, 1)[0])  # the epochs' batch counts may differ by one
    expected = loader_epochs(rs.torch.Loader(factory, **config), 2)[0]
    assert sorted(x for batch in expected[:per_epoch] for x in batch) == sorted(
        [*range(30), *(x for x in range(1000, 1011) if x % 3), *range(5000, 5004)]
    )
    for k in (1, per_epoch - 1, per_epoch + 2):
        head, state = loader_epochs(rs.torch.Loader(factory, **config), 2, stop=k)
        resumed = rs.torch.Loader(factory, **config)
        resumed.load_state_dict(state)
        tail, _ = loader_epochs(resumed, 2 if k < per_epoch else 1)
        assert head + tail == expected, k


@pytest.mark.parametrize("config", LOADER_CONFIGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_a_restarting_mix_inside_a_loader_resumes_twice_in_a_row(config: dict[str, Any]) -> None:
    factory = functools.partial(loader_pipeline, "restart")

    def batches(loader: Any, count: int) -> list[list[int]]:
        return [[int(x) for x in batch] for batch in islice(iter(loader), count)]

    expected = batches(rs.torch.Loader(factory, **config), 30)
    first = rs.torch.Loader(factory, **config)
    head = batches(first, 7)
    state = json.loads(json.dumps(first.state_dict()))
    second = rs.torch.Loader(factory, **config)
    second.load_state_dict(state)
    middle = batches(second, 9)
    third = rs.torch.Loader(factory, **config)
    third.load_state_dict(json.loads(json.dumps(second.state_dict())))
    assert head + middle + batches(third, 14) == expected


# -- the documented schedules, checked against models written from docs/mixing.md -----------------

M64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15


def splitmix64(x: int) -> int:
    z = (x + GOLDEN) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def documented_draw(seed: int, epoch: int, step: int, eligible: list[str], weights: dict[str, float]) -> str:
    """The "random" rule as docs/mixing.md states it: ``u`` from three splitmix64 rounds, then
    the first eligible component, in the given order, whose cumulative share exceeds ``u``."""
    key = splitmix64((splitmix64((splitmix64(seed) ^ epoch) & M64) + step * GOLDEN) & M64)
    u = (key >> 11) / float(1 << 53)
    total = sum(weights[name] for name in eligible)
    cumulative = 0.0
    for name in eligible:
        cumulative += weights[name] / total
        if u < cumulative:
            return name
    return eligible[-1]


def test_random_schedule_is_the_documented_pure_function_across_drops_weights_epochs_and_restores() -> None:
    sizes = {"a": 40, "b": 9, "c": 25, "z": 5}
    names = list(sizes)

    def build(weights: dict[str, float]) -> Mix[Any]:
        parts = {name: ints(1000 * i, size) for i, (name, size) in enumerate(sizes.items())}
        return rs.mix(parts, weights=weights, seed=77, on_end="drop", schedule="random")

    weights = {"a": 2.0, "b": 1.0, "c": 0.5, "z": 0.0}
    pipe = build(weights)
    for epoch in range(2):
        left, active = dict(sizes), dict.fromkeys(names, True)
        step = 0
        while True:
            if epoch == 0 and step == 30:
                weights = {"a": 1.0, "b": 1.0, "c": 3.0, "z": 0.0}
                pipe.set_weights(weights)
                pipe = restored(lambda: build(weights), pipe.get_state())  # type: ignore[assignment]
            eligible = [name for name in names if active[name] and weights[name] > 0]
            while eligible:
                chosen = documented_draw(77, epoch, step, eligible, weights)
                if left[chosen]:
                    break
                active[chosen] = False
                eligible.remove(chosen)
            item = next(pipe, None)
            if not eligible:
                assert item is None and pipe.ended
                break
            assert pipe.last_component == chosen, (epoch, step)
            assert item == 1000 * names.index(chosen) + sizes[chosen] - left[chosen]
            left[chosen] -= 1
            step += 1
        assert pipe.epoch == epoch and pipe.active == ["z"]
        iter(pipe)  # the next mix epoch


def test_smooth_schedule_always_picks_a_largest_credit_as_documented() -> None:
    """A model of the documented credits (no drops): each step's pick has the largest
    ``credit + share`` (ties within 1e-9), then every credit grows by its share and the pick
    loses 1; the model's credits equal the state's across weight changes and a restore."""
    names = ["a", "b", "c", "d"]

    def build(weights: dict[str, float]) -> Mix[Any]:
        return rs.mix({name: ints(0, 10_000) for name in names}, weights=weights, seed=13)

    weights = {"a": 5.0, "b": 3.0, "c": 2.0, "d": 0.0}
    pipe = build(weights)
    credits = dict.fromkeys(names, 0.0)
    for step in range(600):
        if step in (150, 400):
            weights = (
                {"a": 1.0, "b": 1.0, "c": 1.0, "d": 1.0} if step == 150 else {"a": 0.1, "b": 0.0, "c": 7.0, "d": 2.0}
            )
            pipe.set_weights(weights)
        if step == 300:
            state = roundtrip(pipe.get_state())
            assert all(abs(state["credits"][name] - credits[name]) < 1e-9 for name in names)
            pipe = restored(lambda: build(weights), state)  # type: ignore[assignment]
        eligible = [name for name in names if weights[name] > 0]
        total = sum(weights[name] for name in eligible)
        shares = {name: weights[name] / total for name in eligible}
        best = max(credits[name] + shares[name] for name in eligible)
        next(pipe)
        chosen = pipe.last_component
        assert chosen in eligible and credits[chosen] + shares[chosen] >= best - 1e-9, step
        for name in eligible:
            credits[name] += shares[name]
        credits[chosen] -= 1.0
    final = pipe.get_state()["credits"]
    assert all(abs(final[name] - credits[name]) < 1e-9 for name in names), (final, credits)


@pytest.mark.parametrize("count", [2, 3, 5])
def test_equal_weights_give_rounds_of_one_each_in_an_order_that_varies_with_the_seed(count: int) -> None:
    names = [chr(ord("a") + i) for i in range(count)]
    firsts = set()
    rounds_by_seed = []
    for seed in range(8):
        pipe = rs.mix({name: rs.from_list([name] * 300) for name in names}, seed=seed)
        items = take(pipe, 60 * count)
        rounds = [tuple(items[i : i + count]) for i in range(0, len(items), count)]
        assert all(sorted(r) == names for r in rounds), seed
        firsts |= {r[0] for r in rounds}
        rounds_by_seed.append(rounds)
    assert firsts == set(names)  # not always the first name
    assert len({tuple(rounds) for rounds in rounds_by_seed}) == 8


# -- sharing, length, start_epoch ------------------------------------------------------------------


def test_a_node_read_item_by_item_shared_through_a_nested_mix_is_a_config_error() -> None:
    src = ints(0, 10).filter(lambda x: x % 2 == 1)
    inner = rs.mix({"a": src, "b": ints(50, 3)})
    with pytest.raises(rs.ConfigError, match="also read by component"):
        rs.mix({"inner": inner, "again": src.batch(2)})
    with pytest.raises(rs.ConfigError, match="also read by component"):
        rs.mix({"inner": inner, "again": inner.map(lambda x: x)})
    with pytest.raises(rs.ConfigError):
        rs.mix({"inner": inner, "same": inner})
    prefetched = ints(0, 5).prefetch(2)
    with pytest.raises(rs.ConfigError):
        rs.mix({"a": prefetched, "b": prefetched.map(lambda x: x)})


@pytest.mark.parametrize("on_end", ON_END)
def test_an_indexed_node_shared_by_position_resumes_exactly_while_epochs_diverge(on_end: str) -> None:
    def build() -> Node[Any]:
        shuffled = ints(0, 10).shuffle(1)
        return rs.mix(
            {
                "x": shuffled,  # iterated through its own cursor, restarted on its own
                "y": shuffled.map(lambda v: v + 100),  # reads it by position
                "z": shuffled.shard(0, 3).map(lambda v: v + 1000),
            },
            weights={"x": 1, "y": 2, "z": 1},
            seed=2,
            on_end=on_end,
        )

    if on_end == "drop":  # every component read to its end, each in its own order
        third = [v + 1000 for v in ints(0, 10).shuffle(1).shard(0, 3)]
        assert sorted(build()) == sorted([*range(10), *range(100, 110), *third])
    for k in (0, 5, 10, 17, 24, 25):
        check_resume(build, k, 40, k2=min(k + 6, 40))


def test_len_of_a_drop_mix_is_the_items_of_its_epoch_after_restores_and_weight_changes() -> None:
    def build() -> Mix[Any]:
        return rs.mix(
            {"a": ints(0, 7), "b": ints(100, 3), "zero": ints(200, 4)},
            weights={"a": 2, "b": 1, "zero": 0},
            on_end="drop",
        )

    pipe = build()
    assert len(pipe) == 10
    take(pipe, 4)
    pipe.set_weights({"a": 0, "b": 1, "zero": 1})  # a stops at what it gave
    resumed = restored(
        lambda: rs.mix(
            {"a": ints(0, 7), "b": ints(100, 3), "zero": ints(200, 4)},
            weights={"a": 0, "b": 1, "zero": 1},
            on_end="drop",
        ),
        pipe.get_state(),
    )
    assert isinstance(resumed, Mix)
    expected = len(resumed)
    assert expected == resumed.counts["a"] + 3 + 4
    assert 4 + len(list(resumed)) == expected


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_start_epoch_starts_every_component_and_resumes_inside_that_epoch(schedule: str) -> None:
    def build() -> Mix[Any]:
        return rs.mix(
            {"a": ints(0, 6).shuffle(1), "b": ints(100, 3).shuffle(2)}, seed=5, on_end="restart", schedule=schedule
        )

    pipe = build()
    take(pipe, 17)
    assert sum(pipe.restarts.values()) > 0
    pipe.start_epoch(3)
    assert pipe.epoch == 3 and pipe.step == 0 and pipe.restarts == {"a": 0, "b": 0} and pipe.last_component is None
    fresh = build()
    fresh.start_epoch(3)
    assert take(pipe, 12) == take(fresh, 12)
    state = roundtrip(pipe.get_state())
    expected = take(pipe, 20)
    assert take(restored(build, state), 20) == expected
    other = build()
    other.start_epoch(3)
    assert take(build(), 12) != take(other, 12)  # epoch 3 is another shuffle of every component


def passthrough(item: Any) -> Any:
    return item


@pytest.mark.parametrize("around", ["pmap", "pmap-prefetch", "prefetch-pmap-batch"])
def test_set_weights_under_a_parallel_map_after_close_applies_from_the_next_item_handed_out(around: str) -> None:
    def build(weights: dict[str, float]) -> tuple[Mix[Any], Node[Any]]:
        parts = {name: rs.from_list([f"{name}{i}" for i in range(60)]) for name in ("a", "b")}
        mixed = rs.mix(parts, weights=weights, seed=0)
        if around == "pmap":
            return mixed, mixed.map(passthrough, num_workers=2)
        if around == "pmap-prefetch":
            return mixed, mixed.map(passthrough, num_workers=2).prefetch(5)
        return mixed, mixed.prefetch(3).map(passthrough, num_workers=2).batch(2)

    def flat(items: list[Any]) -> list[str]:
        return [x for item in items for x in (item if isinstance(item, list) else [item])]

    mixed, pipe = build({"a": 1, "b": 1})
    head = flat(take(pipe, 6))
    assert any(item.startswith("b") for item in head)
    pipe.close()
    assert mixed.step == len(head)  # back at the last item handed out
    mixed.set_weights({"a": 1, "b": 0})
    assert all(item.startswith("a") for item in flat(take(pipe, 6)))
    state = roundtrip(pipe.get_state())
    _, resumed = build({"a": 1, "b": 0})
    resumed.set_state(state)
    assert take(resumed, 8) == take(pipe, 8)
    pipe.close()
    resumed.close()


@settings(max_examples=20, deadline=None)
@given(
    on_end=st.sampled_from(ON_END),
    schedule=st.sampled_from(SCHEDULES),
    k1=st.integers(0, 50),
    extra=st.integers(0, 30),
    new=st.lists(st.sampled_from([0.0, 1e-12, 0.5, 1.0, 4.0, 1e12]), min_size=3, max_size=3).filter(any),
)
def test_drawn_weight_changes_then_a_checkpoint_continue_exactly(
    on_end: str, schedule: str, k1: int, extra: int, new: list[float]
) -> None:
    new_weights = dict(zip("abc", new))
    pipe = three(on_end, schedule=schedule)
    head = take(pipe, k1)
    pipe.set_weights(new_weights)
    middle = take(pipe, extra)
    state = roundtrip(pipe.get_state())
    at_state = stats(pipe)
    rest = take(pipe, 40)
    zero = {name for name, weight in new_weights.items() if not weight}
    assert not [item for item in middle + rest if "abc"[item // 1000] in zero]  # never read after the change
    resumed = three(on_end, new_weights, schedule)
    resumed.set_state(state)
    assert stats(resumed) == at_state
    assert take(resumed, 40) == rest
    assert len(head) == k1 and len(middle) == extra  # every mode here has items in every epoch
