"""Restore latency of a packer over an expensive map: ``set_state`` + first row.

A 20,000-document epoch of UltraChat-like lengths goes through ``shuffle -> map(fn) ->
pack(2048, strategy, buffer_size)``, where ``fn`` busy-waits ``cost`` ms per document (a
tokenizer's CPU time). States are taken at 1%, 50% and 99% of the epoch's rows (with a free map:
the map is pure, so the state is the same) and restored into a freshly built pipeline with the
map's cost on; the figure is ``set_state`` + the first row, beside the time the uninterrupted
pipeline takes for that same row (what any run pays there, restored or not).

With ``--state-every-row`` the pipeline also takes a state after every row before the point, as
a ``rs.torch.Loader`` worker does with every batch, so the state restored is a packer's base and
the log since it (docs/packing.md, "States taken often") rather than a whole one.

Baseline: ``--old DIR`` runs the same measurements with the ``resumable`` found in ``DIR`` (a
``git worktree`` of an older commit), in alternating subprocesses; each figure is the median
over ``--runs`` rounds. Packing throughput and efficiency of both are printed too.

    .venv/bin/python bench/bench_restore.py --old /tmp/old          # the tables
    .venv/bin/python bench/bench_restore.py --old /tmp/old --plot   # and docs/restore_vs_buffer.png
    .venv/bin/python bench/bench_restore.py --old /tmp/old --state-every-row
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

DOCUMENTS = 20_000
SEQ_LEN = 2048
POINTS = (0.01, 0.5, 0.99)
BUFFERS = (100, 1000)
COSTS_MS = (0.0, 1.0)
PLOT_BUFFERS = (50, 100, 200, 500, 1000, 2000)
EXTRA = [  # (strategy, chain) at buffer 1000, 1 ms: the other strategies, and other chains under best_fit
    ("first_fit", "map"),
    ("greedy", "map"),
    ("bfd", "map"),
    ("best_fit", "parallel_map"),
    ("best_fit", "prefetch"),
]
ROOT = Path(__file__).resolve().parent.parent
PLOT = ROOT / "docs" / "restore_vs_buffer.png"

cost_s = [0.0]  # the map's cost per document, switched on after the states are taken


def expensive(record: dict[str, Any]) -> dict[str, Any]:
    """Busy-wait ``cost_s`` (CPU time, as a tokenizer spends it), then pass the record on."""
    if cost_s[0]:
        end = time.perf_counter() + cost_s[0]
        while time.perf_counter() < end:
            pass
    return record


def corpus() -> list[dict[str, Any]]:
    """UltraChat-like lengths: ln(tokens) ~ N(6.6, 0.9), at least 1."""
    lengths = np.maximum(1, np.exp(np.random.default_rng(0).normal(6.6, 0.9, DOCUMENTS))).astype(np.int64)
    return [{"input_ids": np.arange(length, dtype=np.int32)} for length in lengths.tolist()]


def build(rs: Any, docs: list[dict[str, Any]], strategy: str, buffer_size: int, chain: str) -> Any:
    pipe = rs.from_list(docs).shuffle(0)
    if chain == "parallel_map":
        pipe = pipe.filter(lambda record: True).map(expensive, num_workers=4)
    elif chain == "prefetch":
        pipe = pipe.map(expensive).prefetch(4)
    else:
        pipe = pipe.map(expensive)
    return pipe.pack(SEQ_LEN, strategy=strategy, buffer_size=buffer_size)


STATE_EVERY_ROW = [False]
"""Whether the pipeline takes a state after every row before the one restored (``--state-every-row``)."""


def restore_ms(rs: Any, docs: list[dict[str, Any]], strategy: str, buffer: int, chain: str, cost_ms: float) -> dict:
    """States at each point, then (restored, uninterrupted) ms of the row that follows."""
    cost_s[0] = 0.0
    rows = sum(1 for _ in build(rs, docs, strategy, buffer, chain))
    out = {}
    for point in POINTS:
        cost_s[0] = 0.0
        pipe = build(rs, docs, strategy, buffer, chain)
        for _ in range(max(1, int(rows * point))):
            next(pipe)
            if STATE_EVERY_ROW[0]:
                pipe.get_state()
        state = json.loads(json.dumps(pipe.get_state()))
        cost_s[0] = cost_ms / 1000
        start = time.perf_counter()
        next(pipe)
        uninterrupted = time.perf_counter() - start
        fresh = build(rs, docs, strategy, buffer, chain)
        start = time.perf_counter()
        fresh.set_state(state)
        next(fresh)
        restored = time.perf_counter() - start
        out[str(point)] = (restored * 1000, uninterrupted * 1000)
    return out


def throughput(rs: Any, docs: list[dict[str, Any]]) -> dict:
    """best_fit(1000) over the epoch with a free map: rows/s and efficiency."""
    cost_s[0] = 0.0
    pipe = build(rs, docs, "best_fit", 1000, "map")
    start = time.perf_counter()
    rows = sum(1 for _ in pipe)
    seconds = time.perf_counter() - start
    return {"rows_per_s": rows / seconds, "efficiency": pipe.stats.efficiency}


def measure(plot: bool) -> dict:
    """One round of every figure with the ``resumable`` on sys.path."""
    import resumable as rs

    docs = corpus()
    figures: dict[str, Any] = {"throughput": throughput(rs, docs)}
    for buffer in BUFFERS:
        for cost in COSTS_MS:
            figures[f"best_fit/map/{buffer}/{cost}"] = restore_ms(rs, docs, "best_fit", buffer, "map", cost)
    for strategy, chain in EXTRA:
        figures[f"{strategy}/{chain}/1000/1.0"] = restore_ms(rs, docs, strategy, 1000, chain, 1.0)
    if plot:
        for buffer in PLOT_BUFFERS:
            figures[f"plot/{buffer}"] = restore_ms(rs, docs, "best_fit", buffer, "map", 1.0)
    return figures


def run(tree: Path, plot: bool, state_every_row: bool) -> dict:
    """``measure`` in a subprocess importing ``resumable`` from ``tree``."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    command = [sys.executable, __file__, "--measure"] + (["--plot"] if plot else [])
    command += ["--state-every-row"] if state_every_row else []
    done = subprocess.run(command, env=env, cwd=tree, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"the measurement with {tree} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def median(rounds: list[dict], key: str, point: str, which: int) -> float:
    return statistics.median(figures[key][point][which] for figures in rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", type=Path, help="a tree holding the baseline's resumable package")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--plot", action="store_true", help=f"also write {PLOT.relative_to(ROOT)}")
    parser.add_argument("--state-every-row", action="store_true", help="a state after every row before each point")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    STATE_EVERY_ROW[0] = args.state_every_row
    if args.measure:
        print(json.dumps(measure(args.plot)))
        return
    trees = {"new": ROOT} | ({"old": args.old} if args.old else {})
    rounds: dict[str, list[dict]] = {name: [] for name in trees}
    for _ in range(args.runs):  # alternating: old, new, old, new, ...
        for name in reversed(trees):
            rounds[name].append(run(trees[name], args.plot, args.state_every_row))
    print(f"load: {os.getloadavg()[0]:.2f} (1 min); {DOCUMENTS} documents, seq_len {SEQ_LEN}, median of {args.runs}")
    print("set_state + first row, ms (uninterrupted run's same row, ms)")
    header = f"{'strategy':10} {'chain':13} {'buffer':>6} {'map':>5}" + "".join(
        f" {f'{point:.0%} ' + name:>20}" for point in POINTS for name in reversed(trees)
    )
    print(header)
    keys = [f"best_fit/map/{b}/{c}" for b in BUFFERS for c in COSTS_MS] + [f"{s}/{c}/1000/1.0" for s, c in EXTRA]
    for key in keys:
        strategy, chain, buffer, cost = key.split("/")
        line = f"{strategy:10} {chain:13} {buffer:>6} {float(cost):>3.0f}ms"
        for point in map(str, POINTS):
            for name in reversed(trees):
                restored = median(rounds[name], key, point, 0)
                uninterrupted = median(rounds[name], key, point, 1)
                line += f" {f'{restored:.1f} ({uninterrupted:.1f})':>20}"
        print(line)
    for name in reversed(trees):
        rows = statistics.median(r["throughput"]["rows_per_s"] for r in rounds[name])
        efficiency = rounds[name][0]["throughput"]["efficiency"]
        print(f"{name}: best_fit(1000) {rows:,.0f} rows/s, efficiency {efficiency:.2%}")
    if args.plot:
        plot(trees, rounds)


def plot(trees: dict[str, Path], rounds: dict[str, list[dict]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6.4, 4.2))
    for name in reversed(trees):
        for point, marker in zip(map(str, POINTS), "o^s"):
            values = [median(rounds[name], f"plot/{buffer}", point, 0) for buffer in PLOT_BUFFERS]
            label = f"{'before' if name == 'old' else 'after'}, at {float(point):.0%} of the epoch"
            axes.plot(PLOT_BUFFERS, values, marker=marker, linestyle="--" if name == "old" else "-", label=label)
    axes.axhline(100, color="grey", linewidth=0.8)
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_xlabel("best_fit buffer_size (documents)")
    axes.set_ylabel("set_state + first row (ms)")
    axes.set_title("Restore over a 1 ms/document map (median of runs)")
    axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(PLOT, dpi=120)
    print(f"wrote {PLOT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
