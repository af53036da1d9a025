from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import resumable as rs
from resumable.cli import main


def test_index_prints_record_counts_and_writes_sidecars(tmp_path: Path, capsys) -> None:
    (tmp_path / "a.jsonl").write_text('{"a": 1}\n\n{"a": 2}\n')
    (tmp_path / "b.jsonl").write_text('{"b": 1}\n')
    assert main(["index", "--quiet", str(tmp_path / "*.jsonl")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["2", str(tmp_path / "a.jsonl")]
    assert out[1].split() == ["1", str(tmp_path / "b.jsonl")]
    assert out[2].split()[:4] == ["3", "records", "in", "2"]
    assert (tmp_path / "a.jsonl.rsidx").exists()
    assert main(["index", "--quiet", str(tmp_path / "a.jsonl")]) == 0  # fresh sidecar reused


def test_index_error_exits_2_with_message(tmp_path: Path, capsys) -> None:
    assert main(["index", str(tmp_path / "missing.jsonl")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_module_entry_point(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text('{"a": 1}\n')
    result = subprocess.run(
        [sys.executable, "-m", "resumable", "index", str(tmp_path / "a.jsonl")], capture_output=True, text=True
    )
    assert result.returncode == 0
    assert "1  records in 1 file" in result.stdout
    assert "indexing" in result.stderr  # the progress bar


def test_a_closed_stdout_ends_quietly(tmp_path: Path) -> None:
    """``python -m resumable inspect STATE | head``: the reader is gone before the report."""
    (tmp_path / "a.jsonl").write_text('{"a": 1}\n')
    state = tmp_path / "state.json"
    rs.save_state(rs.from_list([1, 2]).batch(1).get_state(), state)
    for command in (["inspect", str(state)], ["index", "--quiet", str(tmp_path / "a.jsonl")]):
        read_end, write_end = os.pipe()
        os.close(read_end)
        try:
            result = subprocess.run(
                [sys.executable, "-m", "resumable", *command], stdout=write_end, stderr=subprocess.PIPE
            )
        finally:
            os.close(write_end)
        assert result.stderr == b"", result.stderr.decode()
        assert result.returncode == 1
