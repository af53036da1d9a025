"""Pack: token sequences into fixed-length rows, checkpointed by reference.

The packer holds documents in a bounded buffer, but its state never holds tokens: every
buffered piece is saved as ``[*key, token_start, token_end]``: the provenance key of the record
it came from (``upstream.last_key()``: ``(epoch, index in the leaf source)``, the same on every
rank, so pieces can move between consumers in an elastic rescale, behind the names of the mix
components it came through) plus a token range (with a ``length_fn``, also the positions each
piece's document reserves). A restore plans from those alone and fetches each record again
(``upstream.fetch_many``) when its row is handed out, so ``set_state`` runs no map and the
fetches are bounded by the buffer, never by the position in the epoch.

This module holds the node: its options, its state and its rows. How a record becomes token
arrays and how much of it is kept is ``_documents.Documents``; what an epoch holds between the
upstream and the rows lives in one of two modes: ``_buffered.BufferedRows`` (the streaming
strategies) or ``_planned.PlannedRows`` (a whole-epoch plan, ``strategy="bfd"`` without
``buffer_size``). The modes hold the upstream and the ``Documents``, never the node: a pipeline
that goes out of scope is freed at once, and its pools and threads stop with it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from resumable.core.indexed import IndexedNode
from resumable.core.keys import RecordKey
from resumable.core.node import Node
from resumable.core.options import INT64_MIN, choice_option, flag_option, int_option
from resumable.core.state import INT64_MAX, require, require_count, short_repr
from resumable.errors import ConfigError, StateError
from resumable.pack._buffered import BufferedRows
from resumable.pack._documents import Documents
from resumable.pack._entries import (
    BUFFER_SIZE,
    COUNTERS,
    DOCUMENT_FIELDS,
    INPUT_FIELD,
    LABELS_FIELD,
    LENGTH_FN,
    MASK_FIRST_TOKEN,
    MAX_DOCUMENTS,
    OVERLONG,
    PAD_TOKEN_ID,
    PAYLOAD_OPTIONS,
    SEQ_LEN,
    SPLIT_POSITIONS,
    STATS,
    STRATEGY,
    TOKEN_FIELDS,
)
from resumable.pack._pieces import untraceable
from resumable.pack._planned import PlannedRows
from resumable.pack.rows import ROW_FIELDS, PadValue, RowFormat, collate_rows, cu_seqlens_length
from resumable.pack.strategies import STRATEGIES, Packer, make_packer

DEFAULT_BUFFER_SIZE = 1000
OVERLONG_POLICIES = ("split", "truncate", "drop")
POSITION_MODES = ("restart", "continue")
SEQ_LEN_MAX = 2**31 - 1
"""The longest row: ``cu_seqlens`` and ``document_ids`` are int32."""


@dataclass(frozen=True)
class PackStats:
    """What the packer did this epoch.

    ``documents`` counts documents with tokens in the rows (``split`` and ``truncated`` ones
    included), ``dropped`` overlong documents left out, ``empty`` documents without tokens.
    Document counters grow when the packer takes a document (it may still be buffered);
    ``rows`` and ``padding`` (tokens) grow when a row is handed out.
    """

    seq_len: int
    documents: int = 0
    split: int = 0
    truncated: int = 0
    dropped: int = 0
    empty: int = 0
    rows: int = 0
    padding: int = 0

    @property
    def tokens(self) -> int:
        """Non-padding tokens handed out."""
        return self.rows * self.seq_len - self.padding

    @property
    def efficiency(self) -> float:
        """Non-padding tokens / (rows * seq_len); 0.0 before the first row."""
        return self.tokens / (self.rows * self.seq_len) if self.rows else 0.0


class Pack(Node[dict[str, Any]]):
    """Pack documents' token ids into rows of exactly ``seq_len`` tokens.

    Options:

    - ``strategy``: ``"best_fit"`` (default; best-fit-decreasing rounds over a buffer of
      ``buffer_size`` documents), ``"first_fit"`` (each document into the oldest open row with
      room; at most ``buffer_size`` documents in open rows), ``"greedy"`` (next-fit: one open row,
      closed when the next document does not fit) or ``"bfd"`` (best-fit-decreasing: over the whole
      epoch of an indexed upstream when ``buffer_size`` is not given, else over consecutive
      windows of ``buffer_size`` documents).
    - ``buffer_size``: documents the packer may hold (default 1000; see ``strategy`` for bfd).
    - ``overlong``: documents longer than ``seq_len`` are ``"split"`` (full rows of ``seq_len``,
      then the tail packed like any document), ``"truncate"`` (first ``seq_len`` tokens) or
      ``"drop"``.
    - ``split_positions``: ``"restart"`` (a split tail's positions start at 0) or ``"continue"``
      (they continue from the tail's offset in the document).
    - ``mask_first_token``: labels -100 at the first token of every piece, so no token is
      trained to follow the previous document.
    - ``max_documents``: pieces per row at most (bounds the length of ``cu_seqlens``).
    - ``input_field`` / ``labels_field``: record fields holding the token ids and optional labels
      (``labels_field=None``: labels are always the token ids).
    - ``pad_token_id``: ``input_ids`` value at padding.
    - ``token_fields``: per-token record fields (loss masks, token types), sliced like the
      labels; a list of names (padded with 0) or a mapping of names to pad values.
    - ``document_fields``: per-document record fields (images, paths, metadata), carried to
      the row as ``[(offset, value), ...]``, one entry per piece (``None`` after a split's first).
    - ``length_fn``: ``length_fn(record)``, an int >= the record's token count, is its cost in
      the row: its tokens, then positions reserved for a processor to fill (image tokens). Such
      documents are never split, so it needs ``overlong="drop"`` or ``"truncate"``.

    Rows are dicts of numpy arrays (see ``resumable.pack.rows``); ``Pack.collate`` stacks them
    into batches. ``stats`` reports what the packer did. Once the upstream ends, the open rows
    are flushed, so an epoch's last rows come before its StopIteration; after ``.repeat()`` the
    stream never ends and documents of consecutive epochs share rows.
    """

    kind = "Pack"
    _unknown_length = (
        "a streaming packer knows how many rows an epoch gives only once it has packed it; "
        "strategy='bfd' without buffer_size plans the epoch ahead and has a len()"
    )

    collate = staticmethod(collate_rows)

    upstream: Node[Any]
    _rows: BufferedRows | PlannedRows
    """What this epoch holds between the upstream and the rows: a streaming buffer, or a
    whole-epoch plan when ``buffer_size`` is None."""

    def __init__(
        self,
        upstream: Node[Any],
        seq_len: int,
        *,
        strategy: str = "best_fit",
        buffer_size: int | None = None,
        overlong: str = "split",
        split_positions: str = "restart",
        mask_first_token: bool = False,
        max_documents: int | None = None,
        input_field: str = "input_ids",
        labels_field: str | None = "labels",
        pad_token_id: int = 0,
        token_fields: Sequence[str] | Mapping[str, PadValue] | None = None,
        document_fields: Sequence[str] | None = None,
        length_fn: Callable[[Any], int] | None = None,
    ) -> None:
        super().__init__(upstream)
        kind = self.kind
        seq_len = int_option(kind, SEQ_LEN, seq_len, most=SEQ_LEN_MAX)
        choice_option(kind, STRATEGY, strategy, STRATEGIES)
        choice_option(kind, OVERLONG, overlong, OVERLONG_POLICIES)
        choice_option(kind, SPLIT_POSITIONS, split_positions, POSITION_MODES)
        buffer_size = int_option(kind, BUFFER_SIZE, buffer_size, optional=True)
        max_documents = int_option(kind, MAX_DOCUMENTS, max_documents, optional=True)
        mask_first_token = flag_option(kind, "mask_first_token", mask_first_token)
        if not isinstance(input_field, str):
            raise ConfigError(f"{kind}: input_field must be a str, got {input_field!r}")
        if labels_field is not None and not isinstance(labels_field, str):
            raise ConfigError(f"{kind}: labels_field must be a str or None, got {labels_field!r}")
        pad_token_id = int_option(kind, "pad_token_id", pad_token_id, least=INT64_MIN, most=INT64_MAX)
        token_pads = _token_fields(kind, token_fields)
        document_names = _names(kind, DOCUMENT_FIELDS, document_fields, [name for name, _ in token_pads])
        if length_fn is not None and not callable(length_fn):
            raise ConfigError(f"{kind}: length_fn must be callable or None, got {length_fn!r}")
        if length_fn is not None and overlong == "split":
            raise ConfigError(
                f"{kind}: with a length_fn a document is packed whole, by its cost, so one over seq_len "
                "cannot be split; pass overlong='drop' or overlong='truncate'"
            )

        if not upstream._traceable():
            raise ConfigError(untraceable(kind, upstream))
        whole_epoch = strategy == "bfd" and buffer_size is None
        if whole_epoch and not isinstance(upstream, IndexedNode):
            raise ConfigError(
                f"{kind}: strategy='bfd' without buffer_size plans the whole epoch and needs random "
                f"access, but the upstream {upstream!r} is not indexed (filter, repeat and batch are "
                "not); give buffer_size=N to pack windows of N documents instead"
            )
        self.seq_len = seq_len
        self.strategy = strategy
        self.buffer_size = None if whole_epoch else (buffer_size or DEFAULT_BUFFER_SIZE)  # None: a whole-epoch plan
        self.overlong = overlong
        self.split_positions = split_positions
        self.mask_first_token = mask_first_token
        self.max_documents = max_documents
        self.input_field = input_field
        self.labels_field = labels_field
        self.pad_token_id = pad_token_id
        self.token_fields = dict(token_pads)
        self.document_fields = list(document_names)
        self.length_fn = length_fn
        self._documents = Documents(
            kind,
            seq_len,
            overlong,
            input_field,
            labels_field,
            tuple(self.token_fields),
            document_names,
            length_fn,
        )
        self._format = RowFormat(
            seq_len=seq_len,
            cu_len=cu_seqlens_length(seq_len, max_documents),
            pad_token_id=pad_token_id,
            mask_first_token=mask_first_token,
            continue_positions=split_positions == "continue",
            token_fields=token_pads,
            document_fields=document_names,
        )
        self._reset()

    def _reset(self) -> None:
        """Empty buffers and counters: a new epoch."""
        if self.buffer_size is None:
            self._rows = PlannedRows.fresh(self)
        else:
            self._rows = BufferedRows(self.upstream, self._documents, self._new_packer(self.buffer_size))

    def _new_packer(self, buffer_size: int) -> Packer:
        """An empty streaming strategy."""
        return make_packer(self.strategy, self.seq_len, buffer_size, self.max_documents)

    # -- public views ------------------------------------------------------------------------

    @property
    def stats(self) -> PackStats:
        """Counters of this epoch (a snapshot)."""
        return PackStats(self.seq_len, **self._rows.counts)

    def pending_keys(self) -> list[RecordKey]:
        """``(epoch, record)`` of every document taken from upstream but not fully handed out,
        once each: exactly the records a restore fetches again. For a whole-epoch plan, the
        documents of the rows not yet handed out."""
        return self._rows.pending_keys()

    # -- iteration ---------------------------------------------------------------------------

    def _next(self) -> dict[str, Any]:
        return self._format.build(self._rows.next_segments())

    def _known_length(self) -> int:
        """Rows of this consumer's epoch for a whole-epoch plan (planning it if it was not
        yet; inherited rows included), else unknown: a streaming packer knows its rows only once
        it has packed them."""
        if isinstance(self._rows, PlannedRows):
            return self._rows.length()
        return super()._known_length()

    # -- epochs and state --------------------------------------------------------------------

    def _on_epoch_start(self) -> None:
        rows = self._rows
        self._reset()
        if isinstance(rows, PlannedRows) and len(rows.inherited):
            # a rescale across an epoch boundary handed over rows of the epoch now starting
            self._rows = PlannedRows.fresh(self, rows.inherited.of_epoch(rows.epoch))

    def _config(self) -> dict[str, Any]:
        config = {
            SEQ_LEN: self.seq_len,
            STRATEGY: self.strategy,
            BUFFER_SIZE: self.buffer_size,
            OVERLONG: self.overlong,
            SPLIT_POSITIONS: self.split_positions,
            MASK_FIRST_TOKEN: self.mask_first_token,
            MAX_DOCUMENTS: self.max_documents,
            INPUT_FIELD: self.input_field,
            LABELS_FIELD: self.labels_field,
            PAD_TOKEN_ID: self.pad_token_id,
        }
        if self.token_fields:
            config[TOKEN_FIELDS] = self.token_fields
        if self.document_fields:
            config[DOCUMENT_FIELDS] = self.document_fields
        if self.length_fn is not None:
            config[LENGTH_FN] = True
        return config

    def _check_config(self, state: dict[str, Any], path: str) -> None:
        """Also reject a state saved with a payload option this packer does not have (they are
        saved only when set)."""
        super()._check_config(state, path)
        config = self._config()
        for key in PAYLOAD_OPTIONS:
            if key in state and key not in config:
                raise StateError(f"{path}: state was saved with {key}={short_repr(state[key])}, this pipeline has none")

    def _progress(self) -> dict[str, Any]:
        return self._rows.progress()

    def _restore(self, state: dict[str, Any], path: str) -> None:
        saved = require(state, STATS, dict, path)
        counts = {name: require_count(saved, name, f"{path} > {STATS}") for name in COUNTERS}
        if self.buffer_size is None:
            self._rows = PlannedRows.restored(self, state, path, counts)
        else:
            self._rows = BufferedRows.restored(self, self._new_packer(self.buffer_size), state, path, counts)

    def _rescale(self, olds: list[dict[str, Any]], path: str, consumer: int, num_consumers: int) -> dict[str, Any]:
        """A fresh epoch state holding this consumer's share of what the old consumers held."""
        rows = PlannedRows if self.buffer_size is None else BufferedRows
        return rows.rescaled(self, olds, path, consumer, num_consumers)

    def _olds_for_children(self, olds: list[dict[str, Any]], path: str) -> list[dict[str, Any]]:
        if self.buffer_size is None:
            return PlannedRows.olds_for_children(self, olds, path)
        return olds


def _names(kind: str, option: str, value: Any, taken: list[str]) -> tuple[str, ...]:
    """Field names given as a list (or tuple) of distinct strings, none a row field or in ``taken``."""
    if value is None:
        return ()
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise ConfigError(f"{kind}: {option} must be a list of field names, got {value!r}")
    for name in value:
        if not isinstance(name, str):
            raise ConfigError(f"{kind}: {option} must hold field names (str), got {name!r}")
        if name in ROW_FIELDS or name in taken:
            raise ConfigError(f"{kind}: {option} names {name!r}, which is already a field of the rows")
        taken = [*taken, name]
    return tuple(value)


def _token_fields(kind: str, value: Any) -> tuple[tuple[str, PadValue], ...]:
    """``(name, pad value)`` of each token field: a list pads with 0, a mapping names the pads."""
    if not isinstance(value, Mapping):
        return tuple((name, 0) for name in _names(kind, TOKEN_FIELDS, value, []))
    names = _names(kind, TOKEN_FIELDS, list(value), [])
    return tuple((name, _pad_value(kind, name, value[name])) for name in names)


def _pad_value(kind: str, name: str, pad: Any) -> PadValue:
    """A token field's pad value as the plain int, float or bool it holds (numpy scalars too,
    so the state stays JSON); a NaN or an infinity is no pad."""
    if isinstance(pad, (np.integer, np.floating, np.bool_)):
        pad = pad.item()
    if not isinstance(pad, (int, float)) or (isinstance(pad, float) and not math.isfinite(pad)):
        raise ConfigError(f"{kind}: token field {name!r} pads with {pad!r}; expected an int, a float or a bool")
    return pad
