"""A Loader worker's batch travels in one shared-memory segment (resumable.torch.segment)."""

from __future__ import annotations

import collections
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import resumable as rs
from resumable.pack import collate_rows
from resumable.torch import Loader, PipelineDataset
from resumable.torch.segment import ALIGNMENT, in_one_segment

Pair = collections.namedtuple("Pair", "first second")


def storage_of(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def odd_batch() -> dict[str, Any]:
    base = torch.arange(10)
    return {
        "ids": torch.arange(6, dtype=torch.int64).view(2, 3),
        "nested": [torch.ones(3, dtype=torch.bool), (torch.full((5,), 1.5, dtype=torch.float16), "text")],
        "pair": Pair(torch.tensor([2.5], dtype=torch.float64), 3),
        "byte": torch.tensor([7], dtype=torch.uint8),
        "alias_head": base[:5],
        "alias_tail": base[5:],
        "empty": torch.zeros(0),
        "grad": torch.ones(2, requires_grad=True),
        "strided": torch.arange(12).view(3, 4).t(),
    }


def test_the_tensors_become_views_of_one_shared_storage_with_the_same_values() -> None:
    batch = odd_batch()
    moved = in_one_segment(batch)
    views = [moved["ids"], moved["nested"][0], moved["nested"][1][0], moved["pair"].first, moved["byte"]]
    originals = [batch["ids"], batch["nested"][0], batch["nested"][1][0], batch["pair"].first, batch["byte"]]
    assert len({storage_of(view) for view in views}) == 1
    assert all(view.is_shared() for view in views)
    for view, original in zip(views, originals):
        assert view.dtype == original.dtype and view.shape == original.shape and torch.equal(view, original)
        assert (view.storage_offset() * view.element_size()) % ALIGNMENT == 0
    assert type(moved["pair"]) is Pair and moved["pair"].second == 3 and moved["nested"][1][1] == "text"
    assert type(moved["nested"]) is list and type(moved["nested"][1]) is tuple


def test_tensors_it_cannot_or_should_not_move_go_as_they_are() -> None:
    batch = odd_batch()
    moved = in_one_segment(batch)
    for name in ("alias_head", "alias_tail", "empty", "grad", "strided"):
        assert moved[name] is batch[name], name
    assert storage_of(moved["alias_head"]) == storage_of(moved["alias_tail"])  # still one storage


def test_the_batch_given_is_left_as_it_was() -> None:
    batch = odd_batch()
    before = {name: value for name, value in batch.items()}
    in_one_segment(batch)
    assert all(batch[name] is value for name, value in before.items())
    assert not batch["ids"].is_shared()


@pytest.mark.parametrize(
    "batch",
    [torch.arange(3), {"only": torch.arange(3), "label": "x"}, [1, 2], None, "text"],
    ids=["tensor", "one-tensor", "list", "none", "str"],
)
def test_a_batch_with_fewer_than_two_tensors_to_move_is_returned_as_it_is(batch: Any) -> None:
    assert in_one_segment(batch) is batch


def test_a_tensor_twice_in_a_batch_is_moved_once() -> None:
    tensor, other = torch.arange(4), torch.arange(3)
    moved = in_one_segment([tensor, tensor, other])
    assert moved[0] is moved[1] and storage_of(moved[0]) == storage_of(moved[2])


def packed_pipeline() -> rs.Node:
    documents = [{"input_ids": np.arange(1 + index % 9)} for index in range(60)]
    return rs.from_list(documents).shuffle(seed=3).shard().pack(16).batch(2, collate_fn=collate_rows)


@pytest.mark.parametrize("persistent", [False, True])
def test_a_loader_s_worker_batches_arrive_in_one_segment_equal_to_a_plain_data_loader_s(persistent: bool) -> None:
    dataset = PipelineDataset(packed_pipeline)
    plain = DataLoader(dataset, batch_size=None, num_workers=2)
    expected = []
    for epoch in range(2):  # two epochs, as the Loader runs them
        dataset.set_epoch(epoch)
        expected += list(plain)
    with Loader(packed_pipeline, num_workers=2, persistent_workers=persistent) as loader:
        received = [batch for _ in range(2) for batch in loader]
    assert len(received) == len(expected) > 0
    for got, want in zip(received, expected):
        assert got.keys() == want.keys()
        assert len({storage_of(tensor) for tensor in want.values()}) == len(want)  # torch: one each
        for name in got:
            assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name
        assert len({storage_of(tensor) for tensor in got.values()}) == 1
