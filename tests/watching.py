"""Watching other processes from tests: wait for a condition (no timing thresholds), read /proc;
and whether a dropped pipeline is freed at once."""

from __future__ import annotations

import contextlib
import gc
import os
import resource
import signal
import time
import weakref
from typing import Any, Callable, Iterator

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


def assert_freed_at_once(holder: list[Any]) -> None:
    """Drop the pipeline ``holder`` holds (a list holding the only reference to it) with the
    cyclic collector off: every node of its subtree is freed at once, so no node holds a
    reference to itself (its threads stop, its memory maps and files close then, not when the
    collector runs)."""
    node = holder.pop()
    refs = [weakref.ref(part) for part in node._subtree()]
    gc.disable()
    try:
        del node
        assert [ref() for ref in refs] == [None] * len(refs)
    finally:
        gc.enable()


def error_of(action: Callable[[], Any]) -> BaseException | None:
    """The exception ``action`` raises, or None. The collector runs here, inside the test:
    half-built torchdata iterators (whose ``__del__`` fails, ``_shutdown`` never set) and loaders
    left in cycles are collected now, not later in pytest's own traceback formatting."""
    try:
        action()
    except Exception as caught:  # noqa: BLE001  # which type is the point of the test
        error: BaseException | None = caught
        error.__traceback__ = None
    else:
        error = None
    gc.collect()
    return error


def open_descriptors() -> int:
    """How many file descriptors this process holds (Linux)."""
    return len(_descriptors_in_use())


def _descriptors_in_use() -> set[int]:
    """The numbers of this process's open descriptors (Linux), without the one that listed them."""
    listed = {int(name) for name in os.listdir("/proc/self/fd")}
    in_use: set[int] = set()
    for descriptor in listed:
        try:
            os.fstat(descriptor)
        except OSError:  # the listing's own, closed by now
            continue
        in_use.add(descriptor)
    return in_use


@contextlib.contextmanager
def descriptor_limit(extra: int) -> Iterator[None]:
    """The soft limit of open files lowered so that exactly ``extra`` descriptor numbers are free
    below it (a process with its usual 1024 and a few hundred shards is in the same place),
    restored after. The limit bounds numbers, not counts: numbers in use above it and gaps below
    it are both taken into account."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    in_use = _descriptors_in_use()
    limit, free = 0, 0
    while free < extra:
        free += limit not in in_use
        limit += 1
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(limit, hard), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
