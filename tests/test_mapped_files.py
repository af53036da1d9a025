"""Files cut short in place while the library reads them through a memory map.

Reading a map past the new end of its file kills the process with SIGBUS, so each case runs in a
child process: it builds a pipeline, reads, cuts a file short with ``truncate`` (same inode, as
another tool would), reads again and prints what came out as JSON. The child must exit normally
having read the right records (a line-index sidecar is rebuilt, a cache block recomputed) or
having raised the typed error naming the file (a data file changed during the run).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECORDS = 5000
"""Records in a JSONL file: five blocks of checksummed offsets in its sidecar."""
PRELUDE = """
import json, os, sys, warnings
import numpy as np
import resumable as rs
from resumable.sources.line_index import SIDECAR_SUFFIX, SidecarWarning
directory = sys.argv[1]
out = {}

def write_jsonl(name, count):
    path = os.path.join(directory, name)
    with open(path, "w") as handle:
        for i in range(count):
            handle.write(json.dumps({"i": i, "text": "x" * (i % 7)}) + "\\n")
    return path

def cut(path, size):
    with open(path, "r+b") as handle:
        handle.truncate(size)
"""


def run_child(code: str, directory: Path) -> dict[str, Any]:
    """Run ``PRELUDE + code`` in a fresh interpreter; it must exit normally and print ``out``."""
    script = PRELUDE + textwrap.dedent(code) + "\nprint(json.dumps(out))\n"
    child = subprocess.run(
        [sys.executable, "-c", script, str(directory)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert child.returncode == 0, f"child exited with {child.returncode}: {child.stderr[-2000:]}"
    return json.loads(child.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]  # the child prints a JSON dict


@pytest.mark.parametrize("opened", ["built", "loaded"])
@pytest.mark.parametrize("read", ["random", "sequential", "shuffled", "malformed"])
@pytest.mark.parametrize("size", [100, -3], ids=["into_offsets", "into_checksums"])
def test_sidecar_cut_short_while_mapped_is_rebuilt(tmp_path: Path, opened: str, read: str, size: int) -> None:
    """Regression: the sidecar's offsets were read through a memory map with no check of its
    size, so a sidecar cut short in place killed the process (SIGBUS). Its size is checked
    before each read of the map; one that changed is rebuilt from the data, with a warning.
    ``built``: the index this process built and stored; ``loaded``: one read from a sidecar."""
    out = run_child(
        f"""
        path = write_jsonl("a.jsonl", {RECORDS})
        if {read!r} == "malformed":
            with open(path, "ab") as handle:
                handle.write(b"{{not json\\n")
        if {opened!r} == "loaded":
            rs.jsonl(path)
        source = rs.jsonl(path)
        pipe = source.shuffle(0) if {read!r} == "shuffled" else source
        it = iter(pipe)
        first = [next(it)["i"] for _ in range(3)]
        sidecar = path + SIDECAR_SUFFIX
        full = os.path.getsize(sidecar)
        cut(sidecar, {size} if {size} > 0 else full + {size})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if {read!r} == "random":
                out["records"] = [source[4000]["i"], source[17]["i"]]
            elif {read!r} == "malformed":
                try:
                    source[{RECORDS}]
                except rs.SourceError as error:
                    out["error"] = str(error)
            else:
                out["records"] = first + [record["i"] for record in it]
        out["warnings"] = [str(w.message) for w in caught if issubclass(w.category, SidecarWarning)]
        out["sidecar_restored"] = os.path.getsize(sidecar) == full
        out["expected"] = [record["i"] for record in rs.jsonl(path).shuffle(0)] if {read!r} == "shuffled" else None
        """,
        tmp_path,
    )
    if read == "random":
        assert out["records"] == [4000, 17]
    elif read == "malformed":
        assert "a.jsonl:5001: malformed JSON record" in out["error"]
    elif read == "sequential":
        assert out["records"] == list(range(RECORDS))
    else:
        assert out["records"] == out["expected"] and sorted(out["records"]) == list(range(RECORDS))
    assert len(out["warnings"]) == 1 and "while in use); rebuilding it" in out["warnings"][0]
    assert out["sidecar_restored"]


def test_data_file_cut_short_while_mapped_is_a_source_error(tmp_path: Path) -> None:
    out = run_child(
        f"""
        path = write_jsonl("a.jsonl", {RECORDS})
        source = rs.jsonl(path)
        source[0]
        cut(path, 100)
        try:
            source[4000]
        except rs.SourceError as error:
            out["error"] = str(error)
        """,
        tmp_path,
    )
    assert "a.jsonl' changed during the run (its size went from" in out["error"]


@pytest.mark.parametrize("shuffled", [False, True], ids=["sequential", "shuffled"])
def test_cache_block_cut_short_during_a_later_epoch_is_recomputed(tmp_path: Path, shuffled: bool) -> None:
    """Regression: cache blocks were read through memory maps with no check, so a block file cut
    short during a later epoch killed the process (SIGBUS). A block whose file changed size is
    computed again and rewritten; iteration goes on with the same records."""
    out = run_child(
        f"""
        import glob
        from resumable.ops.cache import Cache
        def build():
            mapped = rs.from_list(list(range(3000))).map(lambda i: {{"ids": np.arange(i % 50, dtype=np.int32), "i": i}})
            cached = Cache(mapped, os.path.join(directory, "cache"), block_size=1000)
            return cached, (cached.shuffle(0) if {shuffled!r} else cached)
        cache, pipe = build()
        epoch = [record["i"] for record in pipe]
        it = iter(pipe)
        second = [next(it)["i"] for _ in range(10)]
        blocks = sorted(glob.glob(os.path.join(cache.path, "*.arrow")))
        sizes = [os.path.getsize(block) for block in blocks]
        cut(blocks[0], 100)
        cut(blocks[2], sizes[2] - 8)
        before = cache.computed
        second += [record["i"] for record in it]
        fresh = build()[1]
        list(fresh)
        out["same"] = second == [record["i"] for record in fresh]
        out["first_epoch"] = sorted(epoch) == list(range(3000))
        out["recomputed"] = cache.computed - before
        out["restored"] = [os.path.getsize(block) for block in blocks] == sizes
        """,
        tmp_path,
    )
    assert out == {"same": True, "first_epoch": True, "recomputed": 2000, "restored": True}


def test_arrow_file_cut_short_while_mapped_is_a_source_error(tmp_path: Path) -> None:
    out = run_child(
        """
        import pyarrow as pa
        path = os.path.join(directory, "a.arrow")
        table = pa.table({"i": list(range(4000)), "text": ["x" * 50] * 4000})
        with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            for batch in table.to_batches(max_chunksize=500):
                writer.write_batch(batch)
        source = rs.arrow(path)
        source[0]
        cut(path, 1000)
        try:
            source[3900]
        except rs.SourceError as error:
            out["error"] = str(error)
        """,
        tmp_path,
    )
    assert "a.arrow' changed during the run (its size went from" in out["error"]


@pytest.mark.parametrize("access", ["random", "shuffled", "indices"])
def test_hf_cache_file_cut_short_while_mapped_is_a_source_error(tmp_path: Path, access: str) -> None:
    """Regression: from_hf read the dataset's memory-mapped cache files with no check, so a
    cache file cut short killed the process (SIGBUS). The files a batch is mapped from are
    checked before it is read. ``indices``: a dataset with an indices mapping (``shuffle``)."""
    pytest.importorskip("datasets")
    out = run_child(
        f"""
        import datasets
        datasets.disable_progress_bars()
        rows = 4000
        data = {{"i": list(range(rows)), "text": ["x" * 100] * rows}}
        datasets.Dataset.from_dict(data).save_to_disk(os.path.join(directory, "hf"), max_shard_size="100KB")
        dataset = datasets.load_from_disk(os.path.join(directory, "hf"))
        if {access!r} == "indices":
            dataset = dataset.shuffle(seed=3)
        source = rs.from_hf(dataset)
        pipe = source.shuffle(0) if {access!r} == "shuffled" else source
        it = iter(pipe)
        next(it)
        files = [entry["filename"] for entry in dataset.cache_files]
        out["files"] = len(set(files))
        cut(files[-1] if {access!r} == "random" else files[0], 1000)
        try:
            if {access!r} == "random":
                source[rows - 1]
            else:
                for _ in it:
                    pass
        except rs.SourceError as error:
            out["error"] = str(error)
        """,
        tmp_path,
    )
    assert out["files"] > 1
    assert "changed during the run (its size went from" in out["error"] and ".arrow'" in out["error"]
