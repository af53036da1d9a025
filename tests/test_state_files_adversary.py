"""State files on disk and the command line, attacked: damaged, truncated and misplaced state
files given to ``rs.load_state``, ``set_state``, ``Loader.load_state_dict`` and ``python -m
resumable inspect``; odd paths given to ``rs.save_state`` (directories, files in the way,
symlinks, long and non-ASCII names, read-only directories); saves killed mid-write or racing
each other; ``python -m resumable index`` over missing, unreadable and read-only data.

What is expected: a damaged state is a ``StateError`` naming the file, a refused state changes
nothing, a save that cannot happen is an ``OSError`` naming the path and leaves the previous file
and no temporary behind, and the command line exits 2 with one line ``error: ...``, never a
traceback.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import event, given, settings
from hypothesis import strategies as st

import resumable as rs
import resumable.torch as rst
from resumable.cli import main
from resumable.sources._sidecar import SidecarWarning
from tests.resume import take

REPO = Path(__file__).resolve().parents[1]
CLI_TIMEOUT_S = 120
BATCHES_BEFORE = 2  # batches taken before each state is saved
NOBODY = 65534


# ---------------------------------------------------------------------------------------------
# Pipelines, states and helpers


def write_docs(directory: Path) -> Path:
    path = directory / "docs.jsonl"
    if not path.exists():
        path.write_text("".join(f'{{"id": {i}}}\n' for i in range(60)))
    return path


def pipeline_of(directory: Path) -> rs.Node:
    docs = str(write_docs(directory))
    return rs.jsonl(docs).shuffle(2).shard().map(lambda r: r["id"]).filter(lambda x: x % 3).batch(3)


def loader_of(directory: Path, num_workers: int = 0) -> rst.Loader:
    def build() -> rs.Node:
        return pipeline_of(directory).upstream.batch(3, collate_fn=np.array)

    return rst.Loader(build, num_workers=num_workers)


def lists(batches: Any) -> list[Any]:
    return [np.asarray(batch).tolist() for batch in batches]


def hidden(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


def inspect(*argv: str) -> tuple[int, str, str]:
    """``python -m resumable inspect ARGV`` in this process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["inspect", *argv])
    return code, out.getvalue(), err.getvalue()


def index(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["index", "--quiet", *argv])
    return code, out.getvalue(), err.getvalue()


def cli(
    *argv: str, prefix: tuple[str, ...] = (), env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -m resumable ARGV`` in a process of its own (``prefix`` runs it as another user)."""
    return subprocess.run(
        [*prefix, sys.executable, "-m", "resumable", *argv],
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
        cwd=REPO,
        env=env,
    )


def assert_one_line_error(code: int, out: str, err: str, *names: str) -> None:
    assert code == 2, (code, out, err)
    assert out == ""
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    for name in names:
        assert name in err, (name, err)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A pipeline state and a Loader state (no workers) saved after ``BATCHES_BEFORE`` batches,
    the batches that follow each in an uninterrupted run, and their files."""
    directory = tmp_path_factory.mktemp("state_files")
    pipe = pipeline_of(directory)
    take(pipe, BATCHES_BEFORE)
    pipe_state = pipe.get_state()
    pipe_rest = list(pipe)
    loader = loader_of(directory)
    iterator = iter(loader)
    for _ in range(BATCHES_BEFORE):
        next(iterator)
    loader_state = loader.state_dict()
    loader_rest = lists(iterator)
    rs.save_state(pipe_state, directory / "pipe.json")
    rs.save_state(loader_state, directory / "loader.json")
    return {
        "dir": directory,
        "pipe_state": pipe_state,
        "pipe_rest": pipe_rest,
        "loader_state": loader_state,
        "loader_rest": loader_rest,
        "pipe_bytes": (directory / "pipe.json").read_bytes(),
        "loader_bytes": (directory / "loader.json").read_bytes(),
    }


def started_pipeline(directory: Path) -> rs.Node:
    pipe = pipeline_of(directory)
    take(pipe, BATCHES_BEFORE)
    return pipe


def started_loader(directory: Path) -> tuple[rst.Loader, Iterator[Any]]:
    loader = loader_of(directory)
    iterator = iter(loader)
    for _ in range(BATCHES_BEFORE):
        next(iterator)
    return loader, iterator


# ---------------------------------------------------------------------------------------------
# Running as another user, for permissions (root ignores them)


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory every user can enter (pytest's own temporary directories are private)."""
    path = Path(tempfile.mkdtemp(prefix="resumable-perm-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        for root, dirs, files in os.walk(path):
            for name in dirs + files:
                with contextlib.suppress(OSError):
                    os.chmod(os.path.join(root, name), 0o700, follow_symlinks=False)
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def as_other_user(open_dir: Path) -> tuple[str, ...]:
    """A command prefix that runs a process where file permissions apply: nothing for a normal
    user, ``setpriv`` to user nobody under root. Skips where neither works."""
    if os.geteuid() != 0:
        return ()
    prefix = ("setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups")
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: permissions do not apply")
    probe = open_dir / "probe"
    probe.write_text("x")
    probe.chmod(0)
    check = subprocess.run(
        [*prefix, sys.executable, "-c", f"import resumable; open({str(probe)!r})"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=CLI_TIMEOUT_S,
    )
    probe.unlink()
    if "PermissionError" not in check.stderr:
        pytest.skip(f"cannot run a process as another user here: {check.stderr[-200:]}")
    return prefix


def other_user_env(open_dir: Path) -> dict[str, str]:
    cache = open_dir / "user-cache"
    cache.mkdir(exist_ok=True)
    cache.chmod(0o777)
    return dict(os.environ, HOME=str(open_dir), RESUMABLE_CACHE_DIR=str(cache))


# ---------------------------------------------------------------------------------------------
# rs.load_state on files that hold no state


def deep(levels: int, opening: str, closing: str, inner: str = "1") -> bytes:
    return (opening * levels + inner + closing * levels).encode()


NOT_STATES: dict[str, bytes] = {
    "empty": b"",
    "whitespace": b" \n\t ",
    "not utf-8": b'{"kind": "\xff\xfe"}',
    "latin-1 text": '{"kind": "Batché"}'.encode("latin-1"),
    "a list": b"[1, 2]",
    "a number": b"5",
    "null": b"null",
    "a string": b'"{}"',
    "true": b"true",
    "NaN": b"NaN",
    "two objects": b"{}{}",
    "a trailing comma": b'{"kind": "Batch",}',
    "an unterminated string": b'{"kind": "Bat',
    "deep arrays": deep(50_000, "[", "]"),
    "deep objects": deep(50_000, '{"a":', "}"),
    "nested past the limit": b'{"a": ' + deep(300, "[", "]", "") + b"}",
    "an int past Python's digit limit": b'{"position": ' + b"9" * 5000 + b"}",
    "NUL bytes": b"\x00" * 64,
    "a zip header": b"PK\x03\x04" + bytes(60),
}


@pytest.mark.parametrize("name", NOT_STATES)
def test_load_state_refuses_what_is_not_a_state_with_a_state_error_naming_the_file(tmp_path: Path, name: str) -> None:
    path = tmp_path / "bad state.json"
    path.write_bytes(NOT_STATES[name])
    with pytest.raises(rs.StateError) as caught:
        rs.load_state(path)
    assert str(path) in str(caught.value)
    assert "\n" not in str(caught.value)


def test_load_state_refuses_unreadable_places_with_a_state_error_naming_them(tmp_path: Path) -> None:
    (tmp_path / "a file").write_text("{}")
    (tmp_path / "dir.json").mkdir()
    os.symlink("nowhere.json", tmp_path / "dangling.json")
    os.symlink("loop.json", tmp_path / "loop.json")
    places = [
        tmp_path / "missing.json",
        tmp_path / "dir.json",
        tmp_path / "dangling.json",
        tmp_path / "loop.json",
        tmp_path / "a file" / "x.json",  # a parent that is a file
        tmp_path / ("n" * 300 + ".json"),  # a name longer than the file system allows
        Path("/dev/null"),
    ]
    for place in places:
        for as_given in (place, str(place)):
            with pytest.raises(rs.StateError) as caught:
                rs.load_state(as_given)
            assert str(place) in str(caught.value)


def test_load_state_reads_through_a_symlink_and_any_path_type(tmp_path: Path) -> None:
    state = {"kind": "Batch", "version": 1, "note": "ünïcödé ✓"}
    target = tmp_path / "dïr with spaces" / "état 0.json"
    rs.save_state(state, target)
    os.symlink(target, tmp_path / "link.json")
    for as_given in (target, str(target), os.fsencode(target), tmp_path / "link.json"):
        assert rs.load_state(as_given) == state


def test_load_state_given_a_file_descriptor_leaves_it_open(tmp_path: Path) -> None:
    rs.save_state({"kind": "Batch"}, tmp_path / "s.json")
    with open(tmp_path / "s.json", "rb") as handle:
        descriptor = handle.fileno()
        with pytest.raises((TypeError, rs.StateError)):
            rs.load_state(descriptor)  # type: ignore[arg-type]  # not a path
        os.fstat(descriptor)  # still the caller's, still open
        assert handle.read() == (tmp_path / "s.json").read_bytes()


def test_load_state_keeps_json_oddities_and_set_state_refuses_them(data: dict[str, Any], tmp_path: Path) -> None:
    """NaN, Infinity, huge ints and duplicate keys parse as Python's json does; a pipeline then
    refuses the values it cannot hold, and is left as it was."""
    text = json.dumps(data["pipe_state"], separators=(",", ":"))
    assert '"seed":2' in text and '"batch_size":3' in text
    for old, new in (
        ('"seed":2', '"seed":NaN'),
        ('"seed":2', '"seed":-Infinity'),
        ('"batch_size":3', '"batch_size":1e999'),
        ('"batch_size":3', '"batch_size":' + "9" * 4000),
        ('"batch_size":3', '"batch_size":3,"batch_size":4'),  # duplicate keys: the last wins
    ):
        path = tmp_path / "odd.json"
        path.write_text(text.replace(old, new, 1))
        state = rs.load_state(path)
        pipe = started_pipeline(data["dir"])
        before = pipe.get_state()
        with pytest.raises(rs.StateError):
            pipe.set_state(state)
        assert pipe.get_state() == before
        assert list(pipe) == data["pipe_rest"]
    path.write_text(text.replace('"batch_size":3', '"batch_size":4,"batch_size":3', 1))
    pipe = pipeline_of(data["dir"])
    pipe.set_state(rs.load_state(path))
    assert list(pipe) == data["pipe_rest"]


# ---------------------------------------------------------------------------------------------
# Truncated at every byte


def test_every_truncation_of_a_pipeline_and_a_loader_state_is_a_state_error(
    data: dict[str, Any], tmp_path: Path
) -> None:
    path = tmp_path / "cut.json"
    for whole in (data["pipe_bytes"], data["loader_bytes"]):
        for cut in range(len(whole)):
            path.write_bytes(whole[:cut])
            with pytest.raises(rs.StateError, match=re.escape(str(path))):
                rs.load_state(path)
        path.write_bytes(whole)
        assert rs.load_state(path) == json.loads(whole)


def test_inspect_reports_every_truncation_in_one_line(data: dict[str, Any], tmp_path: Path) -> None:
    path = tmp_path / "cut.json"
    for whole in (data["pipe_bytes"], data["loader_bytes"]):
        for cut in range(0, len(whole), 7):
            path.write_bytes(whole[:cut])
            assert_one_line_error(*inspect(str(path)), str(path))


def test_a_truncated_torch_checkpoint_is_one_line_error(data: dict[str, Any], tmp_path: Path) -> None:
    rst.save({"model": torch.arange(64.0), "data": data["loader_state"]}, tmp_path / "whole.pt")
    whole = (tmp_path / "whole.pt").read_bytes()
    path = tmp_path / "cut.pt"
    for cut in sorted({1, 2, 4, 30, 64, len(whole) // 3, len(whole) // 2, len(whole) - 22, len(whole) - 1}):
        path.write_bytes(whole[:cut])
        assert_one_line_error(*inspect(str(path)), str(path))
    code, out, err = inspect(str(tmp_path / "whole.pt"))
    assert code == 0 and err == "" and "rank 0/1: Loader epoch 0" in out


# ---------------------------------------------------------------------------------------------
# Corrupted anywhere: the file, the state, the pipeline and the Loader


TOKENS = [
    b"NaN",
    b"Infinity",
    b"-1",
    b"1e999",
    b"9223372036854775808",
    b"1.5",
    b'"x"',
    b"null",
    b"true",
    b"[]",
    b"{}",
    b'{"kind":"Batch"}',
    b"[" * 250 + b"]" * 250,
]
SCALAR = re.compile(rb":(-?\d+(?:\.\d+)?|true|false|null)(?=[,}\]])")


@st.composite
def corrupted(draw: st.DrawFn, whole: bytes) -> bytes:
    """``whole`` damaged once: cut, a byte changed, bytes inserted or deleted, or one scalar
    value swapped for another JSON (or not quite JSON) token."""
    action = draw(st.sampled_from(["cut", "byte", "insert", "delete", "value"]))
    event(action)
    at = draw(st.integers(0, len(whole) - 1))
    if action == "cut":
        return whole[:at]
    if action == "byte":
        return whole[:at] + bytes([draw(st.integers(0, 255))]) + whole[at + 1 :]
    if action == "insert":
        junk = draw(st.binary(min_size=1, max_size=6) | st.sampled_from(TOKENS + [b",", b"\\", b'"', b"\xc3"]))
        return whole[:at] + junk + whole[at:]
    if action == "delete":
        return whole[:at] + whole[at + draw(st.integers(1, 12)) :]
    match = draw(st.sampled_from(list(SCALAR.finditer(whole))))
    return whole[: match.start(1)] + draw(st.sampled_from(TOKENS)) + whole[match.end(1) :]


@settings(max_examples=40)
@given(st.data())
def test_a_corrupted_state_file_is_refused_typed_and_changes_nothing(data: dict[str, Any], draw: st.DataObject) -> None:
    loader_file = draw.draw(st.booleans())
    whole = data["loader_bytes" if loader_file else "pipe_bytes"]
    path = data["dir"] / "corrupted.json"
    path.write_bytes(draw.draw(corrupted(whole)))

    code, out, err = inspect(str(path))
    assert code in (0, 2), (code, err)
    if code == 2:
        assert_one_line_error(code, out, err, str(path))
    else:
        assert out.startswith(f"{path}: ") and err == ""

    try:
        state = rs.load_state(path)
    except rs.StateError as error:
        event("file refused")
        assert str(path) in str(error)
        return
    assert isinstance(state, dict)
    into_loader = draw.draw(st.booleans())  # the wrong kind of object half of the time
    if into_loader:
        loader, iterator = started_loader(data["dir"])
        before = loader.state_dict()
        try:
            loader.load_state_dict(state)
        except rs.ResumableError:
            event("refused by the Loader")
            assert loader.state_dict() == before
            assert lists(iterator) == data["loader_rest"]
            return
        event("loaded by the Loader")
        with contextlib.suppress(rs.ResumableError):
            lists(loader)
    else:
        pipe = started_pipeline(data["dir"])
        before = pipe.get_state()
        try:
            pipe.set_state(state)
        except rs.ResumableError:
            event("refused by the pipeline")
            assert pipe.get_state() == before
            assert list(pipe) == data["pipe_rest"]
            return
        event("loaded by the pipeline")
        with contextlib.suppress(rs.ResumableError):
            list(pipe)


# ---------------------------------------------------------------------------------------------
# The wrong state in the right file


def test_states_of_the_wrong_kind_from_files_are_refused_and_change_nothing(
    data: dict[str, Any], tmp_path: Path
) -> None:
    pipe_state, loader_state = data["pipe_state"], data["loader_state"]
    other = rs.from_list(list(range(10))).batch(2)
    take(other, 1)
    wrong_for_a_pipeline = {
        "a Loader state": loader_state,
        "another pipeline's": other.get_state(),
        "an extra key renamed": {("batch" if k == "batch_size" else k): v for k, v in pipe_state.items()},
        "a missing key": {k: v for k, v in pipe_state.items() if k != "drop_last"},
        "an empty object": {},
        "the upstream's state": pipe_state["upstream"],
        "the state wrapped": {"data": pipe_state},
    }
    for name, state in wrong_for_a_pipeline.items():
        rs.save_state(state, tmp_path / "wrong.json")
        pipe = started_pipeline(data["dir"])
        before = pipe.get_state()
        with pytest.raises(rs.StateError) as caught:
            pipe.set_state(rs.load_state(tmp_path / "wrong.json"))
        if name == "a Loader state":
            assert "load_state_dict" in str(caught.value)
        assert pipe.get_state() == before, name
        assert list(pipe) == data["pipe_rest"], name
    wrong_for_a_loader = {
        "a pipeline state": pipe_state,
        "another Loader's format": dict(loader_state, format="resumable.Loader/99"),
        "a missing key": {k: v for k, v in loader_state.items() if k != "epoch"},
        "a renamed key": {("world" if k == "world_size" else k): v for k, v in loader_state.items()},
        "another worker count": dict(loader_state, num_workers=2),
        "the torchdata part alone": loader_state["loader"],
        "an empty object": {},
    }
    for name, state in wrong_for_a_loader.items():
        rs.save_state(state, tmp_path / "wrong.json")
        loader, iterator = started_loader(data["dir"])
        before = loader.state_dict()
        with pytest.raises(rs.StateError):
            loader.load_state_dict(rs.load_state(tmp_path / "wrong.json"))
        assert loader.state_dict() == before, name
        assert lists(iterator) == data["loader_rest"], name


def test_saved_states_resume_exactly_through_files_with_odd_names(data: dict[str, Any], tmp_path: Path) -> None:
    for name in ("plain.json", "with spaces.json", "ünï cødé ✓.json", "-leading-dash", ".hidden", "no-extension"):
        rs.save_state(data["pipe_state"], tmp_path / "sub dir" / name)
        pipe = pipeline_of(data["dir"])
        pipe.set_state(rs.load_state(str(tmp_path / "sub dir" / name)))
        assert list(pipe) == data["pipe_rest"]
        loader = loader_of(data["dir"])
        rs.save_state(data["loader_state"], tmp_path / "sub dir" / name)
        loader.load_state_dict(rs.load_state(tmp_path / "sub dir" / name))
        assert lists(loader) == data["loader_rest"]
    assert hidden(tmp_path / "sub dir") == [".hidden"]


# ---------------------------------------------------------------------------------------------
# rs.save_state: paths it cannot write, paths that are odd


def test_saving_where_no_file_can_be_is_an_os_error_that_leaves_nothing_behind(tmp_path: Path) -> None:
    (tmp_path / "a file").write_text("keep")
    (tmp_path / "a dir").mkdir()
    (tmp_path / "a dir" / "inside").write_text("keep too")
    os.symlink("loop", tmp_path / "loop")
    listing = sorted(os.listdir(tmp_path))
    for target in (
        tmp_path / "a file" / "state.json",  # a parent that is a file
        tmp_path / "a file" / "deeper" / "state.json",
        tmp_path / "loop" / "state.json",  # a parent that is a symlink loop
        tmp_path / "a dir",  # a directory where the file goes
    ):
        with pytest.raises(OSError) as caught:
            rs.save_state({"kind": "Batch"}, target)
        assert str(target.parent) in str(caught.value), caught.value
        assert sorted(os.listdir(tmp_path)) == listing
    assert (tmp_path / "a file").read_text() == "keep"
    assert os.listdir(tmp_path / "a dir") == ["inside"]


def test_saving_over_symlinks_replaces_the_link_and_never_its_target(tmp_path: Path) -> None:
    rs.save_state({"kind": "old"}, tmp_path / "real.json")
    os.symlink("real.json", tmp_path / "link.json")
    os.symlink("nowhere.json", tmp_path / "dangling.json")
    os.symlink("self.json", tmp_path / "self.json")
    for name in ("link.json", "dangling.json", "self.json"):
        rs.save_state({"kind": name}, tmp_path / name)
        assert rs.load_state(tmp_path / name) == {"kind": name}
        assert not (tmp_path / name).is_symlink()
    assert rs.load_state(tmp_path / "real.json") == {"kind": "old"}
    assert not (tmp_path / "nowhere.json").exists()
    assert hidden(tmp_path) == []


def test_saving_through_a_symlinked_directory(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    os.symlink("real", tmp_path / "alias")
    rs.save_state({"kind": "Batch"}, tmp_path / "alias" / "state.json")
    assert rs.load_state(tmp_path / "real" / "state.json") == {"kind": "Batch"}
    assert (tmp_path / "alias").is_symlink() and hidden(tmp_path / "real") == []


@pytest.mark.parametrize("umask", [0o022, 0o077], ids=oct)
def test_created_directories_follow_the_umask_too(tmp_path: Path, umask: int) -> None:
    old = os.umask(umask)
    try:
        rs.save_state({"kind": "Batch"}, tmp_path / "a" / "b" / "state.json")
    finally:
        os.umask(old)
    for directory in (tmp_path / "a", tmp_path / "a" / "b"):
        assert directory.stat().st_mode & 0o777 == 0o777 & ~umask
    assert (tmp_path / "a" / "b" / "state.json").stat().st_mode & 0o777 == 0o666 & ~umask


def test_a_state_that_json_cannot_write_keeps_the_previous_file(tmp_path: Path) -> None:
    target = tmp_path / "state.json"
    rs.save_state({"step": 1}, target)
    for bad in ({"step": (1, 2)}, {1: 2}, {"step": object()}, {"step": np.int64(3)}, {"step": torch.tensor(1)}):
        with pytest.raises(rs.StateError):
            rs.save_state(bad, target)  # type: ignore[arg-type]
    with pytest.raises(rs.StateError, match="JSON cannot write"):  # an int past Python's digit limit
        rs.save_state({"step": 10**5000}, target)
    assert rs.load_state(target) == {"step": 1}
    assert hidden(tmp_path) == []


@pytest.mark.parametrize("bad", [None, [1, 2], "state", 5], ids=["None", "list", "str", "int"])
def test_save_state_refuses_what_load_state_would_refuse(tmp_path: Path, bad: Any) -> None:
    target = tmp_path / "state.json"
    rs.save_state({"step": 1}, target)
    with pytest.raises(rs.StateError):
        rs.save_state(bad, target)
    assert rs.load_state(target) == {"step": 1}


@pytest.mark.parametrize("saver", ["save_state", "torch"])
def test_the_longest_valid_file_names_can_be_saved(tmp_path: Path, saver: str) -> None:
    name = "s" * 250
    (tmp_path / name).write_text("{}")  # the file system takes the name
    if saver == "save_state":
        rs.save_state({"step": 2}, tmp_path / name)
        assert rs.load_state(tmp_path / name) == {"step": 2}
    else:
        rst.save({"step": 2}, tmp_path / name)
        assert rst.load(tmp_path / name) == {"step": 2}


def test_save_state_with_a_bytes_path_saves_or_touches_nothing(tmp_path: Path) -> None:
    target = tmp_path / "new" / "dir" / "state.json"
    try:
        rs.save_state({"step": 1}, os.fsencode(target))  # type: ignore[arg-type]  # load_state takes bytes
    except TypeError:
        assert not (tmp_path / "new").exists()
    else:
        assert rs.load_state(target) == {"step": 1}


def test_a_target_with_a_trailing_slash_is_not_written_as_a_file(tmp_path: Path) -> None:
    with pytest.raises(OSError):
        rs.save_state({"step": 1}, str(tmp_path / "ckpt") + os.sep)
    assert not (tmp_path / "ckpt").is_file()


HANGING_GUARD_S = 60.0  # the waits shown never end: a guard well past a loaded machine's start-up finds them
SAVE_ONCE = """
import sys
import resumable as rs
rs.save_state({"step": 2}, sys.argv[1])
print(rs.load_state(sys.argv[1])["step"])
"""


def test_a_dangling_symlink_in_place_of_the_temporary_does_not_hang_the_save(tmp_path: Path) -> None:
    target = tmp_path / "state.json"
    rs.save_state({"step": 1}, target)
    os.symlink("gone", tmp_path / ".state.json.partial")  # say, from a copy of a checkpoint directory
    try:
        done = subprocess.run(
            [sys.executable, "-c", SAVE_ONCE, str(target)], capture_output=True, text=True, timeout=HANGING_GUARD_S
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"save_state still running after {HANGING_GUARD_S} s")
    assert done.returncode == 0 and done.stdout == "2\n", done.stderr


def test_stale_things_at_the_temporarys_name_are_removed_not_followed(tmp_path: Path) -> None:
    """A regular file at the temporary's name that nobody locks is a dead save's: removed."""
    target = tmp_path / "state.json"
    (tmp_path / ".state.json.partial").write_bytes(b'{"half": ')
    (tmp_path / "real").write_text("keep")
    os.symlink("real", tmp_path / ".other.json.partial")  # a symlink there: the link goes, not its target
    rs.save_state({"step": 1}, target)
    rs.save_state({"step": 1}, tmp_path / "other.json")
    assert rs.load_state(target) == {"step": 1} and rs.load_state(tmp_path / "other.json") == {"step": 1}
    assert (tmp_path / "real").read_text() == "keep"
    assert hidden(tmp_path) == []


SAVE_AGAIN = """
import os, sys
import resumable as rs
descriptors = len(os.listdir("/proc/self/fd"))
for attempt in range(3):
    try:
        rs.save_state({"step": 2}, sys.argv[1])
    except OSError as error:
        print(type(error).__name__, os.path.basename(sys.argv[1]) + ".partial" in str(error), flush=True)
print("descriptors leaked:", len(os.listdir("/proc/self/fd")) - descriptors)
"""


def save_three_times(target: Path, prefix: tuple[str, ...] = (), env: dict[str, str] | None = None) -> list[str]:
    """Save ``target`` three times in one fresh process, each failure caught: what it printed."""
    try:
        done = subprocess.run(
            [*prefix, sys.executable, "-c", SAVE_AGAIN, str(target)],
            capture_output=True,
            text=True,
            cwd=REPO,
            env=env,
            timeout=HANGING_GUARD_S,
        )
    except subprocess.TimeoutExpired as expired:
        pytest.fail(f"saves still waiting after {HANGING_GUARD_S} s, having printed {expired.stdout!r}")
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_a_directory_in_place_of_the_temporary_fails_every_save_without_hanging(tmp_path: Path) -> None:
    target = tmp_path / "state.json"
    rs.save_state({"step": 1}, target)
    (tmp_path / ".state.json.partial").mkdir()
    assert save_three_times(target) == ["IsADirectoryError True"] * 3 + ["descriptors leaked: 0"]
    assert rs.load_state(target) == {"step": 1}


def test_a_stale_temporary_in_a_read_only_directory_fails_every_save_without_hanging(
    as_other_user: tuple[str, ...], open_dir: Path
) -> None:
    read_only = open_dir / "read only"
    read_only.mkdir()
    rs.save_state({"step": 1}, read_only / "state.json")
    (read_only / ".state.json.partial").write_bytes(b"left by a killed save")
    for path in (read_only / "state.json", read_only / ".state.json.partial", read_only):
        path.chmod(0o555 if path == read_only else 0o644)
    printed = save_three_times(read_only / "state.json", as_other_user, other_user_env(open_dir))
    assert printed == ["PermissionError True"] * 3 + ["descriptors leaked: 0"]


# ---------------------------------------------------------------------------------------------
# Permissions (as another user where this runs as root)


PERMISSIONS_SCRIPT = """
import json, sys
import resumable as rs
results = {}
def attempt(name, call):
    try:
        results[name] = ["ok", call()]
    except BaseException as error:
        results[name] = [type(error).__name__, str(error), isinstance(error, OSError)]
read_only, unreadable = sys.argv[1], sys.argv[2]
attempt("load unreadable", lambda: rs.load_state(unreadable))
attempt("save over", lambda: rs.save_state({"step": 2}, read_only + "/state.json"))
attempt("save new", lambda: rs.save_state({"step": 2}, read_only + "/new.json"))
attempt("save new dir", lambda: rs.save_state({"step": 2}, read_only + "/sub/new.json"))
attempt("load read-only", lambda: rs.load_state(read_only + "/state.json"))
print(json.dumps(results))
"""


def test_unreadable_files_and_read_only_directories(as_other_user: tuple[str, ...], open_dir: Path) -> None:
    read_only = open_dir / "read only"
    read_only.mkdir()
    rs.save_state({"step": 1}, read_only / "state.json")
    (read_only / "state.json").chmod(0o644)
    read_only.chmod(0o555)
    unreadable = open_dir / "unreadable.json"
    rs.save_state({"step": 1}, unreadable)
    unreadable.chmod(0)
    done = subprocess.run(
        [*as_other_user, sys.executable, "-c", PERMISSIONS_SCRIPT, str(read_only), str(unreadable)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=other_user_env(open_dir),
        timeout=CLI_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout)
    kind, message = results["load unreadable"][:2]
    assert kind == "StateError" and str(unreadable) in message and "Permission" in message
    for name in ("save over", "save new", "save new dir"):
        kind, message, is_os_error = results[name]
        assert is_os_error and "Permission denied" in message and str(read_only) in message, results[name]
    assert results["load read-only"] == ["ok", {"step": 1}]
    read_only.chmod(0o755)
    assert rs.load_state(read_only / "state.json") == {"step": 1}
    assert os.listdir(read_only) == ["state.json"]  # nothing added


def test_inspect_an_unreadable_file_as_one_line(as_other_user: tuple[str, ...], open_dir: Path) -> None:
    unreadable = open_dir / "state.json"
    rs.save_state(rs.from_list([1, 2]).batch(1).get_state(), unreadable)
    unreadable.chmod(0)
    done = cli("inspect", str(unreadable), prefix=as_other_user, env=other_user_env(open_dir))
    assert_one_line_error(done.returncode, done.stdout, done.stderr, str(unreadable), "Permission denied")


def test_inspect_an_unreadable_directory_as_one_line(as_other_user: tuple[str, ...], open_dir: Path) -> None:
    states = open_dir / "states"
    states.mkdir()
    rs.save_state(rs.from_list([1, 2]).batch(1).get_state(), states / "rank0.json")
    states.chmod(0o311)  # enterable, not listable
    done = cli("inspect", str(states), prefix=as_other_user, env=other_user_env(open_dir))
    assert_one_line_error(done.returncode, done.stdout, done.stderr, str(states))


# ---------------------------------------------------------------------------------------------
# Killed and racing saves


SAVING_FOREVER = """
import sys
import resumable as rs
size, step = int(sys.argv[2]), 0
while True:
    step += 1
    rs.save_state({"step": step, "data": [step] * size}, sys.argv[1])
"""
SIZE = 600_000


def test_sigkill_mid_save_of_a_large_state_keeps_a_whole_file_and_one_temporary_at_most(tmp_path: Path) -> None:
    target = tmp_path / "state.json"
    steps = []
    for delay in (0.0, 0.15, 0.33, 0.52):
        process = subprocess.Popen([sys.executable, "-c", SAVING_FOREVER, str(target), str(SIZE)])
        try:
            deadline = time.monotonic() + CLI_TIMEOUT_S
            while not target.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(delay)
        finally:
            process.send_signal(signal.SIGKILL)
            process.wait()
        assert process.returncode == -signal.SIGKILL
        state = rs.load_state(target)  # always whole
        assert state["data"] == [state["step"]] * SIZE
        steps.append(state["step"])
        assert hidden(tmp_path) in ([], [".state.json.partial"])
    assert steps[-1] >= 1
    rs.save_state({"step": 0}, target)
    assert hidden(tmp_path) == [] and rs.load_state(target) == {"step": 0}


SAVING_TIMES = """
import sys
import resumable as rs
writer, times, size = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
for step in range(times):
    rs.save_state({"writer": writer, "step": step, "data": [writer] * size}, sys.argv[1])
"""


def test_two_processes_saving_one_file_while_it_is_read(tmp_path: Path) -> None:
    target = tmp_path / "state.json"
    times, size = 12, 150_000
    writers = [
        subprocess.Popen([sys.executable, "-c", SAVING_TIMES, str(target), str(writer), str(times), str(size)])
        for writer in (1, 2)
    ]
    reads = 0
    try:
        while any(writer.poll() is None for writer in writers):
            if target.exists():
                state = rs.load_state(target)  # never a mix of two, never half of one
                assert state["data"] == [state["writer"]] * size
                reads += 1
            time.sleep(0.005)
    finally:
        for writer in writers:
            writer.kill()
            writer.wait()
    assert [writer.returncode for writer in writers] == [0, 0]
    final = rs.load_state(target)
    assert final["writer"] in (1, 2) and final["step"] == times - 1
    assert final["data"] == [final["writer"]] * size
    assert hidden(tmp_path) == []
    assert reads > 0


# ---------------------------------------------------------------------------------------------
# python -m resumable inspect


def inspect_cases(directory: Path) -> dict[str, Path]:
    """Every malformed input, written under ``directory``: its name and path."""
    cases: dict[str, Path] = {}
    for name, content in NOT_STATES.items():
        path = directory / f"{name}.json"
        path.write_bytes(content)
        cases[name] = path
    other = directory / "other.json"
    other.write_text('{"lr": 0.1, "model": {"weight": [1, 2]}}')
    cases["no state inside"] = other
    kindless = directory / "kindless.json"
    kindless.write_text('{"version": 1, "upstream": {"kind": "FromList", "version": 1}}')
    cases["a node without kind"] = kindless
    (directory / "empty dir").mkdir()
    cases["an empty directory"] = directory / "empty dir"
    (directory / "notes").mkdir()
    (directory / "notes" / "readme.txt").write_text("not a state")
    cases["a directory without states"] = directory / "notes"
    (directory / "bad ranks").mkdir()
    rs.save_state(
        {"kind": "Batch", "version": 1, "upstream": {"kind": "FromList", "version": 1}},
        directory / "bad ranks" / "rank0.json",
    )
    (directory / "bad ranks" / "rank1.json").write_bytes(b'{"kind": "Bat')
    cases["a directory with one bad rank file"] = directory / "bad ranks"
    (directory / "self").mkdir()
    os.symlink(".", directory / "self" / "self.json")
    cases["a directory holding a link to itself"] = directory / "self"
    os.symlink("nowhere.json", directory / "dangling.json")
    cases["a dangling symlink"] = directory / "dangling.json"
    os.symlink("loop.json", directory / "loop.json")
    cases["a symlink loop"] = directory / "loop.json"
    cases["a missing file"] = directory / "missing.json"
    cases["a parent that is a file"] = other / "state.json"
    return cases


def test_inspect_reports_every_malformed_input_in_one_line(tmp_path: Path) -> None:
    for name, path in inspect_cases(tmp_path).items():
        code, out, err = inspect(str(path))
        assert code == 2 and out == "", (name, code, out, err)
        assert err.startswith("error: ") and err.count("\n") == 1, (name, err)


@pytest.mark.parametrize(
    "name", ["empty", "not utf-8", "deep objects", "an int past Python's digit limit", "a missing file"]
)
def test_inspect_from_the_shell_exits_2_with_one_line_and_no_traceback(tmp_path: Path, name: str) -> None:
    path = inspect_cases(tmp_path)[name]
    done = cli("inspect", str(path))
    assert_one_line_error(done.returncode, done.stdout, done.stderr, str(path))


@pytest.mark.parametrize("prefix", [b"\n", b"  ", b"\xef\xbb\xbf"], ids=["newline", "spaces", "BOM"])
def test_inspect_reads_every_state_file_load_state_reads(data: dict[str, Any], tmp_path: Path, prefix: bytes) -> None:
    path = tmp_path / "state.json"
    path.write_bytes(prefix + data["pipe_bytes"])
    assert rs.load_state(path) == data["pipe_state"]
    code, out, err = inspect(str(path))
    assert (code, err) == (0, "") and "pipeline: Batch > Filter > IndexedMap" in out


def test_inspect_valid_states_of_every_form(data: dict[str, Any], tmp_path: Path) -> None:
    directory = data["dir"]
    loader = loader_of(directory, num_workers=2)
    iterator = iter(loader)
    for _ in range(3):
        next(iterator)
    workers_state = loader.state_dict()
    del iterator, loader
    names = tmp_path / "ränk states ✓"
    rs.save_state(workers_state, names / "rank 0.json")
    rs.save_state(workers_state, names / "ранг 1.json")
    (names / "notes.txt").write_text("ignored")
    rst.save({"model": {"w": torch.ones(2)}, "step": 3, "data": workers_state}, tmp_path / "ckpt.pt")
    torch.save(data["loader_state"], tmp_path / "plain torch.pt")
    checks = {
        directory / "pipe.json": ["1 pipeline state", "pipeline: Batch > Filter > IndexedMap > Shard > Shuffle"],
        directory / "loader.json": ["rank 0/1: Loader epoch 0, 2 batches handed out"],
        names: ["4 pipeline states", "rank 0/1, worker 1/2", "files of JsonlSource (1)"],
        tmp_path / "ckpt.pt": ["2 pipeline states", "rank 0/1: Loader epoch 0, 3 batches handed out"],
        tmp_path / "plain torch.pt": ["1 pipeline state", "2 batches handed out"],
    }
    for path, expected in checks.items():
        code, out, err = inspect(str(path))
        assert (code, err) == (0, ""), (path, err)
        assert out.startswith(f"{path}: ")
        for text in expected:
            assert text in out, (path, text, out)


def test_inspect_a_valid_loader_state_from_the_shell(data: dict[str, Any]) -> None:
    done = cli("inspect", str(data["dir"] / "loader.json"))
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert "rank 0/1: Loader epoch 0, 2 batches handed out in this pass" in done.stdout
    position = next(line for line in done.stdout.splitlines() if line.startswith("rank 0/1  "))
    assert position.split()[2] == "0"  # epoch


def damaged_checkpoints(directory: Path) -> dict[str, Path]:
    pipe = rs.from_list(list(range(40))).shuffle(2).batch(3)
    take(pipe, 1)
    junk = directory / "junk metadata"
    junk.mkdir()
    (junk / ".metadata").write_bytes(b"not a checkpoint's metadata")
    empty = directory / "empty metadata"
    empty.mkdir()
    (empty / ".metadata").write_bytes(b"")
    cut = directory / "cut data"
    dcp.save({"data": rst.PerRank(pipe)}, checkpoint_id=str(cut))
    for part in cut.glob("*.distcp"):
        part.write_bytes(part.read_bytes()[: part.stat().st_size // 2])
    return {"junk .metadata": junk, "empty .metadata": empty, "a truncated .distcp": cut}


@pytest.mark.parametrize("name", ["junk .metadata", "empty .metadata", "a truncated .distcp"])
def test_inspect_a_damaged_distributed_checkpoint_as_one_line(tmp_path: Path, name: str) -> None:
    path = damaged_checkpoints(tmp_path)[name]
    try:
        code, out, err = inspect(str(path))
    except BaseException as error:  # CheckpointException is no Exception
        pytest.fail(f"inspect raised {type(error).__name__}")
    assert code == 2 and out == "" and err.startswith("error: ") and str(path) in err


class OpensAFile:
    """Unpickled, opens (so creates) ``path``: what a crafted checkpoint could do instead."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.path), "w"))


def test_inspect_runs_no_code_from_a_crafted_distributed_checkpoint(tmp_path: Path) -> None:
    crafted = tmp_path / "crafted"
    crafted.mkdir()
    marker = tmp_path / "code ran"
    (crafted / ".metadata").write_bytes(pickle.dumps(OpensAFile(marker)))
    with contextlib.suppress(BaseException):  # how it fails is another test's matter
        inspect(str(crafted))
    assert not marker.exists()


def test_load_all_ranks_runs_no_code_from_a_crafted_distributed_checkpoint(tmp_path: Path) -> None:
    """The same metadata given to ``rs.torch.load_all_ranks`` (an elastic resume's reader):
    refused with a StateError naming the file, before torch would unpickle it."""
    import resumable.torch as rst

    crafted = tmp_path / "crafted"
    crafted.mkdir()
    marker = tmp_path / "code ran"
    (crafted / ".metadata").write_bytes(pickle.dumps(OpensAFile(marker)))
    with pytest.raises(rs.StateError, match=r"\.metadata: cannot read a checkpoint's metadata"):
        rst.load_all_ranks(crafted)
    assert not marker.exists()


# ---------------------------------------------------------------------------------------------
# python -m resumable index


def counts(out: str) -> dict[str, int]:
    """``{path: records}`` from index's report, and ``{"total": records}``."""
    found = {}
    for line in out.splitlines():
        number, _, rest = line.strip().partition("  ")
        if rest.startswith("records in "):
            found["total"] = int(number.replace(",", ""))
        else:
            found[rest] = int(number.replace(",", ""))
    return found


def test_index_refuses_what_is_no_data_file_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "dir.jsonl").mkdir()
    (tmp_path / "only dirs").mkdir()
    (tmp_path / "only dirs" / "sub.jsonl").mkdir()
    os.symlink("nowhere.jsonl", tmp_path / "dangling.jsonl")
    os.symlink("loop.jsonl", tmp_path / "loop.jsonl")
    (tmp_path / "good.jsonl").write_text('{"a": 1}\n')
    for argv in (
        [str(tmp_path / "missing.jsonl")],
        [str(tmp_path / "dir.jsonl")],
        [str(tmp_path / "nothing*.jsonl")],
        [str(tmp_path / "only dirs" / "*.jsonl")],
        [str(tmp_path / "dangling.jsonl")],
        [str(tmp_path / "loop.jsonl")],
        [str(tmp_path / "good.jsonl"), str(tmp_path / "missing.jsonl")],  # one bad path among good ones
    ):
        code, out, err = index(*argv)
        assert_one_line_error(code, out, err, argv[-1])
    assert not (tmp_path / "good.jsonl.rsidx").exists()  # nothing indexed when a path is bad


def test_index_counts_odd_files_with_odd_names(tmp_path: Path) -> None:
    files = {
        "empty.jsonl": b"",
        "no final newline.jsonl": b'{"a": 1}\n{"a": 2}',
        "ünïcødé ✓.jsonl": '{"ü": 1}\n\n{"ü": 2}\n'.encode(),
        "bom.jsonl": b'\xef\xbb\xbf{"a": 1}\n',
        "crlf.jsonl": b'{"a": 1}\r\n{"a": 2}\r\n',
    }
    for name, content in files.items():
        (tmp_path / name).write_bytes(content)
    done = cli("index", "--quiet", str(tmp_path / "*.jsonl"))
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    found = counts(done.stdout)
    assert found == {
        str(tmp_path / "bom.jsonl"): 1,
        str(tmp_path / "crlf.jsonl"): 2,
        str(tmp_path / "empty.jsonl"): 0,
        str(tmp_path / "no final newline.jsonl"): 2,
        str(tmp_path / "ünïcødé ✓.jsonl"): 2,
        "total": 7,
    }


def test_index_with_a_file_in_the_way_of_the_cache_dir_still_counts(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text('{"a": 1}\n{"a": 2}\n')
    (tmp_path / "in the way").write_text("a file")
    (tmp_path / "a.jsonl.rsidx").mkdir()  # nor can the sidecar go beside the data
    with pytest.warns(SidecarWarning, match="keeping it in memory"):
        code, out, err = index(str(tmp_path / "a.jsonl"), "--cache-dir", str(tmp_path / "in the way" / "cache"))
    assert code == 0 and "Traceback" not in err
    assert counts(out) == {str(tmp_path / "a.jsonl"): 2, "total": 2}
    assert (tmp_path / "in the way").read_text() == "a file"


def test_index_an_unreadable_file_in_one_line(as_other_user: tuple[str, ...], open_dir: Path) -> None:
    secret = open_dir / "secret.jsonl"
    secret.write_text('{"a": 1}\n')
    secret.chmod(0)
    done = cli("index", "--quiet", str(secret), prefix=as_other_user, env=other_user_env(open_dir))
    assert_one_line_error(done.returncode, done.stdout, done.stderr, str(secret))


def test_index_a_read_only_data_directory(as_other_user: tuple[str, ...], open_dir: Path) -> None:
    data_dir = open_dir / "read only data"
    data_dir.mkdir()
    (data_dir / "a.jsonl").write_text('{"a": 1}\n{"a": 2}\n{"a": 3}\n')
    data_dir.chmod(0o555)
    env = other_user_env(open_dir)
    writable = open_dir / "writable cache"
    writable.mkdir()
    writable.chmod(0o777)
    locked = open_dir / "locked cache"
    locked.mkdir()
    locked.chmod(0o555)
    expected = {str(data_dir / "a.jsonl"): 3, "total": 3}

    done = cli("index", "--quiet", str(data_dir / "a.jsonl"), prefix=as_other_user, env=env)
    assert done.returncode == 0 and counts(done.stdout) == expected, done.stderr
    assert [p.name[: len("a.jsonl.")] for p in Path(env["RESUMABLE_CACHE_DIR"]).glob("*.rsidx")] == ["a.jsonl."]

    done = cli(
        "index", "--quiet", str(data_dir / "a.jsonl"), "--cache-dir", str(writable), prefix=as_other_user, env=env
    )
    assert done.returncode == 0 and counts(done.stdout) == expected, done.stderr
    assert len(list(writable.glob("a.jsonl.*.rsidx"))) == 1

    done = cli(
        "index", "--quiet", str(data_dir / "a.jsonl"), "--cache-dir", str(locked / "sub"), prefix=as_other_user, env=env
    )
    assert done.returncode == 0 and counts(done.stdout) == expected, done.stderr
    assert "SidecarWarning" in done.stderr and "Traceback" not in done.stderr
    assert os.listdir(data_dir) == ["a.jsonl"] and os.listdir(locked) == []


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
def test_save_state_refuses_what_json_cannot_write_and_keeps_the_previous_file(tmp_path: Path, value: float) -> None:
    """NaN and the infinities are not JSON (json.dumps writes them as bare words other readers
    refuse): the save is a StateError, and the previous file stays."""
    target = tmp_path / "state.json"
    rs.save_state({"step": 1}, target)
    with pytest.raises(rs.StateError, match="JSON cannot write this state"):
        rs.save_state({"step": 2, "loss": value}, target)
    assert rs.load_state(target) == {"step": 1}
    assert sorted(os.listdir(tmp_path)) == ["state.json"]
