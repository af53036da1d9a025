"""Elastic resume in one process: consumers simulated as ranks, rescaled several times within
one epoch. Every document (every token, when packing) is delivered exactly once."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any, Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import resumable as rs
from resumable.elastic import consumer_of, rescaled_state, restore
from resumable.pack import expand_references
from tests.sources import INDEXED_KINDS, indexed_source

SEQ_LEN = 16
TOKEN_BASE = 1000  # token t of document d is d * TOKEN_BASE + t + 1: every token names itself


def documents(count: int) -> list[dict[str, Any]]:
    lengths = np.random.default_rng(count).integers(0, 3 * SEQ_LEN, size=count)
    return [
        {"id": d, "input_ids": (d * TOKEN_BASE + np.arange(length) + 1).tolist()}
        for d, length in enumerate(lengths.tolist())
    ]


def keep(record: dict[str, Any]) -> bool:
    return record["id"] % 5 != 3


def ids(record: dict[str, Any]) -> int:
    return record["id"]  # type: ignore[no-any-return]  # records are dicts of ints


CHAINS: dict[str, Callable[[rs.Node, int, int], rs.Node]] = {
    "shard": lambda s, r, w: s.shuffle(7).shard(r, w).map(lambda d: d["id"]),
    "filter_batch": lambda s, r, w: s.shuffle(7).shard(r, w).filter(keep).map(lambda d: d["id"]).batch(3),
    "pack_best_fit": lambda s, r, w: s.shuffle(7).shard(r, w).filter(keep).pack(SEQ_LEN, buffer_size=4),
    "pack_greedy_batch": lambda s, r, w: s.shuffle(3).shard(r, w).pack(SEQ_LEN, strategy="greedy").batch(2),
    "pack_first_fit_truncate": lambda s, r, w: s.shard(r, w).pack(
        SEQ_LEN, strategy="first_fit", buffer_size=3, overlong="truncate"
    ),
    # Two epochs: old consumers whose shards differ by one straddle the boundary between them.
    "repeat_filter_batch": lambda s, r, w: s.shuffle(7).shard(r, w).repeat(2).filter(keep).map(ids).batch(3),
    "pack_repeat_best_fit": lambda s, r, w: (
        s.shuffle(5).shard(r, w).repeat(2).filter(keep).pack(SEQ_LEN, buffer_size=4)
    ),
    # Whole-epoch plans: the rows each old consumer had not handed out are dealt out whole.
    "pack_bfd": lambda s, r, w: s.shuffle(7).shard(r, w).pack(SEQ_LEN, strategy="bfd"),
    "pack_bfd_repeat_batch": lambda s, r, w: (
        s.shuffle(5).shard(r, w).map(dict).pack(SEQ_LEN, strategy="bfd").repeat(2).batch(2)
    ),
}


def delivered(chain: str, item: Any) -> list[int]:
    """What an item delivers: document ids, or (packed) the tokens of its rows."""
    if chain.startswith("pack"):
        rows = item if isinstance(item, list) else [item]
        return [int(t) for row in rows for t in row["input_ids"][row["document_ids"] > 0]]
    return list(item) if isinstance(item, list) else [item]


def expected(chain: str, docs: list[dict[str, Any]]) -> Counter[int]:
    if "repeat" in chain:
        once = expected(chain.replace("repeat_", ""), docs)
        return once + once
    if chain == "shard":
        return Counter(d["id"] for d in docs)
    if chain == "filter_batch":
        return Counter(d["id"] for d in docs if keep(d))
    kept = [d for d in docs if keep(d)] if chain == "pack_best_fit" else docs
    if chain == "pack_first_fit_truncate":
        return Counter(t for d in kept for t in d["input_ids"][:SEQ_LEN])
    return Counter(t for d in kept for t in d["input_ids"])


def run_phases(
    chain: str, docs: list[dict[str, Any]], phases: list[tuple[int, list[float]]], kind: str = "list"
) -> Counter[int]:
    """``run_topologies`` over chain ``chain`` of ``CHAINS`` on ``docs`` in a ``kind`` source."""
    return run_topologies(
        lambda consumer, consumers: CHAINS[chain](indexed_source(kind, docs), consumer, consumers),
        phases,
        lambda item: delivered(chain, item),
    )


def run_topologies(
    build: Callable[[int, int], rs.Node], phases: list[tuple[int, list[float]]], deliver: Callable[[Any], list[int]]
) -> Counter[int]:
    """Run consumers topology by topology: in each phase consumer ``c`` of ``C`` (its pipeline
    ``build(c, C)``) takes a fraction of what it holds, then every state is saved (as JSON) and
    the next topology restores from all of them. The last phase runs to the end of the epoch.
    What the items delivered (``deliver``), counted."""
    seen: Counter[int] = Counter()
    states: list[dict[str, Any]] | None = None
    for number, (consumers, fractions) in enumerate(phases):
        last = number == len(phases) - 1
        new_states = []
        for consumer in range(consumers):
            with build(consumer, consumers) as pipe:
                if states is not None:
                    restore(pipe, states)
                items = list(pipe) if last else take_fraction(pipe, fractions[consumer % len(fractions)])
                for item in items:
                    seen.update(deliver(item))
                new_states.append(json.loads(json.dumps(pipe.get_state())))
        states = new_states
    return seen


def take_fraction(pipe: rs.Node, fraction: float) -> list[Any]:
    """About ``fraction`` of what the pipeline still holds (its state is a fresh copy)."""
    probe = json.loads(json.dumps(pipe.get_state()))
    remaining = sum(1 for _ in pipe)
    pipe.set_state(probe)
    count = int(round(fraction * remaining))
    return [next(pipe) for _ in range(count)]


@pytest.mark.parametrize("kind", INDEXED_KINDS)
@pytest.mark.parametrize("chain", sorted(CHAINS))
def test_each_document_once_across_rescales(chain: str, kind: str) -> None:
    docs = documents(150)
    phases = [(8, [0.3, 0.5, 0.2, 0.6]), (6, [0.4, 0.1, 0.7]), (1, [0.25]), (4, [1.0])]
    assert run_phases(chain, docs, phases, kind) == expected(chain, docs)


@settings(deadline=None)
@given(
    chain=st.sampled_from(sorted(CHAINS)),
    kind=st.sampled_from(INDEXED_KINDS),
    count=st.integers(0, 120),
    phases=st.lists(
        st.tuples(st.integers(1, 7), st.lists(st.floats(0, 1), min_size=1, max_size=4)), min_size=1, max_size=4
    ),
)
def test_each_document_once_for_drawn_topologies(
    chain: str, kind: str, count: int, phases: list[tuple[int, list[float]]]
) -> None:
    docs = documents(count)
    kind = kind if docs else "list"  # a file without records is refused at construction
    assert run_phases(chain, docs, phases, kind) == expected(chain, docs)


@pytest.mark.parametrize("kind", INDEXED_KINDS)
@pytest.mark.parametrize("chain", sorted(CHAINS))
def test_same_topology_is_exact(chain: str, kind: str) -> None:
    docs = documents(60)
    reference = [CHAINS[chain](indexed_source(kind, docs), c, 3) for c in range(3)]
    heads = [[next(pipe) for _ in range(2)] for pipe in reference]
    states = [pipe.get_state() for pipe in reference]
    for consumer, pipe in enumerate(reference):
        resumed = CHAINS[chain](indexed_source(kind, docs), consumer, 3)
        restore(resumed, states)
        assert resumed.get_state() == states[consumer]
        assert [delivered(chain, x) for x in resumed] == [delivered(chain, x) for x in pipe]
    assert all(len(head) == 2 for head in heads)


@pytest.mark.parametrize("kind", INDEXED_KINDS)
def test_later_epochs_run_on_the_new_topology_from_the_start(kind: str) -> None:
    docs = documents(90)
    build = CHAINS["pack_best_fit"]
    old = [build(indexed_source(kind, docs), c, 5) for c in range(5)]
    for pipe in old:
        take_fraction(pipe, 0.5)
    states = [pipe.get_state() for pipe in old]
    for consumer in range(2):
        resumed = build(indexed_source(kind, docs), consumer, 2)
        restore(resumed, states)
        list(resumed)  # the rest of the rescaled epoch
        fresh = build(indexed_source(kind, docs), consumer, 2)
        fresh.start_epoch(1)
        following = [delivered("pack", row) for row in resumed]  # iterating again: epoch 1
        assert following == [delivered("pack", row) for row in fresh]
        assert "remap" not in json.dumps(resumed.get_state())


def test_rescaled_state_is_small_and_says_who_it_is() -> None:
    docs = documents(400)
    build = CHAINS["filter_batch"]
    old = [build(rs.from_list(docs), c, 16) for c in range(16)]
    for c, pipe in enumerate(old):
        for _ in range(c % 3 + 2):
            next(pipe)
    states = [pipe.get_state() for pipe in old]
    new = build(rs.from_list(docs), 2, 3)
    state = rescaled_state(new, states)
    assert consumer_of(state) == (2, 3)
    text = json.dumps(state)
    assert '"parents": "' in text and len(text) < 2000, text  # this consumer's share of the level, encoded

    # Once this consumer has passed the band, its state keeps one integer for the level.
    new.set_state(state)
    band = new.upstream.upstream.upstream.remap.steps[0].band  # Batch > Map > Filter > Shard
    needed = band // 3 + 2  # positions of this consumer's stride (3 consumers) that cover the band
    for _ in range(-(-needed // 3)):  # a batch reads at least 3 positions
        next(new)
    compact = json.dumps(new.get_state())
    assert '"behind"' not in compact and '"shift"' in compact and '"first"' in compact


@pytest.mark.parametrize("kind", INDEXED_KINDS)
def test_compacted_states_rescale_again_exactly(kind: str) -> None:
    """Consumers past the band save compacted remaps, those still in it the full level: a
    second rescale merges them and still delivers each document once."""
    docs = documents(300)
    phases = [(10, [0.3, 0.35, 0.32]), (4, [0.02, 0.5, 0.04, 0.6]), (3, [1.0])]
    assert run_phases("shard", docs, phases, kind) == expected("shard", docs)


def test_wrong_old_states_are_state_errors() -> None:
    docs = documents(40)
    build = CHAINS["shard"]
    old = [build(rs.from_list(docs), c, 3) for c in range(3)]
    states = [pipe.get_state() for pipe in old]
    new = build(rs.from_list(docs), 0, 2)
    with pytest.raises(rs.StateError, match="every consumer's, in order"):
        restore(new, states[:2])
    with pytest.raises(rs.StateError, match="every consumer's, in order"):
        restore(new, states[::-1])
    other = [CHAINS["shard"](rs.from_list(documents(41)), c, 3).get_state() for c in range(3)]
    with pytest.raises(rs.StateError):
        restore(new, other)
    with pytest.raises(rs.StateError, match="no old states"):
        restore(new, [])
    mixed = [build(rs.from_list(docs), c, 3) for c in range(3)]
    mixed[0].start_epoch(2)
    with pytest.raises(rs.StateError, match=r"more than one epoch apart \(epoch \[0, 2\]\)"):
        restore(new, [pipe.get_state() for pipe in mixed])


@settings(deadline=None, max_examples=30)
@given(
    topologies=st.lists(st.tuples(st.integers(1, 4), st.integers(1, 3)), min_size=2, max_size=4),
    fraction=st.floats(0, 0.9),
)
def test_ranks_times_workers_resolved_from_the_environment(topologies: list[tuple[int, int]], fraction: float) -> None:
    """``.shard()`` without arguments, as in a job: each simulated rank x worker builds its
    pipeline under a simulated topology, exactly as it would resolve it in a DataLoader worker."""
    from resumable.order.topology import Topology
    from tests.topology import simulated_consumer

    docs = documents(97)
    seen: Counter[int] = Counter()
    states: list[dict[str, Any]] | None = None
    for number, (ranks, workers) in enumerate(topologies):
        last = number == len(topologies) - 1
        new_states = []
        for rank in range(ranks):
            for worker in range(workers):
                with simulated_consumer(Topology(rank, ranks, worker, workers)):
                    pipe = rs.from_list(docs).shuffle(5).shard().filter(keep).pack(SEQ_LEN, buffer_size=3)
                    if states is not None:
                        restore(pipe, states)
                    rows = list(pipe) if last else take_fraction(pipe, fraction)
                    new_states.append(json.loads(json.dumps(pipe.get_state())))
                for row in rows:
                    seen.update(delivered("pack", row))
        states = new_states
    assert seen == expected("pack_best_fit", docs)


def rescaled_pipeline_state() -> tuple[Callable[[], rs.Node], dict[str, Any]]:
    docs = documents(60)
    build = CHAINS["pack_best_fit"]
    old = [build(rs.from_list(docs), c, 3) for c in range(3)]
    for c, pipe in enumerate(old):
        take_fraction(pipe, 0.2 + 0.2 * c)
    state = rescaled_state(build(rs.from_list(docs), 0, 2), [pipe.get_state() for pipe in old])
    return (lambda: build(rs.from_list(docs), 0, 2)), json.loads(json.dumps(state))


def shard_state(state: dict[str, Any]) -> dict[str, Any]:
    node = state
    while node["kind"] != "Shard":
        node = node["upstream"]
    return node


@pytest.mark.parametrize(
    "edit",
    [
        lambda remap: remap.update(length=2**63),
        lambda remap: remap.update(length=remap["length"] + 1),
        lambda remap: remap["steps"][0].update(top=remap["steps"][0]["top"] + 1),
        lambda remap: remap["steps"][0].update(length=2**63),
        lambda remap: remap["steps"].append({"shift": 5}),
        lambda remap: remap["steps"].insert(0, {"shift": -1}),
    ],
)
def test_an_inconsistent_remap_is_a_state_error(edit: Callable[[dict[str, Any]], None]) -> None:
    """A remap's levels must chain from its length down to the epoch's positions, and each
    level's top must be its furthest cursor; anything else would read other positions."""
    build, state = rescaled_pipeline_state()
    edit(shard_state(state)["remap"])
    pipe = build()
    with pytest.raises(rs.StateError, match="Shard"):
        pipe.set_state(state)


def test_a_remap_compacted_past_the_cursor_is_a_state_error() -> None:
    build, state = rescaled_pipeline_state()
    pipe = build()
    pipe.set_state(state)
    list(pipe)
    ended = json.loads(json.dumps(pipe.get_state()))
    shard = shard_state(ended)
    assert shard["remap"]["first"] > 0  # compacted: the positions before the cursor are gone
    shard["position"] = 0
    with pytest.raises(rs.StateError, match="keeps positions from"):
        build().set_state(ended)


@pytest.mark.parametrize("inherited", [5, None, "x", [[1, 2]], [[0, 10**6, 0, 1]]])
def test_malformed_inherited_pieces_are_state_errors(inherited: Any) -> None:
    """In the form of the previous version (one list per inherited piece), which still loads."""
    build, rescaled = rescaled_pipeline_state()
    state = expand_references(rescaled)
    state["inherited"] = inherited
    with pytest.raises(rs.StateError, match="Pack"):
        build().set_state(state)
    del state["inherited"]
    with pytest.raises(rs.StateError, match="inherited"):
        build().set_state(state)


@pytest.mark.parametrize("position", [2**63, 10**30, -1, 1000])
def test_an_old_cursor_out_of_range_is_a_state_error_naming_the_node(position: int) -> None:
    docs = documents(40)
    build = CHAINS["shard"]
    old = [build(rs.from_list(docs), c, 2) for c in range(2)]
    states = [json.loads(json.dumps(pipe.get_state())) for pipe in old]
    states[1]["position"] = position  # the cursor: the map over the shard
    with pytest.raises(rs.StateError, match="IndexedMap"):
        restore(build(rs.from_list(docs), 0, 3), states)


def repeated_twice() -> rs.Node:
    return rs.from_list(list(range(101))).shuffle(seed=2).shard().repeat(2).batch(4)


@pytest.mark.parametrize("steps, new_workers", [(25, 3), (25, 0), (26, 1)])
def test_loader_workers_straddling_an_epoch_boundary_rescale_exactly_once(steps: int, new_workers: int) -> None:
    """Shards differ by one record, so after ``.repeat()`` one worker may already read the next
    epoch while the other finishes the current one: the rescale continues both epochs."""
    from resumable.torch import Loader

    old = Loader(repeated_twice, num_workers=2)
    seen: Counter[int] = Counter()
    batches = iter(old)
    for _ in range(steps):
        seen.update(int(x) for x in next(batches))
    state = old.state_dict()
    old.close()
    new = Loader(repeated_twice, num_workers=new_workers)
    new.load_state_dict([state])
    for batch in new:
        seen.update(int(x) for x in batch)
    new.close()
    assert seen == Counter({i: 2 for i in range(101)})


def test_rescale_of_consumers_on_both_sides_of_an_epoch_boundary() -> None:
    docs = documents(31)
    build = CHAINS["repeat_filter_batch"]
    old = [build(rs.from_list(docs), c, 2) for c in range(2)]
    seen: Counter[int] = Counter()
    seen.update(next(old[0]))  # consumer 0 stays in epoch 0, consumer 1 moves on to epoch 1
    while shard_state(old[1].get_state())["epoch"] == 0:
        seen.update(next(old[1]))
    states = [json.loads(json.dumps(pipe.get_state())) for pipe in old]
    assert [shard_state(state)["epoch"] for state in states] == [0, 1]
    for consumer in range(3):
        pipe = build(rs.from_list(docs), consumer, 3)
        restore(pipe, states)
        if consumer == 0:
            assert "next_remap" in json.dumps(pipe.get_state())
        for batch in pipe:
            seen.update(batch)
    assert seen == expected("repeat_filter_batch", docs)


def test_the_per_consumer_batch_size_may_change_on_a_rescale() -> None:
    """4 consumers of 6 -> 3 consumers of 8 keeps a global batch of 24; each document once."""
    docs = documents(150)

    def build(consumer: int, consumers: int, size: int) -> rs.Node:
        return rs.from_list(docs).shuffle(4).shard(consumer, consumers).map(ids).batch(size)

    old = [build(c, 4, 6) for c in range(4)]
    seen: Counter[int] = Counter()
    for pipe in old:
        for _ in range(2):
            seen.update(next(pipe))
    states = [pipe.get_state() for pipe in old]
    sizes = []
    for consumer in range(3):
        pipe = build(consumer, 3, 8)
        restore(pipe, states)
        for batch in pipe:
            seen.update(batch)
            sizes.append(len(batch))
    assert seen == expected("shard", docs)
    assert max(sizes) == 8
    same = build(0, 4, 8)
    with pytest.raises(rs.StateError, match="batch_size"):
        same.set_state(states[0])  # a plain restore still checks it
    with pytest.raises(rs.StateError, match="drop_last"):
        restore(rs.from_list(docs).shuffle(4).shard(0, 3).map(ids).batch(8, drop_last=True), states)


def mixed_then_packed(consumer: int, consumers: int, kind: str = "list") -> rs.Node:
    """Two sharded components (the second's tokens offset so every token names itself), mixed,
    then packed: rows hold documents of both, buffered by keys that name the component."""
    web = indexed_source(kind, documents(70)).shuffle(7).shard(consumer, consumers).filter(keep)
    code = rs.from_list(shifted(documents(45))).shard(consumer, consumers)
    return rs.mix({"web": web, "code": code}, weights={"web": 2, "code": 1}, on_end="drop").pack(SEQ_LEN, buffer_size=4)


def shifted(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"id": d["id"], "input_ids": [t + 10**7 for t in d["input_ids"]]} for d in docs]


def mix_expected() -> Counter[int]:
    web = Counter(t for d in documents(70) if keep(d) for t in d["input_ids"])
    return web + Counter(t for d in shifted(documents(45)) for t in d["input_ids"])


@settings(deadline=None, max_examples=20)
@given(
    kind=st.sampled_from(["list", "jsonl"]),
    phases=st.lists(
        st.tuples(st.integers(1, 5), st.lists(st.floats(0, 1), min_size=1, max_size=3)), min_size=1, max_size=3
    ),
)
def test_mix_then_pack_rescales_every_token_once(kind: str, phases: list[tuple[int, list[float]]]) -> None:
    seen = run_topologies(
        lambda consumer, consumers: mixed_then_packed(consumer, consumers, kind),
        phases,
        lambda row: delivered("pack", row),
    )
    assert seen == mix_expected()


def test_a_mix_component_without_a_shard_cannot_be_rescaled() -> None:
    def build(consumer: int, consumers: int) -> rs.Node:
        return rs.mix({"a": rs.from_list(list(range(9))).shard(consumer, consumers), "b": rs.from_list([1, 2])})

    states = [build(c, 2).get_state() for c in range(2)]
    with pytest.raises(rs.ConfigError, match="shard"):
        restore(build(0, 3), states)
