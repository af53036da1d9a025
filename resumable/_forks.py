"""One place where a forked child sets right what it inherited from its parent.

A fork copies the parent's objects but none of its threads: a lock a reader thread held stays
held for ever, a pool or a fetch in flight is the parent's, an open file shares the parent's
offset. Objects that hold such things register here (``inherited``), and one handler, run in
every forked child (a DataLoader worker, a ``multiprocessing`` child), takes them in two
rounds: each first lets go of what is the parent's without touching it
(``InheritedByForks._forget_the_parent``); then, once none holds anything of the parent's,
those that must move do (a read-ahead node returns its upstream to the last item it handed
out, which reads the sources). Module-level state (a process's thread pool, the parent's fork
server) is set right before either round, by functions registered with ``at_fork``.
"""

from __future__ import annotations

import os
import weakref
from typing import Callable, Optional

Settle = Optional[Callable[[], None]]
"""What ``_forget_the_parent`` returns: the object's second round, or None."""


class InheritedByForks:
    """An object holding something of its own process's (a thread, a lock, a pool, an open
    file), registered with ``inherited`` when built and when unpickled."""

    def _forget_the_parent(self) -> Settle:
        """In a forked child: let go of the parent's threads, locks, pools and files without
        touching them; return what to do once every object has (None: nothing)."""
        raise NotImplementedError


_LIVE: weakref.WeakSet[InheritedByForks] = weakref.WeakSet()
_RESETS: list[Callable[[], None]] = []


def inherited(holder: InheritedByForks) -> None:
    """Have ``holder`` set right in every process forked from this one while it is alive."""
    _LIVE.add(holder)


def at_fork(reset: Callable[[], None]) -> None:
    """Run ``reset`` first in every process forked from this one (module-level state)."""
    _RESETS.append(reset)


def _in_forked_child() -> None:
    for reset in _RESETS:
        reset()
    settles = [settle for holder in list(_LIVE) if (settle := holder._forget_the_parent()) is not None]
    for settle in settles:
        settle()


os.register_at_fork(after_in_child=_in_forked_child)
