"""Keyed global shuffle: a random-access permutation of [0, n) in O(1) memory.

An epoch's order is ``perm(k)`` for ``k = 0 .. n-1`` where ``perm`` is a keyed
bijection computed by arithmetic, so any position can be evaluated on its own
(cheap resume, sharding) and no array of size ``n`` is ever built.

Construction, on the smallest power-of-two domain ``2**b >= n``:

* ``ROUNDS`` rounds of ``x = (a*x + c) mod 2**b`` (``a``, ``c`` odd) followed by
  ``x ^= x >> s``.  Both steps are bijections of ``[0, 2**b)``.  The multiply
  carries low bits upwards and the xorshift folds high bits back down; a single
  LCG alone is useless as a shuffle (its low bits cycle with short period and
  consecutive outputs are strongly correlated).
* Per-round constants come from splitmix64 of ``(seed, epoch)``, so every
  (seed, epoch) is an independent-looking permutation.
* Cycle walking maps the domain back into ``[0, n)``: while ``x >= n`` apply the
  bijection again.  Since ``2**b < 2*n``, fewer than two evaluations are needed
  on average.

Vectorised evaluation works in ``uint32`` when ``b <= 32`` (wrapping mod 2**32
then masking to ``b`` bits equals arithmetic mod ``2**b``) and ``uint64``
otherwise, in place, on cache-sized chunks.
"""

from __future__ import annotations

import operator
from typing import Any, ClassVar, Iterator, Mapping, cast

import numpy as np

from resumable.errors import ConfigError, StateError

__all__ = ["Permutation", "permutation_chunks"]

ROUNDS = 6
"""Multiply-add + xorshift rounds. 3 fail the consecutive-pair chi-square tests at N ~ 1e6; 4
pass them but keep structure at power-of-two lags (at N = 2**20, ``perm(k + 2**17) - perm(k)``
takes one value 836 times where a random order gives about 9: a multiplier with few high bits
carries a high-bit difference down too slowly); 6 leave none (``tests/test_order_adversary.py``)
for 25% more arithmetic, about 1 ns a record."""

LEGACY_ROUNDS = 4
"""The rounds of the orders saved before states named them (``ROUNDS_OPTION``): a state without
the entry continues in the order it was saved in."""

ROUNDS_OPTION = "rounds"
"""The state entry of a node whose order is a ``Permutation``: the rounds it was made with."""

_MIN_BITS = 4
"""Smallest domain (2**4 = 16) so tiny n still get distinct, varied constants and shifts."""

_CHUNK = 1 << 16
"""Elements per in-place pass in ``take``: 256 KiB of uint32, so working buffers stay in L2."""

_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _splitmix64(z: int) -> int:
    """splitmix64 output function of ``z``: a strong 64-bit integer hash (pure Python ints)."""
    z = (z + _GOLDEN) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def _check_nonnegative_int(name: str, value: object) -> int:
    """Return ``value`` as a non-negative int or raise ConfigError (bools are rejected)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ConfigError(f"{name} must be an int, got {type(value).__name__}")
    value = int(value)
    if value < 0:
        raise ConfigError(f"{name} must be >= 0, got {value}")
    return value


def saved_rounds(value: object, path: str) -> int:
    """The rounds a saved order was made with (``ROUNDS_OPTION``); StateError unless this
    library makes such orders."""
    if type(value) is not int or value not in (LEGACY_ROUNDS, ROUNDS):
        raise StateError(
            f"{path}: {ROUNDS_OPTION}={value!r} names no order this library makes ({LEGACY_ROUNDS} or {ROUNDS})"
        )
    return value


class PermutationRounds:
    """Mixin of a node whose order is a ``Permutation``: the rounds it makes (``rounds``, which
    its ``_config`` saves under ``ROUNDS_OPTION``), taken from a restored state (one without
    the entry: ``LEGACY_ROUNDS``) and renewed at a new epoch (``Node._saved_options``). Placed
    before the node's base class, so that ``_header_key`` adds the rounds to the base's."""

    _saved_options: ClassVar[Mapping[str, tuple[Any, Any]]] = {ROUNDS_OPTION: (LEGACY_ROUNDS, ROUNDS)}
    rounds: int = ROUNDS  # the node's own once a state or a new epoch sets it

    def _header_key(self) -> object:
        return (self.rounds, cast(Any, super())._header_key())

    def _set_saved_option(self, key: str, value: Any, path: str) -> None:
        self.rounds = saved_rounds(value, path)


class Permutation:
    """Keyed bijection of [0, n) for one (seed, epoch)."""

    n: int

    def __init__(self, n: int, seed: int, epoch: int = 0, rounds: int = ROUNDS) -> None:
        self.n = _check_nonnegative_int("n", n)
        seed = _check_nonnegative_int("seed", seed)
        epoch = _check_nonnegative_int("epoch", epoch)
        if _check_nonnegative_int("rounds", rounds) == 0:
            raise ConfigError("rounds must be >= 1")
        bits = max(_MIN_BITS, (self.n - 1).bit_length())
        self._mask = (1 << bits) - 1
        self._dtype = np.dtype(np.uint32) if bits <= 32 else np.dtype(np.uint64)
        # Masking is redundant when b fills the machine word: wrapping already reduces mod 2**b.
        self._needs_mask = bits != self._dtype.itemsize * 8
        # Cycle walking is only needed when the domain is larger than [0, n).
        self._walks = self.n < (1 << bits)
        # Round constants: consecutive outputs of a SplitMix64 stream seeded by hash(seed) ^ epoch.
        key = _splitmix64(seed & _M64) ^ (epoch & _M64)
        draws = [_splitmix64(key + i * _GOLDEN) for i in range(3 * rounds)]
        constants: list[tuple[int, int, int]] = []
        for r in range(rounds):
            a = (draws[3 * r] & self._mask) | 1
            c = (draws[3 * r + 1] & self._mask) | 1
            # Shift about b/2 (never 0 or b), jittered per round so rounds do not align.
            s = max(1, min(bits - 1, (bits + 1) // 2 + draws[3 * r + 2] % 3 - 1))
            constants.append((a, c, s))
        self._rounds = tuple(constants)

    def __len__(self) -> int:
        return self.n

    def __repr__(self) -> str:
        return f"Permutation(n={self.n})"

    def _bijection(self, x: int) -> int:
        """One application of the keyed bijection of [0, 2**b), on a Python int."""
        mask = self._mask
        for a, c, s in self._rounds:
            x = (a * x + c) & mask
            x ^= x >> s
        return x

    def __call__(self, k: int) -> int:
        """perm(k) for one index, in pure Python ints; raises IndexError if k is not in [0, n)."""
        k = operator.index(k)
        if not 0 <= k < self.n:
            raise IndexError(f"index {k} out of range for permutation of length {self.n}")
        return self._walk(self._bijection(k))

    def _walk(self, x: int) -> int:
        """Cycle-walk one domain value into [0, n)."""
        while x >= self.n:
            x = self._bijection(x)
        return x

    def _bijection_inplace(self, x: np.ndarray, tmp: np.ndarray) -> None:
        """Apply the bijection to ``x`` in place; ``tmp`` is scratch of the same length and dtype."""
        mask = self._mask
        for a, c, s in self._rounds:
            np.multiply(x, a, out=x)
            np.add(x, c, out=x)
            if self._needs_mask:
                np.bitwise_and(x, mask, out=x)
            np.right_shift(x, s, out=tmp)
            np.bitwise_xor(x, tmp, out=x)

    def _permute_inplace(self, x: np.ndarray) -> None:
        """Replace indices ``x`` (word dtype, all in [0, n)) by perm(x), cycle-walking only the stragglers."""
        tmp = np.empty_like(x)
        self._bijection_inplace(x, tmp)
        if not self._walks:
            return
        # Integer (not boolean) indexing: boolean masks of ~25% density are branch-mispredict slow.
        pending = np.flatnonzero(x >= self.n)
        while pending.size:
            y = x[pending]
            self._bijection_inplace(y, tmp[: y.size])
            x[pending] = y
            pending = pending[np.flatnonzero(y >= self.n)]

    def _take_range(self, start: int, stop: int) -> np.ndarray:
        """perm(start..stop-1) as int64, for ``stop - start`` up to about one chunk."""
        x = np.arange(start, stop, dtype=self._dtype)
        self._permute_inplace(x)
        return x.astype(np.int64)

    def take(self, ks: np.ndarray) -> np.ndarray:
        """Vectorised perm over an integer array of indices in [0, n); returns int64 of the same shape."""
        ks = np.asarray(ks)
        if ks.dtype.kind not in "iu":
            raise IndexError(f"indices must be an integer array, got dtype {ks.dtype}")
        if ks.size and (int(ks.min()) < 0 or int(ks.max()) >= self.n):
            raise IndexError(f"indices out of range for permutation of length {self.n}")
        flat = ks.reshape(-1)
        out = np.empty(flat.size, dtype=np.int64)
        for start in range(0, flat.size, _CHUNK):
            x = flat[start : start + _CHUNK].astype(self._dtype)
            self._permute_inplace(x)
            out[start : start + x.size] = x
        return out.reshape(ks.shape)


def permutation_chunks(n: int, seed: int, epoch: int, chunk_size: int = _CHUNK) -> Iterator[np.ndarray]:
    """Yield perm(0), ..., perm(n-1) in order as int64 arrays of ``chunk_size`` (the last may be shorter).

    Memory stays O(chunk_size) however large ``n`` is, for sequential shuffled reading.
    Arguments are validated here, at the call, not on the first ``next``.
    """
    chunk_size = _check_nonnegative_int("chunk_size", chunk_size)
    if chunk_size == 0:
        raise ConfigError("chunk_size must be >= 1")
    perm = Permutation(n, seed, epoch)
    starts = range(0, perm.n, chunk_size)
    return (perm._take_range(start, min(start + chunk_size, perm.n)) for start in starts)
