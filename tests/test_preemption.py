"""The training example killed again and again: the optimiser consumes exactly the batches of
an uninterrupted run (none lost, none repeated) and ends with bit-identical weights."""

from __future__ import annotations

import importlib.util
import signal
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
STEPS = 90


def load_demo():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("resumable_demo", EXAMPLES / "demo.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def test_sigkill_ten_times_then_sigterm_three_times(tmp_path: Path) -> None:
    demo = load_demo()
    reference, interrupted = tmp_path / "runs" / "reference", tmp_path / "runs" / "interrupted"
    assert demo.run_job(reference, STEPS) == 0
    events = demo.run_with_interruptions(interrupted, STEPS, kills=10, terms=3, seed=1)
    kills = [e for e in events if e.startswith("SIGKILL")]
    terms = [e for e in events if e.startswith("SIGTERM")]
    assert len(kills) == 10 and all("exit status -9" in e for e in kills), events
    assert len(terms) == 3 and all("exit status 0" in e for e in terms), events  # graceful: saved, exited
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
