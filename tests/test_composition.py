"""The composition table: every ordered pair of nodes (upstream, downstream) a user can build
either works, or is refused at construction with a ``ConfigError`` that says what to do.

"Works" means two things, both checked here for every such pair on a small pipeline
``source -> ... -> upstream -> downstream`` (with a ``.shard()`` added where it can go without
coming between the two, so that the pipeline can be rescaled):

* exact resume: ``k`` items, ``get_state()``, a JSON round trip, ``set_state()`` on a freshly
  built pipeline, and the continuation equals the uninterrupted run, at the middle of the
  epoch, at its last item and after its end (into the next epoch; after ``.even()``, which runs
  its upstream's epochs itself, the epoch is an even-epoch, ended by its StopIteration, and the
  next one continues the upstream's stream);
* exactly-once rescale: consumers stopped at different points mid-epoch, their states given to
  ``resumable.elastic.restore`` on another number of consumers (2 -> 3 and 3 -> 1); what the
  old consumers delivered before saving plus what the new ones deliver to the end of the epoch
  is one epoch: the same multiset of documents (of tokens, after a packer).

A pipeline with no partitioner (``.shard()`` or a file-sharded ``rs.jsonl_stream``) cannot be
rescaled. Where no shard can go without coming between the pair (a source, a cache or an
indexed filter followed by a node that is not indexed: nothing goes before a source, a shard
before a cache or an indexed filter is refused, and after the pair is too late), the rescale
check is that ``restore`` refuses with a ``ConfigError`` naming the shard.

There is no third verdict: a pair that neither works nor is refused at construction is a bug.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

import resumable as rs
from resumable.elastic import restore
from tests.resume import roundtrip, take
from tests.sources import INDEXED_KINDS, STREAM_KINDS, indexed_source, stream_source

# -- the table --------------------------------------------------------------------------------

UPSTREAM = (
    "source",  # an indexed source: rs.from_list, rs.jsonl, rs.parquet, rs.arrow
    "stream",  # rs.jsonl_stream (file-sharded: its own partitioner)
    "map",  # serial .map(fn)
    "pmap",  # .map(fn, num_workers=2)
    "filter",
    "ifilter",  # .filter(pred, index=True)
    "batch",
    "prefetch",
    "cache",
    "shuffle",
    "block_shuffle",  # .shuffle(seed, block_size=4)
    "shard",
    "repeat",
    "pack",  # a streaming strategy with a buffer: .pack(seq_len, buffer_size=4) (best_fit)
    "pack_bfd",  # whole-epoch plan: .pack(seq_len, strategy="bfd") without buffer_size
    "mix",  # rs.mix({...}, weights): as a downstream node, of its component
    "even",  # .even()
)
DOWNSTREAM = UPSTREAM[2:]  # sources have no upstream


@dataclass(frozen=True)
class Cell:
    """What a pair does: ``works``, or ``refused`` with ``hint``, a substring of the ConfigError
    raised at construction."""

    verdict: str
    hint: str = ""

    @property
    def should_work(self) -> bool:
        return self.verdict == "works"


WORKS = Cell("works")


def refused(hint: str) -> Cell:
    return Cell("refused", hint=hint)


# Refusals, by the substring of their message that says what to do instead.
BEFORE_FILTER = "place it before filter, batch and pack"  # shuffle/shard after an iterator node
CACHE_INDEXED = "place .cache() before filter, batch and pack"
CACHE_ORDER = "place .cache() before shuffle and shard"
BFD_WINDOWS = "give buffer_size=N to pack windows of N documents instead"
UNTRACEABLE = "cannot trace its items back to indexed records"

STREAM_INDEXED = "read plain JSONL files with rs.jsonl"  # shuffle/shard/cache after a stream
SHARD_ONCE = "keep one .shard()"
REPEAT_ONCE = "use a single .repeat(n * m)"
INDEX_ORDER = "place .filter(index=True) before shuffle and shard"
EVEN_LENGTH = "balance an upstream of known length"
EVEN_LAST = "runs the upstream's epochs itself and goes last"  # .even() after a repeat or an even
EVEN_TIMES = "use .even(times=n) instead of .even().repeat(n)"

ITERATOR_ROW = {  # after a node that is not indexed
    "map": WORKS,
    "pmap": WORKS,
    "filter": WORKS,
    "ifilter": refused(BEFORE_FILTER),
    "batch": WORKS,
    "prefetch": WORKS,
    "cache": refused(CACHE_INDEXED),
    "shuffle": refused(BEFORE_FILTER),
    "block_shuffle": refused(BEFORE_FILTER),
    "shard": refused(BEFORE_FILTER),
    "repeat": WORKS,
    "pack": WORKS,
    "pack_bfd": refused(BFD_WINDOWS),
    "mix": WORKS,
    "even": WORKS,
}
INDEXED_ROW = dict.fromkeys(DOWNSTREAM, WORKS)  # after an indexed node

ORDERED_ROW = {**INDEXED_ROW, "cache": refused(CACHE_ORDER), "ifilter": refused(INDEX_ORDER)}  # after an order
UNKNOWN_LENGTH_ROW = {**ITERATOR_ROW, "even": refused(EVEN_LENGTH)}  # after a node of unknown len()
UNTRACEABLE_ROW = {**ITERATOR_ROW, **dict.fromkeys(("pack", "pack_bfd"), refused(UNTRACEABLE))}

ROWS: dict[str, dict[str, Cell]] = {
    "source": INDEXED_ROW,
    "stream": {
        **UNKNOWN_LENGTH_ROW,
        **dict.fromkeys(("cache", "shuffle", "block_shuffle", "shard"), refused(STREAM_INDEXED)),
    },
    "map": INDEXED_ROW,
    "pmap": ITERATOR_ROW,
    "filter": UNKNOWN_LENGTH_ROW,
    "ifilter": INDEXED_ROW,
    "batch": UNTRACEABLE_ROW,
    "prefetch": ITERATOR_ROW,
    "cache": INDEXED_ROW,
    "shuffle": ORDERED_ROW,
    "block_shuffle": ORDERED_ROW,
    "shard": {**ORDERED_ROW, "shard": refused(SHARD_ONCE)},
    "repeat": {**ITERATOR_ROW, "repeat": refused(REPEAT_ONCE), "even": refused(EVEN_LAST)},
    "pack": {**UNTRACEABLE_ROW, "even": refused(EVEN_LENGTH)},
    "pack_bfd": UNTRACEABLE_ROW,
    "mix": ITERATOR_ROW,
    "even": {**UNTRACEABLE_ROW, "repeat": refused(EVEN_TIMES), "even": refused(EVEN_LAST)},
}
TABLE: dict[tuple[str, str], Cell] = {(up, down): cell for up, row in ROWS.items() for down, cell in row.items()}


# -- data -------------------------------------------------------------------------------------

SEQ_LEN = 8
DOCS = [
    {"id": d, "input_ids": [d * 100 + t + 1 for t in range(length)]}
    for d, length in enumerate(np.random.default_rng(0).integers(1, 20, size=24).tolist())
]


def others(offset: int, count: int) -> list[dict[str, Any]]:
    """Documents of a second mix component: ids and tokens disjoint from DOCS'."""
    return [
        {"id": offset + d, "input_ids": [(offset + d) * 100 + t + 1 for t in range(d % 11 + 1)]} for d in range(count)
    ]


OTHERS_X = others(1000, 14)  # the second component of a mix upstream
OTHERS_Y = others(2000, 10)  # the second component of a mix downstream


def touch(item: Any) -> Any:
    """The map function: keeps what an item delivers, adds a field."""
    if isinstance(item, list):
        return [touch(x) for x in item]
    return {**item, "mapped": True}


def keep(item: Any) -> bool:
    """The filter predicate: drops every fifth document; keeps every batch and packed row (a
    rescale regroups those, so dropping any would drop other documents)."""
    return not isinstance(item, dict) or "id" not in item or item["id"] % 5 != 3


def delivered(item: Any) -> list[tuple[str, int]]:
    """What an item delivers: ``("d", id)`` per document, ``("t", token)`` per packed token."""
    if isinstance(item, list):
        return [unit for x in item for unit in delivered(x)]
    if "document_ids" in item:
        return [("t", int(t)) for t in item["input_ids"][item["document_ids"] > 0]]
    return [("d", int(item["id"]))]


def canonical(item: Any) -> Any:
    """A comparable form of an item (rows hold numpy arrays)."""
    if isinstance(item, np.ndarray):
        return ("array", str(item.dtype), item.tolist())
    if isinstance(item, dict):
        return tuple(sorted((key, canonical(value)) for key, value in item.items()))
    if isinstance(item, (list, tuple)):
        return tuple(canonical(x) for x in item)
    return item


# -- building a pair's pipeline ---------------------------------------------------------------

INDEXED_OUT = {"source", "map", "ifilter", "cache", "shuffle", "block_shuffle", "shard"}
"""Upstream kinds whose node is indexed (map: a serial map over an indexed chain)."""
KEEPS_INDEX = {"map", "ifilter", "cache", "shuffle", "block_shuffle"}
"""Downstream kinds that keep random access over an indexed upstream."""
SHARDABLE_BELOW = {
    "map",
    "pmap",
    "filter",
    "batch",
    "prefetch",
    "shuffle",
    "block_shuffle",
    "repeat",
    "pack",
    "pack_bfd",
    "even",
}
"""Upstream kinds that may read a sharded chain."""


def shard_after(up: str, down: str) -> bool:
    """A ``.shard()`` after the pair (both indexed, neither a shard)."""
    return up in INDEXED_OUT and down in KEEPS_INDEX and "shard" not in (up, down)


def shard_before(up: str, down: str) -> bool:
    """A ``.shard()`` in the chain that feeds the upstream node."""
    return not shard_after(up, down) and down != "shard" and up in SHARDABLE_BELOW


def partitioned(up: str, down: str) -> bool:
    """Whether the pair's pipeline has a partitioner, so it can be rescaled."""
    return up in ("stream", "mix", "shard") or down == "shard" or shard_after(up, down) or shard_before(up, down)


def apply(name: str, node: rs.Node, consumer: int, consumers: int) -> rs.Node:
    """``node`` followed by a node of kind ``name``."""
    if name == "map":
        return node.map(touch)
    if name == "pmap":
        return node.map(touch, num_workers=2)
    if name == "filter":
        return node.filter(keep)
    if name == "ifilter":
        return node.filter(keep, index=True, progress=False)
    if name == "batch":
        return node.batch(3)
    if name == "prefetch":
        return node.prefetch(2)
    if name == "cache":
        return node.cache()
    if name == "shuffle":
        return node.shuffle(11)
    if name == "block_shuffle":
        return node.shuffle(11, block_size=4)
    if name == "shard":
        return node.shard(consumer, consumers)
    if name == "repeat":
        return node.repeat(2)
    if name == "pack":
        return node.pack(SEQ_LEN, buffer_size=4)
    if name == "pack_bfd":
        return node.pack(SEQ_LEN, strategy="bfd")
    if name == "mix":
        component = rs.from_list(OTHERS_Y).shard(consumer, consumers)
        return rs.mix({"a": node, "b": component}, weights={"a": 2, "b": 1}, on_end="drop")
    if name == "even":
        # Ranks agree through torch.distributed only; in this one process no group is
        # initialised, so each consumer's epoch is its own offer (carry + len of its upstream's
        # epoch), which is what the resume and rescale checks need: both hold per consumer.
        return node.even()
    raise ValueError(name)


def build_upstream(up: str, down: str, consumer: int, consumers: int, kind: str = "list") -> rs.Node:
    """The chain ending in the pair's upstream node, for consumer ``consumer`` of ``consumers``."""
    if up == "stream":
        return stream_source(kind, DOCS, files=4, rank=consumer, world_size=consumers)
    source = indexed_source(kind, DOCS)
    if up == "source":
        return source
    if up == "mix":
        web = source.shuffle(5).shard(consumer, consumers)
        code = rs.from_list(OTHERS_X).shard(consumer, consumers)
        return rs.mix({"web": web, "code": code}, weights={"web": 3, "code": 2}, on_end="drop")
    if up == "shard" or shard_before(up, down):
        source = source.shuffle(5).shard(consumer, consumers)
        if up == "shard":
            return source
    return apply(up, source, consumer, consumers)


def build(up: str, down: str, consumer: int, consumers: int, kind: str = "list") -> rs.Node:
    pipe = apply(down, build_upstream(up, down, consumer, consumers, kind), consumer, consumers)
    return pipe.shard(consumer, consumers) if shard_after(up, down) else pipe


# -- the checks -------------------------------------------------------------------------------


def take_all(pipe: rs.Node, count: int) -> list[Any]:
    """The next ``count`` items, starting new epochs as a training loop does; none is empty."""
    items = take(pipe, count)
    assert len(items) == count, "an empty epoch"
    return items


def check_exact_resume(up: str, down: str, kind: str) -> None:
    def fresh() -> rs.Node:
        return build(up, down, 1, 2, kind)

    with fresh() as pipe:
        epoch = list(pipe)
        following = take_all(pipe, 5)
    assert epoch, "the pair's pipeline yields nothing: the test data is too small"
    expected = [canonical(item) for item in epoch + following]
    total = len(expected)
    for k in sorted({len(epoch) // 2, len(epoch)}):
        with fresh() as pipe:
            head = take_all(pipe, k)
            state = roundtrip(pipe.get_state())
        with fresh() as resumed:
            resumed.set_state(state)
            rest = take_all(resumed, total - k)
        assert [canonical(item) for item in head + rest] == expected, f"resumed after {k} items"
    with fresh() as pipe:  # after the epoch's StopIteration
        list(pipe)
        state = roundtrip(pipe.get_state())
    with fresh() as resumed:
        resumed.set_state(state)
        assert [canonical(item) for item in take_all(resumed, len(following))] == expected[len(epoch) :]


def one_epoch(up: str, down: str, kind: str, consumers: int) -> Counter[tuple[str, int]]:
    seen: Counter[tuple[str, int]] = Counter()
    for consumer in range(consumers):
        with build(up, down, consumer, consumers, kind) as pipe:
            for item in pipe:
                seen.update(delivered(item))
    return seen


def rescaled_epoch(up: str, down: str, kind: str, old: int, new: int, fractions: list[float]) -> Counter[Any]:
    """Old consumers each stop at a fraction of their epoch and save; new consumers restore
    from every old state and run to the end of the epoch: what all of them delivered."""
    seen: Counter[tuple[str, int]] = Counter()
    states = []
    for consumer in range(old):
        with build(up, down, consumer, old, kind) as pipe:
            length = sum(1 for _ in pipe)
        with build(up, down, consumer, old, kind) as pipe:
            for _ in range(round(fractions[consumer % len(fractions)] * length)):
                seen.update(delivered(next(pipe)))
            states.append(roundtrip(pipe.get_state()))
    for consumer in range(new):
        with build(up, down, consumer, new, kind) as pipe:
            restore(pipe, states)
            for item in pipe:
                seen.update(delivered(item))
    return seen


def check_rescale(up: str, down: str, kind: str) -> None:
    epoch = one_epoch(up, down, kind, 1)
    assert epoch
    # Old consumers stop at different points, a little apart as in training (consumers more
    # than one epoch apart come from different checkpoints and are refused).
    for old, new, fractions in ((2, 3, [0.5, 0.35]), (3, 1, [0.45, 0.6, 0.3])):
        assert one_epoch(up, down, kind, old) == epoch, f"{old} consumers do not split the epoch exactly"
        assert rescaled_epoch(up, down, kind, old, new, fractions) == epoch, f"rescaled {old} -> {new}"


# -- the tests --------------------------------------------------------------------------------


def kinds(up: str) -> tuple[str, ...]:
    """Source kinds a pair runs over: every kind for a source's own row, else a list."""
    return INDEXED_KINDS if up == "source" else STREAM_KINDS if up == "stream" else ("list",)


def params(check: str) -> Iterator[Any]:
    """The cells a check runs on, by source kind."""
    for (up, down), cell in TABLE.items():
        included = {
            "construction": not cell.should_work,
            "resume": cell.should_work,
            "rescale": cell.should_work and partitioned(up, down),
            "no partitioner": cell.should_work and not partitioned(up, down),
        }[check]
        if not included:
            continue
        for kind in kinds(up):
            yield pytest.param(up, down, kind, id=f"{up}->{down}-{kind}")


def test_the_table_has_every_ordered_pair() -> None:
    assert set(TABLE) == {(up, down) for up in UPSTREAM for down in DOWNSTREAM}
    assert {cell.verdict for cell in TABLE.values()} <= {"works", "refused"}
    for pair, cell in TABLE.items():
        assert (cell.verdict == "refused") == bool(cell.hint), pair


@pytest.mark.parametrize("up, down, kind", list(params("resume")))
def test_exact_resume(up: str, down: str, kind: str) -> None:
    check_exact_resume(up, down, kind)


@pytest.mark.parametrize("up, down, kind", list(params("rescale")))
def test_exactly_once_rescale(up: str, down: str, kind: str) -> None:
    check_rescale(up, down, kind)


@pytest.mark.parametrize("up, down, kind", list(params("no partitioner")))
def test_rescale_without_a_partitioner_is_refused(up: str, down: str, kind: str) -> None:
    """No shard can go in without coming between the pair: a rescale is refused, by name."""
    states = []
    for consumer in range(2):
        with build(up, down, consumer, 2, kind) as pipe:
            next(pipe)
            states.append(roundtrip(pipe.get_state()))
    with build(up, down, 0, 3, kind) as pipe, pytest.raises(rs.ConfigError, match="shard"):
        restore(pipe, states)


@pytest.mark.parametrize("up, down, kind", list(params("construction")))
def test_refused_at_construction(up: str, down: str, kind: str) -> None:
    cell = TABLE[(up, down)]
    upstream = build_upstream(up, down, 1, 2, kind)  # the chain up to the pair builds
    with pytest.raises(rs.ConfigError) as refusal:
        apply(down, upstream, 1, 2)
    assert cell.hint in str(refusal.value)


README_LABELS = {"block": "block_shuffle", "bfd": "pack_bfd"}
SYMBOLS = {"✓": "works", "✗": "refused"}


def test_the_readme_shows_this_table() -> None:
    """README.md's "Composition" table has a cell for every pair, and its symbol (✓ works, ✗
    refused) is this table's verdict."""
    text = (Path(__file__).parent.parent / "README.md").read_text(encoding="utf-8")
    section = text.split("\n## Composition\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    header, body = rows[0], rows[2:]

    def cells(line: str) -> list[str]:
        return [cell.strip().strip("*`") for cell in line.strip().strip("|").split("|")]

    downstream = [README_LABELS.get(label, label) for label in cells(header)[1:]]
    shown = {}
    for line in body:
        label, *symbols = cells(line)
        for down, symbol in zip(downstream, symbols):
            shown[(README_LABELS.get(label, label), down)] = SYMBOLS.get(symbol[:1], symbol)
    assert shown == {pair: cell.verdict for pair, cell in TABLE.items()}
    notes = {int(_digits(mark)) for mark in re.findall(r"✗([⁰¹²³⁴⁵⁶⁷⁸⁹]+)", section)}
    for number in sorted(notes):
        assert re.search(rf"^{number}\. ", section, re.MULTILINE), f"footnote {number} is missing"


def _digits(superscript: str) -> str:
    return superscript.translate(str.maketrans("⁰¹²³⁴⁵⁶⁷⁸⁹", "0123456789"))
