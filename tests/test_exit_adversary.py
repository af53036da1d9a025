"""Scripts that exit, or are interrupted, with live pipelines and loaders: no hang, the expected
exit code, nothing on stderr but the expected traceback, no process left behind, and a state
taken in a ``KeyboardInterrupt`` handler resumes exactly.

Each case runs one job (below) in a fresh interpreter, in its own session so that every process
it started can be found in ``/proc`` after it exits. A job holds many live things at once (a
prefetch thread, thread and process pools, a disk cache, JSONL, Parquet and stream sources, an
``.even()``, ``rs.torch.Loader`` with 0, 1 and 2 workers, persistent or not), in globals, in
locals, in reference cycles and in ``with`` blocks, and then exits one way: it falls off the end
(also under ``-W error -X dev``), calls ``sys.exit``, raises, takes a SIGINT (its own, a parent's at
a random moment, or its process group's as a terminal's Ctrl-C sends it), or is killed.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.watching import HANG_GUARD_S, session_processes, wait_until

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

REPO = Path(__file__).resolve().parent.parent
RECORDS = 240
LEFT_BEHIND_LIMIT_S = 20.0  # only a hang guard: processes go within milliseconds of their parent

JOB = r'''
import json, os, signal, sys, time

# As a script started from a terminal: a parent started in the background by a shell without job
# control passes SIGINT on ignored, and Python then installs no KeyboardInterrupt handler.
signal.signal(signal.SIGINT, signal.default_int_handler)

import resumable as rs

FOLDER = sys.argv[2]
JSONL, PARQUET, CACHE = (os.path.join(FOLDER, name) for name in ("d.jsonl", "d.parquet", "cache"))
RECORDS = [{"v": i} for i in range(int(sys.argv[3]))]
K = 5  # items handed out before the job stops, exits or is interrupted
DONE = object()  # the end of an epoch, as next(iterator, DONE) gives it


def double(x):
    return {"v": x["v"] * 2}


def double_all(xs):
    return [{"v": x["v"] * 2} for x in xs]


def ignores_sigint(pid):
    with open(f"/proc/{pid}/status") as status:
        ignored = next(int(line.split()[1], 16) for line in status if line.startswith("SigIgn:"))
    return bool(ignored >> (signal.SIGINT - 1) & 1)


def wait_for_pool(obj):
    """Wait until every worker of the pool of the process map in ``obj``'s chain (if any) has
    run its initializer, which ignores SIGINT: before it, a worker still starting has Python's
    default handler, as any ``ProcessPoolExecutor``'s, and would print a traceback."""
    node = obj
    while node is not None and not hasattr(node, "_pool"):
        node = getattr(node, "upstream", None)
    pool = getattr(node, "_pool", None)
    pids = [process.pid for process in getattr(pool, "_processes", {}).values()]
    while not all(ignores_sigint(pid) for pid in pids):
        time.sleep(0.01)


def failing(x):
    if x["v"] == 9:
        raise ValueError("nine")
    return x


def batches():
    return rs.from_list(RECORDS).shard().map(double).batch(4)


def loader(num_workers, persistent=False, build=batches):
    # imported here, so that the forkserver, which imports this script, need not import torch
    from resumable.torch import Loader

    return Loader(build, num_workers=num_workers, persistent_workers=persistent)


def failing_batches():
    return rs.from_list(RECORDS).shard().map(failing).batch(4)


PIPELINES = {
    "prefetch": lambda: rs.from_list(RECORDS).prefetch(4),
    "thread_map": lambda: rs.jsonl(JSONL).shuffle(seed=1).map(double, num_workers=2).prefetch(2),
    "process_map": lambda: rs.from_list(RECORDS).map(double, num_workers=2, mode="process"),
    "batched_process_map": lambda: (
        rs.parquet(PARQUET).map(double_all, num_workers=2, mode="process", batched=True).batch(4)
    ),
    "batched_thread_map": lambda: rs.from_list(RECORDS).map(double_all, num_workers=2, batched=True).prefetch(2),
    "disk_cache": lambda: rs.from_list(RECORDS).cache(CACHE).map(double, num_workers=2).prefetch(2),
    "stream": lambda: rs.jsonl_stream(JSONL).map(double, num_workers=2),
    "even": lambda: rs.from_list(RECORDS).shard().map(double, num_workers=2).even(),
    "loader0": lambda: loader(0),
    "loader1": lambda: loader(1),
    "loader2": lambda: loader(2),
    "loader2_persistent": lambda: loader(2, persistent=True),
}


def plain(item):
    if hasattr(item, "tolist"):
        return item.tolist()
    if isinstance(item, dict):
        return {key: plain(value) for key, value in item.items()}
    if isinstance(item, (list, tuple)):
        return [plain(value) for value in item]
    return item


def state_of(obj):
    return obj.state_dict() if hasattr(obj, "load_state_dict") and not isinstance(obj, rs.Node) else obj.get_state()


def restored(name, state):
    obj = PIPELINES[name]()
    if not isinstance(obj, rs.Node):  # a Loader
        obj.load_state_dict(json.loads(json.dumps(state)))
    else:
        obj.set_state(json.loads(json.dumps(state)))
    return obj


def started(name, k=K):
    """``name`` built and iterated ``k`` items: the object and its live iterator."""
    obj = PIPELINES[name]()
    iterator = iter(obj)
    for _ in range(k):
        next(iterator)
    return obj, iterator


def say(*words):
    print(*words, flush=True)


class Box:
    """A reference cycle holding what it is given."""

    def __init__(self, *held):
        self.held, self.me = held, self


def loop_that_raises(name):
    """A live pipeline in a frame that a kept exception's traceback holds."""
    obj, iterator = started(name)
    raise RuntimeError(f"kept, holding {obj!r} {iterator!r}")


def resume_after_interrupt(name, wait_for_parent):
    """Iterate ``name``; after K items, SIGINT this process (or tell the parent, which sends it);
    take the state in the handler; a fresh object restored from it continues exactly."""
    reference = [plain(x) for x in PIPELINES[name]()]
    obj, got = PIPELINES[name](), []
    # KeyboardInterrupt inside next() (what is tested: the object's state as the signal finds
    # it); one that lands after next() returned but before the item is counted here waits
    # until it is, or this script would miss an item the object handed out
    inside_next, pending = [False], []

    def on_sigint(signum, frame):
        if inside_next[0]:
            raise KeyboardInterrupt
        pending.append(signum)

    signal.signal(signal.SIGINT, on_sigint)
    iterator = iter(obj)
    try:
        while True:
            inside_next[0] = True
            item = next(iterator, DONE)
            inside_next[0] = False
            if item is DONE:
                break
            got.append(plain(item))
            if pending:
                raise KeyboardInterrupt
            if len(got) == K:
                if wait_for_parent:
                    say("READY")
                else:
                    os.kill(os.getpid(), signal.SIGINT)
            if wait_for_parent:
                time.sleep(0.005)
        while not pending:  # the signal came after the last item: wait for it
            time.sleep(0.01)
        raise KeyboardInterrupt
    except KeyboardInterrupt:
        inside_next[0] = False
        signal.signal(signal.SIGINT, signal.default_int_handler)
        state = state_of(obj)
    rest = [plain(x) for x in restored(name, state)]
    # A signal that came after the last item leaves a state taken after the epoch's end, from
    # which iterating starts the next epoch (the same items: these pipelines do not shuffle).
    exact = got + rest == reference or (got == reference and rest == reference)
    say(f"resumed {name} after {len(got)}:", "exact" if exact else "WRONG")
    return obj


GROUP_INTERRUPTED = ("process_map", "batched_process_map", "loader2", "loader2_persistent")


def group_interrupt(name):
    """Ctrl-C as a terminal sends it, SIGINT to the whole process group (the pool's workers too),
    after K items, once the pool's workers have started (``wait_for_pool``); the handler takes the state; iterating
    on (the same pipeline, or the Loader's same iterator) continues exactly, and so does a fresh
    one restored from the state."""
    reference = [plain(x) for x in PIPELINES[name]()]
    obj, got = PIPELINES[name](), []
    iterator = iter(obj)  # a Loader's: iter(loader) again would start a new epoch
    try:
        for item in iterator:
            got.append(plain(item))
            if len(got) == K:
                wait_for_pool(obj)
                os.killpg(os.getpgrp(), signal.SIGINT)
        while True:
            time.sleep(0.01)
    except KeyboardInterrupt:
        state = state_of(obj)
    same = got + [plain(x) for x in iterator]
    fresh = got + [plain(x) for x in restored(name, state)]
    say(f"group interrupt {name}:", "exact" if same == reference == fresh else "WRONG")


def hold_everything(dev_mode):
    """Live things of every kind, held every way, as a careless training script leaves them: one
    process pool live, one in a reference cycle (a kept exception's traceback), one closed."""
    skipped = {"batched_process_map"}
    held = {name: started(name) for name in PIPELINES if name not in skipped}
    held["cycle"] = Box(*started("thread_map"), *started("loader2_persistent"))
    try:
        loop_that_raises("batched_process_map")
    except RuntimeError as error:
        held["kept_error"] = error
    with PIPELINES["stream"]() as pipe:  # a stream closed by its with block
        next(pipe)
    closing = PIPELINES["loader2"]()
    with closing:
        iterator = iter(closing)
        next(iterator)
    held["closed_loader"] = closing, iterator
    before_iter = PIPELINES["loader2"]()
    before_iter.load_state_dict(state_of(held["loader2"][0]))
    held["restored_not_iterated"] = before_iter
    failing_loader = loader(2, build=failing_batches)
    try:
        for _ in failing_loader:
            pass
    except Exception as error:  # the worker's ValueError, raised again here
        held["worker_raised"] = failing_loader, error
    closed, iterator = held["process_map"]
    closed.close()
    held["closed_pipeline"] = started("process_map")[0]
    held["closed_pipeline"].close()
    return held


def light():
    """One live thing of each kind of worker: a thread, a thread pool, a process pool, Loader workers."""
    return [started(name) for name in ("prefetch", "thread_map", "process_map", "loader2", "loader2_persistent")]


if __name__ == "__main__":
    MODE = sys.argv[1]
    if MODE == "interrupt":
        KEPT = [resume_after_interrupt(name, False) for name in PIPELINES if name != "batched_process_map"]
    elif MODE in ("parent_interrupt_process_map", "parent_interrupt_loader2"):
        KEPT = resume_after_interrupt(MODE.removeprefix("parent_interrupt_"), True)
    elif MODE == "group_interrupt":
        for name in GROUP_INTERRUPTED:
            group_interrupt(name)
    elif MODE == "killed":
        names = ("prefetch", "thread_map", "process_map", "disk_cache", "stream", "loader2", "loader2_persistent")
        KEPT = [started(name) for name in names]
        say("READY")
        while True:
            time.sleep(0.01)
    elif MODE == "end":
        HELD = hold_everything(dev_mode=False)
    elif MODE == "dev":  # everything in a function's locals, dropped as it returns; a few things global
        def scope():
            mine = hold_everything(dev_mode=True)
            say("held", len(mine))

        scope()
        HELD = light()
    else:
        HELD = light()
        if MODE == "exit3":
            for item in PIPELINES["process_map"]():
                sys.exit(3)
        elif MODE == "raise":
            for item in PIPELINES["loader2"]():
                raise RuntimeError("boom")
    say("exiting")
'''


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The job script, with a JSONL and a Parquet file of the records beside it."""
    folder = tmp_path_factory.mktemp("exit_adversary")
    with open(folder / "d.jsonl", "w") as f:
        f.writelines(json.dumps({"v": i}) + "\n" for i in range(RECORDS))
    pq.write_table(pa.table({"v": list(range(RECORDS))}), folder / "d.parquet", row_group_size=50)
    (folder / "job.py").write_text(JOB)
    return folder


def run_job(
    folder: Path, mode: str, flags: tuple[str, ...] = (), send: signal.Signals | None = None
) -> tuple[int, str, str]:
    """Run the job in ``mode``; with ``send``, send that signal to it (its main process only) at
    a random moment after it says READY. Fails the test on a hang or a process left behind."""
    environment = dict(os.environ, PYTHONPATH=str(REPO))
    job = subprocess.Popen(
        [sys.executable, *flags, str(folder / "job.py"), mode, str(folder), str(RECORDS)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=folder,
        env=environment,
        start_new_session=True,
    )
    assert job.stdout is not None
    first = ""
    if send is not None:
        first = job.stdout.readline()
        assert first == "READY\n", first
        wait_until(lambda: random.random() < 0.1 or job.poll() is not None, "a random moment", limit_s=5.0)
        job.send_signal(send)
    try:
        output, errors = job.communicate(timeout=HANG_GUARD_S)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        job.communicate()
        pytest.fail(f"the job ({mode}) hung at exit")
    try:
        wait_until(lambda: not session_processes(job.pid), "the job's processes to end with it", LEFT_BEHIND_LIMIT_S)
    finally:
        for pid in session_processes(job.pid):
            os.kill(pid, signal.SIGKILL)
    return job.returncode, first + output, errors


def assert_quiet(errors: str, flags: tuple[str, ...] = ()) -> None:
    assert "Traceback" not in errors and "Exception ignored" not in errors, errors
    if flags:
        assert "Warning" not in errors, errors


@pytest.mark.parametrize(
    ("mode", "flags"),
    [
        ("end", ()),
        ("dev", ("-W", "error", "-W", "ignore:This DataLoader will create", "-X", "dev")),  # torch's advice on one core
    ],
)
def test_a_script_that_falls_off_the_end_holding_everything_exits_cleanly(
    job: Path, mode: str, flags: tuple[str, ...]
) -> None:
    returncode, output, errors = run_job(job, mode, flags)
    assert returncode == 0, output + errors
    assert output.splitlines()[-1] == "exiting", output
    assert_quiet(errors, flags)


def test_sys_exit_inside_a_loop_exits_with_its_code(job: Path) -> None:
    returncode, output, errors = run_job(job, "exit3")
    assert returncode == 3, output + errors
    assert_quiet(errors)


def test_an_uncaught_exception_inside_a_loop_prints_its_traceback_alone(job: Path) -> None:
    returncode, output, errors = run_job(job, "raise")
    assert returncode == 1, output + errors
    assert errors.count("Traceback") == 1 and errors.rstrip().endswith("RuntimeError: boom"), errors
    assert "Exception ignored" not in errors, errors


def test_a_state_taken_in_a_keyboard_interrupt_handler_resumes_exactly(job: Path) -> None:
    """Every pipeline and loader, interrupted by a SIGINT after K items; the interrupted objects
    are then held until exit."""
    returncode, output, errors = run_job(job, "interrupt")
    assert returncode == 0, output + errors
    resumed = [line for line in output.splitlines() if line.startswith("resumed")]
    assert len(resumed) == 11 and all(line.endswith("exact") for line in resumed), output
    assert_quiet(errors)


@pytest.mark.parametrize("mode", ["parent_interrupt_process_map", "parent_interrupt_loader2"])
def test_a_sigint_at_a_random_moment_resumes_exactly(job: Path, mode: str) -> None:
    returncode, output, errors = run_job(job, mode, send=signal.SIGINT)
    assert returncode == 0, output + errors
    assert any(line.startswith("resumed") and line.endswith("exact") for line in output.splitlines()), output
    assert_quiet(errors)


@pytest.mark.parametrize("sent", [signal.SIGTERM, signal.SIGKILL])
def test_a_killed_script_leaves_no_process(job: Path, sent: signal.Signals) -> None:
    """No Python code runs (SIGTERM's default action, or SIGKILL), and still every worker goes:
    the Loader's, and a process map's pool with the fork server that forked it."""
    returncode, output, errors = run_job(job, "killed", send=sent)
    assert returncode == -sent, output + errors
    assert "Traceback" not in errors, errors  # the resource tracker may warn of a leaked semaphore


def test_ctrl_c_to_the_process_group_leaves_process_maps_and_loaders_quiet_and_usable(job: Path) -> None:
    returncode, output, errors = run_job(job, "group_interrupt")
    assert returncode == 0, output + errors
    lines = output.splitlines()
    assert lines[-1] == "exiting" and len(lines) == 5, output  # process maps (2) and loaders (2)
    assert all(line.startswith("group interrupt") and line.endswith(": exact") for line in lines[:-1]), output
    assert_quiet(errors)
