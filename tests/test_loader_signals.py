"""Loader workers and SIGTERM: a scheduler's SIGTERM is ignored, the trainer's is obeyed, and a
process that exits with live workers neither hangs nor prints errors."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.watching import sigterm_pending, wait_until

JOB = Path(__file__).resolve().parent / "loader_exit_job.py"
EXIT_LIMIT_S = 600  # a hang guard, not a speed check: a clean exit takes about a second

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="workers filter SIGTERM on Linux")


def run_job(mode: str) -> list[str]:
    job = subprocess.Popen(
        [sys.executable, str(JOB), mode],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert job.stdin is not None and job.stdout is not None
    if mode in ("other", "parent"):
        worker_pids = [int(pid) for pid in job.stdout.readline().split()]
        assert len(worker_pids) == 2
        if mode == "other":
            os.kill(worker_pids[0], signal.SIGTERM)  # this test process is not the workers' parent
            wait_until(lambda: not sigterm_pending(worker_pids[0]), "the worker to take the SIGTERM")
        job.stdin.write("go\n")
        job.stdin.flush()
    try:
        output, errors = job.communicate(timeout=EXIT_LIMIT_S)
    except subprocess.TimeoutExpired:
        job.kill()
        pytest.fail("the job hung at exit with live Loader workers")
    assert job.returncode == 0, output + errors
    assert "Traceback" not in errors and "Exception ignored" not in errors, errors
    return output.splitlines()


def test_sigterm_from_another_process_is_ignored_and_the_epoch_completes() -> None:
    lines = run_job("other")
    assert lines == [f"batches after the signal {400 // 4 - 1}", "alive True"]


def test_sigterm_from_the_trainer_stops_the_worker() -> None:
    assert run_job("parent") == [f"exitcode {-signal.SIGTERM}"]


def test_a_failed_restore_in_the_workers_does_not_hang_the_exit() -> None:
    assert run_job("wrong_state") == ["StateError"]


@pytest.mark.parametrize("mode", ["global", "global_persistent"])
def test_a_live_iterator_held_in_a_script_s_globals_exits_cleanly(mode: str) -> None:
    """The iterator is deleted after the interpreter has cleared the modules' globals: its
    shutdown must not reach for one (it printed an AttributeError from ``__del__``)."""
    assert run_job(mode) == ["batch [0, 2, 4, 6]"]


def test_a_batch_interrupted_on_its_way_is_not_in_the_state_taken_then(monkeypatch: pytest.MonkeyPatch) -> None:
    """A KeyboardInterrupt that lands after a worker's batch was taken in but before torch
    counted it handed out (torchdata's _process_data, below the Loader's): the state taken in
    the handler is as of the last batch handed out, and a Loader restored from it gives the
    interrupted batch next (it was once a state that no Loader would load: steps since -1)."""
    import numpy as np
    from torchdata.stateful_dataloader import stateful_dataloader

    import resumable as rs
    from resumable.torch import Loader

    def build() -> rs.Node:
        return rs.from_list(list(range(20))).shard().batch(2)

    expected = [np.asarray(batch).tolist() for batch in Loader(build, num_workers=2)]
    loader = Loader(build, num_workers=2)
    iterator = iter(loader)
    got = [np.asarray(next(iterator)).tolist() for _ in range(3)]

    def interrupted(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(stateful_dataloader._StatefulMultiProcessingDataLoaderIter, "_process_data", interrupted)
    with pytest.raises(KeyboardInterrupt):
        next(iterator)
    monkeypatch.undo()
    state = loader.state_dict()
    del iterator
    resumed = Loader(build, num_workers=2)
    resumed.load_state_dict(state)
    assert got + [np.asarray(batch).tolist() for batch in resumed] == expected
