"""Demo: a training loop is interrupted mid-epoch and resumes exactly, in a new process.

    python examples/demo.py            # or: ./dev demo

1. Generates a small JSONL corpus (nothing is downloaded).
2. Trains a tiny byte-level model for STEPS steps without interruption, logging a fingerprint
   of every batch the optimiser consumed.
3. Trains again, but the process dies abruptly (os._exit, as a preemption would) after
   CRASH_AT steps; the last checkpoint (model, optimiser and data-pipeline state) was written
   at a multiple of CHECKPOINT_EVERY. A new process resumes from it and finishes.
4. Checks the batches consumed and the final weights are identical to the uninterrupted run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

import resumable as rs

STEPS = 60
CHECKPOINT_EVERY = 10
CRASH_AT = 37
SEQ_LEN = 64
BATCH_SIZE = 8
WORDS = "data loader resume checkpoint shard shuffle epoch token batch rank worker state".split()


def make_corpus(directory: Path, files: int = 3, docs_per_file: int = 300) -> str:
    """JSONL files of random sentences with log-normal lengths."""
    rng = np.random.default_rng(0)
    for f in range(files):
        with open(directory / f"part-{f:02d}.jsonl", "w") as out:
            for i in range(docs_per_file):
                words = rng.choice(WORDS, size=max(1, int(rng.lognormal(2.5, 0.7))))
                out.write(json.dumps({"id": f * docs_per_file + i, "text": " ".join(words)}) + "\n")
    return str(directory / "part-*.jsonl")


def tokenize(record: dict) -> np.ndarray:
    """Byte-level tokens, cut or padded to SEQ_LEN + 1 (input plus shifted target)."""
    tokens = np.frombuffer(record["text"].encode(), dtype=np.uint8).astype(np.int64)[: SEQ_LEN + 1]
    return np.pad(tokens, (0, SEQ_LEN + 1 - len(tokens)))


def build_pipeline(pattern: str) -> rs.Node:
    return (
        rs.jsonl(pattern)
        .shuffle(seed=0)
        .shard()
        .repeat()
        .map(tokenize)
        .filter(lambda tokens: tokens[1] != 0)
        .batch(BATCH_SIZE, collate_fn=lambda rows: torch.from_numpy(np.stack(rows)))
    )


class TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(256, 32)
        self.out = torch.nn.Linear(32, 256)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.embed(tokens)))


def save_atomically(payload: dict, path: Path) -> None:
    """Write to a temporary file, fsync, rename: a crash mid-save keeps the old checkpoint."""
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as handle:
        torch.save(payload, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def train(pattern: str, run_dir: Path, crash_at: int | None) -> None:
    """The training loop a user writes: resume from the last checkpoint if there is one."""
    torch.manual_seed(0)
    model = TinyLM()
    optimiser = torch.optim.AdamW(model.parameters(), lr=1e-2)
    pipe = build_pipeline(pattern)
    checkpoint, log = run_dir / "checkpoint.pt", run_dir / "batches.log"
    step = 0
    if checkpoint.exists():
        saved = torch.load(checkpoint, weights_only=True)  # plain data: nothing is unpickled
        model.load_state_dict(saved["model"])
        optimiser.load_state_dict(saved["optimiser"])
        pipe.set_state(saved["data"])
        step = saved["step"]
        lines = log.read_text().splitlines()[:step]  # steps after the checkpoint are redone
        log.write_text("".join(line + "\n" for line in lines))
        print(f"  new process resumed from the checkpoint of step {step}")
    with open(log, "a") as log_file:
        for batch in pipe:
            if step == STEPS:
                break
            loss = torch.nn.functional.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
            log_file.write(hashlib.sha1(batch.numpy().tobytes()).hexdigest()[:16] + "\n")
            step += 1
            if step % CHECKPOINT_EVERY == 0:
                log_file.flush()
                state = {"model": model.state_dict(), "optimiser": optimiser.state_dict(), "data": pipe.get_state()}
                save_atomically({**state, "step": step}, checkpoint)
            if step == crash_at:
                log_file.flush()
                print(f"  process dies at step {step}; last checkpoint at step {step - step % CHECKPOINT_EVERY}")
                os._exit(1)
    torch.save(model.state_dict(), run_dir / "final.pt")


def run_training(pattern: str, run_dir: Path, crash_at: int | None = None) -> int:
    command = [sys.executable, __file__, "train", "--pattern", pattern, "--run-dir", str(run_dir)]
    if crash_at is not None:
        command += ["--crash-at", str(crash_at)]
    return subprocess.run(command, check=False).returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", nargs="?", default="demo", choices=["demo", "train"])
    parser.add_argument("--pattern")
    parser.add_argument("--run-dir", type=Path)
    parser.add_argument("--crash-at", type=int)
    args = parser.parse_args()
    if args.mode == "train":
        train(args.pattern, args.run_dir, args.crash_at)
        return 0

    with tempfile.TemporaryDirectory(prefix="resumable-demo-") as tmp:
        root = Path(tmp)
        (root / "data").mkdir()
        pattern = make_corpus(root / "data")
        print(f"corpus: {len(rs.jsonl(pattern))} documents in {pattern}")
        straight, interrupted = root / "straight", root / "interrupted"
        straight.mkdir()
        interrupted.mkdir()
        print(f"1. uninterrupted run of {STEPS} steps")
        run_training(pattern, straight)
        print(f"2. interrupted run: checkpoint every {CHECKPOINT_EVERY} steps, crash at step {CRASH_AT}")
        exit_code = run_training(pattern, interrupted, crash_at=CRASH_AT)
        print(f"  crashed process exited with code {exit_code}; starting a new process")
        run_training(pattern, interrupted)

        expected = (straight / "batches.log").read_text().splitlines()
        got = (interrupted / "batches.log").read_text().splitlines()
        same_batches = expected == got and len(got) == STEPS
        weights_a = torch.load(straight / "final.pt", weights_only=True)
        weights_b = torch.load(interrupted / "final.pt", weights_only=True)
        same_weights = all(torch.equal(weights_a[name], weights_b[name]) for name in weights_a)
        print(f"3. batches consumed by the optimiser identical: {same_batches} ({len(got)} of {STEPS})")
        print(f"   final model weights bit-identical: {same_weights}")
        return 0 if same_batches and same_weights else 1


if __name__ == "__main__":
    sys.exit(main())
