"""Loader workers die with their trainer, whenever it dies: during their start-up, before they
are tied to it, or later; an orphaned worker obeys anybody's SIGTERM; and a worker outlives the
trainer's *thread* that started it (Linux's parent-death signal follows threads)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.watching import running, sigterm_pending, wait_until

JOB = Path(__file__).resolve().parent / "worker_death_job.py"
JOB_LIMIT_S = 600  # a hang guard, not a speed check
START_METHODS = ("fork", "spawn", "forkserver")
KILLS = {"fork": 10, "spawn": 2, "forkserver": 2}  # a spawned worker takes seconds to start; the first
# kill lands after the first batch (orphans for sure), the others at random around start-up

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal: Linux")


def start_job(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, str(JOB), *args], stdout=subprocess.PIPE, text=True)


def finish(job: subprocess.Popen[str]) -> list[dict[str, Any]]:
    """The job's JSON lines, once its stdout is closed by every process that holds it."""
    try:
        output, _ = job.communicate(timeout=JOB_LIMIT_S)
    except subprocess.TimeoutExpired:
        job.kill()
        pytest.fail("a worker outlived its trainer (the job's output never closed)")
    return [json.loads(line) for line in output.splitlines()]


@pytest.mark.parametrize("start_method", START_METHODS)
def test_no_worker_outlives_a_trainer_killed_around_worker_start_up(start_method: str) -> None:
    job = start_job("kills", start_method, str(KILLS[start_method]), "0")
    [report] = finish(job)
    assert report["survivors"] == []
    assert report["orphans"] > 0  # some kills did land after the workers were started


@pytest.mark.parametrize(
    ("start_method", "ignore_others_sigterm"),
    [("fork", True), ("fork", False), ("spawn", True), ("forkserver", True), ("forkserver", False)],
)
def test_a_worker_whose_trainer_died_before_it_started_exits(start_method: str, ignore_others_sigterm: bool) -> None:
    flag = "ignore_others_sigterm" if ignore_others_sigterm else "obey_all"
    job = start_job("late_start", start_method, flag)
    lines = finish(job)
    assert len(lines) == 1 and "worker" in lines[0]  # and no {"survived": true}
    wait_until(lambda: not running(lines[0]["worker"]), "the worker to finish exiting")  # its files close first


def test_an_orphaned_worker_obeys_any_sigterm() -> None:
    job = start_job("sigterm_filter", "fork")
    assert job.stdout is not None
    try:
        worker = json.loads(job.stdout.readline())["worker"]
        os.kill(worker, signal.SIGTERM)  # this test is not the worker's trainer: ignored
        wait_until(lambda: not sigterm_pending(worker), "the worker to take the SIGTERM")
        assert running(worker)
    finally:
        job.kill()  # the trainer dies; the filter alone stays (no death notice in this job)
        job.wait()
    os.kill(worker, signal.SIGTERM)
    assert finish(job) == []
    wait_until(lambda: not running(worker), "the worker to finish exiting")


def test_workers_outlive_the_thread_that_started_them() -> None:
    job = start_job("thread_ends", "fork")
    assert finish(job) == [{"batches": 10_000 // 4}]
    assert job.returncode == 0
