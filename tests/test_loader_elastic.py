"""rs.torch.Loader resumed on another number of workers (one rank): the interrupted epoch
delivers each document once, and later epochs are the new topology's own."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

import resumable as rs
from resumable.torch import Loader
from tests.test_loader import legacy_loader, legacy_state

DOCUMENTS = 157


def build() -> rs.Node:
    return rs.from_list(list(range(DOCUMENTS))).shuffle(seed=2).shard().filter(lambda x: x % 6 != 1).batch(4)


def items(batches: list[Any]) -> list[int]:
    return [int(x) for batch in batches for x in batch]


EPOCH = sorted(x for x in range(DOCUMENTS) if x % 6 != 1)


@pytest.mark.parametrize(("old_workers", "new_workers", "taken"), [(3, 2, 5), (2, 0, 9), (0, 3, 4), (1, 2, 30)])
def test_other_worker_count_continues_the_epoch_then_runs_its_own(
    old_workers: int, new_workers: int, taken: int
) -> None:
    old = Loader(build, num_workers=old_workers)
    iterator = iter(old)
    head = [next(iterator) for _ in range(taken)]
    state = json.loads(json.dumps(old.state_dict()))
    old.close()

    new = Loader(build, num_workers=new_workers)
    new.load_state_dict([state])
    rest = list(new)
    assert sorted(items(head + rest)) == EPOCH, "each document of the interrupted epoch once"
    next_epoch = list(new)

    fresh = Loader(build, num_workers=new_workers)
    list(fresh)
    assert items(next_epoch) == items(list(fresh)), "epoch 1 as if the new topology had always run"
    assert sorted(items(next_epoch)) == EPOCH


def test_same_topology_through_a_list_is_exact() -> None:
    reference = Loader(build, num_workers=2)
    expected = items(list(reference))
    old = Loader(build, num_workers=2)
    iterator = iter(old)
    head = [next(iterator) for _ in range(7)]
    state = old.state_dict()
    old.close()
    new = Loader(build, num_workers=2)
    new.load_state_dict([state])
    assert items(head + list(new)) == expected


def test_state_taken_between_epochs_starts_the_next_epoch_on_the_new_topology() -> None:
    old = Loader(build, num_workers=3)
    list(old)
    state = old.state_dict()
    new = Loader(build, num_workers=2)
    new.load_state_dict([state])
    fresh = Loader(build, num_workers=2)
    list(fresh)
    assert items(list(new)) == items(list(fresh))
    assert new.epoch == 1


def test_incomplete_or_mixed_rank_states_are_state_errors() -> None:
    old = Loader(build, num_workers=0)
    next(iter(old))
    state = old.state_dict()
    other_rank = dict(state, rank=1, world_size=2)
    new = Loader(build, num_workers=2)
    with pytest.raises(rs.StateError, match="every old rank's state in rank order"):
        new.load_state_dict([other_rank])
    with pytest.raises(rs.StateError, match="no rank states"):
        new.load_state_dict([])
    with pytest.raises(rs.StateError, match="not a resumable Loader state"):
        new.load_state_dict([{"format": "x"}])
    assert np.array_equal(np.sort(items(list(Loader(build)))), EPOCH)


def test_file_sharded_stream_through_the_loader(tmp_path: Any) -> None:
    for f in range(9):
        (tmp_path / f"part{f}.jsonl").write_text("".join(json.dumps({"id": f * 50 + i}) + "\n" for i in range(f + 5)))
    pattern = str(tmp_path / "part*.jsonl")
    everything = sorted(f * 50 + i for f in range(9) for i in range(f + 5))

    def stream() -> rs.Node:
        return rs.jsonl_stream(pattern, shuffle_files=3).map(lambda r: r["id"]).batch(3)

    old = Loader(stream, num_workers=3)
    iterator = iter(old)
    head = [next(iterator) for _ in range(4)]
    state = old.state_dict()
    old.close()
    new = Loader(stream, num_workers=2)
    new.load_state_dict([state])
    assert sorted(items(head + list(new))) == everything
    fresh = Loader(stream, num_workers=2)
    list(fresh)
    assert items(list(new)) == items(list(fresh))


def states_around_the_end_of_epoch_0(config: dict) -> dict[str, dict]:
    """'last': after the last batch, before StopIteration; 'ended': after StopIteration;
    'next': after iter() started epoch 1, before its first batch."""
    loader = Loader(build, **config)
    iterator = iter(loader)
    states = {}
    for _ in iterator:
        states["last"] = json.loads(json.dumps(loader.state_dict()))
    states["ended"] = json.loads(json.dumps(loader.state_dict()))
    iter(loader)
    states["next"] = json.loads(json.dumps(loader.state_dict()))
    return states


OLD_CONFIGS = [{"num_workers": 0}, {"num_workers": 2}, {"num_workers": 2, "persistent_workers": True}]


@pytest.mark.parametrize("old_config", OLD_CONFIGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("new_workers", [1, 3])
def test_states_at_an_epoch_end_continue_on_another_topology(old_config: dict, new_workers: int) -> None:
    fresh = Loader(build, num_workers=new_workers)
    own_epochs = [items(list(fresh)) for _ in range(3)]
    for point, state in states_around_the_end_of_epoch_0(old_config).items():
        new = Loader(build, num_workers=new_workers, persistent_workers=True)
        new.load_state_dict([state])
        if point == "last":  # epoch 0 has nothing left, then the new topology's epoch 1
            assert items(list(new)) == []
            assert (items(list(new)), new.epoch) == (own_epochs[1], 1)
        elif point == "ended":  # the next iter() is epoch 1 already
            assert (items(list(new)), new.epoch) == (own_epochs[1], 1)
        else:  # epoch 1 had begun: all of it, each document once, on the new topology
            assert (sorted(items(list(new))), new.epoch) == (EPOCH, 1)
        assert items(list(new)) == own_epochs[2], point


@pytest.mark.parametrize("new_workers", [0, 2])
def test_state_taken_after_an_elastic_load_and_before_iterating_resumes_the_same(new_workers: int) -> None:
    fresh = Loader(build, num_workers=new_workers)
    own_epochs = [items(list(fresh)) for _ in range(2)]
    old = Loader(build, num_workers=3)
    iterator = iter(old)
    head = [next(iterator) for _ in range(5)]
    mid_epoch = json.loads(json.dumps(old.state_dict()))
    list(iterator)
    ended = json.loads(json.dumps(old.state_dict()))
    for state in (mid_epoch, ended):
        new = Loader(build, num_workers=new_workers)
        new.load_state_dict([state])
        taken = json.loads(json.dumps(new.state_dict()))
        rest = items(list(new))
        resumed = Loader(build, num_workers=new_workers)
        resumed.load_state_dict(taken)
        assert items(list(resumed)) == rest
        if state is mid_epoch:
            assert sorted(items(head) + rest) == EPOCH and new.epoch == 0
            assert items(list(new)) == own_epochs[1]
        else:
            assert rest == own_epochs[1] and new.epoch == 1


@pytest.mark.parametrize("legacy", [False, True])
def test_the_batch_size_may_change_with_the_worker_count(legacy: bool) -> None:
    """2 workers x 6 -> 3 workers x 4: the old workers' states are exact as they stand (they come
    with every batch); in a state saved by an earlier version between two snapshots, the old
    workers are first advanced by the batches handed out since, with their own batch size.
    Then the epoch continues in batches of 4, each document once."""
    documents = list(range(97))

    def with_batch(size: int) -> Any:
        return lambda: rs.from_list(documents).shuffle(seed=2).shard().batch(size)

    old = legacy_loader(with_batch(6), 4, num_workers=2) if legacy else Loader(with_batch(6), num_workers=2)
    seen: list[int] = []
    batches = iter(old)
    for _ in range(7):  # in the legacy state: a snapshot at batch 4, 3 batches since, advanced on restore
        seen.extend(int(x) for x in next(batches))
    state = json.loads(json.dumps(legacy_state(old, 4) if legacy else old.state_dict()))
    assert state["loader"]["_steps_since_snapshot"] == (3 if legacy else 0)
    # Dropping the references stops the workers. Not close(): it reloads the loader's own state,
    # which records interval 1 and so, in a legacy loader, refuses the batches since the snapshot.
    del batches, old
    new = Loader(with_batch(4), num_workers=3)
    new.load_state_dict([state])
    sizes = []
    for batch in new:
        seen.extend(int(x) for x in batch)
        sizes.append(len(batch))
    new.close()
    assert sorted(seen) == documents
    assert max(sizes) == 4
