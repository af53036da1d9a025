"""Helpers for tests that start real process groups."""

from __future__ import annotations

import socket
import time
from typing import Any, Callable

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
