"""Even and pack_figures with real process groups (gloo on loopback), ranks forked as in
tests/test_elastic_mix_distributed.py. One group of 3 ranks whose packed row counts differ
runs every check of one topology (balanced epochs with a collective each step and after each
epoch, exact resume mid-epoch, the figures); then a group of 2 ranks resumes the 3 ranks'
states elastically. What each rank saw goes to a JSON file the test reads back."""

from __future__ import annotations

import json
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import resumable as rs
from resumable.elastic import restore
from resumable.ops.even import Even
from resumable.torch import pack_figures
from tests.processes import free_port, run_ranks

SEQ_LEN = 16
EPOCHS = 3
TIMEOUT = timedelta(seconds=30)


def skewed(count: int) -> list[dict[str, Any]]:
    """Documents whose length follows ``id % 3``, so unshuffled shards of 3 ranks pack into
    very different numbers of rows (one, two and three documents per row)."""
    return [{"input_ids": (d * 1000 + np.arange(15 // (d % 3 + 1)) + 1).tolist()} for d in range(count)]


def mixed(count: int) -> list[dict[str, Any]]:
    """Documents of random lengths: shuffled shards differ by a few rows per epoch."""
    lengths = np.random.default_rng(count).integers(1, 2 * SEQ_LEN, size=count).tolist()
    return [{"input_ids": (d * 1000 + np.arange(n) + 1).tolist()} for d, n in enumerate(lengths)]


def tokens(batch: list[dict[str, np.ndarray]]) -> list[int]:
    return [int(t) for row in batch for t in row["input_ids"][row["document_ids"] > 0]]


def rows(source: rs.Node) -> rs.Node:
    return source.pack(SEQ_LEN, strategy="bfd").batch(2, collate_fn=tokens)


def build_skewed() -> Even:
    return Even(rows(rs.from_list(skewed(60)).shard()), times=EPOCHS)


def build_mixed() -> Even:
    return Even(rows(rs.from_list(mixed(80)).shuffle(4).shard()), times=EPOCHS)


def train(pipe: Even, epochs: int, log: list[int] | None = None) -> list[list[Any]]:
    """Epoch after epoch as a training loop runs them: a collective every step (as a gradient
    all-reduce would be) and a barrier after every epoch; each hangs if the ranks disagree."""
    done = []
    for _ in range(epochs):
        batches = []
        for batch in pipe:
            batches.append(batch)
            dist.all_reduce(torch.ones(1))
        dist.monitored_barrier(timeout=TIMEOUT)
        if log is not None:
            log.append(len(batches))
        done.append(batches)
    return done


def rank_main(rank: int, world_size: int, port: int, out: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size, timeout=TIMEOUT
    )
    try:
        result = three_ranks(rank, Path(out)) if world_size == 3 else two_ranks(rank, Path(out))
        (Path(out) / f"{world_size}ranks{rank}.json").write_text(json.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def three_ranks(rank: int, out: Path) -> dict[str, Any]:
    result: dict[str, Any] = {}
    plain = rows(rs.from_list(skewed(60)).shard())
    result["stream"] = [batch for _ in range(EPOCHS) for batch in plain]
    result["upstream_batches"] = len(plain)

    pipe, sizes = build_skewed(), []
    result["epochs"] = train(pipe, EPOCHS + 1, sizes)
    result["leftover"] = pipe.leftover

    resumed, head = build_skewed(), []
    for batch in resumed:
        head.append(batch)
    head += [next(iter(resumed)) for _ in range(2)]  # mid second epoch: the surplus of the first is read
    state = json.loads(json.dumps(resumed.get_state()))
    again = build_skewed()
    again.set_state(state)
    result["resumed"] = head + [batch for epoch in train(again, EPOCHS) for batch in epoch]

    pack = rs.from_list(skewed(60)).shard().pack(SEQ_LEN, strategy="bfd")
    batch = pack.collate([next(pack) for _ in range(rank + 1)])  # ranks' batches differ in size too
    result["figures"] = pack_figures(batch, stats=pack.stats)
    result["row_tokens"] = np.count_nonzero(batch["document_ids"], axis=1).tolist()
    result["stats"] = [pack.stats.rows, pack.stats.tokens]

    old = build_mixed()
    result["old_head"] = [batch for epoch in train(old, 1) for batch in epoch] + [next(iter(old)) for _ in range(2)]
    rs.save_state(old.get_state(), out / f"old{rank}.json")
    return result


def two_ranks(rank: int, out: Path) -> dict[str, Any]:
    pipe = build_mixed()
    restore(pipe, [rs.load_state(out / f"old{r}.json") for r in range(3)])
    sizes: list[int] = []
    delivered = [batch for epoch in train(pipe, EPOCHS, sizes) for batch in epoch]
    upstream, left = pipe.upstream, []  # what this rank never yielded: the rest of its stream
    while len(left) < pipe.leftover:
        left += list(upstream)
        upstream.next_epoch()
    return {"delivered": delivered, "sizes": sizes, "left": left[: pipe.leftover]}


def test_even_ranks_resume_rescale_and_figures(tmp_path: Path) -> None:
    run_ranks(rank_main, 3, (3, free_port(), str(tmp_path)))
    three = [json.loads((tmp_path / f"3ranks{r}.json").read_text()) for r in range(3)]

    assert len({rank["upstream_batches"] for rank in three}) == 3, "the ranks' batch counts differ"
    quotas = [len(epoch) for epoch in three[0]["epochs"]]
    assert quotas == [min(rank["upstream_batches"] for rank in three)] * EPOCHS + [0]
    for rank in three:
        assert [len(epoch) for epoch in rank["epochs"]] == quotas, "the same number of batches on every rank"
        yielded = [batch for epoch in rank["epochs"] for batch in epoch]
        assert yielded == rank["stream"][: len(yielded)], "each rank continues its own stream"
        assert len(yielded) + rank["leftover"] == len(rank["stream"]), "nothing lost: the rest is leftover"
        assert rank["resumed"] == yielded, "exact resume mid-epoch"

    row_tokens = [t for rank in three for t in rank["row_tokens"]]
    batch_tokens = [sum(rank["row_tokens"]) for rank in three]
    epoch_rows = [rank["stats"][0] for rank in three]
    expected = {
        "seq_len_min": min(row_tokens),
        "seq_len_avg": sum(row_tokens) / len(row_tokens),
        "seq_len_max": max(row_tokens),
        "batch_tokens_min": min(batch_tokens),
        "batch_tokens_avg": sum(batch_tokens) / 3,
        "batch_tokens_max": max(batch_tokens),
        "efficiency": sum(row_tokens) / (len(row_tokens) * SEQ_LEN),
        "epoch_rows_min": min(epoch_rows),
        "epoch_rows_max": max(epoch_rows),
        "epoch_efficiency": sum(rank["stats"][1] for rank in three) / (sum(epoch_rows) * SEQ_LEN),
    }
    assert len(set(row_tokens)) > 1 and len(set(batch_tokens)) == 3, "the ranks' batches differ"
    for rank in three:
        assert rank["figures"] == expected

    run_ranks(rank_main, 2, (2, free_port(), str(tmp_path)))
    two = [json.loads((tmp_path / f"2ranks{r}.json").read_text()) for r in range(2)]
    assert two[0]["sizes"] == two[1]["sizes"], "the new ranks agree afresh"
    seen = Counter(t for rank in three for batch in rank["old_head"] for t in batch)
    seen.update(t for rank in two for batch in rank["delivered"] + rank["left"] for t in batch)
    epochs = len(seen) and max(seen.values())
    assert seen == Counter({t: epochs for d in mixed(80) for t in d["input_ids"]}), "every token once per epoch"
