"""float8.from_float32 (float32 to the 8-bit floats on the integer bits) against ml_dtypes'
own cast, bit for bit: on float32 bit patterns spread over the whole range (NaN payloads
and infinities included), on every value's neighbourhood (ties to even, the float32
values either side), at the largest value and the tie past it, and at the edges of the
blocks it works in. And narrow_round, which uses it, against a rounding written from the
definition."""

import math
from fractions import Fraction
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from clipcli.dtypes import finfo, float64_values
from clipcli.numerics import float8, rounding

SERVED = [
    ml_dtypes.float8_e4m3fn,
    ml_dtypes.float8_e5m2,
    ml_dtypes.float8_e4m3,
    ml_dtypes.float8_e3m4,
]
NOT_SERVED = [
    ml_dtypes.float8_e4m3fnuz,
    ml_dtypes.float8_e5m2fnuz,
    ml_dtypes.float8_e4m3b11fnuz,
    ml_dtypes.float8_e8m0fnu,
    ml_dtypes.bfloat16,
    np.float16,
]


def ml_dtypes_codes(single: np.ndarray, dtype: np.dtype[Any]) -> np.ndarray:
    with np.errstate(all="ignore"):
        codes: np.ndarray = single.astype(dtype).view(np.uint8)
    return codes


def ours(single: np.ndarray, dtype: np.dtype[Any]) -> np.ndarray:
    narrow = float8.from_float32(single, dtype)
    assert narrow is not None
    assert narrow.dtype == dtype
    assert narrow.shape == single.shape
    return narrow.view(np.uint8)


def neighbourhoods(dtype: np.dtype[Any]) -> np.ndarray:
    """Every value, every midpoint, the largest's tie past it, float32's extremes, and the
    float32 values either side of each; both signs, NaN and inf too."""
    values = float64_values(dtype)
    finite = np.unique(np.abs(values[np.isfinite(values)]))
    middles = (finite[1:] + finite[:-1]) / 2
    past = finite[-1] + (finite[-1] - finite[-2]) / 2
    extremes = [3.4028234663852886e38, 2.0**-126, 2.0**-149, 1e-45, 0.0, math.inf]
    points = np.concatenate([finite, middles, [past, 2 * past, finite[-1] * 1.01], extremes])
    single = points.astype(np.float32)
    bits = single.view(np.uint32)
    near = [single, (bits + np.uint32(1)).view(np.float32), (bits - np.uint32(1)).view(np.float32)]
    nans = np.asarray([0x7FC0_0000, 0x7F80_0001, 0x7FBF_FFFF, 0x7FFF_FFFF], np.uint32)
    out = np.concatenate([*near, nans.view(np.float32)])
    return np.concatenate([out, -out])


@pytest.mark.parametrize("dtype", SERVED, ids=lambda d: np.dtype(d).name)
def test_every_neighbourhood_is_ml_dtypes(dtype: Any) -> None:
    single = neighbourhoods(np.dtype(dtype))
    assert ours(single, np.dtype(dtype)).tolist() == ml_dtypes_codes(single, dtype).tolist()


@pytest.mark.parametrize("dtype", SERVED, ids=lambda d: np.dtype(d).name)
def test_bit_patterns_across_the_range_are_ml_dtypes(dtype: Any) -> None:
    """A stride through all 2**32 float32 bit patterns (every exponent, both signs, NaN
    payloads, subnormals)."""
    single = np.arange(0, 1 << 32, 4099, dtype=np.uint64).astype(np.uint32).view(np.float32)
    assert np.array_equal(ours(single, np.dtype(dtype)), ml_dtypes_codes(single, dtype))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", SERVED, ids=lambda d: np.dtype(d).name)
def test_a_thirteenth_of_all_float32_is_ml_dtypes(dtype: Any) -> None:
    for start in range(0, 1 << 32, 1 << 28):
        bits = np.arange(start, start + (1 << 28), 13, dtype=np.uint64).astype(np.uint32)
        single = bits.view(np.float32)
        assert np.array_equal(ours(single, np.dtype(dtype)), ml_dtypes_codes(single, dtype))


@pytest.mark.parametrize("dtype", SERVED, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("extra", [-1, 0, 1])
@pytest.mark.parametrize("at", [0, -1])
def test_blocks_at_their_edges(dtype: Any, extra: int, at: int) -> None:
    """Arrays one under, at and one over a block, with inf, NaN, an overflow, a subnormal
    tie or -0.0 at either end: the same codes (inf and NaN in a block other than the
    first still reach ml_dtypes' cast)."""
    size = float8._ROUND_BLOCK + extra
    rng = np.random.default_rng(size)
    step = float(finfo(np.dtype(dtype)).smallest_subnormal)
    for odd in (math.inf, -math.nan, 1e6, -1e6, 1.5 * step, -0.0):
        single = (rng.standard_normal(size) * 0.1).astype(np.float32)
        single[at] = odd
        assert np.array_equal(ours(single, np.dtype(dtype)), ml_dtypes_codes(single, dtype))


@pytest.mark.parametrize("dtype", SERVED, ids=lambda d: np.dtype(d).name)
def test_shapes_and_strides(dtype: Any) -> None:
    rng = np.random.default_rng(3)
    for single in (
        np.asarray(0.3, np.float32),
        np.zeros(0, np.float32),
        rng.standard_normal((40, 30)).astype(np.float32)[:, ::3],
        rng.standard_normal((3, 4, 5)).astype(np.float32).transpose(2, 0, 1),
    ):
        want = ml_dtypes_codes(single, dtype)
        assert ours(single, np.dtype(dtype)).tobytes() == np.ascontiguousarray(want).tobytes()


@pytest.mark.parametrize("dtype", NOT_SERVED, ids=lambda d: np.dtype(d).name)
def test_other_dtypes_are_not_served(dtype: Any) -> None:
    """fnuz formats (NaN is -0's code), e8m0fnu (no sign), 16-bit floats: None, and
    narrow_round keeps ml_dtypes' cast for them."""
    assert float8.from_float32(np.ones(3, np.float32), np.dtype(dtype)) is None


def reference(x: float, dtype: Any) -> float:
    """x rounded to the fp8 dtype from the definition: nearest on the dtype's grid, ties to
    the even code; past the largest value (by half a step or more, the tie included when
    the largest code is odd), ml_dtypes' overflow value (inf, or NaN for fn formats)."""
    info = finfo(np.dtype(dtype))
    bits = int(info.nmant) + 1
    _, e = math.frexp(x)
    quantum = max(e - bits, int(math.log2(float(info.smallest_subnormal))))
    steps = Fraction(x) / Fraction(2) ** quantum
    nearest = round(steps)  # ties to even: an even multiple of the quantum is an even code
    value = Fraction(nearest) * Fraction(2) ** quantum
    if abs(value) > Fraction(float(info.max)):
        return float(np.asarray(math.copysign(math.inf, x), np.float32).astype(dtype))
    return math.copysign(0.0, x) if value == 0 else float(value)


@pytest.mark.parametrize("dtype", SERVED, ids=lambda d: np.dtype(d).name)
def test_narrow_round_is_the_definition(dtype: Any) -> None:
    """narrow_round (float64 to float32 rounded to odd, then from_float32) against the
    definition on float64 values at and around every tie, where a double rounding would
    go wrong."""
    values = float64_values(np.dtype(dtype))
    finite = np.unique(np.abs(values[np.isfinite(values)]))
    middles = (finite[1:] + finite[:-1]) / 2
    past = finite[-1] + (finite[-1] - finite[-2]) / 2
    points = np.concatenate([finite, middles, [past, finite[-1] * 1.01]])
    near = np.concatenate(
        [points, points * (1 + 2.0**-40), points * (1 - 2.0**-40), points * (1 + 2.0**-25)]
    )
    wide = np.concatenate([near, -near])
    with np.errstate(all="ignore"):
        got = rounding.narrow_round(wide, np.dtype(dtype)).astype(np.float64)
    want = np.asarray([reference(float(x), dtype) for x in wide])
    assert np.array_equal(got, want, equal_nan=True)
    assert np.array_equal(np.signbit(got), np.signbit(want))
