"""Prefetch: run the upstream in a background thread, a bounded number of items ahead.

The state is the state as of the last item handed to the consumer, never the producer's: the
producer thread takes the upstream's mark (``Node._mark``, its counters) right after each item
and sends it along with the item, and ``get_state()`` builds the state of the one attached to
the last item consumed. Items still in the queue when a state is taken are produced again
after a restore.
"""

from __future__ import annotations

import queue
import threading
import weakref
from typing import Any, Sequence, TypeVar

from resumable.core.keys import RecordKey
from resumable.core.node import Mark, Node
from resumable.core.options import int_option
from resumable.ops.read_ahead import ReadAhead

T = TypeVar("T")

BUFFER_SIZE = "buffer_size"

# How often (seconds) a blocked producer or consumer wakes up to check that its partner is
# still there; only the latency of a shutdown depends on it, never the data.
POLL_S = 0.05
# How long the garbage-collection finalizer waits for a producer stuck inside a slow
# ``next(upstream)``; explicit shutdowns wait for it to finish, as the upstream is reused.
FINALIZER_JOIN_TIMEOUT_S = 10.0

# Messages from the producer: (tag, payload, upstream state after it, upstream last_key after it).
_ITEM = 0
_ERROR = 1
_END = 2


class _Producer:
    """One run of the background thread. Holds no reference to the Prefetch node, and between
    items none to its upstream, so that an abandoned node is garbage-collected and its finalizer
    can stop the thread, even where the upstream refers back to whatever holds the node (a map
    whose function is a method of the trainer that holds the pipeline)."""

    def __init__(self, upstream: Node[Any], buffer_size: int, lock: threading.Lock, name: str) -> None:
        self.upstream = weakref.ref(upstream)
        self.queue: queue.Queue[tuple[int, Any, Mark, RecordKey | None]] = queue.Queue(buffer_size)
        self.stop_event = threading.Event()
        self.error_taken = threading.Event()  # the consumer took the error last put
        self.lock = lock
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        lock = self.lock
        while not self.stop_event.is_set():
            upstream = self.upstream()
            if upstream is None:
                return  # the pipeline was collected
            with lock:
                try:
                    item = next(upstream)
                    tag = _ITEM
                except StopIteration:
                    item, tag = None, _END
                except BaseException as error:  # noqa: BLE001 - handed to the consumer
                    item, tag = error, _ERROR
                mark = upstream._mark()
                key = upstream.last_key()
            del upstream  # while waiting for room in the queue
            if tag == _ERROR:
                self.error_taken.clear()
            if not self._put((tag, item, mark, key)) or tag == _END:
                return
            if tag != _ERROR:
                continue
            if not isinstance(item, Exception):
                return  # KeyboardInterrupt, SystemExit: nothing follows
            # Read on once the error is handed out: an upstream that failed without moving (a
            # file gone, an object replaced) would fail at the same record again.
            while not self.error_taken.wait(POLL_S):
                if self.stop_event.is_set():
                    return

    def _put(self, message: tuple[int, Any, Mark, RecordKey | None]) -> bool:
        """Put ``message`` in the queue, waiting while it is full; False if asked to stop."""
        while not self.stop_event.is_set():
            try:
                self.queue.put(message, timeout=POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def get(self) -> tuple[int, Any, Mark, RecordKey | None]:
        """The next message, waiting for the producer."""
        while True:
            try:
                message = self.queue.get(timeout=POLL_S)
            except queue.Empty:
                if not self.thread.is_alive() and self.queue.empty():
                    raise RuntimeError("the prefetch thread stopped without a final message") from None
                continue
            if message[0] == _ERROR:
                self.error_taken.set()
            return message

    def stop(self, join_timeout: float | None = None) -> None:
        """Ask the thread to stop, drop what it produced, and wait for it to finish (at most
        ``join_timeout`` seconds; not when called from the thread itself)."""
        self.stop_event.set()
        if self.thread is not threading.current_thread():
            self.thread.join(join_timeout)
        while True:
            try:
                self.queue.get_nowait()
            except queue.Empty:
                break


class Prefetch(ReadAhead[T]):
    """Run the upstream in a daemon thread, up to ``buffer_size`` items ahead of the consumer.

    State: the upstream state as of the last item handed out (items in flight are produced
    again after a restore). An exception raised by the upstream reaches the consumer, as the
    same exception object, after the items produced before it. The thread starts lazily on
    the first ``next()``, stops on ``set_state``, ``next_epoch``/``start_epoch``, ``close()``
    and when the node is garbage-collected; it is a daemon thread.
    """

    kind = "Prefetch"
    _reader_attributes = (*ReadAhead._reader_attributes, "_lock", "_producer")

    def __init__(self, upstream: Node[T], buffer_size: int = 4) -> None:
        super().__init__(upstream)
        self.buffer_size = int_option(self.kind, BUFFER_SIZE, buffer_size)
        self._exhausted = False

    def _fresh_reader(self) -> None:
        super()._fresh_reader()
        # Serialises the producer's next()/get_state() with fetch() from the consumer side.
        self._lock = threading.Lock()
        self._producer: _Producer | None = None

    def _reads_ahead(self) -> bool:
        return self._producer is not None

    # -- iteration --------------------------------------------------------------------------

    def _next(self) -> T:
        if self._exhausted:
            raise StopIteration
        producer = self._producer
        if producer is None:
            producer = self._start()
        tag, payload, mark, key = producer.get()
        self._record(mark, key)
        if tag == _ITEM:
            item: T = payload
            return item
        if tag == _END:
            self._exhausted = True
            self._drop_ahead()
            raise StopIteration
        if not isinstance(payload, Exception):
            self._shutdown()
        note = f"(raised by {self.upstream!r} in the {self.kind} thread)"
        if note not in getattr(payload, "__notes__", ()):
            payload.add_note(note)
        raise payload

    def _start(self) -> _Producer:
        self._record_live()
        producer = _Producer(self.upstream, self.buffer_size, self._lock, f"resumable-{self.kind}")
        self._producer = producer
        self._finalizer = weakref.finalize(self, producer.stop, FINALIZER_JOIN_TIMEOUT_S)
        return producer

    def _drop_ahead(self) -> bool:
        """Stop the producer thread (if any) and drop the items it had queued."""
        producer, self._producer = self._producer, None
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        if producer is None:
            return False
        producer.stop()
        return True

    def _shutdown(self) -> None:
        """Stop the producer thread; iterating on produces the dropped items again."""
        self._rewind()

    def _upstream_guard(self) -> threading.Lock:
        return self._lock

    # -- epochs, provenance, state ------------------------------------------------------------

    def _begin_epoch(self, epoch: int | None) -> None:
        super()._begin_epoch(epoch)
        self._exhausted = False

    def fetch_many(self, keys: Sequence[RecordKey]) -> list[T]:
        with self._lock:
            return self.upstream.fetch_many(keys)

    def _load(self, state: Any, path: str, progress: bool = True) -> None:
        self._exhausted = False
        super()._load(state, path, progress)
