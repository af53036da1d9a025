"""Stride keys attacked: every chain a key flows through, the Loader, elastic rescales, damaged
states and other topologies.

Below a shard a record's key is ``(Stride(c, C), epoch, k)`` (``resumable.core.keys``). Here:

* every chain whose keys pass through other nodes between the shard and a packer (map, filter,
  parallel map in threads and processes, prefetch, cache and indexed filter and block shuffle
  below the shard, block shuffle and shuffle above it, repeat on either side of the packer, a
  mix of sharded components, ``split_workers=False``, one consumer) resumes from a JSON round
  trip at the first row, the middle, the last row of an epoch and the one after it, the last
  row, after it, and twice in a row, equal to the uninterrupted run;
* ``rs.torch.Loader`` with 0 and 2 workers, persistent or not, over a packed sharded pipeline
  resumes its batches exactly from a ``state_dict`` taken at many points;
* elastic rescales 4x2 -> 3x3 -> 1x1 -> 2x2 of a packer over a repeat deliver every document's
  tokens once per epoch, and the buffers they leave (old consumers' strides, leaf keys of the
  rescaled epoch, the new topology's strides of the next epoch) restore exactly;
* damaged strides and references are ``rs.StateError`` (from ``set_state`` or from the rows
  after it) and a refused state leaves the pipeline as it was;
* a state restored into another topology without ``resumable.elastic`` is a ``StateError``.
"""

from __future__ import annotations

import copy
import itertools
import json
from collections import Counter
from typing import Any, Callable

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

import resumable as rs
from resumable.elastic import rescaled_states, restore
from resumable.pack import expand_references
from resumable.pack._refs import EPOCH, RECORD
from resumable.torch import Loader
from tests.sources import indexed_source

SEQ_LEN = 32
BUFFER = 8
STRIDE_CONSUMER, STRIDE_OF = "consumer", "of"


def documents(count: int) -> list[dict[str, Any]]:
    """Documents of 1-40 tokens, each token naming its document (its id + 1: 0 is padding)."""
    return [{"id": i, "input_ids": [i + 1] * (1 + i * 7 % 40)} for i in range(count)]


DOCS = documents(90)


def tokens(record: dict[str, Any]) -> dict[str, Any]:
    """A map that builds a new record (module level: picklable for process pools)."""
    return {"id": record["id"], "input_ids": list(record["input_ids"])}


def keep(record: dict[str, Any]) -> bool:
    return bool(record["id"] % 5 != 3)


def row_of(item: Any) -> Any:
    """A packed row (or a batch of them) as plain lists: tokens and document ids."""
    if isinstance(item, list):
        return [row_of(part) for part in item]
    return (np.asarray(item["input_ids"]).tolist(), np.asarray(item["document_ids"]).tolist())


def rows(pipe: rs.Node, count: int | None = None) -> list[Any]:
    """The rows ``pipe`` hands out: ``count`` of them, or to its end."""
    return [row_of(item) for item in itertools.islice(pipe, count)]


def saved(node: Any) -> dict[str, Any]:
    """A state as a checkpoint keeps it: through JSON."""
    state = node.get_state() if isinstance(node, rs.Node) else node.state_dict()
    return json.loads(json.dumps(state))


def pack_states(state: Any) -> list[dict[str, Any]]:
    """Every packer state inside ``state`` (a pipeline's, or a loader's, which holds each
    worker's pipeline state as JSON text)."""
    found: list[dict[str, Any]] = []
    if isinstance(state, str) and state.startswith("{"):
        found.extend(pack_states(json.loads(state)))
    elif isinstance(state, dict):
        if state.get("kind") == "Pack":
            found.append(state)
        for value in state.values():
            found.extend(pack_states(value))
    elif isinstance(state, list):
        for value in state:
            found.extend(pack_states(value))
    return found


def buffered_prefixes(state: Any) -> list[str]:
    """The key prefixes of every buffered reference of every packer in ``state``, as JSON."""
    prefixes = []
    for pack in pack_states(state):
        listed = expand_references(pack)
        for section in ("open", "ready", "span", "inherited"):
            entries = listed.get(section, [])
            if section == "span":
                entries = [entries] if entries else []
            for group in entries:
                for ref in group if group and isinstance(group[0], list) else [group]:
                    prefixes.append(json.dumps(ref[:-4]))
    return prefixes


def stride(consumer: int, consumers: int) -> dict[str, int]:
    return {STRIDE_CONSUMER: consumer, STRIDE_OF: consumers}


# -- every chain keys flow through ------------------------------------------------------------

Build = Callable[[int], rs.Node]
"""A pipeline over ``epochs`` epochs."""


def source() -> rs.Node:
    return rs.from_list(DOCS)


def packer(node: rs.Node) -> rs.Node:
    return node.pack(SEQ_LEN, strategy="best_fit", buffer_size=BUFFER)


CHAINS: dict[str, tuple[Build, str]] = {
    # name: (build, the keys its packer holds after a few rows: "stride", "leaf" or a mix's)
    "map_filter": (lambda n: packer(source().shuffle(3).shard(1, 3).map(tokens).filter(keep)).repeat(n), "stride"),
    "map_filter_repeat_inside": (
        lambda n: packer(source().shuffle(3).shard(1, 3).map(tokens).repeat(n).filter(keep)),
        "stride",
    ),
    "parallel_map_threads": (
        lambda n: packer(source().shuffle(3).shard(1, 3).repeat(n).map(tokens, num_workers=2, mode="thread")),
        "stride",
    ),
    "parallel_map_processes": (
        # dict: picklable without importing this module in the pool's processes
        lambda n: packer(source().shuffle(3).shard(2, 3).map(dict, num_workers=2, mode="process")).repeat(n),
        "stride",
    ),
    "prefetch_between": (
        lambda n: packer(source().shuffle(3).shard(1, 3).map(tokens).repeat(n).prefetch(3).filter(keep)),
        "stride",
    ),
    "prefetch_above_pack_jsonl": (
        lambda n: packer(indexed_source("jsonl", DOCS).shuffle(3).shard(0, 2).repeat(n)).prefetch(2),
        "stride",
    ),
    "cache_below_shard": (
        lambda n: packer(source().map(tokens).cache().shuffle(3).shard(1, 3).filter(keep)).repeat(n),
        "stride",
    ),
    "indexed_filter_below_shard": (
        lambda n: packer(
            source().filter(keep, index=True, progress=False).shuffle(3).shard(1, 3).map(tokens).repeat(n)
        ),
        "stride",
    ),
    "block_shuffle_below_shard": (
        lambda n: packer(source().shuffle(3, block_size=4).shard(1, 3).map(tokens)).repeat(n),
        "stride",
    ),
    "block_shuffle_window_below_shard": (
        lambda n: packer(source().shuffle(3, block_size=4, window=3).shard(2, 3).repeat(n)),
        "stride",
    ),
    "block_shuffle_above_shard": (
        lambda n: packer(source().shuffle(3).shard(1, 3).shuffle(4, block_size=4).map(tokens)).repeat(n),
        "leaf",
    ),
    "shuffle_above_shard": (lambda n: packer(source().shard(1, 3).shuffle(4).map(tokens).repeat(n)), "leaf"),
    "no_split_workers": (
        lambda n: packer(source().shuffle(3).shard(1, 3, split_workers=False).map(tokens)).repeat(n),
        "stride",
    ),
    "one_consumer": (lambda n: packer(source().shuffle(3).shard(0, 1).map(tokens).repeat(n)), "stride"),
    "greedy": (
        lambda n: source().shuffle(3).shard(1, 3).repeat(n).map(tokens).pack(SEQ_LEN, strategy="greedy"),
        "stride",
    ),
    "first_fit_truncate": (
        lambda n: (
            source()
            .shuffle(3)
            .shard(1, 3)
            .map(tokens)
            .pack(SEQ_LEN, strategy="first_fit", buffer_size=4, overlong="truncate")
            .repeat(n)
        ),
        "stride",
    ),
    "bfd_batch": (
        lambda n: source().shuffle(3).shard(1, 3).map(tokens).pack(SEQ_LEN, strategy="bfd").batch(2).repeat(n),
        "bfd",
    ),
    "unshuffled_shard": (lambda n: packer(source().shard(2, 3).map(tokens)).repeat(n), "stride"),
    "mix_of_sharded_components": (
        lambda n: packer(
            rs.mix(
                {
                    "a": source().shuffle(1).shard(0, 2).map(tokens),
                    "b": rs.from_list(DOCS[:40]).shuffle(2).shard(1, 3),
                    "c": rs.from_list(DOCS[40:]).shuffle(5),
                },
                weights={"a": 1.0, "b": 2.0, "c": 1.0},
                seed=3,
            )
        ).repeat(n),
        "mix",
    ),
}


FEW_POINTS = {"parallel_map_processes"}
"""Chains resumed at fewer points: each pipeline starts a process pool (about 0.4 s)."""


def resume_points(per_epoch: int, total: int) -> list[int]:
    """The first rows, the middle, the last row of the first epoch and the step after it, the
    middle of the second, its last row and the step after the end."""
    points = {0, 1, 2, per_epoch // 2, per_epoch - 1, per_epoch, per_epoch + 1, (per_epoch + total) // 2}
    return sorted(point for point in points | {total - 1, total} if 0 <= point <= total)


@pytest.mark.parametrize("chain", sorted(CHAINS))
def test_every_chain_resumes_exactly_at_any_point_across_epochs(chain: str) -> None:
    build, keys = CHAINS[chain]
    per_epoch = len(rows(build(1)))
    whole = rows(build(2))
    assert per_epoch < len(whole)
    points = resume_points(per_epoch, len(whole))
    if chain in FEW_POINTS:
        points = [per_epoch // 2, per_epoch, len(whole) - 1]
    for taken in points:
        with build(2) as first:
            head = rows(first, taken)
            state = saved(first)
        with build(2) as resumed:
            resumed.set_state(state)
            assert head + rows(resumed) == whole, f"resumed after {taken} rows"
    with build(2) as first:  # the key kind the chain's packer holds, as the docs say
        rows(first, 3)
        prefixes = set(buffered_prefixes(saved(first)))
    if keys == "stride":
        assert prefixes and all(STRIDE_OF in prefix for prefix in prefixes), prefixes
    elif keys == "leaf":
        assert prefixes == {"[]"}, prefixes
    elif keys == "bfd":  # a whole-epoch plan holds no references while its cursor stands
        assert not prefixes or all(STRIDE_OF in prefix for prefix in prefixes), prefixes
    else:  # a mix: the component's name, then its stride where it is sharded
        assert prefixes <= {'["a", {"consumer": 0, "of": 2}]', '["b", {"consumer": 1, "of": 3}]', '["c"]'}, prefixes


@pytest.mark.parametrize("chain", ["map_filter_repeat_inside", "parallel_map_threads", "mix_of_sharded_components"])
def test_every_chain_resumes_twice_in_a_row(chain: str) -> None:
    build, _ = CHAINS[chain]
    whole = rows(build(2))
    for taken in (len(whole) // 3, len(whole) - 2):
        first = build(2)
        head = rows(first, taken)
        again = build(2)
        again.set_state(saved(first))
        state = saved(again)  # taken right after the restore, before any row
        mid = rows(again, 1)
        twice = build(2)
        twice.set_state(saved(again))
        thrice = build(2)
        thrice.set_state(state)
        assert head + mid + rows(twice) == whole
        assert head + rows(thrice) == whole


def test_a_shard_cannot_sit_below_a_cache_or_an_indexed_filter() -> None:
    """Cache and filter(index=True) over a shard are refused when built, so their keys never
    meet a stride; below the shard they are chains of the property above."""
    with pytest.raises(rs.ConfigError):
        source().shuffle(3).shard(1, 3).cache()
    with pytest.raises(rs.ConfigError):
        source().shuffle(3).shard(1, 3).filter(keep, index=True, progress=False)


# -- the Loader -------------------------------------------------------------------------------


def loader_pipeline() -> rs.Node:
    return packer(rs.from_list(DOCS).shuffle(4).shard().map(tokens)).batch(2)


def loader_batches(loader: Loader, epochs: int, stop: int | None = None) -> tuple[list[Any], dict[str, Any] | None]:
    """Batches of ``epochs`` epochs from the loader's epoch on, and its state after ``stop``."""
    seen: list[Any] = []
    for _ in range(epochs):
        for batch in loader:
            seen.append(row_of(batch))
            if stop is not None and len(seen) == stop:
                return seen, saved(loader)
    return seen, None


def unsplit_pipeline() -> rs.Node:
    """Every worker reads the whole rank's stride (``split_workers=False``)."""
    return packer(rs.from_list(DOCS).shuffle(4).shard(split_workers=False).map(tokens)).batch(2)


LOADER_CONFIGS = [
    {"num_workers": 0},
    {"num_workers": 2},
    {"num_workers": 2, "persistent_workers": True},
    {"num_workers": 2, "split_workers": False},
]


@pytest.mark.parametrize("config", LOADER_CONFIGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_the_loader_resumes_a_packed_sharded_pipeline_exactly(config: dict[str, Any]) -> None:
    config = dict(config)
    build = unsplit_pipeline if config.pop("split_workers", True) is False else loader_pipeline
    reference = Loader(build, **config)
    per_epoch = len(loader_batches(reference, 1)[0])
    expected = loader_batches(Loader(build, **config), 2)[0]
    reference.close()
    consumers = 1 if build is unsplit_pipeline else max(config["num_workers"], 1)
    held: set[str] = set()
    stops = [1, 3, per_epoch - 1, per_epoch, per_epoch + 2, len(expected) - 1]
    if config["num_workers"]:  # each Loader starts its worker processes: fewer points
        stops = [3, per_epoch, per_epoch + 2]
    for stop in stops:
        old = Loader(build, **config)
        head, state = loader_batches(old, 2, stop)
        old.close()
        assert state is not None
        prefixes = set(buffered_prefixes(state))
        assert prefixes <= {json.dumps([stride(c, consumers)]) for c in range(consumers)}, prefixes
        held |= prefixes
        new = Loader(build, **config)
        new.load_state_dict(state)
        epochs_left = 2 - new.epoch
        tail, _ = loader_batches(new, epochs_left)
        assert head + tail == expected, f"resumed after {stop} batches"
        new.close()
    assert held, "no state held stride keys: the test lost its point"


def test_the_loader_rescaled_to_other_workers_delivers_each_token_once_and_resumes_exactly() -> None:
    """2 workers' stride keys dealt out to 3 workers, whose state (old strides, leaf keys of the
    rescaled epoch) is restored into another Loader of 3 workers at several batches."""
    old = Loader(loader_pipeline, num_workers=2)
    head, state = loader_batches(old, 1, 5)
    old.close()
    rescaled = Loader(loader_pipeline, num_workers=3)
    rescaled.load_state_dict([state])
    rest, _ = loader_batches(rescaled, 1)
    rescaled.close()
    seen = sum((delivered(row) for batch in head + rest for row in batch), Counter())
    assert seen == Counter({doc["id"] + 1: len(doc["input_ids"]) for doc in DOCS})
    held_old_strides = False
    for stop in (1, 2, 4):
        first = Loader(loader_pipeline, num_workers=3)
        first.load_state_dict([state])
        taken, middle = loader_batches(first, 1, stop)
        first.close()
        assert middle is not None and taken == rest[:stop]
        held_old_strides |= any('"of": 2' in prefix for prefix in buffered_prefixes(middle))
        again = Loader(loader_pipeline, num_workers=3)
        again.load_state_dict(middle)
        tail, _ = loader_batches(again, 1)
        again.close()
        assert taken + tail == rest, f"restored {stop} batches after the rescale"
    assert held_old_strides, "no state held the old workers' stride keys: the test lost its point"


# -- elastic: 4x2 -> 3x3 -> 1x1 -> 2x2 ----------------------------------------------------------

ELASTIC_DOCS = documents(150)
EPOCHS = 2


def elastic_pipeline(consumer: int, consumers: int, epochs: int = EPOCHS) -> rs.Node:
    return packer(rs.from_list(ELASTIC_DOCS).shuffle(7).shard(consumer, consumers).repeat(epochs).map(tokens))


def delivered(row: Any) -> Counter[int]:
    ids, documents_of = row
    return Counter(token for token, document in zip(ids, documents_of) if document)


def take_share(pipe: rs.Node, fraction: float, prefixes: set[str]) -> list[Any]:
    """About ``fraction`` of what ``pipe`` still holds (measured on a copy of its state), adding
    the key prefixes its packer holds after each row to ``prefixes``."""
    probe = saved(pipe)
    left = sum(1 for _ in pipe)
    pipe.set_state(probe)
    taken = []
    for _ in range(int(round(fraction * left))):
        taken.append(row_of(next(pipe)))
        prefixes.update(buffered_prefixes(pipe.get_state()))
    return taken


def check_restores_exactly(build: Callable[[], rs.Node], state: dict[str, Any], steps: list[int]) -> set[str]:
    """A pipeline restored from ``state``, taken ``step`` rows further and saved, restores into a
    fresh pipeline that hands out the rest as it does; the key prefixes its states held."""
    reference = build()
    reference.set_state(state)
    rest = rows(reference)
    seen: set[str] = set()
    for step in steps:
        if step > len(rest):
            continue
        pipe = build()
        pipe.set_state(state)
        assert rows(pipe, step) == rest[:step]
        middle = saved(pipe)
        seen.update(buffered_prefixes(middle))
        again = build()
        again.set_state(middle)
        assert rows(again) == rest[step:], f"restored {step} rows after the rescale"
    return seen


def test_rescales_deliver_each_token_once_and_mixed_buffers_restore_exactly() -> None:
    """Ranks x workers 4x2 -> 3x3 -> 1x1 -> 2x2, each new rank's workers rescaled together
    (``rescaled_states``); every restored worker also restores exactly from its own states."""
    epochs = 3  # the rescales fall in the first two: the last runs on the new topology whole
    phases = [(4, 2, [0.1, 0.2, 0.05, 0.25]), (3, 3, [0.1, 0.35, 0.2]), (1, 1, [0.3]), (2, 2, [1.0])]
    seen: Counter[int] = Counter()
    states: list[dict[str, Any]] | None = None
    kinds_seen: set[str] = set()
    for number, (ranks, workers, fractions) in enumerate(phases):
        last = number == len(phases) - 1
        consumers = ranks * workers
        new_states = []
        for rank in range(ranks):
            pipes = [elastic_pipeline(rank * workers + worker, consumers, epochs) for worker in range(workers)]
            if states is not None:
                for consumer, (pipe, state) in enumerate(zip(pipes, rescaled_states(pipes, states)), rank * workers):
                    pipe.set_state(state)
                    kinds_seen |= check_restores_exactly(
                        lambda c=consumer: elastic_pipeline(c, consumers, epochs), saved(pipe), [0, 1, 3, 6, 10, 16]
                    )
            for consumer, pipe in enumerate(pipes, rank * workers):
                taken = take_share(pipe, 1.0 if last else fractions[consumer % len(fractions)], kinds_seen)
                for row in taken:
                    seen.update(delivered(row))
                new_states.append(saved(pipe))
                pipe.close()
        states = new_states
    expected = Counter({doc["id"] + 1: epochs * len(doc["input_ids"]) for doc in ELASTIC_DOCS})
    assert seen == expected
    old_strides = {json.dumps([stride(c, 8)]) for c in range(8)}
    new_strides = {json.dumps([stride(c, n)]) for n in (9, 1, 4) for c in range(n)}
    assert kinds_seen & old_strides, "a rescaled buffer held an old consumer's stride keys"
    assert "[]" in kinds_seen, "and leaf keys of the rescaled epoch"
    assert kinds_seen & new_strides, "and the new topology's stride keys of the next epoch"


ELASTIC_VARIANTS: dict[str, Callable[[int, int, int], rs.Node]] = {
    "best_fit": elastic_pipeline,
    "reorder_after_shard": lambda c, n, epochs: packer(
        rs.from_list(ELASTIC_DOCS).shuffle(7).shard(c, n).shuffle(5).repeat(epochs).map(tokens)
    ),
    "block_shuffle_below": lambda c, n, epochs: (
        rs.from_list(ELASTIC_DOCS)
        .shuffle(7, block_size=8)
        .shard(c, n)
        .repeat(epochs)
        .map(tokens)
        .filter(keep)
        .pack(SEQ_LEN, strategy="first_fit", buffer_size=3)
    ),
    "greedy_mix": lambda c, n, epochs: (
        rs.mix(
            {
                "a": rs.from_list(ELASTIC_DOCS[:80]).shuffle(1).shard(c, n).map(tokens),
                "b": rs.from_list(ELASTIC_DOCS[80:]).shuffle(2).shard(c, n),
            },
            weights={"a": 1.0, "b": 1.0},
            seed=4,
            on_end="drop",  # every document of both once an epoch
        )
        .pack(SEQ_LEN, strategy="greedy")
        .repeat(epochs)
    ),
}


def variant_tokens(variant: str, epochs: int) -> Counter[int]:
    kept = [doc for doc in ELASTIC_DOCS if variant != "block_shuffle_below" or keep(doc)]
    return Counter({doc["id"] + 1: epochs * len(doc["input_ids"]) for doc in kept})


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    variant=st.sampled_from(sorted(ELASTIC_VARIANTS)),
    phases=st.lists(
        st.tuples(st.integers(1, 6), st.lists(st.floats(0, 0.6), min_size=1, max_size=3)), min_size=2, max_size=4
    ),
    step=st.integers(0, 12),
)
def test_drawn_rescales_deliver_each_token_once_and_restore_exactly(
    variant: str, phases: list[tuple[int, list[float]]], step: int
) -> None:
    """Drawn topologies over drawn chains (a reading order after the shard, whose rescaled
    epoch keeps leaf keys; a block shuffle and a filter below; a mix of sharded components):
    every token once per epoch, and each restored consumer restores exactly ``step`` rows on."""
    epochs = 2
    build = ELASTIC_VARIANTS[variant]
    seen: Counter[int] = Counter()
    states: list[dict[str, Any]] | None = None
    for number, (consumers, fractions) in enumerate(phases):
        last = number == len(phases) - 1
        new_states = []
        for consumer in range(consumers):
            with build(consumer, consumers, epochs) as pipe:
                if states is not None:
                    restore(pipe, states)
                    if consumer == step % consumers:
                        check_restores_exactly(lambda c=consumer: build(c, consumers, epochs), saved(pipe), [step])
                fraction = 1.0 if last else fractions[consumer % len(fractions)]
                for row in take_share(pipe, fraction, set()):
                    seen.update(delivered(row))
                new_states.append(saved(pipe))
        states = new_states
    assert seen == variant_tokens(variant, epochs)


def shard_of(pipe: rs.Node) -> Any:
    node = pipe
    while not isinstance(node, rs.nodes.Shard):
        node = node.upstream
    return node


def read_up_to(pipe: rs.Node, left: int) -> None:
    """Take rows until the shard has ``left`` positions of the first epoch still to read."""
    shard = shard_of(pipe)
    while shard.epoch == 0 and shard.position < len(shard) - left:
        next(pipe)


def test_one_buffer_holding_old_strides_leaf_keys_and_new_strides_restores_exactly() -> None:
    """A consumer of 3 after 8 whose packer holds, at once, pieces of old consumers (their
    strides), of the rescaled epoch (leaf keys) and of the next epoch (its own stride), saved
    and restored at every row across the epoch boundary."""
    olds = [elastic_pipeline(c, 8) for c in range(8)]
    for consumer, pipe in enumerate(olds):
        read_up_to(pipe, left=5 + consumer % 3)  # the rescaled epoch is short: its end comes soon
    states = [saved(pipe) for pipe in olds]
    mixed = False
    for consumer in range(3):
        pipe = elastic_pipeline(consumer, 3)
        restore(pipe, states)
        rescaled = saved(pipe)
        reference = elastic_pipeline(consumer, 3)
        reference.set_state(rescaled)
        rest = rows(reference)
        walker = elastic_pipeline(consumer, 3)
        walker.set_state(rescaled)
        for step in range(len(rest) + 1):
            state = saved(walker)
            prefixes = set(buffered_prefixes(state))
            old = any('"of": 8' in prefix for prefix in prefixes)
            new = any('"of": 3' in prefix for prefix in prefixes)
            if old and new and "[]" in prefixes:
                mixed = True
            again = elastic_pipeline(consumer, 3)
            again.set_state(state)
            assert rows(again) == rest[step:], f"consumer {consumer}, {step} rows after the rescale"
            next(walker, None)
    assert mixed, "no buffer held the three kinds of keys at once: the test lost its point"


def leaf_keyed(state: dict[str, Any], build: Callable[[], rs.Node]) -> dict[str, Any]:
    """``state`` as the previous version saved it: listed references whose stride keys are
    leaf keys ``[epoch, leaf index, start, end]``."""
    node = build()
    while not isinstance(node, rs.nodes.Shard):
        node = node.upstream
    base = node.upstream

    def convert(entry: Any) -> Any:
        if isinstance(entry, list) and entry and isinstance(entry[0], list):
            return [convert(part) for part in entry]
        if not entry or not isinstance(entry[0], dict):
            return entry
        position = entry[0][STRIDE_CONSUMER] + entry[2] * entry[0][STRIDE_OF]
        leaf = int(base._leaf_indices(np.array([position], dtype=np.int64), entry[1])[0])
        return [entry[1], leaf, *entry[3:]]

    def rewrite(node_state: dict[str, Any]) -> dict[str, Any]:
        if node_state["kind"] == "Pack":
            listed = expand_references(node_state)
            return {
                key: convert(value) if key in ("open", "ready", "span", "inherited") else value
                for key, value in listed.items()
            }
        return {**node_state, "upstream": rewrite(node_state["upstream"])} if "upstream" in node_state else node_state

    return rewrite(copy.deepcopy(state))


def test_a_leaf_keyed_state_below_a_shard_loads_and_its_mixed_buffers_restore_exactly() -> None:
    """A state of the previous version (leaf keys below the shard) continues as the stride-keyed
    one does; the buffers it leaves (its leaf keys beside new stride keys) restore exactly."""
    build = fuzz_pipeline
    whole = rows(build())
    first = build()
    head = rows(first, 14)
    old = leaf_keyed(saved(first), build)
    assert "[]" in set(buffered_prefixes(old)) and not any(STRIDE_OF in p for p in buffered_prefixes(old))
    loaded = build()
    loaded.set_state(old)
    rest = rows(loaded)
    assert head + rest == whole
    walker = build()
    walker.set_state(old)
    mixed = False
    for step in range(len(rest) + 1):
        state = saved(walker)
        prefixes = set(buffered_prefixes(state))
        mixed |= "[]" in prefixes and json.dumps([stride(1, 3)]) in prefixes
        again = build()
        again.set_state(state)
        assert rows(again) == rest[step:], f"{step} rows after the load"
        next(walker, None)
    assert mixed, "no buffer held leaf keys and stride keys at once: the test lost its point"


# -- damaged states ----------------------------------------------------------------------------


def fuzz_pipeline() -> rs.Node:
    return packer(rs.from_list(DOCS).shuffle(3).shard(1, 3).repeat(2).map(tokens))


def good_state() -> dict[str, Any]:
    pipe = fuzz_pipeline()
    rows(pipe, 14)  # into the second epoch: the buffer holds both epochs' keys
    state = saved(pipe)
    refs = pack_states(state)[0]["refs"]
    assert {json.dumps(origin) for origin in refs["origins"]} >= {json.dumps([stride(1, 3)])}
    return state


GOOD = good_state()


def refs_of(state: dict[str, Any]) -> dict[str, Any]:
    refs: dict[str, Any] = pack_states(state)[0]["refs"]
    return refs


JSON_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**65), 2**65),
    st.sampled_from([0, 1, 2, 3, 4, 2**31, 2**63 - 1, 2**63, 2**64, -1]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=4),
)
STRIDE_FIELDS = st.one_of(JSON_SCALARS, st.lists(st.integers(0, 3), max_size=2))
DAMAGED_STRIDES = st.one_of(
    st.fixed_dictionaries({STRIDE_CONSUMER: STRIDE_FIELDS, STRIDE_OF: STRIDE_FIELDS}),
    st.fixed_dictionaries({STRIDE_CONSUMER: st.integers(0, 5), STRIDE_OF: st.integers(0, 5)}),
    st.builds(
        lambda base, key, value: {**base, key: value},
        st.just(stride(1, 3)),
        st.text(max_size=3),
        JSON_SCALARS,
    ),
    st.dictionaries(st.sampled_from([STRIDE_CONSUMER, STRIDE_OF, "Consumer", ""]), st.integers(0, 4), max_size=3),
)
DAMAGED_ORIGINS = st.one_of(
    st.builds(lambda part: [part], DAMAGED_STRIDES),
    st.builds(lambda part, name: [part, name], DAMAGED_STRIDES, st.text(max_size=3)),  # a name after a stride
    st.builds(lambda first, second: [first, second], DAMAGED_STRIDES, DAMAGED_STRIDES),  # two strides
    st.builds(lambda name, part: [name, part], st.text(max_size=3), DAMAGED_STRIDES),  # a name the chain lacks
    st.builds(lambda value: [value], JSON_SCALARS),
    JSON_SCALARS,
    st.just([]),
)


def damage_origin(state: dict[str, Any], at: int, origin: Any) -> None:
    origins = refs_of(state)["origins"]
    origins[at % len(origins)] = origin


def damage_field(state: dict[str, Any], entry: str, field: int, value: Any) -> None:
    refs_of(state)[entry][field] = value


DAMAGES = st.one_of(
    st.builds(lambda at, origin: lambda s: damage_origin(s, at, origin), st.integers(0, 3), DAMAGED_ORIGINS),
    st.builds(
        lambda entry, field, value: lambda s: damage_field(s, entry, field, value),
        st.sampled_from(["base", "bits", "scale"]),
        st.sampled_from([EPOCH, RECORD]),
        st.one_of(
            st.integers(0, 64),
            st.sampled_from([30, 31, 40, 10**6, 2**62, 2**63 - 1, 2**63, 2**64, -1, True, False, 1.0, None, "1"]),
        ),
    ),
)


def noted(outcome: str) -> None:
    """Count ``outcome`` in Hypothesis' statistics (``--hypothesis-show-statistics``)."""
    if currently_in_test_context():
        event(outcome)


def assert_only_state_errors(target: rs.Node, bad: dict[str, Any]) -> None:
    """``bad`` is refused by ``set_state`` with a StateError leaving ``target`` as it was, or
    loads and then only StateErrors come out of the rows after it."""
    before = saved(target)
    twin = fuzz_pipeline()
    twin.set_state(before)
    try:
        target.set_state(bad)
    except rs.StateError:
        noted("refused by set_state")
        assert saved(target) == before, "a refused state changed the pipeline"
        assert rows(target, 6) == rows(twin, 6), "a refused state changed what the pipeline hands out"
        return
    try:
        rows(target)
        noted("loaded and ran to the end")
    except rs.StateError:
        noted("loaded, then a StateError from a row")


def assert_damaged_only_state_errors(damages: list[Callable[[dict[str, Any]], None]]) -> None:
    """``GOOD`` with ``damages`` applied, restored into a pipeline two rows in: only StateErrors."""
    bad = copy.deepcopy(GOOD)
    for damage in damages:
        damage(bad)
    target = fuzz_pipeline()
    rows(target, 2)
    assert_only_state_errors(target, bad)


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(DAMAGES, min_size=1, max_size=3))
def test_damaged_strides_and_references_are_only_state_errors(damages: list[Callable[[dict[str, Any]], None]]) -> None:
    assert_damaged_only_state_errors(damages)


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.one_of(
            st.builds(
                lambda at, consumer, consumers: lambda s: damage_origin(s, at, [stride(consumer, consumers)]),
                st.integers(0, 3),
                st.integers(0, 6),
                st.integers(1, 7),
            ),
            st.builds(
                lambda field, shift: lambda s: damage_field(s, "base", field, refs_of(s)["base"][field] + shift),
                st.sampled_from([EPOCH, RECORD]),
                st.integers(-3, 40),
            ),
        ),
        min_size=1,
        max_size=3,
    )
)
def test_plausible_strides_and_shifted_positions_are_only_state_errors(
    damages: list[Callable[[dict[str, Any]], None]],
) -> None:
    """Damage a check can miss (another valid stride, positions or epochs a little off) loads,
    or is a StateError, never another exception."""
    assert_damaged_only_state_errors(damages)


@pytest.mark.parametrize(
    ("entry", "field", "value"),
    [
        ("base", RECORD, 10**6),  # positions past the stride
        ("base", RECORD, 2**63 - 1),
        ("base", EPOCH, 2**63 - 1),  # an epoch that never comes
        ("base", EPOCH, 10**9),
        ("bits", RECORD, 64),
    ],
)
def test_references_past_the_stride_or_in_far_epochs_are_only_state_errors(entry: str, field: int, value: int) -> None:
    bad = copy.deepcopy(GOOD)
    damage_field(bad, entry, field, value)
    target = fuzz_pipeline()
    rows(target, 1)
    assert_only_state_errors(target, bad)


@pytest.mark.parametrize("shift", [1, 5, 10**6, 2**62])
@pytest.mark.parametrize("strategy", ["best_fit", "greedy"])
def test_positions_past_the_stride_are_refused_by_set_state(shift: int, strategy: str) -> None:
    """Every buffered position moved past the end of the consumer's stride: the packer can tell
    without fetching (the stride's size is arithmetic), so ``set_state`` itself refuses it and
    the pipeline is left as it was."""

    def build() -> rs.Node:
        pipe = rs.from_list(DOCS).shuffle(3).shard(1, 3).map(tokens)
        return pipe.pack(SEQ_LEN, strategy=strategy, buffer_size=BUFFER)

    first = build()
    rows(first, 4)
    bad = saved(first)
    refs = refs_of(bad)
    stride_size = len(DOCS) // 3
    refs["base"][RECORD] = max(refs["base"][RECORD] + shift, stride_size)
    target = build()
    rows(target, 2)
    before = saved(target)
    with pytest.raises(rs.StateError):
        target.set_state(bad)
    assert saved(target) == before


@pytest.mark.parametrize(
    "origin",
    [
        [stride(1, 3), "web"],
        [stride(1, 3), stride(1, 3)],
        [{STRIDE_CONSUMER: 1, STRIDE_OF: 3, "x": 0}],
        [{STRIDE_CONSUMER: True, STRIDE_OF: 3}],
        [{STRIDE_CONSUMER: 1, STRIDE_OF: True}],
        [{STRIDE_CONSUMER: 1.0, STRIDE_OF: 3}],
        [{STRIDE_CONSUMER: 1, STRIDE_OF: 2**63}],
        [{STRIDE_CONSUMER: 2**63 - 2, STRIDE_OF: 2**63 - 1}],
        [{STRIDE_CONSUMER: 89, STRIDE_OF: 90}],  # a stride of one position: past it at once
        [{STRIDE_CONSUMER: 0, STRIDE_OF: 1}],  # valid: another record, never a crash
        [{STRIDE_CONSUMER: 3, STRIDE_OF: 3}],
        [{STRIDE_CONSUMER: -1, STRIDE_OF: 3}],
        [{STRIDE_OF: 3}],
        [{}],
        ["web", stride(1, 3)],
        [None],
    ],
)
def test_each_damaged_stride_is_only_a_state_error(origin: Any) -> None:
    bad = copy.deepcopy(GOOD)
    for at in range(len(refs_of(bad)["origins"])):
        damage_origin(bad, at, origin)
    target = fuzz_pipeline()
    rows(target, 3)
    assert_only_state_errors(target, bad)


# -- another topology, without elastic ---------------------------------------------------------

TOPOLOGIES = [((1, 3), (0, 3)), ((1, 3), (1, 4)), ((0, 1), (0, 2)), ((2, 3), (0, 1)), ((0, 2), (0, 3))]


def topology_pipeline(consumer: int, consumers: int) -> rs.Node:
    return packer(rs.from_list(DOCS).shuffle(3).shard(consumer, consumers).repeat(2).map(tokens))


@pytest.mark.parametrize(("old", "new"), TOPOLOGIES)
@pytest.mark.parametrize("taken", [3, 20])
def test_a_state_restored_into_another_topology_without_elastic_is_a_state_error(
    old: tuple[int, int], new: tuple[int, int], taken: int
) -> None:
    pipe = topology_pipeline(*old)
    rows(pipe, taken)
    state = saved(pipe)
    assert any(STRIDE_OF in prefix for prefix in buffered_prefixes(state))
    target = topology_pipeline(*new)
    rows(target, 2)
    before = saved(target)
    with pytest.raises(rs.StateError):
        target.set_state(state)
    assert saved(target) == before


def test_a_rescaled_state_restored_into_another_topology_without_elastic_is_a_state_error() -> None:
    olds = [topology_pipeline(c, 4) for c in range(4)]
    for pipe in olds:
        rows(pipe, 5)
    pipe = topology_pipeline(1, 3)
    restore(pipe, [saved(old) for old in olds])
    rows(pipe, 2)
    state = saved(pipe)
    for other in [(0, 3), (1, 2), (1, 4)]:
        target = topology_pipeline(*other)
        before = saved(target)
        with pytest.raises(rs.StateError):
            target.set_state(state)
        assert saved(target) == before


@pytest.mark.parametrize(("old", "new"), [(2, 3), (2, 0), (0, 2)])
def test_a_loader_state_of_other_workers_given_as_one_state_is_a_state_error(old: int, new: int) -> None:
    loader = Loader(loader_pipeline, num_workers=old)
    _, state = loader_batches(loader, 1, 3)
    loader.close()
    assert state is not None
    other = Loader(loader_pipeline, num_workers=new)
    with pytest.raises(rs.StateError):
        other.load_state_dict(state)
    other.close()
