"""python -m resumable inspect: readable summaries of saved states."""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

import resumable as rs
import resumable.torch as rst
from resumable.cli import main
from resumable.inspect import chain, describe
from tests.resume import take
from tests.test_loader import legacy_loader, legacy_state


def source(tmp_path: Path) -> str:
    path = tmp_path / "docs.jsonl"
    if not path.exists():
        path.write_text("".join(f'{{"id": {i}}}\n' for i in range(120)))
    return str(path)


def build(tmp_path: Path) -> rs.Node:
    return rs.jsonl(source(tmp_path)).shuffle(2).shard(1, 2).map(lambda r: r["id"]).filter(lambda x: x % 4).batch(3)


def test_pipeline_state_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pipe = build(tmp_path)
    take(pipe, 5)
    rs.save_state(pipe.get_state(), tmp_path / "state.json")
    assert main(["inspect", str(tmp_path / "state.json")]) == 0
    out = capsys.readouterr().out
    assert "pipeline: Batch > Filter > IndexedMap > Shard > Shuffle > JsonlSource" in out
    position = pipe.get_state()["upstream"]["upstream"]["position"]
    row = next(line for line in out.splitlines() if line.startswith("state.json"))
    assert row.split()[1:5] == ["0", str(position), "60", f"{100 * position / 60:.1f}%"]
    assert "Filter: dropped=" in out and "Shard: rank=1, world_size=2" in out
    assert "docs.jsonl" in out and "files of JsonlSource (1)" in out


def test_loader_state_lists_every_worker(tmp_path: Path) -> None:
    def pipeline() -> rs.Node:
        return build(tmp_path).upstream.batch(3, collate_fn=np.array)

    loader = rst.Loader(pipeline, num_workers=2)
    iterator = iter(loader)
    for _ in range(4):
        next(iterator)
    rs.save_state(loader.state_dict(), tmp_path / "loader.json")
    out = describe(str(tmp_path / "loader.json"))
    assert "2 pipeline states" in out
    assert "rank 0/1, worker 0/2" in out and "rank 0/1, worker 1/2" in out


def test_directory_of_rank_files_torch_checkpoint_and_dcp(tmp_path: Path) -> None:
    pipe = build(tmp_path)
    take(pipe, 2)
    states = tmp_path / "states"
    states.mkdir()
    rs.save_state(pipe.get_state(), states / "rank0.json")
    rs.save_state(pipe.get_state(), states / "rank1.json")
    assert describe(str(states)).startswith(f"{states}: 2 pipeline states")

    rst.save({"step": 7, "data": pipe.get_state()}, tmp_path / "ckpt.pt")
    assert "Shuffle: seed=2" in describe(str(tmp_path / "ckpt.pt"))

    dcp.save({"data": rst.PerRank(pipe)}, checkpoint_id=str(tmp_path / "dcp"))
    assert "pipeline: Batch > Filter" in describe(str(tmp_path / "dcp"))


class Config:
    """A training script's own object saved in its checkpoint, which weights_only refuses."""

    def __init__(self) -> None:
        self.lr = 0.1


class Holder:
    """A training script's object that holds the data state among its attributes."""

    def __init__(self, data: dict[str, object]) -> None:
        self.data = data


class RunsCode:
    """An object whose unpickling would run code (a crafted checkpoint): Python's ``exec``, or
    ``os.system``, whose module torch refuses outright."""

    def __init__(self, marker: Path, through_os: bool = False) -> None:
        self.marker = marker
        self.through_os = through_os

    def __reduce__(self) -> tuple[object, tuple[str]]:
        if self.through_os:
            return os.system, (f"touch {self.marker}",)
        return exec, (f"open({str(self.marker)!r}, 'w').close()",)


def test_checkpoints_holding_objects_that_are_not_plain_data_are_inspected_without_running_them(
    tmp_path: Path,
) -> None:
    pipe = build(tmp_path)
    take(pipe, 2)
    marker = tmp_path / "ran"
    others = {
        "args": argparse.Namespace(lr=0.1),
        "config": Config(),
        "when": datetime.datetime(2020, 1, 1),
        "crafted": RunsCode(marker),
        "weights": torch.ones(3),
    }
    rst.save({"data": pipe.get_state(), **others}, tmp_path / "ckpt.pt")
    assert "Shuffle: seed=2" in describe(str(tmp_path / "ckpt.pt"))
    rst.save({"trainer": Holder(pipe.get_state()), "pair": (1, pipe.get_state())}, tmp_path / "held.pt")
    assert describe(str(tmp_path / "held.pt")).startswith(f"{tmp_path / 'held.pt'}: 2 pipeline states")
    dcp.save({"data": rst.PerRank(pipe), "others": others}, checkpoint_id=str(tmp_path / "dcp"))
    assert "Shuffle: seed=2" in describe(str(tmp_path / "dcp"))
    assert rst.load_all_ranks(tmp_path / "dcp") == [json.loads(json.dumps(pipe.get_state()))]
    assert not marker.exists()
    with pytest.raises(pickle.UnpicklingError):  # rst.load stays plain torch.load(weights_only=True)
        rst.load(tmp_path / "ckpt.pt")
    rst.save({"data": pipe.get_state(), "crafted": RunsCode(marker, through_os=True)}, tmp_path / "os.pt")
    with pytest.raises(rs.StateError, match="os.pt: a torch checkpoint .* GLOBAL posix.system"):
        describe(str(tmp_path / "os.pt"))
    assert not marker.exists()


def test_a_per_rank_entry_that_is_not_plain_data_is_a_state_error_naming_it(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    dcp.save({"data": {"rank_0": RunsCode(marker)}}, checkpoint_id=str(tmp_path / "dcp"))
    with pytest.raises(rs.StateError, match="data.rank_0.*not plain data"):
        rst.load_all_ranks(tmp_path / "dcp")
    assert not marker.exists()


def test_not_a_state(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "other.json").write_text('{"lr": 0.1}')
    assert main(["inspect", str(tmp_path / "other.json")]) == 2
    assert "no resumable state found" in capsys.readouterr().err
    assert main(["inspect", str(tmp_path / "missing.json")]) == 2


def test_packer_buffer_is_summarised(tmp_path: Path) -> None:
    documents = [{"input_ids": np.arange(n)} for n in np.random.default_rng(0).integers(1, 300, 200)]
    pipe = rs.from_list(documents).shuffle(1).pack(256, buffer_size=40).batch(2)
    take(pipe, 5)
    rs.save_state(pipe.get_state(), tmp_path / "pack.json")
    out = describe(str(tmp_path / "pack.json"))
    pending = len(set(pipe.upstream.pending_keys()))
    assert f"buffer: {pending} documents referenced" in out
    assert "stats: documents=" in out


def test_packer_buffer_is_one_line_in_every_form_of_its_state(tmp_path: Path) -> None:
    """A packer saves its buffer as reference lists, in a compact encoding, or as an earlier
    state and the events since: the report summarises it the same way in each, its current
    statistics once, and shows none of the raw entries (a base64 blob, an event log)."""
    documents = [{"input_ids": np.arange(n)} for n in np.random.default_rng(0).integers(1, 300, 200)]
    pipe = rs.from_list(documents).shuffle(1).pack(256, strategy="best_fit", buffer_size=40)
    forms = set()
    for step in range(12):
        next(pipe)
        state = pipe.get_state()
        form = "events" if "base_progress" in state else "compact" if "refs" in state else "lists"
        forms.add(form)
        rs.save_state(state, tmp_path / f"pack{step}.json")
        out = describe(str(tmp_path / f"pack{step}.json"))
        pending = len(set(pipe.pending_keys()))
        assert f"buffer: {pending} documents referenced" in out, form
        assert out.count("stats: ") == 1 and f"rows={step + 1}," in out, form
        for raw in ("refs", "data=", "base_progress", "events_since", "event_origins", "sections", "open_sizes"):
            assert raw not in out, (form, raw)
    assert {"events", "compact"} <= forms


def test_mix_components_are_described(tmp_path: Path) -> None:
    pipe = rs.mix(
        {"web": rs.from_list(list(range(50))).shuffle(1), "code": rs.from_list(list(range(30))).shuffle(2)},
        weights={"web": 0.7, "code": 0.3},
    ).batch(4)
    take(pipe, 5)
    rs.save_state(pipe.get_state(), tmp_path / "mix.json")
    out = describe(str(tmp_path / "mix.json"))
    assert "component web: Shuffle > FromList, epoch 0, position" in out
    assert "component code: Shuffle > FromList" in out


def test_rescaled_state_shows_its_band_and_inherited_pieces(tmp_path: Path) -> None:
    from resumable.elastic import restore

    def packed(rank: int, world_size: int) -> rs.Node:
        documents = [{"input_ids": list(range(1 + i % 23))} for i in range(200)]
        return rs.from_list(documents).shuffle(1).shard(rank, world_size).pack(16, buffer_size=8)

    old = [packed(c, 4) for c in range(4)]
    for consumer, pipe in enumerate(old):
        take(pipe, 3 + consumer)
    new = packed(1, 3)
    restore(new, [pipe.get_state() for pipe in old])
    rs.save_state(new.get_state(), tmp_path / "rescaled.json")
    out = describe(str(tmp_path / "rescaled.json"))
    assert "rescaled epoch 0: strides over the" in out
    assert "level of 4 old consumers over 200 positions: cursors" in out and "band of" in out
    assert "pieces inherited from other consumers in a rescale" in out


def sharded(tmp_path: Path) -> rs.Node:
    return rs.jsonl(source(tmp_path)).shuffle(2).shard().map(lambda r: r["id"]).filter(lambda x: x % 4).batch(3)


def worker_rows(report: str) -> list[str]:
    return [line for line in report.splitlines() if line.startswith("rank 0/1, worker") and "%" in line]


def test_loader_state_shows_every_worker_as_of_the_last_batch_handed_out(tmp_path: Path) -> None:
    """Workers hand their state over with every batch: nothing handed out since, nothing to replay."""
    build = functools.partial(sharded, tmp_path)
    loader = rst.Loader(build, 2)
    iterator = iter(loader)
    for _ in range(6):
        next(iterator)
    rs.save_state(loader.state_dict(), tmp_path / "loader.json")
    out = describe(str(tmp_path / "loader.json"))
    assert "rank 0/1: Loader epoch 0, 6 batches handed out in this pass" in out
    assert "worker positions as of the last batch handed out (the workers' snapshot at batch 6)" in out
    assert "handed out since" not in out and "replayed" not in out
    assert describe(str(tmp_path / "loader.json"), build) == out


def test_legacy_loader_state_shows_the_snapshot_and_with_the_pipeline_what_was_handed_out(tmp_path: Path) -> None:
    """A state saved by an earlier version between two snapshots: the report says so, and
    ``--pipeline`` advances the workers to the last batch handed out."""
    build = functools.partial(sharded, tmp_path)
    every_fourth, every_batch = legacy_loader(build, 4, num_workers=2), rst.Loader(build, 2)
    for loader in (every_fourth, every_batch):
        iterator = iter(loader)
        for _ in range(6):
            next(iterator)
    rs.save_state(legacy_state(every_fourth, 4), tmp_path / "every_fourth.json")
    rs.save_state(every_batch.state_dict(), tmp_path / "every_batch.json")
    exact = describe(str(tmp_path / "every_batch.json"))

    at_snapshot = describe(str(tmp_path / "every_fourth.json"))
    assert "rank 0/1: Loader epoch 0, 6 batches handed out in this pass" in at_snapshot
    assert (
        "as of the workers' snapshot at batch 4, not counting the 2 batches handed out since (a state saved by an "
        "earlier version; pass --pipeline MODULE:FUNCTION to replay them)" in at_snapshot
    )
    assert worker_rows(at_snapshot) != worker_rows(exact)

    replayed = describe(str(tmp_path / "every_fourth.json"), build)
    assert "as of the last batch handed out: 2 batches replayed from the workers' snapshot at batch 4" in replayed
    assert worker_rows(replayed) == worker_rows(exact)


def test_loader_state_without_workers_is_exact(tmp_path: Path) -> None:
    loader = rst.Loader(functools.partial(sharded, tmp_path))
    iterator = iter(loader)
    for _ in range(5):
        next(iterator)
    rs.save_state(loader.state_dict(), tmp_path / "loader.json")
    out = describe(str(tmp_path / "loader.json"))
    assert "rank 0/1: Loader epoch 0, 5 batches handed out in this pass" in out
    assert "snapshot" not in out
    pipeline = json.loads(loader.state_dict()["loader"]["fetcher_state"]["dataset_iter_state"]["pipeline"])
    position = next(node["position"] for node in chain(pipeline) if "position" in node)
    row = next(line for line in out.splitlines() if line.startswith("rank 0/1 "))
    assert row.split()[2:4] == ["0", f"{position:,}"] and position > 0


def test_pipeline_option_imports_the_factory_and_reports_bad_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "my_pipeline.py").write_text(
        "import resumable as rs\n"
        f"def build():\n    return rs.jsonl({source(tmp_path)!r}).shuffle(2).shard().batch(3)\n"
        "not_a_function = 3\n"
        "def not_a_pipeline():\n    return [1]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    from my_pipeline import build  # type: ignore[import-not-found]  # written by the test at run time

    loader = legacy_loader(build, 4, num_workers=2)  # a state saved by an earlier version, between snapshots
    iterator = iter(loader)
    for _ in range(5):
        next(iterator)
    rs.save_state(legacy_state(loader, 4), tmp_path / "loader.json")
    assert main(["inspect", str(tmp_path / "loader.json"), "--pipeline", "my_pipeline:build"]) == 0
    assert "1 batches replayed from the workers' snapshot at batch 4" in capsys.readouterr().out
    for spec, message in (
        ("my_pipeline", "expected MODULE:FUNCTION"),
        ("no_such_module:build", "cannot import it"),
        ("my_pipeline:missing", "cannot import it"),
        ("my_pipeline:not_a_function", "int is not a function"),
        ("my_pipeline:not_a_pipeline", "returned list, not a pipeline"),
    ):
        assert main(["inspect", str(tmp_path / "loader.json"), "--pipeline", spec]) == 2
        assert message in capsys.readouterr().err


def test_unreadable_or_corrupt_files_are_errors_not_tracebacks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    loader = rst.Loader(functools.partial(sharded, tmp_path), 2)
    next(iter(loader))
    state = loader.state_dict()
    worker = state["loader"]["_snapshot"]["_worker_snapshots"]["worker_1"]
    worker["fetcher_state"]["dataset_iter_state"]["pipeline"] = "{"
    rs.save_state(state, tmp_path / "corrupt.json")
    (tmp_path / "truncated.json").write_text('{"format": ')
    rs.save_state(dict(state, format="resumable.Loader/99"), tmp_path / "older.json")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    for name, message in (
        ("corrupt.json", "rank 0/1 worker 1 at loader._snapshot._worker_snapshots.worker_1: the pipeline state is not"),
        ("truncated.json", "truncated.json: not valid JSON"),
        ("older.json", "older.json: Loader: not a resumable Loader state (format 'resumable.Loader/3' expected, got "),
        ("junk.pt", "junk.pt: neither JSON nor a torch checkpoint"),
    ):
        assert main(["inspect", str(tmp_path / name)]) == 2
        assert message in capsys.readouterr().err


def test_a_rescale_across_an_epoch_boundary_shows_both_remaps(tmp_path: Path) -> None:
    from resumable.elastic import restore

    def repeated(rank: int, world_size: int) -> rs.Node:
        return rs.from_list(list(range(31))).shuffle(1).shard(rank, world_size).repeat(2)

    old = [repeated(c, 2) for c in range(2)]
    take(old[0], 2)
    take(old[1], 17)  # 15 records in its shard: into epoch 1
    new = repeated(0, 3)
    restore(new, [pipe.get_state() for pipe in old])
    rs.save_state(new.get_state(), tmp_path / "straddle.json")
    out = describe(str(tmp_path / "straddle.json"))
    assert "rescaled epoch 0: strides over the" in out and "rescaled epoch 1: strides over the" in out
