"""Ranks in real process groups (gloo on loopback) reading ``s3://`` objects from the loopback
server through ``rs.torch.Loader`` with DataLoader workers: over two epochs every record comes
exactly once per epoch across the ranks, and a group resumed from the states of an interrupted
one continues with exactly the batches the uninterrupted run gave, for JSONL and Parquet."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest

import resumable as rs
from resumable.torch import Loader
from tests.processes import free_port, process_group, run_ranks, train
from tests.s3server import S3Server
from tests.sources import _file

RECORDS = [{"id": i, "text": f"document {i} " + "z" * (i % 23)} for i in range(173)]
EPOCHS = 2
WORLD_SIZE = 2
NUM_WORKERS = 2
STOP_AFTER = 9
KINDS = ("jsonl", "parquet")


def build(kind: str, url: str, options: dict[str, Any], cache_dir: str) -> rs.Node[Any]:
    read = rs.jsonl if kind == "jsonl" else rs.parquet
    source = read(url, storage_options=options, cache_dir=cache_dir, block_bytes=2048, cache_bytes=16384)
    return source.shuffle(seed=7).shard().map(lambda record: int(record["id"])).batch(4)


def rank_main(rank: int, port: int, phase: str, out: str, make: Any) -> None:
    with process_group(rank, WORLD_SIZE, port):
        result: dict[str, Any] = {}
        if phase == "first":
            result["full"] = train(Loader(make, num_workers=NUM_WORKERS), EPOCHS)
            loader = Loader(make, num_workers=NUM_WORKERS)
            result["head"] = train(loader, EPOCHS, stop_after=STOP_AFTER)
            rs.save_state(loader.state_dict(), Path(out) / f"rank{rank}.json")
        else:
            resumed = Loader(make, num_workers=NUM_WORKERS)
            resumed.load_state_dict(rs.load_state(Path(out) / f"rank{rank}.json"))
            result["tail"] = train(resumed, EPOCHS, resumed=True)
        (Path(out) / f"{phase}{rank}.json").write_text(json.dumps(result))


@pytest.mark.parametrize("kind", KINDS)
def test_ranks_read_s3_exactly_once_and_resume_in_a_new_group(s3_server: S3Server, tmp_path: Path, kind: str) -> None:
    url = s3_server.upload(_file(kind, RECORDS), f"distributed/data.{kind}")
    make = functools.partial(build, kind, url, s3_server.options, str(tmp_path / "cache"))
    results = {}
    for phase in ("first", "second"):
        run_ranks(rank_main, WORLD_SIZE, (free_port(), phase, str(tmp_path), make))
        results[phase] = [json.loads((tmp_path / f"{phase}{r}.json").read_text()) for r in range(WORLD_SIZE)]
    for epoch in range(EPOCHS):
        union = sorted(x for rank in results["first"] for e, batch in rank["full"] if e == epoch for x in batch)
        assert union == list(range(len(RECORDS))), f"epoch {epoch}: every record exactly once over the ranks"
    for rank in range(WORLD_SIZE):
        first, second = results["first"][rank], results["second"][rank]
        assert len(first["head"]) == STOP_AFTER
        assert first["head"] + second["tail"] == first["full"], f"rank {rank}"
