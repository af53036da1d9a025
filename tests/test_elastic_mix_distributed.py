"""Elastic resume of mix -> pack with real process groups (gloo on loopback): 2 ranks mix two
sharded components and pack the documents (best_fit over a buffer), save, and 3 ranks resume
with ``resumable.elastic.restore``, then 1 rank finishes the epoch. Each rank's ``.shard()``
resolves its rank from the process group. Over all phases every token of every document of
both components is delivered exactly once.

The ranks are forked, not spawned: a spawned rank imports torch again (seconds per rank on two
cores), a forked one starts at once. Each rank only reads lists, packs with numpy and talks
gloo, and the parent waits for them with a time limit, so a rank that hangs fails the test
instead of stalling the suite.
"""

from __future__ import annotations

import json
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch.distributed as dist

import resumable as rs
from resumable.elastic import restore
from tests.processes import free_port, run_ranks

SEQ_LEN = 16
# (ranks, rows rank r takes: ROWS[r]; None: to the end of the epoch)
PHASES: list[tuple[int, list[int] | None]] = [(2, [20, 31]), (3, [10, 25, 17]), (1, None)]


def documents(component: int, count: int) -> list[dict[str, Any]]:
    """Token ``t`` of document ``d`` of component ``c`` is ``c * 10**6 + d * 1000 + t + 1``."""
    lengths = np.random.default_rng(component).integers(0, 3 * SEQ_LEN, size=count).tolist()
    return [
        {"id": d, "input_ids": (component * 10**6 + d * 1000 + np.arange(n) + 1).tolist()}
        for d, n in enumerate(lengths)
    ]


def keep(document: dict[str, Any]) -> bool:
    return document["id"] % 5 != 3


def build() -> rs.Node:
    web = rs.from_list(documents(1, 70)).shuffle(seed=11).shard().filter(keep)
    code = rs.from_list(documents(2, 40)).shuffle(seed=12).shard()
    mixed = rs.mix({"web": web, "code": code}, weights={"web": 2, "code": 1}, seed=5, on_end="drop")
    return mixed.pack(SEQ_LEN, strategy="best_fit", buffer_size=4)


def tokens_of(row: dict[str, Any]) -> list[int]:
    return [int(t) for t in row["input_ids"][row["document_ids"] > 0]]


def rank_main(rank: int, world_size: int, port: int, out: str, phase: int) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size, timeout=timedelta(seconds=60)
    )
    try:
        rows = PHASES[phase][1]
        pipe = build()
        if phase > 0:
            previous = Path(out) / f"phase{phase - 1}"
            old_states = [rs.load_state(previous / f"rank{r}.json") for r in range(PHASES[phase - 1][0])]
            restore(pipe, old_states)
        taken = list(pipe) if rows is None else [next(pipe) for _ in range(rows[rank])]
        delivered = [t for row in taken for t in tokens_of(row)]
        here = Path(out) / f"phase{phase}"
        rs.save_state(pipe.get_state(), here / f"rank{rank}.json")
        (here / f"tokens{rank}.json").write_text(json.dumps(delivered))
        dist.barrier()  # every rank has saved before any leaves the group
    finally:
        dist.destroy_process_group()


def test_mix_then_pack_rescaled_2_to_3_to_1_ranks_delivers_every_token_once(tmp_path: Path) -> None:
    seen: Counter[int] = Counter()
    for phase, (ranks, _) in enumerate(PHASES):
        (tmp_path / f"phase{phase}").mkdir()
        run_ranks(rank_main, ranks, (ranks, free_port(), str(tmp_path), phase))
        for rank in range(ranks):
            seen.update(json.loads((tmp_path / f"phase{phase}" / f"tokens{rank}.json").read_text()))
    expected = Counter(t for d in documents(1, 70) if keep(d) for t in d["input_ids"])
    expected += Counter(t for d in documents(2, 40) for t in d["input_ids"])
    assert sum(seen.values()) == sum(expected.values())
    assert seen == expected, "every token of both components exactly once, across three topologies"
