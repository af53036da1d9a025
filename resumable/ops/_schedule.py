"""The arithmetic of a mix's schedule: which component hands out the next item.

Pure functions of the schedule's counters, the weights and a seed; ``resumable.ops.mix.Mix``
keeps the counters and applies them.

``"smooth"`` (largest credit first, the "smooth weighted round-robin" rule). Each eligible
component ``i`` (active, weight > 0) has a credit ``c_i``; its share is
``p_i = w_i / sum(w over eligible)``. At every step the component with the largest ``c_i + p_i``
is chosen; then every eligible credit grows by its ``p_i`` and the chosen one loses 1. Credits
sum to zero and stay bounded, so after ``t`` items each component has handed out ``p_i * t``
items up to a bounded error (of the order of the number of components) at *every* ``t``: no
bursts, no drift, and the realised proportions match the weights from the first hundred items
on, where a random draw is off by ``O(sqrt(t))``. Ties (equal weights give one every few steps)
are broken by a splitmix64 hash keyed by ``(seed, epoch, step, component)``, so the order within
each round varies with the seed instead of always favouring the first name.

``"random"``: independent keyed draws. At step ``t`` of mix epoch ``e``,
``u = splitmix64(key(seed, e) + t)`` mapped to ``[0, 1)`` picks a component by cumulative
weight over the eligible ones, in the order the components were given: a pure function of
``(seed, epoch, step, weights, eligible set)``.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

from resumable.order.lcg import _splitmix64

_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
TIE = 1e-9
"""Scores closer than this are a tie (float sums of shares such as 1/3 are not exact)."""


def shares(
    names: Sequence[str], weights: Mapping[str, float], active: Mapping[str, bool]
) -> tuple[list[str], dict[str, float]]:
    """The eligible components (active, weight > 0), in ``names`` order, and their shares of
    the eligible weight."""
    eligible = [name for name in names if active[name] and weights[name] > 0]
    total = sum(weights[name] for name in eligible)
    if not math.isfinite(total):  # finite weights near the largest float: their shares, scaled first
        top = max(weights[name] for name in eligible)
        scaled = {name: weights[name] / top for name in eligible}
        total = sum(scaled.values())
        return eligible, {name: scaled[name] / total for name in eligible}
    return eligible, {name: weights[name] / total for name in eligible}


def epoch_key(seed: int, epoch: int) -> int:
    """splitmix64 of ``(seed, epoch)``: the key every step of a mix epoch derives its own from."""
    return _splitmix64((_splitmix64(seed & _M64) ^ epoch) & _M64)


def step_key(epoch_key: int, step: int) -> int:
    """splitmix64 of ``(seed, epoch, step)``, from the epoch's key."""
    return _splitmix64((epoch_key + step * _GOLDEN) & _M64)


def draw(key: int, eligible: Sequence[str], shares: Mapping[str, float]) -> str:
    """The ``"random"`` schedule's choice: ``key`` as a uniform ``[0, 1)`` draw, picking by
    cumulative share in ``eligible`` order."""
    u = (key >> 11) / float(1 << 53)
    cumulative = 0.0
    for name in eligible:
        cumulative += shares[name]
        if u < cumulative:
            return name
    return eligible[-1]


def leaders(eligible: Sequence[str], shares: Mapping[str, float], credits: Mapping[str, float]) -> list[str]:
    """The ``"smooth"`` schedule's candidates: the eligible components whose credit plus share
    is the largest (within ``TIE``), in ``eligible`` order."""
    scores = {name: credits[name] + shares[name] for name in eligible}
    best = max(scores.values())
    return [name for name in eligible if scores[name] >= best - TIE]


def break_tie(tied: Sequence[str], names: Sequence[str], key: int) -> str:
    """One of ``tied``, chosen by a hash of the step's ``key`` and each one's place in ``names``."""
    return min(tied, key=lambda name: _splitmix64((key + names.index(name)) & _M64))
