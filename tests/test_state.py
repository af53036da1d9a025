"""State format and validation: JSON only, versioned, typed errors naming the node path."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

import resumable as rs
from resumable.core.state import STATE_VERSION


def pipeline(seed: int = 1, batch_size: int = 4) -> rs.Node:
    return (
        rs.from_list(list(range(50))).shuffle(seed).map(lambda x: x + 1).filter(lambda x: x % 2 == 0).batch(batch_size)
    )


def advanced(pipe: rs.Node, steps: int = 2) -> dict:
    it = iter(pipe)
    for _ in range(steps):
        next(it)
    return pipe.get_state()


def test_state_is_plain_json_with_kind_and_version() -> None:
    state = advanced(pipeline())
    assert json.loads(json.dumps(state)) == state
    node = state
    kinds = []
    while node is not None:
        assert node["version"] == STATE_VERSION
        kinds.append(node["kind"])
        node = node.get("upstream")
    assert kinds == ["Batch", "Filter", "IndexedMap", "Shuffle", "FromList"]


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda s: s.update(kind="Map"), r"^Batch: state was saved by a 'Map' node"),
        (lambda s: s.update(version=99), r"^Batch: state format version 99"),
        (lambda s: s.update(batch_size=3), r"^Batch: state was saved with batch_size=3"),
        (
            lambda s: s["upstream"]["upstream"]["upstream"].update(seed=2),
            r"^Batch > Filter > IndexedMap > Shuffle: .*seed=2",
        ),
        (lambda s: s["upstream"]["upstream"].update(position=10**6), r"IndexedMap: state entry 'position' is 1000000"),
        (
            lambda s: s["upstream"]["upstream"].update(length=7),
            r"IndexedMap: state was saved over 7 records, this pipeline has 50",
        ),
        (lambda s: s["upstream"]["upstream"].update(position=-1), r"'position' is -1"),
        (lambda s: s["upstream"]["upstream"].update(epoch="0"), r"'epoch' is '0', expected int"),
        (lambda s: s["upstream"]["upstream"].update(epoch=True), r"'epoch' is True, expected int"),
        (lambda s: s["upstream"].pop("dropped"), r"^Batch > Filter: state has no 'dropped' entry"),
        (lambda s: s.pop("upstream"), r"^Batch: state has no 'upstream' entry"),
        (lambda s: s["upstream"]["upstream"]["upstream"]["upstream"].update(length=49), r"FromList: .*length=49"),
        (lambda s: s.update(extra=(1, 2)), r"only JSON types"),
    ],
)
def test_foreign_or_corrupt_state_raises_state_error_naming_the_node(mutate, message: str) -> None:
    state = advanced(pipeline())
    bad = copy.deepcopy(state)
    mutate(bad)
    with pytest.raises(rs.StateError, match=message):
        pipeline().set_state(bad)


def test_state_error_is_a_resumable_error_not_an_assertion() -> None:
    with pytest.raises(rs.ResumableError):
        pipeline().set_state("not a state")  # type: ignore[arg-type]  # deliberately wrong, to test the check


def test_failed_restore_leaves_the_pipeline_untouched() -> None:
    pipe = pipeline()
    before = advanced(pipe, 3)
    bad = copy.deepcopy(advanced(pipeline(), 5))
    bad["upstream"]["upstream"]["upstream"]["seed"] = 99
    with pytest.raises(rs.StateError):
        pipe.set_state(bad)
    assert pipe.get_state() == before
    assert list(pipe) == list(_restored(before))


def _restored(state: dict) -> rs.Node:
    pipe = pipeline()
    pipe.set_state(state)
    return pipe


def test_stateful_protocol_aliases() -> None:
    pipe = pipeline()
    state = advanced(pipe)
    assert pipe.state_dict() == state
    other = pipeline()
    other.load_state_dict(state)
    assert list(other) == list(pipe)


def test_torch_distributed_checkpoint_stateful_protocol() -> None:
    from torch.distributed.checkpoint.stateful import Stateful

    assert isinstance(pipeline(), Stateful)


def test_a_deeply_nested_state_is_a_state_error_not_a_recursion_error() -> None:
    deep: Any = 0
    for _ in range(5000):
        deep = [deep]
    pipe = rs.from_list(list(range(5))).batch(2)
    state = pipe.get_state()
    state["upstream"]["extra"] = deep
    with pytest.raises(rs.StateError, match="nested more than"):
        pipe.set_state(state)
    assert next(pipe) == [0, 1]


def test_a_loader_state_given_to_a_pipeline_says_what_to_call() -> None:
    from resumable.loader_state import FORMAT, FORMAT_NAME

    pipe = rs.from_list(list(range(5))).batch(2)
    with pytest.raises(rs.StateError, match=r"rs.torch.Loader .* loader.load_state_dict"):
        pipe.set_state({FORMAT: FORMAT_NAME, "epoch": 0, "loader": {}})
    with pytest.raises(rs.StateError, match="resumable.elastic.restore"):
        pipe.set_state([pipe.get_state()])  # type: ignore[arg-type]  # deliberately wrong, to test the check
    assert next(pipe) == [0, 1]


def test_node_kinds_are_declared_names_that_subclasses_keep() -> None:
    """A state names its nodes by a declared kind, not the class name: a subclass (or a class
    renamed in a refactoring) keeps loading the states of the class it derives from."""
    from resumable.core.node import NODE_KINDS
    from resumable.ops.batch import Batch

    class LoggingBatch(Batch[Any]):
        pass

    assert LoggingBatch.kind == "Batch" and NODE_KINDS["Batch"] is Batch
    pipe = rs.from_list(list(range(9))).batch(2)
    next(pipe)
    sub = LoggingBatch(rs.from_list(list(range(9))), 2)
    sub.set_state(pipe.get_state())
    assert next(sub) == [2, 3]
    with pytest.raises(TypeError, match="already the name of"):
        type("Impostor", (rs.Node,), {"kind": "Batch"})

    class Custom(rs.Node[int]):
        pass

    assert Custom.kind == "Custom"
