"""Elastic resume: continue an epoch on another number of consumers, each document once.

A checkpoint taken by ``C`` consumers (``world_size * num_workers``) resumes on ``C'``. Each new
consumer builds its pipeline as usual and calls ``restore(pipeline, old_states)`` with the
pipeline states of *all* old consumers, in consumer order. It gets

* the positions of the interrupted epoch that no old consumer reached, split into strides
  over the new consumers (``resumable.order.elastic``: while the ragged band between the
  slowest and fastest old cursor is being read, its state keeps the band positions of its own
  stride, about ``band / C'`` of them, encoded; then one integer);
* its share of what old consumers held in buffers, by reference: the buffers of streaming
  packers are dealt out whole (new consumer ``j`` of ``C'`` inherits every piece of old consumers
  ``i`` with ``i * C' // C == j``, a split document's rest included, ``resumable.pack._rescale``),
  so a new consumer reads the buffers of one or two old consumers only; a whole-epoch
  ``bfd`` plan's rows not yet handed out are planned again from the old states and dealt out
  whole (``resumable.pack.epoch``), and the strides they came from count as read.

From the next epoch on, the new topology reads whole epochs as if it had always been there.
With the same number of consumers (even split differently into ranks x workers) each consumer
continues its own stride: bit-exact, as always.

Supported chains: an indexed part with a ``.shard()`` followed only by serial ``.map()`` and
``.shuffle()`` (a shuffle after the shard is a per-consumer reading order, which the remap
replays: ``resumable.order.orders``), or a file-sharded ``rs.jsonl_stream`` (its work items, a
file and a byte offset each, are dealt out), then any of filter, map, batch, prefetch, parallel
map, repeat and pack (every strategy), and ``mix`` of such chains (each component is
rescaled on its own, the schedule starts afresh).
"""

from __future__ import annotations

import copy
import gc
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence, Union, cast

import orjson

from resumable.core.indexed import EPOCH, LENGTH, POSITION, IndexedNode
from resumable.core.node import Node
from resumable.core.protocols import Rescalable
from resumable.core.state import (
    ENDED,
    INT64_MAX,
    KIND,
    STATE_VERSION,
    UPSTREAM,
    VERSION,
    check_header,
    check_json,
    child_path,
    nested,
    put_nested,
    require,
    require_adjacent_epochs,
    require_count,
)
from resumable.errors import ConfigError, StateError
from resumable.ops.map import IndexedMap
from resumable.ops.mix import COMPONENTS
from resumable.order.block_shuffle import BlockShuffle
from resumable.order.elastic import MAX_POSITION, Remap, merge, rescale, shard_sizes
from resumable.order.orders import Order
from resumable.order.partition import shard_size
from resumable.order.shard import NEXT_REMAP, REMAP, Shard
from resumable.order.shuffle import Shuffle
from resumable.order.topology import NUM_WORKERS, RANK, WORKER, WORLD_SIZE, Topology
from resumable.pack._rescale import buffer_free_text, drop_buffer, inherited_from
from resumable.sources.stream import JsonlStream

__all__ = ["OldState", "Rescalable", "as_consumer", "consumer_of", "rescaled_state", "rescaled_states", "restore"]


def as_consumer(pipeline: Node[Any], topology: Topology) -> Node[Any]:
    """``pipeline``, whose shards and file-sharded streams now read as ``topology``'s consumer
    whatever the process: to replay an old consumer, or plan a new one, in this process."""
    for node in pipeline._subtree():
        if isinstance(node, (Shard, JsonlStream)):
            node._consumer.pin(topology)
    return pipeline


def consumer_of(state: dict[str, Any], path: str = "state") -> tuple[int, int]:
    """``(consumer, num_consumers)`` of the partitioning node (shard or file-sharded stream)."""
    nodes = _partitioner_states(state)
    if not nodes:
        raise StateError(f"{path}: the state has no Shard or stream node, so it does not say which consumer it is")
    found = set()
    for node in nodes:
        rank, world_size = require(node, RANK, int, path), require(node, WORLD_SIZE, int, path)
        worker, num_workers = require(node, WORKER, int, path), require(node, NUM_WORKERS, int, path)
        found.add((rank * num_workers + worker, world_size * num_workers))
    if len(found) != 1:
        raise StateError(f"{path}: the state's partitioning nodes disagree on the consumer ({sorted(found)})")
    return found.pop()


def _partitioner_states(state: Any) -> list[dict[str, Any]]:
    """The states of the nodes that split the epoch (shards, file-sharded streams): along the
    upstream chain and into every mix component."""
    found, pending = [], [state]
    while pending:
        node = pending.pop()
        if not isinstance(node, dict):
            continue
        if node.get(KIND) in PARTITIONER_KINDS:
            found.append(node)
            continue
        pending.append(node.get(UPSTREAM))
        components = node.get(COMPONENTS)
        if isinstance(components, dict):
            pending.extend(components.values())
    return found


PARTITIONER_KINDS = (Shard.kind, JsonlStream.kind)
"""The kinds of the nodes that split an epoch over consumers."""
CHILD_KEYS = (UPSTREAM, COMPONENTS)
"""Where a node's state nests its children's."""

OldState = Union[dict[str, Any], str]
"""An old consumer's pipeline state: a dict, or its JSON text as a Loader state holds it (parsed
here, and only the parts a rescale reads are kept)."""


def restore(pipeline: Node[Any], old_states: Sequence[OldState]) -> None:
    """Continue the epoch of ``old_states`` (every old consumer's, in order) on ``pipeline``."""
    pipeline.set_state(rescaled_state(pipeline, old_states))


def rescaled_state(pipeline: Node[Any], old_states: Sequence[OldState]) -> dict[str, Any]:
    """The state ``pipeline`` (a freshly built pipeline of a new consumer) continues from."""
    return rescaled_states([pipeline], old_states)[0]


def rescaled_states(pipelines: Sequence[Node[Any]], old_states: Sequence[OldState]) -> list[dict[str, Any]]:
    """The states ``pipelines`` (freshly built pipelines of new consumers of one topology, such
    as one rank's workers) continue from, in their order.

    The old states are read once for all of them. Each new consumer's packers read the buffers
    of only the old consumers they inherit from (``resumable.pack._rescale``); of every other
    old consumer only what the partitioning needs is kept, its packer buffers dropped as soon as
    its state is parsed (an entry given as JSON text is parsed here), so a rank holds the
    cursors of every old consumer but the buffers of a few."""
    if not pipelines:
        return []
    kind = pipelines[0].kind
    if not isinstance(old_states, (list, tuple)):  # a dict or its text would be read entry by entry
        raise StateError(
            f"{kind}: expected a list of every old consumer's state, in order, got {type(old_states).__name__}"
        )
    if not old_states:
        raise StateError(f"{kind}: no old states to rescale from")
    topologies = [_topology(pipeline) for pipeline in pipelines]
    num_consumers = topologies[0].num_consumers
    if any(topology.num_consumers != num_consumers for topology in topologies):
        raise ConfigError(f"{kind}: the pipelines to rescale belong to topologies of different sizes")
    consumers = [topology.consumer for topology in topologies]
    exact = len(old_states) == num_consumers  # the same strides (maybe other ranks x workers)
    if exact:
        whole = set(consumers)
    else:
        whole = {old for consumer in consumers for old in inherited_from(consumer, num_consumers, len(old_states))}
    packers = _paths(pipelines[0], _holds_buffer, stop=False)
    depth = len(packers[0]) if len(packers) == 1 and set(packers[0]) <= {UPSTREAM} else None
    with _collector_paused():
        olds = [
            _read_old(old, index in whole, packers, depth, f"{kind} (old consumer {index})")
            for index, old in enumerate(old_states)
        ]
    partitioners = _paths(pipelines[0], lambda node: isinstance(node, (Shard, JsonlStream)), stop=True)
    for index, old in enumerate(olds):
        saved = _labels(old, partitioners) or consumer_of(old, f"{kind} (old consumer {index})")
        if saved != (index, len(olds)):
            raise StateError(
                f"old states must be every consumer's, in order: entry {index} of {len(olds)} is "
                f"consumer {saved[0]} of {saved[1]}"
            )
    if exact:
        return [_as_consumer(olds[consumer], topology) for consumer, topology in zip(consumers, topologies)]
    _take_saved_options(list(pipelines), olds, kind)
    return _rescale_node(list(pipelines), olds, kind, consumers, num_consumers)


def _take_saved_options(nodes: list[Node[Any]], olds: list[dict[str, Any]], path: str) -> None:
    """Before any rescale work, each node of the new pipelines takes the options the old
    consumers' states set (``Node._saved_options``: a shuffle's rounds), which they must agree
    on, so that what the rescale reads or plans through them is in the old consumers' order."""
    node = nodes[0]
    if node._saved_options:
        node._take_saved_options(olds, path)
        for other in nodes[1:]:
            other._take_saved_options([node._config()], path)
    for where, child in node._children().items():
        children = [each._children()[where] for each in nodes]
        _take_saved_options(children, _nested_all(olds, where, path), child_path(path, where, child.kind))


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector while thousands of old states are parsed: JSON
    holds no reference cycles, so reference counting frees all of it, and the collector would
    otherwise walk every state parsed so far again and again (a fifth of the time at 32,768)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _topology(pipeline: Node[Any]) -> Topology:
    """The one topology the pipeline's shards and streams split the epoch for."""
    topologies = {partitioner.topology for partitioner in _partitioners(pipeline)}
    if len(topologies) != 1:
        raise ConfigError(f"{pipeline.kind}: its shards or streams split the epoch for different consumers")
    return topologies.pop()


def _read_old(
    old: OldState, whole: bool, packers: list[tuple[str, ...]], depth: int | None, path: str
) -> dict[str, Any]:
    """An old consumer's state as the rescale reads it: parsed if given as JSON text, checked
    to hold JSON types only, and, unless ``whole``, without the buffers of the streaming
    packers nested at ``packers`` (the others' states, copied on the way where ``old`` is the
    caller's dict). With one packer ``depth`` upstreams down, a text is cut before it is
    parsed where it allows (``buffer_free_text``)."""
    if isinstance(old, str):
        cut = None if whole or depth is None else buffer_free_text(old, depth)
        try:
            parsed = orjson.loads(old if cut is None else cut)
        except orjson.JSONDecodeError as error:
            raise StateError(f"{path}: the state is not valid JSON ({error})") from error
        if not isinstance(parsed, dict):
            raise StateError(f"{path}: the state is a {type(parsed).__name__}, expected a JSON object")
        return parsed if whole else _without_buffers(parsed, packers, owned=True)  # JSON text: JSON types
    if not isinstance(old, dict):
        raise StateError(f"{path}: expected a state dict or its JSON text, got {type(old).__name__}")
    kept = old if whole else _without_buffers(old, packers, owned=False)
    check_json(kept, path)
    return kept


def _without_buffers(state: dict[str, Any], packers: list[tuple[str, ...]], owned: bool) -> dict[str, Any]:
    """``state`` without the buffers of the packers nested at ``packers``: changed in place if
    ``owned``, else the dicts on the way are copied. A path the state does not hold is skipped
    (the rescale then reports what is missing)."""
    top = state if owned else dict(state)
    for where in packers:
        node = top
        for key in where:
            child = node.get(key)
            if not isinstance(child, dict):
                break
            if not owned:
                child = node[key] = dict(child)
            node = child
        else:
            drop_buffer(node)
    return top


def _holds_buffer(node: Node[Any]) -> bool:
    """Whether ``node`` is a streaming packer, whose buffer only the new consumers that inherit
    it read."""
    from resumable.pack.node import Pack  # not at the top: resumable.pack imports this module

    return isinstance(node, Pack) and node.buffer_size is not None


def _paths(node: Node[Any], test: Callable[[Node[Any]], bool], stop: bool) -> list[tuple[str, ...]]:
    """Where the states of the nodes of ``node``'s pipeline that pass ``test`` nest in its state
    (not below such a node if ``stop``)."""
    found: list[tuple[str, ...]] = [()] if test(node) else []
    if found and stop:
        return found
    for key, child in node._children().items():
        found.extend(key + where for where in _paths(child, test, stop))
    return found


def _labels(state: dict[str, Any], partitioners: list[tuple[str, ...]]) -> tuple[int, int] | None:
    """``consumer_of(state)`` read where this pipeline's partitioning nodes nest, if their states
    are there, of their kinds and agree (a few dict lookups: thousands of old states are read);
    None for anything else, which ``consumer_of`` then reads or reports."""
    found = None
    for where in partitioners:
        node: Any = state
        for key in where:
            node = node.get(key) if type(node) is dict else None
        if type(node) is not dict or node.get(KIND) not in PARTITIONER_KINDS:
            return None
        rank, world_size, worker, workers = (
            node.get(RANK),
            node.get(WORLD_SIZE),
            node.get(WORKER),
            node.get(NUM_WORKERS),
        )
        if not (type(rank) is int and type(world_size) is int and type(worker) is int and type(workers) is int):
            return None  # bools and other types included: consumer_of reports them
        labels = (rank * workers + worker, world_size * workers)
        if found is not None and labels != found:
            return None
        found = labels
    return found


def _as_consumer(state: dict[str, Any], topology: Topology) -> dict[str, Any]:
    """``state`` with its partitioning nodes relabelled to ``topology`` (same consumer index)."""
    copied = copy.deepcopy(state)
    for node in _partitioner_states(copied):
        node.update(topology.config())
    return copied


def _partitioners(node: Node[Any]) -> list[Shard[Any] | JsonlStream]:
    """The nodes that split the epoch over consumers: on every branch (each mix component) a
    file-sharded stream, or a shard that ends the indexed chain (only serial maps after it)."""
    if isinstance(node, JsonlStream):
        return [node]
    if isinstance(node, IndexedNode):
        return [_find_shard(node)]
    children = node._children()
    if not children:
        raise ConfigError(f"elastic resume needs a .shard() or a file-sharded stream, {node.kind} has none")
    return [partitioner for child in children.values() for partitioner in _partitioners(child)]


def _find_shard(cursor: IndexedNode[Any]) -> Shard[Any]:
    return _shard_and_orders(cursor)[0]


def _shard_and_orders(cursor: IndexedNode[Any]) -> tuple[Shard[Any], list[Order]]:
    """The shard under ``cursor`` and the orders its consumer reads the stride in (the
    shuffles between them, top first); only serial maps and shuffles may come between."""
    node: Node[Any] | None = cursor
    reading_orders: list[Order] = []
    while isinstance(node, (IndexedMap, Shuffle, BlockShuffle)):
        if not isinstance(node, IndexedMap):
            reading_orders.append((node.kind, node._config()))
        node = node.upstream
    if not isinstance(node, Shard):
        found = node.kind if node is not None else "no indexed node"
        raise ConfigError(
            f"elastic resume needs .shard() in the indexed chain, with only serial .map() and "
            f".shuffle() after it; in {cursor!r} it found {found} where the shard should be"
        )
    return node, reading_orders


def _rescale_node(
    nodes: list[Node[Any]], olds: list[dict[str, Any]], path: str, consumers: list[int], num_consumers: int
) -> list[dict[str, Any]]:
    """The states of ``nodes`` (the same node of each new consumer's pipeline), from the old
    consumers' states of that node: checked once, and planned once where no consumer differs."""
    node = nodes[0]
    _check_headers(olds, node.kind, path)
    if isinstance(node, IndexedNode):
        return _rescale_indexed(cast("list[IndexedNode[Any]]", nodes), olds, path)
    if isinstance(node, Rescalable):
        states = [
            cast("Rescalable", each)._rescale(olds, path, consumer, num_consumers)
            for each, consumer in zip(nodes, consumers)
        ]
    else:  # holds nothing per consumer: each distinct old state of its own is checked once
        own = _distinct([{key: value for key, value in old.items() if key not in CHILD_KEYS} for old in olds])
        states = [node._fresh_rescaled(own, path), *(each._fresh_rescaled([], path) for each in nodes[1:])]
    olds = node._olds_for_children(olds, path)
    for where, child in node._children().items():
        child_olds = _nested_all(olds, where, path)
        children = [each._children()[where] for each in nodes]
        rescaled = _rescale_node(children, child_olds, child_path(path, where, child.kind), consumers, num_consumers)
        for state, child_state in zip(states, rescaled):
            put_nested(state, where, child_state)
    return states


def _rescale_indexed(cursors: list[IndexedNode[Any]], olds: list[dict[str, Any]], path: str) -> list[dict[str, Any]]:
    """Each cursor's new state: position 0 of its consumer's stride over what was left. Old
    consumers may straddle an epoch boundary (some already in the next epoch): then the shard
    also holds the remap of the next epoch, whose positions the advanced consumers have read.
    The remaps are planned once; each new consumer keeps its share."""
    epochs = _counts(olds, EPOCH, path)
    if max(epochs) - min(epochs) > 1:
        require_adjacent_epochs(olds, EPOCH, path)  # raises, naming the epochs
    positions = _counts(olds, POSITION, path, upper=MAX_POSITION)

    chains: list[list[IndexedNode[Any]]] = [[] for _ in cursors]
    levels: list[tuple[list[dict[str, Any]], str]] = []
    nodes: list[IndexedNode[Any] | None] = list(cursors)
    states, where = olds, path
    while True:
        for chain, node in zip(chains, nodes):
            chain.append(cast("IndexedNode[Any]", node))
        levels.append((states, where))
        first = cast("IndexedNode[Any]", nodes[0])
        if first.upstream is None:
            break
        states = _nested_all(states, (UPSTREAM,), where)
        where = f"{where} > {first.upstream.kind}"
        nodes = [cast("IndexedNode[Any]", node).upstream for node in nodes]
        _check_headers(_distinct(states), first.upstream.kind, where)

    for node, (states, where) in zip(chains[0], levels):
        if not isinstance(node, Shard):
            for state in _distinct(states):
                node._check_config(state, where)
    shard, reading_orders = _shard_and_orders(cursors[0])
    depth = chains[0].index(shard)
    remap, next_remap = _new_remaps(shard, levels[depth][0], epochs, positions, reading_orders, levels[depth][1])
    rescaled = []
    for chain in chains:
        new_states: list[dict[str, Any]] = []
        length = 0
        for node in chain:
            own = node._header()
            if isinstance(node, Shard):
                consumer, num_consumers = node.topology.consumer, node.topology.num_consumers
                # Each new consumer keeps only its share of the levels (band / C' positions each).
                own[REMAP] = remap.share_for(consumer, num_consumers).to_json()
                if next_remap is not None:
                    own[NEXT_REMAP] = next_remap.share_for(consumer, num_consumers).to_json()
                length = shard_size(remap.length, consumer, num_consumers)
            new_states.append(own)
        for upper, lower in zip(new_states, new_states[1:]):
            upper[UPSTREAM] = lower
        new_states[0].update({EPOCH: min(epochs), POSITION: 0, LENGTH: length, ENDED: False})
        rescaled.append(new_states[0])
    return rescaled


def _check_headers(states: list[dict[str, Any]], kind: str, path: str) -> None:
    """``check_header(state, kind, path)`` of every state, in one pass where all are dicts of
    ``kind`` and this format version (thousands of old states); else it reports the first."""
    if set(map(type, states)) == {dict} and {(state.get(KIND), state.get(VERSION)) for state in states} == {
        (kind, STATE_VERSION)
    }:
        return
    for state in states:
        check_header(state, kind, path)


def _nested_all(states: list[dict[str, Any]], where: tuple[str, ...], path: str) -> list[dict[str, Any]]:
    """``nested(state, where, path)`` of every state: a child's state in each old consumer's."""
    if len(where) == 1:
        children: list[Any] = [state.get(where[0]) for state in states]
        if set(map(type, children)) == {dict}:
            return children
    return [nested(state, where, path) for state in states]


def _counts(states: list[dict[str, Any]], key: str, path: str, upper: int = INT64_MAX) -> list[int]:
    """``require_count(state, key, path, upper)`` of every state, checked in a few C-level
    passes (thousands of old states); a state that fails is reported by ``require_count``."""
    values: list[Any] = [state.get(key) for state in states]
    if set(map(type, values)) == {int} and min(values) >= 0 and max(values) <= upper:
        return values
    return [require_count(state, key, path, upper=upper) for state in states]


def _distinct(states: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``states`` but those equal to the first (compared deeply, in C): a check passed by one
    state is passed by its equals, so the identical states of the nodes under a shard (a
    shuffle's, a source's) are checked once, not once per old consumer."""
    first = states[0]
    return [first, *(state for state in states[1:] if state != first)]


def _new_remaps(
    shard: Shard[Any],
    olds: list[dict[str, Any]],
    epochs: list[int],
    cursors: list[int],
    reading_orders: list[Order],
    path: str,
) -> tuple[Remap, Remap | None]:
    """The remaps of the first epoch the old consumers were in and, if some had moved on, of the
    next one. A consumer that moved on has read its whole share of the first epoch; one that has
    not has read nothing of the next."""
    first = min(epochs)
    held = _held_remaps(shard, olds, epochs, path)
    sizes = shard_sizes(_space(shard, held.get(first)), len(olds)).tolist()
    remap = _rescaled(
        held.get(first),
        first,
        shard,
        [position if epoch == first else size for epoch, position, size in zip(epochs, cursors, sizes)],
        reading_orders,
        path,
    )
    if max(epochs) == first and first + 1 not in held:
        return remap, None
    # The next epoch: what consumers that moved on read of it is left out, and a remap they
    # hold for it from an earlier rescale is carried over.
    following = [position if epoch > first else 0 for epoch, position in zip(epochs, cursors)]
    return remap, _rescaled(held.get(first + 1), first + 1, shard, following, reading_orders, path)


def _held_remaps(shard: Shard[Any], olds: list[dict[str, Any]], epochs: list[int], path: str) -> dict[int, Remap]:
    """Per epoch, the remap the old consumers hold for it (merged from their compacted copies).
    Every consumer reading an epoch holds its remap, or none does; a consumer past an epoch may
    have dropped it."""
    base = len(shard.upstream)
    copies: dict[int, list[Remap]] = {}
    holders: dict[int, set[int]] = {}
    for consumer, old in enumerate(olds):
        for key in (REMAP, NEXT_REMAP):
            if key in old:
                remap = Remap.from_json(old[key], path, base_length=base)
                copies.setdefault(remap.epoch, []).append(remap)
                holders.setdefault(remap.epoch, set()).add(consumer)
    for epoch, consumers in holders.items():
        readers = {consumer for consumer, at in enumerate(epochs) if at == epoch}
        if not readers <= consumers:
            raise StateError(
                f"{path}: only some old consumers hold the remap of epoch {epoch}; they come from different checkpoints"
            )
    return {epoch: merge(remaps, path) for epoch, remaps in copies.items()}


def _space(shard: Shard[Any], previous: Remap | None) -> int:
    """Positions of the space old consumers strode over: a remap's newest space, or the epoch's."""
    return previous.length if previous is not None else len(shard.upstream)


def _rescaled(
    previous: Remap | None, epoch: int, shard: Shard[Any], cursors: list[int], reading_orders: list[Order], path: str
) -> Remap:
    try:
        return rescale(previous, epoch, _space(shard, previous), cursors, reading_orders)
    except StateError as error:
        raise StateError(f"{path}: {error}") from error
