"""The training example killed again and again: the optimiser consumes exactly the batches of
an uninterrupted run (none lost, none repeated) and ends with bit-identical weights; a trainer
killed alone leaves none of its DataLoader workers behind."""

from __future__ import annotations

import importlib.util
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.watching import session_processes, wait_until

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
STEPS = 60


def load_demo():  # type: ignore[no-untyped-def]  # returns the demo module
    spec = importlib.util.spec_from_file_location("resumable_demo", EXAMPLES / "demo.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]  # the demo file exists
    spec.loader.exec_module(module)  # type: ignore[union-attr]  # a file spec has a loader
    return module


def test_sigkill_twice_then_sigterm(tmp_path: Path) -> None:
    """What ``./dev demo`` does (three SIGKILLs, two SIGTERMs), one restart of each kind fewer."""
    demo = load_demo()
    reference, interrupted = tmp_path / "runs" / "reference", tmp_path / "runs" / "interrupted"
    assert demo.run_job(reference, STEPS) == 0
    events = demo.run_with_interruptions(interrupted, STEPS, kills=2, terms=1, seed=1)
    kills = [e for e in events if e.startswith("SIGKILL")]
    terms = [e for e in events if e.startswith("SIGTERM")]
    assert len(kills) == 2 and all("exit status -9" in e for e in kills), events
    assert len(terms) == 1 and all("exit status 0" in e for e in terms), events  # graceful: saved, exited
    assert events[-1] == "finished (exit status 0)"
    assert demo.log_lines(interrupted) == STEPS
    same_batches, same_weights = demo.compare(reference, interrupted)
    assert same_batches, "the optimiser consumed other batches than in the uninterrupted run"
    assert same_weights


def test_sigterm_saves_a_checkpoint_at_the_current_step(tmp_path: Path) -> None:
    demo = load_demo()
    run = tmp_path / "runs" / "a"
    status = demo.run_job(run, STEPS, stop_at=7, sig=signal.SIGTERM)
    assert status == 0
    import resumable.torch as rst

    checkpoint = rst.load(run / "checkpoint.pt")
    assert checkpoint["step"] == demo.log_lines(run) >= 7  # the checkpoint covers every logged step


def test_a_trainer_killed_alone_at_random_moments_leaves_no_worker(tmp_path: Path) -> None:
    """The first kill lands at a step and measures a restart; the others at random moments of
    the restart (which resumes, then starts the workers)."""
    demo = load_demo()
    run = tmp_path / "runs" / "trainer-only"
    command = [sys.executable, str(demo.TRAIN), "--run-dir", str(run), "--steps", str(STEPS)]
    rng = random.Random(4)
    restart_s = 0.0
    for kill in range(3):  # a measured kill, then two at random moments of a restart
        first_new_step = demo.log_lines(run) + 1
        launched = time.monotonic()
        trainer = subprocess.Popen(command, start_new_session=True, stdout=subprocess.DEVNULL)
        if kill == 0:
            wait_until(lambda: trainer.poll() is not None or demo.log_lines(run) >= first_new_step, "a step")
            restart_s = time.monotonic() - launched
            assert len(session_processes(trainer.pid)) > 1  # the trainer and its workers
        else:
            time.sleep(rng.uniform(0.5, 1.2) * restart_s)
        assert trainer.poll() is None
        trainer.kill()  # the trainer alone, not its process group
        trainer.wait()
        wait_until(lambda: session_processes(trainer.pid) == [], "the workers to die with their trainer")
