"""Who is reading: rank and world size from torch.distributed or the environment, plus the
DataLoader worker. Consumers are numbered ``rank * num_workers + worker``."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from resumable.core.options import flag_option, int64_option, is_int
from resumable.errors import ConfigError

# State keys of a node that splits the epoch over consumers (shard, file-sharded stream).
RANK = "rank"
WORLD_SIZE = "world_size"
WORKER = "worker"
NUM_WORKERS = "num_workers"
TOPOLOGY_KEYS = (RANK, WORLD_SIZE, WORKER, NUM_WORKERS)


@dataclass(frozen=True)
class Topology:
    """One consumer's place among ``world_size * num_workers`` consumers."""

    rank: int
    world_size: int
    worker: int = 0
    num_workers: int = 1

    @property
    def consumer(self) -> int:
        return self.rank * self.num_workers + self.worker

    @property
    def num_consumers(self) -> int:
        return self.world_size * self.num_workers

    def config(self) -> dict[str, int]:
        """The topology as state entries (``TOPOLOGY_KEYS``)."""
        return {RANK: self.rank, WORLD_SIZE: self.world_size, WORKER: self.worker, NUM_WORKERS: self.num_workers}


# The rank of the process that started this DataLoader worker: torch.distributed is not
# initialised inside workers, so the parent's rank is handed down (see inherit_rank).
_inherited_rank: tuple[int, int] | None = None


def inherit_rank(rank: int, world_size: int) -> None:
    """Record, in a DataLoader worker, the rank of the process that started it."""
    global _inherited_rank
    check_rank(rank, world_size, "inherited rank")
    _inherited_rank = (rank, world_size)


def distributed_rank() -> tuple[int, int]:
    """``(rank, world_size)`` from an initialised torch.distributed, else the rank a DataLoader
    worker inherited from its parent, else RANK/WORLD_SIZE, else (0, 1).

    torch is only consulted if already imported: if it is not, neither a process group nor a
    DataLoader worker can exist, and importing it would cost a second at start-up.
    """
    torch = sys.modules.get("torch")
    if torch is not None:
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    if _inherited_rank is not None:
        return _inherited_rank
    rank_text, world_text = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    if rank_text is None and world_text is None:
        return 0, 1
    try:
        rank, world_size = int(rank_text or "0"), int(world_text or "1")
    except ValueError as exc:
        raise ConfigError(f"RANK={rank_text!r} and WORLD_SIZE={world_text!r} must be integers") from exc
    check_rank(rank, world_size, "environment RANK/WORLD_SIZE")
    return rank, world_size


# True while a forked process returns its parent's read-ahead nodes to the last item they
# handed out (see as_in_parent).
_as_in_parent = False


@contextlib.contextmanager
def as_in_parent() -> Iterator[None]:
    """Within it, consumers resolve as they last did in the parent process and are not resolved
    for this one: a forked process loads the states its parent's read-ahead nodes recorded
    before it knows which DataLoader worker it is (torch names it only after the fork)."""
    global _as_in_parent
    _as_in_parent = True
    try:
        yield
    finally:
        _as_in_parent = False


def dataloader_worker() -> tuple[int, int]:
    """``(worker_id, num_workers)`` inside a torch DataLoader worker, else (0, 1)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return 0, 1
    info = torch.utils.data.get_worker_info()
    if info is None:
        return 0, 1
    return info.id, info.num_workers


def check_rank(rank: Any, world_size: Any, where: str) -> tuple[int, int]:
    """``(rank, world_size)`` as ints, or a ConfigError unless ``0 <= rank < world_size``, with
    a world size that positions in int64 can count (the shard arithmetic is numpy's)."""
    for name, value in (("rank", rank), ("world_size", world_size)):
        if not is_int(value):
            raise ConfigError(f"{where}: {name} must be an int, got {value!r}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ConfigError(f"{where}: need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    return int(rank), int64_option(where, "world_size", world_size)


class Consumer:
    """Which consumer this process is, for a node that splits the epoch (a shard, a file-sharded
    stream): explicit ``rank``/``world_size`` or else ``distributed_rank()``, split further by
    DataLoader worker unless ``split_workers`` is False. Resolved at first use and again after a
    fork, so a pipeline built before its DataLoader workers start still splits correctly; or
    pinned to another consumer's topology (``pin``), to replay or plan that consumer's reading
    in this process (an elastic rescale)."""

    def __init__(self, rank: int | None, world_size: int | None, split_workers: bool, where: str) -> None:
        self._explicit: tuple[int, int] | None = None  # (rank, world_size) when given
        if rank is not None and world_size is not None:
            self._explicit = check_rank(rank, world_size, where)
        elif rank is not None or world_size is not None:
            raise ConfigError(f"{where}: give both rank and world_size, or neither")
        self.split_workers = flag_option(where, "split_workers", split_workers)
        self._resolved: tuple[int, Topology] | None = None
        self._pinned: Topology | None = None

    def pin(self, topology: Topology) -> None:
        """Read as ``topology``'s consumer from now on, in this process and any other (as its
        rank only, without ``split_workers``)."""
        self._pinned = topology if self.split_workers else Topology(topology.rank, topology.world_size)

    def resolve(self) -> tuple[Topology, bool]:
        """This process's topology, and whether it is new: resolved for the first time, other
        than the parent process's (a DataLoader worker), or pinned to another since."""
        pid = os.getpid()
        if self._pinned is not None:
            fresh = self._resolved is None or self._resolved[1] != self._pinned
            self._resolved = (pid, self._pinned)
            return self._pinned, fresh
        if self._resolved is not None and (self._resolved[0] == pid or _as_in_parent):
            return self._resolved[1], False
        rank, world_size = distributed_rank() if self._explicit is None else self._explicit
        worker, num_workers = dataloader_worker() if self.split_workers else (0, 1)
        topology = Topology(rank, world_size, worker, num_workers)
        if _as_in_parent:  # never resolved in the parent: as it would have, and kept for no one
            return topology, False
        previous, self._resolved = self._resolved, (pid, topology)
        return topology, previous is None or previous[1] != topology
