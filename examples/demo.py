"""Demo: a training job is killed again and again and still consumes exactly the batches of an
uninterrupted run, and ends with bit-identical weights.

    python examples/demo.py            # or: ./dev demo

Runs examples/train.py (a tiny byte-level language model; data pipeline: JSONL, shuffle,
shard, tokenise, pack, batch, through rs.torch.Loader with 2 DataLoader workers):

1. once without interruption;
2. again, killing the whole job (trainer and its DataLoader workers) with SIGKILL at random
   steps, as a preemption would, then with SIGTERM (handled: save, then exit), restarting
   it after each kill; every restart resumes from the last checkpoint.

Then compares the fingerprints of the batches the optimiser consumed, step by step, and the
final weights.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

TRAIN = Path(__file__).with_name("train.py")


def log_lines(run_dir: Path) -> int:
    try:
        return (run_dir / "batches.log").read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def run_job(run_dir: Path, steps: int, stop_at: int | None = None, sig: int = signal.SIGKILL) -> int:
    """Run train.py; with ``stop_at``, send ``sig`` to the whole job once that many batches are
    logged. Returns the exit status (negative: killed by a signal)."""
    command = [sys.executable, str(TRAIN), "--run-dir", str(run_dir), "--steps", str(steps)]
    job = subprocess.Popen(command, start_new_session=True, stdout=subprocess.DEVNULL)
    if stop_at is not None:
        while job.poll() is None and log_lines(run_dir) < stop_at:
            time.sleep(0.005)
        if job.poll() is None:
            os.killpg(job.pid, sig)
    return job.wait(timeout=600)


def run_with_interruptions(run_dir: Path, steps: int, kills: int, terms: int, seed: int = 0) -> list[str]:
    """Interrupt the job ``kills`` times with SIGKILL, then ``terms`` times with SIGTERM, at
    random steps, restarting it each time; then let it finish. Returns what happened."""
    rng = random.Random(seed)
    events = []
    signals = [signal.SIGKILL] * kills + [signal.SIGTERM] * terms
    margin = max(2, steps // (2 * len(signals) + 2)) if signals else 0
    target = 0
    for sig in signals:
        target = max(target, log_lines(run_dir)) + rng.randint(2, margin + 2)
        status = run_job(run_dir, steps, stop_at=target, sig=sig)
        events.append(f"{signal.Signals(sig).name} at step {log_lines(run_dir)} (exit status {status})")
    status = run_job(run_dir, steps)
    events.append(f"finished (exit status {status})")
    return events


def compare(reference: Path, interrupted: Path) -> tuple[bool, bool]:
    """Same batch fingerprints step by step; bit-identical final weights."""
    same_batches = (reference / "batches.log").read_text() == (interrupted / "batches.log").read_text()
    weights_a = torch.load(reference / "final.pt", weights_only=True)
    weights_b = torch.load(interrupted / "final.pt", weights_only=True)
    same_weights = weights_a.keys() == weights_b.keys() and all(
        torch.equal(weights_a[k], weights_b[k]) for k in weights_a
    )
    return same_batches, same_weights


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--kills", type=int, default=3, help="SIGKILLs at random steps")
    parser.add_argument("--terms", type=int, default=1, help="SIGTERMs (graceful) at random steps")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="resumable-demo-") as tmp:
        root = Path(tmp)
        reference, interrupted = root / "reference", root / "interrupted"
        print(f"1. uninterrupted run of {args.steps} steps ...", flush=True)
        run_job(reference, args.steps)
        print(f"2. interrupted run: {args.kills} x SIGKILL, {args.terms} x SIGTERM, restarted after each", flush=True)
        for event in run_with_interruptions(interrupted, args.steps, args.kills, args.terms, args.seed):
            print(f"   {event}", flush=True)
        same_batches, same_weights = compare(reference, interrupted)
        steps = log_lines(interrupted)
        print(f"3. batches consumed by the optimiser identical, step by step: {same_batches} ({steps} steps)")
        print(f"   final weights bit-identical: {same_weights}")
        return 0 if same_batches and same_weights else 1


if __name__ == "__main__":
    sys.exit(main())
