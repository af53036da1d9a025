"""A streaming packer's references packed on arrival (``resumable.pack._refs``), attacked: drawn
sequences of pieces arriving and leaving (records near 2**63, new epochs, lengths of 1, starts
at multiples of ``seq_len`` and off them, mix origins) decode to what the table holds, and a
table that adopts a saved layout saves it again byte for byte; a restored packer saves the state
it was given, then what the original saves; states of the previous version load; a damaged
layout is a ``StateError`` that leaves the pipeline as it was."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import resumable as rs
from resumable.order.lcg import LEGACY_ROUNDS, ROUNDS_OPTION
from resumable.pack import expand_references
from resumable.pack._refs import RefTable, decode
from tests.test_elastic import documents

INT64_MAX = 2**63 - 1
SEQ_LEN = 16
SAVED = json.loads((Path(__file__).parent / "data" / "states_rescaled_pieces.json").read_text())

# A piece: (origin names, epoch, record, start, length), drawn around the edges of each field.
PIECES = st.tuples(
    st.sampled_from([(), ("web",), ("web", "code"), ('"upstream":',)]),
    st.one_of(st.integers(0, 3), st.integers(INT64_MAX - 3, INT64_MAX)),
    st.one_of(st.integers(0, 70), st.integers(2**62, 2**62 + 5), st.integers(INT64_MAX - 5, INT64_MAX)),
    st.one_of(st.integers(0, 5).map(lambda k: k * SEQ_LEN), st.integers(0, 100)),
    st.one_of(st.just(1), st.integers(1, 3 * SEQ_LEN)),
)
# Each step: a piece arrives (unless held), or the held piece at an index (modulo) leaves, or a state is saved.
STEPS = st.lists(st.one_of(PIECES, st.integers(0, 100), st.just("save")), max_size=40)


def reference(piece: tuple[Any, ...]) -> list[Any]:
    names, epoch, record, start, length = piece
    return [*names, epoch, record, start, start + length]


@given(STEPS)
def test_drawn_arrivals_and_departures_decode_to_what_is_held_and_adopted_layouts_save_the_same_bytes(
    steps: list[Any],
) -> None:
    table = RefTable(capacity=1)  # grows as it fills
    held: dict[int, list[Any]] = {}
    for step in [*steps, "save"]:
        if isinstance(step, tuple):
            ref = reference(step)
            if ref in held.values():  # a packer never holds one piece twice
                continue
            held[table.add(tuple(ref[:-2]), ref[-2], ref[-1])] = ref
        elif isinstance(step, int) and held:
            slot = sorted(held)[step % len(held)]
            table.release(slot)
            del held[slot]
        elif step == "save":
            slots = sorted(held, key=lambda slot: json.dumps(held[slot]))  # not in slot order
            encoding = table.encode(np.array(slots, dtype=np.intp))
            assert decode(json.loads(json.dumps(encoding)), "Pack", "refs") == [held[slot] for slot in slots]
            again = RefTable()
            again.adopt(encoding)
            refs = decode(encoding, "Pack", "refs")
            added = [again.add(tuple(ref[:-2]), ref[-2], ref[-1]) for ref in refs]
            assert again.encode(np.array(added, dtype=np.intp)) == encoding


def chain(strategy: str = "best_fit") -> rs.Node:
    """Three epochs of a packer over short documents: the next epoch's pieces arrive while the
    last epoch's are held, and split documents' tails start at multiples of ``seq_len``."""
    return rs.from_list(documents(40)).shuffle(3).shard(0, 1).repeat(3).pack(SEQ_LEN, strategy=strategy, buffer_size=5)


@pytest.mark.parametrize("strategy", ["greedy", "first_fit", "best_fit", "bfd"])
def test_a_restored_packer_saves_the_given_state_then_what_the_original_saves_across_epochs(strategy: str) -> None:
    if strategy == "bfd":

        def build() -> rs.Node:
            return (
                rs.from_list(documents(40))
                .shuffle(3)
                .shard(0, 1)
                .repeat(3)
                .pack(SEQ_LEN, strategy="bfd", buffer_size=5, overlong="truncate")
            )
    else:

        def build() -> rs.Node:
            return chain(strategy)

    original = build()
    states = [json.dumps(original.get_state())]
    for _ in original:
        states.append(json.dumps(original.get_state()))
    for k in range(0, len(states), 3):
        restored = build()
        restored.set_state(json.loads(states[k]))
        assert json.dumps(restored.get_state()) == states[k], f"restored at row {k}"
        for expected in states[k + 1 : k + 6]:
            next(restored)
            assert json.dumps(restored.get_state()) == expected


def test_states_taken_at_other_moments_hold_the_same_references() -> None:
    """The layout refits when a state is taken after a piece it cannot hold arrived, so two
    packers at the same row that took their earlier states at other rows may save other
    layouts (other bytes); they hold the same references, and continue the same."""
    every, sparse = chain(), chain()
    for row in range(60):
        next(every)
        every.get_state()
        next(sparse)
        if row % 7 == 6:
            sparse.get_state()
        assert expand_references(every.get_state()) == expand_references(sparse.get_state())
    assert [row["input_ids"].tolist() for row in every] == [row["input_ids"].tolist() for row in sparse]


def test_states_of_the_previous_version_load_and_save_the_same_references() -> None:
    """The previous version computed a layout per state (``old``) or listed each piece
    (``rescaled``): a packer restored from either saves the same pieces, a packed state byte for
    byte (its layout adopted; its shuffle now names the 4 rounds that version made), and once
    restored from what it saved, that byte for byte."""
    for old in SAVED["old"] + SAVED["rescaled"]:
        shard = old["upstream"]["upstream"]
        pipe = previous_chain(shard["rank"], shard["world_size"])
        pipe.set_state(copy.deepcopy(old))
        saved = pipe.get_state()
        if "refs" in old:
            as_before = copy.deepcopy(saved)
            assert as_before["upstream"]["upstream"]["upstream"].pop(ROUNDS_OPTION) == LEGACY_ROUNDS
            assert json.dumps(as_before) == json.dumps(old)
        listed, given = expand_references(saved), expand_references(old)
        for key in ("open", "ready", "span", "inherited"):
            assert listed[key] == given[key], key
        again = previous_chain(shard["rank"], shard["world_size"])
        again.set_state(json.loads(json.dumps(saved)))
        assert json.dumps(again.get_state()) == json.dumps(saved)


def previous_chain(consumer: int, consumers: int) -> rs.Node:
    from tests.test_pack_rescale import build

    return build(consumer, consumers, documents(SAVED["documents"]))


@pytest.mark.parametrize(
    "edit",
    [
        lambda refs: refs.update(base=[0, 0, INT64_MAX, 0, 1], bits=[0, 0, 1, 0, 0], data="AQ==", count=1),
        lambda refs: refs.update(scale=[1, 1, 0, 1, 1]),  # read every record as the base: was taken
        lambda refs: refs.update(bits=[0, 0, 65, 0, 0]),
        lambda refs: refs.update(base=[0, 0, -1, 0, 0]),
        lambda refs: refs.update(base=[0, 0, True, 0, 0]),
        lambda refs: refs.update(count=refs["count"] + 1),
        lambda refs: refs.update(origins=[[], [1]]),
        lambda refs: refs.update(data=refs["data"][:-4]),
        lambda refs: refs.update(data="@@@@"),
        lambda refs: refs.pop("bits"),
    ],
)
def test_a_damaged_layout_is_a_state_error_and_changes_nothing(edit: Any) -> None:
    pipe = chain()
    for _ in range(7):
        next(pipe)
    state = json.loads(json.dumps(pipe.get_state()))
    edit(state["refs"])
    fresh = chain()
    before = json.dumps(fresh.get_state())
    with pytest.raises(rs.StateError):
        fresh.set_state(state)
    assert json.dumps(fresh.get_state()) == before
    assert [row["input_ids"].tolist() for row in fresh] == [row["input_ids"].tolist() for row in chain()]
