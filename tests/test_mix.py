"""Mix: a deterministic weighted interleave of named pipelines, resumable exactly, with
validated component names and weights that may change on resume."""

from __future__ import annotations

import json
import warnings
from typing import Any, Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import resumable as rs
from resumable import Node
from resumable.ops.mix import Mix, mix
from resumable.pack import expand_references
from tests.resume import check_resume, restored, roundtrip, take
from tests.sources import indexed_source, stream_source

ON_END = ["stop", "drop", "restart"]
SCHEDULES = ["smooth", "random"]


def web(n: int = 30, seed: int = 1) -> Node[Any]:
    return rs.from_list(list(range(n))).shuffle(seed).map(lambda x: ("web", x)).filter(lambda r: r[1] % 7 != 3)


def code(n: int = 17, seed: int = 2) -> Node[Any]:
    return rs.from_list(list(range(1000, 1000 + n))).shuffle(seed).map(lambda x: ("code", x))


def books(n: int = 11, seed: int = 3) -> Node[Any]:
    return rs.from_list(list(range(5000, 5000 + n))).shuffle(seed).batch(2)


def builder(
    on_end: str = "stop", schedule: str = "smooth", weights: dict[str, float] | None = None, after: bool = False
) -> Callable[[], Node[Any]]:
    weights = weights or {"web": 0.5, "code": 0.3, "books": 0.2}

    def build() -> Node[Any]:
        pipe: Node[Any] = mix(
            {"web": web(), "code": code(), "books": books()}, weights=weights, seed=7, on_end=on_end, schedule=schedule
        )
        if after:
            pipe = pipe.map(lambda item: [item]).batch(3)
        return pipe

    return build


def test_items_come_from_the_components_in_their_own_order() -> None:
    pipe = mix({"web": web(), "code": code()}, weights={"web": 1, "code": 1}, on_end="drop")
    items = list(pipe)
    assert [x for x in items if x[0] == "web"] == list(web())
    assert [x for x in items if x[0] == "code"] == list(code())
    assert pipe.counts == {"web": len(list(web())), "code": 17}


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_stop_ends_at_the_first_exhausted_component(schedule: str) -> None:
    pipe = mix({"a": rs.from_list(list(range(5))), "b": rs.from_list(list(range(100, 200)))}, seed=1, schedule=schedule)
    items = list(pipe)
    assert [x for x in items if x < 100] == [0, 1, 2, 3, 4]
    assert pipe._ended
    assert list(pipe) != []  # a new mix epoch starts every component again


def test_drop_continues_until_all_end() -> None:
    pipe = mix({"a": rs.from_list(list(range(5))), "b": rs.from_list(list(range(100, 120)))}, on_end="drop")
    items = list(pipe)
    assert sorted(items) == list(range(5)) + list(range(100, 120))
    assert pipe.active == []


def test_restart_starts_a_new_epoch_of_the_component_and_never_ends() -> None:
    pipe = mix(
        {"a": rs.from_list(list(range(4))).shuffle(0), "b": rs.from_list(list(range(100, 140))).shuffle(1)},
        on_end="restart",
    )
    items = take(pipe, 80)
    a_items = [x for x in items if x < 100]
    assert len(a_items) == 40 and pipe.restarts["a"] == 9
    epochs = [a_items[i : i + 4] for i in range(0, 40, 4)]
    assert all(sorted(epoch) == [0, 1, 2, 3] for epoch in epochs)
    assert len({tuple(epoch) for epoch in epochs}) > 1  # new shuffle order per restart
    assert not pipe._ended


def test_restart_drops_a_component_that_is_empty() -> None:
    pipe = mix({"a": rs.from_list([]), "b": rs.from_list([1, 2, 3])}, on_end="restart")
    assert take(pipe, 7) == [1, 2, 3, 1, 2, 3, 1]
    assert pipe.active == ["b"]
    assert list(mix({"a": rs.from_list([]), "b": rs.from_list([])}, on_end="restart")) == []


def test_zero_weight_component_is_never_read() -> None:
    pipe = mix({"a": rs.from_list([1, 2]), "b": rs.from_list([10, 20, 30])}, weights={"a": 0, "b": 1}, on_end="drop")
    assert list(pipe) == [10, 20, 30]


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("on_end", ON_END)
@pytest.mark.parametrize("after", [False, True])
def test_resume_is_exact(on_end: str, schedule: str, after: bool) -> None:
    build = builder(on_end, schedule, after=after)
    per_epoch = len(list(build())) if on_end != "restart" else 60
    total = min(3 * per_epoch + 5, 150)
    for k in sorted({0, 1, per_epoch // 2, per_epoch - 1, per_epoch, per_epoch + 1, total - 1, total}):
        if k <= total:
            check_resume(build, k, total)
    check_resume(build, per_epoch // 3, total, k2=per_epoch + 2)


@pytest.mark.parametrize("on_end", ON_END)
def test_resume_at_the_step_a_component_ends(on_end: str) -> None:
    """Checkpoints right before, at and after the step at which ``code`` is exhausted."""
    build = builder(on_end, weights={"web": 0.2, "code": 0.6, "books": 0.2})
    pipe = build()
    last_code = 0
    for step, item in enumerate(take(pipe, 60), start=1):
        if isinstance(item, tuple) and item[0] == "code":
            last_code = step
            if on_end == "restart" and pipe.restarts["code"]:
                break
    for k in (last_code - 1, last_code, last_code + 1):
        check_resume(build, k, 70)


def test_state_layout_nests_components() -> None:
    pipe = builder()()
    take(pipe, 10)
    state = roundtrip(pipe.get_state())
    assert state["kind"] == "Mix" and state["names"] == ["web", "code", "books"]
    assert set(state["components"]) == {"web", "code", "books"}
    assert state["components"]["books"]["kind"] == "Batch"
    assert state["step"] == 10 and sum(state["counts"].values()) == 10
    assert len(json.dumps(state)) < 3000


def test_other_component_names_are_rejected() -> None:
    state = builder()().get_state()
    other = mix({"web": web(), "code": code(), "wiki": books()}, weights={"web": 1, "code": 1, "wiki": 1})
    with pytest.raises(rs.StateError, match="components"):
        other.set_state(state)
    reordered = mix({"code": code(), "web": web(), "books": books()}, seed=7)
    with pytest.raises(rs.StateError):
        reordered.set_state(state)


def test_errors_name_the_component_path() -> None:
    state = builder()().get_state()
    state["components"]["books"]["batch_size"] = 5
    with pytest.raises(rs.StateError, match=r"Mix\[books\] > Batch"):
        builder()().set_state(state)


def test_failed_restore_leaves_the_mix_as_it_was() -> None:
    pipe = builder()()
    head = take(pipe, 5)
    good = pipe.get_state()
    bad = json.loads(json.dumps(good))
    bad["components"]["books"]["upstream"]["upstream"]["length"] = 99
    bad["step"] = 3
    with pytest.raises(rs.StateError):
        pipe.set_state(bad)
    assert pipe.get_state() == good
    expected = take(builder()(), 20)
    assert head + take(pipe, 15) == expected


def test_options_are_validated_in_the_state() -> None:
    state = builder("drop")().get_state()
    with pytest.raises(rs.StateError, match="on_end"):
        builder("stop")().set_state(state)
    with pytest.raises(rs.StateError, match="schedule"):
        builder("drop", "random")().set_state(state)


def test_changed_weights_continue_from_the_saved_step() -> None:
    old = {"web": 0.5, "code": 0.3, "books": 0.2}
    new = {"web": 0.1, "code": 0.1, "books": 0.8}
    pipe = builder("restart", weights=old)()
    head = take(pipe, 30)
    state = pipe.get_state()

    first = restored(builder("restart", weights=new), state)
    second = restored(builder("restart", weights=new), state)
    tail = take(first, 200)
    assert take(second, 200) == tail  # deterministic
    assert take(restored(builder("restart", weights=old), state), 200) == take(pipe, 200)  # old weights unchanged
    share_books = sum(isinstance(item, list) for item in tail) / len(tail)
    assert abs(share_books - 0.8) < 0.03
    assert sum(isinstance(item, list) for item in head) / len(head) < 0.3


def test_set_weights_takes_effect_at_once() -> None:
    pipe = mix({"a": rs.from_list([0] * 10_000), "b": rs.from_list([1] * 10_000)}, weights={"a": 1, "b": 1})
    first = take(pipe, 100)
    pipe.set_weights({"a": 9, "b": 1})
    second = take(pipe, 100)
    assert sum(first) == 50 and 9 <= sum(second) <= 11
    assert pipe.weights == {"a": 9.0, "b": 1.0}


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_proportions_converge_to_the_weights(schedule: str) -> None:
    weights = {"a": 0.6, "b": 0.25, "c": 0.15}
    components = {name: rs.from_list(list(range(20_000))) for name in weights}
    pipe = mix(components, weights=weights, seed=3, schedule=schedule)
    take(pipe, 10_000)
    tolerance = 0.001 if schedule == "smooth" else 0.02
    for name, share in pipe.proportions.items():
        assert abs(share - weights[name]) < tolerance
    assert sum(pipe.counts.values()) == pipe.step == 10_000


def test_smooth_schedule_tracks_the_target_at_every_step() -> None:
    weights = {"a": 5, "b": 3, "c": 2}
    pipe = mix({name: rs.from_list(list(range(2000))) for name in weights}, weights=weights, seed=1)
    counts = dict.fromkeys(weights, 0)
    for step in range(1, 1001):
        next(pipe)
        counts[pipe.last_component] += 1  # type: ignore[index]  # set once an item was handed out
        for name, weight in weights.items():
            assert abs(counts[name] - step * weight / 10) < 2


def test_seed_changes_the_order_of_ties() -> None:
    def items(seed: int) -> list[int]:
        return take(mix({"a": rs.from_list([0] * 50), "b": rs.from_list([1] * 50)}, seed=seed), 40)

    assert items(0) == items(0)
    assert items(0) != items(1)
    assert sum(items(0)) == 20


def test_pack_before_mix_resumes_exactly() -> None:
    def corpus(offset: int, lengths: list[int]) -> list[dict[str, Any]]:
        return [{"input_ids": offset + 1000 * i + np.arange(n, dtype=np.int64)} for i, n in enumerate(lengths)]

    rng = np.random.default_rng(0)
    web_docs = corpus(10**6, rng.integers(1, 40, 60).tolist())
    code_docs = corpus(2 * 10**6, rng.integers(1, 25, 40).tolist())

    def build() -> Node[Any]:
        packed = {
            "web": rs.from_list(web_docs)
            .shuffle(0)
            .filter(lambda d: len(d["input_ids"]) != 5)
            .pack(32, strategy="best_fit", buffer_size=8),
            "code": rs.from_list(code_docs).shuffle(1).pack(32, strategy="greedy"),
        }
        rows = mix(packed, weights={"web": 2, "code": 1}, seed=5, on_end="restart")
        return rows.map(lambda row: row["input_ids"].tolist()).batch(2)

    for k in (0, 7, 19, 40):
        check_resume(build, k, 60)
    check_resume(build, 5, 60, k2=33)


def tokenized(offset: int, count: int) -> list[dict[str, Any]]:
    """Documents whose token ids name themselves: ``offset + 1000 * document + position + 1``."""
    lengths = np.random.default_rng(offset).integers(0, 30, count).tolist()
    return [
        {"id": offset + i, "input_ids": (offset + 1000 * i + np.arange(n) + 1).tolist()} for i, n in enumerate(lengths)
    ]


def rows_as_lists(row: dict[str, Any]) -> list[int]:
    return row["input_ids"][row["document_ids"] > 0].tolist()  # type: ignore[no-any-return]  # a row of int64 arrays


PACK_AFTER_MIX: dict[str, Callable[[str], Node[Any]]] = {
    "best_fit_restart": lambda kind: mix(
        {
            "web": indexed_source(kind, tokenized(10**6, 50)).shuffle(0).filter(lambda d: d["id"] % 7 != 3),
            "code": indexed_source(kind, tokenized(2 * 10**6, 30)).shuffle(1),
        },
        weights={"web": 2, "code": 1},
        seed=5,
        on_end="restart",
    ).pack(32, buffer_size=6),
    "greedy_stop_prefetch": lambda kind: (
        mix(
            {
                "web": indexed_source(kind, tokenized(10**6, 50)).shuffle(2),
                "code": rs.from_list(tokenized(3 * 10**6, 20)),
            },
            seed=1,
        )
        .prefetch(3)
        .pack(24, strategy="greedy")
    ),
    "first_fit_nested_stream": lambda kind: mix(
        {
            "inner": mix(
                {"a": indexed_source(kind, tokenized(10**6, 30)), "b": rs.from_list(tokenized(4 * 10**6, 20))}
            ),
            "stream": stream_source("jsonl_stream_gzip", tokenized(5 * 10**6, 25)),
        },
        on_end="drop",
    ).pack(16, strategy="first_fit", buffer_size=4, overlong="split"),
}


@pytest.mark.parametrize("kind", ["list", "jsonl", "parquet"])
@pytest.mark.parametrize("chain", sorted(PACK_AFTER_MIX))
def test_pack_after_mix_resumes_exactly(chain: str, kind: str) -> None:
    """A packer after a mix keeps references whose keys name the mix component, fetched again
    from that component on restore: exact at the start, middle and end of an epoch and across
    epochs, restoring once and twice."""

    def build() -> Node[Any]:
        return PACK_AFTER_MIX[chain](kind).map(rows_as_lists)

    for k in (0, 9, 23):
        check_resume(build, k, 45)
    check_resume(build, 4, 45, k2=30)


def test_pack_after_mix_packs_every_token_once_and_keys_name_the_component() -> None:
    web, code = tokenized(10**6, 40), tokenized(2 * 10**6, 25)
    mixed = mix({"web": rs.from_list(web).shuffle(3), "code": rs.from_list(code)}, on_end="drop")
    pipe = mixed.pack(20, buffer_size=5)
    tokens = sorted(t for row in pipe for t in rows_as_lists(row))
    assert tokens == sorted(t for d in web + code for t in d["input_ids"])
    pipe = mix({"web": rs.from_list(web), "code": rs.from_list(code)}).pack(20, buffer_size=5)
    for _ in range(10):  # until documents wait in the buffer
        next(pipe)
        if expand_references(pipe.get_state())["open"]:
            break
    keys = pipe.pending_keys()
    assert keys and all(key[0] in ("web", "code") and len(key) == 3 for key in keys)
    state = expand_references(pipe.get_state())
    references = state["open"] + state["ready"]
    assert references and all(ref[0] in ("web", "code") and len(ref) == 5 for ref in references)


def test_pack_after_a_mix_of_untraceable_items_is_a_clear_config_error() -> None:
    from torchdata.nodes import IterableWrapper

    from resumable.torch import FromTorchdata

    pipe = mix({"a": FromTorchdata(IterableWrapper([{"input_ids": [1, 2]}])), "b": rs.from_list([{"input_ids": [3]}])})
    with pytest.raises(rs.ConfigError, match="last_key"):
        list(pipe.pack(8))


def test_a_mix_component_whose_documents_are_all_empty_does_not_stop_the_packer() -> None:
    """Empty documents are counted per component: one component without tokens, running
    through its epochs (``restart``), does not look like an upstream that gives no tokens."""
    empty = [{"input_ids": []} for _ in range(3)]
    pipe = mix(
        {"empty": rs.from_list(empty).shuffle(1), "full": rs.from_list(tokenized(10**6, 40))},
        weights={"empty": 5, "full": 1},
        on_end="restart",
    ).pack(16, buffer_size=4)
    assert len(take(pipe, 30)) == 30
    barren = mix({"empty": rs.from_list(empty)}, on_end="restart").pack(16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", rs.BarrenEpochWarning)
        with pytest.raises(rs.BarrenEpochWarning, match="no document of epoch 1 of mix component empty"):
            next(barren)


@pytest.mark.parametrize(
    ("components", "weights", "match"),
    [
        ({}, None, "empty"),
        ([1, 2], None, "dict"),
        ({"a": [1, 2]}, None, "resumable node"),
        ({"": rs.from_list([1])}, None, "names"),
        ({"a": rs.from_list([1])}, {"a": 1, "b": 1}, "unknown"),
        ({"a": rs.from_list([1]), "b": rs.from_list([1])}, {"a": 1}, "no weight"),
        ({"a": rs.from_list([1])}, {"a": -1}, ">= 0"),
        ({"a": rs.from_list([1]), "b": rs.from_list([1])}, {"a": 0, "b": 0.0}, "positive"),
        ({"a": rs.from_list([1])}, {"a": float("nan")}, "finite"),
        ({"a": rs.from_list([1])}, {"a": True}, "finite"),
        ({"a": rs.from_list([1])}, [1], "dict"),
    ],
)
def test_invalid_options_raise_config_error(components: Any, weights: Any, match: str) -> None:
    with pytest.raises(rs.ConfigError, match=match):
        mix(components, weights=weights)


def test_invalid_scalars_raise_config_error() -> None:
    node = rs.from_list([1])
    for options in ({"seed": -1}, {"seed": 1.5}, {"on_end": "loop"}, {"schedule": "fifo"}):
        with pytest.raises(rs.ConfigError):
            mix({"a": rs.from_list([1])}, **options)  # type: ignore[arg-type]  # deliberately wrong, to test the check
    with pytest.raises(rs.ConfigError, match="twice"):
        mix({"a": node, "b": node})
    with pytest.raises(rs.ConfigError):
        mix({"a": node}).set_weights({"a": 0})


def test_repr_and_start_epoch() -> None:
    pipe = builder()()
    assert "web: <Filter < IndexedMap < Shuffle < FromList>" in repr(pipe)
    first = take(pipe, 10)
    pipe.start_epoch(0)
    assert take(pipe, 10) == first and pipe.epoch == 0
    pipe.start_epoch(2)
    assert pipe.epoch == 2 and take(pipe, 10) != first
    assert isinstance(pipe, Mix)


@settings(max_examples=25, deadline=None)
@given(
    weights=st.lists(st.integers(0, 5), min_size=3, max_size=3).filter(any),
    on_end=st.sampled_from(ON_END),
    schedule=st.sampled_from(SCHEDULES),
    k=st.integers(0, 80),
    extra=st.integers(0, 40),
)
def test_resume_property(weights: list[int], on_end: str, schedule: str, k: int, extra: int) -> None:
    build = builder(on_end, schedule, weights=dict(zip(["web", "code", "books"], weights)))
    check_resume(build, k, 100, k2=min(k + extra, 100))


def test_nested_mix_and_repeat_resume_exactly() -> None:
    def build() -> Node[Any]:
        inner = mix({"web": web(), "code": code()}, weights={"web": 3, "code": 1}, seed=2, on_end="drop")
        outer = mix({"inner": inner, "books": books()}, weights={"inner": 4, "books": 1}, seed=9, on_end="drop")
        return outer.repeat(3)

    per_epoch = len(list(build().upstream))  # type: ignore[arg-type]  # the repeat has an upstream
    for k in (0, per_epoch - 1, per_epoch, per_epoch + 3):
        check_resume(build, k, 3 * per_epoch)
    state = build().get_state()
    state["upstream"]["components"]["inner"]["components"]["code"]["upstream"]["seed"] = 5
    with pytest.raises(rs.StateError, match=r"Mix\[inner\] > Mix\[code\] > IndexedMap > Shuffle"):
        build().set_state(state)


@pytest.mark.parametrize("last", [[], {}, 3, "nobody"])
def test_a_malformed_last_component_is_a_state_error(last: Any) -> None:
    build = lambda: rs.mix({"a": rs.from_list([1, 2, 3]), "b": rs.from_list([4, 5])}, seed=1)  # noqa: E731
    pipe = build()
    next(pipe)
    state = pipe.get_state()
    state["last"] = last
    with pytest.raises(rs.StateError, match="last"):
        build().set_state(state)


def test_set_weights_under_a_prefetch_after_close_applies_from_the_next_item_handed_out() -> None:
    def build(weights: dict[str, float]) -> tuple[Mix[Any], Node[Any]]:
        parts = {name: rs.from_list([f"{name}{i}" for i in range(50)]) for name in ("a", "b")}
        mixed = mix(parts, weights=weights, seed=0)
        return mixed, mixed.prefetch(8)

    mixed, pipe = build({"a": 1, "b": 1})
    head = take(pipe, 6)
    assert any(item.startswith("b") for item in head)
    pipe.close()
    mixed.set_weights({"a": 1, "b": 0})
    assert all(item.startswith("a") for item in take(pipe, 6))
    state = roundtrip(pipe.get_state())
    _, resumed = build({"a": 1, "b": 0})
    resumed.set_state(state)
    assert take(resumed, 8) == take(pipe, 8)
