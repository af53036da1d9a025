"""Shard: partition arithmetic, topology discovery, DataLoader workers, real process groups."""

from __future__ import annotations

import numpy as np
import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import given
from hypothesis import strategies as st
from torch.utils.data import DataLoader, IterableDataset

import resumable as rs
from resumable.order.partition import shard_size, shard_to_global
from tests.processes import free_port
from tests.resume import check_resume


@given(total=st.integers(0, 500), consumers=st.integers(1, 40))
def test_shards_partition_the_positions_and_differ_by_at_most_one(total: int, consumers: int) -> None:
    owned = []
    sizes = [shard_size(total, c, consumers) for c in range(consumers)]
    for c, size in enumerate(sizes):
        owned.extend(shard_to_global(np.arange(size), c, consumers).tolist())
    assert sorted(owned) == list(range(total))
    assert max(sizes) - min(sizes) <= 1


def test_shard_of_a_shuffle_covers_each_record_once() -> None:
    shards = [list(rs.from_list(list(range(103))).shuffle(4).shard(r, 4)) for r in range(4)]
    assert sorted(x for shard in shards for x in shard) == list(range(103))
    assert [len(s) for s in shards] == [26, 26, 26, 25]


def test_shard_resumes() -> None:
    def build() -> rs.Node:
        return rs.from_list(list(range(50))).shuffle(2).shard(2, 3)

    for k in (0, 1, 8, 16, 17, 30, 34):
        check_resume(build, k, 34)


def test_topology_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    pipe = rs.from_list(list(range(9))).shard()
    assert pipe.topology == rs.Topology(rank=2, world_size=3)
    assert list(pipe) == [2, 5, 8]


def test_topology_defaults_to_a_single_consumer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert rs.from_list([1, 2]).shard().topology == rs.Topology(rank=0, world_size=1)


def test_bad_environment_and_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "4")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(rs.ConfigError, match="rank=4, world_size=4"):
        len(rs.from_list([1]).shard())
    with pytest.raises(rs.ConfigError, match="need 0 <= rank < world_size"):
        rs.from_list([1]).shard(3, 2)
    with pytest.raises(rs.ConfigError, match="give both rank and world_size"):
        rs.from_list([1]).shard(rank=0)


def test_state_from_another_topology_is_rejected() -> None:
    pipe = rs.from_list(list(range(10))).shard(0, 2)
    next(iter(pipe))
    with pytest.raises(rs.StateError, match="world_size=2, this pipeline has world_size=4"):
        rs.from_list(list(range(10))).shard(0, 4).set_state(pipe.get_state())


class Pipeline(IterableDataset):
    """Builds the pipeline in each worker's copy; the shard resolves its worker there."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.pipe = rs.from_list(list(range(61))).shuffle(8).shard(rank, world_size)

    def __iter__(self):
        return iter(self.pipe)


@pytest.mark.parametrize("num_workers", [0, 2, 3])
def test_dataloader_workers_split_each_rank_further(num_workers: int) -> None:
    seen = []
    for rank in range(2):
        loader = DataLoader(Pipeline(rank, 2), batch_size=None, num_workers=num_workers)
        seen.extend(int(x) for x in loader)
    assert sorted(seen) == list(range(61))


def _rank_main(rank: int, world_size: int, port: int, out: "mp.Queue") -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        pipe = rs.from_list(list(range(50))).shuffle(3).shard()
        out.put((rank, pipe.topology.rank, pipe.topology.world_size, list(pipe)))
    finally:
        dist.destroy_process_group()


def test_topology_from_torch_distributed() -> None:
    world_size = 2
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world_size, port, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    results = sorted(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert [(r, rank, ws) for r, rank, ws, _ in results] == [(0, 0, 2), (1, 1, 2)]
    assert sorted(x for *_, items in results for x in items) == list(range(50))


def test_a_second_shard_is_refused_at_construction() -> None:
    with pytest.raises(rs.ConfigError, match=r"keep one \.shard\(\)"):
        rs.from_list(list(range(8))).shard(0, 2).map(str).shuffle(1).shard(0, 2)
