"""What a streaming packer did since its last whole state, as flat ints.

A state of a packer holding a 1000-document buffer is mostly the references of its pieces, and
the strategy reorders them as rows close, so saving them all costs a gather and a base64 of a few
kB with every batch. Between two such whole states only a few rows leave and a few documents
arrive, so a state a few rows later saves the earlier state (unchanged, the same object) and
the log of what happened since; a restore loads the earlier state and replays the log by
planning alone (the strategy needs each piece's length, never its tokens), then fetches the
records as their rows are handed out, as after any restore.

The log is a list of ints, one event after the other:

- ``ROW, n``: ``n`` rows were handed out, one after the other (each the span's next whole row,
  or the first ready row): a packer hands out a round's rows over many batches;
- ``INHERITED_PULL``: the next piece inherited in a rescale was placed;
- ``FLUSH``: the upstream's epoch ended and the open rows were closed;
- a document: ``origin, epoch, record, full, end, extra`` (``DOCUMENT_INTS`` ints, ``origin``
  >= 0 indexing the key prefixes saved beside the log): tokens ``[0, full)`` made whole rows,
  ``[full, end)`` one piece; ``extra`` positions reserved (``length_fn``);
- the next record: ``NEXT_RECORD - end``, one int, for a document whose key is the previous
  document's with the record one further (below a shard, a consumer reads its stride in order),
  that makes no whole row and reserves nothing: most documents, in a fifth of the ints.
"""

from __future__ import annotations

from typing import Any, Iterator, NamedTuple, Union

from resumable.core.keys import RecordKey, loaded_prefix
from resumable.core.state import INT64_MAX
from resumable.errors import StateError
from resumable.pack._pieces import is_count

ROW = -1
INHERITED_PULL = -2
FLUSH = -3
NEXT_RECORD = -4
DOCUMENT_INTS = 6
MIN_EVENTS = 128
"""Ints a log may hold beyond half the pieces of the state it follows before it is dropped."""


def event_limit(pieces: int) -> int:
    """The longest log kept after a whole state of ``pieces`` pieces: past it the log is dropped
    and the next state is whole, so a packer whose state is never taken keeps no growing log. A
    log longer than half of it is replaced by a whole state when a state is taken, so a state's
    log holds at most a quarter as many ints as its base holds pieces (plus 64): a few hundred
    bytes beside a base of 3-8 bytes a piece."""
    return pieces // 2 + MIN_EVENTS


def next_record(previous: RecordKey | None, key: RecordKey) -> bool:
    """Whether ``key`` follows ``previous`` (same prefix and epoch, the record one further)."""
    return previous is not None and key[-1] == previous[-1] + 1 and key[:-1] == previous[:-1]


class Pulled(NamedTuple):
    """A document event: the record ``key`` gave tokens ``[0, full)`` as whole rows and
    ``[full, end)`` as one piece, reserving ``extra`` positions."""

    key: RecordKey
    full: int
    end: int
    extra: int


Event = Union[int, Pulled]


def parsed_events(events: Any, origins: Any, seq_len: int, path: str) -> Iterator[Event]:
    """The events of a saved log (``ROW``, ``INHERITED_PULL``, ``FLUSH`` or a ``Pulled``), each
    checked as far as it can be alone; StateError naming ``path`` for anything malformed."""
    if not isinstance(events, list) or not isinstance(origins, list):
        raise StateError(f"{path}: the events since the base state and their origins must be lists")
    prefixes = []
    for names in origins:
        prefix = loaded_prefix(names)
        if prefix is None:
            raise StateError(f"{path}: event origin {names!r:.80} is not a list of names (and a stride)")
        prefixes.append(prefix)
    at, previous = 0, None
    while at < len(events):
        code = events[at]
        if isinstance(code, bool) or not isinstance(code, int):
            raise StateError(f"{path}: event {at} is {code!r:.40}, not an event code or an origin index")
        if code < NEXT_RECORD:
            end = NEXT_RECORD - code
            if previous is None or end > seq_len:
                raise StateError(f"{path}: event {at} takes the record after none, or more than a row of tokens")
            previous = (*previous[:-1], previous[-1] + 1)
            yield Pulled(previous, 0, end, 0)
            at += 1
            continue
        if code == ROW:
            count = events[at + 1] if at + 1 < len(events) else None
            if not is_count(count) or not count:
                raise StateError(f"{path}: event {at} hands out rows without a count >= 1 after it")
            for _ in range(count):  # lazily: a damaged count fails at the first row the buffer lacks
                yield ROW
            at += 2
            continue
        if code < 0:
            if code == NEXT_RECORD:
                raise StateError(f"{path}: event {at} takes the next record without tokens")
            yield code
            at += 1
            continue
        fields = events[at + 1 : at + DOCUMENT_INTS]
        if len(fields) < DOCUMENT_INTS - 1 or not all(is_count(value) for value in fields) or code >= len(prefixes):
            raise StateError(f"{path}: event {at} is not a document (origin, epoch, record, full, end, extra)")
        epoch, record, full, end, extra = fields
        if max(fields) > INT64_MAX:  # past what a state's references and counters can hold
            raise StateError(f"{path}: event {at} holds a number above {INT64_MAX}")
        if not 0 <= full <= end or end == 0 or full % seq_len or end - full > seq_len:
            raise StateError(f"{path}: event {at} cuts tokens [0, {full}) and [{full}, {end}) out of rows of {seq_len}")
        previous = (*prefixes[code], epoch, record)
        yield Pulled(previous, full, end, extra)
        at += DOCUMENT_INTS
