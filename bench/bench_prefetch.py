"""Benchmark prefetch and the parallel map: overlap of a slow stage with a slow consumer.

    .venv/bin/python bench/bench_prefetch.py [--records 500] [--stage-ms 1.0] [--work-ms 1.0]
                                             [--consumer sleep|busy] [--workers 4]

1. Prefetch. A stage that sleeps ``stage-ms`` per record (I/O-like, releases the GIL) feeds a
   consumer that works ``work-ms`` per record (``sleep``, or ``busy``: a pure-Python spin that
   holds the GIL). Without prefetch the loop costs stage + work per record; with
   ``.prefetch(4)`` the stage runs in a background thread while the consumer works, so about
   max(stage, work). Target: >= 1.7x.
2. ParallelMap. A map whose function sleeps ``stage-ms`` per record, serial (``.map(fn)``) vs
   ``.map(fn, num_workers=workers)`` in threads; the consumer only takes the items.
   Expected about ``workers``x.

Each figure is the best of three runs; ``get_state()`` is taken after every record, as a
training loop that checkpoints at any step would (it is part of the measured loop).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import resumable as rs  # noqa: E402
from resumable import Node  # noqa: E402

TARGET_PREFETCH = 1.7
REPEATS = 3


def sleeper(ms: float) -> Callable[[int], int]:
    def stage(x: int) -> int:
        time.sleep(ms / 1000)
        return x

    return stage


def spin(ms: float) -> None:
    end = time.perf_counter() + ms / 1000
    while time.perf_counter() < end:
        pass


def run(build: Callable[[], Node[Any]], work: Callable[[], None] | None) -> float:
    """Best wall time in seconds of a full epoch through ``build()``, over REPEATS runs."""
    best = float("inf")
    for _ in range(REPEATS):
        pipe = build()
        start = time.perf_counter()
        count = 0
        for _item in pipe:
            if work is not None:
                work()
            pipe.get_state()
            count += 1
        best = min(best, time.perf_counter() - start)
        pipe.close()
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=500)
    parser.add_argument("--stage-ms", type=float, default=1.0)
    parser.add_argument("--work-ms", type=float, default=1.0)
    parser.add_argument("--consumer", choices=["sleep", "busy"], default="sleep")
    parser.add_argument("--workers", type=int, default=4)
    args = parser.parse_args()

    records = list(range(args.records))
    stage = sleeper(args.stage_ms)
    work: Callable[[], None]
    if args.consumer == "busy":
        work = lambda: spin(args.work_ms)  # noqa: E731
    else:
        work = lambda: time.sleep(args.work_ms / 1000)  # noqa: E731

    print(
        f"{args.records} records, stage sleeps {args.stage_ms} ms/record, "
        f"consumer {args.consumer} {args.work_ms} ms/record, best of {REPEATS}"
    )
    plain = run(lambda: rs.from_list(records).map(stage), work)
    fetched = run(lambda: rs.from_list(records).map(stage).prefetch(4), work)
    ratio = plain / fetched
    print(
        f"prefetch:     plain {plain * 1000:8.1f} ms   .prefetch(4) {fetched * 1000:8.1f} ms   "
        f"speed-up {ratio:4.2f}x (target >= {TARGET_PREFETCH}x)"
    )

    serial = run(lambda: rs.from_list(records).map(stage), None)
    parallel = run(lambda: rs.from_list(records).map(stage, num_workers=args.workers), None)
    print(
        f"parallel map: serial {serial * 1000:8.1f} ms   {args.workers} threads {parallel * 1000:8.1f} ms   "
        f"speed-up {serial / parallel:4.2f}x"
    )
    if ratio < TARGET_PREFETCH:
        print(f"prefetch speed-up below target {TARGET_PREFETCH}x", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
