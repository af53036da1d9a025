"""Signal handling inside DataLoader workers: which SIGTERM a worker obeys."""

from __future__ import annotations

import os
import signal
import threading
from typing import Callable


def init_worker(user_init: Callable[[int], None] | None, worker_id: int) -> None:
    _ignore_sigterm_unless_from_parent()
    if user_init is not None:
        user_init(worker_id)


def _ignore_sigterm_unless_from_parent() -> None:
    """Let only the parent's SIGTERM through: a scheduler's one is ignored, the loader's is not.

    The parent terminates workers with SIGTERM when it shuts them down, and Python's own exit
    hook (``multiprocessing.util._exit_function``) terminates then *joins* them, so a worker
    that ignored every SIGTERM would hang its parent's exit. SIGTERM is blocked in this (the
    worker's main) thread and in every thread started from it, and one daemon thread takes
    each SIGTERM with ``sigwaitinfo``, which tells who sent it.
    """
    if not hasattr(signal, "sigwaitinfo"):  # macOS and Windows: keep the default (exit)
        return
    parent = os.getppid()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

    def wait_for_parent_sigterm() -> None:
        while signal.sigwaitinfo({signal.SIGTERM}).si_pid != parent:
            pass
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        os.kill(os.getpid(), signal.SIGTERM)  # delivered to this thread: default action, exit

    threading.Thread(target=wait_for_parent_sigterm, name="resumable-sigterm", daemon=True).start()

