"""Elastic resume of whole-epoch ``bfd`` plans: the rows every old consumer had not handed out
are re-split, whole, over the new consumers, which hand them out and then go on to the next
epoch, planned whole for the new topology. Every token of the interrupted epoch comes once,
and no document of it is planned again from the upstream.

The chains of ``tests/test_elastic.py::CHAINS`` named ``pack_bfd*`` run through its general
properties too (every source kind, drawn topologies, the same topology exact)."""

from __future__ import annotations

import copy
import itertools
import json
from collections import Counter
from typing import Any, Callable

import pytest

import resumable as rs
from resumable.elastic import rescaled_state, restore
from tests.sources import INDEXED_KINDS, indexed_source
from tests.test_elastic import SEQ_LEN, documents, run_phases
from tests.test_elastic import expected as expected_tokens

DOCS = documents(90)


def planned(consumer: int, consumers: int, kind: str = "list", docs: list[dict[str, Any]] = DOCS) -> rs.Node:
    return indexed_source(kind, docs).shuffle(7).shard(consumer, consumers).pack(SEQ_LEN, strategy="bfd")


def repeated(consumer: int, consumers: int) -> rs.Node:
    return rs.from_list(DOCS).shuffle(5).shard(consumer, consumers).pack(SEQ_LEN, strategy="bfd").repeat(2)


def rows_of(items: list[Any]) -> list[tuple[int, ...]]:
    """Each row's tokens (padding left out), rows of batches flattened."""
    rows = [row for item in items for row in (item if isinstance(item, list) else [item])]
    return [tuple(int(t) for t in row["input_ids"][row["document_ids"] > 0]) for row in rows]


def saved(pipe: rs.Node) -> dict[str, Any]:
    return json.loads(json.dumps(pipe.get_state()))


def pack_state(state: dict[str, Any]) -> dict[str, Any]:
    while state["kind"] != "Pack":
        state = state["upstream"]
    return state


def started(build: Callable[[int, int], rs.Node], consumers: int, steps: list[int]) -> tuple[list[rs.Node], list]:
    """``consumers`` pipelines, consumer ``c`` having handed out ``steps[c]`` items."""
    pipes = [build(c, consumers) for c in range(consumers)]
    head = [next(pipe) for pipe, count in zip(pipes, steps) for _ in range(count)]
    return pipes, head


ALL_TOKENS = expected_tokens("pack_bfd", DOCS)


def test_the_rows_left_are_dealt_out_whole_and_nothing_is_planned_again() -> None:
    old, head = started(planned, 3, [2, 5, 9])
    states = [saved(pipe) for pipe in old]
    left = sorted(rows_of([row for pipe in old for row in pipe]))  # what the old consumers still had
    new_rows = []
    for consumer in range(2):
        pipe = planned(consumer, 2)
        restore(pipe, states)
        assert pipe.upstream._length(0) == 0, "every old stride was planned: none is read again"
        new_rows.extend(rows_of(list(pipe)))
    assert sorted(new_rows) == left, "the same rows: the remaining plan keeps its packing"
    assert Counter(t for row in rows_of(head) + new_rows for t in row) == ALL_TOKENS


def test_old_consumers_that_handed_out_no_row_leave_their_stride_to_be_planned_again() -> None:
    old, head = started(planned, 4, [0, 3, 0, 1])
    states = [saved(pipe) for pipe in old]
    seen = Counter(t for row in rows_of(head) for t in row)
    unplanned = sum(len(pipe.upstream) for pipe, steps in zip(old, [0, 3, 0, 1]) if not steps)
    lengths = []
    for consumer in range(3):
        pipe = planned(consumer, 3)
        restore(pipe, states)
        lengths.append(pipe.upstream._length(0))
        seen.update(t for row in rows_of(list(pipe)) for t in row)
    assert sum(lengths) == unplanned
    assert seen == ALL_TOKENS


@pytest.mark.parametrize(
    "topologies", [t for t in itertools.product(range(1, 5), repeat=3) if t[0] != t[1] != t[2]][::3]
)
def test_two_rescales_in_one_epoch_on_one_to_four_consumers(topologies: tuple[int, int, int]) -> None:
    fractions = [0.2, 0.6, 0.0, 0.45]
    phases = [(consumers, fractions[index:] + fractions[:index]) for index, consumers in enumerate(topologies)]
    phases.append((topologies[-1] % 4 + 1, [1.0]))
    assert run_phases("pack_bfd", DOCS, phases) == ALL_TOKENS


@pytest.mark.parametrize("kind", INDEXED_KINDS)
def test_two_rescales_in_one_epoch_over_every_source_kind(kind: str) -> None:
    phases = [(4, [0.3, 0.1, 0.5]), (3, [0.4, 0.0, 0.7]), (2, [1.0])]
    assert run_phases("pack_bfd", DOCS, phases, kind) == ALL_TOKENS
    assert run_phases("pack_bfd_repeat_batch", DOCS, phases, kind) == expected_tokens("pack_bfd_repeat_batch", DOCS)


def test_a_shuffle_between_the_shard_and_the_packer_is_replayed() -> None:
    def build(consumer: int, consumers: int) -> rs.Node:
        return rs.from_list(DOCS).shard(consumer, consumers).shuffle(3).pack(SEQ_LEN, strategy="bfd")

    seen: Counter[int] = Counter()
    states = None
    for consumers, steps in ((3, [4, 1, 6]), (2, [3, 2]), (4, None)):
        pipes = [build(c, consumers) for c in range(consumers)]
        for consumer, pipe in enumerate(pipes):
            if states is not None:
                restore(pipe, states)
            rows = list(pipe) if steps is None else [next(pipe) for _ in range(steps[consumer])]
            seen.update(t for row in rows_of(rows) for t in row)
        states = [saved(pipe) for pipe in pipes]
    assert seen == ALL_TOKENS


def test_consumers_on_both_sides_of_an_epoch_boundary() -> None:
    """Consumer 0 is still in epoch 0, consumer 1 has handed out rows of epoch 1's plan,
    consumer 2 has started epoch 1 without a row of it: the rescale continues both epochs, and
    a second rescale, before epoch 0 is over, too."""
    old = [repeated(c, 3) for c in range(3)]
    seen: Counter[int] = Counter()
    seen.update(t for row in rows_of([next(old[0])]) for t in row)
    for pipe, rows_into_next in ((old[1], 2), (old[2], 0)):
        while pipe.upstream.upstream.epoch == 0 or pack_state(pipe.get_state())["emitted"] < rows_into_next:
            seen.update(t for row in rows_of([next(pipe)]) for t in row)
    states = [saved(pipe) for pipe in old]
    assert [pack_state(s)["upstream"]["epoch"] for s in states] == [0, 1, 1]

    middle = [repeated(c, 2) for c in range(2)]
    for consumer, pipe in enumerate(middle):
        restore(pipe, states)
        assert "next_remap" in json.dumps(pipe.get_state())
        seen.update(t for row in rows_of([next(pipe) for _ in range(consumer + 1)]) for t in row)
    states = [saved(pipe) for pipe in middle]
    for consumer in range(4):
        pipe = repeated(consumer, 4)
        restore(pipe, states)
        seen.update(t for row in rows_of(list(pipe)) for t in row)
    assert seen == ALL_TOKENS + ALL_TOKENS


def test_the_epoch_after_a_rescale_is_the_new_topologys_own() -> None:
    old, _ = started(repeated, 3, [3, 1, 4])
    states = [saved(pipe) for pipe in old]
    for consumer in range(2):
        pipe = repeated(consumer, 2)
        restore(pipe, states)
        while pipe.upstream.upstream.epoch == 0:
            row = next(pipe)
        rest = rows_of([row, *pipe])  # the row that started epoch 1, then the rest of it
        fresh = repeated(consumer, 2).upstream
        fresh.start_epoch(1)
        assert rest == rows_of(list(fresh))
        assert "inherited" not in json.dumps(pipe.get_state())


@pytest.mark.parametrize("kind", ["list", "jsonl"])
def test_a_rescaled_plan_resumes_exactly_mid_way(kind: str) -> None:
    """Saved part-way through the held rows, and part-way through the plan after them (some
    old strides were left unplanned): a restore through JSON continues with the same rows, and
    a rescale onto the same number of consumers too."""
    old, _ = started(lambda c, n: planned(c, n, kind), 4, [5, 0, 3, 1])
    states = [saved(pipe) for pipe in old]
    build = lambda: planned(1, 3, kind)  # noqa: E731
    pipe = build()
    restore(pipe, states)
    state = saved(pipe)
    expected = rows_of(list(pipe))
    held = len(pack_state(state)["inherited_sizes"])
    assert 1 < held < len(expected)
    for cut in (1, held - 1, held, held + 1, len(expected)):
        first = build()
        first.set_state(state)
        head = rows_of([next(first) for _ in range(cut)])
        middle = saved(first)
        again = build()
        again.set_state(middle)
        assert head + rows_of(list(again)) == expected
        same = build()
        restore(same, [saved(planned(0, 3, kind)), middle, saved(planned(2, 3, kind))])
        assert rows_of(list(same)) == expected[cut:]


def test_rescaling_a_rescaled_state_before_it_hands_out_anything() -> None:
    old, head = started(planned, 2, [3, 2])
    states = [saved(pipe) for pipe in old]
    middle = [planned(c, 3) for c in range(3)]
    for pipe in middle:
        restore(pipe, states)
    states = [saved(pipe) for pipe in middle]
    seen = Counter(t for row in rows_of(head) for t in row)
    for consumer in range(4):
        pipe = planned(consumer, 4)
        restore(pipe, states)
        seen.update(t for row in rows_of(list(pipe)) for t in row)
    assert seen == ALL_TOKENS


def rescaled() -> tuple[Callable[[], rs.Node], dict[str, Any]]:
    """A new consumer's state holding rows of two old consumers, one row handed out."""
    old, _ = started(planned, 3, [2, 4, 1])
    pipe = planned(0, 2)
    restore(pipe, [saved(p) for p in old])
    next(pipe)
    return (lambda: planned(0, 2)), saved(pipe)


@pytest.mark.parametrize(
    "edit",
    [
        lambda s: s.update(inherited=5),
        lambda s: s.pop("inherited"),
        lambda s: s.pop("inherited_sizes"),
        lambda s: s.update(inherited_sizes=[*s["inherited_sizes"][:-1], s["inherited_sizes"][-1] + 1]),
        lambda s: s.update(inherited_sizes=[0, *s["inherited_sizes"]]),
        lambda s: s["inherited"].__setitem__(-1, [0, 1, 2]),
        lambda s: s["inherited"].__setitem__(-1, [0, 1, 5, 5]),
        lambda s: s["inherited"].__setitem__(-1, [0, 1, -1, 5]),
        lambda s: s["inherited"].__setitem__(-1, [0, 10**30, 0, 1]),
        lambda s: s["inherited"].__setitem__(-1, [0, 10**6, 0, 1]),
        lambda s: s["inherited"].__setitem__(-1, [0, 0, 0, 10**4]),
        lambda s: s["inherited"].__setitem__(-1, [3, *s["inherited"][-1][1:]]),
        lambda s: s["inherited"].__setitem__(-1, [True, *s["inherited"][-1][1:]]),
        lambda s: s.update(inherited_sizes=[len(s["inherited"])]),
        lambda s: s.update(planned=-1),
        lambda s: s.update(planned=10**6),
        lambda s: s.update(emitted=10**6),
        lambda s: s.update(emitted="1"),
    ],
)
def test_a_corrupt_rescaled_state_is_a_state_error_and_changes_nothing(edit: Callable[[dict], Any]) -> None:
    build, state = rescaled()
    edit(pack_state(state))
    pipe = build()
    next(pipe)
    before = pipe.get_state()
    with pytest.raises(rs.StateError, match="Pack"):
        pipe.set_state(state)
    assert pipe.get_state() == before


@pytest.mark.parametrize(
    "edit",
    [
        lambda s: s.update(planned=s["planned"] + 1),
        lambda s: s.update(emitted=s["planned"] + 1),
        lambda s: s["upstream"].update(length=s["upstream"]["length"] + 1),
        lambda s: s.update(inherited=[[2, 1, 0, 1]], inherited_sizes=[1]),
        lambda s: s.update(inherited=[[0, 1, 0, 1]], inherited_sizes=[2]),
    ],
)
def test_corrupt_old_states_are_state_errors(edit: Callable[[dict], Any]) -> None:
    old, _ = started(planned, 3, [2, 4, 1])
    states = [saved(pipe) for pipe in old]
    edit(pack_state(states[1]))
    for consumer in range(2):
        with pytest.raises(rs.StateError, match="Pack"):
            rescaled_state(planned(consumer, 2), copy.deepcopy(states))


def test_a_rescale_that_must_plan_an_old_stride_again_checks_it() -> None:
    """Old consumer 1's rows are in new consumer 0's block, so its plan is made again there:
    a plan that no longer matches the saved one is a StateError."""
    old, _ = started(planned, 2, [1, 1])
    states = [saved(pipe) for pipe in old]
    pack_state(states[0])["planned"] += 1  # consumer 0's rows are counted from its saved plan
    with pytest.raises(rs.StateError, match="did the data change"):
        rescaled_state(planned(1, 3), states)


def loader_build() -> rs.Node:
    return rs.from_list(DOCS).shuffle(4).shard().pack(SEQ_LEN, strategy="bfd").batch(2)


def test_loader_resumes_on_three_workers_what_two_left() -> None:
    from resumable.torch import Loader

    old = Loader(loader_build, num_workers=2)
    batches = iter(old)
    head = [next(batches) for _ in range(7)]  # the workers' states as of the 7th batch
    state = json.loads(json.dumps(old.state_dict()))
    old.close()
    new = Loader(loader_build, num_workers=3)
    new.load_state_dict([state])
    rest = list(new)
    assert Counter(t for row in rows_of(head + rest) for t in row) == ALL_TOKENS
    following = rows_of(list(new))
    new.close()
    with Loader(loader_build, num_workers=3) as fresh:
        list(fresh)
        assert following == rows_of(list(fresh)), "epoch 1 as if three workers had always run"
