"""ParallelMap: apply a function in a pool of threads or processes, keeping the order.

The upstream is read in the consumer's thread, a bounded window ahead (``2 * num_workers``
records); each record is submitted to a ``concurrent.futures`` pool together with the
upstream state and key right after it. Results are handed out in upstream order, and the
state is the one attached to the last result handed out, so the records in flight are read
and mapped again after a restore.
"""

from __future__ import annotations

import multiprocessing
import pickle
import threading
import weakref
from collections import deque
from concurrent.futures import BrokenExecutor, Executor, ProcessPoolExecutor, ThreadPoolExecutor
from typing import Any, Callable, Sequence, TypeVar

from resumable.core.keys import RecordKey
from resumable.core.node import Node
from resumable.errors import ConfigError, ResumableError
from resumable.ops.prefetch import check_positive_int
from resumable.ops.read_ahead import ReadAhead

T = TypeVar("T")
U = TypeVar("U")

NUM_WORKERS = "num_workers"
MODE = "mode"
THREAD = "thread"
PROCESS = "process"
MODES = (THREAD, PROCESS)
# Records read ahead of the consumer per worker: enough to keep every worker busy while the
# consumer takes a result, small enough that a restore redoes little work.
IN_FLIGHT_PER_WORKER = 2
# Start method of process pools: "forkserver" does not fork the (possibly multi-threaded)
# training process itself; the function and the records travel by pickle.
PROCESS_START_METHOD = "forkserver"

# Kinds of window entries: a submitted record, the end of the upstream's epoch, an upstream error.
_RESULT = 0
_END = 1
_ERROR = 2


class MapError(ResumableError):
    """The mapped function raised on a record; names the node and the record's key and
    chains the original exception (``__cause__``)."""

    def __init__(self, message: str, key: RecordKey | None) -> None:
        super().__init__(message)
        self.key = key


def _stop_pool(pool: Executor, thread_prefix: str) -> None:
    """Finalizer: stop ``pool``, waiting for its workers unless running in one of them (a
    garbage collection may run the finalizer in any thread)."""
    in_pool_thread = threading.current_thread().name.startswith(thread_prefix)
    pool.shutdown(wait=not in_pool_thread, cancel_futures=True)


class ParallelMap(ReadAhead[U]):
    """Apply ``fn`` to each item in a pool of ``num_workers`` threads or processes (``mode``).

    Results come in upstream order. At most ``2 * num_workers`` items are in flight; the state
    is the upstream state as of the last result handed out. An exception in ``fn`` reaches the
    consumer at that item as a ``MapError`` naming the item's key (its upstream ``last_key()``).
    In process mode ``fn`` must be picklable (a module-level function, not a lambda), and so
    must the items and results. The pool starts lazily and stops on ``close()``, on garbage
    collection and at interpreter exit; it is kept across epochs and restores.
    """

    kind = "ParallelMap"

    def __init__(self, upstream: Node[T], fn: Callable[[T], U], num_workers: int, mode: str = THREAD) -> None:
        super().__init__(upstream)
        if not callable(fn):
            raise ConfigError(f"{self.kind}: expected a callable, got {type(fn).__name__}")
        self.num_workers = check_positive_int(self.kind, NUM_WORKERS, num_workers)
        if mode not in MODES:
            raise ConfigError(f"{self.kind}: mode must be one of {MODES}, got {mode!r}")
        if mode == PROCESS:
            try:
                pickle.dumps(fn)
            except Exception as error:  # noqa: BLE001 - any pickling failure means the same
                raise ConfigError(
                    f"{self.kind}: mode='process' needs a picklable fn (a module-level function, "
                    f"not a lambda or closure); {fn!r} cannot be pickled: {error}"
                ) from error
        self.fn = fn
        self.mode = mode
        self.max_in_flight = IN_FLIGHT_PER_WORKER * self.num_workers
        self._pool: Executor | None = None
        self._finalizer: weakref.finalize[..., ParallelMap[U]] | None = None
        # Entries (kind, future or error, upstream state after it, upstream last_key after it).
        self._window: deque[tuple[int, Any, dict[str, Any], RecordKey | None]] = deque()
        self._upstream_done = False

    # -- iteration --------------------------------------------------------------------------

    def _next(self) -> U:
        self._record_live()
        self._fill()
        if not self._window:
            raise StopIteration  # the end was handed out already
        kind, payload, state, key = self._window.popleft()
        self._record(state, key)
        if kind == _END:
            raise StopIteration
        if kind == _ERROR:
            raise payload
        try:
            result: U = payload.result()
            return result
        except BrokenExecutor:
            raise  # the pool died (a worker was killed): not an error of fn on this record
        except Exception as error:  # noqa: BLE001 - wrapped with the record's key
            raise MapError(
                f"{self.kind} ({self.mode}, {self.num_workers} workers) over {self.upstream!r}: "
                f"fn raised {type(error).__name__} on the record with key {key}: {error}",
                key,
            ) from error

    def _fill(self) -> None:
        """Read the upstream and submit records until the window is full or the epoch ends."""
        upstream, window = self.upstream, self._window
        while not self._upstream_done and len(window) < self.max_in_flight:
            try:
                item = next(upstream)
            except StopIteration:
                self._upstream_done = True
                window.append((_END, None, upstream._state(progress=True), upstream.last_key()))
                return
            except Exception as error:  # noqa: BLE001 - handed out in order
                window.append((_ERROR, error, upstream._state(progress=True), upstream.last_key()))
                continue
            future = self._executor().submit(self.fn, item)
            window.append((_RESULT, future, upstream._state(progress=True), upstream.last_key()))

    def _executor(self) -> Executor:
        if self._pool is None:
            name = f"resumable-{self.kind}"
            pool: Executor
            if self.mode == THREAD:
                pool = ThreadPoolExecutor(self.num_workers, thread_name_prefix=name)
            else:
                context = multiprocessing.get_context(PROCESS_START_METHOD)
                pool = ProcessPoolExecutor(self.num_workers, mp_context=context)
            self._pool = pool
            self._finalizer = weakref.finalize(self, _stop_pool, pool, name)
        return self._pool

    def _drop_ahead(self) -> bool:
        """Forget the records in flight; the pool keeps running for the next ones."""
        ran_ahead = bool(self._window)
        for kind, payload, _, _ in self._window:
            if kind == _RESULT:
                payload.cancel()
        self._window.clear()
        self._upstream_done = False
        return ran_ahead

    def _shutdown(self) -> None:
        """Stop the pool (its threads or processes); iterating on redoes the dropped records."""
        self._rewind()
        pool, self._pool = self._pool, None
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)

    def fetch_many(self, keys: Sequence[RecordKey]) -> list[U]:
        """The items with ``keys``, mapped through the node's pool (in order), so a packer's
        restored rows map their records in parallel, as iteration does; a single item is
        mapped in the calling thread, where the pool would only add a round trip."""
        items = self.upstream.fetch_many(keys)
        if len(items) < 2:
            return [self.fn(item) for item in items]
        return list(self._executor().map(self.fn, items))
