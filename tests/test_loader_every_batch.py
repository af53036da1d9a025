"""rs.torch.Loader hands a state out with every batch: it resumes exactly at any batch, and a
restore replays nothing (the map runs once per record handed out, plus what workers prefetch)."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import resumable as rs
from resumable.loader_state import parse_loader_state
from resumable.pack import collate_rows
from resumable.torch import Loader

RECORDS = 60
BATCH = 4


def record_call(log: Path, x: int) -> int:
    """The map: appends the record to ``log`` (one line per call, from whichever process)."""
    with open(log, "a") as handle:
        handle.write(f"{os.getpid()} {x}\n")
    return x


def build(log: Path) -> rs.Node:
    return rs.from_list(list(range(RECORDS))).shuffle(3).shard().map(functools.partial(record_call, log)).batch(BATCH)


def as_lists(batch: Any) -> list[int]:
    return [int(x) for x in np.asarray(batch)]


def calls(log: Path) -> list[int]:
    return [int(line.split()[1]) for line in log.read_text().splitlines()] if log.exists() else []


CONFIGS = [
    {"num_workers": 0},
    {"num_workers": 2},
    {"num_workers": 2, "persistent_workers": True},
]
POINTS = ["start", "middle", "last batch", "after end"]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("point", POINTS)
def test_a_state_at_any_batch_resumes_exactly_with_nothing_since_its_snapshot(
    tmp_path: Path, config: dict, point: str
) -> None:
    log = tmp_path / "calls.txt"
    uninterrupted = Loader(functools.partial(build, log), **config)
    expected = [as_lists(batch) for batch in uninterrupted]
    next_epoch = [as_lists(batch) for batch in uninterrupted]
    loader = Loader(functools.partial(build, log), **config)
    iterator = iter(loader)
    stop = {"start": 0, "middle": len(expected) // 2, "last batch": len(expected)}.get(point)
    head = [as_lists(next(iterator)) for _ in range(len(expected) if stop is None else stop)]
    if stop is None:
        assert next(iterator, None) is None  # the epoch has ended
    state = json.loads(json.dumps(loader.state_dict()))
    if config["num_workers"]:
        assert state["loader"]["_steps_since_snapshot"] == 0
        assert state["loader"]["_snapshot"]["_snapshot_step"] == len(head)
    loader.close()

    resumed = Loader(functools.partial(build, log), **config)
    resumed.load_state_dict(state)
    rest = [as_lists(batch) for batch in resumed]
    if stop is None:
        assert rest == next_epoch  # a state taken after the epoch ended starts the next one
        assert resumed.epoch == 1
    else:
        assert head + rest == expected
        assert resumed.epoch == 0


@pytest.mark.parametrize("config", CONFIGS[1:], ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_a_restore_replays_nothing(tmp_path: Path, config: dict) -> None:
    """Restored mid-epoch with prefetch_factor=1, the workers map only the records after the
    last batch handed out: no record of a batch handed out before the state is mapped again."""
    log = tmp_path / "calls.txt"
    config = {**config, "prefetch_factor": 1}
    loader = Loader(functools.partial(build, log), **config)
    iterator = iter(loader)
    head = [as_lists(next(iterator)) for _ in range(7)]
    state = loader.state_dict()
    loader.close()
    log.unlink()

    resumed = Loader(functools.partial(build, log), **config)
    resumed.load_state_dict(state)
    rest = [as_lists(batch) for batch in resumed]
    handed_out = {x for batch in head for x in batch}
    assert handed_out.isdisjoint(calls(log)), "a record handed out before the state was mapped again"
    assert sorted(calls(log)) == sorted(x for batch in rest for x in batch)
    assert sorted(handed_out | {x for batch in rest for x in batch}) == list(range(RECORDS))


def packed_documents() -> list[dict[str, list[int]]]:
    """Lengths from 1 to 40 tokens at seq_len 16: pieces, split tails, whole rows and spans."""
    lengths = [(7 * i) % 41 + 1 for i in range(RECORDS)]
    return [{"input_ids": list(range(100 * i, 100 * i + length))} for i, length in enumerate(lengths)]


def build_packed() -> rs.Node:
    return (
        rs.from_list(packed_documents())
        .shuffle(5)
        .shard()
        .pack(16, strategy="best_fit", buffer_size=6)
        .batch(2, collate_fn=collate_rows)
    )


def packed_steps(loader: Loader, count: int | None = None) -> list[tuple[list[list[int]], list[dict[str, Any]]]]:
    """Each batch's rows and, taken right after it, every worker's pipeline state."""
    steps = []
    for batch in loader:
        state = parse_loader_state(json.loads(json.dumps(loader.state_dict())))
        steps.append((batch["input_ids"].tolist(), state.pipelines))
        if count is not None and len(steps) == count:
            break
    return steps


@pytest.mark.parametrize("workers", [0, 2])
def test_a_packer_with_a_state_at_every_batch_resumes_exactly_and_saves_the_same_states(workers: int) -> None:
    """A packer's state taken with every batch: resumed at any batch, the Loader gives the same
    batches and, after each, the same worker states as the uninterrupted one, byte for byte
    (the restored packer keeps the saved layout of its references)."""
    with Loader(build_packed, num_workers=workers) as uninterrupted:
        expected = packed_steps(uninterrupted)
    assert len(expected) > 6, "the scenario needs several batches"
    for stop in (1, len(expected) // 2, len(expected) - 1):
        with Loader(build_packed, num_workers=workers) as loader:
            packed_steps(loader, stop)
            state = json.loads(json.dumps(loader.state_dict()))
        with Loader(build_packed, num_workers=workers) as resumed:
            resumed.load_state_dict(state)
            assert packed_steps(resumed) == expected[stop:]


def without_seed(state: dict[str, Any]) -> dict[str, Any]:
    """A torchdata state without its per-iterator random ``_base_seed`` (the pipelines here use none)."""
    state = json.loads(json.dumps(state))
    del state["_snapshot"]["_main_snapshot"]["_base_seed"]
    return state


def uneven(records: int) -> rs.Node:
    return rs.from_list(list(range(records))).shuffle(5).shard().map(lambda x: x * 2).batch(3)


def double_batch(batch: list[int]) -> list[int]:
    """A collate_fn, applied to each batch in the workers."""
    return [2 * x for x in batch]


@pytest.mark.parametrize(
    "workers, persistent, records",
    [(1, True, 20), (2, False, 37), (2, True, 37), (3, False, 2)],
    ids=["1-persistent", "2", "2-persistent", "3-one-empty"],
)
def test_the_states_that_ride_with_the_batches_are_torchdata_s_own_snapshots(
    workers: int, persistent: bool, records: int
) -> None:
    """The Loader's workers hand each batch over with its state instead of torchdata's
    per-batch snapshot traffic; its state is still what a StatefulDataLoader snapshotting every
    batch holds, after every batch, as workers run out at different points, at the end of a
    pass and in the next one."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    from resumable.torch import PipelineDataset

    build = functools.partial(uneven, records)
    config = {"num_workers": workers, "persistent_workers": persistent, "prefetch_factor": 2}
    config["collate_fn"] = double_batch
    reference = StatefulDataLoader(PipelineDataset(build), batch_size=None, snapshot_every_n_steps=1, **config)
    ours = Loader(build, **config)
    for epoch in range(2):
        reference.dataset.set_epoch(epoch)
        theirs, mine = iter(reference), iter(ours)
        assert without_seed(ours.state_dict()["loader"]) == without_seed(reference.state_dict())
        handed_out = 0
        for expected in theirs:
            batch = [int(x) for x in next(mine)]
            assert batch == [int(x) for x in expected] and all(x % 4 == 0 for x in batch)  # collate_fn applied
            handed_out += 1
            assert without_seed(ours.state_dict()["loader"]) == without_seed(reference.state_dict()), handed_out
        with pytest.raises(StopIteration):
            next(mine)
        assert without_seed(ours.state_dict()["loader"]) == without_seed(reference.state_dict())
        assert handed_out >= records // 3
    ours.close()


def test_only_the_loader_s_own_workers_hand_states_over_with_their_batches() -> None:
    """The same PipelineDataset object, given to a Loader and then to a plain DataLoader:
    the plain one's workers, which the Loader's worker_init_fn never ran in, yield plain batches."""
    from torch.utils.data import DataLoader

    from resumable.torch import PipelineDataset

    dataset = PipelineDataset(functools.partial(uneven, 12))
    with Loader(dataset, num_workers=2) as loader:
        through_loader = sorted(int(x) for batch in loader for x in batch)
    plain = [batch for batch in DataLoader(dataset, batch_size=None, num_workers=2)]
    assert all(type(batch).__name__ != "BatchWithState" for batch in plain)
    assert sorted(int(x) for batch in plain for x in batch) == through_loader == [2 * x for x in range(12)]


@pytest.mark.parametrize("persistent", [False, True], ids=["fresh", "persistent"])
def test_a_restored_state_s_seeds_are_in_every_state_after_it_as_in_torchdata_s(persistent: bool) -> None:
    """The main snapshot's entries but the sampler count are read once per pass; a restore sets
    them anew (the loaded ``_base_seed``), and every state after it holds them, entry for entry
    as a StatefulDataLoader snapshotting every batch restored from the same state."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    from resumable.torch import PipelineDataset

    build = functools.partial(uneven, 37)
    config = {"num_workers": 2, "persistent_workers": persistent, "prefetch_factor": 2}
    first = Loader(build, **config)
    iterator = iter(first)
    next(iterator), next(iterator)
    state = json.loads(json.dumps(first.state_dict()))
    first.close()
    state["loader"]["_snapshot"]["_main_snapshot"]["_base_seed"] = 12345
    reference = StatefulDataLoader(PipelineDataset(build), batch_size=None, snapshot_every_n_steps=1, **config)
    reference.load_state_dict(state["loader"])
    resumed = Loader(build, **config)
    resumed.load_state_dict(state)
    handed_out = 0
    for expected, batch in zip(reference, resumed, strict=True):
        assert [int(x) for x in batch] == [int(x) for x in expected]
        handed_out += 1
        assert resumed.state_dict()["loader"] == reference.state_dict(), handed_out
        assert resumed.state_dict()["loader"]["_snapshot"]["_main_snapshot"]["_base_seed"] == 12345
    assert handed_out == 37 // 3 + 1 - 2
    resumed.close()


@pytest.mark.parametrize("persistent", [False, True], ids=["fresh", "persistent"])
def test_each_state_dict_call_is_a_new_state_with_the_pass_s_header(persistent: bool) -> None:
    """``state_dict()`` per step returns the state built as the batch arrived: each call a new
    outer dict and a new torchdata part (the snapshot shared between the calls of one step, as
    torchdata shares its own), so what a caller adds or changes in one is in no later state;
    each pass's states hold that pass's epoch, and the state after a pass says it ended."""
    loader = Loader(functools.partial(uneven, 20), num_workers=2, persistent_workers=persistent, prefetch_factor=2)
    for epoch in range(3):
        handed_out = 0
        for _ in loader:
            handed_out += 1
            first, second = loader.state_dict(), loader.state_dict()
            assert first == second and first is not second and first["loader"] is not second["loader"]
            first["epoch"], first["loader"]["_steps_since_snapshot"], first["extra"] = 99, 7, 1
            taken = loader.state_dict()
            assert taken == second
            assert parse_loader_state(taken).epoch == epoch
            assert parse_loader_state(taken).handed_out == handed_out and not parse_loader_state(taken).finished
        ended = parse_loader_state(loader.state_dict())
        assert ended.finished and ended.epoch == epoch and ended.handed_out == handed_out == 8  # 2 x ceil(10 / 3)
    loader.close()


def test_a_batch_interrupted_before_torchdata_counts_it_is_not_in_the_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C after the Loader recorded a batch's state but before torchdata counted the batch
    as handed out (it never reached the loop): the state is the one before it, and a Loader
    restored from it hands that batch out next."""
    from torchdata.stateful_dataloader.stateful_dataloader import _StatefulMultiProcessingDataLoaderIter

    build = functools.partial(uneven, 30)
    reference = [as_lists(batch) for batch in Loader(build, num_workers=2)]
    loader = Loader(build, num_workers=2, prefetch_factor=2)
    iterator = iter(loader)
    got = [as_lists(next(iterator)) for _ in range(3)]
    before = loader.state_dict()
    process_data = _StatefulMultiProcessingDataLoaderIter._process_data

    def interrupted(self: Any, *args: Any) -> Any:
        monkeypatch.setattr(_StatefulMultiProcessingDataLoaderIter, "_process_data", process_data)
        raise KeyboardInterrupt

    monkeypatch.setattr(_StatefulMultiProcessingDataLoaderIter, "_process_data", interrupted)
    with pytest.raises(KeyboardInterrupt):
        next(iterator)
    assert loader.state_dict() == before
    loader.close()
    resumed = Loader(build, num_workers=2)
    resumed.load_state_dict(before)
    assert got + [as_lists(batch) for batch in resumed] == reference
