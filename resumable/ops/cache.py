"""Cache: keep an indexed chain's records so later epochs and jobs read them instead of
recomputing them (decoding, tokenising).

    pipe = rs.jsonl(paths).map(tokenize).cache("/scratch/cache").shuffle(0).shard().batch(8)

``Cache`` is an indexed node whose record ``i`` is upstream record ``i``. Towards the nodes
above it, it behaves like a source ("leaf-like"): shuffle, shard and maps placed after it read
its records by position through ``_raw_at``, which returns them from the cache or computes the
missing ones from the upstream (its decoder and maps) and stores them. So the cache key is the
upstream position, which must be a stable record id: the upstream may not contain a shuffle or
a shard (their order depends on the epoch or the process); put those after the cache.

* ``.cache()``: an in-memory LRU of records bounded by ``max_bytes`` (sizes are estimated).
* ``.cache(directory)``: Arrow IPC block files under ``directory/<fingerprint>/``
  (see ``resumable.ops.disk_cache``), where the fingerprint hashes the upstream's configuration
  (source files with size and mtime, options) and the code of its map functions, so another
  pipeline never reads a stale cache. An unwritable directory falls back to memory with one
  ``CacheWarning``.

The state holds only the configuration and the cursor: a resume is exact whether the cache is
cold, warm or half filled, since a cached record equals the computed one.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import os
import warnings
from collections import OrderedDict
from types import CodeType
from typing import Any, Callable, NamedTuple, Sequence, TypeVar

import numpy as np

from resumable.core.indexed import IndexedNode
from resumable.core.node import Node
from resumable.core.options import directory_option, int64_option, int_option
from resumable.errors import CacheWarning, ConfigError, SourceError, stop_error
from resumable.ops import disk_cache

T = TypeVar("T")

DIRECTORY = "directory"
MAX_BYTES = "max_bytes"
BLOCK_SIZE = "block_size"
FINGERPRINT = "fingerprint"

DEFAULT_MAX_BYTES = 1 << 30
DEFAULT_BLOCK_SIZE = 1024
"""Records per disk block: computed, written and read together."""
FINGERPRINT_CHARS = 32
OBJECT_OVERHEAD = 64
"""Bytes added per Python object when estimating a record's size."""
MAX_COPY_DEPTH = 32
"""Containers nested deeper than this in a record are copied whole (``copy.deepcopy``)."""
PROBE_POSITIONS = 64
"""Upstream positions compared across two epochs to detect an epoch-dependent order."""
_MISSING = object()
SKIPPED = disk_cache.SKIPPED


class _SkippedRecord(Exception):
    """Raised by the cache's decoder at a skipped record, so the cursor above skips it too."""


class _Failed(NamedTuple):
    """A record whose computation raised: never stored, raised again where the record is read
    (by the cache's decoder), so the error comes at its record and iteration goes on past it,
    as without the cache."""

    error: Exception


def _unwrap(record: Any) -> Any:
    if record is SKIPPED:
        raise _SkippedRecord
    if type(record) is _Failed:
        raise record.error
    return record


class LRU:
    """Records by position, least recently used evicted first, bounded by estimated bytes.

    Each record is kept as a copy and handed out as a new copy each time (``_survey``): a
    consumer that edits a record in place (a map writing into it) leaves the cached record as
    computed, so every epoch, warm or cold, gives the same records, as on disk."""

    def __init__(self, max_bytes: int, owner: str = "Cache") -> None:
        self.max_bytes = max_bytes
        self.owner = owner
        self.bytes = 0
        self._items: OrderedDict[int, tuple[Any, CopyPlan, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, position: int) -> Any:
        item = self._items.get(position)
        if item is None:
            return _MISSING
        self._items.move_to_end(position)
        return _copied(item[0], item[1])

    def put(self, position: int, record: Any) -> None:
        """Keep a copy of ``record`` unless it alone would pass ``max_bytes``; a ConfigError
        naming it if it cannot be copied."""
        size, plan = _survey(record)
        if size > self.max_bytes:
            return
        try:
            kept = _copied(record, plan)
        except Exception as error:  # noqa: BLE001 - whatever deepcopy raises means the same
            raise ConfigError(
                f"{self.owner}: the record at position {position} cannot be kept in memory, which keeps a copy of "
                f"each record (so that one edited after it is handed out stays as computed): {error!r}"
            ) from error
        old = self._items.pop(position, None)
        if old is not None:
            self.bytes -= old[2]
        self._items[position] = (kept, plan, size)
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, (_, _, evicted) = self._items.popitem(last=False)
            self.bytes -= evicted


CopyPlan = Any
"""How ``_copied`` copies a value: None (immutable: shared), one of the ``_COPY_*`` markers, or
``(_COPY_DICT, {key: plan})`` / ``(_COPY_LIST, [plan, ...])`` for containers of mutable values."""
_COPY_SHALLOW = "shallow"  # a list or dict of immutable values: .copy()
_COPY_ARRAY = "array"
_COPY_DEEP = "deep"  # anything else: copy.deepcopy
_COPY_DICT = "dict"
_COPY_LIST = "list"
_IMMUTABLE = frozenset({int, float, bool, complex, str, bytes, type(None)})


def _survey(value: Any, depth: int = 0) -> tuple[int, CopyPlan]:
    """A record's estimated bytes (array buffers, string lengths, containers recursively, plus
    ``OBJECT_OVERHEAD`` per object) and the plan to copy it with, found in one walk: the walk
    is paid once per record kept, the copies once per record handed out."""
    kind = type(value)
    if kind is str or kind is bytes:
        return len(value) + OBJECT_OVERHEAD, None
    if kind in _IMMUTABLE or (isinstance(value, np.generic) and kind is not np.void):  # a np.void is mutable
        return OBJECT_OVERHEAD // 2, None
    if kind is np.ndarray:  # .copy() of an array of objects would share them
        return value.nbytes + OBJECT_OVERHEAD, _COPY_DEEP if value.dtype.hasobject else _COPY_ARRAY
    if kind is bytearray:
        return len(value) + OBJECT_OVERHEAD, _COPY_SHALLOW
    if depth >= MAX_COPY_DEPTH or not isinstance(value, (dict, list, tuple, set, frozenset)):
        buffer = getattr(value, "nbytes", 0)  # a torch tensor's, a memoryview's, a np.void's
        return (buffer if type(buffer) is int else 0) + OBJECT_OVERHEAD // 2, _COPY_DEEP
    size, plans = OBJECT_OVERHEAD + (0 if isinstance(value, dict) else 8 * len(value)), {}
    items = value.items() if isinstance(value, dict) else enumerate(value)
    for where, item in items:
        item_size, plans[where] = _survey(item, depth + 1)
        size += item_size + (_survey(where, depth + 1)[0] if isinstance(value, dict) else 0)
    immutable = all(plan is None for plan in plans.values())
    if kind is dict or kind is list:
        if immutable:
            return size, _COPY_SHALLOW
        return size, (_COPY_DICT, plans) if kind is dict else (_COPY_LIST, list(plans.values()))
    return size, None if immutable and kind in (tuple, frozenset) else _COPY_DEEP


def _copied(value: Any, plan: CopyPlan) -> Any:
    """A copy of ``value`` that shares nothing mutable with it, by ``_survey``'s plan."""
    if plan is None:
        return value
    if plan == _COPY_SHALLOW or plan == _COPY_ARRAY:  # by value: a pickled cache holds other str objects
        return value.copy()
    if plan == _COPY_DEEP:
        return copy.deepcopy(value)
    kind, plans = plan
    if kind == _COPY_DICT:
        return {key: _copied(item, plans[key]) for key, item in value.items()}
    return [_copied(item, item_plan) for item, item_plan in zip(value, plans)]


def _hash_code(code: CodeType, digest: Any) -> None:
    digest.update(code.co_code)
    digest.update(repr(code.co_names).encode())
    for const in code.co_consts:
        if isinstance(const, CodeType):
            _hash_code(const, digest)
        elif isinstance(const, frozenset):
            digest.update(repr(sorted(map(repr, const))).encode())
        else:
            digest.update(repr(const).encode())


def _function_fingerprint(fn: Any) -> str:
    """Name, bytecode and default arguments of a map function, and the arguments a
    ``functools.partial`` binds: editing ``tokenize`` or ``partial(tokenize, max_len=512)``
    invalidates the cache.

    Values that are plain data (numbers, text, None, and tuples, lists, dicts and sets of them)
    are hashed; of any other value (a tokenizer object, say), closures' captured values and
    objects' attributes only the type, since they have no representation that is the same in
    every process: a function configured through them differently needs another directory.
    """
    digest = hashlib.sha256()
    while isinstance(fn, functools.partial):
        digest.update(f"partial{_plain_repr(fn.args)}{_plain_repr(fn.keywords)}".encode())
        fn = fn.func
    name = f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"
    digest.update(name.encode())
    code = getattr(fn, "__code__", None) or getattr(getattr(type(fn), "__call__", None), "__code__", None)
    if isinstance(code, CodeType):
        _hash_code(code, digest)
    defaults, keyword_defaults = getattr(fn, "__defaults__", None), getattr(fn, "__kwdefaults__", None)
    if defaults or keyword_defaults:  # nothing added without them: fingerprints as before
        digest.update(f"defaults{_plain_repr(defaults)}{_plain_repr(keyword_defaults)}".encode())
    return f"{name}:{digest.hexdigest()[:16]}"


_PLAIN = (type(None), bool, int, float, complex, str, bytes)


def _plain_repr(value: Any) -> str:
    """``repr(value)`` where it is the same in every process (plain data, nested in tuples,
    lists, dicts and sets), else the value's type: what a fingerprint may hash of a value."""
    if isinstance(value, _PLAIN):
        return repr(value)
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__}({','.join(map(_plain_repr, value))})"
    if isinstance(value, dict):
        items = sorted(f"{_plain_repr(key)}:{_plain_repr(item)}" for key, item in value.items())
        return f"dict({','.join(items)})"
    if isinstance(value, (set, frozenset)):
        return f"{type(value).__name__}({','.join(sorted(map(_plain_repr, value)))})"
    kind = type(value)
    return f"<{kind.__module__}.{kind.__qualname__}>"


def fingerprint(upstream: IndexedNode[Any]) -> tuple[str, dict[str, Any]]:
    """``(hex digest, what it hashes)``: the upstream's configuration (``_state(progress=False)``,
    which includes source file fingerprints and options) and its map functions' code."""
    config = {
        "format": disk_cache.FORMAT,
        "upstream": upstream._state(progress=False),
        "functions": [_function_fingerprint(fn) for fn in upstream._record_fns()],
    }
    text = json.dumps(config, sort_keys=True, separators=(",", ":"), default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:FINGERPRINT_CHARS], config


def _check_upstream(upstream: Any) -> IndexedNode[Any]:
    """``upstream``, once checked to be indexed with positions that are stable record ids;
    ConfigError otherwise."""
    if not isinstance(upstream, IndexedNode):
        kind = upstream.kind if isinstance(upstream, Node) else type(upstream).__name__
        raise ConfigError(
            f"Cache needs an indexed upstream (source, map), but {kind} is not indexed; "
            "place .cache() before filter, batch and pack"
        )
    node: Node[Any] | None = upstream
    while node is not None:
        if type(node).__module__.startswith("resumable.order."):
            raise ConfigError(
                f"Cache: the upstream contains {node.kind}, whose order depends on the epoch or the "
                "process, so positions are not stable record ids; place .cache() before shuffle and shard"
            )
        node = node.upstream
    total = len(upstream)
    if total:
        probe = np.unique(np.linspace(0, total - 1, num=min(total, PROBE_POSITIONS)).astype(np.int64))
        if not np.array_equal(upstream._leaf_indices(probe, 0), upstream._leaf_indices(probe, 1)):
            raise ConfigError(
                f"Cache: {upstream!r} maps positions to different records in different epochs; "
                "place .cache() before shuffle and shard"
            )
    return upstream


class Cache(IndexedNode[T]):
    """Record ``i`` is upstream record ``i``, computed once and then read from the cache.

    ``directory=None`` keeps an in-memory LRU bounded by ``max_bytes``; a directory stores
    blocks of ``block_size`` records in Arrow IPC files under ``directory/<fingerprint>/``
    (and uses the LRU only if the directory cannot be written). Records read from disk are
    rebuilt from Arrow: numpy arrays come back as fresh writable arrays of the same dtype.
    """

    kind = "Cache"
    _same_positions = True
    _decodes_whole_chunks = True  # records come as they are (``_decode_run``) unless one failed

    upstream: IndexedNode[Any]

    def __init__(
        self,
        upstream: Node[T],
        directory: str | os.PathLike[str] | None = None,
        max_bytes: int = DEFAULT_MAX_BYTES,
        block_size: int = DEFAULT_BLOCK_SIZE,
    ) -> None:
        indexed = _check_upstream(upstream)
        super().__init__(indexed)
        self.directory = directory_option(self.kind, "directory", directory)
        self.max_bytes = int_option(self.kind, "max_bytes", max_bytes, least=0)
        self.block_size = int64_option(self.kind, "block_size", block_size)
        self.fingerprint, fingerprinted = fingerprint(indexed)
        self._skips = indexed.leaf.skips_malformed
        self.computed = 0
        self._failures = 0  # records whose computation raised (never stored)
        """Records computed from the upstream by this node (not read from the cache)."""
        self._memory = LRU(max_bytes, self.kind)
        self._disk: disk_cache.DiskStore | None = None
        if self.directory is not None:
            root = os.path.join(self.directory, self.fingerprint)
            try:
                self._disk = disk_cache.DiskStore(root, len(indexed), block_size, fingerprinted)
            except OSError as error:
                self._fall_back(root, error)

    @property
    def path(self) -> str | None:
        """The directory holding this pipeline's block files, or None when caching in memory."""
        return None if self._disk is None else self._disk.root

    def _fall_back(self, root: str, error: OSError) -> None:
        warnings.warn(
            f"Cache: cannot write to {root!r} ({error}); caching records in memory only (max_bytes={self.max_bytes})",
            CacheWarning,
            stacklevel=3,
        )
        self._disk = None

    # -- leaf-like random access: the nodes above read final records from here ---------------

    def __len__(self) -> int:
        return len(self.upstream)

    @property
    def leaf(self) -> Cache[T]:  # the leaf of the chain above it
        return self

    def _leaf_indices(self, positions: np.ndarray, epoch: int) -> np.ndarray:
        return positions

    def _record_fns(self) -> tuple[Callable[[Any], Any], ...]:
        return ()

    @property
    def skips_malformed(self) -> bool:
        return self._skips

    def _decoder(self) -> Callable[[Any], Any] | None:
        # A skipped record is cached as SKIPPED, which this decoder makes the nodes above skip
        # as iteration over the source would; a failed one (never stored) raises its error.
        return _unwrap

    def _decode_run(self, raws: Sequence[Any]) -> list[Any]:
        """A run of records as they are, unless one may be skipped or failed: then the run is
        decoded one by one (``_unwrap`` raises at that record), as records are handed out."""
        if self._skips or self._failures:
            return list(map(_unwrap, raws))
        return list(raws)

    def _decode_failed(self, raw: Any, index: int, error: Exception, may_skip: bool) -> None:
        if not isinstance(error, _SkippedRecord):
            raise error
        if not may_skip:
            raise SourceError(
                f"{self.kind}: record {index} was skipped as malformed (on_error='skip'); it cannot be read "
                "by random access"
            ) from None

    def _raw_at(self, indices: np.ndarray) -> Sequence[T]:
        """Final records at upstream positions ``indices``, from the cache or computed."""
        positions = indices.tolist()
        if self._disk is not None:
            return self._from_disk(self._disk, positions)
        return self._from_memory(positions)

    def _from_disk(self, disk: disk_cache.DiskStore, positions: list[int]) -> list[T]:
        """Records at ``positions`` from their blocks, computing and storing missing blocks.

        Each block is checked once per call (``DiskStore.view``: its file still has the size it
        was mapped with) before its records are read, and again after any block had to be
        computed, which takes a while."""
        records: list[Any] = []
        size = self.block_size
        views: dict[int, disk_cache.BlockView | _ComputedBlock] = {}  # checked since the last block was computed
        computed = self.computed
        block = -1
        view: disk_cache.BlockView | _ComputedBlock  # set at the first position: no block is -1
        for position in positions:
            if position // size != block:
                block = position // size
                found = views.get(block)
                if found is None:
                    found = self._block(disk, block)
                    if found is None:  # the directory stopped being writable: memory from now on
                        return records + self._from_memory(positions[len(records) :])
                    if self.computed != computed:
                        computed = self.computed
                        views.clear()
                    views[block] = found
                view = found
            records.append(view.record(position - block * size))
        return records

    def _block(self, disk: disk_cache.DiskStore, block: int) -> disk_cache.BlockView | _ComputedBlock | None:
        view = disk.view(block)
        if view is not None:
            return view
        start, stop = disk.bounds(block)
        computed = self._compute(start, stop)
        if self._failures and any(type(record) is _Failed for record in computed):
            return _ComputedBlock(computed)  # not stored: its failed records are computed again
        table = disk_cache.encode_block(computed, start)
        try:
            disk.write(block, table)
        except OSError as error:
            self._fall_back(disk.root, error)
            for offset, record in enumerate(computed):
                self._memory.put(start + offset, record)
            return None
        return disk.view(block) or disk_cache.BlockView(table)

    def _from_memory(self, positions: list[int]) -> list[T]:
        memory = self._memory
        records = [memory.get(p) for p in positions]
        missing = sorted({p for p, r in zip(positions, records) if r is _MISSING})
        if not missing:
            return records
        computed: dict[int, Any] = {}
        run_start = previous = missing[0]
        for position in [*missing[1:], None]:
            if position is not None and position == previous + 1:
                previous = position
                continue
            for offset, record in enumerate(self._compute(run_start, previous + 1)):
                computed[run_start + offset] = record
                if type(record) is not _Failed:
                    memory.put(run_start + offset, record)
            if position is not None:
                run_start = previous = position
        return [computed[p] if r is _MISSING else r for p, r in zip(positions, records)]

    def _compute(self, start: int, stop: int) -> list[Any]:
        """Upstream records ``[start, stop)``: read raw, decode and map, as its cursor would;
        ``SKIPPED`` where the source skipped a malformed record. The upstream holds no shuffle
        or shard, so its leaf indices rise with its positions (an indexed filter skips some)."""
        leaves = self.upstream._leaf_indices(np.arange(start, stop, dtype=np.int64), 0)
        scanned = list(self.upstream._scan(start, stop, 0, skip=self._skips, failed=self._failed))
        found = np.fromiter((leaf for leaf, _ in scanned), dtype=np.int64, count=len(scanned))
        records: list[Any] = [SKIPPED] * (stop - start)
        for offset, (_, record) in zip(np.searchsorted(leaves, found).tolist(), scanned):
            records[offset] = record
        self.computed += len(records)
        return records

    def _failed(self, error: Exception, _leaf: int) -> _Failed:
        self._failures += 1  # from now on, runs of records are checked for failed ones
        if isinstance(error, StopIteration):  # raised again inside map(), it would end the run
            error = stop_error(f"{self.kind}: a function mapped over its upstream's records", None, error)
        return _Failed(error)

    # -- state: configuration only, plus the cursor -----------------------------------------

    def _config(self) -> dict[str, Any]:
        return {
            DIRECTORY: self.directory,
            MAX_BYTES: self.max_bytes,
            BLOCK_SIZE: self.block_size,
            FINGERPRINT: self.fingerprint,
        }

    def _check_config(self, state: dict[str, Any], path: str) -> None:
        """Nothing to check: a cache never changes the records, so a state saved with another
        directory, size or a cold cache resumes here (the upstream's own checks still apply)."""


class _ComputedBlock:
    """A disk block's records computed but not stored (some failed), read as a ``BlockView``."""

    def __init__(self, records: list[Any]) -> None:
        self.record = records.__getitem__


def cache(
    upstream: Node[T],
    directory: str | os.PathLike[str] | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> Cache[T]:
    """Cache ``upstream``'s records: in memory (an LRU of ``max_bytes``) or, with ``directory``,
    in Arrow IPC files reused by later epochs and jobs. ``upstream`` must be indexed and free
    of shuffle and shard (place those after the cache). Raises ConfigError otherwise."""
    return Cache(upstream, directory, max_bytes=max_bytes, block_size=block_size)
