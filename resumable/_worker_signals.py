"""Signals inside worker processes: a worker dies with its trainer and leaves Ctrl-C to it; a
DataLoader worker, while the trainer lives, obeys only the trainer's SIGTERM (Linux).

The trainer is the process that started the worker (the one iterating the loader, or the
pipeline whose map or index scan owns the pool). torch's
own watchdog in the worker compares ``getppid()`` with the parent it first sees *after*
``worker_init_fn`` and the restore ran, so a trainer killed during worker start-up (or any
time under a fork server) leaves workers that wait for work for ever, and a worker that
ignores other processes' SIGTERM would then ignore everybody's.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
import threading
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from typing import Callable

LINUX = sys.platform.startswith("linux")
PARENT_DEATH_SIGNAL = signal.SIGRTMIN + 2 if LINUX else 0  # 0: never armed elsewhere
"""What the kernel sends a worker when the thread that started it exits: a real-time signal the
worker takes in its signal thread. Not SIGKILL: Linux sends it when that *thread* exits, and a
trainer whose thread that started the workers ends while the process goes on keeps its workers."""

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def init_worker(user_init: Callable[[int], None] | None, worker_id: int, *, ignore_others_sigterm: bool) -> None:
    """``worker_init_fn`` of ``Loader``: leave Ctrl-C to the trainer (as ``init_pool_worker``
    does; torch's workers otherwise exit on it, and the iterator then fails on its next batch),
    tie the worker to its trainer, then run the user's own."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if LINUX:
        watch_trainer(Trainer.of_this_process(), ignore_others_sigterm)
    if user_init is not None:
        user_init(worker_id)


@dataclass(frozen=True)
class Trainer:
    """The process that started this worker, and how to tell that it has exited."""

    pid: int
    process: BaseProcess | None
    """multiprocessing's handle on the trainer; its sentinel reads end-of-file once it exits."""
    via_fork_server: bool
    """Started by a fork server, whose child the worker is (the trainer is not its parent)."""

    @classmethod
    def of_this_process(cls) -> Trainer:
        parent = multiprocessing.parent_process()
        pid = parent.pid if parent is not None and parent.pid is not None else os.getppid()
        return cls(pid, parent, multiprocessing.get_start_method(allow_none=True) == "forkserver")

    def gone(self) -> bool:
        """Whether the trainer has exited. Exact, whatever pids were reused since.

        A worker started by fork or spawn is the trainer's child and is reparented the moment
        it exits. The fork server outlives the trainer, so there it is the sentinel that
        tells: only the trainer holds its other end.
        """
        if self.via_fork_server:
            return self.process is not None and not self.process.is_alive()
        return os.getppid() != self.pid


def watch_trainer(trainer: Trainer, ignore_others_sigterm: bool) -> None:
    """Die with ``trainer`` from now on, and take SIGTERM only from it while it lives.

    A worker started by fork or spawn arms the kernel's parent-death signal. Under a fork
    server no notice would ever come (the server outlives the trainer), so a thread waits on
    the trainer's sentinel instead. Then the trainer is checked: it may have died between the
    fork and this call, before there was anything to notify. The signals are blocked in this (the
    worker's main) thread and in every thread started from it, and one daemon thread takes
    them with ``sigwaitinfo``, which tells who sent them.
    """
    waited: set[int] = {signal.SIGTERM} if ignore_others_sigterm else set()
    if not trainer.via_fork_server:
        waited.add(PARENT_DEATH_SIGNAL)
    signal.pthread_sigmask(signal.SIG_BLOCK, waited)  # first: threads inherit the mask
    if trainer.via_fork_server:
        if trainer.process is not None:
            _start_thread(_die_when_sentinel_closes, trainer.process)
    else:
        _set_parent_death_signal(PARENT_DEATH_SIGNAL)
    if trainer.gone():  # before the watch was armed: now, not at some later moment
        _die()
    if waited:
        _start_thread(_take_signals, trainer, waited)


def init_pool_worker() -> None:
    """Initializer of every worker of the library's process pools (``ParallelMap`` in process
    mode, ``IndexedFilter``'s scan): SIGINT ignored, and death with the trainer.

    A terminal's Ctrl-C sends SIGINT to the whole process group: a worker that took it would
    raise ``KeyboardInterrupt`` inside ``fn``, and the chunks in flight would carry it back after
    the trainer's own handler had run, so iterating on would fail. A trainer killed outright runs
    no shutdown, and the pool's workers, blocked on queues they hold open themselves (and the fork
    server that forked them), would wait for ever; the trainer's sentinel tells them, forked by a
    fork server or by the trainer alike."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    trainer = multiprocessing.parent_process()
    if trainer is not None:
        _start_thread(_die_when_sentinel_closes, trainer)


def _start_thread(target: Callable[..., None], *args: object) -> None:
    name = f"resumable-{target.__name__.lstrip('_')}"
    threading.Thread(target=target, args=args, name=name, daemon=True).start()


def _die_when_sentinel_closes(trainer: BaseProcess) -> None:
    trainer.join()  # waits on the sentinel: returns once the trainer has exited (at once if it has)
    _die()


def _take_signals(trainer: Trainer, waited: set[int]) -> None:
    """Exit on the trainer's SIGTERM or on anybody's once it is gone; die with the trainer."""
    while True:
        received = signal.sigwaitinfo(waited)
        if received.si_signo == PARENT_DEATH_SIGNAL:
            if trainer.gone():  # else only the trainer's thread that started this worker ended
                _die()
        elif received.si_pid == trainer.pid or trainer.gone():
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
            os.kill(os.getpid(), signal.SIGTERM)  # delivered to this thread: default action, exit
            return


def _set_parent_death_signal(signum: int) -> None:
    """``prctl(PR_SET_PDEATHSIG, signum)``: the kernel sends ``signum`` when the parent thread exits."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, ctypes.c_ulong(signum), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0)):
        error = ctypes.get_errno()
        raise OSError(error, f"DataLoader worker: prctl(PR_SET_PDEATHSIG) failed: {os.strerror(error)}")


def _die() -> None:
    """Exit at once, as if killed together with the trainer: nobody is left to report to."""
    os.kill(os.getpid(), signal.SIGKILL)
