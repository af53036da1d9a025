"""Tests for the keyed global shuffle ``resumable.order.lcg``.

Covers exact bijectivity, scalar/vector agreement (also beyond 32 bits), keying by
(seed, epoch), and statistical quality of consecutive outputs against single-LCG
baselines, which the design doc says are not good enough.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from resumable.errors import ConfigError
from resumable.order.lcg import Permutation, permutation_chunks

# Standard normal quantile for a one-sided tail of 1e-4 (Phi^-1(1 - 1e-4)).
Z_1E4 = 3.719016485455709

SWEEP = sorted({0, 1, 2, 3} | {2**k + d for k in range(1, 21) for d in (-1, 0, 1)})


def chi2_critical(df: int, z: float) -> float:
    """Chi-square quantile by the Wilson-Hilferty approximation: df * (1 - h + z*sqrt(h))**3, h = 2/(9 df).

    With z = +Z_1E4 this is the upper critical value at alpha = 1e-4 (e.g. df=225 -> 312.6,
    df=49 -> 94.8, df=5 -> 26.3); with z = -Z_1E4 the lower one (statistic suspiciously small,
    i.e. too regular to be random).
    """
    h = 2.0 / (9.0 * df)
    return df * (1.0 - h + z * math.sqrt(h)) ** 3


def chi2_pairs(u: np.ndarray, v: np.ndarray, g: int) -> tuple[float, int]:
    """Chi-square statistic and df of the independence test on the g x g table of (u, v) cells."""
    table = np.bincount(u * g + v, minlength=g * g).reshape(g, g).astype(np.float64)
    expected = np.outer(table.sum(axis=1), table.sum(axis=0)) / table.sum()
    return float(((table - expected) ** 2 / expected).sum()), (g - 1) ** 2


def high_bits_stat(perm: np.ndarray, n: int) -> tuple[float, int]:
    """Consecutive pairs (perm[k], perm[k+1]) binned on a 16 x 16 grid of their top bits."""
    cells = perm * 16 // n
    return chi2_pairs(cells[:-1], cells[1:], 16)


def low_bits_stat(perm: np.ndarray) -> tuple[float, int]:
    """Consecutive pairs (perm[k] mod 8, perm[k+1] mod 8): the bits a bare LCG gets wrong."""
    cells = perm % 8
    return chi2_pairs(cells[:-1], cells[1:], 8)


def within(stat_df: tuple[float, int]) -> bool:
    """Two-sided acceptance at alpha = 1e-4 per tail."""
    stat, df = stat_df
    return chi2_critical(df, -Z_1E4) < stat < chi2_critical(df, Z_1E4)


def counter_lcg(bits: int, seed: int) -> np.ndarray:
    """Baseline 1, counter mode: perm(k) = (a*k + c) mod 2**bits with a, c odd."""
    rng = np.random.default_rng(seed)
    mask = (1 << bits) - 1
    a = int(rng.integers(0, 1 << bits)) | 1
    c = int(rng.integers(0, 1 << bits)) | 1
    k = np.arange(1 << bits, dtype=np.uint64)
    return ((a * k + c) & mask).astype(np.int64)


def iterated_lcg(bits: int, seed: int) -> np.ndarray:
    """Baseline 2, the full-period LCG sequence x[k+1] = (a*x[k] + c) mod 2**bits (a = 1 mod 4, c odd).

    Built by doubling: if x[k+m] = A_m x[k] + C_m then x[m:2m] = A_m x[:m] + C_m, and
    composing the map with itself gives A_2m = A_m**2, C_2m = A_m C_m + C_m.
    """
    rng = np.random.default_rng(seed)
    size = 1 << bits
    mask = size - 1
    mult, inc = (int(rng.integers(0, size)) * 4 + 1) & mask, int(rng.integers(0, size)) | 1
    x = np.empty(size, dtype=np.uint64)
    x[0] = int(rng.integers(0, size))
    m = 1
    while m < size:
        x[m : 2 * m] = (mult * x[:m] + inc) & mask
        mult, inc = (mult * mult) & mask, (mult * inc + inc) & mask
        m *= 2
    return x.astype(np.int64)


def full(n: int, seed: int, epoch: int = 0) -> np.ndarray:
    return Permutation(n, seed, epoch).take(np.arange(n))


# --- exact bijection -------------------------------------------------------------------------


@pytest.mark.parametrize("n", SWEEP)
def test_take_is_exact_bijection(n: int) -> None:
    out = Permutation(n, seed=12345, epoch=n % 3).take(np.arange(n))
    assert out.dtype == np.int64
    assert out.shape == (n,)
    np.testing.assert_array_equal(np.sort(out), np.arange(n))


@pytest.mark.parametrize(("n", "chunk"), [(0, 5), (1, 1), (1000, 1), (1000, 7), (200_003, 4096), (200_003, 1 << 16)])
def test_permutation_chunks_matches_take(n: int, chunk: int) -> None:
    chunks = list(permutation_chunks(n, seed=9, epoch=2, chunk_size=chunk))
    assert all(c.dtype == np.int64 for c in chunks)
    assert all(len(c) == chunk for c in chunks[:-1])
    got = np.concatenate(chunks) if chunks else np.empty(0, dtype=np.int64)
    np.testing.assert_array_equal(got, full(n, 9, 2))


def test_small_n_orders_are_uniform_over_seeds() -> None:
    """For n = 3 every one of the 6 orders appears about equally often across seeds."""
    orders = [tuple(full(3, seed)) for seed in range(3000)]
    counts = np.array([orders.count(o) for o in sorted(set(orders))], dtype=np.float64)
    assert len(counts) == 6
    stat = float(((counts - 500.0) ** 2 / 500.0).sum())
    assert stat < chi2_critical(5, Z_1E4)


# --- scalar vs vector, random access -----------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 17, 1000, 10**6, 2**32 - 1, 2**32, 2**32 + 1, 10**10, 2**63 - 1])
def test_scalar_matches_take(n: int) -> None:
    rng = np.random.default_rng(n % 1000)
    p = Permutation(n, seed=2**40 + 3, epoch=7)
    edges = [k for k in (0, 1, n - 2, n - 1, 2**32 - 1, 2**32) if 0 <= k < n]
    ks = np.concatenate([np.array(edges, dtype=np.int64), rng.integers(0, n, size=300, dtype=np.int64)])
    vec = p.take(ks)
    assert [p(int(k)) for k in ks] == vec.tolist()
    assert vec.min() >= 0 and vec.max() < n
    assert all(type(p(int(k))) is int for k in ks[:5])


@pytest.mark.parametrize("n", [2**32 + 1, 10**10])
def test_beyond_32_bits_distinct_and_in_range(n: int) -> None:
    """The uint64 path: a large sample of distinct positions maps to distinct values in [0, n)."""
    p = Permutation(n, seed=5, epoch=1)
    ks = np.unique(np.random.default_rng(1).integers(0, n, size=200_000, dtype=np.int64))
    vals = p.take(ks)
    assert vals.min() >= 0 and vals.max() < n
    assert np.unique(vals).size == ks.size
    window = p.take(np.arange(n - 300_000, n))
    assert np.unique(window).size == window.size
    assert abs(np.corrcoef(window[:-1], window[1:])[0, 1]) < 0.01


def test_take_preserves_shape_and_accepts_integer_dtypes() -> None:
    p = Permutation(60_000, seed=3)
    ks = np.arange(60_000, dtype=np.int64).reshape(300, 200)[::2, ::3]
    ref = p.take(ks)
    assert ref.shape == ks.shape and ref.dtype == np.int64
    for dtype in (np.uint16, np.int32, np.uint32, np.uint64):
        np.testing.assert_array_equal(p.take(ks.astype(dtype)), ref)
    assert p.take(np.empty((0, 4), dtype=np.int64)).shape == (0, 4)
    assert p.take(np.int64(5)).shape == ()
    assert int(p.take(np.int64(5))) == p(5)


# --- keying ------------------------------------------------------------------------------------


def test_deterministic_per_seed_and_epoch() -> None:
    np.testing.assert_array_equal(full(100_000, 42, 3), full(100_000, 42, 3))
    assert Permutation(10**10, 42, 3)(123_456_789) == Permutation(10**10, 42, 3)(123_456_789)


@pytest.mark.parametrize(
    ("a", "b"),
    [((0, 0), (0, 1)), ((0, 1), (0, 2)), ((0, 0), (1, 0)), ((1, 2), (2, 1)), ((2**40, 0), (2**40 + 1, 0))],
)
def test_different_keys_give_unrelated_orders(a: tuple[int, int], b: tuple[int, int]) -> None:
    n = 100_000
    pa, pb = full(n, *a), full(n, *b)
    assert np.mean(pa == pb) < 0.001
    assert abs(np.corrcoef(pa, pb)[0, 1]) < 0.02


# --- statistical quality -----------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 2**40 + 17])
def test_lag1_serial_correlation(seed: int) -> None:
    perm = full(10**6, seed, epoch=seed % 5).astype(np.float64)
    assert abs(np.corrcoef(perm[:-1], perm[1:])[0, 1]) < 0.01


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4])
def test_single_lcg_fails_pair_chi_square_and_ours_passes(seed: int) -> None:
    """Joint distribution of consecutive outputs on a high-bit and a low-bit grid, alpha = 1e-4 per tail.

    Critical values come from the Wilson-Hilferty approximation (``chi2_critical``): upper
    312.6 / lower 154.4 for the 16 x 16 high-bit grid (df = 225), upper 94.8 / lower 20.3 for
    the 8 x 8 low-bit grid (df = 49).
    """
    bits = 20
    for n in (1 << bits, 10**6):
        ours = full(n, seed, epoch=1)
        assert within(high_bits_stat(ours, n)), high_bits_stat(ours, n)
        assert within(low_bits_stat(ours)), low_bits_stat(ours)

    hi_upper = chi2_critical(225, Z_1E4)
    lo_upper = chi2_critical(49, Z_1E4)
    counter = counter_lcg(bits, seed)
    iterated = iterated_lcg(bits, seed)
    for baseline in (counter, iterated):
        np.testing.assert_array_equal(np.sort(baseline), np.arange(1 << bits))  # both are permutations
        # Low bits of an LCG step depend only on low bits: (x mod 8) determines (next mod 8).
        assert low_bits_stat(baseline)[0] > 100 * lo_upper
    # Counter mode: perm[k+1] = perm[k] + a, so the top bits of neighbours sit on a diagonal.
    assert high_bits_stat(counter, 1 << bits)[0] > 100 * hi_upper
    # The iterated LCG's pairs form a lattice: far too even (statistic far below the lower tail).
    assert high_bits_stat(iterated, 1 << bits)[0] < chi2_critical(225, -Z_1E4) / 10


# --- validation and properties -----------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(0, 5000),
    seed=st.integers(0, 2**70),
    epoch=st.integers(0, 2**40),
    data=st.data(),
)
def test_property_permutation_and_scalar_agreement(n: int, seed: int, epoch: int, data: st.DataObject) -> None:
    p = Permutation(n, seed, epoch)
    assert len(p) == n and p.n == n
    out = p.take(np.arange(n))
    np.testing.assert_array_equal(np.sort(out), np.arange(n))
    if n:
        ks = data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=40))
        assert [p(k) for k in ks] == p.take(np.array(ks)).tolist()
    for bad in (-1, n):
        with pytest.raises(IndexError):
            p(bad)
        with pytest.raises(IndexError):
            p.take(np.array([0, bad] if n else [bad]))


@given(
    n=st.one_of(st.integers(max_value=-1), st.floats(), st.text(max_size=3), st.none(), st.booleans()),
)
def test_property_invalid_n_raises_config_error(n: object) -> None:
    with pytest.raises(ConfigError):
        Permutation(n, 0)  # type: ignore[arg-type]  # deliberately wrong, to test the check


@given(
    bad=st.one_of(st.integers(max_value=-1), st.floats(), st.text(max_size=3), st.none(), st.booleans()),
    which=st.sampled_from(["seed", "epoch"]),
)
def test_property_invalid_seed_or_epoch_raises_config_error(bad: object, which: str) -> None:
    kwargs = {"n": 10, "seed": 1, "epoch": 0, which: bad}
    with pytest.raises(ConfigError):
        Permutation(**kwargs)  # type: ignore[arg-type]  # deliberately wrong, to test the check


def test_invalid_indices_and_chunk_size() -> None:
    p = Permutation(10, 1)
    with pytest.raises(IndexError):
        p.take(np.array([1.0, 2.0]))
    with pytest.raises(IndexError):
        p.take(np.array([True, False]))
    with pytest.raises(TypeError):
        p(1.5)  # type: ignore[arg-type]  # deliberately wrong, to test the check
    with pytest.raises(IndexError):
        Permutation(0, 1)(0)
    # Validated at the call, before any chunk is requested.
    with pytest.raises(ConfigError):
        permutation_chunks(10, 1, 0, chunk_size=0)
    with pytest.raises(ConfigError):
        permutation_chunks(-1, 1, 0)
