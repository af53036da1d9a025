"""Per-rank states inside ``torch.distributed.checkpoint``.

DCP stores one value per key across all ranks for non-tensor data, but every rank's data
position differs. ``PerRank`` keys the state by rank so each rank saves and loads its own.
The state travels as one JSON string: DCP loads into the structure of the current
``state_dict()``, and a fresh loader's nested structure need not match a saved one's.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

from resumable.errors import StateError
from resumable.order.topology import distributed_rank


class SupportsState(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


def rank_key(rank: int) -> str:
    return f"rank_{rank}"


class PerRank:
    """Wrap a pipeline or loader for ``dcp.save({"data": PerRank(loader)}, ...)``."""

    def __init__(self, stateful: SupportsState) -> None:
        self.stateful = stateful

    def state_dict(self) -> dict[str, str]:
        rank, _ = distributed_rank()
        return {rank_key(rank): json.dumps(self.stateful.state_dict())}

    def load_state_dict(self, state_dict: dict[str, str]) -> None:
        rank, world_size = distributed_rank()
        key = rank_key(rank)
        if not isinstance(state_dict.get(key), str):
            raise StateError(f"PerRank: the checkpoint has no state for rank {rank} of {world_size}")
        self.stateful.load_state_dict(json.loads(state_dict[key]))
