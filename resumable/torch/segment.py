"""A worker's batch in one shared-memory segment.

torch ships each CPU tensor a DataLoader worker hands over in its own shared-memory segment:
the tensor is copied into a new segment, whose file descriptor the main process then fetches
from the worker over a socket, one round trip per tensor (about 0.25-0.35 ms of CPU time on
each side on a 2-core machine). A packed batch has six tensors (``input_ids``, ``labels``,
``position_ids``, ``document_ids``, ``cu_seqlens``, ``cu_seqlens_count``). ``in_one_segment``
copies a batch's tensors into one segment instead, as views of one storage, so the batch
travels with one descriptor: the same copy torch would make, one round trip instead of six.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

ALIGNMENT = 64
"""Each tensor starts at a multiple of this many bytes in the segment (any dtype's alignment,
and a cache line)."""


def in_one_segment(batch: Any) -> Any:
    """``batch`` with its tensors as views of one new shared-memory storage, where that saves
    a round trip: two or more contiguous dense CPU tensors not already in shared memory, found
    in dicts, lists, tuples and named tuples (other containers, and other tensors, go as torch
    sends them), each with its own storage: tensors that share one keep sharing it, as torch
    sends them. Values, dtypes and shapes are unchanged; ``batch`` itself is left as it was."""
    found: list[torch.Tensor] = []
    _collect(batch, found)
    storages = Counter(tensor.untyped_storage().data_ptr() for tensor in found)
    tensors = [tensor for tensor in found if storages[tensor.untyped_storage().data_ptr()] == 1]
    if len(tensors) < 2:
        return batch
    offsets, end = [], 0
    for tensor in tensors:
        offsets.append(end)
        end += -(-tensor.nbytes // ALIGNMENT) * ALIGNMENT
    # What torch's default_collate allocates its workers' batches with (a segment, no copy).
    storage = torch.UntypedStorage._new_shared(end)  # type: ignore[no-untyped-call]
    views: dict[int, torch.Tensor] = {}
    for tensor, offset in zip(tensors, offsets):
        view = torch.empty(0, dtype=tensor.dtype).set_(
            storage, offset // tensor.element_size(), tensor.shape, tensor.stride()
        )
        views[id(tensor)] = view.copy_(tensor)
    return _rebuilt(batch, views)


def _moves(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` may travel as a view of the batch's segment: a plain dense CPU tensor
    torch would copy into a segment of its own (not one in shared memory already)."""
    return (
        type(tensor) is torch.Tensor
        and tensor.device.type == "cpu"
        and tensor.layout == torch.strided
        and not tensor.requires_grad
        and not tensor.is_quantized
        and not tensor.is_shared()  # type: ignore[no-untyped-call]
        and tensor.is_contiguous()
        and tensor.numel() > 0
    )


def _is_container(value: Any) -> bool:
    kind = type(value)
    return kind is dict or kind is list or kind is tuple or (issubclass(kind, tuple) and hasattr(kind, "_fields"))


def _collect(value: Any, tensors: list[torch.Tensor]) -> None:
    if isinstance(value, torch.Tensor):
        if _moves(value) and all(value is not seen for seen in tensors):
            tensors.append(value)
    elif type(value) is dict:
        for item in value.values():
            _collect(item, tensors)
    elif _is_container(value):
        for item in value:
            _collect(item, tensors)


def _rebuilt(value: Any, views: dict[int, torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return views.get(id(value), value)
    if type(value) is dict:
        return {key: _rebuilt(item, views) for key, item in value.items()}
    if type(value) is list:
        return [_rebuilt(item, views) for item in value]
    if type(value) is tuple:
        return tuple(_rebuilt(item, views) for item in value)
    if _is_container(value):  # a named tuple
        return type(value)(*(_rebuilt(item, views) for item in value))
    return value
