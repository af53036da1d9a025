"""Adversary of three changes of 2026-11-27: legacy (4-round) states in repeats, mixes, packers
and Loaders; StopIteration of user code as rs.MapError under cache/prefetch/mix/pack (under a
cache it once hung: the stored StopIteration ended a run of records); old ``gzip-trailer:``
digests of stream states over padded gzip files."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path
from typing import Any, Callable

import pytest

import resumable as rs
from resumable.order.lcg import LEGACY_ROUNDS, ROUNDS, ROUNDS_OPTION
from tests.legacy_orders import built, legacy, rounds_in, with_rounds, without_rounds
from tests.resume import plain, roundtrip, take


def epochs(pipe: rs.Node, n: int) -> list[list[Any]]:
    return [[plain(x) for x in pipe] for _ in range(n)]


# ---------------------------------------------------------------- 1. rounds


N = 20


def repeat_build() -> rs.Node:
    return rs.from_list(list(range(N))).shuffle(3).repeat(3)


@pytest.mark.parametrize("cut", [0, 7, N - 1, N + 3])
def test_legacy_state_in_a_repeat_finishes_its_epoch_legacy_then_six_rounds(
    cut: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    fresh = list(repeat_build())
    with monkeypatch.context() as patch:
        legacy(patch)
        old = built(repeat_build)
        head = take(old, cut)
        state = without_rounds(roundtrip(old.get_state()))
        rest = list(old)
    epoch_end = (cut // N + 1) * N
    assert head + rest[: epoch_end - cut] != fresh[:epoch_end] or cut >= N
    pipe = repeat_build()
    pipe.set_state(state)
    got = list(pipe)
    assert got[: epoch_end - cut] == rest[: epoch_end - cut]
    assert got[epoch_end - cut :] == fresh[epoch_end:]


def test_legacy_state_in_a_repeat_restored_twice_in_a_row(monkeypatch: pytest.MonkeyPatch) -> None:
    fresh = list(repeat_build())
    with monkeypatch.context() as patch:
        legacy(patch)
        old = built(repeat_build)
        take(old, 5)
        state = without_rounds(roundtrip(old.get_state()))
        rest = list(old)
    once = repeat_build()
    once.set_state(state)
    head = take(once, 6)
    again = repeat_build()
    again.set_state(roundtrip(once.get_state()))
    got = head + list(again)
    assert got[: N - 5] == rest[: N - 5]
    assert got[N - 5 :] == fresh[N:]


def mix_build() -> rs.Node:
    a = rs.from_list([{"id": i} for i in range(12)]).shuffle(1)
    b = rs.from_list([{"id": 100 + i} for i in range(18)]).shuffle(2, block_size=3, window=2)
    return rs.mix({"a": a, "b": b}, weights={"a": 0.4, "b": 0.6}, seed=9)


@pytest.mark.parametrize("cut", [0, 4, 11])
def test_legacy_state_of_a_mix_of_two_shuffles(cut: int, monkeypatch: pytest.MonkeyPatch) -> None:
    fresh = epochs(mix_build(), 2)
    with monkeypatch.context() as patch:
        legacy(patch)
        old = built(mix_build)
        take(old, cut)
        state = without_rounds(roundtrip(old.get_state()))
        rest = [plain(x) for x in old]
    pipe = mix_build()
    pipe.set_state(state)
    assert rounds_in(pipe.get_state()) == {LEGACY_ROUNDS}
    assert [plain(x) for x in pipe] == rest
    assert [plain(x) for x in pipe] == fresh[1]
    assert rounds_in(pipe.get_state()) == {ROUNDS}


def pack_build() -> rs.Node:
    docs = [{"input_ids": list(range(1 + i % 5))} for i in range(30)]
    return rs.from_list(docs).shuffle(4).pack(8)


@pytest.mark.parametrize("cut", [0, 3, 9])
def test_legacy_state_with_a_packer_after_the_shuffle(cut: int, monkeypatch: pytest.MonkeyPatch) -> None:
    fresh = epochs(pack_build(), 2)
    with monkeypatch.context() as patch:
        legacy(patch)
        old = built(pack_build)
        take(old, cut)
        state = without_rounds(roundtrip(old.get_state()))
        rest = [plain(x) for x in old]
    pipe = pack_build()
    pipe.set_state(state)
    assert [plain(x) for x in pipe] == rest
    assert [plain(x) for x in pipe] == fresh[1]


def loader_build() -> rs.Node:
    return rs.from_list(list(range(40))).shuffle(seed=5).shard().batch(4, collate_fn=list)


LOADER_CONFIGS = [
    {"num_workers": 0},
    {"num_workers": 2},
    {"num_workers": 2, "persistent_workers": True},
]


def loader_epochs(loader: Any, n: int) -> list[list[list[int]]]:
    return [[[int(v) for v in b] for b in loader] for _ in range(n)]


@pytest.mark.parametrize("config", LOADER_CONFIGS, ids=lambda c: f"w{c['num_workers']}{'p' if len(c) > 1 else ''}")
def test_legacy_loader_state_finishes_legacy_and_next_epoch_is_six_rounds(
    config: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    from resumable.torch import Loader

    fresh = loader_epochs(Loader(loader_build, **config), 2)
    with monkeypatch.context() as patch:
        legacy(patch)
        old = Loader(loader_build, **config)
        it = iter(old)
        head = [[int(v) for v in next(it)] for _ in range(3)]
        state = without_rounds(json.loads(json.dumps(old.state_dict())))
        rest = [[int(v) for v in b] for b in it]
        del it
    assert rounds_in(state) == set()
    assert head + rest != fresh[0]  # the legacy order differs
    loader = Loader(loader_build, **config)
    loader.load_state_dict(state)
    assert [[int(v) for v in b] for b in loader] == rest
    assert [[int(v) for v in b] for b in loader] == fresh[1]
    assert rounds_in(loader.state_dict()) == {ROUNDS}


@pytest.mark.parametrize("config", LOADER_CONFIGS[1:], ids=["w2", "w2p"])
def test_legacy_loader_state_restored_twice_in_a_row(config: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    from resumable.torch import Loader

    fresh = loader_epochs(Loader(loader_build, **config), 2)
    with monkeypatch.context() as patch:
        legacy(patch)
        old = Loader(loader_build, **config)
        it = iter(old)
        for _ in range(2):
            next(it)
        state = without_rounds(json.loads(json.dumps(old.state_dict())))
        rest = [[int(v) for v in b] for b in it]
        del it
    once = Loader(loader_build, **config)
    once.load_state_dict(state)
    it = iter(once)
    head = [[int(v) for v in next(it)] for _ in range(3)]
    mid = json.loads(json.dumps(once.state_dict()))
    del it
    again = Loader(loader_build, **config)
    again.load_state_dict(mid)
    assert head + [[int(v) for v in b] for b in again] == rest
    assert [[int(v) for v in b] for b in again] == fresh[1]


@pytest.mark.parametrize("value", [5, 3, "6", 6.0, None, True])
def test_corrupt_rounds_in_a_loader_state_is_a_state_error_and_changes_nothing(value: Any) -> None:
    from resumable.torch import Loader

    config = {"num_workers": 2}
    reference = Loader(loader_build, **config)
    it = iter(reference)
    for _ in range(2):
        next(it)
    good = json.loads(json.dumps(reference.state_dict()))
    rest = [[int(v) for v in b] for b in it]
    del it
    bad = with_rounds(good, value)
    assert rounds_in(bad) == {value}
    loader = Loader(loader_build, **config)
    # with workers the pipeline state is applied (and refused) in the worker, at the first iter()
    with pytest.raises(rs.StateError, match=ROUNDS_OPTION):
        loader.load_state_dict(bad)
        list(loader)
    loader.load_state_dict(good)
    assert [[int(v) for v in b] for b in loader] == rest


@pytest.mark.parametrize("build", [repeat_build, mix_build, pack_build], ids=["repeat", "mix", "pack"])
@pytest.mark.parametrize("value", [2, 8, "4", [6]])
def test_corrupt_rounds_nested_is_a_state_error_and_leaves_the_pipeline(
    build: Callable[[], rs.Node], value: Any
) -> None:
    pipe = build()
    take(pipe, 4)
    state = roundtrip(pipe.get_state())
    expected = [plain(x) for x in build_restored(build, state)]
    with pytest.raises(rs.StateError, match=ROUNDS_OPTION):
        pipe.set_state(with_rounds(state, value))
    assert [plain(x) for x in pipe] == expected


def build_restored(build: Callable[[], rs.Node], state: Any) -> rs.Node:
    pipe = build()
    pipe.set_state(state)
    return pipe


# ---------------------------------------------------------------- 2. StopIteration


def stops_at_5(x: Any) -> Any:
    if x == 5:
        raise StopIteration("user code")
    return x * 10


def pred_stops_at_5(x: Any) -> bool:
    if x == 5:
        raise StopIteration("user code")
    return x % 2 == 0


def drain(pipe: rs.Node, limit: int = 200) -> list[Any]:
    """Items, with 'E' where a MapError arrived; iteration goes on after it."""
    out: list[Any] = []
    it = iter(pipe)
    while len(out) < limit:
        try:
            out.append(plain(next(it)))
        except rs.MapError as error:
            assert isinstance(error.__cause__, StopIteration)
            out.append("E")
        except StopIteration:
            break
    return out


STOP_BUILDS: dict[str, Callable[[Path], rs.Node]] = {
    "cache memory": lambda _: rs.from_list(list(range(12))).map(stops_at_5).cache(),
    "cache disk": lambda d: rs.from_list(list(range(12))).map(stops_at_5).cache(str(d / "c")),
    "prefetch": lambda _: rs.from_list(list(range(12))).map(stops_at_5).prefetch(3),
    "thread": lambda _: rs.from_list(list(range(12))).map(stops_at_5, num_workers=2),
    "process": lambda _: rs.from_list(list(range(12))).map(stops_at_5, num_workers=2, mode="process"),
    "filter prefetch": lambda _: rs.from_list(list(range(12))).filter(pred_stops_at_5).prefetch(2),
    "mix": lambda _: rs.mix(
        {"a": rs.from_list(list(range(12))).map(stops_at_5), "b": rs.from_list(list(range(100, 106)))},
        seed=2,
        on_end="stop",
    ),
}


@pytest.mark.parametrize("kind", list(STOP_BUILDS))
def test_stop_iteration_of_user_code_is_a_map_error_and_iteration_goes_on(kind: str, tmp_path: Path) -> None:
    pipe = STOP_BUILDS[kind](tmp_path)
    first = drain(pipe)
    assert first.count("E") == 1
    assert 50 not in first
    if kind not in ("mix", "filter prefetch"):
        assert first == [x * 10 if x != 5 else "E" for x in range(12)]
    # the next epoch meets the failing record again (it is not cached); a mix reorders epochs
    second = drain(pipe)
    assert second == first if kind != "mix" else second.count("E") == 1


@pytest.mark.parametrize("kind", list(STOP_BUILDS))
def test_state_right_after_the_stop_iteration_resumes_exactly(kind: str, tmp_path: Path) -> None:
    reference = drain(STOP_BUILDS[kind](tmp_path))
    at = reference.index("E") + 1
    pipe = STOP_BUILDS[kind](tmp_path)
    it = iter(pipe)
    seen: list[Any] = []
    while len(seen) < at:
        try:
            seen.append(plain(next(it)))
        except rs.MapError:
            seen.append("E")
    state = roundtrip(pipe.get_state())
    restored = STOP_BUILDS[kind](tmp_path)
    restored.set_state(state)
    assert seen + drain(restored) == reference


def test_indexed_filter_predicate_stop_iteration_is_a_typed_error(tmp_path: Path) -> None:
    pipe = rs.from_list(list(range(12))).filter(pred_stops_at_5, index=True, progress=False)
    with pytest.raises((rs.SourceError, rs.MapError)) as info:
        list(pipe)
    assert "5" in str(info.value)


def length_stops(record: dict) -> int:
    if record["input_ids"][0] == 5:
        raise StopIteration("user code")
    return len(record["input_ids"])


def test_pack_length_fn_stop_iteration_does_not_end_the_epoch_silently() -> None:
    docs = [{"input_ids": [i, i]} for i in range(10)]
    pipe = rs.from_list(docs).pack(4, length_fn=length_stops, overlong="drop")
    try:
        rows = [plain(x) for x in pipe]
    except rs.ResumableError:
        return  # a typed error: fine
    tokens = [t for row in rows for t in row["input_ids"] if t != 0 or True]
    assert 9 in tokens  # the records after the failing one were not silently lost


# ---------------------------------------------------------------- 3. gzip digests


def write_gz(path: Path, ids: range, pad: int = 32) -> None:
    data = gzip.compress(b"".join(b'{"id": %d}\n' % i for i in ids), mtime=0)
    path.write_bytes(data + b"\0" * pad)


def old_format(state: dict) -> dict:
    state = json.loads(json.dumps(state))
    for fp in state["files"]:
        assert fp[3].startswith("gzip-tail:")
        fp[3] = "gzip-trailer:" + "0" * 16
    return state


def stream_setup(tmp_path: Path) -> tuple[Path, Callable[[], rs.Node], dict, list[Any]]:
    path = tmp_path / "a.jsonl.gz"
    write_gz(path, range(10))
    build = lambda: rs.jsonl_stream([str(path)])  # noqa: E731
    pipe = build()
    take(pipe, 4)
    state = roundtrip(pipe.get_state())
    rest = list(pipe)
    return path, build, state, rest


def test_old_trailer_digest_untouched_file_restores_exactly(tmp_path: Path) -> None:
    _, build, state, rest = stream_setup(tmp_path)
    pipe = build()
    pipe.set_state(old_format(state))
    assert list(pipe) == rest


def test_old_trailer_digest_after_touch_is_a_state_error_naming_the_file(tmp_path: Path) -> None:
    path, build, state, rest = stream_setup(tmp_path)
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    pipe = build()
    before = list(build())
    with pytest.raises(rs.StateError, match="a.jsonl.gz"):
        pipe.set_state(old_format(state))
    assert list(pipe) == before
    # a new-format state restores after the touch
    again = build()
    again.set_state(state)
    assert list(again) == rest


def test_padded_replacement_same_size_new_mtime_is_refused_in_both_formats(tmp_path: Path) -> None:
    path, build, state, _ = stream_setup(tmp_path)
    size = path.stat().st_size
    write_gz(path, range(10, 20), pad=0)
    data = path.read_bytes()
    path.write_bytes(data + b"\0" * (size - len(data)))
    assert path.stat().st_size == size
    for saved in (state, old_format(state)):
        with pytest.raises(rs.StateError, match="a.jsonl.gz"):
            build().set_state(saved)


def test_state_taken_after_an_old_format_restore_holds_the_new_digest(tmp_path: Path) -> None:
    path, build, state, rest = stream_setup(tmp_path)
    pipe = build()
    pipe.set_state(old_format(state))
    head = take(pipe, 2)
    newer = roundtrip(pipe.get_state())
    assert all(fp[3].startswith("gzip-tail:") for fp in newer["files"])
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    again = build()
    again.set_state(newer)
    assert head + list(again) == rest
