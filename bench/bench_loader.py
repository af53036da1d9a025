"""End to end through DataLoader workers: ``rs.torch.Loader`` with a state taken after every
batch against a plain torch DataLoader over the same pipeline, in one run.

Two pipelines over the same JSONL corpus:

- ``tokens``: JSONL -> shuffle -> shard -> map(byte tokenise, cut to 512) -> batch(8);
- ``packed``: JSONL -> shuffle -> shard -> map(byte tokenise) -> pack(2048, best_fit,
  buffer_size=1000) -> batch(8), whose state holds a 1000-document buffer's references;
- ``bpe``: ``packed`` with a real tokenizer, the byte-level BPE of ``bench_tokenize.py``
  (``tokenizers``, from the ``bench`` extra; trained on its 20 MB corpus, cached): the work of
  a training job's loader, about 20 ms per batch on average, against which the state's fixed cost
  per batch is measured.

``tokens`` and ``packed`` cost 0.2-1 ms of work per batch, so they show the loader's own cost
per batch as large as it gets.

The baseline is a plain ``torch.utils.data.DataLoader`` over a plain ``IterableDataset`` of the
same pipeline, whose state is never taken. The Loader hands a state out with every batch and
the loop calls ``state_dict()`` after every step. The Loader's workers also hand each batch
over their own way (``resumable.torch.transport``: inline when small, else in one shared-memory
segment, where torch sends a segment per tensor), so a second baseline isolates the state's
cost: the plain DataLoader with the same transport (``same transport``). For each worker count
the loops take turns (in rotating order), ``--runs`` times; the ratio of each run is baseline
seconds / Loader seconds, and the table gives the medians. The CPU ratios divide the CPU
seconds of the timed batches (this process and its workers, read from ``/proc``; start-up
excluded, as from the wall time), which preemptions by other jobs do not inflate.
``state_dict/step`` is the loop's time in ``state_dict()`` over its whole time (each call timed
by ``perf_counter`` alone: a CPU-time clock read costs about as much as the call); ``(median)``
is the median call over the mean step instead, which leaves out the calls that waited for a
core (two workers and the loop share two cores here).

``--in-process`` measures instead what a worker adds per batch, in one process, which a loaded
machine disturbs far less than the end-to-end loops: two copies of the pipeline advance in
lockstep, one batch each in turn, one plain and one followed by what a Loader worker does with
every batch (``WorkerIterator.state_dict()``: ``get_state()`` and its JSON encoding), timed
in CPU seconds of the process (a loaded machine's preemptions do not count); the ratio is the
plain copy's seconds / the other's, the best a Loader can reach when its workers are the
bottleneck. ``state us`` is the wall time of that ``state_dict()`` call alone, right after the
batch (median over runs of the mean per batch; ``(median)``: of the median call, which leaves
out the batches whose state was a packer's whole one), ``kB`` the median size of the JSON it ships;
with ``--baseline``, a third copy built and saved by the other version advances in the same
lockstep (the two take turns going first).

    python bench/bench_loader.py [--batches N] [--workers 0 2 4] [--runs 5] [--pipelines tokens packed bpe]
    python bench/bench_loader.py --in-process [--batches N] [--runs 5] [--pipelines tokens packed bpe]
    PYTHONPATH=<dir> python bench/bench_loader.py --baseline resumable_before ...   # another version too

``--workers 0`` runs the loops without workers (no transport: ``same transport`` is the plain
DataLoader again), where ``state_dict()`` builds the pipeline's state at each call.

``--batches`` defaults to 1500 per run for ``tokens``, 400 for ``packed``, 500 for ``bpe``.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import os
import statistics
import sys
import time
import warnings
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, default_convert
from torchdata.stateful_dataloader import StatefulDataLoader

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import resumable as rs  # noqa: E402
import resumable.torch as rst  # noqa: E402
from bench.corpus import make_jsonl_corpus  # noqa: E402
from resumable.torch.dataset import WorkerIterator  # noqa: E402
from resumable.torch.transport import for_transport  # noqa: E402

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "corpus-100mb.jsonl")
CORPUS_BYTES = 100 << 20
SEQ_LEN = 2048
TOKENS_LEN = 512
"""Tokens kept per document by the ``tokens`` pipeline (fixed shapes, as a trainer wants)."""
BATCH = 8
PREFETCH_FACTOR = 4


def tokenize(record: dict[str, Any]) -> dict[str, np.ndarray]:
    """Byte-level tokens of the text: cheap, so the loader's own cost shows."""
    return {"input_ids": np.frombuffer(record["text"].encode(), dtype=np.uint8).astype(np.int32)}


def tokenize_fixed(record: dict[str, Any]) -> dict[str, np.ndarray]:
    """Byte-level tokens cut or padded to ``TOKENS_LEN``."""
    ids = np.zeros(TOKENS_LEN, dtype=np.int32)
    raw = np.frombuffer(record["text"].encode()[:TOKENS_LEN], dtype=np.uint8)
    ids[: len(raw)] = raw
    return {"input_ids": ids}


def stack(rows: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {"input_ids": np.stack([row["input_ids"] for row in rows])}


def build_tokens(package: Any = rs) -> rs.Node:
    """``package``: ``resumable``, or the copy a ``--baseline`` names."""
    return package.jsonl(DATA).shuffle(seed=0).shard().repeat().map(tokenize_fixed).batch(BATCH, collate_fn=stack)


def packed_pipeline(package: Any, tokenizer: Callable[[dict[str, Any]], dict[str, np.ndarray]]) -> rs.Node:
    """JSONL -> shuffle -> shard -> map(``tokenizer``) -> pack(best_fit, 1000) -> batch."""
    return (
        package.jsonl(DATA)
        .shuffle(seed=0)
        .shard()
        .repeat()
        .map(tokenizer)
        .pack(SEQ_LEN, strategy="best_fit", buffer_size=1000)
        .batch(BATCH, collate_fn=package.pack.collate_rows)
    )


def build_packed(package: Any = rs) -> rs.Node:
    return packed_pipeline(package, tokenize)


def build_bpe(package: Any = rs) -> rs.Node:
    from bench.bench_tokenize import Tokenize, corpus, trained_tokenizer  # the bench extra's tokenizers

    return packed_pipeline(package, Tokenize(trained_tokenizer(corpus(BPE_CORPUS_MB, BPE_CORPUS_FILES))))


BPE_CORPUS_MB, BPE_CORPUS_FILES = 20, 8
"""The corpus ``bench_tokenize.py`` trains its BPE on (the tokenizer is read from its cache)."""

PIPELINES: dict[str, Callable[[], rs.Node]] = {"tokens": build_tokens, "packed": build_packed, "bpe": build_bpe}
DEFAULT_BATCHES = {"tokens": 1500, "packed": 400, "bpe": 500}
"""Batches per run: about 1.5 s of work with 2 workers; ``bpe`` batches take about 20 ms of
tokenising on average, in bursts (the packer takes a few hundred documents at a time), so its
runs are long enough to hold several."""


class PlainDataset(IterableDataset):  # type: ignore[type-arg]  # torch's generic dataset, over plain dicts
    """The same pipeline as a plain IterableDataset: iterated, never asked for its state."""

    def __init__(self, build: Callable[[], rs.Node]) -> None:
        self.build = build

    def __iter__(self) -> Iterator[Any]:
        return iter(self.build())


class ConstantStateIterator:
    """The pipeline's iterator reporting a constant state of a worker state's size: what
    torchdata's own snapshot machinery costs per batch, without the pipeline's state."""

    def __init__(self, pipeline: rs.Node) -> None:
        self.pipeline = pipeline

    def __iter__(self) -> ConstantStateIterator:
        return self

    def __next__(self) -> Any:
        return next(self.pipeline)

    def state_dict(self) -> dict[str, Any]:
        return {"pipeline": CONSTANT_STATE, "epoch": 0}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Never called: the control loop is not restored."""


CONSTANT_STATE = "x" * 600
"""About the size of the ``tokens`` pipeline's state as JSON text."""


class ConstantStateDataset(PlainDataset):
    def __iter__(self) -> Iterator[Any]:
        return ConstantStateIterator(self.build())


def process_cpu(pid: int) -> float:
    """CPU seconds (user + system) of process ``pid`` so far, from ``/proc``."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def time_loop(loader: Any, batches: int, take_state: bool) -> tuple[float, float, list[float]]:
    """Over ``batches`` batches after a warm-up batch (workers started, buffers primed): wall
    seconds, CPU seconds of this process and the workers, and the wall seconds of each
    state_dict() call (on shared cores some include a preemption by the workers or other jobs)."""
    iterator = iter(loader)
    next(iterator)
    workers = [worker.pid for worker in getattr(iterator, "_workers", ())]  # torch's, for their CPU time
    calls: list[float] = []
    clock = time.perf_counter
    cpu = -time.process_time() - sum(map(process_cpu, workers))
    start = clock()
    for _ in range(batches):
        next(iterator)
        if take_state:
            before = clock()
            loader.state_dict()
            calls.append(clock() - before)
    elapsed = clock() - start
    cpu += time.process_time() + sum(map(process_cpu, workers))
    del iterator
    return elapsed, cpu, calls


def convert_for_transport(batch: Any) -> Any:
    """The plain DataLoader's conversion, then the Loader's transport (``resumable.torch.transport``)."""
    return for_transport(default_convert(batch))


def control_loader(build: Callable[[], rs.Node], **config: Any) -> StatefulDataLoader:
    """torchdata's StatefulDataLoader with a snapshot at every batch, over ``ConstantStateDataset``."""
    return StatefulDataLoader(ConstantStateDataset(build), batch_size=None, snapshot_every_n_steps=1, **config)


def compare(
    build: Callable[[], rs.Node],
    workers: int,
    batches: int,
    runs: int,
    baseline: Any = None,
    control: bool = False,
) -> dict[str, dict[str, float]]:
    """Medians over ``runs`` runs in rotating order, for the Loader (and the ``baseline``
    package's Loader, over its own copy of the pipeline): batches/s of its loop and of the
    plain one, their ratio by wall time and by CPU time (main process and workers, over the
    timed batches), and ``state_dict()``'s share of the Loader's step (its wall seconds over the
    loop's, and its median call over the mean step)."""
    loaders: dict[str, tuple[Callable[..., Any], Callable[[], rs.Node]]] = {"loader": (rst.Loader, build)}
    if baseline is not None:
        loaders["baseline"] = (baseline.torch.Loader, functools.partial(build, baseline))
    if control:
        loaders["control"] = (control_loader, build)
    kinds = ["plain", "transport", *loaders]
    prefetch = PREFETCH_FACTOR if workers else None  # torch refuses one without workers
    seconds: dict[str, list[float]] = {kind: [] for kind in kinds}
    cpu: dict[str, list[float]] = {kind: [] for kind in kinds}
    shares: dict[str, list[float]] = {kind: [] for kind in loaders}
    median_shares: dict[str, list[float]] = {kind: [] for kind in loaders}
    for run in range(runs):
        for kind in kinds[run % len(kinds) :] + kinds[: run % len(kinds)]:
            if kind in ("plain", "transport"):
                plain = DataLoader(
                    PlainDataset(build),
                    batch_size=None,
                    num_workers=workers,
                    prefetch_factor=prefetch,
                    collate_fn=convert_for_transport if kind == "transport" and workers else None,
                )
                wall, used, _ = time_loop(plain, batches, take_state=False)
            else:
                loader_class, builder = loaders[kind]
                loader = loader_class(builder, num_workers=workers, prefetch_factor=prefetch)
                wall, used, calls = time_loop(loader, batches, take_state=True)
                shares[kind].append(sum(calls) / wall)
                median_shares[kind].append(statistics.median(calls) * batches / wall)
                if kind == "control":
                    loader._iterator._shutdown_workers()  # torchdata's; it keeps its iterator
                else:
                    loader.close()
            seconds[kind].append(wall)
            cpu[kind].append(used)
    rows = {}
    for kind in loaders:
        ratios = [plain / ours for plain, ours in zip(seconds["plain"], seconds[kind])]
        rows[kind] = {
            "plain": batches / statistics.median(seconds["plain"]),
            "loader": batches / statistics.median(seconds[kind]),
            "ratio": statistics.median(ratios),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
            "cpu_ratio": statistics.median(plain / ours for plain, ours in zip(cpu["plain"], cpu[kind])),
            "transport_ratio": statistics.median(
                plain / ours for plain, ours in zip(seconds["transport"], seconds[kind])
            ),
            "transport_cpu_ratio": statistics.median(plain / ours for plain, ours in zip(cpu["transport"], cpu[kind])),
            "state_share": statistics.median(shares[kind]),
            "state_median_share": statistics.median(median_shares[kind]),
        }
    return rows


def worker_cost(
    build: Callable[..., rs.Node], batches: int, runs: int, baseline: Any = None
) -> dict[str, dict[str, float]]:
    """Medians over ``runs``: a worker's CPU seconds per batch without and with its state per
    batch, and their ratio (see ``--in-process``); with a ``baseline`` package, a third copy of
    the pipeline built and saved by it advances in the same lockstep."""
    versions: dict[str, tuple[Any, Any]] = {"this": (rs, WorkerIterator)}
    if baseline is not None:
        versions["baseline"] = (baseline, importlib.import_module(f"{baseline.__name__}.torch.dataset").WorkerIterator)
    times: dict[str, list[float]] = {"plain": [], **{name: [] for name in versions}}
    ratios: dict[str, list[float]] = {name: [] for name in versions}
    state_times: dict[str, list[float]] = {name: [] for name in versions}
    state_medians: dict[str, list[float]] = {name: [] for name in versions}
    sizes: dict[str, list[int]] = {name: [] for name in versions}
    for _ in range(runs):
        plain = build()
        workers = {name: iterator(build(package), epoch=0) for name, (package, iterator) in versions.items()}
        next(plain)  # buffers primed
        for worker in workers.values():
            next(worker)
        spent = dict.fromkeys(times, 0.0)
        calls: dict[str, list[float]] = {name: [] for name in versions}
        order = list(workers.items())
        for batch in range(batches):
            start = time.process_time()
            next(plain)
            spent["plain"] += time.process_time() - start
            for name, worker in order if batch % 2 else order[::-1]:  # neither version always second
                start = time.process_time()
                next(worker)
                middle = time.perf_counter()
                shipped = worker.state_dict()
                calls[name].append(time.perf_counter() - middle)
                spent[name] += time.process_time() - start
                sizes[name].append(len(shipped["pipeline"]))
        plain.close()
        for worker in workers.values():
            worker.pipeline.close()
        for name, seconds in spent.items():
            times[name].append(seconds / batches)
        for name in versions:
            ratios[name].append(spent["plain"] / spent[name])
            state_times[name].append(sum(calls[name]) / batches)
            state_medians[name].append(statistics.median(calls[name]))
    return {
        name: {
            "plain": statistics.median(times["plain"]),
            "stated": statistics.median(times[name]),
            "ratio": statistics.median(ratios[name]),
            "ratio_min": min(ratios[name]),
            "ratio_max": max(ratios[name]),
            "state_us": 1e6 * statistics.median(state_times[name]),
            "state_median_us": 1e6 * statistics.median(state_medians[name]),
            "kB": statistics.median(sizes[name]) / 1000,
        }
        for name in versions
    }


def batches_label(args: argparse.Namespace) -> str:
    if args.batches:
        return f"{args.batches} batches"
    return ", ".join(f"{DEFAULT_BATCHES[name]} batches ({name})" for name in args.pipelines)


def main_in_process(args: argparse.Namespace, baseline: Any) -> None:
    print(
        f"in one process: {batches_label(args)} of {BATCH} rows per run, {args.runs} runs, medians; "
        "a plain copy and a copy taking a worker's state after every batch, in lockstep"
    )
    print(
        f"{'pipeline':<10}{'version':<10}{'plain ms/b':>12}{'state ms/b':>12}{'ratio':>8}{'(min-max)':>14}"
        f"{'state us':>10}{'(median)':>10}{'kB':>7}"
    )
    for name in args.pipelines:
        rows = worker_cost(PIPELINES[name], args.batches or DEFAULT_BATCHES[name], args.runs, baseline)
        for version, row in rows.items():
            spread = f"{row['ratio_min']:.3f}-{row['ratio_max']:.3f}"
            print(
                f"{name:<10}{version:<10}{1e3 * row['plain']:>12.3f}{1e3 * row['stated']:>12.3f}"
                f"{row['ratio']:>8.3f}{spread:>14}{row['state_us']:>10.1f}{row['state_median_us']:>10.1f}{row['kB']:>7.1f}",
                flush=True,
            )


def main() -> None:
    # More workers than cores is what --workers 4 measures on a small machine: torch's advice is known.
    warnings.filterwarnings("ignore", message="This DataLoader will create", category=UserWarning)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=None, help="per run (default: tokens 1500, packed 400, bpe 500)")
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--pipelines", nargs="+", choices=sorted(PIPELINES), default=list(PIPELINES))
    parser.add_argument("--in-process", action="store_true", help="a worker's cost per batch, in one process")
    parser.add_argument(
        "--control",
        action="store_true",
        help="also torchdata's StatefulDataLoader snapshotting every batch, over iterators whose state is a "
        "constant string: torchdata's own cost per batch",
    )
    parser.add_argument(
        "--baseline",
        help="module name of another version of the package (a copy renamed, on PYTHONPATH): its Loader "
        "runs as a third loop, in rotating order with the other two",
    )
    args = parser.parse_args()
    baseline = importlib.import_module(args.baseline) if args.baseline else None
    if baseline is not None:
        importlib.import_module(f"{args.baseline}.torch")
    make_jsonl_corpus(DATA, CORPUS_BYTES)
    len(rs.jsonl(DATA))  # index built before timing
    if "bpe" in args.pipelines:
        build_bpe().close()  # its tokenizer trained and cached here, not by the first workers at once
    torch.set_num_threads(1)
    if args.in_process:
        main_in_process(args, baseline)
        return

    print(
        f"{batches_label(args)} of {BATCH} rows per run, {args.runs} runs in rotating order, medians; "
        "Loader: a state with every batch and state_dict() after every step"
    )
    width = 10 + max(len(args.baseline or "") + 2, 9 if args.control else 0)
    print(
        f"{'pipeline':<{width}}{'workers':>8}{'plain b/s':>11}{'Loader b/s':>12}{'ratio':>8}{'(min-max)':>14}"
        f"{'state_dict/step':>17}{'(median)':>11}{'CPU ratio':>11}{'same transport':>16}{'(CPU)':>8}"
    )
    for name in args.pipelines:
        for workers in args.workers:
            batches = args.batches or DEFAULT_BATCHES[name]
            rows = compare(PIPELINES[name], workers, batches, args.runs, baseline, args.control)
            for kind, row in rows.items():
                label = {"loader": name, "baseline": f"{name}, {args.baseline}", "control": f"{name}, control"}[kind]
                spread = f"{row['ratio_min']:.2f}-{row['ratio_max']:.2f}"
                print(
                    f"{label:<{width}}{workers:>8}{row['plain']:>11.1f}{row['loader']:>12.1f}{row['ratio']:>8.3f}"
                    f"{spread:>14}{100 * row['state_share']:>16.2f}%{100 * row['state_median_share']:>10.2f}%"
                    f"{row['cpu_ratio']:>11.3f}{row['transport_ratio']:>16.3f}{row['transport_cpu_ratio']:>8.3f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
