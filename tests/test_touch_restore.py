"""Which file sources restore after a ``touch`` or a ``cp`` without ``-p``, as the README and
docs/sources.md state it: every source whose fingerprints hold a content digest (``rs.jsonl``,
``rs.parquet``, ``rs.arrow``, ``rs.from_hf``, gzip ``rs.jsonl_stream``) restores over the same
content with another mtime; plain ``rs.jsonl_stream`` files have no digest, so their mtime must be
kept (``cp -p``, ``rsync -a``) and a new one is a ``StateError`` on restore and a ``SourceError``
during the run."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest

import resumable as rs
from resumable.sources import files
from tests.resume import take
from tests.test_input_fuzz import KINDS, RECORDS, build, write

RESTORES_AFTER_TOUCH = {kind: kind != "jsonl_stream" for kind in KINDS}
"""Source kinds (see ``tests.test_input_fuzz.write``) that restore over a file with a new mtime."""
TAKEN = 7


def new_mtime(path: str, how: str, directory: Path) -> str:
    """The file at ``path`` (or a copy) with the same content and another mtime."""
    if how == "copy":  # cp without -p: a new file, a new mtime, in another directory
        directory.mkdir()
        copy = str(directory / os.path.basename(path))
        shutil.copyfile(path, copy)
        info = os.stat(path)
        os.utime(copy, ns=(info.st_atime_ns, info.st_mtime_ns + 10**9))  # a new mtime even on coarse clocks
        return copy
    info = os.stat(path)
    os.utime(path, ns=(info.st_atime_ns, info.st_mtime_ns + 10**9))
    return path


@pytest.mark.parametrize("how", ["touch", "copy"])
@pytest.mark.parametrize("kind", KINDS)
def test_restore_after_a_new_mtime_as_documented(tmp_path: Path, kind: str, how: str) -> None:
    path = write(kind, tmp_path)
    pipe = build(kind, path, shuffled=False)
    take(pipe, TAKEN)
    state = pipe.get_state()
    expected = take(build(kind, path, shuffled=False), len(RECORDS))[TAKEN:]
    moved = new_mtime(path, how, tmp_path / "copied")
    resumed = build(kind, moved, shuffled=False)
    if RESTORES_AFTER_TOUCH[kind]:
        resumed.set_state(state)
        assert take(resumed, len(RECORDS) - TAKEN) == expected
    else:
        with pytest.raises(rs.StateError, match=r"no content digest to compare\); restore that file \(cp -p"):
            resumed.set_state(state)


@pytest.mark.parametrize("kind", KINDS)
def test_touch_during_the_run_as_documented(tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(files, "WATCH_INTERVAL", 0)
    path = write(kind, tmp_path)
    pipe = build(kind, path, shuffled=False)
    take(pipe, TAKEN)
    new_mtime(path, "touch", tmp_path)
    if RESTORES_AFTER_TOUCH[kind]:
        pipe.get_state()
        assert len(take(pipe, len(RECORDS))) == len(RECORDS)  # the rest of the epoch, then the next
    else:
        with pytest.raises(rs.SourceError, match="changed during the run .*this format has no content digest"):
            pipe.get_state()


def test_from_hf_restores_after_touch_and_copy(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    datasets.disable_progress_bars()
    datasets.Dataset.from_list(RECORDS).save_to_disk(str(tmp_path / "hf"), max_shard_size="1KB")
    dataset = datasets.load_from_disk(str(tmp_path / "hf"))
    pipe = rs.from_hf(dataset)
    take(pipe, TAKEN)
    state = pipe.get_state()
    for entry in dataset.cache_files:
        new_mtime(entry["filename"], "touch", tmp_path)
    shutil.copytree(tmp_path / "hf", tmp_path / "copied", copy_function=shutil.copyfile)  # cp without -p
    for directory in ("hf", "copied"):
        resumed: Any = rs.from_hf(datasets.load_from_disk(str(tmp_path / directory)))
        resumed.set_state(state)
        assert take(resumed, len(RECORDS) - TAKEN) == RECORDS[TAKEN:]
