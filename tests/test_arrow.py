"""ArrowSource (IPC file and stream formats) and from_hf (Hugging Face datasets)."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

import resumable as rs
from resumable.sources.arrow import ArrowSource, HfSource, arrow, from_hf
from tests.resume import check_resume, take

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
datasets = pytest.importorskip("datasets")
datasets.disable_progress_bars()


def table(ids: range) -> pa.Table:
    return pa.table({"id": list(ids), "text": ["x" * (i % 5) for i in ids]})


def write_ipc(path: Path, data: pa.Table, stream: bool, batch_rows: int) -> str:
    with pa.OSFile(str(path), "wb") as sink:
        open_writer = pa.ipc.new_stream if stream else pa.ipc.new_file
        with open_writer(sink, data.schema) as writer:
            for batch in data.to_batches(max_chunksize=batch_rows):
                writer.write_batch(batch)
    return str(path)


def corpus(tmp_path: Path) -> str:
    write_ipc(tmp_path / "a.arrow", table(range(0, 40)), stream=False, batch_rows=7)
    write_ipc(tmp_path / "b.arrow", table(range(40, 75)), stream=True, batch_rows=9)
    write_ipc(tmp_path / "c.arrow", table(range(75, 100)), stream=False, batch_rows=30)
    return str(tmp_path / "*.arrow")


# -- Arrow IPC ------------------------------------------------------------------------------------


def test_reads_file_and_stream_formats_as_one_index_space(tmp_path: Path) -> None:
    source = arrow(corpus(tmp_path))
    assert len(source) == 100
    assert [r["id"] for r in source] == list(range(100))
    assert source[44] == {"id": 44, "text": "xxxx"}
    indices = np.array([99, 0, 41, 5, 98, 40, 74], dtype=np.int64)
    assert [r["id"] for r in source._raw_at(indices)] == indices.tolist()
    assert source.block_bounds()[:3].tolist() == [0, 7, 14]


def test_missing_empty_and_invalid_files_fail_at_construction(tmp_path: Path) -> None:
    with pytest.raises(rs.SourceError, match="no such file"):
        arrow(str(tmp_path / "missing.arrow"))
    with pytest.raises(rs.SourceError, match="no files match"):
        arrow(str(tmp_path / "*.arrow"))
    empty = write_ipc(tmp_path / "empty.arrow", table(range(0)), stream=True, batch_rows=5)
    with pytest.raises(rs.SourceError, match="no rows in .*empty.arrow"):
        arrow(empty)
    (tmp_path / "bad.arrow").write_bytes(b"definitely not arrow")
    with pytest.raises(rs.SourceError, match="neither an Arrow IPC file nor an Arrow IPC stream"):
        arrow(str(tmp_path / "bad.arrow"))


def test_pickles_without_memory_maps(tmp_path: Path) -> None:
    source = arrow(corpus(tmp_path))
    clone = pickle.loads(pickle.dumps(source))
    assert clone._batches is None
    assert [r["id"] for r in clone][:3] == [0, 1, 2] and clone[99]["id"] == 99


def test_changed_file_is_a_state_error_and_a_source_error_after_pickling(tmp_path: Path) -> None:
    path = write_ipc(tmp_path / "a.arrow", table(range(10)), stream=False, batch_rows=4)
    source = arrow(path)
    take(source, 3)
    state = source.get_state()
    blob = pickle.dumps(source)
    write_ipc(tmp_path / "a.arrow", table(range(12)), stream=False, batch_rows=4)
    with pytest.raises(rs.StateError, match="changed since the state was saved"):
        arrow(path).set_state(state)
    with pytest.raises(rs.SourceError, match="changed since the pipeline was built"):
        pickle.loads(blob)[0]


CHAINS: dict[str, Any] = {
    "plain": lambda s: s,
    "shuffle": lambda s: s.shuffle(seed=3),
    "block_shuffle": lambda s: s.shuffle(seed=3, block_size="row_group", window=2),
    "shard": lambda s: s.shuffle(seed=1).shard(2, 3),
    "map_filter_batch": lambda s: s.map(lambda r: r["id"]).filter(lambda i: i % 4 != 1).batch(3),
    "repeat": lambda s: s.shuffle(seed=5).repeat(),
}


@pytest.mark.parametrize("chain", sorted(CHAINS))
def test_arrow_resume_property(tmp_path: Path, chain: str) -> None:
    pattern = corpus(tmp_path)

    def build() -> rs.Node[Any]:
        return CHAINS[chain](arrow(pattern))

    for k in (0, 1, 50, 99, 100, 101, 170):
        check_resume(build, k, 230)
    check_resume(build, 10, 230, k2=140)


# -- Hugging Face datasets -------------------------------------------------------------------------


@pytest.fixture()
def hf_dataset(tmp_path: Path) -> Any:
    """A memory-mapped dataset: built in memory, saved to disk and loaded back."""
    data = {"id": list(range(60)), "text": [f"doc {i}" for i in range(60)], "tags": [[i, i + 1] for i in range(60)]}
    datasets.Dataset.from_dict(data).save_to_disk(str(tmp_path / "hf"), max_shard_size="1KB")
    return datasets.load_from_disk(str(tmp_path / "hf"))


def test_from_hf_records_equal_dataset_items(hf_dataset: Any) -> None:
    assert len(hf_dataset.cache_files) > 1  # several shards: several Arrow files
    source = from_hf(hf_dataset)
    assert isinstance(source, HfSource) and len(source) == 60
    assert list(source) == [hf_dataset[i] for i in range(60)]
    assert source[17] == hf_dataset[17]


def test_from_hf_honours_the_indices_mapping(hf_dataset: Any) -> None:
    view = hf_dataset.shuffle(seed=4).select(range(5, 45)).filter(lambda ex: ex["id"] % 3 != 0)
    assert view._indices is not None
    source = from_hf(view)
    assert len(source) == len(view)
    assert list(source) == [view[i] for i in range(len(view))]
    picks = np.array([len(view) - 1, 0, 7], dtype=np.int64)
    assert list(source._raw_at(picks)) == [view[int(i)] for i in picks]


def test_from_hf_decodes_features_like_the_dataset(tmp_path: Path) -> None:
    features = datasets.Features({"label": datasets.ClassLabel(names=["neg", "pos"]), "text": datasets.Value("string")})
    dataset = datasets.Dataset.from_dict({"label": [0, 1, 1], "text": ["a", "b", "c"]}, features=features)
    assert list(from_hf(dataset)) == [dataset[i] for i in range(3)]


def test_from_hf_rejects_other_objects_and_empty_datasets(hf_dataset: Any) -> None:
    with pytest.raises(rs.ConfigError, match="map-style datasets.Dataset"):
        from_hf(datasets.DatasetDict({"train": hf_dataset}))
    with pytest.raises(rs.ConfigError, match="map-style datasets.Dataset"):
        from_hf([{"id": 1}])
    with pytest.raises(rs.SourceError, match="has no rows"):
        from_hf(hf_dataset.select([]))


def test_from_hf_state_names_fingerprint_and_files(hf_dataset: Any) -> None:
    source = from_hf(hf_dataset)
    take(source, 5)
    state = source.get_state()
    assert state["fingerprint"] == hf_dataset._fingerprint
    assert [os.path.basename(f[0]) for f in state["files"]] == [
        os.path.basename(f["filename"]) for f in hf_dataset.cache_files
    ]
    with pytest.raises(rs.StateError, match="dataset fingerprint"):
        from_hf(hf_dataset.select(range(10))).set_state(state)


def test_from_hf_pickles_and_resumes(hf_dataset: Any) -> None:
    source = from_hf(hf_dataset.shuffle(seed=1))
    take(source, 10)
    clone = pickle.loads(pickle.dumps(source))
    assert clone._batches is None
    assert [r["id"] for r in clone] == [r["id"] for r in source]


@pytest.mark.parametrize("chain", ["plain", "shuffle", "shard", "map_filter_batch", "repeat"])
def test_from_hf_resume_property(hf_dataset: Any, chain: str) -> None:
    view = hf_dataset.shuffle(seed=2)

    def build() -> rs.Node[Any]:
        return CHAINS[chain](from_hf(view))

    for k in (0, 1, 30, 59, 60, 61, 100):
        check_resume(build, k, 140)
    check_resume(build, 10, 140, k2=90)


def test_arrow_reads_hf_cache_files(hf_dataset: Any) -> None:
    files = sorted(f["filename"] for f in hf_dataset.cache_files)
    source = arrow(files)
    assert isinstance(source, ArrowSource)
    assert [r["id"] for r in source] == list(range(60))
