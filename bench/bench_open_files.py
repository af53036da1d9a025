"""What reading a corpus of many shards costs when the process may not keep them all open.

    python bench/bench_open_files.py [--files 2000] [--records 40] [--budget 64] [--rounds 3]

Builds ``--files`` small JSONL and Parquet shards of ``--records`` records each, then reads every
record of each corpus once in sequence and once globally shuffled (``.shuffle(seed=0)``), with
the process's usual budget of open files (a quarter of ``ulimit -n``, above the file count here,
so every file stays open once touched) and with a budget of ``--budget`` (below it: a shuffle
reopens a file at nearly every record). Rounds interleave the two budgets; the table gives the
best µs per record of each and their ratio, and the reopenings counted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any, Callable

import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import resumable as rs  # noqa: E402
from resumable.sources import open_files  # noqa: E402
from resumable.sources.open_files import OpenFiles  # noqa: E402


def make_corpus(root: str, files: int, records: int) -> dict[str, str]:
    """The glob of each kind's corpus under ``root``."""
    os.makedirs(os.path.join(root, "jsonl"), exist_ok=True)
    os.makedirs(os.path.join(root, "parquet"), exist_ok=True)
    for file in range(files):
        ids = range(file * records, (file + 1) * records)
        with open(os.path.join(root, "jsonl", f"{file:05d}.jsonl"), "w") as out:
            out.writelines(json.dumps({"id": i, "text": "x" * 100}) + "\n" for i in ids)
        table = pa.table({"id": list(ids), "text": ["x" * 100] * records})
        pq.write_table(table, os.path.join(root, "parquet", f"{file:05d}.parquet"))
    return {kind: os.path.join(root, kind, f"*.{kind}") for kind in ("jsonl", "parquet")}


class CountingOpens:
    """Counts the handles ``OpenFiles`` opens (each one a reopening once the budget is full)."""

    def __init__(self) -> None:
        self.count = 0
        self._get = OpenFiles.get

    def __enter__(self) -> CountingOpens:
        counter = self

        def get(handles: Any, file: int, opener: Callable[[int], Any]) -> Any:
            if handles.opened(file) is None:
                counter.count += 1
            return counter._get(handles, file, opener)

        OpenFiles.get = get  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        OpenFiles.get = self._get  # type: ignore[method-assign]


def one_pass(build: Callable[[], rs.Node[Any]], budget: int | None) -> tuple[float, int, int]:
    """Seconds of one pass over a freshly built source, the records and the files opened."""
    usual = open_files.budget
    if budget is not None:
        open_files.budget = lambda: budget  # type: ignore[assignment]
    try:
        with CountingOpens() as opens:
            pipe = build()
            start = time.perf_counter()
            count = sum(1 for _ in pipe)
            elapsed = time.perf_counter() - start
            del pipe
        return elapsed, count, opens.count
    finally:
        open_files.budget = usual  # type: ignore[assignment]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=2000)
    parser.add_argument("--records", type=int, default=40)
    parser.add_argument("--budget", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(f"usual budget {open_files.budget()} open files; small budget {args.budget}; {args.files} files")
    with tempfile.TemporaryDirectory() as root:
        globs = make_corpus(root, args.files, args.records)
        readers = {"jsonl": rs.jsonl, "parquet": rs.parquet}
        print(f"{'source':10}{'order':10}{'usual us/rec':>14}{'small us/rec':>14}{'ratio':>8}{'opens':>10}")
        for kind, pattern in globs.items():
            read = readers[kind]
            read(pattern)  # line indices written once, outside the timings
            for order, build in (
                ("sequence", lambda: read(pattern)),
                ("shuffled", lambda: read(pattern).shuffle(seed=0)),
            ):
                best: dict[str, tuple[float, int]] = {}
                for _ in range(args.rounds):
                    for name, budget in (("usual", None), ("small", args.budget)):
                        elapsed, count, opens = one_pass(build, budget)
                        per_record = elapsed / count * 1e6
                        if name not in best or per_record < best[name][0]:
                            best[name] = (per_record, opens)
                usual, small = best["usual"], best["small"]
                print(f"{kind:10}{order:10}{usual[0]:14.2f}{small[0]:14.2f}{small[0] / usual[0]:8.2f}{small[1]:>10}")


if __name__ == "__main__":
    main()
