"""Real process groups (gloo on loopback): every rank with DataLoader workers, checkpoints
per rank (plain files and torch.distributed.checkpoint), a new group restores exactly."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch.distributed.checkpoint as dcp

import resumable as rs
from resumable.torch import Loader, PerRank
from tests.processes import free_port, process_group, run_ranks, train

DOCUMENTS = 211
EPOCHS = 2


def build() -> rs.Node:
    return (
        rs.from_list(list(range(DOCUMENTS)))
        .shuffle(seed=3)
        .shard()
        .map(lambda x: x * 10)
        .filter(lambda x: x % 7 != 0)
        .batch(5, collate_fn=np.array)
    )


def rank_main(rank: int, world_size: int, port: int, phase: str, out: str, num_workers: int, stop_after: int) -> None:
    with process_group(rank, world_size, port):
        result: dict[str, Any] = {}
        if phase == "first":
            result["full"] = train(Loader(build, num_workers=num_workers), EPOCHS)
            loader = Loader(build, num_workers=num_workers)
            result["head"] = train(loader, EPOCHS, stop_after=stop_after)
            rs.save_state(loader.state_dict(), Path(out) / f"rank{rank}.json")
            dcp.save({"data": PerRank(loader)}, checkpoint_id=str(Path(out) / "dcp"))
        else:
            from_file = Loader(build, num_workers=num_workers)
            from_file.load_state_dict(rs.load_state(Path(out) / f"rank{rank}.json"))
            result["tail_file"] = train(from_file, EPOCHS, resumed=True)
            from_dcp = Loader(build, num_workers=num_workers)
            dcp.load({"data": PerRank(from_dcp)}, checkpoint_id=str(Path(out) / "dcp"))
            result["tail_dcp"] = train(from_dcp, EPOCHS, resumed=True)
        (Path(out) / f"{phase}{rank}.json").write_text(json.dumps(result))


def run_group(world_size: int, phase: str, out: Path, num_workers: int, stop_after: int) -> list[dict[str, Any]]:
    """Start a fresh process group; every process exits before this returns."""
    run_ranks(rank_main, world_size, (world_size, free_port(), phase, str(out), num_workers, stop_after))
    return [json.loads((out / f"{phase}{r}.json").read_text()) for r in range(world_size)]


@pytest.mark.parametrize(("world_size", "num_workers", "stop_after"), [(2, 2, 13), (4, 2, 7)])
def test_ranks_with_workers_resume_exactly_in_a_new_group(
    tmp_path: Path, world_size: int, num_workers: int, stop_after: int
) -> None:
    first = run_group(world_size, "first", tmp_path, num_workers, stop_after)
    second = run_group(world_size, "second", tmp_path, num_workers, stop_after)
    expected_epoch = sorted(x * 10 for x in range(DOCUMENTS) if x * 10 % 7)
    for epoch in range(EPOCHS):
        union = sorted(x for rank in first for e, batch in rank["full"] if e == epoch for x in batch)
        assert union == expected_epoch, f"epoch {epoch}: every document exactly once over all ranks"
    for rank in range(world_size):
        full, head = first[rank]["full"], first[rank]["head"]
        assert len(head) == stop_after
        assert head + second[rank]["tail_file"] == full, f"rank {rank}, plain state file"
        assert head + second[rank]["tail_dcp"] == full, f"rank {rank}, torch.distributed.checkpoint"
