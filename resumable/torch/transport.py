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
non-contiguous or nested ones, ones that require grad, subclasses, and
tensors sharing a storage with another tensor of the batch (they keep sharing it). A batch
holding anything but dicts, lists, tuples, named tuples, tensors, numpy arrays and scalars and
plain Python values (a dataclass, a set), or one container twice (or itself), goes whole as
torch sends it: only then is every tensor it holds, and every alias between them, in view. A
conjugated (or negated) view the transport moves arrives with its values, made plain (torch's
own way drops the bit).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable

import numpy as np
import torch

INLINE_BYTES = 256 << 10
"""Up to this many bytes of tensors a batch travels inline. Measured on a 2-core machine, two
workers, per batch: at 64 kB the main process spends 192 us inline against 574 us with torch's
segment; at 256 kB 371 against 340; at 1 MB 1,242 against 504 (bench/bench_transport.py,
docs/benchmarks.md). The main process, which runs the training step, sets the limit."""

ALIGNMENT = 64
"""In a segment, each tensor starts at a multiple of this many bytes (any dtype's alignment,
and a cache line)."""


def for_transport(batch: Any) -> Any:
    """``batch`` ready for the worker's result queue: its tensors inline or in one segment
    (see the module's docstring). Values, dtypes and shapes are unchanged once unpickled;
    ``batch`` itself is left as it was."""
    found: dict[int, torch.Tensor] = {}
    if not _collect(batch, found, set()):
        return batch
    storage = {key: _storage_of(tensor) for key, tensor in found.items()}
    sharing = Counter(storage.values())
    tensors = [tensor for key, tensor in found.items() if _moves(tensor) and sharing[storage[key]] == 1]
    if not tensors:
        return batch
    if sum(tensor.nbytes for tensor in tensors) <= INLINE_BYTES:
        return _rebuilt(batch, {id(tensor): _Inline(tensor) for tensor in tensors})
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
    """A tensor that pickles as its bytes and unpickles as a tensor again. Its bytes are taken
    here, in the worker's collate step, where an error reaches the main process with the batch
    (an error while pickling, in the queue's thread, would lose the batch)."""

    __slots__ = ("data", "dtype", "shape")

    def __init__(self, tensor: torch.Tensor) -> None:
        # A conjugated or negated view is made plain first (torch's own way loses the bit).
        self.data = tensor.resolve_conj().resolve_neg().reshape(-1).view(torch.uint8).numpy()
        self.dtype = tensor.dtype
        self.shape = tuple(tensor.shape)

    def __reduce__(self) -> tuple[Callable[..., torch.Tensor], tuple[np.ndarray, torch.dtype, tuple[int, ...]]]:
        return _tensor_from_bytes, (self.data, self.dtype, self.shape)


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
        and not tensor.is_nested
        and tensor.is_contiguous()
        and tensor.numel() > 0
    )


def _is_container(value: Any) -> bool:
    kind = type(value)
    return kind is dict or kind is list or kind is tuple or (issubclass(kind, tuple) and hasattr(kind, "_fields"))


_PLAIN = frozenset({str, bytes, int, float, bool, complex, type(None)})


def _collect(value: Any, tensors: dict[int, torch.Tensor], containers: set[int]) -> bool:
    """Gather the tensors of ``value`` by id; False if ``value`` holds something whose tensors
    cannot be seen (an object of another kind) or a container twice (shared, or itself)."""
    if isinstance(value, torch.Tensor):
        tensors[id(value)] = value
        return True
    if type(value) in _PLAIN or isinstance(value, np.generic):
        return True
    if type(value) is np.ndarray:  # an array of objects may hold tensors, out of view
        return not value.dtype.hasobject
    if not (type(value) is dict or _is_container(value)) or id(value) in containers:
        return False
    containers.add(id(value))
    items = value.values() if type(value) is dict else value
    return all(_collect(item, tensors, containers) for item in items)


def _storage_of(tensor: torch.Tensor) -> int:
    """Where a tensor's storage lives (0 for tensors without one, a nested or sparse tensor)."""
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return 0


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
