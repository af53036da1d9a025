"""Adversary: odd record values carried through every node.

Records hold numpy scalars (int64, float32, bool_, float16), 0-d arrays, strided, reversed and
transposed arrays, big-endian dtypes, float16 and bool arrays, structured and object arrays,
empty arrays of shape (0,) and (3, 0), torch tensors (a transposed one too), bytes and
bytearray, tuples beside lists, None, NaN, infinities and -0.0, ints past 2**63 and 2**64,
dicts nested 20 levels deep, and strs holding lone surrogates and NULs. They come from
``rs.from_list``, or from maps over JSONL and Parquet sources, and go through map (inline, in
threads, in processes), prefetch, batch (default and a ``collate_fn``), the in-memory and disk
caches, filter, mix, shuffle and shard, pack, and ``rs.torch.Loader`` with 0 and 2 workers.

For each: the value arrives equal (type, dtype with its byte order, shape, bytes; NaN and -0.0
by their bits) or a typed ``rs`` error / documented refusal comes out, and the central resume
property holds (iterate k, ``get_state``, JSON, a fresh pipeline's ``set_state``, continue ==
the uninterrupted run) at k = 0, the middle, the last item and past the end, with states that
stay JSON.

The bugs it found are mended: the disk cache raised pyarrow's or Python's bare errors (not
``ConfigError``) for big-endian and float128 arrays, float128 scalars and strs with lone
surrogates; the memory cache shared the elements of object arrays and np.void scalars between
epochs, and counted a torch tensor at 32 bytes whatever its size (``max_bytes`` did not bound
it); pack wrapped big-endian uint64 ids past int64 to negative ids. Two are documented limits,
tested as such: JSONL integers past 64 bits become floats (orjson), and big-endian arrays cross
processes in native byte order (numpy's pickling below protocol 5).
"""

from __future__ import annotations

import json
import math
import struct
import sys
import threading
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import resumable as rs
from resumable import Node
from resumable.ops.cache import cache
from tests.resume import take

pytestmark = [pytest.mark.filterwarnings("ignore:This DataLoader will create")]

Build = Callable[[], Node[Any]]

COUNT = 10
"""Records per source: small, so that every cut of every chain stays cheap."""
DEPTH = 20
"""Levels of the nested dict each record holds."""
TIMEOUT = 60  # seconds: a Loader worker that never answers fails the test instead of hanging it


# -- the values --------------------------------------------------------------------------------


def nested(i: int) -> dict[str, Any]:
    value: dict[str, Any] = {"leaf": i}
    for level in range(DEPTH):
        value = {f"level{level}": value}
    return value


def odd_values(i: int, tensors: bool = True) -> dict[str, Any]:
    """Record ``i``'s odd values: a pure function of ``i``, built afresh at every call. Without
    ``tensors``, torch is not imported (a process pool's workers import this module, and torch
    costs each of them over a second)."""
    values = {
        "np_int64": np.int64(i - 3),
        "np_float32": np.float32(i / 3),
        "np_bool": np.bool_(i % 2),
        "np_float16": np.float16(i + 0.5),
        "zero_d": np.array(i, dtype=np.int16),
        "strided": np.arange(3 * i + 3, dtype=np.int32)[::3],
        "reversed": np.arange(i + 2, dtype=np.float64)[::-1],
        "transposed": (np.arange(6, dtype=np.int16).reshape(2, 3) + i).T,
        "big_endian_int": np.arange(i + 1, dtype=">i4"),
        "big_endian_float": np.array([i, -0.0, np.nan], dtype=">f8"),
        "float16": np.array([i, np.inf, np.nan, -0.0], dtype=np.float16),
        "bools": np.array([i % 2 == 0, True, False]),
        "structured": np.array([(i, 1.5, b"a\x00")], dtype=[("a", "<i4"), ("b", ">f8"), ("c", "S2")]),
        "objects": np.array([i, "s", None, (1, [2])], dtype=object),
        "empty": np.zeros((0,), dtype=np.uint16),
        "empty_3_0": np.zeros((3, 0), dtype=np.float32),
        "bytes": bytes([0, 255, i]),
        "bytearray": bytearray(b"\x00b" + bytes([i])),
        "tuple": (i, "t", (None, 1.5)),
        "list": [i, "t", [None, 1.5]],
        "none": None,
        "nan": math.nan,
        "inf": math.inf,
        "neg_inf": -math.inf,
        "neg_zero": -0.0,
        "int_2_63": 2**63 + i,
        "int_2_64": 2**64 + i,
        "int_below_int64": -(2**63) - 1 - i,
        "int_huge": 10**40 + i,
        "deep": nested(i),
        "surrogates": "a\ud800b\udfff" + str(i),
        "nul": "x\x00y" * (i + 1),
    }
    if tensors:
        import torch

        values["tensor"] = torch.arange(i + 1, dtype=torch.int32)
        values["tensor_half_t"] = torch.full((2, 3), i, dtype=torch.float16).t()
    return values


def odd_record(record: Any) -> dict[str, Any]:
    """The map that turns a plain source record ``{"i": i, ...}`` into an odd one."""
    i = int(record["i"])
    return {"i": i, **odd_values(i)}


def odd_record_without_tensors(record: Any) -> dict[str, Any]:
    i = int(record["i"])
    return {"i": i, **odd_values(i, tensors=False)}


def odd_records() -> list[dict[str, Any]]:
    return [odd_record({"i": i}) for i in range(COUNT)]


def keep(record: Any) -> bool:
    return int(record["i"]) % 3 != 1


def as_tuple(batch: list[Any]) -> tuple[Any, ...]:
    """A collate function that returns the batch as a tuple, records unchanged."""
    return tuple(batch)


def as_is(batch: Any) -> Any:
    return batch


def same(a: Any, b: Any) -> bool:
    """Equal as values that a user would tell apart: the same type, dtype (byte order and
    fields too), shape and bytes for arrays and tensors, the same bits for floats (NaN, -0.0),
    the same keys in the same order for dicts."""
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        if a.dtype != b.dtype or a.dtype.str != b.dtype.str or a.shape != b.shape:
            return False
        if a.dtype.kind == "O":
            return all(same(x, y) for x, y in zip(a.flat, b.flat))
        return a.tobytes() == b.tobytes()
    if isinstance(a, np.generic):
        return a.dtype.str == b.dtype.str and a.tobytes() == b.tobytes()
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and a.numpy().tobytes() == b.numpy().tobytes()
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def differences(got: Any, expected: Any, where: str = "") -> list[str]:
    """Where ``got`` and ``expected`` differ, for the assertion messages."""
    if isinstance(expected, dict) and type(got) is dict and list(got) == list(expected):
        return [d for k in expected for d in differences(got[k], expected[k], f"{where}.{k}")]
    if isinstance(expected, (list, tuple)) and type(got) is type(expected) and len(got) == len(expected):
        return [d for n, (x, y) in enumerate(zip(got, expected)) for d in differences(x, y, f"{where}[{n}]")]
    if same(got, expected):
        return []
    return [f"{where}: got {got!r} ({type(got).__name__} {getattr(got, 'dtype', '')}), expected {expected!r}"]


def assert_same(got: Any, expected: Any) -> None:
    found = differences(got, expected)
    assert not found, found[:5]


JSON_TYPES = (dict, list, str, int, float, bool, type(None))


def assert_json(state: Any) -> dict[str, Any]:
    """The state holds JSON types only (no numpy scalars, tuples, NaN) and survives JSON."""
    stack = [state]
    while stack:
        value = stack.pop()
        assert type(value) in JSON_TYPES, f"{type(value).__name__} in a state"
        if isinstance(value, float):
            assert math.isfinite(value)
        if isinstance(value, dict):
            assert all(type(key) is str for key in value)
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    text = json.dumps(state, allow_nan=False)
    loaded: dict[str, Any] = json.loads(text)
    assert loaded == state
    return loaded


def cuts(count: int) -> list[int]:
    """k = 0, the middle, the last item, the epoch's end and past it."""
    return sorted({0, count // 2, max(count - 1, 0), count, count + 1})


def check_resume(build: Build, count: int) -> list[Any]:
    """The central property with ``same`` for equality: returns the uninterrupted run (two
    epochs and two items, ``count`` items an epoch)."""
    total = 2 * count + 2
    whole = build()
    expected = take(whole, total)
    whole.close()
    assert len(expected) == total
    for k in cuts(count):
        pipe = build()
        head = take(pipe, k)
        state = assert_json(pipe.get_state())
        pipe.close()
        resumed = build()
        resumed.set_state(state)
        rest = take(resumed, total - k)
        assert_json(resumed.get_state())
        resumed.close()
        assert len(head) + len(rest) == total, k
        assert_same(head + rest, expected)
    return expected


def native(value: Any) -> Any:
    """``value`` with its arrays in native byte order (what crosses a pickle at protocol 4)."""
    if isinstance(value, np.ndarray) and value.dtype.byteorder == (">" if np.little_endian else "<"):
        return value.astype(value.dtype.newbyteorder("="))
    if isinstance(value, dict):
        return {key: native(item) for key, item in value.items()}
    return value


def check_records(items: list[Any], byte_order: bool = True, tensors: bool = True) -> list[int]:
    """Every record (in batches, lists or tuples of them) equals ``odd_record`` of its number
    (but for its arrays' byte order, unless ``byte_order``); returns the numbers in order."""
    numbers = []
    for item in items:
        for record in item if isinstance(item, (list, tuple)) else [item]:
            expected = odd_record(record) if tensors else odd_record_without_tensors(record)
            assert_same(record, expected if byte_order else native(expected))
            numbers.append(record["i"])
    return numbers


# -- sources -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A JSONL and a Parquet file of ``{"i": i, ...}``; the Parquet one also holds odd column
    values (uint64 past int64, float16, binary with NULs, NaN and None)."""
    root = tmp_path_factory.mktemp("record-values")
    jsonl = root / "plain.jsonl"
    jsonl.write_text("".join(json.dumps({"i": i}) + "\n" for i in range(COUNT)))
    table = pa.table(
        {
            "i": pa.array(range(COUNT), pa.int64()),
            "u64": pa.array([2**64 - 1 - i for i in range(COUNT)], pa.uint64()),
            "f16": pa.array(np.array([i + 0.5 if i % 3 else np.nan for i in range(COUNT)], np.float16)),
            "bin": pa.array([bytes([0, i, 0]) if i % 4 else None for i in range(COUNT)], pa.binary()),
            "f": pa.array([[math.nan, -0.0, math.inf][i % 3] for i in range(COUNT)], pa.float64()),
        }
    )
    parquet = root / "odd.parquet"
    pq.write_table(table, str(parquet), row_group_size=3)
    return {"jsonl": str(jsonl), "parquet": str(parquet)}


def test_parquet_columns_of_odd_values_read_as_pyarrow_and_resume(files: dict[str, str]) -> None:
    expected = pq.read_table(files["parquet"]).to_pylist()
    got = list(rs.parquet(files["parquet"]))
    assert_same(got, expected)
    source = rs.parquet(files["parquet"])
    assert_same([source[i] for i in (9, 0, 4)], [expected[i] for i in (9, 0, 4)])
    check_resume(lambda: rs.parquet(files["parquet"]).shuffle(5).shard(0, 2), COUNT // 2)


# -- every node ----------------------------------------------------------------------------------


CHAINS: dict[str, Callable[[dict[str, str]], Node[Any]]] = {
    "list-shuffle-shard": lambda f: rs.from_list(odd_records()).shuffle(3).shard(1, 2),
    "jsonl-shuffle-map-inline": lambda f: rs.jsonl(f["jsonl"]).shuffle(3).map(odd_record),
    "parquet-map-threads-filter": lambda f: rs.parquet(f["parquet"]).map(odd_record, num_workers=2).filter(keep),
    "list-filter-prefetch": lambda f: rs.from_list(odd_records()).filter(keep).prefetch(2),
    "jsonl-map-shuffle-batch3": lambda f: rs.jsonl(f["jsonl"]).map(odd_record).shuffle(1).batch(3),
    "list-batch4-collate-tuple": lambda f: rs.from_list(odd_records()).batch(4, collate_fn=as_tuple),
    "list-memory-cache-shuffle": lambda f: rs.from_list(odd_records()).cache().shuffle(2),
    "jsonl-map-memory-cache-shard-threads": lambda f: (
        rs.jsonl(f["jsonl"]).map(odd_record).cache(max_bytes=1 << 16).shuffle(4).shard(0, 2).map(as_is, num_workers=2)
    ),
    "list-indexed-filter-block-shuffle-repeat2": lambda f: (
        rs.from_list(odd_records()).filter(keep, index=True, progress=False).shuffle(5, block_size=3).repeat(2)
    ),
    "mix": lambda f: rs.mix(
        {"list": rs.from_list(odd_records()).shuffle(1), "parquet": rs.parquet(f["parquet"]).map(odd_record)},
        weights={"list": 0.6, "parquet": 0.4},
        seed=3,
    ),
}


@pytest.mark.parametrize("chain", list(CHAINS))
def test_odd_values_arrive_equal_and_resume_through_every_node(chain: str, files: dict[str, str]) -> None:
    def build() -> Node[Any]:
        return CHAINS[chain](files)

    with build() as pipe:
        epoch = list(pipe)
    numbers = check_records(epoch)
    expected_numbers = {
        "list-shuffle-shard": COUNT // 2,
        "parquet-map-threads-filter": len([i for i in range(COUNT) if i % 3 != 1]),
        "list-filter-prefetch": len([i for i in range(COUNT) if i % 3 != 1]),
        "list-indexed-filter-block-shuffle-repeat2": 2 * len([i for i in range(COUNT) if i % 3 != 1]),
        "jsonl-map-memory-cache-shard-threads": COUNT // 2,
        "mix": None,  # stops when a component ends
    }.get(chain, COUNT)
    if expected_numbers is not None:
        assert len(numbers) == expected_numbers
    expected = check_resume(build, len(epoch))
    check_records(expected)


def test_odd_values_through_a_map_in_processes_arrive_equal_and_resume(files: dict[str, str]) -> None:
    """Equal but for the byte order of big-endian arrays (see the test after this one); torch
    tensors cross processes in the Loader's tests."""

    def build() -> Node[Any]:
        return (
            rs.jsonl(files["jsonl"])
            .map(odd_record_without_tensors, num_workers=2, mode="process")
            .filter(keep)
            .batch(2)
        )

    with build() as pipe:
        epoch = list(pipe)
    assert check_records(epoch, byte_order=False, tensors=False) == [i for i in range(COUNT) if i % 3 != 1]
    expected = check_resume(build, len(epoch))
    check_records(expected, byte_order=False, tensors=False)


def big_endian_arrays(record: Any) -> dict[str, Any]:
    i = int(record["i"])
    return {"i": i, "int": np.arange(i + 1, dtype=">i4"), "float": np.array([i, -0.0], dtype=">f8")}


BIG_ENDIAN_TRANSPORT: dict[str, Callable[[str], list[Any]]] = {
    "process-map": lambda path: list(rs.jsonl(path).map(big_endian_arrays, num_workers=1, mode="process")),
    "loader-workers": lambda path: loader_epoch(big_endian_pipeline, num_workers=1, collate_fn=as_is),
}


def loader_epoch(build: Build, **options: Any) -> list[Any]:
    import resumable.torch as rst

    with rst.Loader(build, **options) as loader:
        return list(loader)


def big_endian_pipeline() -> Node[Any]:
    return rs.jsonl(JSONL_PATH[0]).shard().map(big_endian_arrays)


@pytest.mark.parametrize("transport", ["process-map", "loader-workers"])
def test_big_endian_arrays_arrive_equal_across_processes_in_either_byte_order(
    transport: str, files: dict[str, str]
) -> None:
    """docs/parallel.md: numpy (2.4) pickles a byte-swapped array in native byte order below
    pickle protocol 5, which Python before 3.14 uses between processes: the values arrive equal,
    the byte order may not (a documented limit, as in any multiprocessing pipeline)."""
    JSONL_PATH[:] = [files["jsonl"]]
    expected = list(rs.jsonl(files["jsonl"]).map(big_endian_arrays))
    got = BIG_ENDIAN_TRANSPORT[transport](files["jsonl"])
    assert_same([native(record) for record in got], [native(record) for record in expected])  # the values


def test_odd_records_that_are_not_dicts_pass_every_node_as_they_are() -> None:
    """Whole records that are a tuple, None, a numpy scalar, a 0-d or big-endian array, a
    tensor, bytes, a bytearray, a surrogate str, NaN."""
    import torch

    values = [
        (1, [2]),
        None,
        np.float16(1.5),
        np.array(2, dtype=">u2"),
        np.arange(4, dtype=">f4")[::-2],
        torch.tensor([1.5, math.nan]),
        b"\x00",
        bytearray(b"\x01"),
        "\udc80",
        math.nan,
        -0.0,
        2**64,
    ]

    def build() -> Node[Any]:
        return rs.from_list(values).shuffle(2).map(as_is, num_workers=2).prefetch(2).batch(3)

    with build() as pipe:
        got = [item for batch in pipe for item in batch]
    order = list(rs.from_list(list(range(len(values)))).shuffle(2))
    assert_same(got, [values[i] for i in order])
    check_resume(build, 4)
    check_resume(lambda: rs.from_list(values).filter(lambda v: v is not None).batch(5, collate_fn=as_tuple), 3)


# -- rs.torch.Loader ---------------------------------------------------------------------------

JSONL_PATH: list[str] = []


def loader_pipeline() -> Node[Any]:
    return rs.jsonl(JSONL_PATH[0]).shuffle(1).shard().map(odd_record).filter(keep).batch(2)


def loader_run(options: dict[str, Any], state: dict[str, Any] | None, stop: int | None) -> tuple[list[Any], Any]:
    """The batches of a fresh Loader (restored from ``state``) until ``stop`` batches or the
    end of the pass, and its state then, checked to be JSON."""
    import resumable.torch as rst

    with rst.Loader(loader_pipeline, collate_fn=as_is, **options) as loader:
        if state is not None:
            loader.load_state_dict(state)
        got = []
        for batch in loader:
            got.append(batch)
            if len(got) == stop:
                break
        return got, assert_json(loader.state_dict())


@pytest.mark.parametrize("workers", [0, 2])
def test_odd_values_through_the_loader_arrive_equal_and_resume(workers: int, files: dict[str, str]) -> None:
    """With workers, equal but for the byte order of big-endian arrays (see
    ``test_big_endian_arrays_keep_their_byte_order_across_processes``)."""
    import resumable.torch as rst

    JSONL_PATH[:] = [files["jsonl"]]
    options = {"num_workers": workers, "timeout": TIMEOUT} if workers else {}
    with rst.Loader(loader_pipeline, collate_fn=as_is, **options) as loader:
        first, second = list(loader), list(loader)
    assert sorted(check_records(first, byte_order=not workers)) == [i for i in range(COUNT) if i % 3 != 1]
    assert check_records(second, byte_order=not workers) != check_records(first, byte_order=not workers)
    for stop in [0, len(first) // 2, len(first) - 1, len(first)]:
        head, state = loader_run(options, None, stop) if stop else ([], None)
        rest, _ = loader_run(options, state, None)
        assert_same(head + rest, first)
    _, ended = loader_run(options, None, None)  # the state after the StopIteration: past the end
    following, _ = loader_run(options, ended, None)
    assert_same(following, second)


def test_the_loaders_default_collation_makes_tensors_of_the_same_dtype_and_leaves_the_rest() -> None:
    """docs/torch.md: torch's ``default_convert``: numpy arrays and scalars become tensors
    (inside dicts, lists and tuples), other values stay as they are."""
    import torch

    import resumable.torch as rst

    convertible = [
        "np_int64",
        "np_float32",
        "np_bool",
        "np_float16",
        "zero_d",
        "strided",
        "transposed",
        "float16",
        "bools",
        "empty",
        "empty_3_0",
    ]
    kept = ["tensor", "tensor_half_t", "bytes", "bytearray", "none", "nan", "neg_zero", "int_2_64", "deep", "nul"]
    kept += ["surrogates", "int_below_int64", "objects"]
    records = [{name: odd_values(i)[name] for name in convertible + kept} for i in range(4)]
    with rst.Loader(lambda: rs.from_list(records).shuffle(1), num_workers=0) as loader:
        got = list(loader)
    order = list(rs.from_list(list(range(4))).shuffle(1))
    for record, i in zip(got, order):
        assert list(record) == convertible + kept
        for name in convertible:
            value, tensor = records[i][name], record[name]
            assert isinstance(tensor, torch.Tensor), name
            assert torch.from_numpy(np.ascontiguousarray(value)).dtype == tensor.dtype, name
            assert tuple(tensor.shape) == np.shape(value), name
            assert np.asarray(value).tobytes() == tensor.numpy().tobytes(), name
        assert_same({name: record[name] for name in kept}, {name: records[i][name] for name in kept})


ARRAYS_TORCH_REFUSES = {
    "reversed": np.arange(4)[::-1],
    "big-endian": np.arange(3, dtype=">i4"),
    "structured": np.zeros(2, dtype=[("a", "<i4")]),
}


def torch_refuses(record: Any) -> dict[str, Any]:
    i = int(record["i"])
    return {"i": i, "ids": ARRAYS_TORCH_REFUSES[RECORD_KIND[0]] if i == 3 else np.arange(i)}


RECORD_KIND: list[str] = []


@pytest.mark.parametrize("kind", list(ARRAYS_TORCH_REFUSES))
@pytest.mark.parametrize("workers", [0, 2])
def test_an_array_torch_cannot_convert_fails_its_batch_alone_and_the_loader_goes_on(
    kind: str, workers: int, files: dict[str, str]
) -> None:
    """A reversed, big-endian or structured array has no tensor: torch's ``default_convert``
    raises at that batch; the batches after it come as without it, also after a restore from
    the state taken right after the error."""
    import resumable.torch as rst

    RECORD_KIND[:] = [kind]
    JSONL_PATH[:] = [files["jsonl"]]
    options = {"num_workers": workers, "timeout": TIMEOUT} if workers else {}

    def build() -> Node[Any]:
        return rs.jsonl(JSONL_PATH[0]).shard().map(torch_refuses)

    seen: list[Any] = []
    with rst.Loader(build, **options) as loader:
        iterator = iter(loader)
        while True:
            try:
                seen.append(int(next(iterator)["i"]))
            except StopIteration:
                break
            except (ValueError, TypeError) as error:  # torch's, from default_convert
                assert "numpy" in str(error) or "stride" in str(error) or "byte order" in str(error)
                seen.append("failed")
                state = assert_json(loader.state_dict())
                after = seen[:]
    assert sorted(x for x in seen if x != "failed") == [i for i in range(COUNT) if i != 3]
    assert seen.count("failed") == 1
    with rst.Loader(build, **options) as resumed:
        resumed.load_state_dict(state)
        rest = [int(batch["i"]) for batch in resumed]
    assert after + rest == seen


# -- the in-memory cache: copies of odd values --------------------------------------------------


def edit_in_place(record: dict[str, Any]) -> dict[str, Any]:
    """A map after the cache that edits every mutable part of its record in place."""
    record["tensor"] += 1
    record["bytearray"][0] += 1
    record["tuple_list"][1].append(0)
    record["deep"]["level19"]["level18"]["edited"] = True
    record["zero_d"] += 1
    record["structured"]["a"] += 1
    record["big_endian_int"] += 1
    record["list"][2].append(0)
    return record


def mutable_values(record: Any) -> dict[str, Any]:
    i = int(record["i"])
    values = odd_values(i)
    keep = ("tensor", "bytearray", "deep", "zero_d", "structured", "big_endian_int", "list")
    return {"i": i, "tuple_list": (i, [1]), **{name: values[name] for name in keep}}


@pytest.mark.parametrize("max_bytes", [1 << 20, 600])
def test_a_map_editing_odd_values_in_place_after_the_memory_cache_changes_no_later_epoch(
    max_bytes: int, files: dict[str, str]
) -> None:
    """docs/cache.md: the memory cache keeps a copy and hands out a new copy each time."""
    uncached = rs.jsonl(files["jsonl"]).map(mutable_values).cache(max_bytes=0).shuffle(2).map(edit_in_place)
    expected = [list(uncached) for _ in range(3)]
    pipe = rs.jsonl(files["jsonl"]).map(mutable_values).cache(max_bytes=max_bytes).shuffle(2).map(edit_in_place)
    assert_same([list(pipe) for _ in range(3)], expected)


def lock(record: Any) -> dict[str, Any]:
    return {"i": record["i"], "lock": threading.Lock()}


def non_leaf_tensor(record: Any) -> dict[str, Any]:
    import torch

    return {"i": record["i"], "grad": torch.ones(2, requires_grad=True) * 2}


def generator(record: Any) -> dict[str, Any]:
    return {"i": record["i"], "items": (x for x in range(2))}


@pytest.mark.parametrize("make", [lock, non_leaf_tensor, generator])
def test_a_value_the_memory_cache_cannot_copy_is_a_config_error_naming_its_position(
    make: Callable[[Any], Any], files: dict[str, str]
) -> None:
    """docs/cache.md: other objects are copied by ``copy.deepcopy``, which must work on them,
    else a ``ConfigError`` names the record."""
    with pytest.raises(rs.ConfigError, match="record at position 0"):
        list(rs.jsonl(files["jsonl"]).map(make).cache())
    assert len(list(rs.jsonl(files["jsonl"]).map(make).cache(max_bytes=0))) == COUNT  # nothing kept


def numpy_payload(record: Any) -> dict[str, Any]:
    return {"i": record["i"], "x": np.zeros(1 << 15)}  # 256 KiB


def tensor_payload(record: Any) -> dict[str, Any]:
    import torch

    return {"i": record["i"], "x": torch.zeros(1 << 15, dtype=torch.float64)}  # 256 KiB


@pytest.mark.parametrize("make", [numpy_payload, tensor_payload], ids=["numpy", "tensor"])
def test_max_bytes_bounds_a_memory_cache_of_large_arrays_and_tensors(
    make: Callable[[Any], Any], files: dict[str, str]
) -> None:
    """docs/cache.md: an in-memory LRU bounded by ``max_bytes``: here 1 MiB, under records of
    256 KiB each, so it keeps at most 3 of them and a second epoch computes the others again."""
    pipe = rs.jsonl(files["jsonl"]).map(make).cache(max_bytes=1 << 20)
    for _ in range(2):
        assert [int(record["i"]) for record in pipe] == list(range(COUNT))
    assert pipe.computed >= 2 * COUNT - 3


def shared_parts(record: Any) -> dict[str, Any]:
    i = int(record["i"])
    return {"i": i, "objects": np.array([[i], None], dtype=object), "void": np.zeros(1, dtype=[("a", "<i4")])[0]}


def edit_object_array(record: dict[str, Any]) -> dict[str, Any]:
    record["objects"][0].append(-1)
    return record


def edit_void(record: dict[str, Any]) -> dict[str, Any]:
    record["void"]["a"] += 1
    return record


@pytest.mark.parametrize("edit", [edit_object_array, edit_void], ids=["object-array-element", "structured-scalar"])
def test_a_memory_cache_shares_no_mutable_part_of_an_odd_value(
    edit: Callable[[Any], Any], files: dict[str, str]
) -> None:
    def build(max_bytes: int) -> Node[Any]:
        return rs.jsonl(files["jsonl"]).map(shared_parts).cache(max_bytes=max_bytes).map(edit)

    expected = list(build(0))
    pipe = build(1 << 20)
    assert_same(list(pipe), expected)
    assert_same(list(pipe), expected)  # the second epoch reads the cache


# -- the disk cache ------------------------------------------------------------------------------

STORABLE = [
    "np_int64",
    "np_float32",
    "np_bool",
    "np_float16",
    "strided",
    "reversed",
    "float16",
    "bools",
    "empty",
    "bytes",
    "nan",
    "inf",
    "neg_inf",
    "neg_zero",
    "nul",
]


def storable(record: Any) -> dict[str, Any]:
    """Values docs/cache.md says a disk cache stores and serves as computed."""
    i = int(record["i"])
    values = odd_values(i)
    return {
        "i": i,
        **{name: values[name] for name in STORABLE},
        "str_or_none": None if i % 3 == 0 else "s\x00" * i,
        "ints": [i, None, 2**63 - 1, -(2**63)],
        "floats": [math.nan, -0.0, math.inf],
    }


def test_values_a_disk_cache_stores_come_back_as_computed_and_resume(tmp_path: Path, files: dict[str, str]) -> None:
    def build(directory: Path | None) -> Node[Any]:
        source = rs.jsonl(files["jsonl"]).map(storable)
        cached = source if directory is None else cache(source, str(directory), block_size=4)
        return cached.shuffle(2).shard(1, 2)

    reference = take(build(None), 2 * (COUNT // 2) + 2)
    for round_ in ("cold", "warm"):  # the second round reads the blocks the first one wrote
        cached = build(tmp_path)
        assert_same(take(cached, len(reference)), reference)
        assert cached.upstream.upstream.computed == (COUNT if round_ == "cold" else 0)
        assert_same(check_resume(lambda: build(tmp_path), COUNT // 2), reference)


REFUSED_ON_DISK = ["zero_d", "empty_3_0", "structured", "objects", "tensor", "bytearray", "tuple", "deep", "int_2_63"]


@pytest.mark.parametrize("name", REFUSED_ON_DISK)
def test_values_a_disk_cache_cannot_store_are_config_errors_naming_the_field(name: str, tmp_path: Path) -> None:
    """docs/cache.md: 2-d arrays, tuples, nested dicts, arbitrary objects (and ints pyarrow
    cannot hold) raise a ConfigError that names the field when the block is written."""
    records = [{"i": i, name: odd_values(i)[name]} for i in range(3)]
    with pytest.raises(rs.ConfigError, match=repr(name)):
        list(rs.from_list(records).cache(str(tmp_path)))
    assert_same(list(rs.from_list(records).cache()), records)  # the memory cache keeps them


def big_endian(i: int) -> Any:
    return np.arange(i + 1, dtype=">i4")


def long_double(i: int) -> Any:
    return np.arange(i + 1, dtype=np.longdouble)


def surrogate_str(i: int) -> Any:
    return "a\ud800" * i


def surrogates_in_a_list(i: int) -> Any:
    return ["\udc80", str(i)]


def long_double_scalar(i: int) -> Any:
    return np.longdouble(i)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(big_endian, id="big-endian-array"),
        pytest.param(long_double, id="longdouble-array"),
        pytest.param(long_double_scalar, id="longdouble-scalar"),
        pytest.param(surrogate_str, id="surrogate-str"),
        pytest.param(surrogates_in_a_list, id="surrogate-in-a-list"),
    ],
)
def test_a_disk_cache_stores_a_value_as_computed_or_refuses_it_with_a_config_error(
    make: Callable[[int], Any], tmp_path: Path
) -> None:
    records = [{"i": i, "v": make(i)} for i in range(3)]
    try:
        got = list(rs.from_list(records).cache(str(tmp_path)))
    except rs.ConfigError as error:
        assert "'v'" in str(error)
        return
    assert_same(got, records)


# -- pack ------------------------------------------------------------------------------------------

DOCUMENT_FIELDS = ["tuple", "np_float16", "tensor", "structured", "deep", "surrogates", "nan", "int_2_64", "bytearray"]


def documents(dtype: str) -> Callable[[Any], dict[str, Any]]:
    def document(record: Any) -> dict[str, Any]:
        i = int(record["i"])
        ids = (np.arange(1 + (5 * i) % 9) * 37 + i) % 250
        tokens: Any = {
            "uint8": ids.astype(np.uint8),
            "uint16": ids.astype(np.uint16),
            "int32": ids.astype(np.int32),
            "int64": ids.astype(np.int64),
            "big-endian": ids.astype(">i4"),
            "reversed": ids.astype(np.int64)[::-1],
            "strided": np.repeat(ids, 2).astype(np.uint16)[::2],
            "list": ids.tolist(),
        }[dtype]
        values = odd_values(i)
        return {
            "input_ids": tokens,
            "half": (ids / 7).astype(np.float16),
            "flag": ids % 2 == 0,
            "weight": (ids / 3).astype(">f4"),
            **{name: values[name] for name in DOCUMENT_FIELDS},
        }

    return document


DOCUMENT_MAPS = {dtype: documents(dtype) for dtype in ("uint8", "uint16", "int32", "int64", "big-endian", "reversed")}
DOCUMENT_MAPS.update({dtype: documents(dtype) for dtype in ("strided", "list")})


@pytest.mark.parametrize("dtype", list(DOCUMENT_MAPS))
def test_pack_of_any_integer_dtype_with_odd_payloads_resumes_exactly(dtype: str, files: dict[str, str]) -> None:
    def build() -> Node[Any]:
        return (
            rs.jsonl(files["jsonl"])
            .shuffle(3)
            .map(DOCUMENT_MAPS[dtype])
            .pack(
                8,
                strategy="best_fit",
                buffer_size=3,
                token_fields=["half", "flag", "weight"],
                document_fields=DOCUMENT_FIELDS,
            )
        )

    rows = list(build())
    documents_seen = 0
    for row in rows:
        assert row["input_ids"].dtype == np.int64
        assert (row["half"].dtype, row["flag"].dtype) == (np.float16, np.bool_)
        assert row["weight"].dtype.kind == "f" and row["weight"].dtype.itemsize == 4
        starts = row["cu_seqlens"][: len(row[DOCUMENT_FIELDS[0]])].tolist()
        for number, start in enumerate(starts):
            offset, payload = row[DOCUMENT_FIELDS[0]][number]
            assert offset == start
            if payload is None:  # a later piece of a split document
                continue
            documents_seen += 1
            i = payload[0]
            record = documents(dtype)({"i": i})
            for name in DOCUMENT_FIELDS:
                assert row[name][number][0] == start
                assert_same(row[name][number][1], record[name])
            ids = np.asarray(record["input_ids"]).tolist()
            assert row["input_ids"][start : start + len(ids)].tolist() == ids[: len(row["input_ids"]) - start]
            piece = slice(start, start + min(len(ids), 8 - start))
            assert row["half"][piece].tobytes() == record["half"][: piece.stop - start].tobytes()
            assert row["weight"][piece].tolist() == record["weight"][: piece.stop - start].tolist()
    assert documents_seen == COUNT
    check_resume(build, len(rows))


def test_pack_rows_are_the_same_whatever_the_integer_dtype_of_the_ids(files: dict[str, str]) -> None:
    def rows(dtype: str) -> list[Any]:
        pipe = rs.jsonl(files["jsonl"]).map(DOCUMENT_MAPS[dtype]).pack(8, strategy="greedy", token_fields=["half"])
        return [{k: v for k, v in row.items() if k != "half"} for row in pipe]

    reference = rows("list")
    for dtype in ("uint8", "uint16", "int32", "int64", "big-endian", "strided"):
        assert_same(rows(dtype), reference)


@pytest.mark.parametrize("field", ["input_ids", "labels"])
def test_big_endian_uint64_ids_past_int64_are_refused_like_native_ones(field: str) -> None:
    for dtype in ("<u8", ">u8"):
        ids = np.array([2**63 + 5, 1], dtype=dtype)
        record = {"input_ids": ids} if field == "input_ids" else {"input_ids": [1, 2], "labels": ids}
        with pytest.raises(rs.SourceError, match="above the int64"):
            list(rs.from_list([record]).pack(4, strategy="greedy"))


# -- JSONL numbers past 64 bits ----------------------------------------------------------------


def test_jsonl_integers_at_the_64_bit_edges_are_exact(tmp_path: Path) -> None:
    values = [2**64 - 1, 2**63, 2**63 - 1, -(2**63), 0, -1]
    path = tmp_path / "edges.jsonl"
    path.write_text("".join(json.dumps({"a": value}) + "\n" for value in values))
    for source in (rs.jsonl(str(path)), rs.jsonl_stream(str(path))):
        got = [record["a"] for record in source]
        assert_same(got, values)
    check_resume(lambda: rs.jsonl(str(path)).shuffle(1), len(values))


@pytest.mark.parametrize("value", [2**64, -(2**63) - 1, 10**30])
def test_jsonl_integers_past_64_bits_come_out_as_floats_as_documented(value: int, tmp_path: Path) -> None:
    """docs/sources.md: orjson reads an integer beyond 64 bits as a float (a documented limit)."""
    path = tmp_path / "big.jsonl"
    path.write_text(json.dumps({"a": 1}) + "\n" + json.dumps({"a": value}) + "\n")
    for source in (rs.jsonl(str(path)), rs.jsonl_stream(str(path))):
        got = [record["a"] for record in source]
        assert got == [1, float(value)] and type(got[1]) is float
