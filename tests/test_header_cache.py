"""A node keeps the header of its states (kind, version, options, identity) between states and
builds it again when ``_header_key()`` says it may have changed: a shard's topology, a file
source's fingerprints, an elastic option, a list source's length. Each case
first takes a state (so the header is kept), changes what the header depends on, and checks the
next state against a pipeline built fresh in the changed conditions. The suite runs with
``RESUMABLE_VERIFY_HEADERS=1`` (tests/conftest.py), under which every kept header is compared
with a fresh one; the last tests show that this check catches a missing key."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

import resumable as rs
from resumable.core import node as node_module
from resumable.elastic import as_consumer
from resumable.order.topology import Topology
from resumable.sources import files
from tests.resume import take
from tests.test_input_fuzz import KINDS, build, write
from tests.test_touch_restore import RESTORES_AFTER_TOUCH, new_mtime


def without_progress(state: dict[str, Any]) -> dict[str, Any]:
    """``state``'s headers only, down the chain: what a kept header may get wrong."""
    return {
        key: without_progress(value) if isinstance(value, dict) else value
        for key, value in state.items()
        if key in ("kind", "version", "upstream", "batch_size", "drop_last", "length", "files")
        or key in ("rank", "world_size", "worker", "num_workers", "kept", "kept_digest")
    }


def files_of(state: dict[str, Any]) -> list[list[Any]]:
    """The fingerprints ``[path, size, mtime_ns, digest]`` saved by the source at the chain's end."""
    while "upstream" in state:
        state = state["upstream"]
    return list(state["files"])


def test_verification_is_on_in_the_suite() -> None:
    assert node_module.VERIFY_HEADERS, "tests/conftest.py sets RESUMABLE_VERIFY_HEADERS=1 before resumable loads"


def test_an_elastic_batch_size_is_in_the_next_state() -> None:
    pipe = rs.from_list(list(range(40))).batch(4)
    take(pipe, 2)
    assert pipe.get_state()["batch_size"] == 4
    saved = rs.from_list(list(range(40))).batch(8).get_state()
    pipe._adopt_elastic_options(saved, pipe.kind)
    state = pipe.get_state()
    assert state["batch_size"] == 8
    assert without_progress(state) == without_progress(saved)


def test_a_shard_pinned_to_another_consumer_names_it() -> None:
    pipe = rs.from_list(list(range(40))).shard(0, 2).batch(2)
    take(pipe, 1)
    assert pipe.get_state()["upstream"]["rank"] == 0
    as_consumer(pipe, Topology(1, 2, 1, 3))
    shard_state = pipe.get_state()["upstream"]
    assert (shard_state["rank"], shard_state["world_size"], shard_state["worker"], shard_state["num_workers"]) == (
        1,
        2,
        1,
        3,
    )


def test_a_stream_pinned_to_another_consumer_names_it(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    path.write_text("".join(f'{{"i": {i}}}\n' for i in range(20)))
    pipe = rs.jsonl_stream([str(path)], rank=0, world_size=1)
    take(pipe, 3)
    assert pipe.get_state()["rank"] == 0
    as_consumer(pipe, Topology(1, 2))
    state = pipe.get_state()
    assert (state["rank"], state["world_size"]) == (1, 2)


def test_a_list_source_that_grew_saves_its_new_length() -> None:
    records = list(range(10))
    pipe = rs.from_list(records)
    take(pipe, 3)
    assert pipe.get_state()["length"] == 10
    records.extend(range(10, 15))
    assert pipe.get_state()["length"] == 15


def test_a_filter_index_is_in_every_state(tmp_path: Path) -> None:
    """The first header builds the index (``_config``), so it needs no key."""
    pipe = rs.from_list(list(range(30))).filter(lambda x: x % 3 == 0, index=True, progress=False)
    first = pipe.get_state()  # builds the index on the way
    take(pipe, 4)
    assert pipe.get_state()["kept"] == first["kept"] == 10
    assert without_progress(pipe.get_state()) == without_progress(first)


@pytest.mark.parametrize("kind", [kind for kind in KINDS if RESTORES_AFTER_TOUCH[kind]])
def test_a_new_mtime_recorded_during_the_run_is_in_the_next_state(
    tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(files, "WATCH_INTERVAL", 0)
    path = write(kind, tmp_path)
    pipe = build(kind, path, shuffled=False)
    take(pipe, 3)
    before = pipe.get_state()
    new_mtime(path, "touch", tmp_path)
    after = pipe.get_state()  # the watch records the new mtime: the content is the same
    mtime = os.stat(path).st_mtime_ns
    assert [saved[2] for saved in files_of(before)] != [mtime] == [saved[2] for saved in files_of(after)]
    fresh = build(kind, path, shuffled=False)
    assert without_progress(after) == without_progress(fresh.get_state())


def test_states_taken_before_the_workers_start_do_not_leak_into_theirs() -> None:
    """The main process keeps its own headers (rank 0, worker 0 of 1); each worker's shard
    resolves its own topology, and its states say so."""
    pipe = rs.from_list(list(range(64))).shuffle(seed=1).shard().batch(4)
    main_state = pipe.get_state()
    assert main_state["upstream"]["num_workers"] == 1
    loader = rs.torch.Loader(pipe, num_workers=2)
    batches = iter(loader)
    next(batches)
    next(batches)
    workers = loader.state_dict()["loader"]["_snapshot"]["_worker_snapshots"]
    topologies = set()
    for worker in workers.values():
        shard = json.loads(worker["fetcher_state"]["dataset_iter_state"]["pipeline"])["upstream"]
        topologies.add((shard["worker"], shard["num_workers"]))
    assert topologies == {(0, 2), (1, 2)}
    assert pipe.get_state()["upstream"]["num_workers"] == 1


class Stretch(rs.Node[Any]):
    """A node whose option can change as it runs and that forgets to say so in ``_header_key``."""

    kind = "StretchForTest"

    def __init__(self, upstream: rs.Node[Any]) -> None:
        super().__init__(upstream)
        self.factor = 1

    def _next(self) -> Any:
        return next(self.upstream) * self.factor

    def _config(self) -> dict[str, Any]:
        return {"factor": self.factor}


def test_verification_names_a_node_whose_header_went_stale() -> None:
    pipe = Stretch(rs.from_list(list(range(10))))
    take(pipe, 2)
    pipe.get_state()
    pipe.factor = 3
    with pytest.raises(RuntimeError, match=r"StretchForTest: its kept state header .* is stale .*_header_key"):
        pipe.get_state()


def test_without_verification_a_missing_key_keeps_the_old_header(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the verification guards against: a kept header is trusted as long as its key holds."""
    monkeypatch.setattr(node_module, "VERIFY_HEADERS", False)
    pipe = Stretch(rs.from_list(list(range(10))))
    pipe.get_state()
    pipe.factor = 3
    assert pipe.get_state()["factor"] == 1
