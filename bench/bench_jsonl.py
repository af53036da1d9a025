"""JSONL source against a bare ``orjson`` loop on the same file, in one run.

    python bench/bench_jsonl.py [--size-mb 300] [--repeats 3]
    python bench/bench_jsonl.py --small [--records 1000000] [--repeats 5]
    python bench/bench_jsonl.py [--small] --baseline DIR/resumable_old

Prints docs/s of sequential and shuffled iteration against ``for line in f: orjson.loads(line)``,
resume latency (``set_state`` + first record) at 1%, 50% and 99% of the file (with Hugging Face
``datasets`` streaming JSON beside it when installed), and ``get_state()`` cost on a chain.

The default corpus holds 1-5 kB documents (``bench/corpus.py``). ``--small`` generates one file of
``--records`` records of about 100-130 bytes instead, where Python's per-record cost dominates, and
reports medians over the interleaved rounds rather than the best, by wall clock and by CPU time.

``--baseline`` compares with another version of the package in the same process: a copy of its
``resumable`` directory renamed (with its imports) to the directory's name, e.g. for commit C::

    mkdir -p /tmp/old && git archive C resumable | tar -x -C /tmp/old
    mv /tmp/old/resumable /tmp/old/resumable_old
    grep -rl resumable /tmp/old/resumable_old | xargs sed -i -E \
        's/\bfrom resumable([. ])/from resumable_old\1/g; s/\bimport resumable\b/import resumable_old/g'

Its runs join the interleaved rounds (medians by wall clock and CPU time, as with ``--small``),
and each resume point is measured ``RESUME_PAIRS`` times per version, alternating, as medians.
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import time
import timeit
from typing import Any, Callable

import numpy as np
import orjson

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import resumable as rs  # noqa: E402
from bench.corpus import make_jsonl_corpus  # noqa: E402
from bench.timing import best_of, drain  # noqa: E402

DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
RESUME_POINTS = (0.01, 0.5, 0.99)
SMALL_RECORDS = 1_000_000
SMALL_LINE_BYTES = (100, 130)
"""Range of a small record's line length in bytes, newline included (uniform)."""
SMALL_WORD_LETTERS = (2, 9)
"""Range of a word's length in letters in the small corpus (uniform)."""
RESUME_PAIRS = 30
"""Resumes per point and version with ``--baseline`` (alternating), reported as medians."""


def make_small_corpus(path: str, records: int, seed: int = 0) -> str:
    """Write ``records`` lines ``{"id": i, "text": "..."}`` of about 100-130 bytes each (random lowercase
    words) at ``path`` and return it; an existing file is reused. Written to a temp name and
    renamed, so a killed run never leaves a truncated corpus behind."""
    if os.path.exists(path):
        return path
    rng = np.random.default_rng(seed)
    lengths = rng.integers(SMALL_LINE_BYTES[0], SMALL_LINE_BYTES[1] + 1, records)
    # Random words: letters with a space after each word, one long pool sliced per record.
    letters = rng.integers(ord("a"), ord("z") + 1, int(lengths.sum()), dtype=np.uint8)
    gaps = np.cumsum(rng.integers(SMALL_WORD_LETTERS[0] + 1, SMALL_WORD_LETTERS[1] + 2, len(letters) // 3))
    letters[gaps[gaps < len(letters)]] = ord(" ")
    pool = letters.tobytes()
    lines = []
    at = 0
    for record, length in enumerate(lengths.tolist()):
        head = b'{"id": %d, "text": "' % record
        size = max(1, length - len(head) - 3)  # the closing '"}' and the newline
        lines.append(b'%s%s"}\n' % (head, pool[at : at + size].strip() or b"x"))
        at += size
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    temp = f"{path}.{os.getpid()}.tmp"
    with open(temp, "wb") as out:
        out.write(b"".join(lines))
    os.replace(temp, path)
    return path


def interleaved_rounds(repeats: int, runs: dict[str, Callable[[], int]]) -> dict[str, list[tuple[float, float, int]]]:
    """``(wall seconds, CPU seconds, items)`` of each run in each of ``repeats`` rounds, the runs
    interleaved within a round so that machine noise hits all of them alike."""
    rounds: dict[str, list[tuple[float, float, int]]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            wall, cpu = time.perf_counter(), time.process_time()
            count = run()
            rounds[name].append((time.perf_counter() - wall, time.process_time() - cpu, count))
    return rounds


def print_median_ratios(rounds: dict[str, list[tuple[float, float, int]]], base: str, size_mb: float) -> None:
    """Median docs/s of each run, and the medians over rounds of its speed relative to ``base``
    in the same round, by wall clock and by CPU time (CPU time is steadier on a shared machine)."""
    width = max(22, *(len(name) + 2 for name in rounds))
    print(f"\n{'iteration':<{width}}{'docs/s':>12}{'MB/s':>9}{'ratio':>8}{'CPU ratio':>11}")
    for name, times in rounds.items():
        if {count for _, _, count in times} != {times[0][2]} or times[0][2] != rounds[base][0][2]:
            raise SystemExit(f"{name} read another number of records than {base}")
        seconds = statistics.median(wall for wall, _, _ in times)
        wall_ratio = statistics.median(b[0] / t[0] for b, t in zip(rounds[base], times))
        cpu_ratio = statistics.median(b[1] / t[1] for b, t in zip(rounds[base], times))
        count = times[0][2]
        print(f"{name:<{width}}{count / seconds:>12,.0f}{size_mb / seconds:>9.0f}{wall_ratio:>8.2f}{cpu_ratio:>11.2f}")


def bare_loop(path: str) -> int:
    """The baseline: a plain binary line loop decoding each line with orjson."""
    count = 0
    with open(path, "rb") as handle:
        for line in handle:
            orjson.loads(line)
            count += 1
    return count


def resume_latency(build: Callable[[], rs.Node], position: int) -> tuple[float, float]:
    """Seconds to build the pipeline, and to ``set_state`` at ``position`` plus the first record."""
    state = build().get_state()
    state["position"] = position
    start = time.perf_counter()
    pipe = build()
    built = time.perf_counter()
    pipe.set_state(state)
    next(pipe)
    return built - start, time.perf_counter() - built


def baseline_package(path: str) -> Any:
    """The package copy at ``path`` (a directory named like the package it holds), imported."""
    directory, name = os.path.split(os.path.abspath(path))
    sys.path.insert(0, directory)
    return importlib.import_module(name)


def paired_resume_latency(packages: dict[str, Any], path: str, position: int, shuffled: bool) -> dict[str, float]:
    """Median seconds of ``set_state`` at ``position`` plus the first record for each package,
    ``RESUME_PAIRS`` resumes each, alternating between the packages."""
    seconds: dict[str, list[float]] = {name: [] for name in packages}
    for turn in range(RESUME_PAIRS):
        for name in list(packages)[:: 1 if turn % 2 == 0 else -1]:
            package = packages[name]

            def build(package: Any = package) -> Any:
                source = package.jsonl(path)
                return source.shuffle(0) if shuffled else source

            seconds[name].append(resume_latency(build, position)[1])
    return {name: statistics.median(values) for name, values in seconds.items()}


def hf_resume_latency(path: str, position: int) -> float | None:
    """Hugging Face ``datasets`` streaming JSON: ``load_state_dict`` at ``position`` + first record."""
    try:
        import datasets
    except ImportError:
        return None
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    datasets.disable_progress_bars()

    def load() -> Any:
        return datasets.load_dataset("json", data_files=path, split="train", streaming=True)

    probe = load()
    next(iter(probe))
    state = probe.state_dict()
    _set_example_index(state, position)
    start = time.perf_counter()
    resumed = load()
    resumed.load_state_dict(state)
    next(iter(resumed))
    return time.perf_counter() - start


def _set_example_index(state: Any, position: int) -> None:
    """Point a datasets IterableDataset state at ``position`` within its (single) shard."""
    if isinstance(state, dict):
        for key, value in state.items():
            if key == "shard_example_idx":
                state[key] = position
            else:
                _set_example_index(value, position)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=None, help="rounds of the runs (default 3, 5 with --small)")
    parser.add_argument("--small", action="store_true", help="records of 100-130 bytes instead of 1-5 kB")
    parser.add_argument("--records", type=int, default=SMALL_RECORDS, help="records in the --small corpus")
    parser.add_argument("--no-hf", action="store_true", help="skip the Hugging Face datasets comparison")
    parser.add_argument("--baseline", help="directory of another version of the package, compared side by side")
    args = parser.parse_args()

    if args.small:
        path = make_small_corpus(os.path.join(DATA_DIR, f"small-{args.records}.jsonl"), args.records)
        repeats = args.repeats or 5
    else:
        path = make_jsonl_corpus(os.path.join(DATA_DIR, f"corpus-{args.size_mb}mb.jsonl"), args.size_mb << 20)
        repeats = args.repeats or 3
    size_mb = os.path.getsize(path) / 1e6
    with open(path, "rb") as handle:  # warm the page cache
        while handle.read(64 << 20):
            pass
    records = len(rs.jsonl(path))  # builds or loads the line index
    print(f"file: {path} ({size_mb:.0f} MB, {records:,} records, {size_mb * 1e6 / records:,.0f} B/record)")
    summary = "median" if args.small or args.baseline else "best"
    print(f"{summary} of {repeats} interleaved rounds, load average {os.getloadavg()[0]:.1f}")

    runs: dict[str, Callable[[], int]] = {
        "bare orjson loop": lambda: bare_loop(path),
        "rs.jsonl": lambda: drain(rs.jsonl(path)),
        "rs.jsonl.shuffle(0)": lambda: drain(rs.jsonl(path).shuffle(0)),
    }
    baseline = None if args.baseline is None else baseline_package(args.baseline)
    if baseline is not None:
        name = baseline.__name__
        runs[f"{name}.jsonl"] = lambda: drain(baseline.jsonl(path))
        runs[f"{name}.jsonl.shuffle(0)"] = lambda: drain(baseline.jsonl(path).shuffle(0))
    if args.small or baseline is not None:
        print_median_ratios(interleaved_rounds(repeats, runs), "bare orjson loop", size_mb)
    else:
        best = best_of(repeats, runs)
        base_seconds, base_count = best["bare orjson loop"]
        print(f"\n{'iteration':<22}{'docs/s':>12}{'MB/s':>9}{'ratio':>8}")
        for name, (seconds, count) in best.items():
            if count != base_count:
                raise SystemExit(f"{name} read {count} records, the bare loop {base_count}")
            print(f"{name:<22}{count / seconds:>12,.0f}{size_mb / seconds:>9.0f}{base_seconds / seconds:>8.2f}")

    if baseline is not None:
        packages = {"rs": rs, baseline.__name__: baseline}
        print(f"\nresume (set_state + first record), median of {RESUME_PAIRS} alternating, ms")
        print(
            f"{'resume at':<12}"
            + "".join(f"{name + (' shuffled' if s else ''):>26}" for s in (0, 1) for name in packages)
        )
        for fraction in RESUME_POINTS:
            position = int(records * fraction)
            sequential = paired_resume_latency(packages, path, position, shuffled=False)
            shuffled = paired_resume_latency(packages, path, position, shuffled=True)
            cells = [sequential[name] for name in packages] + [shuffled[name] for name in packages]
            print(f"{fraction:<12.0%}" + "".join(f"{cell * 1e3:>26.3f}" for cell in cells))
        print(f"load average {os.getloadavg()[0]:.1f}")
        return

    print(f"\n{'resume at':<12}{'build ms':>10}{'set_state+next ms':>19}{'shuffled ms':>13}{'HF datasets ms':>16}")
    for fraction in RESUME_POINTS:
        position = int(records * fraction)
        build_s, resume_s = min(resume_latency(lambda: rs.jsonl(path), position) for _ in range(5))
        shuffled_s = min(resume_latency(lambda: rs.jsonl(path).shuffle(0), position)[1] for _ in range(5))
        hf = None if args.no_hf else hf_resume_latency(path, position)
        hf_text = "n/a" if hf is None else f"{hf * 1e3:.0f}"
        print(f"{fraction:<12.0%}{build_s * 1e3:>10.2f}{resume_s * 1e3:>19.3f}{shuffled_s * 1e3:>13.3f}{hf_text:>16}")

    chain = rs.jsonl(path).shuffle(0).shard(0, 1).map(lambda r: r["text"]).filter(bool).batch(8)
    next(chain)
    calls = 20000
    cost = min(timeit.repeat(chain.get_state, number=calls, repeat=3)) / calls
    print(f"\nget_state() on jsonl>shuffle>shard>map>filter>batch: {cost * 1e6:.2f} us per call")


if __name__ == "__main__":
    main()
