"""Elastic resume: continue an epoch on another number of consumers, each document once.

A checkpoint taken by ``C`` consumers (``world_size * num_workers``) resumes on ``C'``. Each new
consumer builds its pipeline as usual and calls ``restore(pipeline, old_states)`` with the
pipeline states of *all* old consumers, in consumer order. It gets

* the positions of the interrupted epoch that no old consumer reached, split into strides
  over the new consumers (``resumable.order.elastic``: while the ragged band between the
  slowest and fastest old cursor is being read, its state keeps the band positions of its own
  stride, about ``band / C'`` of them, encoded; then one integer);
* its share of what old consumers held in buffers, by reference: the packer's pieces (a split
  document's rest included) are dealt out one by one across the new consumers; a whole-epoch
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
from typing import Any, Sequence

from resumable.core.indexed import EPOCH, LENGTH, POSITION, IndexedNode
from resumable.core.node import Node
from resumable.core.protocols import Rescalable
from resumable.core.state import (
    ENDED,
    KIND,
    UPSTREAM,
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
from resumable.sources.stream import JsonlStream

__all__ = ["Rescalable", "as_consumer", "consumer_of", "rescaled_state", "restore"]


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
        if node.get(KIND) in (Shard.kind, JsonlStream.kind):
            found.append(node)
            continue
        pending.append(node.get(UPSTREAM))
        components = node.get(COMPONENTS)
        if isinstance(components, dict):
            pending.extend(components.values())
    return found


def restore(pipeline: Node[Any], old_states: Sequence[dict[str, Any]]) -> None:
    """Continue the epoch of ``old_states`` (every old consumer's, in order) on ``pipeline``."""
    pipeline.set_state(rescaled_state(pipeline, old_states))


def rescaled_state(pipeline: Node[Any], old_states: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The state ``pipeline`` (a freshly built pipeline of a new consumer) continues from."""
    if not old_states:
        raise StateError(f"{pipeline.kind}: no old states to rescale from")
    for index, old in enumerate(old_states):
        check_json(old, f"{pipeline.kind} (old consumer {index})")
    topologies = {partitioner.topology for partitioner in _partitioners(pipeline)}
    if len(topologies) != 1:
        raise ConfigError(f"{pipeline.kind}: its shards or streams split the epoch for different consumers")
    topology = topologies.pop()
    consumer, num_consumers = topology.consumer, topology.num_consumers
    for index, old in enumerate(old_states):
        saved = consumer_of(old, f"{pipeline.kind} (old consumer {index})")
        if saved != (index, len(old_states)):
            raise StateError(
                f"old states must be every consumer's, in order: entry {index} of {len(old_states)} is "
                f"consumer {saved[0]} of {saved[1]}"
            )
    if len(old_states) == num_consumers:  # the same strides (maybe other ranks x workers): exact
        return _as_consumer(old_states[consumer], topology)
    return _rescale_node(pipeline, list(old_states), pipeline.kind, consumer, num_consumers)


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
            f".shuffle() after it, found {found} under {cursor.kind}"
        )
    return node, reading_orders


def _rescale_node(
    node: Node[Any], olds: list[dict[str, Any]], path: str, consumer: int, num_consumers: int
) -> dict[str, Any]:
    for old in olds:
        check_header(old, node.kind, path)
    if isinstance(node, IndexedNode):
        return _rescale_indexed(node, olds, path)
    if isinstance(node, Rescalable):
        state = node._rescale(olds, path, consumer, num_consumers)
    else:
        state = node._fresh_rescaled(olds, path)
    olds = node._olds_for_children(olds, path)
    for where, child in node._children().items():
        child_olds = [nested(old, where, path) for old in olds]
        rescaled = _rescale_node(child, child_olds, child_path(path, where, child.kind), consumer, num_consumers)
        put_nested(state, where, rescaled)
    return state


def _rescale_indexed(cursor: IndexedNode[Any], olds: list[dict[str, Any]], path: str) -> dict[str, Any]:
    """The cursor's new state: position 0 of this consumer's stride over what was left. Old
    consumers may straddle an epoch boundary (some already in the next epoch): then the shard
    also holds the remap of the next epoch, whose positions the advanced consumers have read."""
    epochs = require_adjacent_epochs(olds, EPOCH, path)
    cursors = [require_count(old, POSITION, path, upper=MAX_POSITION) for old in olds]
    reading_orders = _shard_and_orders(cursor)[1]

    chain: list[tuple[IndexedNode[Any], list[dict[str, Any]], str]] = []
    node: IndexedNode[Any] | None = cursor
    states, where = olds, path
    while node is not None:
        chain.append((node, states, where))
        if node.upstream is None:
            break
        states = [require(state, UPSTREAM, dict, where) for state in states]
        where = f"{where} > {node.upstream.kind}"
        node = node.upstream
        for state in states:
            check_header(state, node.kind, where)

    new_states: list[dict[str, Any]] = []
    length = 0
    for node, states, where in chain:
        own = node._header()
        if isinstance(node, Shard):
            remap, next_remap = _new_remaps(node, states, epochs, cursors, reading_orders, where)
            consumer, num_consumers = node.topology.consumer, node.topology.num_consumers
            # Each new consumer keeps only its share of the levels (band / C' positions each).
            own[REMAP] = remap.share_for(consumer, num_consumers).to_json()
            if next_remap is not None:
                own[NEXT_REMAP] = next_remap.share_for(consumer, num_consumers).to_json()
            length = shard_size(remap.length, consumer, num_consumers)
        else:
            for state in states:
                node._check_config(state, where)
        new_states.append(own)
    for upper, lower in zip(new_states, new_states[1:]):
        upper[UPSTREAM] = lower
    new_states[0].update({EPOCH: min(epochs), POSITION: 0, LENGTH: length, ENDED: False})
    return new_states[0]


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
