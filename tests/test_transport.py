"""How a Loader worker's batch travels to the main process (resumable.torch.transport): small
batches inline, larger ones in one shared-memory segment, the same tensors either way."""

from __future__ import annotations

import collections
import pickle
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import resumable as rs
from resumable.pack import collate_rows
from resumable.torch import Loader, PipelineDataset
from resumable.torch.transport import ALIGNMENT, INLINE_BYTES, for_transport

Pair = collections.namedtuple("Pair", "first second")


def storage_of(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def shipped(batch: Any) -> Any:
    """``batch`` as the main process gets it: through the worker's transport and a pickle."""
    return pickle.loads(ForkingPickler.dumps(for_transport(batch)))


def odd_batch(rows: int = 2) -> dict[str, Any]:
    base = torch.arange(10)
    return {
        "ids": torch.arange(3 * rows, dtype=torch.int64).view(rows, 3),
        "nested": [torch.ones(3, dtype=torch.bool), (torch.full((5,), 1.5, dtype=torch.bfloat16), "text")],
        "pair": Pair(torch.tensor([2.5], dtype=torch.float64), 3),
        "scalar": torch.tensor(7, dtype=torch.uint8),
        "alias_head": base[:5],
        "alias_tail": base[5:],
        "empty": torch.zeros(0),
        "grad": torch.ones(2, requires_grad=True),
        "strided": torch.arange(12).view(3, 4).t(),
    }


MOVED = ("ids", "nested.0", "nested.1.0", "pair.first", "scalar")
KEPT = ("alias_head", "alias_tail", "empty", "grad", "strided")


def at(batch: dict[str, Any], path: str) -> Any:
    value: Any = batch
    for part in path.split("."):
        value = getattr(value, part) if isinstance(value, Pair) else value[int(part) if part.isdigit() else part]
    return value


@pytest.mark.parametrize("rows", [2, INLINE_BYTES // 24 + 1], ids=["inline", "segment"])
def test_every_tensor_arrives_equal_whichever_way_it_travels(rows: int) -> None:
    batch = odd_batch(rows)
    arrived = shipped(batch)
    for path in MOVED + KEPT:
        got, sent = at(arrived, path), at(batch, path)
        assert type(got) is torch.Tensor and got.dtype == sent.dtype and got.shape == sent.shape, path
        assert torch.equal(got, sent), path
    assert type(arrived["pair"]) is Pair and arrived["pair"].second == 3 and arrived["nested"][1][1] == "text"
    assert storage_of(arrived["alias_head"]) == storage_of(arrived["alias_tail"])  # still one storage
    arrived["ids"] += 1  # writable, and not the sender's
    assert torch.equal(batch["ids"], torch.arange(3 * rows).view(rows, 3))


def test_a_small_batch_travels_inline_and_a_large_one_in_one_segment() -> None:
    batch = odd_batch()
    small = for_transport(batch)
    assert all(type(at(small, path)).__name__ == "_Inline" for path in MOVED)
    assert all(at(small, path) is at(batch, path) for path in KEPT)
    large = for_transport(odd_batch(INLINE_BYTES // 24 + 1))
    views = [at(large, path) for path in MOVED]
    assert len({storage_of(view) for view in views}) == 1 and all(view.is_shared() for view in views)
    assert all((view.storage_offset() * view.element_size()) % ALIGNMENT == 0 for view in views)


def test_the_batch_given_is_left_as_it_was() -> None:
    for rows in (2, INLINE_BYTES // 24 + 1):
        batch = odd_batch(rows)
        before = dict(batch)
        for_transport(batch)
        assert all(batch[name] is value for name, value in before.items())
        assert not batch["ids"].is_shared()


def test_a_tensor_twice_in_a_batch_arrives_as_one_tensor_twice() -> None:
    for size in (4, INLINE_BYTES):  # inline, in a segment
        tensor = torch.arange(size)
        arrived = shipped([tensor, tensor, torch.arange(3)])
        assert arrived[0] is arrived[1] and torch.equal(arrived[0], tensor)


@pytest.mark.parametrize("batch", [[1, 2], None, "text", {"label": "x"}], ids=["list", "none", "str", "dict"])
def test_a_batch_without_tensors_is_returned_as_it_is(batch: Any) -> None:
    assert for_transport(batch) is batch


def test_a_large_batch_s_tensors_already_in_shared_memory_keep_their_segments() -> None:
    shared = torch.arange(INLINE_BYTES // 8 + 1).share_memory_()
    batch = {"shared": shared, "a": torch.arange(3), "b": torch.arange(4)}
    moved = for_transport(batch)
    assert moved["shared"] is shared
    assert storage_of(moved["a"]) == storage_of(moved["b"]) != storage_of(shared)


def packed_pipeline(seq_len: int) -> rs.Node:
    documents = [{"input_ids": np.arange(1 + index % (seq_len // 2))} for index in range(60)]
    return rs.from_list(documents).shuffle(seed=3).shard().pack(seq_len).batch(2, collate_fn=collate_rows)


@pytest.mark.parametrize("seq_len", [16, 8192], ids=["inline", "segment"])
@pytest.mark.parametrize("persistent", [False, True])
def test_a_loader_s_worker_batches_equal_a_plain_data_loader_s(seq_len: int, persistent: bool) -> None:
    build = lambda: packed_pipeline(seq_len)  # noqa: E731 - forked workers inherit it
    dataset = PipelineDataset(build)
    plain = DataLoader(dataset, batch_size=None, num_workers=2)
    expected = []
    for epoch in range(2):  # two epochs, as the Loader runs them
        dataset.set_epoch(epoch)
        expected += list(plain)
    with Loader(build, num_workers=2, persistent_workers=persistent) as loader:
        received = [batch for _ in range(2) for batch in loader]
    assert len(received) == len(expected) > 0
    for got, want in zip(received, expected):
        assert got.keys() == want.keys()
        for name in got:
            assert type(got[name]) is torch.Tensor and got[name].dtype == want[name].dtype, name
            assert torch.equal(got[name], want[name]), name
        storages = {storage_of(tensor) for tensor in got.values()}
        assert len(storages) == (len(got) if seq_len == 16 else 1)


class Holder:
    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


@pytest.mark.parametrize(
    "make",
    [
        lambda: {"a": torch.arange(3), "b": torch.arange(4), "held": Holder(torch.arange(2))},
        lambda: {"a": torch.arange(3), "b": torch.arange(4), "set": {1, 2}},
        lambda: {
            "a": torch.arange(3),
            "b": torch.arange(4),
            "objects": np.array([torch.arange(2), None], dtype=object),
        },
        lambda: (lambda shared: {"a": torch.arange(3), "x": shared, "y": shared})([torch.arange(4)]),
    ],
    ids=["object", "set", "object-array", "container-twice"],
)
def test_a_batch_whose_every_tensor_cannot_be_seen_goes_whole_as_torch_sends_it(make: Any) -> None:
    batch = make()
    assert for_transport(batch) is batch


def test_a_batch_that_holds_itself_goes_as_torch_sends_it() -> None:
    batch: dict[str, Any] = {"a": torch.arange(3), "b": torch.arange(4)}
    batch["self"] = batch
    assert for_transport(batch) is batch


def test_a_tensor_sharing_its_storage_with_one_left_to_torch_stays_with_it() -> None:
    base = torch.arange(12).view(3, 4)
    arrived = shipped({"base": base, "view": base.t(), "other": torch.arange(5), "more": torch.arange(6)})
    assert storage_of(arrived["base"]) == storage_of(arrived["view"])
    arrived["base"][0, 1] = -1
    assert arrived["view"][1, 0] == -1


def test_a_conjugated_view_arrives_with_its_values() -> None:
    values = torch.tensor([1 + 2j, 3 - 1j])
    for rows in (1, INLINE_BYTES // 16 + 1):  # inline, in a segment
        batch = {"conj": values.repeat(rows).conj(), "other": torch.arange(3)}
        arrived = shipped(batch)
        assert not arrived["conj"].is_conj() and torch.equal(arrived["conj"], batch["conj"].resolve_conj())
