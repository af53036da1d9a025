"""Adversary: the parameters a pipeline is built with, wrong ones and odd but valid ones.

Wrong values (bools where ints are expected, floats, strings, None, zero, negatives, huge ints,
non-callables, unknown names, paths that are not paths or match nothing) must be refused when
the node is built, with a typed error (``rs.ConfigError``, or ``rs.SourceError`` for data that
cannot be read) whose message names the node and the option: never a bare TypeError,
AttributeError, OverflowError or numpy error at the first ``next()``, and never a silent
acceptance that changes what the pipeline yields. numpy integer scalars and ``int`` subclasses
are what configs and numpy arithmetic hand a user, so they must behave exactly as the ints they
stand for, states included.

Odd but valid values (window=1, block_size=1, block sizes past the epoch, more ranks than
records, batches larger than the epoch, one short batch dropped, seq_len=1, buffer_size=1,
repeat(1), even() without torch.distributed, empty and one-record sources through every node)
must yield what their documentation says and resume exactly: save after k items, restore into a
freshly built pipeline, continue; the run equals the uninterrupted one at k = 0, 1, the middle,
the last item, the epoch's end and into the next epoch.

Bugs found are kept as strict xfails naming what goes wrong.
"""

from __future__ import annotations

import enum
import functools
import gzip
import json
import os
from itertools import islice
from pathlib import Path
from typing import Any, Callable

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import resumable as rs
from tests.resume import plain, roundtrip, take

N = rs.nodes
Build = Callable[[], rs.Node[Any]]


# -- helpers ----------------------------------------------------------------------------------


def records(n: int) -> list[dict[str, int]]:
    return [{"x": i} for i in range(n)]


def src(n: int = 10) -> rs.Node[Any]:
    return rs.from_list(records(n))


def documents(n: int) -> list[dict[str, Any]]:
    """Token documents of 1 to 5 tokens, every token id positive (0 is the pad id)."""
    return [{"input_ids": [100 * i + t + 1 for t in range(1 + (i * 7) % 5)]} for i in range(n)]


def identity(item: Any) -> Any:
    return item


def keep_all(item: Any) -> bool:
    return True


def keep_none(item: Any) -> bool:
    return False


def write_jsonl(path: Path, rows: list[Any]) -> str:
    path.write_bytes(b"".join(orjson.dumps(row) + b"\n" for row in rows))
    return str(path)


def write_parquet(path: Path, rows: list[dict[str, Any]], row_group_size: int = 2) -> str:
    pq.write_table(pa.Table.from_pylist(rows), str(path), row_group_size=row_group_size)
    return str(path)


def write_arrow(path: Path, rows: list[dict[str, Any]]) -> str:
    table = pa.Table.from_pylist(rows)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    return str(path)


def resume_points(length: int) -> list[int]:
    """Start, the first item, the middle, the last item, the epoch's end, into the next one."""
    return sorted({0, 1, length // 2, max(length - 1, 0), length, length + 1})


def check_every_point(build: Build, epoch_length: int, epochs: int = 3) -> list[Any]:
    """Save at every point of ``resume_points(epoch_length)``, restore into a fresh pipeline
    (the state sent through JSON), continue; the run must equal the uninterrupted one.
    Returns the uninterrupted run (as plain data)."""
    total = epochs * max(epoch_length, 1) + 2
    whole = build()
    expected = [plain(item) for item in take(whole, total)]
    whole.close()
    for k in resume_points(epoch_length):
        if k > total:
            continue
        pipe = build()
        head = [plain(item) for item in take(pipe, k)]
        state = pipe.get_state()
        text = json.dumps(state, sort_keys=True)  # plain JSON, or this raises
        pipe.close()
        resumed = build()
        resumed.set_state(roundtrip(state))
        rest = [plain(item) for item in take(resumed, total - k)]
        resumed.close()
        assert head + rest == expected, f"resume after {k} items differs"
        assert json.dumps(state, sort_keys=True) == text
    return expected


def config_error(build: Callable[[], Any], *words: str) -> rs.ConfigError:
    """``build()`` must raise ConfigError at once, naming every one of ``words``."""
    with pytest.raises(rs.ConfigError) as caught:
        build()
    for word in words:
        assert word in str(caught.value), f"{word!r} not named in {caught.value}"
    return caught.value


# -- 1. wrong values are refused when the node is built, naming node and option -----------------

REFUSED: dict[str, tuple[Callable[[], Any], tuple[str, ...]]] = {
    # shuffle
    "shuffle seed=True": (lambda: src().shuffle(seed=True), ("Shuffle", "seed")),
    "shuffle seed=False": (lambda: src().shuffle(seed=False), ("Shuffle", "seed")),
    "shuffle seed=-1": (lambda: src().shuffle(seed=-1), ("Shuffle", "seed")),
    "shuffle seed=1.0": (lambda: src().shuffle(seed=1.0), ("Shuffle", "seed")),
    "shuffle seed=None": (lambda: src().shuffle(seed=None), ("Shuffle", "seed")),
    "shuffle seed='0'": (lambda: src().shuffle(seed="0"), ("Shuffle", "seed")),
    "block seed=-5": (lambda: src().shuffle(seed=-5, block_size=2), ("BlockShuffle", "seed")),
    "block_size=0": (lambda: src().shuffle(block_size=0), ("BlockShuffle", "block_size")),
    "block_size=-1": (lambda: src().shuffle(block_size=-1), ("BlockShuffle", "block_size")),
    "block_size=True": (lambda: src().shuffle(block_size=True), ("BlockShuffle", "block_size")),
    "block_size=2.0": (lambda: src().shuffle(block_size=2.0), ("BlockShuffle", "block_size")),
    "block_size='rows'": (lambda: src().shuffle(block_size="rows"), ("BlockShuffle", "block_size")),
    "block_size=row_group in memory": (lambda: src().shuffle(block_size="row_group"), ("BlockShuffle", "row_group")),
    "window=0": (lambda: src().shuffle(window=0), ("BlockShuffle", "window")),
    "window=True": (lambda: src().shuffle(block_size=2, window=True), ("BlockShuffle", "window")),
    "window=1.5": (lambda: src().shuffle(window=1.5), ("BlockShuffle", "window")),
    "window='4'": (lambda: src().shuffle(window="4"), ("BlockShuffle", "window")),
    # shard
    "shard rank only": (lambda: src().shard(rank=0), ("Shard", "rank", "world_size")),
    "shard world_size only": (lambda: src().shard(world_size=2), ("Shard", "rank", "world_size")),
    "shard world_size=0": (lambda: src().shard(0, 0), ("Shard", "world_size")),
    "shard rank=world_size": (lambda: src().shard(2, 2), ("Shard", "rank")),
    "shard rank=-1": (lambda: src().shard(-1, 2), ("Shard", "rank")),
    "shard rank=True": (lambda: src().shard(True, 2), ("Shard", "rank")),
    "shard world_size=True": (lambda: src().shard(0, True), ("Shard", "world_size")),
    "shard rank=0.0": (lambda: src().shard(0.0, 2), ("Shard", "rank")),
    "shard world_size='2'": (lambda: src().shard(0, "2"), ("Shard", "world_size")),
    "shard world_size=-2**100": (lambda: src().shard(0, -(2**100)), ("Shard", "world_size")),
    "shuffle after batch": (lambda: src().batch(2).shuffle(), ("shuffle", "random access")),
    "shard after filter": (lambda: src().filter(keep_all).shard(0, 1), ("shard", "random access")),
    "second shard": (lambda: src().shard(0, 2).shard(0, 1), ("Shard", "sharded already")),
    # batch
    "batch 0": (lambda: src().batch(0), ("Batch", "batch_size")),
    "batch -3": (lambda: src().batch(-3), ("Batch", "batch_size")),
    "batch True": (lambda: src().batch(True), ("Batch", "batch_size")),
    "batch 2.0": (lambda: src().batch(2.0), ("Batch", "batch_size")),
    "batch 2.5": (lambda: src().batch(2.5), ("Batch", "batch_size")),
    "batch None": (lambda: src().batch(None), ("Batch", "batch_size")),
    "batch '8'": (lambda: src().batch("8"), ("Batch", "batch_size")),
    "batch collate_fn=5": (lambda: src().batch(2, collate_fn=5), ("Batch", "collate_fn")),
    "batch collate_fn='stack'": (lambda: src().batch(2, collate_fn="stack"), ("Batch", "collate_fn")),
    # repeat / even
    "repeat 0": (lambda: src().repeat(0), ("Repeat", "times")),
    "repeat -1": (lambda: src().repeat(-1), ("Repeat", "times")),
    "repeat True": (lambda: src().repeat(True), ("Repeat", "times")),
    "repeat 2.0": (lambda: src().repeat(2.0), ("Repeat", "times")),
    "repeat inf": (lambda: src().repeat(float("inf")), ("Repeat", "times")),
    "repeat twice": (lambda: src().repeat(2).repeat(2), ("Repeat",)),
    "even 0": (lambda: src().even(0), ("Even", "times")),
    "even True": (lambda: src().even(True), ("Even", "times")),
    "even 1.0": (lambda: src().even(1.0), ("Even", "times")),
    "even over a streaming filter": (lambda: src().filter(keep_all).even(), ("Even", "len")),
    "even after repeat": (lambda: src().repeat(2).even(), ("Even", "repeat")),
    # map
    "map None": (lambda: src().map(None), ("IndexedMap", "callable")),
    "map 5": (lambda: src().map(5), ("IndexedMap", "callable")),
    "streaming map 'upper'": (lambda: src().batch(1).map("upper"), ("Map", "callable")),
    "map num_workers=-1": (lambda: src().map(identity, num_workers=-1), ("ParallelMap", "num_workers")),
    "map num_workers=True": (lambda: src().map(identity, num_workers=True), ("ParallelMap", "num_workers")),
    "map num_workers=1.0": (lambda: src().map(identity, num_workers=1.0), ("ParallelMap", "num_workers")),
    "map num_workers='2'": (lambda: src().map(identity, num_workers="2"), ("ParallelMap", "num_workers")),
    "map mode='fiber'": (lambda: src().map(identity, num_workers=1, mode="fiber"), ("ParallelMap", "mode")),
    "map mode=None": (lambda: src().map(identity, num_workers=1, mode=None), ("ParallelMap", "mode")),
    "map process lambda": (
        lambda: src().map(lambda r: r, num_workers=1, mode="process"),
        ("ParallelMap", "picklable"),
    ),
    "map batched=1": (lambda: src().map(identity, num_workers=1, batched=1), ("ParallelMap", "batched")),
    "map batched without workers": (lambda: src().map(identity, batched=True), ("batched", "num_workers")),
    # filter
    "filter None": (lambda: src().filter(None), ("Filter", "callable")),
    "streaming filter 5": (lambda: src().batch(1).filter(5), ("Filter", "callable")),
    "filter index after batch": (lambda: src().batch(1).filter(keep_all, index=True), ("index=True", "random access")),
    "filter batched without index": (lambda: src().filter(keep_all, batched=True), ("batched", "index=True")),
    "filter index_key=5": (lambda: src().filter(keep_all, index=True, index_key=5), ("IndexedFilter", "index_key")),
    "filter num_proc=-1": (lambda: src().filter(keep_all, index=True, num_proc=-1), ("IndexedFilter", "num_proc")),
    "filter num_proc=True": (lambda: src().filter(keep_all, index=True, num_proc=True), ("IndexedFilter", "num_proc")),
    "filter progress='yes'": (
        lambda: src().filter(keep_all, index=True, progress="yes"),
        ("IndexedFilter", "progress"),
    ),
    "filter cache_dir=5": (lambda: src().filter(keep_all, index=True, cache_dir=5), ("IndexedFilter", "cache_dir")),
    # cache
    "cache max_bytes=-1": (lambda: src().cache(max_bytes=-1), ("Cache", "max_bytes")),
    "cache max_bytes=1.5": (lambda: src().cache(max_bytes=1.5), ("Cache", "max_bytes")),
    "cache max_bytes=True": (lambda: src().cache(max_bytes=True), ("Cache", "max_bytes")),
    "cache directory=5": (lambda: src().cache(directory=5), ("Cache", "directory")),
    "cache block_size=0": (lambda: N.Cache(src(), block_size=0), ("Cache", "block_size")),
    "cache after shuffle": (lambda: src().shuffle().cache(), ("Cache", "shuffle")),
    "cache after batch": (lambda: src().batch(2).cache(), ("Cache",)),
    # prefetch
    "prefetch 0": (lambda: src().prefetch(0), ("Prefetch", "buffer_size")),
    "prefetch -1": (lambda: src().prefetch(-1), ("Prefetch", "buffer_size")),
    "prefetch True": (lambda: src().prefetch(True), ("Prefetch", "buffer_size")),
    "prefetch 1.0": (lambda: src().prefetch(1.0), ("Prefetch", "buffer_size")),
    "prefetch None": (lambda: src().prefetch(None), ("Prefetch", "buffer_size")),
    # pack
    "pack seq_len=0": (lambda: rs.from_list(documents(3)).pack(0), ("Pack", "seq_len")),
    "pack seq_len=-4": (lambda: rs.from_list(documents(3)).pack(-4), ("Pack", "seq_len")),
    "pack seq_len=True": (lambda: rs.from_list(documents(3)).pack(True), ("Pack", "seq_len")),
    "pack seq_len=4.0": (lambda: rs.from_list(documents(3)).pack(4.0), ("Pack", "seq_len")),
    "pack seq_len=None": (lambda: rs.from_list(documents(3)).pack(None), ("Pack", "seq_len")),
    "pack strategy unknown": (lambda: rs.from_list(documents(3)).pack(4, strategy="worst_fit"), ("Pack", "strategy")),
    "pack strategy case": (lambda: rs.from_list(documents(3)).pack(4, strategy="Best_Fit"), ("Pack", "strategy")),
    "pack strategy None": (lambda: rs.from_list(documents(3)).pack(4, strategy=None), ("Pack", "strategy")),
    "pack strategy list": (lambda: rs.from_list(documents(3)).pack(4, strategy=["greedy"]), ("Pack", "strategy")),
    "pack buffer_size=0": (lambda: rs.from_list(documents(3)).pack(4, buffer_size=0), ("Pack", "buffer_size")),
    "pack buffer_size=True": (lambda: rs.from_list(documents(3)).pack(4, buffer_size=True), ("Pack", "buffer_size")),
    "pack buffer_size=1.0": (lambda: rs.from_list(documents(3)).pack(4, buffer_size=1.0), ("Pack", "buffer_size")),
    "pack overlong unknown": (lambda: rs.from_list(documents(3)).pack(4, overlong="wrap"), ("Pack", "overlong")),
    "pack split_positions unknown": (
        lambda: rs.from_list(documents(3)).pack(4, split_positions="keep"),
        ("Pack", "split_positions"),
    ),
    "pack mask_first_token=1": (
        lambda: rs.from_list(documents(3)).pack(4, mask_first_token=1),
        ("Pack", "mask_first_token"),
    ),
    "pack mask_first_token='no'": (
        lambda: rs.from_list(documents(3)).pack(4, mask_first_token="no"),
        ("Pack", "mask_first_token"),
    ),
    "pack max_documents=0": (lambda: rs.from_list(documents(3)).pack(4, max_documents=0), ("Pack", "max_documents")),
    "pack max_documents=True": (
        lambda: rs.from_list(documents(3)).pack(4, max_documents=True),
        ("Pack", "max_documents"),
    ),
    "pack pad_token_id=1.5": (lambda: rs.from_list(documents(3)).pack(4, pad_token_id=1.5), ("Pack", "pad_token_id")),
    "pack pad_token_id=True": (lambda: rs.from_list(documents(3)).pack(4, pad_token_id=True), ("Pack", "pad_token_id")),
    "pack pad_token_id=None": (lambda: rs.from_list(documents(3)).pack(4, pad_token_id=None), ("Pack", "pad_token_id")),
    "pack input_field=5": (lambda: rs.from_list(documents(3)).pack(4, input_field=5), ("Pack", "input_field")),
    "pack labels_field=5": (lambda: rs.from_list(documents(3)).pack(4, labels_field=5), ("Pack", "labels_field")),
    "pack token_fields='mask'": (
        lambda: rs.from_list(documents(3)).pack(4, token_fields="mask"),
        ("Pack", "token_fields"),
    ),
    "pack token_fields twice": (
        lambda: rs.from_list(documents(3)).pack(4, token_fields=["m", "m"]),
        ("Pack", "token_fields"),
    ),
    "pack token_fields row field": (
        lambda: rs.from_list(documents(3)).pack(4, token_fields=["position_ids"]),
        ("Pack", "token_fields"),
    ),
    "pack token pad nan": (
        lambda: rs.from_list(documents(3)).pack(4, token_fields={"m": float("nan")}),
        ("Pack", "m"),
    ),
    "pack document_fields=[1]": (
        lambda: rs.from_list(documents(3)).pack(4, document_fields=[1]),
        ("Pack", "document_fields"),
    ),
    "pack length_fn=5": (
        lambda: rs.from_list(documents(3)).pack(4, length_fn=5, overlong="drop"),
        ("Pack", "length_fn"),
    ),
    "pack length_fn with split": (lambda: rs.from_list(documents(3)).pack(4, length_fn=len), ("Pack", "overlong")),
    "pack bfd whole over a stream": (
        lambda: rs.from_list(documents(3)).filter(keep_all).pack(4, strategy="bfd"),
        ("Pack", "buffer_size"),
    ),
    "pack after batch": (lambda: rs.from_list(documents(3)).batch(2).pack(4), ("Pack", "last_key")),
    # mix
    "mix list": (lambda: rs.mix([src(), src()]), ("Mix", "dict")),
    "mix empty": (lambda: rs.mix({}), ("Mix", "empty")),
    "mix name ''": (lambda: rs.mix({"": src()}), ("Mix", "names")),
    "mix name 1": (lambda: rs.mix({1: src()}), ("Mix", "names")),
    "mix not a node": (lambda: rs.mix({"a": [1, 2]}), ("Mix[a]", "node")),
    "mix same node twice": (lambda: (lambda s: rs.mix({"a": s, "b": s}))(src()), ("Mix[b]", "twice")),
    "mix weight nan": (lambda: rs.mix({"a": src(), "b": src()}, weights={"a": float("nan"), "b": 1}), ("Mix[a]",)),
    "mix weight inf": (lambda: rs.mix({"a": src(), "b": src()}, weights={"a": float("inf"), "b": 1}), ("Mix[a]",)),
    "mix weight -inf": (lambda: rs.mix({"a": src(), "b": src()}, weights={"a": -float("inf"), "b": 1}), ("Mix[a]",)),
    "mix weight 10**400": (lambda: rs.mix({"a": src(), "b": src()}, weights={"a": 10**400, "b": 1}), ("Mix[a]",)),
    "mix weight -1": (lambda: rs.mix({"a": src(), "b": src()}, weights={"a": -1, "b": 1}), ("Mix[a]", "weight")),
    "mix weight True": (lambda: rs.mix({"a": src(), "b": src()}, weights={"a": True, "b": 1}), ("Mix[a]", "weight")),
    "mix weight '1'": (lambda: rs.mix({"a": src(), "b": src()}, weights={"a": "1", "b": 1}), ("Mix[a]", "weight")),
    "mix weight None": (lambda: rs.mix({"a": src(), "b": src()}, weights={"a": None, "b": 1}), ("Mix[a]", "weight")),
    "mix weights all 0": (lambda: rs.mix({"a": src(), "b": src()}, weights={"a": 0, "b": 0.0}), ("Mix", "positive")),
    "mix weights list": (lambda: rs.mix({"a": src(), "b": src()}, weights=[1, 1]), ("Mix", "weights")),
    "mix weights missing": (lambda: rs.mix({"a": src(), "b": src()}, weights={"a": 1}), ("Mix", "'b'")),
    "mix weights unknown": (lambda: rs.mix({"a": src()}, weights={"a": 1, "z": 1}), ("Mix", "'z'")),
    "mix seed -1": (lambda: rs.mix({"a": src()}, seed=-1), ("Mix", "seed")),
    "mix seed True": (lambda: rs.mix({"a": src()}, seed=True), ("Mix", "seed")),
    "mix seed 0.5": (lambda: rs.mix({"a": src()}, seed=0.5), ("Mix", "seed")),
    "mix on_end unknown": (lambda: rs.mix({"a": src()}, on_end="loop"), ("Mix", "on_end")),
    "mix on_end None": (lambda: rs.mix({"a": src()}, on_end=None), ("Mix", "on_end")),
    "mix schedule unknown": (lambda: rs.mix({"a": src()}, schedule="fair"), ("Mix", "schedule")),
    # sources: options
    "from_list None": (lambda: rs.from_list(None), ("FromList",)),
    "from_list 5": (lambda: rs.from_list(5), ("FromList",)),
    "from_list generator": (lambda: rs.from_list(x for x in range(3)), ("FromList", "list(records)")),
    "from_list dict": (lambda: rs.from_list({"a": 1}), ("FromList",)),
    "from_list set": (lambda: rs.from_list({1, 2}), ("FromList",)),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_wrong_value_is_a_config_error_naming_node_and_option_when_built(case: str) -> None:
    build, words = REFUSED[case]
    config_error(build, *words)


@pytest.fixture
def jsonl_file(tmp_path: Path) -> str:
    return write_jsonl(tmp_path / "data.jsonl", records(6))


SOURCE_OPTIONS: dict[str, tuple[Callable[[str], Any], tuple[str, ...]]] = {
    "jsonl on_error='ignore'": (lambda p: rs.jsonl(p, on_error="ignore"), ("JsonlSource", "on_error")),
    "jsonl on_error=None": (lambda p: rs.jsonl(p, on_error=None), ("JsonlSource", "on_error")),
    "jsonl on_error=True": (lambda p: rs.jsonl(p, on_error=True), ("JsonlSource", "on_error")),
    "jsonl cache_dir=5": (lambda p: rs.jsonl(p, cache_dir=5), ("JsonlSource", "cache_dir")),
    "jsonl block_bytes=0": (lambda p: rs.jsonl(p, block_bytes=0), ("JsonlSource", "block_bytes")),
    "jsonl cache_bytes<block": (
        lambda p: rs.jsonl(p, block_bytes=1 << 20, cache_bytes=1 << 10),
        ("JsonlSource", "cache_bytes"),
    ),
    "jsonl disk_cache_bytes=-1": (lambda p: rs.jsonl(p, disk_cache_bytes=-1), ("JsonlSource", "disk_cache_bytes")),
    "jsonl storage_options local": (lambda p: rs.jsonl(p, storage_options={}), ("JsonlSource", "storage_options")),
    "jsonl filesystem junk": (lambda p: rs.jsonl(p, filesystem="local"), ("JsonlSource", "filesystem")),
    "stream on_error='warn'": (lambda p: rs.jsonl_stream(p, on_error="warn"), ("JsonlStream", "on_error")),
    "stream shuffle_files=True": (lambda p: rs.jsonl_stream(p, shuffle_files=True), ("JsonlStream", "shuffle_files")),
    "stream shuffle_files=1.0": (lambda p: rs.jsonl_stream(p, shuffle_files=1.0), ("JsonlStream", "shuffle_files")),
    "stream chunk_bytes=0": (lambda p: rs.jsonl_stream(p, chunk_bytes=0), ("JsonlStream", "chunk_bytes")),
    "stream chunk_bytes=True": (lambda p: rs.jsonl_stream(p, chunk_bytes=True), ("JsonlStream", "chunk_bytes")),
    "stream rank only": (lambda p: rs.jsonl_stream(p, rank=0), ("JsonlStream", "rank", "world_size")),
    "stream rank=world_size": (lambda p: rs.jsonl_stream(p, rank=3, world_size=3), ("JsonlStream", "rank")),
    "stream world_size=0": (lambda p: rs.jsonl_stream(p, rank=0, world_size=0), ("JsonlStream", "world_size")),
    "stream rank=True": (lambda p: rs.jsonl_stream(p, rank=True, world_size=2), ("JsonlStream", "rank")),
    "stream then shard": (lambda p: rs.jsonl_stream(p).shard(0, 2), ("shard", "random access")),
    "stream then shuffle": (lambda p: rs.jsonl_stream(p).shuffle(seed=0), ("shuffle", "random access")),
    "local and url mixed": (lambda p: rs.jsonl([p, "s3://bucket/x.jsonl"]), ("JsonlSource", "mix")),
}


@pytest.mark.parametrize("case", sorted(SOURCE_OPTIONS))
def test_a_wrong_source_option_is_a_config_error_naming_it(case: str, jsonl_file: str) -> None:
    build, words = SOURCE_OPTIONS[case]
    error = pytest.raises(rs.ResumableError, build, jsonl_file).value
    assert isinstance(error, rs.ConfigError), repr(error)
    for word in words:
        assert word in str(error), f"{word!r} not named in {error}"


def test_parquet_options_are_config_errors_naming_them(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "data.parquet", records(6))
    config_error(lambda: rs.parquet(path, columns="x"), "ParquetSource", "columns")
    config_error(lambda: rs.parquet(path, columns=["x", None]), "ParquetSource", "columns")
    config_error(lambda: rs.parquet(path, cache_row_groups=0), "ParquetSource", "cache_row_groups")
    config_error(lambda: rs.parquet(path, cache_row_groups=True), "ParquetSource", "cache_row_groups")
    config_error(lambda: rs.parquet(path, block_bytes=-1), "ParquetSource", "block_bytes")
    config_error(lambda: rs.arrow(path, cache_bytes=0), "ArrowSource", "cache_bytes")


def test_paths_that_match_nothing_or_hold_nothing_are_source_errors_naming_them(tmp_path: Path) -> None:
    """A missing file, a glob that matches nothing, a directory, an empty file, an empty list:
    SourceError at construction naming the path, for every file source (an empty or blank-only
    JSONL file alone is no records; a Parquet/Arrow reader refuses a file of another format)."""
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    blank = tmp_path / "blank.jsonl"
    blank.write_bytes(b"\n \n\t\r\n")
    good = write_jsonl(tmp_path / "good.jsonl", records(3))
    missing = str(tmp_path / "missing.jsonl")
    nothing = str(tmp_path / "*.nothing")
    for make in (rs.jsonl, rs.parquet, rs.arrow, rs.jsonl_stream):
        for paths, named in (
            (missing, missing),
            (nothing, nothing),
            (str(tmp_path), str(tmp_path)),
            ([good, missing], missing),
        ):
            with pytest.raises(rs.SourceError) as caught:
                make(paths)
            assert named in str(caught.value), (make, paths, caught.value)
        with pytest.raises(rs.SourceError, match="no paths"):
            make([])
    for paths in (str(empty), str(blank), [str(empty), str(blank)]):
        with pytest.raises(rs.SourceError, match="no records"):
            rs.jsonl(paths)
    for make in (rs.parquet, rs.arrow):
        for path in (str(empty), good):
            with pytest.raises(rs.SourceError) as caught:
                make(path)
            assert path in str(caught.value)


def test_an_empty_file_among_others_contributes_nothing_and_resumes(tmp_path: Path) -> None:
    empty = tmp_path / "b_empty.jsonl"
    empty.write_bytes(b"")
    first = write_jsonl(tmp_path / "a.jsonl", records(3))
    last = write_jsonl(tmp_path / "c.jsonl", [{"x": 10}])
    expected = records(3) + [{"x": 10}]
    assert list(rs.jsonl([first, str(empty), last])) == expected
    assert list(rs.jsonl(str(tmp_path / "*.jsonl"))) == expected
    assert list(rs.jsonl_stream([first, str(empty), last])) == expected
    check_every_point(lambda: rs.jsonl([first, str(empty), last]).shuffle(seed=4).shard(0, 1), 4)
    check_every_point(lambda: rs.jsonl_stream([first, str(empty), last], shuffle_files=3), 4)


def test_a_stream_over_only_empty_files_yields_nothing_and_resumes(tmp_path: Path) -> None:
    """rs.jsonl_stream cannot count records at construction (gzip), so files without records
    make an empty stream, through every node that may follow it."""
    plain_empty = tmp_path / "empty.jsonl"
    plain_empty.write_bytes(b"")
    gz_empty = tmp_path / "empty.jsonl.gz"
    gz_empty.write_bytes(gzip.compress(b""))
    paths = [str(plain_empty), str(gz_empty)]
    assert list(rs.jsonl_stream(paths)) == []
    for build in (
        lambda: rs.jsonl_stream(paths),
        lambda: rs.jsonl_stream(paths, shuffle_files=2, rank=1, world_size=3).batch(2),
        lambda: rs.jsonl_stream(paths).filter(keep_all).map(identity).repeat(),
        lambda: rs.jsonl_stream(paths).pack(4, strategy="greedy", buffer_size=1),
        lambda: rs.jsonl_stream(paths).prefetch(1),
    ):
        assert check_every_point(build, 0) == []


# -- 1b. bugs: wrong values that are not refused as they should be -----------------------------


@pytest.mark.parametrize("make", ["jsonl", "parquet", "arrow", "jsonl_stream"])
def test_paths_of_the_wrong_type_are_config_errors(make: str, jsonl_file: str) -> None:
    source = getattr(rs, make)
    for paths in (None, 123, 1.5, jsonl_file.encode(), [jsonl_file, None], [jsonl_file, 7]):
        with pytest.raises(rs.ResumableError):
            source(paths)


def test_parquet_columns_that_are_not_a_list_are_config_errors(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "data.parquet", records(4))
    for columns in (5, 1.0, True):
        config_error(lambda: rs.parquet(path, columns=columns), "ParquetSource", "columns")


@pytest.mark.parametrize(
    "block_size, window",
    [(2**63, None), (2**100, 1), (1, 2**63), (2**61, 4), (2**40, 2**30)],
    ids=["block 2**63", "block 2**100", "window 2**63", "block 2**61 x window 4", "block 2**40 x window 2**30"],
)
def test_block_shuffle_sizes_past_int64_are_refused_or_work(block_size: int, window: int | None) -> None:
    """A block larger than the epoch is one block: a huge one is as valid as n + 1, or refused
    when built; never an OverflowError at the first record."""
    try:
        pipe = src(10).shuffle(seed=1, block_size=block_size, window=window)
    except rs.ConfigError as error:
        assert "BlockShuffle" in str(error)
        return
    assert sorted(item["x"] for item in pipe) == list(range(10))


@pytest.mark.parametrize("world_size", [2**63, 2**100])
def test_a_world_size_past_int64_is_refused_or_reads_its_share(world_size: int) -> None:
    try:
        pipe = src(10).shard(0, world_size)
    except rs.ConfigError as error:
        assert "Shard" in str(error) and "world_size" in str(error)
        return
    assert len(pipe) == 1
    assert list(pipe) == [{"x": 0}]


def test_a_world_size_just_below_int64_reads_its_share_and_resumes() -> None:
    assert list(src(10).shard(0, 2**63 - 1)) == [{"x": 0}]
    assert list(src(10).shard(2**62, 2**63 - 1)) == []
    check_every_point(lambda: src(10).shuffle(seed=2).shard(3, 2**62).repeat(2), 1)


@pytest.mark.parametrize("pad", [2**63, -(2**63) - 1, 2**100])
def test_a_pad_token_id_that_int64_rows_cannot_hold_is_a_config_error(pad: int) -> None:
    config_error(lambda: rs.from_list(documents(3)).pack(4, pad_token_id=pad), "Pack", "pad_token_id")


def test_pad_token_ids_at_the_int64_bounds_and_negative_ones_fill_the_padding() -> None:
    for pad in (2**63 - 1, -(2**63), -1):
        row = next(iter(rs.from_list([{"input_ids": [5]}]).pack(3, pad_token_id=pad, strategy="greedy")))
        assert row["input_ids"].tolist() == [5, pad, pad]
        assert row["labels"].tolist() == [5, -100, -100]


def test_a_seq_len_no_row_can_have_is_a_config_error_when_built() -> None:
    config_error(lambda: rs.from_list(documents(3)).pack(2**63), "Pack", "seq_len")


def test_a_negative_shuffle_files_seed_is_refused_when_the_stream_is_built(jsonl_file: str) -> None:
    config_error(lambda: rs.jsonl_stream(jsonl_file, shuffle_files=-1), "JsonlStream", "shuffle_files")


def test_seeds_up_to_64_bits_are_accepted_and_resume_and_larger_ones_are_refused(jsonl_file: str) -> None:
    """Orders are keyed by 64 bits: a seed past them would repeat a smaller seed's order."""
    for build, kind in [
        (lambda seed: src(3).shuffle(seed=seed), "Shuffle"),
        (lambda seed: src(3).shuffle(seed=seed, block_size=2), "BlockShuffle"),
        (lambda seed: rs.mix({"a": src(3)}, seed=seed), "Mix"),
        (lambda seed: rs.jsonl_stream(jsonl_file, shuffle_files=seed), "JsonlStream"),
    ]:
        for seed in (2**64, 2**64 + 5, 2**100):
            config_error(functools.partial(build, seed), kind, "seed" if kind != "JsonlStream" else "shuffle_files")
    for seed in (2**63, 2**64 - 1, np.uint64(2**64 - 1)):
        order = [item["x"] for item in src(10).shuffle(seed=seed)]
        assert sorted(order) == list(range(10))
        check_every_point(lambda: src(7).shuffle(seed=seed).repeat(2), 7)
        check_every_point(lambda: src(7).shuffle(seed=seed, block_size=2, window=2).repeat(2), 7)
        check_every_point(lambda: rs.mix({"a": src(3), "b": src(4)}, seed=seed, schedule="random"), 6)


def test_huge_counts_that_are_bounds_only_work() -> None:
    """batch_size, buffer sizes, max_documents, repeat/even times and cache sizes far past the
    data are bounds that are never reached: accepted, and the pipeline reads as with small ones."""
    assert [len(b) for b in src(10).batch(2**63)] == [10]
    assert list(src(10).batch(2**100, drop_last=True)) == []
    assert len(src(10).batch(2**63)) == 1
    assert [item["x"] for item in islice(src(3).repeat(2**100), 7)] == [0, 1, 2, 0, 1, 2, 0]
    assert [item["x"] for item in islice(src(3).even(times=2**100), 7)] == [0, 1, 2]
    assert [item["x"] for item in src(3).prefetch(2**63)] == [0, 1, 2]
    assert [item["x"] for item in src(3).cache(max_bytes=2**100)] == [0, 1, 2]
    small = [plain(row) for row in rs.from_list(documents(6)).pack(6, buffer_size=8, max_documents=8)]
    huge = [plain(row) for row in rs.from_list(documents(6)).pack(6, buffer_size=2**63, max_documents=2**63)]
    for a, b in zip(small, huge):
        assert a["input_ids"] == b["input_ids"]
    check_every_point(lambda: src(5).batch(2**63).repeat(3), 1)


@pytest.mark.parametrize("option", ["batch drop_last", "shard split_workers", "stream split_workers", "filter index"])
@pytest.mark.parametrize("value", ["false", "no", 2])
def test_a_flag_that_is_not_a_bool_is_a_config_error(option: str, value: Any, jsonl_file: str) -> None:
    """mask_first_token, batched and progress refuse non-bools; the other flags should too, as
    a string from a config ('false') is true."""
    builds = {
        "batch drop_last": lambda: src().batch(3, drop_last=value),
        "shard split_workers": lambda: src().shard(0, 1, split_workers=value),
        "stream split_workers": lambda: rs.jsonl_stream(jsonl_file, split_workers=value),
        "filter index": lambda: src().filter(keep_all, index=value, progress=False),
    }
    config_error(builds[option], option.split()[-1])


def test_flags_take_numpy_bools_and_refuse_ints() -> None:
    """Every flag takes a bool, Python's or numpy's, and refuses what is only truthy or falsy."""
    assert [len(b) for b in src(7).batch(3, drop_last=np.True_)] == [3, 3]
    assert [len(b) for b in src(7).batch(3, drop_last=np.False_)] == [3, 3, 1]
    masked = next(rs.from_list(documents(2)).pack(4, mask_first_token=np.True_))
    expected = next(rs.from_list(documents(2)).pack(4, mask_first_token=True))
    assert masked.keys() == expected.keys()
    assert all(np.array_equal(masked[key], expected[key]) for key in expected)
    for value in (0, 1):
        config_error(lambda: src(7).batch(3, drop_last=value), "Batch", "drop_last")
        config_error(lambda: rs.from_list(documents(2)).pack(4, mask_first_token=value), "Pack", "mask_first_token")


@pytest.mark.parametrize("num_workers", [0, None])
def test_an_unknown_map_mode_is_refused_whatever_num_workers(num_workers: Any) -> None:
    config_error(lambda: src().map(identity, num_workers=num_workers, mode="procss"), "mode")


@pytest.mark.parametrize("node", ["cache", "filter"])
def test_an_empty_directory_string_does_not_write_into_the_current_directory(
    node: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    try:
        if node == "cache":
            pipe = src(4).cache(directory="")
        else:
            pipe = src(4).filter(keep_all, index=True, cache_dir="", progress=False)
    except rs.ConfigError:
        return
    assert [item["x"] for item in pipe] == [0, 1, 2, 3]
    assert sorted(os.listdir(cwd)) == []


# -- 1c. nodes built directly with an upstream that is not a node --------------------------------

INDEXED_CLASSES: dict[str, Callable[[Any], Any]] = {
    "Shuffle": lambda up: N.Shuffle(up, seed=0),
    "BlockShuffle": lambda up: N.BlockShuffle(up, seed=0, block_size=2),
    "Shard": lambda up: N.Shard(up, 0, 1),
    "IndexedMap": lambda up: N.IndexedMap(up, identity),
    "IndexedFilter": lambda up: N.IndexedFilter(up, keep_all, progress=False),
}
PLAIN_CLASSES: dict[str, Callable[[Any], Any]] = {
    "Map": lambda up: N.Map(up, identity),
    "Filter": lambda up: N.Filter(up, keep_all),
    "Batch": lambda up: N.Batch(up, 2),
    "Repeat": lambda up: N.Repeat(up, 2),
    "Even": lambda up: N.Even(up),
    "Prefetch": lambda up: N.Prefetch(up, 2),
    "ParallelMap": lambda up: N.ParallelMap(up, identity, 1),
    "Pack": lambda up: N.Pack(up, 4),
    "Cache": lambda up: N.Cache(up),
}
NOT_A_NODE = {"list": [{"x": 1}], "str": "data.jsonl", "dict": {"x": 1}, "source class": N.FromList}
NOT_A_NODE_OBJECT = ("list", "str", "dict")  # a node class has a kind, so it is named as not indexed


@pytest.mark.parametrize("upstream", sorted(NOT_A_NODE))
@pytest.mark.parametrize("name", sorted(PLAIN_CLASSES))
def test_a_node_built_directly_over_a_non_node_is_a_config_error(name: str, upstream: str) -> None:
    config_error(lambda: PLAIN_CLASSES[name](NOT_A_NODE[upstream]), name)


@pytest.mark.parametrize("upstream", NOT_A_NODE_OBJECT)
@pytest.mark.parametrize("name", sorted(INDEXED_CLASSES))
def test_an_indexed_node_built_directly_over_a_non_node_is_a_config_error(name: str, upstream: str) -> None:
    config_error(lambda: INDEXED_CLASSES[name](NOT_A_NODE[upstream]), name)


@pytest.mark.parametrize("name", sorted({**INDEXED_CLASSES, **PLAIN_CLASSES}))
def test_a_node_built_directly_over_none_is_a_config_error(name: str) -> None:
    build = {**INDEXED_CLASSES, **PLAIN_CLASSES}[name]
    config_error(lambda: build(None), name)


# -- 2. numpy scalars and int subclasses ------------------------------------------------------


class Size(enum.IntEnum):
    ONE = 1
    TWO = 2
    THREE = 3
    FOUR = 4


NUMERIC_OPTIONS: dict[str, Callable[[Any], rs.Node[Any]]] = {
    "shuffle seed": lambda v: src(9).shuffle(seed=v),
    "block_size": lambda v: src(9).shuffle(seed=1, block_size=v),
    "window": lambda v: src(9).shuffle(seed=1, block_size=2, window=v),
    "shard rank": lambda v: src(9).shard(v, 4),
    "shard world_size": lambda v: src(9).shard(1, v),
    "batch_size": lambda v: src(9).batch(v),
    "repeat times": lambda v: src(3).repeat(v),
    "even times": lambda v: src(3).even(v),
    "prefetch buffer_size": lambda v: src(9).prefetch(v),
    "map num_workers": lambda v: src(9).map(identity, num_workers=v),
    "cache max_bytes": lambda v: src(9).cache(max_bytes=v),
    "pack seq_len": lambda v: rs.from_list(documents(6)).pack(v, buffer_size=3),
    "pack buffer_size": lambda v: rs.from_list(documents(6)).pack(5, buffer_size=v),
    "pack max_documents": lambda v: rs.from_list(documents(6)).pack(5, max_documents=v, buffer_size=3),
    "pack pad_token_id": lambda v: rs.from_list(documents(6)).pack(5, pad_token_id=v, buffer_size=3),
    "mix seed": lambda v: rs.mix({"a": src(3), "b": src(4)}, seed=v),
}


def json_only(value: Any) -> bool:
    """Whether ``value`` is made of exact JSON types (no numpy scalars, no int subclasses)."""
    if isinstance(value, dict):
        return all(type(k) is str and json_only(v) for k, v in value.items())
    if isinstance(value, list):
        return all(json_only(v) for v in value)
    return value is None or type(value) in (str, int, float, bool)


def check_like_the_int(build: Callable[[Any], rs.Node[Any]], value: Any, as_int: int) -> None:
    """A pipeline built with ``value`` yields and saves exactly what one built with the int does,
    and each restores the other's state."""
    expected_pipe = build(as_int)
    expected = [plain(item) for item in take(expected_pipe, 12)]
    pipe = build(value)
    head = [plain(item) for item in take(pipe, 5)]
    state = pipe.get_state()
    json.dumps(state)
    int_pipe = build(as_int)
    take(int_pipe, 5)
    assert roundtrip(state) == roundtrip(int_pipe.get_state())
    resumed = build(value)
    resumed.set_state(roundtrip(int_pipe.get_state()))
    assert head + [plain(item) for item in take(resumed, 7)] == expected
    for node in (expected_pipe, pipe, int_pipe, resumed):
        node.close()


@pytest.mark.parametrize("option", sorted(NUMERIC_OPTIONS))
def test_numpy_integer_options_behave_as_the_ints_they_hold(option: str) -> None:
    build = NUMERIC_OPTIONS[option]
    for scalar in (np.int64(2), np.int32(2), np.uint8(2)):
        check_like_the_int(build, scalar, 2)


@pytest.mark.parametrize("option", sorted(NUMERIC_OPTIONS))
def test_int_subclass_options_behave_as_the_ints_they_hold_and_save_plain_json(option: str) -> None:
    """An IntEnum is an int: accepted, and what the pipeline yields and saves is the int's."""
    check_like_the_int(NUMERIC_OPTIONS[option], Size.TWO, 2)


def test_int_subclass_options_save_their_int_values() -> None:
    pipe = src(9).shuffle(seed=Size.THREE).shard(Size.ONE, Size.FOUR).batch(Size.TWO)
    next(pipe)
    text = json.dumps(pipe.get_state())
    assert '"seed": 3' in text and '"batch_size": 2' in text and '"world_size": 4' in text


def test_numpy_mix_weights_are_plain_floats_in_the_state_and_mix_as_floats() -> None:
    def build(weights: dict[str, Any]) -> rs.Node[Any]:
        return rs.mix({"a": src(30), "b": src(30)}, weights=weights, seed=3)

    as_floats = [item["x"] for item in islice(build({"a": 3.0, "b": 1.0}), 20)]
    for weights in (
        {"a": np.float64(3), "b": np.float64(1)},
        {"a": np.int64(3), "b": np.int32(1)},
        {"a": np.float32(3), "b": 1},
    ):
        pipe = build(weights)
        assert [item["x"] for item in islice(pipe, 20)] == as_floats
        state = pipe.get_state()
        assert json_only(state), state
        check_every_point(lambda: build(weights), 40, epochs=1)


def test_numpy_and_bool_scalars_for_sizes_never_pass_silently() -> None:
    """Whatever a node does with numpy scalars, a bool never stands for 1 and a numpy float
    never for an int: each is refused by name."""
    config_error(lambda: src().batch(np.True_), "Batch", "batch_size")
    config_error(lambda: src().batch(np.float64(2.0)), "Batch", "batch_size")
    config_error(lambda: src().shuffle(seed=np.True_), "Shuffle", "seed")
    config_error(lambda: src().shard(np.False_, 2), "Shard", "rank")
    config_error(lambda: src().repeat(np.float32(2)), "Repeat", "times")
    config_error(lambda: rs.from_list(documents(2)).pack(np.float64(4)), "Pack", "seq_len")
    config_error(lambda: rs.mix({"a": src()}, weights={"a": np.True_}), "Mix[a]", "weight")


# -- 3. odd but valid values: what they yield ---------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 5, 9])
def test_more_ranks_than_records_give_one_record_to_the_first_ranks_and_none_to_the_rest(n: int) -> None:
    world_size = n + 3
    shares = [[item["x"] for item in src(n).shuffle(seed=7).shard(rank, world_size)] for rank in range(world_size)]
    assert sorted(x for share in shares for x in share) == list(range(n))
    assert [len(share) for share in shares] == [1] * n + [0] * 3
    assert [len(src(n).shard(rank, world_size)) for rank in range(world_size)] == [1] * n + [0] * 3


def test_more_stream_consumers_than_files_leave_some_empty(tmp_path: Path) -> None:
    paths = [write_jsonl(tmp_path / f"{i}.jsonl", records(3)[i : i + 1]) for i in range(3)]
    shares = [[item["x"] for item in rs.jsonl_stream(paths, rank=rank, world_size=5)] for rank in range(5)]
    assert shares == [[0], [1], [2], [], []]
    for rank in (0, 4):
        check_every_point(lambda: rs.jsonl_stream(paths, shuffle_files=1, rank=rank, world_size=5).repeat(3), 1)


@pytest.mark.parametrize(
    "block_size, window",
    [(1, 1), (1, None), (None, 1), (9, 1), (9, 9), (10, 1), (1000, 1), (1000, 1000), (3, 1000)],
)
def test_block_shuffle_extremes_are_permutations_that_change_by_epoch(
    block_size: int | None, window: int | None
) -> None:
    pipe = src(9).shuffle(seed=11, block_size=block_size, window=window)
    epochs = [[item["x"] for item in pipe] for _ in range(4)]
    for order in epochs:
        assert sorted(order) == list(range(9))
    assert len({tuple(order) for order in epochs}) > 1, "every epoch in the same order"
    check_every_point(lambda: src(9).shuffle(seed=11, block_size=block_size, window=window), 9)


def test_row_group_blocks_with_a_window_past_the_row_groups(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "data.parquet", records(7), row_group_size=2)
    for window in (1, 4, 1000):
        order = [item["x"] for item in rs.parquet(path).shuffle(seed=3, block_size="row_group", window=window)]
        assert sorted(order) == list(range(7))
        check_every_point(lambda: rs.parquet(path).shuffle(seed=3, block_size="row_group", window=window), 7)
    single = write_parquet(tmp_path / "single.parquet", records(5), row_group_size=100)
    order = [item["x"] for item in rs.parquet(single).shuffle(seed=3, block_size="row_group", window=1)]
    assert sorted(order) == list(range(5))


@pytest.mark.parametrize("n, batch_size", [(1, 2), (5, 6), (5, 100), (7, 7)])
def test_a_batch_larger_than_the_epoch_is_the_whole_epoch_or_nothing_with_drop_last(n: int, batch_size: int) -> None:
    assert [[item["x"] for item in b] for b in src(n).batch(batch_size)] == [list(range(n))]
    assert len(src(n).batch(batch_size)) == 1
    dropped = list(src(n).batch(batch_size, drop_last=True))
    assert dropped == ([] if n < batch_size else [records(n)])
    assert len(src(n).batch(batch_size, drop_last=True)) == len(dropped)
    check_every_point(lambda: src(n).batch(batch_size, drop_last=True).repeat(3), len(dropped))
    check_every_point(lambda: src(n).batch(batch_size), 1)


@pytest.mark.parametrize("n, batch_size", [(7, 3), (5, 2), (1, 2), (9, 8)])
def test_drop_last_drops_exactly_the_one_short_batch(n: int, batch_size: int) -> None:
    batches = [[item["x"] for item in b] for b in src(n).batch(batch_size, drop_last=True)]
    whole = n // batch_size
    assert batches == [list(range(i * batch_size, (i + 1) * batch_size)) for i in range(whole)]
    assert len(src(n).batch(batch_size, drop_last=True)) == whole
    check_every_point(lambda: src(n).shuffle(seed=2).batch(batch_size, drop_last=True), whole)
    # batches after repeat() run across epoch boundaries: only the run's last short batch is dropped
    assert len(list(islice(src(n).repeat(3).batch(batch_size, drop_last=True), 100))) == 3 * n // batch_size


def test_repeat_once_is_one_epoch_and_iterating_again_is_the_next() -> None:
    pipe = src(5).shuffle(seed=1).repeat(1)
    alone = src(5).shuffle(seed=1)
    for _ in range(3):
        assert list(pipe) == list(alone)
    assert len(src(5).repeat(1)) == 5
    check_every_point(lambda: src(5).shuffle(seed=1).repeat(1), 5)


def test_even_needs_no_process_group_on_one_rank() -> None:
    """Without torch.distributed each epoch is the upstream's, in full, with no carry."""
    pipe = src(5).shuffle(seed=3).even()
    alone = src(5).shuffle(seed=3)
    for _ in range(3):
        assert list(pipe) == list(alone)
    assert pipe.leftover == 0
    once = src(5).even(times=1)
    assert len(list(once)) == 5 and list(once) == []
    check_every_point(lambda: src(5).shuffle(seed=3).shard(1, 2).batch(2).even(), 2)
    check_every_point(lambda: src(5).even(times=1), 5)


@pytest.mark.parametrize("strategy", ["greedy", "first_fit", "best_fit", "bfd"])
@pytest.mark.parametrize("overlong", ["split", "truncate", "drop"])
def test_seq_len_one_and_buffer_size_one_pack_every_token_alone(strategy: str, overlong: str) -> None:
    docs = documents(6)
    rows = [plain(row) for row in rs.from_list(docs).pack(1, strategy=strategy, buffer_size=1, overlong=overlong)]
    tokens = [row["input_ids"][0] for row in rows]
    if overlong == "split":
        assert sorted(tokens) == sorted(t for d in docs for t in d["input_ids"])
    elif overlong == "truncate":
        assert sorted(tokens) == sorted(d["input_ids"][0] for d in docs)
    else:
        assert sorted(tokens) == sorted(d["input_ids"][0] for d in docs if len(d["input_ids"]) == 1)
    for row in rows:
        assert row["position_ids"] == [0] and row["document_ids"] == [1] and row["cu_seqlens"] == [0, 1]
    check_every_point(
        lambda: rs.from_list(docs).shuffle(seed=5).pack(1, strategy=strategy, buffer_size=1, overlong=overlong),
        len(rows),
    )


@pytest.mark.parametrize("strategy", ["greedy", "first_fit", "best_fit", "bfd"])
def test_buffer_size_one_and_max_documents_one_give_one_document_per_row(strategy: str) -> None:
    docs = documents(7)
    build = lambda: rs.from_list(docs).pack(5, strategy=strategy, buffer_size=1, max_documents=1)  # noqa: E731
    rows = [plain(row) for row in build()]
    assert len(rows) == len(docs)
    for row in rows:
        assert max(row["document_ids"]) == 1
        assert len(row["cu_seqlens"]) == 3
    assert sorted(t for row in rows for t in row["input_ids"] if t) == sorted(t for d in docs for t in d["input_ids"])
    check_every_point(build, len(rows))


def test_a_whole_epoch_bfd_plan_at_seq_len_one_has_a_len_and_resumes() -> None:
    docs = documents(4)
    tokens = sum(len(d["input_ids"]) for d in docs)
    pipe = rs.from_list(docs).shuffle(seed=2).pack(1, strategy="bfd")
    assert len(pipe) == tokens
    assert len(list(pipe)) == tokens
    check_every_point(lambda: rs.from_list(docs).shuffle(seed=2).pack(1, strategy="bfd"), tokens)


def test_window_one_block_one_and_world_size_past_records_on_every_file_source(tmp_path: Path) -> None:
    rows = records(5)
    sources = {
        "jsonl": lambda: rs.jsonl(write_once(tmp_path / "d.jsonl", lambda p: write_jsonl(p, rows))),
        "parquet": lambda: rs.parquet(write_once(tmp_path / "d.parquet", lambda p: write_parquet(p, rows, 1))),
        "arrow": lambda: rs.arrow(write_once(tmp_path / "d.arrow", lambda p: write_arrow(p, rows))),
    }
    for name, source in sources.items():
        for rank in (0, 4, 7):
            build = lambda: source().shuffle(seed=9, block_size=1, window=1).shard(rank, 8).batch(3)  # noqa: E731
            expected = [] if rank >= 5 else [1]
            assert [len(b) for b in build()] == expected, name
            check_every_point(build, len(expected))


def write_once(path: Path, write: Callable[[Path], str]) -> str:
    return str(path) if path.exists() else write(path)


# -- 4. empty and one-record sources through every node, resumed everywhere ---------------------

CHAINS: dict[str, Callable[[rs.Node[Any]], rs.Node[Any]]] = {
    "source": lambda s: s,
    "shuffle": lambda s: s.shuffle(seed=3),
    "shuffle window=1 block_size=1": lambda s: s.shuffle(seed=3, block_size=1, window=1),
    "shuffle block past the epoch": lambda s: s.shuffle(seed=3, block_size=50, window=7),
    "shard past the records": lambda s: s.shard(2, 3),
    "shard first of many": lambda s: s.shuffle(seed=1).shard(0, 5),
    "map": lambda s: s.map(identity),
    "parallel map 1 thread": lambda s: s.map(identity, num_workers=1),
    "parallel map batched": lambda s: s.map(lambda b: list(b), num_workers=1, batched=True),
    "streaming filter keeps none": lambda s: s.filter(keep_none),
    "streaming filter keeps all": lambda s: s.batch(1).filter(keep_all),
    "indexed filter then shuffle": lambda s: s.filter(keep_all, index=True, progress=False).shuffle(seed=2),
    "indexed filter keeps none": lambda s: s.filter(keep_none, index=True, progress=False),
    "batch past the epoch": lambda s: s.batch(4),
    "batch drop_last": lambda s: s.batch(2, drop_last=True),
    "repeat 1": lambda s: s.repeat(1),
    "repeat": lambda s: s.shuffle(seed=5).repeat(),
    "even": lambda s: s.even(),
    "even times 1": lambda s: s.shuffle(seed=5).even(times=1),
    "cache max_bytes 0": lambda s: s.cache(max_bytes=0),
    "cache max_bytes 1": lambda s: s.cache(max_bytes=1).shuffle(seed=1),
    "prefetch 1": lambda s: s.prefetch(1),
    "mix of one": lambda s: rs.mix({"only": s}),
    "mix with a zero weight": lambda s: rs.mix({"a": s, "z": src(2)}, weights={"a": 1, "z": 0}),
    "mix drop": lambda s: rs.mix({"a": s, "b": src(2)}, on_end="drop", schedule="random"),
    "mix restart": lambda s: rs.mix({"a": s, "b": src(1)}, on_end="restart"),
}
PACKS: dict[str, Callable[[rs.Node[Any]], rs.Node[Any]]] = {
    "pack greedy 1": lambda s: s.pack(1, strategy="greedy", buffer_size=1),
    "pack first_fit 1": lambda s: s.pack(1, strategy="first_fit", buffer_size=1),
    "pack best_fit 1": lambda s: s.pack(2, strategy="best_fit", buffer_size=1),
    "pack bfd window 1": lambda s: s.pack(3, strategy="bfd", buffer_size=1, max_documents=1),
    "pack bfd whole": lambda s: s.shuffle(seed=1).pack(2, strategy="bfd"),
    "pack after repeat": lambda s: s.repeat(2).pack(4, buffer_size=1, overlong="truncate"),
    "pack after mix": lambda s: rs.mix({"a": s, "b": rs.from_list(documents(1))}).pack(3, buffer_size=1),
    "pack then batch": lambda s: s.pack(3, strategy="first_fit", buffer_size=1).batch(2, drop_last=True),
}


def epoch_length(build: Build) -> int:
    """Items of the first epoch (at most a few hundred: an endless pipeline is cut there)."""
    pipe = build()
    count = sum(1 for _ in islice(pipe, 300))
    pipe.close()
    return count


@pytest.mark.parametrize("n", [0, 1, 3])
@pytest.mark.parametrize("chain", sorted(CHAINS))
def test_tiny_in_memory_sources_through_every_node_resume_exactly(chain: str, n: int) -> None:
    data = records(n)

    def build() -> rs.Node[Any]:
        return CHAINS[chain](rs.from_list(data))

    length = min(epoch_length(build), 12)
    run = check_every_point(build, length)
    if n == 0 and not chain.startswith("mix"):
        assert run == []


@pytest.mark.parametrize("n", [0, 1, 3])
@pytest.mark.parametrize("chain", sorted(PACKS))
def test_tiny_token_sources_through_every_packer_resume_exactly(chain: str, n: int) -> None:
    data = documents(n)

    def build() -> rs.Node[Any]:
        return PACKS[chain](rs.from_list(data))

    length = min(epoch_length(build), 12)
    check_every_point(build, length)


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "arrow", "stream", "stream gzip"])
def test_a_one_record_file_through_every_node_resumes_exactly(kind: str, tmp_path: Path) -> None:
    row = [{"x": 42, "input_ids": [1, 2, 3]}]
    if kind == "jsonl":
        path = write_jsonl(tmp_path / "one.jsonl", row)
        make: Callable[[], rs.Node[Any]] = lambda: rs.jsonl(path)  # noqa: E731
    elif kind == "parquet":
        path = write_parquet(tmp_path / "one.parquet", row)
        make = lambda: rs.parquet(path)  # noqa: E731
    elif kind == "arrow":
        path = write_arrow(tmp_path / "one.arrow", row)
        make = lambda: rs.arrow(path)  # noqa: E731
    else:
        path = str(tmp_path / "one.jsonl.gz") if kind.endswith("gzip") else str(tmp_path / "one.jsonl")
        data = orjson.dumps(row[0]) + b"\n"
        Path(path).write_bytes(gzip.compress(data) if kind.endswith("gzip") else data)
        make = lambda: rs.jsonl_stream(path, shuffle_files=0)  # noqa: E731
    chains: list[Callable[[rs.Node[Any]], rs.Node[Any]]] = [
        lambda s: s.repeat(3),
        lambda s: s.batch(5).repeat(2),
        lambda s: s.batch(5, drop_last=True),
        lambda s: s.pack(1, strategy="greedy", buffer_size=1),
        lambda s: s.pack(2, strategy="best_fit", buffer_size=1, overlong="drop"),
        lambda s: s.prefetch(1),
        lambda s: rs.mix({"one": s, "two": rs.from_list([{"x": 7, "input_ids": [9]}])}, on_end="restart"),
    ]
    if not kind.startswith("stream"):
        chains += [
            lambda s: s.shuffle(seed=1, block_size=1, window=1).shard(0, 4),
            lambda s: s.shuffle(seed=1, block_size=99).shard(3, 4),
            lambda s: s.shuffle(seed=1).pack(4, strategy="bfd").even(),
            lambda s: s.cache(directory=str(tmp_path / "cache")).shuffle(seed=2).shard(0, 3).repeat(2),
            lambda s: s.cache(directory=str(tmp_path / "cache"), max_bytes=0).batch(2),
        ]
    for chain in chains:
        check_every_point(lambda: chain(make()), min(epoch_length(lambda: chain(make())), 8))


@pytest.mark.parametrize("n", [0, 1, 2])
def test_a_disk_cache_of_a_tiny_source_reads_and_resumes_cold_and_warm(n: int, tmp_path: Path) -> None:
    directory = str(tmp_path / "cache")

    def build() -> rs.Node[Any]:
        return rs.from_list(records(n)).map(identity).cache(directory, max_bytes=0).shuffle(seed=4).repeat(2)

    cold = check_every_point(build, n)  # the first run writes the cache
    warm = check_every_point(build, n)  # later runs read it
    assert cold == warm
    assert sorted(item["x"] for item in cold[:n]) == list(range(n))


# -- 5. a property over the sizes a pipeline is built with --------------------------------------


@settings(max_examples=15, deadline=None)
@given(
    n=st.integers(0, 12),
    seed=st.one_of(st.integers(0, 3), st.just(2**64 - 1)),
    block=st.sampled_from([None, (1, 1), (1, 3), (2, 1), (5, 2), (40, 40)]),
    world_size=st.integers(1, 15),
    batch_size=st.integers(1, 15),
    drop_last=st.booleans(),
    times=st.sampled_from([None, 1, 2]),
    data=st.data(),
)
def test_any_sizes_partition_the_epoch_and_resume_at_any_item(
    n: int,
    seed: int,
    block: tuple[int, int] | None,
    world_size: int,
    batch_size: int,
    drop_last: bool,
    times: int | None,
    data: st.DataObject,
) -> None:
    def shuffled() -> rs.Node[Any]:
        base = src(n)
        if block is None:
            return base.shuffle(seed=seed)
        return base.shuffle(seed=seed, block_size=block[0], window=block[1])

    # one epoch over every rank is the whole data set once
    shares = [[item["x"] for item in shuffled().shard(rank, world_size)] for rank in range(world_size)]
    assert sorted(x for share in shares for x in share) == list(range(n))
    assert max(map(len, shares)) - min(map(len, shares)) <= 1

    rank = data.draw(st.integers(0, world_size - 1), label="rank")

    def build() -> rs.Node[Any]:
        pipe: rs.Node[Any] = shuffled().shard(rank, world_size)
        if times is not None:
            pipe = pipe.repeat(times)
        return pipe.batch(batch_size, drop_last=drop_last)

    per_epoch = len(shares[rank]) * (times or 1)
    batches = per_epoch // batch_size if drop_last else -(-per_epoch // batch_size)
    first = [[item["x"] for item in b] for b in build()]
    assert len(first) == batches
    assert all(len(b) == batch_size for b in first[: per_epoch // batch_size])
    total = 3 * max(batches, 1) + 1
    expected = [plain(item) for item in take(build(), total)]
    k = data.draw(st.integers(0, total), label="k")
    pipe = build()
    head = [plain(item) for item in take(pipe, k)]
    resumed = build()
    resumed.set_state(roundtrip(pipe.get_state()))
    assert head + [plain(item) for item in take(resumed, total - k)] == expected
