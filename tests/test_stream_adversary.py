"""Adversary: the streaming JSONL source ``rs.jsonl_stream``.

Plain and gzip files mixed in one glob: 0-byte files, a single line without a newline, CRLF, a
UTF-8 BOM (plain and inside gzip), blank lines, gzip made of several members (cut in the middle
of a line, an empty member), a line of several MB, truncated gzip; more consumers (ranks x
workers) than files; files whose sizes differ 1000x. The central property (take k, state, JSON,
a freshly built pipeline, continue == uninterrupted) at every step of two epochs with
``shuffle_files``, twice in a row, behind map/filter/batch/pack/prefetch/repeat, and inside
``rs.torch.Loader`` with 0, 2 and 3 workers (persistent too). Files changed between save and
restore, hand-corrupted states (only ``rs.StateError``, pipeline unchanged), elastic restores
onto other consumer counts (every line exactly once).

There is no buffer shuffle node for streams (the README's composition table refuses
``.shuffle()`` after a stream; ``shuffle_files`` is the only reordering), so none is attacked.
"""

from __future__ import annotations

import copy
import gzip
import json
import os
import pickle
import shutil
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

import resumable as rs
from resumable.elastic import restore
from resumable.pack import collate_rows
from resumable.torch import Loader
from tests.resume import check_resume, roundtrip, take

BOM = b"\xef\xbb\xbf"


def write(path: Path, data: bytes | str) -> str:
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    return str(path)


def rec(i: int) -> bytes:
    """Record ``i``: its id and token ids that name it (never 0, so 0 is padding after .pack)."""
    return json.dumps({"id": i, "input_ids": list(range(i * 10 + 1, i * 10 + 2 + i % 4))}).encode()


def reference(path: str) -> list[Any]:
    """What a careful reader makes of a file: every gzip member decompressed, a BOM at the start
    dropped, lines split at b"\\n", lines of only spaces, tabs and CRs skipped."""
    data = Path(path).read_bytes()
    if path.endswith(".gz"):
        data = gzip.decompress(data) if data else b""
    if data.startswith(BOM):
        data = data[len(BOM) :]
    return [json.loads(line) for line in data.split(b"\n") if line.strip(b" \t\r")]


def odd_corpus(directory: Path) -> str:
    """Seven odd files, plain and gzip mixed in one glob; twelve records."""
    directory.mkdir(exist_ok=True)
    files = {
        "a0_empty.jsonl": b"",
        "a1_one_line_no_newline.jsonl": rec(10),
        "a2_bom_crlf.jsonl.gz": gzip.compress(BOM + rec(20) + b"\r\n\r\n" + rec(21) + b"\r\n  \t\r\n" + rec(22)),
        "a3_blank_lines.jsonl": b"\n\n" + rec(30) + b"\n \n" + rec(31) + b"\n" + rec(32) + b"\n\n",
        "a4_members.jsonl.gz": gzip.compress(rec(40)[:5])  # a member ends in the middle of a line
        + gzip.compress(rec(40)[5:] + b"\n" + rec(41) + b"\n")
        + gzip.compress(b"")
        + gzip.compress(rec(42)),
        "a5_empty_member.jsonl.gz": gzip.compress(b""),
        "a6_bom.jsonl": BOM + rec(60) + b"\n" + rec(61) + b"\n",
    }
    for name, data in files.items():
        write(directory / name, data)
    return str(directory / "a*")


ODD_IDS = [10, 20, 21, 22, 30, 31, 32, 40, 41, 42, 60, 61]


def ids(items: list[Any]) -> list[int]:
    return [record["id"] for record in items]


def consumers_of(pattern: str, count: int, **options: Any) -> list[rs.Node[Any]]:
    return [rs.jsonl_stream(pattern, rank=c, world_size=count, **options) for c in range(count)]


# -- reading, splitting by file ---------------------------------------------------------------


def test_odd_files_read_like_a_reference_reader(tmp_path: Path) -> None:
    pattern = odd_corpus(tmp_path / "odd")
    paths = sorted(str(p) for p in (tmp_path / "odd").iterdir())
    expected = [record for path in paths for record in reference(path)]
    assert ids(expected) == ODD_IDS
    assert list(rs.jsonl_stream(pattern)) == expected
    stream = rs.jsonl_stream(pattern)
    list(stream)
    assert stream.get_state()["queue"] == [] and stream.skipped == 0


@pytest.mark.parametrize("count", [2, 3, 7, 9, 16])
def test_every_line_exactly_once_per_epoch_over_all_consumers_even_with_more_consumers_than_files(
    tmp_path: Path, count: int
) -> None:
    pattern = odd_corpus(tmp_path / "odd")
    streams = consumers_of(pattern, count, shuffle_files=3)
    orders = []
    for _ in range(4):  # epochs: a new file order each, every line once each
        seen = []
        order = []
        for stream in streams:
            got = ids(list(stream))
            seen += got
            order += got
            files = [i // 10 for i in got]  # ids name their file
            assert files == sorted(files, key=files.index)  # whole files, one after the other
        assert sorted(seen) == ODD_IDS
        orders.append(order)
    if count < 7:
        assert len({tuple(order) for order in orders}) > 1  # shuffle_files reorders per epoch
    else:
        # 7 files: consumer c >= 7 gets none, in every epoch
        assert all(list(stream) == [] for stream in streams[7:])


def test_sizes_differing_a_thousandfold_split_by_file_and_resume_on_every_consumer(tmp_path: Path) -> None:
    write(tmp_path / "big.jsonl.gz", gzip.compress(b"\n".join(rec(1000 + i) for i in range(1000)) + b"\n"))
    write(tmp_path / "small.jsonl", rec(1) + b"\n")
    write(tmp_path / "tiny.jsonl.gz", gzip.compress(rec(2)))
    pattern = str(tmp_path / "*")
    every = [1, 2, *range(1000, 2000)]
    for count in (2, 3):
        seen = [i for stream in consumers_of(pattern, count, shuffle_files=1) for i in ids(list(stream))]
        assert sorted(seen) == every
        for consumer in range(count):

            def build(consumer: int = consumer, count: int = count) -> rs.Node[Any]:
                return rs.jsonl_stream(pattern, shuffle_files=1, rank=consumer, world_size=count)

            n = len(list(build()))
            for k in sorted({0, 1, n // 2, n - 1, n, n + 1}):
                check_resume(build, k, 2 * n + 2)


@pytest.mark.parametrize("compressed", [False, True])
def test_a_line_longer_than_any_read_size_reads_resumes_and_is_fetched_again(tmp_path: Path, compressed: bool) -> None:
    big = {"id": 1, "text": "é" * (3 << 20)}  # 6 MB of UTF-8 on one line
    data = rec(0) + b"\n" + json.dumps(big, ensure_ascii=False).encode() + b"\r\n" + rec(2)
    name = "long.jsonl.gz" if compressed else "long.jsonl"
    path = write(tmp_path / name, gzip.compress(data, compresslevel=1) if compressed else data)
    stream = rs.jsonl_stream(path)
    assert ids(list(stream)) == [0, 1, 2]
    for k in range(4):
        check_resume(lambda: rs.jsonl_stream(path), k, 5)
    stream = rs.jsonl_stream(path)
    keys = []
    for _ in range(3):
        next(stream)
        keys.append(stream.last_key())
    assert ids(stream.fetch_many(keys[::-1])) == [2, 1, 0]
    assert stream.fetch(keys[1]) == big


def test_every_record_key_fetches_its_record(tmp_path: Path) -> None:
    """A packer's restore fetches its buffer by key: the first line after a BOM, a line that
    spans two gzip members, the last line without a newline, all in one fetch_many."""
    pattern = odd_corpus(tmp_path / "odd")
    stream = rs.jsonl_stream(pattern, shuffle_files=2)
    records, keys = [], []
    for record in stream:
        records.append(record)
        keys.append(stream.last_key())
    assert len(set(keys)) == len(keys) == len(ODD_IDS)
    order = list(range(len(keys)))[::-2] + list(range(len(keys)))[::2]
    assert rs.jsonl_stream(pattern, shuffle_files=2).fetch_many([keys[i] for i in order]) == [records[i] for i in order]


def test_other_compressions_are_read_as_plain_jsonl_and_fail_naming_the_file(tmp_path: Path) -> None:
    """Only ``.gz`` is decompressed (docs/sources.md); a gzip file under another name, a bz2 or
    an xz file are read as plain JSONL: a SourceError naming the file, never a bare error."""
    import bz2
    import lzma

    text = b"".join(rec(i) + b"\n" for i in range(20))
    for name, payload in (
        ("data.jsonl.bz2", bz2.compress(text)),
        ("data.jsonl.xz", lzma.compress(text)),
        ("data.jsonl.gzip", gzip.compress(text)),
        ("data.jsonl.GZ", gzip.compress(text)),
    ):
        path = write(tmp_path / name, payload)
        with pytest.raises(rs.SourceError, match=name.replace(".", "[.]")):
            list(rs.jsonl_stream(path))


# -- the central property: every step, two epochs, chains, consumers ---------------------------

CHAINS: dict[str, Callable[[rs.Node[Any]], rs.Node[Any]]] = {
    "plain": lambda s: s,
    "map_filter_batch": lambda s: s.map(lambda r: r["id"]).filter(lambda i: i % 3 != 1).batch(2),
    "pack": lambda s: s.pack(6, buffer_size=3).map(lambda row: row["input_ids"].tolist()),
    "pack_batch": lambda s: (
        s.pack(5, strategy="greedy").batch(2, collate_fn=collate_rows).map(lambda b: b["input_ids"].tolist())
    ),
    "repeat": lambda s: s.repeat(),
}


@pytest.mark.parametrize("consumer", [(0, 1), (1, 3)], ids=lambda c: f"{c[0]}of{c[1]}")
@pytest.mark.parametrize("chain", sorted(CHAINS))
def test_resume_at_every_step_of_two_shuffled_epochs(tmp_path: Path, chain: str, consumer: tuple[int, int]) -> None:
    pattern = odd_corpus(tmp_path / "odd")

    def build() -> rs.Node[Any]:
        return CHAINS[chain](rs.jsonl_stream(pattern, shuffle_files=5, rank=consumer[0], world_size=consumer[1]))

    n = len(take(build(), 100))  # two epochs or more (repeat: as many as asked)
    n = min(n, 30)
    assert n > 4
    for k in range(n + 1):
        check_resume(build, k, n)
    for k in range(0, n, 4):
        check_resume(build, k, n, k2=min(n, k + 3))  # restored twice in a row


FILE_SHAPES = st.lists(
    st.tuples(
        st.integers(0, 4),  # records
        st.booleans(),  # gzip
        st.sampled_from([b"\n", b"\r\n", b"\n\n", b"\r\n \t\r\n"]),  # line end (with blank lines)
        st.booleans(),  # BOM
        st.booleans(),  # a last line without its newline
    ),
    min_size=1,
    max_size=6,
)


@given(shapes=FILE_SHAPES, count=st.integers(1, 5), seed=st.integers(0, 2**64 - 1), data=st.data())
def test_random_file_sets_split_whole_and_resume_anywhere(
    tmp_path_factory: pytest.TempPathFactory, shapes: list[Any], count: int, seed: int, data: st.DataObject
) -> None:
    directory = tmp_path_factory.mktemp("shapes")
    every = []
    for f, (records, compressed, end, bom, open_end) in enumerate(shapes):
        lines = [rec(f * 10 + i) for i in range(records)]
        every += [f * 10 + i for i in range(records)]
        text = (BOM if bom else b"") + end.join(lines) + (b"" if open_end or not lines else end)
        write(directory / f"f{f}.jsonl{'.gz' if compressed else ''}", gzip.compress(text) if compressed else text)
    pattern = str(directory / "f*")
    shares = [ids(list(stream)) for stream in consumers_of(pattern, count, shuffle_files=seed)]
    assert sorted(i for share in shares for i in share) == sorted(every)
    consumer = data.draw(st.integers(0, count - 1))
    n = len(shares[consumer])

    def build() -> rs.Node[Any]:
        return rs.jsonl_stream(pattern, shuffle_files=seed, rank=consumer, world_size=count).repeat()

    k = data.draw(st.integers(0, 2 * n + 1))
    check_resume(build, k, 2 * n + 2, k2=data.draw(st.sampled_from([None, k + 1])))


def test_resume_behind_a_prefetch_at_the_last_line_of_each_file(tmp_path: Path) -> None:
    pattern = odd_corpus(tmp_path / "odd")

    def build() -> rs.Node[Any]:
        return rs.jsonl_stream(pattern, shuffle_files=4).map(lambda r: r["id"]).prefetch(2)

    n = len(ODD_IDS)
    for k in (0, 1, 4, 7, 10, n - 1, n, n + 1, n + 4, 2 * n):
        check_resume(build, k, 2 * n + 2)
    check_resume(build, 3, 2 * n + 2, k2=n + 1)


def test_a_consumer_without_files_resumes_to_nothing(tmp_path: Path) -> None:
    pattern = odd_corpus(tmp_path / "odd")
    stream = rs.jsonl_stream(pattern, rank=8, world_size=9).repeat()
    assert take(stream, 3) == []
    state = roundtrip(stream.get_state())
    assert state["upstream"]["queue"] == []
    resumed = rs.jsonl_stream(pattern, rank=8, world_size=9).repeat()
    resumed.set_state(state)
    assert take(resumed, 3) == []


def test_copies_of_a_stream_in_the_middle_of_a_gzip_file_continue_alike(tmp_path: Path) -> None:
    path = write(tmp_path / "a.jsonl.gz", gzip.compress(b"".join(rec(i) + b"\n" for i in range(50))))
    plain = write(tmp_path / "b.jsonl", b"".join(rec(100 + i) + b"\n" for i in range(5)))
    stream = rs.jsonl_stream([path, plain])
    take(stream, 17)
    copies = [pickle.loads(pickle.dumps(stream)), copy.deepcopy(stream)]
    rest = ids(list(stream))
    assert rest == [*range(17, 50), *range(100, 105)]
    assert [ids(list(c)) for c in copies] == [rest, rest]


# -- errors in the data -------------------------------------------------------------------------


@pytest.mark.parametrize("compressed", [False, True])
def test_a_malformed_line_names_its_physical_line_after_any_resume_or_is_skipped(
    tmp_path: Path, compressed: bool
) -> None:
    body = BOM + rec(0) + b"\r\n\r\n" + rec(1) + b"\n  \n" + rec(2) + b"\r\n" + b'{"id": 3\n' + rec(4)
    name = "bad.jsonl.gz" if compressed else "bad.jsonl"
    payload = gzip.compress(body[:30]) + gzip.compress(body[30:]) if compressed else body
    path = write(tmp_path / name, payload)
    for k in range(4):
        stream = rs.jsonl_stream(path)
        assert ids(take(stream, k)) == [0, 1, 2][:k]
        resumed = rs.jsonl_stream(path)
        resumed.set_state(roundtrip(stream.get_state()))
        with pytest.raises(rs.SourceError, match=rf"{name.replace('.', '[.]')}:6: malformed JSON"):
            list(resumed)
        skipping = rs.jsonl_stream(path, on_error="skip")
        take(skipping, k)
        resumed = rs.jsonl_stream(path, on_error="skip")
        resumed.set_state(roundtrip(skipping.get_state()))
        assert ids(list(resumed)) == [0, 1, 2, 4][k:]
        assert resumed.skipped == 1


@pytest.mark.parametrize("victim", [1, 2], ids=["gzip", "plain"])
def test_a_removed_file_is_skipped_and_counted_with_on_error_skip(tmp_path: Path, victim: int) -> None:
    paths = [
        write(tmp_path / "a.jsonl", b"".join(rec(i) + b"\n" for i in range(3))),
        write(tmp_path / "b.jsonl.gz", gzip.compress(b"".join(rec(10 + i) + b"\n" for i in range(3)))),
        write(tmp_path / "c.jsonl", b"".join(rec(20 + i) + b"\n" for i in range(3))),
    ]
    stream = rs.jsonl_stream(paths, on_error="skip")
    assert ids(take(stream, 1)) == [0]
    os.remove(paths[victim])
    rest = ids(list(stream))
    assert rest == [i for i in [1, 2, 10, 11, 12, 20, 21, 22] if i // 10 != victim]
    assert stream.skipped == 1


def test_a_truncated_gzip_file_yields_a_prefix_of_its_lines_then_a_source_error(tmp_path: Path) -> None:
    """Wherever a gzip file is cut, the stream yields whole lines of the file, in order, never a
    cut line (lines are numbers, so a cut one would still parse), then a SourceError naming it;
    with on_error="skip" the same prefix and one skip."""
    text = b"".join(str(5_000_000 + i * 7919).encode() + b"\n" for i in range(3000))
    whole = gzip.compress(text, compresslevel=1)
    lines = [int(line) for line in text.split()]
    good = write(tmp_path / "z_good.jsonl", b"1\n2\n")
    reached = set()
    for cut in range(10, len(whole), max(1, len(whole) // 40)):
        path = write(tmp_path / "cut.jsonl.gz", whole[:cut])
        got: list[int] = []
        with pytest.raises(rs.SourceError, match=r"cut\.jsonl\.gz"):
            for record in rs.jsonl_stream([path, good]):
                got.append(record)
        assert got == lines[: len(got)]
        reached.add(len(got))
        skipping = rs.jsonl_stream([path, good], on_error="skip")
        assert list(skipping) == got + [1, 2] and skipping.skipped == 1
    assert len(reached) > 10  # the cuts fell at many places in the content


# -- hand-corrupted states: only StateError, pipeline unchanged ----------------------------------


def numbers_corpus(tmp_path: Path) -> list[str]:
    """Two files whose lines are numbers: a line's tail is a number too."""
    plain = write(tmp_path / "a.jsonl", "".join(f"{5000 + 111 * i}\n" for i in range(1, 9)))
    packed = write(tmp_path / "b.jsonl.gz", gzip.compress("".join(f"{7000 + 111 * i}\n" for i in range(1, 9)).encode()))
    return [plain, packed]


def set_item(*where: Any) -> Callable[[dict[str, Any]], None]:
    """An edit of a state: set the entry at the path ``where[:-1]`` to ``where[-1]``."""

    def edit(state: dict[str, Any]) -> None:
        holder: Any = state
        for key in where[:-2]:
            holder = holder[key]
        holder[where[-2]] = where[-1]

    return edit


CORRUPTIONS: dict[str, Callable[[dict[str, Any]], None]] = {
    "negative_offset": set_item("queue", 0, 1, -1),
    "offset_past_plain_end": set_item("queue", 0, 1, 41),
    "offset_past_gzip_bound": set_item("queue", 1, 1, 10**9),
    "offset_float": set_item("queue", 0, 1, 15.0),
    "offset_string": set_item("queue", 0, 1, "15"),
    "offset_null": set_item("queue", 0, 1, None),
    "file_bool": set_item("queue", 0, 0, True),
    "file_out_of_range": set_item("queue", 0, 0, 2),
    "file_negative": set_item("queue", 0, 0, -1),
    "line_negative": set_item("queue", 0, 2, -4),
    "item_short": set_item("queue", 0, [0, 15]),
    "item_long": set_item("queue", 0, [0, 15, 3, 0]),
    "item_dict": set_item("queue", 0, {"file": 0}),
    "queue_dict": set_item("queue", {}),
    "queue_missing": lambda state: state.pop("queue"),
    "wrong_file_name": set_item("files", 0, 0, "/elsewhere/c.jsonl"),
    "files_swapped": lambda state: state["files"].reverse(),
    "fewer_files": lambda state: state["files"].pop(),
    "more_files": lambda state: state["files"].append(state["files"][0]),
    "file_size": set_item("files", 0, 1, 41),
    "file_digest": set_item("files", 1, 3, "gzip-tail:0000000000000000"),
    "fingerprint_short": set_item("files", 0, ["a.jsonl"]),
    "epoch_negative": set_item("epoch", -1),
    "epoch_string": set_item("epoch", "0"),
    "next_queue_bad": set_item("next_queue", [[7, 0, 0]]),
    "rank": set_item("rank", 1),
    "world_size": set_item("world_size", 2),
    "shuffle_files": set_item("shuffle_files", 3),
    "on_error": set_item("on_error", "skip"),
    "kind": set_item("kind", "JsonlSource"),
    "version": set_item("version", 99),
    "ended_string": set_item("ended", "no"),
}


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_a_hand_corrupted_state_is_a_state_error_and_leaves_the_stream_as_it_was(
    tmp_path: Path, corruption: str
) -> None:
    paths = numbers_corpus(tmp_path)
    saved = rs.jsonl_stream(paths)
    assert take(saved, 3) == [5111, 5222, 5333]
    state = roundtrip(saved.get_state())
    assert state["queue"] == [[0, 15, 3], [1, 0, 0]]
    bad = copy.deepcopy(state)
    CORRUPTIONS[corruption](bad)

    victim = rs.jsonl_stream(paths)
    take(victim, 10)  # in the middle of the gzip file, its handle open
    expected = take(rs.jsonl_stream(paths), 16)[10:]
    with pytest.raises(rs.StateError):
        victim.set_state(bad)
    assert take(victim, 6) == expected
    victim.set_state(state)  # a good state still loads after the failed one
    assert take(victim, 5) == [5444, 5555, 5666, 5777, 5888]


@pytest.mark.parametrize("compressed", [False, True])
def test_an_offset_inside_a_line_is_a_state_error_not_a_record(tmp_path: Path, compressed: bool) -> None:
    path = numbers_corpus(tmp_path)[int(compressed)]
    first = 5111 if not compressed else 7111
    stream = rs.jsonl_stream(path)
    assert take(stream, 1) == [first]
    state = roundtrip(stream.get_state())
    assert state["queue"] == [[0, 5, 1]]
    state["queue"][0][1] = 7  # inside "5222\n" (or "7222\n"): its tail "22" parses as a number
    resumed = rs.jsonl_stream(path)
    got: list[Any] = []
    with pytest.raises(rs.StateError, match=r"b\.jsonl\.gz|a\.jsonl"):
        resumed.set_state(state)
        got += list(resumed)  # a gzip offset may only be checked when reached
    assert 22 not in got


def test_a_queue_naming_a_file_twice_is_a_state_error(tmp_path: Path) -> None:
    paths = numbers_corpus(tmp_path)
    stream = rs.jsonl_stream(paths)
    take(stream, 3)
    state = roundtrip(stream.get_state())
    state["queue"].append([1, 0, 0])
    resumed = rs.jsonl_stream(paths)
    with pytest.raises(rs.StateError, match="queue"):
        resumed.set_state(state)
    got = list(resumed)
    assert len(got) == len(set(got))


def test_a_failed_set_state_leaves_a_packer_after_the_stream_as_it_was(tmp_path: Path) -> None:
    pattern = odd_corpus(tmp_path / "odd")

    def build() -> rs.Node[Any]:
        return rs.jsonl_stream(pattern, shuffle_files=1).pack(7, buffer_size=3).map(lambda r: r["input_ids"].tolist())

    expected = take(build(), 12)
    pipe = build()
    assert take(pipe, 3) == expected[:3]
    state = roundtrip(pipe.get_state())
    for edit in (
        set_item("upstream", "upstream", "queue", 0, 1, -5),  # the stream's part
        set_item("upstream", "upstream", "files", 0, 0, "x.jsonl"),
    ):
        bad = copy.deepcopy(state)
        edit(bad)
        with pytest.raises(rs.StateError):
            pipe.set_state(bad)
    assert take(pipe, 9) == expected[3:]


# -- files changed between save and restore ------------------------------------------------------


def two_files(tmp_path: Path) -> list[str]:
    plain = write(tmp_path / "a.jsonl", b"".join(rec(i) + b"\n" for i in range(6)))
    stored = gzip.compress(b"".join(rec(10 + i) + b"\n" for i in range(6)), compresslevel=0)
    packed = write(tmp_path / "b.jsonl.gz", stored)  # stored: other text of its length keeps its size
    return [plain, packed]


def appended(path: str) -> None:
    data = Path(path).read_bytes()
    extra = gzip.compress(rec(99) + b"\n") if path.endswith(".gz") else rec(99) + b"\n"
    write(Path(path), data + extra)


def truncated(path: str) -> None:
    data = Path(path).read_bytes()
    write(Path(path), data[: len(data) - 9])


def replaced_same_size(path: str) -> None:
    """Other content, the same size, a new mtime."""
    if path.endswith(".gz"):
        text = gzip.decompress(Path(path).read_bytes()).replace(b'"id": 1', b'"id": 7')
        data = gzip.compress(text, compresslevel=0)
        assert len(data) == os.path.getsize(path)
    else:
        data = Path(path).read_bytes().replace(b'"id": 1', b'"id": 7')
    write(Path(path), data)
    info = os.stat(path)
    os.utime(path, ns=(info.st_atime_ns, info.st_mtime_ns + 10**9))


CHANGES = {"appended": appended, "truncated": truncated, "replaced_same_size": replaced_same_size}


@pytest.mark.parametrize("which", [0, 1], ids=["plain", "gzip"])
@pytest.mark.parametrize("change", sorted(CHANGES))
@pytest.mark.parametrize("read", ["before", "inside", "after"])
def test_a_file_changed_between_save_and_restore_is_a_state_error(
    tmp_path: Path, change: str, which: int, read: str
) -> None:
    """Whether the state was taken before the changed file was read, inside it or after it."""
    paths = two_files(tmp_path)
    taken = {"before": 0 if which == 0 else 2, "inside": 3 if which == 0 else 8, "after": 7 if which == 0 else 12}
    stream = rs.jsonl_stream(paths)
    take(stream, taken[read])
    state = roundtrip(stream.get_state())
    CHANGES[change](paths[which])
    name = os.path.basename(paths[which]).replace(".", "[.]")
    fresh = rs.jsonl_stream(paths)
    with pytest.raises(rs.StateError, match=rf"{name}' differs from the file the state was taken over"):
        fresh.set_state(state)
    assert ids(take(fresh, 1)) == [0]  # left as it was: a fresh epoch over the new files
    with pytest.raises(rs.StateError):
        fresh.set_state(state)


def test_a_new_file_matching_the_glob_or_a_removed_one_is_a_state_error(tmp_path: Path) -> None:
    paths = two_files(tmp_path)
    pattern = str(tmp_path / "*.jsonl*")
    stream = rs.jsonl_stream(pattern)
    take(stream, 4)
    state = roundtrip(stream.get_state())
    extra = write(tmp_path / "c.jsonl", rec(50) + b"\n")
    with pytest.raises(rs.StateError, match="state was saved over 2 files, this source has 3"):
        rs.jsonl_stream(pattern).set_state(state)
    os.remove(extra)
    os.remove(paths[0])
    with pytest.raises(rs.StateError):
        rs.jsonl_stream(pattern).set_state(state)


def test_files_staged_elsewhere_with_their_mtimes_resume_exactly(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    paths = two_files(tmp_path / "src")
    stream = rs.jsonl_stream(paths, shuffle_files=2)
    take(stream, 8)
    state = roundtrip(stream.get_state())
    expected = take(stream, 6)
    (tmp_path / "job").mkdir()
    staged = [shutil.copy2(path, tmp_path / "job") for path in paths]  # cp -p
    resumed = rs.jsonl_stream([str(path) for path in staged], shuffle_files=2)
    resumed.set_state(state)
    assert take(resumed, 6) == expected
    gz = str(staged[1])
    info = os.stat(gz)
    os.utime(gz, ns=(info.st_atime_ns, info.st_mtime_ns + 10**9))  # a touched gzip file restores
    again = rs.jsonl_stream([str(path) for path in staged], shuffle_files=2)
    again.set_state(state)
    assert take(again, 6) == expected


def padded_gzip(records: list[int], size: int = 1024) -> bytes:
    """Gzip padded with zeros to ``size`` bytes (tape-block padding; gzip readers skip it)."""
    data = gzip.compress(b"".join(rec(i) + b"\n" for i in records), mtime=0)
    assert len(data) <= size
    return data + b"\0" * (size - len(data))


def test_a_zero_padded_gzip_file_replaced_between_save_and_restore_is_a_state_error(tmp_path: Path) -> None:
    path = tmp_path / "padded.jsonl.gz"
    write(path, padded_gzip(list(range(10, 20))))
    stream = rs.jsonl_stream(str(path))
    assert ids(take(stream, 3)) == [10, 11, 12]
    state = roundtrip(stream.get_state())
    write(path, padded_gzip(list(range(30, 40))))  # other records of the same length, same size
    info = os.stat(path)
    os.utime(path, ns=(info.st_atime_ns, info.st_mtime_ns + 10**9))
    resumed = rs.jsonl_stream(str(path))
    with pytest.raises(rs.StateError, match="padded"):
        resumed.set_state(state)
        ids(list(resumed))  # today: [33, ..., 39], lines of the other file


def test_a_zero_padded_gzip_file_replaced_during_the_run_is_a_source_error(tmp_path: Path) -> None:
    path = tmp_path / "padded.jsonl.gz"
    write(path, padded_gzip(list(range(10, 20))))
    other = write(tmp_path / "z.jsonl", rec(1) + b"\n")
    stream = rs.jsonl_stream([str(path), other])
    assert ids(take(stream, 3)) == [10, 11, 12]
    write(path, padded_gzip(list(range(30, 40))))
    info = os.stat(path)
    os.utime(path, ns=(info.st_atime_ns, info.st_mtime_ns + 10**9))
    stream.close()  # the next read opens the file again, and checks it
    got: list[int] = []
    with pytest.raises(rs.SourceError, match=r"padded\.jsonl\.gz' changed during the run"):
        got += ids(list(stream))
    assert not set(got) & set(range(30, 40))


def test_a_touched_empty_gzip_file_still_restores(tmp_path: Path) -> None:
    data = write(tmp_path / "a.jsonl.gz", gzip.compress(b"".join(rec(i) + b"\n" for i in range(5))))
    empty = write(tmp_path / "b.jsonl.gz", b"")  # an empty shard
    stream = rs.jsonl_stream([data, empty])
    take(stream, 2)
    state = roundtrip(stream.get_state())
    for path in (data, empty):
        info = os.stat(path)
        os.utime(path, ns=(info.st_atime_ns, info.st_mtime_ns + 10**9))
    resumed = rs.jsonl_stream([data, empty])
    resumed.set_state(state)
    assert ids(list(resumed)) == [2, 3, 4]


def test_a_glob_over_a_directory_does_not_read_the_sidecars_rs_jsonl_wrote_there(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    plain, packed = two_files(data)
    pattern = str(data / "*")
    stream = rs.jsonl_stream(pattern)
    take(stream, 3)
    state = roundtrip(stream.get_state())
    expected = ids(take(stream, 9))
    assert len(list(rs.jsonl(plain))) == 6  # indexing the plain file writes a.jsonl.rsidx beside it
    assert sorted(os.listdir(data)) == ["a.jsonl", "a.jsonl.rsidx", "b.jsonl.gz"]
    assert ids(list(rs.jsonl_stream(pattern))) == [*range(6), *range(10, 16)]
    resumed = rs.jsonl_stream(pattern)
    resumed.set_state(state)
    assert ids(take(resumed, 9)) == expected


# -- elastic restore onto other consumer counts ---------------------------------------------------


def test_elastic_restores_through_more_consumers_than_files_see_every_line_once(tmp_path: Path) -> None:
    write(tmp_path / "big.jsonl.gz", gzip.compress(b"".join(rec(1000 + i) + b"\n" for i in range(300))))
    write(tmp_path / "mid.jsonl", b"".join(rec(100 + i) + b"\n" for i in range(30)))
    write(tmp_path / "one.jsonl", rec(7))
    pattern = str(tmp_path / "*")
    every = Counter([7, *range(100, 130), *range(1000, 1300)])
    seen: Counter[int] = Counter()
    states = None
    for count, taken in ((9, 11), (2, 40), (5, 17), (4, 3), (1, None)):
        new_states = []
        for consumer in range(count):
            pipe = rs.jsonl_stream(pattern, shuffle_files=6, rank=consumer, world_size=count)
            if states is not None:
                restore(pipe, states)
            got = list(pipe) if taken is None else [x for _, x in zip(range(taken), pipe)]  # in this epoch
            seen.update(ids(got))
            new_states.append(roundtrip(pipe.get_state()))
        states = new_states
    assert seen == every


# -- rs.torch.Loader ------------------------------------------------------------------------------


def loader_corpus(tmp_path: Path) -> str:
    """Four files (two empty or nearly), sizes 0, 1, 2 and 40 lines: fewer files with lines than
    three workers, and one worker reads 20 times as much as another."""
    write(tmp_path / "p0.jsonl", rec(1))
    write(tmp_path / "p1.jsonl.gz", gzip.compress(b"".join(rec(100 + i) + b"\r\n" for i in range(40))))
    write(tmp_path / "p2.jsonl", b"")
    write(tmp_path / "p3.jsonl.gz", gzip.compress(BOM + rec(20) + b"\n\n" + rec(21)))
    return str(tmp_path / "p*")


LOADER_IDS = sorted([1, 20, 21, *range(100, 140)])


def loader_run(loader: Loader, epochs: int, stop: int | None = None, first: int = 0) -> tuple[list[Any], Any]:
    """(epoch, batch ids) for ``epochs`` epochs from ``first``; with ``stop``, the state after
    that many batches (through JSON), taken inside the loop as a trainer does."""
    seen: list[Any] = []
    for epoch in range(first, epochs):
        for batch in loader:
            seen.append((epoch, [int(x) for x in batch]))
            if len(seen) == stop:
                return seen, roundtrip(loader.state_dict())
    return seen, None


LOADER_CONFIGS = [
    {"num_workers": 0},
    {"num_workers": 2},
    {"num_workers": 3, "persistent_workers": True},
]


@pytest.mark.parametrize("config", LOADER_CONFIGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_loader_resumes_exactly_from_its_state_dict(tmp_path: Path, config: dict[str, Any]) -> None:
    pattern = loader_corpus(tmp_path)

    def build() -> rs.Node[Any]:
        return rs.jsonl_stream(pattern, shuffle_files=2).map(lambda r: r["id"]).batch(3)

    expected, _ = loader_run(Loader(build, **config), 2)
    epoch0 = [batch for epoch, batch in expected if epoch == 0]
    assert sorted(i for batch in epoch0 for i in batch) == LOADER_IDS
    per_epoch = len(epoch0)
    for k in (1, per_epoch - 1, per_epoch, per_epoch + 2):
        head, state = loader_run(Loader(build, **config), 2, stop=k)
        resumed = Loader(build, **config)
        resumed.load_state_dict(state)
        tail, _ = loader_run(resumed, 2, first=resumed.epoch)
        assert head + tail == expected, k
        resumed.close()


def test_loader_with_a_packer_after_the_stream_resumes_exactly(tmp_path: Path) -> None:
    pattern = loader_corpus(tmp_path)

    def build() -> rs.Node[Any]:
        return rs.jsonl_stream(pattern).pack(8, buffer_size=4).map(lambda r: r["input_ids"]).batch(2)

    def rows(loader: Loader, stop: int | None = None) -> tuple[list[Any], Any]:
        seen: list[Any] = []
        for batch in loader:
            seen.append([[int(x) for x in row] for row in batch])
            if len(seen) == stop:
                return seen, roundtrip(loader.state_dict())
        return seen, None

    config = {"num_workers": 2, "persistent_workers": True}
    expected, _ = rows(Loader(build, **config))
    tokens = Counter(t for batch in expected for row in batch for t in row if t)
    assert tokens == Counter(t for i in LOADER_IDS for t in json.loads(rec(i))["input_ids"])
    for k in (2, len(expected) // 2, len(expected) - 1):
        head, state = rows(Loader(build, **config), stop=k)
        resumed = Loader(build, **config)
        resumed.load_state_dict(state)
        assert head + rows(resumed)[0] == expected, k


@pytest.mark.parametrize("old_workers,new_workers,stop", [(3, 2, 6), (2, 5, 12)])
def test_loader_elastic_restore_across_a_repeat_sees_every_line_once_per_epoch(
    tmp_path: Path, old_workers: int, new_workers: int, stop: int
) -> None:
    """Workers' shares differ 20x, so some are already in the second pass of the repeat when
    the state is taken; more new workers than files with lines."""
    pattern = loader_corpus(tmp_path)

    def build() -> rs.Node[Any]:
        return rs.jsonl_stream(pattern, shuffle_files=4).repeat(2).map(lambda r: r["id"]).batch(2)

    old = Loader(build, num_workers=old_workers)
    iterator = iter(old)
    head = [next(iterator) for _ in range(stop)]
    state = roundtrip(old.state_dict())
    old.close()
    new = Loader(build, num_workers=new_workers)
    new.load_state_dict([state])
    seen = Counter(int(x) for batch in head + list(new) for x in batch)
    assert seen == Counter({i: 2 for i in LOADER_IDS})


def test_loader_over_a_stream_already_read_in_the_main_process(tmp_path: Path) -> None:
    """A pipeline object (not a factory) read into its gzip file before the Loader copies it:
    every worker starts its epoch from the start of its own files."""
    pattern = loader_corpus(tmp_path)
    for workers in (0, 2):
        pipe = rs.jsonl_stream(pattern, shuffle_files=1).map(lambda r: r["id"]).batch(3)
        take(pipe, 5)
        loader = Loader(pipe, num_workers=workers)
        for _ in range(2):
            assert sorted(int(x) for batch in loader for x in batch) == LOADER_IDS
        loader.close()


def test_loader_worker_state_corrupted_is_a_state_error_with_the_first_batch(tmp_path: Path) -> None:
    """docs/torch.md: each worker validates its own pipeline state, so a stream state past its file's
    end arrives as rs.StateError with the first batch; the loaded state stays, and a good one loads."""
    pattern = loader_corpus(tmp_path)

    def build() -> rs.Node[Any]:
        return rs.jsonl_stream(pattern).map(lambda r: r["id"]).batch(2)

    loader = Loader(build, num_workers=2)
    iterator = iter(loader)
    for _ in range(3):
        next(iterator)
    state = roundtrip(loader.state_dict())
    expected = [[int(x) for x in batch] for batch in iterator]
    loader.close()
    bad = copy.deepcopy(state)
    snapshots = bad["loader"]["_snapshot"]["_worker_snapshots"]
    holder = snapshots["worker_1"]["fetcher_state"]["dataset_iter_state"]
    pipeline = json.loads(holder["pipeline"])
    stream_state = pipeline["upstream"]["upstream"]
    assert stream_state["kind"] == "JsonlStream" and stream_state["queue"]
    stream_state["queue"][0][1] = 10**6
    holder["pipeline"] = json.dumps(pipeline)
    resumed = Loader(build, num_workers=2)
    resumed.load_state_dict(bad)
    with pytest.raises(rs.StateError, match="points past the end"):
        list(resumed)
    assert resumed.state_dict() == bad
    resumed.load_state_dict(state)
    assert [[int(x) for x in batch] for batch in resumed] == expected
    resumed.close()


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_a_malformed_line_read_by_a_loader_worker_is_a_source_error_naming_file_and_line(
    tmp_path: Path, on_error: str
) -> None:
    write(tmp_path / "a.jsonl", b"".join(rec(i) + b"\n" for i in range(4)))
    write(tmp_path / "b.jsonl.gz", gzip.compress(rec(10) + b"\r\n\r\n" + b'{"id": 11\n' + rec(12) + b"\n"))
    pattern = str(tmp_path / "*")

    def build() -> rs.Node[Any]:
        return rs.jsonl_stream(pattern, on_error=on_error).map(lambda r: r["id"]).batch(1)

    loader = Loader(build, num_workers=2)
    if on_error == "raise":
        with pytest.raises(rs.SourceError, match=r"b\.jsonl\.gz:3: malformed JSON record"):
            list(loader)
    else:
        assert sorted(int(x) for batch in loader for x in batch) == [0, 1, 2, 3, 10, 12]
    loader.close()


TIB = 1 << 40


def sparse_file(path: Path, tail_at: int, tail: bytes, head: bytes = b"") -> bool:
    """Write ``head``, then ``tail`` at byte ``tail_at`` over a hole; False (and no file) where
    the file system cannot hold it sparse (checked first on a 64 MiB hole)."""
    probe = path.with_name("probe")
    try:
        with open(probe, "wb") as out:
            out.seek(64 << 20)
            out.write(b"x")
        if os.stat(probe).st_blocks * 512 > 1 << 20:
            return False
        with open(path, "wb") as out:
            out.write(head)
            out.seek(tail_at)
            out.write(tail)
        return os.stat(path).st_blocks * 512 < 1 << 20
    except OSError:
        return False
    finally:
        probe.unlink(missing_ok=True)


def test_a_plain_file_past_one_tebibyte_is_refused_when_the_stream_is_built(tmp_path: Path) -> None:
    """Record keys pack a byte offset in 40 bits: a larger plain file is a SourceError naming it
    when the stream is built (docs/sources.md), never keys that spill into another file's."""
    huge = tmp_path / "huge.jsonl"
    if not sparse_file(huge, TIB - 2, b"\n" + rec(1) + b"\n" + rec(2) + b"\n", head=rec(0) + b"\n"):
        pytest.skip("no sparse files here")
    other = write(tmp_path / "other.jsonl", b"".join(rec(100 + i) + b"\n" for i in range(3)))
    try:
        with pytest.raises(rs.SourceError, match="huge.jsonl.*split it"):
            rs.jsonl_stream([str(huge), other])
    finally:
        huge.unlink()
