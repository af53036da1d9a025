"""Adversary of composition: long and unusual chains of nodes, drawn in any order.

A chain is a source (in memory, a JSONL file, a Parquet file) and 2-6 nodes drawn from every
node the library has, in any order: serial and threaded maps, streaming and indexed filters,
both shuffles, shard, repeat, even, batch, caches in memory and on disk, prefetch, a mix with a
second branch and every packer. An order the composition table refuses must be an
``rs.ConfigError`` at construction (or a typed error at the first ``next()``), never a bare
Python error; every other chain must resume exactly (k items, get_state, JSON, a freshly built
chain, continue == uninterrupted; twice in a row), ``len()`` where known must count its first
epoch, a chain that differs only in what shapes no data (cache in memory or on disk, read-ahead
sizes, threads) must resume the state exactly, and one that differs in what does (a seed, a
batch size, a shard, an index, a node inserted or removed, the source) must refuse it with an
``rs.StateError`` naming the node, leaving the chain as it was.

Then fixed chains: nodes twice (two shuffles, block shuffles, caches, indexed filters, batches,
read-aheads, mixes of mixes), checked at every point; clashes with other nodes between the two
(two shards, two repeats, two packs, cache or an indexed filter after an order, ...), refused
when built; user functions raising mid-epoch deep in a chain, where a loop that stops at the
error and restarts from its checkpoint must get what iterating on gives; a prefetch inserted
anywhere and maps in threads, which change nothing through ``next_epoch``/``start_epoch``; and
``rs.torch.Loader`` with 0 and 2 workers over such chains.
"""

from __future__ import annotations

import json
import warnings
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given
from hypothesis import strategies as st

import resumable as rs
from resumable import Node
from tests.resume import flat, loops, plain, roundtrip

Build = Callable[[], Node[Any]]
Step = tuple[Any, ...]

CAP = 40  # items in the longest run compared
SOURCE_SIZE = 13
SIDE_SIZE = 6


# -- records and the functions over them ------------------------------------------------------


def documents(size: int, component: int = 0) -> list[dict[str, Any]]:
    """``size`` documents of 1 to 7 tokens; token ``t`` of document ``i`` of ``component`` is
    ``component*10**6 + i*100 + t + 1``, so every item names where it came from."""
    return [
        {"id": 1000 * component + i, "input_ids": [component * 10**6 + i * 100 + t + 1 for t in range(i * 5 % 7 + 1)]}
        for i in range(size)
    ]


def tag(item: Any) -> int:
    """An int that depends on the whole item: a document, a packed row, a batch of them."""
    if isinstance(item, list):
        return sum(tag(x) for x in item)
    return int(np.asarray(item["input_ids"], dtype=np.int64).sum()) + int(item.get("id", 0))


def shift(item: Any, by: int) -> Any:
    """The item with every token moved by ``by`` (documents, packed rows, batches of either)."""
    if isinstance(item, list):
        return [shift(x, by) for x in item]
    tokens = item["input_ids"]
    moved = tokens + by if isinstance(tokens, np.ndarray) else [int(t) + by for t in tokens]
    return {**item, "input_ids": moved}


def keep(item: Any, modulus: int) -> bool:
    return tag(item) % modulus != 0


def keep_doc(item: dict[str, Any], modulus: int) -> bool:
    """Documents whose id is not a multiple of ``modulus``; with a negative one, the others."""
    return item["id"] % modulus != 0 if modulus > 0 else item["id"] % -modulus == 0


# -- sources ----------------------------------------------------------------------------------


class Sources:
    """Source nodes over ``documents``: in memory, or a JSONL or Parquet file in a directory."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.written: dict[tuple[str, int, int], str] = {}

    def __call__(self, kind: str, size: int = SOURCE_SIZE, component: int = 0) -> Node[Any]:
        records = documents(size, component)
        if kind == "list":
            return rs.from_list(records)
        key = (kind, size, component)
        if key not in self.written:
            path = self.root / f"{kind}-{size}-{component}.{kind}"
            if kind == "jsonl":
                path.write_text("".join(json.dumps(record) + "\n" for record in records))
            else:
                pq.write_table(pa.Table.from_pylist(records), path, row_group_size=4)
            self.written[key] = str(path)
        path_text = self.written[key]
        return rs.jsonl(path_text) if kind == "jsonl" else rs.parquet(path_text)


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> Sources:
    return Sources(tmp_path_factory.mktemp("chain-sources"))


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("chain-caches")


# -- chains -----------------------------------------------------------------------------------


def apply_step(pipe: Node[Any], step: Step, sources: Sources, cache_root: Path) -> Node[Any]:
    name = step[0]
    if name == "map":
        return pipe.map(partial(shift, by=step[1]))
    if name == "pmap":
        return pipe.map(partial(shift, by=step[1]), num_workers=step[2], mode="thread")
    if name == "filter":
        return pipe.filter(partial(keep, modulus=step[1]))
    if name == "ifilter":
        return pipe.filter(partial(keep_doc, modulus=step[1]), index=True, progress=False)
    if name == "shuffle":
        return pipe.shuffle(step[1])
    if name == "block":
        return pipe.shuffle(step[1], block_size=step[2], window=step[3])
    if name == "shard":
        return pipe.shard(step[1], step[2])
    if name == "repeat":
        return pipe.repeat(step[1])
    if name == "even":
        return pipe.even(times=step[1])
    if name == "batch":
        return pipe.batch(step[1], drop_last=step[2])
    if name == "cache":
        return pipe.cache(str(cache_root / "disk") if step[1] == "disk" else None)
    if name == "prefetch":
        return pipe.prefetch(step[1])
    if name == "mix":
        _, seed, on_end, side_seed = step
        side = sources("list", SIDE_SIZE, component=1).shuffle(side_seed)
        return rs.mix({"main": pipe, "side": side}, weights={"main": 2, "side": 1}, seed=seed, on_end=on_end)
    if name == "pack":
        _, seq_len, strategy = step
        return pipe.pack(seq_len, strategy=strategy, buffer_size=None if strategy == "bfd" else 3)
    raise ValueError(step)


def chain(source: str, steps: list[Step], sources: Sources, cache_root: Path) -> Build:
    def build() -> Node[Any]:
        pipe = sources(source)
        for step in steps:
            pipe = apply_step(pipe, step, sources, cache_root)
        return pipe

    return build


STEPS: dict[str, st.SearchStrategy[Step]] = {
    "map": st.tuples(st.just("map"), st.integers(1, 9)),
    "pmap": st.tuples(st.just("pmap"), st.integers(1, 9), st.just(2)),
    "filter": st.tuples(st.just("filter"), st.integers(3, 5)),
    "ifilter": st.tuples(st.just("ifilter"), st.integers(2, 4)),
    "shuffle": st.tuples(st.just("shuffle"), st.integers(0, 2**32)),
    "block": st.tuples(st.just("block"), st.integers(0, 2**16), st.integers(1, 4), st.integers(1, 3)),
    "shard": st.integers(1, 3).flatmap(
        lambda world: st.tuples(st.just("shard"), st.integers(0, world - 1), st.just(world))
    ),
    "repeat": st.tuples(st.just("repeat"), st.sampled_from([None, 2, 3])),
    "even": st.tuples(st.just("even"), st.sampled_from([None, 2])),
    "batch": st.tuples(st.just("batch"), st.integers(1, 4), st.booleans()),
    "cache": st.tuples(st.just("cache"), st.sampled_from(["memory", "disk"])),
    "prefetch": st.tuples(st.just("prefetch"), st.integers(1, 3)),
    "mix": st.tuples(
        st.just("mix"), st.integers(0, 99), st.sampled_from(["stop", "drop", "restart"]), st.integers(0, 99)
    ),
    "pack": st.tuples(
        st.just("pack"), st.sampled_from([4, 8, 13]), st.sampled_from(["greedy", "first_fit", "best_fit", "bfd"])
    ),
}
StepStrategy = st.one_of(*STEPS.values())
Source = st.sampled_from(["list", "jsonl", "parquet"])
Chains = st.tuples(Source, st.lists(StepStrategy, min_size=2, max_size=6))


def _kinds(*names: str) -> st.SearchStrategy[Step]:
    return st.one_of(*(STEPS[name] for name in names))


# Chains drawn in the order the composition table mostly allows (random-access nodes first,
# then iterator nodes, .even() last), so that long chains are legal more often than not.
OrderedChains = st.tuples(
    Source,
    st.tuples(
        st.lists(_kinds("map", "ifilter", "cache"), max_size=2),
        st.lists(_kinds("shuffle", "block"), max_size=2),
        st.lists(_kinds("shard"), max_size=1),
        st.lists(_kinds("map", "pmap", "filter", "prefetch", "mix", "pack", "repeat", "batch"), min_size=1, max_size=4),
        st.lists(_kinds("even"), max_size=1),
    ).map(lambda parts: [step for part in parts for step in part][:6]),
)


def try_build(build: Build) -> Node[Any] | rs.ResumableError:
    """The built chain with its first item read, or the typed error that refused it. Any other
    exception fails the test: an illegal order must be refused by the library, by name."""
    try:
        pipe = build()
    except rs.ConfigError as error:
        return error
    try:
        next(iter(pipe), None)
    except rs.ResumableError as error:
        pipe.close()
        return error
    pipe.close()
    return build()


# -- the resume property ------------------------------------------------------------------------


def check_resume(build: Build, expected: list[Any], k: int, k2: int) -> None:
    """k items, state, JSON, a fresh chain, continue == ``expected``; then again from the
    restored chain after ``k2`` items (restoring twice in a row)."""
    total = len(expected)
    with build() as pipe:
        head = flat(loops(pipe, k))
        assert len(head) == k
        state = roundtrip(pipe.get_state())
        rest = loops(pipe, total - k)
        assert head + flat(rest) == expected, "get_state() disturbed the iteration"
    with build() as resumed:
        resumed.set_state(state)
        middle = flat(loops(resumed, k2 - k))
        assert head + middle == expected[:k2], f"resumed at {k}"
        second = roundtrip(resumed.get_state())
        with build() as again:
            again.set_state(second)
            after = loops(again, total - k2)
        assert head + middle + flat(after) == expected, f"resumed at {k}, then again at {k2}"
        if k2 == k:
            assert after == rest, "the loops (epoch ends) differ after a restore"


def node_path(pipe: Node[Any], depth: int) -> str:
    """The path a message gives for the node ``depth`` nodes below the top of ``pipe`` (through
    a mix, its ``main`` component): ``Batch > Mix[main] > Shuffle``."""
    path, node = pipe.kind, pipe
    for _ in range(depth):
        if node.kind == "Mix":
            node = node._children()[("components", "main")]
            path = f"{path}[main] > {node.kind}"
        else:
            node = node.upstream
            path = f"{path} > {node.kind}"
    return path


MUTATED_KIND = {
    "shuffle": "Shuffle",
    "block": "BlockShuffle",
    "shard": "Shard",
    "batch": "Batch",
    "repeat": "Repeat",
    "even": "Even",
    "pack": "Pack",
    "mix": "Mix",
    "ifilter": "IndexedFilter",
}


def mutated(step: Step) -> Step:
    """``step`` with one option that shapes the stream changed."""
    name = step[0]
    if name in ("shuffle", "block", "mix"):
        return (name, step[1] + 1, *step[2:])
    if name == "shard":
        return ("shard", 0 if step[1] else 1, max(step[2], 2))
    if name == "batch":
        return ("batch", step[1] + 1, step[2])
    if name == "repeat":
        return ("repeat", 3 if step[1] != 3 else None)
    if name == "even":
        return ("even", 3 if step[1] is None else None)
    if name == "pack":
        return ("pack", step[1] + 1, step[2])
    if name == "ifilter":  # keeps the records it dropped: another index
        return ("ifilter", -step[1])
    raise ValueError(step)


Namer = Callable[[Node[Any]], tuple[str, ...]]


def variants(source: str, steps: list[Step]) -> list[tuple[str, list[Step], Namer]]:
    """Chains that differ from ``source, steps``, each with what a refused state's message may
    start with, given the built chain: the path of the node that differs and a colon, or only
    the top node's kind where a node was inserted or removed (the paths then part somewhere)."""
    top: Namer = lambda pipe: (pipe.kind,)  # noqa: E731
    found: list[tuple[str, list[Step], Namer]] = []
    for index, step in enumerate(steps):
        depth = len(steps) - 1 - index
        if step[0] in MUTATED_KIND:
            # Another index also changes the kept count of indexed filters above it, which
            # are checked first: the message may name any node down to this one.
            namer = at_depths(range(depth + 1)) if step[0] == "ifilter" else at_depth(depth)
            found.append((source, [*steps[:index], mutated(step), *steps[index + 1 :]], namer))
        if step[0] == "mix":  # another order of the side branch, under the mix
            other_side = (*step[:3], step[3] + 1)
            namer = lambda pipe, depth=depth: (node_path(pipe, depth) + "[side] > Shuffle:",)  # noqa: E731
            found.append((source, [*steps[:index], other_side, *steps[index + 1 :]], namer))
        if step[0] in ("map", "filter", "prefetch", "pmap", "cache"):
            found.append((source, [*steps[:index], *steps[index + 1 :]], top))
        found.append((source, [*steps[:index], ("map", 5), *steps[index:]], top))
    found.append((source, [*steps, ("prefetch", 2)], top))
    other_source = "jsonl" if source == "list" else "list"
    found.append((other_source, steps, at_depth(len(steps))))
    return found


def at_depth(depth: int) -> Namer:
    return at_depths([depth])


def at_depths(depths: Iterable[int]) -> Namer:
    return lambda pipe: tuple(node_path(pipe, depth) + ":" for depth in depths)


def equivalents(steps: list[Step]) -> list[list[Step]]:
    """Chains that differ from ``steps`` only in what shapes no data, which a state must resume
    in exactly (docs/cache.md, docs/parallel.md): a cache in memory instead of on disk and back,
    another read-ahead, another number of threads."""
    found = []
    for index, step in enumerate(steps):
        name = step[0]
        if name == "cache":
            other: Step = ("cache", "memory" if step[1] == "disk" else "disk")
        elif name == "prefetch":
            other = ("prefetch", step[1] + 1)
        elif name == "pmap":
            other = ("pmap", step[1], 1)
        else:
            continue
        found.append([*steps[:index], other, *steps[index + 1 :]])
    return found


def tame(steps: list[Step]) -> list[Step]:
    """``steps`` without streaming filters after a ``restart`` mix: it never ends and its items
    come round again, so a filter that happens to reject every one of them would wait forever
    (as any endless loop over a filter that rejects everything)."""
    restart = False
    kept = []
    for step in steps:
        restart = restart or step[:1] == ("mix",) and step[2] == "restart"
        if not (restart and step[0] == "filter"):
            kept.append(step)
    return kept


def check_refused_restore(other: Build, state: dict[str, Any], namer: Namer, total: int, at: int) -> None:
    """``state`` loaded into ``other``, a chain it does not belong to, after ``at`` of its items:
    an ``rs.StateError`` whose message starts with one of ``namer(chain)``, and ``other`` goes on as
    if the call had not been made."""
    with other() as whole:
        expected = flat(loops(whole, total))
    at = min(at, len(expected))
    with other() as pipe:
        head = flat(loops(pipe, at))
        before = json.dumps(pipe.get_state(), sort_keys=True)
        with pytest.raises(rs.StateError) as refused:
            pipe.set_state(state)
        assert str(refused.value).startswith(namer(pipe)), str(refused.value)
        assert json.dumps(pipe.get_state(), sort_keys=True) == before, "a refused state changed the state"
        assert head + flat(loops(pipe, total - len(head))) == expected, "a refused state changed the chain"


@given(spec=Chains, data=st.data())
def test_a_chain_in_any_order_is_refused_by_name_or_resumes_exactly(
    spec: tuple[str, list[Step]], data: st.DataObject, sources: Sources, cache_root: Path
) -> None:
    check_chain(spec[0], tame(spec[1]), data, sources, cache_root)


@given(spec=OrderedChains, data=st.data())
def test_a_long_chain_in_table_order_is_refused_by_name_or_resumes_exactly(
    spec: tuple[str, list[Step]], data: st.DataObject, sources: Sources, cache_root: Path
) -> None:
    check_chain(spec[0], tame(spec[1]), data, sources, cache_root)


def check_chain(source: str, steps: list[Step], data: st.DataObject, sources: Sources, cache_root: Path) -> None:
    """Refused at construction with a ConfigError (or a typed error at the first item); or the
    resume property at 0, mid-epoch, the epoch's last item, the step after and a drawn point,
    each restored twice in a row; ``len()``, where known, the first epoch's count; the state
    resumed exactly by chains that differ in what shapes no data, and refused by name, changing
    nothing, by chains that differ in what does."""
    build = chain(source, steps, sources, cache_root)
    built = try_build(build)
    if isinstance(built, rs.ResumableError):
        assert isinstance(built, rs.ConfigError), repr(built)
        return
    built.close()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", rs.BarrenEpochWarning)
            with build() as pipe:
                first = sum(1 for _ in zip(range(CAP + 1), pipe))
            with build() as pipe:
                expected = flat(loops(pipe, min(2 * first + 2, CAP)))
    except rs.BarrenEpochWarning:  # a packer or filter after a "restart" mix with nothing left
        return
    total = len(expected)
    with build() as pipe:
        try:
            length = len(pipe)
        except TypeError:
            pass
        else:
            assert (length, first) == (first, first) or first > CAP, "len() is not the first epoch's count"
    drawn = data.draw(st.integers(0, total), label="k")
    for k in sorted(p for p in {0, first // 2, first, first + 1, drawn} if p <= total):
        check_resume(build, expected, k, data.draw(st.integers(k, total), label="k2"))

    with build() as pipe:
        head = flat(loops(pipe, drawn))
        state = roundtrip(pipe.get_state())
    for same_steps in equivalents(steps):
        with chain(source, same_steps, sources, cache_root)() as same:
            same.set_state(state)
            assert head + flat(loops(same, total - drawn)) == expected, f"resumed in {same_steps}"
    for other_source, other_steps, namer in variants(source, steps):
        other = chain(other_source, other_steps, sources, cache_root)
        if isinstance(try_build(other), rs.ResumableError):
            continue
        check_refused_restore(other, state, namer, min(total, 12), data.draw(st.integers(0, 4), label="at"))


# -- rs.torch.Loader over long chains ----------------------------------------------------------


def as_is(batch: Any) -> Any:
    return batch


def loader_chain(name: str, sources: Sources, cache_root: Path) -> Build:
    """Chains whose ``.shard()`` splits over DataLoader workers, ending in batches."""

    def build() -> Node[Any]:
        if name == "ifilter-pack":
            return (
                sources("jsonl", 24)
                .filter(partial(keep_doc, modulus=4), index=True, progress=False)
                .shuffle(3)
                .shard()
                .map(partial(shift, by=1))
                .pack(8, strategy="best_fit", buffer_size=3)
                .batch(2)
            )
        if name == "mix-cache-prefetch":
            main = (
                sources("parquet", 24)
                .cache(str(cache_root / "loader"))
                .shuffle(2, block_size=2, window=2)
                .shard()
                .map(partial(shift, by=2), num_workers=2)
            )
            side = sources("list", 10, component=1).shuffle(1).shard()
            return rs.mix({"main": main, "side": side}, seed=5, on_end="drop").batch(3).prefetch(2)
        if name == "batches-of-batches":
            return (
                sources("list", 30)
                .shuffle(4)
                .shard()
                .batch(2)
                .map(partial(shift, by=3))
                .filter(partial(keep, modulus=5))
                .batch(2, drop_last=True)
                .repeat(2)
            )
        raise ValueError(name)

    return build


def train(loader: Any, epochs: int, stop: int | None = None, first_epoch: int = 0) -> tuple[list[Any], Any]:
    """(epoch, batch) pairs of a training loop over ``epochs`` epochs, and the loader's state
    (through JSON) after ``stop`` batches, taken inside the loop as a trainer checkpoints."""
    seen: list[Any] = []
    for epoch in range(first_epoch, epochs):
        for batch in loader:
            seen.append((epoch, plain(batch)))
            if len(seen) == stop:
                return seen, roundtrip(loader.state_dict())
    return seen, None


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("name", ["ifilter-pack", "mix-cache-prefetch", "batches-of-batches"])
def test_a_loader_over_a_long_chain_resumes_exactly_twice_in_a_row(
    name: str, workers: int, sources: Sources, cache_root: Path
) -> None:
    import resumable.torch as rst

    build = loader_chain(name, sources, cache_root)

    def make() -> Any:
        return rst.Loader(build, num_workers=workers, collate_fn=as_is)

    expected, _ = train(make(), 2)
    per_epoch = sum(1 for epoch, _ in expected if epoch == 0)
    assert per_epoch >= 3 and len(expected) > per_epoch + 2, expected
    k, k2 = per_epoch // 2, per_epoch + 1
    head, state = train(make(), 2, stop=k)
    second = make()
    second.load_state_dict(state)
    middle, state2 = train(second, 2, stop=k2 - k, first_epoch=second.epoch)
    third = make()
    third.load_state_dict(state2)
    tail, _ = train(third, 2, first_epoch=third.epoch)
    assert head + middle + tail == expected


# -- nodes twice in one chain ------------------------------------------------------------------


def ids(item: Any) -> list[int]:
    """The document ids inside an item (a document, or batches of documents)."""
    return [i for x in item for i in ids(x)] if isinstance(item, list) else [item["id"]]


def every_point(build: Build, count: int) -> list[Any]:
    """The first ``count`` items (across epochs); the resume property at every point of them,
    restoring a second time a few items later."""
    with build() as pipe:
        expected = flat(loops(pipe, count))
    for k in range(len(expected) + 1):
        check_resume(build, expected, k, min(len(expected), k + 3))
    return expected


def permutation_per_epoch(loops_: list[list[Any]], epochs: int = 1) -> None:
    assert sorted(ids(loops_[0])) == sorted(list(range(SOURCE_SIZE)) * epochs)


def shifted_documents(loops_: list[list[Any]], by: int, kept: Callable[[int], bool] = lambda i: True) -> None:
    """The first loop holds ``documents`` (those whose id is ``kept``) shifted by ``by``, in some order."""
    size = 24 if max(ids(loops_[0])) >= SOURCE_SIZE else SOURCE_SIZE
    want = [plain(shift(doc, by)) for doc in documents(size) if kept(doc["id"])]
    assert sorted(loops_[0], key=lambda doc: doc["id"]) == want


def half_of_the_kept(loops_: list[list[Any]]) -> None:
    """Shard 1 of 2 of the 10 records both filters keep: 5 of them, and only those."""
    kept = {i for i in range(24) if i % 2 and i % 5}
    assert len(loops_[0]) == 5 and set(ids(loops_[0])) < kept, ids(loops_[0])


TWICE: dict[str, tuple[Callable[[Sources, Path], Node[Any]], Callable[[list[list[Any]]], None]]] = {
    "shuffle-shuffle-repeat": (
        lambda s, c: s("list").shuffle(1).shuffle(1).repeat(2),
        partial(permutation_per_epoch, epochs=2),
    ),
    "block-block-shuffle": (
        lambda s, c: (
            s("parquet").shuffle(1, block_size="row_group", window=2).shuffle(2, block_size=3, window=2).shuffle(3)
        ),
        permutation_per_epoch,
    ),
    "cache-map-cache": (
        lambda s, c: (
            s("jsonl").map(partial(shift, by=1)).cache(str(c / "twice")).map(partial(shift, by=2)).cache().shuffle(4)
        ),
        partial(shifted_documents, by=3),
    ),
    "cache-ifilter-cache-ifilter": (
        lambda s, c: (
            s("list", 24)
            .cache()
            .filter(partial(keep_doc, modulus=3), index=True, progress=False)
            .cache(str(c / "twice"))
            .filter(partial(keep_doc, modulus=4), index=True, progress=False)
            .shuffle(5)
        ),
        partial(shifted_documents, by=0, kept=lambda i: i % 3 != 0 and i % 4 != 0),
    ),
    "ifilter-ifilter-shard": (
        lambda s, c: (
            s("parquet", 24)
            .filter(partial(keep_doc, modulus=2), index=True, progress=False)
            .filter(partial(keep_doc, modulus=5), index=True, progress=False)
            .shuffle(6)
            .shard(1, 2)
        ),
        half_of_the_kept,
    ),
    "batch-batch-repeat": (
        lambda s, c: s("list").shuffle(7).batch(3).batch(2).repeat(2),
        partial(permutation_per_epoch, epochs=2),
    ),
    "batch-map-filter-batch": (
        lambda s, c: (
            s("jsonl").batch(2).map(partial(shift, by=1)).filter(partial(keep, modulus=3)).batch(2, drop_last=True)
        ),
        lambda loops_: (
            all(len(item) == 2 and all(keep(batch, 3) for batch in item) for item in loops_[0]) and len(loops_[0]) >= 2
        ),
    ),
    "prefetch-pmap-pmap-prefetch": (
        lambda s, c: (
            s("list")
            .shuffle(8)
            .prefetch(1)
            .map(partial(shift, by=1), num_workers=2)
            .map(partial(shift, by=2), num_workers=3)
            .prefetch(2)
        ),
        partial(shifted_documents, by=3),
    ),
    "mix-of-mixes": (
        lambda s, c: rs.mix(
            {
                "main": rs.mix({"main": s("list").shuffle(1), "side": s("jsonl", 5, 1)}, seed=1, on_end="restart"),
                "side": s("parquet", 7, 2).shuffle(2),
            },
            weights={"main": 1, "side": 2},
            seed=2,
            on_end="drop",
        ),
        lambda loops_: sorted(i for i in ids(loops_[0]) if i >= 2000) == list(range(2000, 2007)),
    ),
}


@pytest.mark.parametrize("name", list(TWICE))
def test_a_node_twice_in_a_chain_resumes_exactly_at_every_point(name: str, sources: Sources, cache_root: Path) -> None:
    make, check = TWICE[name]
    build = partial(make, sources, cache_root)
    every_point(build, 24)
    with build() as pipe:
        assert check(loops(pipe, 2 * CAP)) is not False


# Orders the composition table refuses, with nodes between the two that clash: the refusal
# must come when the chain is built, as a ConfigError saying what to do.
REFUSED: dict[str, tuple[Callable[[Sources, Path], Node[Any]], str]] = {
    "shard-shard": (lambda s, c: s("list").shard(0, 2).shard(0, 2), "keep one .shard()"),
    "shard-map-shard": (lambda s, c: s("list").shard(0, 2).map(partial(shift, by=1)).shard(1, 3), "keep one .shard()"),
    "repeat-repeat": (lambda s, c: s("list").repeat(2).repeat(3), "use a single .repeat(n * m)"),
    "repeat-map-batch-repeat": (
        lambda s, c: s("list").repeat(2).map(partial(shift, by=1)).batch(2).repeat(3),
        "use a single .repeat(n * m)",
    ),
    "repeat-in-a-mix-then-repeat": (
        lambda s, c: rs.mix({"main": s("list").repeat(2), "side": s("jsonl")}).prefetch(2).repeat(3),
        "use a single .repeat(n * m)",
    ),
    "even-map-even": (lambda s, c: s("list").even().map(partial(shift, by=1)).even(), "goes last"),
    "even-batch-repeat": (lambda s, c: s("list").even().batch(2).repeat(2), "use .even(times=n) instead"),
    "repeat-map-even": (lambda s, c: s("list").repeat(2).map(partial(shift, by=1)).even(), "goes last"),
    "pack-pack": (lambda s, c: s("list").pack(8).pack(8), "cannot trace its items back"),
    "pack-filter-map-pack": (
        lambda s, c: s("list").pack(8).filter(partial(keep, modulus=3)).map(partial(shift, by=1)).pack(13),
        "cannot trace its items back",
    ),
    "batch-map-pack": (lambda s, c: s("list").batch(2).map(partial(shift, by=1)).pack(8), "cannot trace"),
    "batch-in-a-mix-then-pack": (
        lambda s, c: rs.mix({"main": s("list").batch(2), "side": s("jsonl")}).pack(8),
        "cannot trace its items back",
    ),
    "filter-map-bfd": (
        lambda s, c: s("list").filter(partial(keep, modulus=3)).map(partial(shift, by=1)).pack(8, strategy="bfd"),
        "give buffer_size=N",
    ),
    "shuffle-map-cache": (lambda s, c: s("list").shuffle(1).map(partial(shift, by=1)).cache(), "before shuffle"),
    "shard-map-map-cache-on-disk": (
        lambda s, c: s("list").shard(0, 2).map(partial(shift, by=1)).map(partial(shift, by=1)).cache(str(c / "no")),
        "before shuffle and shard",
    ),
    "block-map-ifilter": (
        lambda s, c: s("parquet").shuffle(1, block_size=2).map(partial(shift, by=1)).filter(bool, index=True),
        "place .filter(index=True) before shuffle and shard",
    ),
    "ifilter-shard-cache-ifilter": (
        lambda s, c: s("list").filter(bool, index=True, progress=False).shard(0, 2).cache(),
        "before shuffle and shard",
    ),
    "pmap-shuffle": (lambda s, c: s("list").map(partial(shift, by=1), num_workers=2).shuffle(1), "random access"),
    "prefetch-ifilter": (lambda s, c: s("list").prefetch(2).filter(bool, index=True), "random access"),
    "pmap-cache": (lambda s, c: s("list").map(partial(shift, by=1), num_workers=2).cache(), "before filter"),
    "mix-shard": (lambda s, c: rs.mix({"main": s("list"), "side": s("jsonl")}).shard(0, 2), "random access"),
    "pack-shuffle": (lambda s, c: s("list").pack(8).shuffle(1), "random access"),
    "filter-even": (lambda s, c: s("list").filter(partial(keep, modulus=3)).batch(2).even(), "len() is unknown"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_a_clash_anywhere_in_a_chain_is_a_config_error_saying_what_to_do(
    name: str, sources: Sources, cache_root: Path
) -> None:
    make, hint = REFUSED[name]
    with pytest.raises(rs.ConfigError) as refused:
        make(sources, cache_root)
    assert hint in str(refused.value)


# -- user functions that raise, mid-epoch, deep in a chain -------------------------------------


class Boom(Exception):
    pass


def fail_on(item: Any, bad: frozenset[int]) -> Any:
    """The item, unless it is a document whose id is in ``bad``: then ``Boom``."""
    if isinstance(item, dict) and item.get("id") in bad:
        raise Boom(f"document {item['id']}")
    return item


def fail_on_rows(row: Any) -> Any:
    """A packed row, unless its first token is a multiple of 3: then ``Boom``."""
    if int(row["input_ids"][0]) % 3 == 0:
        raise Boom("row")
    return row


def outcomes(pipe: Node[Any], count: int) -> list[Any]:
    """What ``count`` calls of ``next()`` give, as a training loop that catches the errors of
    its data sees them: items, ``END`` for an epoch's end, and each error's type (with its
    cause's, for a ``MapError``; with its message for other typed errors), stopping after 5
    ends in a row."""
    found: list[Any] = []
    ends = 0
    while len(found) < count and ends < 5:
        try:
            found.append(plain(next(pipe)))
            ends = 0
        except StopIteration:
            found.append("END")
            ends += 1
        except rs.MapError as error:
            found.append(("MapError", type(error.__cause__).__name__))
        except Boom as error:
            found.append(("Boom", str(error)))
        except rs.ResumableError as error:
            found.append((type(error).__name__, str(error)))
    return found


FAILING: dict[str, Callable[[Sources, Path], Node[Any]]] = {
    "shuffle-map-pack-batch": lambda s, c: (
        s("list").shuffle(1).map(partial(fail_on, bad=frozenset({3, 7}))).pack(8, buffer_size=3).batch(2)
    ),
    "map-cache-shuffle-shard-batch": lambda s, c: (
        s("jsonl")
        .map(partial(fail_on, bad=frozenset({2, 3, 9})))
        .cache(str(c / "failing"))
        .shuffle(1)
        .shard(0, 2)
        .batch(2)
    ),
    "shuffle-pmap-prefetch-pack-prefetch": lambda s, c: (
        s("parquet")
        .shuffle(2)
        .map(partial(fail_on, bad=frozenset({3, 7})), num_workers=2)
        .prefetch(2)
        .pack(8, strategy="first_fit", buffer_size=3)
        .prefetch(2)
    ),
    "mix-restart-of-a-failing-map-then-batch": lambda s, c: rs.mix(
        {"main": s("list").shuffle(3).map(partial(fail_on, bad=frozenset({3}))), "side": s("list", 5, 1)},
        seed=1,
        on_end="restart",
    ).batch(2),
    "shuffle-map-repeat-pack": lambda s, c: (
        s("list").shuffle(1).map(partial(fail_on, bad=frozenset({3, 7}))).repeat(2).pack(13, strategy="greedy")
    ),
    "ifilter-map-shuffle-shard-batch": lambda s, c: (
        s("list", 24)
        .filter(partial(keep_doc, modulus=3), index=True, progress=False)
        .map(partial(fail_on, bad=frozenset({4, 8, 10})))
        .shuffle(1)
        .shard(0, 2)
        .batch(2)
    ),
    "pack-failing-row-map-filter": lambda s, c: (
        s("list").shuffle(1).pack(8, buffer_size=3).map(fail_on_rows).filter(partial(keep, modulus=5))
    ),
}


@pytest.mark.parametrize("name", list(FAILING))
def test_a_chain_left_at_an_error_of_a_user_function_resumes_as_iterating_on(
    name: str, sources: Sources, cache_root: Path
) -> None:
    """A training loop that stops at an error (or at any other call), checkpoints and restarts
    gets what iterating on would have given: the other items, the same errors, the same ends."""
    build = partial(FAILING[name], sources, cache_root)
    with build() as pipe:
        expected = outcomes(pipe, 40)
    errors = [found for found in expected if isinstance(found, tuple)]
    assert errors and {error[0] for error in errors} <= {"Boom", "MapError"}, errors
    for k in range(len(expected) + 1):
        with build() as pipe:
            head = outcomes(pipe, k)
            state = roundtrip(pipe.get_state())
        with build() as resumed:
            resumed.set_state(state)
            assert head + outcomes(resumed, len(expected) - k) == expected, f"resumed after {k} calls"


@pytest.mark.parametrize("workers", [0, 2])
def test_an_error_of_a_map_under_even_lets_the_epoch_end_and_the_next_begin(sources: Sources, workers: int) -> None:
    """The failed item counts against the epoch's quota (it is gone, as without ``.even()``): each
    epoch ends after the same number of calls, and ``iter()`` starts the next one."""
    fn = partial(fail_on, bad=frozenset({7}))
    mapped = sources("list").map(fn, num_workers=workers) if workers else sources("list").map(fn)
    pipe = mapped.batch(2).even(times=2)
    epochs = []
    for _ in range(3):
        iter(pipe)
        epochs.append(outcomes(pipe, 30))
    errors = [[found[0] for found in epoch if isinstance(found, tuple)] for epoch in epochs]
    assert errors == ([["Boom"], ["Boom"], []] if not workers else [["MapError"], ["MapError"], []]), epochs
    calls = [len([found for found in epoch if found != "END"]) for epoch in epochs]
    assert calls[0] == calls[1] == -(-SOURCE_SIZE // 2) and calls[2] == 0, calls


def test_an_error_of_a_map_under_a_whole_epoch_plan_is_a_source_error_naming_the_record(sources: Sources) -> None:
    """A whole-epoch plan reads every record before its first row: a map that raises on one
    leaves it nothing to plan, a SourceError naming the record (the map's error its cause), at
    ``len()`` and at every call (each reads again), never the bare error, never a record left out."""
    pipe = sources("list").map(partial(fail_on, bad=frozenset({3}))).pack(8, strategy="bfd")
    for _ in range(2):
        with pytest.raises(rs.SourceError, match=r"Pack\(strategy='bfd'\).*position 3 of the source") as raised:
            next(pipe)
        assert isinstance(raised.value.__cause__, Boom)
        with pytest.raises(rs.SourceError, match="position 3"):
            len(pipe)


def test_an_error_of_a_map_below_an_indexed_filter_is_typed_and_named_or_passes(sources: Sources) -> None:
    pipe = (
        sources("list")
        .map(partial(fail_on, bad=frozenset({3})))
        .filter(partial(keep_doc, modulus=5), index=True, progress=False)
        .shuffle(1)
    )
    found = outcomes(pipe, 20)
    if found[0][0] == "SourceError":  # the scan refused, naming where, as for a predicate's error
        assert "position 3" in found[0][1], found[0]
    else:  # or the record's error came once, and the epoch went on without it
        assert found.count(("Boom", "document 3")) == 1 and "END" in found, found[:4]


def mixed_rows(side_seed: int = 1) -> Node[Any]:
    """Packed rows of a mix whose components are sharded over the DataLoader workers."""
    main = rs.from_list(documents(20)).shuffle(3).shard().map(partial(shift, by=1))
    side = rs.from_list(documents(8, 1)).shuffle(side_seed).shard()
    return rs.mix({"main": main, "side": side}, seed=2, on_end="drop").pack(8, buffer_size=3).batch(2)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_loader_state_of_a_chain_that_differs_deep_in_a_mix_is_refused_by_name_then_a_good_one_resumes(
    workers: int,
) -> None:
    import resumable.torch as rst

    def make(side_seed: int) -> Any:
        return rst.Loader(partial(mixed_rows, side_seed), num_workers=workers, collate_fn=as_is)

    _, foreign = train(make(1), 2, stop=3)
    expected, _ = train(make(2), 2)
    loader = make(2)
    loader.load_state_dict(foreign)
    with pytest.raises(rs.StateError) as refused:  # each worker checks its own: with the first batch
        train(loader, 2)
    assert "Batch > Pack > Mix[side] > Shard > Shuffle: state was saved with seed=1" in str(refused.value)
    head, state = train(make(2), 2, stop=4)
    loader.load_state_dict(state)
    tail, _ = train(loader, 2, first_epoch=loader.epoch)
    assert head + tail == expected


# -- read-ahead anywhere in a chain changes nothing ---------------------------------------------

Ops = st.lists(
    st.one_of(
        st.tuples(st.just("take"), st.integers(0, 7)),
        st.tuples(st.just("next_epoch")),
        st.tuples(st.just("start_epoch"), st.integers(0, 4)),
    ),
    min_size=1,
    max_size=5,
)


def run_ops(pipe: Node[Any], ops: list[Step]) -> list[Any]:
    """What a training loop that takes items, abandons epochs and jumps to others sees."""
    seen: list[Any] = []
    for op in ops:
        if op[0] == "take":
            seen.append(loops(pipe, op[1]))
        elif op[0] == "next_epoch":
            pipe.next_epoch()
        else:
            pipe.start_epoch(op[1])
        seen.append(op)
    return seen


@given(spec=OrderedChains, ops=Ops, data=st.data())
def test_a_prefetch_anywhere_and_threads_for_maps_change_nothing_across_epoch_jumps(
    spec: tuple[str, list[Step]], ops: list[Step], data: st.DataObject, sources: Sources, cache_root: Path
) -> None:
    """The same chain with a ``.prefetch()`` inserted at a drawn place and some serial maps run
    in threads yields the same items, with the same epoch ends, through ``next_epoch()`` and
    ``start_epoch()``; and its state then resumes exactly."""
    source, steps = spec[0], tame(spec[1])
    at = data.draw(st.integers(0, len(steps)), label="prefetch at")
    threaded = [("pmap", step[1], 2) if step[0] == "map" and data.draw(st.booleans()) else step for step in steps]
    threaded[at:at] = [("prefetch", data.draw(st.integers(1, 3), label="buffer"))]
    build, build_threaded = chain(source, steps, sources, cache_root), chain(source, threaded, sources, cache_root)
    if isinstance(try_build(build), rs.ResumableError) or isinstance(try_build(build_threaded), rs.ResumableError):
        return
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", rs.BarrenEpochWarning)
            with build() as pipe:
                expected = run_ops(pipe, ops)
    except rs.BarrenEpochWarning:  # a packer or filter after a "restart" mix with nothing left
        return
    with build_threaded() as pipe:
        assert run_ops(pipe, ops) == expected
        state = roundtrip(pipe.get_state())
        after = loops(pipe, 10)
    with build_threaded() as resumed:
        resumed.set_state(state)
        assert loops(resumed, 10) == after
