"""Atomic checkpoint files: a crash during a save keeps the previous checkpoint."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import pytest
import torch
import torch.distributed.checkpoint as dcp

import resumable as rs
import resumable._file_locks
import resumable.torch as rst
from resumable.checkpoint import write_atomically
from tests.resume import take
from tests.watching import wait_until

SAVERS: dict[str, Callable[[dict[str, int], Path], None]] = {"save_state": rs.save_state, "torch": rst.save}
LOADERS: dict[str, Callable[[Path], object]] = {"save_state": rs.load_state, "torch": rst.load}


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
    (tmp_path / "deep.json").write_text('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(rs.StateError, match="deep.json"):
        rs.load_state(tmp_path / "deep.json")
    (tmp_path / "nested.json").write_text('{"a": ' + "[" * 300 + "]" * 300 + "}")
    with pytest.raises(rs.StateError, match="nested more than"):
        rs.load_state(tmp_path / "nested.json")


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
    rst.save({"step": 0}, target)
    assert hidden(tmp_path) == []  # whatever the kills left is gone


def hidden(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


@pytest.mark.parametrize("saver", SAVERS)
def test_save_creates_missing_directories(tmp_path: Path, saver: str) -> None:
    target = tmp_path / "ckpt" / "step-1" / "data-rank0.json"
    SAVERS[saver]({"step": 1}, target)
    assert LOADERS[saver](target) == {"step": 1}


@pytest.mark.parametrize("saver", SAVERS)
@pytest.mark.parametrize("umask", [0o022, 0o027, 0o077], ids=oct)
def test_saved_files_follow_the_umask(tmp_path: Path, saver: str, umask: int) -> None:
    stale = tmp_path / ".c.partial"
    stale.write_bytes(b"left by a crash")
    stale.chmod(0o644)  # removed, not reused with its mode
    old = os.umask(umask)
    try:
        SAVERS[saver]({"step": 1}, tmp_path / "c")
    finally:
        os.umask(old)
    assert (tmp_path / "c").stat().st_mode & 0o777 == 0o666 & ~umask
    assert hidden(tmp_path) == []


KILLED_MID_SAVE = """
import os, signal, sys
from resumable.checkpoint import write_atomically

def crash(out):
    out.write(b"half a checkpoint")
    out.flush()
    os.kill(os.getpid(), signal.SIGKILL)

write_atomically(sys.argv[1], crash)
"""


@pytest.mark.parametrize("saver", SAVERS)
def test_the_next_save_removes_the_temporary_of_a_killed_save(tmp_path: Path, saver: str) -> None:
    target = tmp_path / "data-rank0.json"
    SAVERS[saver]({"step": 1}, target)
    killed = subprocess.run([sys.executable, "-c", KILLED_MID_SAVE, str(target)])
    assert killed.returncode == -signal.SIGKILL
    assert hidden(tmp_path) == [".data-rank0.json.partial"]
    assert LOADERS[saver](target) == {"step": 1}  # the previous checkpoint is intact
    SAVERS[saver]({"step": 2}, target)
    assert LOADERS[saver](target) == {"step": 2}
    assert hidden(tmp_path) == []


HELD_MID_SAVE = """
import sys
from resumable.checkpoint import write_atomically

def write_then_wait(out):
    out.write(b'{"writer": "other process"}')
    out.flush()
    print("writing", flush=True)
    sys.stdin.readline()

write_atomically(sys.argv[1], write_then_wait)
"""


def flock_waiters(path: Path) -> bool:
    """Whether some process waits for a lock on the file ``path`` (/proc/locks marks it ``->``)."""
    inode = f":{path.stat().st_ino} "
    with open("/proc/locks") as locks:
        return any("->" in line and inode in line for line in locks)


def test_a_live_writers_temporary_is_kept_and_saves_of_one_target_take_turns(tmp_path: Path) -> None:
    target = tmp_path / "data-rank0.json"
    temp = tmp_path / ".data-rank0.json.partial"
    writer = subprocess.Popen(
        [sys.executable, "-c", HELD_MID_SAVE, str(target)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert writer.stdin is not None and writer.stdout is not None
    try:
        assert writer.stdout.readline() == "writing\n"
        live = temp.stat().st_ino
        second = threading.Thread(target=rs.save_state, args=({"writer": "this process"}, target))
        second.start()
        wait_until(lambda: flock_waiters(temp), "the second save to wait for the first")
        assert temp.stat().st_ino == live  # neither removed nor replaced
        writer.stdin.write("go\n")
        writer.stdin.flush()
        assert writer.wait(timeout=120) == 0  # its rename found its temporary
        second.join()
    finally:
        writer.kill()
    assert rs.load_state(target) == {"writer": "this process"}  # the second save came last
    assert hidden(tmp_path) == []


def test_concurrent_saves_of_one_target_leave_one_whole_file(tmp_path: Path) -> None:
    target = tmp_path / "state.json"
    payloads = [{"writer": writer, "data": list(range(writer * 1000))} for writer in range(4)]

    def save_repeatedly(payload: dict[str, object]) -> None:
        for _ in range(20):
            rs.save_state(payload, target)

    threads = [threading.Thread(target=save_repeatedly, args=(payload,)) for payload in payloads]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert rs.load_state(target) in payloads
    assert hidden(tmp_path) == []


def test_without_file_locks_saves_use_their_own_temporaries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_locks(handle: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(resumable._file_locks.fcntl, "flock", no_locks)
    (tmp_path / ".c.partial").write_bytes(b"maybe a live writer's: cannot tell without locks")
    rs.save_state({"step": 1}, tmp_path / "c")
    assert rs.load_state(tmp_path / "c") == {"step": 1}
    assert hidden(tmp_path) == [".c.partial"]  # left alone
