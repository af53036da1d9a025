"""How a Loader worker's batch reaches the main process (resumable.torch.transport), attacked as a
user would: every dtype, 0-d and empty tensors, batches at the inline limit, one byte over and
tens of MB over, hundreds of tensors, deep and odd containers, aliases, tensors that stay with
torch's own transport, tensors already in shared memory, numpy arrays, a failing collate_fn,
other start methods, persistent workers, the file_system sharing strategy, batches mutated and
kept by the main process, resumes, and what a closed Loader leaves behind. Batches are compared
with a plain DataLoader over the same PipelineDataset, or with the values built in this process."""

from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import gc
import glob
import json
import os
from typing import Any, Callable, Iterator

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, default_collate

import resumable as rs
from resumable.torch import Loader, PipelineDataset
from resumable.torch.transport import INLINE_BYTES
from tests.resume import loader_head, loader_rest

# torch warns as it rebuilds the sparse tensor of a batch (kept_by_torch) in the main process.
pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks are implicitly disabled")

Pair = collections.namedtuple("Pair", "left right")


@dataclasses.dataclass
class Holder:
    """A dataclass: a container the transport does not look into."""

    tensor: Any
    label: str


class Box:
    """A plain class holding a tensor."""

    def __init__(self, tensor: Any) -> None:
        self.tensor = tensor


def _dtypes() -> list[torch.dtype]:
    found = [
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.complex64,
        torch.complex128,
    ]
    return found + [getattr(torch, name) for name in ("uint16", "uint32", "uint64") if hasattr(torch, name)]


DTYPES = _dtypes()


def random_tensor(seed: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Random bytes as ``dtype`` (NaNs and all: batches are compared bit for bit); bools 0 or 1."""
    generator = torch.Generator().manual_seed(seed)
    count = int(np.prod(shape, dtype=np.int64))
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    size = torch.empty(0, dtype=dtype).element_size()
    return torch.randint(0, 256, (count * size,), dtype=torch.uint8, generator=generator).view(dtype).reshape(shape)


def storage_of(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)


def same(got: Any, want: Any, where: str = "batch") -> None:
    """``got`` is ``want``'s equal: the same types all the way down, tensors of the same class,
    dtype, shape, requires_grad and bits."""
    assert type(got) is type(want), f"{where}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, torch.Tensor) and want.is_sparse:
        assert got.is_sparse and torch.equal(got.to_dense(), want.to_dense()), where
    elif isinstance(want, torch.Tensor):
        assert (got.dtype, got.shape, got.requires_grad) == (want.dtype, want.shape, want.requires_grad), where
        assert torch.equal(bits(got), bits(want)), where
    elif isinstance(want, np.ndarray):
        assert got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes(), where
    elif isinstance(want, dict):
        assert list(got) == list(want), where
        for key in want:
            same(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for index, (left, right) in enumerate(zip(got, want)):
            same(left, right, f"{where}[{index}]")
    elif isinstance(want, (set, frozenset)):
        assert sorted(bits(item).tolist() for item in got) == sorted(bits(item).tolist() for item in want), where
    elif dataclasses.is_dataclass(want) or isinstance(want, Box):
        same(vars(got), vars(want), where)
    else:
        assert got == want, where


# -- the batches: record i is turned into CASES[i % len(CASES)](i) by the collate_fn -------------


def every_dtype(seed: int, rows: int = 3) -> dict[str, Any]:
    batch: dict[str, Any] = {}
    for index, dtype in enumerate(DTYPES):
        name = str(dtype).removeprefix("torch.")
        batch[name] = random_tensor(seed * 100 + index, (rows, 5), dtype)
        batch[f"{name}_0d"] = random_tensor(seed * 100 + 50 + index, (), dtype)
        batch[f"{name}_odd"] = random_tensor(seed * 100 + 70 + index, (7,), dtype)  # odd byte counts
        batch[f"{name}_empty"] = torch.empty((2, 0, 3), dtype=dtype)
    batch["zero_rows"] = torch.empty((0,), dtype=torch.int64)
    return batch


def every_dtype_large(seed: int) -> dict[str, Any]:
    return every_dtype(seed, rows=INLINE_BYTES // (5 * 4 * 2))  # past the limit whatever the dtype


def exactly_inline(seed: int) -> dict[str, Any]:
    """Tensors of INLINE_BYTES in all, odd sizes among them."""
    batch = {
        "floats": random_tensor(seed, ((INLINE_BYTES - 24 - 5 - 3) // 4,), torch.float32),
        "longs": random_tensor(seed + 1, (3,), torch.int64),
        "bytes": random_tensor(seed + 2, (5,), torch.uint8),
        "signed": random_tensor(seed + 3, (3,), torch.int8),
    }
    assert sum(tensor.nbytes for tensor in batch.values()) == INLINE_BYTES
    return batch


def one_byte_over(seed: int) -> dict[str, Any]:
    batch = exactly_inline(seed)
    batch["extra"] = torch.tensor([seed % 2 == 0])
    return batch


def far_over(seed: int) -> dict[str, Any]:
    return {
        "pixels": random_tensor(seed, (3, 1024, 1024 * 2), torch.float32),  # 24 MiB
        "labels": random_tensor(seed + 1, (3,), torch.int64),
        "mask": random_tensor(seed + 2, (3, 5), torch.bool),
        "note": f"record {seed}",
    }


def hundreds_small(seed: int) -> list[Any]:
    return [random_tensor(seed * 1000 + index, (index % 4,), DTYPES[index % len(DTYPES)]) for index in range(300)]


def hundreds_over(seed: int) -> tuple[Any, ...]:
    return tuple(random_tensor(seed * 1000 + index, (257,), torch.float32) for index in range(400))  # 411 kB


def nested(seed: int, large: bool = False) -> dict[str, Any]:
    deep: Any = random_tensor(seed, (4,), torch.int32)
    for level in range(40):
        tensor = random_tensor(seed * 100 + level, (level % 3 + 1,), DTYPES[level % len(DTYPES)])
        deep = [{"level": level, "t": tensor, "inner": (deep, Pair(tensor.clone(), level))}]
    return {
        "deep": deep,
        "dataclass": Holder(random_tensor(seed + 1, (3,), torch.float64), "h"),
        "box": Box(random_tensor(seed + 2, (2, 2), torch.int16)),
        "set": {random_tensor(seed + 3, (2,), torch.int64)},
        "frozenset": frozenset({random_tensor(seed + 4, (2,), torch.uint8)}),
        "numpy": np.arange(seed, seed + 6, dtype=np.float32).reshape(2, 3),
        "numpy_0d": np.array(seed, dtype=np.int16),
        "pair": Pair(random_tensor(seed + 5, (INLINE_BYTES if large else 2,), torch.uint8), None),
        "scalars": (seed, 1.5, "text", None, b"bytes"),
        "ordered": collections.OrderedDict(t=random_tensor(seed + 6, (3,), torch.int32)),  # a dict subclass
    }


def nested_large(seed: int) -> dict[str, Any]:
    return nested(seed, large=True)


def kept_by_torch(seed: int, large: bool = False) -> dict[str, Any]:
    """Tensors the transport leaves to torch, next to tensors it moves."""
    base = random_tensor(seed, (64, 48), torch.float32)
    leaf = random_tensor(seed + 1, (5,), torch.float32).requires_grad_()
    return {
        "transposed": base.t(),
        "every_other": base[:, ::2],
        "expanded": random_tensor(seed + 2, (1, 4), torch.int64).expand(3, 4),
        "channels_last": random_tensor(seed + 3, (2, 3, 4, 5), torch.float32).contiguous(
            memory_format=torch.channels_last
        ),
        "grad": leaf,
        "parameter": torch.nn.Parameter(random_tensor(seed + 4, (3,), torch.float32)),
        "frozen_parameter": torch.nn.Parameter(random_tensor(seed + 5, (3,), torch.float32), requires_grad=False),
        "sparse": random_tensor(seed + 9, (4, 4), torch.float32).relu().to_sparse(),
        "slice_of_big": random_tensor(seed + 6, (100_000,), torch.int64)[10:20],
        "moved": random_tensor(seed + 7, (INLINE_BYTES if large else 3,), torch.uint8),
        "moved_too": random_tensor(seed + 8, (4,), torch.int32),
    }


def kept_by_torch_large(seed: int) -> dict[str, Any]:
    return kept_by_torch(seed, large=True)


def bare_small(seed: int) -> torch.Tensor:
    return random_tensor(seed, (2, 3), torch.bfloat16)


def bare_large(seed: int) -> torch.Tensor:
    return random_tensor(seed, (INLINE_BYTES + 1,), torch.uint8)


def no_tensors(seed: int) -> Any:
    return {"seed": seed, "numpy": np.arange(3) + seed, "text": ["a", "b"]}


CASES: list[Callable[[int], Any]] = [
    every_dtype,
    every_dtype_large,
    exactly_inline,
    one_byte_over,
    far_over,
    hundreds_small,
    hundreds_over,
    nested,
    nested_large,
    kept_by_torch,
    kept_by_torch_large,
    bare_small,
    bare_large,
    no_tensors,
]


def made(record: int) -> Any:
    """The batch of ``record``, as the collate_fn builds it in a worker (module level: workers
    started by spawn or a fork server unpickle it)."""
    return CASES[record % len(CASES)](record)


def listed(records: tuple[int, ...], shuffle: bool = False) -> rs.Node[Any]:
    """A pipeline of these record numbers, shuffled anew each epoch or in order, split between
    workers (module level: a ``functools.partial`` of it pickles into spawned workers)."""
    source: rs.Node[Any] = rs.from_list(list(records))
    return (source.shuffle(seed=5) if shuffle else source).shard()


def pipeline_of(records: Any, shuffle: bool = False) -> Callable[[], rs.Node[Any]]:
    return functools.partial(listed, tuple(records), shuffle)


def plain_passes(
    build: Callable[[], rs.Node[Any]], epochs: int, collate_fn: Callable[[Any], Any] | None = made, workers: int = 2
) -> list[list[Any]]:
    """What a plain DataLoader over the same PipelineDataset yields, epoch by epoch."""
    dataset = PipelineDataset(build)
    loader = DataLoader(dataset, batch_size=None, num_workers=workers, collate_fn=collate_fn)
    passes = []
    for epoch in range(epochs):
        dataset.set_epoch(epoch)
        passes.append(list(loader))
    return passes


def torch_shm(pids: set[int]) -> set[str]:
    """torch's segment files made by these processes (``torch_<pid>_...``): other tests may run
    beside this one in other processes."""
    return {path for path in glob.glob("/dev/shm/torch_*") if int(os.path.basename(path).split("_")[1]) in pids}


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def settled(check: Callable[[], bool]) -> bool:
    """``check()`` once garbage is collected (a few tries: freeing a segment needs no time, but
    the collector may run finalizers in any order)."""
    for _ in range(5):
        gc.collect()
        if check():
            return True
    return False


# -- every kind of batch ------------------------------------------------------------------------


def test_every_kind_of_batch_arrives_as_a_plain_data_loader_s_and_as_built() -> None:
    build = pipeline_of(range(len(CASES)))
    expected = plain_passes(build, 2)
    with Loader(build, num_workers=2, collate_fn=made) as loader:
        received = [list(loader) for _ in range(2)]
    assert [len(batches) for batches in received] == [len(batches) for batches in expected] == [len(CASES)] * 2
    for epoch in range(2):
        for record, (got, want) in enumerate(zip(received[epoch], expected[epoch])):
            same(got, want, f"epoch {epoch} record {record} ({CASES[record % len(CASES)].__name__})")
            same(got, made(record), f"record {record} as built")


def test_the_limit_is_inclusive_and_a_byte_over_goes_in_one_segment() -> None:
    """At INLINE_BYTES the batch travels inline (a storage per tensor, none shared), one byte over
    in one shared segment: the values are the same either way."""
    build = pipeline_of([2, 3, 16, 17])  # exactly_inline, one_byte_over
    with Loader(build, num_workers=1, collate_fn=made) as loader:
        received = list(loader)
    for record, got in zip([2, 3, 16, 17], received):
        same(got, made(record))
        storages = {storage_of(tensor) for tensor in got.values()}
        if record in (2, 16):
            assert len(storages) == len(got) and not any(tensor.is_shared() for tensor in got.values())
        else:
            assert len(storages) == 1 and all(tensor.is_shared() for tensor in got.values())
            assert sum(tensor.nbytes for tensor in got.values()) == INLINE_BYTES + 1


# -- aliases ------------------------------------------------------------------------------------


def aliases(record: int) -> dict[str, Any]:
    size = 4 if record % 2 == 0 else INLINE_BYTES
    base = torch.arange(2 * size, dtype=torch.int64)
    once = torch.full((size,), record)
    return {"head": base[:size], "tail": base[size:], "twice": [once, (once, Pair(once, 1))], "alone": base + 1}


def test_views_of_one_base_keep_sharing_it_and_a_tensor_twice_arrives_as_one() -> None:
    build = pipeline_of(list(range(4)))
    (expected,) = plain_passes(build, 1, aliases)
    with Loader(build, num_workers=2, collate_fn=aliases) as loader:
        received = list(loader)
    for got, want in zip(received, expected):
        same(got, want)
        for batch in (got, want):
            assert storage_of(batch["head"]) == storage_of(batch["tail"])
            once = batch["twice"][0]
            assert batch["twice"][1][0] is once and batch["twice"][1][1].left is once
        whole = torch.empty(0, dtype=torch.int64).set_(got["head"].untyped_storage())
        whole[got["tail"].storage_offset()] = -7  # written through the storage: the tail sees it
        assert got["tail"][0].item() == -7


def strided_alias(record: int) -> dict[str, Any]:
    size = 4 if record % 2 == 0 else INLINE_BYTES
    base = torch.arange(2 * size, dtype=torch.int64).view(2, size)
    return {"base": base, "view": base.t(), "other": torch.arange(size)}


def held_alias(record: int) -> dict[str, Any]:
    size = 4 if record % 2 == 0 else INLINE_BYTES
    tensor = torch.arange(size, dtype=torch.int64)
    return {"tensor": tensor, "held": Holder(tensor, "same tensor"), "other": torch.arange(size)}


@pytest.mark.parametrize("collate_fn", [strided_alias, held_alias], ids=["strided-view", "in-a-dataclass"])
def test_a_tensor_shares_its_storage_with_a_view_the_transport_leaves_to_torch(collate_fn: Any) -> None:
    build = pipeline_of(list(range(2)))  # one inline batch, one past the limit
    (expected,) = plain_passes(build, 1, collate_fn, workers=1)
    with Loader(build, num_workers=1, collate_fn=collate_fn) as loader:
        received = list(loader)
    assert len(received) == len(expected) == 2
    for got, want in zip(received, expected):
        same(got, want)
        aliases_of = lambda batch: batch["view"] if "view" in batch else batch["held"].tensor  # noqa: E731
        assert storage_of(aliases_of(want)) == storage_of(next(iter(want.values())))  # a DataLoader's: one
        first = next(iter(got.values()))
        first.view(-1)[0] = -1  # written through one, seen through the other, as in-process
        assert aliases_of(got).reshape(-1)[0].item() == -1


def unviewable(record: int) -> dict[str, Any]:
    """Tensors that are contiguous, of the CPU and strided, but not plain memory: a lazily
    conjugated complex tensor (records 0, 1) and a nested tensor (2, 3); even records small,
    odd ones with a tensor past the inline limit beside."""
    values = torch.complex(torch.arange(3, dtype=torch.float32), torch.ones(3))
    odd = values.conj() if record < 2 else torch.nested.nested_tensor([torch.arange(3.0), torch.arange(5.0)])
    return {"odd": odd, "other": torch.arange(4 if record % 2 == 0 else INLINE_BYTES)}


def unbound(tensor: torch.Tensor) -> list[list[Any]]:
    """A tensor's values, resolved: a nested tensor's as its rows, a conjugate view's conjugated."""
    if tensor.is_nested:
        return [row.tolist() for row in tensor.unbind()]
    return [tensor.resolve_conj().tolist()]


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
@pytest.mark.parametrize(
    "record",
    [
        pytest.param(0, id="conjugate-inline"),
        pytest.param(1, id="conjugate-segment"),
        pytest.param(2, id="nested-inline"),
        pytest.param(3, id="nested-segment"),
    ],
)
def test_a_conjugate_view_or_a_nested_tensor_arrives_with_its_values(record: int) -> None:
    """One record per Loader: a batch the worker fails to send is lost without a hang. The values
    built in this process are the reference (a plain DataLoader drops the conjugate bit: torch's
    transport; it keeps a nested tensor)."""
    build = pipeline_of([record])
    if record >= 2:
        ((plain,),) = plain_passes(build, 1, unviewable, workers=1)
        assert unbound(plain["odd"]) == unbound(unviewable(record)["odd"])
    with Loader(build, num_workers=1, collate_fn=unviewable) as loader:
        received = list(loader)
    assert len(received) == 1, "the batch was lost"
    want = unviewable(record)
    assert unbound(received[0]["odd"]) == unbound(want["odd"]) and torch.equal(received[0]["other"], want["other"])


def itself(record: int) -> dict[str, Any]:
    batch: dict[str, Any] = {"ids": torch.arange(4) + record}
    batch["self"] = batch
    return batch


def test_a_batch_that_holds_itself_arrives() -> None:
    build = pipeline_of([0])
    ((want,),) = plain_passes(build, 1, itself, workers=1)
    assert want["self"] is want and torch.equal(want["ids"], torch.arange(4))  # pickle keeps the cycle
    with Loader(build, num_workers=1, collate_fn=itself) as loader:
        (got,) = list(loader)
    assert got["self"] is got and torch.equal(got["ids"], torch.arange(4))


def one_list_twice(record: int) -> dict[str, Any]:
    shared = [torch.arange(3) + record, "label"]
    return {"a": shared, "b": shared}


def test_a_container_held_twice_arrives_as_one() -> None:
    build = pipeline_of([0])
    ((want,),) = plain_passes(build, 1, one_list_twice, workers=1)
    assert want["a"] is want["b"]
    with Loader(build, num_workers=1, collate_fn=one_list_twice) as loader:
        (got,) = list(loader)
    same(got, want)
    assert got["a"] is got["b"]


# -- collate functions of the user's -----------------------------------------------------------


def refuses_thirds(record: int) -> Any:
    if record % 3 == 1:
        raise ValueError(f"record {record} refused")
    return made(record)


def is_error(outcome: Any) -> bool:
    return type(outcome) is tuple and len(outcome) == 2 and outcome[0] is ValueError


def outcomes(iterator: Iterator[Any], count: int) -> list[Any]:
    """The next ``count`` batches, each exception raised in their place as (type, message)."""
    found: list[Any] = []
    for _ in range(count):
        try:
            found.append(next(iterator))
        except StopIteration:
            break
        except ValueError as error:
            found.append((type(error), str(error)))
    return found


def test_a_collate_fn_that_raises_on_some_batches_raises_there_as_documented() -> None:
    """Each refused batch raises its ValueError, with the worker's traceback in its message, at
    its place; iterating on gives the next batches, as with a plain DataLoader; a state taken
    right after an error continues past it."""
    build = pipeline_of([record for record in range(12) if CASES[record % len(CASES)] is not far_over])
    dataset = PipelineDataset(build)
    expected = outcomes(iter(DataLoader(dataset, batch_size=None, num_workers=2, collate_fn=refuses_thirds)), 20)
    with Loader(build, num_workers=2, collate_fn=refuses_thirds) as loader:
        iterator = iter(loader)
        head = outcomes(iterator, 2)  # record 0, then record 1's error
        state = json.loads(json.dumps(loader.state_dict()))
        received = head + outcomes(iterator, 20)
    with Loader(build, num_workers=2, collate_fn=refuses_thirds) as resumed:
        resumed.load_state_dict(state)
        rest = outcomes(iter(resumed), 20)
    assert len(received) == len(expected) == 11
    errors = 0
    for got, want in zip(received, expected):
        if is_error(want):
            errors += 1
            assert is_error(got) and "Caught ValueError in DataLoader worker process" in got[1]
            assert want[1].split("\n")[-2:] == got[1].split("\n")[-2:]  # "ValueError: record n refused"
        else:
            same(got, want)
    assert errors == 3 and is_error(received[1])  # records 1, 7 and 10
    assert len(rest) == len(received) - 2
    for got, want in zip(rest, received[2:]):
        if is_error(want):
            assert is_error(got) and want[1].split("\n")[-2:] == got[1].split("\n")[-2:]
        else:
            same(got, want)


def stacked(record: int) -> dict[str, Any]:
    """torch's default_collate over rows: in a worker it stacks them into shared memory."""
    width = 8 if record % 2 == 0 else INLINE_BYTES // 8
    rows = [
        {"ids": random_tensor(record * 10 + row, (width,), torch.int64), "flag": torch.tensor(row % 2 == 0)}
        for row in range(3)
    ]
    return {"stacked": default_collate(rows), "extra": random_tensor(record, (5,), torch.float32)}


def test_tensors_torch_s_default_collate_put_in_shared_memory_arrive_equal() -> None:
    build = pipeline_of(range(6))
    (expected,) = plain_passes(build, 1, stacked)
    with Loader(build, num_workers=2, collate_fn=stacked) as loader:
        received = list(loader)
    assert len(received) == len(expected) == 6
    for record, (got, want) in enumerate(zip(received, expected)):
        same(got, want)
        same(got, stacked(record))  # in this process default_collate stacks into plain memory
        got["stacked"]["ids"] += 1  # writable, as a DataLoader's are
    for record, got in enumerate(received):
        assert torch.equal(got["stacked"]["ids"], stacked(record)["stacked"]["ids"] + 1)


NUMPY_DTYPES = ["bool", "uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64"]
NUMPY_DTYPES += ["complex64", "complex128"] + [name for name in ("uint16", "uint32", "uint64") if hasattr(torch, name)]


def numpy_record(record: int) -> dict[str, Any]:
    generator = np.random.default_rng(record)
    length = 3 if record % 2 == 0 else INLINE_BYTES // 8
    fields: dict[str, Any] = {"record": record, "text": f"r{record}"}
    for name in NUMPY_DTYPES:
        raw = generator.integers(0, 2 if name == "bool" else 256, size=length * np.dtype(name).itemsize, dtype=np.uint8)
        fields[name] = raw.astype(bool) if name == "bool" else raw.view(name)
    fields["scalar"] = np.float32(record)
    fields["every_other"] = np.arange(10)[::2]
    fields["list"] = [np.arange(3) + record, (np.ones(2, dtype=np.int16), "x")]
    return fields


def test_numpy_records_through_the_default_conversion_arrive_as_a_plain_data_loader_s() -> None:
    """collate_fn=None: torch's default_convert turns the pipeline's numpy arrays into tensors
    that share the arrays' memory, then they travel."""
    build = lambda: rs.from_list([numpy_record(record) for record in range(4)]).shard()  # noqa: E731
    (expected,) = plain_passes(build, 1, collate_fn=None)
    with Loader(build, num_workers=2) as loader:
        received = list(loader)
    assert len(received) == len(expected) == 4
    for record, (got, want) in enumerate(zip(received, expected)):
        same(got, want)
        assert type(got["uint8"]) is torch.Tensor and got["record"] == record


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_workers_started_by_spawn_or_a_fork_server_hand_over_the_same_batches(context: str) -> None:
    records = (0, 1, 3, 6, 7, 10, 12)  # every dtype, past the limit, a byte over, 400 views, deep, kept, bare
    with Loader(pipeline_of(records), num_workers=1, collate_fn=made, multiprocessing_context=context) as loader:
        received = list(loader)
    assert len(received) == len(records)
    for record, got in zip(records, received):
        same(got, made(record), f"record {record}")


def as_record(record: int) -> int:
    return record


def test_persistent_workers_hand_over_three_epochs_as_a_plain_data_loader_does() -> None:
    build = pipeline_of(range(len(CASES)), shuffle=True)
    orders = [[int(record) for record in epoch] for epoch in plain_passes(build, 3, as_record)]
    assert len({tuple(order) for order in orders}) == 3  # each epoch its own order
    expected = plain_passes(build, 3)
    with Loader(build, num_workers=2, persistent_workers=True, collate_fn=made) as loader:
        received = [list(loader) for _ in range(3)]
    for epoch in range(3):
        assert len(received[epoch]) == len(expected[epoch]) == len(CASES)
        for record, got, want in zip(orders[epoch], received[epoch], expected[epoch]):
            same(got, want, f"epoch {epoch} record {record}")
            same(got, made(record), f"epoch {epoch} record {record} as built")


# -- memory: sharing strategies, leaks, batches mutated and kept ---------------------------------


@pytest.fixture
def sharing_strategy(request: pytest.FixtureRequest) -> Iterator[str]:
    old = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy(request.param)
    try:
        yield request.param
    finally:
        torch.multiprocessing.set_sharing_strategy(old)


@pytest.mark.parametrize("sharing_strategy", ["file_descriptor", "file_system"], indirect=True)
def test_a_closed_loader_leaves_no_segment_and_no_descriptor_behind(sharing_strategy: str) -> None:
    records = (1, 3, 6, 10, 12, 0, 2, 5)  # segments, a batch left to torch, inline batches
    build = pipeline_of(records)
    (expected,) = plain_passes(build, 1)  # also opens what the strategy keeps for the process
    gc.collect()
    fds = open_fds()
    with Loader(build, num_workers=2, collate_fn=made) as loader:
        received = list(loader)
        ours = {os.getpid(), *(worker.pid for worker in loader._iterator._workers)}  # torch's, for their pids
        held_fds, held_files = open_fds() - fds, torch_shm(ours)
    assert len(received) == len(expected) == len(records)
    for record, got, want in zip(records, received, expected):
        same(got, want, f"record {record}")
        same(got, made(record), f"record {record} as built")
    if sharing_strategy == "file_system":
        assert held_files  # the batches' segments are files in /dev/shm while they are held
    else:
        assert held_fds > 0 and not held_files  # and descriptors here
    del received, got
    assert settled(lambda: not torch_shm(ours)), sorted(torch_shm(ours))
    assert settled(lambda: open_fds() == fds), (open_fds(), fds)


def tensors_in(batch: Any) -> list[torch.Tensor]:
    """The batch's tensors in dicts, lists and tuples, in order."""
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, dict):
        return [tensor for value in batch.values() for tensor in tensors_in(value)]
    if isinstance(batch, (list, tuple)):
        return [tensor for value in batch for tensor in tensors_in(value)]
    return []


UNALIASED = tuple(
    record
    for record in range(len(CASES))
    if CASES[record % len(CASES)] not in (kept_by_torch, kept_by_torch_large, no_tensors)
)


def test_batches_the_main_process_writes_to_and_keeps_are_its_own() -> None:
    """Writing into half of a batch's tensors changes neither its other tensors (neighbours in a
    segment) nor any later batch (the next epoch's of the same records); every batch kept to
    the end still holds what it held once written to, while the same workers (persistent) send more."""
    kept = []
    with Loader(pipeline_of(UNALIASED), num_workers=2, persistent_workers=True, collate_fn=made) as loader:
        for epoch in range(2):
            for position, batch in enumerate(loader):
                record = UNALIASED[position]
                built = made(record)
                same(batch, built, f"epoch {epoch} record {record}")
                received, fresh = tensors_in(batch), tensors_in(built)
                assert len(received) == len(fresh) > 0
                for tensor in received[::2]:
                    tensor.detach().fill_(epoch + 1)
                for index, (tensor, want) in enumerate(zip(received, fresh)):
                    written = torch.full_like(want, epoch + 1)
                    assert torch.equal(bits(tensor), bits(want if index % 2 else written)), f"{record}: {index}"
                kept.append((batch, copy.deepcopy(batch)))
                gc.collect()  # whatever the main process frees may be reused by the next batches
    assert len(kept) == 2 * len(UNALIASED)
    for index, (batch, snapshot) in enumerate(kept):
        same(batch, snapshot, f"kept batch {index}")


RESUMED = tuple(record for record in range(len(CASES) * 2) if CASES[record % len(CASES)] is not far_over)


def test_a_loader_resumed_at_several_steps_hands_over_the_uninterrupted_batches() -> None:
    build = pipeline_of(RESUMED, shuffle=True)
    count = len(RESUMED)
    with Loader(build, num_workers=2, collate_fn=made) as loader:
        expected = [batch for _ in range(2) for batch in loader]
    assert len(expected) == 2 * count
    for stop in (1, 7, count, count + 3):
        with Loader(build, num_workers=2, collate_fn=made) as loader:
            head = loader_head(loader, stop, count, lambda batch: batch)
            state = json.loads(json.dumps(loader.state_dict()))
        with Loader(build, num_workers=2, collate_fn=made) as resumed:
            resumed.load_state_dict(state)
            rest = loader_rest(resumed, stop, count, lambda batch: batch)
        assert len(head) + len(rest) == len(expected), stop
        for index, (got, want) in enumerate(zip(head + rest, expected)):
            same(got, want, f"stop {stop} batch {index}")
