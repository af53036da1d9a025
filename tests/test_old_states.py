"""States written by resumable 0.1.0 (``tests/data/states_0.1.0.json``, produced by that release
with the builders below) still load and continue exactly: a Loader state (format 1) is upgraded
to the current format, a pipeline state loads as it is."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import resumable as rs
import resumable.torch as rst
from tests.legacy_orders import legacy
from tests.resume import take

SAVED = json.loads((Path(__file__).parent / "data" / "states_0.1.0.json").read_text())


def build() -> rs.Node:
    """The pipeline 0.1.0 iterated: 5 batches were handed out before each Loader state."""
    return rs.from_list(list(range(60))).shuffle(seed=3).shard().filter(lambda x: x % 7 != 2).batch(4)


def packed() -> rs.Node:
    """The packer 0.1.0 iterated: 5 rows were handed out before its state."""
    return rs.from_list([{"input_ids": list(range(1, 2 + i % 9))} for i in range(40)]).shuffle(1).pack(8, buffer_size=4)


def batches(loader: Any) -> list[list[int]]:
    return [[int(x) for x in batch] for batch in loader]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_loader_state_of_0_1_0_continues_exactly(workers: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """It finishes its epoch in the order of 0.1.0, whose shuffle made 4 rounds (the state holds
    no ``rounds``); the next epoch is shuffled as this version shuffles it."""
    saved = SAVED[str(workers)]
    assert saved["state"]["format"] == "resumable.Loader/1"
    with rst.Loader(build, num_workers=workers) as reference:
        batches(reference)
        following = batches(reference)
    with monkeypatch.context() as patch:  # every epoch in 0.1.0's order (forked workers inherit it)
        legacy(patch)
        with rst.Loader(build, num_workers=workers) as reference:
            whole = batches(reference)
    assert whole[:5] == saved["head"]
    with rst.Loader(build, num_workers=workers) as loader:
        loader.load_state_dict(saved["state"])
        assert batches(loader) == whole[5:]
        assert batches(loader) == following
        assert loader.state_dict()["format"] == "resumable.Loader/3"


def test_a_pipeline_state_of_0_1_0_continues_exactly() -> None:
    """Packers then let a long document's whole rows leave at once, and one restored from such
    a state still does, so it continues with the rows the code of that time gave after it
    (``pipeline_rows``, recorded before whole rows waited beside the pieces)."""
    pipe = packed()
    pipe.set_state(SAVED["pipeline"])
    assert [row["input_ids"].tolist() for row in take(pipe, 12)] == SAVED["pipeline_rows"]
