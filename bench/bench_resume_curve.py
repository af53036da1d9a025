"""Resume latency along a JSONL file: ``rs.jsonl`` against Hugging Face ``datasets`` streaming.

    .venv/bin/python bench/bench_resume_curve.py [--size-mb 300] [--runs 5] [--hf-runs 3] [--plot]

For about ten positions from 0% to 99% of a generated corpus (``bench/corpus.py``), one
uninterrupted pass of each reader saves the state after ``k`` records and the record that comes
next. A resume then builds a fresh reader, loads that state and takes the first record, which
must equal the uninterrupted run's (the two readers must also agree on it):

- ours: ``rs.jsonl(path)`` (its line index cached in the sidecar, as after a first run) and
  ``rs.jsonl(path).shuffle(seed=0)``: build + ``set_state`` + first record, median of ``--runs``;
- ``datasets``: ``load_dataset("json", data_files=path, streaming=True, split="train")`` +
  ``load_state_dict`` + first example, median of ``--hf-runs``. Once one resume takes more than
  ``--hf-limit-s`` seconds, the farther positions are skipped for ``datasets`` (and said so).

Rounds alternate the readers at every position, so load on the machine hits both alike; a
garbage collection runs before each timed resume.
``--plot`` also writes ``docs/resume_vs_position.png`` (log-scale latency against position).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import resumable as rs  # noqa: E402
from bench.corpus import make_jsonl_corpus  # noqa: E402

DATA_DIR = ROOT / "bench" / "data"
PLOT = ROOT / "docs" / "resume_vs_position.png"
FRACTIONS = (0.0, 0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99)
"""Resume positions, as fractions of the file's records."""
SHUFFLE_SEED = 0
WARM_BLOCK = 64 << 20
"""Bytes per read when warming the page cache before timing."""


@dataclass
class Reader:
    """One way of reading the file: how to build it fresh, and what an uninterrupted run saved."""

    name: str
    build: Callable[[], Any]
    states: dict[int, Any] = field(default_factory=dict)
    expected: dict[int, dict[str, Any]] = field(default_factory=dict)
    times: dict[int, list[float]] = field(default_factory=dict)
    skipped: set[int] = field(default_factory=set)


def ours(path: str, shuffled: bool) -> Reader:
    """``rs.jsonl`` (optionally shuffled) with its states and next records at ``positions``."""

    def build() -> rs.Node:
        pipe = rs.jsonl(path)
        return pipe.shuffle(seed=SHUFFLE_SEED) if shuffled else pipe

    return Reader("rs.jsonl.shuffle(0)" if shuffled else "rs.jsonl", build)


def hf(path: str) -> Reader:
    """Hugging Face ``datasets`` streaming JSON over the same file."""
    import datasets

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    datasets.disable_progress_bars()

    def build() -> Any:
        return datasets.load_dataset("json", data_files=path, streaming=True, split="train")

    return Reader("datasets streaming", build)


def save_along(reader: Reader, positions: list[int], state_of: Callable[[Any], Any]) -> None:
    """One uninterrupted pass: the state after ``k`` records and the record ``k`` for each position."""
    source = reader.build()
    items = iter(source)
    done = 0
    for position in positions:
        while done < position:
            next(items)
            done += 1
        reader.states[position] = state_of(source)
        reader.expected[position] = next(items)
        done += 1


def resume_ours(reader: Reader, position: int) -> float:
    """Seconds to build ``rs.jsonl``, ``set_state`` and take the first record; checks the record."""
    gc.collect()  # no collection of the other reader's garbage inside the timed span
    began = time.perf_counter()
    pipe = reader.build()
    pipe.set_state(reader.states[position])
    record = next(pipe)
    seconds = time.perf_counter() - began
    check(reader, position, record)
    return seconds


def resume_hf(reader: Reader, position: int) -> float:
    """Seconds to ``load_dataset``, ``load_state_dict`` and take the first example; checks it."""
    state = copy.deepcopy(reader.states[position])
    gc.collect()
    began = time.perf_counter()
    dataset = reader.build()
    dataset.load_state_dict(state)
    example = next(iter(dataset))
    seconds = time.perf_counter() - began
    check(reader, position, example)
    return seconds


def check(reader: Reader, position: int, record: dict[str, Any]) -> None:
    """Stop the benchmark when a resumed record differs from the uninterrupted run's."""
    if record != reader.expected[position]:
        raise SystemExit(
            f"{reader.name}: resumed at record {position:,} gave id {record.get('id')}, "
            f"the uninterrupted run id {reader.expected[position].get('id')}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=int, default=300, help="corpus size (bench/data/corpus-<N>mb.jsonl)")
    parser.add_argument("--runs", type=int, default=5, help="resumes per position for rs.jsonl (median)")
    parser.add_argument("--hf-runs", type=int, default=3, help="resumes per position for datasets (median)")
    parser.add_argument("--hf-limit-s", type=float, default=60.0, help="skip farther datasets points past this")
    parser.add_argument("--no-hf", action="store_true", help="skip the Hugging Face datasets comparison")
    parser.add_argument("--plot", action="store_true", help=f"also write {PLOT.relative_to(ROOT)}")
    args = parser.parse_args()

    path = make_jsonl_corpus(str(DATA_DIR / f"corpus-{args.size_mb}mb.jsonl"), args.size_mb << 20)
    with open(path, "rb") as handle:  # warm the page cache: every reader finds the file in memory
        while handle.read(WARM_BLOCK):
            pass
    records = len(rs.jsonl(path))  # builds the line index once, or loads the cached sidecar
    positions = [min(records - 1, int(records * fraction)) for fraction in FRACTIONS]
    if any(later <= earlier for earlier, later in zip(positions, positions[1:])):
        raise SystemExit(f"{path}: {records} records are too few for {len(FRACTIONS)} distinct positions")
    size_mb = os.path.getsize(path) / 1e6
    print(f"file: {path} ({size_mb:.0f} MB, {records:,} records), load {os.getloadavg()[0]:.1f}")

    readers = [ours(path, shuffled=False), ours(path, shuffled=True)]
    for reader in readers:
        save_along(reader, positions, lambda pipe: json.loads(json.dumps(pipe.get_state())))
    peer = None if args.no_hf else hf(path)
    if peer is not None:
        save_along(peer, positions, lambda dataset: copy.deepcopy(dataset.state_dict()))
        for position in positions:
            if peer.expected[position] != readers[0].expected[position]:
                raise SystemExit(f"datasets and rs.jsonl disagree on record {position:,}")

    for round_index in range(max(args.runs, 0 if peer is None else args.hf_runs)):
        for position in positions:
            if round_index < args.runs:
                for reader in readers:
                    reader.times.setdefault(position, []).append(resume_ours(reader, position))
            if peer is not None and round_index < args.hf_runs and position not in peer.skipped:
                seconds = resume_hf(peer, position)
                peer.times.setdefault(position, []).append(seconds)
                if seconds > args.hf_limit_s:
                    peer.skipped.update(later for later in positions if later > position)

    all_readers = readers + ([peer] if peer is not None else [])
    print(
        f"resume = build + set_state + first record; rs.jsonl median of {args.runs}, datasets median of "
        f"{args.hf_runs}; every resumed record equals the uninterrupted run's"
    )
    header = f"{'position':>8} {'record':>8}" + "".join(f" {reader.name + ' ms':>24}" for reader in all_readers)
    if peer is not None:
        header += f" {'datasets / rs.jsonl':>20}"
    print(header)
    print("-" * len(header))
    medians: dict[str, dict[int, float]] = {reader.name: {} for reader in all_readers}
    for fraction, position in zip(FRACTIONS, positions):
        line = f"{fraction:>8.0%} {position:>8,}"
        for reader in all_readers:
            if position in reader.times:
                medians[reader.name][position] = statistics.median(reader.times[position]) * 1e3
                line += f" {medians[reader.name][position]:>24.2f}"
            else:
                line += f" {'skipped':>24}"
        if peer is not None and position in medians[peer.name]:
            line += f" {medians[peer.name][position] / medians[readers[0].name][position]:>20,.0f}"
        print(line)
    if peer is not None and peer.skipped:
        print(f"datasets: positions past a resume of more than {args.hf_limit_s:.0f} s skipped")
    print(f"load {os.getloadavg()[0]:.1f}")
    if args.plot:
        plot(positions, records, size_mb, medians)


def plot(positions: list[int], records: int, size_mb: float, medians: dict[str, dict[int, float]]) -> None:
    """Write the resume latency of every reader against the position, log-scale latency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6.4, 4.2))
    for (name, values), marker in zip(medians.items(), "o^s"):
        points = [position for position in positions if position in values]
        axes.plot(
            [100 * position / records for position in points],
            [values[position] for position in points],
            marker=marker,
            label=name,
        )
    axes.set_yscale("log")
    axes.set_xlabel(f"resume position (% of {records:,} records, {size_mb:.0f} MB)")
    axes.set_ylabel("build + set_state + first record (ms)")
    axes.set_title("Resume latency along a JSONL file (median of runs)")
    axes.grid(True, which="both", linewidth=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(PLOT, dpi=120)
    print(f"wrote {PLOT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
