"""rs.torch.Loader: exact resume over DataLoader workers, prefetching and epochs."""

from __future__ import annotations

import functools
import json
from typing import Any

import numpy as np
import pytest

import resumable as rs
from resumable.torch import Loader, PipelineDataset

EPOCHS = 2


def build(seed: int = 5) -> rs.Node:
    return (
        rs.from_list(list(range(97)))
        .shuffle(seed=seed)
        .shard()
        .map(lambda x: x * 3)
        .filter(lambda x: x % 7 != 0)
        .batch(4, collate_fn=np.array)
    )


def as_lists(batch: Any) -> list[int]:
    return [int(x) for x in batch]


def train(loader: Loader, stop_after: int | None = None, resumed: bool = False) -> tuple[list[Any], dict | None]:
    """A training loop over EPOCHS epochs: (epoch, batch) pairs, and the state after
    ``stop_after`` batches (taken inside the loop, as a trainer checkpoints)."""
    seen: list[Any] = []
    first_epoch = loader.epoch if resumed else 0
    for epoch in range(first_epoch, EPOCHS):
        for batch in loader:
            seen.append((epoch, as_lists(batch)))
            if stop_after is not None and len(seen) == stop_after:
                return seen, json.loads(json.dumps(loader.state_dict()))
    return seen, None


def make(config: dict) -> Loader:
    return Loader(build, **config)


CONFIGS = [
    {"num_workers": 0},
    {"num_workers": 1, "prefetch_factor": 1},
    {"num_workers": 2, "prefetch_factor": 4},
    {"num_workers": 2, "prefetch_factor": 1, "persistent_workers": True},
    {"num_workers": 3, "prefetch_factor": 4, "persistent_workers": True},
    {"num_workers": 3, "prefetch_factor": 1},
    {"num_workers": 2, "prefetch_factor": 2, "snapshot_every_n_steps": 1},
    {"num_workers": 2, "prefetch_factor": 2, "snapshot_every_n_steps": 4},
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_resume_matches_uninterrupted_run_at_many_steps(config: dict) -> None:
    expected, _ = train(make(config))
    per_epoch = sum(1 for epoch, _ in expected if epoch == 0)
    assert sorted(x for epoch, b in expected if epoch == 0 for x in b) == [x * 3 for x in range(97) if x * 3 % 7]
    assert [b for e, b in expected if e == 0] != [b for e, b in expected if e == 1]  # reshuffled
    for k in (1, per_epoch // 2, per_epoch, per_epoch + 1, len(expected) - 1):
        head, state = train(make(config), stop_after=k)
        resumed_loader = make(config)
        resumed_loader.load_state_dict(state)
        tail, _ = train(resumed_loader, resumed=True)
        assert head + tail == expected, f"resumed after {k} batches"


def test_restoring_twice_in_a_row() -> None:
    config = {"num_workers": 2, "prefetch_factor": 2}
    expected, _ = train(make(config))
    head, state = train(make(config), stop_after=5)
    second = make(config)
    second.load_state_dict(state)
    middle, state2 = train(second, stop_after=7, resumed=True)
    third = make(config)
    third.load_state_dict(state2)
    tail, _ = train(third, resumed=True)
    assert head + middle + tail == expected


def test_state_taken_between_epochs_starts_the_next_epoch() -> None:
    config = {"num_workers": 2}
    expected, _ = train(make(config))
    loader = make(config)
    first = [(0, as_lists(b)) for b in loader]
    state = loader.state_dict()
    resumed = make(config)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    second = [(1, as_lists(b)) for b in resumed]
    assert first + second == expected
    assert resumed.epoch == 1


def test_state_is_json_and_holds_every_worker() -> None:
    loader = make({"num_workers": 3})
    iterator = iter(loader)
    next(iterator)
    state = loader.state_dict()
    assert json.loads(json.dumps(state)) == state
    workers = state["loader"]["_snapshot"]["_worker_snapshots"]
    assert sorted(workers) == ["worker_0", "worker_1", "worker_2"]
    assert state["num_workers"] == 3 and state["world_size"] == 1 and state["epoch"] == 0


def test_state_before_iterating_and_after_loading_round_trips() -> None:
    loader = make({"num_workers": 2})
    initial = loader.state_dict()
    fresh = make({"num_workers": 2})
    fresh.load_state_dict(initial)
    assert fresh.state_dict()["loader"] == initial["loader"]
    assert [as_lists(b) for b in fresh] == [as_lists(b) for b in make({"num_workers": 2})]


def test_other_topology_is_a_state_error() -> None:
    loader = make({"num_workers": 2})
    next(iter(loader))
    state = loader.state_dict()
    with pytest.raises(rs.StateError, match="saved with num_workers=2, this loader has num_workers=3"):
        make({"num_workers": 3}).load_state_dict(state)
    with pytest.raises(rs.StateError, match="not a resumable Loader state"):
        make({"num_workers": 2}).load_state_dict(state["loader"])
    bad = json.loads(json.dumps(state))
    bad["world_size"] = 4
    with pytest.raises(rs.StateError, match="saved with world_size=4"):
        make({"num_workers": 2}).load_state_dict(bad)


def test_dataset_adapter_with_a_plain_dataloader_and_set_epoch() -> None:
    from torch.utils.data import DataLoader

    dataset = PipelineDataset(lambda: rs.from_list(list(range(20))).shuffle(1).shard())
    loader = DataLoader(dataset, batch_size=None, num_workers=2)
    epoch0 = sorted(int(x) for x in loader)
    first_order = [int(x) for x in loader]
    dataset.set_epoch(1)
    second_order = [int(x) for x in loader]
    assert epoch0 == list(range(20)) and sorted(second_order) == list(range(20))
    assert first_order != second_order


def test_invalid_arguments() -> None:
    with pytest.raises(rs.ConfigError, match="num_workers must be a non-negative int"):
        Loader(build, num_workers=-1)
    with pytest.raises(rs.ConfigError, match="expected a pipeline or a function"):
        PipelineDataset(3)  # type: ignore[arg-type]


def test_state_of_another_pipeline_is_a_state_error_naming_the_node() -> None:
    for num_workers in (0, 2):
        loader = make({"num_workers": num_workers, "snapshot_every_n_steps": 1})
        iterator = iter(loader)
        next(iterator)
        state = loader.state_dict()
        wrong = Loader(functools.partial(build, seed=6), num_workers=num_workers)
        wrong.load_state_dict(state)
        message = "Batch > Filter > IndexedMap > Shard > Shuffle: state was saved with seed=5, this pipeline has seed=6"
        with pytest.raises(rs.StateError, match=message):
            next(iter(wrong))


@pytest.mark.parametrize("persistent_workers", [False, True])
def test_close_stops_the_workers_and_the_next_iter_continues(persistent_workers: bool) -> None:
    config = {"num_workers": 2, "persistent_workers": persistent_workers}
    expected, _ = train(make(config))
    with make(config) as loader:
        iterator = iter(loader)
        head = [(0, as_lists(next(iterator))) for _ in range(6)]
        workers = list(iterator._workers)
        loader.close()
        assert not any(worker.is_alive() for worker in workers)
        loader.close()  # closing twice is harmless
        tail, _ = train(loader, resumed=True)
    assert head + tail == expected
