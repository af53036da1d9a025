"""python -m resumable inspect over damaged states: bare pipeline states and Loader states,
damaged anywhere (inside each worker's encoded pipeline state too), always end cleanly: a
report (exit 0) or one line ``error: ...`` (exit 2), never a traceback."""

from __future__ import annotations

import contextlib
import functools
import io
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

import resumable as rs
import resumable.torch as rst
from resumable.cli import main
from resumable.elastic import restore
from tests.resume import take
from tests.test_loader import legacy_loader, legacy_state
from tests.test_state_fuzz import paths

ENCODED = ("fetcher_state", "dataset_iter_state", "pipeline")
REPLACEMENTS = [None, True, 5, -1, 1.5, 10**30, -(10**30), 2**63, "", "5", "x", [], ["a"], [1], {}, {"kind": 5}]
DELETE = object()
# The snapshot interval of the Loader state saved as an earlier version saved it.
LEGACY_SNAPSHOT_EVERY = 4
# Imported by ``--pipeline`` as the function that builds the Loader states' pipeline.
LOADER_PIPELINE = f"{__name__}:loader_pipeline"


def loader_pipeline() -> rs.Node:
    return rs.from_list(list(range(40))).shuffle(3).shard().filter(lambda x: x % 5).batch(2)


def packed(rank: int, world_size: int) -> rs.Node:
    documents = [{"input_ids": list(range(1 + i % 23))} for i in range(120)]
    return rs.from_list(documents).shuffle(1).shard(rank, world_size).pack(16, buffer_size=8).batch(2)


def bare_states(data: Path) -> list[dict[str, Any]]:
    """A state of each shape the report reads: file fingerprints, a packer's buffer, mix
    components, and a rescaled shard's remap with inherited pieces."""
    (data / "docs.jsonl").write_text("".join(f'{{"id": {i}}}\n' for i in range(60)))
    files = rs.jsonl(str(data / "docs.jsonl")).shuffle(2).shard(1, 2).map(lambda r: r["id"]).batch(3)
    mixed = rs.mix(
        {"web": rs.from_list(list(range(50))).shuffle(1), "code": rs.from_list(list(range(30))).shuffle(2)},
        weights={"web": 0.7, "code": 0.3},
    ).batch(4)
    old = [packed(consumer, 3) for consumer in range(3)]
    for consumer, pipe in enumerate([files, mixed, *old]):
        take(pipe, 2 + consumer)
    rescaled = packed(0, 2)
    restore(rescaled, [pipe.get_state() for pipe in old])
    return [files.get_state(), mixed.get_state(), rescaled.get_state()]


def loader_states() -> list[dict[str, Any]]:
    """Loader states without workers and with two, after 6 batches: as this version saves them,
    and, with two workers, as an earlier version saved one between two snapshots (whose report
    counts the batches handed out since, and which ``--pipeline`` advances)."""
    states = []
    for num_workers, every in ((0, None), (2, None), (2, LEGACY_SNAPSHOT_EVERY)):
        config = {"num_workers": num_workers, "collate_fn": np.array}
        if every is None:
            loader = rst.Loader(loader_pipeline, **config)
        else:
            loader = legacy_loader(loader_pipeline, every, **config)
        iterator = iter(loader)
        for _ in range(6):
            next(iterator)
        states.append(loader.state_dict() if every is None else legacy_state(loader, every))
        # Dropping the references stops the workers. Not close(): it reloads the loader's own state,
        # which records interval 1 and so, in a legacy loader, refuses the batches since the snapshot.
        del iterator, loader
    return json.loads(json.dumps(states))


@pytest.fixture(scope="module")
def examples(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    directory = tmp_path_factory.mktemp("inspect_fuzz")
    return directory, bare_states(directory) + loader_states()


def damage(draw: st.DrawFn, value: Any) -> None:
    """Delete, replace, truncate or wrap one entry of ``value`` (a dict), in place."""
    path = draw(st.sampled_from(paths(value)))
    holder = functools.reduce(lambda item, key: item[key], path[:-1], value)
    key = path[-1]
    action = draw(st.sampled_from(["delete", "replace", "truncate", "wrap"]))
    if action == "delete" and isinstance(holder, dict):
        del holder[key]
    elif action == "truncate" and isinstance(holder[key], (str, list)):
        holder[key] = holder[key][: draw(st.integers(0, max(len(holder[key]) - 1, 0)))]
    elif action == "wrap":
        holder[key] = [holder[key]]
    else:
        action = "replace"
        holder[key] = draw(st.sampled_from(REPLACEMENTS))
    event(f"{action} {key}" if isinstance(key, str) else action)


@st.composite
def damaged(draw: st.DrawFn, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` damaged once; in a Loader state, as often inside a worker's pipeline state."""
    state = json.loads(json.dumps(state))
    workers = state.get("loader", {}).get("_snapshot", {}).get("_worker_snapshots", {})
    iterators = [worker for worker in workers.values()] if workers else [state["loader"]] if "loader" in state else []
    if iterators and draw(st.booleans()):
        holder = functools.reduce(lambda item, key: item[key], ENCODED[:-1], draw(st.sampled_from(iterators)))
        pipeline = json.loads(holder["pipeline"])
        damage(draw, pipeline)
        holder["pipeline"] = json.dumps(pipeline)
    else:
        damage(draw, state)
    return state


def inspect(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["inspect", *argv])
    return code, out.getvalue(), err.getvalue()


@settings(max_examples=60)
@given(data=st.data())
def test_damaged_states_are_reported_or_refused_in_one_line(
    data: st.DataObject, examples: tuple[Path, list[dict[str, Any]]]
) -> None:
    directory, states = examples
    state = data.draw(st.sampled_from(states))
    path = directory / "damaged.json"
    path.write_text(json.dumps(data.draw(damaged(state))))
    replay = "loader" in state and data.draw(st.booleans())
    code, out, err = inspect(str(path), *(["--pipeline", LOADER_PIPELINE] if replay else []))
    if code == 0:
        event("reported")
        assert out.startswith(f"{path}: ") and err == ""
    else:
        event("refused")
        assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err


SOURCE = ("upstream",) * 4  # Batch > IndexedMap > Shard > Shuffle > JsonlSource
FILE_0 = "JsonlSource: state entry 'files'\\[0\\]"


@pytest.mark.parametrize(
    ("at", "key", "value", "message"),
    [
        (("upstream",), "position", "5", "Batch > IndexedMap: state entry 'position' is '5', expected an int in"),
        (("upstream",), "kind", DELETE, "Batch > upstream: state has no 'kind' entry"),
        ((), "kind", 5, "the outermost node: state entry 'kind' is 5, expected a string"),
        ((), "kind", DELETE, "the outermost node: state has no 'kind' entry"),
        ((*SOURCE, "files"), 0, ["a"], f"{FILE_0} is \\['a'\\], expected \\[path, size, mtime_ns, digest\\]"),
        ((*SOURCE, "files", 0), 2, 10**30, f"{FILE_0}: a file's mtime_ns 10{{30}} is no date in the years 1 to"),
        ((*SOURCE, "files", 0), 2, -(10**20), f"{FILE_0}: a file's mtime_ns -10{{20}} is no date in the years"),
    ],
)
def test_a_damaged_pipeline_state_is_refused_naming_the_node_and_field(
    examples: tuple[Path, list[dict[str, Any]]], at: tuple[Any, ...], key: Any, value: Any, message: str
) -> None:
    directory, states = examples
    state = json.loads(json.dumps(states[0]))
    holder = functools.reduce(lambda item, step: item[step], at, state)
    if value is DELETE:
        del holder[key]
    else:
        holder[key] = value
    path = directory / "refused.json"
    path.write_text(json.dumps(state))
    code, out, err = inspect(str(path))
    assert (code, out) == (2, "")
    assert re.fullmatch(f"error: {re.escape(str(path))}: .*{message}.*\n", err), err


def test_a_damaged_worker_pipeline_state_is_refused_naming_rank_and_worker(
    examples: tuple[Path, list[dict[str, Any]]],
) -> None:
    directory, states = examples
    state = json.loads(json.dumps(states[-1]))
    holder = functools.reduce(
        lambda item, step: item[step], ENCODED[:-1], state["loader"]["_snapshot"]["_worker_snapshots"]["worker_1"]
    )
    pipeline = json.loads(holder["pipeline"])
    cursor = pipeline
    while "position" not in cursor:
        cursor = cursor["upstream"]
    cursor["position"] = "5"
    holder["pipeline"] = json.dumps(pipeline)
    path = directory / "refused.json"
    path.write_text(json.dumps(state))
    code, out, err = inspect(str(path))
    assert (code, out) == (2, "")
    assert err.startswith(f"error: {path} rank 0/1, worker 1/2: Batch > ") and err.count("\n") == 1
    assert "state entry 'position' is '5', expected an int in" in err
