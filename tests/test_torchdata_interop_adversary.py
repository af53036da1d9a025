"""Adversary: resumable and torchdata used together, as a user mixes them.

``rst.ToTorchdata`` under torchdata's ``Loader``, ``Prefetcher``, ``Batcher``, ``Mapper`` and
``ParallelMapper`` with our own read-ahead nodes (prefetch, thread maps) inside; torchdata graphs
inside pipelines (``rst.FromTorchdata``), nested both ways; ``rst.PipelineDataset`` under
torchdata's ``StatefulDataLoader`` with one and two fresh workers and persistent ones; and
``rst.Loader`` over pipelines that hold a torchdata graph.

The contract attacked: a state taken at any point of an epoch (before the first item, after it,
in the middle, at the last item, after the epoch's end, in the next epoch), sent through JSON or
``torch.save`` / ``torch.load(weights_only=True)``, restored into freshly built objects (twice in
a row too) continues exactly as the uninterrupted run, every record once per epoch over the
workers; one checkpoint may hold our states and torchdata's side by side; errors raised inside
torchdata nodes over our pipelines arrive at their item and iteration goes on after them; a
foreign or damaged state is an ``rs.StateError`` that leaves everything as it was; ``close()``
and dropping a graph stop every thread. The known limits in docs/torch.md (torchdata's Loader's
stale end-of-epoch state, torchdata's read-ahead nodes dropping their reader in a refused
``reset``) are avoided here, not retested. Bugs it found, mended: a Loader state taken after an
epoch ended over a torchdata graph resumed with the graph's first pass again; a fresh
``FromTorchdata`` took ``start_epoch(1)`` and gave its first pass; ``close()`` did not reach the
resumable nodes inside the graph."""

from __future__ import annotations

import copy
import functools
import gc
import io
import json
import multiprocessing
import threading
import weakref
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torchdata.nodes as tn
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

import resumable as rs
import resumable.torch as rst
from tests.resume import loader_head, roundtrip, take
from tests.watching import error_of, wait_until

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")

RECORDS = 13
"""Two workers read 7 and 6 of them: 4 and 3 batches of 2, so they end at different steps."""
BATCH = 2
EPOCH = 7
"""Batches per epoch, with one worker or two."""
TIMEOUT = 60  # seconds: a worker that never answers fails the test instead of hanging it


def double(x: int) -> int:
    return 2 * x


def times3(x: int) -> int:
    return 3 * x


def ints(batch: Any) -> list[int]:
    return [int(x) for x in batch]


def plain(item: Any) -> Any:
    return item if isinstance(item, int) else [int(x) for x in item]


def through_torch(state: Any) -> Any:
    """``state`` saved with ``torch.save`` and read back with ``torch.load(weights_only=True)``."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def numbers() -> rs.Node:
    return rs.from_list(list(range(RECORDS))).shuffle(seed=3).shard().map(double).batch(BATCH)


def record_set(batches: list[list[int]]) -> list[int]:
    return sorted(x // 2 for batch in batches for x in batch)


# -- PipelineDataset under torchdata's StatefulDataLoader with workers ----------------------------


def stateful(workers: int, persistent: bool) -> StatefulDataLoader:
    return StatefulDataLoader(
        rst.PipelineDataset(numbers),
        batch_size=None,
        num_workers=workers,
        persistent_workers=persistent,
        timeout=TIMEOUT if workers else 0,
    )


def passes(loader: Any, count: int) -> list[list[int]]:
    """``count`` passes of ``for batch in loader``, flattened, each batch as a list of ints."""
    return [ints(batch) for _ in range(count) for batch in loader]


# (whole epochs first, batches of the next, whether its StopIteration was seen)
POINTS = {
    "before_the_first": (0, 0, False),
    "first": (0, 1, False),
    "middle": (0, 3, False),
    "last": (0, EPOCH, False),
    "after_the_last": (0, EPOCH, True),
    "first_of_the_next_epoch": (1, 1, False),
    "middle_of_epoch_2": (2, 4, False),
}
WORKER_POINTS = {
    (1, False): ["before_the_first", "last", "first_of_the_next_epoch"],
    (2, False): ["middle", "last", "after_the_last", "first_of_the_next_epoch"],
    (2, True): ["first", "middle", "after_the_last", "first_of_the_next_epoch", "middle_of_epoch_2"],
}


@pytest.mark.parametrize(("workers", "persistent"), list(WORKER_POINTS), ids=["1-fresh", "2-fresh", "2-persistent"])
def test_a_stateful_dataloader_with_workers_resumes_at_every_point_of_an_epoch(workers: int, persistent: bool) -> None:
    """States at the start, after the first batch, the middle, the last batch, after the epoch's
    StopIteration and in later epochs, through torch.save or JSON, continued by a fresh
    StatefulDataLoader and restored a second time two batches later: the uninterrupted stream,
    every record once per epoch (the workers' shards end at different steps)."""
    total_epochs = 4
    whole = stateful(workers, persistent)
    expected = [passes(whole, 1) for _ in range(total_epochs)]
    del whole
    assert all(record_set(epoch) == list(range(RECORDS)) for epoch in expected)
    stream = [batch for epoch in expected for batch in epoch]
    for index, name in enumerate(WORKER_POINTS[(workers, persistent)]):
        done, k, finished = POINTS[name]
        first = stateful(workers, persistent)
        head = passes(first, done)
        iterator = iter(first)
        head += [ints(next(iterator)) for _ in range(k)]
        if finished:
            assert next(iterator, "ended") == "ended"
        state = through_torch(first.state_dict()) if index % 2 else roundtrip(first.state_dict())
        del iterator, first
        resumed = stateful(workers, persistent)
        resumed.load_state_dict(state)
        left = total_epochs - done - (1 if finished else 0)
        rest: list[list[int]] = []
        if k + 2 <= EPOCH and not finished:  # restore a second time two batches later
            iterator = iter(resumed)
            rest = [ints(next(iterator)) for _ in range(2)]
            again = roundtrip(resumed.state_dict())
            del iterator, resumed
            resumed = stateful(workers, persistent)
            resumed.load_state_dict(again)
        rest += passes(resumed, left)
        del resumed
        assert head + rest == stream, f"resumed at {name}"


# -- a torchdata graph inside a pipeline, under StatefulDataLoader and rst.Loader -----------------


def nested() -> rs.Node:
    """Our shuffled, sharded source in torchdata's Mapper, back in a pipeline: what a user who
    keeps a torchdata map step writes. Every epoch a new order (ToTorchdata's next epoch)."""
    inner = rst.ToTorchdata(rs.from_list(list(range(RECORDS))).shuffle(seed=3).shard())
    return rst.FromTorchdata(tn.Mapper(inner, double)).batch(BATCH)


def sampled() -> rs.Node:
    """torchdata's own sampler graph, reshuffled every pass (SamplerWrapper's set_epoch)."""
    data = list(range(8))
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=3)  # type: ignore[arg-type]  # a list is a sized dataset
    return rst.FromTorchdata(tn.MapStyleWrapper(data, sampler)).map(double).batch(4)  # type: ignore[arg-type]  # a list is map-style


@pytest.mark.parametrize(("workers", "persistent"), [(0, False), (2, True)], ids=["main", "2-persistent"])
def test_a_stateful_dataloader_over_a_torchdata_graph_in_a_pipeline_resumes_in_later_epochs(
    workers: int, persistent: bool
) -> None:
    """``FromTorchdata(Mapper(ToTorchdata(shard)))``: each worker's inner shard is its own, every
    record once per epoch, a new order every epoch; states in epochs 0, 1 and 2 (the pass count
    travels in the state) and at the end of an epoch continue exactly."""

    def make() -> StatefulDataLoader:
        return StatefulDataLoader(
            rst.PipelineDataset(nested), batch_size=None, num_workers=workers, persistent_workers=persistent
        )

    whole = make()
    expected = [passes(whole, 1) for _ in range(4)]
    del whole
    assert all(record_set(epoch) == list(range(RECORDS)) for epoch in expected)
    assert expected[0] != expected[1] != expected[2]
    for done, k in [(0, 3), (1, EPOCH), (2, 0), (2, 5)]:
        first = make()
        head = passes(first, done)
        iterator = iter(first)
        head += [ints(next(iterator)) for _ in range(k)]
        state = through_torch(first.state_dict())
        del iterator, first
        resumed = make()
        resumed.load_state_dict(state)
        rest = passes(resumed, 4 - done)
        del resumed
        assert head + rest == [batch for epoch in expected for batch in epoch], (done, k)


@pytest.mark.parametrize("build", [nested, sampled], ids=["to_torchdata_inside", "sampler_wrapper"])
@pytest.mark.parametrize(("workers", "persistent"), [(0, False), (1, True)], ids=["main", "persistent"])
def test_a_loader_state_after_the_epoch_over_a_torchdata_graph_resumes_into_the_next_epoch(
    build: Callable[[], rs.Node], workers: int, persistent: bool
) -> None:
    """docs/torch.md: a state taken after an epoch ended (its last batch and the StopIteration)
    resumes into the next epoch. The Loader starts that epoch on a freshly built pipeline with
    ``start_epoch(1)``, which a fresh FromTorchdata takes as the beginning of its torchdata node's
    first pass; it keeps the ended pipeline state only for pipelines with ``.even()``."""
    with rst.Loader(
        build, num_workers=workers, persistent_workers=persistent, timeout=TIMEOUT if workers else 0
    ) as whole:
        expected = [passes(whole, 1) for _ in range(2)]
    assert expected[0] != expected[1]  # each pass of the graph a new order
    with rst.Loader(build, num_workers=workers, persistent_workers=persistent) as loader:
        head = loader_head(loader, len(expected[0]), len(expected[0]), ints)
        state = roundtrip(loader.state_dict())
    assert head == expected[0]
    with rst.Loader(build, num_workers=workers, persistent_workers=persistent) as resumed:
        resumed.load_state_dict(state)
        assert passes(resumed, 1) == expected[1]


@pytest.mark.parametrize("build", [nested, sampled], ids=["to_torchdata_inside", "sampler_wrapper"])
def test_a_fresh_from_torchdata_told_epoch_1_gives_the_second_pass_or_refuses(build: Callable[[], rs.Node]) -> None:
    """What a DataLoader worker started fresh for epoch 1 does: ``start_epoch(1)`` on a newly built
    pipeline. Exact would be the uninterrupted pipeline's second pass; refusing is allowed."""
    whole = build()
    first, second = [ints(b) for b in whole], [ints(b) for b in whole]
    assert first != second
    fresh = build()
    got: list[Any] = []
    error = error_of(lambda: (fresh.start_epoch(1), got.extend(ints(b) for b in fresh)))
    if error is not None:  # refused at start_epoch or at the first item (a restore may come between)
        assert isinstance(error, rs.ConfigError) and got == [], repr(error)
        return
    assert got == second


def test_a_loader_with_fresh_workers_over_a_torchdata_graph_never_repeats_epoch_0_silently() -> None:
    """docs/torch.md asks for persistent workers with FromTorchdata; with fresh ones, epoch 1 should
    then be refused (ConfigError, as epoch 2 is), not epoch 0's order again."""
    with rst.Loader(sampled, num_workers=1, timeout=TIMEOUT) as loader:
        first = passes(loader, 1)
        second: list[Any] = []
        error = error_of(lambda: second.extend(passes(loader, 1)))
    assert record_set(first) == list(range(8))
    assert isinstance(error, rs.ConfigError) or second != first, repr(error)


def test_a_loader_over_a_torchdata_graph_with_persistent_workers_resumes_mid_epoch_twice() -> None:
    """rst.Loader, two persistent workers, each with its own inner shard inside the torchdata
    graph: every record once per epoch over three epochs, and states in epochs 0 and 1 (mid and
    last batch) restored twice in a row continue exactly into the following epoch."""

    def make() -> rst.Loader:
        return rst.Loader(nested, num_workers=2, persistent_workers=True, timeout=TIMEOUT)

    with make() as whole:
        expected = [passes(whole, 1) for _ in range(3)]
    assert all(record_set(epoch) == list(range(RECORDS)) for epoch in expected)
    assert expected[0] != expected[1]
    stream = expected[0] + expected[1]
    for stop, again_after in [(3, 2), (EPOCH - 1, 1), (EPOCH + 1, 3)]:
        with make() as loader:
            head = loader_head(loader, stop, EPOCH, ints)
            state = through_torch(loader.state_dict())
        with make() as resumed:
            resumed.load_state_dict(state)
            iterator = iter(resumed)
            middle = [ints(next(iterator)) for _ in range(again_after)]
            again = roundtrip(resumed.state_dict())
            del iterator
        with make() as last:
            last.load_state_dict(again)
            rest = until(last, len(stream) - len(head) - len(middle))
        assert head + middle + rest == stream, f"resumed at {stop}, then {again_after} later"


def until(loader: Any, count: int) -> list[list[int]]:
    """Passes of ``loader`` until ``count`` batches (a pass that only finishes an epoch whose last
    batch was handed out before the state is empty)."""
    found: list[list[int]] = []
    for _ in range(count + 2):
        if len(found) >= count:
            break
        found += passes(loader, 1)
    return found


# -- torchdata's Loader over our read-ahead nodes ----------------------------------------------------

SIZE = 10


def shuffled(seed: int = 1) -> rs.Node:
    return rs.from_list(list(range(SIZE))).shuffle(seed=seed)


READ_AHEAD: dict[str, tuple[Callable[[], tn.BaseNode], int]] = {
    "prefetcher_over_our_prefetch": (lambda: tn.Prefetcher(rst.ToTorchdata(shuffled().prefetch(2)), 2), SIZE),
    "batcher_over_our_thread_map": (
        lambda: tn.Batcher(rst.ToTorchdata(shuffled().map(double, num_workers=2, mode="thread")), 3, drop_last=False),
        4,
    ),
    "parallel_mapper_over_our_prefetch": (
        lambda: tn.ParallelMapper(rst.ToTorchdata(shuffled().prefetch(3)), times3, num_workers=2, method="thread"),
        SIZE,
    ),
    "mapper_over_nested_prefetchers": (
        lambda: tn.Mapper(
            rst.ToTorchdata(
                rst.FromTorchdata(tn.Prefetcher(rst.ToTorchdata(shuffled().prefetch(2).batch(2)), 2)).map(sum)
            ),
            double,
        ),
        5,
    ),
}


def td_take(loader: tn.Loader, count: int) -> list[Any]:
    """``count`` items as ``for epoch: for item in loader`` reads them (breaking right after the
    last one). A pass may be empty once (it finishes an epoch whose last item was handed out
    before a state); two empty passes in a row end it."""
    items: list[Any] = []
    empty = 0
    while len(items) < count and empty < 2:
        before = len(items)
        for item in loader:
            items.append(plain(item))
            if len(items) == count:
                break
        empty = empty + 1 if len(items) == before else 0
    return items


@pytest.mark.parametrize("name", READ_AHEAD)
def test_a_torchdata_loader_over_our_read_ahead_nodes_resumes_at_every_point(name: str) -> None:
    """Before the first item, after it, mid-epoch, at the last item, the first of the next epoch
    and in epoch 2, each state through torch.save (weights only), restored into a fresh graph;
    then restored twice in a row; then loaded into the used Loader itself (going back)."""
    graph, epoch = READ_AHEAD[name]
    total = 3 * epoch
    expected = td_take(tn.Loader(graph()), total)
    assert expected[:epoch] != expected[epoch : 2 * epoch]  # a new order each pass
    states = {}
    points = (0, 1, epoch // 2, epoch, epoch + 1, 2 * epoch + 1)
    if name == "parallel_mapper_over_our_prefetch":  # each of its resets waits for torchdata's threads
        points = (1, epoch // 2, epoch + 1)
    for k in points:
        first = tn.Loader(graph())
        head = td_take(first, k)
        states[k] = through_torch(first.state_dict())
        resumed = tn.Loader(graph())
        resumed.load_state_dict(states[k])
        assert head + td_take(resumed, total - k) == expected, f"resumed after {k}"
    for k, k2 in [(1, epoch // 2), (epoch + 1, 2 * epoch - 1)]:
        resumed = tn.Loader(graph())
        resumed.load_state_dict(states[k])
        middle = td_take(resumed, k2 - k)
        again = tn.Loader(graph())
        again.load_state_dict(roundtrip(resumed.state_dict()))
        assert expected[:k] + middle + td_take(again, total - k2) == expected, f"restored at {k}, {k2}"
    used = tn.Loader(graph())
    td_take(used, epoch + 2)
    used.load_state_dict(states[epoch // 2])
    assert td_take(used, total - epoch // 2) == expected[epoch // 2 :]


def test_our_state_inside_a_torchdata_loader_state_restores_the_bare_pipeline() -> None:
    """A checkpoint written by a ``tn.Loader(Batcher(ToTorchdata(pipe)))``: the pipeline's own
    state inside it restores the same pipeline used without torchdata, at the record after the
    last batch handed out, and its next epoch is the uninterrupted pipeline's."""
    loader = tn.Loader(tn.Batcher(rst.ToTorchdata(shuffled().map(double)), 3, drop_last=False))
    head = td_take(loader, 2)
    state = through_torch(loader.state_dict())
    bare = shuffled().map(double)
    bare.set_state(state["root"]["source"]["resumable"])
    reference = shuffled().map(double)
    epoch0, epoch1 = list(reference), list(reference)
    assert [x for batch in head for x in batch] + list(bare) == epoch0
    assert list(bare) == epoch1


# -- one checkpoint with our states and torchdata's -------------------------------------------------


def graph_for_checkpoint() -> tn.BaseNode:
    return tn.Prefetcher(tn.Batcher(rst.ToTorchdata(shuffled(4).map(double)), 3, drop_last=False), 2)


def chain_for_checkpoint() -> rs.Node:
    return rst.FromTorchdata(tn.Batcher(rst.ToTorchdata(shuffled(5)), 2, drop_last=False)).map(sum).repeat()


def sdl_for_checkpoint() -> StatefulDataLoader:
    return StatefulDataLoader(rst.PipelineDataset(numbers), batch_size=None)


def checkpoint_parts(steps: tuple[int, int, int, int]) -> tuple[list[Any], dict[str, Any]]:
    """Take ``steps`` items from a tn.Loader, a pipeline holding a torchdata graph, a
    StatefulDataLoader and an rst.Loader (each as a training loop reads), return what they gave
    and one checkpoint holding all four states beside a model's tensors."""
    graph_loader = tn.Loader(graph_for_checkpoint())
    chain = chain_for_checkpoint()
    sdl = sdl_for_checkpoint()
    seen = [td_take(graph_loader, steps[0]), [plain(x) for x in take(chain, steps[1])]]
    seen.append(td_take(sdl, steps[2]))  # type: ignore[arg-type]  # a DataLoader iterates like a tn.Loader
    with rst.Loader(numbers) as loader:
        seen.append(td_take(loader, steps[3]))  # type: ignore[arg-type]
        data = {
            "graph": graph_loader.state_dict(),
            "chain": chain.get_state(),
            "sdl": sdl.state_dict(),
            "loader": loader.state_dict(),
        }
    return seen, {"model": torch.nn.Linear(2, 1).state_dict(), "data": data, "step": sum(steps)}


def continue_from(data: dict[str, Any], counts: tuple[int, int, int, int]) -> list[Any]:
    graph_loader = tn.Loader(graph_for_checkpoint())
    graph_loader.load_state_dict(data["graph"])
    chain = chain_for_checkpoint()
    chain.set_state(data["chain"])
    sdl = sdl_for_checkpoint()
    sdl.load_state_dict(data["sdl"])
    rest = [td_take(graph_loader, counts[0]), [plain(x) for x in take(chain, counts[1])]]
    rest.append(td_take(sdl, counts[2]))  # type: ignore[arg-type]
    with rst.Loader(numbers) as loader:
        loader.load_state_dict(data["loader"])
        rest.append(td_take(loader, counts[3]))  # type: ignore[arg-type]
    return rest


@settings(max_examples=max(4, settings.default.max_examples // 2))
@given(
    steps=st.tuples(st.integers(0, 9), st.integers(0, 12), st.integers(0, 15), st.integers(0, 15)),
    how=st.sampled_from(["rst.save", "json"]),
)
def test_one_checkpoint_holding_our_states_and_torchdata_s_resumes_every_part(
    steps: tuple[int, int, int, int], how: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A torchdata Loader over our pipeline, our pipeline over a torchdata graph, a
    StatefulDataLoader over a PipelineDataset and an rst.Loader, checkpointed together at drawn
    steps (epoch ends and later epochs included) beside a model's tensors, written with rst.save
    and read with rst.load (weights only) or through JSON: every part continues exactly."""
    total = (12, 15, 20, 20)
    expected, _ = checkpoint_parts(total)
    seen, checkpoint = checkpoint_parts(steps)
    if how == "rst.save":
        path = tmp_path_factory.mktemp("ckpt") / "step.pt"
        rst.save(checkpoint, path)
        loaded = rst.load(path)
        assert torch.equal(loaded["model"]["weight"], checkpoint["model"]["weight"])
        data = loaded["data"]
    else:
        data = json.loads(json.dumps(checkpoint["data"]))
    rest = continue_from(data, tuple(t - s for t, s in zip(total, steps)))  # type: ignore[arg-type]
    for part, (head, tail, whole) in enumerate(zip(seen, rest, expected)):
        assert head + tail == whole, f"part {part} resumed after {steps[part]}"


# -- errors inside torchdata nodes over our pipelines -----------------------------------------------


class FailOn:
    """Raises ValueError on the record ``bad``, else doubles."""

    def __init__(self, bad: int) -> None:
        self.bad = bad

    def __call__(self, x: int) -> int:
        if x == self.bad:
            raise ValueError(f"record {x}")
        return 2 * x


def outcomes(iterator: Any, then: Callable[[], Any] | None = None) -> list[Any]:
    """Everything ``iterator`` gives until StopIteration: items, and ``("raised", type)`` for each
    exception; ``then()`` is called right after the first exception."""
    found: list[Any] = []
    while True:
        try:
            found.append(plain(next(iterator)))
        except StopIteration:
            return found
        except Exception as error:  # noqa: BLE001  # which type is the point
            found.append(("raised", type(error).__name__))
            if then is not None and sum(isinstance(x, tuple) for x in found) == 1:
                found.append(("state", then()))


def failing_graph(where: str) -> tn.BaseNode:
    fail = FailOn(5)
    source = rs.from_list(list(range(SIZE)))
    if where == "torchdata_mapper":
        return tn.Mapper(rst.ToTorchdata(source), fail)
    if where == "our_map":
        return tn.Mapper(rst.ToTorchdata(source.map(fail)), plain)
    return tn.Mapper(rst.ToTorchdata(source.map(fail, num_workers=2, mode="thread")), plain)


@pytest.mark.parametrize("where", ["torchdata_mapper", "our_map", "our_thread_map"])
def test_an_error_under_a_torchdata_loader_arrives_at_its_item_and_iteration_goes_on(where: str) -> None:
    """The function fails on one record: in torchdata's Mapper over our source, in our map, in our
    thread-pool map (a MapError with the record's key), all under tn.Mapper and tn.Loader. The
    error arrives at its item, the items after it follow, and a state taken right after the error
    continues with them in a fresh graph."""
    loader = tn.Loader(failing_graph(where))
    iterator = iter(loader)

    def after_the_error() -> list[Any]:
        resumed = tn.Loader(failing_graph(where))
        resumed.load_state_dict(roundtrip(loader.state_dict()))
        return list(resumed)

    found = outcomes(iterator, after_the_error)
    error_type = "MapError" if where == "our_thread_map" else "ValueError"
    after = [2 * x for x in range(6, SIZE)]
    assert found == [*(2 * x for x in range(5)), ("raised", error_type), ("state", after), *after]


def test_our_map_error_keeps_its_key_through_a_torchdata_mapper() -> None:
    node = failing_graph("our_thread_map")
    node.reset()
    assert [next(node) for _ in range(5)] == [0, 2, 4, 6, 8]
    with pytest.raises(rs.MapError) as caught:
        next(node)
    assert caught.value.key == (0, 5)
    assert next(node) == 12


def test_a_torchdata_mapper_error_inside_a_pipeline_behaves_as_our_own_map_error() -> None:
    """``FromTorchdata(Mapper(ToTorchdata(src), fn)).batch(3)`` gives, raises and resumes after
    the error exactly as ``src.map(fn).batch(3)`` does: the same outcomes, and a state taken
    right after the error continues with the same batches in both."""

    def ours() -> rs.Node:
        return rs.from_list(list(range(SIZE))).shuffle(seed=2).map(FailOn(4)).batch(3).repeat(2)

    def theirs() -> rs.Node:
        inner = rst.ToTorchdata(rs.from_list(list(range(SIZE))).shuffle(seed=2))
        return rst.FromTorchdata(tn.Mapper(inner, FailOn(4))).batch(3).repeat(2)

    found = []
    for build in (ours, theirs):
        pipe = build()

        def after(pipe: rs.Node = pipe, build: Callable[[], rs.Node] = build) -> list[Any]:
            resumed = build()
            resumed.set_state(through_torch(pipe.get_state()))
            return outcomes(resumed)

        found.append(outcomes(pipe, after))
    assert found[0] == found[1]
    assert found[0].count(("raised", "ValueError")) == 2  # once in each epoch


def test_a_source_error_under_a_torchdata_mapper_arrives_at_its_record_and_iteration_goes_on(tmp_path: Path) -> None:
    """A malformed JSONL line read through ToTorchdata under tn.Mapper: SourceError naming the
    file and line at that record, then the records after it; a state taken right after the error
    continues with them."""
    path = tmp_path / "data.jsonl"
    path.write_text("".join("{broken\n" if i == 3 else json.dumps({"x": i}) + "\n" for i in range(8)))

    def graph() -> tn.BaseNode:
        return tn.Mapper(rst.ToTorchdata(rs.jsonl(str(path))), lambda record: record["x"])

    loader = tn.Loader(graph())
    iterator = iter(loader)
    head = [next(iterator) for _ in range(3)]
    with pytest.raises(rs.SourceError, match=r"data\.jsonl:4"):
        next(iterator)
    state = roundtrip(loader.state_dict())
    rest = list(iterator)
    resumed = tn.Loader(graph())
    resumed.load_state_dict(state)
    assert head == [0, 1, 2] and rest == list(resumed) == [4, 5, 6, 7]


# -- foreign and damaged states ---------------------------------------------------------------------


def pipe_for_states() -> rs.Node:
    return rs.from_list(list(range(9))).shuffle(seed=2).shard().batch(2)


def chain_for_states() -> rs.Node:
    inner = rst.ToTorchdata(rs.from_list(list(range(9))).shuffle(seed=2))
    return rst.FromTorchdata(tn.Batcher(inner, 2, drop_last=False)).map(sum)


def every_kind_of_state() -> dict[str, Any]:
    """One state of each kind this area makes, each taken after one item."""
    states: dict[str, Any] = {}
    pipe = pipe_for_states()
    next(pipe)
    states["pipeline"] = pipe.get_state()
    chain = chain_for_states()
    next(chain)
    states["from_torchdata_chain"] = chain.get_state()
    node = rst.ToTorchdata(pipe_for_states())
    node.reset()
    next(node)
    states["to_torchdata_node"] = node.get_state()
    loader = tn.Loader(rst.ToTorchdata(pipe_for_states()))
    next(iter(loader))
    states["torchdata_loader"] = loader.state_dict()
    sdl = StatefulDataLoader(rst.PipelineDataset(pipe_for_states), batch_size=None)
    next(iter(sdl))
    states["stateful_dataloader"] = sdl.state_dict()
    with rst.Loader(pipe_for_states) as ours:
        next(iter(ours))
        states["rst_loader"] = ours.state_dict()
    other = rs.from_list(list(range(9))).shuffle(seed=7).shard().batch(2)
    next(other)
    states["other_seed"] = other.get_state()
    return roundtrip(states)


KINDS = [
    "from_torchdata_chain",
    "other_seed",
    "pipeline",
    "rst_loader",
    "stateful_dataloader",
    "to_torchdata_node",
    "torchdata_loader",
]


@functools.cache
def states_of_every_kind() -> str:
    return json.dumps(every_kind_of_state())


Outcome = tuple[Any, Callable[[], list[Any]]]


def pipeline_target(state: Any) -> Outcome:
    pipe = pipe_for_states()
    next(pipe)
    error = None if state is None else error_of(lambda: pipe.set_state(state))
    return error, lambda: [plain(b) for b in pipe] + [pipe.get_state()]


def chain_target(state: Any) -> Outcome:
    chain = chain_for_states()
    next(chain)
    error = None if state is None else error_of(lambda: chain.set_state(state))
    return error, lambda: [*chain, chain.get_state()]


def node_target(state: Any) -> Outcome:
    node = rst.ToTorchdata(pipe_for_states())
    node.reset()
    next(node)
    error = None if state is None else error_of(lambda: node.reset(state))
    return error, lambda: [plain(b) for b in node] + [node.get_state()]


def loader_target(state: Any) -> Outcome:
    loader = rst.Loader(pipe_for_states)
    iterator = iter(loader)
    next(iterator)
    error = None if state is None else error_of(lambda: loader.load_state_dict(state))
    return error, lambda: [ints(b) for b in iterator] + [loader.state_dict()] + [ints(b) for b in loader]


TARGETS: dict[str, tuple[Callable[[Any], Outcome], str]] = {
    "pipeline.set_state": (pipeline_target, "pipeline"),
    "from_torchdata_chain.set_state": (chain_target, "from_torchdata_chain"),
    "to_torchdata_node.reset": (node_target, "to_torchdata_node"),
    "rst_loader.load_state_dict": (loader_target, "rst_loader"),
}


@pytest.mark.parametrize(
    ("target", "kind"), [(target, kind) for target, (_, own) in TARGETS.items() for kind in KINDS if kind != own]
)
def test_a_state_of_another_kind_is_a_state_error_and_changes_nothing(target: str, kind: str) -> None:
    """Every kind of state given where another kind belongs (a torchdata Loader's state to a
    pipeline, a StatefulDataLoader's to an rst.Loader, our pipeline's to ToTorchdata, another
    seed's anywhere): StateError, and the object goes on exactly as an untouched one."""
    make, _ = TARGETS[target]
    error, rest = make(json.loads(states_of_every_kind())[kind])
    assert isinstance(error, rs.StateError), repr(error)
    _, untouched = make(None)
    assert rest() == untouched()


def paths_in(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found = [prefix] if prefix else []
    if isinstance(value, dict):
        for key, item in value.items():
            found += paths_in(item, (*prefix, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found += paths_in(item, (*prefix, index))
    return found


ODD_VALUES = [None, -1, 0, 2**70, "x", "", [], {}, 1.5, True, [1, 2], {"kind": "Batch"}, "DELETE"]


def damaged(state: dict[str, Any], data: Any) -> dict[str, Any]:
    """``state`` with one entry anywhere replaced by an odd value, or deleted."""
    state = copy.deepcopy(state)
    path = data.draw(st.sampled_from(paths_in(state)))
    value = data.draw(st.sampled_from(ODD_VALUES))
    parent = state
    for key in path[:-1]:
        parent = parent[key]
    if value == "DELETE" and isinstance(parent, dict):
        del parent[path[-1]]
    else:
        parent[path[-1]] = copy.deepcopy(value)
    return state


def deep_chain() -> rs.Node:
    """Ours over torchdata over ours: a filter and a repeat outside, a Batcher and a thread map inside."""
    inner = rst.ToTorchdata(rs.from_list(list(range(12))).shuffle(seed=4).map(double, num_workers=2, mode="thread"))
    return rst.FromTorchdata(tn.Batcher(inner, 3, drop_last=False)).filter(lambda b: sum(b) % 3 != 1).repeat(2)


@settings(max_examples=max(6, settings.default.max_examples))
@given(data=st.data(), taken=st.integers(0, 9))
def test_a_damaged_state_of_a_chain_through_torchdata_is_a_state_error_that_changes_nothing(
    data: Any, taken: int
) -> None:
    """Ours > torchdata Batcher > ours, any one entry of its state damaged: set_state raises
    StateError and the pipeline goes on exactly as before, or takes the state and then iterates
    without any error that is not ours."""
    with deep_chain() as pipe:
        take(pipe, taken)
        good = pipe.get_state()
        bad = damaged(good, data)
        error = error_of(lambda: pipe.set_state(bad))
        if error is None:
            outcome = error_of(lambda: take(pipe, 30))
            assert outcome is None or isinstance(outcome, rs.ResumableError), repr(outcome)
            return
        assert isinstance(error, rs.StateError), repr(error)
        assert pipe.get_state() == good
        rest = take(pipe, 30)
    with deep_chain() as fresh:
        fresh.set_state(good)
        assert rest == take(fresh, 30)


@settings(max_examples=max(6, settings.default.max_examples))
@given(data=st.data(), taken=st.integers(0, 8))
def test_a_damaged_to_torchdata_state_inside_a_torchdata_loader_is_a_state_error(data: Any, taken: int) -> None:
    """A ``tn.Loader(Batcher(ToTorchdata(pipe)))`` state whose pipeline part is damaged: the next
    ``iter()`` raises StateError or goes on without an error that is not ours; after a
    StateError the pipeline inside is as it was, and the same Loader takes the good state next and
    continues exactly."""

    def graph(pipe: rs.Node) -> tn.BaseNode:
        return tn.Batcher(rst.ToTorchdata(pipe), 2, drop_last=False)

    def source() -> rs.Node:
        return rs.from_list(list(range(11))).shuffle(seed=6).map(double).prefetch(2)

    with source() as whole:
        expected = td_take(tn.Loader(graph(whole)), taken + 12)[taken:]
    with source() as first_pipe:
        first = tn.Loader(graph(first_pipe))
        td_take(first, taken)
        good = roundtrip(first.state_dict())
    bad = copy.deepcopy(good)
    bad["root"]["source"]["resumable"] = damaged(good["root"]["source"]["resumable"], data)
    with source() as pipe:
        loader = tn.Loader(graph(pipe))
        td_take(loader, 1)
        before = pipe.get_state()
        loader.load_state_dict(bad)
        error = error_of(lambda: iter(loader))
        if error is None:
            outcome = error_of(lambda: td_take(loader, 12))
            assert outcome is None or isinstance(outcome, rs.ResumableError), repr(outcome)
            return
        assert isinstance(error, rs.StateError), repr(error)
        assert pipe.get_state() == before
        loader.load_state_dict(good)
        assert td_take(loader, 12) == expected


# -- threads: close, reset and drop -------------------------------------------------------------------


def new_threads(before: set[threading.Thread], prefix: str = "") -> list[str]:
    """The names of the live threads started since ``before`` was taken (``prefix``: ours only)."""
    return sorted(t.name for t in set(threading.enumerate()) - before if t.name.startswith(prefix))


@pytest.mark.parametrize("inner", ["prefetch", "thread_map"])
def test_close_stops_our_threads_inside_a_torchdata_graph(inner: str) -> None:
    """docs/parallel.md: ``pipe.close()`` from the top of any pipeline stops the threads and pools
    of every node below it, and iterating on afterwards continues after the last item."""
    before = set(threading.enumerate())
    source = shuffled()
    source = source.prefetch(2) if inner == "prefetch" else source.map(double, num_workers=2, mode="thread")
    pipe = rst.FromTorchdata(tn.Batcher(rst.ToTorchdata(source), 2, drop_last=False)).map(sum).repeat()
    epoch = list(shuffled() if inner == "prefetch" else shuffled().map(double))
    head = take(pipe, 2)
    assert new_threads(before, "resumable-")
    pipe.close()
    try:
        left = new_threads(before, "resumable-")
        assert left == [], f"still running after close(): {left}"
    finally:
        assert head + take(pipe, 3) == [a + b for a, b in zip(epoch[::2], epoch[1::2])]
        source.close()


def test_resets_and_restores_of_a_torchdata_prefetcher_over_our_read_ahead_keep_one_set_of_threads() -> None:
    """tn.Loader over Prefetcher over our prefetch and thread map: broken-off epochs and restores,
    many times; the threads stay one set (torchdata's reader and ours), the next whole epoch holds
    every record once, and dropping the Loader stops them all."""
    before = set(threading.enumerate())
    pipe = rs.from_list(list(range(8))).shuffle(seed=1).prefetch(2).map(double, num_workers=2, mode="thread")
    loader = tn.Loader(tn.Prefetcher(rst.ToTorchdata(pipe), 2))
    state = None
    most = 0
    for round_ in range(8):
        if round_ % 3 == 2 and state is not None:
            loader.load_state_dict(state)
        iterator = iter(loader)
        next(iterator)
        state = loader.state_dict()
        most = max(most, len(new_threads(before)))
        del iterator
    assert most <= 4  # torchdata's reader, our prefetch thread and our two map threads
    assert sorted(x // 2 for x in loader) == list(range(8))
    del loader, pipe
    gc.collect()
    wait_until(lambda: not new_threads(before), "every thread of the dropped Loader to stop")


def test_a_dropped_pipeline_over_a_torchdata_graph_frees_our_nodes_inside_at_once() -> None:
    """No cycle keeps the nodes inside a FromTorchdata alive: with the collector off, dropping the
    pipeline frees them, and their thread stops."""
    before = set(threading.enumerate())
    source = shuffled().prefetch(2)
    inside = weakref.ref(source)
    holder = [rst.FromTorchdata(tn.Batcher(rst.ToTorchdata(source), 2, drop_last=False)).batch(2)]
    del source
    next(holder[0])
    assert new_threads(before, "resumable-") == ["resumable-Prefetch"]
    gc.disable()
    try:
        holder.pop()
        assert inside() is None
    finally:
        gc.enable()
    wait_until(lambda: not new_threads(before, "resumable-"), "our prefetch thread to stop")


def test_loader_workers_over_a_torchdata_graph_with_our_read_ahead_leave_nothing_behind() -> None:
    """rst.Loader, persistent workers whose pipelines hold torchdata's Prefetcher over our prefetch:
    every record once per epoch, a new order each epoch, and no worker or thread is left once the
    Loader is closed."""

    def build() -> rs.Node:
        inner = rst.ToTorchdata(rs.from_list(list(range(RECORDS))).shuffle(seed=3).shard().map(double).prefetch(2))
        return rst.FromTorchdata(tn.Prefetcher(inner, 2)).batch(BATCH)

    before = set(threading.enumerate())
    with rst.Loader(build, num_workers=2, persistent_workers=True, timeout=TIMEOUT) as loader:
        epochs = [passes(loader, 1) for _ in range(2)]
    assert all(record_set(epoch) == list(range(RECORDS)) for epoch in epochs) and epochs[0] != epochs[1]
    assert multiprocessing.active_children() == []
    gc.collect()
    wait_until(lambda: not new_threads(before), "the Loader's threads to stop")
