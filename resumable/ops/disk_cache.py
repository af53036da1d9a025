"""On-disk record store of ``Cache``: aligned blocks of records in Arrow IPC files.

Layout under ``<directory>/<fingerprint>/``::

    config.json                      the upstream's configuration the fingerprint hashes (for people)
    000000000000-000000001024.arrow  records [0, 1024): one Arrow IPC file, one record batch
    000000001024-000000002048.arrow  records [1024, 2048)
    .000000002048-000000003072.arrow.partial    a write in progress, or left by a crash until that block is written

Block ``b`` holds records ``[b * block_size, min((b + 1) * block_size, length))``. A block is
computed as a whole the first time any of its records is asked for, written to a temporary file,
fsynced and renamed into place (``write_atomically``), so a reader sees a complete block or none.
Two processes that compute the same block write identical bytes and the last rename wins.

Each file is self-describing: the schema's metadata says how each column maps back to the
Python value the map produced (see ``encode_block`` / ``BlockView``), so reading record ``i``
is one dict lookup for the block plus one slice per column.

Block files are memory-mapped. A file cut short in place while mapped would kill the process
(SIGBUS) when a record past its new end is read, so a view is handed out only after an ``fstat``
shows its file still has the size it was mapped with; one that changed is computed again.
"""

from __future__ import annotations

import json
import os
import re
from collections import OrderedDict
from typing import Any, Callable, Sequence, Union, cast

import numpy as np
import pyarrow as pa

from resumable.checkpoint import write_atomically
from resumable.errors import ConfigError
from resumable.sources.open_files import MappedFile

FORMAT = "resumable-cache/1"
META_KEY = b"resumable"
CONFIG_FILE = "config.json"
BLOCK_NAME = re.compile(r"^(\d{12})-(\d{12})\.arrow$")
VALUE_COLUMN = "value"
"""The single column of a block whose records are not dicts."""

# Column kinds: how a column turns back into the values the map returned.
ARRAY = "array"  # 1-d numpy array of numbers or bools -> list<dtype>, read back as a numpy array
NUMPY = "numpy"  # numpy scalar -> column of that dtype, read back as a numpy scalar
PYTHON = "python"  # int, float, bool, str, bytes, None, lists of those -> read back with to_pylist

_PY_TYPES = {bool: pa.bool_(), int: pa.int64(), float: pa.float64(), str: pa.string(), bytes: pa.binary()}
_PY_TAGS = {python_type.__name__: arrow_type for python_type, arrow_type in _PY_TYPES.items()}
MAX_LIST_DEPTH = 32
"""Lists and dicts nested deeper than this in a field are not stored on disk."""
SKIPPED_KEY = "skipped"
"""Block metadata: offsets of records the source skipped as malformed (none stored for them)."""
START_KEY = "start"
"""Block metadata: the position of the block's first record, so a file renamed (or copied) to
another block's name is not served as that block."""


class _Skipped:
    """The stand-in for a record the source skipped as malformed (``on_error="skip"``); pickled
    by name, so that it comes back as itself (the in-memory cache keeps records pickled)."""

    def __reduce__(self) -> str:
        return "SKIPPED"

    def __repr__(self) -> str:
        return "<skipped record>"


SKIPPED = _Skipped()
MAX_OPEN_BLOCKS = 4096
"""Blocks kept open before the least recent is closed. An open block is a memory map plus a few
Arrow objects (no decoded records), so random access over many blocks stays cheap."""


def block_name(start: int, stop: int) -> str:
    """The file name of the block holding records ``[start, stop)``."""
    return f"{start:012d}-{stop:012d}.arrow"


def _unsupported(key: str, value: Any, why: str = "") -> ConfigError:
    where = f"field {key!r}" if key != VALUE_COLUMN else "record"
    return ConfigError(
        f"Cache: cannot store {where} of type {type(value).__name__} on disk{why}; supported: dicts of "
        "1-d numeric numpy arrays and numpy scalars (native byte order, up to 64 bits), int, float, bool, "
        "str, bytes, None and lists of those "
        "(or one such value per record); use .cache() without a directory for other records"
    )


def _arrow_numeric(dtype: np.dtype[Any]) -> bool:
    """Whether Arrow stores numbers of ``dtype`` as they are: bool, ints and floats of up to 64
    bits, in this machine's byte order (not float128, not byte-swapped)."""
    return dtype.kind in "biuf" and dtype.isnative and dtype.itemsize <= 8


def _kind_of(key: str, value: Any) -> tuple[str, str]:
    """``(kind, type tag)`` of one value; records of one block must agree per column."""
    if isinstance(value, np.ndarray):
        if value.ndim != 1 or not _arrow_numeric(value.dtype):
            raise _unsupported(key, value, f" (a {value.ndim}-d array of {value.dtype.str})")
        return ARRAY, value.dtype.str
    if isinstance(value, np.generic):
        if not _arrow_numeric(value.dtype):
            raise _unsupported(key, value, f" (of {value.dtype.str})")
        return NUMPY, value.dtype.str
    if value is None:
        return PYTHON, "none"
    if type(value) in _PY_TYPES:
        return PYTHON, type(value).__name__
    if type(value) is list:
        return PYTHON, "list"  # its elements: _list_column_kind
    if isinstance(value, (tuple, dict)):
        raise _unsupported(key, value, " (tuples and nested dicts do not round-trip)")
    raise _unsupported(key, value)


ValueKind = Union[str, tuple[str, "ValueKind"], tuple[str, tuple[tuple[str, "ValueKind"], ...]], None]
"""What a value inside a list is, as far as the values seen tell: a Python type's name,
``("list", kind)``, ``("dict", ((key, kind), ...))``, None where nothing tells (None, [])."""


def _list_column_kind(key: str, values: list[Any]) -> ValueKind:
    """The one kind of the elements of a column's lists, across its records (Nones aside).
    Arrow infers a list column's type from all of its elements and would turn ints into floats,
    strs into bytes or tuples into lists, and give dicts each other's keys: a ConfigError
    unless every element is of one Python type, lists of one, or dicts of the same keys in the
    same order whose values agree likewise."""
    found: ValueKind = None
    for value in values:
        if value is not None:
            found = _unify(key, found, _value_kind(key, value, 0))
    return found


def _value_kind(key: str, value: Any, depth: int) -> ValueKind:
    if value is None:
        return None
    if type(value) in _PY_TYPES:
        return type(value).__name__
    if depth < MAX_LIST_DEPTH and type(value) is list:
        found: ValueKind = None
        for element in value:
            found = _unify(key, found, _value_kind(key, element, depth + 1))
        return ("list", found)
    if depth < MAX_LIST_DEPTH and type(value) is dict and depth > 0 and all(type(k) is str for k in value):
        return ("dict", tuple((k, _value_kind(key, v, depth + 1)) for k, v in value.items()))
    raise _unsupported(key, value, " (inside a list: it does not round-trip)")


def _unify(key: str, first: ValueKind, second: ValueKind) -> ValueKind:
    """The kind that ``first`` and ``second`` both are (None unifies with anything)."""
    if first is None or first == second:
        return second
    if second is None:
        return first
    if isinstance(first, tuple) and isinstance(second, tuple) and first[0] == second[0]:
        if first[0] == "list":
            return ("list", _unify(key, cast("ValueKind", first[1]), cast("ValueKind", second[1])))
        fields, others = (
            cast("tuple[tuple[str, ValueKind], ...]", first[1]),
            cast("tuple[tuple[str, ValueKind], ...]", second[1]),
        )
        if [name for name, _ in fields] == [name for name, _ in others]:
            return ("dict", tuple((name, _unify(key, a, b)) for (name, a), (_, b) in zip(fields, others)))
    raise ConfigError(f"Cache: field {key!r} holds lists that mix {first} and {second}; it cannot be stored on disk")


def _column(key: str, kind: str, tag: str, values: list[Any]) -> pa.Array:
    if kind == ARRAY:
        dtype = np.dtype(tag)
        lengths = np.fromiter((len(v) for v in values), dtype=np.int64, count=len(values))
        offsets = np.zeros(len(values) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        flat = np.concatenate(values).astype(dtype, copy=False) if values else np.empty(0, dtype)
        return pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(flat))
    if kind == NUMPY:
        return pa.array(np.array(values, dtype=np.dtype(tag)))
    try:
        if tag in ("none", "list"):
            return pa.array(values)
        return pa.array(values, type=_PY_TAGS[tag])
    except (pa.ArrowException, OverflowError, UnicodeError) as error:  # a str with a lone surrogate
        raise _unsupported(key, values[0], f": {error}") from error


def encode_block(records: Sequence[Any], start: int) -> pa.Table:
    """An Arrow table holding ``records`` (all dicts with the same keys, or all plain values),
    the block's from position ``start``; ``SKIPPED`` records are not stored, their offsets are
    listed in the metadata."""
    skipped = [offset for offset, record in enumerate(records) if record is SKIPPED]
    if skipped:
        records = [record for record in records if record is not SKIPPED]
    if not records:
        meta = {"format": FORMAT, START_KEY: start, "wrapped": True, "columns": {}, SKIPPED_KEY: skipped}
        return pa.table({}, metadata={META_KEY: json.dumps(meta)})
    wrapped = not isinstance(records[0], dict)
    rows = [{VALUE_COLUMN: r} for r in records] if wrapped else list(records)
    keys = list(rows[0])
    for key in keys:
        if not isinstance(key, str):
            raise ConfigError(f"Cache: record keys must be strings to be stored on disk, got {key!r}")
    kinds: dict[str, list[str]] = {}
    columns = []
    for key in keys:
        try:
            values = [row[key] for row in rows]
        except (KeyError, TypeError):
            raise ConfigError(f"Cache: records of one block have different fields (first has {keys})") from None
        found = {_kind_of(key, v) for v in values}
        python_tags = {tag for kind, tag in found if kind == PYTHON}
        if len(found) > 1 and not (len(python_tags) == len(found) and len(python_tags - {"none"}) <= 1):
            raise ConfigError(f"Cache: field {key!r} mixes value types {sorted(found)}; it cannot be stored on disk")
        kind, tag = next(iter(found)) if len(found) == 1 else (PYTHON, next(iter(python_tags - {"none"})))
        if tag == "list":
            _list_column_kind(key, values)
        kinds[key] = [kind, tag]
        columns.append(_column(key, kind, tag, values))
    for row in rows:
        if len(row) != len(keys):
            raise ConfigError(f"Cache: records of one block have different fields (first has {keys})")
    meta = {"format": FORMAT, START_KEY: start, "wrapped": wrapped, "columns": kinds, SKIPPED_KEY: skipped}
    schema = pa.schema([pa.field(k, c.type) for k, c in zip(keys, columns)], metadata={META_KEY: json.dumps(meta)})
    return pa.Table.from_arrays(columns, schema=schema)


class BlockView:
    """Records of one block, read from an Arrow table (memory-mapped when it came from disk:
    ``mapping`` is then the map its buffers view)."""

    def __init__(self, table: pa.Table, mapping: MappedFile | None = None) -> None:
        """ValueError unless ``table`` is a block as ``encode_block`` writes it: its metadata
        is checked against its columns, so a damaged or foreign file is computed again."""
        self._mapping = mapping
        meta = json.loads((table.schema.metadata or {}).get(META_KEY, b"{}"))
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise ValueError("not a resumable cache block")
        start, wrapped, columns = meta.get(START_KEY), meta.get("wrapped"), meta.get("columns")
        if type(start) is not int or start < 0 or type(wrapped) is not bool or not isinstance(columns, dict):
            raise ValueError("a cache block without its start, wrapping or columns")
        if list(columns) != table.column_names or (wrapped and table.num_columns and list(columns) != [VALUE_COLUMN]):
            raise ValueError(f"a cache block whose columns {table.column_names} are not those described")
        skipped = meta.get(SKIPPED_KEY, [])
        if not isinstance(skipped, list) or not all(type(offset) is int for offset in skipped):
            raise ValueError("a cache block whose skipped offsets are not a list of ints")
        table = table.combine_chunks()
        self.start = start
        self._skipped = np.asarray(skipped, dtype=np.int64)
        self.num_rows = table.num_rows + len(skipped)
        if skipped and (skipped[0] < 0 or skipped[-1] >= self.num_rows or np.any(np.diff(self._skipped) <= 0)):
            raise ValueError("a cache block whose skipped offsets do not rise within it")
        self._wrapped = wrapped
        self._getters: list[tuple[str, Callable[[int], Any]]] = []
        for key, described in columns.items():
            column = table.column(key)
            kind = _described_kind(described, column.type)
            array = column.chunk(0) if column.num_chunks else pa.array([], type=column.type)
            self._getters.append((key, _getter(kind, array)))

    def intact(self) -> bool:
        """Whether the block's file still has the size it was mapped with (always true in
        memory): reading a map past the end of a file cut short kills the process (SIGBUS)."""
        mapping = self._mapping
        return mapping is None or mapping.cut_to() is None

    def record(self, offset: int) -> Any:
        """The record at ``offset`` of the block (``SKIPPED`` for a skipped one)."""
        skipped = self._skipped
        if len(skipped):
            before = int(np.searchsorted(skipped, offset))
            if before < len(skipped) and skipped[before] == offset:
                return SKIPPED
            offset -= before
        if self._wrapped:
            return self._getters[0][1](offset)
        return {key: get(offset) for key, get in self._getters}


def _described_kind(described: Any, arrow_type: pa.DataType) -> str:
    """The kind of a column described as ``[kind, type tag]``; ValueError unless the column's
    Arrow type is the one ``encode_block`` writes for that description."""
    if not (isinstance(described, list) and len(described) == 2 and all(isinstance(v, str) for v in described)):
        raise ValueError(f"a cache block column described as {described!r}")
    kind: str = described[0]
    tag: str = described[1]
    expected: pa.DataType | None = None
    try:
        if kind == ARRAY:
            expected = pa.large_list(pa.from_numpy_dtype(np.dtype(tag)))
        elif kind == NUMPY:
            expected = pa.from_numpy_dtype(np.dtype(tag))
        elif kind == PYTHON and tag in _PY_TAGS:
            expected = _PY_TAGS[tag]
        elif kind == PYTHON and tag == "none":
            expected = pa.null()
        elif kind == PYTHON and tag == "list" and (pa.types.is_list(arrow_type) or pa.types.is_null(arrow_type)):
            expected = arrow_type
    except (TypeError, ValueError, pa.ArrowException):  # a tag that is no dtype
        expected = None
    if expected is None or arrow_type != expected:
        raise ValueError(f"a cache block column of Arrow type {arrow_type} described as {described!r}")
    return kind


def _getter(kind: str, array: pa.Array) -> Callable[[int], Any]:
    if kind == ARRAY:
        offsets = array.offsets.to_numpy()
        values = array.values.to_numpy(zero_copy_only=False)

        def get_array(row: int) -> np.ndarray:
            copy: np.ndarray = values[offsets[row] : offsets[row + 1]].copy()  # writable, like what the map made
            return copy

        return get_array
    if kind == NUMPY:
        column = array.to_numpy(zero_copy_only=False)  # zero-copy: numeric, no nulls
        get_numpy: Callable[[int], Any] = column.__getitem__
        return get_numpy

    def get_python(row: int) -> Any:  # per row, so an open block holds no Python objects
        return array[row].as_py()

    return get_python


class DiskStore:
    """The block files of one fingerprint directory: find, read and write blocks."""

    def __init__(self, root: str, length: int, block_size: int, config: dict[str, Any]) -> None:
        """Create ``root`` and its ``config.json``; OSError when the directory is not writable."""
        self.root = root
        self.length = length
        self.block_size = block_size
        self._views: OrderedDict[int, BlockView] = OrderedDict()
        os.makedirs(root, exist_ok=True)
        config_path = os.path.join(root, CONFIG_FILE)
        if not os.path.exists(config_path):
            payload = json.dumps(config, sort_keys=True, indent=1).encode()
            write_atomically(config_path, lambda out: out.write(payload))
        self.known = self.scan()

    def __getstate__(self) -> dict[str, Any]:
        """Pickle (DataLoader workers) without the open blocks: memory maps do not pickle, and a
        worker maps the files again."""
        state = self.__dict__.copy()
        state["_views"] = OrderedDict()
        return state

    def bounds(self, block: int) -> tuple[int, int]:
        start = block * self.block_size
        return start, min(start + self.block_size, self.length)

    def scan(self) -> set[int]:
        """Blocks present in the directory listing (temp files and foreign names ignored)."""
        found = set()
        for name in os.listdir(self.root):
            match = BLOCK_NAME.match(name)
            if match is None:
                continue
            start, stop = int(match.group(1)), int(match.group(2))
            if start % self.block_size == 0 and (start, stop) == self.bounds(start // self.block_size):
                found.add(start // self.block_size)
        return found

    def path(self, block: int) -> str:
        return os.path.join(self.root, block_name(*self.bounds(block)))

    def view(self, block: int) -> BlockView | None:
        """The block's records if its file exists and is intact, else None (compute it). An open
        view is checked first: one whose file changed size (cut short) is dropped."""
        view = self._views.get(block)
        if view is not None:
            if view.intact():
                self._views.move_to_end(block)
                return view
            del self._views[block]
            self.known.discard(block)
            return None
        try:
            mapping = MappedFile.of(self.path(block))  # no descriptor held: thousands of blocks stay open
            table = pa.ipc.open_file(mapping.buffer).read_all()
            table.validate(full=True)  # offsets and UTF-8 checked once, not trusted by every read
            view = BlockView(table, mapping)
        except (OSError, ValueError, KeyError, pa.ArrowException):
            self.known.discard(block)
            return None
        start, stop = self.bounds(block)
        if view.start != start or view.num_rows != stop - start:  # another block's file, or cut
            self.known.discard(block)
            return None
        self.known.add(block)
        self._views[block] = view
        if len(self._views) > MAX_OPEN_BLOCKS:
            self._views.popitem(last=False)
        return view

    def write(self, block: int, table: pa.Table) -> None:
        """Put ``table`` in place atomically; OSError if the write fails (nothing is left)."""
        sink = pa.BufferOutputStream()
        with pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
        payload = sink.getvalue()
        write_atomically(self.path(block), lambda out: out.write(payload))
        self.known.add(block)
