"""The checks of the options a node or source is built with: written once, one form of message.

Integers may be Python ints or numpy integers (what configurations and numpy arithmetic give);
each is kept as the Python int it holds, so that states stay plain JSON. A bool is never a
number (``True`` is no batch size), and a flag is a bool (Python's or numpy's), never a value
taken by its truth (``drop_last="false"`` would drop). A bad option is a ``ConfigError`` naming
the node and the option when the node is built, not an error at its first item.
"""

from __future__ import annotations

import math
import numbers
import os
from typing import Any, Sequence, TypeGuard, overload

import numpy as np

from resumable.core.state import INT64_MAX
from resumable.errors import ConfigError

INT64_MIN = -(2**63)


SEED_MAX = 2**64 - 1
"""The largest seed: shuffles and mixes are keyed by its 64 bits (a numpy ``SeedSequence``'s
uint64 draws included)."""


def is_int(value: Any) -> TypeGuard[int | np.integer[Any]]:
    """Whether ``value`` is an integer option's value: an int or a numpy integer, not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


@overload
def int_option(kind: str, name: str, value: Any, *, least: int = 1, most: int | None = None) -> int: ...


@overload
def int_option(
    kind: str, name: str, value: Any, *, least: int = 1, most: int | None = None, optional: bool
) -> int | None: ...


def int_option(
    kind: str, name: str, value: Any, *, least: int = 1, most: int | None = None, optional: bool = False
) -> int | None:
    """``value`` as an int in ``[least, most]`` (None allowed with ``optional``), else a
    ``ConfigError`` naming ``kind`` and ``name``. ``most`` is where numpy arithmetic ends
    (``INT64_MAX``) for options that meet it; counts and seeds that stay in Python have none."""
    if value is None and optional:
        return None
    if not is_int(value) or value < least:
        wanted = {0: "a non-negative int", 1: "a positive int"}.get(least, f"an int >= {least}")
        raise ConfigError(f"{kind}: {name} must be {wanted}{' or None' if optional else ''}, got {value!r}")
    if most is not None and value > most:
        raise ConfigError(f"{kind}: {name} must be at most {most:,}, got {value!r}")
    return int(value)


@overload
def seed_option(kind: str, name: str, value: Any) -> int: ...


@overload
def seed_option(kind: str, name: str, value: Any, *, optional: bool) -> int | None: ...


def seed_option(kind: str, name: str, value: Any, *, optional: bool = False) -> int | None:
    """A seed: an int in ``[0, SEED_MAX]`` (None allowed with ``optional``). Orders are keyed by
    64 bits, so a larger seed would repeat a smaller one's order; it is refused instead."""
    return int_option(kind, name, value, least=0, most=SEED_MAX, optional=optional)


def int64_option(kind: str, name: str, value: Any, *, least: int = 1) -> int:
    """``int_option`` for a value that numpy arrays hold or count (at most ``INT64_MAX``)."""
    return int_option(kind, name, value, least=least, most=INT64_MAX)


def finite_float(value: Any) -> float | None:
    """``value`` as a float if it is a finite real number (Python's or numpy's, not a bool),
    else None: NaN, an infinity, or an int beyond the largest float (which ``float()`` refuses
    with an OverflowError)."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        return None
    try:
        converted = float(value)
    except OverflowError:
        return None
    return converted if math.isfinite(converted) else None


def flag_option(kind: str, name: str, value: Any) -> bool:
    """``value`` as a bool, if it is one (Python's or numpy's), else a ``ConfigError``."""
    if not isinstance(value, (bool, np.bool_)):
        raise ConfigError(f"{kind}: {name} must be a bool, got {value!r}")
    return bool(value)


def choice_option(kind: str, name: str, value: Any, choices: Sequence[str]) -> str:
    """``value`` if it is one of ``choices``, else a ``ConfigError`` listing them."""
    if not isinstance(value, str) or value not in choices:
        raise ConfigError(f"{kind}: unknown {name} {value!r}, expected one of {', '.join(map(repr, choices))}")
    return value


def directory_option(kind: str, name: str, value: Any) -> str | None:
    """``value`` as an absolute directory path, or None; an empty path (which would name the
    working directory) or one of another type is a ``ConfigError``."""
    if value is None:
        return None
    path = os.fspath(value) if isinstance(value, (str, os.PathLike)) else None
    if not isinstance(path, str) or not path:
        raise ConfigError(f"{kind}: {name} must be a directory path or None, got {value!r}")
    return os.path.abspath(path)
