"""How a Loader worker's batch travels to the main process.

torch ships each CPU tensor a DataLoader worker hands over in a shared-memory segment of its
own: the tensor is copied into a new segment, whose file descriptor the main process then
fetches from the worker over a socket. That round trip costs about 0.3-0.5 ms of CPU time on
each side (2-core machine) whatever the tensor's size, while token batches are small: 16 kB
for 8 x 512 int32 tokens, 0.5 MB in six tensors for a packed batch of 8 x 2048 (``input_ids``,
``labels``, ``position_ids``, ``document_ids``, ``cu_seqlens``, ``cu_seqlens_count``).
``for_transport`` sends a batch's tensors the cheaper way:

- inline, when they hold at most ``INLINE_BYTES`` in all: pickled as bytes with the rest of the
  batch through the worker's result pipe, and tensors again as soon as the main process
  unpickles them (before a pin-memory thread sees them);
- else in one segment: copied into one shared storage (the copy torch makes anyway), as views
  of it, so the batch travels with one descriptor instead of one per tensor.

Tensors this does not apply to go as torch sends them: tensors of other devices or layouts,
non-contiguous ones, ones that require grad, subclasses, and tensors sharing a storage with
another (they keep sharing it), as well as tensors in containers other than dicts, lists,
tuples and named tuples.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable

import numpy as np
import torch

INLINE_BYTES = 256 << 10
"""Up to this many bytes of tensors a batch travels inline. Measured on a 2-core machine, two
workers, per batch: at 64 kB the main process spends 100 us inline against 500 us with a
segment; at 256 kB 233 against 333; at 1 MB 1,450 against 567 (bench/bench_loader.py,
docs/benchmarks.md). The main process, which runs the training step, sets the limit."""

ALIGNMENT = 64
"""In a segment, each tensor starts at a multiple of this many bytes (any dtype's alignment,
and a cache line)."""


def for_transport(batch: Any) -> Any:
    """``batch`` ready for the worker's result queue: its tensors inline or in one segment
    (see the module's docstring). Values, dtypes and shapes are unchanged once unpickled;
    ``batch`` itself is left as it was."""
    found: list[torch.Tensor] = []
    _collect(batch, found)
    storages = Counter(tensor.untyped_storage().data_ptr() for tensor in found)
    tensors = [tensor for tensor in found if storages[tensor.untyped_storage().data_ptr()] == 1]
    if sum(tensor.nbytes for tensor in tensors) <= INLINE_BYTES:
        return _rebuilt(batch, {id(tensor): _Inline(tensor) for tensor in tensors}) if tensors else batch
    return in_one_segment(batch, [tensor for tensor in tensors if not tensor.is_shared()])  # type: ignore[no-untyped-call]


def in_one_segment(batch: Any, tensors: list[torch.Tensor]) -> Any:
    """``batch`` with ``tensors`` (two or more of its own) as views of one new shared storage."""
    if len(tensors) < 2:  # no round trip to save
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


class _Inline:
    """A tensor that pickles as its bytes and unpickles as a tensor again."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def __reduce__(self) -> tuple[Callable[..., torch.Tensor], tuple[np.ndarray, torch.dtype, tuple[int, ...]]]:
        tensor = self.tensor
        return _tensor_from_bytes, (tensor.reshape(-1).view(torch.uint8).numpy(), tensor.dtype, tuple(tensor.shape))


def _tensor_from_bytes(data: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.from_numpy(data).view(dtype).reshape(shape)


def _moves(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` may travel inline or as a view of the batch's segment."""
    return (
        type(tensor) is torch.Tensor
        and tensor.device.type == "cpu"
        and tensor.layout == torch.strided
        and not tensor.requires_grad
        and not tensor.is_quantized
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


def _rebuilt(value: Any, replacements: dict[int, Any]) -> Any:
    if isinstance(value, torch.Tensor):
        return replacements.get(id(value), value)
    if type(value) is dict:
        return {key: _rebuilt(item, replacements) for key, item in value.items()}
    if type(value) is list:
        return [_rebuilt(item, replacements) for item in value]
    if type(value) is tuple:
        return tuple(_rebuilt(item, replacements) for item in value)
    if _is_container(value):  # a named tuple
        return type(value)(*(_rebuilt(item, replacements) for item in value))
    return value
