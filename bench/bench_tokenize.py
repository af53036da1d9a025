"""Tokenisation and packing end to end (issue 13): our pipeline against the same job written
with Hugging Face ``datasets`` under torchdata's ``StatefulDataLoader``, in one run.

    .venv/bin/python bench/bench_tokenize.py [--size-mb 50] [--files 8] [--workers 1 2] [--runs 3]
        [--hf 1000/2/in 100/32/in ...]                  # the datasets variants to compare with
    .venv/bin/python bench/bench_tokenize.py --profile    # cProfile of our consumer process, k=1

1. A JSONL corpus of ``--size-mb`` MB in ``--files`` files (``bench/corpus.py``: Zipf words,
   log-normal lengths, mean ~3.9 kB a document) and a byte-level BPE (``tokenizers``: ByteLevel
   pre-tokenizer, 8,192 tokens, ``<pad>`` = 0) trained on it, both cached in ``bench/data/``.
2. Ours: ``rs.jsonl(paths).shuffle(seed=0).shard(0, 1).map(tokenize, num_workers=k,
   mode="process").pack(2048, strategy="best_fit", buffer_size=1000).batch(8)``, iterated in
   this process with ``get_state()`` after every batch; and "ours batched", the same with
   ``.map(tokenize.records, num_workers=k, mode="thread", batched=True)``: one ``encode_batch``
   per chunk of records (up to 64), which the Rust tokenizer runs without the GIL, so ``k``
   threads tokenise in parallel and no record or result is pickled.
3. ``datasets``: ``load_dataset("json", data_files=paths, streaming=True, split="train")
   .shuffle(seed=0, buffer_size=1000).map(tokenize.batch, batched=True)``, a greedy (next-fit)
   packer written here, batches of 8 from ``StatefulDataLoader(num_workers=k)``. A streaming
   dataset splits its *files* over the DataLoader workers, so the corpus is written as several
   files: with one file, ``datasets`` would run one worker whatever ``k`` is.
   Each ``--hf`` spec ``B/P/O`` is one variant of this job: ``B`` records per ``encode_batch``
   call (``datasets``' default 1,000), the DataLoader's ``prefetch_factor`` ``P`` (its default
   2) and ``in_order`` (``in``) or not (``out``). The first spec, ``1000/2/in``, is the job as
   a user writes it; the others are tuned: with 1,000 records a call (seconds of tokenising)
   each worker yields rows in bursts, and a DataLoader that takes batches from its workers in
   turn, at most ``P`` ahead each, leaves one worker idle while the other tokenises.

All read the whole corpus; all tokenise with the same ``Tokenize`` object (``encode`` per
record for ours, ``encode_batch`` per chunk for ours batched and per 1,000 records for
``datasets``), with the Rust
tokenizer's own thread pool off (``TOKENIZERS_PARALLELISM=false``) so that ``k`` is the only
parallelism. Real tokens are the non-padding ``input_ids`` of the emitted batches; the
seconds run from building the pipeline to its last batch, so they include starting the
workers and, for ours, filling the packer's buffer. CPU seconds per million real tokens add up
this process and every worker (``/proc`` and reaped children): on a shared machine they show the
cost of each job more steadily than its speed; CPU seconds over wall seconds are the cores the
job kept busy. For ``datasets``, each worker clocks the time its packer spends suspended, waiting
for the DataLoader to ask for the next row, against the time it spends producing rows: a worker
that waits while cores are free shows a loader that serialises, whatever else the machine runs.
Each ``k`` runs ``--runs`` times, the jobs alternating (the order reversed every other run); the
table gives medians, and each ratio (one of ours / that job's throughput) is the median of the
runs' ratios.

Before the table the script checks that a process-mode map works with the tokenizer: a
``Tokenize`` pickles by its file path (each worker loads the tokenizer once), while a callable
holding the ``Tokenizer`` object itself pickles the whole model, which a process map sends with
every record; both are timed over the same records.
"""

from __future__ import annotations

import os

# The workers are the parallelism under test: keep the Rust tokenizer's thread pool off in every
# process (DataLoader workers forked after it ran would switch it off anyway, with a warning).
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import cProfile  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import multiprocessing  # noqa: E402
import pickle  # noqa: E402
import pstats  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Any, Callable, Iterator  # noqa: E402

import numpy as np  # noqa: E402
import orjson  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import resumable as rs  # noqa: E402
from bench.corpus import make_jsonl_corpus  # noqa: E402
from resumable.pack import collate_rows  # noqa: E402

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
SEQ_LEN = 2048
BATCH = 8
BUFFER = 1000
"""The packer's buffer (ours) and the shuffle buffer (``datasets``), in documents."""
VOCAB_SIZE = 8192
PAD = "<pad>"
PAD_ID = 0
"""``<pad>`` is the first special token, so its id is 0: the packer's default ``pad_token_id``."""
IGNORE = -100
"""Label at padding, as our packer writes it."""
HF_MAP_BATCH = 1000
"""Records per ``encode_batch`` call in the ``datasets`` job (``datasets``' own default)."""
HF_PREFETCH = 2
"""Batches each DataLoader worker may have ready ahead (``prefetch_factor``'s default)."""
HF_VARIANTS = ["1000/2/in", "1000/128/in"]
"""``datasets`` variants compared by default (``--hf``): the job as written, and the tuned one."""
PICKLE_CHECK_RECORDS = 40
"""Records mapped in each process-mode pickling check."""


# -- corpus and tokenizer ----------------------------------------------------------------------


def corpus(size_mb: int, files: int) -> list[str]:
    """Paths of the benchmark corpus: ``files`` JSONL files of ``size_mb / files`` MB each."""
    folder = os.path.join(DATA, f"tokenize-{size_mb}mb-{files}")
    per_file = (size_mb << 20) // files
    return [make_jsonl_corpus(os.path.join(folder, f"part-{i:02d}.jsonl"), per_file, seed=i) for i in range(files)]


def texts(paths: list[str]) -> Iterator[str]:
    """Every document's text, file by file."""
    for path in paths:
        with open(path, "rb") as lines:
            for line in lines:
                yield orjson.loads(line)["text"]


def trained_tokenizer(paths: list[str]) -> str:
    """Path of a byte-level BPE trained on ``paths``: trained once, then read from its file."""
    path = os.path.join(os.path.dirname(paths[0]), f"bpe-{VOCAB_SIZE}.json")
    if os.path.exists(path):
        return path
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=[PAD], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    start = time.perf_counter()
    tokenizer.train_from_iterator(texts(paths), trainer)
    if tokenizer.token_to_id(PAD) != PAD_ID:
        raise RuntimeError(f"{PAD} got id {tokenizer.token_to_id(PAD)}, expected {PAD_ID}")
    temp = f"{path}.{os.getpid()}.tmp"
    tokenizer.save(temp)
    os.replace(temp, path)
    print(f"trained the BPE ({VOCAB_SIZE} tokens) in {time.perf_counter() - start:.1f} s: {path}")
    return path


@functools.lru_cache(maxsize=None)
def load_tokenizer(path: str) -> Tokenizer:
    """The tokenizer saved at ``path``, loaded once per process."""
    return Tokenizer.from_file(path)


class Tokenize:
    """The tokenisation both jobs run: ``tokenize(record)`` for ours, ``tokenize.batch(columns)``
    for a batched ``datasets`` map.

    It pickles as its file path, so a process pool ships a few bytes per task and each worker
    loads the tokenizer once.
    """

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[type[Tokenize], tuple[str]]:
        return (Tokenize, (self.path,))

    def __call__(self, record: dict[str, Any]) -> dict[str, np.ndarray]:
        ids = load_tokenizer(self.path).encode(record["text"]).ids
        return {"input_ids": np.array(ids, dtype=np.int32)}

    def batch(self, columns: dict[str, list[Any]]) -> dict[str, list[list[int]]]:
        encodings = load_tokenizer(self.path).encode_batch(columns["text"])
        return {"input_ids": [encoding.ids for encoding in encodings]}

    def records(self, records: list[dict[str, Any]]) -> list[dict[str, np.ndarray]]:
        """``self(record)`` for each record in one ``encode_batch`` call, which the Rust
        tokenizer runs without holding the GIL: a batched map over a thread pool."""
        encodings = load_tokenizer(self.path).encode_batch([record["text"] for record in records])
        return [{"input_ids": np.array(encoding.ids, dtype=np.int32)} for encoding in encodings]


class TokenizeHolding:
    """The same function holding the ``Tokenizer`` object itself: what a user writes first.
    It pickles the whole model (vocabulary and merges)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def __call__(self, record: dict[str, Any]) -> dict[str, np.ndarray]:
        return {"input_ids": np.array(self.tokenizer.encode(record["text"]).ids, dtype=np.int32)}


def check_process_map(path: str, paths: list[str]) -> None:
    """Map the same records in a one-process pool with both tokenising callables; print the
    pickled sizes and the seconds per record, and check they give the same tokens."""
    records = [{"text": text} for _, text in zip(range(PICKLE_CHECK_RECORDS), texts(paths))]
    callables: dict[str, Callable[[dict[str, Any]], dict[str, np.ndarray]]] = {
        "Tokenize (by path)": Tokenize(path),
        "holding the Tokenizer": TokenizeHolding(Tokenizer.from_file(path)),
    }
    results = {}
    for name, fn in callables.items():
        pipe = rs.from_list(records).map(fn, num_workers=1, mode="process")
        next(pipe)  # the pool started, the first task done
        start = time.perf_counter()
        rest = list(pipe)
        per_record = (time.perf_counter() - start) / len(rest)
        pipe.close()
        results[name] = rest
        print(f"  process map, {name}: pickles to {len(pickle.dumps(fn)):,} bytes; {1e3 * per_record:.2f} ms/record")
    first, second = results.values()
    if not all(np.array_equal(a["input_ids"], b["input_ids"]) for a, b in zip(first, second, strict=True)):
        raise RuntimeError("the two tokenising callables gave different tokens")


# -- the two jobs --------------------------------------------------------------------------------


def descendants_cpu() -> dict[int, float]:
    """CPU seconds (user + system) of every live process below this one, by pid, from /proc."""
    parents: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat_file:
                stat = stat_file.read()
        except OSError:
            continue  # exited meanwhile
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (name) "
        parents[int(entry)] = int(fields[PROC_PPID])
        cpu[int(entry)] = (int(fields[PROC_UTIME]) + int(fields[PROC_STIME])) / CLOCK_TICKS
    below, frontier = set(), [os.getpid()]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent and pid not in below]
        below.update(children)
        frontier.extend(children)
    return {pid: cpu[pid] for pid in below}


PROC_PPID, PROC_UTIME, PROC_STIME = 1, 11, 12
"""Fields of /proc/<pid>/stat after the command name."""
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


class CpuClock:
    """CPU seconds spent by this process and every process below it between ``__init__`` and
    ``read()``: this process's own time, the children already reaped (DataLoader workers) and
    the live descendants (a process pool's workers, started by the forkserver)."""

    def __init__(self) -> None:
        self.own = time.process_time()
        self.reaped = self._reaped()
        self.live = descendants_cpu()

    @staticmethod
    def _reaped() -> float:
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        return usage.ru_utime + usage.ru_stime

    def read(self) -> float:
        live = descendants_cpu()
        grown = sum(seconds - self.live.get(pid, 0.0) for pid, seconds in live.items())
        return time.process_time() - self.own + self._reaped() - self.reaped + grown


class Run:
    """What one run of a job measured."""

    def __init__(
        self, seconds: float, first_batch: float, tokens: int, rows: int, cpu: float, idle: float | None = None
    ) -> None:
        self.seconds = seconds
        self.first_batch = first_batch
        self.tokens = tokens
        self.rows = rows
        self.cpu = cpu
        self.idle = idle
        """The workers' mean share of their time waiting to be asked for a row (``datasets`` only)."""

    @property
    def efficiency(self) -> float:
        return self.tokens / (self.rows * SEQ_LEN)

    @property
    def cores(self) -> float:
        """Cores kept busy on average: CPU seconds over wall seconds."""
        return self.cpu / self.seconds


@dataclasses.dataclass(frozen=True)
class HfConfig:
    """One variant of the ``datasets`` job: records per ``encode_batch`` call, the DataLoader's
    ``prefetch_factor``, and whether it hands batches out in worker order."""

    map_batch: int = HF_MAP_BATCH
    prefetch: int = HF_PREFETCH
    in_order: bool = True

    @classmethod
    def parse(cls, spec: str) -> HfConfig:
        """``B/P/O``, e.g. ``1000/2/in`` or ``100/32/out``."""
        parts = spec.split("/")
        if len(parts) != 3 or not parts[0].isdigit() or not parts[1].isdigit() or parts[2] not in ("in", "out"):
            raise argparse.ArgumentTypeError(f"--hf {spec!r}: expected BATCH/PREFETCH/in|out, e.g. 1000/2/in")
        return cls(int(parts[0]), int(parts[1]), parts[2] == "in")

    @property
    def label(self) -> str:
        return f"datasets {self.map_batch}/{self.prefetch}/{'in' if self.in_order else 'out'}"


def ours(paths: list[str], tokenize: Tokenize, workers: int, batched: bool = False) -> Run:
    """Our pipeline over the whole corpus, a state taken after every batch: ``tokenize`` per
    record in a process pool, or with ``batched``, ``tokenize.records`` per chunk of records in
    a thread pool (``encode_batch`` releases the GIL, so no record or result is pickled)."""
    clock = CpuClock()
    start = time.perf_counter()
    records = rs.jsonl(paths).shuffle(seed=0).shard(0, 1)
    if batched:
        mapped = records.map(tokenize.records, num_workers=workers, mode="thread", batched=True)
    else:
        mapped = records.map(tokenize, num_workers=workers, mode="process")
    pack = mapped.pack(SEQ_LEN, strategy="best_fit", buffer_size=BUFFER)
    pipe = pack.batch(BATCH, collate_fn=collate_rows)
    tokens = rows = 0
    first_batch = 0.0
    for batch in pipe:
        if not rows:
            first_batch = time.perf_counter() - start
        ids = batch["input_ids"]
        tokens += int(np.count_nonzero(ids != PAD_ID))
        rows += len(ids)
        pipe.get_state()
    seconds = time.perf_counter() - start
    cpu = clock.read()  # before close(): the pool's workers are still alive
    pipe.close()
    if tokens != pack.stats.tokens:
        raise RuntimeError(f"counted {tokens} real tokens, the packer reports {pack.stats.tokens}")
    return Run(seconds, first_batch, tokens, rows, cpu)


def greedy_pack(examples: Any, seq_len: int) -> Iterator[dict[str, np.ndarray]]:
    """Next-fit packing: documents go into the open row while they fit; a document that does not
    fit closes the row, and one longer than ``seq_len`` is split over as many rows as it needs.
    Rows carry ``input_ids``, ``labels`` (-100 at padding) and ``position_ids``."""
    ids = np.full(seq_len, PAD_ID, dtype=np.int64)
    positions = np.zeros(seq_len, dtype=np.int64)
    fill = 0
    for example in examples:
        tokens = np.asarray(example["input_ids"], dtype=np.int64)
        if fill and fill + len(tokens) > seq_len and len(tokens) <= seq_len:
            yield _row(ids, positions, fill)
            fill = 0
        offset = 0
        while offset < len(tokens):
            take = min(len(tokens) - offset, seq_len - fill)
            ids[fill : fill + take] = tokens[offset : offset + take]
            positions[fill : fill + take] = np.arange(take)
            fill += take
            offset += take
            if fill == seq_len:
                yield _row(ids, positions, fill)
                fill = 0
    if fill:
        yield _row(ids, positions, fill)


def _row(ids: np.ndarray, positions: np.ndarray, fill: int) -> dict[str, np.ndarray]:
    row_ids = ids.copy()
    row_ids[fill:] = PAD_ID
    labels = row_ids.copy()
    labels[fill:] = IGNORE
    row_positions = positions.copy()
    row_positions[fill:] = 0
    return {"input_ids": row_ids, "labels": labels, "position_ids": row_positions}


def timed(rows: Iterator[dict[str, np.ndarray]], clocks: Any, slot: int) -> Iterator[dict[str, np.ndarray]]:
    """Yield ``rows``, adding to ``clocks[slot]`` the seconds spent producing them and to
    ``clocks[slot + 1]`` the seconds waiting, suspended, for the DataLoader to ask for the next:
    a worker waits when the loader takes batches from another worker first."""
    mark = time.perf_counter()
    for row in rows:
        now = time.perf_counter()
        clocks[slot] += now - mark
        yield row
        mark = time.perf_counter()
        clocks[slot + 1] += mark - now
    clocks[slot] += time.perf_counter() - mark


def idle_share(clocks: Any, workers: int) -> float:
    """The workers' mean share of their time spent waiting, from ``timed``'s clocks."""
    return statistics.mean(float(clocks[2 * w + 1] / (clocks[2 * w] + clocks[2 * w + 1])) for w in range(workers))


def datasets_job(paths: list[str], tokenize: Tokenize, workers: int, config: HfConfig) -> Run:
    """The same job with ``datasets`` streaming, a greedy packer and a StatefulDataLoader,
    configured by ``config``."""
    from datasets import load_dataset
    from torch.utils.data import IterableDataset, get_worker_info
    from torchdata.stateful_dataloader import StatefulDataLoader

    class Packed(IterableDataset):  # type: ignore[type-arg]  # torch's generic dataset, over plain dicts
        """The tokenised stream, packed greedily in each DataLoader worker, its time clocked."""

        def __init__(self, dataset: Any, clocks: Any) -> None:
            self.dataset = dataset
            self.clocks = clocks

        def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
            info = get_worker_info()  # every run has DataLoader workers (k >= 1)
            slot = 2 * (info.id if info is not None else 0)
            return timed(greedy_pack(self.dataset, SEQ_LEN), self.clocks, slot)

    clock = CpuClock()
    start = time.perf_counter()
    dataset = (
        load_dataset("json", data_files=paths, streaming=True, split="train")
        .shuffle(seed=0, buffer_size=BUFFER)
        .map(tokenize.batch, batched=True, batch_size=config.map_batch, remove_columns=["id", "text"])
    )
    clocks = multiprocessing.Array("d", 2 * workers, lock=False)  # per worker: producing, waiting
    loader = StatefulDataLoader(
        Packed(dataset, clocks),
        batch_size=BATCH,
        num_workers=workers,
        prefetch_factor=config.prefetch,
        in_order=config.in_order,
    )
    tokens = rows = 0
    first_batch = 0.0
    for batch in loader:
        if not rows:
            first_batch = time.perf_counter() - start
        ids = batch["input_ids"]
        tokens += int((ids != PAD_ID).sum())
        rows += len(ids)
    seconds = time.perf_counter() - start
    cpu = clock.read()  # the workers are reaped by now
    return Run(seconds, first_batch, tokens, rows, cpu, idle_share(clocks, workers))


Job = Callable[[list[str], Tokenize, int], Run]


OURS = {"ours": ours, "ours batched": functools.partial(ours, batched=True)}
"""Our jobs: ``tokenize`` per record in a process pool (the job as the issue writes it), and
``tokenize.records`` per chunk in a thread pool (a batched map)."""


def jobs(variants: list[HfConfig]) -> dict[str, Job]:
    """Ours and each ``datasets`` variant, by label."""
    todo: dict[str, Job] = dict(OURS)
    todo.update((config.label, functools.partial(datasets_job, config=config)) for config in variants)
    return todo


def compare(
    paths: list[str], tokenize: Tokenize, workers: int, runs: int, documents: int, todo: dict[str, Job]
) -> None:
    """Alternate the jobs ``runs`` times at ``workers`` and print one line of medians per job."""
    measured: dict[str, list[Run]] = {name: [] for name in todo}
    for run in range(runs):
        order = list(todo) if run % 2 == 0 else list(reversed(todo))
        for name in order:
            measured[name].append(todo[name](paths, tokenize, workers))
    counts = {name: [r.tokens for r in job_runs] for name, job_runs in measured.items()}
    if len({tokens for job_counts in counts.values() for tokens in job_counts}) != 1:
        raise RuntimeError(f"real tokens differ between runs or jobs: {counts}")
    for name, job_runs in measured.items():
        seconds = statistics.median(r.seconds for r in job_runs)
        cells = [
            f"{workers}",
            name,
            f"{statistics.median(r.tokens / r.seconds for r in job_runs) / 1e3:,.0f}",
            *("" if name in OURS else ratio_cell(measured[mine], job_runs) for mine in OURS),
            f"{documents / seconds:,.0f}",
            f"{statistics.median(1e6 * r.cpu / r.tokens for r in job_runs):.2f}",
            f"{statistics.median(r.cores for r in job_runs):.2f}",
            "" if name in OURS else f"{100 * statistics.median(r.idle or 0.0 for r in job_runs):.0f}%",
            f"{100 * job_runs[0].efficiency:.2f}%",
            f"{statistics.median(r.first_batch for r in job_runs):.1f}",
        ]
        print(f"| {' | '.join(cells)} |", flush=True)


def ratio_cell(mine: list[Run], theirs: list[Run]) -> str:
    """The median over runs of one of our jobs' throughput over another job's, and its range."""
    ratios = [o.tokens / o.seconds / (r.tokens / r.seconds) for o, r in zip(mine, theirs, strict=True)]
    return f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"


def profile(paths: list[str], tokenize: Tokenize, workers: int) -> None:
    """cProfile of our job's consumer process (reading, shuffling, the pool's traffic, packing)."""
    profiler = cProfile.Profile()
    profiler.enable()
    run = ours(paths, tokenize, workers)
    profiler.disable()
    print(f"ours, k={workers}: {run.tokens / run.seconds / 1e3:,.0f} k tokens/s over {run.seconds:.1f} s")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


def main() -> None:
    cores = os.cpu_count() or 1
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=int, default=50)
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--workers", type=int, nargs="+", default=[k for k in (1, 2, 4) if k <= cores])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--hf",
        type=HfConfig.parse,
        nargs="+",
        default=[HfConfig.parse(spec) for spec in HF_VARIANTS],
        help="datasets variants, each BATCH/PREFETCH/in|out (map batch, prefetch_factor, in_order)",
    )
    parser.add_argument("--profile", action="store_true", help="profile our job at the first --workers instead")
    args = parser.parse_args()

    paths = corpus(args.size_mb, args.files)
    tokenize = Tokenize(trained_tokenizer(paths))
    source = rs.jsonl(paths)  # line indices built before timing
    documents = len(source)
    size = sum(os.path.getsize(path) for path in paths)
    print(
        f"os.cpu_count() = {cores}; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}; "
        f"corpus {size / 1e6:.1f} MB, {documents:,} documents in {len(paths)} files"
    )
    if args.profile:
        profile(paths, tokenize, args.workers[0])
        return
    check_process_map(tokenize.path, paths)
    print(
        f"whole corpus per run, {args.runs} alternating runs, medians; seq_len {SEQ_LEN}, batches of {BATCH}; "
        "datasets B/P/O: records per encode_batch / prefetch_factor / in_order\n"
        "| k | job | k tokens/s | ours / job (min-max) | ours batched / job | docs/s | CPU s per M tokens "
        "| cores busy | workers waiting | packing efficiency | first batch (s) |\n"
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    todo = jobs(args.hf)
    for workers in args.workers:
        compare(paths, tokenize, workers, args.runs, documents, todo)
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
