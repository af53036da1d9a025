"""JSONL and Parquet over S3 against the same files read locally, on a moto S3 server this script
starts on 127.0.0.1 (in this process), in one run; Hugging Face ``datasets`` streaming beside it.

    python bench/bench_s3.py [--size-mb 300] [--repeats 2] [--resume-repeats 3] [--block-size 1024]

Prints, for a JSONL corpus of ``--size-mb``:

- docs/s sequential and block-shuffled (remote, local, ratio) with the disk chunk cache off
  (``disk_cache_bytes=0``: every byte comes from the server), bytes fetched per epoch over the
  data size and ranged requests per 1,000 records (the source's ``stats``); then the same orders
  in a next epoch read through a disk chunk cache that a first epoch filled;
- resume latency (build the source with its line index cached, ``set_state``, first record) at
  1%, 50% and 99% of the object, sequential and block-shuffled, with a cold chunk cache (disk
  tier off) and a warm one (the median of ``--resume-repeats``); every resumed record is checked
  against the record an uninterrupted run gives there;
- ``datasets`` streaming over the same server: sequential docs/s and resume latency through
  ``IterableDataset.state_dict()`` / ``load_state_dict()`` (time to the first example);
- Parquet written from the same records (row groups of about ``--row-group-mb``): sequential and
  row-group block shuffle, docs/s remote vs local and bytes fetched over the file size.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Callable, Iterator

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import resumable as rs  # noqa: E402
from bench.corpus import make_jsonl_corpus  # noqa: E402
from bench.timing import best_of, drain  # noqa: E402
from resumable.sources.blocks import DISK_CACHE_BYTES  # noqa: E402
from tests.s3server import BUCKET, KEY_ID, REGION, SECRET, S3Server  # noqa: E402

DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
RESUME_POINTS = (0.01, 0.5, 0.99)
ORDERS = ("sequential", "block shuffle")
SEED = 0
INDEX_DIR = "index"
"""Cache dir holding only the line index sidecar: with the disk tier off, a cold chunk cache."""
WARM_DIR = "warm-{order}"
"""Cache dir whose disk tier a first epoch in ``order`` fills: the warm chunk cache."""
PROBE_BYTES = 1 << 20
"""Length of the ranged GET timed alone to show what one request costs on this server."""
ID_FIELD = "id"
"""Field of each corpus record that names it: what a resumed record is checked by."""


@dataclass(frozen=True)
class Corpus:
    """One data file, local and uploaded, and the cache dirs the remote reads use."""

    path: str
    url: str
    size: int
    records: int
    options: dict[str, Any]
    work: str

    def cache(self, name: str) -> str:
        return os.path.join(self.work, name)


Make = Callable[[], Any]
"""Builds a pipeline from scratch (what a restarted job does): a node, or ``_StatefulIterable``."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=2, help="epochs timed per figure (best kept)")
    parser.add_argument("--resume-repeats", type=int, default=3, help="resumes timed per point (median kept)")
    parser.add_argument("--block-size", type=int, default=1024, help="records per shuffled block (JSONL; the default)")
    parser.add_argument("--row-group-mb", type=float, default=4.0, help="Parquet row group size (uncompressed)")
    args = parser.parse_args()
    print(f"load average at start: {_load()}")
    path = make_jsonl_corpus(os.path.join(DATA_DIR, f"corpus-{args.size_mb}mb.jsonl"), args.size_mb << 20)
    server = S3Server()
    work = tempfile.mkdtemp(prefix="resumable-bench-s3-")
    try:
        corpus = _upload(server, path, "bench/corpus.jsonl", work)
        print(f"one {PROBE_BYTES >> 20} MiB ranged GET alone: {request_ms(server, corpus, args.resume_repeats):.0f} ms")
        jsonl_throughput(corpus, args.repeats, args.block_size)
        jsonl_resume(corpus, args.resume_repeats, args.block_size)
        datasets_peer(corpus, server, args.repeats, args.resume_repeats)
        parquet_throughput(server, path, work, args.repeats, args.row_group_mb)
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(f"load average at end: {_load()}")


def _upload(server: S3Server, path: str, key: str, work: str) -> Corpus:
    """Upload the JSONL file and build its line index (one streamed scan) into the index dir."""
    url = server.upload(path, key)
    rs.jsonl(path)  # the local line index too, so that no timed epoch builds it
    corpus = Corpus(path, url, os.path.getsize(path), 0, server.options, work)
    start = time.perf_counter()
    records = len(remote_jsonl(corpus, INDEX_DIR, disk=False))
    build = time.perf_counter() - start
    for order in ORDERS:
        shutil.copytree(corpus.cache(INDEX_DIR), corpus.cache(WARM_DIR.format(order=order)))
    print(f"JSONL: {records:,} records, {corpus.size / 1e6:.1f} MB; line index by one streamed scan: {build:.2f} s")
    return replace(corpus, records=records)


def request_ms(server: S3Server, corpus: Corpus, repeats: int) -> float:
    """Median ms of one ranged GET of ``PROBE_BYTES`` from the middle of the object (boto3):
    the floor under every figure that waits for a request on this server."""
    key = corpus.url.removeprefix(f"s3://{BUCKET}/")
    start_byte = corpus.size // 2
    byte_range = f"bytes={start_byte}-{start_byte + PROBE_BYTES - 1}"
    times: list[float] = []
    for _ in range(repeats):
        start = time.perf_counter()
        server.client.get_object(Bucket=BUCKET, Key=key, Range=byte_range)["Body"].read()
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


def remote_jsonl(corpus: Corpus, cache: str, disk: bool) -> rs.nodes.JsonlSource:
    """The uploaded object, its index in ``cache``; blocks through the disk tier there or not."""
    return rs.jsonl(
        corpus.url,
        storage_options=corpus.options,
        cache_dir=corpus.cache(cache),
        disk_cache_bytes=DISK_CACHE_BYTES if disk else 0,
    )


def ordered(source: rs.nodes.JsonlSource, order: str, block_size: int) -> rs.Node[Any]:
    return source if order == "sequential" else source.shuffle(seed=SEED, block_size=block_size)


def jsonl_throughput(corpus: Corpus, repeats: int, block_size: int) -> None:
    """Docs/s remote (disk tier off, then warm) against local, and what the remote epochs fetched."""
    print(f"\nJSONL throughput (best of {repeats} epochs; block shuffle: {block_size}-record blocks)")
    for order in ORDERS:
        _or_why(order, partial(_jsonl_epochs, corpus, order, repeats, block_size))


def _jsonl_epochs(corpus: Corpus, order: str, repeats: int, block_size: int) -> None:
    """The throughput figures of one order."""
    sources: dict[str, rs.nodes.JsonlSource] = {}

    def epoch(where: str, order: str = order) -> int:
        if where == "local":
            source = rs.jsonl(corpus.path)
        else:
            warm = where == "warm"
            source = remote_jsonl(corpus, WARM_DIR.format(order=order) if warm else INDEX_DIR, disk=warm)
        sources[where] = source
        return drain(ordered(source, order, block_size))

    best = best_of(repeats, {"remote": lambda: epoch("remote"), "local": lambda: epoch("local")})
    cold = _rates(best)
    cold_stats = sources["remote"].stats
    epoch("warm")  # the first epoch fills the disk tier
    filled = sources["warm"].stats
    warm = _rates(best_of(repeats, {"warm": lambda: epoch("warm")}))
    warm_stats = sources["warm"].stats
    print(
        f"{order:>14}, disk cache off: remote {cold['remote']:,.0f} docs/s, local {cold['local']:,.0f} docs/s "
        f"(ratio {cold['remote'] / cold['local']:.2f}); {_fetched(cold_stats, corpus.size, corpus.records)}"
    )
    print(f"{'':>14}  first epoch filling the disk cache: {_fetched(filled, corpus.size, corpus.records)}")
    print(
        f"{'':>14}  next epoch, disk cache warm: remote {warm['warm']:,.0f} docs/s "
        f"(ratio {warm['warm'] / cold['local']:.2f}); {_fetched(warm_stats, corpus.size, corpus.records)}, "
        f"{warm_stats['disk_hits']:,} disk hits"
    )


def _or_why(label: str, figure: Callable[[], None]) -> None:
    """Print one figure; when the server fails a read even after the retries, print why and go on."""
    try:
        figure()
    except rs.SourceError as error:
        print(f"{label:>14}: not measured: {error}")


def _rates(best: dict[str, tuple[float, int]]) -> dict[str, float]:
    return {name: count / elapsed for name, (elapsed, count) in best.items()}


def _fetched(stats: dict[str, int], size: int, records: int) -> str:
    return (
        f"fetched {stats['bytes_fetched'] / size:.2f}x the data, "
        f"{1000 * stats['requests'] / records:.2f} requests per 1,000 records, {stats['retries']} retries"
    )


def jsonl_resume(corpus: Corpus, repeats: int, block_size: int) -> None:
    """Resume latency at ``RESUME_POINTS`` of an epoch, chunk cache cold and warm."""
    print(f"\nJSONL resume (median of {repeats}: build the source with its index cached + set_state + first record)")
    counts = [int(point * corpus.records) for point in RESUME_POINTS]
    for order in ORDERS:
        _or_why(order, partial(_jsonl_resumes, corpus, order, counts, repeats, block_size))


def _jsonl_resumes(corpus: Corpus, order: str, counts: list[int], repeats: int, block_size: int) -> None:
    """The resume figures of one order."""
    # The states come from one pass over the warm cache; they hold no cache dir, so they fit both.
    warm_dir = WARM_DIR.format(order=order)
    reference = ordered(remote_jsonl(corpus, warm_dir, disk=True), order, block_size)
    marks = states_at(reference, counts, _record_id)
    for label, cache, disk in (("cold", INDEX_DIR, False), ("warm", warm_dir, True)):
        built: list[rs.nodes.JsonlSource] = []

        def make(cache: str = cache, disk: bool = disk) -> rs.Node[Any]:
            built.append(remote_jsonl(corpus, cache, disk))
            return ordered(built[-1], order, block_size)

        times = [resume_ms(make, state, expected, _record_id, repeats) for state, expected in marks]
        figures = " / ".join(f"{ms:.0f}" for ms in times)
        last = built[-1].stats
        print(
            f"{order:>14}, chunk cache {label}: {figures} ms at {_points()} "
            f"(the last resume: {last['requests']} ranged reads, {last['bytes_fetched'] / 1e6:.1f} MB, "
            f"{last['disk_hits']} disk hits, {last['retries']} retries)"
        )


def states_at(pipe: Any, counts: list[int], key: Callable[[Any], Any]) -> list[tuple[Any, Any]]:
    """One pass over ``pipe``: its state after each of ``counts`` records (ascending), and the
    ``key`` of the record that comes next there."""
    marks: list[tuple[Any, Any]] = []
    iterator = iter(pipe)
    read = 0
    for count in counts:
        for _ in range(count - read):
            next(iterator)
        read = count
        state = pipe.state_dict()
        record = next(iterator)
        read += 1
        marks.append((state, key(record)))
    return marks


def resume_ms(make: Make, state: Any, expected: Any, key: Callable[[Any], Any], repeats: int) -> float:
    """Median ms to build a pipeline, load ``state`` and get its first record, which must be
    the one an uninterrupted run gives there."""
    times: list[float] = []
    for _ in range(repeats):
        start = time.perf_counter()
        pipe = make()
        pipe.load_state_dict(state)
        record = next(iter(pipe))
        times.append(1000 * (time.perf_counter() - start))
        if key(record) != expected:
            raise RuntimeError(f"resumed at {key(record)!r}, expected {expected!r}: {pipe!r}")
    return statistics.median(times)


def datasets_peer(corpus: Corpus, server: S3Server, repeats: int, resume_repeats: int) -> None:
    """Hugging Face ``datasets`` streaming over the same object: sequential docs/s and resume
    latency by ``state_dict()``/``load_state_dict()``; if it cannot read the server, why."""
    print("\nHugging Face datasets streaming (json builder over s3fs), same object")
    try:
        from datasets import load_dataset
    except ImportError as error:
        print(f"  not measured: {error} (pip install 'resumable[bench]')")
        return
    storage = {
        "key": KEY_ID,
        "secret": SECRET,
        "client_kwargs": {"endpoint_url": server.endpoint, "region_name": REGION},
    }

    def make() -> Any:
        return load_dataset("json", data_files=corpus.url, streaming=True, split="train", storage_options=storage)

    try:
        start = time.perf_counter()
        dataset = make()
        loaded = time.perf_counter() - start
        elapsed, count = best_of(repeats, {"datasets": lambda: drain(dataset)})["datasets"]
        print(
            f"  sequential: {count / elapsed:,.0f} docs/s ({count:,} examples, best of {repeats}; "
            f"load_dataset before it: {loaded:.2f} s)"
        )
        counts = [int(point * corpus.records) for point in RESUME_POINTS]
        marks = states_at(_StatefulIterable(make()), counts, _record_id)
        times = [
            resume_ms(lambda: _StatefulIterable(make()), state, expected, _record_id, resume_repeats)
            for state, expected in marks
        ]
        figures = " / ".join(f"{ms:.0f}" for ms in times)
        print(f"  resume (load_dataset + load_state_dict + first example, median of {resume_repeats}):")
        print(f"    {figures} ms at {_points()}")
    except Exception as error:  # the peer's failure is a figure to report, not a reason to stop
        print(f"  cannot read the server: {type(error).__name__}: {error}")


class _StatefulIterable:
    """An ``IterableDataset`` under the node's state method names, for ``states_at``/``resume_ms``."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __iter__(self) -> Iterator[Any]:
        return iter(self.dataset)

    def state_dict(self) -> Any:
        return self.dataset.state_dict()

    def load_state_dict(self, state: Any) -> None:
        self.dataset.load_state_dict(state)


def parquet_throughput(server: S3Server, jsonl_path: str, work: str, repeats: int, row_group_mb: float) -> None:
    """Parquet from the same records: sequential and row-group block shuffle, remote (disk tier
    off) against local, and bytes fetched over the file size."""
    path = write_parquet(jsonl_path, int(row_group_mb * (1 << 20)))
    size = os.path.getsize(path)
    url = server.upload(path, "bench/corpus.parquet")
    groups = rs.parquet(path).block_bounds().size - 1
    print(f"\nParquet: {size / 1e6:.1f} MB, {groups} row groups (best of {repeats} epochs, disk cache off)")
    for order in ORDERS:
        _or_why(order, partial(_parquet_epochs, path, url, server.options, work, order, repeats))


def _parquet_epochs(path: str, url: str, options: dict[str, Any], work: str, order: str, repeats: int) -> None:
    """The Parquet figures of one order."""
    sources: dict[str, Any] = {}

    def epoch(where: str) -> int:
        if where == "local":
            source = rs.parquet(path)
        else:
            source = rs.parquet(url, storage_options=options, cache_dir=work, disk_cache_bytes=0)
        sources[where] = source
        pipe = source if order == "sequential" else source.shuffle(seed=SEED, block_size="row_group")
        return drain(pipe)

    rates = _rates(best_of(repeats, {"remote": lambda: epoch("remote"), "local": lambda: epoch("local")}))
    stats = sources["remote"].stats
    fetched = stats["bytes_fetched"] / os.path.getsize(path)
    label = order if order == "sequential" else "row-group shuffle"
    print(
        f"{label:>17}: remote {rates['remote']:,.0f} docs/s, local {rates['local']:,.0f} docs/s "
        f"(ratio {rates['remote'] / rates['local']:.2f}); fetched {fetched:.2f}x "
        f"the file, {1000 * stats['requests'] / len(sources['remote']):.2f} requests per 1,000 records, "
        f"{stats['retries']} retries"
    )


def write_parquet(jsonl_path: str, row_group_bytes: int) -> str:
    """The JSONL file's records as Parquet next to it, row groups of about ``row_group_bytes``
    of Arrow data; reused while newer than the JSONL file."""
    import pyarrow.json as pj
    import pyarrow.parquet as pq

    path = f"{os.path.splitext(jsonl_path)[0]}.parquet"
    if os.path.exists(path) and os.path.getmtime(path) >= os.path.getmtime(jsonl_path):
        return path
    table = pj.read_json(jsonl_path)
    rows = max(1, int(row_group_bytes * table.num_rows / table.nbytes))
    temp = f"{path}.{os.getpid()}.tmp"
    pq.write_table(table, temp, row_group_size=rows)
    os.replace(temp, path)
    return path


def _record_id(record: dict[str, Any]) -> Any:
    return record[ID_FIELD]


def _points() -> str:
    return " / ".join(f"{point:.0%}" for point in RESUME_POINTS)


def _load() -> str:
    return " ".join(f"{value:.2f}" for value in os.getloadavg())


if __name__ == "__main__":
    main()
