"""Adversary of epoch edges: the points around where an epoch ends and the next begins, through
every source kind and every way of iterating.

Pipelines: each source kind (``rs.from_list``, ``rs.jsonl`` over three files, ``rs.parquet``
over two files of several row groups, ``rs.arrow`` over two files of several record batches,
``rs.jsonl_stream`` over four files with ``shuffle_files``) alone, and under three chains:
shuffle -> shard -> map -> batch(3); shuffle -> shard -> filter -> map -> batch(3,
drop_last=True); shuffle -> shard -> map -> pack(best_fit) -> batch(2) (a stream has no
shuffle or shard: it splits by file). 23 records, so no epoch length is a multiple of the batch
size or of the worker count.

Iteration: the pipeline itself; ``rs.torch.Loader`` with 0, 1 and 2 workers and 2 persistent
ones; torchdata's ``StatefulDataLoader`` over ``rs.torch.PipelineDataset`` without workers and
with 2 persistent ones.

A run is a training loop's script: for each epoch ``iter()``, ``next()`` for each item, then
the ``next()`` that raises ``StopIteration``. It is cut before the first item, after it, in the
middle, after the last item (before ``StopIteration``), after ``StopIteration``, after the
``iter()`` that begins the next epoch (before its first item), after that epoch's first item
and at the last item of the third epoch. At a cut the state is taken (twice: both agree), a
freshly built object loads it and the script goes on: the run must equal the uninterrupted one
epoch for epoch, over three or four epochs, also when the state is loaded twice in a row and
when the run is cut at every edge in turn. Without workers the states at each point also equal
those of the uninterrupted run, and ``len()`` is what each epoch yields (also after a restore),
or a ``TypeError`` naming the node. Then epochs of nothing (everything filtered out, empty
files, ``drop_last`` with fewer rows than a batch), empty epochs between full ones, workers
with nothing to read, and sources with no files at all. Tests marked ``xfail(strict=True)``
are bugs this file found.
"""

from __future__ import annotations

import functools
import gzip
import json
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from torchdata.stateful_dataloader import StatefulDataLoader

import resumable as rs
import resumable.torch as rst
from resumable.loader_state import parse_loader_state
from resumable.pack import collate_rows
from tests.resume import plain

pytestmark = [
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated"),
    pytest.mark.filterwarnings("ignore:This DataLoader will create"),
]

RECORDS = 23
TIMEOUT = 60  # seconds: a worker that never answers fails the test instead of hanging it
END = object()


# -- records, functions, files ------------------------------------------------------------------


def records(count: int = RECORDS) -> list[dict[str, Any]]:
    """Documents of 1 to 11 tokens; token ``t`` of document ``i`` is ``100*i + t``."""
    return [{"id": i, "input_ids": [100 * i + t for t in range((7 * i) % 11 + 1)]} for i in range(count)]


def shift(record: dict[str, Any]) -> dict[str, Any]:
    return {"id": record["id"], "input_ids": [int(t) + 1 for t in record["input_ids"]]}


def keep(record: dict[str, Any]) -> bool:
    return int(record["id"]) % 3 != 1


def nothing(record: dict[str, Any]) -> bool:
    return False


def only_zero(record: dict[str, Any]) -> bool:
    return int(record["id"]) == 0


def even_id(record: dict[str, Any]) -> bool:
    return int(record["id"]) % 2 == 0


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def write_parquet(path: Path, rows: list[dict[str, Any]], group: int) -> str:
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=group)
    return str(path)


def write_arrow(path: Path, rows: list[dict[str, Any]], chunk: int) -> str:
    table = pa.Table.from_pylist(rows)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=chunk):
            writer.write_batch(batch)
    return str(path)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    root = tmp_path_factory.mktemp("epoch-edges")
    rows = records()
    empty = root / "empty.jsonl"
    empty.write_text("")
    with gzip.open(root / "empty.jsonl.gz", "wt") as handle:
        handle.write("")
    return {
        "jsonl": [
            write_jsonl(root / f"part{i}.jsonl", rows[a:b]) for i, (a, b) in enumerate([(0, 8), (8, 15), (15, 23)])
        ],
        "parquet": [write_parquet(root / "a.parquet", rows[:12], 3), write_parquet(root / "b.parquet", rows[12:], 4)],
        "arrow": [write_arrow(root / "a.arrow", rows[:10], 4), write_arrow(root / "b.arrow", rows[10:], 4)],
        "stream": [
            write_jsonl(root / f"stream{i}.jsonl", rows[a:b])
            for i, (a, b) in enumerate([(0, 7), (7, 12), (12, 18), (18, 23)])
        ],
        "empty_stream": [str(empty), str(root / "empty.jsonl.gz")],
        "half_empty_stream": [str(empty), write_jsonl(root / "half.jsonl", rows[:6])],
    }


# -- pipelines ----------------------------------------------------------------------------------

KINDS = ["list", "jsonl", "parquet", "arrow", "stream"]
CHAINS = ["source", "batched", "filtered", "packed"]


def source(kind: str, paths: dict[str, list[str]]) -> rs.Node[Any]:
    if kind == "list":
        return rs.from_list(records())
    if kind == "jsonl":
        return rs.jsonl(paths["jsonl"])
    if kind == "parquet":
        return rs.parquet(paths["parquet"])
    if kind == "arrow":
        return rs.arrow(paths["arrow"])
    if kind == "stream":
        return rs.jsonl_stream(paths["stream"], shuffle_files=5)
    raise ValueError(kind)


def build(kind: str, chain: str, paths: dict[str, list[str]]) -> rs.Node[Any]:
    pipe = source(kind, paths)
    if chain == "source":
        return pipe
    if kind != "stream":
        pipe = pipe.shuffle(7).shard()
    if chain == "batched":
        return pipe.map(shift).batch(3)
    if chain == "filtered":
        return pipe.filter(keep).map(shift).batch(3, drop_last=True)
    if chain == "packed":
        return pipe.map(shift).pack(8, strategy="best_fit", buffer_size=3).batch(2, collate_fn=collate_rows)
    raise ValueError(chain)


def unknown_length(kind: str, chain: str) -> str | None:
    """The node that ``len()`` must name, or None where the length is known."""
    if chain == "filtered":
        return "Filter"
    if chain == "packed":
        return "Pack"
    return "JsonlStream" if kind == "stream" else None


def roundtrip(state: Any) -> Any:
    return json.loads(json.dumps(state))


# -- ways of iterating --------------------------------------------------------------------------


class Mode:
    """How a pipeline is iterated, saved and restored."""

    workers = 0

    def make(self, factory: Callable[[], rs.Node[Any]]) -> Any:
        raise NotImplementedError

    def state(self, obj: Any) -> Any:
        return roundtrip(obj.state_dict())

    def load(self, obj: Any, state: Any) -> None:
        obj.load_state_dict(roundtrip(state))

    def close(self, obj: Any) -> None:
        obj.close()


class Alone(Mode):
    def make(self, factory: Callable[[], rs.Node[Any]]) -> Any:
        return factory()

    def state(self, obj: Any) -> Any:
        return roundtrip(obj.get_state())

    def load(self, obj: Any, state: Any) -> None:
        obj.set_state(roundtrip(state))


class Through(Mode):
    def __init__(self, workers: int, persistent: bool = False) -> None:
        self.workers, self.persistent = workers, persistent

    def make(self, factory: Callable[[], rs.Node[Any]]) -> Any:
        timeout = TIMEOUT if self.workers else 0
        return rst.Loader(factory, num_workers=self.workers, persistent_workers=self.persistent, timeout=timeout)


class Stateful(Mode):
    def __init__(self, workers: int, persistent: bool = False) -> None:
        self.workers, self.persistent = workers, persistent

    def make(self, factory: Callable[[], rs.Node[Any]]) -> Any:
        return StatefulDataLoader(
            rst.PipelineDataset(factory),
            batch_size=None,
            num_workers=self.workers,
            persistent_workers=self.persistent,
            timeout=TIMEOUT if self.workers else 0,
        )

    def close(self, obj: Any) -> None:
        iterator = getattr(obj, "_iterator", None)
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()


MODES: dict[str, Mode] = {
    "alone": Alone(),
    "loader0": Through(0),
    "loader1": Through(1),
    "loader2": Through(2),
    "loader2p": Through(2, persistent=True),
    "sdl0": Stateful(0),
    "sdl2p": Stateful(2, persistent=True),
}


# -- the script of a training loop, and cuts in it ------------------------------------------------


def script(lengths: list[int]) -> list[str]:
    """A training loop over epochs of these lengths: ``iter``, a ``next`` per item, ``stop``."""
    actions: list[str] = []
    for length in lengths:
        actions += ["iter"] + ["next"] * length + ["stop"]
    return actions


POINTS = ["fresh", "iter0", "first", "mid", "last", "stopped", "iter1", "first1", "last2"]
TWICE = {"iter0", "last", "stopped", "iter1", "last2"}  # where a state is also loaded twice in a row


def cut_index(point: str, lengths: list[int]) -> int:
    """How many actions of ``script(lengths)`` come before the cut at ``point``."""
    start1 = lengths[0] + 2
    start2 = start1 + lengths[1] + 2
    return {
        "fresh": 0,
        "iter0": 1,
        "first": 2,
        "mid": 1 + lengths[0] // 2,
        "last": 1 + lengths[0],
        "stopped": start1,
        "iter1": start1 + 1,
        "first1": start1 + 2,
        "stopped1": start2,
        "last2": start2 + 1 + lengths[2],
    }[point]


class Run:
    """What a run gave: one list of items per epoch, and the states taken at the cuts and at the
    captured points, by the index of the action they came before."""

    def __init__(self) -> None:
        self.loops: list[list[Any]] = []
        self.states: dict[int, Any] = {}


def epoch_at(actions: list[str], index: int) -> int:
    """The epoch of the pipeline after ``actions[:index]``: the last one begun (0 at first)."""
    return max(0, actions[:index].count("iter") - 1)


def play(
    mode: Mode,
    factory: Callable[[], rs.Node[Any]],
    lengths: list[int],
    cuts: set[int] = frozenset(),  # type: ignore[assignment]
    capture: set[int] = frozenset(),  # type: ignore[assignment]
    twice: bool = False,
    length_of: str | None = "unchecked",
) -> Run:
    """Play ``script(lengths)``; before the actions whose indices are in ``cuts``, take the state
    (twice, checked equal), close the object, load the state into a freshly made one (with
    ``twice``, take its state at once and load that into yet another) and go on with it. With
    ``length_of`` (None: a known length; a name: the node a TypeError names) check ``len()`` at
    each epoch's start and after each restore."""
    actions = script(lengths)
    run = Run()
    obj = mode.make(factory)
    iterator: Any = None
    inside = False

    def check_length(epoch: int) -> None:
        if length_of == "unchecked":
            return
        if length_of is None:
            assert len(obj) == lengths[epoch], (epoch, lengths)
        else:
            with pytest.raises(TypeError, match=length_of):
                len(obj)

    try:
        for index, action in enumerate([*actions, "end"]):
            if index in cuts or index in capture:
                state = mode.state(obj)
                assert mode.state(obj) == state, "two states taken at the same point differ"
                run.states[index] = state
            if index in cuts:
                mode.close(obj)
                obj = mode.make(factory)
                mode.load(obj, state)
                if twice:
                    again = mode.state(obj)
                    mode.close(obj)
                    obj = mode.make(factory)
                    mode.load(obj, again)
                check_length(epoch_at(actions, index))
                if inside:
                    iterator = iter(obj)  # the training loop goes on: a resumed loop
            if action == "iter":
                iterator = iter(obj)
                run.loops.append([])
                inside = True
                check_length(len(run.loops) - 1)
            elif action == "next":
                item = next(iterator, END)
                assert item is not END, f"the epoch ended early, at action {index}"
                run.loops[-1].append(plain(item))
            elif action == "stop":
                item = next(iterator, END)
                assert item is END, f"the epoch went on past its end, at action {index}: {plain(item)}"
                inside = False
    finally:
        mode.close(obj)
    return run


EPOCHS = 4
_UNINTERRUPTED: dict[tuple[str, str, str], list[list[Any]]] = {}


def uninterrupted(mode_name: str, kind: str, chain: str, factory: Callable[[], rs.Node[Any]]) -> list[list[Any]]:
    """``EPOCHS`` epochs of a fresh object, one loop each (module-level cache)."""
    key = (mode_name, kind, chain)
    if key not in _UNINTERRUPTED:
        mode = MODES[mode_name]
        obj = mode.make(factory)
        try:
            _UNINTERRUPTED[key] = [[plain(item) for item in obj] for _ in range(EPOCHS)]
        finally:
            mode.close(obj)
    return _UNINTERRUPTED[key]


def epochs_for(point: str) -> int:
    """Epochs a run cut at ``point`` covers: three, or four past the third epoch's last item."""
    return 4 if point == "last2" else 3


# -- the uninterrupted runs themselves ---------------------------------------------------------


@pytest.mark.parametrize("chain", CHAINS)
@pytest.mark.parametrize("kind", KINDS)
def test_each_epoch_holds_every_record_once_in_a_new_order(files: dict, kind: str, chain: str) -> None:
    """The premise of the cuts: without workers, each epoch has the same records (those the
    chain keeps), a shuffled one in another order each time, and the lengths the cuts need."""
    expected = uninterrupted("alone", kind, chain, functools.partial(build, kind, chain, files))
    ids = [epoch_ids(loop, chain) for loop in expected]
    assert all(epoch == ids[0] for epoch in ids)
    if chain in ("source", "batched", "packed"):
        assert ids[0] == list(range(RECORDS))
    if chain != "source":
        assert len({json.dumps(loop) for loop in expected}) == EPOCHS, "an epoch repeated the order of another"
    assert all(len(loop) >= 3 for loop in expected)


def ids_in(loop: list[Any]) -> list[int]:
    """Record ids in a loop's items: documents, batches of them, or packed batches (the ids of
    their real tokens, ``100*i + t + 1``, once per row: a split document shows in two rows)."""
    found: list[int] = []
    for item in loop:
        if isinstance(item, list):
            found += ids_in(item)
        elif "id" in item:
            found.append(item["id"])
        else:
            for tokens, documents in zip(np.asarray(item["input_ids"]), np.asarray(item["document_ids"])):
                found += sorted({(int(t) - 1) // 100 for t, d in zip(tokens, documents) if d})
    return found


def epoch_ids(loop: list[Any], chain: str) -> list[int]:
    ids = ids_in(loop)
    return sorted(set(ids)) if chain == "packed" else sorted(ids)


# -- one cut at each edge, without workers (every source and chain) -------------------------------

CHEAP = [
    *[("alone", kind, chain) for kind in KINDS for chain in CHAINS],
    ("loader0", "list", "batched"),
    ("loader0", "parquet", "packed"),
    ("loader0", "stream", "filtered"),
    ("sdl0", "arrow", "filtered"),
    ("sdl0", "stream", "batched"),
]
_REFERENCE: dict[tuple[str, str, str], Run] = {}


def reference_run(mode_name: str, kind: str, chain: str, factory: Callable[[], rs.Node[Any]]) -> Run:
    """An uninterrupted run with its states at every point of four epochs (module-level cache)."""
    key = (mode_name, kind, chain)
    if key not in _REFERENCE:
        lengths = [len(loop) for loop in uninterrupted(mode_name, kind, chain, factory)]
        _REFERENCE[key] = play(MODES[mode_name], factory, lengths, capture=set(range(len(script(lengths)) + 1)))
    return _REFERENCE[key]


@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize(("mode_name", "kind", "chain"), CHEAP, ids=["-".join(case) for case in CHEAP])
def test_a_cut_at_an_epoch_edge_resumes_exactly_once_and_twice_in_a_row(
    files: dict, mode_name: str, kind: str, chain: str, point: str
) -> None:
    """One cut at ``point``: the run equals the uninterrupted one over three epochs (four for
    ``last2``), also loading the state twice in a row at the edges themselves; without workers
    the state equals that of an uninterrupted run at the same point, and ``len()`` after the
    restore and at each epoch's start is the epoch's (or a TypeError naming the node)."""
    factory = functools.partial(build, kind, chain, files)
    expected = uninterrupted(mode_name, kind, chain, factory)
    epochs = epochs_for(point)
    lengths = [len(loop) for loop in expected[:epochs]]
    cut = cut_index(point, lengths)
    mode = MODES[mode_name]
    length_of: str | None = "unchecked"
    if mode_name == "alone":
        length_of = unknown_length(kind, chain)
    # A packer's state depends on the states taken before it (an earlier whole state and the log
    # since, docs/state.md), so the reference takes one at the cut alone, as the cut run does.
    reference = play(mode, factory, lengths, capture={cut}) if mode_name == "alone" else None
    for twice in (False, True) if point in TWICE else (False,):
        run = play(mode, factory, lengths, cuts={cut}, twice=twice, length_of=length_of)
        assert run.loops == expected[:epochs], (point, twice)
        if reference is not None:
            assert run.states[cut] == reference.states[cut]


@pytest.mark.parametrize(("mode_name", "kind", "chain"), CHEAP[:20], ids=["-".join(case) for case in CHEAP[:20]])
def test_states_after_restores_at_every_edge_equal_the_uninterrupted_run_s(
    files: dict, mode_name: str, kind: str, chain: str
) -> None:
    """Cut at every edge in turn, one run: every state taken after a restore equals the state of
    the uninterrupted run at the same point (counters, buffers, epochs all restored)."""
    factory = functools.partial(build, kind, chain, files)
    expected = uninterrupted(mode_name, kind, chain, factory)
    lengths = [len(loop) for loop in expected]
    cuts = {cut_index(point, lengths) for point in POINTS}
    every = set(range(len(script(lengths)) + 1))
    reference = reference_run(mode_name, kind, chain, factory).states
    run = play(MODES[mode_name], factory, lengths, cuts=cuts, capture=every)
    assert run.loops == expected
    for index in sorted(every):
        assert run.states[index] == reference[index], index


AGREE = [("list", "packed"), ("jsonl", "filtered"), ("parquet", "batched"), ("arrow", "packed"), ("stream", "packed")]


@pytest.mark.parametrize(("kind", "chain"), AGREE, ids=["-".join(case) for case in AGREE])
def test_a_loader_without_workers_saves_the_pipeline_s_own_state_at_every_point(
    files: dict, kind: str, chain: str
) -> None:
    """States taken at the same point two ways agree: at every point of four epochs (before the
    first iter(), after each iter(), item and StopIteration), the pipeline state inside the
    state of a Loader without workers is the state of the pipeline iterated alone."""
    factory = functools.partial(build, kind, chain, files)
    lengths = [len(loop) for loop in uninterrupted("alone", kind, chain, factory)]
    every = set(range(len(script(lengths)) + 1))
    alone = reference_run("alone", kind, chain, factory)
    through = play(MODES["loader0"], factory, lengths, capture=every)
    assert through.loops == alone.loops
    for index in sorted(every):
        assert parse_loader_state(through.states[index]).pipelines == [alone.states[index]], index


# -- every edge in one run, with workers -----------------------------------------------------------

WORKER_CASES = [
    ("loader1", "parquet", "filtered"),
    ("loader2", "jsonl", "packed"),
    ("loader2p", "arrow", "filtered"),
    ("loader2p", "stream", "packed"),
    ("sdl2p", "stream", "filtered"),
]


@pytest.mark.parametrize(("mode_name", "kind", "chain"), WORKER_CASES, ids=["-".join(case) for case in WORKER_CASES])
def test_a_run_cut_at_every_edge_in_turn_with_workers_equals_the_uninterrupted_one(
    files: dict, mode_name: str, kind: str, chain: str
) -> None:
    """Four epochs cut before the first item, after it, in the middle, at the last item, after
    StopIteration, after the next iter(), after that epoch's first item and at the third
    epoch's last: each time a new loader loads the state and the loop goes on."""
    factory = functools.partial(build, kind, chain, files)
    expected = uninterrupted(mode_name, kind, chain, factory)
    for loop in expected:  # each record at most once (drop_last drops a worker's own tail)
        ids = epoch_ids(loop, chain)
        assert len(ids) == len(set(ids))
        assert set(ids) <= {i for i in range(RECORDS) if chain != "filtered" or keep({"id": i})}
    lengths = [len(loop) for loop in expected]
    cuts = {cut_index(point, lengths) for point in POINTS}
    run = play(MODES[mode_name], factory, lengths, cuts=cuts, twice=kind == "arrow")
    assert run.loops == expected


def test_a_state_taken_twice_in_a_row_after_restore_at_the_iter_of_an_epoch_resumes_exactly(files: dict) -> None:
    """Restored, then its state taken at once and restored again, at the iter() that began the
    second epoch (2 fresh workers, 23 records in batches of 3; the persistent case above
    restores twice at every edge)."""
    factory = functools.partial(build, "list", "batched", files)
    expected = uninterrupted("loader2", "list", "batched", factory)
    lengths = [len(loop) for loop in expected[:3]]
    run = play(MODES["loader2"], factory, lengths, cuts={cut_index("iter1", lengths)}, twice=True)
    assert run.loops == expected[:3]


# -- len() against what is yielded ---------------------------------------------------------------


@pytest.mark.parametrize("chain", CHAINS)
@pytest.mark.parametrize("kind", KINDS)
def test_len_of_a_loader_is_its_pipeline_s_without_workers_and_a_type_error_with_them(
    files: dict, kind: str, chain: str
) -> None:
    factory = functools.partial(build, kind, chain, files)
    name = unknown_length(kind, chain)
    with rst.Loader(factory) as loader:
        if name is None:
            assert len(loader) == len(factory()) == len(uninterrupted("loader0", kind, chain, factory)[0])
        else:
            with pytest.raises(TypeError, match=name):
                len(loader)
    with rst.Loader(factory, num_workers=1, timeout=TIMEOUT) as loader, pytest.raises(TypeError):
        len(loader)


@pytest.mark.parametrize("rank", [0, 1, 2])
@pytest.mark.parametrize("kind", ["list", "jsonl", "parquet", "arrow"])
def test_len_of_each_consumer_is_what_it_yields_in_each_epoch_and_after_a_restore_at_each_edge(
    files: dict, kind: str, rank: int
) -> None:
    """Three consumers of 23 records in batches of 4 (8, 8 and 7 records: 2, 2 and 2 batches)."""

    def consumer() -> rs.Node[Any]:
        return source(kind, files).shuffle(3).shard(rank, 3).map(shift).batch(4)

    whole = consumer()
    length = len(whole)
    assert length == len(list(whole)) == 2
    for point in ("iter0", "last", "stopped", "iter1", "last2"):
        lengths = [length] * epochs_for(point)
        run = play(MODES["alone"], consumer, lengths, cuts={cut_index(point, lengths)}, length_of=None)
        assert [len(loop) for loop in run.loops] == lengths


# -- epochs of nothing ----------------------------------------------------------------------------


def empty_by_filter(kind: str, paths: dict[str, list[str]]) -> rs.Node[Any]:
    pipe = source(kind, paths)
    if kind != "stream":
        pipe = pipe.shuffle(1).shard()
    return pipe.filter(nothing).map(shift).batch(3)


def short_of_a_batch(paths: dict[str, list[str]]) -> rs.Node[Any]:
    return rs.from_list(records(2)).shuffle(1).shard().batch(3, drop_last=True)


def empty_files(paths: dict[str, list[str]]) -> rs.Node[Any]:
    return rs.jsonl_stream(paths["empty_stream"], shuffle_files=2).map(shift).batch(2)


EMPTY = {
    **{f"filtered-{kind}": functools.partial(empty_by_filter, kind) for kind in KINDS},
    "short-of-a-batch": short_of_a_batch,
    "empty-files": empty_files,
    "empty-list": lambda paths: rs.from_list([]).shuffle(3).shard().batch(2),
}
EMPTY_CASES = [("alone", name) for name in EMPTY] + [
    ("loader0", "filtered-parquet"),
    ("loader2", "empty-files"),
    ("sdl0", "filtered-stream"),
    ("sdl2p", "filtered-jsonl"),
]


@pytest.mark.parametrize(("mode_name", "name"), EMPTY_CASES, ids=["-".join(case) for case in EMPTY_CASES])
def test_epochs_of_nothing_resume_at_every_edge_and_count_their_epochs(files: dict, mode_name: str, name: str) -> None:
    """Empty epochs: ``iter`` then ``stop`` three times, cut everywhere (without workers each cut
    its own run, ending in the state the uninterrupted run ends in; with them one run cut at
    every action); len() is 0 where known."""
    factory = functools.partial(EMPTY[name], files)
    mode = MODES[mode_name]
    lengths = [0, 0, 0]
    count = len(script(lengths)) + 1
    reference = play(mode, factory, lengths, capture=set(range(count)))
    assert reference.loops == [[], [], []]
    if mode.workers:  # one run, cut everywhere: workers cost a start each
        assert play(mode, factory, lengths, cuts=set(range(count))).loops == [[], [], []]
    for cut in range(count) if not mode.workers else ():
        run = play(mode, factory, lengths, cuts={cut}, capture={count - 1}, twice=cut % 2 == 1)
        assert run.loops == [[], [], []]
        if mode_name == "alone":
            assert run.states[count - 1] == reference.states[count - 1], cut
    if name in ("short-of-a-batch", "empty-list"):
        assert len(factory()) == 0


def test_len_of_a_batch_short_of_its_size_with_drop_last_is_zero_and_so_is_what_it_yields(files: dict) -> None:
    pipe = short_of_a_batch(files)
    assert len(pipe) == 0
    assert list(pipe) == [] and list(pipe) == []
    assert len(pipe) == 0
    unbatched = rs.from_list(records(2)).shuffle(1).shard().batch(3)
    assert len(unbatched) == 1 == len(list(unbatched))


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "arrow", "stream"])
def test_a_source_over_no_files_is_a_source_error_when_built(tmp_path: Path, kind: str) -> None:
    make = {"jsonl": rs.jsonl, "parquet": rs.parquet, "arrow": rs.arrow, "stream": rs.jsonl_stream}[kind]
    for paths in ([], str(tmp_path / "*.none")):
        with pytest.raises(rs.SourceError):
            make(paths)


# -- workers with nothing to read ------------------------------------------------------------------


def worker_one_empty(paths: dict[str, list[str]]) -> rs.Node[Any]:
    """Worker 1 of 2 reads odd positions, whose ids are odd: the filter leaves it nothing."""
    return rs.from_list(records()).shard().filter(even_id).map(shift).batch(3)


def one_record_kept(paths: dict[str, list[str]]) -> rs.Node[Any]:
    """One record kept in each epoch, in the shard of worker 0 or 1 as the shuffle puts it."""
    return rs.from_list(records()).shuffle(11).shard().filter(only_zero).map(shift).batch(1)


def half_empty_files(paths: dict[str, list[str]]) -> rs.Node[Any]:
    """An empty file and a full one, in a new order each epoch: a worker reads nothing."""
    return rs.jsonl_stream(paths["half_empty_stream"], shuffle_files=4).map(shift).batch(4)


def big_batches(paths: dict[str, list[str]]) -> rs.Node[Any]:
    """12 and 11 records in batches of 12 with drop_last: one batch from worker 0, none from 1."""
    return rs.jsonl(paths["jsonl"]).shuffle(2).shard().map(shift).batch(12, drop_last=True)


LOPSIDED = {
    "filter-empties-worker-1": worker_one_empty,
    "one-record-kept": one_record_kept,
    "half-empty-files": half_empty_files,
    "drop-last-empties-worker-1": big_batches,
}
LOPSIDED_CASES = [
    ("loader2", "half-empty-files"),
    ("loader2p", "one-record-kept"),
    ("sdl2p", "filter-empties-worker-1"),
    ("sdl2p", "drop-last-empties-worker-1"),
]


@pytest.mark.parametrize(("mode_name", "name"), LOPSIDED_CASES, ids=["-".join(case) for case in LOPSIDED_CASES])
def test_a_worker_with_nothing_to_read_resumes_at_every_edge(files: dict, mode_name: str, name: str) -> None:
    factory = functools.partial(LOPSIDED[name], files)
    expected = uninterrupted(mode_name, "lopsided", name, factory)
    assert all(len(loop) >= 1 for loop in expected)
    lengths = [len(loop) for loop in expected]
    cuts = {cut_index(point, lengths) for point in POINTS}
    run = play(MODES[mode_name], factory, lengths, cuts=cuts, twice=name == "one-record-kept")
    assert run.loops == expected


# -- epochs of nothing between epochs of something ---------------------------------------------------


def now_and_then(topology: tuple[int, ...], paths: dict[str, list[str]]) -> rs.Node[Any]:
    """A whole-epoch plan packs each consumer's share of the epoch in 8 to 12 rows; batches of
    10 with drop_last make that one batch in some epochs and none in others: with the seed
    here, epochs 0, 2 and 5 hold one batch and 1, 3 and 4 none (consumer 0 of 2, and both
    consumers together)."""
    return (
        rs.from_list(records())
        .shuffle(6)
        .shard(*topology)
        .map(shift)
        .pack(8, strategy="bfd")
        .batch(10, drop_last=True, collate_fn=collate_rows)
    )


NOW_AND_THEN = [("alone", (0, 2)), ("loader0", (0, 2)), ("loader2p", ())]


@pytest.mark.parametrize(("mode_name", "topology"), NOW_AND_THEN, ids=[case[0] for case in NOW_AND_THEN])
def test_empty_epochs_between_full_ones_resume_at_every_edge(files: dict, mode_name: str, topology: tuple) -> None:
    """Six epochs of 1, 0, 1, 0, 0, 1 batches: cut at every action of the script (each cut its
    own run without workers, also restoring twice; with workers one run, cut at every action
    from the start of epoch 1 to the end of epoch 4); ``len()`` follows each epoch."""
    factory = functools.partial(now_and_then, topology, files)
    mode = MODES[mode_name]
    obj = mode.make(factory)
    try:
        expected = [[plain(item) for item in obj] for _ in range(6)]
    finally:
        mode.close(obj)
    lengths = [len(loop) for loop in expected]
    assert lengths == [1, 0, 1, 0, 0, 1]
    count = len(script(lengths)) + 1
    if mode.workers:  # one run, cut at each edge around the empty epochs 1, 3 and 4
        assert play(mode, factory, lengths, cuts=set(range(3, 12))).loops == expected
        return
    for cut in range(count):
        run = play(
            mode,
            factory,
            lengths,
            cuts={cut},
            twice=cut % 2 == 0,
            length_of=None if mode_name == "alone" else "unchecked",
        )
        assert run.loops == expected, cut


# -- len() of a Loader restored into another epoch ----------------------------------------------------


def varying(paths: dict[str, list[str]]) -> rs.Node[Any]:
    """Consumer 0 of 2 under a whole-epoch plan: 11, 8, 10 and 8 rows in epochs 0 to 3."""
    return rs.from_list(records()).shuffle(0).shard(0, 2).map(shift).pack(8, strategy="bfd")


@pytest.mark.parametrize("point", ["iter1", "first1", "stopped1", "last2"])
def test_len_of_a_pipeline_restored_into_a_later_epoch_is_that_epoch_s(files: dict, point: str) -> None:
    """The pipeline's own len() after set_state: the loaded epoch's (ended or not)."""
    factory = functools.partial(varying, files)
    lengths = [len(loop) for loop in uninterrupted("alone", "varying", "", factory)]
    assert lengths == [11, 8, 10, 8]
    lengths = lengths[: epochs_for(point)]
    play(MODES["alone"], factory, lengths, cuts={cut_index(point, lengths)}, length_of=None)


def advance(obj: Any, actions: list[str]) -> None:
    """Play ``actions`` of a script on ``obj`` (the items are not kept)."""
    iterator: Any = None
    for action in actions:
        if action == "iter":
            iterator = iter(obj)
        elif action == "next":
            assert next(iterator, END) is not END
        else:
            assert next(iterator, END) is END


@pytest.mark.parametrize("point", ["iter1", "first1", "stopped1", "last2"])
def test_len_of_a_loader_without_workers_restored_into_a_later_epoch_is_that_epoch_s(files: dict, point: str) -> None:
    """What a learning-rate schedule reads on restart: len() of the restored Loader equals the
    uninterrupted Loader's at the same point (the rows of consumer 0 of 2 vary by epoch)."""
    factory = functools.partial(varying, files)
    lengths = [len(loop) for loop in uninterrupted("loader0", "varying", "", factory)]
    assert lengths == [11, 8, 10, 8]
    with rst.Loader(factory) as loader:
        advance(loader, script(lengths)[: cut_index(point, lengths)])
        state = roundtrip(loader.state_dict())
        epoch, length = loader.epoch, len(loader)
    assert length == lengths[epoch] and epoch == (2 if point == "last2" else 1)
    with rst.Loader(factory) as resumed, rst.Loader(factory) as untouched:
        resumed.load_state_dict(state)
        untouched.load_state_dict(state)
        assert resumed.epoch == epoch
        assert len(resumed) == length
        assert resumed.state_dict() == untouched.state_dict()  # len() left the loaded state pending
        assert repr(list(resumed)) == repr(list(untouched))  # and the pass it resumes as it was
