"""ParallelMap: apply a function in a pool of threads or processes, keeping the order.

The upstream is read in the consumer's thread, a bounded window ahead; records go to a
``concurrent.futures`` pool in chunks (one task maps a list of records), and each record keeps
its own upstream state and key in the window. Results are handed out in upstream order, and the
state is the one attached to the last result handed out, so the records in flight are read and
mapped again after a restore. A process pool receives ``fn`` once per worker, when the worker
starts, and then only records: a task costs the same whatever ``fn`` holds. A batched ``fn``
takes a whole chunk in one call.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.spawn
import multiprocessing.util
import os
import pickle
import subprocess
import sys
import traceback
import weakref
from collections import deque
from concurrent.futures import BrokenExecutor, Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from typing import Any, Callable, Optional, Sequence, TypeVar, cast

import numpy as np

from resumable._forks import at_fork
from resumable._worker_signals import init_pool_worker
from resumable.core.keys import RecordKey
from resumable.core.node import Mark, Node
from resumable.core.options import choice_option, flag_option, int_option
from resumable.errors import ConfigError, MapError, ResumableError, stop_error
from resumable.ops.read_ahead import ReadAhead

T = TypeVar("T")
U = TypeVar("U")

NUM_WORKERS = "num_workers"
MODE = "mode"
THREAD = "thread"
PROCESS = "process"
MODES = (THREAD, PROCESS)
# Chunks in flight per worker: one being mapped and one queued behind it, so a worker never
# waits for the consumer between two chunks.
IN_FLIGHT_PER_WORKER = 2
# Records per task. A chunk starts at one record after every restart of the window (a restore, a
# new epoch), so the first record after a restore is mapped alone and handed out at once; the
# size then doubles with each chunk handed out, up to MAX_CHUNK, where the pool's cost per task
# (about 0.5 ms for a process pool) is a small share of a record's.
FIRST_CHUNK = 1
MAX_CHUNK = 64
# Start method of process pools: "forkserver" does not fork the (possibly multi-threaded)
# training process itself; the function (once per worker) and the records travel by pickle.
PROCESS_START_METHOD = "forkserver"
# Imported by the forkserver before it forks the first pool's workers (see _preload_in_forkserver).
PACKAGE = __name__.partition(".")[0]

# Kinds of window entries: a submitted record, the end of the upstream's epoch, an upstream error.
_RESULT = 0
_END = 1
_ERROR = 2

# What one task returns: the results in order (None where fn raised) and, if fn raised, the
# exception and, from a worker process, its formatted traceback, by the record's index in the chunk.
Failures = Optional[dict[int, tuple[BaseException, Optional[str]]]]
Outcome = tuple[list[Any], Failures]


class RemoteTraceback(Exception):
    """The traceback of an exception raised by ``fn`` in a worker process, as text; set as that
    exception's ``__cause__`` in the consumer (as ``concurrent.futures`` does)."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return self.text


def _map_items(fn: Callable[[Any], Any], items: list[Any], remote: bool, batched: bool) -> Outcome:
    """``fn`` over ``items``: every record is mapped, a failure of one does not stop the others
    (each record's error is handed out at that record, as if it had been mapped alone). A
    batched ``fn`` maps the whole list in one call; if that call fails, each record is mapped
    alone, so the error reaches the records it belongs to."""
    if batched and len(items) > 1:
        try:
            return apply_batched(fn, items), None
        except BaseException:  # noqa: BLE001 - found again below, record by record
            pass
    results: list[Any] = []
    failures: Failures = None
    for index, item in enumerate(items):
        try:
            results.append(apply_batched(fn, [item])[0] if batched else fn(item))
        except BaseException as error:  # noqa: BLE001 - handed out at its record, whatever it is
            results.append(None)
            if failures is None:
                failures = {}
            failures[index] = _portable(error) if remote else (error, None)
    return results, failures


def apply_batched(fn: Callable[[Any], Any], items: list[Any]) -> list[Any]:
    """A batched ``fn`` over ``items``: its results, checked to be one per record. ``fn`` gets
    copies of several records (deep, where they can be copied), so that what a failed call
    changed in them is not seen by the retry of each record alone."""
    results = fn(_copies(items) if len(items) > 1 else list(items))
    checked = list(results) if _is_sequence(results) else None
    if checked is None or len(checked) != len(items):
        got = "" if checked is None else f" of {len(checked)} results"
        raise ConfigError(
            f"map(batched=True): fn returned a {type(results).__name__}{got} for {len(items)} records; it must "
            "return a list (a sequence, or a numpy array along its first axis) of one result per record, in order"
        )
    return checked


def _copies(items: list[Any]) -> list[Any]:
    """Deep copies of ``items``, or the list alone if a record cannot be copied (an open file)."""
    try:
        return copy.deepcopy(items)
    except Exception:  # noqa: BLE001 - any record deepcopy refuses
        return list(items)


def _is_sequence(results: Any) -> bool:
    """Whether ``results`` lists results in order: a sequence that is not text, or a numpy
    array of at least one dimension (not a mapping, a set, a frame of columns, a scalar)."""
    if isinstance(results, np.ndarray):
        return results.ndim >= 1
    return isinstance(results, Sequence) and not isinstance(results, (str, bytes, bytearray))


def _portable(error: BaseException) -> tuple[BaseException, str]:
    """``error`` with its traceback text, or, if it cannot make the trip back from the worker,
    the pickling error in its place (what a pool task that returned it would have raised)."""
    try:
        pickle.loads(pickle.dumps(error))
    except Exception as failure:  # noqa: BLE001 - any pickling failure means the same
        error = failure
    return error, "".join(traceback.format_exception(error))


def _no_function(item: Any) -> Any:
    raise ResumableError("ParallelMap worker: no function installed (the pool's initializer did not run)")


# The function of this worker process's pool, and whether it is batched, installed once when
# the worker starts.
_worker_fn: Callable[[Any], Any] = _no_function
_worker_batched = False


def _install_fn(pickled_fn: bytes, batched: bool) -> None:
    """Pool initializer: keep the function pickled in ``pickled_fn`` for every task of this
    worker process (which leaves Ctrl-C to the trainer and dies with it: ``init_pool_worker``).
    The pool keeps its initializer's arguments for the workers it starts later: as bytes they
    hold no reference to the function, which may refer back to whatever holds the pipeline (a
    method of the trainer), so a dropped pipeline is still collected and its pool stopped."""
    global _worker_fn, _worker_batched
    init_pool_worker()
    _worker_fn, _worker_batched = pickle.loads(pickled_fn), batched


def _map_in_worker(items: list[Any]) -> Outcome:
    """A process pool's task: the installed function over ``items``."""
    return _map_items(_worker_fn, items, remote=True, batched=_worker_batched)


def _preload_in_forkserver() -> None:
    """Have the forkserver import this package (with numpy and pyarrow) when it starts, so the
    workers it forks start with it loaded. Otherwise every worker of every pool imported it
    again, re-running the main script's imports: about half a second of CPU per worker, and
    the wall time to the first result.

    The modules already listed stay (``__main__`` by default, or what the program set; an empty
    list, set by the program, means no preload and is kept). A forkserver already running is
    left as it is. Nothing is added where the forkserver would import another copy of the
    package than this one, and what was added is taken back where it now would (a forkserver
    restarted in another working directory). The list is read from ``multiprocessing``'s own
    forkserver object, as the standard library keeps it (it has no public getter); where that
    is missing, the default is assumed."""
    global _added_to_preload
    listed = getattr(getattr(multiprocessing.forkserver, "_forkserver", None), "_preload_modules", None)
    modules = list(listed) if isinstance(listed, (list, tuple)) else ["__main__"]
    if not modules:
        return
    python_environment = frozenset((name, value) for name, value in os.environ.items() if name.startswith("PYTHON"))
    same_copy = _forkserver_imports_this_copy(os.getcwd(), python_environment)
    if same_copy and PACKAGE not in modules:
        multiprocessing.forkserver.set_forkserver_preload([*modules, PACKAGE])
        _added_to_preload = True
    elif not same_copy and _added_to_preload:
        multiprocessing.forkserver.set_forkserver_preload([name for name in modules if name != PACKAGE])
        _added_to_preload = False


_added_to_preload = False
"""Whether ``_preload_in_forkserver`` put the package on the forkserver's list (and may take it off)."""


def _forget_the_parents_forkserver() -> None:
    """In a forked child: the running forkserver is the parent's child, which ``multiprocessing``
    here would wait for (``ChildProcessError``) before the child's first process pool; so the
    child forgets it, closing its own copy of the pipe that keeps it alive, and its first pool
    starts a forkserver of its own. Read from ``multiprocessing``'s forkserver object as the
    standard library keeps it; left alone where that is missing."""
    server = getattr(multiprocessing.forkserver, "_forkserver", None)
    if getattr(server, "_forkserver_pid", None) is None:
        return
    alive = getattr(server, "_forkserver_alive_fd", None)
    server._forkserver_pid = server._forkserver_address = server._forkserver_alive_fd = None  # type: ignore[union-attr]
    if alive is not None:
        with contextlib.suppress(OSError):
            os.close(alive)


at_fork(_forget_the_parents_forkserver)


@functools.lru_cache(maxsize=None)
def _forkserver_imports_this_copy(cwd: str, python_environment: frozenset[tuple[str, str]]) -> bool:
    """Whether an interpreter started as the forkserver is (same executable, flags, working
    directory ``cwd`` and environment, of which the ``PYTHON*`` variables shape its
    ``sys.path``) finds this copy of the package. One that found another (a checkout on this
    program's ``sys.path``, another version installed) would hand that copy to every worker.
    Asked of a fresh interpreter (about 50 ms), once per working directory and environment."""
    probe = f"import importlib.util; spec = importlib.util.find_spec({PACKAGE!r}); print(spec and spec.origin)"
    # the interpreter and flags multiprocessing starts the forkserver with (its own helper, private)
    flags: list[str] = getattr(multiprocessing.util, "_args_from_interpreter_flags", list)()
    command = [multiprocessing.spawn.get_executable(), *flags, "-c", probe]
    try:
        printed = subprocess.run(
            command, cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=10, check=True
        ).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return False
    this = sys.modules[PACKAGE].__file__
    # the last line: a sitecustomize may print before the probe does
    return bool(printed) and this is not None and os.path.realpath(printed[-1]) == os.path.realpath(this)


def _with_cause(failure: tuple[BaseException, str | None]) -> BaseException:
    """The exception of a failed record, its worker traceback (if any) as its cause."""
    error, text = failure
    if text is not None:
        error.__cause__ = RemoteTraceback(text)
    return error


class _Chunk:
    """Records submitted as one task, and the task's outcome once the consumer needed it."""

    __slots__ = ("items", "future", "results", "failures")

    def __init__(self) -> None:
        self.items: list[Any] = []
        self.future: Future[Outcome] | None = None  # set when the chunk is submitted (unless that failed)
        self.results: list[Any] | None = None
        self.failures: Failures = None


def _stop_pool(pool: Executor) -> None:
    """Finalizer: stop ``pool`` without waiting for its threads or processes, which end by
    themselves. A garbage collection runs it in whatever thread allocates, even inside
    ``threading``'s own locked bookkeeping (a thread starting), where joining a thread (a pool's
    threads and its manager thread are not daemons) would wait for ever on that lock."""
    pool.shutdown(wait=False, cancel_futures=True)


class ParallelMap(ReadAhead[U]):
    """Apply ``fn`` to each item in a pool of ``num_workers`` threads or processes (``mode``).

    Results come in upstream order. Records go to the pool in chunks of 1 growing to
    ``MAX_CHUNK`` (64); at most ``2 * num_workers`` chunks are in flight. With ``batched``,
    ``fn`` maps a chunk in one call (a list of items in, one result per item out); chunks
    start at one record after a restore, so ``fn`` must map each item as it would alone. The
    state is the upstream state as of the last result handed out. An exception in ``fn``
    reaches the consumer at that item as a ``MapError`` naming the item's key (its upstream
    ``last_key()``). In process mode ``fn`` must be picklable (a module-level function, not a
    lambda), and so must the items and results; each worker process receives ``fn`` once. The
    pool starts lazily and stops on ``close()``, on garbage collection and at interpreter exit;
    it is kept across epochs and restores.
    """

    kind = "ParallelMap"
    _reader_attributes = (*ReadAhead._reader_attributes, "_pool", "_window", "_upstream_done", "_chunk_size")

    def __init__(
        self, upstream: Node[T], fn: Callable[..., Any], num_workers: int, mode: str = THREAD, batched: bool = False
    ) -> None:
        super().__init__(upstream)
        if not callable(fn):
            raise ConfigError(f"{self.kind}: expected a callable, got {type(fn).__name__}")
        batched = flag_option(self.kind, "batched", batched)
        self.num_workers = int_option(self.kind, NUM_WORKERS, num_workers)
        mode = choice_option(self.kind, "mode", mode, MODES)
        self.fn = fn
        self.mode = mode
        self.batched = batched
        if mode == PROCESS:
            self._pickled_fn()

    def _pickled_fn(self) -> bytes:
        """``fn`` pickled, as a process pool's workers receive it; a ConfigError if it cannot be."""
        try:
            return pickle.dumps(self.fn)
        except Exception as error:  # noqa: BLE001 - any pickling failure means the same
            raise ConfigError(
                f"{self.kind}: mode='process' needs a picklable fn (a module-level function, "
                f"not a lambda or closure); {self.fn!r} cannot be pickled: {error}"
            ) from error

    def _fresh_reader(self) -> None:
        super()._fresh_reader()
        self._pool: Executor | None = None
        # Entries (kind, chunk or error, index in the chunk, upstream mark after it, upstream
        # last_key after it): one per record, in upstream order.
        self._window: deque[tuple[int, Any, int, Mark, RecordKey | None]] = deque()
        self._upstream_done = False
        self._chunk_size = FIRST_CHUNK

    def _reads_ahead(self) -> bool:
        return bool(self._window)

    @property
    def max_in_flight(self) -> int:
        """Records the window holds at most now (it grows with the chunk size)."""
        return IN_FLIGHT_PER_WORKER * self.num_workers * self._chunk_size

    # -- iteration --------------------------------------------------------------------------

    def _next(self) -> U:
        self._record_live()
        self._fill()
        if not self._window:
            raise StopIteration  # the end was handed out already
        kind, payload, index, mark, key = self._window[0]
        if kind == _RESULT and payload.results is None:
            self._resolve(payload)  # while the entry is still ahead: an interrupt here hands nothing out
        self._window.popleft()
        self._record(mark, key)
        if kind == _END:
            raise StopIteration
        if kind == _ERROR:
            raise payload
        chunk: _Chunk = payload
        results = cast("list[Any]", chunk.results)  # resolved above
        if chunk.failures is not None and index in chunk.failures:
            error = _with_cause(chunk.failures[index])
            if not isinstance(error, Exception):
                raise error  # SystemExit, KeyboardInterrupt...: as a serial map raises them
            raise MapError(
                f"{self.kind} ({self.mode}, {self.num_workers} workers) over {self.upstream!r}: "
                f"fn raised {type(error).__name__} on the record with key {key}: {error}",
                key,
            ) from error
        result: U = results[index]
        results[index] = None  # the consumer holds it now; the chunk need not
        return result

    def _resolve(self, chunk: _Chunk) -> None:
        """Wait for ``chunk``'s task and keep its outcome; the next chunks grow."""
        if chunk.future is None:  # its submission failed (the pool could not start): again
            chunk.future = self._submit(chunk.items)
        try:
            chunk.results, chunk.failures = chunk.future.result()
        except BrokenExecutor:
            raise  # the pool died (a worker was killed): not an error of fn on these records
        except Exception as error:  # noqa: BLE001 - the task itself failed, not fn
            # The records or results could not travel (pickling): map each record alone, so the
            # failure reaches the record it belongs to and the others are handed out.
            chunk.results, chunk.failures = self._one_by_one(chunk.items, error)
        chunk.items = []
        self._chunk_size = min(MAX_CHUNK, 2 * self._chunk_size)

    def _one_by_one(self, items: list[Any], error: Exception) -> Outcome:
        """The outcome of a chunk whose task failed as a whole, record by record."""
        if len(items) == 1:
            return [None], {0: (error, None)}
        results: list[Any] = []
        failures: dict[int, tuple[BaseException, str | None]] = {}
        for index, future in enumerate([self._submit([item]) for item in items]):
            try:
                [result], failed = future.result()
            except BrokenExecutor:
                raise
            except Exception as item_error:  # noqa: BLE001 - this record's transport failed
                result, failed = None, {0: (item_error, None)}
            results.append(result)
            if failed is not None:
                failures[index] = failed[0]
        return results, failures or None

    def _fill(self) -> None:
        """Read the upstream and submit chunks of records until the window has no room for
        another chunk or the epoch ends; every record read is submitted before returning."""
        upstream, window = self.upstream, self._window
        if window and window[-1][0] == _ERROR:
            return  # read on once the error is handed out: an upstream that failed without moving
            # (a file gone, an object replaced) would fail at the same record again and again
        chunk = _Chunk()
        try:
            while not self._upstream_done and (chunk.items or len(window) + self._chunk_size <= self.max_in_flight):
                try:
                    item = next(upstream)
                except StopIteration:
                    self._upstream_done = True
                    window.append((_END, None, 0, upstream._mark(), upstream.last_key()))
                    break
                except Exception as error:  # noqa: BLE001 - handed out in order
                    window.append((_ERROR, error, 0, upstream._mark(), upstream.last_key()))
                    break
                window.append((_RESULT, chunk, len(chunk.items), upstream._mark(), upstream.last_key()))
                chunk.items.append(item)
                if len(chunk.items) == self._chunk_size:
                    chunk.future = self._submit(chunk.items)
                    chunk = _Chunk()
        finally:  # even when interrupted: every chunk in the window has its task
            if chunk.items:
                chunk.future = self._submit(chunk.items)

    def _submit(self, items: list[Any]) -> Future[Outcome]:
        if self.mode == THREAD:
            return self._executor().submit(_map_items, self.fn, items, False, self.batched)
        return self._executor().submit(_map_in_worker, items)

    def _executor(self) -> Executor:
        if self._pool is None:
            name = f"resumable-{self.kind}"
            pool: Executor
            if self.mode == THREAD:
                pool = ThreadPoolExecutor(self.num_workers, thread_name_prefix=name)
            else:
                if multiprocessing.current_process().daemon:
                    raise ConfigError(
                        f"{self.kind} over {self.upstream!r}: mode='process' cannot start a pool in a daemonic "
                        "process (a DataLoader worker, whose children multiprocessing forbids); use mode='thread' "
                        "there (batched=True for a tokenizer's encode_batch), or let the DataLoader's workers be the "
                        "processes"
                    )
                _preload_in_forkserver()
                context = multiprocessing.get_context(PROCESS_START_METHOD)
                pool = ProcessPoolExecutor(
                    self.num_workers,
                    mp_context=context,
                    initializer=_install_fn,
                    initargs=(self._pickled_fn(), self.batched),
                )
            self._pool = pool
            self._finalizer = weakref.finalize(self, _stop_pool, pool)
        return self._pool

    def _drop_ahead(self) -> bool:
        """Forget the records in flight; the pool keeps running for the next ones, which start
        again from chunks of one record."""
        ran_ahead = bool(self._window)
        for kind, payload, _, _, _ in self._window:
            if kind == _RESULT and payload.future is not None:
                payload.future.cancel()
        self._window.clear()
        self._upstream_done = False
        self._chunk_size = FIRST_CHUNK
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
        """The items with ``keys``, mapped through the node's pool (in order, one chunk per
        worker), so a packer's restored rows map their records in parallel, as iteration does;
        a single item is mapped in the calling thread, where the pool would only add a round
        trip. An exception of ``fn`` is raised as it is."""
        items = self.upstream.fetch_many(keys)
        try:
            if len(items) < 2:
                if self.batched:
                    return apply_batched(self.fn, items) if items else []
                return [self.fn(item) for item in items]
            size = min(MAX_CHUNK, math.ceil(len(items) / self.num_workers))
            futures = [self._submit(items[start : start + size]) for start in range(0, len(items), size)]
            mapped: list[U] = []
            for future in futures:
                results, failures = future.result()
                if failures is not None:
                    raise _with_cause(failures[min(failures)])
                mapped.extend(results)
            return mapped
        except StopIteration as stop:
            raise stop_error(f"{self.kind}: fn", None, stop) from stop
