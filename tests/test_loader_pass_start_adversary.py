"""How ``rs.torch.Loader`` starts each pass, attacked.

Fresh workers (``num_workers > 0`` without ``persistent_workers``) are new processes each pass:
each builds its pipeline afresh, takes its predecessor's final state (``set_state``) and starts
the next epoch, as a persistent worker's pipeline (and the main process's without workers) goes
on from the epoch it ended. Here every kind of pipeline a user builds runs three epochs in each
worker mode, batch for batch against the others, and against a run that restores into a fresh
Loader at each epoch boundary; files touched between epochs (same content) must go on, files
whose content changed must stop with a typed error in every mode. Persistent workers whose
restart fails (a Ctrl-C, an error) leave the Loader as it was before ``iter()``. Workers started
by ``spawn`` get the main process's filters on the library's warnings.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import warnings
from pathlib import Path
from typing import Any, Callable

import pytest

import resumable as rs
from resumable.torch import Loader, _torchdata
from tests.resume import plain

EPOCHS = 3
Factory = Callable[[], rs.Node]


def make(pipeline: Any, workers: int, persistent: bool = False) -> Loader:
    return Loader(
        pipeline,
        num_workers=workers,
        persistent_workers=persistent,
        timeout=30 if workers else 0,
    )


def epochs_of(loader: Loader, count: int = EPOCHS) -> list[list[Any]]:
    """``count`` whole passes of ``loader``, batch for batch; its workers stopped after."""
    try:
        return [[plain(batch) for batch in loader] for _ in range(count)]
    finally:
        loader.close()


def restoring_each_epoch(build: Callable[[], Loader], count: int = EPOCHS) -> list[list[Any]]:
    """``count`` passes, each in a freshly built Loader loaded with the state taken at the
    end of the previous pass (through JSON, as a checkpoint keeps it)."""
    out: list[list[Any]] = []
    state: dict[str, Any] | None = None
    for _ in range(count):
        loader = build()
        if state is not None:
            loader.load_state_dict(state)
        try:
            out.append([plain(batch) for batch in loader])
            state = json.loads(json.dumps(loader.state_dict()))
        finally:
            loader.close()
    return out


# -- pipelines ---------------------------------------------------------------------------------


def triple(x: Any) -> Any:
    return x * 3 if isinstance(x, int) else {**x, "v": x["v"] * 3}


def not_seventh(x: Any) -> bool:
    return (x if isinstance(x, int) else x["v"]) % 7 != 0


def tokens(i: int) -> dict[str, Any]:
    return {"input_ids": list(range(i, i + 1 + (i * 7) % 9))}


def write_jsonl(path: Path, count: int, offset: int = 0) -> Path:
    path.write_text("".join(json.dumps({"v": i + offset}) + "\n" for i in range(count)))
    return path


def listed() -> rs.Node:
    return rs.from_list(list(range(37))).shuffle(seed=3).shard().map(triple).filter(not_seventh).batch(4)


def block_shuffled() -> rs.Node:
    return rs.from_list(list(range(40))).shuffle(seed=2, block_size=4).shard().batch(5)


def thread_mapped() -> rs.Node:
    return rs.from_list(list(range(30))).shuffle(seed=4).shard().map(triple, num_workers=2, mode="thread").batch(4)


def index_filtered() -> rs.Node:
    return (
        rs.from_list(list(range(40))).filter(not_seventh, index=True, progress=False).shuffle(seed=5).shard().batch(3)
    )


def documents() -> rs.Node:
    return rs.from_list([tokens(i) for i in range(30)]).shuffle(seed=6).shard()


def packed(**options: Any) -> rs.Node:
    return documents().pack(16, **options).batch(2)


def repeated() -> rs.Node:
    return rs.from_list(list(range(11))).shuffle(seed=7).shard().repeat(2).batch(3)


def mixed(on_end: str) -> rs.Node:
    return rs.mix(
        {
            "a": rs.from_list(list(range(13))).shuffle(seed=8).shard(),
            "b": rs.from_list(list(range(100, 121))).shuffle(seed=9).shard(),
        },
        weights={"a": 1, "b": 2},
        seed=1,
        on_end=on_end,
    ).batch(3)


def cached() -> rs.Node:
    return rs.from_list(list(range(25))).map(triple).cache().shuffle(seed=10).shard().batch(4)


def prefetched() -> rs.Node:
    return rs.from_list(list(range(25))).shuffle(seed=11).shard().map(triple).prefetch(3).batch(4)


def sometimes_empty() -> rs.Node:
    """Three records over two workers, of which only two pass: a worker's share changes with
    the epoch's shuffle, and is empty in some epochs."""
    return rs.from_list(list(range(3))).shuffle(seed=12).shard().filter(lambda x: x < 2).batch(1)


def jsonl_file(path: Path) -> rs.Node:
    return rs.jsonl(str(path)).shuffle(seed=13).shard().map(triple).batch(4)


def jsonl_streamed(paths: list[str]) -> rs.Node:
    return rs.jsonl_stream(paths, shuffle_files=1).filter(not_seventh).batch(4)


def parquet_file(path: Path) -> rs.Node:
    return rs.parquet(str(path)).shuffle(seed=14).shard().batch(4)


def file_pipelines(tmp_path: Path) -> dict[str, Factory]:
    first = write_jsonl(tmp_path / "a.jsonl", 23)
    second = write_jsonl(tmp_path / "b.jsonl", 9, offset=100)
    import pyarrow as pa
    import pyarrow.parquet as pq

    table_path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"v": list(range(26))}), table_path, row_group_size=5)
    return {
        "jsonl": functools.partial(jsonl_file, first),
        "jsonl_stream": functools.partial(jsonl_streamed, [str(first), str(second), str(first)]),
        "parquet": functools.partial(parquet_file, table_path),
    }


PIPELINES: dict[str, Factory] = {
    "from_list shuffle shard map filter batch": listed,
    "block shuffle": block_shuffled,
    "thread map": thread_mapped,
    "indexed filter": index_filtered,
    "pack greedy": functools.partial(packed, strategy="greedy"),
    "pack best_fit buffer": functools.partial(packed, strategy="best_fit", buffer_size=4),
    "pack bfd whole epoch": functools.partial(packed, strategy="bfd"),
    "repeat(2)": repeated,
    "mix stop": functools.partial(mixed, "stop"),
    "mix drop": functools.partial(mixed, "drop"),
    "cache": cached,
    "prefetch": prefetched,
    "a worker empty in some epochs": sometimes_empty,
}


def all_pipelines(tmp_path: Path) -> dict[str, Factory]:
    return {**PIPELINES, **file_pipelines(tmp_path)}


NAMES = [*PIPELINES, "jsonl", "jsonl_stream", "parquet"]


@pytest.mark.parametrize("name", NAMES)
def test_every_worker_mode_gives_the_same_epochs(name: str, tmp_path: Path) -> None:
    """Three epochs, batch for batch: one fresh worker == no worker, two fresh workers == two
    persistent workers; and restoring into a fresh Loader at each epoch's end changes nothing,
    with fresh workers and without. Each epoch is a new order (the Loader advances epochs)."""
    factory = all_pipelines(tmp_path)[name]
    alone = epochs_of(make(factory, 0))
    assert epochs_of(make(factory, 1)) == alone
    two = epochs_of(make(factory, 2, persistent=True))
    assert epochs_of(make(factory, 2)) == two
    assert restoring_each_epoch(functools.partial(make, factory, 2)) == two
    assert restoring_each_epoch(functools.partial(make, factory, 0)) == alone
    assert sorted(map(repr, alone[0])) != [] or name == "a worker empty in some epochs"
    if name not in ("a worker empty in some epochs", "jsonl_stream"):
        assert alone[0] != alone[1], "the Loader must start a new epoch with each pass"


@functools.cache
def listed_on_two_workers() -> list[list[Any]]:
    """``listed``'s three epochs on two persistent workers (the reference of several tests)."""
    return epochs_of(make(listed, 2, persistent=True))


def test_a_pipeline_object_behaves_as_its_factory() -> None:
    """A pipeline handed over as an object, not a factory: each fresh worker gets a copy of it
    as built, and continues from the ended pass's state as the factory's pipelines do."""
    expected = listed_on_two_workers()
    assert epochs_of(make(listed(), 2)) == expected
    assert epochs_of(make(listed(), 2, persistent=True)) == expected
    assert restoring_each_epoch(lambda: make(listed(), 2)) == expected
    assert epochs_of(make(listed(), 0)) == epochs_of(make(listed, 0))


def evened() -> rs.Node:
    return (
        rs.from_list(list(range(11)))
        .filter(not_seventh, index=True, progress=False)
        .shuffle(seed=15)
        .shard()
        .batch(3)
        .even(times=2)
    )


def test_even_in_one_process_across_worker_modes() -> None:
    """``.even()`` without torch.distributed: every mode agrees epoch for epoch, restores too."""
    alone = epochs_of(make(evened, 0))
    assert epochs_of(make(evened, 1)) == alone
    two = epochs_of(make(evened, 2, persistent=True))
    assert epochs_of(make(evened, 2)) == two
    assert restoring_each_epoch(functools.partial(make, evened, 2)) == two


@pytest.mark.parametrize("workers,persistent", [(0, False), (2, False), (2, True)])
def test_state_at_an_epoch_end_loaded_then_two_more_epochs(workers: int, persistent: bool) -> None:
    """A state taken once the first epoch ended, loaded into a fresh Loader, then iterated for two
    epochs: the uninterrupted run's epochs 1 and 2."""
    expected = epochs_of(make(listed, workers, persistent))
    first = make(listed, workers, persistent)
    assert [plain(batch) for batch in first] == expected[0]
    state = json.loads(json.dumps(first.state_dict()))
    first.close()
    resumed = make(listed, workers, persistent)
    resumed.load_state_dict(state)
    assert epochs_of(resumed, 2) == expected[1:]


def test_abandoned_passes_agree_across_modes() -> None:
    """A trainer that leaves each pass after two batches: the next iter() starts the next
    epoch from its start in every mode (nothing of the abandoned pass is carried into it)."""

    def run(loader: Loader) -> list[list[Any]]:
        out = []
        try:
            for _ in range(EPOCHS):
                iterator = iter(loader)
                out.append([plain(next(iterator)) for _ in range(2)])
        finally:
            loader.close()
        return out

    two = run(make(listed, 2, persistent=True))
    assert run(make(listed, 2)) == two
    whole = epochs_of(make(listed, 2))
    assert [epoch[:2] for epoch in whole] == two


def test_state_size_stays_bounded_over_twenty_epochs() -> None:
    """Carrying the ended state into each new pass must not make states grow with the epoch."""
    loader = make(mixed_drop_small, 1)
    sizes = []
    try:
        for _ in range(20):
            for _batch in loader:
                pass
            sizes.append(len(json.dumps(loader.state_dict())))
    finally:
        loader.close()
    assert max(sizes) - sizes[1] <= 8, sizes  # digits of the epoch count, nothing more


def mixed_drop_small() -> rs.Node:
    return rs.mix(
        {"a": rs.from_list(list(range(5))).shuffle(seed=1).shard(), "b": rs.from_list([9, 8]).repeat(2)},
        on_end="drop",
    ).batch(2)


# -- files between epochs ----------------------------------------------------------------------

MODES = [(0, False), (1, False), (2, False), (2, True)]
MODE_IDS = ["no workers", "one fresh", "two fresh", "two persistent"]


@pytest.mark.parametrize("workers,persistent", MODES, ids=MODE_IDS)
def test_a_touched_file_goes_on(workers: int, persistent: bool, tmp_path: Path) -> None:
    """A file whose mtime changed between epochs but not its content is the same file."""
    path = write_jsonl(tmp_path / "a.jsonl", 12)
    factory = functools.partial(jsonl_file, path)
    expected = epochs_of(make(factory, workers, persistent))
    loader = make(factory, workers, persistent)
    seen = []
    try:
        for _ in range(EPOCHS):
            seen.append([plain(batch) for batch in loader])
            stamp = os.stat(path).st_mtime_ns + 5_000_000_000
            os.utime(path, ns=(stamp, stamp))
    finally:
        loader.close()
    assert seen == expected


@pytest.mark.parametrize("workers,persistent", MODES, ids=MODE_IDS)
def test_a_file_changed_between_epochs_stops_the_next_pass(workers: int, persistent: bool, tmp_path: Path) -> None:
    """A file rewritten (same size, new content) between epochs is found as the next pass starts:
    a typed error of the library, in every worker mode, never the new content read silently."""
    path = write_jsonl(tmp_path / "a.jsonl", 12)
    loader = make(functools.partial(jsonl_file, path), workers, persistent)
    try:
        first = [plain(batch) for batch in loader]
        assert first
        before = path.read_bytes()
        path.write_bytes(before.replace(b'"v": 1', b'"v": 7'))
        assert len(path.read_bytes()) == len(before) and path.read_bytes() != before
        errors: tuple[type[BaseException], ...] = (rs.SourceError,)  # the pipeline's own check
        if workers and not persistent:  # set_state's fingerprint check (docs/sources.md)
            errors = (rs.StateError,)
        if persistent:  # documented: torchdata's worker loop dies on it (docs/torch.md)
            errors = (rs.ResumableError, RuntimeError)
        with pytest.raises(errors):
            for _ in range(2):
                [plain(batch) for batch in loader]
    finally:
        with contextlib.suppress(rs.SourceError):  # without workers: test_close_..._changed_file
            loader.close()


def test_close_without_workers_after_a_file_changed(tmp_path: Path) -> None:
    """close() (also run by ``with loader:`` on the way out of an error) stops a Loader whatever
    its files became: an ended pass, then the file rewritten, then close() must not raise."""
    path = write_jsonl(tmp_path / "a.jsonl", 6)
    loader = make(functools.partial(jsonl_file, path), 0)
    list(loader)
    path.write_bytes(path.read_bytes().replace(b'"v": 1', b'"v": 7'))
    loader.close()


def test_a_file_changed_after_an_end_state_stops_the_restored_pass(tmp_path: Path) -> None:
    """A state taken at an epoch's end, the file changed, then loaded into a fresh Loader with
    fresh workers: its next pass raises a StateError (set_state's fingerprint check)."""
    path = write_jsonl(tmp_path / "a.jsonl", 12)
    factory = functools.partial(jsonl_file, path)
    loader = make(factory, 2)
    [plain(batch) for batch in loader]
    state = loader.state_dict()
    loader.close()
    path.write_bytes(path.read_bytes().replace(b'"v": 1', b'"v": 7'))
    resumed = make(factory, 2)
    resumed.load_state_dict(state)
    try:
        with pytest.raises(rs.ResumableError):
            list(resumed)
    finally:
        resumed.close()


# -- persistent workers whose restart fails ----------------------------------------------------


class Once:
    """Raise ``KeyboardInterrupt`` at the first call of the wrapped function, then pass through."""

    def __init__(self, function: Callable[..., Any]) -> None:
        self.function, self.fired = function, False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.fired:
            self.fired = True
            raise KeyboardInterrupt
        return self.function(*args, **kwargs)


def interrupt_points() -> list[tuple[Any, str]]:
    """Places in torchdata's restart of persistent workers where a Ctrl-C may land."""
    from torchdata.stateful_dataloader.stateful_dataloader import _StatefulMultiProcessingDataLoaderIter as It

    return [(It, name) for name in ("_reset", "_try_put_index", "_get_data") if hasattr(It, name)]


@pytest.mark.parametrize("point", [name for _, name in interrupt_points()])
@pytest.mark.parametrize("after", ["iterate on", "restore"])
def test_ctrl_c_while_persistent_workers_restart(point: str, after: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C as persistent workers start the second pass: iter() raises it and the Loader is
    as before the call; iterating on (or restoring the state then taken) gives the uninterrupted
    run's epochs 1 and 2."""
    owner = dict((name, cls) for cls, name in interrupt_points())[point]
    expected = listed_on_two_workers()
    loader = make(listed, 2, persistent=True)
    try:
        assert [plain(batch) for batch in loader] == expected[0]
        with monkeypatch.context() as patch:
            patch.setattr(owner, point, Once(getattr(owner, point)))
            try:
                got = [plain(batch) for batch in loader]
            except KeyboardInterrupt:
                got = None
        if got is not None:  # the wrapped function is not on the restart's way: nothing to check
            pytest.skip(f"{point} was not called while the workers restarted")
        state = json.loads(json.dumps(loader.state_dict()))
        if after == "iterate on":
            assert epochs_of(loader, 2) == expected[1:]
        else:
            loader.close()
            resumed = make(listed, 2, persistent=True)
            resumed.load_state_dict(state)
            assert epochs_of(resumed, 2) == expected[1:]
    finally:
        loader.close()


def test_persistent_restart_failing_then_fixed_continues(monkeypatch: pytest.MonkeyPatch) -> None:
    """A KeyboardInterrupt from the Loader's own restart (torchdata's iterator reset) leaves the
    state of the ended epoch: state_dict() then equals the one taken right after the epoch."""
    loader = make(listed, 2, persistent=True)
    try:
        [plain(batch) for batch in loader]
        ended = json.loads(json.dumps(loader.state_dict()))
        with monkeypatch.context() as patch:
            patch.setattr(_torchdata, "current_iterator", Once(_torchdata.current_iterator))
            with pytest.raises(KeyboardInterrupt):
                iter(loader)
        assert json.loads(json.dumps(loader.state_dict())) == ended
    finally:
        loader.close()


# -- warning filters in spawned workers --------------------------------------------------------


def warns_in_worker() -> rs.Node:
    return rs.from_list(list(range(4))).shard().map(emit_warning).batch(2)


def emit_warning(x: int) -> int:
    warnings.warn("from the pipeline", rs.CacheWarning, stacklevel=1)
    return x


class UsersWarning(rs.ResumableWarning):
    """A user's own subclass of the library's warning, importable (module level)."""


def spawned(workers: int = 1) -> Loader:
    return Loader(warns_in_worker, num_workers=workers, multiprocessing_context="spawn", timeout=60)


def test_error_and_ignore_filters_reach_spawned_workers() -> None:
    """An "error" filter on a library warning set in the main process stops a spawned worker's
    pipeline with it; the same Loader's next pass, after the filter became "ignore", yields every
    batch (the filters are read as each pass's workers start)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", rs.CacheWarning)
        loader = spawned()
        try:
            with pytest.raises(rs.CacheWarning):
                list(loader)
            warnings.simplefilter("ignore", rs.CacheWarning)
            with warnings.catch_warnings(record=True) as caught:
                assert [plain(batch) for batch in loader] == [[0, 1], [2, 3]]
            assert not [w for w in caught if issubclass(w.category, rs.ResumableWarning)]
        finally:
            loader.close()


def test_a_filter_on_an_importable_subclass_of_the_library_s_warning_reaches_spawn() -> None:
    """A user's own ``rs.ResumableWarning`` subclass defined at module level pickles by name:
    a filter on it goes to spawned workers without stopping them."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", UsersWarning)
        warnings.simplefilter("ignore", rs.CacheWarning)
        loader = spawned()
        try:
            assert [plain(batch) for batch in loader] == [[0, 1], [2, 3]]
        finally:
            loader.close()


def test_a_filter_on_a_local_subclass_of_the_library_s_warning_does_not_break_spawn() -> None:
    """The filters shipped to spawned workers must not stop them from starting: one on a class
    they cannot import (defined in a function) should stay in the main process."""

    class Local(rs.ResumableWarning):
        pass

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rs.CacheWarning)
        warnings.simplefilter("error", Local)
        loader = spawned()
        try:
            assert [plain(batch) for batch in loader] == [[0, 1], [2, 3]]
        finally:
            loader.close()
