"""A streaming packer whose states are taken often saves, between two whole states, the earlier
one and the log of what it did since (``resumable.pack._events``), and a restore replays that
log by planning alone. Checked with a state after every row, over every streaming strategy,
long documents (spans), payloads with a ``length_fn``, a mix, shard strides, a stream source,
rescaled (inherited) pieces and the epoch's end: every state restores exactly into a fresh
pipeline, which then saves the same states as the original; the log stands for the whole state
a packer would have saved (``resolved``); it stays bounded when no state is taken; and damaged
logs give only StateError, leaving the pipeline as it was."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import resumable as rs
from resumable.elastic import restore
from resumable.inspect import describe
from resumable.pack._buffered import listed, resolved
from resumable.pack._entries import BASE_PROGRESS, EVENTS, STATS
from resumable.pack._events import NEXT_RECORD
from resumable.pack.node import Pack
from tests.resume import plain, roundtrip

SEQ_LEN = 16
STREAMING = ["greedy", "first_fit", "best_fit", "bfd"]
LENGTHS = [(number * 7) % 23 + (45 if number % 13 == 0 else 0) for number in range(1, 121)]
DOCS = [
    {"id": number, "input_ids": list(range(number * 1000, number * 1000 + length)), "image": number % 3}
    for number, length in enumerate(LENGTHS, start=1)
]
Build = Callable[[], rs.Node[Any]]


def cost(record: dict[str, Any]) -> int:
    return len(record["input_ids"]) + int(record["image"])


def packed(upstream: rs.Node[Any], strategy: str, payloads: bool = False, buffer_size: int = 8) -> rs.Node[Any]:
    if not payloads:
        return upstream.pack(SEQ_LEN, strategy=strategy, buffer_size=buffer_size)
    return upstream.pack(
        SEQ_LEN,
        strategy=strategy,
        buffer_size=buffer_size,
        overlong="truncate",
        document_fields=["image"],
        length_fn=cost,
    )


def chain(kind: str, strategy: str) -> Build:
    """Pipelines over which the packer's log is replayed."""

    def build() -> rs.Node[Any]:
        if kind == "mix":
            halves = {"a": rs.from_list(DOCS[::2]).shuffle(1), "b": rs.from_list(DOCS[1::2]).shuffle(2)}
            return packed(rs.mix(halves, weights={"a": 0.6, "b": 0.4}, seed=5), strategy)
        source = rs.from_list(DOCS).shuffle(3)
        if kind == "shard":
            return packed(source.shard(rank=1, world_size=2).repeat(2), strategy)
        if kind == "payloads":
            return packed(source.filter(lambda record: record["id"] % 7 != 0), strategy, payloads=True)
        return packed(source, strategy, buffer_size=4 if kind == "small" else 8)

    return build


def pack_node(pipe: rs.Node[Any]) -> Pack:
    node: rs.Node[Any] | None = pipe
    while not isinstance(node, Pack):
        node = node.upstream if node is not None else None
        if node is None:
            raise AssertionError("no packer in the pipeline")
    return node


def pack_state(state: dict[str, Any]) -> dict[str, Any]:
    while state["kind"] != "Pack":
        state = state["upstream"]
    return state


def run(build: Build, rows: int, state: dict[str, Any] | None = None) -> tuple[list[Any], list[dict[str, Any]]]:
    """``rows`` rows across epochs (after restoring ``state``, if given), and the state (through
    JSON) after each."""
    pipe, items, states = build(), [], []
    if state is not None:
        pipe.set_state(state)
    while len(items) < rows:
        for row in pipe:
            items.append(plain(row))
            states.append(roundtrip(pipe.get_state()))
            if len(items) == rows:
                break
    return items, states


KINDS = ["plain", "small", "mix", "shard", "payloads"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("strategy", STREAMING)
def test_every_state_taken_row_by_row_restores_exactly_and_saves_the_same_states(kind: str, strategy: str) -> None:
    build = chain(kind, strategy)
    total = 150  # past the end of the first epoch (about 100 rows)
    items, states = run(build, total)
    logged = [i for i, state in enumerate(states) if EVENTS in pack_state(state)]
    assert len(logged) > total // 2, "states taken row by row should mostly be logs"
    assert any(EVENTS not in pack_state(state) for state in states[1:]), "the log is never rebased"
    if kind == "shard":  # a consumer reads its stride in order: most documents take one int
        assert any(code < NEXT_RECORD for i in logged for code in pack_state(states[i])[EVENTS])
    for at in sorted({0, 1, 2, len(states) // 3, len(states) // 2, len(states) - 2, *logged[::9]}):
        after, their_states = run(build, total - at - 1, states[at])
        assert after == items[at + 1 :], f"restored at row {at}"
        assert their_states == states[at + 1 :], f"states after the restore at row {at}"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("strategy", STREAMING)
def test_a_log_stands_for_the_whole_state_a_packer_saves_then(kind: str, strategy: str) -> None:
    """``resolved`` (what rescale and inspect read) of each logged state equals the whole progress
    of a twin packer that never took a state, at the same row."""
    build = chain(kind, strategy)
    pipe, twin = build(), build()
    checked = 0
    for _ in range(140):
        for each in (pipe, twin):
            if next(each, None) is None:
                each.next_epoch()
        state = pack_state(roundtrip(pipe.get_state()))
        whole = {**pack_state(roundtrip(twin.get_state())), **pack_node(twin)._rows.whole_progress()}
        if EVENTS in state:
            checked += 1
            ours, theirs = listed(resolved(state, "Pack"), "Pack"), listed(roundtrip(whole), "Pack")
            for key in ("open", "open_sizes", "ready", "ready_sizes", "span", "inherited", "exhausted", "reserved"):
                assert ours.get(key) == theirs.get(key), key
    assert checked > 50


def test_the_log_stays_bounded_when_no_state_is_taken() -> None:
    pipe = packed(rs.from_list(DOCS).shuffle(3).repeat(), "best_fit")
    pipe.get_state()  # a base, then never another state
    rows = pack_node(pipe)._rows
    for _ in range(3000):
        next(pipe)
        assert len(rows._events) <= rows._event_limit
    assert rows._base is None  # dropped: the next state is whole
    assert EVENTS not in pipe.get_state()


def test_a_log_restores_over_a_stream_fetching_its_records_at_once(tmp_path: Path) -> None:
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))

    def build() -> rs.Node[Any]:
        return packed(rs.jsonl_stream(str(path)), "best_fit")

    items, states = run(build, 60)
    logged = [i for i, state in enumerate(states) if EVENTS in pack_state(state)]
    assert logged
    for at in logged[::7]:
        pipe = build()
        pipe.set_state(states[at])
        assert pack_node(pipe)._rows._fetcher is None  # every buffered record fetched on restore
        after = [plain(row) for _, row in zip(range(60 - at - 1), pipe)]
        assert after == items[at + 1 :]


@pytest.mark.parametrize("strategy", STREAMING)
def test_logged_states_rescale_with_every_token_once(strategy: str) -> None:
    """Old consumers' states are logs; the new consumers inherit their buffers and, between
    them, deliver every token of the epoch exactly once."""

    def build(consumer: int, consumers: int) -> rs.Node[Any]:
        return packed(rs.from_list(DOCS).shuffle(3).shard(rank=consumer, world_size=consumers), strategy)

    seen: list[int] = []
    olds = []
    for consumer in range(3):
        pipe = build(consumer, 3)
        for index, row in enumerate(pipe):
            seen.extend(int(token) for token in row["input_ids"][row["input_ids"] >= 1000])
            state = roundtrip(pipe.get_state())
            if index >= 5 + 4 * consumer and EVENTS in pack_state(state):
                break
        olds.append(state)
    assert all(EVENTS in pack_state(old) for old in olds)
    for consumer in range(2):
        pipe = build(consumer, 2)
        restore(pipe, olds)
        for row in pipe:
            seen.extend(int(token) for token in row["input_ids"][row["input_ids"] >= 1000])
            pipe.get_state()
    everything = [token for doc in DOCS for token in doc["input_ids"]]
    assert sorted(seen) == sorted(everything)


def test_inspect_describes_a_logged_state_as_the_whole_one(tmp_path: Path) -> None:
    build = chain("plain", "best_fit")
    pipe, twin = build(), build()
    for _ in range(20):
        next(pipe)
        next(twin)
        state = pipe.get_state()
    assert EVENTS in pack_state(state)
    texts = []
    for name, saved in (("logged", state), ("whole", {**twin.get_state(), **pack_node(twin)._rows.whole_progress()})):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(saved))
        texts.append(next(line for line in describe(str(path)).splitlines() if "documents referenced" in line))
    assert texts[0] == texts[1]


def damaged(state: dict[str, Any], data: st.DataObject) -> dict[str, Any]:
    """A copy of a logged state with its log, origins or base damaged."""
    state = copy.deepcopy(state)
    own = pack_state(state)
    events = own[EVENTS]
    where = data.draw(st.sampled_from(["event", "cut", "extend", "origins", "base", "type", "stats"]))
    if where == "event" and events:
        events[data.draw(st.integers(0, len(events) - 1))] = data.draw(
            st.one_of(st.integers(-5, 10**6), st.just(2**64), st.booleans(), st.text(max_size=2), st.none())
        )
    elif where == "cut" and events:
        del events[data.draw(st.integers(0, len(events) - 1)) :]
    elif where == "extend":
        events.extend(data.draw(st.lists(st.integers(-4, 200), min_size=1, max_size=12)))
    elif where == "origins":
        own["event_origins"] = data.draw(st.sampled_from([[], [["a"]], "x", [[{"consumer": 0}]], [None]]))
    elif where == "base":
        base = own[BASE_PROGRESS]
        base.pop(data.draw(st.sampled_from(sorted(base))))
    elif where == "type":
        own[data.draw(st.sampled_from([EVENTS, BASE_PROGRESS, "event_origins"]))] = data.draw(
            st.sampled_from([None, 3, "text", {}])
        )
    else:
        own[STATS] = {"rows": -1}
    return state


LOGGED = {
    strategy: [state for state in run(chain("payloads", strategy), 60)[1] if EVENTS in pack_state(state)]
    for strategy in ("best_fit", "greedy")
}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), strategy=st.sampled_from(sorted(LOGGED)))
def test_a_damaged_log_is_a_state_error_and_leaves_the_pipeline_as_it_was(strategy: str, data: st.DataObject) -> None:
    states = LOGGED[strategy]
    state = damaged(data.draw(st.sampled_from(states)), data)
    pipe = chain("payloads", strategy)()
    for _ in range(data.draw(st.integers(0, 30))):
        next(pipe)
    before = json.dumps(pipe.get_state())
    try:
        pipe.set_state(state)
    except rs.StateError:
        assert json.dumps(pipe.get_state()) == before
        return
    try:  # a log that still parses may name pieces the records do not hold: found as they are fetched
        for _ in range(40):
            next(pipe)
    except StopIteration:
        pass
    except rs.StateError:
        pass


def test_a_state_taken_twice_at_one_row_is_the_same_and_a_value() -> None:
    pipe = chain("plain", "best_fit")()
    for _ in range(12):
        next(pipe)
        first = pipe.get_state()
    frozen = json.dumps(first)
    assert json.dumps(pipe.get_state()) == frozen
    next(pipe)
    pipe.get_state()
    assert json.dumps(first) == frozen


@pytest.mark.parametrize("inherited", [5, "x", [[1, 2]]])
def test_a_malformed_entry_is_a_state_error_over_a_stream_too(tmp_path: Path, inherited: Any) -> None:
    """A stream upstream fetches every buffered record as the state loads (not lazily), so the
    references are listed for that fetch before the rows are checked: a malformed list is still
    only a StateError, and the pipeline is left as it was."""
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    pipe = packed(rs.jsonl_stream(str(path)), "best_fit")
    for _ in range(5):
        next(pipe)
    state = listed(roundtrip(pipe.get_state()), "Pack")  # the packer is the outermost node
    state["inherited"] = inherited
    fresh = packed(rs.jsonl_stream(str(path)), "best_fit")
    before = json.dumps(fresh.get_state())
    with pytest.raises(rs.StateError):
        fresh.set_state(state)
    assert json.dumps(fresh.get_state()) == before
