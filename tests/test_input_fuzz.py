"""Corrupted inputs: only typed errors come out, and a bad sidecar never fails valid data.

Files of every source kind (JSONL, streamed plain and gzip JSONL, Parquet, Arrow IPC file and
stream format) are damaged (bytes flipped, cut short, appended to, deleted, made unreadable)
before the source is built, after it is built but before it reads, or between taking a state
and restoring it into a fresh pipeline. Whatever happens, construction, iteration, random
access, ``get_state`` and ``set_state`` may only raise ``rs.ResumableError`` subclasses. Line-index
sidecars are damaged separately: the data is valid, so every record must come out, unchanged.
"""

from __future__ import annotations

import gzip
import json
import os
import stat
import warnings
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import resumable as rs
from resumable.sources import _sidecar, line_index
from tests.resume import take

RECORDS = [{"id": i, "text": "café " * (i % 5) + "x" * i} for i in range(60)]
KINDS = ("jsonl", "jsonl_stream", "jsonl_gzip", "parquet", "arrow", "arrow_stream")
PHASES = ("before_build", "before_read", "before_restore")


def write(kind: str, directory: Path) -> str:
    """A file of ``kind`` holding ``RECORDS``."""
    lines = "".join(json.dumps(record) + "\n" for record in RECORDS)
    if kind in ("jsonl", "jsonl_stream"):
        path = directory / "data.jsonl"
        path.write_text(lines)
    elif kind == "jsonl_gzip":
        path = directory / "data.jsonl.gz"
        path.write_bytes(gzip.compress(lines.encode()))
    elif kind == "parquet":
        path = directory / "data.parquet"
        pq.write_table(pa.Table.from_pylist(RECORDS), str(path), row_group_size=16)
    else:
        path = directory / "data.arrow"
        table = pa.Table.from_pylist(RECORDS)
        new_writer = pa.ipc.new_stream if kind == "arrow_stream" else pa.ipc.new_file
        with pa.OSFile(str(path), "wb") as sink, new_writer(sink, table.schema) as writer:
            for batch in table.to_batches(max_chunksize=16):
                writer.write_batch(batch)
    return str(path)


def build(kind: str, path: str, shuffled: bool) -> rs.Node[Any]:
    if kind in ("jsonl_stream", "jsonl_gzip"):
        return rs.jsonl_stream(path)
    source: rs.Node[Any] = {"jsonl": rs.jsonl, "parquet": rs.parquet}.get(kind, rs.arrow)(path)
    return source.shuffle(3) if shuffled else source


@st.composite
def damages(draw: st.DrawFn) -> Callable[[str], None]:
    """A function that damages the file at a path: flip, cut, append, delete or chmod 000."""
    how = draw(st.sampled_from(["flip", "truncate", "append", "delete", "chmod"]))
    where = draw(st.floats(0, 1))
    flips = draw(st.lists(st.integers(1, 255), min_size=1, max_size=4))
    tail = draw(st.binary(min_size=1, max_size=64))

    def damage(path: str) -> None:
        if how == "delete":
            os.remove(path)
        elif how == "chmod":
            os.chmod(path, 0)
        else:
            data = bytearray(Path(path).read_bytes())
            at = int(where * (len(data) - 1))
            if how == "flip":
                for offset, mask in enumerate(flips):
                    data[min(at + offset, len(data) - 1)] ^= mask
            elif how == "truncate":
                data = data[:at]
            else:
                data += tail
            with open(path, "r+b") as out:  # in place, as a writer would: memory maps see it
                out.truncate(len(data))
                out.seek(0)
                out.write(data)

    return damage


def exercise(pipe: rs.Node[Any]) -> None:
    """Everything a training loop does with a source: iterate, save, random access."""
    take(pipe, len(RECORDS) + 5)
    pipe.get_state()
    if isinstance(pipe, rs.nodes.IndexedNode) and len(pipe):
        pipe[len(pipe) - 1]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(KINDS), phase=st.sampled_from(PHASES), damage=damages(), shuffled=st.booleans())
def test_damaged_files_raise_only_typed_errors(
    tmp_path_factory: pytest.TempPathFactory, kind: str, phase: str, damage: Callable[[str], None], shuffled: bool
) -> None:
    path = write(kind, tmp_path_factory.mktemp("fuzz"))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", line_index.SidecarWarning)
            if phase == "before_build":
                damage(path)
                exercise(build(kind, path, shuffled))
            elif phase == "before_read":
                pipe = build(kind, path, shuffled)
                damage(path)
                exercise(pipe)
            else:
                pipe = build(kind, path, shuffled)
                take(pipe, 7)
                state = json.loads(json.dumps(pipe.get_state()))
                damage(path)
                fresh = build(kind, path, shuffled)
                fresh.set_state(state)
                exercise(fresh)
    except rs.ResumableError:
        pass
    finally:
        if os.path.exists(path):
            os.chmod(path, stat.S_IRUSR | stat.S_IWUSR)


@st.composite
def sidecar_damages(draw: st.DrawFn) -> Callable[[bytes], bytes]:
    """A function that damages a sidecar's bytes: in its header, its offsets or its checksums."""
    how = draw(st.sampled_from(["flip_header", "flip_body", "truncate", "append", "garbage", "empty"]))
    where = draw(st.floats(0, 1))
    mask = draw(st.integers(1, 255))
    tail = draw(st.binary(min_size=1, max_size=32))

    def damage(data: bytes) -> bytes:
        header = _sidecar.HEADER.size
        damaged = bytearray(data)
        if how == "flip_header":
            damaged[int(where * (header - 1))] ^= mask
        elif how == "flip_body":
            damaged[header + int(where * (len(data) - header - 1))] ^= mask
        elif how == "truncate":
            damaged = damaged[: int(where * len(data))]
        elif how == "append":
            damaged += tail
        elif how == "garbage":
            damaged = bytearray(tail * (len(data) // len(tail) + 1))[: len(data)]
        else:
            damaged = bytearray()
        return bytes(damaged)

    return damage


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(damage=sidecar_damages(), shuffled=st.booleans(), block_entries=st.sampled_from([4, 16, 1024]))
def test_damaged_sidecars_never_fail_valid_data(
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
    damage: Callable[[bytes], bytes],
    shuffled: bool,
    block_entries: int,
) -> None:
    monkeypatch.setattr(_sidecar, "BLOCK_ENTRIES", block_entries)
    path = write("jsonl", tmp_path_factory.mktemp("sidecar"))
    build("jsonl", path, shuffled=False)
    sidecar = Path(path + line_index.SIDECAR_SUFFIX)
    sidecar.write_bytes(damage(sidecar.read_bytes()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", line_index.SidecarWarning)
        pipe = build("jsonl", path, shuffled)
        records = take(pipe, len(RECORDS))
        state = pipe.get_state()
    assert sorted(records, key=lambda record: record["id"]) == RECORDS if shuffled else records == RECORDS
    sidecar.write_bytes(damage(sidecar.read_bytes()))  # damaged again before a restore
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", line_index.SidecarWarning)
        resumed = build("jsonl", path, shuffled)
        resumed.set_state(state)
        assert take(resumed, len(RECORDS)) == take(build("jsonl", path, shuffled), 2 * len(RECORDS))[len(RECORDS) :]
