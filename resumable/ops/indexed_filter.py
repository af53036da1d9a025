"""IndexedFilter: an index of the records a predicate keeps, so random access survives a filter.

    pipe = rs.parquet(paths).filter(lambda r: r["length"] <= 4096, index=True, cache_dir="/scratch/idx")
    pipe = pipe.shuffle(0).shard()          # shuffle, shard, len() and elastic resume still work

Position ``i`` of the filter is the ``i``-th upstream position the predicate keeps. The kept
positions are found once, by scanning the upstream (in chunks, decoded as its cursor decodes; a
source's ``on_error="skip"`` records are left out like rejected ones), on first need: ``len()``,
iteration, ``get_state`` or random access. They are a numpy array (uint32 below 2**32 upstream
records, else int64): in memory, or with ``cache_dir`` a memory-mapped ``.npy`` sidecar shared by
every process (DataLoader workers, ranks, later jobs) that builds the same pipeline.

The sidecar's name hashes the upstream's fingerprint (its configuration with the source files'
fingerprints, and its maps' code: ``resumable.ops.cache.fingerprint``), the predicate's name and
bytecode, and the user's ``index_key``. Values a predicate closes over cannot be fingerprinted:
change ``index_key`` when they change. A ``.json`` beside the sidecar holds its count and digest;
a sidecar that fails them is rebuilt. One process builds while the others wait on a lock file,
and the sidecar is written to a temporary and renamed, so readers never see a partial file.

The upstream's positions must not depend on the epoch or the process: shuffle, block shuffle and
shard go after the filter (sources, serial maps, caches and other indexed filters may come before).
"""

from __future__ import annotations

import functools
import hashlib
import json
import multiprocessing
import operator
import os
import warnings
from concurrent.futures import ProcessPoolExecutor
from typing import Any, Callable, Iterator, TypeVar

import numpy as np
import xxhash
from tqdm import tqdm

from resumable._file_locks import held
from resumable._worker_signals import init_pool_worker
from resumable.checkpoint import write_atomically
from resumable.core.indexed import MAX_CHUNK, IndexedNode, read_ahead_failure
from resumable.core.options import directory_option, flag_option, int_option
from resumable.errors import ConfigError, SidecarWarning, SourceError
from resumable.ops.cache import _function_fingerprint, fingerprint

T = TypeVar("T")

INDEX_KEY = "index_key"
KEPT = "kept"
KEPT_DIGEST = "kept_digest"

FORMAT = 1
"""Version of the sidecar and its description; part of the sidecar's name."""
KEY_CHARS = 32
KEY = "key"
CHECK_BLOCK = 1 << 20
"""Kept positions checked for order per step when a sidecar is loaded (bounded memory)."""
SIDECAR_PREFIX = "kept-"
TASK_RECORDS = 1 << 16
"""Upstream positions per task of a parallel scan: contiguous ranges, small enough for a
progress bar that moves and for an even load over the processes."""
UINT32_RECORDS = 2**32
"""Upstreams with fewer records store kept positions as uint32 (4 bytes per kept record)."""

Predicate = Callable[[Any], Any]
_Job = tuple[IndexedNode[Any], Predicate, bool, bool, np.dtype[Any]]
_JOB: _Job | None = None
"""The scan a worker process runs: (upstream, predicate, batched, skip, dtype)."""


def _check_stable(upstream: IndexedNode[Any]) -> None:
    """Refuse an upstream whose positions depend on the epoch or the process (ConfigError)."""
    for node in upstream._subtree():
        if isinstance(node, IndexedNode) and node.upstream is not None and not node._same_positions:
            if not isinstance(node, IndexedFilter):
                raise ConfigError(
                    f"IndexedFilter: the upstream contains {node.kind}, whose positions depend on the epoch or "
                    "the process, so the kept positions could not be the same every epoch; place "
                    ".filter(index=True) before shuffle and shard (they may follow it)"
                )


def _dtype(records: int) -> np.dtype[Any]:
    return np.dtype(np.uint32) if records < UINT32_RECORDS else np.dtype(np.int64)


def _digest(kept: np.ndarray) -> str:
    return xxhash.xxh3_64_hexdigest(np.ascontiguousarray(kept).data)


def _chunks(
    upstream: IndexedNode[Any], start: int, stop: int, skip: bool
) -> Iterator[tuple[int, np.ndarray, list[Any]]]:
    """``(records read, positions, records)`` for upstream positions ``[start, stop)`` of
    epoch 0, read in chunks and decoded; records the source skips as malformed (``skip``) are
    left out of ``positions`` and ``records``."""
    position = start
    while position < stop:
        raws = upstream._read_chunk(position, min(MAX_CHUNK, stop - position), 0)
        positions = np.arange(position, position + len(raws), dtype=np.int64)
        leaves = upstream._leaf_indices(positions, 0)
        decoded = list(upstream._decoded(raws, leaves, skip, read_ahead_failure("IndexedFilter")))
        if len(decoded) < len(raws):  # leaf indices rise with positions in an accepted upstream
            found = np.fromiter((leaf for leaf, _ in decoded), dtype=np.int64, count=len(decoded))
            positions = positions[np.searchsorted(leaves, found)]
        position += len(raws)
        yield len(raws), positions, [record for _, record in decoded]


def _mask(predicate: Predicate, batched: bool, positions: np.ndarray, records: list[Any]) -> np.ndarray:
    """What ``predicate`` keeps of ``records`` (at upstream ``positions``), as a bool array; a
    predicate that fails raises SourceError naming the position."""
    if batched:
        try:
            mask = np.asarray(predicate(records))
        except Exception as error:  # noqa: BLE001 - the user's predicate, reported with its positions
            where = f"positions [{positions[0]}, {positions[-1]}]" if len(positions) else "no records"
            raise SourceError(f"IndexedFilter: the batched predicate failed on upstream {where}: {error!r}") from error
        if mask.shape != (len(records),):
            raise ConfigError(
                f"IndexedFilter: a batched predicate returns one bool per record, got shape {mask.shape} "
                f"for {len(records)} records"
            )
        return mask.astype(bool, copy=False)
    pending = iter(records)
    try:
        return np.fromiter(map(bool, map(predicate, pending)), dtype=bool, count=len(records))
    except Exception as error:  # noqa: BLE001 - the user's predicate, reported with its position
        failed = len(records) - operator.length_hint(pending) - 1
        raise SourceError(
            f"IndexedFilter: the predicate failed on upstream position {int(positions[failed])}: {error!r}"
        ) from error


def _kept_in(job: _Job, start: int, stop: int, bar: tqdm[Any] | None = None) -> np.ndarray:
    """The kept positions among upstream positions ``[start, stop)``, in order."""
    upstream, predicate, batched, skip, dtype = job
    parts = [np.empty(0, dtype=dtype)]
    for count, positions, records in _chunks(upstream, start, stop, skip):
        parts.append(positions[_mask(predicate, batched, positions, records)].astype(dtype))
        if bar is not None:
            bar.update(count)
    return np.concatenate(parts)


def _check_positions(kept: np.ndarray, records: int) -> None:
    """Raise ValueError unless ``kept`` rises strictly within ``[0, records)``: what a scan
    writes. Checked a block at a time, so a memory-mapped index stays out of memory."""
    if len(kept) and (int(kept[0]) < 0 or int(kept[-1]) >= records):
        raise ValueError(f"its positions leave [0, {records})")
    for start in range(0, max(len(kept) - 1, 0), CHECK_BLOCK):
        block = np.asarray(kept[start : start + CHECK_BLOCK + 1])
        if np.any(block[1:] <= block[:-1]):
            raise ValueError("its positions do not rise")


def _shown(part: np.ndarray, records: int, bar: tqdm[Any]) -> np.ndarray:
    """``part``, once the progress bar has counted the ``records`` it covers."""
    bar.update(records)
    return part


def _beside(sidecar: str, suffix: str) -> str:
    """The file beside the sidecar ``kept-<key>.npy`` with ``suffix`` instead of ``.npy``."""
    return sidecar[: -len(".npy")] + suffix


def _adopt(job: _Job) -> None:
    """Worker process initialiser: the scan it serves (inherited as it is under fork); the
    worker leaves Ctrl-C to the trainer and dies with it (``init_pool_worker``)."""
    global _JOB
    init_pool_worker()
    _JOB = job


def _kept_in_task(bounds: tuple[int, int]) -> np.ndarray:
    """A worker process's task: the kept positions of one contiguous range."""
    if _JOB is None:
        raise RuntimeError("IndexedFilter: a scan worker was started without its scan")
    return _kept_in(_JOB, *bounds)


def _context() -> multiprocessing.context.BaseContext:
    """Fork where the platform has it (the pipeline and predicate are inherited, not pickled)."""
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    return multiprocessing.get_context(method)


class IndexedFilter(IndexedNode[T]):
    """Position ``i`` is the ``i``-th upstream position ``predicate`` keeps; random access.

    ``predicate(record)`` returns a truth value; with ``batched=True`` it takes a list of
    records and returns one bool per record (a sequence or numpy array), so it may vectorise.
    ``num_proc > 0`` scans in that many processes over contiguous ranges; ``progress`` shows
    a tqdm bar. ``cache_dir`` keeps the index in a memory-mapped sidecar (see the module).
    """

    kind = "IndexedFilter"

    upstream: IndexedNode[Any]

    def __init__(
        self,
        upstream: IndexedNode[T],
        predicate: Predicate,
        index_key: str | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        num_proc: int = 0,
        progress: bool = True,
        batched: bool = False,
    ) -> None:
        super().__init__(upstream)
        _check_stable(self._parent)
        if not callable(predicate):
            raise ConfigError(f"{self.kind}: expected a callable predicate, got {type(predicate).__name__}")
        if index_key is not None and not isinstance(index_key, str):
            raise ConfigError(f"{self.kind}: index_key must be a str or None, got {type(index_key).__name__}")
        self.predicate = predicate
        self.index_key = index_key
        self.cache_dir = directory_option(self.kind, "cache_dir", cache_dir)
        self.num_proc = int_option(self.kind, "num_proc", num_proc, least=0)
        self.progress = flag_option(self.kind, "progress", progress)
        self.batched = flag_option(self.kind, "batched", batched)
        self.scanned = 0
        """Upstream records this node has run the predicate over (0 when it loaded a sidecar)."""
        self._kept: np.ndarray | None = None
        self._kept_digest = ""
        self._mapped = False  # whether _kept maps the sidecar (reopened, not pickled)

    # -- the index ------------------------------------------------------------------------

    @property
    def kept(self) -> np.ndarray:
        """The kept upstream positions, ascending; built or loaded on first use."""
        if self._kept is None:
            self._kept = self._build()
        return self._kept

    @property
    def dropped(self) -> int:
        """Upstream records not kept: rejected by the predicate, or skipped as malformed."""
        return len(self.upstream) - len(self)

    @property
    def sidecar(self) -> str | None:
        """The path of the index's ``.npy`` sidecar, or None without ``cache_dir``."""
        if self.cache_dir is None:
            return None
        return os.path.join(self.cache_dir, f"{SIDECAR_PREFIX}{self._key()}.npy")

    def _key(self) -> str:
        """What the index is (upstream, predicate, ``index_key``) as a hash: the sidecar's name,
        also kept in its description so a sidecar renamed from another index is not taken."""
        upstream_key, _ = fingerprint(self.upstream)
        text = json.dumps([FORMAT, upstream_key, _function_fingerprint(self.predicate), self.index_key])
        return hashlib.sha256(text.encode()).hexdigest()[:KEY_CHARS]

    def _build(self) -> np.ndarray:
        sidecar = self.sidecar
        if sidecar is None:
            return self._remember(self._scan_all(), None, mapped=False)
        try:  # one process builds it while the others wait; without a lock (read-only), each loads or builds
            with held(_beside(sidecar, ".lock")):
                loaded = self._load_sidecar(sidecar)
                if loaded is not None:
                    return loaded
                kept = self._remember(self._scan_all(), None, mapped=False)
                self._write_sidecar(sidecar, kept)
                # Map what was written, so the index costs no resident memory from now on.
                return self._remember(np.load(sidecar, mmap_mode="r"), self._kept_digest, mapped=True)
        except OSError as error:
            warnings.warn(
                f"{self.kind}: cannot use the index sidecar {sidecar!r} ({error}); the index stays in memory "
                "and is built again by the next process",
                SidecarWarning,
                stacklevel=3,
            )
            return self._kept if self._kept is not None else self._remember(self._scan_all(), None, mapped=False)

    def _remember(self, kept: np.ndarray, digest: str | None, mapped: bool) -> np.ndarray:
        self._kept, self._mapped = kept, mapped
        self._kept_digest = _digest(kept) if digest is None else digest
        return kept

    def _scan_all(self) -> np.ndarray:
        """Run the predicate over every upstream record: the kept positions, in order."""
        total = len(self.upstream)
        job: _Job = (self.upstream, self.predicate, self.batched, self.upstream.leaf.skips_malformed, _dtype(total))
        bar = functools.partial(tqdm, total=total, disable=not self.progress, desc=f"{self.kind}: indexing", unit="rec")
        # a daemonic process (a DataLoader worker) may not start children: it scans itself
        if self.num_proc == 0 or total <= TASK_RECORDS or multiprocessing.current_process().daemon:
            with bar() as shown:
                kept = _kept_in(job, 0, total, shown)
        else:
            tasks = [(start, min(start + TASK_RECORDS, total)) for start in range(0, total, TASK_RECORDS)]
            # The workers start (fork) before the progress bar's monitor thread does.
            with ProcessPoolExecutor(self.num_proc, mp_context=_context(), initializer=_adopt, initargs=(job,)) as pool:
                parts = pool.map(_kept_in_task, tasks)
                with bar() as shown:
                    kept = np.concatenate(
                        [_shown(part, stop - start, shown) for (start, stop), part in zip(tasks, parts)]
                    )
        self.scanned += total
        return kept

    def _description(self, kept: np.ndarray) -> dict[str, Any]:
        """What the ``.json`` beside a sidecar holds: what the index is, and its count and digest."""
        return {
            "format": FORMAT,
            KEY: self._key(),
            INDEX_KEY: self.index_key,
            "records": len(self.upstream),
            KEPT: len(kept),
            "dtype": kept.dtype.str,
            KEPT_DIGEST: _digest(kept),
            "upstream": fingerprint(self.upstream)[1],
            "predicate": _function_fingerprint(self.predicate),
        }

    def _write_sidecar(self, sidecar: str, kept: np.ndarray) -> None:
        """The index, then its description, each written to a temporary and renamed."""
        write_atomically(sidecar, lambda out: np.save(out, kept, allow_pickle=False))
        text = json.dumps(self._description(kept), sort_keys=True, default=repr).encode()
        write_atomically(_beside(sidecar, ".json"), lambda out: out.write(text))

    def _load_sidecar(self, sidecar: str) -> np.ndarray | None:
        """The memory-mapped index in ``sidecar`` if it is intact and describes this index; None
        (with a SidecarWarning when files were there but wrong) to build it again."""
        description = _beside(sidecar, ".json")
        if not os.path.exists(sidecar) or not os.path.exists(description):
            return None
        dtype = _dtype(len(self.upstream))
        try:
            with open(description, "rb") as handle:
                saved = json.loads(handle.read())
            kept = np.load(sidecar, mmap_mode="r", allow_pickle=False)
            if not isinstance(saved, dict) or kept.ndim != 1 or kept.dtype != dtype:
                raise ValueError(f"not a {dtype} vector with its description")
            records = len(self.upstream)
            expected = {
                "format": FORMAT,
                KEY: self._key(),
                INDEX_KEY: self.index_key,
                "records": records,
                KEPT: len(kept),
            }
            wrong = {key: saved.get(key) for key, value in expected.items() if saved.get(key) != value}
            if wrong:
                raise ValueError(f"it describes another index: {wrong}")
            if saved.get(KEPT_DIGEST) != _digest(kept):
                raise ValueError("its digest does not match its contents")
            _check_positions(kept, records)
        except (OSError, ValueError, EOFError, RecursionError) as error:  # np.load: EOFError on an empty file
            warnings.warn(
                f"{self.kind}: index sidecar {sidecar!r} is damaged or stale ({error}); rebuilding it",
                SidecarWarning,
                stacklevel=5,
            )
            return None
        return self._remember(kept, saved[KEPT_DIGEST], mapped=True)

    # -- random access ----------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.kept)

    def _length(self, epoch: int) -> int:
        return len(self)

    def _leaf_indices(self, positions: np.ndarray, epoch: int) -> np.ndarray:
        return self.upstream._leaf_indices(self._intact_kept()[positions].astype(np.int64), epoch)

    def _intact_kept(self) -> np.ndarray:
        """``kept``, loaded again first if its sidecar was cut short in place since it was
        mapped: reading a map past the end of its file kills the process (SIGBUS). The check is
        an ``fstat`` of the map numpy keeps (``mmap.size``), once per lookup of a chunk."""
        kept = self.kept
        mapping = getattr(kept, "_mmap", None) if self._mapped else None
        if mapping is not None and mapping.size() < len(mapping):
            warnings.warn(
                f"{self.kind}: index sidecar {self.sidecar!r} went from {len(mapping)} to {mapping.size()} bytes "
                "while in use; rebuilding it",
                SidecarWarning,
                stacklevel=4,
            )
            self._kept = None
            kept = self.kept
        return kept

    # -- state: the index is part of the configuration --------------------------------------

    def _config(self) -> dict[str, Any]:
        kept = len(self)  # builds the index, and its digest, if need be
        return {INDEX_KEY: self.index_key, KEPT: kept, KEPT_DIGEST: self._kept_digest}

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (DataLoader workers under spawn): a memory-mapped index is mapped again by the
        new process, an index in memory travels with the node."""
        state = self.__dict__.copy()
        if self._mapped:
            state["_kept"], state["_mapped"] = None, False
        return state
