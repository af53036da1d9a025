"""Adversarial checks of the two on-disk stores that several processes share: the block files
of ``.cache(directory)`` and the kept-positions sidecar of ``.filter(index=True, cache_dir=...)``.

Several real processes (fork and spawn, DataLoader workers with persistent workers on and off)
fill one store at once; writers are SIGKILLed mid-write; files are damaged (truncated, empty,
garbage, wrong metadata, swapped, a sidecar with other values, a lock file that is a directory);
the directory disappears or is shared by other pipelines; resumes cross fresh processes at the
start, middle, last item and end of an epoch, warm or cold. What must hold: the data is what the
uninterrupted run yields (every record once per epoch), and damaged files are rebuilt or refused
with the library's typed errors, never a wrong record, a raw exception, a crash or a hang.

The six bugs it found are mended: a block file renamed to another block's name was served as
that block, block metadata that did not fit its table raised AttributeError or gave wrong
records, a map's or predicate's default arguments and a partial's bound arguments were not in
the fingerprint, and a sidecar cut short under a running process gave wrong positions or SIGBUS.
"""

from __future__ import annotations

import functools
import glob
import io
import json
import multiprocessing
import os
import shutil
import signal
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pytest

import resumable as rs
from resumable.ops import disk_cache, indexed_filter
from resumable.ops.cache import cache
from resumable.ops.disk_cache import block_name
from resumable.sources._sidecar import SidecarWarning
from tests.resume import roundtrip, take
from tests.sources import indexed_source, replace_file

N = 60
BLOCK = 7
RECORDS = [{"id": i, "text": "x" * (i % 7)} for i in range(N)]
CHILD_TIMEOUT_S = 60.0


def keep(record: dict[str, Any]) -> bool:
    return record["id"] % 3 != 0


KEPT = [r["id"] for r in RECORDS if keep(r)]


def tokenize(record: dict[str, Any]) -> dict[str, Any]:
    ids = np.arange(record["id"] % 5, dtype=np.int32) + record["id"]
    return {"id": record["id"], "ids": ids, "n": len(record["text"])}


def slow_tokenize(record: dict[str, Any]) -> dict[str, Any]:
    time.sleep(0.002)
    return tokenize(record)


def summary(record: dict[str, Any]) -> list[Any]:
    """A record as comparable plain data, its array's dtype included."""
    ids = record["ids"]
    return [record["id"], ids.dtype.str, ids.tolist(), record["n"]]


EXPECTED = {i: summary(tokenize(r)) for i, r in enumerate(RECORDS)}


def write_jsonl(path: Path, records: list[dict[str, Any]] = RECORDS) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def cached(source: rs.Node[Any], directory: Any, fn: Callable[[Any], Any] = tokenize) -> Any:
    return cache(source.map(fn), directory, block_size=BLOCK)


def in_child(target: Callable[..., Any], *args: Any, method: str = "fork", timeout: float = CHILD_TIMEOUT_S) -> Any:
    """``target(*args)`` in a new process: its result, or an AssertionError naming how it died
    (a signal, an exception) or that it hung (killed after ``timeout``)."""
    context = multiprocessing.get_context(method)
    queue = context.Queue()
    process = context.Process(target=_report, args=(queue, target, args))
    process.start()
    try:
        outcome = _outcome(queue, process, timeout)
    finally:
        process.join(10)
        if process.is_alive():
            process.kill()
            process.join(10)
    if outcome is None:
        raise AssertionError(f"child died with exit code {process.exitcode} ({target.__name__})")
    ok, value = outcome
    if not ok:
        raise AssertionError(f"child raised {value}")
    return value


def _outcome(queue: Any, process: Any, timeout: float) -> Any:
    """What the child put on ``queue``; None if it died without answering; AssertionError if it
    is still running after ``timeout`` (a hang)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return queue.get(timeout=0.1)
        except Exception:  # noqa: BLE001 - queue.Empty: not yet
            if not process.is_alive():
                try:
                    return queue.get(timeout=1.0)
                except Exception:  # noqa: BLE001 - died without answering
                    return None
    raise AssertionError(f"child hung (still running after {timeout} s)")


def _report(queue: Any, target: Callable[..., Any], args: tuple[Any, ...]) -> None:
    warnings.simplefilter("ignore")
    try:
        queue.put((True, target(*args)))
    except BaseException as error:  # noqa: BLE001 - reported to the parent
        queue.put((False, f"{type(error).__module__}.{type(error).__name__}: {error}"))


def run_many(targets: list[tuple[str, Callable[..., Any], tuple[Any, ...]]]) -> list[Any]:
    """Start every ``(method, target, args)`` at once; their results in order (hang guarded)."""
    queues, processes = [], []
    for method, target, args in targets:
        context = multiprocessing.get_context(method)
        queue = context.Queue()
        process = context.Process(target=_report, args=(queue, target, args))
        queues.append(queue)
        processes.append(process)
    for process in processes:
        process.start()
    results = []
    try:
        for queue, process in zip(queues, processes):
            outcome = _outcome(queue, process, CHILD_TIMEOUT_S)
            assert outcome is not None, f"child died with exit code {process.exitcode}"
            ok, value = outcome
            assert ok, f"child raised {value}"
            results.append(value)
    finally:
        for process in processes:
            process.join(10)
            if process.is_alive():
                process.kill()
                process.join(10)
    assert all(p.exitcode == 0 for p in processes), [p.exitcode for p in processes]
    return results


# -- several processes fill one store at once ------------------------------------------------------


def _fill_cache(data: str, directory: str, seed: int) -> tuple[list[Any], int]:
    node = cached(rs.jsonl(data), directory, slow_tokenize)
    records = [summary(r) for r in take(node.shuffle(seed), N)]
    return sorted(records), node.computed


def test_fork_and_spawn_processes_fill_one_cache_at_once(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl")
    directory = str(tmp_path / "cache")
    targets = [("fork", _fill_cache, (data, directory, seed)) for seed in range(3)]
    targets.append(("spawn", _fill_cache, (data, directory, 9)))
    results = run_many(targets)
    for records, computed in results:
        assert records == [EXPECTED[i] for i in range(N)]
        assert computed <= N
    again = cached(rs.jsonl(data), directory, slow_tokenize)
    assert [summary(r) for r in take(again, N)] == [EXPECTED[i] for i in range(N)]
    assert again.computed == 0
    assert not [name for name in os.listdir(again.path) if name.endswith(".partial")]


def slow_keep(record: dict[str, Any]) -> bool:
    time.sleep(0.003)
    return keep(record)


def _build_index(data: str, directory: str) -> tuple[list[int], int]:
    node = rs.jsonl(data).filter(slow_keep, index=True, cache_dir=directory, progress=False)
    return [r["id"] for r in take(node, len(node))], node.scanned


def test_fork_and_spawn_processes_build_one_sidecar_once(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl")
    directory = str(tmp_path / "index")
    targets = [("fork", _build_index, (data, directory)) for _ in range(3)]
    targets.append(("spawn", _build_index, (data, directory)))
    results = run_many(targets)
    assert [ids for ids, _ in results] == [KEPT] * 4
    assert sum(scanned for _, scanned in results) == N  # one process scanned, the others waited and loaded
    names = os.listdir(directory)
    assert not [name for name in names if name.endswith(".partial")]
    assert sum(name.endswith(".npy") for name in names) == 1


def loader_pipeline(data: str, cache_dir: str, index_dir: str) -> rs.Node[Any]:
    node = cached(rs.jsonl(data), cache_dir).filter(keep, index=True, cache_dir=index_dir, progress=False)
    return node.shuffle(5).shard().map(lambda r: r["id"]).batch(3, collate_fn=list)


@pytest.mark.parametrize("persistent", [False, True])
def test_loader_workers_fill_cache_and_sidecar_every_record_once_per_epoch(tmp_path: Path, persistent: bool) -> None:
    from resumable.torch import Loader

    data = write_jsonl(tmp_path / "d.jsonl")
    dirs = (str(tmp_path / "cache"), str(tmp_path / "index"))

    def make() -> Any:
        return Loader(
            lambda: loader_pipeline(data, *dirs),
            num_workers=2,
            multiprocessing_context="fork",
            persistent_workers=persistent,
            collate_fn=lambda b: b,
        )

    loader = make()
    epochs = [[batch for batch in loader] for _ in range(2)]
    for epoch in epochs:
        assert Counter(i for batch in epoch for i in batch) == Counter(KEPT)
    # a fresh loader over the warm stores, stopped mid-epoch and resumed by another fresh one
    loader = make()
    head = []
    for batch in loader:
        head.append(batch)
        if len(head) == 5:
            break
    state = json.loads(json.dumps(loader.state_dict()))
    resumed = make()
    resumed.load_state_dict(state)
    tail = list(resumed) + list(resumed)
    expected = epochs[0] + epochs[1]
    assert head + tail == expected


# -- a writer killed mid-write ---------------------------------------------------------------------


def _killed_mid_block(directory: str) -> None:
    """Fill the cache, but die (SIGKILL) half-way through writing block 2."""
    real = disk_cache.write_atomically
    victim = block_name(2 * BLOCK, 3 * BLOCK)

    def dying(path: str, write: Callable[[Any], Any]) -> None:
        if not path.endswith(victim):
            real(path, write)
            return

        def half(out: Any) -> None:
            buffer = io.BytesIO()
            write(buffer)
            data = buffer.getvalue()
            out.write(data[: len(data) // 2])
            out.flush()
            os.kill(os.getpid(), signal.SIGKILL)

        real(path, half)

    disk_cache.write_atomically = dying  # type: ignore[assignment]  # only in this child
    take(cached(rs.from_list(RECORDS), directory), N)


def test_cache_writer_killed_mid_block_leaves_a_partial_that_a_new_run_survives(tmp_path: Path) -> None:
    directory = str(tmp_path / "cache")
    with pytest.raises(AssertionError, match="exit code -9"):
        in_child(_killed_mid_block, directory)
    root = cached(rs.from_list(RECORDS), directory).path
    assert root is not None
    names = os.listdir(root)
    assert [name for name in names if name.endswith(".partial")] == [f".{block_name(2 * BLOCK, 3 * BLOCK)}.partial"]
    node = cached(rs.from_list(RECORDS), directory)
    assert sorted(summary(r) for r in take(node.shuffle(2), N)) == [EXPECTED[i] for i in range(N)]
    assert node.computed == N - 2 * BLOCK  # the two complete blocks were read, the rest computed
    assert not [name for name in os.listdir(root) if name.endswith(".partial")]


def _killed_writing_sidecar(directory: str, stage: str) -> None:
    """Build the sidecar, but die (SIGKILL) while holding the lock: half-way through the ``.npy``,
    or after the ``.npy`` was renamed into place and before its ``.json``."""

    def dying(self: Any, sidecar: str, kept: np.ndarray) -> None:
        if stage == "mid_npy":

            def half(out: Any) -> None:
                buffer = io.BytesIO()
                np.save(buffer, kept, allow_pickle=False)
                out.write(buffer.getvalue()[:40])
                out.flush()
                os.kill(os.getpid(), signal.SIGKILL)

            indexed_filter.write_atomically(sidecar, half)
        indexed_filter.write_atomically(sidecar, lambda out: np.save(out, kept, allow_pickle=False))
        os.kill(os.getpid(), signal.SIGKILL)

    indexed_filter.IndexedFilter._write_sidecar = dying  # type: ignore[method-assign]  # only in this child
    len(rs.from_list(RECORDS).filter(keep, index=True, cache_dir=directory, progress=False))


def _index(directory: str) -> tuple[list[int], int]:
    node = rs.from_list(RECORDS).filter(keep, index=True, cache_dir=directory, progress=False)
    return [r["id"] for r in take(node, len(node))], node.scanned


@pytest.mark.parametrize("stage", ["mid_npy", "before_json"])
def test_sidecar_builder_killed_holding_the_lock_then_a_new_run(tmp_path: Path, stage: str) -> None:
    directory = str(tmp_path / "index")
    with pytest.raises(AssertionError, match="exit code -9"):
        in_child(_killed_writing_sidecar, directory, stage)
    assert glob.glob(os.path.join(directory, "*.lock"))  # the dead builder's lock file is left
    assert in_child(_index, directory) == (KEPT, N)  # no hang on the lock, rebuilt
    assert in_child(_index, directory) == (KEPT, 0)  # and then loaded
    assert not [name for name in os.listdir(directory) if name.endswith(".partial")]


# -- damaged block files ---------------------------------------------------------------------------


def _fill(directory: Path) -> str:
    node = cached(rs.from_list(RECORDS), directory)
    take(node, N)
    assert node.path is not None
    return node.path


def _rewrite_block(path: str, table: pa.Table) -> None:
    with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)


DAMAGE: dict[str, Callable[[str], None]] = {
    "truncated": lambda p: os.truncate(p, os.path.getsize(p) // 2),
    "zero_length": lambda p: os.truncate(p, 0),
    "garbage": lambda p: Path(p).write_bytes(os.urandom(os.path.getsize(p))),
    "arrow_magic_then_garbage": lambda p: Path(p).write_bytes(b"ARROW1\x00\x00" + os.urandom(400)),
    "other_row_count": lambda p: _rewrite_block(p, pa.ipc.open_file(p).read_all().slice(0, 3)),
    "no_metadata": lambda p: _rewrite_block(p, pa.ipc.open_file(p).read_all().replace_schema_metadata(None)),
    "other_format": lambda p: _rewrite_block(
        p, pa.ipc.open_file(p).read_all().replace_schema_metadata({b"resumable": b'{"format": "resumable-cache/0"}'})
    ),
    "metadata_not_json": lambda p: _rewrite_block(
        p, pa.ipc.open_file(p).read_all().replace_schema_metadata({b"resumable": b"\xff{"})
    ),
    "a_directory": lambda p: (os.unlink(p), os.mkdir(p)),  # type: ignore[func-returns-value]
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_block_is_computed_again(tmp_path: Path, damage: str) -> None:
    root = _fill(tmp_path)
    DAMAGE[damage](os.path.join(root, block_name(BLOCK, 2 * BLOCK)))
    node = cached(rs.from_list(RECORDS), tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a block path that is a directory cannot be replaced: memory
        records = [summary(r) for r in take(node.shuffle(1), N)]
    assert sorted(records) == [EXPECTED[i] for i in range(N)]
    if damage != "a_directory":  # that one cannot be replaced: the cache falls back to memory, by design
        assert node.computed == BLOCK


def _read_after_cut(directory: str) -> list[Any]:
    node = cached(rs.from_list(RECORDS), directory)
    first = [summary(r) for r in take(node, N)]
    path = os.path.join(node.path, block_name(BLOCK, 2 * BLOCK))
    os.truncate(path, 64)  # cut short in place while this process has it mapped
    return first + [summary(r) for r in take(node, N)]


def test_block_cut_short_while_mapped_is_recomputed_not_sigbus(tmp_path: Path) -> None:
    _fill(tmp_path)
    assert in_child(_read_after_cut, str(tmp_path)) == [EXPECTED[i] for i in range(N)] * 2


def test_swapped_block_files_are_not_served_as_each_other(tmp_path: Path) -> None:
    root = _fill(tmp_path)
    first, second = (os.path.join(root, block_name(b * BLOCK, (b + 1) * BLOCK)) for b in (0, 1))
    os.rename(first, first + ".x")
    os.rename(second, first)
    os.rename(first + ".x", second)
    records = [summary(r) for r in take(cached(rs.from_list(RECORDS), tmp_path), N)]
    assert records == [EXPECTED[i] for i in range(N)]


def _meta(columns: Any, wrapped: bool = False) -> bytes:
    return json.dumps({"format": disk_cache.FORMAT, "wrapped": wrapped, "columns": columns, "skipped": []}).encode()


GOOD_COLUMNS = {"id": ["python", "int"], "ids": ["array", "<i4"], "n": ["python", "int"]}
BAD_METADATA = {
    "json_list": b"[1]",
    "columns_a_list": _meta([]),
    "int_column_said_array": _meta({**GOOD_COLUMNS, "id": ["array", "<i8"]}),
    "said_wrapped": _meta(GOOD_COLUMNS, wrapped=True),
    "a_column_left_out": _meta({"id": ["python", "int"], "n": ["python", "int"]}),
}


@pytest.mark.parametrize("metadata", sorted(BAD_METADATA))
def test_block_with_metadata_that_does_not_fit_its_table_is_computed_again(tmp_path: Path, metadata: str) -> None:
    root = _fill(tmp_path)
    path = os.path.join(root, block_name(0, BLOCK))
    table = pa.ipc.open_file(path).read_all()
    assert json.loads(table.schema.metadata[b"resumable"])["columns"] == GOOD_COLUMNS
    _rewrite_block(path, table.replace_schema_metadata({b"resumable": BAD_METADATA[metadata]}))
    node = cached(rs.from_list(RECORDS), tmp_path)
    try:
        records = [summary(r) for r in take(node, N)]
    except rs.ResumableError:
        return  # refused with a typed error: acceptable
    assert records == [EXPECTED[i] for i in range(N)]


def test_cache_directory_removed_mid_epoch_still_yields_every_record(tmp_path: Path) -> None:
    node = cached(rs.from_list(RECORDS), tmp_path / "cache")
    pipe = node.shuffle(4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        head = take(pipe, 20)
        shutil.rmtree(tmp_path / "cache")
        tail = take(pipe, N - 20)
        again = take(pipe, N)
    assert sorted(summary(r) for r in head + tail) == [EXPECTED[i] for i in range(N)]
    assert sorted(summary(r) for r in again) == [EXPECTED[i] for i in range(N)]


# -- one directory, several pipelines ---------------------------------------------------------------


def other_tokenize(record: dict[str, Any]) -> dict[str, Any]:
    ids = np.arange(record["id"] % 5, dtype=np.int32) - record["id"]
    return {"id": record["id"], "ids": ids, "n": len(record["text"])}


def test_directory_shared_by_pipelines_with_other_maps_and_other_files(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    other = [{"id": i, "text": "y" * (i % 4)} for i in range(N)]
    pipes = {
        "tokenize": lambda: cached(rs.from_list(RECORDS), shared),
        "other_map": lambda: cached(rs.from_list(RECORDS), shared, other_tokenize),
        "jsonl": lambda: cached(rs.jsonl(write_jsonl(tmp_path / "a.jsonl")), shared),
        "other_jsonl": lambda: cached(rs.jsonl(write_jsonl(tmp_path / "b.jsonl", other)), shared),
    }
    expected = {
        "tokenize": [EXPECTED[i] for i in range(N)],
        "other_map": [summary(other_tokenize(r)) for r in RECORDS],
        "jsonl": [EXPECTED[i] for i in range(N)],
        "other_jsonl": [summary(tokenize(r)) for r in other],
    }
    for _ in range(2):  # cold, then warm, interleaved
        for name, build in pipes.items():
            assert [summary(r) for r in take(build(), N)] == expected[name], name
    assert len({build().path for build in pipes.values()}) == 4


@pytest.mark.parametrize("change", ["rewritten_same_size", "rewritten_same_size_and_mtime", "touched"])
def test_source_file_changed_after_the_cache_and_index_were_built(tmp_path: Path, change: str) -> None:
    path = tmp_path / "d.jsonl"
    write_jsonl(path)
    dirs = tmp_path / "cache", tmp_path / "index"

    def build() -> Any:
        return cached(rs.jsonl(str(path)), dirs[0]).filter(keep, index=True, cache_dir=dirs[1], progress=False)

    assert [r["id"] for r in take(build(), len(KEPT))] == KEPT
    stat = os.stat(path)
    if change == "touched":
        records = RECORDS
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 5_000_000_000))
    else:  # same ids and lengths, other text: same size; other ids kept by nothing else
        records = [{"id": r["id"], "text": "z" * len(r["text"])} for r in RECORDS]
        mtime = (stat.st_atime_ns, stat.st_mtime_ns) if change.endswith("mtime") else None
        replace_file(path, "".join(json.dumps(r) + "\n" for r in records).encode(), mtime)
        assert os.path.getsize(path) == stat.st_size
    node = build()
    got = take(node, len(node))
    assert [r["id"] for r in got] == KEPT
    assert [summary(r) for r in got] == [summary(tokenize(records[i])) for i in KEPT]


# -- fingerprints: what a "different pipeline" is ---------------------------------------------------


def _defined(source: str) -> Callable[[Any], Any]:
    namespace: dict[str, Any] = {"__name__": __name__, "np": np}
    exec(source, namespace)  # noqa: S102 - the same function edited in place, as in a source file
    return namespace["tokenize_scaled"]  # type: ignore[no-any-return]


def test_editing_a_maps_default_argument_gives_a_new_cache(tmp_path: Path) -> None:
    template = "def tokenize_scaled(record, scale={}):\n    return {{'id': record['id'] * scale}}\n"
    before, after = _defined(template.format(2)), _defined(template.format(3))
    assert [r["id"] for r in take(cached(rs.from_list(RECORDS), tmp_path, before), N)] == [2 * i for i in range(N)]
    assert [r["id"] for r in take(cached(rs.from_list(RECORDS), tmp_path, after), N)] == [3 * i for i in range(N)]


def test_editing_a_predicates_default_argument_gives_a_new_index(tmp_path: Path) -> None:
    template = "def tokenize_scaled(record, modulus={}):\n    return record['id'] % modulus != 0\n"
    for modulus in (3, 4):
        predicate = _defined(template.format(modulus))
        node = rs.from_list(RECORDS).filter(predicate, index=True, cache_dir=tmp_path, progress=False)
        assert [r["id"] for r in take(node, len(node))] == [i for i in range(N) if i % modulus]


def scaled(record: dict[str, Any], scale: int) -> dict[str, Any]:
    return {"id": record["id"] * scale}


def test_partials_with_other_arguments_get_other_caches(tmp_path: Path) -> None:
    two = cached(rs.from_list(RECORDS), tmp_path, functools.partial(scaled, scale=2))
    three = cached(rs.from_list(RECORDS), tmp_path, functools.partial(scaled, scale=3))
    assert [r["id"] for r in take(two, N)] == [2 * i for i in range(N)]
    assert [r["id"] for r in take(three, N)] == [3 * i for i in range(N)]


# -- damaged sidecars ------------------------------------------------------------------------------


def _npy(values: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, values, allow_pickle=False)
    return buffer.getvalue()


def _header(text: str) -> bytes:
    return b"\x93NUMPY\x01\x00\x76\x00" + text.encode().ljust(117) + b"\n"


SIDECAR_DAMAGE: dict[str, Callable[[bytes, bytes], tuple[bytes, bytes]]] = {
    "npy_truncated": lambda n, j: (n[: len(n) // 2], j),
    "npy_empty": lambda n, j: (b"", j),
    "npy_header_only": lambda n, j: (n[:128], j),
    "npy_garbage": lambda n, j: (os.urandom(len(n)), j),
    "npy_magic_then_garbage": lambda n, j: (b"\x93NUMPY\x01\x00" + os.urandom(200), j),
    "npy_huge_shape": lambda n, j: (_header("{'descr': '<u4', 'fortran_order': False, 'shape': (99999999999,), }"), j),
    "npy_negative_shape": lambda n, j: (_header("{'descr': '<u4', 'fortran_order': False, 'shape': (-5,), }"), j),
    "npy_object_dtype": lambda n, j: (_header("{'descr': '|O', 'fortran_order': False, 'shape': (3,), }"), j),
    "npy_other_version": lambda n, j: (b"\x93NUMPY\x09\x00" + n[8:], j),
    "npy_other_values": lambda n, j: (_npy(np.arange(len(KEPT), dtype=np.uint32)), j),
    "npy_big_endian": lambda n, j: (_npy(np.load(io.BytesIO(n)).astype(">u4")), j),
    "npy_2d": lambda n, j: (_npy(np.load(io.BytesIO(n)).reshape(2, -1)), j),
    "json_garbage": lambda n, j: (n, b"\xff\xfe garbage"),
    "json_a_list": lambda n, j: (n, b"[1, 2]"),
    "json_deep": lambda n, j: (n, b"[" * 100_000),
    "json_empty": lambda n, j: (n, b""),
    "json_other_count": lambda n, j: (n, json.dumps({**json.loads(j), "kept": 3}).encode()),
    # values that rise within range, with a description that matches them but another key
    "renamed_from_another_index": lambda n, j: (
        _npy(np.arange(0, 2 * len(KEPT), 2, dtype=np.uint32)),
        json.dumps(
            {
                **json.loads(j),
                "key": "0" * 32,
                "kept_digest": indexed_filter._digest(np.arange(0, 2 * len(KEPT), 2, dtype=np.uint32)),
            }
        ).encode(),
    ),
}


@pytest.mark.parametrize("damage", sorted(SIDECAR_DAMAGE))
def test_damaged_sidecar_is_rebuilt(tmp_path: Path, damage: str) -> None:
    _index(str(tmp_path))
    (npy,) = glob.glob(str(tmp_path / "*.npy"))
    description = npy[: -len(".npy")] + ".json"
    new_npy, new_json = SIDECAR_DAMAGE[damage](Path(npy).read_bytes(), Path(description).read_bytes())
    Path(npy).write_bytes(new_npy)
    Path(description).write_bytes(new_json)
    with pytest.warns(SidecarWarning, match="damaged or stale"):
        ids, scanned = _index(str(tmp_path))
    assert ids == KEPT and scanned == N
    assert _index(str(tmp_path)) == (KEPT, 0)  # the rebuilt sidecar is good


def test_lock_file_that_is_a_directory_and_cache_dir_that_is_a_file(tmp_path: Path) -> None:
    _index(str(tmp_path / "a"))
    (lock,) = glob.glob(str(tmp_path / "a" / "*.lock"))
    for name in os.listdir(tmp_path / "a"):
        os.unlink(tmp_path / "a" / name)
    os.mkdir(lock)  # no lock to take: built without it (as where the file system has none), and stored
    assert _index(str(tmp_path / "a")) == (KEPT, N)
    assert _index(str(tmp_path / "a")) == (KEPT, 0)
    (tmp_path / "b").write_text("a file")
    with pytest.warns(SidecarWarning):
        assert _index(str(tmp_path / "b")) == (KEPT, N)


def _read_after_sidecar_cut(directory: str) -> list[int]:
    node = rs.from_list(RECORDS).filter(keep, index=True, cache_dir=directory, progress=False)
    first = [r["id"] for r in take(node, len(node))]
    assert node._mapped
    os.truncate(node.sidecar, 128)  # cut short in place while this process has it mapped
    return first + [r["id"] for r in take(node.shuffle(1), len(node))]


def test_sidecar_cut_short_while_mapped_is_not_sigbus(tmp_path: Path) -> None:
    _index(str(tmp_path))
    result = in_child(_read_after_sidecar_cut, str(tmp_path))
    assert result[: len(KEPT)] == KEPT and sorted(result[len(KEPT) :]) == KEPT


# -- resume exactness through both stores, fresh processes ------------------------------------------


def resume_pipeline(kind: str, cache_dir: str | None, index_dir: str | None) -> rs.Node[Any]:
    source = indexed_source(kind, RECORDS)
    node = cached(source, cache_dir) if cache_dir is not None else source.map(tokenize)
    node = node.filter(keep, index=True, cache_dir=index_dir, progress=False)
    return node.shuffle(11).shard(1, 2).map(summary)


def _resume(kind: str, cache_dir: str, index_dir: str, state: dict[str, Any], count: int) -> list[Any]:
    pipe = resume_pipeline(kind, cache_dir, index_dir)
    pipe.set_state(roundtrip(state))
    return take(pipe, count)


SHARD = len(KEPT) // 2
TOTAL = 2 * SHARD + 5


@pytest.mark.parametrize("kind", ["list", "jsonl", "parquet"])
@pytest.mark.parametrize("k", [0, 7, SHARD - 1, SHARD, SHARD + 6])
def test_resume_through_cache_and_sidecar_in_a_fresh_process(tmp_path: Path, kind: str, k: int) -> None:
    expected = take(resume_pipeline(kind, None, None), TOTAL)
    assert len({item[0] for item in expected[:SHARD]}) == SHARD and {item[0] for item in expected} <= set(KEPT)
    dirs = str(tmp_path / "cache"), str(tmp_path / "index")
    pipe = resume_pipeline(kind, *dirs)
    head = take(pipe, k)
    state = pipe.get_state()
    assert head == expected[:k]
    if k % 2:  # a cold resume: the stores wiped after the state was taken
        shutil.rmtree(dirs[0])
        shutil.rmtree(dirs[1])
    assert in_child(_resume, kind, *dirs, state, TOTAL - k) == expected[k:]


def test_resume_in_a_spawned_process_over_a_warm_cache(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl")
    dirs = str(tmp_path / "cache"), str(tmp_path / "index")
    expected = take(spawn_pipeline(data, *dirs), TOTAL)
    pipe = spawn_pipeline(data, *dirs)
    head = take(pipe, 9)
    assert head == expected[:9]
    assert in_child(_spawn_resume, data, *dirs, pipe.get_state(), TOTAL - 9, method="spawn") == expected[9:]


def spawn_pipeline(data: str, cache_dir: str, index_dir: str) -> rs.Node[Any]:
    node = cached(rs.jsonl(data), cache_dir).filter(keep, index=True, cache_dir=index_dir, progress=False)
    return node.shuffle(11).shard(0, 2).map(summary)


def _spawn_resume(data: str, cache_dir: str, index_dir: str, state: dict[str, Any], count: int) -> list[Any]:
    pipe = spawn_pipeline(data, cache_dir, index_dir)
    pipe.set_state(roundtrip(state))
    return take(pipe, count)
