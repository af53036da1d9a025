"""Mix: a deterministic weighted interleave of several named pipelines.

    web = rs.jsonl("web/*.jsonl").shuffle(seed=0).map(tokenize).pack(4096)
    code = rs.jsonl("code/*.jsonl").shuffle(seed=1).map(tokenize).pack(4096)
    rows = rs.mix({"web": web, "code": code}, weights={"web": 0.7, "code": 0.3}, seed=0).batch(8)

Every item of the mix is the next item of one component, chosen by a *scheduler* whose state is
a handful of counters, so a checkpoint of the mix is its counters plus every component's own
state, and a restore is exact: the restored mix hands out exactly the item that would have come
next.

Scheduling rules (``schedule=``)
--------------------------------

``"smooth"`` (default): largest credit first, the "smooth weighted round-robin" rule. After
``t`` items each component has handed out its share of ``t`` up to a bounded error at *every*
``t`` (no bursts, no drift), ties broken by a hash keyed by the seed. This is the default
because training mixtures are usually specified as proportions that every stretch of the
stream should respect.

``"random"``: independent keyed draws, a pure function of ``(seed, epoch, step, weights,
eligible set)``; use it when the interleave must look like i.i.d. sampling.

Either way the scheduler's state is plain counters (step, per-component counts and credits),
so resuming never replays anything. The arithmetic is in ``resumable.ops._schedule``.

When a component ends (``on_end=``)
-----------------------------------

* ``"stop"`` (default): the mix ends when the first chosen component is exhausted. The next mix
  epoch starts *every* component's next epoch (the others' unread rest is skipped).
* ``"drop"``: the exhausted component leaves; the others share its weight in proportion to
  theirs; the mix ends when no component with a positive weight is left.
* ``"restart"``: the exhausted component starts its next epoch (a new shuffle order, via its
  ``next_epoch()``) and the mix goes on: the mix never ends, like ``repeat()``. A component
  whose fresh epoch yields nothing is dropped instead (it would spin forever), so the mix ends
  only when every component is empty.

Weights are not part of the validated configuration: a pipeline built with other weights (or
``set_weights()``) loads a saved state and continues from the saved step with the new weights.
The component names, ``on_end``, ``schedule`` and ``seed`` are validated.

Provenance: ``last_key()`` is the key of the last item handed out with its component's name in
front (``("web", epoch, index)``), and ``fetch_many`` sends each key to its component, so a
packer (or any buffer that keeps references) may follow a mix.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping, Sequence, TypeVar, cast

from resumable.core.indexed import IndexedNode
from resumable.core.keys import RecordKey
from resumable.core.node import Node
from resumable.core.options import finite_float, seed_option
from resumable.core.state import (
    ENDED,
    check_config,
    epoch_after,
    require,
    require_adjacent_epochs,
    require_count,
    require_epoch,
    short_repr,
)
from resumable.errors import ConfigError, StateError
from resumable.ops import _schedule

T = TypeVar("T")

ON_END = ("stop", "drop", "restart")
SCHEDULES = ("smooth", "random")

# State entries.
NAMES = "names"
ON_END_KEY = "on_end"
SCHEDULE = "schedule"
SEED = "seed"
COMPONENTS = "components"
EPOCH = "epoch"
STEP = "step"
COUNTS = "counts"
CREDITS = "credits"
ACTIVE = "active"
RESTARTS = "restarts"
FRESH = "fresh"
WEIGHTS = "weights"  # informational only: never validated
LAST = "last"


def _read_item_by_item(node: Node[Any]) -> Iterator[Node[Any]]:
    """``node`` and the nodes below it that are read through their own cursor, item by item:
    all but the indexed nodes under an indexed node, which reads them by position."""
    pending = [node]
    while pending:
        current = pending.pop()
        yield current
        indexed = isinstance(current, IndexedNode)
        pending.extend(
            child for child in current._children().values() if not (indexed and isinstance(child, IndexedNode))
        )


class Mix(Node[T]):
    """Interleave named component pipelines by weight; see the module docstring for the rules.

    Args:
        components: ``{name: node}``, at least one; every node a distinct resumable node.
        weights: ``{name: weight}`` with exactly the component names, finite and >= 0, not
            all zero; None gives every component the same weight. Proportions, not counts:
            ``{"a": 3, "b": 1}`` is 75% / 25%.
        seed: non-negative int keying tie-breaks (``"smooth"``) or draws (``"random"``).
        on_end: ``"stop"``, ``"drop"`` or ``"restart"``: what an exhausted component does.
        schedule: ``"smooth"`` (largest credit first) or ``"random"`` (keyed draws).
    """

    kind = "Mix"
    _reads_upstream = False

    _last: str | None
    _cached_plan: tuple[list[str], dict[str, float]] | None
    _cached_base: int | None

    def __init__(
        self,
        components: Mapping[str, Node[Any]],
        weights: Mapping[str, float] | None = None,
        seed: int = 0,
        on_end: str = "stop",
        schedule: str = "smooth",
    ) -> None:
        super().__init__(None)
        kind = self.kind
        if not isinstance(components, Mapping):
            raise ConfigError(f"{kind}: components must be a dict {{name: node}}, got {type(components).__name__}")
        if not components:
            raise ConfigError(f"{kind}: components must not be empty")
        readers: dict[int, str] = {}  # a node read item by item -> the component reading it
        for name, node in components.items():
            if not isinstance(name, str) or not name:
                raise ConfigError(f"{kind}: component names must be non-empty strings, got {name!r}")
            if not isinstance(node, Node):
                raise ConfigError(f"{kind}[{name}]: a component must be a resumable node, got {type(node).__name__}")
            if id(node) in readers:
                raise ConfigError(f"{kind}[{name}]: the same node object is given twice; build one per component")
            for reader in _read_item_by_item(node):
                other = readers.setdefault(id(reader), name)
                if other != name:
                    raise ConfigError(
                        f"{kind}[{name}]: its {reader.kind} is also read by component {other!r}, and a node read "
                        "item by item hands each record to one reader only; build one per component (nodes read "
                        "by position, below a shuffle, shard or map of an indexed source, may be shared)"
                    )
        seed = seed_option(kind, SEED, seed)
        if on_end not in ON_END:
            raise ConfigError(f"{kind}: unknown on_end {on_end!r}, expected one of {', '.join(map(repr, ON_END))}")
        if schedule not in SCHEDULES:
            raise ConfigError(
                f"{kind}: unknown schedule {schedule!r}, expected one of {', '.join(map(repr, SCHEDULES))}"
            )
        self.components: dict[str, Node[Any]] = dict(components)
        self.names: tuple[str, ...] = tuple(self.components)
        self.seed = seed
        self.on_end = on_end
        self.schedule = schedule
        self._weights = self._checked_weights(weights)
        self._epoch = 0
        self._on_epoch_start()

    # -- weights ---------------------------------------------------------------------------------

    def _checked_weights(self, weights: Mapping[str, float] | None) -> dict[str, float]:
        kind = self.kind
        if weights is None:
            return {name: 1.0 for name in self.names}
        if not isinstance(weights, Mapping):
            raise ConfigError(f"{kind}: weights must be a dict {{name: weight}}, got {type(weights).__name__}")
        unknown = [name for name in weights if name not in self.components]
        if unknown:
            raise ConfigError(
                f"{kind}: weights for unknown components {unknown!r}; the components are {list(self.names)!r}"
            )
        missing = [name for name in self.names if name not in weights]
        if missing:
            raise ConfigError(f"{kind}: no weight for components {missing!r}")
        checked: dict[str, float] = {}
        for name in self.names:
            weight = weights[name]
            value = finite_float(weight)
            if value is None:
                raise ConfigError(f"{kind}[{name}]: weight must be a finite number, got {weight!r}")
            if value < 0:
                raise ConfigError(f"{kind}[{name}]: weight must be >= 0, got {weight!r}")
            checked[name] = value
        if not any(checked.values()):
            raise ConfigError(f"{kind}: at least one weight must be positive, got {checked!r}")
        return checked

    @property
    def weights(self) -> dict[str, float]:
        """The current weights (a copy)."""
        return dict(self._weights)

    def set_weights(self, weights: Mapping[str, float]) -> None:
        """Use ``weights`` from the next item on (same validation as the constructor). The
        credits carry over, so the new proportions take effect at once and smoothly."""
        self._weights = self._checked_weights(weights)
        self._cached_plan = None

    # -- statistics ------------------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """Mix epochs started before the current one (``next_epoch`` adds one)."""
        return self._epoch

    @property
    def step(self) -> int:
        """Items handed out in the current mix epoch."""
        return self._step

    @property
    def counts(self) -> dict[str, int]:
        """Items handed out per component in the current mix epoch."""
        return dict(self._counts)

    @property
    def proportions(self) -> dict[str, float]:
        """Realised share of each component in the current mix epoch (all 0.0 before any item)."""
        step = self._step
        return {name: (count / step if step else 0.0) for name, count in self._counts.items()}

    @property
    def active(self) -> list[str]:
        """Components not yet exhausted (``"drop"``) or not found empty (``"restart"``)."""
        return [name for name in self.names if self._active[name]]

    @property
    def eligible(self) -> list[str]:
        """Components the mix still chooses from: active, with a weight above zero."""
        return list(self._plan()[0])

    @property
    def restarts(self) -> dict[str, int]:
        """Epochs each component started inside this mix epoch (``on_end="restart"``)."""
        return dict(self._restarts)

    @property
    def last_component(self) -> str | None:
        """Name of the component behind the last item handed out (None before the first)."""
        return self._last

    # -- scheduling ------------------------------------------------------------------------------

    def _plan(self) -> tuple[list[str], dict[str, float]]:
        """The eligible components (active, weight > 0) and their shares, cached until the
        weights, the active set or the epoch change."""
        if self._cached_plan is None:
            self._cached_plan = _schedule.shares(self.names, self._weights, self._active)
        return self._cached_plan

    def _key(self, step: int) -> int:
        """splitmix64 of ``(seed, epoch, step)``."""
        if self._cached_base is None:
            self._cached_base = _schedule.epoch_key(self.seed, self._epoch)
        return _schedule.step_key(self._cached_base, step)

    def _choose(self, eligible: list[str], shares: dict[str, float]) -> str:
        """The component for the current step; a pure function of the counters and weights."""
        step = self._step
        if self.schedule == "random":
            return _schedule.draw(self._key(step), eligible, shares)
        tied = _schedule.leaders(eligible, shares, self._credits)
        return tied[0] if len(tied) == 1 else _schedule.break_tie(tied, self.names, self._key(step))

    def _drop(self, name: str) -> None:
        """Remove ``name`` from the schedule; its credit is spread over the others."""
        self._active[name] = False
        self._cached_plan = None
        credit = self._credits[name]
        self._credits[name] = 0.0
        rest = [other for other in self.names if self._active[other] and self._weights[other] > 0]
        if rest and credit:
            for other in rest:
                self._credits[other] += credit / len(rest)

    def _next(self) -> T:
        if self._ended:
            raise StopIteration
        while True:
            eligible, shares = self._plan()
            if not eligible:
                raise StopIteration
            name = self._choose(eligible, shares)
            component = self.components[name]
            try:
                item: T = next(component)
            except StopIteration:
                self._component_ended(name)
                continue
            for other in eligible:
                self._credits[other] += shares[other]
            self._credits[name] -= 1.0
            self._step += 1
            self._counts[name] += 1
            self._fresh[name] = False
            self._last = name
            return item

    def _component_ended(self, name: str) -> None:
        """React to an exhausted component; raises StopIteration when the mix ends."""
        if self.on_end == "stop":
            raise StopIteration
        if self.on_end == "restart" and not self._fresh[name]:
            self.components[name].next_epoch()
            self._restarts[name] += 1
            self._fresh[name] = True
            return
        self._drop(name)

    # -- epochs ----------------------------------------------------------------------------------

    def _begin_epoch(self, epoch: int | None) -> None:
        for component in self.components.values():
            component._begin_epoch(epoch)
        self._epoch = epoch_after(self.kind, self._epoch, epoch)
        self._ended = False
        self._on_epoch_start()

    def _on_epoch_start(self) -> None:
        self._step = 0
        self._counts = {name: 0 for name in self.names}
        self._credits = {name: 0.0 for name in self.names}
        self._active = {name: True for name in self.names}
        self._restarts = {name: 0 for name in self.names}
        self._fresh = {name: False for name in self.names}
        self._last = None
        self._cached_plan = None
        self._cached_base = None

    # -- length ----------------------------------------------------------------------------------

    def _known_length(self) -> int:
        """With ``on_end="drop"``: every component with a weight above zero is read to its end,
        and one without gives what it gave while it had one. Otherwise TypeError: a stopping
        mix ends where the schedule first picks an exhausted component, known only by running
        the schedule, and a restarting mix never ends."""
        if self.on_end == "restart":
            raise TypeError(
                f"{self.kind}: with on_end='restart' the mix never ends; use on_end='drop' for a known length"
            )
        if self.on_end == "stop":
            raise TypeError(
                f"{self.kind}: with on_end='stop' the mix ends where the schedule first picks an exhausted component, "
                "known only by running the schedule; use on_end='drop' for a known length"
            )
        return sum(
            len(self.components[name]) if weight > 0 else self._counts[name] for name, weight in self._weights.items()
        )

    # -- provenance ------------------------------------------------------------------------------

    def last_key(self) -> RecordKey | None:
        """The last item's key in its component, behind the component's name (None before the
        first item, or when that component cannot trace its items)."""
        if self._last is None:
            return None
        key = self.components[self._last].last_key()
        return None if key is None else (self._last, *key)

    def fetch_many(self, keys: Sequence[RecordKey]) -> list[T]:
        """The items with ``keys``, each fetched again by the component its key names."""
        wanted: dict[str, list[int]] = {}
        for slot, key in enumerate(keys):
            name = key[0] if isinstance(key, tuple) and len(key) > 1 else None
            if not isinstance(name, str) or name not in self.components:
                raise IndexError(f"{self.kind}: {key!r} does not name a component of this mix first")
            wanted.setdefault(name, []).append(slot)
        items: list[Any] = [None] * len(keys)
        for name, slots in wanted.items():
            fetched = self.components[name].fetch_many([tuple(keys[slot][1:]) for slot in slots])
            for slot, item in zip(slots, fetched):
                items[slot] = item
        return items

    # -- state -----------------------------------------------------------------------------------

    def _config(self) -> dict[str, Any]:
        return {NAMES: list(self.names), ON_END_KEY: self.on_end, SCHEDULE: self.schedule, SEED: self.seed}

    def _progress(self) -> dict[str, Any]:
        return {
            EPOCH: self._epoch,
            STEP: self._step,
            COUNTS: dict(self._counts),
            CREDITS: dict(self._credits),
            ACTIVE: dict(self._active),
            RESTARTS: dict(self._restarts),
            FRESH: dict(self._fresh),
            WEIGHTS: dict(self._weights),
            LAST: self._last,
        }

    def _check_config(self, state: dict[str, Any], path: str) -> None:
        saved = state.get(NAMES)
        if saved != list(self.names):
            raise StateError(
                f"{path}: state was saved for components {short_repr(saved)}, this mix has {list(self.names)!r}"
            )
        check_config(state, self._config(), path)

    def _restore(self, state: dict[str, Any], path: str) -> None:
        self._epoch = require_epoch(state, EPOCH, path)
        self._step = require_count(state, STEP, path)
        counts = self._per_name(state, COUNTS, int, path)
        if any(count < 0 for count in counts.values()) or sum(counts.values()) != self._step:
            raise StateError(f"{path}: state counts {counts!r} do not add up to step {self._step}")
        credits = {
            name: finite_float(value) for name, value in self._per_name(state, CREDITS, (int, float), path).items()
        }
        if any(value is None for value in credits.values()):
            raise StateError(f"{path}: state credits {short_repr(state[CREDITS])} are not finite")
        restarts = self._per_name(state, RESTARTS, int, path)
        if any(value < 0 for value in restarts.values()):
            raise StateError(f"{path}: state restarts {restarts!r} must be >= 0")
        last = require(state, LAST, (str, type(None)), path)
        if last is not None and last not in self.components:
            raise StateError(f"{path}: state names an unknown last component {last!r}")
        self._counts = counts
        self._credits = cast("dict[str, float]", credits)  # all finite floats (checked above)
        self._active = self._per_name(state, ACTIVE, bool, path)
        self._restarts = restarts
        self._fresh = self._per_name(state, FRESH, bool, path)
        self._last = last
        self._cached_plan = None
        self._cached_base = None

    def _per_name(self, state: dict[str, Any], key: str, types: type | tuple[type, ...], path: str) -> dict[str, Any]:
        """A ``{name: value}`` entry with exactly this mix's names and values of ``types``."""
        entry = require(state, key, dict, path)
        if sorted(entry) != sorted(self.names):
            raise StateError(f"{path}: state entry {key!r} names {sorted(entry)!r}, expected {sorted(self.names)!r}")
        values = {}
        for name in self.names:
            value = entry[name]
            bad_bool = isinstance(value, bool) and types is not bool
            if not isinstance(value, types) or bad_bool:
                raise StateError(f"{path}: state entry {key}[{name!r}] is {short_repr(value)}")
            values[name] = value
        return values

    def _children(self) -> dict[tuple[str, ...], Node[Any]]:
        return {(COMPONENTS, name): node for name, node in self.components.items()}

    def _rescale(self, olds: list[dict[str, Any]], path: str, consumer: int, num_consumers: int) -> dict[str, Any]:
        """A fresh schedule in the old consumers' mix epoch (each consumer interleaved on its own,
        so their counters do not add up); the components are rescaled one by one."""
        for old in olds:
            self._check_config(old, path)
        epochs = require_adjacent_epochs(olds, EPOCH, path)
        return {**self._header(), **self._progress(), EPOCH: min(epochs), ENDED: False}

    def __repr__(self) -> str:
        inner = ", ".join(f"{name}: {node!r}" for name, node in self.components.items())
        return f"<Mix[{inner}]>"


def mix(
    components: Mapping[str, Node[Any]],
    weights: Mapping[str, float] | None = None,
    seed: int = 0,
    on_end: str = "stop",
    schedule: str = "smooth",
) -> Mix[Any]:
    """Interleave named pipelines by weight, deterministically and resumably (see ``Mix``)."""
    return Mix(components, weights=weights, seed=seed, on_end=on_end, schedule=schedule)
