"""Adversarial checks of two changes: file checks run by ``get_state()`` only (``Node._watch``
over the pipeline), and an indexed source keeping its own decoders through ``_WeakMethod``.

* Every file of every source kind is watched through every reader a pipeline can put above it
  (prefetch, a thread map, nested read-aheads, a mix, ``filter(index=True)``, ``cache()``, the
  ``rs.torch.Loader``): once the check is due, ``get_state()`` raises ``SourceError`` and
  nothing else; once the file is back, the epoch delivers every record exactly once.
* A pipeline pickled or deep-copied mid-epoch continues as the original would, with the
  original dropped, and restores a state; a dropped copy is freed without the collector.
"""

from __future__ import annotations

import copy
import gc
import gzip
import json
import os
import pickle
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import resumable as rs
from resumable import Node
from resumable.sources import files
from tests.sources import INDEXED_KINDS, indexed_source, replace_file
from tests.watching import assert_freed_at_once, wait_until

COUNT = 24
ERRORS_GUARD = 10_000
"""Only a guard against a reader that never recovers: the errors a reader caught while the file
differed come out in order, as many as its buffers held (a thread map's window alone holds up
to 256 entries), so a bound of a few times ``COUNT`` could stop the epoch before its end."""
FILE_KINDS = ("jsonl", "parquet", "arrow", "arrow_stream", "jsonl_stream", "jsonl_stream_gzip")
OPENERS: dict[str, Callable[[list[str]], Node[Any]]] = {
    "jsonl": rs.jsonl,
    "parquet": rs.parquet,
    "arrow": rs.arrow,
    "arrow_stream": rs.arrow,
    "jsonl_stream": rs.jsonl_stream,
    "jsonl_stream_gzip": rs.jsonl_stream,
}


def same(item: Any) -> Any:
    return item


def ids(record: dict[str, Any]) -> int:
    return record["id"]  # type: ignore[no-any-return]  # records are dicts of ints


def keep(record: dict[str, Any]) -> bool:
    return record["id"] % 3 != 0


def as_is(batch: Any) -> Any:
    return batch


def write(path: Path, kind: str, records: list[dict[str, Any]]) -> Path:
    lines = b"".join(json.dumps(record).encode() + b"\n" for record in records)
    if kind in ("jsonl", "jsonl_stream"):
        path.write_bytes(lines)
    elif kind == "jsonl_stream_gzip":
        path = path.with_name(path.name + ".gz")
        path.write_bytes(gzip.compress(lines))
    elif kind == "parquet":
        pq.write_table(pa.Table.from_pylist(records), path, row_group_size=3)
    else:
        table = pa.Table.from_pylist(records)
        new_writer = pa.ipc.new_stream if kind == "arrow_stream" else pa.ipc.new_file
        with pa.OSFile(str(path), "wb") as sink, new_writer(sink, table.schema) as writer:
            for batch in table.to_batches(max_chunksize=3):
                writer.write_batch(batch)
    return path


def file_source(directory: Path, kind: str, first: int = 0) -> tuple[Node[Any], list[Path], list[int]]:
    """A source of ``kind`` over ``COUNT`` records (ids from ``first``) in two files."""
    records = [{"id": first + index} for index in range(COUNT)]
    paths = [write(directory / f"{kind}-{first}-{part}", kind, records[part::2]) for part in range(2)]
    return OPENERS[kind]([str(path) for path in paths]), paths, [record["id"] for record in records]


READERS: dict[str, Callable[[Node[Any]], Node[Any]]] = {
    "plain": lambda node: node,
    "prefetch": lambda node: node.prefetch(2),
    "thread_map": lambda node: node.map(same, num_workers=2),
    "nested": lambda node: node.prefetch(2).map(same, num_workers=2).prefetch(3),
}


def watched_cases() -> list[tuple[str, str, bool]]:
    cases = [(kind, reader, False) for kind in FILE_KINDS for reader in READERS]
    cases += [(kind, "mix", False) for kind in FILE_KINDS]
    cases += [(kind, "nested", True) for kind in ("jsonl", "arrow", "jsonl_stream")]  # same size
    cases += [(kind, chain, False) for kind in ("jsonl", "parquet", "arrow") for chain in ("filter_index", "cache")]
    return cases


def pipeline(kind: str, reader: str, directory: Path) -> tuple[Node[Any], Path, list[int]]:
    """The pipeline, the file to change (the second of the first source: a round robin that
    checked only the first file would miss it) and the ids it must deliver."""
    source, paths, expected = file_source(directory, kind)
    if reader == "mix":
        other, _, more = file_source(directory, "parquet" if kind != "parquet" else "jsonl", 1000)
        return rs.mix({"a": source, "b": other}).prefetch(2), paths[1], expected + more
    if reader == "filter_index":
        return source.filter(keep, index=True).prefetch(2), paths[1], [i for i in expected if keep({"id": i})]
    if reader == "cache":
        return source.cache().map(same, num_workers=2), paths[1], expected
    return READERS[reader](source), paths[1], expected


@pytest.mark.parametrize(("kind", "reader", "same_size"), watched_cases())
def test_a_changed_file_is_a_source_error_once_due_and_the_epoch_survives_its_restore(
    kind: str, reader: str, same_size: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(files, "WATCH_INTERVAL", 0)  # every get_state() checks one file per source
    pipe, changed, expected = pipeline(kind, reader, tmp_path)
    with pipe:
        got = [next(pipe)["id"]]
        original, info = changed.read_bytes(), os.stat(changed)
        try:
            replace_file(changed, bytes(byte ^ 0x55 for byte in original) if same_size else original + b"\n\n")
            raised = []
            for _ in range(2):  # two files per source: the round robin reaches the changed one
                try:
                    pipe.get_state()
                except Exception as error:  # noqa: BLE001 - the type is what is checked
                    raised.append(error)
            assert raised, "a state was saved over a changed file with its check due"
            assert all(type(error) is rs.SourceError for error in raised), raised
            assert all(changed.name in str(error) for error in raised)
        finally:
            replace_file(changed, original, (info.st_atime_ns, info.st_mtime_ns))
        errors = []
        while len(errors) <= ERRORS_GUARD:
            try:
                got.append(next(pipe)["id"])
            except StopIteration:
                break
            except Exception as error:  # noqa: BLE001 - what a reader caught in the window
                errors.append(error)
        assert all(type(error) is rs.SourceError for error in errors), errors
        assert sorted(got) == sorted(expected)
        pipe.get_state()


@pytest.mark.parametrize("kind", ["jsonl", "arrow", "jsonl_stream_gzip"])
def test_a_set_state_failing_on_a_changed_file_leaves_the_pipeline_as_it_was(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``set_state`` takes ``get_state()`` of the previous position first, which now watches."""
    monkeypatch.setattr(files, "WATCH_INTERVAL", 0)
    source, paths, expected = file_source(tmp_path, kind)
    with source.prefetch(2) as pipe:
        got = [next(pipe)["id"]]
        saved = pipe.get_state()
        got.append(next(pipe)["id"])
        before = pipe.get_state()  # the round robin is on the first file again after two calls
        # the reader idle (its buffer full), so that it does not read the file while it is changed
        producer = pipe._producer
        assert producer is not None
        wait_until(lambda: producer.queue.full() or not producer.thread.is_alive(), "an idle prefetch thread")
        original, info = paths[0].read_bytes(), os.stat(paths[0])
        try:
            replace_file(paths[0], original + b"\n")
            with pytest.raises(rs.SourceError, match=paths[0].name):
                pipe.set_state(saved)
        finally:
            replace_file(paths[0], original, (info.st_atime_ns, info.st_mtime_ns))
        assert pipe.get_state() == before
        got += [record["id"] for record in pipe]
        assert sorted(got) == sorted(expected)


def test_loader_workers_and_the_main_process_report_a_changed_file_as_a_source_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from resumable.torch import Loader

    monkeypatch.setattr(files, "WATCH_INTERVAL", 0)
    source, paths, _ = file_source(tmp_path, "parquet")
    loader = Loader(source.map(ids).batch(2), num_workers=0, collate_fn=as_is)
    batches = iter(loader)
    next(batches)
    replace_file(paths[1], paths[1].read_bytes() + b"xx")
    with pytest.raises(rs.SourceError, match=paths[1].name):
        for _ in range(2):
            loader.state_dict()

    source, paths, _ = file_source(tmp_path, "jsonl")
    loader = Loader(source.shard().map(ids).batch(2), num_workers=2, collate_fn=as_is)
    batches = iter(loader)
    next(batches)
    replace_file(paths[0], paths[0].read_bytes() + b"\n\n")
    with pytest.raises(rs.SourceError, match=paths[0].name):  # a worker's state with a batch
        list(batches)


# -- copies: pickled (DataLoader workers), deep-copied; the original dropped -------------------

RECORDS = [{"id": index, "text": "x" * (index % 5)} for index in range(23)]
CHAINS: dict[str, Callable[[Node[Any]], Node[Any]]] = {
    "source": lambda source: source,
    "shuffle_shard_map": lambda source: source.shuffle(3).shard(0, 2).map(ids),
    "filter_index": lambda source: source.filter(keep, index=True),
    "cache": lambda source: source.cache().map(ids),
    "mix": lambda source: rs.mix({"a": source, "b": indexed_source("list", RECORDS).shuffle(1)}),
}


def hf_source() -> Node[Any]:
    datasets = pytest.importorskip("datasets")
    features = datasets.Features({"id": datasets.Value("int64"), "text": datasets.Value("string")})
    return rs.from_hf(datasets.Dataset.from_list(RECORDS, features=features))


def any_source(kind: str) -> Node[Any]:
    return hf_source() if kind == "hf" else indexed_source(kind, RECORDS)


def copied(node: Node[Any], how: str) -> Node[Any]:
    return pickle.loads(pickle.dumps(node)) if how == "pickle" else copy.deepcopy(node)


@pytest.mark.parametrize(
    ("kind", "chain", "how"),
    [(kind, chain, "pickle") for kind in (*INDEXED_KINDS, "hf") for chain in CHAINS]
    + [(kind, chain, "deepcopy") for kind in (*INDEXED_KINDS, "hf") for chain in ("source", "mix")],
)
def test_a_copy_taken_mid_epoch_continues_as_the_original_with_the_original_dropped(
    kind: str, chain: str, how: str
) -> None:
    reference = CHAINS[chain](any_source(kind))
    node = CHAINS[chain](any_source(kind))
    for _ in range(5):
        next(reference)
        next(node)
    state = reference.get_state()
    rest = list(reference)
    copy_ = copied(node, how)
    del node
    gc.collect()
    assert list(copy_) == rest
    restored = copied(CHAINS[chain](any_source(kind)), how)  # a state restored into a copy
    restored.set_state(json.loads(json.dumps(state)))
    assert list(restored) == rest


@pytest.mark.parametrize(
    ("kind", "reader"), [(kind, None) for kind in INDEXED_KINDS] + [("parquet", "prefetch"), ("hf", "thread_map")]
)
def test_a_dropped_copy_is_freed_without_the_collector(kind: str, reader: str | None) -> None:
    node = copied(any_source(kind).filter(keep, index=True).shuffle(2), "pickle")
    next(node)
    node = copy.deepcopy(node)
    if reader is not None:
        node = READERS[reader](node)
    next(node)
    node.get_state()
    next(node)
    pipeline = [node]
    del node
    assert_freed_at_once(pipeline)


@pytest.mark.parametrize("kind", INDEXED_KINDS)
def test_a_shallow_copy_reads_on_by_itself(kind: str) -> None:
    """``copy.copy`` of a source mid-epoch reads on from the same record with its own flow and
    decoders: the original and the copy each give the rest of the epoch, in any interleaving,
    and the copy outlives the original."""
    node = indexed_source(kind, RECORDS)
    head = [next(node) for _ in range(5)]
    shallow = copy.copy(node)
    assert [next(node), next(shallow), next(shallow)] == [RECORDS[5], RECORDS[5], RECORDS[6]]
    assert head + [RECORDS[5]] + list(node) == RECORDS
    del node
    gc.collect()
    assert head + RECORDS[5:7] + list(shallow) == RECORDS


def loader_pipeline() -> Node[Any]:
    """Every indexed source kind in one mix, so one worker start covers them all."""
    components = {kind: indexed_source(kind, RECORDS).shuffle(1).shard() for kind in INDEXED_KINDS}
    return rs.mix(components, seed=4).map(ids).batch(4)


@pytest.mark.parametrize("context", ["spawn"])  # a fork server's workers unpickle the same way; seconds each
def test_loader_workers_started_from_scratch_continue_a_forked_loaders_state(context: str) -> None:
    """Workers under spawn and forkserver unpickle the pipeline (its decoders bound to their own
    copy) and restore a state a forked loader saved: the same batches as the forked run."""
    from resumable.torch import Loader

    forked = Loader(loader_pipeline(), num_workers=2, multiprocessing_context="fork", collate_fn=as_is)
    batches = iter(forked)
    head = [next(batches) for _ in range(3)]
    state = forked.state_dict()
    rest = list(batches)
    assert sorted(i for batch in head + rest for i in batch) == sorted(list(range(23)) * len(INDEXED_KINDS))
    started = Loader(loader_pipeline(), num_workers=2, multiprocessing_context=context, collate_fn=as_is)
    started.load_state_dict(json.loads(json.dumps(state)))
    assert list(started) == rest
