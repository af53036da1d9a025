"""rs.torch.Loader states that pass field by field but cannot be continued: more batches since
the snapshot than the workers hold, worker states grafted from another epoch, counters at the
end of the range a state can hold. Each is a StateError, and the loader is left as it was."""

from __future__ import annotations

import json
import multiprocessing
from typing import Any

import pytest

import resumable as rs
from resumable.loader_state import MAX_COUNT
from resumable.torch import Loader
from tests.test_loader import as_lists, batches, small, states_along_three_epochs, with_entry

WORKERS = ("loader", "_snapshot", "_worker_snapshots")
PASS_EPOCH = ("fetcher_state", "dataset_iter_state", "epoch")
IN_RANGE = f"an int in \\[0, {MAX_COUNT}\\]"


def state_after(config: dict, taken: int) -> dict[str, Any]:
    loader = Loader(small, **config)
    iterator = iter(loader)
    for _ in range(taken):
        next(iterator)
    state = json.loads(json.dumps(loader.state_dict()))
    loader.close()
    return state


@pytest.mark.parametrize("persistent_workers", [False, True])
def test_more_batches_since_the_snapshot_than_the_workers_hold_is_a_state_error(persistent_workers: bool) -> None:
    config = {"num_workers": 2, "persistent_workers": persistent_workers}
    expected = batches(Loader(small, **config))
    assert len(expected) == 8  # two workers, four batches each
    at_the_end = state_after(config, 8)
    counts = at_the_end["loader"]
    assert (counts["_snapshot"]["_snapshot_step"], counts["_steps_since_snapshot"]) == (8, 0)
    # As an earlier version, which snapshotted every 4 batches, could have saved it.
    bad = with_entry(with_entry(at_the_end, ("snapshot_every_n_steps",), 4), ("loader", "_steps_since_snapshot"), 3)
    children = set(multiprocessing.active_children())
    loader = Loader(small, **config)
    loader.load_state_dict(bad)
    message = (
        "Loader rank 0/1 at loader: the state counts more batches than its workers hold "
        "\\(state entry '_steps_since_snapshot' is 3, but the workers' snapshot at batch 8 is followed by fewer\\)"
    )
    for _ in range(2):  # the loaded state stays as it was: the same error again
        with pytest.raises(rs.StateError, match=message):
            for _ in loader:
                pass
        assert loader.state_dict() == bad
        assert set(multiprocessing.active_children()) <= children, "the half-started workers are stopped"
    loader.load_state_dict(state_after(config, 3))
    assert batches(loader) == expected[3:]


def grafted(envelope: dict[str, Any], inner: dict[str, Any]) -> dict[str, Any]:
    """``envelope`` with the torchdata part (every worker's pipeline state) of ``inner``."""
    return dict(json.loads(json.dumps(envelope)), loader=json.loads(json.dumps(inner["loader"])))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_worker_states_grafted_from_another_epoch_are_a_state_error(num_workers: int) -> None:
    config = {"num_workers": num_workers}
    reference = Loader(small, **config)
    expected = [batches(reference) for _ in range(3)]
    states = states_along_three_epochs(config, {(0, 2), (2, 2)})
    epoch_0, epoch_2 = states[0, 2], states[2, 2]
    where = (
        "Loader rank 0/1 at loader.fetcher_state.dataset_iter_state"
        if num_workers == 0
        else "Loader rank 0/1 worker 0 at loader._snapshot._worker_snapshots.worker_0.fetcher_state.dataset_iter_state"
    )
    loader = Loader(small, **config)
    loader.load_state_dict(epoch_0)
    for bad, saved, envelope in ((grafted(epoch_0, epoch_2), 2, 0), (grafted(epoch_2, epoch_0), 0, 2)):
        message = f"{where}: state entry 'epoch' is {saved}, expected {envelope}: this pipeline state comes from a pass"
        with pytest.raises(rs.StateError, match=message):
            loader.load_state_dict(bad)
        with pytest.raises(rs.StateError, match=message.replace("Loader rank", "Loader \\(old rank 0\\) rank")):
            loader.load_state_dict([bad])
        with pytest.raises(rs.StateError, match=message.replace("Loader rank", "Loader \\(old rank 0\\) rank")):
            Loader(small, num_workers=1 if num_workers else 3).load_state_dict([bad])  # another topology
    assert loader.state_dict() == epoch_0
    assert batches(loader) == expected[0][2:]
    assert (batches(loader), loader.epoch) == (expected[1], 1)


def test_a_loader_going_back_to_an_epoch_it_already_started_gets_that_epoch() -> None:
    """Without workers the main process iterates: loading a state that continues with an
    epoch this process had already started must start that epoch, not the one after it."""
    reference = Loader(small)
    expected = [batches(reference) for _ in range(3)]
    loader = Loader(small)
    assert batches(loader) == expected[0]
    ended = json.loads(json.dumps(loader.state_dict()))
    iterator = iter(loader)
    next(iterator)
    loader.load_state_dict(ended)
    assert (batches(loader), loader.epoch) == (expected[1], 1)
    again = Loader(small)
    again.load_state_dict(json.loads(json.dumps(loader.state_dict())))
    assert batches(again) == expected[2]


def test_an_elastic_restore_into_a_process_that_started_the_epoch_is_exact() -> None:
    old = Loader(small, num_workers=2)
    iterator = iter(old)
    head = [as_lists(next(iterator)) for _ in range(3)]
    state = json.loads(json.dumps(old.state_dict()))
    old.close()
    loader = Loader(small)
    next(iter(loader))  # this process has started epoch 0 already
    loader.load_state_dict([state])
    iterator = iter(loader)
    middle = [as_lists(next(iterator))]
    resumed = Loader(small)
    resumed.load_state_dict(json.loads(json.dumps(loader.state_dict())))  # its own state loads again
    rest = middle + batches(resumed)
    assert sorted(x for batch in head + rest for x in batch) == list(range(20))


def at_epoch(state: dict[str, Any], epoch: int) -> dict[str, Any]:
    """``state`` moved to ``epoch``: the envelope and every worker's pass."""
    state = with_entry(state, ("epoch",), epoch)
    if state["num_workers"] == 0:
        return with_entry(state, ("loader", *PASS_EPOCH), epoch)
    for worker in state["loader"]["_snapshot"]["_worker_snapshots"]:
        state = with_entry(state, (*WORKERS, worker, *PASS_EPOCH), epoch)
    return state


@pytest.mark.parametrize("num_workers", [0, 2])
def test_epochs_stay_in_the_range_a_state_can_hold(num_workers: int) -> None:
    config = {"num_workers": num_workers}
    expected = batches(Loader(small, **config))
    mid_epoch = state_after(config, 2)
    loader = Loader(small, **config)
    for epoch in (MAX_COUNT + 1, 2**63 - 1):
        with pytest.raises(rs.StateError, match=f"state entry 'epoch' is {epoch}, expected {IN_RANGE}"):
            loader.load_state_dict(at_epoch(mid_epoch, epoch))
    last = at_epoch(mid_epoch, MAX_COUNT)
    loader.load_state_dict(last)
    assert (batches(loader), loader.epoch) == (expected[2:], MAX_COUNT)
    ended = loader.state_dict()
    last_one = f"epoch {MAX_COUNT:,} is the last one a Loader state can count"
    with pytest.raises(rs.StateError, match=last_one):
        iter(loader)
    assert loader.state_dict() == ended
    again = Loader(small, **config)
    again.load_state_dict(ended)
    with pytest.raises(rs.StateError, match=last_one):
        iter(again)
    other = Loader(small, num_workers=1 if num_workers == 0 else 0)
    other.load_state_dict([ended])  # on another topology, state_dict() itself starts the next epoch
    for attempt in (Loader.state_dict, iter):
        with pytest.raises(rs.StateError, match=last_one):
            attempt(other)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_batch_counts_stay_in_the_range_a_state_can_hold(num_workers: int) -> None:
    config = {"num_workers": num_workers}
    expected = batches(Loader(small, **config))
    state = state_after(config, 2)
    if num_workers:
        counters = [("loader", "_snapshot", "_snapshot_step")]
        counters_of_requests = [("loader", "_snapshot", "_main_snapshot", "_sampler_iter_yielded")]
    else:
        counters = [("loader", "_num_yielded"), ("loader", "_sampler_iter_yielded")]
        counters_of_requests = []
    loader = Loader(small, **config)
    for path in counters + counters_of_requests:
        with pytest.raises(rs.StateError, match=f"'{path[-1]}' is {MAX_COUNT + 1}, expected {IN_RANGE}"):
            loader.load_state_dict(with_entry(state, path, MAX_COUNT + 1))
    near_the_end = state
    for path in counters:
        near_the_end = with_entry(near_the_end, path, MAX_COUNT - 1)
    loader.load_state_dict(near_the_end)
    iterator = iter(loader)
    assert as_lists(next(iterator)) == expected[2]
    with pytest.raises(rs.StateError, match=f"{MAX_COUNT:,} batches handed out in this pass, the most a state can"):
        next(iterator)
    last = loader.state_dict()
    handed_out = last["loader"]["_snapshot"]["_snapshot_step"] if num_workers else last["loader"]["_num_yielded"]
    assert handed_out == MAX_COUNT
    loader.close()  # takes its own state and loads it again
    Loader(small, **config).load_state_dict(last)
    for path in counters_of_requests:  # torchdata asks workers for batches ahead: that count is held too
        requested = with_entry(state, path, MAX_COUNT)
        loader.load_state_dict(requested)
        with pytest.raises(rs.StateError, match=f"{MAX_COUNT:,} batches requested in this pass, the most a state can"):
            iter(loader)
        assert loader.state_dict() == requested
