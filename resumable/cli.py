"""Command line: ``python -m resumable index PATHS...`` and ``python -m resumable inspect STATE``."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Any, Callable, Sequence

from resumable.core.node import Node
from resumable.errors import ConfigError, ResumableError
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
    inspect.add_argument(
        "--pipeline",
        metavar="MODULE:FUNCTION",
        help="the function that builds the pipeline (as given to rs.torch.Loader), importable from here. Only a "
        "Loader state saved by an earlier version between two of its workers' snapshots needs it: its workers' "
        "positions are then advanced to the last batch handed out (this reads the data files). States this "
        "version saves are exact without it",
    )
    return parser


def import_pipeline_factory(spec: str) -> Callable[[], Node[Any]]:
    """The function ``MODULE:FUNCTION`` names, checked to build a pipeline when called."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ConfigError(f"--pipeline {spec!r}: expected MODULE:FUNCTION, such as mytraining.data:build")
    try:
        factory: Any = importlib.import_module(module_name)
        for name in attribute.split("."):
            factory = getattr(factory, name)
    except (ImportError, AttributeError) as error:
        raise ConfigError(f"--pipeline {spec!r}: cannot import it ({error})") from error
    if not callable(factory):
        raise ConfigError(f"--pipeline {spec!r}: {type(factory).__name__} is not a function")

    def build() -> Node[Any]:
        pipeline = factory()
        if not isinstance(pipeline, Node):
            raise ConfigError(f"--pipeline {spec!r} returned {type(pipeline).__name__}, not a pipeline")
        return pipeline

    return build


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

            build = import_pipeline_factory(args.pipeline) if args.pipeline else None
            print(describe(args.state, build))
            code = 0
        else:
            code = index_files(args.paths, args.cache_dir, args.quiet)
        sys.stdout.flush()
    except ResumableError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader went away (``| head``): stop quietly. Python flushes stdout again at
        # exit, so point it at /dev/null first or that flush raises once more.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    return code
