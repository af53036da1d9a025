"""What a read-ahead node costs per record over small records: ``prefetch`` and the thread
``map(fn, num_workers)`` against the serial chain, in one run.

    python bench/bench_read_ahead.py [--records 300000] [--rounds 5] [--state-every 64]
    python bench/bench_read_ahead.py --baseline DIR/resumable_old   # another version beside it

The chain is ``jsonl -> shuffle -> shard`` over one file of records of about 100-130 bytes
(``bench_jsonl.make_small_corpus``), then one of: a serial ``map(fn)``, ``.prefetch(8)``, or
``.map(fn, num_workers=2)`` in threads or in processes, where ``fn`` returns the record's id (no work: what is
measured is what the node adds per record). ``get_state()`` is taken every ``--state-every``
records, as a loop checkpointing any batch would. A read-ahead node records where its upstream
stood after every record it reads ahead (a mark, built into a state only for the record a state
is asked at), so the upstream's state is not built per record.

Rounds interleave the loops (and the versions, with ``--baseline``: a copy of the package made as
``bench_jsonl.py`` describes); the table gives medians of µs per record by wall clock and by the
process's CPU time (its pool threads included, a process pool's workers not), and the ratio to
the serial chain of the same version.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import resumable as rs  # noqa: E402
from bench.bench_jsonl import baseline_package, make_small_corpus  # noqa: E402

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "small-read-ahead.jsonl")
POOL_WORKERS = 2
PREFETCH = 8


def record_id(record: dict[str, Any]) -> Any:
    return record["id"]


LOOPS: dict[str, Callable[[Any], Any]] = {
    "serial map": lambda chain: chain.map(record_id),
    "prefetch(8)": lambda chain: chain.prefetch(PREFETCH).map(record_id),
    "thread map, 2 workers": lambda chain: chain.map(record_id, num_workers=POOL_WORKERS),
    "process map, 2 workers": lambda chain: chain.map(record_id, num_workers=POOL_WORKERS, mode="process"),
}


def timed(package: Any, path: str, loop: str, records: int, state_every: int) -> tuple[float, float]:
    """Seconds per record of one pass, by wall clock and by this process's CPU time."""
    pipe = LOOPS[loop](package.jsonl(path).shuffle(seed=0).shard(rank=0, world_size=1))
    wall, cpu = time.perf_counter(), time.process_time()
    count = 0
    for _ in pipe:
        count += 1
        if count % state_every == 0:
            pipe.get_state()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    pipe.close()
    if count != records:
        raise RuntimeError(f"{loop}: {count} records, expected {records}")
    return wall / count, cpu / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=300_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--state-every", type=int, default=64)
    parser.add_argument("--baseline", help="a copy of another version of the package, beside this one")
    args = parser.parse_args()
    path = make_small_corpus(DATA.replace(".jsonl", f"-{args.records}.jsonl"), args.records)
    packages = {"this": rs}
    if args.baseline:
        packages["baseline"] = baseline_package(args.baseline)
    times: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for package in packages.values():  # build the line index once, outside the timing
        len(package.jsonl(path))
    for round_ in range(args.rounds):
        order = list(packages.items()) if round_ % 2 == 0 else list(reversed(packages.items()))
        for version, package in order:
            for loop in LOOPS:
                times.setdefault((version, loop), []).append(timed(package, path, loop, args.records, args.state_every))
    print(
        f"{args.records} records of 100-130 bytes, jsonl -> shuffle -> shard -> loop, get_state() every "
        f"{args.state_every} records, {args.rounds} interleaved rounds, medians"
    )
    print(f"{'version':9} {'loop':24} {'us/rec':>8} {'CPU us/rec':>11} {'x serial':>9}")
    for version in packages:
        serial = statistics.median(wall for wall, _ in times[(version, "serial map")])
        for loop in LOOPS:
            wall = statistics.median(w for w, _ in times[(version, loop)])
            cpu = statistics.median(c for _, c in times[(version, loop)])
            print(f"{version:9} {loop:24} {wall * 1e6:8.2f} {cpu * 1e6:11.2f} {wall / serial:9.2f}")


if __name__ == "__main__":
    main()
