"""Simulated consumers: what a pipeline resolves inside a DataLoader worker of some rank."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator
from unittest import mock

from resumable.order import topology as topology_module
from resumable.order.topology import Topology


@contextmanager
def simulated_consumer(topology: Topology) -> Iterator[None]:
    """Within the block, shards and streams first used resolve ``topology`` from the
    environment, as they would in worker ``topology.worker`` of rank ``topology.rank``."""
    with (
        mock.patch.object(topology_module, "distributed_rank", return_value=(topology.rank, topology.world_size)),
        mock.patch.object(topology_module, "dataloader_worker", return_value=(topology.worker, topology.num_workers)),
    ):
        yield
