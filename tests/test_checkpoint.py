"""Atomic checkpoint files: a crash during a save keeps the previous checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import resumable as rs
import resumable.torch as rst
from resumable.checkpoint import write_atomically
from tests.resume import take


def pipeline() -> rs.Node:
    return rs.from_list(list(range(40))).shuffle(2).filter(lambda x: x % 3).batch(3)


def test_save_and_load_state_as_json(tmp_path: Path) -> None:
    pipe = pipeline()
    take(pipe, 4)
    rs.save_state(pipe.get_state(), tmp_path / "state.json")
    assert json.loads((tmp_path / "state.json").read_text()) == pipe.get_state()
    resumed = pipeline()
    resumed.set_state(rs.load_state(tmp_path / "state.json"))
    assert list(resumed) == list(pipe)


def test_unreadable_state_files_are_state_errors(tmp_path: Path) -> None:
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(rs.StateError, match="bad.json: cannot read a state"):
        rs.load_state(tmp_path / "bad.json")
    with pytest.raises(rs.StateError, match="a state is a JSON object"):
        rs.load_state(tmp_path / "list.json")
    with pytest.raises(rs.StateError, match="missing.json"):
        rs.load_state(tmp_path / "missing.json")


def test_failed_write_keeps_the_previous_file_and_no_temporaries(tmp_path: Path) -> None:
    target = tmp_path / "ckpt.pt"
    rst.save({"step": 1}, target)

    def crash(out) -> None:
        out.write(b"partial")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        write_atomically(target, crash)
    assert rst.load(target) == {"step": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]


def test_torch_checkpoint_holds_model_optimiser_and_data_state(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 2)
    optimiser = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimiser.step()
    pipe = pipeline()
    take(pipe, 2)
    checkpoint = {"model": model.state_dict(), "optimiser": optimiser.state_dict(), "data": pipe.get_state()}
    rst.save(checkpoint, tmp_path / "c.pt")
    loaded = rst.load(tmp_path / "c.pt")  # weights_only=True: nothing unpickled
    assert loaded["data"] == pipe.get_state()
    assert torch.equal(loaded["model"]["weight"], model.state_dict()["weight"])


def test_distributed_checkpoint_round_trip(tmp_path: Path) -> None:
    pipe = pipeline()
    take(pipe, 3)
    dcp.save({"data": pipe}, checkpoint_id=str(tmp_path / "dcp"))
    resumed = pipeline()
    dcp.load({"data": resumed}, checkpoint_id=str(tmp_path / "dcp"))
    assert list(resumed) == list(pipe)


SAVER = """
import sys, torch
import resumable.torch as rst
step = 0
payload = torch.zeros(2_000_000)
while True:
    step += 1
    payload += 1
    rst.save({"step": step, "payload": payload}, sys.argv[1])
"""


def test_sigkill_during_saves_never_corrupts_the_checkpoint(tmp_path: Path) -> None:
    target = tmp_path / "ckpt.pt"
    steps = []
    for attempt in range(5):
        process = subprocess.Popen([sys.executable, "-c", SAVER, str(target)])
        deadline = time.monotonic() + 60
        while not target.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.1 + 0.07 * attempt)
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
        checkpoint = rst.load(target)  # always a whole checkpoint
        assert torch.all(checkpoint["payload"] == checkpoint["step"])
        steps.append(checkpoint["step"])
    assert all(step >= 1 for step in steps)
