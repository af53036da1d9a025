"""Elastic resume with real process groups (gloo on loopback) and DataLoader workers:
4 x 2 -> 3 x 3 -> 1 x 1 -> 2 x 2 ranks x workers within one epoch, with shuffle, filter,
pack(best_fit) and batch. Over all phases every token of the epoch is delivered exactly once."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

import resumable as rs
from resumable.torch import Loader, PerRank, load_all_ranks
from tests.processes import free_port, run_ranks

DOCUMENTS = 160
SEQ_LEN = 16
TOKEN_BASE = 1000
# (ranks, workers, batches each rank takes; None: to the end of the epoch, how it is saved)
PHASES = [(4, 2, 3, "files"), (3, 3, 4, "dcp"), (1, 1, 5, "files"), (2, 2, None, "files")]


def documents() -> list[dict[str, Any]]:
    lengths = np.random.default_rng(5).integers(0, 3 * SEQ_LEN, size=DOCUMENTS).tolist()
    return [{"id": d, "input_ids": (d * TOKEN_BASE + np.arange(n) + 1).tolist()} for d, n in enumerate(lengths)]


def keep(document: dict[str, Any]) -> bool:
    return document["id"] % 5 != 3


def build() -> rs.Node:
    return rs.from_list(documents()).shuffle(seed=11).shard().filter(keep).pack(SEQ_LEN, buffer_size=4).batch(2)


def tokens_of(batch: list[dict[str, Any]]) -> list[int]:
    return [int(t) for row in batch for t in row["input_ids"][row["document_ids"] > 0]]


def rank_main(rank: int, world_size: int, port: int, out: str, phase: int) -> None:
    mp.set_start_method("fork", force=True)  # as under torchrun: workers fork
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        _, workers, batches, saving = PHASES[phase]
        loader = Loader(build, num_workers=workers)
        if phase > 0:
            previous = Path(out) / f"phase{phase - 1}"
            if PHASES[phase - 1][3] == "dcp":
                old_states = load_all_ranks(str(previous / "dcp"))
            else:
                old_states = [rs.load_state(path) for path in sorted(previous.glob("rank*.json"))]
            loader.load_state_dict(old_states)
        delivered: list[int] = []
        for number, batch in enumerate(loader):
            delivered += tokens_of(batch)
            if batches is not None and number + 1 == batches:
                break
        here = Path(out) / f"phase{phase}"
        if saving == "dcp":
            dcp.save({"data": PerRank(loader)}, checkpoint_id=str(here / "dcp"))
        else:
            rs.save_state(loader.state_dict(), here / f"rank{rank}.json")
        (here / f"tokens{rank}.json").write_text(json.dumps(delivered))
        loader.close()
    finally:
        dist.destroy_process_group()


def test_rescaled_three_times_within_an_epoch_delivers_every_token_once(tmp_path: Path) -> None:
    seen: Counter[int] = Counter()
    for phase, (ranks, _, _, _) in enumerate(PHASES):
        (tmp_path / f"phase{phase}").mkdir()
        run_ranks(rank_main, ranks, (ranks, free_port(), str(tmp_path), phase))
        for rank in range(ranks):
            seen.update(json.loads((tmp_path / f"phase{phase}" / f"tokens{rank}.json").read_text()))
    expected = Counter(t for d in documents() if keep(d) for t in d["input_ids"])
    assert sum(seen.values()) == sum(expected.values())
    assert seen == expected, "every token of the epoch exactly once, across four topologies"
