"""The ``Node`` base class: the iteration protocol, state assembly and the fluent methods.

A node is an iterator with ``get_state()`` / ``set_state()``. Filter, batch and repeat are plain
nodes: they pull from their upstream and keep only small counters. A node's state is its header
(kind, format version, options, identity), its progress, and its children's states nested where
``_children`` places them; the base class assembles and loads all of it, so a subclass declares
only its own options and counters. Nodes with random access derive from
``resumable.core.indexed.IndexedNode``.
"""

from __future__ import annotations

import copy
import os
import sys
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    ClassVar,
    Generic,
    Iterator,
    Literal,
    Mapping,
    Sequence,
    TypeVar,
    Union,
    overload,
)

from resumable.core.keys import RecordKey
from resumable.core.options import choice_option, flag_option, int_option
from resumable.core.state import (
    ENDED,
    KIND,
    MAX_EPOCH,
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
)
from resumable.errors import ConfigError, StateError

if TYPE_CHECKING:
    from resumable.ops.batch import Batch
    from resumable.ops.even import Even
    from resumable.ops.repeat import Repeat
    from resumable.order.shard import Shard
    from resumable.pack.node import Pack

T = TypeVar("T")
U = TypeVar("U")

VERIFY_HEADERS = os.environ.get("RESUMABLE_VERIFY_HEADERS") == "1"
"""Whether ``Node._header`` checks every header it kept against a fresh one (a development check)."""

NODE_KINDS: dict[str, type[Node[Any]]] = {}
"""Node classes by the ``kind`` they declare: one class per name."""

Mark = Union[dict[str, Any], tuple[dict[str, Any], bool, Any]]
"""What ``Node._mark`` records: the state itself, or (progress, ended, the upstream's mark)."""


class Node(Generic[T]):
    """An iterator over one epoch of items whose position can be saved and restored."""

    kind: ClassVar[str] = "Node"
    """The node's name in its states. Each node class declares it (``kind = "Batch"``) and a
    subclass inherits it, so renaming or subclassing a class keeps checkpoints loadable; a
    class that declares none and derives from no declaring class is named after itself."""
    # Whether the node reads an upstream node (all but sources and a mix, which read none or
    # their components): building one without is a ConfigError.
    _reads_upstream: ClassVar[bool] = True
    # Whether the upstream's state includes its counters. An indexed node reads its upstream
    # by random access, so only the upstream's configuration matters.
    _upstream_progress: ClassVar[bool] = True
    _upstream_only: ClassVar[bool] = True  # children and their states are the base class's
    # Options that may change on an elastic resume (a rescale), though not on a plain restore.
    _elastic_options: ClassVar[tuple[str, ...]] = ()
    # Options a restored state sets rather than checks, each with (the value of states saved
    # before it existed, the value of a new epoch): a shuffle's ``rounds``, so that a checkpoint
    # finishes its epoch in the order it began, and the next epoch takes this version's.
    _saved_options: ClassVar[Mapping[str, tuple[Any, Any]]] = {}
    # The header ``_header`` built last, with the ``_header_key()`` it was built under.
    _built_header: tuple[object, dict[str, Any]] | None = None
    # Why ``len()`` of this node is unknown, in the TypeError of the default ``_known_length``.
    _unknown_length: ClassVar[str] = "the number of items it yields is unknown until it has read them"

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
        cls._upstream_only = cls._children is Node._children and cls._child_state is Node._child_state
        if cls._state is not Node._state and cls._varies is Node._varies:
            raise TypeError(f"{cls.__qualname__}: a node that adds to _state must say in _varies when a mark cannot")

    def __init__(self, upstream: Node[Any] | None = None) -> None:
        if (upstream is not None or self._reads_upstream) and not isinstance(upstream, Node):
            raise ConfigError(
                f"{type(self).__name__}: upstream must be a resumable node, got {type(upstream).__name__}"
            )
        self.upstream = upstream
        self._ended = False
        self._hooked: dict[str, tuple[Node[Any], ...]] = {}

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
        self._begin_epoch(int_option(self.kind, "epoch", epoch, least=0, most=MAX_EPOCH))

    def _begin_epoch(self, epoch: int | None) -> None:
        """Reset this node and its upstream to the start of ``epoch`` (None: the next one)."""
        if self.upstream is not None:
            self.upstream._begin_epoch(epoch)
        self._ended = False
        self._renew_saved_options()
        self._on_epoch_start()

    def _on_epoch_start(self) -> None:
        """Hook: clear per-epoch counters and buffers."""

    # -- length -----------------------------------------------------------------------------

    def __len__(self) -> int:
        """Items of the current epoch for this consumer (the whole epoch, not what remains):
        the steps per epoch of a learning-rate schedule. TypeError, naming the node that makes
        it unknown, where it cannot be told without reading the data, or where it is past what
        ``len()`` can return (``sys.maxsize``: a ``repeat(n)`` of a huge epoch)."""
        length = self._known_length()
        if length > sys.maxsize:
            raise TypeError(f"{self.kind}: {length:,} items, past the {sys.maxsize:,} that len() can return")
        return length

    def __bool__(self) -> bool:
        """A node is always true, whatever its length (``__len__`` may raise or be 0)."""
        return True

    def _known_length(self) -> int:
        """Hook: items of this node's current epoch for this consumer; raise TypeError naming
        the node when unknown. A node whose length follows from its upstream's asks for
        ``len(self.upstream)`` (an indexed node's ``__len__`` is its own), so the TypeError of the
        node that makes the length unknown reaches the caller unchanged. Only
        TypeError: ``list(node)`` takes ``len()`` as a size hint and lets only TypeError pass."""
        raise TypeError(f"{self.kind}: {self._unknown_length}")

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

    def _subtree(self) -> Iterator[Node[Any]]:
        """This node and every node it reads from, down every branch (mix components)."""
        pending: list[Node[Any]] = [self]
        while pending:
            node = pending.pop()
            yield node
            pending.extend(node._children().values())

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
        configuration and identity; a new dict, which the caller completes.

        Built once and kept while ``_header_key()`` holds, so that a state taken with every
        batch does not build every node's options again. With ``RESUMABLE_VERIFY_HEADERS=1`` in
        the environment (the test suite sets it) every kept header is compared with a fresh one."""
        key = self._header_key()
        built = self._built_header
        if built is None or (built[0] is not key and built[0] != key):
            built = self._built_header = (key, self._fresh_header())
        elif VERIFY_HEADERS and built[1] != (fresh := self._fresh_header()):
            raise RuntimeError(
                f"{self.kind}: its kept state header {built[1]!r:.300} is stale (now {fresh!r:.300}); "
                "its _header_key() misses what changed"
            )
        return built[1].copy()

    def _fresh_header(self) -> dict[str, Any]:
        """The header built from the node as it is now (what ``_header`` keeps)."""
        return {KIND: self.kind, VERSION: STATE_VERSION, **self._config(), **self._identity()}

    def _header_key(self) -> object:
        """Hook: what ``_config()`` and ``_identity()`` depend on beyond the options fixed when
        the node was built (None: nothing): a shard's topology, a file source's fingerprints, an
        option that an elastic restore sets. ``_header`` builds the header again when it is
        another object and unequal."""
        return None

    def _progress(self) -> dict[str, Any]:
        """Counters that change during iteration."""
        return {}

    def _restore(self, state: dict[str, Any], path: str) -> None:
        """Validate and load this node's counters from ``state`` (upstream already loaded)."""

    def get_state(self) -> dict[str, Any]:
        """The position after the last item handed out, as a small JSON-serialisable dict;
        ``SourceError`` if a file read was found changed (see ``_watch``)."""
        for node in self._overriding("_watch"):
            node._watch()
        return self._state(progress=True)

    def _watch(self) -> None:
        """Hook: check that what this node reads has not changed since the run began (a file
        source checks one file per call, round robin), raising ``SourceError`` if it has.
        ``get_state`` runs it over the pipeline, so a state is never saved over changed data;
        building a state (``_state``, a mark) never raises for it, so a read-ahead's reader
        loses no record to it."""

    def _state(self, progress: bool) -> dict[str, Any]:
        """Header, then progress (unless only the configuration is asked for), then each
        child's state where ``_children`` places it."""
        state = self._header()
        if progress:
            state.update(self._progress())
            state[ENDED] = self._ended
        if self._upstream_only:  # the common case, without the general walk's cost per node
            if self.upstream is not None:
                state[UPSTREAM] = self.upstream._state(progress and self._upstream_progress)
            return state
        for where, child in self._children().items():
            put_nested(state, where, self._child_state(child, progress))
        return state

    def _child_state(self, child: Node[Any], progress: bool) -> dict[str, Any]:
        """A child's state as saved in this node's: with its progress unless this node's own
        progress determines it (``_upstream_progress``); a read-ahead node substitutes the
        state it recorded as of the last item handed out."""
        return child._state(progress=progress and self._upstream_progress)

    # -- marks: a state recorded now, built when it is asked for --------------------------------

    def _mark(self) -> Mark:
        """A cheap record of this node's position now, from which ``_marked_state`` builds the
        state that ``_state(progress=True)`` returns now, however far the node moves on
        meanwhile: what a read-ahead node keeps for every item it reads ahead, of which only a
        few become states. It holds the counters down the chain; the headers and the
        configuration-only states, which do not change while a node is read, are built from
        the live nodes when the state is asked for. Where they may change (``_varies``) and
        for nodes that nest children their own way, the mark is the state itself."""
        for node in self._overriding("_varies"):
            if node._varies():
                return self._state(progress=True)
        return self._counters()

    def _counters(self) -> Mark:
        """The mark below ``_mark``'s check: this node's progress and its upstream's, down the
        chain (the state itself from a node that nests children its own way)."""
        if not self._upstream_only:
            return self._state(progress=True)
        upstream = self.upstream
        below = upstream._counters() if upstream is not None and self._upstream_progress else None
        return (self._progress(), self._ended, below)

    def _marked_state(self, mark: Mark) -> dict[str, Any]:
        """The state ``mark`` recorded (see ``_mark``), with the headers of the live nodes."""
        if isinstance(mark, dict):
            return self._with_live_headers(mark)
        progress, ended, below = mark
        state = self._header()
        state.update(progress)
        # the live header wins over a progress entry that repeats it (from_list's length, which
        # grows with its list); _header() above has just kept it
        state.update(self._built_header[1])  # type: ignore[index]
        state[ENDED] = ended
        upstream = self.upstream
        if upstream is not None:
            state[UPSTREAM] = (
                upstream._marked_state(below) if self._upstream_progress else upstream._state(progress=False)
            )
        return state

    def _with_live_headers(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state``, built by this node earlier, with every node's header as it is now: a mark
        held as a whole state keeps its progress, but a file's new mtime, a list that grew or a
        topology set since (a fork into a Loader worker) are the live nodes'. A new dict; the
        nested states it changes are copied, not edited."""
        state = {**state, **self._header()}
        for where, child in self._children().items():
            outer = state
            for key in where[:-1]:
                outer[key] = dict(outer[key])
                outer = outer[key]
            outer[where[-1]] = child._with_live_headers(outer[where[-1]])
        return state

    def _varies(self) -> bool:
        """Hook: whether this node's state apart from its progress may change as it is read (a
        shard holding a remap, compacted as its cursor moves), so a mark cannot defer it."""
        return False

    def _overriding(self, hook: str) -> tuple[Node[Any], ...]:
        """The nodes of this node's subtree whose class overrides the method ``hook``. Those
        below it are found once per hook (a pipeline's structure is fixed when it is built);
        the node itself is not kept among them, so that no node holds a reference to itself
        and a dropped pipeline is freed (its threads stopped) at once, not by the collector."""
        base = getattr(Node, hook)
        below = self._hooked.get(hook)
        if below is None:
            nodes = self._subtree()
            next(nodes)  # this node
            below = self._hooked[hook] = tuple(node for node in nodes if getattr(type(node), hook) is not base)
        return (self, *below) if getattr(type(self), hook) is not base else below

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
        """Reject a state saved with other options or over other data; take the options the
        state sets (``_saved_options``)."""
        self._take_saved_options([state], path)
        check_config(state, self._checked_config(), path)
        self._check_identity(state, path)

    def _checked_config(self) -> dict[str, Any]:
        """``_config()`` but the options a state sets (``_saved_options``)."""
        config = self._config()
        if self._saved_options:
            config = {key: value for key, value in config.items() if key not in self._saved_options}
        return config

    def _take_saved_options(self, states: Sequence[Mapping[str, Any]], path: str) -> None:
        """Set each of ``_saved_options`` to its value in ``states`` (or the value of states
        saved before it existed), which must agree: old consumers of one checkpoint."""
        for key, (before, _) in self._saved_options.items():
            values = {repr(state.get(key, before)): state.get(key, before) for state in states}
            if len(values) > 1:
                raise StateError(
                    f"{path}: old consumers' states hold different {key} ({', '.join(sorted(values))}); "
                    "they come from different checkpoints"
                )
            for value in values.values():
                self._set_saved_option(key, value, path)

    def _renew_saved_options(self) -> None:
        """A new epoch (not a restored one) takes each of ``_saved_options`` at its new value."""
        for key, (_, new) in self._saved_options.items():
            self._set_saved_option(key, new, self.kind)

    def _set_saved_option(self, key: str, value: Any, path: str) -> None:
        """Set option ``key`` (one of ``_saved_options``) to a saved ``value``; StateError if invalid."""
        raise NotImplementedError

    def _fresh_rescaled(self, olds: list[dict[str, Any]], path: str) -> dict[str, Any]:
        """This node's own state entries (no upstream) on a new consumer, for a node that holds
        nothing per consumer (``resumable.core.protocols.Rescalable`` nodes do): the same options (but
        ``_elastic_options``; ``_saved_options`` the rescale took from the old states before), the
        same data, counters of a fresh epoch."""
        config = {key: value for key, value in self._checked_config().items() if key not in self._elastic_options}
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

    @overload
    def map(
        self, fn: Callable[[T], U], num_workers: int = 0, mode: str = "thread", *, batched: Literal[False] = False
    ) -> Node[U]: ...

    @overload
    def map(
        self,
        fn: Callable[[list[T]], Sequence[U]],
        num_workers: int = 0,
        mode: str = "thread",
        *,
        batched: Literal[True],
    ) -> Node[U]: ...

    def map(
        self, fn: Callable[..., Any], num_workers: int = 0, mode: str = "thread", *, batched: bool = False
    ) -> Node[Any]:
        """Apply ``fn`` to every item; with ``num_workers``, in a pool of threads or processes
        (``mode``), keeping the order. With ``batched``, ``fn`` takes a list of items and returns
        one result per item, in order (a tokenizer's ``encode_batch``, which in Rust runs
        without the GIL, so a thread pool tokenises in parallel); it needs a pool."""
        from resumable.ops.parallel_map import MODES, ParallelMap

        pool = ParallelMap.kind  # the options of a map in a pool, checked without workers too (a typo)
        num_workers = int_option(pool, "num_workers", num_workers, least=0, optional=True) or 0
        choice_option(pool, "mode", mode, MODES)
        if flag_option(pool, "batched", batched) and not num_workers:
            raise ConfigError(
                f"{self.kind}: map(batched=True) maps chunks of items in a pool: give num_workers >= 1 "
                "(one thread is enough for a function that releases the GIL, such as encode_batch)"
            )
        if num_workers:
            return ParallelMap(self, fn, num_workers=num_workers, mode=mode, batched=batched)
        return self._serial_map(fn)

    def _serial_map(self, fn: Callable[[T], U]) -> Node[U]:
        """The node ``map(fn)`` builds without a pool."""
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
        """Keep the items for which ``predicate`` is true, as they stream past. With ``index``,
        scan a random-access upstream once and keep random access (see ``IndexedNode.filter``;
        ``batched`` predicates too)."""
        if flag_option(self.kind, "index", index):
            raise self._not_indexed("filter(index=True)")
        if flag_option(self.kind, "batched", batched):
            raise ConfigError(f"{self.kind}: filter(batched=True) needs index=True")
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

    def even(self, times: int | None = None, group: Any = None) -> Even:
        """Run epochs back to back with the same number of items on every rank in each (agreed
        once per epoch through ``torch.distributed``), the surplus carried over; place it last."""
        from resumable.ops.even import Even

        return Even(self, times, group)

    def shuffle(self, seed: int = 0, block_size: int | str | None = None, window: int | None = None) -> Node[T]:
        """Global shuffle; needs random access (place it before filter, batch or pack)."""
        raise self._not_indexed("shuffle()")

    def shard(self, rank: int | None = None, world_size: int | None = None, split_workers: bool = True) -> Shard[T]:
        """Partition across ranks; needs random access (place it before filter, batch or pack)."""
        raise self._not_indexed("shard()")

    def _not_indexed(self, method: str) -> ConfigError:
        """The error for ``method``, which needs random access, called on this streaming node."""
        return ConfigError(
            f"{self.kind}: {method} needs random access, which {self.kind} does not give (it streams, as filter, "
            "batch, pack, repeat, mix, prefetch and a parallel map do); place it before filter, batch and pack, "
            f"and before {self.kind}"
        )

    def __copy__(self) -> Node[T]:
        """A copy that reads on from where this node stands, by itself. A node read item by item
        moves its upstream, so a copy sharing its nodes would split the records with the original
        (and a read-ahead's two readers would run on one upstream): the copy is whole, as
        ``copy.deepcopy`` or a pickled copy is. An indexed node's copy shares its upstream,
        which it reads by position (``IndexedNode.__copy__``)."""
        return copy.deepcopy(self)

    def __repr__(self) -> str:
        chain = []
        node: Node[Any] | None = self
        while node is not None:
            chain.append(node.kind)
            node = node.upstream
        return f"<{' < '.join(chain)}>"
