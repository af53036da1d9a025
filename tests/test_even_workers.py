"""Even inside DataLoader workers of a multi-rank job: 2 gloo ranks x 2 workers of
``rs.torch.Loader`` (fresh workers each epoch, then persistent ones) over documents whose
lengths follow the consumer, so the 4 consumers' packed batch counts differ (6, 3, 2, 2 per
epoch). Every consumer agrees through the process group's store; ranks forked as in
tests/test_even_distributed.py, what each saw goes to a JSON file the test reads back."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

import resumable as rs
import resumable.torch as rst
from resumable.loader_state import parse_loader_state
from tests.processes import free_port, run_ranks
from tests.test_even_distributed import SEQ_LEN, TIMEOUT, tokens

WORKERS = 2
CONSUMERS = 2 * WORKERS
EPOCHS = 2
DOCUMENTS = 48


def skewed() -> list[dict[str, Any]]:
    """Document ``d`` goes to consumer ``d % 4`` (unshuffled shard) and has ``15 // (d % 4 + 1)``
    tokens: 1, 2, 3 and 5 documents per row of 16 on the four consumers."""
    return [{"input_ids": (d * 1000 + np.arange(15 // (d % CONSUMERS + 1)) + 1).tolist()} for d in range(DOCUMENTS)]


def rows(source: rs.Node) -> rs.Node:
    return source.pack(SEQ_LEN, strategy="bfd").batch(2, collate_fn=tokens)


def build() -> rs.Node:
    return rows(rs.from_list(skewed()).shard()).even(times=EPOCHS)


def consumer_stream(consumer: int) -> list[Any]:
    """Consumer ``consumer``'s batches over ``EPOCHS`` upstream epochs, back to back."""
    pipe = rows(rs.from_list(skewed()).shard(consumer, CONSUMERS))
    return [batch for _ in range(EPOCHS) for batch in pipe]


def loader(persistent: bool) -> rst.Loader:
    return rst.Loader(build, num_workers=WORKERS, persistent_workers=persistent)


def epoch(pipe: rst.Loader) -> list[Any]:
    """One epoch as a training loop runs it: a collective each step, a barrier at the end."""
    batches = []
    for batch in pipe:
        batches.append(batch)
        dist.all_reduce(torch.ones(1))
    dist.monitored_barrier(timeout=TIMEOUT)
    return batches


def carries(state: dict[str, Any]) -> list[int]:
    """Each worker's Even carry in a Loader state."""
    return [pipeline["carry"] for pipeline in parse_loader_state(state).pipelines]


def rank_main(rank: int, world_size: int, port: int, out: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size, timeout=TIMEOUT
    )
    try:
        result = {}
        for persistent in (False, True):
            pipe = loader(persistent)
            epochs, ends = [], []
            for _ in range(EPOCHS + 1):
                epochs.append(epoch(pipe))
                ends.append(pipe.state_dict())
            again = []
            pipe.load_state_dict(ends[0])  # epoch 1 is agreed again, on the same keys
            again.append(epoch(pipe))

            resumed = loader(persistent)  # mid-epoch 1: its quota is in the state
            head = epoch(resumed)
            head += [batch for _, batch in zip(range(3), resumed)]
            state = json.loads(json.dumps(resumed.state_dict()))
            fresh = loader(persistent)
            fresh.load_state_dict(state)
            tail = [batch for batch in fresh]
            dist.all_reduce(torch.ones(1))
            result[str(persistent)] = {
                "epochs": epochs,
                "leftover": carries(ends[-1]),
                "again": again,
                "resumed": head + tail,
            }
            for each in (pipe, resumed, fresh):
                each.close()
        (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("persistent", ["False", "True"])
def test_workers_of_every_rank_agree_through_the_store(persistent: str, results: list[dict[str, Any]]) -> None:
    ranks = [rank[persistent] for rank in results]
    streams = [consumer_stream(c) for c in range(CONSUMERS)]
    quota = min(len(stream) for stream in streams) // EPOCHS  # each consumer's batches per epoch: 6, 3, 2, 2
    assert len({len(stream) for stream in streams}) == 3, "the consumers' batch counts differ"
    for r, rank in enumerate(ranks):
        assert [len(e) for e in rank["epochs"]] == [WORKERS * quota] * EPOCHS + [0], "the same count on every rank"
        yielded = [batch for e in rank["epochs"] for batch in e]
        for w in range(WORKERS):
            stream, mine = streams[r * WORKERS + w], yielded[w::WORKERS]  # workers take turns
            assert mine == stream[: len(mine)], "each worker continues its own stream"
            assert len(mine) + rank["leftover"][w] == len(stream), "nothing lost: the rest is leftover"
        assert rank["again"] == rank["epochs"][1:2], "agreeing epoch 1 again gives the same epoch"
        assert rank["resumed"] == yielded, "exact resume mid-epoch"


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """What each of 2 forked ranks saw; ranks still running after 120 s are killed."""
    out = tmp_path_factory.mktemp("even_workers")
    run_ranks(rank_main, 2, (2, free_port(), str(out)))
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
