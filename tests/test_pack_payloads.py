"""Payloads through the packer: per-token fields sliced and padded like the labels, per-document
fields carried to the row of each piece (on a split document's first piece only), a packing
cost from ``length_fn`` with the reserved positions inside the document's segment, through every
strategy and source kind, across resume and rescale (states still hold references only); and
``len()`` of a whole-epoch plan. The multimodal/SFT example of docs/packing.md runs here too."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

import resumable as rs
from resumable.elastic import restore
from resumable.pack import collate_rows, expand_references
from tests.resume import check_resume, take
from tests.sources import INDEXED_KINDS, indexed_source

SEQ_LEN = 8
STRIDE = 1000  # token = number * STRIDE + offset in the document: every token names its place
MASK_PAD, TYPE_PAD = 0, 7
STRATEGIES: list[tuple[str, int | None]] = [
    ("greedy", 3),
    ("first_fit", 3),
    ("best_fit", 3),
    ("bfd", 3),
    ("bfd", None),
]
PAYLOADS: dict[str, Any] = {
    "token_fields": {"loss_mask": MASK_PAD, "token_type_ids": TYPE_PAD},
    "document_fields": ["image", "path"],
}
LENGTHS = [3, 5, 9, 2, 8, 17, 1, 6, 4, 12, 7, 3, 0, 10, 5, 2]


def records(lengths: list[int] = LENGTHS, numpy: bool = False) -> list[dict[str, Any]]:
    """Documents whose token fields differ from their tokens and whose image and path name them;
    with ``numpy`` the fields are numpy arrays of their own dtypes (for an in-memory source)."""
    docs = []
    for number, length in enumerate(lengths, start=1):
        offsets = np.arange(length)
        doc = {
            "input_ids": (number * STRIDE + offsets).tolist(),
            "loss_mask": ((offsets + number) % 2).tolist(),
            "token_type_ids": (offsets % 3 + 1).tolist(),
            "image": [[number, number + 1], [number + 2, number + 3]],
            "path": f"images/{number}.png",
            "image_tokens": number % 4,
        }
        if numpy:
            doc["loss_mask"] = np.asarray(doc["loss_mask"], dtype=np.int8)
            doc["token_type_ids"] = np.asarray(doc["token_type_ids"], dtype=np.int32)
            doc["image"] = np.asarray(doc["image"], dtype=np.uint8)
        docs.append(doc)
    return docs


def source(kind: str, lengths: list[int] = LENGTHS) -> rs.Node[Any]:
    return indexed_source(kind, records(lengths)) if kind != "list" else rs.from_list(records(lengths, numpy=True))


def plain(row: dict[str, Any]) -> dict[str, Any]:
    """A row as comparable plain data."""
    return {
        name: value.tolist() if isinstance(value, np.ndarray) else [(at, _plain(item)) for at, item in value]
        for name, value in row.items()
    }


def _plain(value: Any) -> Any:
    return value if value is None or isinstance(value, str) else np.asarray(value).tolist()


def check_row(
    row: dict[str, Any], docs: list[dict[str, Any]], extra: Callable[[dict[str, Any]], int] | None = None
) -> list[tuple[int, int, int]]:
    """Check every piece of ``row`` against its record (named by its first token): token fields
    slice the record's arrays, document fields sit at the piece's offset on its first piece only,
    reserved positions (``extra``) follow the tokens inside the segment. Returns ``(number,
    start, end)`` of each piece."""
    pieces = []
    count = int(row["cu_seqlens_count"])
    bounds = row["cu_seqlens"][:count].tolist()
    used = bounds[-1] if row["document_ids"][bounds[-1] - 1] > 0 else bounds[-2]
    for index in range(int(row["document_ids"].max())):
        at, stop = bounds[index], bounds[index + 1]
        assert (row["document_ids"][at:stop] == index + 1).all()
        first = int(row["input_ids"][at])
        number, start = divmod(first, STRIDE)
        doc = docs[number - 1]
        reserved = extra(doc) if extra is not None and start == 0 else 0
        end = start + stop - at - reserved
        tokens = slice(at, stop - reserved)
        assert row["input_ids"][tokens].tolist() == doc["input_ids"][start:end]
        for name, pad in PAYLOADS["token_fields"].items():
            assert row[name][tokens].tolist() == np.asarray(doc[name])[start:end].tolist()
            assert (row[name][stop - reserved : stop] == pad).all()
        assert (row["labels"][stop - reserved : stop] == -100).all()
        assert row["position_ids"][at:stop].tolist() == list(range(stop - at))
        for name in PAYLOADS["document_fields"]:
            offset, value = row[name][index]
            assert offset == at
            assert _plain(value) == (_plain(doc[name]) if start == 0 else None)
        pieces.append((number, start, end))
    for name, pad in PAYLOADS["token_fields"].items():
        assert (row[name][used:] == pad).all()
        assert row[name].shape == (SEQ_LEN,)
    for name in PAYLOADS["document_fields"]:
        assert len(row[name]) == len(pieces)
    return pieces


def pack(pipe: rs.Node[Any], strategy: str, buffer_size: int | None, **options: Any) -> rs.Node[Any]:
    return pipe.pack(SEQ_LEN, strategy=strategy, buffer_size=buffer_size, **{**PAYLOADS, **options})


@pytest.mark.parametrize("kind", INDEXED_KINDS)
@pytest.mark.parametrize(("strategy", "buffer_size"), STRATEGIES)
def test_rows_carry_the_slices_and_payloads_of_their_pieces(kind: str, strategy: str, buffer_size: int | None) -> None:
    docs = records()
    rows = list(pack(source(kind).shuffle(3), strategy, buffer_size))
    pieces = [piece for row in rows for piece in check_row(row, docs)]
    tokens = Counter((number, offset) for number, start, end in pieces for offset in range(start, end))
    assert tokens == Counter((n, o) for n, length in enumerate(LENGTHS, start=1) for o in range(length))
    assert any(start > 0 for _, start, _ in pieces), "a split document's later pieces are checked"
    dtypes = {row["loss_mask"].dtype for row in rows} | {row["token_type_ids"].dtype for row in rows}
    assert dtypes == ({np.dtype(np.int8), np.dtype(np.int32)} if kind == "list" else {np.dtype(np.int64)})


@pytest.mark.parametrize(("strategy", "buffer_size"), STRATEGIES)
def test_resume_with_payloads_at_every_point_and_across_epochs(strategy: str, buffer_size: int | None) -> None:
    kind = INDEXED_KINDS[STRATEGIES.index((strategy, buffer_size)) % len(INDEXED_KINDS)]

    def build() -> rs.Node[Any]:
        return pack(source(kind).shuffle(5), strategy, buffer_size).map(plain)

    per_epoch = len(list(build()))
    total = 2 * per_epoch + 2
    for k in (0, per_epoch // 2, per_epoch - 1, per_epoch, per_epoch + 1):
        check_resume(build, k, total)
    check_resume(build, 1, total, k2=per_epoch + 2)


@pytest.mark.parametrize(("strategy", "buffer_size"), [("best_fit", 3), ("bfd", None)])
def test_rescale_with_payloads_carries_every_piece_once_with_its_payload(
    strategy: str, buffer_size: int | None
) -> None:
    docs = records()

    def build(consumer: int, consumers: int) -> rs.Node[Any]:
        return pack(source("jsonl").shuffle(7).shard(consumer, consumers), strategy, buffer_size)

    old = [build(consumer, 3) for consumer in range(3)]
    rows = [next(pipe) for pipe, steps in zip(old, [1, 3, 2]) for _ in range(steps)]
    states = [json.loads(json.dumps(pipe.get_state())) for pipe in old]
    for consumer in range(2):
        pipe = build(consumer, 2)
        restore(pipe, states)
        rows.extend(pipe)
    pieces = [piece for row in rows for piece in check_row(row, docs)]
    tokens = Counter((number, offset) for number, start, end in pieces for offset in range(start, end))
    assert tokens == Counter((n, o) for n, length in enumerate(LENGTHS, start=1) for o in range(length))


def image_cost(record: dict[str, Any]) -> int:
    return len(record["input_ids"]) + int(record["image_tokens"])


@pytest.mark.parametrize(("strategy", "buffer_size"), STRATEGIES)
@pytest.mark.parametrize("overlong", ["drop", "truncate"])
def test_length_fn_reserves_the_cost_inside_each_segment(strategy: str, buffer_size: int | None, overlong: str) -> None:
    docs = records()
    pipe = pack(source("list").shuffle(1), strategy, buffer_size, length_fn=image_cost, overlong=overlong)
    rows = list(pipe)
    pieces = [piece for row in rows for piece in check_row(row, docs, lambda doc: int(doc["image_tokens"]))]
    assert all(start == 0 for _, start, _ in pieces), "a document with a cost is never split"
    expected = {}
    for number, doc in enumerate(docs, start=1):
        length, cost = len(doc["input_ids"]), image_cost(doc)
        keep = length if cost <= SEQ_LEN else (SEQ_LEN - doc["image_tokens"] if overlong == "truncate" else 0)
        if length and keep > 0:
            expected[number] = keep
    assert {number: end for number, _, end in pieces} == expected
    stats = pipe.stats
    costs = sum(expected[number] + docs[number - 1]["image_tokens"] for number in expected)
    assert stats.tokens == costs, "reserved positions are not padding"
    assert stats.dropped == sum(
        1 for number, doc in enumerate(docs, start=1) if doc["input_ids"] and number not in expected
    )
    assert stats.documents == len(expected)


def test_length_fn_resumes_exactly() -> None:
    def build() -> rs.Node[Any]:
        pipe = pack(source("parquet").shuffle(2), "best_fit", 3, length_fn=image_cost, overlong="truncate")
        return pipe.map(plain)

    check_resume(build, 4, 12, k2=8)


def test_len_of_a_whole_epoch_plan_counts_its_rows_in_every_epoch_and_after_a_rescale() -> None:
    def build(consumer: int = 0, consumers: int = 1) -> rs.Node[Any]:
        return pack(source("list").shuffle(4).shard(consumer, consumers), "bfd", None)

    pipe = build()
    for _epoch in range(2):
        length = len(pipe)
        rows = take(pipe, 3)
        assert len(pipe) == length, "the whole epoch, not what remains"
        assert length == len(rows) + len(list(pipe))
        iter(pipe)  # the next epoch, in a new order
    old = [build(consumer, 3) for consumer in range(3)]
    for pipe, steps in zip(old, [2, 0, 1]):
        take(pipe, steps)
    states = [pipe.get_state() for pipe in old]
    for consumer in range(2):
        pipe = build(consumer, 2)
        restore(pipe, states)
        assert len(pipe) == len(list(pipe)) > 0
    with pytest.raises(TypeError, match="Pack"):
        len(pack(source("list"), "best_fit", 3))


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"loss_mask": [1, 0]}, r"record \(epoch 0, record \d+\) has 2 'loss_mask' for 3 'input_ids'"),
        ({"loss_mask": [[1], [0], [1]]}, "token field 'loss_mask' must be a 1-d"),
        ({"token_type_ids": ["a", "b", "c"]}, "token field 'token_type_ids' must be a 1-d"),
        ({"token_type_ids": None}, "token field 'token_type_ids' must be a 1-d"),
    ],
)
def test_corrupt_token_fields_are_source_errors(change: dict[str, Any], match: str) -> None:
    docs = [{**doc, **change} if doc["input_ids"] and len(doc["input_ids"]) == 3 else doc for doc in records()]
    with pytest.raises(rs.SourceError, match=match):
        list(rs.from_list(docs).pack(SEQ_LEN, **PAYLOADS))


@pytest.mark.parametrize("missing", ["loss_mask", "path"])
def test_a_missing_payload_field_is_a_source_error(missing: str) -> None:
    docs = records()
    del docs[4][missing]
    with pytest.raises(rs.SourceError, match=rf"record \(epoch 0, record 4\) has no '{missing}' field"):
        list(rs.from_list(docs).pack(SEQ_LEN, strategy="bfd", **PAYLOADS))


@pytest.mark.parametrize("cost", [2.0, -1, True, "5", None, 1])
def test_a_bad_length_fn_result_is_a_source_error_naming_the_record(cost: Any) -> None:
    docs = records([3, 4])
    pipe = rs.from_list(docs).pack(SEQ_LEN, length_fn=lambda record: cost, overlong="drop")
    with pytest.raises(rs.SourceError, match=r"length_fn gave .* for record \(epoch 0, record 0\) of 3 tokens"):
        list(pipe)


@pytest.mark.parametrize("strategy", ["greedy", "bfd"])
def test_a_failing_length_fn_is_a_source_error_naming_the_record(strategy: str) -> None:
    def cost(record: dict[str, Any]) -> int:
        length = len(record["input_ids"])
        return length + 0 * (1 // (length - 4))  # fails on the record of 4 tokens

    pipe = rs.from_list(records([3, 4])).pack(SEQ_LEN, strategy=strategy, length_fn=cost, overlong="drop")
    with pytest.raises(rs.SourceError, match=r"length_fn failed on record \(epoch 0, record 1\): ZeroDivisionError"):
        list(pipe)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"token_fields": "loss_mask"}, "token_fields must be a list of field names"),
        ({"token_fields": ["labels"]}, "already a field of the rows"),
        ({"token_fields": ["mask"], "document_fields": ["mask"]}, "already a field of the rows"),
        ({"document_fields": [3]}, "must hold field names"),
        ({"token_fields": {"mask": float("nan")}}, "pads with nan"),
        ({"token_fields": {"mask": "0"}}, "pads with '0'"),
        ({"length_fn": image_cost}, "overlong='drop' or overlong='truncate'"),
        ({"length_fn": 3, "overlong": "drop"}, "length_fn must be callable"),
    ],
)
def test_bad_payload_options_are_config_errors(options: dict[str, Any], match: str) -> None:
    with pytest.raises(rs.ConfigError, match=match):
        rs.from_list(records()).pack(SEQ_LEN, **options)


def test_a_state_with_payload_options_needs_them_and_holds_no_payload() -> None:
    pipe = pack(source("list").shuffle(0), "best_fit", 3, length_fn=image_cost, overlong="drop")
    take(pipe, 2)
    state = json.loads(json.dumps(pipe.get_state()))
    text = json.dumps(state)
    assert "images/" not in text and expand_references(state)["open"], "references, never payloads"
    assert state["token_fields"] == PAYLOADS["token_fields"] and state["length_fn"] is True
    without = rs.from_list(records(numpy=True)).shuffle(0).pack(SEQ_LEN, buffer_size=3, overlong="drop", **PAYLOADS)
    with pytest.raises(rs.StateError, match="state was saved with length_fn=True, this pipeline has none"):
        without.set_state(state)


def test_collate_keeps_document_fields_as_lists_and_flattens_their_offsets() -> None:
    rows = list(pack(source("list"), "greedy", None))[:3]
    batch = collate_rows(rows)
    assert batch["loss_mask"].shape == (3, SEQ_LEN) and batch["loss_mask"].dtype == np.int8
    assert batch["path"] == [row["path"] for row in rows]
    flat = collate_rows(rows, flatten=True, as_torch=True)
    assert tuple(flat["token_type_ids"].shape) == (1, 3 * SEQ_LEN)
    assert flat["path"] == [(at + r * SEQ_LEN, value) for r, row in enumerate(rows) for at, value in row["path"]]
    starts = flat["cu_seqlens"][: int(flat["cu_seqlens_count"]) - 1].tolist()
    assert [at for at, _ in flat["path"]] == [s for s in starts if flat["document_ids"][0, s] > 0]


def test_the_multimodal_example_of_the_docs_runs() -> None:
    text = (Path(__file__).parents[1] / "docs" / "packing.md").read_text()
    section = text[text.index("## Multimodal and SFT payloads") :]
    code = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert code is not None
    namespace: dict[str, Any] = {}
    exec(compile(code.group(1), "docs/packing.md", "exec"), namespace)
    batch = namespace["batch"]
    assert batch["input_ids"].shape == batch["loss_mask"].shape == (2, namespace["SEQ_LEN"])
    assert all(isinstance(images, list) for images in batch["pixel_values"])
    expanded, documents = namespace["expanded"], len(batch["pixel_values"][0])
    assert expanded.shape == (namespace["SEQ_LEN"],)
    assert int((expanded == namespace["IMAGE_TOKEN"]).sum()) == documents * namespace["IMAGE_TOKENS"]
    assert (expanded[batch["document_ids"][0] == 0] == 0).all(), "the expansion stays inside the segments"
