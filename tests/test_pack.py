"""The Pack node: output format, overlong policies and their counters, collate, epochs, and
typed errors for bad options, bad records and bad states."""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import resumable as rs
from resumable.pack import IGNORE_INDEX, Pack, collate_rows, expand_references
from tests.resume import take

STRIDE = 100_000  # token = document * STRIDE + offset: every token says where it came from
STRATEGIES = [("greedy", 4), ("first_fit", 3), ("best_fit", 3), ("bfd", 3), ("bfd", None)]


def document(number: int, length: int, labels: bool = False) -> dict[str, Any]:
    tokens = number * STRIDE + np.arange(length, dtype=np.int64)
    record: dict[str, Any] = {"input_ids": tokens.tolist(), "id": number}
    if labels:
        record["labels"] = (tokens + 7).tolist()
    return record


def corpus(lengths: list[int], labels: bool = False) -> list[dict[str, Any]]:
    return [document(number + 1, length, labels) for number, length in enumerate(lengths)]


def packed(
    lengths: list[int], seq_len: int, strategy: str, buffer_size: int | None, labels: bool = False, **options: Any
) -> tuple[Pack, list[dict[str, np.ndarray]]]:
    source = rs.from_list(corpus(lengths, labels)).shuffle(5)
    pack = source.pack(seq_len, strategy=strategy, buffer_size=buffer_size, **options)
    return pack, list(pack)


def segments(row: dict[str, np.ndarray]) -> list[tuple[int, int, int]]:
    """``(document, first offset, length)`` of every segment of a row, from its tokens."""
    found = []
    for number in range(1, int(row["document_ids"].max(initial=0)) + 1):
        tokens = row["input_ids"][row["document_ids"] == number]
        document_number, offsets = np.divmod(tokens, STRIDE)
        assert len(set(document_number.tolist())) == 1, "a segment mixes documents"
        assert np.array_equal(offsets, offsets[0] + np.arange(len(offsets))), "a segment is not contiguous"
        found.append((int(document_number[0]), int(offsets[0]), len(tokens)))
    return found


def check_row_format(
    row: dict[str, np.ndarray], seq_len: int, cu_len: int, options: dict[str, Any], labelled: bool
) -> None:
    assert set(row) == {"input_ids", "labels", "position_ids", "document_ids", "cu_seqlens", "cu_seqlens_count"}
    for field in ("input_ids", "labels", "position_ids", "document_ids"):
        assert row[field].shape == (seq_len,)
    assert row["input_ids"].dtype == row["labels"].dtype == row["position_ids"].dtype == np.int64
    assert row["document_ids"].dtype == row["cu_seqlens"].dtype == np.int32
    assert row["cu_seqlens"].shape == (cu_len,) and row["cu_seqlens_count"].shape == ()

    document_ids = row["document_ids"]
    used = int(np.count_nonzero(document_ids))
    assert used > 0 and np.all(document_ids[used:] == 0) and np.all(document_ids[:used] > 0), "padding at the end"
    assert np.all(np.diff(document_ids[:used]) >= 0) and np.all(np.diff(document_ids[:used]) <= 1)
    assert document_ids[0] == 1, "document ids are 1-based"
    padding = seq_len - used
    assert np.all(row["labels"][used:] == IGNORE_INDEX)
    assert np.all(row["input_ids"][used:] == options.get("pad_token_id", 0))
    assert np.array_equal(row["position_ids"][used:], np.arange(padding))

    pieces = segments(row)
    bounds = np.cumsum([0] + [length for _, _, length in pieces] + ([padding] if padding else []))
    count = int(row["cu_seqlens_count"])
    assert count == len(bounds)
    assert np.array_equal(row["cu_seqlens"][:count], bounds)
    assert np.all(row["cu_seqlens"][count:] == seq_len)
    if options.get("max_documents") is not None:
        assert len(pieces) <= options["max_documents"]

    continue_positions = options.get("split_positions") == "continue"
    for (_, offset, length), start in zip(pieces, bounds):
        expected = np.arange(length) + (offset if continue_positions else 0)
        assert np.array_equal(row["position_ids"][start : start + length], expected)
        tokens = row["input_ids"][start : start + length]
        labels = row["labels"][start : start + length]
        expected_labels = tokens + 7 if labelled else tokens
        if options.get("mask_first_token"):
            assert labels[0] == IGNORE_INDEX
            assert np.array_equal(labels[1:], expected_labels[1:])
        else:
            assert np.array_equal(labels, expected_labels)


LENGTHS = st.lists(st.one_of(st.sampled_from([0, 1, 7, 8, 9, 24, 26]), st.integers(0, 30)), max_size=25)


@given(
    lengths=LENGTHS,
    strategy=st.sampled_from(STRATEGIES),
    overlong=st.sampled_from(["split", "truncate", "drop"]),
    split_positions=st.sampled_from(["restart", "continue"]),
    mask_first_token=st.booleans(),
    max_documents=st.sampled_from([None, 1, 2, 3]),
    labelled=st.booleans(),
    pad_token_id=st.sampled_from([0, -1]),
)
def test_rows_are_well_formed_and_reproduce_the_documents(
    lengths: list[int],
    strategy: tuple[str, int | None],
    overlong: str,
    split_positions: str,
    mask_first_token: bool,
    max_documents: int | None,
    labelled: bool,
    pad_token_id: int,
) -> None:
    seq_len = 8
    options = {
        "overlong": overlong,
        "split_positions": split_positions,
        "mask_first_token": mask_first_token,
        "max_documents": max_documents,
        "pad_token_id": pad_token_id,
    }
    pack, rows = packed(lengths, seq_len, *strategy, labels=labelled, **options)
    cu_len = seq_len + 1 if max_documents is None else min(max_documents + 2, seq_len + 1)
    pieces: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for row in rows:
        check_row_format(row, seq_len, cu_len, options, labelled)
        for number, offset, length in segments(row):
            pieces[number].append((offset, length))

    # Concatenating each document's pieces in offset order gives back exactly what the policy keeps.
    for number, length in enumerate(lengths, start=1):
        kept = length if length <= seq_len or overlong == "split" else (seq_len if overlong == "truncate" else 0)
        offsets = sorted(pieces.pop(number, []))
        assert [offset for offset, _ in offsets] == list(np.cumsum([0] + [n for _, n in offsets])[:-1])
        assert sum(n for _, n in offsets) == kept
        if overlong == "split" and length > seq_len:
            assert len(offsets) > 1
    assert not pieces, "tokens from nowhere"

    stats = pack.stats
    assert stats.rows == len(rows)
    assert stats.tokens == sum(int(np.count_nonzero(row["document_ids"])) for row in rows)
    assert stats.padding == stats.rows * seq_len - stats.tokens
    if rows:
        assert stats.efficiency == pytest.approx(stats.tokens / (len(rows) * seq_len))


@pytest.mark.parametrize("strategy, buffer_size", STRATEGIES)
@pytest.mark.parametrize(
    "overlong, expected",
    [
        # lengths 0, 1, seq_len, seq_len + 1, 3 * seq_len, 3 * seq_len + 2 with seq_len = 8
        ("split", dict(documents=5, split=3, truncated=0, dropped=0, empty=1, tokens=1 + 8 + 9 + 24 + 26)),
        ("truncate", dict(documents=5, split=0, truncated=3, dropped=0, empty=1, tokens=1 + 8 + 8 + 8 + 8)),
        ("drop", dict(documents=2, split=0, truncated=0, dropped=3, empty=1, tokens=1 + 8)),
    ],
)
def test_overlong_policies_and_their_counters(
    strategy: str, buffer_size: int | None, overlong: str, expected: dict[str, int]
) -> None:
    pack, rows = packed([0, 1, 8, 9, 24, 26], 8, strategy, buffer_size, overlong=overlong)
    stats = pack.stats
    counted = {name: getattr(stats, name) for name in expected}
    assert counted == expected
    assert stats.rows == len(rows)
    assert stats.padding == len(rows) * 8 - expected["tokens"]
    full_rows = [row for row in rows if np.count_nonzero(row["document_ids"]) == 8 and row["document_ids"].max() == 1]
    minimum_full = {"split": 1 + 1 + 3 + 3, "truncate": 4, "drop": 1}[overlong]
    assert len(full_rows) >= minimum_full


def test_split_tail_positions_restart_or_continue() -> None:
    for mode, expected in (("restart", [0, 1, 2]), ("continue", [16, 17, 18])):
        _, rows = packed([19], 8, "greedy", None, split_positions=mode)
        assert [row["position_ids"][:3].tolist() for row in rows][-1] == expected
        assert rows[1]["position_ids"][0] == (8 if mode == "continue" else 0)


def test_stats_efficiency_before_any_row_and_per_epoch() -> None:
    pack = rs.from_list(corpus([3, 5])).pack(8, strategy="greedy")
    assert pack.stats.efficiency == 0.0 and pack.stats.rows == 0
    assert len(list(pack)) == 1 and pack.stats.efficiency == 1.0
    assert len(list(pack)) == 1 and pack.stats.rows == 1, "counters are per epoch"


def test_pack_before_and_after_repeat() -> None:
    """Before repeat every epoch flushes its own rows; after repeat the stream never ends and
    documents of consecutive epochs share rows."""
    docs = corpus([4, 4, 4])
    per_epoch = list(rs.from_list(docs).shuffle(1).pack(8, strategy="greedy").repeat(2))
    assert [int(np.count_nonzero(row["document_ids"])) for row in per_epoch] == [8, 4, 8, 4]
    endless = take(rs.from_list(docs).shuffle(1).repeat().pack(8, strategy="greedy"), 3)
    assert [int(np.count_nonzero(row["document_ids"])) for row in endless] == [8, 8, 8]
    assert sorted(number for row in endless for number, _, _ in segments(row)) == [1, 1, 2, 2, 3, 3]


def test_bfd_over_the_epoch_packs_optimally_here_and_keeps_a_shuffled_row_order() -> None:
    lengths = [9, 9, 9, 9, 7, 7, 7, 7]
    pack, rows = packed(lengths, 16, "bfd", None)
    assert len(rows) == 4 and pack.stats.efficiency == 1.0


def test_pipeline_with_batch_and_collate() -> None:
    pipe = rs.from_list(corpus([3, 4, 5, 6, 7, 2])).shuffle(0).pack(8, strategy="best_fit", buffer_size=4)
    batches = list(pipe.batch(2, collate_fn=Pack.collate))
    assert batches and all(batch["input_ids"].shape == (2, 8) for batch in batches[:-1])
    assert batches[0]["cu_seqlens"].shape == (2, 9) and batches[0]["cu_seqlens_count"].shape == (2,)


def test_collate_rows_to_torch_and_flattened() -> None:
    torch = pytest.importorskip("torch")
    _, rows = packed([3, 4, 5, 6, 7, 2, 8], 8, "first_fit", 3, max_documents=3)
    batch = collate_rows(rows[:3], as_torch=True)
    assert batch["input_ids"].dtype == torch.int64 and batch["input_ids"].shape == (3, 8)
    assert batch["cu_seqlens"].dtype == torch.int32 and batch["cu_seqlens"].shape == (3, 5)

    flat = collate_rows(rows[:3], flatten=True)
    assert flat["input_ids"].shape == (1, 24) and flat["cu_seqlens"].shape == (3 * 4 + 1,)
    count = int(flat["cu_seqlens_count"])
    boundaries = [0]
    for index, row in enumerate(rows[:3]):
        row_count = int(row["cu_seqlens_count"])
        boundaries += (row["cu_seqlens"][1:row_count] + index * 8).tolist()
    assert flat["cu_seqlens"][:count].tolist() == boundaries
    assert np.all(flat["cu_seqlens"][count:] == 24)
    numbered = flat["document_ids"][0][flat["document_ids"][0] > 0]
    assert np.array_equal(np.unique(numbered), np.arange(1, numbered.max() + 1)), "document ids across the batch"
    assert np.all(np.diff(numbered) >= 0)
    with pytest.raises(ValueError):
        collate_rows([])


def test_input_arrays_and_field_names() -> None:
    """numpy arrays of any integer dtype, other field names, labels_field=None."""
    docs = [{"tokens": np.arange(1, 6, dtype=np.uint16), "target": np.arange(5, dtype=np.int32)}]
    (row,) = list(rs.from_list(docs).pack(8, input_field="tokens", labels_field="target"))
    assert row["input_ids"][:5].tolist() == [1, 2, 3, 4, 5] and row["labels"][:5].tolist() == [0, 1, 2, 3, 4]
    (row,) = list(rs.from_list(docs).pack(8, input_field="tokens", labels_field=None))
    assert row["labels"][:5].tolist() == [1, 2, 3, 4, 5]


def test_pending_keys_name_exactly_the_buffered_records() -> None:
    pipe = rs.from_list(corpus([3, 4, 5, 6, 20, 2, 3])).shuffle(2).pack(8, strategy="first_fit", buffer_size=3)
    for _ in range(2):
        next(pipe)
    state = expand_references(pipe.get_state())
    refs = state["open"] + state["ready"]
    refs += [state["span"]] if state["span"] else []
    assert sorted(pipe.pending_keys()) == sorted({(epoch, position) for epoch, position, _, _ in refs})
    assert pipe.pending_keys()


# -- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(seq_len=0), "seq_len must be a positive int"),
        (dict(seq_len=-3), "seq_len must be a positive int"),
        (dict(seq_len=True), "seq_len must be a positive int"),
        (dict(seq_len=8.0), "seq_len must be a positive int"),
        (dict(buffer_size=0), "buffer_size must be a positive int"),
        (dict(buffer_size=-1), "buffer_size must be a positive int"),
        (dict(strategy="worst_fit"), "unknown strategy 'worst_fit'"),
        (dict(overlong="wrap"), "unknown overlong 'wrap'"),
        (dict(split_positions="keep"), "unknown split_positions"),
        (dict(max_documents=0), "max_documents must be a positive int"),
        (dict(mask_first_token=1), "mask_first_token must be a bool"),
        (dict(input_field=3), "input_field must be a str"),
        (dict(labels_field=3), "labels_field must be a str or None"),
        (dict(pad_token_id=None), "pad_token_id must be an int"),
    ],
)
def test_bad_options_raise_at_construction(options: dict[str, Any], message: str) -> None:
    options = {"seq_len": 8, **options}
    seq_len = options.pop("seq_len")
    with pytest.raises(rs.ConfigError, match=message):
        rs.from_list(corpus([3])).pack(seq_len, **options)
    with pytest.raises(rs.ConfigError, match=message):
        Pack(rs.from_list(corpus([3])), seq_len, **options)


def test_whole_epoch_bfd_needs_an_indexed_upstream() -> None:
    with pytest.raises(rs.ConfigError, match="give buffer_size=N"):
        rs.from_list(corpus([3])).filter(lambda record: True).pack(8, strategy="bfd")
    rs.from_list(corpus([3])).filter(lambda record: True).pack(8, strategy="bfd", buffer_size=10)


class Untraceable(rs.Node):
    """A custom node that does not implement the provenance protocol."""

    _reads_upstream = False

    def __init__(self, records: list[dict[str, Any]]) -> None:
        super().__init__(None)
        self._records = iter(records)

    def _next(self) -> dict[str, Any]:
        return next(self._records)


def test_an_untraceable_upstream_is_a_clear_error_at_construction() -> None:
    with pytest.raises(rs.ConfigError, match="needs|cannot trace"):
        Untraceable(corpus([3, 4])).pack(8)
    with pytest.raises(rs.ConfigError, match="cannot trace"):
        rs.from_list(corpus([3, 4])).batch(2).map(lambda batch: batch[0]).pack(8)


class KeyLess(Untraceable):
    """A custom node that claims provenance but has none to give."""

    def last_key(self) -> None:
        return None


def test_an_upstream_without_keys_is_a_clear_error_at_the_first_document() -> None:
    pack = KeyLess(corpus([3, 4])).pack(8)
    with pytest.raises(rs.ConfigError, match="cannot trace"):
        next(pack)


@pytest.mark.parametrize(
    "record, message",
    [
        ({"text": "hello"}, r"has no 'input_ids' field \(it has 'text'\)"),
        ({"input_ids": [1.5, 2.0]}, "integer ids"),
        ({"input_ids": [[1, 2], [3, 4]]}, "1-d sequence"),
        ({"input_ids": ["a", "b"]}, "integer ids"),
        ({"input_ids": [1, 2], "labels": [1]}, "has 1 'labels' for 2 'input_ids'"),
        ([1, 2, 3], "is a list, expected a mapping"),
        ({"input_ids": [2**63, 2**63 + 1]}, "above the int64 rows can hold"),
        ({"input_ids": np.array([5, 2**64 - 1], dtype=np.uint64)}, "above the int64 rows can hold"),
        ({"input_ids": [1], "labels": [2**63]}, "'labels' holds id"),
        ({"input_ids": [2**64]}, "integer ids"),
    ],
)
def test_bad_records_name_their_key(record: Any, message: str) -> None:
    records = [{"input_ids": [1, 2]}] * 3 + [record]
    for strategy, buffer_size in STRATEGIES:
        pack = rs.from_list(records).pack(8, strategy=strategy, buffer_size=buffer_size)
        with pytest.raises(rs.SourceError, match=message) as error:
            list(pack)
        assert "(epoch 0, record 3)" in str(error.value)


# -- bad states --------------------------------------------------------------------------------


STATE_CORPUS = corpus([3, 4, 5, 6, 20, 2, 3, 1, 7])


def build_first_fit() -> Pack:
    return rs.from_list(STATE_CORPUS).shuffle(5).pack(8, strategy="first_fit", buffer_size=3)


def long_record() -> int:
    """The record index of the 20-token document (pieces name records by their source index)."""
    return next(i for i, document in enumerate(STATE_CORPUS) if len(document["input_ids"]) == 20)


def midway_state() -> dict[str, Any]:
    pipe = build_first_fit()
    take(pipe, 2)
    state = expand_references(pipe.get_state())  # the list form, which states had before, still loads
    assert state["open"], "the scenario needs open rows"
    return state


def corrupt(change: Any) -> dict[str, Any]:
    state = json.loads(json.dumps(midway_state()))
    change(state)
    return state


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda s: s.update(strategy="best_fit"), "strategy"),
        (lambda s: s.update(seq_len=16), "seq_len"),
        (lambda s: s.update(buffer_size=4), "buffer_size"),
        (lambda s: s.pop("open"), "no 'open' entry"),
        (lambda s: s.update(open={"a": 1}), "'open'"),
        (lambda s: s.pop("open_sizes"), "no 'open_sizes' entry"),
        (lambda s: s["open_sizes"].append(1), "'open_sizes' counts"),
        (lambda s: s["open_sizes"].__setitem__(0, -1), "expected counts >= 0"),
        (lambda s: s["open"].__setitem__(0, 5), r"\[epoch, record, token_start, token_end\]"),
        (lambda s: s["open"].__setitem__(0, [0, 1, 2]), r"\[epoch, record, token_start, token_end\]"),
        (lambda s: s["open"].__setitem__(0, [0, -1, 0, 2]), r"\[epoch, record, token_start, token_end\]"),
        (lambda s: s["open"].__setitem__(0, [0, 1, 0, True]), r"\[epoch, record, token_start, token_end\]"),
        (lambda s: s["open"].__setitem__(0, [0, 1, 2, 2]), "empty token range"),
        (lambda s: s["open"].__setitem__(0, [0, 999, 0, 1]), "names no record: record index 999 out of range"),
        (lambda s: s.update(open=[[0, long_record(), 0, 20]], open_sizes=[1]), "longer than seq_len"),
        (lambda s: s.update(open=[[0, i, 0, 1] for i in range(4)], open_sizes=[1] * 4), "more than buffer_size"),
        (lambda s: s.update(ready=[], ready_sizes=[0]), "does not fit"),
        (lambda s: s.update(span=[0, 4, 0, 5]), "whole number of rows"),
        (lambda s: s.update(exhausted="no"), "'exhausted'"),
        (lambda s: s["stats"].update(rows=-1), "'rows'"),
        (lambda s: s.pop("stats"), "no 'stats' entry"),
    ],
)
def test_bad_states_raise_state_errors_and_leave_the_node_as_it_was(change: Any, message: str) -> None:
    pipe = build_first_fit()
    head = take(pipe, 3)
    before = pipe.get_state()
    with pytest.raises(rs.StateError, match=message) as error:
        pipe.set_state(corrupt(change))
    assert str(error.value).startswith("Pack")
    assert pipe.get_state() == before
    rest = [row["input_ids"].tolist() for row in take(pipe, 100)]
    expected = [row["input_ids"].tolist() for row in take(build_first_fit(), 103)][3:]
    assert len(head) == 3 and rest == expected


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda s: s["open"].__setitem__(0, [0, 1, 0, 7]), "outside record"),
    ],
)
def test_a_piece_its_record_cannot_give_is_a_state_error_when_its_row_is_due(change: Any, message: str) -> None:
    """A restore fetches a record only when its row is handed out, so a reference the record
    cannot give is found then: a StateError naming the packer, and the packer is left as it
    was (the same error again on the next call, no row lost)."""
    pipe = build_first_fit()
    pipe.set_state(corrupt(change))
    with pytest.raises(rs.StateError, match=message) as error:
        take(pipe, len(STATE_CORPUS))
    assert str(error.value).startswith("Pack")
    before = pipe.get_state()
    with pytest.raises(rs.StateError, match=message):
        next(pipe)
    assert pipe.get_state() == before


def test_a_whole_epoch_plan_rejects_more_rows_than_it_has() -> None:
    def build() -> Pack:
        return rs.from_list(corpus([3, 4, 5])).pack(8, strategy="bfd")

    pipe = build()
    state = pipe.get_state()
    state["emitted"] = 50
    with pytest.raises(rs.StateError, match="50 rows handed out"):
        build().set_state(state)


# -- compact references ----------------------------------------------------------------------


def test_compact_references_round_trip_exactly() -> None:
    """Origins (mix paths), epochs, records up to int64, split starts and whole rows' lengths."""
    from resumable.pack._refs import RefTable, decode

    refs = [
        [0, 5, 0, 7],
        ["web", 3, 2**62, 4096, 4100],
        ["web", "code", 0, 0, 0, 2048 * 40],
        [1, 17, 2048, 2049],
        [0, 5, 0, 7],
    ]
    table = RefTable(capacity=2)  # grows
    slots = np.array([table.add(tuple(ref[:-2]), ref[-2], ref[-1]) for ref in refs])
    encoded = json.loads(json.dumps(table.encode(slots)))
    assert decode(encoded, "Pack", "refs") == refs
    assert decode(table.encode(slots[::-1]), "Pack", "refs") == refs[::-1]
    assert decode(table.encode(slots[:0]), "Pack", "refs") == []
    assert decode(RefTable().encode(slots[:0]), "Pack", "refs") == []


def test_a_reference_table_packs_each_piece_once_and_refits_when_one_does_not_fit() -> None:
    """Pieces packed when they arrive under the table's layout; one outside it (a record below
    the base, a new epoch, a start that the scale does not divide) makes the next encoding the
    smallest layout that holds every piece held, and pieces let go no longer count."""
    from resumable.pack._refs import RefTable, decode

    table = RefTable()
    held = {table.add((0, record), 0, 100 + record): [0, record, 0, 100 + record] for record in (40, 50, 60)}

    def encoded() -> dict[str, Any]:
        slots = np.array(list(held))
        encoding = table.encode(slots)
        assert decode(encoding, "Pack", "refs") == list(held.values())
        return encoding

    assert encoded()["base"] == [0, 0, 40, 0, 140] and encoded()["bits"] == [0, 0, 5, 0, 5]
    held[table.add((0, 45), 0, 150)] = [0, 45, 0, 150]  # fits: packed as it arrives
    assert encoded()["base"] == [0, 0, 40, 0, 140]
    for ref in ([1, 7, 0, 3], [0, 55, 2048 * 3, 2048 * 3 + 9], [0, 41, 2048, 2049]):
        held[table.add(tuple(ref[:2]), ref[2], ref[3])] = ref
        encoded()
    assert encoded()["base"] == [0, 0, 7, 0, 1] and encoded()["scale"] == [1, 1, 1, 2048, 1]
    held[table.add((0, 42), 5, 6)] = [0, 42, 5, 6]  # a start 2048 does not divide
    assert encoded()["scale"] == [1, 1, 1, 1, 1]
    for slot in [slot for slot, ref in held.items() if ref[1] < 41 or ref[2]]:
        table.release(slot)
        del held[slot]
    held[table.add((0, 3), 0, 7)] = [0, 3, 0, 7]  # below the base: the held pieces alone set the layout
    assert encoded()["base"] == [0, 0, 3, 0, 7] and encoded()["scale"] == [1, 1, 1, 1, 1]


def test_a_restored_packer_saves_the_state_it_was_given_and_then_what_the_original_saves() -> None:
    """The restored table adopts the saved layout, so states match byte for byte as both go on."""
    pipe = build_first_fit()
    take(pipe, 3)
    resumed = build_first_fit()
    resumed.set_state(json.loads(json.dumps(pipe.get_state())))
    assert resumed.get_state() == pipe.get_state()
    for row, expected in zip(resumed, pipe, strict=True):
        assert row["input_ids"].tolist() == expected["input_ids"].tolist()
        assert resumed.get_state() == pipe.get_state()


def compact_state() -> dict[str, Any]:
    pipe = build_first_fit()
    take(pipe, 2)
    state = json.loads(json.dumps(pipe.get_state()))
    assert state["refs"]["count"] > 1, "the scenario needs pieces held"
    return state


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda s: s.update(refs=[1, 2]), "not an encoding"),
        (lambda s: s["refs"].update(data="not base64!"), "not base64"),
        (lambda s: s["refs"].update(data=s["refs"]["data"][:-4]), "not .* references"),
        (lambda s: s["refs"].update(count=s["refs"]["count"] + 1), "not .* references"),
        (lambda s: s["refs"].update(bits=[65, 0, 0, 0, 0]), "base, scale and bits"),
        (lambda s: s["refs"].update(base=[0, 0, -1, 0, 0]), "base, scale and bits"),
        (lambda s: s["refs"].update(origins=[]), "unknown origin"),
        (lambda s: s["refs"]["base"].__setitem__(2, 2**63 - 2), "above"),
        (lambda s: s["sections"].__setitem__(0, s["sections"][0] + 1), "'sections' counts"),
        (lambda s: s.update(sections=[0, 0, 2, 0]), "expected 4 counts"),
        (lambda s: s["refs"]["base"].__setitem__(2, 999), "out of range"),
    ],
)
def test_a_damaged_compact_state_is_a_state_error_and_changes_nothing(change: Any, message: str) -> None:
    pipe = build_first_fit()
    take(pipe, 3)
    before = pipe.get_state()
    state = compact_state()
    change(state)
    with pytest.raises(rs.StateError, match=message) as error:
        pipe.set_state(state)
    assert str(error.value).startswith("Pack")
    assert pipe.get_state() == before
