"""Command line: ``python -m resumable index PATHS...`` and ``python -m resumable inspect STATE``."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from resumable.errors import ResumableError
from resumable.sources.files import expand_paths
from resumable.sources.line_index import LineIndex


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m resumable", description="Tools for resumable data pipelines.")
    commands = parser.add_subparsers(dest="command", required=True)
    index = commands.add_parser(
        "index",
        help="build the line-offset indices of JSONL files ahead of training",
        description="Build (or check) the line-offset index of each JSONL file and print its record count.",
    )
    index.add_argument("paths", nargs="+", help="JSONL files or globs (quote globs to keep the order sorted)")
    index.add_argument("--cache-dir", help="where to keep indices when the data directory is read-only")
    index.add_argument("--quiet", action="store_true", help="no progress bar")
    inspect = commands.add_parser(
        "inspect",
        help="summarise a saved state: epoch, position and progress per rank and worker, files, buffers",
        description="Print a saved state readably. STATE is a state or checkpoint file (JSON or torch), "
        "a directory of per-rank state files, or a torch.distributed.checkpoint directory.",
    )
    inspect.add_argument("state", help="state file or directory")
    return parser


def index_files(paths: Sequence[str], cache_dir: str | None, quiet: bool) -> int:
    """Index every file with one progress bar over all bytes; print records per file and in total."""
    from tqdm import tqdm

    files = expand_paths(list(paths), "index")
    total_bytes = sum(os.path.getsize(path) for path in files)
    counts = []
    with tqdm(total=total_bytes, unit="B", unit_scale=True, desc="indexing", disable=quiet, file=sys.stderr) as bar:
        for path in files:
            done_before = bar.n
            index = LineIndex.open(path, cache_dir=cache_dir, progress=bar.update)
            bar.update(done_before + index.size - bar.n)  # a fresh sidecar was loaded, nothing read
            counts.append(index.num_records)
    for path, count in zip(files, counts):
        print(f"{count:>14,d}  {path}")
    print(f"{sum(counts):>14,d}  records in {len(files)} file{'s' if len(files) != 1 else ''}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "inspect":
            from resumable.inspect import describe

            print(describe(args.state))
            return 0
        return index_files(args.paths, args.cache_dir, args.quiet)
    except ResumableError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
