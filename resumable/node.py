"""Node base classes: the iteration protocol, state save/restore and the fluent methods.

Two kinds of node:

* ``Node``: an iterator with ``get_state()`` / ``set_state()``. Filter, batch and repeat are
  plain nodes: they pull from their upstream and keep only small counters.
* ``IndexedNode``: a node whose record at position ``i`` of epoch ``e`` is a pure function of
  ``(i, e)`` (sources, shuffle, shard, map over those). Random access is stateless; the only
  counters are the cursor ``(epoch, position)`` of the outermost indexed node being iterated,
  so resuming is arithmetic, never a replay.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Generic, Iterator, Sequence, TypeVar

import numpy as np

from resumable.errors import ConfigError, StateError
from resumable.state import (
    ENDED,
    KIND,
    STATE_VERSION,
    UPSTREAM,
    VERSION,
    check_config,
    check_header,
    check_json,
    child_path,
    nested,
    put_nested,
    require,
    require_count,
)

if TYPE_CHECKING:
    from resumable.ops.batch import Batch
    from resumable.ops.filter import Filter
    from resumable.ops.repeat import Repeat
    from resumable.order.shard import Shard
    from resumable.pack.node import Pack
    from resumable.sources.source import Source

T = TypeVar("T")
U = TypeVar("U")

RecordKey = tuple[Any, ...]
"""A record's provenance: ``(epoch, index)``, its epoch and its index in the leaf source (for a
stream, its file and byte offset packed into one int), the same whatever the shuffle and however
the epoch is sharded, so buffers keep references that survive a rescale. Each mix the record
came through puts the name of its component in front: ``("web", epoch, index)``."""


def leaf_key(key: Any, kind: str) -> tuple[int, int]:
    """``key`` as the ``(epoch, index)`` of a leaf record; IndexError if it is not one (a state
    whose references were damaged or belong to another pipeline)."""
    if (
        not isinstance(key, tuple)
        or len(key) != 2
        or not all(isinstance(part, (int, np.integer)) and not isinstance(part, bool) for part in key)
    ):
        raise IndexError(f"{kind}: {key!r} is not the (epoch, index) key of one of its records")
    return int(key[0]), int(key[1])

EPOCH = "epoch"
POSITION = "position"
LENGTH = "length"

# The cursor reads records in chunks that start small (a fast first record after a resume)
# and double up to a size that amortises per-chunk work.
MIN_CHUNK = 16
MAX_CHUNK = 4096


NODE_KINDS: dict[str, type[Node[Any]]] = {}
"""Node classes by the ``kind`` they declare: one class per name."""


class Node(Generic[T]):
    """An iterator over one epoch of items whose position can be saved and restored."""

    kind: ClassVar[str] = "Node"
    """The node's name in its states. Each node class declares it (``kind = "Batch"``) and a
    subclass inherits it, so renaming or subclassing a class keeps checkpoints loadable; a
    class that declares none and derives from no declaring class is named after itself."""
    # Whether the upstream's state includes its counters. An indexed node reads its upstream
    # by random access, so only the upstream's configuration matters.
    _upstream_progress: ClassVar[bool] = True
    # Options that may change on an elastic resume (a rescale), though not on a plain restore.
    _elastic_options: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "kind" in cls.__dict__:
            registered = NODE_KINDS.setdefault(cls.kind, cls)
            if registered is not cls:
                raise TypeError(
                    f"{cls.__qualname__}: kind {cls.kind!r} is already the name of {registered.__qualname__}"
                )
        elif cls.kind not in NODE_KINDS:
            cls.kind = cls.__name__

    def __init__(self, upstream: Node[Any] | None = None) -> None:
        if upstream is not None and not isinstance(upstream, Node):
            raise ConfigError(
                f"{type(self).__name__}: upstream must be a resumable node, got {type(upstream).__name__}"
            )
        self.upstream = upstream
        self._ended = False

    # -- iteration --------------------------------------------------------------------------

    def __iter__(self) -> Node[T]:
        """Return self; a node whose epoch has ended starts the next one (like a DataLoader)."""
        if self._ended:
            self.next_epoch()
        return self

    def __next__(self) -> T:
        try:
            return self._next()
        except StopIteration:
            self._ended = True
            raise

    def _next(self) -> T:
        raise NotImplementedError

    @property
    def ended(self) -> bool:
        """Whether this node has signalled the end of its current epoch (StopIteration)."""
        return self._ended

    def next_epoch(self) -> None:
        """Start the next epoch: a full new pass, in a new shuffle order."""
        self._begin_epoch(None)

    def start_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its beginning (what a fresh DataLoader worker does)."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ConfigError(f"{self.kind}: epoch must be a non-negative int, got {epoch!r}")
        self._begin_epoch(epoch)

    def _begin_epoch(self, epoch: int | None) -> None:
        """Reset this node and its upstream to the start of ``epoch`` (None: the next one)."""
        if self.upstream is not None:
            self.upstream._begin_epoch(epoch)
        self._ended = False
        self._on_epoch_start()

    def _on_epoch_start(self) -> None:
        """Hook: clear per-epoch counters and buffers."""

    # -- shutdown ---------------------------------------------------------------------------

    def close(self) -> None:
        """Stop every background thread and worker pool in this pipeline (prefetch, parallel
        map). They also stop when garbage-collected; this makes it deterministic, e.g. when a
        training loop ends early. Iterating afterwards continues after the last item handed out."""
        self._shutdown()
        for child in self._children().values():
            child.close()

    def _shutdown(self) -> None:
        """Hook: stop this node's own threads or pools."""

    def __enter__(self) -> Node[T]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- provenance: lets buffering nodes store references instead of contents ----------------

    def last_key(self) -> RecordKey | None:
        """``(epoch, leaf index)`` of the indexed record behind the last item handed out, or
        None when items cannot be traced back to one record (after batch or pack, say)."""
        return None

    def _traceable(self) -> bool:
        """Whether every item can be traced back to one record (``last_key``), known when the
        pipeline is built: a node that passes records through, over traceable children."""
        return type(self).last_key is not Node.last_key and all(
            child._traceable() for child in self._children().values()
        )

    def fetch(self, key: RecordKey) -> T:
        """The item with provenance ``key``, produced again by random access (no iteration)."""
        return self.fetch_many([key])[0]

    def fetch_many(self, keys: Sequence[RecordKey]) -> list[T]:
        """The items with provenance ``keys``, in that order: what a restoring buffer (a
        packer) asks for in one call, so a source that reads sequentially (a gzip stream) reads
        each file once, in offset order, instead of once per key."""
        raise ConfigError(f"{self.kind}: items cannot be fetched again by key")

    # -- state ------------------------------------------------------------------------------

    def _config(self) -> dict[str, Any]:
        """Options that shape the data stream; a state saved with other values is rejected."""
        return {}

    def _identity(self) -> dict[str, Any]:
        """What the node reads (file fingerprints), checked by ``_check_identity`` with its own
        message; saved with every state, rescaled ones included."""
        return {}

    def _check_identity(self, state: dict[str, Any], path: str) -> None:
        """Reject a state saved over other data (other files, changed files)."""

    def _header(self) -> dict[str, Any]:
        """The entries every state of this node starts with: kind, format version,
        configuration and identity."""
        return {KIND: self.kind, VERSION: STATE_VERSION, **self._config(), **self._identity()}

    def _progress(self) -> dict[str, Any]:
        """Counters that change during iteration."""
        return {}

    def _restore(self, state: dict[str, Any], path: str) -> None:
        """Validate and load this node's counters from ``state`` (upstream already loaded)."""

    def get_state(self) -> dict[str, Any]:
        """The position after the last item handed out, as a small JSON-serialisable dict."""
        return self._state(progress=True)

    def _state(self, progress: bool) -> dict[str, Any]:
        """Header, then progress (unless only the configuration is asked for), then each
        child's state where ``_children`` places it."""
        state = self._header()
        if progress:
            state.update(self._progress())
            state[ENDED] = self._ended
        for where, child in self._children().items():
            put_nested(state, where, self._child_state(child, progress))
        return state

    def _child_state(self, child: Node[Any], progress: bool) -> dict[str, Any]:
        """A child's state as saved in this node's: with its progress unless this node's own
        progress determines it (``_upstream_progress``); a read-ahead node substitutes the
        state it recorded as of the last item handed out."""
        return child._state(progress=progress and self._upstream_progress)

    def set_state(self, state: dict[str, Any]) -> None:
        """Continue exactly after the item at which ``state`` was taken.

        Raises ``StateError`` naming the node's path if the state belongs to another pipeline,
        version or data. Whatever fails, the node is left as it was.
        """
        check_json(state, self.kind)
        previous = self.get_state()
        try:
            self._load(state, self.kind)
        except Exception:
            self._load(previous, self.kind)
            raise

    def _load(self, state: Any, path: str, progress: bool = True) -> None:
        """Check the header and configuration, load the children, then this node's progress."""
        check_header(state, self.kind, path)
        self._check_config(state, path)
        children = self._children()
        for group in {where[:-1] for where in children if len(where) > 1}:
            saved, expected = nested(state, group, path), {w[-1] for w in children if w[:-1] == group}
            if set(saved) != expected:
                name = "/".join(group)
                raise StateError(f"{path}: state holds {name} {sorted(saved)!r}, this node has {sorted(expected)!r}")
        for where, child in children.items():
            child._load(nested(state, where, path), child_path(path, where, child.kind), self._upstream_progress)
        if progress:
            self._restore(state, path)
            self._ended = require(state, ENDED, bool, path)

    def _check_config(self, state: dict[str, Any], path: str) -> None:
        """Reject a state saved with other options or over other data."""
        check_config(state, self._config(), path)
        self._check_identity(state, path)

    def _fresh_rescaled(self, olds: list[dict[str, Any]], path: str) -> dict[str, Any]:
        """This node's own state entries (no upstream) on a new consumer, for a node that holds
        nothing per consumer (``resumable.elastic.Rescalable`` nodes do): the same options (but
        ``_elastic_options``), the same data, counters of a fresh epoch."""
        config = {key: value for key, value in self._config().items() if key not in self._elastic_options}
        for old in olds:
            check_config(old, config, path)
            self._check_identity(old, path)
        return {**self._header(), **self._progress(), ENDED: False}

    def _children(self) -> dict[tuple[str, ...], Node[Any]]:
        """The nodes this one reads from, by where their states nest in its state: its
        upstream under ``("upstream",)``, a mix's components under ``("components", name)``."""
        return {} if self.upstream is None else {(UPSTREAM,): self.upstream}

    def _olds_for_children(self, olds: list[dict[str, Any]], path: str) -> list[dict[str, Any]]:
        """The old consumers' states as the elastic rescale of this node's children reads them:
        ``olds`` themselves, unless this node has taken more of its upstream's epoch than the
        upstream's cursor shows (a whole-epoch plan takes its whole stride at once)."""
        return olds

    def _adopt_elastic_options(self, state: Any, path: str) -> None:
        """Take the values of ``_elastic_options`` saved in ``state``, down the chain, so an old
        consumer's batches can be replayed with the options it ran with (``rs.torch.Loader``)."""
        if not isinstance(state, dict):
            return
        for key in self._elastic_options:
            if key in state:
                self._set_elastic_option(key, state[key], path)
        if self.upstream is not None:
            self.upstream._adopt_elastic_options(state.get(UPSTREAM), f"{path} > {self.upstream.kind}")

    def _set_elastic_option(self, key: str, value: Any, path: str) -> None:
        """Set option ``key`` (one of ``_elastic_options``) to a saved ``value``; StateError if invalid."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """Alias of ``get_state`` (``torch.distributed.checkpoint.Stateful`` protocol)."""
        return self.get_state()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Alias of ``set_state`` (``torch.distributed.checkpoint.Stateful`` protocol)."""
        self.set_state(state_dict)

    # -- fluent construction ----------------------------------------------------------------

    def map(self, fn: Callable[[T], U], num_workers: int = 0, mode: str = "thread") -> Node[U]:
        """Apply ``fn`` to every item; with ``num_workers``, in a pool of threads or processes
        (``mode``), keeping the order."""
        if num_workers:
            from resumable.ops.parallel_map import ParallelMap

            return ParallelMap(self, fn, num_workers=num_workers, mode=mode)
        from resumable.ops.map import Map

        return Map(self, fn)

    def prefetch(self, buffer_size: int = 4) -> Node[T]:
        """Run the upstream in a background thread, up to ``buffer_size`` items ahead."""
        from resumable.ops.prefetch import Prefetch

        return Prefetch(self, buffer_size)

    def cache(self, directory: str | None = None, max_bytes: int = 1 << 30) -> Node[T]:
        """Keep the upstream's outputs: in memory (an LRU of ``max_bytes``) or, with
        ``directory``, on disk in Arrow IPC files reused by later epochs and jobs."""
        from resumable.ops.cache import cache

        return cache(self, directory, max_bytes=max_bytes)

    def filter(self, predicate: Callable[[T], bool]) -> Filter[T]:
        """Keep the items for which ``predicate`` is true."""
        from resumable.ops.filter import Filter

        return Filter(self, predicate)

    def batch(
        self, batch_size: int, drop_last: bool = False, collate_fn: Callable[[list[T]], Any] | None = None
    ) -> Batch[T]:
        """Group items into lists of ``batch_size`` (passed through ``collate_fn`` if given)."""
        from resumable.ops.batch import Batch

        return Batch(self, batch_size, drop_last=drop_last, collate_fn=collate_fn)

    def pack(self, seq_len: int, **options: Any) -> Pack:
        """Pack token sequences into fixed-length rows (see ``rs.nodes.Pack`` for the options)."""
        from resumable.pack.node import Pack

        return Pack(self, seq_len, **options)

    def repeat(self, times: int | None = None) -> Repeat[T]:
        """Run epochs back to back, forever or ``times`` times, reshuffling each epoch."""
        from resumable.ops.repeat import Repeat

        return Repeat(self, times)

    def shuffle(self, seed: int = 0, block_size: int | str | None = None, window: int | None = None) -> Node[T]:
        """Global shuffle; needs random access (place it before filter, batch or pack)."""
        raise ConfigError(f"{self.kind}: shuffle() needs random access; place it before filter, batch and pack")

    def shard(
        self, rank: int | None = None, world_size: int | None = None, split_workers: bool = True
    ) -> Shard[T]:
        """Partition across ranks; needs random access (place it before filter, batch or pack)."""
        raise ConfigError(f"{self.kind}: shard() needs random access; place it before filter, batch and pack")

    def __repr__(self) -> str:
        chain = []
        node: Node[Any] | None = self
        while node is not None:
            chain.append(node.kind)
            node = node.upstream
        return f"<{' < '.join(chain)}>"


class IndexedNode(Node[T]):
    """A node with stateless random access; iterating it runs a cursor ``(epoch, position)``."""

    upstream: IndexedNode[Any] | None
    _upstream_progress = False
    _chunk: Sequence[Any]
    _chunk_leaves: np.ndarray | None  # leaf indices of the chunk, for last_key()
    _chunk_start: int

    def __init__(self, upstream: IndexedNode[Any] | None = None) -> None:
        if upstream is not None and not isinstance(upstream, IndexedNode):
            raise ConfigError(
                f"{type(self).__name__} needs random access, but {upstream.kind} is not indexed; "
                "place it before filter, batch and pack"
            )
        super().__init__(upstream)
        self._epoch = 0
        self._reset_cursor(0)
        self._decode: Callable[[Any], Any] | None = None
        self._fns: tuple[Callable[[Any], Any], ...] = ()
        self._chain_ready = False

    # -- random access, overridden by subclasses ---------------------------------------------

    def __len__(self) -> int:
        raise NotImplementedError

    def _length(self, epoch: int) -> int:
        """Positions in ``epoch``: ``len(self)``, unless a rescale left a shard of another size."""
        return len(self)

    def _pass_cursor(self, epoch: int, position: int) -> None:
        """Hook: the cursor's position as a state is taken, for nodes whose positions it also
        is (a shard under serial maps compacts its remap with it)."""

    def _check_cursor(self, epoch: int, position: int, path: str) -> None:
        """Tell the indexed chain below a restored cursor where it stands, so that a node whose
        state depends on it (a shard's compacted remap) rejects a state that cannot serve it."""
        if self.upstream is not None:
            self.upstream._check_cursor(epoch, position, path)

    def _enter_epoch(self, epoch: int) -> None:
        """Tell the indexed chain below the cursor which epoch is being read (a shard drops
        the remap of an earlier epoch)."""
        if self.upstream is not None:
            self.upstream._enter_epoch(epoch)

    @property
    def _parent(self) -> IndexedNode[Any]:
        """The upstream of a node that transforms one (every indexed node but a source)."""
        if self.upstream is None:
            raise ConfigError(f"{self.kind} has no upstream")
        return self.upstream

    @property
    def leaf(self) -> Source[Any]:
        """The source at the bottom of this indexed chain."""
        if self.upstream is None:
            raise NotImplementedError
        return self.upstream.leaf

    def _leaf_indices(self, positions: np.ndarray, epoch: int) -> np.ndarray:
        """Map this node's positions in ``epoch`` to record indices of the leaf source."""
        if self.upstream is None:
            raise NotImplementedError
        return self.upstream._leaf_indices(positions, epoch)

    def _raw_chunk(self, start: int, count: int, epoch: int) -> Sequence[Any]:
        """Undecoded records for positions ``[start, start + count)``; at least one, at most count."""
        positions = np.arange(start, start + count, dtype=np.int64)
        return self.leaf._raw_at(self._leaf_indices(positions, epoch))

    def _record_fns(self) -> tuple[Callable[[Any], Any], ...]:
        """Per-record functions (maps) applied after decoding, from the leaf up to here."""
        if self.upstream is None:
            return ()
        return self.upstream._record_fns()

    def __getitem__(self, position: int) -> T:
        """The record at ``position`` of the current epoch, by random access."""
        return self.record_at(self._epoch, position)

    def record_at(self, epoch: int, position: int) -> T:
        """The record at ``position`` of ``epoch``, by random access."""
        length = self._length(epoch)
        if not isinstance(position, (int, np.integer)) or not 0 <= position < length:
            raise IndexError(f"{self.kind}: position {position!r} out of range [0, {length})")
        return self._record_of(int(self._leaf_indices(np.array([position], dtype=np.int64), epoch)[0]))

    def fetch_many(self, keys: Sequence[RecordKey]) -> list[T]:
        size = len(self.leaf)
        indices = [leaf_key(key, self.kind)[1] for key in keys]
        for index in indices:
            if not 0 <= index < size:
                raise IndexError(f"{self.kind}: record index {index!r} out of range [0, {size})")
        return [self._record_of(index) for index in indices]

    def _record_of(self, index: int) -> T:
        """Leaf record ``index`` through this chain's decoder and maps."""
        self._prepare_chain()
        leaf = self.leaf
        raw = leaf._raw_at(np.array([index], dtype=np.int64))[0]
        record = raw
        if self._decode is not None:
            try:
                record = self._decode(raw)
            except Exception as error:  # noqa: BLE001 - the source raises its own error
                leaf._decode_failed(raw, index, error, may_skip=False)
        for fn in self._fns:
            record = fn(record)
        return record  # type: ignore[no-any-return]

    def _scan(self, start: int, stop: int, epoch: int, skip: bool) -> Iterator[tuple[int, T]]:
        """``(leaf index, record)`` for positions ``[start, stop)`` of ``epoch``, read in chunks
        by random access (the cursor does not move). A record the decoder rejects raises the
        source's error, or with ``skip`` is left out when the source skips malformed records
        (``on_error="skip"``, counted by the source), as iteration would."""
        position = start
        while position < stop:
            raws = self._raw_chunk(position, min(MAX_CHUNK, stop - position), epoch)
            leaves = self._leaf_indices(np.arange(position, position + len(raws), dtype=np.int64), epoch)
            position += len(raws)
            yield from self._decoded(raws, leaves, skip)

    def _scan_leaves(self, leaves: np.ndarray, skip: bool) -> Iterator[tuple[int, T]]:
        """``(leaf index, record)`` for leaf records ``leaves`` (int64), in that order, read as
        ``_scan`` reads positions: for positions another consumer read (an elastic rescale)."""
        for start in range(0, len(leaves), MAX_CHUNK):
            chunk = leaves[start : start + MAX_CHUNK]
            yield from self._decoded(self.leaf._raw_at(chunk), chunk, skip)

    def _decoded(self, raws: Sequence[Any], leaves: np.ndarray, skip: bool) -> Iterator[tuple[int, T]]:
        """Raw records of leaf indices ``leaves`` through this chain's decoder and maps."""
        self._prepare_chain()
        decode, fns = self._decode, self._fns
        for raw, leaf in zip(raws, leaves.tolist()):
            record = raw
            if decode is not None:
                try:
                    record = decode(raw)
                except Exception as error:  # noqa: BLE001 - the source raises its own error
                    self.leaf._decode_failed(raw, leaf, error, may_skip=skip)
                    continue
            for fn in fns:
                record = fn(record)
            yield leaf, record

    def last_key(self) -> RecordKey | None:
        last = self.position - 1
        if last < 0:
            return None
        offset = last - self._chunk_start
        if offset < 0:  # restored at a chunk boundary: the record came before this chunk
            return (self._epoch, int(self._leaf_indices(np.array([last], dtype=np.int64), self._epoch)[0]))
        if self._chunk_leaves is None:
            positions = np.arange(self._chunk_start, self._chunk_start + len(self._chunk), dtype=np.int64)
            self._chunk_leaves = self._leaf_indices(positions, self._epoch)
        return (self._epoch, int(self._chunk_leaves[offset]))

    # -- fluent methods that keep random access ----------------------------------------------

    def map(self, fn: Callable[[T], U], num_workers: int = 0, mode: str = "thread") -> Node[U]:
        """Apply ``fn`` to every record. Serial maps keep random access (``fn`` must be pure);
        with ``num_workers`` the map runs in a pool and the result is an iterator node."""
        if num_workers:
            return super().map(fn, num_workers=num_workers, mode=mode)
        from resumable.ops.map import IndexedMap

        return IndexedMap(self, fn)

    def shuffle(self, seed: int = 0, block_size: int | str | None = None, window: int | None = None) -> Node[T]:
        """Global shuffle: an O(1)-memory keyed permutation, new every epoch. With
        ``block_size`` (records, or ``"row_group"``), a locality-aware block shuffle: blocks
        of consecutive records are permuted, then records within a window of blocks."""
        if block_size is None and window is None:
            from resumable.order.shuffle import Shuffle

            return Shuffle(self, seed)
        from resumable.order.block_shuffle import BlockShuffle

        return BlockShuffle(self, seed, block_size=block_size, window=window)

    def shard(
        self, rank: int | None = None, world_size: int | None = None, split_workers: bool = True
    ) -> Shard[T]:
        """Keep this consumer's stride of positions (rank, and DataLoader worker if any)."""
        from resumable.order.shard import Shard

        return Shard(self, rank, world_size, split_workers=split_workers)

    # -- the cursor -------------------------------------------------------------------------
    # A chunk of raw records is consumed through C-level iterators, map(fn, map(decode,
    # iter(chunk))), so handing out a record costs one call from __next__; the position is
    # derived from how many raw records the chunk's list iterator has left.

    def _reset_cursor(self, position: int) -> None:
        self._chunk = ()
        self._chunk_leaves = None
        self._chunk_start = position
        self._chunk_size = MIN_CHUNK
        self._pending: Iterator[Any] = iter(())
        self._next_record: Callable[[], Any] = self._pending.__next__

    def _prepare_chain(self) -> None:
        if not self._chain_ready:
            self._decode = self.leaf._decoder()
            self._fns = self._record_fns()
            self._chain_ready = True

    def __next__(self) -> T:
        while True:
            try:
                return self._next_record()  # type: ignore[no-any-return]
            except StopIteration:
                self._load_next_chunk()
            except Exception as error:  # noqa: BLE001 - sorted out off the hot path
                self._skip_or_raise(error)

    def _load_next_chunk(self) -> None:
        """Read the next chunk of raw records; StopIteration at the end of the epoch."""
        start = self._chunk_start + len(self._chunk)
        total = self._length(self._epoch)
        self._chunk_leaves = None
        if start >= total:
            self._chunk, self._chunk_start = (), total
            self._ended = True
            raise StopIteration
        self._prepare_chain()
        chunk = self._raw_chunk(start, min(self._chunk_size, total - start), self._epoch)
        self._chunk, self._chunk_start = chunk, start
        self._chunk_size = min(self._chunk_size * 2, MAX_CHUNK)
        self._pending = iter(chunk)
        records: Iterator[Any] = self._pending
        if self._decode is not None:
            records = map(self._decode, records)
        for fn in self._fns:
            records = map(fn, records)
        self._next_record = records.__next__

    def _skip_or_raise(self, error: Exception) -> None:
        """A record failed: a decode error goes to the source (raise, or return to skip it); an
        error raised by a map function reaches the consumer as it is. Either way the record is
        consumed."""
        position = self.position - 1
        raw = self._chunk[position - self._chunk_start]
        if self._decode is None:
            raise error
        try:
            self._decode(raw)
        except Exception as decode_error:  # noqa: BLE001 - the source raises its own error
            self._reject(raw, position, self._epoch, decode_error, may_skip=True)
            return
        raise error

    def _reject(self, raw: Any, position: int, epoch: int, error: Exception, may_skip: bool) -> None:
        leaf_index = int(self._leaf_indices(np.array([position], dtype=np.int64), epoch)[0])
        self.leaf._decode_failed(raw, leaf_index, error, may_skip)

    @property
    def position(self) -> int:
        """Records of the current epoch handed out so far (skipped ones included)."""
        return self._chunk_start + len(self._chunk) - operator.length_hint(self._pending)

    @property
    def epoch(self) -> int:
        return self._epoch

    def _begin_epoch(self, epoch: int | None) -> None:
        # Indexed upstreams are read by random access: only this cursor moves.
        self._epoch = self._epoch + 1 if epoch is None else epoch
        self._enter_epoch(self._epoch)
        self._reset_cursor(0)
        self._ended = False

    def _progress(self) -> dict[str, Any]:
        position = self.position
        self._pass_cursor(self._epoch, position)
        return {EPOCH: self._epoch, POSITION: position, LENGTH: self._length(self._epoch)}

    def _restore(self, state: dict[str, Any], path: str) -> None:
        epoch = require_count(state, EPOCH, path)
        self._enter_epoch(epoch)
        length = require_count(state, LENGTH, path)
        if length != self._length(epoch):
            raise StateError(
                f"{path}: state was saved over {length} records, this pipeline has {self._length(epoch)}"
            )
        position = require_count(state, POSITION, path, upper=length)
        self._check_cursor(epoch, position, path)
        self._epoch = epoch
        self._reset_cursor(position)
