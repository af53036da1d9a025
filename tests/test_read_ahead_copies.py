"""A read-ahead pipeline (prefetch, parallel map) copied into another process after it was read:
pickled (a spawned DataLoader worker, ``copy.deepcopy``) or forked (a forked worker, a plain
``fork``). The copy starts without the reader, its upstream back at the last item handed out,
so it continues as the pipeline without a reader would, and so does the original; in a Loader's
workers every record of the epoch comes exactly once, and the Loader's state resumes exactly."""

from __future__ import annotations

import copy
import multiprocessing
import pickle
from typing import Any, Callable

import pytest

import resumable as rs
from resumable import Node
from resumable.ops.read_ahead import ReadAhead
from tests.sources import INDEXED_KINDS, STREAM_KINDS, _file, indexed_source, stream_source
from tests.test_read_ahead import read_ahead_fully

RECORDS = [{"id": i, "text": f"record {i}"} for i in range(24)]
EPOCH = len(RECORDS)
BATCH = 3
CHILD_TIMEOUT_S = 120.0  # a hang guard, not a speed check


def identity(record: dict[str, Any]) -> dict[str, Any]:
    return record


READERS: dict[str, Callable[[Node[Any]], Node[Any]]] = {
    "none": lambda upstream: upstream,
    "prefetch": lambda upstream: upstream.prefetch(4),
    "thread_map": lambda upstream: upstream.map(identity, num_workers=2),
    "prefetch_over_thread_map": lambda upstream: upstream.map(identity, num_workers=2).prefetch(3),
}
WITH_READERS = [name for name in READERS if name != "none"]


REMOTE_KINDS = ("s3_jsonl", "s3_parquet", "s3_jsonl_stream")
REMOTE: dict[str, Any] = {}
"""URLs of the records uploaded to the loopback S3 server, and its ``storage_options``."""


@pytest.fixture(scope="module")
def remote(s3_server: Any) -> None:
    """``RECORDS`` as a JSONL and a Parquet object, and dealt over a plain and a gzip JSONL object."""
    REMOTE["options"] = s3_server.options
    REMOTE["s3_jsonl"] = s3_server.upload(_file("jsonl", RECORDS), "copies/records.jsonl")
    REMOTE["s3_parquet"] = s3_server.upload(_file("parquet", RECORDS), "copies/records.parquet")
    for part, kind in enumerate(("jsonl", "jsonl_gzip")):
        s3_server.upload(_file(kind, RECORDS[part::2]), f"copies/stream/part-{part}.jsonl{'.gz' if part else ''}")
    REMOTE["s3_jsonl_stream"] = "s3://" + REMOTE["s3_jsonl"][len("s3://") :].split("/")[0] + "/copies/stream/part-*"


def source(kind: str) -> Node[Any]:
    if kind in STREAM_KINDS:
        return stream_source(kind, RECORDS)
    if kind == "s3_jsonl_stream":
        return rs.jsonl_stream(REMOTE[kind], storage_options=REMOTE["options"], chunk_bytes=256)
    if kind == "s3_jsonl":
        return rs.jsonl(REMOTE[kind], storage_options=REMOTE["options"]).shuffle(seed=3)
    if kind == "s3_parquet":
        return rs.parquet(REMOTE[kind], storage_options=REMOTE["options"]).shuffle(seed=3)
    return indexed_source(kind, RECORDS).shuffle(seed=3)


def build(kind: str, reader: str) -> Node[Any]:
    return READERS[reader](source(kind))


def ids(items: list[dict[str, Any]]) -> list[int]:
    return [item["id"] for item in items]


def taken(pipe: Node[Any], count: int) -> list[int]:
    got = ids([next(pipe) for _ in range(count)])
    read_ahead_fully(pipe)  # the reader is as far ahead as it goes
    return got


def serial_after(kind: str, count: int) -> tuple[list[int], dict[str, Any]]:
    """What a pipeline without a reader yields after ``count`` items, up to its epoch's end, and
    its state there."""
    plain = build(kind, "none")
    taken(plain, count)
    return ids(list(plain)), plain.get_state()


def without_readers(state: dict[str, Any]) -> dict[str, Any]:
    """The state below every read-ahead node: the state of the pipeline without them."""
    while state["kind"] in ("Prefetch", "ParallelMap", "Map"):
        state = state["upstream"]
    return state


@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
@pytest.mark.parametrize("reader", WITH_READERS)
@pytest.mark.parametrize("kind", INDEXED_KINDS + STREAM_KINDS)
@pytest.mark.parametrize("count", [0, 1, EPOCH // 2, EPOCH - 1, EPOCH])
def test_a_copy_continues_where_the_consumer_is(how: str, reader: str, kind: str, count: int) -> None:
    check_a_copy(how, reader, kind, count)


@pytest.mark.parametrize("reader", ["prefetch", "prefetch_over_thread_map"])
@pytest.mark.parametrize("kind", REMOTE_KINDS)
@pytest.mark.parametrize("count", [0, EPOCH // 2, EPOCH - 1, EPOCH])
def test_a_copy_of_a_pipeline_over_objects_continues_where_the_consumer_is(
    remote: None, reader: str, kind: str, count: int
) -> None:
    check_a_copy("pickle", reader, kind, count)


def check_a_copy(how: str, reader: str, kind: str, count: int) -> None:
    expected, end_state = serial_after(kind, count)
    pipe = build(kind, reader)
    try:
        taken(pipe, count)
        before = pipe.get_state()
        duplicate = pickle.loads(pickle.dumps(pipe)) if how == "pickle" else copy.deepcopy(pipe)
        try:
            assert duplicate.get_state() == before
            assert ids(list(duplicate)) == expected
            assert without_readers(duplicate.get_state()) == end_state
        finally:
            duplicate.close()
        assert pipe.get_state() == before  # the original was returned to its record, not moved
        assert ids(list(pipe)) == expected
    finally:
        pipe.close()


def _continue_in_child(pipe: Node[Any], sender: Any) -> None:
    try:
        sender.send(("ok", ids(list(pipe)), pipe.get_state()))
    except BaseException as error:  # noqa: BLE001 - reported to the parent
        sender.send(("error", repr(error), None))
    finally:
        pipe.close()


@pytest.mark.parametrize("reader", list(READERS))
@pytest.mark.parametrize("kind", ["list", "jsonl", "jsonl_stream"])
@pytest.mark.parametrize("count", [0, EPOCH // 2, EPOCH - 1])
def test_a_forked_copy_continues_where_the_consumer_is(reader: str, kind: str, count: int) -> None:
    check_a_forked_copy(reader, kind, count)


@pytest.mark.parametrize("reader", ["none", "prefetch", "thread_map"])
@pytest.mark.parametrize("kind", REMOTE_KINDS)
def test_a_forked_copy_of_a_pipeline_over_objects_continues_where_the_consumer_is(
    remote: None, reader: str, kind: str
) -> None:
    check_a_forked_copy(reader, kind, EPOCH // 2)


def check_a_forked_copy(reader: str, kind: str, count: int) -> None:
    expected, end_state = serial_after(kind, count)
    pipe = build(kind, reader)
    try:
        taken(pipe, count)
        context = multiprocessing.get_context("fork")
        receiver, sender = context.Pipe(duplex=False)
        child = context.Process(target=_continue_in_child, args=(pipe, sender))
        child.start()
        try:
            if not receiver.poll(CHILD_TIMEOUT_S):
                pytest.fail("the forked child did not answer")
            outcome, got, state = receiver.recv()
        finally:
            child.join(CHILD_TIMEOUT_S)
            if child.is_alive():
                child.kill()
        assert outcome == "ok", got
        assert got == expected
        assert without_readers(state) == end_state
        assert ids(list(pipe)) == expected  # the parent's reader goes on undisturbed
    finally:
        pipe.close()


def loader_pipeline(kind: str, reader: str) -> Node[Any]:
    return READERS[reader](source(kind).shard()).batch(BATCH)


def loader_epoch(loader: rs.torch.Loader) -> list[list[int]]:
    return [ids(batch) for batch in loader]


# (source kind, reader, start method, persistent workers): every combination forks; spawning
# costs seconds per worker here, so one case spawns (persistent workers: the copy outlives a pass).
LOADER_CASES = [
    *[
        (kind, reader, "fork", persistent)
        for kind in ("list", "parquet")
        for reader in WITH_READERS
        for persistent in (False, True)
    ],
    ("parquet", "prefetch_over_thread_map", "spawn", True),
]


@pytest.mark.parametrize(("kind", "reader", "context", "persistent"), LOADER_CASES)
def test_a_pipeline_read_in_the_main_process_then_in_loader_workers(
    kind: str, reader: str, context: str, persistent: bool
) -> None:
    """Read first in the main process (a look at a batch, say), then handed to a Loader: each
    worker reads its shard from the epoch's start, every record comes once, and a state taken
    midway resumes a fresh Loader exactly; the next epoch too."""
    check_loader_workers(kind, reader, context, persistent)


@pytest.mark.parametrize("kind", ["s3_jsonl", "s3_parquet"])
def test_a_pipeline_over_objects_read_in_the_main_process_then_in_loader_workers(remote: None, kind: str) -> None:
    check_loader_workers(kind, "prefetch", "fork", True)


def check_loader_workers(kind: str, reader: str, context: str, persistent: bool) -> None:

    def make_loader(pipe: Node[Any], context: str = context) -> rs.torch.Loader:
        return rs.torch.Loader(pipe, num_workers=2, multiprocessing_context=context, persistent_workers=persistent)

    reference = make_loader(loader_pipeline(kind, "none"), "fork")  # the same batches, sooner
    try:
        expected = [loader_epoch(reference), loader_epoch(reference)]
    finally:
        reference.close()
    pipe = loader_pipeline(kind, reader)
    next(pipe)
    loader = make_loader(pipe)
    try:
        batches = iter(loader)
        first = [ids(next(batches)) for _ in range(3)]
        state = loader.state_dict()
        first += [ids(batch) for batch in batches]
        second = loader_epoch(loader)
    finally:
        loader.close()
        pipe.close()
    assert [first, second] == expected
    assert sorted(i for batch in first for i in batch) == list(range(EPOCH))
    resumed = make_loader(loader_pipeline(kind, reader))
    try:
        resumed.load_state_dict(state)
        assert loader_epoch(resumed) == expected[0][3:]
    finally:
        resumed.close()


def test_every_read_ahead_node_and_stream_is_known_to_the_fork_handler() -> None:
    """The fork handler reaches the read-ahead nodes and the streams (whose open files a child
    must not share) through one registry of weak references: a node built, unpickled or copied
    is in it, and one dropped leaves it."""
    from resumable import _forks

    pipe = build("list", "prefetch_over_thread_map")
    stream = stream_source("jsonl_stream", [{"id": i} for i in range(6)])
    holders = [node for node in pipe._subtree() if isinstance(node, ReadAhead)] + [stream]
    duplicates = pickle.loads(pickle.dumps((pipe, stream)))
    copies = [node for node in duplicates[0]._subtree() if isinstance(node, ReadAhead)] + [duplicates[1]]
    assert len(holders) == len(copies) == 3
    assert all(node in _forks._LIVE for node in holders + copies)
    count = len(_forks._LIVE)
    del duplicates, copies
    assert len(_forks._LIVE) == count - 3
    pipe.close()
