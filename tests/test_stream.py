"""JsonlStream: plain and gzip JSONL read as streams, sharded by file, resumed by byte offset,
and rescaled elastically by dealing out (file, offset) work items."""

from __future__ import annotations

import gzip
import json
import os
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import pytest

import resumable as rs
from resumable.elastic import restore
from resumable.pack import expand_references
from resumable.sources import files
from resumable.sources import stream as stream_module
from tests.resume import check_resume, take

FILES = 7
PER_FILE = 23


def corpus(tmp_path: Path) -> str:
    """Seven files, every other one gzip; blank lines and a CRLF line among the records."""
    for f in range(FILES):
        lines = []
        for i in range(PER_FILE):
            first = 1000 * (f * 100 + i) + 1  # token ids name their document and never repeat
            record = {"id": f * 100 + i, "input_ids": list(range(first, first + (i * 7) % 19))}
            lines.append(json.dumps(record) + ("\r\n" if i == 3 else "\n"))
            if i % 6 == 0:
                lines.append("\n  \n")
        text = "".join(lines)
        path = tmp_path / f"part{f}.jsonl{'.gz' if f % 2 else ''}"
        if f % 2:
            with gzip.open(path, "wt") as out:
                out.write(text)
        else:
            path.write_text(text)
    return str(tmp_path / "part*")


ALL_IDS = sorted(f * 100 + i for f in range(FILES) for i in range(PER_FILE))


def ids(items: list[Any]) -> list[int]:
    return [record["id"] for record in items]


def test_reads_plain_and_gzip_files_skipping_blank_lines(tmp_path: Path) -> None:
    stream = rs.jsonl_stream(corpus(tmp_path))
    assert ids(list(stream)) == ALL_IDS
    assert stream.get_state()["queue"] == []


def test_consumers_split_by_file_and_cover_every_record_once(tmp_path: Path) -> None:
    pattern = corpus(tmp_path)
    seen = []
    for consumer in range(3):
        stream = rs.jsonl_stream(pattern, shuffle_files=4, rank=consumer, world_size=3)
        records = ids(list(stream))
        assert len({record // 100 for record in records}) in (2, 3)  # whole files
        seen += records
    assert sorted(seen) == ALL_IDS


def test_shuffled_file_order_changes_each_epoch(tmp_path: Path) -> None:
    stream = rs.jsonl_stream(corpus(tmp_path), shuffle_files=9)
    first = ids(list(stream))
    second = ids(list(stream))
    assert sorted(first) == sorted(second) == ALL_IDS
    assert first != second


CHAINS: dict[str, Callable[[rs.Node], rs.Node]] = {
    "plain": lambda s: s,
    "filter_batch": lambda s: s.filter(lambda r: r["id"] % 3).map(lambda r: r["id"]).batch(4),
    "pack": lambda s: s.pack(16, buffer_size=5).map(lambda row: row["input_ids"].tolist()),
    "repeat": lambda s: s.repeat(),
}


@pytest.mark.parametrize("chain", sorted(CHAINS))
def test_resume_property(tmp_path: Path, chain: str) -> None:
    pattern = corpus(tmp_path)

    def build() -> rs.Node:
        return CHAINS[chain](rs.jsonl_stream(pattern, shuffle_files=2))

    for k in (0, 1, 22, 23, 60, 161):
        check_resume(build, k, 200)
    check_resume(build, 10, 200, k2=70)


def test_malformed_lines_name_file_and_line_or_are_skipped(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text('{"id": 1}\n\n{"id": \n{"id": 3}\n')
    with pytest.raises(rs.SourceError, match=r"a\.jsonl:3: malformed JSON"):
        list(rs.jsonl_stream(str(tmp_path / "a.jsonl")))
    skipping = rs.jsonl_stream(str(tmp_path / "a.jsonl"), on_error="skip")
    assert ids(list(skipping)) == [1, 3] and skipping.skipped == 1


def test_changed_files_and_bad_queues_are_errors(tmp_path: Path) -> None:
    pattern = corpus(tmp_path)
    stream = rs.jsonl_stream(pattern)
    take(stream, 5)
    state = stream.get_state()
    bad = json.loads(json.dumps(state))
    bad["queue"][0] = [99, 0, 0]
    with pytest.raises(rs.StateError, match="queue entry"):
        rs.jsonl_stream(pattern).set_state(bad)
    (tmp_path / "part0.jsonl").write_text('{"id": 0}\n')
    with pytest.raises(rs.StateError, match="part0.jsonl' differs from the file the state was taken over"):
        rs.jsonl_stream(pattern).set_state(state)
    stream.close()  # files are checked when opened
    with pytest.raises(rs.SourceError, match="part0.jsonl' changed during the run"):
        list(stream)


def delivered(chain: str, item: Any) -> list[int]:
    if chain == "pack":
        return [int(t) for t in item if t]  # token 0 is padding; document tokens are ids >= 1
    return list(item) if isinstance(item, list) else [item["id"]]


@pytest.mark.parametrize("chain", ["plain", "filter_batch", "pack"])
def test_elastic_rescale_deals_out_work_items(tmp_path: Path, chain: str) -> None:
    pattern = corpus(tmp_path)
    records = [json.loads(line) for line in _all_lines(tmp_path)]
    if chain == "pack":
        expected = Counter(t for r in records for t in r["input_ids"])
    elif chain == "filter_batch":
        expected = Counter(r["id"] for r in records if r["id"] % 3)
    else:
        expected = Counter(r["id"] for r in records)

    seen: Counter[int] = Counter()
    states = None
    for consumers, taken in ((4, 9), (3, 5), (1, 12), (2, None)):
        new_states = []
        for consumer in range(consumers):
            pipe = CHAINS[chain](rs.jsonl_stream(pattern, shuffle_files=1, rank=consumer, world_size=consumers))
            if states is not None:
                restore(pipe, states)
            items = list(pipe) if taken is None else [x for _, x in zip(range(taken), pipe)]
            for item in items:
                seen.update(delivered(chain, item))
            new_states.append(json.loads(json.dumps(pipe.get_state())))
        states = new_states
    assert seen == expected


def _all_lines(tmp_path: Path) -> list[str]:
    lines = []
    for path in sorted(tmp_path.glob("part*")):
        text = gzip.open(path, "rt").read() if path.suffix == ".gz" else path.read_text()
        lines += [line for line in text.splitlines() if line.strip()]
    return lines


def test_bad_options_are_config_errors(tmp_path: Path) -> None:
    pattern = corpus(tmp_path)
    with pytest.raises(rs.ConfigError, match="need 0 <= rank < world_size"):
        rs.jsonl_stream(pattern, rank=3, world_size=2)
    with pytest.raises(rs.ConfigError, match="give both rank and world_size"):
        rs.jsonl_stream(pattern, rank=0)
    with pytest.raises(rs.ConfigError, match="shuffle_files must be a non-negative int or None"):
        rs.jsonl_stream(pattern, shuffle_files=True)
    with pytest.raises(rs.SourceError, match="no files match"):
        rs.jsonl_stream(str(tmp_path / "nothing*.jsonl"))


# -- bad states and bad inputs: typed errors naming the file ---------------------------------------


def gzip_file(path: Path, records: int = 20) -> str:
    with gzip.open(path, "wt") as out:
        out.writelines(json.dumps({"id": i, "text": "abc " * i}) + "\n" for i in range(records))
    return str(path)


@pytest.mark.parametrize("offset", [2**63, 2**40, "past_what_it_can_hold"])
def test_gzip_offsets_past_what_the_file_can_hold_are_refused_at_set_state(tmp_path: Path, offset: Any) -> None:
    """Regression: a gzip offset of 2**63 in a state was accepted and failed at next()."""
    path = gzip_file(tmp_path / "a.jsonl.gz")
    stream = rs.jsonl_stream(path)
    take(stream, 2)
    state = json.loads(json.dumps(stream.get_state()))
    limit = os.path.getsize(path) * stream_module.MAX_DEFLATE_RATIO
    state["queue"][0][1] = limit + 1 if offset == "past_what_it_can_hold" else offset
    fresh = rs.jsonl_stream(path)
    with pytest.raises(rs.StateError, match=r"points past the end of .*a\.jsonl\.gz"):
        fresh.set_state(state)
    assert take(fresh, 1) == [{"id": 0, "text": ""}]  # left as it was


def test_gzip_offset_past_the_content_is_a_state_error_when_reached(tmp_path: Path) -> None:
    path = gzip_file(tmp_path / "a.jsonl.gz")
    stream = rs.jsonl_stream(path)
    state = json.loads(json.dumps(stream.get_state()))
    content = len(gzip.decompress(Path(path).read_bytes()))
    state["queue"][0][1] = content + 5  # possible for a gzip file of this size, but past this one's content
    stream.set_state(state)
    with pytest.raises(rs.StateError, match=r"past the end of .*a\.jsonl\.gz'.*not taken over this file"):
        next(stream)


def corrupt_gzip(path: str, how: str) -> None:
    data = bytearray(Path(path).read_bytes())
    if how == "header":
        data[:2] = b"XX"  # BadGzipFile
    elif how == "truncated":
        data = data[: len(data) // 2]  # EOFError
    elif how == "deflate":
        for at in range(20, len(data) - 10, 7):
            data[at] ^= 0x5A  # zlib.error, or a CRC mismatch (BadGzipFile)
    Path(path).write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["header", "truncated", "deflate"])
def test_corrupt_gzip_is_a_source_error_naming_file_and_line(tmp_path: Path, how: str) -> None:
    """Regression: bare BadGzipFile and EOFError (zlib.error too) reached the user."""
    path = gzip_file(tmp_path / "a.jsonl.gz", records=200)
    corrupt_gzip(path, how)
    with pytest.raises(rs.SourceError, match=r"JsonlStream: cannot read .*a\.jsonl\.gz:\d+: \w+"):
        list(rs.jsonl_stream(path))


def test_removed_or_unreadable_file_is_a_source_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: a bare PermissionError reached the user."""
    first = gzip_file(tmp_path / "a.jsonl.gz")
    second = write_plain(tmp_path / "b.jsonl")
    stream = rs.jsonl_stream([first, second])
    take(stream, 3)
    os.remove(second)
    with pytest.raises(rs.SourceError, match=r"b\.jsonl"):
        list(stream)

    def refuse(path: str) -> Any:
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(stream_module, "_open", refuse)
    with pytest.raises(rs.SourceError, match=r"cannot read .*a\.jsonl\.gz:1: PermissionError"):
        next(rs.jsonl_stream(first))
    with pytest.raises(rs.SourceError, match=r"cannot read .*a\.jsonl\.gz'.*PermissionError"):
        rs.jsonl_stream(first).fetch((0, 0))


def write_plain(path: Path, records: int = 10) -> str:
    path.write_text("".join(json.dumps({"id": i}) + "\n" for i in range(records)))
    return str(path)


def touch(path: str) -> None:
    info = os.stat(path)
    os.utime(path, ns=(info.st_atime_ns, info.st_mtime_ns + 10**10))


def test_touched_gzip_restores_by_its_trailer_a_touched_plain_file_cannot(tmp_path: Path) -> None:
    gz = gzip_file(tmp_path / "a.jsonl.gz")
    plain = write_plain(tmp_path / "b.jsonl")
    stream = rs.jsonl_stream([gz, plain])
    take(stream, 4)
    state = stream.get_state()
    assert state["files"][0][3].startswith("gzip-tail:") and state["files"][1][3] is None
    expected = take(stream, 10)
    touch(gz)
    resumed = rs.jsonl_stream([gz, plain])
    resumed.set_state(state)
    assert take(resumed, 10) == expected
    touch(plain)
    with pytest.raises(rs.StateError, match=r"b\.jsonl' differs .*no content digest to compare"):
        rs.jsonl_stream([gz, plain]).set_state(state)


def test_file_changed_during_the_run_is_caught_at_get_state_and_epoch_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(files, "WATCH_INTERVAL", 0)
    first = write_plain(tmp_path / "a.jsonl")
    second = gzip_file(tmp_path / "b.jsonl.gz")
    stream = rs.jsonl_stream([first, second])
    take(stream, 2)
    with open(second, "ab") as out:
        out.write(b"\x00")
    with pytest.raises(rs.SourceError, match=r"b\.jsonl\.gz' changed during the run \(its size"):
        for _ in range(2):  # one file per get_state, round robin
            stream.get_state()
    epochs = rs.jsonl_stream(first)
    assert len(list(epochs)) == 10
    with open(first, "a") as out:
        out.write('{"id": 10}\n')
    with pytest.raises(rs.SourceError, match=r"a\.jsonl' changed during the run"):
        iter(epochs)


@pytest.mark.parametrize(
    "phases", [((3, (30, 60, 90)), (2, None)), ((4, (50, 10, 80, 45)), (3, (20, 40, 5)), (1, None))]
)
def test_elastic_rescale_of_consumers_on_both_sides_of_an_epoch_boundary(tmp_path: Path, phases: Any) -> None:
    """After ``.repeat()`` some old consumers may be in the next epoch while others finish the
    current one: both epochs' remaining work items are dealt out, each record comes twice."""
    pattern = corpus(tmp_path)
    seen: Counter[int] = Counter()
    states = None
    straddled = False
    for consumers, taken in phases:
        new_states = []
        for consumer in range(consumers):
            pipe = rs.jsonl_stream(pattern, shuffle_files=3, rank=consumer, world_size=consumers).repeat(2)
            if states is not None:
                restore(pipe, states)
            items = list(pipe) if taken is None else [x for _, x in zip(range(taken[consumer]), pipe)]
            seen.update(ids(items))
            new_states.append(json.loads(json.dumps(pipe.get_state())))
        epochs = {state["upstream"]["epoch"] for state in new_states}
        straddled = straddled or len(epochs) == 2
        states = new_states
    assert straddled
    assert seen == Counter({record_id: 2 for record_id in ALL_IDS})


def test_a_packer_restore_reads_each_gzip_file_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The packer's buffered pieces are fetched in one call, so a gzip file is decompressed once
    up to its last buffered record, not once per record (restore cost bounded by the buffer)."""
    path = tmp_path / "docs.jsonl.gz"
    with gzip.open(path, "wt") as out:
        out.writelines(json.dumps({"input_ids": list(range(1, 2 + i % 9))}) + "\n" for i in range(400))

    def build() -> rs.Node:
        return rs.jsonl_stream(str(path)).pack(16, buffer_size=50)

    pipe = build()
    take(pipe, 40)
    state = expand_references(json.loads(json.dumps(pipe.get_state())))
    assert len(state["open"]) > 20
    opened: list[str] = []
    original = stream_module._open
    monkeypatch.setattr(stream_module, "_open", lambda name: opened.append(name) or original(name))
    resumed = build()
    resumed.set_state(state)
    assert opened == [str(path)]
    rows = [row["input_ids"].tolist() for row in take(resumed, 10)]
    assert rows == [row["input_ids"].tolist() for row in take(pipe, 10)]
