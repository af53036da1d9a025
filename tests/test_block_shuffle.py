"""BlockShuffle: an exact bijection with locality, new every epoch, resumable."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given
from hypothesis import strategies as st

import resumable as rs
from resumable.order.block_shuffle import DEFAULT_BLOCK_SIZE, DEFAULT_WINDOW, BlockLayout, BlockShuffle
from resumable.sources.memory import from_list
from resumable.sources.parquet import parquet
from tests.resume import check_resume


@given(
    total=st.integers(1, 300),
    block_size=st.integers(1, 40),
    window=st.integers(1, 6),
    seed=st.integers(0, 2**40),
    epoch=st.integers(0, 5),
)
def test_fixed_blocks_are_an_exact_bijection(total: int, block_size: int, window: int, seed: int, epoch: int) -> None:
    out = BlockLayout(total, window, block_size=block_size).take(np.arange(total), seed, epoch)
    assert sorted(out.tolist()) == list(range(total))


@given(
    sizes=st.lists(st.integers(1, 30), min_size=1, max_size=25),
    window=st.integers(1, 6),
    seed=st.integers(0, 2**40),
    epoch=st.integers(0, 5),
)
def test_variable_blocks_are_an_exact_bijection(sizes: list[int], window: int, seed: int, epoch: int) -> None:
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    total = int(bounds[-1])
    layout = BlockLayout(total, window, bounds=bounds)
    out = layout.take(np.arange(total), seed, epoch)
    assert sorted(out.tolist()) == list(range(total))
    # Random access agrees with the vectorised evaluation, in any order.
    picks = np.random.default_rng(seed % 1000).permutation(total)
    assert layout.take(picks, seed, epoch).tolist() == out[picks].tolist()


def test_windows_only_mix_their_own_blocks() -> None:
    block_size, window, total = 10, 3, 1000
    out = BlockLayout(total, window, block_size=block_size).take(np.arange(total), 7, 0)
    span = block_size * window
    for start in range(0, total, span):
        blocks = set((out[start : start + span] // block_size).tolist())
        assert len(blocks) <= window
    # Records inside one window are really mixed, not left in block order.
    assert not np.all(np.diff(out[:span]) == 1)


def test_new_order_every_epoch_and_seed() -> None:
    layout = BlockLayout(500, 2, block_size=16)
    first = layout.take(np.arange(500), 0, 0).tolist()
    assert first != layout.take(np.arange(500), 0, 1).tolist()
    assert first != layout.take(np.arange(500), 1, 0).tolist()
    assert first == BlockLayout(500, 2, block_size=16).take(np.arange(500), 0, 0).tolist()


def test_row_group_blocks_read_each_row_group_about_once(tmp_path: Path) -> None:
    table = pa.table({"id": list(range(1000))})
    pq.write_table(table, str(tmp_path / "a.parquet"), row_group_size=100)
    source = parquet(str(tmp_path / "a.parquet"))
    decoded: list[int] = []
    original = source._read_row_group

    def spy(group: int, private_handle: bool = False) -> pa.Table:
        decoded.append(group)
        return original(group, private_handle)

    source._read_row_group = spy  # type: ignore[method-assign]  # a spy on the source
    shuffled = source.shuffle(seed=5, block_size="row_group", window=3)
    assert isinstance(shuffled, BlockShuffle)
    assert shuffled.num_blocks == 10 and source.cache_row_groups >= 3
    ids = [r["id"] for r in shuffled]
    assert sorted(ids) == list(range(1000)) and ids != list(range(1000))
    assert sorted(decoded) == list(range(10))


def test_defaults_and_natural_blocks_through_maps(tmp_path: Path) -> None:
    pq.write_table(pa.table({"id": list(range(50))}), str(tmp_path / "a.parquet"), row_group_size=20)
    mapped = parquet(str(tmp_path / "a.parquet")).map(lambda r: r["id"]).shuffle(seed=1, window=2)
    assert mapped.get_state()["block_size"] == "row_group" and mapped.num_blocks == 3  # type: ignore[attr-defined]  # the node is a BlockShuffle
    assert sorted(mapped) == list(range(50))
    plain = from_list(list(range(3000))).shuffle(seed=1, window=1)
    state = plain.get_state()
    assert (state["block_size"], state["window"], state["seed"]) == (DEFAULT_BLOCK_SIZE, 1, 1)
    sized = from_list(list(range(30))).shuffle(seed=0, block_size=4)
    assert sized.get_state()["window"] == DEFAULT_WINDOW


def test_invalid_options_fail_at_construction() -> None:
    source = from_list(list(range(10)))
    with pytest.raises(rs.ConfigError, match="block_size must be"):
        BlockShuffle(source, 0, block_size=0)
    with pytest.raises(rs.ConfigError, match="block_size must be"):
        BlockShuffle(source, 0, block_size="rows")
    with pytest.raises(rs.ConfigError, match="window must be"):
        BlockShuffle(source, 0, block_size=2, window=0)
    with pytest.raises(rs.ConfigError, match="seed must be"):
        BlockShuffle(source, -1, block_size=2)
    with pytest.raises(rs.ConfigError, match="needs a source with row groups"):
        BlockShuffle(source, 0, block_size="row_group")
    with pytest.raises(rs.ConfigError, match="rise strictly"):
        BlockLayout(10, 2, bounds=np.array([0, 5, 5, 10]))


def test_state_with_other_options_is_a_state_error() -> None:
    pipe = from_list(list(range(100))).shuffle(seed=1, block_size=8, window=2)
    state = pipe.get_state()
    with pytest.raises(rs.StateError, match="block_size"):
        from_list(list(range(100))).shuffle(seed=1, block_size=9, window=2).set_state(state)
    with pytest.raises(rs.StateError, match="window"):
        from_list(list(range(100))).shuffle(seed=1, block_size=8, window=3).set_state(state)
    with pytest.raises(rs.StateError, match="seed"):
        from_list(list(range(100))).shuffle(seed=2, block_size=8, window=2).set_state(state)


CHAINS: dict[str, Any] = {
    "plain": lambda s: s.shuffle(seed=4, block_size=7, window=3),
    "shard": lambda s: s.shuffle(seed=4, block_size=5, window=2).shard(0, 3),
    "map_filter_batch": lambda s: s.shuffle(seed=4, block_size=6).map(lambda x: x * 2).filter(lambda x: x % 3).batch(5),
    "repeat": lambda s: s.shuffle(seed=4, block_size=9, window=2).repeat(),
}


@pytest.mark.parametrize("chain", sorted(CHAINS))
def test_resume_property(chain: str) -> None:
    def build() -> rs.Node[Any]:
        return CHAINS[chain](from_list(list(range(103))))

    total = 260
    for k in (0, 1, 50, 102, 103, 104, 200):
        check_resume(build, k, total)
    check_resume(build, 5, total, k2=150)


def test_resume_over_parquet_row_groups(tmp_path: Path) -> None:
    for n, rows in enumerate((35, 0, 22)):
        ids = pa.array(range(n * 100, n * 100 + rows), pa.int64())
        pq.write_table(pa.table({"id": ids}), str(tmp_path / f"{n}.parquet"), row_group_size=8)
    pattern = str(tmp_path / "*.parquet")

    def build() -> rs.Node[Any]:
        return parquet(pattern).shuffle(seed=9, block_size="row_group", window=2).shard(1, 2).repeat()

    for k in (0, 13, 28, 29, 60):
        check_resume(build, k, 90)
    check_resume(build, 3, 90, k2=40)


@pytest.mark.parametrize("block_size", [4, None])
def test_after_a_shard_in_dataloader_workers_each_worker_reads_its_stride(block_size: int | None) -> None:
    """A pipeline built in the main process and shuffled after its shard: each DataLoader worker
    lays the blocks over its own stride (the layout once followed the builder's length)."""
    from torch.utils.data import DataLoader

    from resumable.torch.dataset import PipelineDataset

    pipe = from_list(list(range(41))).shard().shuffle(3, block_size=block_size, window=2)
    delivered = [int(x) for x in DataLoader(PipelineDataset(pipe), num_workers=2, batch_size=None)]
    assert sorted(delivered) == list(range(41))
