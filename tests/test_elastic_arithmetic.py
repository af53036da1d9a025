"""The re-split arithmetic of resumable.order.elastic: what is left is partitioned exactly, across
several rescales in a row, at the scale of a large job, with a state that stays small."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from resumable.errors import StateError
from resumable.order.elastic import Level, Offset, Remap, rescale, shard_sizes
from resumable.order.partition import shard_size


def consumed_positions(remap: Remap | None, consumers: int, cursors: list[int]) -> list[int]:
    """Epoch positions read by consumers at ``cursors`` in the newest space of ``remap``."""
    read = []
    for consumer, cursor in enumerate(cursors):
        local = consumer + np.arange(cursor, dtype=np.int64) * consumers
        read.extend((remap.to_base(local) if remap is not None else local).tolist())
    return read


@settings(deadline=None)
@given(
    total=st.integers(0, 300),
    rescales=st.lists(st.tuples(st.integers(1, 13), st.lists(st.floats(0, 1), min_size=1)), min_size=1, max_size=5),
)
def test_what_is_left_is_an_exact_partition_after_each_rescale(
    total: int, rescales: list[tuple[int, list[float]]]
) -> None:
    remap: Remap | None = None
    space = total
    read: list[int] = []
    for consumers, fractions in rescales:
        sizes = shard_sizes(space, consumers)
        cursors = [int(size * fractions[c % len(fractions)]) for c, size in enumerate(sizes.tolist())]
        read += consumed_positions(remap, consumers, cursors)
        remap = rescale(remap, 0, space, cursors)
        space = remap.length
        left = remap.to_base(np.arange(space, dtype=np.int64)).tolist()
        assert sorted(read + left) == list(range(total))
        assert Remap.from_json(json.loads(json.dumps(remap.to_json())), "test").to_json() == remap.to_json()


def test_levels_compact_once_every_consumer_has_passed_the_band() -> None:
    first = rescale(None, 3, 1000, [30, 31, 29, 30])  # 4 consumers, a ragged band of 1 + 2 + 1 positions
    assert isinstance(first.steps[0], Level) and first.steps[0].band == 4
    # 5 new consumers; one is still inside the band: the level stays.
    kept = rescale(first, 3, first.length, [0, 5, 5, 5, 5])
    assert [type(step) for step in kept.steps] == [Level, Level]
    # All passed the band (their positions 0..3 hold it): the old level becomes one integer.
    passed = rescale(first, 3, first.length, [5, 5, 5, 5, 5])
    assert passed.to_json()["steps"] == [{"shift": 5 * 5 + (31 * 4 - 4)}]


def test_bad_cursors_and_mismatched_remaps_are_state_errors() -> None:
    with pytest.raises(StateError, match="consumer 1 of 2 is at position 6, its shard has 5"):
        rescale(None, 0, 10, [5, 6])
    remap = rescale(None, 0, 10, [2, 1])
    with pytest.raises(StateError, match="does not fit"):
        rescale(remap, 1, remap.length, [0])
    with pytest.raises(StateError, match="not a level or an offset"):
        Remap.from_json({"epoch": 0, "length": 3, "steps": [{"shift": "x"}]}, "Shard")


def test_scale_simulation_ten_billion_documents() -> None:
    """4096 ranks x 8 workers stop at a random point of an epoch of 10^10 documents and resume
    on 3000 x 6. Checked by arithmetic and by sampling, without materialising the epoch."""
    total, old, new = 10**10, 4096 * 8, 3000 * 6
    rng = np.random.default_rng(2026)
    sizes = shard_sizes(total, old)
    base = int(rng.integers(0, int(sizes.min()) - 64))
    cursors = np.minimum(base + rng.integers(0, 64, size=old), sizes)  # workers drift by a few batches
    remap = rescale(None, 0, total, cursors.tolist())
    level = remap.steps[0]
    assert isinstance(level, Level)

    # Counting: what is left is exactly what was not read.
    assert remap.length == total - int(cursors.sum())
    # The band, exhaustively: each unread position below the fastest cursor appears once.
    band = level.to_parent(np.arange(level.band, dtype=np.int64))
    consumer, stride = band % old, band // old
    assert len(np.unique(band)) == level.band
    assert (stride >= cursors[consumer]).all() and (stride < level.top).all()
    assert level.band == int((level.top - cursors).sum())
    # The tail, by sampling: positions map past the fastest cursor, in order, to the end.
    sample = np.sort(rng.integers(level.band, remap.length, size=100_000))
    mapped = remap.to_base(sample)
    assert (mapped >= level.top * old).all() and (mapped < total).all()
    assert (np.diff(mapped) == np.diff(sample)).all()
    assert int(remap.to_base(np.array([remap.length - 1]))[0]) == total - 1

    # New shards differ by at most one document.
    new_sizes = [shard_size(remap.length, c, new) for c in (0, 1, new // 2, new - 1)]
    assert max(new_sizes) - min(new_sizes) <= 1
    # The whole level, as planned (saved only under a reading order), encoded: about a byte
    # per old consumer; each new consumer saves only its share of it (test_elastic_share.py).
    whole = len(json.dumps(remap.to_json(), separators=(",", ":")))
    assert whole < 2 * old
    assert len(json.dumps(remap.share_for(new - 1, new).to_json())) < 1024
    # Every new consumer passes the band after a few documents: the next rescale compacts it.
    new_cursors = [shard_size(remap.length, c, new) // 2 for c in range(new)]
    again = rescale(remap, 0, remap.length, new_cursors)
    assert len(again.steps) <= 2 and all(isinstance(step, Offset) for step in again.steps[1:])


@given(
    st.integers(1, 400),
    st.lists(st.lists(st.integers(0, 30), min_size=1, max_size=6), min_size=1, max_size=4),
    st.integers(0, 10**6),
)
def test_past_its_tail_start_a_remap_is_a_shift(length: int, rescales: list[list[int]], first: int) -> None:
    """``Remap.tail_shift``: every position from ``start`` on maps to itself plus ``shift``, the
    arithmetic that names the positions past the bands by stride keys; compacting keeps it."""
    remap = None
    for drawn in rescales:
        space = length if remap is None else remap.length
        sizes = shard_sizes(space, len(drawn))
        remap = rescale(remap, 0, space, [min(c, int(s)) for c, s in zip(drawn, sizes)])
    assert remap is not None
    tail = remap.tail_shift()
    assert tail is not None
    start, shift = tail
    positions = np.arange(min(start, remap.length), remap.length, dtype=np.int64)
    assert np.array_equal(remap.to_base(positions), positions + shift)
    compacted = remap.compacted(min(first, remap.length))
    kept = positions[positions >= compacted.first]
    assert compacted.tail_shift() is not None
    assert np.array_equal(compacted.to_base(kept), kept + shift)
