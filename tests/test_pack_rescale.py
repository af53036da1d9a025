"""Streaming packers' buffers are dealt out whole in an elastic rescale: new consumer ``j`` of
``C'`` inherits the pieces of the old consumers ``i`` of ``C`` with ``i * C' // C == j``, and reads
no other old consumer's buffer (``resumable.pack._rescale``)."""

from __future__ import annotations

import copy
import json
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

import resumable as rs
import resumable.pack._rescale as rescale_module
from resumable.elastic import rescaled_state, rescaled_states, restore
from resumable.pack import expand_references
from resumable.pack._rescale import buffer_free_text, inherited_from
from tests.test_elastic import CHAINS, delivered, documents, expected, take_fraction

CHAIN = "pack_best_fit"
SAVED = json.loads((Path(__file__).parent / "data" / "states_rescaled_pieces.json").read_text())


def build(consumer: int, consumers: int, docs: list[dict[str, Any]]) -> rs.Node:
    return CHAINS[CHAIN](rs.from_list(docs), consumer, consumers)


def old_states(docs: list[dict[str, Any]], consumers: int) -> tuple[list[dict[str, Any]], Counter[int]]:
    """Every old consumer's state part-way (JSON round trip) and the tokens they delivered."""
    seen: Counter[int] = Counter()
    states = []
    for consumer in range(consumers):
        pipe = build(consumer, consumers, docs)
        for row in take_fraction(pipe, 0.1 + 0.7 * consumer / consumers):
            seen.update(delivered(CHAIN, row))
        states.append(json.loads(json.dumps(pipe.get_state())))
    return states, seen


def pieces(state: dict[str, Any]) -> list[str]:
    """Every piece reference a packer state holds, in any section, as JSON text (a stride key's
    reference holds a dict)."""
    listed = expand_references(state)
    span = [listed["span"]] if listed["span"] else []
    return sorted(json.dumps(ref) for ref in listed["open"] + listed["ready"] + span + listed["inherited"])


@given(st.integers(1, 60), st.integers(1, 60))
def test_old_consumers_are_dealt_out_in_contiguous_runs_that_differ_by_at_most_one(old: int, new: int) -> None:
    runs = [inherited_from(consumer, new, old) for consumer in range(new)]
    assert [i for run in runs for i in run] == list(range(old))
    assert max(map(len, runs)) - min(map(len, runs)) <= 1
    assert all(i * new // old == consumer for consumer, run in enumerate(runs) for i in run)


@pytest.mark.parametrize(("old", "new"), [(7, 3), (3, 7), (5, 5 - 1), (4, 1)])
def test_a_new_consumer_holds_exactly_the_pieces_of_the_old_buffers_it_inherits(old: int, new: int) -> None:
    docs = documents(160)
    states, seen = old_states(docs, old)
    for consumer in range(new):
        state = rescaled_state(build(consumer, new, docs), states)
        inherited = sorted(ref for i in inherited_from(consumer, new, old) for ref in pieces(states[i]))
        assert pieces(state) == inherited
        assert state["sections"] == [0, 0, 0, len(inherited)]
    for consumer in range(new):
        pipe = build(consumer, new, docs)
        restore(pipe, states)
        for row in pipe:
            seen.update(delivered(CHAIN, row))
    assert seen == expected(CHAIN, docs)


def test_old_buffers_not_inherited_are_never_read() -> None:
    """Old consumer 5's references are unreadable: only the new consumer that inherits its
    buffer notices; the others rescale as if nothing were wrong."""
    docs = documents(160)
    states, _ = old_states(docs, 7)
    damaged = copy.deepcopy(states)
    whole = damaged[5].get("base_progress", damaged[5])  # a state a few rows after a whole one keeps it
    whole["refs"]["data"] = "not base64!"
    whole["sections"] = "not counts"
    for consumer in range(3):
        pipe = build(consumer, 3, docs)
        if 5 in inherited_from(consumer, 3, 7):
            with pytest.raises(rs.StateError, match=r"Pack \(old consumer 5\)"):
                rescaled_state(pipe, damaged)
        else:
            assert rescaled_state(pipe, damaged) == rescaled_state(build(consumer, 3, docs), states)


def test_each_new_consumer_decodes_only_the_old_buffers_it_inherits(monkeypatch: pytest.MonkeyPatch) -> None:
    docs = documents(160)
    states, _ = old_states(docs, 7)
    decoded: list[int] = []
    real = rescale_module.listed

    def counting(state: dict[str, Any], path: str) -> dict[str, Any]:
        decoded.append(next(i for i, old in enumerate(states) if old == state))
        return real(state, path)

    monkeypatch.setattr(rescale_module, "listed", counting)
    pipelines = [build(consumer, 6, docs) for consumer in (2, 3)]  # one "rank" of two workers
    rescaled_states(pipelines, states)
    assert decoded == [*inherited_from(2, 6, 7), *inherited_from(3, 6, 7)] == [3, 4]


@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("dumps", [json.dumps, lambda state: orjson.dumps(state).decode()])
def test_states_given_as_json_text_rescale_the_same(batched: bool, dumps: Callable[[Any], str]) -> None:
    """The form a Loader state holds them in: each old worker's state as JSON text (written by
    orjson there, whose text is cut before it is parsed where no buffer of it is inherited)."""
    docs = documents(160)

    def built(consumer: int, consumers: int) -> rs.Node:
        pipe = build(consumer, consumers, docs)
        return pipe.batch(2) if batched else pipe

    states = []
    for consumer in range(7):
        pipe = built(consumer, 7)
        take_fraction(pipe, 0.1 + 0.1 * consumer)
        states.append(json.loads(json.dumps(pipe.get_state())))
    texts = [dumps(state) for state in states]
    assert (buffer_free_text(texts[0], int(batched)) is None) == (dumps is json.dumps)
    consumers = (4, 5)  # inheriting from old consumers 5 and 6 only
    expected_states = [rescaled_state(built(consumer, 6), states) for consumer in consumers]
    assert rescaled_states([built(consumer, 6) for consumer in consumers], texts) == expected_states
    with pytest.raises(rs.StateError, match="old consumer 3"):
        rescaled_states([built(0, 6)], [*texts[:3], "{not json", *texts[4:]])


def test_rescaled_states_of_the_previous_version_still_load_and_rescale_again() -> None:
    """States written by the previous version (``tests/data/states_rescaled_pieces.json``):
    5 old consumers rescaled to 3, each new state listing its inherited pieces one by one. They
    continue, and rescale again (to 2) part-way, delivering every token once."""
    docs = documents(SAVED["documents"])
    assert all("refs" not in state and state["inherited"] for state in SAVED["rescaled"])
    seen = Counter(SAVED["head"])
    states = []
    for consumer, state in enumerate(SAVED["rescaled"]):
        pipe = build(consumer, 3, docs)
        pipe.set_state(state)
        for row in take_fraction(pipe, 0.3):
            seen.update(delivered(CHAIN, row))
        states.append(json.loads(json.dumps(pipe.get_state())))
    for consumer in range(2):
        pipe = build(consumer, 2, docs)
        restore(pipe, states)
        for row in pipe:
            seen.update(delivered(CHAIN, row))
    assert seen == expected(CHAIN, docs)


def test_the_old_states_of_the_previous_version_rescale_with_whole_buffers() -> None:
    docs = documents(SAVED["documents"])
    seen = Counter(SAVED["head"])
    for consumer in range(3):
        pipe = build(consumer, 3, docs)
        restore(pipe, SAVED["old"])
        for row in pipe:
            seen.update(delivered(CHAIN, row))
    assert seen == expected(CHAIN, docs)
