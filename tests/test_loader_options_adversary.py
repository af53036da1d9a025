"""Adversary: the DataLoader options an ML engineer passes to ``rs.torch.Loader``.

Every option is either refused when the Loader is built (naming the option), or accepted with
exact resume: k batches, ``state_dict()``, a fresh Loader over a fresh pipeline,
``load_state_dict``, and the rest equals the uninterrupted run. Never silently wrong batches,
never a raw exception from deep inside torch where the Loader could have refused upfront.

The four bugs it found are mended: ``prefetch_factor=0``, ``timeout`` without workers and a
``collate_fn`` that is not callable were accepted and failed at the first batch (a masked
assertion, a bare AssertionError, a TypeError in a worker), and ``num_workers`` set on a built
Loader broke its next ``iter()``: all are ``rs.ConfigError``s where they are given."""

from __future__ import annotations

import itertools
import json
import multiprocessing
import random
import warnings
from typing import Any, Callable

import numpy as np
import pytest
import torch

import resumable as rs
from resumable.torch import Loader
from tests.resume import loader_head, loader_rest
from tests.watching import error_of

RECORDS = 23
BATCH = 2
TIMEOUT = 60  # seconds: a worker that never answers fails the test instead of hanging it

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")


def numbers(records: int = RECORDS, batch: int = BATCH, seed: int = 3) -> rs.Node:
    return rs.from_list(list(range(records))).shuffle(seed=seed).shard().batch(batch)


def records_of(batch: Any) -> list[int]:
    return [int(x) for x in batch]


def saved(loader: Loader) -> dict[str, Any]:
    return json.loads(json.dumps(loader.state_dict()))


def two_epochs(make: Callable[[], Loader]) -> list[list[list[int]]]:
    with make() as loader:
        return [[records_of(batch) for batch in loader] for _ in range(2)]


def check_exact_resume(make: Callable[[], Loader]) -> None:
    """States at the start, the middle, the last batch, after StopIteration of epoch 0, and in
    epoch 1: each, loaded into a fresh Loader, continues the uninterrupted two-epoch run."""
    expected = two_epochs(make)
    assert sorted(x for batch in expected[0] for x in batch) == list(range(RECORDS))
    assert expected[0] != expected[1], "a new order each epoch"
    count = len(expected[0])
    stream = expected[0] + expected[1]
    for stop in sorted({0, 1, count // 2, count - 1, count, count + 1}):
        with make() as loader:
            taken = loader_head(loader, stop, count, records_of)
            state = saved(loader)
        with make() as resumed:
            resumed.load_state_dict(state)
            rest = loader_rest(resumed, stop, count, records_of)
        assert taken + rest == stream, f"resumed after {stop} batches"


# -- options a DataLoader has and this Loader does not -----------------------------------------


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("batch_size", 4),
        ("shuffle", True),
        ("sampler", [0, 1, 2]),
        ("batch_sampler", [[0, 1]]),
        ("drop_last", True),
        ("generator", torch.Generator()),
        ("in_order", False),
        ("pin_memory_device", "cpu"),
    ],
)
def test_sampling_and_batching_options_are_refused_when_built_naming_the_option(option: str, value: Any) -> None:
    """The pipeline shuffles and batches itself: torch's sampling options would reorder or
    regroup behind the state's back, so they are refused at construction, by name."""
    with pytest.raises((TypeError, rs.ConfigError), match=option):
        Loader(numbers, num_workers=1, **{option: value})


@pytest.mark.parametrize(
    ("option", "config"),
    [
        ("prefetch_factor", {"num_workers": 0, "prefetch_factor": 2}),
        ("prefetch_factor", {"num_workers": 1, "prefetch_factor": -1}),
        ("persistent_workers", {"num_workers": 0, "persistent_workers": True}),
        ("timeout", {"num_workers": 1, "timeout": -1}),
        ("multiprocessing_context", {"num_workers": 0, "multiprocessing_context": "fork"}),
        ("multiprocessing_context", {"num_workers": 1, "multiprocessing_context": "bogus"}),
        ("num_workers", {"num_workers": 2.0}),
        ("num_workers", {"num_workers": True}),
    ],
)
def test_impossible_worker_options_are_refused_when_built_naming_the_option(option: str, config: dict) -> None:
    with pytest.raises((ValueError, rs.ConfigError), match=option):
        Loader(numbers, **config)


@pytest.mark.parametrize("attribute", ["batch_size", "persistent_workers", "sampler", "drop_last"])
def test_options_torch_freezes_cannot_be_set_on_a_built_loader(attribute: str) -> None:
    loader = Loader(numbers, num_workers=0)
    with pytest.raises((ValueError, rs.ConfigError), match=attribute):
        setattr(loader, attribute, 4)


def test_prefetch_factor_zero_is_refused_when_built() -> None:
    def build_and_iterate() -> None:
        loader = Loader(numbers, num_workers=1, prefetch_factor=0, timeout=TIMEOUT)
        with loader:
            next(iter(loader))

    error = error_of(build_and_iterate)
    assert isinstance(error, rs.ConfigError) and "prefetch_factor" in str(error), repr(error)


def test_a_timeout_without_workers_is_refused_or_ignored() -> None:
    try:
        loader = Loader(numbers, num_workers=0, timeout=5)
    except rs.ConfigError as error:
        assert "timeout" in str(error)
        return
    assert sorted(x for batch in loader for x in batch) == list(range(RECORDS))


def test_a_collate_fn_that_is_not_callable_is_refused_when_built() -> None:
    with pytest.raises(rs.ConfigError, match="collate_fn"):
        loader = Loader(numbers, num_workers=1, collate_fn=3, timeout=TIMEOUT)  # type: ignore[arg-type]
        with loader:
            next(iter(loader))


@pytest.mark.parametrize(("built", "set_to"), [(0, 2), (2, 0)])
def test_num_workers_set_on_a_built_loader_is_a_config_error(built: int, set_to: int) -> None:
    """Refused where it is set (the workers' options are fixed when the Loader is built), and the
    Loader goes on as built."""
    loader = Loader(numbers, num_workers=built, timeout=TIMEOUT if built else 0)
    with loader:
        with pytest.raises(rs.ConfigError, match="num_workers"):
            loader.num_workers = set_to
        for name, value in (("collate_fn", list), ("prefetch_factor", 3), ("worker_init_fn", None)):
            with pytest.raises(rs.ConfigError, match=name):
                setattr(loader, name, value)
        assert sorted(x for batch in loader for x in batch) == list(range(RECORDS))
        assert loader.state_dict()["num_workers"] == built


# -- options accepted: exact resume ------------------------------------------------------------


def reseeding_init(worker_id: int) -> None:
    """A worker_init_fn as many training scripts have: it seeds (and draws from) every global RNG."""
    random.seed(worker_id)
    np.random.seed(worker_id)
    torch.manual_seed(1234 + worker_id)
    random.random(), np.random.rand(), torch.rand(1)


def to_tuple(batch: list[int]) -> tuple[int, ...]:
    return tuple(batch)


ACCEPTED = [
    {"num_workers": 0},
    {"num_workers": 0, "collate_fn": to_tuple},
    {"num_workers": 1, "prefetch_factor": 1, "worker_init_fn": reseeding_init},
    {"num_workers": 2, "persistent_workers": True, "worker_init_fn": reseeding_init, "timeout": TIMEOUT},
    {"num_workers": 2, "prefetch_factor": 64, "collate_fn": to_tuple},
    {"num_workers": 2, "multiprocessing_context": "context-fork", "persistent_workers": True},
    {"num_workers": 2, "prefetch_factor": 1, "snapshot_every_n_steps": 1, "pin_memory": False},
]


def config_id(config: dict[str, Any]) -> str:
    return "-".join(f"{key}={getattr(value, '__name__', value)}" for key, value in config.items())


@pytest.mark.parametrize("config", ACCEPTED, ids=config_id)
def test_accepted_options_resume_exactly_at_every_boundary(config: dict[str, Any]) -> None:
    config = dict(config)
    if config.get("multiprocessing_context") == "context-fork":
        config["multiprocessing_context"] = multiprocessing.get_context("fork")  # an object, not a name
    check_exact_resume(lambda: Loader(numbers, **config))


def test_a_huge_snapshot_interval_only_warns_and_still_resumes_exactly() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        check_exact_resume(lambda: Loader(numbers, num_workers=2, snapshot_every_n_steps=10**9))


@pytest.mark.parametrize("context", ["spawn"])
def test_a_spawn_context_object_resumes_exactly(context: str) -> None:
    make = lambda: Loader(  # noqa: E731
        numbers, num_workers=1, persistent_workers=True, multiprocessing_context=multiprocessing.get_context(context)
    )
    expected = two_epochs(lambda: Loader(numbers, num_workers=1, persistent_workers=True))  # forked: the same
    # batches, without a spawned worker's seconds of start-up
    with make() as loader:
        iterator = iter(loader)
        head = [records_of(next(iterator)) for _ in range(3)]
        state = saved(loader)
    with make() as resumed:
        resumed.load_state_dict(state)
        assert head + [records_of(batch) for batch in resumed] == expected[0]


# -- more workers than data, epochs of nothing -------------------------------------------------


@pytest.mark.parametrize("workers", [0, 1, 2, 3])
@pytest.mark.parametrize("records", [0, 1, 2])
def test_workers_with_nothing_to_read_resume_exactly(workers: int, records: int) -> None:
    """More workers than records (some shards empty), or an epoch of 0 items: every record once
    per epoch, and a state at every point resumes the rest exactly."""
    make = lambda: Loader(lambda: numbers(records, 1), num_workers=workers, timeout=TIMEOUT if workers else 0)  # noqa: E731
    expected = two_epochs(make)
    assert [sorted(x for b in epoch for x in b) for epoch in expected] == [list(range(records))] * 2
    stream = expected[0] + expected[1]
    for stop in range(len(expected[0]) + 1):
        with make() as loader:
            iterator = iter(loader)
            taken = [records_of(next(iterator)) for _ in range(stop)]
            if stop == len(expected[0]):
                assert next(iterator, "ended") == "ended"
            state = saved(loader)
        with make() as resumed:
            resumed.load_state_dict(state)
            rest = [records_of(b) for b in resumed]
            if stop < len(expected[0]):
                rest += [records_of(b) for b in resumed]
        assert taken + rest == stream, (stop, state)


# -- factories ---------------------------------------------------------------------------------


def not_a_node() -> Any:
    return [[1, 2], [3]]


@pytest.mark.parametrize("workers", [0, 1])
def test_a_factory_returning_something_else_is_a_config_error(workers: int) -> None:
    loader = Loader(not_a_node, num_workers=workers, timeout=TIMEOUT if workers else 0)
    with pytest.raises(rs.ConfigError, match="not a pipeline"), loader:
        next(iter(loader))


def raising_factory() -> rs.Node:
    raise KeyError("no such dataset")


@pytest.mark.parametrize("workers", [0, 2])
def test_a_factory_that_raises_reaches_the_user_and_does_not_hang(workers: int) -> None:
    loader = Loader(raising_factory, num_workers=workers, timeout=TIMEOUT if workers else 0)
    with pytest.raises(KeyError, match="no such dataset"), loader:
        next(iter(loader))


def test_a_factory_that_builds_another_pipeline_each_call_is_caught_on_restore() -> None:
    """A factory reading a mutable config (here: a counter as the seed) builds a different
    pipeline in the resumed run: the restore is a StateError naming the shuffle, never batches
    of another order."""
    seeds = itertools.count(1)
    make = lambda: Loader(lambda: numbers(seed=next(seeds)), num_workers=0)  # noqa: E731
    with make() as loader:
        iterator = iter(loader)
        next(iterator)
        state = saved(loader)
    with make() as resumed:
        resumed.load_state_dict(state)
        with pytest.raises(rs.StateError, match="seed"):
            next(iter(resumed))


# -- worker_init_fn that raises ----------------------------------------------------------------


def failing_init(worker_id: int) -> None:
    if worker_id == 1:
        raise ValueError("worker init failed on purpose")


@pytest.mark.parametrize("persistent", [False, True], ids=["fresh", "persistent"])
def test_a_worker_init_fn_that_raises_reaches_the_user_and_the_state_stays_exact(persistent: bool) -> None:
    """The error of a worker_init_fn arrives, no hang; the state taken before it (here: the
    loaded one) still resumes exactly in a Loader whose workers start."""
    good = lambda: Loader(numbers, num_workers=2, persistent_workers=persistent)  # noqa: E731
    expected = two_epochs(good)[0]
    with good() as loader:
        iterator = iter(loader)
        head = [records_of(next(iterator)) for _ in range(3)]
        state = saved(loader)
    bad = Loader(numbers, num_workers=2, persistent_workers=persistent, worker_init_fn=failing_init, timeout=TIMEOUT)
    bad.load_state_dict(state)
    with pytest.raises(ValueError, match="worker init failed on purpose"), bad:
        list(bad)
    with good() as resumed:
        resumed.load_state_dict(state)
        assert head + [records_of(batch) for batch in resumed] == expected


# -- states loaded into a Loader with other options ---------------------------------------------


def plus_hundred(batch: list[int]) -> list[int]:
    return [x + 100 for x in batch]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_state_loaded_with_another_collate_fn_continues_the_same_records(workers: int) -> None:
    """The collate function is no part of the state: a resumed run with another one gets the
    same records, collated its way."""
    with Loader(numbers, num_workers=workers) as loader:
        expected = [records_of(batch) for batch in loader]
    with Loader(numbers, num_workers=workers) as loader:
        iterator = iter(loader)
        head = [records_of(next(iterator)) for _ in range(4)]
        state = saved(loader)
    with Loader(numbers, num_workers=workers, collate_fn=plus_hundred) as resumed:
        resumed.load_state_dict(state)
        rest = [[x - 100 for x in batch] for batch in resumed]
    assert head + rest == expected


@pytest.mark.parametrize("workers", [0, 2])
def test_a_state_loaded_into_a_pipeline_with_another_batch_size_is_a_state_error(workers: int) -> None:
    with Loader(numbers, num_workers=workers) as loader:
        iterator = iter(loader)
        next(iterator)
        state = saved(loader)
    with Loader(lambda: numbers(batch=3), num_workers=workers, timeout=TIMEOUT if workers else 0) as resumed:
        resumed.load_state_dict(state)
        with pytest.raises(rs.StateError, match="Batch"):
            next(iter(resumed))


@pytest.mark.parametrize(("saved_with", "loaded_with"), [(0, 2), (2, 1)])
def test_a_single_state_loaded_with_another_worker_count_names_num_workers(saved_with: int, loaded_with: int) -> None:
    """One rank's state is not elastic by itself (docs/torch.md: give the list of every rank's)."""
    with Loader(numbers, num_workers=saved_with) as loader:
        iterator = iter(loader)
        next(iterator)
        state = saved(loader)
    other = Loader(numbers, num_workers=loaded_with)
    with pytest.raises(rs.StateError, match="num_workers"):
        other.load_state_dict(state)
    with other:  # left as it was: a fresh epoch 0
        assert sorted(x for batch in other for x in batch) == list(range(RECORDS))
