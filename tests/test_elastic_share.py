"""Each new consumer saves only its share of a rescale level (the band positions of its own
stride), encoded: the shares of all consumers still merge into an exact partition at the next
rescale, a state of the previous format (the whole level, one cursor per old consumer) still
loads, and a damaged or foreign share is a StateError."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import resumable as rs
from resumable.elastic import rescaled_state
from resumable.errors import StateError
from resumable.order.elastic import (
    MAX_POSITION,
    Level,
    Offset,
    Remap,
    Share,
    decode_ints,
    encode_ints,
    merge,
    rescale,
    shard_sizes,
)


def saved(remap: Remap, consumer: int, consumers: int, cursor: int) -> Remap:
    """What consumer ``consumer`` of ``consumers`` at ``cursor`` saves of ``remap``, as the shard
    does: compacted past its cursor, through JSON."""
    first = consumer + max(cursor - 1, 0) * consumers
    return Remap.from_json(json.loads(json.dumps(remap.compacted(first).to_json())), "test")


@given(st.lists(st.integers(0, MAX_POSITION), max_size=200))
def test_integers_round_trip_through_text(values: list[int]) -> None:
    array = np.asarray(values, dtype=np.int64)
    text = encode_ints(array)
    assert text.isascii()
    assert decode_ints(text, len(values), "test").tolist() == values


@pytest.mark.parametrize(
    "text, count, match",
    [
        ("3:eJwDAAAAAAE=", 0, "byte width"),
        (12, 0, "byte width"),
        ("1:not base64!", 1, "do not decode"),
        (encode_ints(np.arange(5)), 4, "expected 4"),
        (encode_ints(np.arange(5)), 6, "expected 6"),
        ("1:eJwDAAAAAAE=", 10**9, "cannot hold"),
        (encode_ints(np.array([MAX_POSITION])).replace("8:", "1:"), 1, "expected 1"),
    ],
)
def test_damaged_integers_are_state_errors(text: Any, count: int, match: str) -> None:
    with pytest.raises(StateError, match=match):
        decode_ints(text, count, "test")


@settings(deadline=None)
@given(
    total=st.integers(0, 300),
    rescales=st.lists(st.tuples(st.integers(1, 13), st.lists(st.floats(0, 1), min_size=1)), min_size=1, max_size=5),
)
def test_shares_merge_into_an_exact_partition_after_each_rescale(
    total: int, rescales: list[tuple[int, list[float]]]
) -> None:
    """Consumers hold only their shares (compacted past their cursors) and read through them;
    the next rescale merges what they saved. Every position is read once over all rescales."""
    space, consumers = total, 1
    held: list[Remap] = []
    read: list[int] = []
    for new_consumers, fractions in rescales:
        sizes = shard_sizes(space, consumers)
        cursors = [int(size * fractions[c % len(fractions)]) for c, size in enumerate(sizes.tolist())]
        for consumer, cursor in enumerate(cursors):
            local = consumer + np.arange(cursor, dtype=np.int64) * consumers
            read.extend((held[consumer].to_base(local) if held else local).tolist())
        copies = [saved(remap, c, consumers, cursor) for c, (remap, cursor) in enumerate(zip(held, cursors))]
        remap = rescale(merge(copies, "test") if held else None, 0, space, cursors)
        space, consumers = remap.length, new_consumers
        held = [remap.share_for(c, consumers) for c in range(consumers)]
        left = []
        for consumer, share in enumerate(held):
            left.extend(share.to_base(np.arange(consumer, space, consumers, dtype=np.int64)).tolist())
        assert sorted(read + left) == list(range(total))


def test_a_share_keeps_its_own_band_positions_and_refuses_others() -> None:
    remap = rescale(None, 0, 1000, [30, 31, 29, 30])  # band of 4: positions of consumers 0, 2, 2, 3
    share = remap.share_for(1, 3)
    newest = share.steps[0]
    assert isinstance(newest, Share) and newest.keys.tolist() == [1]
    assert share.to_base(np.array([1, 4, 7])).tolist() == remap.to_base(np.array([1, 4, 7])).tolist()
    with pytest.raises(IndexError, match="band position 0"):
        share.to_base(np.array([0]))
    assert Remap.from_json(json.loads(json.dumps(share.to_json())), "test").to_json() == share.to_json()


def test_scale_shares_are_small() -> None:
    """4096 x 8 -> 3000 x 6 with cursors 64 apart: a new consumer's remap is under 1 kB where
    the whole level takes about 93 kB of JSON (2.85 bytes per old consumer)."""
    total, old, new = 10**10, 4096 * 8, 3000 * 6
    rng = np.random.default_rng(2026)
    sizes = shard_sizes(total, old)
    cursors = np.minimum(int(rng.integers(0, int(sizes.min()) - 64)) + rng.integers(0, 64, size=old), sizes)
    remap = rescale(None, 0, total, cursors.tolist())
    level = remap.steps[0]
    assert isinstance(level, Level)
    for consumer in (0, 1, new // 2, new - 1):
        share = remap.share_for(consumer, new)
        assert len(json.dumps(share.to_json())) < 1024
        stride = np.arange(consumer, min(remap.length, 50 * new), new, dtype=np.int64)
        assert (share.to_base(stride) == remap.to_base(stride)).all()
    # The whole level, encoded (as it is saved under a reading order), is a third of its JSON list.
    assert len(json.dumps(level.to_json())) < 40_000


def test_a_level_saved_whole_still_loads_and_merges_with_shares() -> None:
    """States of the previous format hold the whole level as a JSON list of distances."""
    remap = rescale(None, 2, 100, [9, 12, 10, 12])
    level = remap.steps[0]
    assert isinstance(level, Level)
    plain = {"epoch": 2, "length": remap.length, "steps": [level.to_json()]}
    assert isinstance(plain["steps"][0]["behind"], list)
    loaded = Remap.from_json(plain, "test")
    positions = np.arange(loaded.length, dtype=np.int64)
    assert (loaded.to_base(positions) == remap.to_base(positions)).all()
    merged = merge([loaded, remap.share_for(0, 3), remap.share_for(1, 3).compacted(10**6)], "test")
    assert isinstance(merged.steps[0], Level)
    foreign = rescale(None, 2, 100, [9, 12, 11, 12]).share_for(0, 3)
    with pytest.raises(StateError, match="different checkpoints"):
        merge([loaded, foreign], "test")


def test_shares_from_different_checkpoints_do_not_merge() -> None:
    one = rescale(None, 0, 100, [9, 12, 10, 12])
    other = rescale(None, 0, 100, [12, 9, 12, 10])
    with pytest.raises(StateError, match="different checkpoints"):
        merge([one.share_for(0, 2), other.share_for(1, 2)], "test")
    offset = Remap(0, one.length, (Offset(1),))
    with pytest.raises(StateError, match="different checkpoints"):
        merge([one.share_for(0, 2), offset], "test")


def pipeline(rank: int, world_size: int) -> rs.Node:
    return rs.from_list(list(range(97))).shuffle(5).shard(rank, world_size).batch(2)


def old_states(cursors: list[int]) -> list[dict[str, Any]]:
    states = []
    for consumer, batches in enumerate(cursors):
        pipe = pipeline(consumer, len(cursors))
        for _ in range(batches):
            next(pipe)
        states.append(pipe.get_state())
    return states


def test_a_rescaled_pipeline_continues_from_a_share_as_from_the_whole_level() -> None:
    olds = old_states([3, 5, 4, 5])
    state = rescaled_state(pipeline(1, 3), olds)
    remap = state["upstream"]["remap"]
    assert set(remap["steps"][0]) >= {"keys", "parents"}
    shared = pipeline(1, 3)
    shared.set_state(state)
    # The previous format: the whole level, as a JSON list.
    whole = rescale(None, 0, 97, [6, 10, 8, 10])
    state["upstream"]["remap"] = whole.to_json()
    plain = pipeline(1, 3)
    plain.set_state(state)
    assert list(shared) == list(plain)


def test_another_consumers_share_is_a_state_error() -> None:
    olds = old_states([3, 5, 4, 5])
    mine = rescaled_state(pipeline(1, 3), olds)
    theirs = rescaled_state(pipeline(0, 3), olds)
    mine["upstream"]["remap"] = theirs["upstream"]["remap"]
    with pytest.raises(StateError, match="another consumer's share"):
        pipeline(1, 3).set_state(mine)


@pytest.mark.parametrize(
    "damage",
    [
        lambda step: step.update(count=step["count"] + 1),
        lambda step: step.update(band=0),
        lambda step: step.update(lowest=step["top"] + 1),
        lambda step: step.update(keys=encode_ints(np.array([50] * step["count"]))),
        lambda step: step.update(parents=encode_ints(np.array([10**6] * step["count"]))),
        lambda step: step.update(parents="8:AAAA"),
    ],
)
def test_damaged_shares_are_state_errors(damage: Any) -> None:
    olds = old_states([3, 5, 4, 5])
    state = rescaled_state(pipeline(1, 3), olds)
    damage(state["upstream"]["remap"]["steps"][0])
    with pytest.raises(StateError):
        pipeline(1, 3).set_state(state)
