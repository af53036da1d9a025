"""The same records as every indexed source kind, so a property runs over all of them.

``indexed_source(kind, records)`` returns a fresh source node over ``records`` (a list of dicts
with the same keys): in memory, or written once per process to JSONL, Parquet or Arrow IPC
(file and stream format) files in a temporary directory removed at exit. Properties
parametrised over ``INDEXED_KINDS`` catch a mistake that only one kind makes (a state entry
that only file-backed sources carry, say).
"""

from __future__ import annotations

import atexit
import gzip
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

import resumable as rs

INDEXED_KINDS = ("list", "jsonl", "parquet", "arrow", "arrow_stream")
STREAM_KINDS = ("jsonl_stream", "jsonl_stream_gzip")

_DIRECTORY = tempfile.mkdtemp(prefix="resumable-test-sources-")
atexit.register(shutil.rmtree, _DIRECTORY, ignore_errors=True)
_WRITTEN: dict[tuple[str, str], str] = {}
"""(kind, JSON of the records) -> path of the file holding them."""


def indexed_source(kind: str, records: list[dict[str, Any]]) -> rs.Node[Any]:
    """A fresh source of ``kind`` whose records equal ``records`` (empty lists are not files)."""
    if kind == "list":
        return rs.from_list(records)
    path = _file(kind, records)
    if kind == "jsonl":
        return rs.jsonl(path)
    if kind == "parquet":
        return rs.parquet(path)
    if kind in ("arrow", "arrow_stream"):
        return rs.arrow(path)
    raise ValueError(f"unknown source kind {kind!r}")


def replace_file(path: Path, data: bytes, mtime: tuple[int, int] | None = None) -> None:
    """New contents for ``path`` the way a tool that rewrites a file safely gives them (a new
    file renamed over it): a reader's memory map of the old file stays valid, where rewriting
    in place would cut it short under a reader thread (SIGBUS). With ``mtime`` (access and
    modification times in ns), the new file carries those times, as a restore that keeps them."""
    staged = path.with_name(path.name + ".staged")
    staged.write_bytes(data)
    if mtime is not None:
        os.utime(staged, ns=mtime)
    os.replace(staged, path)


def stream_source(kind: str, records: list[dict[str, Any]], files: int = 3, **options: Any) -> rs.Node[Any]:
    """A fresh ``rs.jsonl_stream`` over ``records`` split into ``files`` files, plain or gzip."""
    parts = [records[index::files] for index in range(files)]
    paths = [_file("jsonl_gzip" if kind == "jsonl_stream_gzip" else "jsonl", part) for part in parts if part]
    return rs.jsonl_stream(paths, **options)


def _file(kind: str, records: list[dict[str, Any]]) -> str:
    text = json.dumps(records, sort_keys=True)
    key = (kind, text)
    if key not in _WRITTEN:
        path = os.path.join(_DIRECTORY, f"{len(_WRITTEN)}.{kind}")
        if kind == "jsonl":
            with open(path, "w") as out:
                out.writelines(json.dumps(record) + "\n" for record in records)
        elif kind == "jsonl_gzip":
            path += ".gz"
            with gzip.open(path, "wt") as out:
                out.writelines(json.dumps(record) + "\n" for record in records)
        else:
            table = pa.Table.from_pylist(records)
            if kind == "parquet":
                pq.write_table(table, path, row_group_size=max(1, len(records) // 5))
            else:
                new_writer = pa.ipc.new_stream if kind == "arrow_stream" else pa.ipc.new_file
                with pa.OSFile(path, "wb") as sink, new_writer(sink, table.schema) as writer:
                    for batch in table.to_batches(max_chunksize=max(1, len(records) // 4)):
                        writer.write_batch(batch)
        _WRITTEN[key] = path
    return _WRITTEN[key]
