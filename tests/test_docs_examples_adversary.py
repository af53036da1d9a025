"""The documentation as a newcomer meets it: README.md and every docs/*.md page (but the
figures of docs/benchmarks.md), tried as written.

Each code example runs here, adapted only to read small generated data under ``tmp_path``, and
each concrete claim is checked against the code: a parameter and its default, an error's type
and message, what a state holds, what happens at an epoch's end, what ``python -m resumable
inspect`` prints, what the Loader does, and that every public name a page uses exists with the
signature the page gives. A claim the code contradicts is a strict expected failure: ``BUG:``
where the library is wrong, ``BUG: docs/<page> says ...`` where the page is (those tests read
the page, and pass once it is mended).
"""

from __future__ import annotations

import argparse
import ast
import gzip
import inspect
import io
import json
import logging
import os
import pickle
import re
import stat
import subprocess
import sys
import threading
import warnings
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import resumable as rs
import resumable.elastic
import resumable.pack
import resumable.torch as rst
from resumable.cli import main as cli_main
from resumable.pack import IGNORE_INDEX, collate_rows, expand_references
from tests.resume import plain

ROOT = Path(__file__).resolve().parent.parent


def page(name: str) -> str:
    return (ROOT / name).read_text(encoding="utf-8")


def python_blocks(name: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", page(name), flags=re.S)


def json_blocks(name: str) -> list[Any]:
    return [json.loads(block) for block in re.findall(r"```json\n(.*?)```", page(name), flags=re.S)]


def write_jsonl(path: Path, records: list[Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def texts(tmp_path: Path, files: int = 3, per_file: int = 40) -> None:
    """``data/0.jsonl`` ... under ``tmp_path``: records with a ``text`` of 1 to 50 characters."""
    for f in range(files):
        write_jsonl(
            tmp_path / "data" / f"{f}.jsonl",
            [{"text": "abcdefg"[i % 7] * (1 + (i * 7 + f) % 50), "n": f * per_file + i} for i in range(per_file)],
        )


class MyTokenizer:
    """Stands for the README's ``my_tokenizer``: bytes as token ids."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode())


my_tokenizer = MyTokenizer()


def tokenize(record: dict[str, Any]) -> dict[str, Any]:
    return {"input_ids": my_tokenizer.encode(record["text"])}


def tok_numbers(record: Any) -> dict[str, Any]:
    n = record if isinstance(record, int) else record["n"]
    return {"input_ids": list(range(1, 2 + n % 11))}


def rows_equal(a: Any, b: Any) -> bool:
    return bool(plain(a) == plain(b))


def run_cli(*args: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli_main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


# -- public names and signatures ------------------------------------------------------------


DOCUMENTED_NAMES = {
    rs: "jsonl jsonl_stream parquet arrow from_hf from_list mix save_state load_state nodes "
    "ConfigError SourceError StateError MapError ResumableError",
    rs.nodes: "JsonlSource JsonlStream ParquetSource ArrowSource HfSource FromList Shuffle BlockShuffle Shard "
    "IndexedMap Map ParallelMap Filter IndexedFilter Batch Pack Repeat Even Prefetch Cache Mix",
    rst: "Loader PipelineDataset PerRank load_all_ranks save load distributed_rank pack_figures "
    "ToTorchdata FromTorchdata",
    resumable.pack: "collate_rows expand_references IGNORE_INDEX Pack PackStats",
    resumable.elastic: "restore rescaled_state rescaled_states",
}

# Signatures as the pages write them. The first names are positional placeholders (the code may
# name them otherwise); every keyword must exist with that default.
DOCUMENTED_SIGNATURES: list[tuple[str, Callable[..., Any], str]] = [
    ("docs/sources.md", rs.jsonl, 'paths_or_glob, on_error="raise", cache_dir=None'),
    (
        "docs/sources.md",
        rs.jsonl_stream,
        'paths_or_glob, on_error="raise", shuffle_files=None, rank=None, world_size=None, split_workers=True',
    ),
    ("docs/formats.md", rs.parquet, "paths_or_glob, columns=None, cache_row_groups=4"),
    ("docs/formats.md", rs.arrow, "paths_or_glob"),
    ("docs/formats.md", rs.from_hf, "dataset"),
    ("docs/sources.md", rs.from_list, "sequence"),
    ("docs/mixing.md", rs.nodes.Mix, 'components, weights=None, seed=0, on_end="stop", schedule="smooth"'),
    ("docs/mixing.md", rs.mix, 'components, weights=None, seed=0, on_end="stop", schedule="smooth"'),
    ("README.md", rs.Node.shuffle, "self, seed=0"),
    ("README.md", rs.Node.shard, "self, rank=None, world_size=None, split_workers=True"),
    ("README.md", rs.Node.map, 'self, fn, num_workers=0, mode="thread", batched=False'),
    ("README.md", rs.Node.batch, "self, n, drop_last=False, collate_fn=None"),
    ("README.md", rs.Node.repeat, "self, times=None"),
    ("README.md", rs.Node.even, "self, times=None, group=None"),
    ("README.md", rs.Node.prefetch, "self, buffer_size=4"),
    ("README.md", rs.Node.cache, "self, directory=None, max_bytes=1073741824"),
    (
        "docs/filter.md",
        rs.IndexedNode.filter,
        "self, predicate, index=False, index_key=None, cache_dir=None, num_proc=0, progress=True, batched=False",
    ),
    (
        "docs/packing.md",
        rs.nodes.Pack,
        'upstream, seq_len, strategy="best_fit", buffer_size=None, overlong="split", split_positions="restart", '
        'mask_first_token=False, max_documents=None, input_field="input_ids", labels_field="labels", '
        "pad_token_id=0, token_fields=None, document_fields=None, length_fn=None",
    ),
    ("docs/packing.md", collate_rows, "rows, as_torch=False, flatten=False"),
    ("docs/cache.md", rs.nodes.Cache, "upstream, directory=None, max_bytes=1073741824, block_size=1024"),
    (
        "docs/cache.md",
        resumable.ops.cache.cache,  # type: ignore[attr-defined]
        "upstream, directory=None, max_bytes=1073741824, block_size=1024",
    ),
    ("docs/parallel.md", rs.nodes.Prefetch, "upstream, buffer_size"),
    ("docs/parallel.md", rs.nodes.ParallelMap, "upstream, fn, num_workers, mode"),
    (
        "docs/filter.md",
        rs.nodes.IndexedFilter,
        "upstream, predicate, index_key=None, cache_dir=None, num_proc=0, progress=True, batched=False",
    ),
    (
        "docs/torch.md",
        rst.Loader,
        "pipeline_or_factory, num_workers=0, collate_fn=None, pin_memory=False, timeout=0, "
        "prefetch_factor=None, persistent_workers=False, multiprocessing_context=None, worker_init_fn=None, "
        "workers_ignore_sigterm=True",
    ),
    ("docs/torch.md", rst.PipelineDataset, "pipeline_or_factory"),
    ("docs/torch.md", rst.pack_figures, "batch, stats=None, group=None"),
    ("docs/torch.md", rst.save, "obj, path"),
    ("docs/torch.md", rst.load, "path"),
    ("docs/torch.md", rst.load_all_ranks, 'checkpoint_dir, key="data"'),
    ("docs/torch.md", rst.ToTorchdata, "pipe"),
    ("docs/torch.md", rst.FromTorchdata, "base_node"),
    ("docs/elastic.md", resumable.elastic.restore, "pipeline, old_states"),
    ("docs/elastic.md", resumable.elastic.rescaled_state, "pipeline, old_states"),
    ("docs/state.md", rs.save_state, "state, path"),
    ("docs/state.md", rs.load_state, "path"),
]


def parse_documented(text: str) -> tuple[list[str], dict[str, Any]]:
    call = ast.parse(f"f({text})", mode="eval").body
    assert isinstance(call, ast.Call)
    return [ast.unparse(arg) for arg in call.args], {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords}


def test_every_public_name_the_docs_use_exists() -> None:
    for module, names in DOCUMENTED_NAMES.items():
        missing = [name for name in names.split() if not hasattr(module, name)]
        assert not missing, f"{module.__name__} lacks {missing}"
    assert rs.pack.Pack.collate is collate_rows  # "collate_rows (also Pack.collate)"
    assert IGNORE_INDEX == -100
    from resumable.ops.cache import CacheWarning  # docs/cache.md
    from resumable.sources.line_index import SidecarWarning  # docs/sources.md, docs/filter.md

    assert issubclass(CacheWarning, UserWarning) and issubclass(SidecarWarning, UserWarning)
    from resumable.core.node import NODE_KINDS
    from resumable.core.state import STATE_VERSION

    assert STATE_VERSION == 1  # docs/state.md: "now 1"
    assert {"Batch", "Filter", "Shuffle", "JsonlSource", "Pack", "Mix", "Cache"} <= set(NODE_KINDS)


@pytest.mark.parametrize(
    ("where", "fn", "documented"), DOCUMENTED_SIGNATURES, ids=lambda v: getattr(v, "__qualname__", None)
)
def test_documented_signature(where: str, fn: Callable[..., Any], documented: str) -> None:
    positional, keywords = parse_documented(documented)
    parameters = list(inspect.signature(fn).parameters.values())
    assert len(parameters) >= len(positional) + len(keywords), f"{where}: {fn.__qualname__}{inspect.signature(fn)}"
    for parameter in parameters[: len(positional)]:
        assert parameter.kind in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD), f"{where}: {parameter}"
    by_name = {p.name: p for p in parameters}
    for name, default in keywords.items():
        assert name in by_name, f"{where}: {fn.__qualname__} has no parameter {name!r}"
        assert by_name[name].default == default, f"{where}: {fn.__qualname__}({name}=...) default"


def test_filter_takes_batched_on_every_node() -> None:
    """docs/filter.md: ``node.filter(predicate, index=False, ..., batched=False)``; without
    ``index=True`` "the other options are unused, and ``batched=True`` is a ``ConfigError``"."""
    streaming = rs.from_list([1, 2]).batch(1)
    assert list(streaming.filter(bool, batched=False)) == [[1], [2]]
    with pytest.raises(rs.ConfigError):
        streaming.filter(bool, batched=True)


# -- README.md ------------------------------------------------------------------------------


def readme_pipeline() -> rs.Node:
    return (
        rs.jsonl("data/*.jsonl")
        .shuffle(seed=0)
        .shard()
        .repeat()
        .map(tokenize)
        .filter(lambda ex: len(ex["input_ids"]) > 0)
        .pack(seq_len=4096, strategy="best_fit", buffer_size=1000)
        .batch(8, collate_fn=collate_rows)
    )


def test_readme_quickstart_continues_with_the_next_batch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    texts(tmp_path)
    monkeypatch.chdir(tmp_path)
    pipe = readme_pipeline()
    seen = []
    for step, batch in enumerate(pipe):
        seen.append(batch)
        if step == 1:
            rs.save_state(pipe.get_state(), "ckpt/data.json")
        if step == 3:
            break
    assert {key: (value.shape, value.dtype) for key, value in seen[0].items()} == {
        "input_ids": ((8, 4096), np.int64),
        "labels": ((8, 4096), np.int64),
        "position_ids": ((8, 4096), np.int64),
        "document_ids": ((8, 4096), np.int32),
        "cu_seqlens": ((8, 4097), np.int32),
        "cu_seqlens_count": ((8,), np.int32),
    }
    pipe = readme_pipeline()
    pipe.set_state(rs.load_state("ckpt/data.json"))
    assert rows_equal([next(pipe), next(pipe)], seen[2:4])
    # "small JSON": kilobytes with a 1000-document buffer, never tokens
    assert len(json.dumps(pipe.get_state())) < 20_000


def test_readme_without_collate_fn_a_batch_is_a_list_of_rows() -> None:
    batch = next(rs.from_list([{"input_ids": [1, 2, 3]}] * 5).pack(4).batch(2))
    assert isinstance(batch, list) and len(batch) == 2
    assert set(batch[0]) == {"input_ids", "labels", "position_ids", "document_ids", "cu_seqlens", "cu_seqlens_count"}


def test_readme_known_length() -> None:
    def numbers(n: int = 10) -> rs.Node:
        return rs.from_list(list(range(n)))

    assert len(numbers().batch(3)) == 4 and len(numbers().batch(3, drop_last=True)) == 3
    assert len(numbers().repeat(3)) == 30
    assert [len(numbers().shard(r, 3)) for r in range(3)] == [4, 3, 3]
    assert len(numbers().prefetch()) == len(numbers().map(str, num_workers=2)) == 10
    assert len(numbers().filter(lambda x: x % 2 == 0, index=True, progress=False)) == 5
    assert len(rs.mix({"a": numbers(3), "b": numbers(2)}, on_end="drop")) == 5
    assert len(rs.from_list([{"input_ids": [1, 2]}] * 5).pack(4, strategy="bfd")) == 3
    with pytest.raises(TypeError) as error:
        len(numbers().filter(bool).batch(8))
    assert str(error.value) == (
        "Filter: the number of items a streaming filter keeps is unknown until it has read them; "
        "use .filter(predicate, index=True) for a known length"
    )
    for unknown, kind in (
        (numbers().repeat(), "Repeat"),
        (rs.mix({"a": numbers(3), "b": numbers(2)}), "Mix"),
        (rs.from_list([{"input_ids": [1]}]).pack(4).batch(2), "Pack"),
    ):
        with pytest.raises(TypeError, match=f"^{kind}: "):
            len(unknown)
    # the whole epoch, also after a set_state in mid-epoch
    pipe = numbers(23).shuffle(0).shard(1, 3).batch(2)
    for _ in range(2):
        next(pipe)
    restored = numbers(23).shuffle(0).shard(1, 3).batch(2)
    restored.set_state(pipe.get_state())
    assert len(restored) == len(pipe) == 4


def test_readme_random_access_then_iteration_and_epochs() -> None:
    for late in (lambda n: n.shuffle(0), lambda n: n.shard(0, 1)):
        with pytest.raises(rs.ConfigError, match="^Filter: .*needs random access"):
            late(rs.from_list([1, 2]).filter(bool))
        with pytest.raises(rs.ConfigError, match="^Batch: "):
            late(rs.from_list([1, 2]).batch(1))
    pipe = rs.from_list(list(range(8))).shuffle(0)
    epochs = [list(pipe) for _ in range(3)]
    assert all(sorted(epoch) == list(range(8)) for epoch in epochs)
    assert len({tuple(epoch) for epoch in epochs}) == 3, "a new shuffle order every epoch"


def test_readme_shard_reads_rank_and_world_size(monkeypatch: pytest.MonkeyPatch) -> None:
    assert rs.from_list(list(range(10))).shard().get_state()["world_size"] == 1
    assert rst.distributed_rank() == (0, 1)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert rst.distributed_rank() == (1, 3)
    assert list(rs.from_list(list(range(10))).shard()) == [1, 4, 7]


def test_readme_errors_list() -> None:
    assert issubclass(rs.ConfigError, ValueError)
    for error in (rs.ConfigError, rs.SourceError, rs.StateError, rs.MapError):
        assert issubclass(error, rs.ResumableError)
    with pytest.raises(rs.ConfigError, match="drop_last must be a bool"):
        rs.from_list([1]).batch(1, drop_last="false")  # type: ignore[arg-type]
    with pytest.raises(rs.ConfigError):
        rs.from_list([1]).shuffle(2**64)
    assert rs.from_list([1, 2]).shuffle(2**64 - 1).get_state()["seed"] == 2**64 - 1
    state = rs.from_list([1, 2, 3]).shuffle(np.int64(3)).batch(np.int32(2)).get_state()  # type: ignore[arg-type]
    assert type(state["batch_size"]) is int and type(state["upstream"]["seed"]) is int
    assert json.loads(json.dumps(state)) == state
    with pytest.raises(rs.ConfigError):
        rs.from_list([1]).pack(2**31)  # past int32's largest length
    rs.from_list([1]).pack(2**31 - 1)
    with pytest.raises(rs.ConfigError, match="unknown mode"):
        rs.from_list([1]).map(str, num_workers=0, mode="nope")  # unknown even where unused
    with pytest.raises(rs.ConfigError):
        rs.from_list([1]).cache("")  # an empty directory path
    with pytest.raises(rs.ConfigError, match="resumable node"):
        rs.nodes.Batch([1, 2], 2)  # type: ignore[arg-type]
    with pytest.raises(rs.ConfigError):
        rs.jsonl(5)  # type: ignore[arg-type]
    for bad in (lambda: rs.from_list([1]).shard(2, 2), lambda: rs.from_list([1]).pack(0)):
        with pytest.raises(rs.ConfigError):
            bad()


def raise_stop(x: Any) -> Any:
    raise StopIteration


def fail_on_two(x: int) -> int:
    if x == 2:
        raise KeyError("two")
    return x


def test_readme_map_errors() -> None:
    for pipe in (
        rs.from_list([1, 2]).map(raise_stop),
        rs.from_list([1, 2]).filter(raise_stop),
        rs.from_list([1, 2]).batch(1, collate_fn=raise_stop),
        rs.from_list([1, 2]).map(raise_stop, num_workers=2),
    ):
        with pytest.raises(rs.MapError) as error:
            list(pipe)
        assert isinstance(error.value.__cause__, StopIteration)
    # other errors of a serial function arrive as they are, and iteration goes on after them
    pipe = rs.from_list([1, 2, 3]).map(fail_on_two)
    got: list[Any] = []
    while True:
        try:
            got.append(next(pipe))
        except StopIteration:
            break
        except KeyError:
            got.append("KeyError")
    assert got == [1, "KeyError", 3]


def test_readme_a_loader_state_or_a_list_given_to_set_state_says_what_to_do() -> None:
    def build() -> rs.Node:
        return rs.from_list(list(range(10))).shuffle(0).batch(2)

    loader = rst.Loader(build)
    next(iter(loader))
    pipe = build()
    next(pipe)
    with pytest.raises(rs.StateError, match=r"loader\.load_state_dict"):
        build().set_state(loader.state_dict())
    with pytest.raises(rs.StateError, match=r"resumable\.elastic\.restore"):
        build().set_state([pipe.get_state()] * 2)  # type: ignore[arg-type]


def test_readme_index_command(tmp_path: Path) -> None:
    texts(tmp_path, files=2, per_file=30)
    result = subprocess.run(
        [sys.executable, "-m", "resumable", "index", "data/*.jsonl"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert [line.split() for line in result.stdout.splitlines()] == [
        ["30", "data/0.jsonl"],
        ["30", "data/1.jsonl"],
        ["60", "records", "in", "2", "files"],
    ]
    assert "indexing" in result.stderr  # the progress bar
    assert (tmp_path / "data" / "0.jsonl.rsidx").exists()


def test_readme_inspect_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    texts(tmp_path, files=2, per_file=30)
    monkeypatch.chdir(tmp_path)
    pipe = rs.jsonl("data/*.jsonl").shuffle(0).shard(0, 1).map(tokenize).filter(bool).pack(64, buffer_size=4).batch(2)
    for _ in range(3):
        next(pipe)
    rs.save_state(pipe.get_state(), "ckpt/data.json")
    code, out, _ = run_cli("inspect", "ckpt/data.json", capsys=capsys)
    assert code == 0
    lines = out.splitlines()
    assert "pipeline: Batch > Pack > Filter > IndexedMap > Shard > Shuffle > JsonlSource" in lines
    header = next(line for line in lines if line.startswith("consumer"))
    assert header.split() == ["consumer", "epoch", "position", "length", "progress", "ended"]
    assert any(line.strip().startswith("Filter: dropped=") for line in lines)
    assert any("buffer:" in line and "documents referenced" in line for line in lines)
    assert "files of JsonlSource (2):" in lines
    assert any(line.strip().startswith("data/0.jsonl") and "modified" in line for line in lines)
    (tmp_path / "bad.json").write_text("{nope")
    code, out, err = run_cli("inspect", "bad.json", capsys=capsys)
    assert code == 2 and out == "" and err.startswith("error: bad.json: ")


def test_readme_threads_stop_on_close() -> None:
    before = threading.active_count()
    pipe = rs.from_list(list(range(50))).map(str, num_workers=3).prefetch(2)
    next(pipe)
    pipe.close()
    assert threading.active_count() <= before
    assert list(pipe)[:2] == ["1", "2"]  # iterating on after close() works
    with rs.from_list(list(range(5))).prefetch(2) as pipe:
        assert next(pipe) == 0


def test_readme_and_docs_referenced_files_exist() -> None:
    text = "\n".join(page(p) for p in ["README.md", *sorted(f"docs/{f.name}" for f in (ROOT / "docs").glob("*.md"))])
    for reference in sorted(set(re.findall(r"tests/[a-z_0-9]+\.py(?:::\w+)?", text))):
        path, _, function = reference.partition("::")
        assert (ROOT / path).is_file(), reference
        if function:
            assert re.search(rf"def {function}\b", (ROOT / path).read_text()), reference
    for path in sorted(set(re.findall(r"(?:resumable|bench|examples)/[\w/]+\.py", text))):
        assert (ROOT / path).is_file(), path
    layout = {
        "core": "node indexed state keys protocols",
        "sources": "jsonl parquet arrow memory stream source files line_index _line_scan _sidecar",
        "order": "lcg shuffle block_shuffle shard partition elastic orders topology",
        "ops": "map parallel_map prefetch read_ahead filter batch repeat cache disk_cache mix _schedule",
        "pack": "node _documents _buffered _planned _pieces strategies rows epoch",
        ".": "elastic inspect cli checkpoint loader_state errors",
    }
    for folder, modules in layout.items():
        for module in modules.split():
            assert (ROOT / "resumable" / folder / f"{module}.py").is_file(), (folder, module)
    assert (ROOT / "dev").is_file() and (ROOT / ".ci" / "run").is_file()


# -- docs/state.md --------------------------------------------------------------------------


def keep_g(record: dict[str, Any]) -> bool:
    return bool(record["i"] % 7 != 0)


def same(record: Any) -> Any:
    return record


def test_state_md_example_is_what_the_pipeline_saves(tmp_path: Path) -> None:
    """``rs.jsonl(path).shuffle(1).shard(0, 2).map(f).filter(g).batch(4)`` after three batches,
    over 1000 records: the page's state, entry for entry, but the file's name, size and mtime."""
    path = write_jsonl(tmp_path / "a.jsonl", [{"i": i} for i in range(1000)])

    def build(seed: int = 1) -> rs.Node:
        return rs.jsonl(str(path)).shuffle(seed).shard(0, 2).map(same).filter(keep_g).batch(4)

    pipe = build()
    for _ in range(3):
        next(pipe)
    state = pipe.get_state()
    documented = json_blocks("docs/state.md")[0]
    files = state["upstream"]["upstream"]["upstream"]["upstream"]["upstream"].pop("files")
    documented["upstream"]["upstream"]["upstream"]["upstream"]["upstream"].pop("files")
    assert state == documented
    [[name, size, mtime_ns, digest]] = files
    assert (name, size, mtime_ns) == (str(path), path.stat().st_size, path.stat().st_mtime_ns)
    assert re.fullmatch(r"jsonl-content-xxh3_64:[0-9a-f]{16}", digest)
    with pytest.raises(rs.StateError) as error:
        build(2).set_state(state)
    assert (
        str(error.value)
        == "Batch > Filter > IndexedMap > Shard > Shuffle: state was saved with seed=1, this pipeline has seed=2"
    )
    # survives JSON and torch.load(weights_only=True)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True) == json.loads(json.dumps(state)) == state


def test_state_md_a_state_is_a_value_both_ways() -> None:
    documents = [{"input_ids": list(range(1, 2 + (i * 5) % 11))} for i in range(300)]

    def build() -> rs.Node:
        return rs.from_list(documents).shuffle(0).shard(0, 1).pack(16, strategy="best_fit", buffer_size=20).batch(2)

    pipe = build()
    for _ in range(5):
        next(pipe)
    state = pipe.get_state()
    frozen = json.dumps(state, sort_keys=True)
    expected = [next(pipe) for _ in range(15)]
    assert json.dumps(state, sort_keys=True) == frozen, "iterating further changed a state already taken"
    given = json.loads(frozen)
    restored = build()
    restored.set_state(given)
    given["upstream"]["upstream"]["upstream"]["position"] = 0  # the caller's dict, edited afterwards
    given["upstream"].pop("upstream")
    assert rows_equal([next(restored) for _ in range(15)], expected)


def test_state_md_refused_state_leaves_the_pipeline_as_it_was() -> None:
    def build() -> rs.Node:
        return rs.from_list(list(range(10))).shuffle(0).batch(2)

    reference = build()
    expected = [next(reference) for _ in range(3)]
    pipe = build()
    for _ in range(2):
        next(pipe)
    bad = pipe.get_state()
    bad["upstream"] = dict(bad["upstream"], seed=9)
    with pytest.raises(rs.StateError, match="^Batch > Shuffle: state was saved with seed=9, this pipeline has seed=0$"):
        pipe.set_state(bad)
    assert next(pipe) == expected[2]
    deep: dict[str, Any] = {"kind": "Batch"}
    node = deep
    for _ in range(250):
        node["upstream"] = {"kind": "Batch"}
        node = node["upstream"]
    with pytest.raises(rs.StateError, match="more than 200 levels"):
        build().set_state(deep)


def test_state_md_nodes_read_by_position_may_be_shared() -> None:
    shuffled = rs.from_list(list(range(6))).shuffle(0)
    first, second = shuffled.map(lambda x: x), shuffled.map(lambda x: -x)
    assert sorted(first) == list(range(6)) and sorted(second) == sorted(-x for x in range(6))
    streamed = rs.from_list(list(range(6))).filter(bool)
    with pytest.raises(rs.ConfigError, match="read by component"):
        rs.mix({"a": streamed.batch(2), "b": streamed.batch(3)})


def test_state_md_limits_of_size() -> None:
    pipe = rs.from_list([1, 2, 3])
    pipe.start_epoch(2**62)
    assert list(pipe) == [1, 2, 3]
    with pytest.raises(rs.StateError):
        pipe.next_epoch()
    with pytest.raises(rs.ConfigError):
        rs.from_list([1]).shuffle(0).start_epoch(2**62 + 1)
    with pytest.raises(rs.ConfigError):
        rs.from_list(range(2**63))
    with pytest.raises(TypeError, match="^Repeat: "):
        len(rs.from_list(range(2**62)).repeat(4))


def test_state_md_epoch_ends() -> None:
    """A state taken right after the last item: the restored pipeline first finishes that
    epoch with an empty loop, and the next loop is the next epoch."""

    def build() -> rs.Node:
        return rs.from_list(list(range(4))).shuffle(0)

    pipe = build()
    iterator = iter(pipe)
    for _ in range(4):
        next(iterator)
    restored = build()
    restored.set_state(pipe.get_state())
    assert list(restored) == list(pipe) == []
    assert list(restored) == list(pipe) and sorted(list(build())) == [0, 1, 2, 3]


def test_state_md_topology_and_rounds() -> None:
    shard = rs.from_list(list(range(10))).shard(0, 2)
    next(shard)
    with pytest.raises(rs.StateError, match="world_size=2, this pipeline has world_size=3"):
        rs.from_list(list(range(10))).shard(0, 3).set_state(shard.get_state())
    shuffled = rs.from_list(list(range(10))).shuffle(0)
    next(shuffled)
    state = shuffled.get_state()
    assert state["rounds"] == 6
    with pytest.raises(rs.StateError):
        rs.from_list(list(range(10))).shuffle(0).set_state(dict(state, rounds=5))
    old = rs.from_list(list(range(10))).shuffle(0)
    old.set_state(dict(state, rounds=4))  # a state saved before the entry: 4 rounds
    assert len(list(old)) == 9 and old.get_state()["rounds"] == 4
    next(iter(old))
    assert old.get_state()["rounds"] == 6, "the next epoch is shuffled with 6 rounds"


def test_state_md_saving_a_state_to_a_file(tmp_path: Path) -> None:
    pipe = rs.from_list([1, 2]).batch(1)
    next(pipe)
    path = tmp_path / "ckpt" / "data-rank0.json"
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / ".data-rank0.json.partial").write_text("left by a killed save")
    rs.save_state(pipe.get_state(), path)
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["data-rank0.json"]
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask
    assert rs.load_state(path) == pipe.get_state()
    rs.save_state(pipe.get_state(), tmp_path / "fresh" / "deeper" / "data.json")  # missing directories
    rs.save_state(pipe.get_state(), os.fsencode(tmp_path / "bytes.json"))  # type: ignore[arg-type]
    for bad in ({"kind": "X", "v": float("nan")}, {"kind": "X", "v": float("inf")}, [1]):
        with pytest.raises(rs.StateError):
            rs.save_state(bad, tmp_path / "never.json")  # type: ignore[arg-type]
    assert not (tmp_path / "never.json").exists()
    with pytest.raises(IsADirectoryError):
        rs.save_state(pipe.get_state(), str(tmp_path / "dir") + "/")
    descriptor = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(TypeError):
            rs.load_state(descriptor)  # type: ignore[arg-type]
    finally:
        os.close(descriptor)


# -- docs/sources.md ------------------------------------------------------------------------


def test_sources_md_records_and_bad_lines(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    odd = tmp_path / "odd.jsonl"
    odd.write_bytes(b'\xef\xbb\xbf{"i": 0}\r\n\r\n   \n{"i": 1}\n\t\n{"i": 2}')
    source = rs.jsonl(str(odd))
    assert list(source) == [{"i": 0}, {"i": 1}, {"i": 2}]
    assert source.stats["blank_lines"] == 3
    assert (tmp_path / "odd.jsonl.rsidx").is_file()
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"i": 0}\nnot json\n' + b"{\xff}\n" * 12 + b'{"i": 3}\n')
    with pytest.raises(rs.SourceError, match=rf"^{re.escape(str(bad))}:2: malformed JSON record: "):
        list(rs.jsonl(str(bad)))
    caplog.set_level(logging.WARNING, logger="resumable")
    skipping = rs.jsonl(str(bad), on_error="skip")
    assert list(skipping) == [{"i": 0}, {"i": 3}]
    assert skipping.stats["skipped"] == 13
    logged = [r for r in caplog.records if r.name == "resumable"]
    assert len([r for r in logged if "skipped malformed JSON record" in r.getMessage()]) == 10
    assert "further malformed records are counted" in logged[-1].getMessage()
    (tmp_path / "empty.jsonl").write_text("")
    assert len(rs.jsonl([str(tmp_path / "empty.jsonl"), str(odd)])) == 3  # an empty file among others
    for missing in (tmp_path / "nope.jsonl", tmp_path / "*.nothing", tmp_path, tmp_path / "empty.jsonl"):
        with pytest.raises(rs.SourceError):
            rs.jsonl(str(missing))
    with gzip.open(tmp_path / "z.jsonl.gz", "wt") as out:
        out.write('{"a": 1}\n')
    for on_error in ("raise", "skip"):
        with pytest.raises(rs.SourceError, match="gzip"):
            rs.jsonl(str(tmp_path / "z.jsonl.gz"), on_error=on_error)
    with pytest.raises(rs.ConfigError):
        rs.from_list(x for x in range(3))  # type: ignore[arg-type]


def test_sources_md_globs(tmp_path: Path) -> None:
    folder = tmp_path / "g"
    write_jsonl(folder / "shard[0].jsonl", [{"a": 1}])
    assert list(rs.jsonl(str(folder / "shard[0].jsonl"))) == [{"a": 1}]  # a name that reads as a glob
    for name in ("_SUCCESS", "_metadata", "_common_metadata"):
        (folder / name).write_text("x")
    names = [Path(f[0]).name for f in rs.jsonl(str(folder / "*")).get_state()["files"]]
    assert names == ["shard[0].jsonl"], "globs leave out sidecars and dataset markers"
    paths = [write_jsonl(tmp_path / f"{n}.jsonl", [{"f": n, "i": i} for i in range(4)]) for n in range(3)]
    assert [r["f"] for r in rs.jsonl([str(paths[2]), str(paths[0])])][::4] == [2, 0]  # explicit lists keep their order
    (folder / "link.jsonl").symlink_to(tmp_path / "missing.jsonl")
    with pytest.raises(rs.SourceError, match="symbolic link to a missing file"):
        rs.jsonl(str(folder / "*.jsonl"))


def test_sources_md_fingerprints(tmp_path: Path) -> None:
    data = tmp_path / "data"
    write_jsonl(data / "a.jsonl", [{"i": i} for i in range(20)])
    write_jsonl(data / "b.jsonl", [{"i": i} for i in range(20)])
    pipe = rs.jsonl(str(data / "*.jsonl")).shuffle(0)
    for _ in range(5):
        next(pipe)
    state = pipe.get_state()
    rest = list(pipe)
    before = (data / "a.jsonl").stat()
    os.utime(data / "a.jsonl", ns=(before.st_atime_ns, before.st_mtime_ns + 10**9))  # touch
    staged = tmp_path / "staged"
    staged.mkdir()
    for name in ("a.jsonl", "b.jsonl"):
        (staged / name).write_bytes((data / name).read_bytes())  # cp without -p, another directory
    for folder in (data, staged):
        restored = rs.jsonl(str(folder / "*.jsonl")).shuffle(0)
        restored.set_state(state)
        assert list(restored) == rest
    write_jsonl(data / "a.jsonl", [{"i": i, "t": "xy"} for i in range(20)])
    with pytest.raises(rs.StateError) as error:
        rs.jsonl(str(data / "*.jsonl")).shuffle(0).set_state(state)
    size = (data / "a.jsonl").stat().st_size
    assert str(error.value) == (
        f"Shuffle > JsonlSource: file '{data / 'a.jsonl'}' differs from the file the state was taken over "
        f"(size {before.st_size} -> {size} bytes); restore that file (cp -p and rsync -a keep mtimes), or "
        "build the pipeline over the new data without restoring this state"
    )
    over_two = rs.jsonl(str(staged / "*.jsonl")).get_state()
    write_jsonl(staged / "c.jsonl", [{"i": 0}])
    with pytest.raises(rs.StateError, match=r"saved over 2 files, this source has 3 \(new here: 'c\.jsonl'\)"):
        rs.jsonl(str(staged / "*.jsonl")).set_state(over_two)
    with pytest.raises(rs.StateError, match=r"saved over 2 files, this source has 1 \(missing here: 'b\.jsonl'\)"):
        rs.jsonl(str(staged / "a.jsonl")).set_state(over_two)


def test_sources_md_streaming_jsonl(tmp_path: Path) -> None:
    paths = [write_jsonl(tmp_path / f"{n}.jsonl", [{"f": n, "i": i} for i in range(4)]) for n in range(3)]
    with gzip.open(tmp_path / "3.jsonl.gz", "wt") as out:
        out.writelines(json.dumps({"f": 3, "i": i}) + "\n" for i in range(4))
    every = [*map(str, paths), str(tmp_path / "3.jsonl.gz")]
    assert [sorted({r["f"] for r in rs.jsonl_stream(every, rank=r, world_size=2)}) for r in range(2)] == [
        [0, 2],
        [1, 3],
    ]
    assert list(rs.jsonl_stream(every[:3], rank=3, world_size=4)) == []  # fewer files than consumers
    stream = rs.jsonl_stream(every)
    for _ in range(3):
        next(stream)
    state = stream.get_state()
    assert state["queue"][0] == [0, paths[0].stat().st_size * 3 // 4, 3]  # [file, byte offset, line]
    assert [f[3] for f in state["files"]][:3] == [None, None, None] and state["files"][3][3].startswith("gzip-")
    key = stream.last_key()
    assert key is not None and stream.fetch(key) == {"f": 0, "i": 2}
    for late in (lambda s: s.shuffle(0), lambda s: s.shard()):
        with pytest.raises(rs.ConfigError, match="shuffle_files"):
            late(rs.jsonl_stream(every))
    with pytest.raises(TypeError):
        len(rs.jsonl_stream(every))
    gz = (tmp_path / "3.jsonl.gz").stat()
    os.utime(tmp_path / "3.jsonl.gz", ns=(gz.st_atime_ns, gz.st_mtime_ns + 10**9))
    rs.jsonl_stream(every).set_state(state)  # gzip: restores after a touch
    plain_file = paths[1].stat()
    os.utime(paths[1], ns=(plain_file.st_atime_ns, plain_file.st_mtime_ns + 10**9))
    with pytest.raises(rs.StateError, match="no content digest to compare"):
        rs.jsonl_stream(every).set_state(state)
    assert rs.jsonl_stream(every).skipped == 0


def test_even_over_a_source_that_skips_malformed_lines(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """docs/torch.md: ``len()`` of a source read with ``on_error="skip"`` counts its malformed
    lines, so ``.even()`` over it ends short with a SourceError naming the source and the
    remedies; ``.filter(..., index=True)`` after the source gives the exact length, and the even
    epoch is then the upstream's: 3 batches of the 9 good records."""
    path = tmp_path / "a.jsonl"
    path.write_text("".join(json.dumps({"i": i}) + "\n" if i != 4 else "bad\n" for i in range(10)))
    with pytest.raises(rs.SourceError, match=r"JsonlSource.*on_error='skip'.*index=True"):
        list(rs.jsonl(str(path), on_error="skip").shuffle(0).shard().batch(3).even(times=1))

    def build() -> rs.Node:
        indexed = rs.jsonl(str(path), on_error="skip").filter(bool, index=True, progress=False)
        return indexed.shuffle(0).shard().batch(3)

    expected = list(build())
    assert len(expected) == 3 and sorted(r["i"] for batch in expected for r in batch) == [0, 1, 2, 3, 5, 6, 7, 8, 9]
    assert list(build().even(times=1)) == expected


# -- docs/filter.md -------------------------------------------------------------------------

predicate_calls = [0]


def keep_even(record: dict[str, Any]) -> bool:
    predicate_calls[0] += 1
    return bool(record["i"] % 2 == 0)


def test_filter_md_example(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    tokens = [[(i * 997 + f * 13) % 6000 for i in range(50)] for f in range(2)]
    for f in range(2):
        pq.write_table(pa.table({"num_tokens": tokens[f]}), f"data/{f}.parquet", row_group_size=16)
    index_dir = str(tmp_path / "rs-index")

    def build() -> rs.Node:
        return (
            rs.parquet("data/*.parquet")
            .filter(
                lambda r: r["num_tokens"] <= 4096, index=True, cache_dir=index_dir, index_key="max-4096", progress=False
            )
            .shuffle(seed=0)
            .shard()
            .batch(8)
        )

    pipe = build()
    kept = sum(t <= 4096 for file in tokens for t in file)
    assert len(pipe) == -(-kept // 8)
    names = sorted(os.listdir(index_dir))
    assert [re.sub(r"kept-[0-9a-f]+", "kept-KEY", name) for name in names] == [
        "kept-KEY.json",
        "kept-KEY.lock",
        "kept-KEY.npy",
    ]
    assert np.load(tmp_path / "rs-index" / names[2]).dtype == np.uint32
    description = json.loads((tmp_path / "rs-index" / names[0]).read_text())
    assert {"index_key", "records", "kept", "dtype", "kept_digest", "upstream"} <= set(description)
    assert description["index_key"] == "max-4096" and description["kept"] == kept
    first = next(pipe)
    assert all(r["num_tokens"] <= 4096 for r in first)
    state = pipe.get_state()
    filtered = state["upstream"]["upstream"]["upstream"]
    assert (filtered["kind"], filtered["index_key"], filtered["kept"]) == ("IndexedFilter", "max-4096", kept)
    assert "kept_digest" in filtered
    restored = build()
    restored.set_state(state)
    assert next(restored) == next(pipe)


def test_filter_md_options_and_placement(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "a.jsonl"
    path.write_text("".join(json.dumps({"i": i}) + "\n" if i not in (4, 7) else "bad\n" for i in range(200)))
    caplog.set_level(logging.ERROR, logger="resumable")
    predicate_calls[0] = 0
    kept = rs.jsonl(str(path), on_error="skip").filter(keep_even, index=True, progress=False)
    assert predicate_calls[0] == 0, "never at construction"
    assert len(kept) == 99 and predicate_calls[0] == 198
    assert kept.dropped == 101, "dropped counts the skipped records and the rejected ones"
    copied = pickle.loads(pickle.dumps(kept))
    assert len(copied) == 99 and predicate_calls[0] == 198, "a pipeline pickled after the scan carries the index"
    numbers = rs.from_list(list(range(20)))
    batched = numbers.filter(lambda records: np.array(records) % 3 == 0, index=True, batched=True, progress=False)
    assert list(batched) == [0, 3, 6, 9, 12, 15, 18]
    with pytest.raises(rs.ConfigError):
        list(rs.from_list(list(range(20))).filter(lambda records: [True], index=True, batched=True, progress=False))
    with pytest.raises(rs.ConfigError):
        rs.from_list([1]).filter(bool, batched=True)
    for below in (lambda n: n.shuffle(0), lambda n: n.shard(0, 1), lambda n: n.shuffle(0, block_size=4)):
        with pytest.raises(rs.ConfigError, match="before shuffle and shard"):
            below(rs.from_list([1, 2])).filter(bool, index=True)
    with pytest.raises(rs.ConfigError):
        rs.from_list([1]).batch(1).filter(bool, index=True)
    failing = rs.from_list(list(range(20))).filter(fail_on_two, index=True, progress=False)
    with pytest.raises(rs.SourceError, match="upstream position 2") as error:
        list(failing)
    assert isinstance(error.value.__cause__, KeyError)

    def parity(divisor: int) -> rs.Node:
        return (
            rs.from_list(list(range(20)))
            .filter(lambda x: x % divisor == 0, index=True, progress=False, index_key="a")
            .shuffle(0)
            .shard(0, 1)
        )

    saved = parity(2)
    next(saved)
    with pytest.raises(rs.StateError, match=r"^Shard > Shuffle > IndexedFilter: state was saved with kept=10"):
        parity(3).set_state(saved.get_state())


# -- docs/packing.md ------------------------------------------------------------------------


def test_packing_md_output_format_example() -> None:
    documents = [{"input_ids": [11, 12, 13]}, {"input_ids": [21, 22, 23, 24]}]
    for strategy in ("greedy", "first_fit", "best_fit", "bfd"):
        [row] = list(rs.from_list(documents).pack(8, strategy=strategy))
        assert {key: (value.dtype, value.shape) for key, value in row.items()} == {
            "input_ids": (np.int64, (8,)),
            "labels": (np.int64, (8,)),
            "position_ids": (np.int64, (8,)),
            "document_ids": (np.int32, (8,)),
            "cu_seqlens": (np.int32, (9,)),
            "cu_seqlens_count": (np.int32, ()),
        }
        assert plain(row) == {
            "input_ids": [11, 12, 13, 21, 22, 23, 24, 0],
            "labels": [11, 12, 13, 21, 22, 23, 24, -100],
            "position_ids": [0, 1, 2, 0, 1, 2, 3, 0],
            "document_ids": [1, 1, 1, 2, 2, 2, 2, 0],
            "cu_seqlens": [0, 3, 7, 8, 8, 8, 8, 8, 8],
            "cu_seqlens_count": 4,
        }
    for m, cu_len in ((2, 4), (20, 9)):  # min(m + 2, seq_len + 1)
        [row] = list(rs.from_list(documents).pack(8, max_documents=m))
        assert row["cu_seqlens"].shape == (cu_len,)
    rows = list(rs.from_list([{"input_ids": [1]}] * 20).pack(8, max_documents=3))
    assert max(int(row["document_ids"].max()) for row in rows) == 3


def test_packing_md_options() -> None:
    state = rs.from_list([{"input_ids": [1]}]).pack(8).get_state()
    assert (state["strategy"], state["buffer_size"], state["overlong"], state["split_positions"]) == (
        "best_fit",
        1000,
        "split",
        "restart",
    )
    long = [{"input_ids": list(range(1, 21))}]
    restart = list(rs.from_list(long).pack(8, strategy="greedy", mask_first_token=True))
    assert [r["position_ids"].tolist() for r in restart] == [list(range(8)), list(range(8)), [0, 1, 2, 3, 0, 1, 2, 3]]
    assert [r["labels"].tolist()[0] for r in restart] == [-100] * 3
    cont = list(rs.from_list(long).pack(8, strategy="greedy", split_positions="continue"))
    assert [r["position_ids"].tolist()[0] for r in cont] == [0, 8, 16]
    short = [{"input_ids": [11, 12, 13]}, {"input_ids": [21, 22, 23, 24]}]
    truncate = rs.from_list(long + short).pack(8, strategy="greedy", overlong="truncate")
    assert [r["input_ids"].tolist()[0] for r in truncate] == [1, 11]
    assert (truncate.stats.truncated, truncate.stats.rows) == (1, 2)
    drop = rs.from_list(long + short).pack(8, strategy="greedy", overlong="drop")
    assert len(list(drop)) == 1 and drop.stats.dropped == 1
    empty = rs.from_list([{"input_ids": []}] + short).pack(8)
    list(empty)
    assert empty.stats.empty == 1
    labelled = rs.from_list([{"input_ids": [1, 2, 3], "labels": [-100, 2, 3]}, {"input_ids": [4, 5], "labels": None}])
    assert plain(next(labelled.pack(8))["labels"]) == [-100, 2, 3, 4, 5, -100, -100, -100]
    unlabelled = rs.from_list([{"input_ids": [1, 2, 3], "labels": [-100, 2, 3]}]).pack(8, labels_field=None)
    assert plain(next(unlabelled)["labels"]) == [1, 2, 3, -100, -100, -100, -100, -100]
    narrow = rs.from_list([{"input_ids": np.array([1, 2, 3], dtype=np.uint16)}]).pack(8, pad_token_id=7)
    row = next(narrow)
    assert row["input_ids"].dtype == np.int64 and plain(row["input_ids"]) == [1, 2, 3, 7, 7, 7, 7, 7]
    stats = narrow.stats
    assert (stats.tokens, stats.rows, stats.padding, stats.efficiency) == (3, 1, 5, 3 / 8)
    for bad in (
        {"buffer_size": 0},
        {"strategy": "nope"},
        {"overlong": "nope"},
        {"mask_first_token": "yes"},
        {"length_fn": len},  # a length_fn cannot split
    ):
        with pytest.raises(rs.ConfigError):
            rs.from_list(short).pack(8, **bad)


def test_packing_md_payloads_and_reserved_positions() -> None:
    records = [
        {"input_ids": [1, 2, 3], "mask": np.array([True, False, True]), "image": "a"},
        {"input_ids": list(range(10, 22)), "mask": np.ones(12, dtype=bool), "image": "b"},
    ]
    rows = list(rs.from_list(records).pack(8, strategy="greedy", token_fields=["mask"], document_fields=["image"]))
    assert all(row["mask"].dtype == np.bool_ for row in rows), "a numpy array keeps its dtype"
    assert [row["image"] for row in rows] == [[(0, "b")], [(0, "a"), (3, None)]]  # a split document's later piece
    assert collate_rows(rows)["image"] == [[(0, "b")], [(0, "a"), (3, None)]]
    assert collate_rows(rows, flatten=True)["image"] == [(0, "b"), (8, "a"), (11, None)]
    [row] = list(
        rs.from_list([{"input_ids": [5, 6]}, {"input_ids": [7]}]).pack(
            8, strategy="greedy", length_fn=lambda r: len(r["input_ids"]) + 2, overlong="drop"
        )
    )
    assert plain(row) == {
        "input_ids": [5, 6, 0, 0, 7, 0, 0, 0],
        "labels": [5, 6, -100, -100, 7, -100, -100, -100],
        "position_ids": [0, 1, 2, 3, 0, 1, 2, 0],
        "document_ids": [1, 1, 1, 1, 2, 2, 2, 0],
        "cu_seqlens": [0, 4, 7, 8, 8, 8, 8, 8, 8],
        "cu_seqlens_count": 4,
    }
    with pytest.raises(rs.SourceError, match="length_fn"):
        list(rs.from_list([{"input_ids": [5, 6]}]).pack(8, length_fn=lambda r: 1, overlong="drop"))


def test_packing_md_collate_rows() -> None:
    rows = list(rs.from_list([{"input_ids": [11, 12, 13]}, {"input_ids": [21, 22, 23, 24]}]).pack(8)) * 3
    stacked = collate_rows(rows)
    assert {k: v.shape for k, v in stacked.items()} == {
        "input_ids": (3, 8),
        "labels": (3, 8),
        "position_ids": (3, 8),
        "document_ids": (3, 8),
        "cu_seqlens": (3, 9),
        "cu_seqlens_count": (3,),
    }
    flat = collate_rows(rows, flatten=True)
    assert flat["input_ids"].shape == (1, 24)
    assert flat["cu_seqlens"].shape == (3 * (9 - 1) + 1,)
    assert plain(flat["document_ids"])[0][:17] == [1, 1, 1, 2, 2, 2, 2, 0, 3, 3, 3, 4, 4, 4, 4, 0, 5]
    count = int(flat["cu_seqlens_count"])
    assert plain(flat["cu_seqlens"])[:count] == [0, 3, 7, 8, 11, 15, 16, 19, 23, 24]
    tensors = collate_rows(rows, as_torch=True)
    assert isinstance(tensors["input_ids"], torch.Tensor)


def test_packing_md_sft_example_runs_as_written() -> None:
    [example] = [block for block in python_blocks("docs/packing.md") if "def conversation" in block]
    scope: dict[str, Any] = {}
    exec(compile(example, "docs/packing.md", "exec"), scope)  # noqa: S102
    batch, expanded = scope["batch"], scope["expanded"]
    assert batch["input_ids"].shape == batch["labels"].shape == batch["loss_mask"].shape == (2, 64)
    assert len(batch["pixel_values"]) == 2 and all(isinstance(entry[0], int) for entry in batch["pixel_values"][0])
    assert expanded.shape == (64,) and int((expanded == scope["IMAGE_TOKEN"]).sum()) % scope["IMAGE_TOKENS"] == 0


def test_packing_md_state_example_and_references() -> None:
    documented = next(block for block in json_blocks("docs/packing.md") if block.get("strategy") == "first_fit")
    documents = [{"input_ids": list(range(1, 2 + (i * 7) % 13))} for i in range(60)]
    pack = rs.from_list(documents).map(same).pack(16, strategy="first_fit", buffer_size=8)
    for _ in range(5):
        next(pack)
    state = pack.get_state()
    assert set(state) == set(documented)
    assert set(state["refs"]) == set(documented["refs"])
    assert (state["upstream"]["kind"], state["stats"]["rows"]) == ("IndexedMap", 5)
    assert len(state["sections"]) == 4 and state["open_sizes"][-1] == 0  # the last group: whole rows waiting
    expanded = expand_references(state)
    held = [tuple(piece[:2]) for piece in expanded["open"]]
    assert held == pack.pending_keys()
    restored = rs.from_list(documents).map(same).pack(16, strategy="first_fit", buffer_size=8)
    restored.set_state(state)
    assert rows_equal(list(restored), list(pack))


def test_packing_md_length_epochs_and_errors() -> None:
    documents = [{"input_ids": list(range(1, 2 + (i * 5) % 11))} for i in range(50)]
    with pytest.raises(TypeError, match="^Pack: "):
        len(rs.from_list(documents).pack(16))
    planned = rs.from_list(documents).shuffle(0).shard(0, 1).pack(16, strategy="bfd")
    rows = len(planned)
    for _ in range(3):
        next(planned)
    restored = rs.from_list(documents).shuffle(0).shard(0, 1).pack(16, strategy="bfd")
    restored.set_state(planned.get_state())
    assert len(planned) == len(restored) == rows == 3 + len(list(restored))
    # pack().repeat(): every epoch packed on its own, its last row flushed before StopIteration
    per_epoch = [r["input_ids"].tolist() for r in rs.from_list([{"input_ids": [1] * 3}] * 3).pack(8).repeat(2)]
    assert per_epoch == [[1] * 6 + [0, 0], [1] * 3 + [0] * 5] * 2
    one = rs.from_list(documents[:20]).pack(16)
    list(one)
    iterator = iter(one)
    next(iterator)
    assert one.stats.rows == 1, "the counters restart every epoch"
    with warnings.catch_warnings():
        warnings.simplefilter("error", rs.BarrenEpochWarning)
        with pytest.raises(rs.BarrenEpochWarning):
            next(rs.from_list([{"input_ids": []}]).repeat().pack(8))
    with pytest.raises(rs.ConfigError, match="last_key"):
        next(rs.nodes.Pack(rs.from_list(documents).batch(1).map(lambda b: b[0]), 8))
    for record, says in (
        ({"x": 1}, "has no 'input_ids' field"),
        (5, "expected a mapping"),
        ({"input_ids": [1, 2], "labels": [1]}, "'labels' for 2 'input_ids'"),
        ({"input_ids": [[1, 2]]}, "1-d sequence"),
    ):
        with pytest.raises(rs.SourceError, match=rf"^Pack: record \(epoch 0, record 3\) .*{re.escape(says)}"):
            list(rs.from_list([{"input_ids": [1]}] * 3 + [record]).pack(8, strategy="greedy"))


def test_packing_md_error_example_matches_the_message() -> None:
    example = re.search(r"e\.g\. `(record \(epoch \d+, \w+ \d+\))`", page("docs/packing.md"))
    assert example is not None
    with pytest.raises(rs.SourceError) as error:
        list(rs.from_list([{"input_ids": [1]}] * 17 + [{"x": 1}]).pack(8, strategy="greedy"))
    wording = re.sub(r"\d+", "N", example.group(1))
    assert wording in re.sub(r"\d+", "N", str(error.value))


# -- docs/mixing.md -------------------------------------------------------------------------


def mixing_example(tmp_path: Path, weights: dict[str, float]) -> rs.Node:
    web = rs.jsonl(str(tmp_path / "web" / "*.jsonl")).shuffle(seed=0).shard().map(tok_numbers).pack(64)
    code = rs.jsonl(str(tmp_path / "code" / "*.jsonl")).shuffle(seed=1).shard().map(tok_numbers).pack(64)
    return rs.mix(
        {"web": web, "code": code},
        weights=weights,
        seed=0,
        on_end="restart",
        schedule="smooth",
    ).batch(8)


def test_mixing_md_example_and_state_layout(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "web" / "a.jsonl", [{"n": i} for i in range(80)])
    write_jsonl(tmp_path / "code" / "a.jsonl", [{"n": 100 + i} for i in range(30)])
    rows = mixing_example(tmp_path, {"web": 0.7, "code": 0.3})
    for _ in range(3):
        next(rows)
    state = rows.get_state()
    mix_state = state["upstream"]
    documented = next(block for block in json_blocks("docs/mixing.md") if block.get("kind") == "Mix")
    assert set(mix_state) == set(documented)
    assert (mix_state["names"], mix_state["on_end"], mix_state["schedule"]) == (["web", "code"], "restart", "smooth")
    assert sum(mix_state["counts"].values()) == mix_state["step"] == 24
    assert mix_state["components"]["web"]["kind"] == "Pack"
    same_weights = mixing_example(tmp_path, {"web": 7, "code": 3})  # "{"web": 7, "code": 3} is the same"
    same_weights.set_state(json.loads(json.dumps(state)))
    assert rows_equal([next(same_weights) for _ in range(4)], [next(rows) for _ in range(4)])
    mix = rows.upstream
    assert type(mix) is rs.nodes.Mix and mix.last_component in ("web", "code")
    assert set(mix.proportions) == {"web", "code"} and abs(sum(mix.proportions.values()) - 1) < 1e-9
    assert (mix.epoch, mix.active, mix.weights) == (0, ["web", "code"], {"web": 0.7, "code": 0.3})


def test_mixing_md_validation_table() -> None:
    one = rs.from_list([1])
    for components, options, says in (
        ([one], {}, "must be a dict"),
        ({}, {}, "must not be empty"),
        ({"": one}, {}, "non-empty strings"),
        ({"a": [1]}, {}, "resumable node"),
        ({"a": one, "b": one}, {}, "given twice"),
        ({"a": rs.from_list([1])}, {"weights": {"a": 1, "b": 1}}, "unknown components"),
        ({"a": rs.from_list([1]), "b": rs.from_list([1])}, {"weights": {"a": 1}}, "no weight"),
        ({"a": rs.from_list([1])}, {"weights": {"a": -1}}, ">= 0"),
        ({"a": rs.from_list([1])}, {"weights": {"a": float("nan")}}, "finite"),
        ({"a": rs.from_list([1])}, {"weights": {"a": float("inf")}}, "finite"),
        ({"a": rs.from_list([1])}, {"weights": {"a": True}}, "finite"),
        ({"a": rs.from_list([1])}, {"weights": {"a": 0}}, "positive"),
        ({"a": rs.from_list([1])}, {"seed": -1}, "non-negative int"),
        ({"a": rs.from_list([1])}, {"seed": 1.0}, "non-negative int"),
        ({"a": rs.from_list([1])}, {"on_end": "x"}, "unknown on_end"),
        ({"a": rs.from_list([1])}, {"schedule": "x"}, "unknown schedule"),
    ):
        with pytest.raises(rs.ConfigError, match=says):
            rs.mix(components, **options)  # type: ignore[arg-type]
    rs.mix({"a": rs.from_list([1])}, weights={"a": np.float32(1)})  # numpy weights
    huge = rs.mix({k: rs.from_list(list(range(10))) for k in "ab"}, weights={"a": 1.5e308, "b": 1.5e308})
    [next(huge) for _ in range(6)]
    assert huge.counts == {"a": 3, "b": 3}, "weights summing past the largest float"


def test_mixing_md_schedules_and_on_end() -> None:
    weights = {"a": 5, "b": 3, "c": 2}
    smooth = rs.mix({k: rs.from_list(list(range(300))) for k in weights}, weights=weights, seed=3)
    for t in range(1, 301):
        next(smooth)
        assert all(abs(smooth.counts[k] - w / 10 * t) < 2 for k, w in weights.items())
    draws = []
    for _ in range(2):  # a pure function of (seed, epoch, step, weights, eligible set)
        random = rs.mix({k: rs.from_list(list(range(100))) for k in "ab"}, weights={"a": 3, "b": 1}, schedule="random")
        draws.append([(next(random), random.last_component) for _ in range(40)])
    assert draws[0] == draws[1] and random.counts["a"] > random.counts["b"]
    never = rs.mix({"a": rs.from_list([1, 2, 3]), "b": rs.from_list([4])}, weights={"a": 1, "b": 0}, on_end="drop")
    assert list(never) == [1, 2, 3]
    fresh = rs.mix({"a": rs.from_list([1, 2]), "b": rs.from_list([3, 4])})
    assert fresh.proportions == {"a": 0.0, "b": 0.0}
    stop = rs.mix({"a": rs.from_list([1, 2, 3]), "b": rs.from_list([4])}, on_end="stop")
    first = list(stop)
    assert 4 in first and len(first) <= 3, "the epoch ends as soon as a chosen component is exhausted"
    assert 4 in list(stop), "the next mix epoch starts every component's next epoch"
    drop = rs.mix({"a": rs.from_list([1, 2, 3]), "b": rs.from_list([4])}, on_end="drop")
    assert sorted(drop) == [1, 2, 3, 4]
    restart = rs.mix({"a": rs.from_list([1, 2, 3]), "b": rs.from_list([9]).filter(lambda x: False)}, on_end="restart")
    assert [next(restart) for _ in range(7)] == [1, 2, 3, 1, 2, 3, 1] and restart.active == ["a"]
    empty = rs.mix({k: rs.from_list([1]).filter(lambda x: False) for k in "ab"}, on_end="restart")
    assert list(empty) == []
    counted = rs.mix({"a": rs.from_list([1, 2, 3]), "b": rs.from_list([4, 5, 6])})
    list(counted)
    next(iter(counted))
    assert sum(counted.counts.values()) == 1 and counted.epoch == 1, "counts reset at each mix epoch"
    started = rs.mix({"a": rs.from_list([1, 2, 3]).shuffle(0), "b": rs.from_list([4, 5, 6]).shuffle(0)})
    started.start_epoch(3)
    assert started.epoch == 3 and started.get_state()["components"]["a"]["epoch"] == 3
    assert sorted(started) == [1, 2, 3, 4, 5, 6]


def test_mixing_md_state_validation() -> None:
    def build(order: str = "ab") -> rs.Node:
        parts = {"a": rs.from_list([1, 2, 3]).shuffle(0).map(same), "b": rs.from_list([4, 5])}
        return rs.mix({name: parts[name] for name in order})

    mix = build()
    next(mix)
    state = mix.get_state()
    informational = json.loads(json.dumps(state))
    informational["weights"] = {"a": 5, "b": 0.1}
    build().set_state(informational)
    miscounted = json.loads(json.dumps(state))
    miscounted["counts"]["a"] += 1
    with pytest.raises(rs.StateError, match="do not add up to step"):
        build().set_state(miscounted)
    with pytest.raises(rs.StateError, match="components"):
        build("ba").set_state(state)
    foreign = json.loads(json.dumps(state))
    foreign["components"]["a"]["kind"] = "Batch"
    with pytest.raises(rs.StateError, match=r"^Mix\[a\] > IndexedMap: "):
        build().set_state(foreign)


def test_mixing_md_set_weights_after_close() -> None:
    mix = rs.mix({"web": rs.from_list(list(range(100))), "code": rs.from_list(list(range(100, 200)))})
    pipe = mix.prefetch(2)
    assert sorted(next(pipe) for _ in range(4)) == [0, 1, 100, 101]
    pipe.close()
    mix.set_weights({"web": 1.0, "code": 0.0})
    assert [next(pipe) for _ in range(4)] == [2, 3, 4, 5]
    assert mix.last_component == "web"
    pipe.close()
    for bad in ({"web": -1, "code": 1}, {"web": 1}):
        with pytest.raises(rs.ConfigError):
            mix.set_weights(bad)


def test_mixing_md_keys_let_a_packer_follow_a_mix() -> None:
    mix = rs.mix(
        {"web": rs.from_list([1, 2, 3]).shuffle(0), "code": rs.from_list([4, 5]).shuffle(0).shard()},
        on_end="restart",
    )
    next(mix)
    assert mix.last_key() == ("web", 0, 0)
    next(mix)
    key = mix.last_key()
    assert key is not None and key[0] == "code" and key[2:] == (0, 0)
    assert repr(key[1]) == "Stride(consumer=0, consumers=1)"
    assert mix.fetch_many([key]) == [4]

    def build() -> rs.Node:
        docs = rs.mix(
            {
                "web": rs.from_list(list(range(40))).shuffle(0).shard().map(tok_numbers),
                "code": rs.from_list(list(range(40, 60))).shuffle(1).shard().map(tok_numbers),
            },
            weights={"web": 0.7, "code": 0.3},
            on_end="restart",
        )
        return docs.pack(32, strategy="best_fit", buffer_size=10).batch(2)

    rows = build()
    for _ in range(4):
        next(rows)
    restored = build()
    restored.set_state(json.loads(json.dumps(rows.get_state())))
    assert rows_equal([next(restored) for _ in range(6)], [next(rows) for _ in range(6)])
    with pytest.raises(rs.ConfigError):
        rs.mix({"a": rs.from_list([{"input_ids": [1]}])}).pack(8, strategy="bfd")


def test_inspect_shows_the_components_of_a_mix(tmp_path: Path, capsys: Any) -> None:
    pipe = rs.mix({"a": rs.from_list([1, 2, 3]).shuffle(0), "b": rs.from_list([4, 5]).shuffle(0)}).batch(2)
    next(pipe)
    rs.save_state(pipe.get_state(), tmp_path / "mix.json")
    code, out, _ = run_cli("inspect", str(tmp_path / "mix.json"), capsys=capsys)
    assert code == 0
    assert "pipeline: Batch > Mix" in out
    assert "component a: Shuffle > FromList, epoch 0, position 1 of 3" in out
    assert "component b: Shuffle > FromList, epoch 0, position 1 of 2" in out


def test_mixing_md_not_covered_list_is_current() -> None:
    stale = re.search(r"does not descend into a mix's\s+`components`", page("docs/mixing.md"))
    assert stale is None


# -- docs/cache.md --------------------------------------------------------------------------

map_calls = [0]


def tokenize_counted(record: dict[str, Any]) -> dict[str, Any]:
    map_calls[0] += 1
    return {"input_ids": np.arange(len(record["text"]), dtype=np.int32), "n": record["n"]}


def test_cache_md_example(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "data" / "a.jsonl", [{"text": "w" * (i % 10), "n": i} for i in range(2500)])
    cache_dir = str(tmp_path / "rs-cache")

    def build(directory: str | None = cache_dir) -> rs.Node:
        return rs.jsonl("data/*.jsonl").map(tokenize_counted).cache(directory).shuffle(seed=0).shard().batch(8)

    map_calls[0] = 0
    pipe = build()
    assert sum(len(batch) for batch in pipe) == 2500 and map_calls[0] == 2500
    cache = pipe.upstream.upstream.upstream
    assert type(cache) is rs.nodes.Cache and cache.computed == 2500
    assert cache.path is not None and Path(cache.path).parent == Path(cache_dir)
    assert re.fullmatch(r"[0-9a-f]{32}", Path(cache.path).name)
    assert sorted(os.listdir(cache.path)) == [
        "000000000000-000000001024.arrow",
        "000000001024-000000002048.arrow",
        "000000002048-000000002500.arrow",
        "config.json",
    ]
    map_calls[0] = 0
    restarted = build()
    next(restarted)
    state = restarted.get_state()
    rest = list(restarted)
    assert map_calls[0] == 0 and restarted.upstream.upstream.upstream.computed == 0
    cached = state["upstream"]["upstream"]["upstream"]
    assert {"directory", "max_bytes", "block_size", "fingerprint"} <= set(cached)
    assert cached["block_size"] == 1024 and cached["max_bytes"] == 1 << 30
    in_memory = build(None)  # a state resumes in a pipeline that caches elsewhere, or in memory
    assert in_memory.upstream.upstream.upstream.path is None
    in_memory.set_state(state)
    assert [[r["n"] for r in b] for b in in_memory] == [[r["n"] for r in b] for b in rest]
    documented = next(block for block in json_blocks("docs/cache.md") if block.get("kind") == "Cache")
    outer = rs.from_list([{"a": 1}] * 5).cache(str(tmp_path / "outer"))
    next(outer)
    assert set(outer.get_state()) == set(documented)


def test_cache_md_placement_and_values(tmp_path: Path) -> None:
    with pytest.raises(rs.ConfigError, match="before filter"):
        rs.from_list([1]).filter(bool).cache()
    for below in (lambda n: n.shuffle(0), lambda n: n.shard(0, 1)):
        with pytest.raises(rs.ConfigError, match="before shuffle and shard"):
            below(rs.from_list([1])).cache()
    for field, value in (("grid", np.zeros((2, 2))), ("pair", (1, 2))):
        with pytest.raises(rs.ConfigError, match=f"field '{field}'"):
            list(rs.from_list([{field: value}]).cache(str(tmp_path / field)))
        assert plain(list(rs.from_list([{field: value}]).cache())) == plain([{field: value}])  # in memory: fine
    assert list(rs.from_list(["a", "b"]).cache(str(tmp_path / "strings"))) == ["a", "b"]
    records = [{"a": np.arange(3, dtype=np.int16), "s": np.int32(5), "l": [1, 2], "n": None, "b": b"x"}] * 2
    list(rs.from_list(records).cache(str(tmp_path / "typed")))
    back = list(rs.from_list(records).cache(str(tmp_path / "typed")))[0]
    assert back["a"].dtype == np.int16 and back["a"].flags.writeable
    assert type(back["s"]) is np.int32 and back["l"] == [1, 2] and back["n"] is None and back["b"] == b"x"
    map_calls[0] = 0
    nothing = rs.from_list([{"text": "ab", "n": i} for i in range(10)]).map(tokenize_counted).cache(max_bytes=0)
    list(nothing), list(nothing)
    assert map_calls[0] == 20 and nothing.computed == 20, "max_bytes=0 keeps nothing"
    (tmp_path / "in-the-way").write_text("x")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert list(rs.from_list([{"a": 1}]).cache(str(tmp_path / "in-the-way"))) == [{"a": 1}]
    assert [w.category.__name__ for w in caught] == ["CacheWarning"]
    factory = resumable.ops.cache.cache(rs.from_list([1, 2]), None, max_bytes=10, block_size=2)  # type: ignore[attr-defined]
    assert type(factory) is rs.nodes.Cache and list(factory) == [1, 2]


# -- docs/formats.md ------------------------------------------------------------------------


def test_formats_md_parquet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    for f in range(2):
        table = pa.table({"text": [f"t{f}-{i}" for i in range(30)], "id": list(range(30))})
        pq.write_table(table, f"data/{f}.parquet", row_group_size=8)
    pipe = rs.parquet("data/*.parquet", columns=["text"]).shuffle(seed=0, block_size="row_group").shard()
    assert type(pipe.upstream) is rs.nodes.BlockShuffle
    assert sorted(r["text"] for r in pipe) == sorted(f"t{f}-{i}" for f in range(2) for i in range(30))
    source = rs.parquet("data/*.parquet")
    assert source.locate(37) == ("data/1.parquet", 0, 7)
    assert source.block_bounds().tolist() == [0, 8, 16, 24, 30, 38, 46, 54, 60] and source.num_row_groups == 8
    for bad in ({"columns": "text"}, {"cache_row_groups": 0}):
        with pytest.raises(rs.ConfigError):
            rs.parquet("data/*.parquet", **bad)
    with pytest.raises(rs.SourceError, match="no column"):
        rs.parquet("data/*.parquet", columns=["nope"])
    (tmp_path / "bad.parquet").write_text("nope")
    with pytest.raises(rs.SourceError, match="cannot read 'bad.parquet' as Parquet"):
        rs.parquet("bad.parquet")
    collector: list[Any] = []
    table = pa.table({"x": list(range(10))})
    pq.write_to_dataset(table, "out.parquet", metadata_collector=collector)
    pq.write_metadata(table.schema, "out.parquet/_metadata", metadata_collector=collector)
    pq.write_metadata(table.schema, "out.parquet/_common_metadata")
    (tmp_path / "out.parquet" / "_SUCCESS").write_text("")
    assert len(rs.parquet("out.parquet/*")) == 10
    with pytest.raises(rs.SourceError, match="summary"):
        rs.parquet("out.parquet/_metadata")
    shard = rs.parquet("data/*.parquet").shuffle(0, block_size="row_group").shard()
    next(shard)
    state = shard.get_state()
    assert {k: state["upstream"][k] for k in ("seed", "block_size", "window")} == {
        "seed": 0,
        "block_size": "row_group",
        "window": 4,
    }
    assert state["upstream"]["upstream"]["files"][0][3].startswith("parquet-footer-xxh3_64:")
    with pytest.raises(rs.StateError, match=r"^Shard > BlockShuffle: state was saved with window=4"):
        rs.parquet("data/*.parquet").shuffle(0, block_size="row_group", window=3).shard().set_state(state)


def test_formats_md_arrow_and_block_shuffle(tmp_path: Path) -> None:
    table = pa.table({"x": list(range(20))})
    with pa.ipc.new_file(tmp_path / "a.arrow", table.schema) as writer:
        for batch in table.to_batches(max_chunksize=7):
            writer.write_batch(batch)
    with pa.ipc.new_stream(tmp_path / "b.arrow", table.schema) as writer:
        for batch in table.to_batches(max_chunksize=5):
            writer.write_batch(batch)
    source = rs.arrow(str(tmp_path / "*.arrow"))
    assert len(source) == 40 and source.block_bounds().tolist() == [0, 7, 14, 20, 25, 30, 35, 40]
    assert source.get_state()["files"][0][3].startswith("arrow-ipc-metadata-xxh3_64:")
    shuffled = rs.arrow(str(tmp_path / "*.arrow")).shuffle(1, block_size="row_group")
    assert sorted(r["x"] for r in shuffled) == sorted(list(range(20)) * 2)
    (tmp_path / "bad.arrow").write_text("nope")
    with pytest.raises(rs.SourceError, match="neither an Arrow IPC file nor an Arrow IPC stream"):
        rs.arrow(str(tmp_path / "bad.arrow"))
    with pytest.raises(rs.ConfigError):
        rs.from_list(list(range(10))).shuffle(0, block_size="row_group")
    windowed = rs.from_list(list(range(3000))).shuffle(0, window=4)
    assert type(windowed) is rs.nodes.BlockShuffle and windowed.get_state()["block_size"] == 1024
    assert rs.nodes.BlockShuffle(rs.from_list(list(range(10)))).get_state()["window"] == 4


# -- docs/parallel.md -----------------------------------------------------------------------


def parallel_example(prefetch: bool = True) -> rs.Node:
    pipe = (
        rs.from_list(list(range(200)))
        .shuffle(seed=0)
        .map(tok_numbers, num_workers=4)
        .filter(lambda ex: len(ex["input_ids"]) > 0)
        .pack(seq_len=16)
        .batch(8)
    )
    return pipe.prefetch(4) if prefetch else pipe


def walk(state: dict[str, Any]) -> list[Any]:
    """A state's nodes, a packer's references expanded (their saved form may differ)."""
    out = []
    node: dict[str, Any] | None = state
    while node:
        if node.get("kind") == "Pack":
            full = expand_references(node)
            out.append(
                {k: full[k] for k in ("open", "ready", "span", "inherited", "open_sizes", "ready_sizes", "stats")}
            )
        else:
            out.append({k: v for k, v in node.items() if k != "upstream"})
        node = node.get("upstream")
    return out


def test_parallel_md_example_state_is_that_of_the_last_item_handed_out() -> None:
    pipe, serial = parallel_example(), parallel_example(prefetch=False)
    for _ in range(3):
        next(pipe), next(serial)
    state = pipe.get_state()
    assert (state["kind"], set(state)) == ("Prefetch", {"kind", "version", "ended", "upstream"})
    assert state["upstream"]["upstream"]["upstream"]["upstream"]["kind"] == "ParallelMap"
    assert walk(state["upstream"]) == walk(serial.get_state())
    restored = parallel_example()
    restored.set_state(state)
    assert rows_equal(next(restored), next(pipe))
    pipe.close()
    restored.close()


def test_parallel_md_exceptions() -> None:
    pipe = rs.from_list(list(range(6))).shuffle(0).map(fail_on_two, num_workers=2)
    got: list[Any] = []
    while True:
        try:
            got.append(next(pipe))
        except StopIteration:
            break
        except rs.MapError as error:
            got.append(("MapError", error.key, type(error.__cause__).__name__))
    assert ("MapError", (0, 2), "KeyError") in got and len(got) == 6
    prefetched = rs.from_list(list(range(6))).map(fail_on_two).prefetch(2)
    got = []
    while True:
        try:
            got.append(next(prefetched))
        except StopIteration:
            break
        except KeyError as error:
            got.append(("KeyError", any("Prefetch" in note for note in getattr(error, "__notes__", []))))
    assert got == [0, 1, ("KeyError", True), 3, 4, 5]
    with pytest.raises(rs.ConfigError, match="picklable"):
        rs.from_list([1]).map(lambda x: x, num_workers=2, mode="process")
    with pytest.raises(rs.ConfigError, match="num_workers >= 1"):
        rs.from_list([1]).map(same, batched=True)
    columns = rs.from_list(list(range(6))).map(lambda records: {"a": records}, num_workers=1, batched=True)
    with pytest.raises(rs.MapError) as caught:
        next(columns)
    assert isinstance(caught.value.__cause__, rs.ConfigError)
    columns.close()


chunk_sizes: list[int] = []


def double_batch(records: list[int]) -> list[int]:
    chunk_sizes.append(len(records))
    return [2 * r for r in records]


def double(record: int) -> int:
    return 2 * record


def test_parallel_md_chunks_and_what_shapes_no_data() -> None:
    chunk_sizes.clear()
    assert list(rs.from_list(list(range(300))).map(double_batch, num_workers=1, batched=True)) == [
        2 * r for r in range(300)
    ]
    assert chunk_sizes[0] == 1 and max(chunk_sizes) == 64 and chunk_sizes[:8] == sorted(chunk_sizes[:8])
    saved = rs.from_list(list(range(300))).map(double_batch, num_workers=8, batched=True)
    for _ in range(50):
        next(saved)
    state = saved.get_state()
    saved.close()
    for other in (
        rs.from_list(list(range(300))).map(double, num_workers=2),
        rs.from_list(list(range(300))).map(double_batch, num_workers=1, mode="thread", batched=True),
    ):
        other.set_state(state)
        assert next(other) == 100
        other.close()
    mapped = rs.from_list(list(range(10))).shuffle(0).map(double, num_workers=2)
    first = next(mapped)
    key = mapped.last_key()
    assert key is not None and mapped.fetch(key) == first
    mapped.close()


# -- docs/torch.md --------------------------------------------------------------------------


def torch_example_build() -> rs.Node:
    return (
        rs.jsonl("data/*.jsonl")
        .shuffle(seed=0)
        .shard()
        .repeat()
        .map(tokenize)
        .pack(256)
        .batch(8, collate_fn=collate_rows)
    )


def test_torch_md_example_checkpoint_and_resume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    texts(tmp_path)
    monkeypatch.chdir(tmp_path)
    model = torch.nn.Linear(2, 2)
    optimiser = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = rst.Loader(torch_example_build, num_workers=2)
    seen = []
    for step, batch in enumerate(loader):
        seen.append(batch)
        if step % 3 == 0:
            rst.save(
                {"model": model.state_dict(), "optimiser": optimiser.state_dict(), "data": loader.state_dict()},
                "ckpt.pt",
            )
        if step == 4:
            break
    assert isinstance(seen[0]["input_ids"], torch.Tensor) and seen[0]["input_ids"].shape == (8, 256)
    loader.close()
    checkpoint = rst.load("ckpt.pt")
    model.load_state_dict(checkpoint["model"])
    optimiser.load_state_dict(checkpoint["optimiser"])
    resumed = rst.Loader(torch_example_build, num_workers=2)
    resumed.load_state_dict(checkpoint["data"])
    assert rows_equal(next(iter(resumed)), seen[4]), "saved at step 3: the next batch is step 4's"
    resumed.close()


def numbers_build() -> rs.Node:
    return rs.from_list(list(range(20))).shuffle(seed=0).shard().batch(3)


def other_seed_build() -> rs.Node:
    return rs.from_list(list(range(20))).shuffle(seed=1).shard().batch(3)


def as_is(batch: Any) -> Any:
    return batch


def test_torch_md_loader_options() -> None:
    for options, says in (
        ({"collate_fn": 5}, "collate_fn must be callable"),
        ({"num_workers": 1, "worker_init_fn": 5}, "worker_init_fn must be callable"),
        ({"num_workers": 1, "timeout": -1}, "timeout"),
        ({"timeout": 5}, "num_workers=0"),
        ({"num_workers": 1, "prefetch_factor": 0}, "prefetch_factor"),
    ):
        with pytest.raises(rs.ConfigError, match=says):
            rst.Loader(numbers_build, **options)
    for reordering in ("batch_size", "shuffle", "sampler", "drop_last", "generator"):
        with pytest.raises(TypeError):
            rst.Loader(numbers_build, **{reordering: None})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rst.Loader(numbers_build, snapshot_every_n_steps=1)
    with pytest.warns(FutureWarning):
        rst.Loader(numbers_build, snapshot_every_n_steps=16)
    loader = rst.Loader(numbers_build)
    for frozen in (
        "num_workers",
        "collate_fn",
        "worker_init_fn",
        "timeout",
        "prefetch_factor",
        "multiprocessing_context",
    ):
        with pytest.raises(rs.ConfigError, match="cannot be changed"):
            setattr(loader, frozen, getattr(loader, frozen))
    assert len(loader) == 7
    with pytest.raises(TypeError, match="workers"):
        len(rst.Loader(numbers_build, num_workers=2))


def test_torch_md_epochs_and_collation() -> None:
    loader = rst.Loader(numbers_build)
    passes = []
    for _ in range(2):
        passes.append([int(x) for batch in loader for x in batch])
        assert sorted(passes[-1]) == list(range(20))
    assert passes[0] != passes[1] and loader.epoch == 1
    ended = loader.state_dict()  # after the epoch's last batch and its StopIteration
    resumed = rst.Loader(numbers_build)
    resumed.load_state_dict(ended)
    iterator = iter(resumed)
    assert resumed.epoch == 2
    list(iterator)
    iter(resumed)
    assert resumed.epoch == 3
    at_last = rst.Loader(numbers_build)
    iterator = iter(at_last)
    for _ in range(len(at_last)):
        next(iterator)
    finishing = rst.Loader(numbers_build)
    finishing.load_state_dict(at_last.state_dict())
    assert list(finishing) == [] and finishing.epoch == 0
    assert len(list(finishing)) == 7 and finishing.epoch == 1
    rows = rs.from_list([{"a": np.arange(2), "s": np.int64(5), "t": "x", "l": [1, 2], "n": 3}]).batch(1)
    [converted] = next(iter(rst.Loader(rows)))
    assert isinstance(converted["a"], torch.Tensor) and isinstance(converted["s"], torch.Tensor)
    assert (converted["t"], converted["l"], converted["n"]) == ("x", [1, 2], 3)
    [kept] = next(iter(rst.Loader(rs.from_list([{"a": np.arange(2)}]).batch(1), num_workers=2, collate_fn=as_is)))
    assert isinstance(kept["a"], np.ndarray)


def test_torch_md_state_and_validation() -> None:
    loader = rst.Loader(numbers_build, num_workers=2)
    iterator = iter(loader)
    head = [next(iterator) for _ in range(3)]
    state = loader.state_dict()
    assert set(state) == {"format", "epoch", "rank", "world_size", "num_workers", "snapshot_every_n_steps", "loader"}
    assert (state["format"], state["snapshot_every_n_steps"], state["num_workers"]) == ("resumable.Loader/3", 1, 2)
    worker = state["loader"]["_snapshot"]["_worker_snapshots"]["worker_1"]["fetcher_state"]["dataset_iter_state"]
    assert set(worker) == {"pipeline", "epoch"} and json.loads(worker["pipeline"])["kind"] == "Batch"
    rest = list(iterator)
    loader.close()
    with pytest.raises(rs.StateError, match="num_workers=2, this loader has num_workers=1"):
        rst.Loader(numbers_build, num_workers=1).load_state_dict(state)
    damaged = json.loads(json.dumps(state))
    damaged["loader"]["_snapshot"]["_worker_snapshots"]["worker_1"]["fetcher_state"]["dataset_iter_state"][
        "pipeline"
    ] = "{nope"
    target = rst.Loader(numbers_build, num_workers=2)
    target.load_state_dict(state)
    with pytest.raises(rs.StateError) as error:
        target.load_state_dict(damaged)
    assert str(error.value).startswith(
        "Loader rank 0/1 worker 1 at loader._snapshot._worker_snapshots.worker_1: the pipeline state is not valid JSON"
    )
    assert [plain(b) for b in target] == [plain(b) for b in rest], "a refused state leaves the loader as it was"
    other = rst.Loader(other_seed_build, num_workers=2)
    other.load_state_dict(state)  # each worker validates its own pipeline state: at the first batch
    with pytest.raises(rs.StateError, match="state was saved with seed=0, this pipeline has seed=1"):
        next(iter(other))
    other.close()
    assert len(head) == 3


def test_torch_md_shutdown_and_plain_dataloader() -> None:
    for workers in (0, 2):
        whole = [plain(b) for b in rst.Loader(numbers_build, num_workers=workers)]
        loader = rst.Loader(numbers_build, num_workers=workers)
        iterator = iter(loader)
        head = [plain(next(iterator)) for _ in range(3)]
        loader.close()
        assert head + [plain(b) for b in loader] == whole, "the next iter() starts where the old workers stopped"
    with rst.Loader(numbers_build, num_workers=1) as loader:
        assert len(next(iter(loader))) == 3
    dataset = rst.PipelineDataset(numbers_build)
    assert isinstance(dataset, torch.utils.data.IterableDataset)
    plain_loader = torch.utils.data.DataLoader(dataset, batch_size=None)
    passes = [[int(x) for b in plain_loader for x in b] for _ in range(2)]
    assert passes[0] != passes[1], "without workers each iter() starts the next epoch"
    for bad in ("1", -1, True, 1.0):
        with pytest.raises(rs.ConfigError):
            dataset.set_epoch(bad)  # type: ignore[arg-type]
    dataset.set_epoch(np.int64(2))


def test_set_epoch_refuses_an_epoch_past_the_last_at_the_call() -> None:
    """docs/torch.md: ``set_epoch`` "refuses anything else at the call"; docs/state.md: epochs
    run to 2^62, ``start_epoch`` past it is a ``ConfigError``."""
    dataset = rst.PipelineDataset(numbers_build)
    with pytest.raises(rs.ConfigError):
        dataset.set_epoch(2**62 + 1)


def test_torch_md_checkpoint_files(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / ".ckpt.pt.partial").write_bytes(b"left by a killed save")
    rst.save({"w": torch.ones(2)}, tmp_path / "sub" / "ckpt.pt")
    assert os.listdir(tmp_path / "sub") == ["ckpt.pt"]
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE((tmp_path / "sub" / "ckpt.pt").stat().st_mode) == 0o666 & ~umask
    rst.save({"w": torch.ones(1)}, os.fsencode(tmp_path / "new" / "b.pt"))  # type: ignore[arg-type]
    assert torch.equal(rst.load(tmp_path / "new" / "b.pt")["w"], torch.ones(1))
    with pytest.raises(IsADirectoryError):
        rst.save({"w": 1}, str(tmp_path / "dir") + "/")
    torch.save({"x": argparse.Namespace(a=1)}, tmp_path / "unsafe.pt")
    with pytest.raises(pickle.UnpicklingError):  # weights_only: nothing is unpickled
        rst.load(tmp_path / "unsafe.pt")


def test_torch_md_balanced_ranks_and_pack_figures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    texts(tmp_path, files=2)
    monkeypatch.chdir(tmp_path)

    def build() -> rs.Node:
        return (
            rs.jsonl("data/*.jsonl")
            .shuffle(seed=0)
            .shard()
            .map(tokenize)
            .pack(64, strategy="bfd")
            .batch(8, collate_fn=collate_rows)
            .even()
        )

    pipe = build()
    per_epoch = [sum(1 for _ in pipe) for _ in range(3)]
    assert per_epoch == [len(build().upstream)] * 3 and pipe.leftover == 0
    pack = rs.jsonl("data/*.jsonl").shuffle(seed=0).shard().map(tokenize).pack(64, strategy="bfd")
    pipe = pack.batch(8, collate_fn=collate_rows).even()
    figures: dict[str, float] = {}
    for batch in pipe:
        figures = rst.pack_figures(batch, stats=pack.stats)
    assert set(figures) == {
        "seq_len_min",
        "seq_len_avg",
        "seq_len_max",
        "batch_tokens_min",
        "batch_tokens_avg",
        "batch_tokens_max",
        "efficiency",
        "epoch_rows_min",
        "epoch_rows_max",
        "epoch_efficiency",
    }
    assert figures["epoch_rows_min"] == figures["epoch_rows_max"] == pack.stats.rows
    assert figures["epoch_efficiency"] == pytest.approx(pack.stats.efficiency)
    with pytest.raises(rs.ConfigError):
        rs.from_list([1, 2]).filter(bool).even()  # len() unknown


def test_torch_md_torchdata_interop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torchdata.nodes as tn

    write_jsonl(tmp_path / "data" / "a.jsonl", [{"n": i} for i in range(20)])
    monkeypatch.chdir(tmp_path)

    def make() -> Any:
        return tn.Loader(tn.Batcher(rst.ToTorchdata(rs.jsonl("data/*.jsonl").shuffle(0).map(lambda r: r["n"])), 8))

    loader = make()
    epochs = [[x for batch in loader for x in batch] for _ in range(3)]
    assert all(len(epoch) == len(set(epoch)) == 16 and set(epoch) <= set(range(20)) for epoch in epochs)
    assert len({tuple(epoch) for epoch in epochs}) == 3, "each epoch: the pipeline's next epoch, a new order"
    loader = make()
    iterator = iter(loader)
    next(iterator)
    state = loader.state_dict()
    json.dumps(state)  # plain JSON
    rest = list(iterator)
    again = make()
    again.load_state_dict(state)
    assert list(again) == rest
    mapper = tn.ParallelMapper(tn.IterableWrapper(range(10)), lambda x: {"v": x}, num_workers=2)
    pipe = rst.FromTorchdata(mapper).filter(lambda r: r["v"] % 2 == 0).batch(8).repeat(2)
    assert [[r["v"] for r in batch] for batch in pipe] == [[0, 2, 4, 6, 8]] * 2
    pipe.close()
    with pytest.raises(rs.ConfigError):
        rst.FromTorchdata(tn.IterableWrapper(range(3))).shuffle(0)
    with pytest.raises(rs.StateError):
        rst.ToTorchdata(rs.from_list([1, 2]).shuffle(0)).reset({"kind": "Batch", "version": 1})


def test_torch_md_inspect_a_loader_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    (tmp_path / "mytraining_data.py").write_text(
        "import resumable as rs\n\n\ndef build():\n"
        "    return rs.from_list(list(range(20))).shuffle(seed=0).shard().batch(2)\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    from mytraining_data import build  # type: ignore[import-not-found]

    loader = rst.Loader(build, num_workers=2)
    iterator = iter(loader)
    for _ in range(3):
        next(iterator)
    rst.save(
        {"model": {"w": torch.ones(2)}, "data": loader.state_dict(), "args": argparse.Namespace(lr=0.1)},
        tmp_path / "ckpt.pt",
    )
    (tmp_path / "ckpt").mkdir()
    rs.save_state(loader.state_dict(), tmp_path / "ckpt" / "data-rank0.json")
    loader.close()
    reports = []
    for args in (
        ["ckpt/data-rank0.json"],
        ["ckpt.pt"],
        ["ckpt"],
        ["ckpt/data-rank0.json", "--pipeline", "mytraining_data:build"],
    ):
        code, out, err = run_cli("inspect", *args, capsys=capsys)
        assert code == 0, err
        assert "rank 0/1: Loader epoch 0, 3 batches handed out in this pass" in out
        assert "  worker positions as of the last batch handed out (the workers' snapshot at batch 3)" in out
        table = [line.split() for line in out.splitlines() if line.startswith("rank 0/1, worker") and "%" in line]
        assert [row[:4] + row[-3:] for row in table] == [
            ["rank", "0/1,", "worker", "0/2"] + ["10", "40.0%", "no"],
            ["rank", "0/1,", "worker", "1/2"] + ["10", "20.0%", "no"],
        ]
        reports.append(out.split("\n", 1)[1])
    assert len(set(reports)) == 1
    head = subprocess.run(
        f"{sys.executable} -m resumable inspect ckpt/data-rank0.json | head -1",
        shell=True,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert head.stdout == "ckpt/data-rank0.json: 2 pipeline states\n" and head.stderr == ""


def test_torch_md_per_rank_checkpoint(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    loader = rst.Loader(numbers_build)
    iterator = iter(loader)
    next(iterator)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"data": rst.PerRank(loader)}, checkpoint_id=str(tmp_path / "dcp"))
        rest = [plain(b) for b in iterator]
        old = rst.load_all_ranks(str(tmp_path / "dcp"), key="data")
        assert isinstance(old, list) and len(old) == 1
        for given in (old, old[0]):  # a list of one state per old rank, same topology: the exact path
            resumed = rst.Loader(numbers_build)
            resumed.load_state_dict(given)
            assert [plain(b) for b in resumed] == rest
        resumed = rst.Loader(numbers_build)
        dcp.load({"data": rst.PerRank(resumed)}, checkpoint_id=str(tmp_path / "dcp"))
    assert [plain(b) for b in resumed] == rest


def test_torch_md_nodes_and_loader_are_stateful() -> None:
    from torch.distributed.checkpoint.stateful import Stateful
    from torchdata.stateful_dataloader import StatefulDataLoader

    pipe = rs.from_list([1]).batch(1)
    loader = rst.Loader(pipe)
    assert isinstance(pipe, Stateful) and isinstance(loader, Stateful) and isinstance(loader, StatefulDataLoader)
    assert pipe.state_dict() == pipe.get_state()


# -- docs/elastic.md ------------------------------------------------------------------------


def elastic_build() -> rs.Node:
    return rs.from_list(list(range(50))).shuffle(seed=0).shard().map(same).batch(3)


def test_elastic_md_loader_example(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    seen: list[int] = []
    old_world_size = 2
    for rank in range(old_world_size):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", str(old_world_size))
        loader = rst.Loader(elastic_build, num_workers=2)
        iterator = iter(loader)
        for _ in range(2 + rank):
            seen += [int(x) for x in next(iterator)]
        rs.save_state(loader.state_dict(), f"ckpt/rank{rank}.json")
        loader.close()
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: more workers than cores
        loader = rst.Loader(elastic_build, num_workers=3)
        old = [rs.load_state(f"ckpt/rank{r}.json") for r in range(old_world_size)]
        loader.load_state_dict(old)
        rest = [int(x) for batch in loader for x in batch]
        assert sorted(seen + rest) == list(range(50)), "each document once"
        assert sorted(int(x) for batch in loader for x in batch) == list(range(50))
        loader.close()


def test_elastic_md_pipelines_without_a_loader(tmp_path: Path, capsys: Any) -> None:
    def build(c: int, n: int) -> rs.Node:
        return rs.from_list(list(range(50))).shuffle(0).shard(c, n).filter(lambda x: True).batch(2)

    olds, seen = [], []
    for c in range(3):
        pipe = build(c, 3)
        for _ in range(c + 1):
            seen += next(pipe)
        olds.append(pipe.get_state())
    rest = []
    for r in range(2):
        pipe = build(r, 2)
        resumable.elastic.restore(pipe, olds)
        rest += [x for batch in pipe for x in batch]
    assert sorted(seen + rest) == list(range(50))
    state = resumable.elastic.rescaled_state(build(0, 2), olds)
    assert state["kind"] == "Batch"
    with pytest.raises(rs.ConfigError):
        resumable.elastic.restore(rs.from_list([1, 2]).filter(bool), [rs.from_list([1, 2]).filter(bool).get_state()])
    documents = [{"input_ids": list(range(1, 2 + (i * 5) % 11))} for i in range(120)]
    packers = []
    for c in range(3):
        pipe = rs.from_list(documents).shuffle(0).shard(c, 3).pack(16, strategy="best_fit", buffer_size=8).batch(2)
        for _ in range(2 + c):
            next(pipe)
        packers.append(pipe.get_state())
    new = rs.from_list(documents).shuffle(0).shard(0, 2).pack(16, strategy="best_fit", buffer_size=8).batch(2)
    rs.save_state(resumable.elastic.rescaled_state(new, packers), tmp_path / "rescaled.json")
    code, out, _ = run_cli("inspect", str(tmp_path / "rescaled.json"), capsys=capsys)
    assert code == 0
    assert "inherited from other consumers in a rescale" in out
    assert re.search(
        r"level of 3 old consumers over 120 positions: cursors \d+\.\.\d+, band of \d+ unread positions, tail from \d+",
        out,
    )
