"""Adapters between resumable nodes and ``torchdata.nodes``, both ways.

* ``ToTorchdata(pipe)``: a resumable pipeline as a ``torchdata.nodes.BaseNode``, so it can
  feed a torchdata graph and be driven (and checkpointed) by ``torchdata.nodes.Loader``.
* ``FromTorchdata(base_node)``: any ``BaseNode`` as a resumable iterator node, so
  ``.map/.filter/.batch/.repeat/.pack`` can follow it inside a resumable pipeline.

torchdata's protocol: ``reset(None)`` begins a pass, ``reset(state)`` restores one,
``get_state()`` describes the position after the last item handed out. ``Loader`` calls
``root.reset()`` at every ``iter()``, i.e. at the start of each epoch.
"""

from __future__ import annotations

from typing import Any, Optional, TypeVar

from torchdata.nodes import BaseNode

from resumable.core.node import Node
from resumable.core.state import JSON_SCALARS, KIND, STATE_VERSION, VERSION, check_header, require, require_count
from resumable.errors import ConfigError, StateError

T = TypeVar("T")

# ToTorchdata's state: {"kind", "version", "started", "resumable": <the pipeline's state>}
TO_TORCHDATA = "ToTorchdata"
STARTED = "started"
RESUMABLE = "resumable"

# FromTorchdata's state adds to the node header: the torchdata node's class (an option, so a
# state from another graph is rejected), the pass counter, the items handed out in this pass
# and the torchdata node's own state.
NODE_TYPE = "node_type"
EPOCH = "epoch"
YIELDED = "yielded"
TORCHDATA = "torchdata"


class ToTorchdata(BaseNode[T]):  # type: ignore[misc]  # torchdata is untyped (Any)
    """A resumable pipeline as a ``torchdata.nodes.BaseNode``.

    * ``reset(None)`` on first use keeps the pipeline where it is (fresh, or restored with
      ``set_state`` before wrapping; an ended epoch moves on to the next one). Once items have
      been handed out, ``reset(None)`` starts the pipeline's next epoch: a full new pass in a
      new shuffle order, which is what ``Loader`` asks for at every ``iter()``.
    * ``reset(state)`` restores the pipeline exactly (``rs.StateError`` if it does not fit).
    * ``get_state()`` is ``{"kind", "version", "started", "resumable": pipeline.get_state()}``,
      JSON types only, so a ``Loader`` state over it survives ``json.dumps``.
    """

    def __init__(self, node: Node[T]) -> None:
        if not isinstance(node, Node):
            raise ConfigError(f"{TO_TORCHDATA}: expected a resumable node, got {type(node).__name__}")
        super().__init__()
        self.node = node
        # Whether an item was handed out since the last reset: SamplerWrapper's convention,
        # so a reset that follows another reset (or the first one) never skips an epoch.
        self._started = False

    def reset(self, initial_state: Optional[dict[str, Any]] = None) -> None:
        if initial_state is not None:
            self._restore(initial_state)
        elif self._started:
            self.node.next_epoch()
            self._started = False
        else:
            iter(self.node)  # starts the next epoch only if the current one has ended
        super().reset(initial_state)  # marks the node initialised, only once the reset succeeded

    def _restore(self, state: Any) -> None:
        check_header(state, TO_TORCHDATA, TO_TORCHDATA)
        started = require(state, STARTED, bool, TO_TORCHDATA)
        pipeline_state = require(state, RESUMABLE, dict, TO_TORCHDATA)
        try:
            self.node.set_state(pipeline_state)  # leaves the pipeline as it was on error
        except StateError as error:
            raise StateError(f"{TO_TORCHDATA} > {error}") from error
        self._started = started

    def next(self) -> T:
        item = next(self.node)
        self._started = True
        return item

    def close(self) -> None:
        """Stop the threads and pools of the pipeline it wraps (``Node.close``)."""
        self.node.close()

    def get_state(self) -> dict[str, Any]:
        return {KIND: TO_TORCHDATA, VERSION: STATE_VERSION, STARTED: self._started, RESUMABLE: self.node.get_state()}


class FromTorchdata(Node[T]):
    """A ``torchdata.nodes.BaseNode`` as a resumable iterator node.

    Not indexed: ``.shuffle()`` and ``.shard()`` must come before it (in torchdata) and
    ``last_key()`` is None. The state nests the torchdata node's ``state_dict()`` under
    ``"torchdata"``; ``set_state`` passes it back through ``base_node.reset(state)``.

    Epochs: torchdata nodes have no epoch number; ``reset()`` begins "a new pass", whose
    content (the same order, the sampler's next epoch) is up to the torchdata node. So
    ``next_epoch()`` resets the torchdata node and counts passes in ``epoch``, and
    ``start_epoch(e)`` works only where it is exact: ``e`` is the next pass of a node that has
    begun one (same as ``next_epoch()``), or the current one while nothing of it has been handed
    out (nothing to do). Any other ``e`` raises ``ConfigError`` rather than silently replaying
    another pass. A node that never began a pass (built fresh) can only begin its first, or
    continue a state restored before its first item: a later epoch asked of it waits for such a
    restore, and without one is a ``ConfigError`` at its first item.

    ``close()`` reaches the resumable pipelines inside the torchdata graph (``ToTorchdata``
    nodes found through the graph's attributes) and stops their threads and pools.
    """

    kind = "FromTorchdata"
    _reads_upstream = False

    def __init__(self, base_node: BaseNode[T]) -> None:
        if not isinstance(base_node, BaseNode):
            raise ConfigError(f"FromTorchdata: expected a torchdata.nodes.BaseNode, got {type(base_node).__name__}")
        super().__init__()
        self.base_node = base_node
        self._epoch = 0
        self._yielded = 0
        self._begun = False  # whether the torchdata node began a pass (read, reset or restored)
        self._unreachable: ConfigError | None = None  # a later epoch asked of a fresh node
        self._restored_unread = False  # restored, and nothing asked of the torchdata node since

    @property
    def epoch(self) -> int:
        """Passes begun before the current one (0 in the first)."""
        return self._epoch

    @property
    def _name(self) -> str:
        return f"{self.kind}({type(self.base_node).__name__})"

    def _next(self) -> T:
        if self._unreachable is not None:
            raise self._unreachable
        self._begun, self._restored_unread = True, False
        item: T = next(self.base_node)
        self._yielded += 1
        return item

    def _begin_epoch(self, epoch: int | None) -> None:
        target = self._epoch + 1 if epoch is None else epoch
        self._unreachable = None
        if target == self._epoch + 1 and self._begun:
            if self._restored_unread:
                self._touch_the_restored_pass()
            self.base_node.reset()
            self._epoch += 1
        elif not self._begun and target != self._epoch:
            # refused at its first item, unless a state restored first says where the node is (a
            # DataLoader worker starts the Loader's epoch, then restores the pass it continues)
            self._unreachable = self._cannot_start(target, "its first pass (epoch 0), or continue a saved state")
        elif target != self._epoch or self._yielded:
            raise self._cannot_start(target, f"its next pass (epoch {self._epoch + 1})")
        self._yielded = 0
        super()._begin_epoch(epoch)

    def _touch_the_restored_pass(self) -> None:
        """Ask a torchdata node restored in a pass it now leaves for one more item (dropped, or
        the end of the pass), as a live node was: some count a restored pass as not begun
        (SamplerWrapper's ``reset(state)`` clears its flag), so their next ``reset()`` would
        repeat that pass's epoch."""
        self._restored_unread = False
        next(self.base_node, None)

    def _cannot_start(self, epoch: int, begins: str) -> ConfigError:
        return ConfigError(
            f"{self._name}: cannot start epoch {epoch}; a torchdata node has no epoch number and can only begin "
            f"{begins} (with rs.torch.Loader, keep its workers: persistent_workers=True)"
        )

    def _shutdown(self) -> None:
        for node in _resumable_nodes_in(self.base_node):
            node.close()

    def _config(self) -> dict[str, Any]:
        return {NODE_TYPE: type(self.base_node).__name__}

    def _progress(self) -> dict[str, Any]:
        state = self.base_node.state_dict()
        if not isinstance(state, dict):
            raise StateError(f"{self._name}: the torchdata node's state is a {type(state).__name__}, not a dict")
        return {EPOCH: self._epoch, YIELDED: self._yielded, TORCHDATA: _json_copy(state, self._name, "")}

    def _restore(self, state: dict[str, Any], path: str) -> None:
        epoch = require_count(state, EPOCH, path)
        yielded = require_count(state, YIELDED, path)
        saved = require(state, TORCHDATA, dict, path)
        try:
            # A copy: torchdata nodes may keep the dict they are given as their own state.
            self.base_node.reset(_json_copy(saved, path, ""))
        except Exception as error:  # noqa: BLE001 - torchdata nodes raise KeyError, ValueError, ...
            raise StateError(
                f"{path}: the torchdata node {type(self.base_node).__name__} rejected its saved state: {error!r}"
            ) from error
        self._epoch, self._yielded, self._begun, self._unreachable = epoch, yielded, True, None
        self._restored_unread = True


def _resumable_nodes_in(graph: BaseNode[Any]) -> list[ToTorchdata[Any]]:
    """The ``ToTorchdata`` nodes of a torchdata graph, found through its nodes' attributes
    (torchdata nodes hold their sources as attributes, or in lists, tuples and dicts of them)."""
    found: list[ToTorchdata[Any]] = []
    seen: set[int] = set()
    pending: list[Any] = [graph]
    while pending:
        value = pending.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        if isinstance(value, ToTorchdata):
            found.append(value)
        elif isinstance(value, BaseNode):
            pending.extend(vars(value).values())
        elif isinstance(value, (list, tuple)):
            pending.extend(value)
        elif isinstance(value, dict):
            pending.extend(value.values())
    return found


def _json_copy(value: Any, name: str, where: str) -> Any:
    """A deep copy of ``value`` (so the state taken stays a value while the torchdata node runs
    on), raising StateError naming the node and the entry unless it holds only JSON types."""
    if isinstance(value, dict):
        copy = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise StateError(f"{name}: torchdata state key {key!r} at {where or 'top level'} is not a string")
            copy[key] = _json_copy(item, name, f"{where}[{key!r}]")
        return copy
    if isinstance(value, list):
        return [_json_copy(item, name, f"{where}[{index}]") for index, item in enumerate(value)]
    if isinstance(value, JSON_SCALARS):
        return value
    raise StateError(
        f"{name}: torchdata state holds a {type(value).__name__} at {where or 'top level'}; only JSON types "
        "(dict, list, str, int, float, bool, None) can be saved"
    )
