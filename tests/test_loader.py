"""rs.torch.Loader: exact resume over DataLoader workers, prefetching and epochs."""

from __future__ import annotations

import functools
import gc
import json
import warnings
from typing import Any

import numpy as np
import pytest

import resumable as rs
import resumable.torch as rst
from resumable.torch import Loader, PipelineDataset, _torchdata
from resumable.torch.dataset import CollateBatch
from tests.processes import as_rank

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
    {"num_workers": 2, "prefetch_factor": 2},
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
    with pytest.raises(rs.ConfigError, match="num_workers must be a non-negative int, got -1"):
        Loader(build, num_workers=-1)
    for every in (0, None, 2.0, True):
        with pytest.raises(rs.ConfigError, match="snapshot_every_n_steps must be an int >= 1"):
            Loader(build, num_workers=2, snapshot_every_n_steps=every)  # type: ignore[arg-type]  # deliberately wrong, to test the check
    with pytest.raises(rs.ConfigError, match="expected a pipeline or a function"):
        PipelineDataset(3)  # type: ignore[arg-type]  # deliberately wrong, to test the check


def test_state_of_another_pipeline_is_a_state_error_naming_the_node() -> None:
    for num_workers in (0, 2):
        loader = make({"num_workers": num_workers})
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
        for worker in workers:  # torch joins each for 5 s, then terminates it: give that time to take effect
            worker.join(timeout=10)
        assert not any(worker.is_alive() for worker in workers)
        loader.close()  # closing twice is harmless
        tail, _ = train(loader, resumed=True)
    assert head + tail == expected


def exit_codes(workers: list[Any]) -> list[int | None]:
    """Each worker's exit code once it has stopped: 0 if it took the shutdown request, -SIGTERM
    if torch had to terminate it (torch joins each for 5 s first: give that time to take effect)."""
    for worker in workers:
        worker.join(timeout=20)
    return [worker.exitcode for worker in workers]


def failure_kept_with_a_live_loader(config: dict) -> tuple[RuntimeError, list[Any], int]:
    """A training loop that fails mid-epoch and keeps its error in a local: the error's
    traceback holds the loop's frame, which holds the error and the loader, a reference cycle
    only the cyclic garbage collector frees. Returns the error, the loader's workers and the
    id of its iterator."""
    loader = make(config)
    iterator = iter(loader)
    next(iterator)
    workers = list(iterator._workers)
    try:
        raise RuntimeError("the training step failed")
    except RuntimeError as error:
        failure = error
    return failure, workers, id(iterator)


@pytest.mark.parametrize("persistent_workers", [False, True])
def test_a_loader_freed_by_the_cyclic_collector_stops_its_workers_without_killing_them(
    persistent_workers: bool,
) -> None:
    failure, workers, iterator = failure_kept_with_a_live_loader(
        {"num_workers": 2, "persistent_workers": persistent_workers}
    )
    assert all(worker.is_alive() for worker in workers)
    assert iterator in _torchdata._QUEUES_OF_LIVE_ITERATORS
    del failure
    gc.collect()
    assert iterator not in _torchdata._QUEUES_OF_LIVE_ITERATORS  # released with the workers
    assert exit_codes(workers) == [0, 0]


def fail_at_50(x: int) -> int:
    if x == 50:
        raise ValueError("record 50 is broken")
    return x


def failing() -> rs.Node:
    return rs.from_list(list(range(97))).shard().map(fail_at_50).batch(4, collate_fn=np.array)


def test_a_loader_whose_worker_raised_stops_its_workers_without_killing_them_when_collected() -> None:
    """torch raises a worker's error again from a frame that holds it (a cycle), so the
    iterator, whose frames the traceback passed through, is left to the cyclic collector."""
    loader = Loader(failing, num_workers=2)
    iterator = iter(loader)
    workers = list(iterator._workers)
    with pytest.raises(ValueError, match="record 50 is broken"):
        for _ in iterator:
            pass
    assert all(worker.is_alive() for worker in workers)
    del loader, iterator
    gc.collect()
    assert exit_codes(workers) == [0, 0]


def test_an_iterator_s_queues_are_released_when_its_workers_stop() -> None:
    for config in ({"num_workers": 2}, {"num_workers": 2, "persistent_workers": True}):
        loader = make(config)
        for _ in range(2):  # each pass's iterator, or the persistent one across passes
            for _ in loader:
                assert id(_torchdata.current_iterator(loader)) in _torchdata._QUEUES_OF_LIVE_ITERATORS
        iterator = id(_torchdata.current_iterator(loader))
        assert (iterator in _torchdata._QUEUES_OF_LIVE_ITERATORS) is bool(config.get("persistent_workers"))
        loader.close()
        assert iterator not in _torchdata._QUEUES_OF_LIVE_ITERATORS


def small() -> rs.Node:
    return rs.from_list(list(range(20))).shuffle(1).shard().batch(3)


def batches(loader: Loader) -> list[list[int]]:
    return [as_lists(batch) for batch in loader]


def states_along_three_epochs(config: dict, points: set[tuple[int, int]]) -> dict[tuple[int, int | str], dict]:
    """States taken at (epoch, batches handed out in it) for each point, and at (epoch, "ended")
    once the epoch's iterator has raised StopIteration."""
    loader = Loader(small, **config)
    states: dict[tuple[int, int | str], dict] = {}
    for epoch in range(3):
        iterator = iter(loader)
        taken = 0
        while True:
            if (epoch, taken) in points:
                states[epoch, taken] = json.loads(json.dumps(loader.state_dict()))
            try:
                next(iterator)
            except StopIteration:
                break
            taken += 1
        states[epoch, "ended"] = json.loads(json.dumps(loader.state_dict()))
    return states


SMALL_CONFIGS = [
    {"num_workers": 0},
    {"num_workers": 1},
    {"num_workers": 2},
    {"num_workers": 2, "persistent_workers": True},
]


@pytest.mark.parametrize("config", SMALL_CONFIGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_state_at_any_point_of_an_epoch_or_after_it_resumes_the_right_epoch(config: dict) -> None:
    reference = Loader(small, **config)
    expected = [batches(reference) for _ in range(5)]
    assert len({json.dumps(epoch) for epoch in expected}) == 5  # a new order every epoch
    per_epoch = len(expected[0])
    points = {(epoch, taken) for epoch in (0, 1) for taken in (0, 1, per_epoch - 1, per_epoch)} | {(2, 1)}
    for (epoch, taken), state in states_along_three_epochs(config, points).items():
        resumed = Loader(small, **config)
        resumed.load_state_dict(state)
        if taken == "ended":  # the next iter() is the next epoch, then the one after
            assert [batches(resumed), batches(resumed)] == expected[epoch + 1 : epoch + 3], f"ended {epoch}"
            assert resumed.epoch == epoch + 2
        else:  # the rest of the epoch, then the next one
            assert batches(resumed) == expected[epoch][taken:], f"epoch {epoch} after {taken}"
            assert batches(resumed) == expected[epoch + 1], f"epoch after {epoch}, {taken}"
            assert resumed.epoch == epoch + 1


@pytest.mark.parametrize("config", SMALL_CONFIGS[:4], ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_state_taken_after_loading_and_before_iterating_is_the_loaded_one(config: dict) -> None:
    reference = Loader(small, **config)
    expected = [batches(reference) for _ in range(2)]
    states = states_along_three_epochs(config, {(0, 2)})
    for point, rest in (((0, 2), expected[0][2:]), ((0, "ended"), expected[1])):
        loaded = Loader(small, **config)
        loaded.load_state_dict(states[point])
        assert loaded.state_dict() == states[point]
        again = Loader(small, **config)
        again.load_state_dict(loaded.state_dict())
        assert batches(again) == rest
        assert batches(loaded) == rest


def test_state_key_names_are_torchdata_s() -> None:
    from torchdata.stateful_dataloader import incremental_state
    from torchdata.stateful_dataloader import stateful_dataloader as torchdata_loader

    import resumable.loader_state as keys

    multi = torchdata_loader._StatefulMultiProcessingDataLoaderIter
    assert (keys.ITERATOR_FINISHED, keys.SAMPLER_ITER_YIELDED, keys.LEN_CALLED, keys.SHARED_SEED) == (
        torchdata_loader._ITERATOR_FINISHED,
        torchdata_loader._SAMPLER_ITER_YIELDED,
        torchdata_loader._ITERABLEDATASET_LEN_CALLED,
        torchdata_loader._SHARED_SEED,
    )
    assert keys.NUM_YIELDED == torchdata_loader._StatefulSingleProcessDataLoaderIter._NUM_YIELDED
    assert (
        keys.SNAPSHOT,
        keys.SNAPSHOT_STEP,
        keys.LAST_YIELDED,
        keys.MAIN_SNAPSHOT,
        keys.WORKER_SNAPSHOTS,
        keys.STEPS_SINCE,
        keys.MAIN_NUM_WORKERS,
        keys.BASE_SEED,
    ) == (
        multi._SNAPSHOT,
        multi._SNAPSHOT_STEP,
        multi._LAST_YIELDED_WORKER_ID,
        multi._MAIN_SNAPSHOT,
        multi._WORKER_SNAPSHOTS,
        multi._STEPS_SINCE_SNAPSHOT,
        multi._NUM_WORKERS,
        multi._BASE_SEED,
    )
    assert multi._worker_key(None, 3) == f"{keys.WORKER_PREFIX}3"  # type: ignore[arg-type]  # torchdata's private helper takes None
    assert (keys.WORKER_ID, keys.FETCHER_STATE, keys.FETCHER_ENDED, keys.DATASET_STATE, keys.ITER_STATE) == (
        incremental_state._WORKER_ID,
        incremental_state._FETCHER_STATE,
        incremental_state._FETCHER_ENDED,
        incremental_state._DATASET_STATE,
        incremental_state._DATASET_ITER_STATE,
    )


def with_entry(state: dict, path: tuple[str, ...], value: Any) -> dict:
    """A copy of ``state`` with the entry at ``path`` set to ``value`` (deleted for ``DELETE``)."""
    copied = json.loads(json.dumps(state))
    holder = copied
    for key in path[:-1]:
        holder = holder[key]
    if value is DELETE:
        del holder[path[-1]]
    else:
        holder[path[-1]] = value
    return copied


DELETE = object()
WORKER_1 = ("loader", "_snapshot", "_worker_snapshots", "worker_1")
ENCODED = ("fetcher_state", "dataset_iter_state", "pipeline")
PASS_EPOCH = ("fetcher_state", "dataset_iter_state", "epoch")


def corruptions(state: dict) -> list[tuple[tuple[str, ...], Any, str]]:
    """(path, value, message) for the broken states the tester reported, and their siblings."""
    common = [
        (("format",), "resumable.Loader/99", "not a resumable Loader state"),
        (("format",), "resumable.Other/1", "not a resumable Loader state"),
        (("num_workers",), -1, "rank 0/1: state entry 'num_workers' is -1, expected an int in"),
        (("epoch",), "1", "rank 0/1: state entry 'epoch' is '1', expected int"),
        (("rank",), 1, "state entry 'rank' is 1, expected 0"),
        (("snapshot_every_n_steps",), 0, "'snapshot_every_n_steps' is 0, expected an int in \\[1, 10000\\]"),
        (("snapshot_every_n_steps",), 10**18, "'snapshot_every_n_steps' is 10{18}, expected an int in \\[1, 10000\\]"),
        (("loader", "_iterator_finished"), DELETE, "at loader: state has no '_iterator_finished' entry"),
    ]
    if state["num_workers"] == 0:
        encoded = state["loader"][ENCODED[0]][ENCODED[1]][ENCODED[2]]
        return common + [
            (("loader", *ENCODED), encoded[: len(encoded) // 2], "rank 0/1 at loader: the pipeline state is not valid"),
            (("loader", "_num_yielded"), -3, "'_num_yielded' is -3"),
            (("loader", "fetcher_state"), None, "'fetcher_state' is None, expected dict"),
            (("loader", "_shared_seed"), 10**30, "'_shared_seed' is 10{30}"),
            (("loader", *PASS_EPOCH), "0", "at loader.fetcher_state.dataset_iter_state: state entry 'epoch' is '0'"),
            (("num_workers",), 10**12, "at loader: state has no '_steps_since_snapshot' entry"),
        ]
    encoded = state["loader"]["_snapshot"]["_worker_snapshots"]["worker_1"][ENCODED[0]][ENCODED[1]][ENCODED[2]]
    return common + [
        ((*WORKER_1, *ENCODED), encoded[:-7], f"rank 0/1 worker 1 at {'.'.join(WORKER_1)}: the pipeline state is not"),
        (("loader", "_snapshot"), DELETE, "rank 0/1 at loader: state has no '_snapshot' entry"),
        (
            ("loader", "_steps_since_snapshot"),
            10**30,
            "'_steps_since_snapshot' is 10{30}, expected 0",
        ),
        (("loader", "_snapshot", "_last_yielded_worker_id"), 10**30, "'_last_yielded_worker_id' is 10{30}"),
        (("loader", "_snapshot", "_last_yielded_worker_id"), -1, "'_last_yielded_worker_id' is -1"),
        (
            ("loader", "_snapshot", "_worker_snapshots", "worker_2"),
            {},
            "holds \\['worker_0', 'worker_1', 'worker_2'\\], expected worker_0 to worker_1 for num_workers=2",
        ),
        ((*WORKER_1, "worker_id"), 0, "worker 1 .*'worker_id' is 0, expected 1"),
        (("num_workers",), 10**12, "'_num_workers' is 2, expected 1000000000000"),
        (("loader", "_snapshot", "_main_snapshot", "_num_workers"), 3, "'_num_workers' is 3, expected 2"),
        (("loader", "_snapshot", "_main_snapshot", "_base_seed"), 2**64, "'_base_seed' is 18446744073709551616"),
        ((*WORKER_1, "dataset_state"), {"x": 1}, "worker 1 .*'dataset_state' is not null"),
        ((*WORKER_1, *PASS_EPOCH), DELETE, "worker 1 .*dataset_iter_state: state has no 'epoch' entry"),
        ((*WORKER_1, *PASS_EPOCH), 1, "worker 1 .*dataset_iter_state: state entry 'epoch' is 1, expected 0"),
    ]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_corrupt_states_are_state_errors_naming_the_field_and_change_nothing(num_workers: int) -> None:
    config = {"num_workers": num_workers}
    expected = batches(Loader(small, **config))
    old = Loader(small, **config)
    iterator = iter(old)
    for _ in range(5):
        next(iterator)
    state = json.loads(json.dumps(old.state_dict()))

    loader = Loader(small, **config)
    iterator = iter(loader)
    head = [as_lists(next(iterator)) for _ in range(2)]
    before = loader.state_dict()
    for path, value, message in corruptions(state):
        bad = with_entry(state, path, value)
        with pytest.raises(rs.StateError, match=message):
            loader.load_state_dict(bad)
        with pytest.raises(rs.StateError, match=message.replace("rank 0/1", "\\(old rank 0\\) rank 0/1")):
            loader.load_state_dict([bad])
    for wrong in (None, 3, "state"):
        with pytest.raises(rs.StateError):
            loader.load_state_dict(wrong)  # type: ignore[arg-type]  # deliberately wrong, to test the check
    assert loader.state_dict() == before
    assert head + [as_lists(batch) for batch in iterator] == expected
    loader.load_state_dict(state)
    assert batches(loader) == expected[5:]


def legacy_loader(pipeline: Any, every: int, **config: Any) -> Loader:
    """A Loader that snapshots every ``every`` batches, as the previous version did by default
    (it passed the interval to torchdata and wrote it into the state; see ``legacy_state``)."""
    loader = Loader(pipeline, **config)
    loader.snapshot_every_n_steps = every  # read by torchdata when it builds the next iterator
    # workers that hand over plain batches, whose states travel in torchdata's snapshots
    if isinstance(loader.collate_fn, CollateBatch):  # past the Loader's guard on built options
        super(Loader, loader).__setattr__("collate_fn", loader.collate_fn.collate_fn)
    return loader


def legacy_state(loader: Loader, every: int) -> dict:
    return {**loader.state_dict(), "snapshot_every_n_steps": every}


@pytest.mark.parametrize("persistent", [False, True])
def test_a_state_saved_with_a_snapshot_interval_still_resumes_exactly(persistent: bool) -> None:
    expected = batches(Loader(small, num_workers=2))
    old = legacy_loader(small, 4, num_workers=2, persistent_workers=persistent)
    iterator = iter(old)
    head = [as_lists(next(iterator)) for _ in range(3)]
    state = json.loads(json.dumps(legacy_state(old, 4)))
    assert state["loader"]["_steps_since_snapshot"] == 3
    resumed = Loader(small, num_workers=2, persistent_workers=persistent)
    resumed.load_state_dict(state)
    iterator = iter(resumed)  # torchdata advances the workers by the 3 batches, once
    assert resumed.state_dict()["loader"]["_steps_since_snapshot"] == 0
    middle = [as_lists(next(iterator)) for _ in range(2)]
    again = Loader(small, num_workers=2)
    again.load_state_dict(json.loads(json.dumps(resumed.state_dict())))
    assert head + middle + batches(again) == expected


def test_snapshot_every_n_steps_is_deprecated_and_ignored() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", "This DataLoader will create")  # torch's advice on a one-core machine
        Loader(small, num_workers=2, snapshot_every_n_steps=1)
    with pytest.warns(FutureWarning, match="snapshot_every_n_steps=16 is ignored and deprecated"):
        loader = Loader(small, num_workers=2, snapshot_every_n_steps=16)
    iterator = iter(loader)
    for _ in range(3):
        next(iterator)
    state = loader.state_dict()
    assert (state["snapshot_every_n_steps"], state["loader"]["_steps_since_snapshot"]) == (1, 0)
    assert state["loader"]["_snapshot"]["_snapshot_step"] == 3


def keep_as_is(batch: Any) -> Any:
    return batch


@pytest.mark.parametrize("num_workers", [0, 1])
def test_default_collation_makes_tensors_and_an_identity_collate_fn_keeps_numpy(num_workers: int) -> None:
    import torch

    def records() -> rs.Node:
        return rs.from_list([{"ids": np.arange(3), "count": np.int64(2), "n": 5} for _ in range(4)]).batch(2)

    first = next(iter(Loader(records, num_workers)))[0]
    assert isinstance(first["ids"], torch.Tensor) and isinstance(first["count"], torch.Tensor)
    assert first["n"] == 5 and not isinstance(first["n"], torch.Tensor)
    kept = next(iter(Loader(records, num_workers, collate_fn=keep_as_is)))[0]
    assert isinstance(kept["ids"], np.ndarray) and isinstance(kept["count"], np.int64)


def test_a_damaged_per_rank_string_is_a_state_error() -> None:
    loader = Loader(small)
    encoded = rst.PerRank(loader).state_dict()["rank_0"]
    with pytest.raises(rs.StateError, match="PerRank: rank 0 of 1: the stored state is not valid JSON"):
        rst.PerRank(loader).load_state_dict({"rank_0": encoded[:-3]})
    assert batches(loader) == batches(Loader(small))


def test_a_loader_iterator_copied_into_a_forked_child_is_dropped_there_quietly() -> None:
    """A process forked while a Loader iterates (another loader's worker, a multiprocessing
    child) holds a copy of the iterator; collected there, it leaves the parent's workers, queues
    and threads alone, with nothing on stderr (it printed an AssertionError from
    ``_shutdown_workers``: "can only test a child process")."""
    import multiprocessing
    import os
    import sys

    with Loader(build, num_workers=2) as loader:
        held = [iter(loader)]
        first = next(held[0])

        def drop_the_copy() -> None:
            raised: list[Any] = []
            sys.unraisablehook = raised.append
            held.clear()
            loader._iterator = None  # the copy's last reference
            gc.collect()
            os._exit(len(raised))

        child = multiprocessing.get_context("fork").Process(target=drop_the_copy)
        child.start()
        child.join()
        assert child.exitcode == 0
        rest = list(held[0])
    with Loader(build, num_workers=2) as reference:
        assert [np.asarray(b).tolist() for b in [first, *rest]] == [np.asarray(b).tolist() for b in reference]


def test_len_without_workers_is_the_pipelines_and_with_workers_a_type_error() -> None:
    """``len(loader)`` (a learning-rate schedule's steps per epoch): without workers, the
    pipeline's ``len()``, which is the number of batches a pass yields; with workers, a
    TypeError that says why, not one naming an inner class."""

    def build() -> rs.Node:
        return rs.from_list(list(range(10))).shuffle(seed=1).shard().batch(3)

    loader = rst.Loader(build)
    assert len(loader) == 4 == len(list(loader))
    with pytest.raises(TypeError, match="Filter"):
        len(rst.Loader(lambda: rs.from_list(list(range(10))).filter(bool).batch(3)))
    with pytest.raises(TypeError, match="Loader: len.. is unknown with DataLoader workers"):
        len(rst.Loader(build, num_workers=2))


def varying_lengths() -> rs.Node:
    """Rows per epoch that differ from epoch to epoch (a whole-epoch packing plan under a shard)."""
    return (
        rs.from_list([{"input_ids": list(range(1 + i * 3 % 7))} for i in range(46)])
        .shuffle(0)
        .shard()
        .pack(8, strategy="bfd")
    )


def test_len_after_loading_a_later_epoch_is_that_epoch_s_own_and_rescaled() -> None:
    """Before the next iter() applies a loaded state, len() is the loaded epoch's (what a
    learning-rate schedule reads on restart): the same as once iter() applied it, for a state
    of this rank and for every old rank's states rescaled onto fewer ranks; the resumed pass is
    the same with or without that len()."""
    olds, lengths = [], []
    for rank in range(2):
        with as_rank(rank, 2):
            loader = rst.Loader(varying_lengths)
            list(loader)
            iterator = iter(loader)
            next(iterator)
            lengths.append(len(loader))
            olds.append(json.loads(json.dumps(loader.state_dict())))
    for world_size, state in ((2, olds[0]), (1, olds)):
        with as_rank(0, world_size):
            resumed, untouched = rst.Loader(varying_lengths), rst.Loader(varying_lengths)
            resumed.load_state_dict(state)
            untouched.load_state_dict(state)
            before = len(resumed)
            rest = [batch["input_ids"].tolist() for batch in resumed]
            assert len(resumed) == before  # the length of the epoch the state was in
            assert rest == [batch["input_ids"].tolist() for batch in untouched]
            if world_size == 2:
                assert before == lengths[0] != len(rst.Loader(varying_lengths))  # epoch 0's differs


def keep_none(record: int) -> bool:
    return False


def barren_endless() -> rs.Node:
    """An endless read whose filter keeps nothing: a ``BarrenEpochWarning`` after its first epoch."""
    return rs.from_list(list(range(40))).shard().repeat().filter(keep_none)


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_filters_on_the_library_s_warnings_reach_workers_that_inherit_none(context: str) -> None:
    """A ``BarrenEpochWarning`` made an error in the training script stops a worker's endless
    read also where the worker inherits no warning filters (``spawn``, macOS's default, and
    ``forkserver``): the Loader applies the main process's filters on its own warnings there.
    (Forked workers inherit them: tests/test_endless_upstream_adversary.py.)"""
    with warnings.catch_warnings():
        warnings.simplefilter("error", rs.BarrenEpochWarning)
        loader = Loader(barren_endless, num_workers=1, multiprocessing_context=context, timeout=30)
        with pytest.raises(rs.BarrenEpochWarning, match="Filter: the predicate kept no item"):
            next(iter(loader))
        loader.close()


def test_only_filters_on_the_library_s_warnings_go_to_workers_in_their_order() -> None:
    """Filters on other categories (a user's own, which a spawned worker may not import; all
    warnings) stay in the main process; the library's keep their order."""
    from resumable.torch.loader import own_warning_filters

    class Mine(UserWarning):
        pass

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rs.ChunkCacheWarning)
        warnings.simplefilter("error", Mine)
        warnings.filterwarnings("error", message="Filter: ", category=rs.BarrenEpochWarning, module="resumable")
        warnings.simplefilter("error")
        shipped = own_warning_filters()
    assert [(action, category) for action, _, category, _, _ in shipped] == [
        ("error", rs.BarrenEpochWarning),
        ("ignore", rs.ChunkCacheWarning),
    ]
    assert shipped[0][1].pattern == "Filter: " and shipped[0][3].pattern == "resumable"
