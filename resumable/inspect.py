"""Readable summaries of saved states: ``python -m resumable inspect STATE``.

Finds every pipeline state inside a state file (a pipeline or ``rs.torch.Loader`` state in
JSON, a torch checkpoint, a ``torch.distributed.checkpoint`` directory, or a directory of
per-rank files) and prints, per rank and DataLoader worker, the epoch, position and progress,
then the options and counters of every node, and the files involved.

A Loader state holds each worker's pipeline state as of the last batch handed out (workers hand
it over with every batch), so the report is exact as it is. A state saved by an earlier
version, whose workers did so every few batches, may count batches handed out after their
snapshot: the report says how many, and, given the function that builds the pipeline, advances
the workers by them so that every position is the one as of the last batch handed out.
"""

from __future__ import annotations

import datetime
import json
import os
import pickle
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from resumable._stand_ins import NotRead
from resumable.core.indexed import EPOCH, LENGTH, POSITION
from resumable.core.keys import loaded_prefix
from resumable.core.node import Node
from resumable.core.state import (
    ENDED,
    INT64_MAX,
    KIND,
    LOADER_FORMAT,
    LOADER_FORMAT_PREFIX,
    UPSTREAM,
    VERSION,
    check_json,
    is_count,
)
from resumable.errors import StateError
from resumable.loader_state import LoaderState, parse_loader_state
from resumable.ops.mix import COMPONENTS
from resumable.order.elastic import Offset, Remap, Reorder
from resumable.order.shard import NEXT_REMAP, REMAP
from resumable.pack._buffered import listed
from resumable.pack._entries import (
    BASE_PROGRESS,
    BUFFER_ENTRIES,
    EXHAUSTED,
    INHERITED,
    OPEN,
    OPEN_SIZES,
    READY,
    READY_SIZES,
    REFS,
)
from resumable.pack.node import Pack
from resumable.sources._line_scan import UTF8_BOM
from resumable.sources.files import FILES, LEGACY_FINGERPRINT_LENGTH, MTIME_NS, NAME, SIZE

CURSOR_KEYS = (EPOCH, POSITION, LENGTH)
NODE_KEYS = (KIND, VERSION, UPSTREAM)  # a pipeline state holds all of them (a source, the first two)
PIECES = (OPEN, READY, INHERITED)  # a packer's references, [*mix component names, epoch, record, start, end]
UNIX_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)
# Counts the report shows (cursors, file sizes) fit int64; larger ones are damage.
# A damaged value shown in an error is cut to this many characters: the error stays one line.
SHOWN_CHARACTERS = 80

PipelineFactory = Callable[[], Node[Any]]

JSON_SNIFF_BYTES = 4096
"""How much of a file ``load_any`` reads to tell JSON from a torch checkpoint."""
JSON_WHITESPACE = b" \t\r\n"


@dataclass
class Found:
    """One pipeline state and where it sits: source file, rank, worker, and the Loader state
    that holds it (``None`` for a bare pipeline state)."""

    source: str
    rank: int | None
    world_size: int | None
    worker: int | None
    num_workers: int | None
    state: dict[str, Any]
    loader: LoaderState | None = None


def load_any(path: str) -> list[tuple[str, Any]]:
    """The saved objects at ``path``: ``(label, object)`` pairs."""
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, ".metadata")):
            return [(path, _load_dcp(path))]
        try:
            listed = os.listdir(path)
        except OSError as error:
            raise StateError(f"{path}: cannot list: {error}") from error
        names = sorted(n for n in listed if n.endswith((".json", ".pt")))
        if not names:
            raise StateError(f"{path}: no .json or .pt state files in this directory")
        return [item for name in names for item in load_any(os.path.join(path, name))]
    try:
        with open(path, "rb") as handle:
            head = handle.read(JSON_SNIFF_BYTES)
    except OSError as error:
        raise StateError(f"{path}: cannot read: {error}") from error
    first = head.removeprefix(UTF8_BOM).lstrip(JSON_WHITESPACE)[:1]
    if first in (b"{", b"[", b""):  # JSON as load_state reads it (a BOM, whitespace), or nothing but that
        with open(path, "rb") as handle:
            text = handle.read()
        try:
            return [(path, json.loads(text))]
        except (ValueError, RecursionError) as error:
            raise StateError(f"{path}: not valid JSON ({error})") from error
    from resumable.torch.distributed import load_plain

    try:
        return [(path, load_plain(path, stand_in=True, map_location="cpu"))]
    except Exception as error:  # what torch.load raises on a file that is no checkpoint has no common type
        refused = [line for line in str(error).splitlines() if "GLOBAL" in line]
        if isinstance(error, pickle.UnpicklingError) and refused:  # one torch will not stand in for (os.system)
            raise StateError(
                f"{path}: a torch checkpoint that torch.load(weights_only=True) refuses to read ({refused[0]:.200})"
            ) from error
        raise _unreadable(path, "neither JSON nor a torch checkpoint", error) from error


def _load_dcp(path: str) -> Any:
    """A ``torch.distributed.checkpoint`` directory's contents, its metadata checked first
    (``read_metadata``: a crafted one runs no code) and its byte entries read by
    ``torch.load(weights_only=True)``, in this process alone."""
    from resumable.torch.distributed import load_checkpoint, read_metadata

    read_metadata(path)
    contents: dict[str, Any] = {}
    load_checkpoint(contents, path, rebuild=True)
    return contents


def _unreadable(path: str, what: str, error: BaseException) -> StateError:
    first_line = (str(error).strip().splitlines() or [""])[0]
    return StateError(f"{path}: {what} ({type(error).__name__}: {first_line:.200})")


def find_states(source: str, obj: Any, build: PipelineFactory | None = None) -> Iterator[Found]:
    """Every pipeline state inside ``obj``, with rank and worker when a Loader state holds it.

    With ``build`` (the function that builds the pipeline), each DataLoader worker's state in a
    Loader state saved by an earlier version is advanced from its snapshot to the last batch
    handed out. Searched in order, without
    recursion: a checkpoint may nest deeper than Python's stack.
    """
    pending = [obj]
    seen: set[int] = set()  # containers already searched: objects may refer back to each other
    while pending:
        obj = pending.pop()
        if isinstance(obj, (dict, list, tuple, set, frozenset, NotRead)):
            if id(obj) in seen:
                continue
            seen.add(id(obj))
        if isinstance(obj, str) and obj.startswith("{"):
            try:
                obj = json.loads(obj)  # rs.torch.PerRank stores states as JSON strings
            except (ValueError, RecursionError):
                continue
        if isinstance(obj, dict) and sum(key in obj for key in NODE_KEYS) >= 2:  # a node state, perhaps damaged
            yield Found(source, None, None, None, None, obj)
        elif isinstance(obj, dict) and str(obj.get(LOADER_FORMAT)).startswith(LOADER_FORMAT_PREFIX):
            yield from _loader_states(source, parse_loader_state(obj, f"{source}: Loader"), build)
        elif isinstance(obj, dict):
            pending.extend(reversed(obj.values()))
        elif isinstance(obj, (list, tuple)):
            pending.extend(reversed(obj))
        elif isinstance(obj, (set, frozenset)):
            pending.extend(obj)
        elif isinstance(obj, NotRead):  # a training script's own object, which may hold the state
            pending.extend([obj.state, obj.arguments])


def _loader_states(source: str, loader: LoaderState, build: PipelineFactory | None) -> Iterator[Found]:
    if build is None:
        pipelines = loader.pipelines
    else:
        from resumable.torch.elastic import handed_out_states

        pipelines = handed_out_states(build, loader)
    for worker, pipeline in enumerate(pipelines):
        yield Found(
            source,
            loader.rank,
            loader.world_size,
            worker if loader.num_workers else None,
            loader.num_workers,
            pipeline,
            loader,
        )


def chain(state: dict[str, Any]) -> list[dict[str, Any]]:
    """The node states from the outermost to the source."""
    nodes = []
    node: Any = state
    while isinstance(node, dict):
        nodes.append(node)
        node = node.get(UPSTREAM)
    return nodes


def describe(path: str, build: PipelineFactory | None = None) -> str:
    """The report printed by ``python -m resumable inspect PATH [--pipeline MODULE:FUNCTION]``."""
    found = [f for source, obj in load_any(path) for f in find_states(source, obj, build)]
    if not found:
        raise StateError(f"{path}: no resumable state found")
    for item in found:
        check_readable(item)
    lines = [f"{path}: {len(found)} pipeline state{'s' if len(found) != 1 else ''}"]
    lines.append("pipeline: " + " > ".join(node[KIND] for node in chain(found[0].state)))
    lines.append("")
    lines.extend(_progress_table(found))
    loaders = list({id(item.loader): item.loader for item in found if item.loader is not None}.values())
    if loaders:
        lines.append("")
        lines.extend(line for loader in loaders for line in _loader_lines(loader, replayed=build is not None))
    for item in found:
        details = _node_details(item.state)
        if details:
            lines.append("")
            lines.append(f"{_consumer_label(item)}:")
            lines.extend(details)
    lines.extend(_files(found[0].state))
    return "\n".join(lines)


def _consumer_label(item: Found) -> str:
    parts = []
    if item.rank is not None:
        parts.append(f"rank {item.rank}/{item.world_size}")
    if item.worker is not None:
        parts.append(f"worker {item.worker}/{item.num_workers}")
    return ", ".join(parts) or os.path.basename(item.source)


def _loader_lines(loader: LoaderState, replayed: bool) -> list[str]:
    """Where a Loader state stands, and as of which batch its workers' positions are."""
    finished = ", finished" if loader.finished else ""
    lines = [
        f"rank {loader.rank}/{loader.world_size}: Loader epoch {loader.epoch}, "
        f"{loader.handed_out:,} batches handed out in this pass{finished}"
    ]
    if not loader.num_workers:
        return lines
    snapshot, since = loader.snapshot_step, loader.steps_since_snapshot
    if not since:
        lines.append(
            f"  worker positions as of the last batch handed out (the workers' snapshot at batch {snapshot:,})"
        )
    elif replayed:
        lines.append(
            f"  worker positions as of the last batch handed out: {since:,} batches replayed from the workers' "
            f"snapshot at batch {snapshot:,}"
        )
    else:
        lines.append(
            f"  worker positions as of the workers' snapshot at batch {snapshot:,}, not counting the {since:,} "
            "batches handed out since (a state saved by an earlier version; pass --pipeline MODULE:FUNCTION to "
            "replay them)"
        )
    return lines


PROGRESS_COLUMNS = ("epoch", "position", "length", "progress")
PROGRESS_WIDTHS = (7, 12, 12, 10)
"""The least widths of the progress table's number columns; a wider number widens its column."""


def _progress_table(found: list[Found]) -> list[str]:
    cells: list[tuple[str, tuple[str, ...], str]] = []
    for item in found:
        cursor = next((node for node in chain(item.state) if "position" in node), None)
        ended = "yes" if item.state.get(ENDED) else "no"
        if cursor is None:
            cells.append((_consumer_label(item), ("-",) * len(PROGRESS_COLUMNS), ended))
            continue
        length = cursor.get("length", 0)
        progress = f"{100 * cursor['position'] / length:.1f}%" if length else "-"
        cells.append(
            (_consumer_label(item), (f"{cursor['epoch']}", f"{cursor['position']:,}", f"{length:,}", progress), ended)
        )
    widths = [
        max([least, *(len(numbers[column]) + 2 for _, numbers, _ in cells)])
        for column, least in enumerate(PROGRESS_WIDTHS)
    ]
    header = f"{'consumer':<28}" + "".join(f"{name:>{width}}" for name, width in zip(PROGRESS_COLUMNS, widths))
    rows = [header + "  ended", "-" * (len(header) + 7)]
    for label, numbers, ended in cells:
        rows.append(f"{label:<28}" + "".join(f"{cell:>{width}}" for cell, width in zip(numbers, widths)) + f"  {ended}")
    return rows


def _node_details(state: dict[str, Any]) -> list[str]:
    """Options and counters of each node, lists summarised by their length."""
    lines = []
    for node in chain(state):
        fields = []
        is_pack = node[KIND] == Pack.kind
        for key, value in node.items():
            if key in (KIND, VERSION, UPSTREAM, ENDED, FILES, COMPONENTS, REMAP, NEXT_REMAP, *CURSOR_KEYS):
                continue
            if is_pack and key in BUFFER_ENTRIES:  # summarised below (_pack_buffer)
                continue
            if isinstance(value, list):
                fields.append(f"{key}: {len(value)} entries")
            elif isinstance(value, dict):
                fields.append(f"{key}: " + ", ".join(f"{k}={v}" for k, v in sorted(value.items())))
            else:
                fields.append(f"{key}={value}")
        if fields:
            lines.append(f"  {node[KIND]}: " + ", ".join(fields))
        if is_pack:
            lines.append("    buffer: " + _pack_buffer(node))
        for key in (REMAP, NEXT_REMAP):
            if isinstance(node.get(key), dict):
                lines.extend("    " + line for line in _remap_lines(node[key], node[KIND]))
        for name, component in (node.get(COMPONENTS) or {}).items():
            lines.append(f"    component {name}: {_cursor_text(component)}")
            lines.extend("    " + line for line in _node_details(component))
    return lines


def _cursor_text(state: dict[str, Any]) -> str:
    """``A > B > C, epoch e, position p of n``: a chain and where its cursor stands."""
    text = " > ".join(node[KIND] for node in chain(state))
    cursor = next((node for node in chain(state) if "position" in node), None)
    if cursor is not None:
        text += f", epoch {cursor['epoch']}, position {cursor['position']:,} of {cursor.get('length', 0):,}"
    return text


def _pack_buffer(node: dict[str, Any]) -> str:
    """The packer's buffered references: open rows still filling, closed rows not yet emitted."""
    node = listed(node, str(node.get("kind", "Pack")))  # the compact form, as lists
    open_pieces, open_rows = len(node.get(OPEN, [])), len(node.get(OPEN_SIZES, []))
    ready_pieces, ready_rows = len(node.get(READY, [])), len(node.get(READY_SIZES, []))
    inherited = node.get(INHERITED, [])
    references = [*node.get(OPEN, []), *node.get(READY, []), *inherited]
    documents = {str(ref[:-2]) for ref in references}  # a stride key's prefix holds a dict
    text = (
        f"{len(documents)} documents referenced: {open_pieces} pieces in {open_rows} open groups, "
        f"{ready_pieces} pieces in {ready_rows} closed rows not yet emitted"
    )
    if inherited:
        text += f", {len(inherited)} pieces inherited from other consumers in a rescale"
    if node.get(EXHAUSTED):
        text += "; its upstream's epoch is read to the end"
    return text


def _remap_lines(value: dict[str, Any], path: str) -> list[str]:
    """An elastic rescale's remap: what this shard strides over, level by level."""
    remap = Remap.from_json(value, path)
    lines = [f"rescaled epoch {remap.epoch}: strides over the {remap.length:,} positions left by earlier topologies"]
    for step in remap.steps:
        if isinstance(step, Offset):
            lines.append(f"  compacted level: position + {step.shift:,}")
            continue
        if isinstance(step, Reorder):
            names = ", ".join(
                f"{kind}({', '.join(f'{key}={value}' for key, value in config.items())})"
                for kind, config in step.orders
            )
            lines.append(f"  the {step.consumers:,} old consumers read their strides in the order of {names}")
            continue
        cursors = step.cursors
        lines.append(
            f"  level of {step.consumers:,} old consumers over {step.parent_length:,} positions: cursors "
            f"{int(cursors.min()):,}..{step.top:,}, band of {step.band:,} unread positions, "
            f"tail from {step.tail_start:,}"
        )
    return lines


def _files(state: dict[str, Any]) -> list[str]:
    lines = []
    for node in chain(state):
        files = node.get(FILES)
        if not isinstance(files, list):
            continue
        lines.append("")
        lines.append(f"files of {node[KIND]} ({len(files)}):")
        for name, size, mtime_ns, *_ in files:  # [path, size, mtime_ns, digest]; old states lack the digest
            when = _modified(mtime_ns, node[KIND])
            lines.append(f"  {name}  {size / 1e6:,.1f} MB  modified {when:%Y-%m-%d %H:%M:%S} UTC")
    return lines


def _modified(mtime_ns: int, where: str) -> datetime.datetime:
    """A file's modification time from its fingerprint; StateError if no date holds it."""
    try:
        return UNIX_EPOCH + datetime.timedelta(microseconds=mtime_ns // 1000)
    except OverflowError as error:
        raise StateError(f"{where}: a file's mtime_ns {_shown(mtime_ns)} is no date in the years 1 to 9999") from error


def check_readable(item: Found) -> None:
    """Raise StateError unless the report can read what it shows of ``item.state``: every
    node's kind, cursor, packer buffer, mix components, shard remap and file fingerprints.
    Only what the report reads is checked (a pipeline checks the rest when it restores);
    the error names the state file, rank and worker, the node's path and the field."""
    where = item.source if item.rank is None else f"{item.source} {_consumer_label(item)}"
    check_json(item.state, where)  # only JSON, and shallow enough to walk
    _check_nodes(item.state, where, "")


def _check_nodes(state: Any, where: str, outer: str) -> None:
    """A chain of node states down to its source, and each mix component's chain; ``outer``
    is the path that leads to ``state`` (empty for the outermost node)."""
    node, path, place = state, outer, outer or "the outermost node"
    while True:
        if not isinstance(node, dict):
            raise StateError(f"{where}: {place}: a node state is a {type(node).__name__}, not an object")
        kind = _entry(node, KIND, f"{where}: {place}", lambda value: isinstance(value, str), "a string")
        path = f"{path} > {kind}" if path else kind
        at = f"{where}: {path}"
        if POSITION in node:
            for key in (EPOCH, POSITION, LENGTH) if LENGTH in node else (EPOCH, POSITION):
                _entry(node, key, at, is_count, f"an int in [0, {INT64_MAX}]")
        if isinstance(node.get(FILES), list):
            for index, fingerprint in enumerate(node[FILES]):
                _check_fingerprint(fingerprint, f"{at}: state entry {FILES!r}[{index}]")
        if kind == Pack.kind:
            _check_pack_buffer(node, at)
        for key in (REMAP, NEXT_REMAP):
            if isinstance(node.get(key), dict):
                _remap_lines(node[key], at)  # reads the remap as the report does, or raises StateError
        components = node.get(COMPONENTS) or {}
        if not isinstance(components, dict):
            raise StateError(f"{at}: state entry {COMPONENTS!r} is {_shown(components)}, expected an object")
        for name, component in components.items():
            _check_nodes(component, where, f"{path}[{name}]")
        if UPSTREAM not in node:
            return
        node, place = node[UPSTREAM], f"{path} > {UPSTREAM}"


def _check_fingerprint(fingerprint: Any, at: str) -> None:
    """``[path, size, mtime_ns, digest]`` (older states lack the digest)."""
    if (
        not isinstance(fingerprint, list)
        or len(fingerprint) < LEGACY_FINGERPRINT_LENGTH
        or not isinstance(fingerprint[NAME], str)
        or not is_count(fingerprint[SIZE])
        or isinstance(fingerprint[MTIME_NS], bool)
        or not isinstance(fingerprint[MTIME_NS], int)
    ):
        raise StateError(f"{at} is {_shown(fingerprint)}, expected [path, size, mtime_ns, digest]")
    _modified(fingerprint[MTIME_NS], at)


def _check_pack_buffer(node: dict[str, Any], at: str) -> None:
    """The lists ``_pack_buffer`` counts, and the document key heading each reference (a
    compact ``refs`` entry decoded first: ``StateError`` naming ``at`` when it is damaged)."""
    if REFS in node or BASE_PROGRESS in node:
        node = listed(node, at)
    for key in (*PIECES, OPEN_SIZES, READY_SIZES):
        if key in node:
            _entry(node, key, at, lambda value: isinstance(value, list), "a list")
    for key in PIECES:
        for index, piece in enumerate(node.get(key, [])):
            if (
                not isinstance(piece, list)
                or len(piece) < 4
                or not all(is_count(value) for value in piece[-4:])
                or loaded_prefix(piece[:-4]) is None
            ):
                raise StateError(
                    f"{at}: state entry {key!r}[{index}] is {_shown(piece)}, "
                    "expected [mix component names..., epoch, record, start, end]"
                )


def _entry(holder: dict[str, Any], key: str, at: str, valid: Callable[[Any], bool], expected: str) -> Any:
    """``holder[key]``, if there and ``valid``; StateError naming the entry otherwise."""
    if key not in holder:
        raise StateError(f"{at}: state has no {key!r} entry")
    value = holder[key]
    if not valid(value):
        raise StateError(f"{at}: state entry {key!r} is {_shown(value)}, expected {expected}")
    return value


def _shown(value: Any) -> str:
    """``repr(value)``, cut short for a one-line error."""
    text = repr(value)
    return text if len(text) <= SHOWN_CHARACTERS else text[: SHOWN_CHARACTERS - 3] + "..."
