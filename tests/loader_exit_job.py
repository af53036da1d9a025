"""A job for test_loader_signals: Loader workers, SIGTERM, and an exit with live workers.

Usage: python loader_exit_job.py MODE. Every mode exits with the loader's workers still running,
as a crashing or careless trainer does; the interpreter must not hang on them.
- ``other``: prints the worker pids, waits for a line on stdin (the first worker has taken the
  test's SIGTERM by then), finishes the epoch and reports whether that worker is alive.
- ``parent``: the same, but this process signals the worker and reports its exit code.
  torch's SIGCHLD handler is put back to the default first: it raises in whatever this process
  runs when the worker dies, which under CPU load can be any line after the ``kill``.
- ``wrong_state``: a state from another pipeline fails in the workers at start-up; the error
  (and with it the half-built iterator) is kept until exit.
- ``global`` and ``global_persistent``: the loader and its live iterator are the script's
  globals, deleted only as the interpreter clears its modules.
"""

from __future__ import annotations

import os
import signal
import sys

import resumable as rs
from resumable.torch import Loader

DOCUMENTS = 400


def build(batch_size: int = 4) -> rs.Node:
    return rs.from_list(list(range(DOCUMENTS))).shard().batch(batch_size)


def signal_a_worker(sender: str) -> None:
    loader = Loader(build, num_workers=2, prefetch_factor=2, persistent_workers=True)
    iterator = iter(loader)
    next(iterator)
    workers = iterator._workers  # type: ignore[attr-defined]  # torchdata's private worker list
    print(" ".join(str(w.pid) for w in workers), flush=True)
    sys.stdin.readline()
    if sender == "parent":
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.kill(workers[0].pid, signal.SIGTERM)
        workers[0].join()  # the test's timeout guards against a hang
        print(f"exitcode {workers[0].exitcode}", flush=True)
    else:
        print(f"batches after the signal {sum(1 for _ in iterator)}", flush=True)
        print(f"alive {workers[0].is_alive()}", flush=True)


def restore_a_wrong_state() -> BaseException:
    loader = Loader(build, num_workers=2)
    iterator = iter(loader)
    next(iterator)
    wrong = Loader(lambda: build(batch_size=5), num_workers=2)
    wrong.load_state_dict(loader.state_dict())
    try:
        next(iter(wrong))
    except rs.StateError as error:
        print(type(error).__name__, flush=True)
        return error
    raise SystemExit("a state from another pipeline was accepted")


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "wrong_state":
        kept = restore_a_wrong_state()
    elif mode.startswith("global"):
        loader = Loader(build, num_workers=2, persistent_workers=mode == "global_persistent")
        iterator = iter(loader)
        print(f"batch {[int(x) for x in next(iterator)]}", flush=True)
    else:
        signal_a_worker(mode)
