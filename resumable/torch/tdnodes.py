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
    ``start_epoch(e)`` works only where it is exact: ``e`` is the next pass (same as
    ``next_epoch()``), or the current one while nothing of it has been handed out (nothing
    to do). Any other ``e`` raises ``ConfigError`` rather than silently replaying another pass.
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

    @property
    def epoch(self) -> int:
        """Passes begun before the current one (0 in the first)."""
        return self._epoch

    @property
    def _name(self) -> str:
        return f"{self.kind}({type(self.base_node).__name__})"

    def _next(self) -> T:
        item: T = next(self.base_node)
        self._yielded += 1
        return item

    def _begin_epoch(self, epoch: int | None) -> None:
        if epoch is None or epoch == self._epoch + 1:
            self.base_node.reset()
            self._epoch += 1
        elif epoch != self._epoch or self._yielded:
            raise ConfigError(
                f"{self._name}: cannot start epoch {epoch}; a torchdata node has no epoch number and can "
                f"only begin its next pass (epoch {self._epoch + 1})"
            )
        self._yielded = 0
        super()._begin_epoch(epoch)

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
        self._epoch, self._yielded = epoch, yielded


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
