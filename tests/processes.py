"""Helpers for tests that start real process groups."""

from __future__ import annotations

import contextlib
import os
import socket
import time
from typing import Any, Callable, Iterator

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on loopback that is free now, for a gloo rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(main: Callable[..., None], ranks: int, args: tuple[Any, ...], limit_s: float = 120.0) -> None:
    """Run ``main(rank, *args)`` in ``ranks`` forked processes; an error in one is raised here,
    and ranks still running after ``limit_s`` seconds are killed and fail the test."""
    context = mp.start_processes(main, args=args, nprocs=ranks, join=False, start_method="fork")
    deadline = time.monotonic() + limit_s
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            raise AssertionError(f"the {ranks} ranks did not finish within {limit_s} s")


@contextlib.contextmanager
def process_group(rank: int, world_size: int, port: int) -> Iterator[None]:
    """A gloo group on loopback for the forked rank ``rank``, destroyed after the block. Its
    DataLoader workers fork too, as a process started by torchrun forks them (one started here
    with "spawn" would spawn them, importing torch afresh in every worker)."""
    mp.set_start_method("fork", force=True)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def train(loader: Any, epochs: int, stop_after: int | None = None, resumed: bool = False) -> list[list[Any]]:
    """``[epoch, batch as a list of ints]`` for every batch of ``epochs`` epochs of ``loader`` (an
    ``rs.torch.Loader``; a resumed one from its own epoch), or of its first ``stop_after`` batches."""
    seen: list[list[Any]] = []
    for epoch in range(loader.epoch if resumed else 0, epochs):
        for batch in loader:
            seen.append([epoch, [int(x) for x in batch]])
            if len(seen) == stop_after:
                return seen
    return seen


@contextlib.contextmanager
def as_rank(rank: int, world_size: int) -> Iterator[None]:
    """Within the block this process is rank ``rank`` of ``world_size`` (no process group)."""
    saved = {key: os.environ.get(key) for key in ("RANK", "WORLD_SIZE")}
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world_size)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
