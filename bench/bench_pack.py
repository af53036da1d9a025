"""Benchmark the sequence packer: efficiency per strategy, throughput and state cost.

    .venv/bin/python bench/bench_pack.py [--docs 20000] [--seed 0]

Document lengths are drawn from log-normal fits of real corpora (ln of GPT-2 token counts):
UltraChat-like mu=6.952 sigma=0.533, C4-like mu=5.459 sigma=1.158, Alpaca-like mu=4.822
sigma=0.702. Every figure is measured end to end through ``rs.nodes.Pack`` over an in-memory
source of pre-made int32 numpy token arrays, on one core:

- efficiency: non-padding tokens / (rows * seq_len), next to the lower bound
  sum(len) / (ceil(sum(len) / seq_len) * seq_len);
- Mtok/s: non-padding tokens handed out per second (source, packing and row assembly);
- get_state: mean microseconds per call with the buffer full (half-way through the epoch),
  and the state's JSON size; restore: milliseconds of ``set_state`` into a fresh pipeline.

Targets: best_fit (buffer 1000) >= 98.5% on UltraChat-like at 2048 and >= 99.5% on C4-like;
bfd over the whole set >= 98.7% on UltraChat-like; best_fit >= 5 M tokens/s.

``online-bf`` is a reference, not a strategy: classic online best fit (each document into the
fullest open row that fits, in arrival order; the fullest row is closed when open rows hold
more than 1000 documents). It shows why ``best_fit`` plans its buffer instead.

``--balance`` measures length balance over time instead: on a corpus where 60% of the documents
are longer than ``seq_len`` (log-normal mu=7.18 sigma=1.0 at seq_len 1024, mean 2,160 tokens),
the share of tokens from long documents in every window of consecutive rows (windows of the
rows that ``2 * buffer_size`` documents make) against the epoch's share: the largest
difference in points, the first window's share, and how many rows open the epoch before the
first one holding a short document's tokens.

``--plan`` times the whole-epoch plan alone (``Plan.pack``: pieces, best-fit-decreasing, row
order) over UltraChat-like and C4-like lengths at 2048, in each row order, best of three.

``--payloads`` measures throughput with payload fields against without: UltraChat-like lengths at
2048, each document with a per-token ``loss_mask`` (int8) as a token field and an image path as a
document field; the best of three alternating runs of each.

``--plot`` measures packing efficiency against buffer size instead (greedy, first_fit, best_fit
and windowed bfd at buffer sizes 10-2000; greedy has no buffer and the whole-epoch bfd none to
size, so both are drawn as horizontal references), prints the table, and writes
``docs/packing_efficiency.png`` with one panel per corpus and seq_len of the main table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from bisect import bisect_left, insort
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import resumable as rs  # noqa: E402
from resumable.pack import Pack  # noqa: E402
from resumable.pack.epoch import ROW_ORDERS, Plan  # noqa: E402

CORPORA = {"UltraChat": (6.952, 0.533), "C4": (5.459, 1.158), "Alpaca": (4.822, 0.702)}
CASES = [("UltraChat", 2048), ("C4", 2048), ("Alpaca", 2048), ("UltraChat", 8192)]
STRATEGIES: list[tuple[str, int | None]] = [
    ("greedy", None),
    ("first_fit", 64),
    ("first_fit", 1000),
    ("best_fit", 100),
    ("best_fit", 1000),
    ("bfd", 1000),
    ("bfd", None),
]
VOCAB = 50257
STATE_CALLS = 200


def lengths(corpus: str, count: int, seed: int) -> np.ndarray:
    """Document lengths in tokens (at least 1), log-normal with the corpus's fit."""
    mu, sigma = CORPORA[corpus]
    rng = np.random.default_rng(seed)
    return np.maximum(1, np.rint(np.exp(rng.normal(mu, sigma, count)))).astype(np.int64)


def documents(sizes: np.ndarray, seed: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed + 1)
    tokens = rng.integers(0, VOCAB, int(sizes.sum()), dtype=np.int32)
    bounds = np.concatenate(([0], np.cumsum(sizes)))
    return [{"input_ids": tokens[start:stop]} for start, stop in zip(bounds[:-1], bounds[1:])]


def lower_bound(sizes: np.ndarray, seq_len: int) -> float:
    total = int(sizes.sum())
    return total / (math.ceil(total / seq_len) * seq_len)


def build(docs: list[dict[str, np.ndarray]], seq_len: int, strategy: str, buffer_size: int | None) -> Pack:
    return rs.from_list(docs).pack(seq_len, strategy=strategy, buffer_size=buffer_size)


def measure(docs: list[dict[str, np.ndarray]], seq_len: int, strategy: str, buffer_size: int | None) -> dict[str, Any]:
    """One full epoch through the node, with the state taken and restored half-way."""
    pack = build(docs, seq_len, strategy, buffer_size)
    began = time.perf_counter()
    rows = sum(1 for _ in pack)
    seconds = time.perf_counter() - began
    stats = pack.stats

    probe = build(docs, seq_len, strategy, buffer_size)
    for _ in range(rows // 2):
        next(probe)
    began = time.perf_counter()
    for _ in range(STATE_CALLS):
        state = probe.get_state()
    state_us = (time.perf_counter() - began) / STATE_CALLS * 1e6
    fresh = build(docs, seq_len, strategy, buffer_size)
    began = time.perf_counter()
    fresh.set_state(json.loads(json.dumps(state)))
    restore_ms = (time.perf_counter() - began) * 1e3
    if not all(np.array_equal(a["input_ids"], b["input_ids"]) for a, b in zip(probe, fresh)):
        raise RuntimeError(f"{strategy}: the restored pipeline diverged")
    return {
        "rows": rows,
        "efficiency": stats.efficiency,
        "mtok_s": stats.tokens / seconds / 1e6,
        "state_us": state_us,
        "state_kb": len(json.dumps(state)) / 1e3,
        "restore_ms": restore_ms,
        "pending": len(probe.pending_keys()),
    }


def online_best_fit(sizes: np.ndarray, seq_len: int, buffer_size: int) -> float:
    """Reference: classic online best fit over open rows in arrival order (see the docstring)."""
    keys: list[int] = []  # capacity << 32 | row, sorted
    members: dict[int, int] = {}
    used_rows = 0
    held = 0
    pieces = []
    for size in sizes.tolist():
        pieces += [seq_len] * (size // seq_len) + ([size % seq_len] if size % seq_len else [])
    for size in pieces:
        at = bisect_left(keys, size << 32)
        if at == len(keys):
            used_rows += 1
            if size == seq_len:
                continue
            row, capacity, count = used_rows, seq_len - size, 1
        else:
            key = keys.pop(at)
            row, capacity = key & 0xFFFFFFFF, (key >> 32) - size
            count = members.pop(row) + 1
        held += 1
        if capacity == 0:
            held -= count
            continue
        members[row] = count
        insort(keys, capacity << 32 | row)
        if held > buffer_size:
            held -= members.pop(keys.pop(0) & 0xFFFFFFFF)
    return float(sum(pieces)) / (used_rows * seq_len)


BALANCE_CORPUS = (7.18, 1.0)
"""ln tokens of the balance corpus: 60% of its documents are longer than ``BALANCE_SEQ_LEN``."""
BALANCE_SEQ_LEN = 1024
BALANCE_BUFFER = 1000
BALANCE_WINDOW = 2
"""Window length, in buffers: the rows that ``BALANCE_WINDOW * buffer_size`` documents make."""
BALANCE_STRATEGIES: list[tuple[str, int | None]] = [
    ("greedy", None),
    ("first_fit", BALANCE_BUFFER),
    ("best_fit", BALANCE_BUFFER),
    ("bfd", BALANCE_BUFFER),
    ("bfd", None),
]
SHORT_TOKEN, LONG_TOKEN = 1, 2  # every token of a document says whether it is longer than seq_len


def window_drift(long_tokens: np.ndarray, tokens: np.ndarray, window: int) -> float:
    """Largest |long-token share of ``window`` consecutive rows - the epoch's share|, in points."""
    cum_long = np.concatenate(([0], np.cumsum(long_tokens)))
    cum_all = np.concatenate(([0], np.cumsum(tokens)))
    window = min(window, len(tokens))
    shares = (cum_long[window:] - cum_long[:-window]) / (cum_all[window:] - cum_all[:-window])
    return float(np.abs(shares - cum_long[-1] / cum_all[-1]).max() * 100)


def measure_balance(
    sizes: np.ndarray, docs: list[dict[str, np.ndarray]], strategy: str, buffer_size: int | None
) -> dict[str, Any]:
    """One epoch: each row's long-document and non-padding tokens, then their drift over windows."""
    pack = build(docs, BALANCE_SEQ_LEN, strategy, buffer_size)
    long_tokens, tokens = [], []
    for row in pack:
        ids = row["input_ids"]
        long_tokens.append(int(np.count_nonzero(ids == LONG_TOKEN)))
        tokens.append(int(np.count_nonzero(ids)))
    long_array, all_array = np.array(long_tokens), np.array(tokens)
    window = round(BALANCE_WINDOW * BALANCE_BUFFER * len(tokens) / len(sizes))
    return {
        "rows": len(tokens),
        "efficiency": pack.stats.efficiency,
        "epoch": long_array.sum() / all_array.sum(),
        "first": long_array[:window].sum() / all_array[:window].sum(),
        "drift": window_drift(long_array, all_array, window),
        "long_run": int(np.argmin(long_array == all_array)),
        "window": window,
    }


def balance(count: int, seed: int) -> None:
    """Print the length-balance table (``--balance``)."""
    mu, sigma = BALANCE_CORPUS
    rng = np.random.default_rng(seed)
    sizes = np.maximum(1, np.rint(np.exp(rng.normal(mu, sigma, count)))).astype(np.int64)
    kinds = np.where(sizes > BALANCE_SEQ_LEN, LONG_TOKEN, SHORT_TOKEN).astype(np.uint8)
    tokens = np.repeat(kinds, sizes)
    bounds = np.concatenate(([0], np.cumsum(sizes)))
    docs = [{"input_ids": tokens[start:stop]} for start, stop in zip(bounds[:-1], bounds[1:])]
    print(
        f"{count} documents, seed {seed}, ln tokens ~ N({mu}, {sigma}), seq_len {BALANCE_SEQ_LEN}: "
        f"{np.mean(sizes > BALANCE_SEQ_LEN):.1%} of documents and "
        f"{sizes[sizes > BALANCE_SEQ_LEN].sum() / sizes.sum():.1%} of tokens are longer than seq_len"
    )
    header = (
        f"{'strategy':<10} {'buffer':>6} {'rows':>6} {'efficiency':>10} {'window':>6} {'epoch':>7} "
        f"{'first':>7} {'max drift':>9} {'long run':>8}"
    )
    print(header)
    print("-" * len(header))
    for strategy, buffer_size in BALANCE_STRATEGIES:
        result = measure_balance(sizes, docs, strategy, buffer_size)
        buffer_text = "epoch" if strategy == "bfd" and buffer_size is None else str(buffer_size or "-")
        print(
            f"{strategy:<10} {buffer_text:>6} {result['rows']:>6} {result['efficiency']:>9.2%} "
            f"{result['window']:>6} {result['epoch']:>7.2%} {result['first']:>7.2%} "
            f"{result['drift']:>6.2f} pt {result['long_run']:>8}"
        )
    print(
        "window: rows per window; epoch / first: long-document share of the epoch's tokens and of the "
        "first window's; max drift: largest |window share - epoch share| over every window; long run: "
        "rows before the first that holds a short document's tokens"
    )


PLAN_RUNS = 3


def plan_build(count: int, seed: int) -> None:
    """Print the seconds ``Plan.pack`` takes per row order (``--plan``)."""
    seq_len = 2048
    print(f"{count} documents per corpus, seq_len {seq_len}, best of {PLAN_RUNS} runs, one core")
    header = f"{'corpus':<10} {'row order':<14} {'pieces':>9} {'rows':>9} {'seconds':>8}"
    print(header)
    print("-" * len(header))
    for corpus in ("UltraChat", "C4"):
        sizes = lengths(corpus, count, seed)
        documents = np.stack([np.arange(count), sizes // seq_len * seq_len, sizes, np.zeros_like(sizes)], axis=1)
        for row_order in ROW_ORDERS:
            best = math.inf
            for _ in range(PLAN_RUNS):
                began = time.perf_counter()
                plan = Plan.pack(documents, seq_len, None, {}, row_order)
                best = min(best, time.perf_counter() - began)
            print(f"{corpus:<10} {row_order:<14} {len(plan.order):>9} {plan.rows:>9} {best:>8.2f}")


PAYLOAD_STRATEGIES: list[tuple[str, int | None]] = [("greedy", None), ("best_fit", 1000), ("bfd", None)]
PAYLOAD_RUNS = 3


def payload_docs(docs: list[dict[str, np.ndarray]]) -> list[dict[str, Any]]:
    """``docs`` with a loss mask per token and an image path per document."""
    mask = np.ones(sum(len(doc["input_ids"]) for doc in docs), dtype=np.int8)
    bounds = np.concatenate(([0], np.cumsum([len(doc["input_ids"]) for doc in docs])))
    return [
        {**doc, "loss_mask": mask[start:stop], "image": f"images/{index}.png"}
        for index, (doc, start, stop) in enumerate(zip(docs, bounds[:-1], bounds[1:]))
    ]


def payload_throughput(count: int, seed: int) -> None:
    """Print Mtok/s with one token field and one document field against without (``--payloads``)."""
    seq_len = 2048
    plain = documents(lengths("UltraChat", count, seed), seed)
    loaded = payload_docs(plain)
    options = {"token_fields": ["loss_mask"], "document_fields": ["image"]}
    print(f"{count} UltraChat-like documents, seq_len {seq_len}, best of {PAYLOAD_RUNS} alternating runs, one core")
    header = f"{'strategy':<10} {'buffer':>6} {'without Mtok/s':>14} {'with Mtok/s':>12} {'ratio':>6}"
    print(header)
    print("-" * len(header))
    for strategy, buffer_size in PAYLOAD_STRATEGIES:
        best = {"without": 0.0, "with": 0.0}
        for _ in range(PAYLOAD_RUNS):
            for name, docs, extra in (("without", plain, {}), ("with", loaded, options)):
                pack = rs.from_list(docs).pack(seq_len, strategy=strategy, buffer_size=buffer_size, **extra)
                began = time.perf_counter()
                for _row in pack:
                    pass
                best[name] = max(best[name], pack.stats.tokens / (time.perf_counter() - began) / 1e6)
        buffer_text = "epoch" if strategy == "bfd" and buffer_size is None else str(buffer_size or "-")
        print(
            f"{strategy:<10} {buffer_text:>6} {best['without']:>14.1f} {best['with']:>12.1f} "
            f"{best['with'] / best['without']:>6.2f}"
        )


PLOT = ROOT / "docs" / "packing_efficiency.png"
PLOT_BUFFERS = (10, 20, 50, 100, 200, 500, 1000, 2000)
PLOT_STRATEGIES = ("first_fit", "best_fit", "bfd")
"""Strategies drawn against ``PLOT_BUFFERS``; greedy and the whole-epoch bfd are flat references."""


def efficiency(docs: list[dict[str, np.ndarray]], seq_len: int, strategy: str, buffer_size: int | None) -> float:
    """Real tokens / (rows * seq_len) over one epoch, counted from the rows' document ids."""
    pack = build(docs, seq_len, strategy, buffer_size)
    rows = real = 0
    for row in pack:
        rows += 1
        real += int(np.count_nonzero(row["document_ids"]))
    if real != pack.stats.tokens:
        raise RuntimeError(f"{strategy}({buffer_size}): {real} real tokens in the rows, {pack.stats.tokens} counted")
    return real / (rows * seq_len)


def efficiency_plot(count: int, seed: int) -> None:
    """Print efficiency per strategy and buffer size and write ``PLOT`` (``--plot``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    print(f"{count} documents per corpus, seed {seed}: efficiency = real tokens / (rows * seq_len)")
    header = f"{'corpus':<10} {'seq_len':>7} {'strategy':<18}" + "".join(f" {size:>7}" for size in PLOT_BUFFERS)
    print(header)
    print("-" * len(header))
    figure, panels = plt.subplots(2, 2, figsize=(9.6, 7.2), sharex=True)
    for (corpus, seq_len), axes in zip(CASES, panels.flat):
        sizes = lengths(corpus, count, seed)
        docs = documents(sizes, seed)
        for strategy in PLOT_STRATEGIES:
            values = [efficiency(docs, seq_len, strategy, size) for size in PLOT_BUFFERS]
            label = "bfd (window)" if strategy == "bfd" else strategy
            print(f"{corpus:<10} {seq_len:>7} {label:<18}" + "".join(f" {value:>7.2%}" for value in values))
            axes.plot(PLOT_BUFFERS, [100 * value for value in values], marker="o", markersize=3, label=label)
        for strategy, style, label in (("greedy", ":", "greedy (no buffer)"), ("bfd", "--", "bfd (whole epoch)")):
            value = efficiency(docs, seq_len, strategy, None)
            print(f"{corpus:<10} {seq_len:>7} {label:<18} {value:>7.2%}  (every buffer size)")
            axes.axhline(100 * value, color="grey" if strategy == "greedy" else "black", linestyle=style, label=label)
        axes.axhline(100 * lower_bound(sizes, seq_len), color="black", linewidth=0.5, label="bound")
        axes.set_xscale("log")
        axes.set_title(f"{corpus}-like lengths, seq_len {seq_len}", fontsize=9)
        axes.grid(True, which="both", linewidth=0.3)
    for axes in panels[-1]:
        axes.set_xlabel("buffer_size (documents)")
    for axes in panels[:, 0]:
        axes.set_ylabel("efficiency (% real tokens)")
    panels.flat[0].legend(fontsize=7)
    figure.suptitle(f"Packing efficiency by strategy and buffer size ({count:,} documents per corpus)")
    figure.tight_layout()
    figure.savefig(PLOT, dpi=120)
    print(f"wrote {PLOT.relative_to(ROOT)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=20_000, help="documents per corpus")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--balance", action="store_true", help="measure length balance over time instead")
    parser.add_argument("--payloads", action="store_true", help="measure throughput with payload fields instead")
    parser.add_argument("--plan", action="store_true", help="time the whole-epoch plan alone instead")
    parser.add_argument("--plot", action="store_true", help=f"write {PLOT.relative_to(ROOT)} instead")
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core
    if args.balance:
        balance(args.docs, args.seed)
        return
    if args.payloads:
        payload_throughput(args.docs, args.seed)
        return
    if args.plan:
        plan_build(args.docs, args.seed)
        return
    if args.plot:
        efficiency_plot(args.docs, args.seed)
        return

    header = (
        f"{'corpus':<10} {'seq_len':>7} {'strategy':<10} {'buffer':>6} {'rows':>6} {'efficiency':>10} "
        f"{'bound':>7} {'Mtok/s':>7} {'get_state':>10} {'state':>8} {'restore':>8}"
    )
    print(f"{args.docs} documents per corpus, seed {args.seed}, int32 token arrays, one core")
    print(header)
    print("-" * len(header))
    for corpus, seq_len in CASES:
        sizes = lengths(corpus, args.docs, args.seed)
        docs = documents(sizes, args.seed)
        bound = lower_bound(sizes, seq_len)
        for strategy, buffer_size in STRATEGIES:
            result = measure(docs, seq_len, strategy, buffer_size)
            buffer_text = "epoch" if strategy == "bfd" and buffer_size is None else str(buffer_size or "-")
            print(
                f"{corpus:<10} {seq_len:>7} {strategy:<10} {buffer_text:>6} {result['rows']:>6} "
                f"{result['efficiency']:>9.2%} {bound:>7.2%} {result['mtok_s']:>7.1f} "
                f"{result['state_us']:>8.0f}us {result['state_kb']:>6.1f}kB {result['restore_ms']:>6.1f}ms"
            )
        reference = online_best_fit(sizes, seq_len, 1000)
        print(f"{corpus:<10} {seq_len:>7} {'online-bf':<10} {1000:>6} {'':>6} {reference:>9.2%} {bound:>7.2%}")
    print(
        "mean document lengths: "
        + ", ".join(f"{name} {float(np.exp(mu + sigma**2 / 2)):.0f}" for name, (mu, sigma) in CORPORA.items())
    )


if __name__ == "__main__":
    main()
