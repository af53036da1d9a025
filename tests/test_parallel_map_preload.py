"""The forkserver's preload of the package, as programs meet it: each test runs a program in
a fresh interpreter (a process map needs a ``__main__`` guard and a module-level ``fn``) and
asks every pool worker whether the forkserver that forked it had the package loaded, and
which copy of the package the worker uses: always the program's own copy, preloaded or not."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import resumable as rs

pytestmark = pytest.mark.skipif(
    not os.path.exists("/proc/self/maps"), reason="reads the forkserver's mapped libraries in /proc"
)

# The program's copy of the package, and the folder it is imported from.
THIS_COPY = rs.__file__
THIS_ROOT = str(Path(rs.__file__).resolve().parent.parent)
# Seconds one program may run (each takes 1-3 s: its imports, the forkserver's start, two pools).
PROGRAM_TIMEOUT = 60

WHERE = """
import os
import sys

IMPORTED_IN = os.getpid()


def imported_in_forkserver(_: object) -> bool:
    \"\"\"In a pool worker: whether this module was imported by its parent, the forkserver.\"\"\"
    return IMPORTED_IN == os.getppid()


def where(_: object) -> tuple[bool, str]:
    \"\"\"In a pool worker: whether its parent, the forkserver, had pyarrow mapped (the package
    was preloaded there), and the file of the package this worker uses.\"\"\"
    with open(f"/proc/{os.getppid()}/maps") as maps:
        return "libarrow" in maps.read(), sys.modules["resumable"].__file__
"""

# Runs its steps in order: chdir=FOLDER, map=N (a process map of N records over 2 workers; what
# the workers found), forkserver (a bare forkserver process, started and joined), preload=A,B
# (the program's own preload, as a list; empty: none), preload-tuple=A,B (the same as a tuple),
# probe=N (a process map of N records:
# whether the workers' forkserver imported preload_where), kill-forkserver (SIGKILL it and
# wait until it is gone; multiprocessing starts another at the next pool).
PROGRAM = """
import json
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import sys
import time

if os.environ.get("INSERT_COPY"):
    sys.path.insert(0, os.environ["INSERT_COPY"])  # the program imports this copy explicitly

import preload_where
import resumable as rs


def pool_map(n: int) -> list[tuple[bool, str]]:
    with rs.from_list(list(range(n))).map(preload_where.where, num_workers=2, mode="process") as pipe:
        return sorted(set(pipe))


def probe(n: int) -> list[bool]:
    with rs.from_list(list(range(n))).map(preload_where.imported_in_forkserver, num_workers=2, mode="process") as pipe:
        return sorted(set(pipe))


def kill_forkserver() -> None:
    pid = multiprocessing.forkserver._forkserver._forkserver_pid
    os.kill(pid, signal.SIGKILL)
    for _ in range(500):  # a zombie until multiprocessing reaps it at the next pool
        with open(f"/proc/{pid}/stat") as stat:
            if stat.read().rsplit(")", 1)[1].split()[0] == "Z":
                return
        time.sleep(0.01)


def nothing() -> None:
    pass


if __name__ == "__main__":
    found = []
    for step in sys.argv[1:]:
        action, _, argument = step.partition("=")
        if action == "chdir":
            os.chdir(argument)
        elif action == "map":
            found.append(pool_map(int(argument)))
        elif action == "preload":
            multiprocessing.set_forkserver_preload(argument.split(",") if argument else [])
        elif action == "preload-tuple":
            multiprocessing.set_forkserver_preload(tuple(argument.split(",")) if argument else ())
        elif action == "probe":
            found.append(probe(int(argument)))
        elif action == "kill-forkserver":
            kill_forkserver()
        elif action == "forkserver":
            process = multiprocessing.get_context("forkserver").Process(target=nothing)
            process.start()
            process.join()
    print(json.dumps(found))
"""


def shadow_copy(tmp_path: Path) -> Path:
    """A folder holding another (empty) ``resumable`` package: a worker that imported it would
    report its file instead of the program's."""
    shadow = tmp_path / "shadow"
    (shadow / "resumable").mkdir(parents=True)
    (shadow / "resumable" / "__init__.py").write_text("")
    return shadow


def run_program(
    tmp_path: Path,
    *steps: str,
    flags: tuple[str, ...] = (),
    cwd: Path | None = None,
    path_first: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    module: bool = False,
) -> list[list[list[object]]]:
    """Run ``PROGRAM`` with ``steps`` in a fresh interpreter (``python FLAGS program.py`` or
    ``python FLAGS -m preload_program``); ``path_first`` goes first on its ``PYTHONPATH``.
    What each map's workers found: one list of distinct (preloaded, package file) per map."""
    scripts = tmp_path / "scripts"
    scripts.mkdir(exist_ok=True)
    (scripts / "preload_where.py").write_text(WHERE)
    (scripts / "preload_program.py").write_text(PROGRAM)
    pythonpath = os.pathsep.join([*path_first, str(scripts), *sys.path])
    target = ["-m", "preload_program"] if module else [str(scripts / "preload_program.py")]
    run = subprocess.run(
        [sys.executable, *flags, *target, *steps],
        cwd=cwd or tmp_path,
        env={**os.environ, "PYTHONPATH": pythonpath, **(env or {})},
        capture_output=True,
        text=True,
        timeout=PROGRAM_TIMEOUT,
    )
    assert run.returncode == 0, run.stderr
    found: list[list[list[object]]] = json.loads(run.stdout.splitlines()[-1])
    return found


PRELOADED = [[True, THIS_COPY]]
NOT_PRELOADED = [[False, THIS_COPY]]


def test_a_program_run_from_another_folder_preloads_this_copy(tmp_path: Path) -> None:
    assert run_program(tmp_path, "map=2", "map=3") == [PRELOADED, PRELOADED]


def test_a_program_run_as_a_module_preloads_this_copy(tmp_path: Path) -> None:
    assert run_program(tmp_path, "map=2", module=True, cwd=tmp_path / "scripts") == [PRELOADED]


def test_moving_into_a_folder_with_another_copy_before_the_first_map_preloads_nothing(tmp_path: Path) -> None:
    """The forkserver starts in the folder the program is in at its first map, and would find
    the copy there first: it is left bare, and the workers import the program's copy."""
    shadow = shadow_copy(tmp_path)
    assert run_program(tmp_path, f"chdir={shadow}", "map=2", "map=3") == [NOT_PRELOADED, NOT_PRELOADED]


def test_a_program_started_in_a_folder_with_another_copy_preloads_nothing(tmp_path: Path) -> None:
    """The same, for a program started there: the workers import the program's copy."""
    shadow = shadow_copy(tmp_path)
    assert run_program(tmp_path, "map=2", cwd=shadow) == [NOT_PRELOADED]


def test_moving_into_a_folder_with_another_copy_after_the_first_map_keeps_this_copy(tmp_path: Path) -> None:
    """The forkserver, already running, keeps the copy it preloaded for later pools."""
    shadow = shadow_copy(tmp_path)
    assert run_program(tmp_path, "map=2", f"chdir={shadow}", "map=3") == [PRELOADED, PRELOADED]


def test_pythonpath_naming_another_copy_preloads_nothing_when_the_program_imports_this_one(tmp_path: Path) -> None:
    """``PYTHONPATH`` leads a fresh interpreter to another copy, the program inserts this one
    on its ``sys.path``: nothing is preloaded, and the workers use the program's copy."""
    shadow = shadow_copy(tmp_path)
    found = run_program(tmp_path, "map=2", path_first=(str(shadow),), env={"INSERT_COPY": THIS_ROOT})
    assert found == [NOT_PRELOADED]


@pytest.mark.skipif(sys.version_info < (3, 11), reason="-P and PYTHONSAFEPATH came with Python 3.11")
@pytest.mark.parametrize(("flags", "env"), [(("-P",), {}), ((), {"PYTHONSAFEPATH": "1"})], ids=["-P", "PYTHONSAFEPATH"])
def test_a_safe_path_interpreter_preloads_from_a_folder_holding_another_copy(
    tmp_path: Path, flags: tuple[str, ...], env: dict[str, str]
) -> None:
    """With ``-P`` (or ``PYTHONSAFEPATH``) the forkserver, started with the program's flags and
    environment, does not look in its working folder, so it finds this copy and preloads it."""
    shadow = shadow_copy(tmp_path)
    assert run_program(tmp_path, "map=2", flags=flags, cwd=shadow, env=env) == [PRELOADED]


def test_a_forkserver_already_running_is_left_as_it_is(tmp_path: Path) -> None:
    """Started by the program before its first map, the forkserver loaded nothing; its workers
    import the package themselves."""
    assert run_program(tmp_path, "forkserver", "map=2", "map=3") == [NOT_PRELOADED, NOT_PRELOADED]


def test_warnings_as_errors_leave_process_maps_working(tmp_path: Path) -> None:
    """Under ``-W error`` (forwarded to the forkserver), a preloaded forkserver forks its workers
    (Python 3.12 and later warn there of a fork in a multi-threaded process; the warning is not
    raised)."""
    assert run_program(tmp_path, "map=2", flags=("-W", "error")) == [PRELOADED]


@pytest.mark.parametrize("step", ["preload", "preload-tuple"], ids=["list", "tuple"])
def test_the_programs_own_preload_stays_listed(tmp_path: Path, step: str) -> None:
    """A preload the program set (a list, or a tuple, which the standard library accepts too)
    is kept beside the package: the forkserver imported both."""
    assert run_program(tmp_path, f"{step}=preload_where", "probe=2", "map=2") == [[True], PRELOADED]


def test_an_empty_preload_set_by_the_program_is_kept(tmp_path: Path) -> None:
    """An empty list is the program's way to have the forkserver preload nothing."""
    assert run_program(tmp_path, "preload=", "map=2") == [NOT_PRELOADED]


def test_a_forkserver_restarted_in_a_folder_with_another_copy_preloads_nothing(tmp_path: Path) -> None:
    """The forkserver died and the program moved into a folder holding another copy: the next
    forkserver would import that one, so the package is taken off the list again."""
    shadow = shadow_copy(tmp_path)
    found = run_program(tmp_path, "map=2", "kill-forkserver", f"chdir={shadow}", "map=3")
    assert found == [PRELOADED, NOT_PRELOADED]


def test_a_sitecustomize_that_prints_leaves_the_preload_on(tmp_path: Path) -> None:
    """The copy check reads the fresh interpreter's last line: a ``sitecustomize`` printing
    first does not turn the preload off."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("print('hello from sitecustomize')\n")
    assert run_program(tmp_path, "map=2", path_first=(str(site),)) == [PRELOADED]


def test_the_standard_library_internals_the_preload_reads_are_there() -> None:
    """``ParallelMap`` reads the forkserver's preload list and the interpreter flags it is
    started with from ``multiprocessing``'s private names (with fallbacks): fail here, by name,
    if a Python release renames them."""
    import multiprocessing.forkserver
    import multiprocessing.util

    assert isinstance(multiprocessing.forkserver._forkserver._preload_modules, (list, tuple))
    assert isinstance(multiprocessing.util._args_from_interpreter_flags(), list)
