"""A packer's restore maps no record: planning needs only each buffered piece's cost (its token
range, and with a ``length_fn`` the positions saved under ``reserved``), so ``set_state`` fetches
nothing and each record is fetched again when its row is handed out. Checked for every streaming
strategy, with and without payloads, over a parallel map, a prefetch and DataLoader workers;
states saved before ``reserved`` existed still restore exactly, by fetching every record at once."""

from __future__ import annotations

import copy
import json
import pickle
from typing import Any

import numpy as np
import pytest

import resumable as rs
import resumable.torch as rst
from resumable.elastic import restore
from tests.resume import check_resume, scribble, take

SEQ_LEN = 16
BUFFER = 6
STREAMING = ["greedy", "first_fit", "best_fit", "bfd"]
LENGTHS = [(number * 7) % 23 + (40 if number % 11 == 0 else 0) for number in range(1, 81)]
DOCS = [
    {"id": number, "input_ids": list(range(number * 1000, number * 1000 + length)), "image": number % 4}
    for number, length in enumerate(LENGTHS, start=1)
]

calls = [0]  # map calls in this process


def counted(record: dict[str, Any]) -> dict[str, Any]:
    """The map before the packer, counting its calls (a tokenizer in a real pipeline)."""
    calls[0] += 1
    ids = record["input_ids"]
    return {**record, "mask": [token % 2 for token in ids]}


def cost(record: dict[str, Any]) -> int:
    """Tokens plus positions reserved for an image."""
    return len(record["input_ids"]) + int(record["image"])


def as_lists(row: dict[str, Any]) -> dict[str, Any]:
    return {name: value.tolist() if isinstance(value, np.ndarray) else value for name, value in row.items()}


def pack(upstream: rs.Node[Any], strategy: str, payloads: bool) -> rs.Node[Any]:
    if not payloads:
        return upstream.pack(SEQ_LEN, strategy=strategy, buffer_size=BUFFER)
    return upstream.pack(
        SEQ_LEN,
        strategy=strategy,
        buffer_size=BUFFER,
        overlong="truncate",
        token_fields=["mask"],
        document_fields=["image"],
        length_fn=cost,
    )


def build(strategy: str, payloads: bool, chain: str = "map") -> rs.Node[Any]:
    pipe: rs.Node[Any] = rs.from_list(DOCS).shuffle(3)
    if chain == "parallel_map":
        pipe = pipe.filter(lambda record: record["id"] % 5 != 0).map(counted, num_workers=2)
    elif chain == "prefetch":
        pipe = pipe.map(counted).prefetch(3)
    else:
        pipe = pipe.map(counted)
    return pack(pipe, strategy, payloads).map(as_lists)


@pytest.mark.parametrize("payloads", [False, True])
@pytest.mark.parametrize("strategy", STREAMING)
def test_set_state_maps_no_record_and_the_rows_continue_exactly(strategy: str, payloads: bool) -> None:
    total = len(list(build(strategy, payloads)))
    for k in (1, total // 3, total // 2, total - 2):
        pipe = build(strategy, payloads)
        head = take(pipe, k)
        state = json.loads(json.dumps(pipe.get_state()))
        assert ("reserved" in state["upstream"]) == payloads
        expected = take(pipe, total)
        fresh = build(strategy, payloads)
        calls[0] = 0
        fresh.set_state(state)
        assert calls[0] == 0, "set_state mapped records"
        assert head + take(fresh, total) == head + expected


@pytest.mark.parametrize("payloads", [False, True])
@pytest.mark.parametrize("strategy", STREAMING)
def test_a_restored_packer_pickles_and_its_copy_continues_exactly(strategy: str, payloads: bool) -> None:
    """A restored packer holds its lazy pieces' refetcher (what a spawned DataLoader worker, or a
    pickled pipeline under a prefetch that read ahead, carries): it pickles, and the copy's rows
    are the original's."""
    pipe = build(strategy, payloads)
    take(pipe, 3)
    fresh = build(strategy, payloads)
    fresh.set_state(pipe.get_state())
    copied = pickle.loads(pickle.dumps(fresh))
    assert take(copied, 6) == take(fresh, 6) == take(pipe, 6)


@pytest.mark.parametrize("strategy", STREAMING)
def test_a_state_the_caller_edits_after_set_state_changes_nothing(strategy: str) -> None:
    """The restored packer's later states build on what it loaded, not on the caller's dict."""
    pipe = build(strategy, True)
    take(pipe, 4)
    state = pipe.get_state()
    control, edited = build(strategy, True), build(strategy, True)
    control.set_state(copy.deepcopy(state))
    mine = copy.deepcopy(state)
    edited.set_state(mine)
    scribble(mine)
    assert take(edited, 5) == take(control, 5)
    assert edited.get_state() == control.get_state()
    again = build(strategy, True)
    again.set_state(edited.get_state())
    assert take(again, 5) == take(control, 5)


@pytest.mark.parametrize("chain", ["parallel_map", "prefetch"])
@pytest.mark.parametrize("strategy", ["first_fit", "best_fit"])
def test_over_a_parallel_map_and_a_prefetch(chain: str, strategy: str) -> None:
    for payloads in (False, True):
        total = len(list(build(strategy, payloads, chain)))
        for k in (2, total // 2, total - 1):
            check_resume(lambda: build(strategy, payloads, chain), k, total)


@pytest.mark.parametrize("strategy", STREAMING)
def test_a_state_saved_before_reserved_existed_restores_exactly_by_fetching_its_records(strategy: str) -> None:
    """A payload state without ``reserved`` (the form before it existed) cannot plan without the
    records' costs: it fetches every buffered record in set_state, as the code of that time did."""
    pipe = build(strategy, True)
    take(pipe, 5)
    state = json.loads(json.dumps(pipe.get_state()))
    del state["upstream"]["reserved"]
    pending = len(pipe.upstream.pending_keys())  # type: ignore[attr-defined]  # the upstream is the Pack
    expected = take(pipe, 40)
    fresh = build(strategy, True)
    calls[0] = 0
    fresh.set_state(state)
    assert calls[0] == pending
    assert take(fresh, 40) == expected


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda state: state.update(reserved=[0]), "'reserved' must hold"),
        (lambda state: state["reserved"].__setitem__(0, -1), "'reserved' must hold"),
        (lambda state: state["reserved"].__setitem__(0, SEQ_LEN * 3 + 1), "longer than seq_len|do not fit"),
    ],
)
def test_a_bad_reserved_entry_is_a_state_error(change: Any, message: str) -> None:
    pipe = build("best_fit", True)
    take(pipe, 5)
    state = json.loads(json.dumps(pipe.get_state()))
    change(state["upstream"])
    with pytest.raises(rs.StateError, match=message):
        build("best_fit", True).set_state(state)


def test_a_reserved_count_that_differs_from_the_record_is_a_state_error_when_its_row_is_due() -> None:
    pipe = build("first_fit", True)
    take(pipe, 5)
    saved = json.loads(json.dumps(pipe.get_state()))
    tried = 0
    for entry in reversed(range(len(saved["upstream"]["reserved"]))):
        state = json.loads(json.dumps(saved))
        reserved = state["upstream"]["reserved"]
        reserved[entry] = 0 if reserved[entry] else 1
        fresh = build("first_fit", True)
        try:  # a count that no piece's shape contradicts loads; the record tells, when due
            fresh.set_state(state)
        except rs.StateError:
            continue
        tried += 1
        with pytest.raises(rs.StateError, match="did the data change"):
            take(fresh, 100)
    assert tried


def rescaled_build(consumer: int, consumers: int) -> rs.Node[Any]:
    return pack(rs.from_list(DOCS).shuffle(7).shard(consumer, consumers).map(counted), "best_fit", True)


def test_a_rescale_deals_the_reserved_positions_with_the_pieces() -> None:
    old = [rescaled_build(consumer, 3) for consumer in range(3)]
    rows = [next(pipe) for pipe, steps in zip(old, [1, 3, 2]) for _ in range(steps)]
    states = [json.loads(json.dumps(pipe.get_state())) for pipe in old]
    for consumer in range(2):
        pipe = rescaled_build(consumer, 2)
        calls[0] = 0
        restore(pipe, states)
        assert calls[0] == 0, "a rescaled restore mapped records"
        rows.extend(pipe)
    kept = {
        doc["id"]: min(len(doc["input_ids"]), SEQ_LEN - doc["image"])
        for doc in DOCS
        if doc["input_ids"] and doc["image"] < SEQ_LEN
    }
    assert tokens_by_document(rows) == kept, "every kept token once, after the rescale"


def tokens_by_document(rows: list[dict[str, Any]]) -> dict[int, int]:
    """Tokens of each document over ``rows`` (every document's first token names it)."""
    tokens: dict[int, int] = {}
    for row in rows:
        ids, documents = np.asarray(row["input_ids"]), np.asarray(row["document_ids"])
        for document in range(1, int(documents.max(initial=0)) + 1):
            segment = ids[documents == document]
            number = int(segment[0]) // 1000
            tokens[number] = tokens.get(number, 0) + int((segment >= number * 1000).sum())
    return tokens


def loader_build() -> rs.Node[Any]:
    return pack(rs.from_list(DOCS).shuffle(3).shard().map(counted), "best_fit", True).batch(2)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_loader_restores_in_its_workers_exactly(workers: int) -> None:
    def text(batch: list[dict[str, Any]]) -> str:
        return json.dumps([as_lists(row) for row in batch], default=str)

    with rst.Loader(loader_build, num_workers=workers, collate_fn=list) as loader:
        whole, state = [], None
        for batch in loader:
            whole.append(text(batch))
            if len(whole) == 4:
                state = loader.state_dict()
    with rst.Loader(loader_build, num_workers=workers, collate_fn=list) as loader:
        loader.load_state_dict(state)
        assert [text(batch) for batch in loader] == whole[4:]
