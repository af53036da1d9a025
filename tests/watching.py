"""Watching other processes from tests: wait for a condition (no timing thresholds), read /proc."""

from __future__ import annotations

import os
import signal
import time
from typing import Callable

import pytest

HANG_GUARD_S = 120.0  # only a hang guard: conditions hold within milliseconds on an idle machine
POLL_S = 0.01


def wait_until(condition: Callable[[], bool], what: str, limit_s: float = HANG_GUARD_S) -> None:
    """Return once ``condition()`` holds; fail the test naming ``what`` if it never does."""
    deadline = time.monotonic() + limit_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"gave up waiting for {what} after {limit_s:.0f} s")
        time.sleep(POLL_S)


def running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (Linux)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def session_processes(session: int) -> list[int]:
    """The live processes of session ``session`` (a job started in its own, and everything it
    started: its orphans keep the session too)."""
    found = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/stat") as stat:
                fields = stat.read().rpartition(")")[2].split()
        except (FileNotFoundError, ProcessLookupError):  # exited meanwhile
            continue
        if int(fields[3]) == session and running(int(name)):  # fields[3]: the session id
            found.append(int(name))
    return found


def sigterm_pending(pid: int) -> bool:
    """Whether a SIGTERM sent to the process ``pid`` waits to be taken (its shared pending set)."""
    with open(f"/proc/{pid}/status") as status:
        pending = next(line for line in status if line.startswith("ShdPnd:"))
    return bool(int(pending.split()[1], 16) >> (signal.SIGTERM - 1) & 1)
