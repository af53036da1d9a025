"""Elastic rescale of a streaming packer: old consumers' buffers are dealt out whole.

New consumer ``j`` of ``C'`` inherits every piece held by the old consumers ``i`` of ``C`` with
``i * C' // C == j`` (``inherited_from``): a contiguous run of ``C / C'`` old consumers, rounded
down or up, so runs differ by at most one buffer. Every piece an old consumer held (the pieces
it had inherited itself, the rest of a long document, its ready rows, its open groups) goes to
exactly one new consumer, so each token is packed exactly once.

Whole buffers rather than pieces dealt one by one, because a new consumer then reads the
references of only the one or two old packers it inherits from (a contiguous run, so one or two
old ranks' states when every rank of ``R`` holds ``C / R`` consumers), not those of all ``C``:
at 32,768 old consumers that is the difference between decoding two packer states and 32,768
per new worker. The other old consumers' packer states are not read at all: ``resumable.elastic``
cuts them out of an old state's text before parsing it (``buffer_free_text``) or drops them once
parsed (``drop_buffer``), so a rank keeps only the cursors of the old consumers it does not
inherit from. A contiguous run (rather than ``i % C'``) also keeps a new
rank's inherited buffers within a few consecutive old ranks, and matches how a whole-epoch
``bfd`` plan deals out its rows.

The new consumer's state names its inherited pieces in the packer's own compact encoding
(``REFS`` with ``SECTIONS`` ``[0, 0, 0, n]``): old consumer ``i``'s pieces, then ``i + 1``'s,
each in the order inherited, span, ready rows, open groups (pieces waiting longest first).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from resumable.core.keys import RecordKey
from resumable.core.state import ENDED, KIND, UPSTREAM, VERSION, require
from resumable.errors import StateError
from resumable.pack._buffered import SINCE_ENTRIES, listed, saved_reserved
from resumable.pack._entries import (
    BUFFER_SIZE,
    COUNTERS,
    EXHAUSTED,
    INHERITED,
    OPEN,
    OPEN_SIZES,
    READY,
    READY_SIZES,
    REFS,
    RESERVED,
    SECTIONS,
    SPAN,
    STATS,
)
from resumable.pack._pieces import PIECE_FIELDS, reference_parts
from resumable.pack._refs import REF_LIMIT, RefTable

if TYPE_CHECKING:
    from resumable.pack.node import Pack

PACK_KIND = "Pack"
"""``Pack.kind``, the kind of the states whose buffers ``drop_buffer`` drops (``pack.node`` is not
imported here: it imports ``resumable.elastic``, which imports this module)."""

BUFFER_ENTRIES = (OPEN, OPEN_SIZES, READY, READY_SIZES, SPAN, INHERITED, REFS, SECTIONS, RESERVED, *SINCE_ENTRIES)
"""A streaming packer's entries that hold or cut its piece references (every state form)."""


def inherited_from(consumer: int, num_consumers: int, num_old: int) -> range:
    """The old consumers (of ``num_old``) whose buffers new consumer ``consumer`` of
    ``num_consumers`` inherits: those ``i`` with ``i * num_consumers // num_old == consumer``."""
    return range(-(-consumer * num_old // num_consumers), -(-(consumer + 1) * num_old // num_consumers))


def rescaled(pack: Pack, olds: list[dict[str, Any]], path: str, consumer: int, num_consumers: int) -> dict[str, Any]:
    """A fresh epoch state of ``pack`` holding the pieces of the old consumers this consumer
    inherits from (``inherited_from``); the others' packer states are not read."""
    table = RefTable()
    slots: list[int] = []
    reserved: list[int] | None = []  # None once an old state does not say (saved before RESERVED)
    for index in inherited_from(consumer, num_consumers, len(olds)):
        where = f"{path} (old consumer {index})"
        saved = olds[index]
        pack._check_config(saved, where)
        old = listed(saved, where)
        sections = [require(old, key, list, where) for key in (OPEN, READY, INHERITED)]
        span = require(old, SPAN, list, where)
        opened, ready, inherited = sections
        held = [*inherited, *([span] if span else []), *ready, *opened]
        extras = _extras(old, [len(opened), len(ready), 1 if span else 0, len(inherited)], pack, where)
        prefixes: dict[tuple[int, ...], RecordKey] = {}  # one state's references share their prefixes
        for entry in held:
            key, start, end = _parsed(entry, where, prefixes)
            slots.append(table.add(key, start, end))
        if extras is None or reserved is None:
            reserved = None
        else:
            reserved.extend(extras)
    state = pack._header()
    sizes = [len(group) for group in pack._new_packer(1).groups()]  # an empty strategy's (format) groups
    state.update(
        {
            REFS: table.encode(np.array(slots, dtype=np.intp)),
            SECTIONS: [0, 0, 0, len(slots)],
            OPEN_SIZES: sizes,
            READY_SIZES: [],
            EXHAUSTED: False,
            STATS: dict.fromkeys(COUNTERS, 0),
            ENDED: False,
        }
    )
    if pack.length_fn is not None and reserved is not None:
        state[RESERVED] = reserved
    return state


def _extras(old: dict[str, Any], counts: list[int], pack: Pack, where: str) -> list[int] | None:
    """The reserved positions of an old state's pieces in dealing order (inherited, span, ready,
    open; the state saves them open, ready, span, inherited), or None where it does not say."""
    saved = saved_reserved(old, sum(counts), pack.length_fn is not None, where)
    if saved is None:
        return None
    parts, at = [], 0
    for count in counts:
        parts.append(saved[at : at + count])
        at += count
    return [extra for part in reversed(parts) for extra in part]


def _parsed(entry: Any, where: str, prefixes: dict[tuple[int, ...], RecordKey]) -> tuple[tuple[Any, ...], int, int]:
    """``(key, start, end)`` of a piece reference ``[*component names, epoch, record, start, end]``
    (``prefixes``: see ``reference_parts``)."""
    parts = reference_parts(entry, prefixes)
    if parts is not None and all(value < REF_LIMIT for value in entry[-PIECE_FIELDS:]) and parts[1] < parts[2]:
        return parts
    raise StateError(
        f"{where}: piece reference {entry!r:.80} is not [epoch, record, token_start, token_end] of ints >= 0 "
        "with start < end (behind mix component names, after a mix, and a shard's stride, below a shard)"
    )


def drop_buffer(state: dict[str, Any]) -> None:
    """Drop a streaming packer's buffer (``BUFFER_ENTRIES``) from an old consumer's packer state
    that a new consumer does not inherit from: it keeps header, options, counters and upstream.
    A whole-epoch plan's state (no ``buffer_size``), or another node's, is left as it is."""
    if state.get(KIND) == PACK_KIND and state.get(BUFFER_SIZE) is not None:
        for key in BUFFER_ENTRIES:
            state.pop(key, None)


HEADER_TEXT = f'{{"{KIND}":"{PACK_KIND}","{VERSION}":'
"""How a packer's state begins in JSON text as a Loader's workers write it (orjson: no spaces,
the header first)."""
UPSTREAM_TEXT = f'"{UPSTREAM}":'


def buffer_free_text(text: str, depth: int) -> str | None:
    """The JSON text of an old consumer's state with the own entries of its streaming packer,
    ``depth`` upstreams down, cut to the header: for a rescale that does not inherit from it,
    which reads of that packer's state only the header, while its buffer is most of the text
    (8.5 of 9 kB with a 1000-document buffer) and parsing 32,768 of them most of a new rank's
    restore. Only a text as a Loader's workers write it qualifies: no spaces, each node's
    header first and its upstream last, no ``upstream`` key among a packer's own entries or
    those of the nodes above it; None for any other."""
    at = 0
    for _ in range(depth):
        at = text.find(UPSTREAM_TEXT, at)
        if at < 0:
            return None
        at += len(UPSTREAM_TEXT)
    if not text.startswith(HEADER_TEXT, at):
        return None
    header_end = text.find(",", at + len(HEADER_TEXT))
    upstream = text.find(UPSTREAM_TEXT, header_end)
    if header_end < 0 or upstream < 0:
        return None
    return text[: header_end + 1] + text[upstream:]
