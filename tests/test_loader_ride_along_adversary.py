"""rs.torch.Loader's workers hand each batch over with its pipeline state (``BatchWithState``),
and the main process rebuilds torchdata's every-batch snapshot from them: attacked as a user
would attack it.

Other start methods (spawn, forkserver), a timeout, pinning, collate functions and pipeline
items that look like ``BatchWithState`` (tuples, NamedTuples with its field names, dicts with a
"state" key, ``BatchWithState`` itself, None), an exception in a worker at some batch, a
``PipelineDataset`` shared with another loader, states taken at every point of two epochs,
``.even()`` carries across epochs, elastic restores from these states, and a fuzzer against
torchdata's own every-batch snapshot. Every Loader here is tiny: a start costs 0.1-0.3 s.
"""

from __future__ import annotations

import functools
import json
import socket
from typing import Any, Callable, Iterator, NamedTuple

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

import resumable as rs
from resumable.loader_state import parse_loader_state
from resumable.torch import Loader, PipelineDataset
from resumable.torch.dataset import BatchWithState

RECORDS = 13
"""Two workers read 7 and 6 of them: 4 and 3 batches of 2, so the workers end at different steps."""
BATCH = 2
WORKERS = 2
FUZZ_EXAMPLES = max(3, settings.default.max_examples // 8)
"""Each example starts three Loaders (about 2 s): 5 under the ci profile, 18 under dev."""


def double(x: int) -> int:
    return 2 * x


def numbers(records: int = RECORDS, batch: int = BATCH) -> rs.Node:
    """The pipeline most tests use: shuffled, sharded over workers, mapped, batched."""
    return rs.from_list(list(range(records))).shuffle(3).shard().map(double).batch(batch)


def plain(value: Any) -> Any:
    """``value`` as comparable data that keeps every container's type (a tensor's dtype too)."""
    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.dtype), value.tolist())
    if isinstance(value, np.ndarray):
        return ("ndarray", str(value.dtype), value.tolist())
    if isinstance(value, dict):
        return (type(value).__name__, {key: plain(item) for key, item in value.items()})
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, [plain(item) for item in value])
    if isinstance(value, Odd):
        return ("Odd", plain(value.payload))
    return value


def records_of(batch: Any) -> list[int]:
    """The records of one batch of ``numbers`` (halved back: the map doubles them)."""
    return [int(x) // 2 for x in batch]


def without_seed(state: dict[str, Any]) -> dict[str, Any]:
    """A torchdata iterator state without its per-iterator random ``_base_seed``."""
    state = json.loads(json.dumps(state))
    del state["_snapshot"]["_main_snapshot"]["_base_seed"]
    return state


def reference(build: Callable[[], rs.Node], **config: Any) -> StatefulDataLoader:
    """torchdata's own loader over the same pipeline, with a snapshot at every batch: the
    states the Loader must reproduce (its workers yield plain batches)."""
    return StatefulDataLoader(PipelineDataset(build), batch_size=None, snapshot_every_n_steps=1, **config)


def saved(loader: Loader) -> dict[str, Any]:
    """The loader's state as a checkpoint holds it: through JSON."""
    return json.loads(json.dumps(loader.state_dict()))


def run_to_epoch(loader: Loader, last_epoch: int) -> list[Any]:
    """Every batch from where ``loader`` stands to the end of epoch ``last_epoch``."""
    batches: list[Any] = []
    while True:
        batches += [plain(batch) for batch in loader]
        if loader.epoch >= last_epoch:
            return batches


# -- states at every point ---------------------------------------------------------------------

CONFIGS = [
    {"num_workers": 0},
    {"num_workers": 1, "timeout": 30},
    {"num_workers": WORKERS, "prefetch_factor": 1},
    {"num_workers": WORKERS, "persistent_workers": True, "prefetch_factor": 3},
]


def config_id(config: dict[str, Any]) -> str:
    return "-".join(f"{key}={value}" for key, value in config.items())


@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_a_state_taken_at_any_point_restores_exactly_across_the_epoch_boundary(config: dict[str, Any]) -> None:
    """States before the first batch, after ``iter()``, after every batch, after StopIteration,
    once the next pass started and one batch into it, after ``close()``, after
    ``load_state_dict`` and before ``iter()``, and twice in a row: each, restored into a freshly
    built Loader, gives exactly the rest of the uninterrupted two-epoch stream."""
    with Loader(numbers, **config) as uninterrupted:
        epochs = [[plain(batch) for batch in uninterrupted] for _ in range(2)]
    stream = epochs[0] + epochs[1]
    assert len(epochs[0]) >= 4 and epochs[0] != epochs[1]

    states: list[tuple[str, int, dict[str, Any]]] = []  # (point, batches of the stream before it, state)
    loader = Loader(numbers, **config)

    def take(point: str, done: int) -> None:
        state = saved(loader)
        assert saved(loader) == state, f"{point}: a second state_dict() in a row differs"
        states.append((point, done, state))

    take("before iter()", 0)
    iterator = iter(loader)
    take("after iter()", 0)
    for done in range(1, len(epochs[0]) + 1):
        assert plain(next(iterator)) == stream[done - 1]
        take(f"after batch {done}", done)
    with pytest.raises(StopIteration):
        next(iterator)
    take("after StopIteration", len(epochs[0]))
    iterator = iter(loader)
    take("next pass started", len(epochs[0]))
    assert plain(next(iterator)) == stream[len(epochs[0])]
    take("one batch into epoch 1", len(epochs[0]) + 1)
    loader.close()
    take("after close()", len(epochs[0]) + 1)
    point, done, mid = states[3]
    loader.load_state_dict(mid)
    take(f"loaded ({point}), before iter()", done)
    assert states[-1][2] == mid, "a loaded state is handed back as it was"
    assert run_to_epoch(loader, 1) == stream[done:], "the loader that loaded it continues exactly"
    loader.close()

    for point, done, state in states:
        with Loader(numbers, **config) as resumed:
            resumed.load_state_dict(state)
            assert run_to_epoch(resumed, 1) == stream[done:], point


# -- what the batches are made of ----------------------------------------------------------


class Pair(NamedTuple):
    """A user's NamedTuple with BatchWithState's own field names."""

    batch: Any
    state: Any


class Odd:
    """An object torch knows nothing about."""

    def __init__(self, payload: Any) -> None:
        self.payload = payload


def as_tuple(batch: list[int]) -> tuple[int, ...]:
    return tuple(batch)


def as_state_dict(batch: list[int]) -> dict[str, Any]:
    return {"state": batch, "batch": len(batch)}


def as_pair(batch: list[int]) -> Pair:
    return Pair(batch, {"pipeline": "not ours", "epoch": 0})


def as_batch_with_state(batch: list[int]) -> BatchWithState:
    return BatchWithState(batch, {"pipeline": "{}", "epoch": 7})


def as_odd(batch: list[int]) -> Odd:
    return Odd(batch)


def as_none(batch: list[int]) -> None:
    return None


def items(kind: str) -> rs.Node:
    """A pipeline whose items (no ``.batch()``) are of the given kind."""
    made: dict[str, Callable[[int], Any]] = {
        "tuples": lambda i: (i, str(i)),
        "pairs": lambda i: Pair(i, {"state": i}),
        "dicts with a state key": lambda i: {"state": {"pipeline": str(i), "epoch": 0}, "batch": [i]},
        "batches with state": lambda i: BatchWithState([i], {"pipeline": "{}", "epoch": 0}),
        "numpy": lambda i: np.arange(i, dtype=np.int16),
    }
    return rs.from_list([made[kind](i) for i in range(7)]).shard()


COLLATES = [as_tuple, as_state_dict, as_pair, as_batch_with_state, as_odd, as_none]


@pytest.mark.parametrize(
    "build, collate_fn",
    [(numbers, collate) for collate in COLLATES]
    + [(functools.partial(items, kind), None) for kind in ("tuples", "pairs", "dicts with a state key", "numpy")]
    + [(functools.partial(items, "batches with state"), collate) for collate in (None, as_pair)],
    ids=[collate.__name__ for collate in COLLATES]
    + ["items: tuples", "items: pairs", "items: dicts with a state key", "items: numpy"]
    + ["items: batches with state", "items: batches with state, as_pair"],
)
def test_what_the_user_gets_is_what_torchdata_gives_whatever_the_batches_look_like(
    build: Callable[[], rs.Node], collate_fn: Callable[[Any], Any] | None
) -> None:
    """Batches that look like the state-carrying wrapper (its field names, a "state" key, the
    wrapper itself as an item or from the collate_fn, None) reach the user as torchdata gives
    them, and the state after each is torchdata's snapshot, so the wrapper is never confused
    with what the pipeline or the collate_fn made."""
    config = {"num_workers": WORKERS, "collate_fn": collate_fn}
    theirs = reference(build, **config)
    with Loader(build, **config) as ours:
        mine = iter(ours)
        count = 0
        for expected in theirs:
            batch = next(mine)
            assert type(batch) is type(expected)
            assert plain(batch) == plain(expected)
            count += 1
            assert without_seed(ours.state_dict()["loader"]) == without_seed(theirs.state_dict()), count
        assert next(mine, "ended") == "ended"
        assert count > WORKERS


def test_pinning_keeps_a_batch_with_its_state() -> None:
    """What the pinning thread does to each item: a ``BatchWithState`` stays one, its state
    untouched (its JSON string and epoch hold no tensor to pin; no accelerator needed)."""
    from torch.utils.data._utils.pin_memory import pin_memory

    item = BatchWithState([1, 2], {"pipeline": '{"kind":"Batch"}', "epoch": 3})
    pinned = pin_memory(item)
    assert type(pinned) is BatchWithState
    assert pinned == item


@pytest.mark.skipif(not torch.accelerator.is_available(), reason="no accelerator: torch turns pin_memory off")
def test_a_pinned_loader_resumes_exactly() -> None:
    with Loader(numbers, num_workers=WORKERS) as unpinned:
        expected = [plain(batch.cpu()) for batch in unpinned]
    with Loader(numbers, num_workers=WORKERS, pin_memory=True) as loader:
        iterator = iter(loader)
        head = [next(iterator) for _ in range(3)]
        assert all(batch.is_pinned() for batch in head)
        state = saved(loader)
    with Loader(numbers, num_workers=WORKERS, pin_memory=True) as resumed:
        resumed.load_state_dict(state)
        assert [plain(batch.cpu()) for batch in head + list(resumed)] == expected


# -- other start methods -----------------------------------------------------------------------


@pytest.mark.parametrize("context", ["spawn"])  # a fork server's workers unpickle the same way; seconds each
def test_workers_started_by_spawn_or_a_fork_server_ship_the_same_states(context: str) -> None:
    """The collate wrapper, the user's collate_fn and the factory pickle into the workers; the
    batches and states are those of forked workers, and a state restores exactly."""
    build = functools.partial(numbers, 9, 2)
    workers = 1  # a worker that is not forked from this process imports torch: seconds each
    config = {"num_workers": workers, "collate_fn": as_tuple}
    with Loader(build, **config) as forked:
        forked_iterator = iter(forked)
        expected = [plain(next(forked_iterator)) for _ in range(2)]
        forked_state = without_seed(forked.state_dict()["loader"])
        expected += [plain(batch) for batch in forked_iterator]
    with Loader(build, multiprocessing_context=context, **config) as loader:
        iterator = iter(loader)
        head = [plain(next(iterator)) for _ in range(2)]
        assert without_seed(loader.state_dict()["loader"]) == forked_state
        state = saved(loader)
        assert head + [plain(batch) for batch in iterator] == expected
    with Loader(build, multiprocessing_context=context, **config) as resumed:
        resumed.load_state_dict(state)
        assert head + [plain(batch) for batch in resumed] == expected


# -- an exception in a worker --------------------------------------------------------------


class TwoArgumentError(Exception):
    """An exception torch cannot rebuild from its message (it raises a RuntimeError instead)."""

    def __init__(self, record: int, why: str) -> None:
        super().__init__(f"record {record}: {why}")


BAD_RECORD = 8


def fail_at(kind: str, x: int) -> int:
    """The map: raises on ``BAD_RECORD`` (doubled: the map runs after ``double``)."""
    if x == 2 * BAD_RECORD:
        if kind == "value":
            raise ValueError(f"record {BAD_RECORD} is bad")
        if kind == "source":
            raise rs.SourceError(f"FromList: record {BAD_RECORD} is malformed")
        if kind == "two arguments":
            raise TwoArgumentError(BAD_RECORD, "bad")
    return x


def fail_in_collate(batch: list[int]) -> list[int]:
    if 2 * BAD_RECORD in batch:
        raise KeyError(f"collate_fn: record {BAD_RECORD}")
    return batch


def failing(kind: str) -> rs.Node:
    return (
        rs.from_list(list(range(RECORDS))).shuffle(3).shard().map(double).map(functools.partial(fail_at, kind)).batch(2)
    )


def steps_until_error(loader: Any) -> tuple[list[tuple[Any, dict[str, Any]]], BaseException | None, Iterator[Any]]:
    """Each batch with the state after it, up to the first exception (and the iterator)."""
    iterator = iter(loader)
    steps = []
    while True:
        try:
            batch = next(iterator)
        except StopIteration:
            return steps, None, iterator
        except Exception as error:  # noqa: BLE001  # the one under test
            return steps, error, iterator
        state = loader.state_dict()
        steps.append((plain(batch), state["loader"] if isinstance(loader, Loader) else state))


def same_error(mine: BaseException | None, theirs: BaseException | None) -> None:
    """Same type, same first line (which worker caught what) and same last line (the message);
    the traceback between differs by the iterator's frame."""
    assert mine is not None and theirs is not None
    assert type(mine) is type(theirs)
    lines, expected = str(mine).strip().splitlines(), str(theirs).strip().splitlines()
    assert (lines[0], lines[-1]) == (expected[0], expected[-1])


@pytest.mark.parametrize("kind", ["value", "source", "two arguments", "collate"])
def test_an_exception_in_a_worker_reaches_the_user_and_the_state_before_it_is_exact(kind: str) -> None:
    """The user gets the worker's exception as torchdata gives it (same type and message); every
    state up to it, restored, gives the same batches and then the same exception; a loop that
    catches it and goes on gets torchdata's batches; and the state taken right after it, restored,
    goes on as that loop does (torchdata's would raise the error again: its failing worker sends
    no state with the error; the Loader's does)."""
    build = functools.partial(failing, "none" if kind == "collate" else kind)
    config = {"num_workers": WORKERS, "collate_fn": fail_in_collate if kind == "collate" else None}
    theirs = reference(build, **config)
    expected, their_error, their_iterator = steps_until_error(theirs)
    with Loader(build, **config) as ours:
        steps, error, iterator = steps_until_error(ours)
        assert [batch for batch, _ in steps] == [batch for batch, _ in expected]
        assert [without_seed(state) for _, state in steps] == [without_seed(state) for _, state in expected]
        same_error(error, their_error)
        if kind == "two arguments":
            assert isinstance(error, RuntimeError) and "record 8: bad" in str(error)
        after = saved(ours)
        # Going on after catching it: the batches torchdata gives.
        going_on = [plain(batch) for batch in iterator]
        assert going_on == [plain(batch) for batch in their_iterator]
    with Loader(build, **config) as resumed:
        resumed.load_state_dict(after)
        assert [plain(batch) for batch in resumed] == going_on

    batches = [batch for batch, _ in expected]
    for done in range(len(steps) + 1):
        with Loader(build, **config) as loader:
            iterator = iter(loader)
            head = [plain(next(iterator)) for _ in range(done)]
            state = saved(loader)
        with Loader(build, **config) as resumed:
            resumed.load_state_dict(state)
            rest, again, _ = steps_until_error(resumed)
            assert head + [batch for batch, _ in rest] == batches, done
            same_error(again, their_error)


# -- a dataset shared with another loader ----------------------------------------------------


@pytest.mark.parametrize("other", [DataLoader, StatefulDataLoader], ids=["DataLoader", "StatefulDataLoader"])
def test_a_dataset_given_to_a_loader_gives_plain_batches_to_another_loader(other: type) -> None:
    """A ``PipelineDataset`` iterated by a Loader, then (the same object) by a plain
    DataLoader or StatefulDataLoader, gives that loader the pipeline's batches. (Before
    8ebfeaf the Loader set a flag on the dataset object, and the other loader got
    ``BatchWithState`` items.)"""
    dataset = PipelineDataset(numbers)
    with Loader(dataset, num_workers=WORKERS) as loader:
        first = [records_of(batch) for batch in loader]
    batches = list(other(dataset, batch_size=None, num_workers=WORKERS))
    assert not any(isinstance(batch, BatchWithState) for batch in batches)
    assert sorted(x for batch in batches for x in records_of(batch)) == sorted(x for b in first for x in b)


def test_two_loaders_over_one_dataset_each_get_their_batches() -> None:
    """A training Loader with workers and an evaluation Loader without, over one dataset object.
    (Before 8ebfeaf the second Loader turned the dataset's flag off, and the first one's
    workers failed in the collate wrapper with an AttributeError.)"""
    dataset = PipelineDataset(numbers)
    with Loader(dataset, num_workers=WORKERS) as training, Loader(dataset, num_workers=0) as evaluation:
        ours = sorted(x for batch in evaluation for x in records_of(batch))
        assert sorted(x for batch in training for x in records_of(batch)) == ours == list(range(RECORDS))


INNER = PipelineDataset(functools.partial(rs.from_list, [10, 11]))
"""A dataset a user's map reads from, in whatever process runs the map."""


def with_inner_item(x: int) -> tuple[int, Any]:
    """The map: ``x`` and the first item of ``INNER``, iterated right here (no DataLoader)."""
    return x, next(iter(INNER))


def mapping_with_inner() -> rs.Node:
    return rs.from_list(list(range(4))).shard().map(with_inner_item)


def test_a_pipeline_dataset_iterated_inside_a_loader_worker_gives_its_own_items() -> None:
    """A map that iterates another ``PipelineDataset`` in-process gets that pipeline's items in
    a Loader's workers as it does without workers."""
    build = mapping_with_inner
    with Loader(build, num_workers=0) as serial:
        expected = sorted(plain(item) for item in serial)
    assert expected[0] == ("list", [0, 10])
    with Loader(build, num_workers=1) as loader:
        assert sorted(plain(item) for item in loader) == expected


def user_init(worker_id: int) -> None:
    """A worker_init_fn a framework sets on a built loader."""


def add_one(batch: list[int]) -> list[int]:
    return [x + 1 for x in batch]


@pytest.mark.parametrize("attribute", ["worker_init_fn", "collate_fn"])
def test_replacing_a_hook_on_a_built_loader_works_or_is_a_clear_config_error(attribute: str) -> None:
    """DataLoader lets ``worker_init_fn`` and ``collate_fn`` be set after construction (some
    frameworks set ``worker_init_fn``): the Loader must either give the right batches (and
    exact states) or refuse with a ``ConfigError`` that names the Loader and says to pass the
    hook to its constructor."""
    loader = Loader(numbers, num_workers=WORKERS)
    shift = 1 if attribute == "collate_fn" else 0
    try:
        setattr(loader, attribute, user_init if attribute == "worker_init_fn" else add_one)
        with loader:
            got = sorted(x for batch in loader for x in batch)
    except rs.ConfigError as error:
        assert "Loader" in str(error) and attribute in str(error)
        return
    assert got == [2 * x + shift for x in range(RECORDS)]


# -- .even() carries and elastic restores ----------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    """A gloo group of one rank: its TCPStore is where the Loader's workers agree in ``.even()``."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def evened() -> rs.Node:
    """7 records over 2 workers (4 and 3), batches of 1, even: worker 0 carries one more each epoch."""
    return rs.from_list(list(range(7))).shard().batch(1).even()


def carries(state: dict[str, Any]) -> list[int]:
    return [pipeline["carry"] for pipeline in parse_loader_state(state).pipelines]


@pytest.mark.usefixtures("one_rank_group")
def test_even_carries_read_from_the_shipped_states_continue_across_epochs() -> None:
    """Fresh workers each epoch continue worker 0's growing carry from the state at the pass's
    end (``Loader._carried``, built from the states the batches brought), as persistent
    workers keep it; a state saved at each epoch's end or mid-epoch continues the same."""
    epochs = 3
    with Loader(evened, num_workers=WORKERS, persistent_workers=True) as persistent:
        expected = [[plain(batch) for batch in persistent] for _ in range(epochs)]
    assert len({len(epoch) for epoch in expected}) == 1, "even: the same count each epoch"
    loader = Loader(evened, num_workers=WORKERS)
    ends = []
    for epoch in range(epochs):
        iterator = iter(loader)
        head = [plain(next(iterator)) for _ in range(3)]
        middle = saved(loader)
        assert head + [plain(batch) for batch in iterator] == expected[epoch], epoch
        ends.append(saved(loader))
        with Loader(evened, num_workers=WORKERS) as resumed:
            resumed.load_state_dict(middle)
            assert head + run_to_epoch(resumed, epoch) == expected[epoch], epoch
    loader.close()
    assert [carries(state) for state in ends] == [[1, 0], [2, 0], [3, 0]]
    for epoch, state in enumerate(ends[:-1]):
        with Loader(evened, num_workers=WORKERS) as resumed:
            resumed.load_state_dict(state)
            assert run_to_epoch(resumed, epoch + 1) == expected[epoch + 1], epoch


def flat(batches: list[list[int]]) -> list[int]:
    return [x for batch in batches for x in batch]


@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")
@pytest.mark.parametrize("persistent", [False, True], ids=["fresh", "persistent"])
def test_an_elastic_restore_from_shipped_states_sees_every_record_once(persistent: bool) -> None:
    """States taken before the first batch, while both workers run, once the first has ended,
    after the last batch and after StopIteration, loaded as the only old rank's into 3 workers:
    the epoch sees every record once (nothing more after the last batch), the next epoch all of
    them; a state of the rescaled loader after its first batch restores exactly."""
    config = {"num_workers": WORKERS, "persistent_workers": persistent}
    with Loader(numbers, **config) as whole:
        batches = len(list(whole))
    for stop, ended in [(0, False), (3, False), (batches - 1, False), (batches, False), (batches, True)]:
        with Loader(numbers, **config) as loader:
            iterator = iter(loader)
            head = flat([records_of(next(iterator)) for _ in range(stop)])
            if ended:
                assert next(iterator, "ended") == "ended"
            old = saved(loader)
        rescaled = Loader(numbers, num_workers=3, persistent_workers=persistent)
        rescaled.load_state_dict([old])
        rest, middle = [], None
        if not ended:
            for batch in rescaled:
                rest.append(records_of(batch))
                middle = saved(rescaled) if middle is None else middle
            assert sorted(head + flat(rest)) == list(range(RECORDS)), stop
            assert rescaled.epoch == 0
        assert sorted(flat([records_of(batch) for batch in rescaled])) == list(range(RECORDS)), (stop, ended)
        assert rescaled.epoch == 1
        rescaled.close()
        if middle is not None:
            with Loader(numbers, num_workers=3, persistent_workers=persistent) as resumed:
                resumed.load_state_dict(middle)
                assert [records_of(batch) for batch in resumed] == rest[1:], stop


# -- a fuzzer against torchdata's every-batch snapshot -----------------------------------------


@settings(max_examples=FUZZ_EXAMPLES)
@given(
    workers=st.integers(1, 2),
    persistent=st.booleans(),
    prefetch=st.integers(1, 3),
    records=st.integers(0, 30),
    batch=st.integers(1, 4),
    epoch=st.integers(0, 1),
    stop=st.floats(0, 1),
)
def test_fuzzed_loaders_hold_torchdata_s_snapshot_and_resume_exactly(
    workers: int, persistent: bool, prefetch: int, records: int, batch: int, epoch: int, stop: float
) -> None:
    """Drawn workers, persistence, prefetch, records, batch size, and a stop point in the first
    or second epoch (0 = before its first batch, 1 = after its StopIteration, or its last batch
    in the second epoch): after every
    batch the state is torchdata's every-batch snapshot, and the state at the stop, restored,
    continues the two-epoch stream."""
    build = functools.partial(numbers, records, batch)
    config = {"num_workers": workers, "persistent_workers": persistent, "prefetch_factor": prefetch}
    theirs = reference(build, **config)
    ours = Loader(build, **config)
    stream: list[Any] = []
    for current in range(2):
        theirs.dataset.set_epoch(current)
        mine = iter(ours)
        candidates = [(len(stream), saved(ours))]  # (batches of the stream before it, state)
        for expected in theirs:
            assert plain(next(mine)) == plain(expected)
            stream.append(plain(expected))
            assert without_seed(ours.state_dict()["loader"]) == without_seed(theirs.state_dict()), len(stream)
            candidates.append((len(stream), saved(ours)))
        assert next(mine, "ended") == "ended"
        assert without_seed(ours.state_dict()["loader"]) == without_seed(theirs.state_dict())
        candidates.append((len(stream), saved(ours)))
        if current == epoch:
            if current == 1:  # the state after the last StopIteration would continue in epoch 2
                candidates.pop()
            done, state = candidates[round(stop * (len(candidates) - 1))]
    ours.close()
    with Loader(build, **config) as resumed:
        resumed.load_state_dict(state)
        assert run_to_epoch(resumed, 1) == stream[done:]
