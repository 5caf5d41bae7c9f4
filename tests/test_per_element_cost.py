"""Issue 20, "CPU per element, per dtype": the fast paths of the write pass give exactly
what one correct rounding of the exact product gives, checked against exact rational
arithmetic (fractions.Fraction) that shares no code with clipcli; and they take the fast
path (a table for bfloat16, cache-sized blocks for float32) instead of the whole-chunk
float64 temporaries and ml_dtypes' per-element rounding that cost 13-18 ns/element.
"""

from __future__ import annotations

import math
import tracemalloc
import warnings
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest

from clipcli.dtypes import finfo
from clipcli.numerics import rounding
from clipcli.numerics.search import exact_product_bits, truncate_factor

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)


def round_exactly(value: Fraction, negative: bool, digits: int, max_finite: float) -> float:
    """`value` rounded to nearest, ties to even, onto a binary format with `digits`
    significant bits and IEEE gradual underflow below 2**-126 (bfloat16 and float32 share
    float32's exponent range); beyond the largest finite value, inf."""
    magnitude = abs(value)
    if magnitude == 0:
        return -0.0 if negative else 0.0
    exponent = magnitude.numerator.bit_length() - magnitude.denominator.bit_length()
    if Fraction(2) ** exponent > magnitude:
        exponent -= 1  # now 2**exponent <= magnitude < 2**(exponent + 1)
    step = Fraction(2) ** (max(exponent, -126) - (digits - 1))
    rounded = round(magnitude / step) * step  # round() of a Fraction: ties to even
    result = math.inf if rounded > Fraction(max_finite) else float(rounded)
    return -result if negative else result


def reference_scaled(values: np.ndarray, scale: float, exponent: int) -> np.ndarray:
    """values * scale * 2**exponent, each rounded once to the values' dtype, exactly."""
    digits = 8 if values.dtype == BF16 else 24
    max_finite = float(finfo(values.dtype).max)
    factor = Fraction(scale) * Fraction(2) ** exponent
    out = []
    with np.errstate(invalid="ignore"):  # NaN entries
        wide = values.astype(np.float64)
    for x in wide:
        if not math.isfinite(x):
            out.append(x * scale)  # NaN stays NaN, inf stays inf (factor > 0)
            continue
        out.append(round_exactly(Fraction(x) * factor, math.copysign(1, x) < 0, digits, max_finite))
    with np.errstate(invalid="ignore"):
        return np.array(out, np.float64).astype(values.dtype)


def same_values(got: np.ndarray, want: np.ndarray) -> None:
    """Bit for bit, except that any NaN matches any NaN."""
    assert got.dtype == want.dtype
    bits = np.dtype(f"u{got.dtype.itemsize}")
    with np.errstate(invalid="ignore"):
        nan = np.isnan(want.astype(np.float64))
        assert np.array_equal(np.isnan(got.astype(np.float64)), nan)
    mismatch = np.flatnonzero((got.view(bits) != want.view(bits)) & ~nan)
    assert mismatch.size == 0, (got[mismatch[:5]], want[mismatch[:5]])


# The search's factors have exact_product_bits significant bits; --use-norm's C / N has
# all 53 (carried exactly, rounded once); a tiny factor needs the exponent and makes
# subnormals and zeros.
BF16_FACTORS = [
    (truncate_factor(0.7, exact_product_bits([BF16])), 0),
    (0.7, 0),
    (0.75, -130),
    (truncate_factor(1 / 3, exact_product_bits([BF16])), -5),
]


@pytest.mark.parametrize(("scale", "exponent"), BF16_FACTORS)
def test_bfloat16_scaling_of_every_value_is_one_correct_rounding(
    scale: float, exponent: int
) -> None:
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(BF16)
    got = rounding.scale_chunk(every, scale, exponent)
    same_values(got, reference_scaled(every, scale, exponent))


def test_bfloat16_scaling_goes_through_a_table() -> None:
    """One 65,536-entry table per factor (~1 ns/element), not ml_dtypes' rounding of each
    element (13 ns/element), for a chunk of at least 1/TABLE_SHARE of the values: the
    second chunk with the same factor adds no table, and a small chunk after it uses it.
    (Session 36: a chunk smaller than that, with a factor whose table is not made, is
    scaled directly: --norm made a table for every small tensor. The test's first chunk
    was 1,000 values; it is now the smallest that makes a table.)"""
    rounding._scale_table.cache_clear()
    rounding._TABLES_MADE.clear()
    size = (1 << 16) // rounding.TABLE_SHARE
    chunk = np.linspace(-3, 3, size, dtype=np.float32).astype(BF16)
    factor = truncate_factor(0.6, exact_product_bits([BF16]))
    rounding.scale_chunk(chunk, factor)
    rounding.scale_chunk(chunk[::-1].copy(), factor)
    rounding.scale_chunk(chunk[:1000].copy(), factor)
    info = rounding._scale_table.cache_info()
    assert (info.misses, info.hits) == (1, 2)


@pytest.mark.parametrize(
    "dtype", [BF16, np.dtype(np.float16), np.dtype(ml_dtypes.float8_e4m3fn)], ids=str
)
@pytest.mark.parametrize(("scale", "exponent"), BF16_FACTORS)
def test_a_small_chunk_is_scaled_as_its_table_would(
    dtype: np.dtype, scale: float, exponent: int
) -> None:
    """Below 1/TABLE_SHARE of the values (exactly at it, a table; one fewer, none) a chunk
    is scaled directly, to the same bits as the table gives (NaN, inf, subnormals and
    zeros of both signs included), without a warning."""
    rounding._scale_table.cache_clear()
    rounding._TABLES_MADE.clear()
    codes = 256**dtype.itemsize
    every = np.arange(codes, dtype=np.uint32).astype(f"u{dtype.itemsize}").view(dtype)
    table = rounding.scale_chunk(every, scale, exponent)  # the whole table's own values
    rounding._scale_table.cache_clear()
    rounding._TABLES_MADE.clear()
    at_least = codes // rounding.TABLE_SHARE
    rng = np.random.default_rng(codes)
    for size in (1, at_least - 1, at_least):
        picks = rng.choice(codes, size=size, replace=False)
        before = rounding._scale_table.cache_info().misses
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = rounding.scale_chunk(every[picks], scale, exponent)
        made = rounding._scale_table.cache_info().misses - before
        assert made == (1 if size == at_least else 0)
        assert np.array_equal(
            got.view(f"u{dtype.itemsize}"), table[picks].view(f"u{dtype.itemsize}")
        )


def float32_probe(size: int) -> np.ndarray:
    """Normal, subnormal, extreme and special float32 values, `size` of them."""
    rng = np.random.default_rng(size)
    values = rng.standard_normal(size).astype(np.float32)
    values[::7] *= np.float32(1e-38)  # near and below the normal range: subnormal outputs
    values[::11] = np.float32(3.4e38)
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1.4e-45, -1.4e-45], np.float32)
    values[: special.size] = special[:size]
    return values


@pytest.mark.parametrize("size", [1, rounding._SCALE_BLOCK - 1, rounding._SCALE_BLOCK])
@pytest.mark.parametrize(
    ("scale", "exponent"),
    [(truncate_factor(0.7, exact_product_bits([F32])), 0), (0.5859375, -3), (0.75, -140)],
)
def test_float32_blocked_scaling_is_one_correct_rounding(
    size: int, scale: float, exponent: int
) -> None:
    """At, below and past the block size (the last block short or full); factors as the
    search makes them, with and without an exponent."""
    values = float32_probe(size + (1 if size == rounding._SCALE_BLOCK else 0))
    sample = np.r_[0:64, values.size - 64 : values.size]
    sample = sample[(sample >= 0) & (sample < values.size)]
    got = rounding.scale_chunk(values, scale, exponent)
    assert got.shape == values.shape
    same_values(got[sample], reference_scaled(values[sample], scale, exponent))
    # Every element, against numpy's own float64 product and cast (exact product, one
    # rounding: the Fraction check above vouches for that pair on the sample).
    with np.errstate(over="ignore"):
        want = np.ldexp(values.astype(np.float64) * scale, exponent).astype(np.float32)
    same_values(got, want)


def test_float32_scaling_keeps_no_float64_copy_of_the_chunk() -> None:
    """The write pass scaled a float32 chunk through two float64 copies of it and a third
    array (fresh pages each: 4 ns/element); now blocks go through one buffer in cache. The
    peak of numpy's allocations is the output plus that buffer."""
    chunk = np.ones(1 << 20, np.float32)
    factor = truncate_factor(0.7, exact_product_bits([F32]))
    tracemalloc.start()
    try:
        rounding.scale_chunk(chunk, factor)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak <= chunk.nbytes + rounding._SCALE_BLOCK * 8 + (128 << 10)
