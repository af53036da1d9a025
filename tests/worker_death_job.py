"""Jobs for test_worker_death: trainers that die while their Loader workers start or run.

Usage: python worker_death_job.py MODE START_METHOD [ARGS]. Every mode prints one JSON line.

- ``kills START_METHOD ITERATIONS SEED``: a harness that forks trainers and SIGKILLs each one
  at a random moment around its workers' start-up (between building the iterator and the
  first batch, measured on the first iteration). The harness is a child subreaper, so every
  orphaned descendant becomes its child: it waits for all of them to exit and reports
  ``{"orphans": n, "survivors": [...]}``, survivors being those still running after
  ``HANG_GUARD_S`` (killed then, so that nothing is left behind).
- ``late_start START_METHOD FLAG``: this process (the trainer) starts one worker and dies; the
  worker waits until it is gone and only then ties itself to it, as a worker that was slow to
  start does. Prints ``{"worker": pid}``; the worker prints ``{"survived": true}`` if it did.
- ``sigterm_filter START_METHOD``: starts one worker with the SIGTERM filter alone (no death
  notice: as a worker is between its trainer's death and the notice), prints
  ``{"worker": pid}`` once the filter runs, and waits to be killed.
- ``thread_ends START_METHOD``: the iterator (and with it the workers) is made in a thread
  that ends; the main thread then finishes the epoch. Prints ``{"batches": n}``.
"""

from __future__ import annotations

import ctypes
import json
import multiprocessing
import os
import random
import signal
import sys
import threading
import time
from multiprocessing.synchronize import Event
from typing import Any, Iterator

import resumable as rs
from resumable._worker_signals import Trainer, _take_signals, init_worker
from resumable.torch import Loader

DOCUMENTS = 10_000
HANG_GUARD_S = 120  # a hang guard, not a speed check: orphans exit within milliseconds
PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>
READY, FIRST_BATCH = b"r", b"b"


def build() -> rs.Node:
    return rs.from_list(list(range(DOCUMENTS))).shard().batch(4)


def train(start_method: str, report: int) -> None:
    """A trainer: announce the iterator, then iterate epochs for ever."""
    loader = Loader(build, num_workers=2, multiprocessing_context=start_method)
    os.write(report, READY)
    for epoch in range(sys.maxsize):
        for step, _ in enumerate(loader):
            if epoch == step == 0:
                os.write(report, FIRST_BATCH)


def kill_trainers(start_method: str, iterations: int, seed: int) -> dict[str, object]:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, ctypes.c_ulong(1), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0)):
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
    rng = random.Random(seed)
    start_up = 0.0
    orphans: list[int] = []
    survivors: list[str] = []
    for iteration in range(iterations):
        read_end, write_end = os.pipe()
        trainer = os.fork()
        if trainer == 0:
            os.close(read_end)
            try:
                train(start_method, write_end)
            finally:
                os._exit(1)
        os.close(write_end)
        os.read(read_end, 1)  # READY: the workers start now
        started = time.monotonic()
        if iteration == 0:
            os.read(read_end, 1)  # FIRST_BATCH: learn how long a start-up takes on this machine
            start_up = time.monotonic() - started
        else:
            time.sleep(rng.uniform(0, 1.5 * start_up))
        os.kill(trainer, signal.SIGKILL)
        os.waitpid(trainer, 0)
        os.close(read_end)
        orphans += reap_orphans(survivors)
    return {"orphans": len(orphans), "survivors": survivors}


def reap_orphans(survivors: list[str]) -> list[int]:
    """Wait for every remaining child (orphans reparented here); note and kill the ones that hang."""
    reaped: list[int] = []
    signal.signal(signal.SIGALRM, lambda *_: kill_children(survivors))
    signal.alarm(HANG_GUARD_S)
    try:
        while True:
            try:
                pid, _ = os.waitpid(-1, 0)
            except ChildProcessError:
                return reaped
            reaped.append(pid)
    finally:
        signal.alarm(0)


def kill_children(survivors: list[str]) -> None:
    """Kill this process's children, then again a second later: their own orphans come next."""
    signal.alarm(1)
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/children") as listing:
            for pid in listing.read().split():
                with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                    command = cmdline.read().replace(b"\0", b" ").decode()
                survivors.append(f"{pid}: {command}")
                os.kill(int(pid), signal.SIGKILL)


def start_late(ignore_others_sigterm: bool) -> None:
    """A worker whose trainer died before it was tied to it.

    It waits until the trainer is gone for good (reparented: its sentinel closes a moment
    earlier, and a worker tied to it in between dies too, by the death notice, just not here).
    """
    trainer = Trainer.of_this_process()
    while not trainer.gone():
        time.sleep(0.01)
    init_worker(None, 0, ignore_others_sigterm=ignore_others_sigterm)
    print(json.dumps({"survived": True}), flush=True)


def filter_sigterm(ready: Event) -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    trainer = Trainer.of_this_process()
    threading.Thread(target=_take_signals, args=(trainer, {signal.SIGTERM}), daemon=True).start()
    ready.set()
    threading.Event().wait()


def late_start(start_method: str, ignore_others_sigterm: bool) -> None:
    context = multiprocessing.get_context(start_method)
    worker = context.Process(target=start_late, args=(ignore_others_sigterm,))
    worker.start()
    print(json.dumps({"worker": worker.pid}), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def sigterm_filter(start_method: str) -> None:
    context = multiprocessing.get_context(start_method)
    ready = context.Event()
    worker = context.Process(target=filter_sigterm, args=(ready,))
    worker.start()
    ready.wait()
    print(json.dumps({"worker": worker.pid}), flush=True)
    threading.Event().wait()


def thread_ends(start_method: str) -> None:
    loader = Loader(build, num_workers=2, multiprocessing_context=start_method, persistent_workers=True)
    started: list[Iterator[Any]] = []
    thread = threading.Thread(target=lambda: started.append(iter(loader)))
    thread.start()
    thread.join()
    print(json.dumps({"batches": sum(1 for _ in started[0])}), flush=True)


if __name__ == "__main__":
    mode, method = sys.argv[1], sys.argv[2]
    if mode == "kills":
        print(json.dumps(kill_trainers(method, int(sys.argv[3]), int(sys.argv[4]))), flush=True)
    elif mode == "late_start":
        late_start(method, sys.argv[3] == "ignore_others_sigterm")
    elif mode == "sigterm_filter":
        sigterm_filter(method)
    else:
        thread_ends(method)
