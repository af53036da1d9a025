"""Adversarial states: corrupt one entry of a real pipeline state (delete it, change its type,
make it huge, negative or deeply nested, shorten or lengthen a list) and load it.

Only the library's typed errors may come out of ``set_state`` and of the iteration after an
accepted state (never a TypeError, IndexError, OverflowError, RecursionError or a hang), and a
rejected state leaves the pipeline exactly as it was: it continues with the items it would
have given without the failed call.
"""

from __future__ import annotations

import atexit
import copy
import functools
import json
import shutil
import tempfile
from typing import Any, Callable
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import resumable as rs
from resumable import Node
from resumable.elastic import rescaled_state
from resumable.ops import even
from tests.resume import take
from tests.sources import INDEXED_KINDS, indexed_source, stream_source

Build = Callable[[], Node[Any]]

DOCS = [{"id": i, "input_ids": list(range(1, 2 + (i * 7) % 13))} for i in range(40)]
PAYLOAD_DOCS = [
    {**doc, "mask": [(doc["id"] + t) % 2 for t in range(len(doc["input_ids"]))], "image": f"img{doc['id']}"}
    for doc in DOCS
]
AFTER = 12  # items compared after a rejected state, or iterated after an accepted one
STREAMING_STRATEGIES = ("greedy", "first_fit", "best_fit")
INDEX_DIRECTORY = tempfile.mkdtemp(prefix="resumable-test-state-fuzz-")
atexit.register(shutil.rmtree, INDEX_DIRECTORY, ignore_errors=True)


def ids(record: dict[str, Any]) -> dict[str, Any]:
    return {"id": record["id"], "input_ids": record["input_ids"]}


def cost(record: dict[str, Any]) -> int:
    """A packing cost above the token count: positions reserved for an image."""
    return len(record["input_ids"]) + record["id"] % 3


def payload_pack(source: Node[Any], strategy: str) -> Node[Any]:
    """A packer with token and document fields and a ``length_fn``, using ``strategy``."""
    options: dict[str, Any] = {} if strategy == "bfd" else {"buffer_size": 4}
    return source.pack(
        8,
        strategy=strategy,
        overlong="truncate",
        token_fields=["mask"],
        document_fields=["image"],
        length_fn=cost,
        **options,
    ).map(tokens)


def tokens(row: Any) -> Any:
    return {key: np.asarray(value).tolist() for key, value in row.items()} if isinstance(row, dict) else row


def chains(kind: str) -> dict[str, Build]:
    source: Callable[[], Node[Any]] = lambda: indexed_source(kind, DOCS)  # noqa: E731
    payloads: Callable[[], Node[Any]] = lambda: indexed_source(kind, PAYLOAD_DOCS).shuffle(5)  # noqa: E731
    return {
        "indexed_filter": lambda: (
            source().filter(lambda r: r["id"] % 3, index=True, progress=False).shuffle(2).shard(1, 2).batch(2)
        ),
        "indexed_filter_cache": lambda: (
            source()
            .filter(lambda r: r["id"] % 4, index=True, cache_dir=INDEX_DIRECTORY, progress=False)
            .shuffle(3)
            .shard(0, 2)
        ),
        "even": lambda: source().shuffle(1).shard(0, 3).batch(2).even(times=3),
        "even_bfd": lambda: source().shuffle(4).pack(8, strategy="bfd").map(tokens).even(),
        **{
            f"pack_payloads_{strategy}": functools.partial(lambda s: payload_pack(payloads(), s), strategy)
            for strategy in (*STREAMING_STRATEGIES, "bfd")
        },
        "shuffle_shard_map": lambda: source().shuffle(3).shard(1, 3).map(ids),
        "filter_batch_repeat": lambda: source().shuffle(1).shard(0, 2).filter(lambda r: r["id"] % 3).batch(3).repeat(2),
        "block_shuffle": lambda: source().shuffle(5, block_size=4, window=2).batch(2),
        "pack_best_fit": lambda: source().shuffle(2).shard(0, 2).pack(8, buffer_size=4).map(tokens),
        "pack_greedy_split": lambda: source().pack(5, strategy="greedy", overlong="split").map(tokens),
        "pack_bfd_epoch": lambda: source().shuffle(4).pack(8, strategy="bfd").map(tokens),
        "prefetch_parallel": lambda: source().shuffle(6).map(ids, num_workers=2).prefetch(3).batch(2),
        "cache": lambda: source().cache().shuffle(7).shard(0, 2),
        "mix_pack": lambda: (
            rs.mix({"a": source().shuffle(2), "b": rs.from_list(DOCS[:9])}, on_end="restart")
            .pack(8, buffer_size=4)
            .map(tokens)
        ),
        "mix": lambda: rs.mix(
            {"a": source().shuffle(1).repeat(), "b": rs.from_list(list(range(9)))}, weights={"a": 2, "b": 1}, seed=3
        ),
    }


def other_chains() -> dict[str, Build]:
    """Sources that are not indexed: file-sharded streams (plain and gzip), a torchdata graph."""

    def torchdata_graph() -> Node[Any]:
        from torchdata.nodes import IterableWrapper

        from resumable.torch import FromTorchdata

        return FromTorchdata(IterableWrapper(range(30))).batch(4)

    return {
        "stream": lambda: stream_source("jsonl_stream", DOCS, shuffle_files=1, rank=0, world_size=2).batch(3),
        "stream_gzip_pack": lambda: stream_source("jsonl_stream_gzip", DOCS).pack(8, buffer_size=3).map(tokens),
        "stream_prefetch_repeat": lambda: stream_source("jsonl_stream", DOCS).prefetch(2).repeat(2),
        "from_torchdata": torchdata_graph,
    }


def rescaled_chain(kind: str) -> tuple[Build, Callable[[], dict[str, Any]]]:
    """A packer after a rescale 3 -> 2 consumers: the state holds a remap and inherited pieces."""

    def build(consumer: int, consumers: int) -> Node[Any]:
        return indexed_source(kind, DOCS).shuffle(2).shard(consumer, consumers).pack(8, buffer_size=4).map(tokens)

    def state() -> dict[str, Any]:
        olds = []
        for consumer in range(3):
            pipe = build(consumer, 3)
            take(pipe, 2 + consumer)
            olds.append(pipe.get_state())
        return rescaled_state(build(0, 2), olds)

    return (lambda: build(0, 2)), state


def even_carry_chain(kind: str) -> tuple[Build, Callable[[], dict[str, Any]]]:
    """An Even whose state carries a surplus over epochs counted ahead: it ran against a rank
    that offered fewer items every epoch."""

    def build() -> Node[Any]:
        return indexed_source(kind, DOCS).shuffle(1).batch(3).even()

    def state() -> dict[str, Any]:
        pipe = build()
        with mock.patch.object(even, "agree_min", lambda offer, group=None: min(offer, 5)):
            take(pipe, 17)
        return pipe.get_state()

    return build, state


PREPARED = {"rescaled_pack": rescaled_chain, "even_carry": even_carry_chain}
"""Chains whose state is made by more than iterating: (build, state) per source kind."""


def prepared(kind: str, chain: str) -> tuple[Build, Node[Any]]:
    """The chain's builder and a pipeline of it, restored to its prepared state if it has one."""
    if chain in PREPARED:
        build, make_state = PREPARED[chain](kind)
        pipe = build()
        pipe.set_state(make_state())
        return build, pipe
    build = {**chains(kind), **other_chains()}[chain]
    return build, build()


def paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in a JSON value: dict keys and list indices, depth first."""
    found = [prefix] if prefix else []
    if isinstance(value, dict):
        for key, item in value.items():
            found.extend(paths(item, (*prefix, key)))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found.extend(paths(item, (*prefix, index)))
    return found


def nested(depth: int) -> Any:
    value: Any = 0
    for _ in range(depth):
        value = [value]
    return value


REPLACEMENTS: list[Any] = [
    None,
    True,
    False,
    -1,
    0,
    1,
    2**31,
    2**63,
    10**30,
    -(2**63),
    1.5,
    "x",
    "",
    [],
    {},
    [[]],
    [-1],
]
OPERATIONS = ["delete", "replace", "increment", "decrement", "truncate", "append", "duplicate", "deep"]


def corrupt(state: dict[str, Any], where: tuple[Any, ...], operation: str, replacement: Any) -> dict[str, Any]:
    corrupted = copy.deepcopy(state)
    parent: Any = corrupted
    for step in where[:-1]:
        parent = parent[step]
    last = where[-1]
    value = parent[last]
    if operation == "delete":
        del parent[last]
    elif operation == "replace":
        parent[last] = copy.deepcopy(replacement)
    elif operation in ("increment", "decrement"):
        step = 1 if operation == "increment" else -1
        parent[last] = value + step if isinstance(value, int) and not isinstance(value, bool) else replacement
    elif operation == "truncate":
        parent[last] = value[: len(value) // 2] if isinstance(value, (list, str)) else replacement
    elif operation == "append":
        parent[last] = [*value, value[-1] if value else 0] if isinstance(value, list) else replacement
    elif operation == "duplicate":
        parent[last] = value + value if isinstance(value, list) else replacement
    else:
        parent[last] = nested(5000)
    return corrupted


def items_after(build: Build, state: dict[str, Any]) -> list[Any]:
    """The ``AFTER`` items a pipeline restored from ``state`` hands out next."""
    reference = build()
    reference.set_state(json.loads(json.dumps(state)))
    expected = take(reference, AFTER)
    reference.close()
    return expected


def check_corrupted_state(
    build: Build, state: dict[str, Any], corrupted: dict[str, Any], expected: list[Any] | None = None
) -> None:
    """``corrupted`` is rejected with a typed error and leaves the pipeline as it was (handing
    out ``expected``, ``items_after(build, state)``, computed here unless given), or it is
    accepted and iterating on raises nothing but typed errors."""
    if expected is None:
        expected = items_after(build, state)
    pipe = build()
    pipe.set_state(json.loads(json.dumps(state)))
    try:
        pipe.set_state(corrupted)
    except rs.ResumableError:
        assert take(pipe, AFTER) == expected, "a rejected state changed the pipeline"
        return
    finally:
        pipe.close()
    try:
        take(pipe, AFTER)
    except rs.ResumableError:
        pass
    finally:
        pipe.close()


SWEEP: list[tuple[str, Any]] = [
    ("delete", None),
    ("increment", None),
    ("decrement", None),
    ("truncate", None),
    ("append", None),
    ("deep", None),
    *[("replace", value) for value in (None, True, -1, 2**63, 10**30, 1.5, "x", [], {}, [-1])],
]


def distinct_places(state: dict[str, Any]) -> list[tuple[Any, ...]]:
    """Every dict entry, and of each list its first and last element only."""
    places = []
    for where in paths(state):
        indices = [step for step in where if isinstance(step, int)]
        if all(index == 0 for index in indices) or where[-1] == -1:
            places.append(where)
    for where in paths(state):
        if where and isinstance(where[-1], int) and where[-1] > 0:
            parent: Any = state
            for step in where[:-1]:
                parent = parent[step]
            if where[-1] == len(parent) - 1 and all(isinstance(s, str) or s == 0 for s in where[:-1]):
                places.append(where)
    return places


SWEPT = [
    chain
    for chain in [*sorted(chains("list")), *sorted(other_chains()), *PREPARED]
    if "payloads" not in chain and chain != "even_bfd"
]
"""Chains the sweep covers: of the payload packers (they share how records are read) only greedy;
the others, and Even over a bfd packer (both swept on their own), are drawn by the random test."""


@pytest.mark.parametrize("chain", [*SWEPT, "pack_payloads_greedy"])
def test_every_entry_of_a_state_corrupted_every_way(chain: str) -> None:
    """Each entry of a mid-epoch state (and of each list its first and last element), with
    each corruption of ``SWEEP``: a deterministic sweep that random sampling would thin out."""
    build, pipe = prepared("list", chain)
    take(pipe, 5)
    state = json.loads(json.dumps(pipe.get_state()))
    pipe.close()
    expected = items_after(build, state)
    for where in distinct_places(state):
        for operation, replacement in SWEEP:
            check_corrupted_state(build, state, corrupt(state, where, operation, replacement), expected)


@settings(deadline=None, max_examples=30)
@given(
    kind=st.sampled_from(INDEXED_KINDS),
    chain=st.sampled_from([*sorted(chains("list")), *PREPARED]),
    taken=st.integers(0, 30),
    data=st.data(),
    operation=st.sampled_from(OPERATIONS),
    replacement=st.sampled_from(REPLACEMENTS),
)
def test_a_corrupted_state_is_a_typed_error_or_a_valid_state(
    kind: str, chain: str, taken: int, data: st.DataObject, operation: str, replacement: Any
) -> None:
    build, pipe = prepared(kind, chain)
    take(pipe, taken)
    state = json.loads(json.dumps(pipe.get_state()))
    pipe.close()
    where = data.draw(st.sampled_from(paths(state)), label="where")
    check_corrupted_state(build, state, corrupt(state, where, operation, replacement))


@settings(deadline=None, max_examples=15)
@given(value=st.recursive(st.none() | st.integers() | st.text(max_size=3), lambda inner: st.lists(inner, max_size=3)))
def test_any_json_value_as_a_whole_state_is_a_typed_error(value: Any) -> None:
    build = chains("list")["pack_best_fit"]
    pipe = build()
    expected = take(build(), AFTER)
    try:
        pipe.set_state(value)
    except rs.ResumableError:
        pass
    assert take(pipe, AFTER) == expected
