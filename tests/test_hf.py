"""from_hf over map-style Hugging Face datasets, and ArrowSource over their cache files."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import resumable as rs
from resumable.sources.arrow import ArrowSource, HfSource, arrow, from_hf
from tests.resume import check_resume, take
from tests.test_arrow import CHAINS

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
datasets = pytest.importorskip("datasets")
datasets.disable_progress_bars()


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


def test_from_hf_read_and_decode_errors_are_source_errors(hf_dataset: Any) -> None:
    files = [f["filename"] for f in hf_dataset.cache_files]
    corrupted = next(path for path in files if b"doc 3" in Path(path).read_bytes())
    data = Path(corrupted).read_bytes()
    Path(corrupted).write_bytes(data.replace(b"doc 3", b"do\xff\xfe3"))  # memory-mapped: seen by the dataset
    with pytest.raises(rs.SourceError, match=r"HfSource: cannot read record batch \d+ of dataset .*ArrowInvalid"):
        list(from_hf(hf_dataset))
    Path(corrupted).write_bytes(data)

    source = from_hf(hf_dataset)

    def broken(example: Any) -> Any:
        raise ValueError("cannot decode this image")

    source._features_decode = broken
    with pytest.raises(rs.SourceError, match=r"cannot decode row 0 of dataset .*ValueError: cannot decode this image"):
        next(source)


def test_from_hf_restores_over_touched_cache_files(hf_dataset: Any) -> None:
    source = from_hf(hf_dataset)
    take(source, 7)
    state = source.get_state()
    assert all(f[3].startswith("arrow-ipc-metadata-xxh3_64:") for f in state["files"])
    expected = take(source, 20)
    for entry in hf_dataset.cache_files:
        info = os.stat(entry["filename"])
        os.utime(entry["filename"], ns=(info.st_atime_ns, info.st_mtime_ns + 10**10))
    resumed = from_hf(hf_dataset)
    resumed.set_state(state)
    assert take(resumed, 20) == expected
