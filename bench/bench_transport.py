"""How a DataLoader worker's batch reaches the main process: torch's way (a shared-memory
segment per tensor, its file descriptor fetched from the worker over a socket) against the two
ways of ``resumable.torch.transport`` (inline through the result pipe; one segment for all the
batch's tensors), in one run.

Workers yield the same batch of random int arrays over and over (no pipeline: only the
transport is measured); the main process takes ``--batches`` batches after a warm-up. Per way
and batch shape: batches/s, and CPU microseconds per batch of the main process and of the
workers together (from ``/proc``). Shapes: ``tokens`` is one (8, 512) int32 tensor (16 kB);
``packed`` the six tensors of a packed batch of 8 x 2048 (0.5 MB); ``64k`` to ``4M`` one int32
tensor of that size. ``torch`` sends numpy arrays converted by ``default_convert``, as a plain
DataLoader does; ``inline`` and ``segment`` force each way whatever the size (the Loader picks
inline up to ``INLINE_BYTES``).

    python bench/bench_transport.py [--batches 1500] [--workers 2] [--shapes tokens packed 64k 256k 1M 4M]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, default_convert

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from resumable.torch import transport  # noqa: E402

Shape = list[tuple[tuple[int, ...], Any]]
SHAPES: dict[str, Shape] = {
    "tokens": [((8, 512), np.int32)],
    "packed": [((8, 2048), np.int64)] * 3 + [((8, 2048), np.int32), ((8, 2049), np.int32), ((8,), np.int32)],
    "64k": [((8, 2048), np.int32)],
    "256k": [((8, 8192), np.int32)],
    "1M": [((8, 32768), np.int32)],
    "4M": [((8, 131072), np.int32)],
}


def by_torch(batch: dict[str, np.ndarray]) -> Any:
    return default_convert(batch)


def inline(batch: dict[str, np.ndarray]) -> Any:
    tensors = default_convert(batch)
    return {key: transport._Inline(tensor) for key, tensor in tensors.items()}


def one_segment(batch: dict[str, np.ndarray]) -> Any:
    tensors = default_convert(batch)
    if len(tensors) == 1:  # one tensor: a segment of its own is torch's way already
        return tensors
    return transport.in_one_segment(tensors, list(tensors.values()))


WAYS: dict[str, Callable[[dict[str, np.ndarray]], Any]] = {"torch": by_torch, "inline": inline, "segment": one_segment}


class Batches(IterableDataset):  # type: ignore[type-arg]  # torch's generic dataset
    def __init__(self, shape: Shape) -> None:
        self.shape = shape

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        generator = np.random.default_rng(0)
        arrays = [generator.integers(0, 255, size).astype(dtype) for size, dtype in self.shape]
        while True:
            yield {f"field{index}": array.copy() for index, array in enumerate(arrays)}


def process_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(shape: Shape, way: str, workers: int, batches: int) -> tuple[float, float, float]:
    """Batches/s, main-process CPU us per batch, workers' CPU us per batch."""
    loader = DataLoader(Batches(shape), batch_size=None, num_workers=workers, prefetch_factor=4, collate_fn=WAYS[way])
    iterator = iter(loader)
    for _ in range(50):
        next(iterator)
    pids = [worker.pid for worker in iterator._workers]  # torch's, for their CPU time
    main, spent = -time.process_time(), -sum(map(process_cpu, pids))
    start = time.perf_counter()
    for _ in range(batches):
        next(iterator)
    elapsed = time.perf_counter() - start
    main += time.process_time()
    spent += sum(map(process_cpu, pids))
    del iterator
    return batches / elapsed, 1e6 * main / batches, 1e6 * spent / batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=1500)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{args.batches} batches, {args.workers} workers; CPU us per batch (main process, workers together)")
    print(f"{'shape':<8}{'kB':>8}{'way':>9}{'batches/s':>11}{'main us':>9}{'workers us':>12}")
    for name in args.shapes:
        shape = SHAPES[name]
        kilobytes = sum(int(np.prod(size)) * np.dtype(dtype).itemsize for size, dtype in shape) / 1000
        for way in WAYS:
            rate, main_us, workers_us = measure(shape, way, args.workers, args.batches)
            print(f"{name:<8}{kilobytes:>8.0f}{way:>9}{rate:>11.0f}{main_us:>9.0f}{workers_us:>12.0f}", flush=True)


if __name__ == "__main__":
    main()
