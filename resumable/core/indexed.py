"""``IndexedNode``: random access, and the cursor engine that iterates it.

An indexed node's record at position ``i`` of epoch ``e`` is a pure function of ``(i, e)``
(sources, shuffle, shard, map over those). Random access is stateless; the only counters are
the cursor ``(epoch, position)`` of the outermost indexed node being iterated, so resuming is
arithmetic, never a replay. The cursor reads raw records in chunks and hands them out through
C-level iterators (decode, then the serial maps).
"""

from __future__ import annotations

import itertools
import operator
import weakref
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterator, NoReturn, Sequence, TypeVar, cast

import numpy as np

from resumable.core.keys import RecordKey, Stride, leaf_key
from resumable.core.node import Node
from resumable.core.options import flag_option
from resumable.core.state import epoch_after, require_count, require_epoch
from resumable.errors import ConfigError, MapError, SourceError, StateError, stop_error
from resumable.order.partition import shard_size

if TYPE_CHECKING:
    from resumable.core.protocols import Leaf
    from resumable.order.shard import Shard

T = TypeVar("T")
U = TypeVar("U")

# Cursor state entries.
EPOCH = "epoch"
POSITION = "position"
LENGTH = "length"

# The cursor reads one record first after a restore (a fast first record), then chunks that
# start small and double up to a size that amortises per-chunk work.
MIN_CHUNK = 16
MAX_CHUNK = 4096
DECODE_RUN = 128
DECODE_RUN_BYTES = 32 << 10
"""Records a leaf that allows it decodes ahead in one call: at most ``DECODE_RUN``, and about
``DECODE_RUN_BYTES`` of raw records (judged by a run's first record), so that they are still in
the CPU cache when handed out and freed while their memory is (sequential reading of ~115-byte
records took about 25% more CPU time when runs were 4096 records long than with 64-256)."""

_NOTHING: Iterator[Any] = iter(())
"""An empty run: a reset cursor's pending records (shared; it never yields)."""
_END: Iterator[Any] = iter(())
"""What ``IndexedNode._next_run`` returns after the epoch (compared by identity): the flow ends."""
_SKIPPED = object()
"""A record the source skipped (``on_error="skip"``), dropped from its run."""
_KEPT = partial(operator.is_not, _SKIPPED)
"""The C-level filter that drops skipped records."""


def _raise(error: BaseException) -> NoReturn:
    raise error


class _LastOfRun:
    """The last record of a run (``IndexedNode._run_over``), through the decoder and the maps in
    Python, where a StopIteration of a function is the ``MapError`` it stands for. If the run's
    C-level part stopped short (a StopIteration before its last record), it ends without taking
    a record, and the next run reports it (``IndexedNode._next_run``). It holds the node by a
    weak reference, as the flow does (``_Flow``), so no cycle keeps a dropped pipeline alive."""

    __slots__ = ("_node", "_records", "_done")

    def __init__(self, node: IndexedNode[Any], records: Iterator[Any]) -> None:
        self._node, self._records, self._done = weakref.ref(node), records, False

    def __iter__(self) -> _LastOfRun:
        return self

    def __next__(self) -> Any:
        node = self._node()
        if node is None or self._done or operator.length_hint(self._records) != 1:
            raise StopIteration
        self._done = True
        record = next(self._records)
        if node._run_guarded:
            record = node._decode_or_reject(record)
            if record is _SKIPPED:
                raise StopIteration
        try:
            for fn in node._fns:
                record = fn(record)
        except StopIteration as stop:
            raise stop_error(f"{node.kind}: a function mapped over its records", node.last_key(), stop) from stop
        return record


def _next_run_of(node: weakref.ref[IndexedNode[Any]]) -> Iterator[Any]:
    live = node()
    return _END if live is None else live._next_run()


class _Flow:
    """An indexed node's records as one C-level iterator, ``next``: ``chain.from_iterable``
    over the runs that ``IndexedNode._next_run`` returns, one call per chunk. It holds the node
    by a weak reference, so no cycle keeps a dropped pipeline (and its memory maps) alive.
    Pickled with the node (a DataLoader worker), it starts again at the node's position."""

    __slots__ = ("next", "_node")

    def __init__(self, node: IndexedNode[Any]) -> None:
        self._node = weakref.ref(node)
        self.next: Callable[[], Any] = itertools.chain.from_iterable(
            iter(partial(_next_run_of, self._node), _END)
        ).__next__

    def __getstate__(self) -> IndexedNode[Any] | None:
        return self._node()

    def __setstate__(self, node: IndexedNode[Any]) -> None:
        self._node = weakref.ref(node)
        self.next = self._resume

    def _resume(self) -> Any:
        """The first record after unpickling: the node's cursor starts again where it stands."""
        node = self._node()
        if node is None:
            raise StopIteration
        node._reset_cursor(node.position)
        return node._flow.next()


class _WeakMethod:
    """A method of a node kept in the node itself (its own decoder, when the node is its chain's
    leaf), holding the node by a weak reference. Pickled with the node, it holds the copy."""

    __slots__ = ("_node", "_name")

    def __init__(self, node: IndexedNode[Any], name: str) -> None:
        self._node = weakref.ref(node)
        self._name = name

    def __call__(self, *args: Any) -> Any:
        return getattr(self._node(), self._name)(*args)

    def __reduce__(self) -> tuple[type[_WeakMethod], tuple[IndexedNode[Any] | None, str]]:
        return _WeakMethod, (self._node(), self._name)


class _FirstFlow:
    """``IndexedNode._flow``: the node's flow, made on the first ``next`` after a reset and then
    kept in the instance, which a reset drops it from (building or restoring a node makes none).
    A plain non-data descriptor: ``functools.cached_property`` takes a lock on every miss."""

    def __get__(self, node: IndexedNode[Any], owner: type | None = None) -> _Flow:
        flow = node.__dict__["_flow"] = _Flow(node)
        return flow


Failed = Callable[[Exception, int], Any]
"""What a scan makes of a record whose decoding or maps raise, given the error and the record's
leaf index (``IndexedNode._scan``)."""


def read_ahead_failure(reader: str) -> Failed:
    """The ``failed`` of a node that reads its whole epoch before its first output (a
    whole-epoch packing plan, an index of kept positions): a function below it that raises on a
    record leaves it nothing to go on with, so it is a SourceError naming ``reader`` and the
    record, the function's error its cause. Raised at every attempt (each reads again), never
    the bare error, which would come with no record named, and never left out silently."""

    def failed(error: Exception, leaf: int) -> NoReturn:
        raise SourceError(
            f"{reader}: reads every record of the epoch before its first output, and a function below it raised "
            f"on the record at position {leaf} of the source ({type(error).__name__}: {error}); mend the record or "
            "the function (its error is the cause of this one)"
        ) from error

    return failed


class IndexedNode(Node[T]):
    """A node with stateless random access; iterating it runs a cursor ``(epoch, position)``."""

    upstream: IndexedNode[Any] | None
    _upstream_progress = False
    _same_positions: ClassVar[bool] = False
    """Whether position ``i`` here is position ``i`` of the upstream (serial maps, the cache)."""
    _chunk: Sequence[Any]
    _chunk_leaves: np.ndarray | None  # leaf indices of the chunk, for last_key()
    _chunk_start: int
    _decodes_whole_chunks: ClassVar[bool] = False
    """Leaf flag: the decoder is cheap and its output no bigger than its input (JSON lines), so
    the cursor decodes ``DECODE_RUN`` records in one C-level call ahead of the consumer. Leaves
    whose decoder may be costly (images) leave it False: records are decoded as handed out."""

    def __init__(self, upstream: IndexedNode[Any] | None = None) -> None:
        if isinstance(upstream, Node) and not isinstance(upstream, IndexedNode):
            raise ConfigError(
                f"{type(self).__name__} needs random access, but {upstream.kind} is not indexed; "
                "place it before filter, batch and pack"
            )
        super().__init__(upstream)
        self._epoch = 0
        self._reset_cursor(0)
        self._decode: Callable[[Any], Any] | None = None
        self._decode_ahead = False
        self._run_decoder: Callable[[Sequence[Any]], list[Any]] = list  # the leaf's, once the chain is prepared
        self._fns: tuple[Callable[[Any], Any], ...] = ()
        self._chain_ready = False

    # -- random access, overridden by subclasses ---------------------------------------------

    def __len__(self) -> int:
        raise NotImplementedError

    def _length(self, epoch: int) -> int:
        """Positions in ``epoch``: the upstream's (a source's own length), unless a rescale
        left a shard of another size (the shard says so)."""
        return len(self) if self.upstream is None else self.upstream._length(epoch)

    def _pass_cursor(self, epoch: int, position: int) -> None:
        """Hook: the cursor's position as a state is taken, passed down while it is also the
        upstream's position (a shard under serial maps compacts its remap with it)."""
        if self._same_positions and self.upstream is not None:
            self.upstream._pass_cursor(epoch, position)

    def _check_cursor(self, epoch: int, position: int, path: str) -> None:
        """Tell the indexed chain below a restored cursor where it stands, so that a node whose
        state depends on it (a shard's compacted remap) rejects a state that cannot serve it.
        Below a node that reorders or splits positions, the cursor may need any position: 0."""
        if self.upstream is not None:
            self.upstream._check_cursor(epoch, position if self._same_positions else 0, path)

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
    def leaf(self) -> Leaf:
        """The source at the bottom of this indexed chain (or a cache standing in for it)."""
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

    def _read_chunk(self, start: int, count: int, epoch: int) -> Sequence[Any]:
        """``_raw_chunk``, which must give at least one record: a source that gives none where
        its length says there are records would have its readers ask for them for ever."""
        raws = self._raw_chunk(start, count, epoch)
        if len(raws) == 0:  # a numpy array for an in-memory source
            raise SourceError(
                f"{self!r}: its source gave no record at position {start} of epoch {epoch} where its length "
                f"says there are {count} or more"
            )
        return raws

    def _reads_ahead(self) -> bool:
        """Whether this leaf gains from ``_read_ahead`` (a remote source); the cursor computes
        the leaf indices of its next chunk only for one that does."""
        return False

    def _read_ahead(self, indices: np.ndarray) -> None:
        """Leaf hook: the leaf records at ``indices`` will be read next; start fetching them."""

    def _reserve_span(self, fraction: float) -> None:
        """Leaf hook: readers go back and forth over about ``fraction`` of the records at a time
        (a block shuffle's window): keep that much of the data cached."""

    def _decoder(self) -> Callable[[Any], Any] | None:
        """Leaf hook: the function turning a raw record into a record; None when raw records
        are final."""
        return None

    def _decode_run(self, raws: Sequence[Any]) -> list[Any]:
        """Leaf hook: a run of raw records decoded ahead (``_decodes_whole_chunks``), raising the
        decoder's error on a malformed one. One decoder call per record here; a leaf may do it
        in fewer (JSONL: one call per run)."""
        decode = self._decoder()
        return list(raws) if decode is None else list(map(decode, raws))

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
        return [self._record_of(index) for index in self._leaf_records(keys)]

    def _leaf_records(self, keys: Sequence[RecordKey]) -> list[int]:
        """The leaf record index of each key, leaf keys and stride keys alike (those of one
        stride and epoch resolved in one call); IndexError for a key naming no record."""
        indices: list[int] = [0] * len(keys)
        strides: dict[tuple[Stride, int], list[int]] = {}
        for at, key in enumerate(keys):
            if len(key) == 3 and isinstance(key[0], Stride):
                strides.setdefault((key[0], key[1]), []).append(at)
            else:
                indices[at] = leaf_key(key, self.kind)[1]
        size = len(self.leaf)
        for index in indices:
            if not 0 <= index < size:
                raise IndexError(f"{self.kind}: record index {index!r} out of range [0, {size})")
        for (stride, epoch), ats in strides.items():
            positions = [keys[at][2] for at in ats]
            for at, leaf in zip(ats, self._stride_leaves(stride, epoch, positions).tolist()):
                indices[at] = leaf
        return indices

    def _stride_leaves(self, stride: Stride, epoch: int, positions: list[int]) -> np.ndarray:
        """Leaf indices of positions ``positions`` of ``stride`` in ``epoch``; IndexError for one
        outside the stride (or below a chain without a shard)."""
        base, problem = self._stride_base(), self.stride_problem(stride, epoch, positions)
        if base is None or problem is not None:
            raise IndexError(f"{self.kind}: {problem}")
        below = stride.consumer + np.array(positions, dtype=np.int64) * stride.consumers
        return base._leaf_indices(below, epoch)

    def stride_problem(self, stride: Stride, epoch: int, positions: Sequence[int]) -> str | None:
        """Why positions ``positions`` of ``stride`` in ``epoch`` name no record here (None when
        they all do): no shard below, a position that is not an int, or one past the stride."""
        base = self._stride_base()
        if base is None:
            return f"{stride} names a shard's stride, but no shard is below {self.kind}"
        if not all(isinstance(position, int) and not isinstance(position, bool) for position in positions):
            return f"positions {list(positions)!r:.80} of {stride} are not all ints"
        size = shard_size(base._length(epoch), stride.consumer, stride.consumers)
        if positions and not 0 <= min(positions) <= max(positions) < size:
            return f"positions {min(positions)}-{max(positions)} of {stride} out of range [0, {size})"
        return None

    def _stride_base(self) -> IndexedNode[Any] | None:
        """The node whose positions stride keys count: a shard's upstream (None without a shard)."""
        return None if self.upstream is None else self.upstream._stride_base()

    def _stride_key(self, epoch: int, position: int) -> RecordKey | None:
        """The key of this node's ``position`` in ``epoch`` as a stride key, where its positions
        are a shard's own (serial maps over a shard) and the shard can name it so; None for a
        leaf key."""
        if self._same_positions and self.upstream is not None:
            return self.upstream._stride_key(epoch, position)
        return None

    def _record_of(self, index: int) -> T:
        """Leaf record ``index`` through this chain's decoder and maps."""
        self._prepare_chain()
        leaf = self.leaf
        raw = leaf._raw_at(np.array([index], dtype=np.int64))[0]
        record: T = raw  # raw records are final records unless the source decodes them
        if self._decode is not None:
            try:
                record = self._decode(raw)
            except Exception as error:  # noqa: BLE001 - the source raises its own error
                leaf._decode_failed(raw, index, error, may_skip=False)
        try:
            for fn in self._fns:
                record = fn(record)
        except StopIteration as stop:
            raise stop_error(f"{self.kind}: a function mapped over leaf record {index}", None, stop) from stop
        return record

    def _scan(
        self, start: int, stop: int, epoch: int, skip: bool, failed: Failed | None = None
    ) -> Iterator[tuple[int, T]]:
        """``(leaf index, record)`` for positions ``[start, stop)`` of ``epoch``, read in chunks
        by random access (the cursor does not move). A record the decoder rejects raises the
        source's error, or with ``skip`` is left out when the source skips malformed records
        (``on_error="skip"``, counted by the source), as iteration would. With ``failed``, a
        record whose decoding or maps raise is ``failed(error, leaf)`` instead (which may raise)."""
        position = start
        while position < stop:
            raws = self._read_chunk(position, min(MAX_CHUNK, stop - position), epoch)
            leaves = self._leaf_indices(np.arange(position, position + len(raws), dtype=np.int64), epoch)
            position += len(raws)
            yield from self._decoded(raws, leaves, skip, failed)

    def _scan_leaves(self, leaves: np.ndarray, skip: bool, failed: Failed | None = None) -> Iterator[tuple[int, T]]:
        """``(leaf index, record)`` for leaf records ``leaves`` (int64), in that order, read as
        ``_scan`` reads positions: for positions another consumer read (an elastic rescale)."""
        for start in range(0, len(leaves), MAX_CHUNK):
            chunk = leaves[start : start + MAX_CHUNK]
            yield from self._decoded(self.leaf._raw_at(chunk), chunk, skip, failed)

    def _decoded(
        self, raws: Sequence[Any], leaves: np.ndarray, skip: bool, failed: Failed | None = None
    ) -> Iterator[tuple[int, T]]:
        """Raw records of leaf indices ``leaves`` through this chain's decoder and maps (with
        ``failed``, a record that raises is ``failed(error)``, as ``_scan`` says)."""
        self._prepare_chain()
        decode, fns = self._decode, self._fns
        for raw, leaf in zip(raws, leaves.tolist()):
            record = raw
            try:
                if decode is not None:
                    try:
                        record = decode(raw)
                    except Exception as error:  # noqa: BLE001 - the source raises its own error
                        self.leaf._decode_failed(raw, leaf, error, may_skip=skip)
                        continue
                for fn in fns:
                    record = fn(record)
            except Exception as error:
                if failed is None:
                    raise
                record = failed(error, leaf)
            yield leaf, record

    def last_key(self) -> RecordKey | None:
        """A stride key where this node's positions are a shard's (``_stride_key``), a leaf key
        otherwise."""
        last = self.position - 1
        if last < 0:
            return None
        key = self._stride_key(self._epoch, last)
        if key is not None:
            return key
        offset = last - self._chunk_start
        if offset < 0:  # restored at a chunk boundary: the record came before this chunk
            return (self._epoch, int(self._leaf_indices(np.array([last], dtype=np.int64), self._epoch)[0]))
        if self._chunk_leaves is None:
            positions = np.arange(self._chunk_start, self._chunk_start + len(self._chunk), dtype=np.int64)
            self._chunk_leaves = self._leaf_indices(positions, self._epoch)
        return (self._epoch, int(self._chunk_leaves[offset]))

    # -- fluent methods that keep random access ----------------------------------------------

    def _serial_map(self, fn: Callable[[T], U]) -> Node[U]:
        """A serial map over records keeps random access (``fn`` must be pure), so shuffle and
        shard may follow it."""
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

    def shard(self, rank: int | None = None, world_size: int | None = None, split_workers: bool = True) -> Shard[T]:
        """Keep this consumer's stride of positions (rank, and DataLoader worker if any)."""
        from resumable.order.shard import Shard

        return Shard(self, rank, world_size, split_workers=split_workers)

    def filter(
        self,
        predicate: Callable[[T], bool],
        index: bool = False,
        index_key: str | None = None,
        cache_dir: str | None = None,
        num_proc: int = 0,
        progress: bool = True,
        batched: bool = False,
    ) -> Node[T]:
        """Keep the records ``predicate`` accepts. Without ``index``, as they stream past (random
        access ends here). With ``index``, scan this node once (in ``num_proc`` processes, with a
        progress bar) for the positions it keeps; shuffle, shard and ``len()`` then work after the
        filter. ``cache_dir`` keeps that index in a memory-mapped sidecar shared by processes and
        jobs; change ``index_key`` whenever the predicate's meaning changes. With ``batched``,
        ``predicate`` takes a list of records and returns one bool per record (index only)."""
        if not flag_option(self.kind, "index", index):
            return super().filter(predicate, batched=batched)
        from resumable.ops.indexed_filter import IndexedFilter

        return IndexedFilter(
            self,
            predicate,
            index_key=index_key,
            cache_dir=cache_dir,
            num_proc=num_proc,
            progress=progress,
            batched=batched,
        )

    # -- the cursor -------------------------------------------------------------------------
    # The records flow through one C-level iterator (_Flow) over runs: DECODE_RUN records of the
    # raw chunk decoded ahead in one call where the leaf allows it (else the whole chunk, decoded
    # as handed out), then map(fn, iter(records)). ``next(node)`` reaches the flow's __next__
    # through a property, so handing out a record runs no Python frame. The position is derived
    # from how many records the run's list iterator has left.

    if TYPE_CHECKING:

        def __next__(self) -> T: ...

    else:
        __next__ = property(operator.attrgetter("_flow.next"))

    _flow = _FirstFlow()

    def _reset_cursor(self, position: int) -> None:
        self._raws: Sequence[Any] = ()
        self._raws_start = position
        self._chunk = ()
        self._chunk_leaves = None
        self._chunk_start = position
        self._chunk_size = MIN_CHUNK
        self._run_size = 1
        self._pending: Iterator[Any] = _NOTHING
        self._run_guarded = False
        self.__dict__.pop("_flow", None)

    def _prepare_chain(self) -> None:
        if not self._chain_ready:
            leaf = self.leaf
            decode = leaf._decoder()
            self._decode = None if decode is None else self._held_weakly(decode)
            self._decode_ahead = leaf._decodes_whole_chunks
            self._run_decoder = self._held_weakly(leaf._decode_run)
            self._fns = self._record_fns()
            self._chain_ready = True

    def __copy__(self) -> IndexedNode[T]:
        """A shallow copy reads on from the same position by itself: with its own flow and
        decoders (the original's hold the original, weakly), so neither moves the other."""
        clone = type(self).__new__(type(self))
        clone.__dict__.update(self.__dict__)
        clone._hooked = {}
        clone._chain_ready = False
        clone._reset_cursor(self.position)
        return clone

    def _held_weakly(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` to keep in this node: a method of the node itself is kept as a ``_WeakMethod``,
        so that, as with ``_Flow``, no cycle keeps a dropped pipeline (and its memory maps, its
        files) alive until the collector runs."""
        if getattr(fn, "__self__", None) is not self:
            return fn
        return _WeakMethod(self, cast("Any", fn).__func__.__name__)

    def _next_run(self) -> Iterator[Any]:
        """The flow's next run: the next chunk's records, or ``_END`` after the epoch. It never
        raises (that would end the flow): an error comes back as a run that raises it, with the
        cursor where it was, so the next call tries again."""
        try:
            if operator.length_hint(self._pending):  # the last run stopped short: a StopIteration
                return itertools.chain(map(_raise, (self._stopped_error(),)), self._run_over(self._pending))
            return self._load_next_chunk()
        except StopIteration:  # inside a run it would read as the end of that run
            return map(_raise, (RuntimeError(f"{self.kind}: reading a chunk raised StopIteration"),))
        except BaseException as error:  # noqa: BLE001 - raised again, to the consumer, by the run
            return map(_raise, (error,))

    def _load_next_chunk(self) -> Iterator[Any]:
        """The next run of records (``_END`` at the end of the epoch): the next ``DECODE_RUN``
        records of the raw chunk decoded ahead, or the whole raw chunk decoded as it is handed
        out; a new raw chunk is read when this one is used up. The cursor moves onto the run
        only once it is read and decoded."""
        start = self._chunk_start + len(self._chunk)
        raws, offset, size = self._raws, start - self._raws_start, self._chunk_size
        if offset >= len(raws):
            total = self._length(self._epoch)
            if start >= total:
                self._chunk, self._chunk_start, self._chunk_leaves = (), total, None
                self._pending = _NOTHING
                self._ended = True
                return _END
            self._prepare_chain()
            reads_ahead = self.leaf._reads_ahead()
            # The first chunk after a restore (or at an epoch's start) is one record, ahead of
            # the chunk sizes: the first record waits for no other (a remote leaf reads the
            # next chunk ahead meanwhile).
            first = not self._raws
            raws, offset = self._read_chunk(start, 1 if first else min(size, total - start), self._epoch), 0
            if not first:
                size = min(size * 2, MAX_CHUNK)
            following = start + len(raws)
            if following < total and reads_ahead:  # the next chunk is known: fetch it now
                positions = np.arange(following, min(following + size, total), dtype=np.int64)
                self.leaf._read_ahead(self._leaf_indices(positions, self._epoch))
        records, guarded = self._decoded_run(raws, offset)
        self._raws, self._raws_start, self._chunk_size = raws, start - offset, size
        self._chunk, self._chunk_start, self._chunk_leaves = records, start, None
        self._pending, self._run_guarded = iter(records), guarded
        return self._run_over(self._pending)

    def _run_over(self, records: Iterator[Any]) -> Iterator[Any]:
        """A run over ``records`` of the current chunk: decoded one by one where the run needs
        it, then through the chain's maps, all at C level, but for its last record
        (``_LastOfRun``): a function's StopIteration there would end the run as its end does,
        and no record after it would show that it stopped short."""
        fns = self._fns
        if not fns:
            return filter(_KEPT, map(self._decode_or_reject, records)) if self._run_guarded else records
        head = itertools.islice(records, max(operator.length_hint(records) - 1, 0))
        run: Iterator[Any] = filter(_KEPT, map(self._decode_or_reject, head)) if self._run_guarded else head
        for fn in fns:
            run = map(fn, run)
        return itertools.chain(run, _LastOfRun(self, records))

    def _stopped_error(self) -> MapError:
        """The error for the record at which the last run stopped short: a mapped function (or
        the decoder) raised StopIteration there, which ``map`` takes for the end of the run.
        The record counts as handed out, as one whose function raised anything else; its
        functions are pure, so calling them again on it gives the StopIteration as the cause."""
        record = self._chunk[len(self._chunk) - operator.length_hint(self._pending) - 1]
        stop = StopIteration()
        try:
            if self._run_guarded:
                record = self._decode_or_reject(record)
            if record is not _SKIPPED:
                for fn in self._fns:
                    record = fn(record)
        except StopIteration as raised:
            stop = raised
        except Exception:  # noqa: BLE001, S110 - not pure after all: reported without its cause
            pass
        return stop_error(f"{self.kind}: a function mapped over its records", self.last_key(), stop)

    def _decoded_run(self, raws: Sequence[Any], offset: int) -> tuple[Sequence[Any], bool]:
        """The records of the run starting at ``raws[offset]``, and whether they still need
        ``_decode_or_reject`` one by one. A leaf that allows it has a run decoded in one C-level
        call, unless a record is malformed (then that run is decoded as it is handed out); runs
        start at one record (the first record after a resume waits for no other) and double up
        to ``DECODE_RUN`` records or about ``DECODE_RUN_BYTES``. Other leaves' chunks are one
        run, decoded as it is handed out."""
        decode = self._decode
        if decode is None:
            return raws, False
        if not self._decode_ahead:
            return raws, True
        first = raws[offset]
        fits = DECODE_RUN_BYTES // len(first) if isinstance(first, bytes) and first else DECODE_RUN
        part = raws[offset : offset + max(1, min(self._run_size, fits))]
        self._run_size = min(self._run_size * 2, DECODE_RUN)
        try:
            return self._run_decoder(part), False
        except Exception:  # noqa: BLE001 - a malformed record: sorted out as it is handed out
            return part, True

    def _decode_or_reject(self, raw: Any) -> Any:
        """Decode the raw record just taken from the chunk; a rejected one goes to the source,
        which raises its error or returns to skip it (``_SKIPPED``, dropped from the run)."""
        decode = self._decode
        if decode is None:
            return raw
        try:
            return decode(raw)
        except Exception as error:  # noqa: BLE001 - the source raises its own error
            position = self.position - 1
            leaf_index = int(self._leaf_indices(np.array([position], dtype=np.int64), self._epoch)[0])
            self.leaf._decode_failed(raw, leaf_index, error, may_skip=True)
            return _SKIPPED

    @property
    def position(self) -> int:
        """Records of the current epoch handed out so far (skipped ones included)."""
        return self._chunk_start + len(self._chunk) - operator.length_hint(self._pending)

    @property
    def epoch(self) -> int:
        return self._epoch

    def _begin_epoch(self, epoch: int | None) -> None:
        # Indexed upstreams are read by random access: only this cursor moves.
        self._epoch = epoch_after(self.kind, self._epoch, epoch)
        node: IndexedNode[Any] | None = self
        while node is not None:  # a new epoch of the chain: its shuffles take this version's order
            node._renew_saved_options()
            node = node.upstream
        self._enter_epoch(self._epoch)
        self._reset_cursor(0)
        self._ended = False

    def _progress(self) -> dict[str, Any]:
        position = self.position
        self._pass_cursor(self._epoch, position)
        return {EPOCH: self._epoch, POSITION: position, LENGTH: self._length(self._epoch)}

    def _restore(self, state: dict[str, Any], path: str) -> None:
        epoch = require_epoch(state, EPOCH, path)
        self._enter_epoch(epoch)
        length = require_count(state, LENGTH, path)
        if length != self._length(epoch):
            raise StateError(f"{path}: state was saved over {length} records, this pipeline has {self._length(epoch)}")
        position = require_count(state, POSITION, path, upper=length)
        self._check_cursor(epoch, position, path)
        self._epoch = epoch
        self._reset_cursor(position)
