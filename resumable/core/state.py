"""State format: version, keys, fingerprints and the checks that validate a loaded state.

A state is plain JSON data (dict, list, str, int, float, bool, None) so that loading one can
never run code. Every node's state names its kind and the format version; nodes nest their
upstream's state under ``UPSTREAM``. Errors name the node's path in the pipeline, for example
``Batch > Filter > Shuffle > JsonlSource``.
"""

from __future__ import annotations

import reprlib
from typing import Any, Mapping, Sequence, TypeGuard, cast

from resumable.errors import StateError

STATE_VERSION = 1

KIND = "kind"
VERSION = "version"
UPSTREAM = "upstream"
ENDED = "ended"
LOADER_FORMAT = "format"
LOADER_FORMAT_PREFIX = "resumable.Loader/"
"""How a Loader state announces itself (``resumable.loader_state``), so a pipeline can say what
to do when it is given one."""

JSON_SCALARS = (str, int, float, bool, type(None))
MAX_DEPTH = 200
"""Deepest nesting a state may have: a node adds one or two levels, so this allows pipelines of
about a hundred nodes while a hostile state cannot exhaust the stack of a recursive reader."""


def require(state: Mapping[str, Any], key: str, types: type | tuple[type, ...], path: str) -> Any:
    """Return ``state[key]``, raising StateError if it is missing or of the wrong type."""
    if key not in state:
        raise StateError(f"{path}: state has no {key!r} entry")
    value = state[key]
    wrong_bool = isinstance(value, bool) and types is int
    if not isinstance(value, types) or wrong_bool:
        raise StateError(f"{path}: state entry {key!r} is {short_repr(value)}, expected {_type_names(types)}")
    return value


INT64_MAX = 2**63 - 1
MAX_EPOCH = 2**62
"""The last epoch a node begins and a state holds: orders are keyed by the epoch in 64 bits, a
packer's references hold it in int64, and an elastic rescale counts to 2**62."""


def is_count(value: Any, upper: int = INT64_MAX) -> TypeGuard[int]:
    """An int (not a bool) in ``[0, upper]``: a count, position or size as a state saves it."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= upper


def epoch_after(kind: str, current: int, epoch: int | None) -> int:
    """The epoch a node begins: ``epoch`` when given, else the one after ``current``;
    StateError past ``MAX_EPOCH`` (an order keyed past 64 bits would repeat an earlier one)."""
    following = current + 1 if epoch is None else epoch
    if following > MAX_EPOCH:
        raise StateError(f"{kind}: epoch {following:,} is past the last one a state can count ({MAX_EPOCH:,})")
    return following


def require_epoch(state: Mapping[str, Any], key: str, path: str) -> int:
    """An epoch entry: an int in ``[0, MAX_EPOCH]``."""
    return require_count(state, key, path, upper=MAX_EPOCH)


def require_count(state: Mapping[str, Any], key: str, path: str, upper: int | None = None) -> int:
    """Return a non-negative int entry, at most ``upper`` when given."""
    value: int = require(state, key, int, path)
    if value < 0 or (upper is not None and value > upper):
        bound = f"[0, {upper}]" if upper is not None else ">= 0"
        raise StateError(f"{path}: state entry {key!r} is {value}, expected an int in {bound}")
    return value


def nested(state: Mapping[str, Any], where: tuple[str, ...], path: str) -> dict[str, Any]:
    """The state nested at ``where`` (a child's: ``("upstream",)``, ``("components", name)``)."""
    value: Any = state
    for key in where:
        if not isinstance(value, dict) or not isinstance(value.get(key), dict):
            raise StateError(f"{path}: state has no {'/'.join(where)!r} entry")
        value = value[key]
    return cast("dict[str, Any]", value)  # each step checked to be a dict


def put_nested(state: dict[str, Any], where: tuple[str, ...], value: dict[str, Any]) -> None:
    """Nest ``value`` in ``state`` at ``where``."""
    for key in where[:-1]:
        state = state.setdefault(key, {})
    state[where[-1]] = value


def child_path(path: str, where: tuple[str, ...], kind: str) -> str:
    """The path of a child in messages: ``Batch > Shard``, ``Mix[web] > Shard``."""
    return f"{path}[{where[-1]}] > {kind}" if len(where) > 1 else f"{path} > {kind}"


def check_header(state: Any, kind: str, path: str) -> None:
    """Check that ``state`` is a dict saved by a node of ``kind`` with this format version."""
    if not isinstance(state, dict):
        hint = (
            "; to continue every old consumer's states on this one, use resumable.elastic.restore(pipe, states)"
            if isinstance(state, list)
            else ""
        )
        raise StateError(f"{path}: expected a state dict, got {type(state).__name__}{hint}")
    if KIND not in state and str(state.get(LOADER_FORMAT, "")).startswith(LOADER_FORMAT_PREFIX):
        raise StateError(
            f"{path}: this is a state of rs.torch.Loader (format {state[LOADER_FORMAT]!r}), which holds every "
            "worker's pipeline state; restore it with loader.load_state_dict(state) on a Loader over this "
            "pipeline, not with pipe.set_state"
        )
    saved_kind = state.get(KIND)
    if saved_kind != kind:
        raise StateError(f"{path}: state was saved by a {saved_kind!r} node, this node is {kind!r}")
    saved_version = state.get(VERSION)
    if saved_version != STATE_VERSION:
        raise StateError(f"{path}: state format version {saved_version!r}, this library reads version {STATE_VERSION}")


def require_adjacent_epochs(states: Sequence[Mapping[str, Any]], key: str, path: str) -> list[int]:
    """The epoch count under ``key`` of each old consumer's state; StateError unless they lie in
    one epoch or two consecutive ones (consumers whose shards differ by one item straddle an
    epoch boundary for a moment, as after ``.repeat()``)."""
    values = [require_count(state, key, path) for state in states]
    if values and max(values) - min(values) > 1:
        raise StateError(
            f"{path}: old consumers are more than one epoch apart ({key} {sorted(set(values))}); they come from "
            "different checkpoints"
        )
    return values


def check_config(state: Mapping[str, Any], config: Mapping[str, Any], path: str) -> None:
    """Check that every option that shapes the data stream matches the saved one."""
    for key, expected in config.items():
        if key not in state:
            raise StateError(f"{path}: state has no {key!r} entry")
        saved = state[key]
        if saved != expected:
            raise StateError(
                f"{path}: state was saved with {key}={short_repr(saved)}, "
                f"this pipeline has {key}={short_repr(expected)}"
            )


def check_json(value: Any, path: str) -> None:
    """Raise StateError unless ``value`` is made of JSON types only (no tuples, numpy or tensors)
    nested at most ``MAX_DEPTH`` deep. Iterative, so a hostile state cannot exhaust the stack."""
    pending: list[tuple[Any, int]] = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, (dict, list)) and depth > MAX_DEPTH:
            raise StateError(f"{path}: state is nested more than {MAX_DEPTH} levels deep")
        if isinstance(item, dict):
            for key, child in item.items():
                if not isinstance(key, str):
                    raise StateError(f"{path}: state key {key!r} is not a string")
                pending.append((child, depth + 1))
        elif isinstance(item, list):
            pending.extend((child, depth + 1) for child in item)
        elif not isinstance(item, JSON_SCALARS):
            raise StateError(f"{path}: state holds a {type(item).__name__}, only JSON types are allowed")


def short_repr(value: Any, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters: a hostile state may hold huge values."""
    text = reprlib.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _type_names(types: type | tuple[type, ...]) -> str:
    if isinstance(types, tuple):
        return " or ".join(t.__name__ for t in types)
    return types.__name__
