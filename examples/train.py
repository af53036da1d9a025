"""A small real training script that survives preemption.

    python examples/train.py --run-dir examples/runs/a --steps 200

A tiny byte-level causal language model trains on CPU on a JSONL corpus the script generates
(in ``--data``, once). The data pipeline shuffles, shards, tokenises, packs documents into rows
of ``--seq-len`` tokens and batches them, through ``rs.torch.Loader`` with DataLoader workers.
Every ``--checkpoint-every`` steps the model, optimiser and data state go into one checkpoint,
written atomically. On start the script resumes from the last checkpoint. SIGTERM is handled
gracefully: the current step finishes, a checkpoint is saved, the script exits with status 0.
Kill it with SIGKILL at any moment and restart it: it goes on exactly as if never interrupted.

``batches.log`` in the run directory lists a fingerprint of every batch the optimiser consumed,
one per step; ``final.pt`` holds the weights when ``--steps`` is reached.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

import resumable as rs
import resumable.torch as rst
from resumable.pack import collate_rows

WORDS = (
    "the model reads tokens from packed rows while the loader keeps every worker's position "
    "so a preempted job resumes with exactly the next batch on each rank"
).split()


def make_corpus(directory: Path, files: int = 4, docs_per_file: int = 400) -> str:
    """Deterministic JSONL files of random sentences with log-normal lengths."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for f in range(files):
        path = directory / f"part-{f:02d}.jsonl"
        if path.exists():
            continue
        lines = []
        for i in range(docs_per_file):
            words = rng.choice(WORDS, size=max(1, int(rng.lognormal(3.0, 0.8))))
            lines.append(json.dumps({"id": f * docs_per_file + i, "text": " ".join(words)}))
        temp = path.with_suffix(".tmp")
        temp.write_text("\n".join(lines) + "\n")
        os.replace(temp, path)
    return str(directory / "part-*.jsonl")


def tokenize(record: dict[str, Any]) -> dict[str, np.ndarray]:
    """Byte-level tokens: the UTF-8 bytes of the text."""
    return {"input_ids": np.frombuffer(record["text"].encode(), dtype=np.uint8).astype(np.int64)}


def build_pipeline(pattern: str, seq_len: int, batch_size: int) -> rs.Node:
    return (
        rs.jsonl(pattern)
        .shuffle(seed=0)
        .shard()
        .repeat()
        .map(tokenize)
        .filter(lambda doc: len(doc["input_ids"]) > 1)
        .pack(seq_len, strategy="best_fit", buffer_size=64)
        .batch(batch_size, collate_fn=collate_rows)
    )


class TinyLM(torch.nn.Module):
    """One causal transformer layer over byte embeddings."""

    def __init__(self, seq_len: int, width: int = 64) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(256, width)
        self.position = torch.nn.Embedding(seq_len, width)
        self.block = torch.nn.TransformerEncoderLayer(
            width, nhead=4, dim_feedforward=2 * width, dropout=0.0, batch_first=True
        )
        self.head = torch.nn.Linear(width, 256)
        self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(seq_len), persistent=False)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(input_ids) + self.position(position_ids)
        return self.head(self.block(hidden, src_mask=self.mask, is_causal=True))


def fingerprint(batch: dict[str, Any]) -> str:
    return hashlib.sha1(np.ascontiguousarray(batch["input_ids"]).tobytes()).hexdigest()[:16]


def train(args: argparse.Namespace) -> int:
    torch.manual_seed(0)
    torch.set_num_threads(1)  # bit-identical arithmetic from run to run
    run_dir = Path(args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    pattern = make_corpus(Path(args.data))
    model = TinyLM(args.seq_len)
    optimiser = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = rst.Loader(lambda: build_pipeline(pattern, args.seq_len, args.batch_size), num_workers=args.num_workers)
    checkpoint_path, log_path = run_dir / "checkpoint.pt", run_dir / "batches.log"

    step = 0
    if checkpoint_path.exists():
        checkpoint = rst.load(checkpoint_path)
        model.load_state_dict(checkpoint["model"])
        optimiser.load_state_dict(checkpoint["optimiser"])
        loader.load_state_dict(checkpoint["data"])
        step = checkpoint["step"]
        print(f"resumed from the checkpoint of step {step}", flush=True)
    # The log keeps exactly the steps the checkpoint covers; later ones are redone.
    kept = log_path.read_text().splitlines()[:step] if log_path.exists() else []
    log_path.write_text("".join(line + "\n" for line in kept))

    stop_requested = False

    def request_stop(signum: int, frame: Any) -> None:
        nonlocal stop_requested
        stop_requested = True

    signal.signal(signal.SIGTERM, request_stop)

    def save_checkpoint() -> None:
        state = {"model": model.state_dict(), "optimiser": optimiser.state_dict(), "data": loader.state_dict()}
        rst.save({**state, "step": step}, checkpoint_path)

    with open(log_path, "a") as log:
        for batch in loader:
            if step >= args.steps:
                break
            logits = model(batch["input_ids"][:, :-1], batch["position_ids"][:, :-1])
            loss = torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), batch["labels"][:, 1:].flatten(), ignore_index=-100
            )
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
            step += 1
            log.write(fingerprint(batch) + "\n")
            log.flush()
            if step % args.checkpoint_every == 0 or stop_requested:
                save_checkpoint()
            if stop_requested:
                print(f"SIGTERM: checkpoint saved at step {step}, exiting", flush=True)
                return 0
    torch.save(model.state_dict(), run_dir / "final.pt")
    print(f"finished {step} steps, loss {loss.item():.3f}", flush=True)
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--data", default=None, help="corpus directory (default: RUN_DIR/../data)")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--checkpoint-every", type=int, default=5)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args(argv)
    if args.data is None:
        args.data = str(Path(args.run_dir).resolve().parent / "data")
    return args


if __name__ == "__main__":
    sys.exit(train(parse_args()))
