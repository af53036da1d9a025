"""States as a version before ``rounds`` saved them (4-round orders): made by running pipelines
whose permutation nodes keep the legacy rounds for every epoch, then dropping the entries."""

from __future__ import annotations

import json
from typing import Any, Callable

import pytest

from resumable import Node
from resumable.order.lcg import LEGACY_ROUNDS, ROUNDS_OPTION, PermutationRounds


def legacy(patch: pytest.MonkeyPatch) -> None:
    """Every permutation node built from now on (``built``) makes 4 rounds, every epoch."""
    patch.setattr(PermutationRounds, "_saved_options", {ROUNDS_OPTION: (LEGACY_ROUNDS, LEGACY_ROUNDS)})


def built(build: Callable[[], Node[Any]]) -> Node[Any]:
    """A pipeline whose nodes take their new-epoch rounds now, as at an epoch's start."""
    pipe = build()
    for node in pipe._subtree():
        node._renew_saved_options()
    return pipe


def _rewritten(state: Any, rewrite: Callable[[dict[str, Any]], dict[str, Any]]) -> Any:
    """``state`` with ``rewrite`` applied to every dict in it, inside JSON strings too (the
    worker states a Loader state holds), innermost first."""
    if isinstance(state, dict):
        return rewrite({key: _rewritten(value, rewrite) for key, value in state.items()})
    if isinstance(state, list):
        return [_rewritten(value, rewrite) for value in state]
    if isinstance(state, str) and state.startswith("{"):
        try:
            inner = json.loads(state)
        except ValueError:
            return state
        return json.dumps(_rewritten(inner, rewrite))
    return state


def without_rounds(state: Any) -> Any:
    """``state`` as a version before ``rounds`` saved it: the entry gone everywhere."""
    return _rewritten(state, lambda entries: {key: value for key, value in entries.items() if key != ROUNDS_OPTION})


def with_rounds(state: Any, rounds: Any) -> Any:
    """``state`` with every ``rounds`` entry set to ``rounds``."""
    return _rewritten(
        state, lambda entries: {**entries, ROUNDS_OPTION: rounds} if ROUNDS_OPTION in entries else entries
    )


def rounds_in(state: Any) -> set[Any]:
    """Every ``rounds`` value in ``state``."""
    found: set[Any] = set()

    def note(entries: dict[str, Any]) -> dict[str, Any]:
        if ROUNDS_OPTION in entries:
            found.add(entries[ROUNDS_OPTION])
        return entries

    _rewritten(state, note)
    return found
