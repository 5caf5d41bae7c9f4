"""Issue 20, --axes on 8-bit floats: a chunk with a factor per slice is scaled through a
table of each factor's results on all 256 values (rounding._scale_by_tables) instead of
rounding element by element. The same bits as the element-by-element path for every
8-bit dtype, every code, factors from 1 down past the smallest subnormal and of all 53
bits, per row, per column and broadcast in three dimensions, strided chunks, exactly at
the size where tables start to pay and one element short of it; and, for the two OCP
formats, against exact rounding to nearest, ties to even, worked out with fractions from
ml_dtypes' own values (no clipcli code).
"""

from __future__ import annotations

from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
from small_floats import FP8_NAMES, dtypes_of

from clipcli.numerics import rounding

DTYPES = dtypes_of(FP8_NAMES)
PER_ENTRY = rounding.FACTOR_TABLES_FROM


def element_by_element(chunk: np.ndarray, scales: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):
        scaled: np.ndarray = rounding._scale(chunk, scales, 0)
    return scaled


def factors(count: int, seed: int, digits: int = 53) -> np.ndarray:
    """Factors in (0, 1] of at most `digits` significant bits, with 1, powers of two, ones
    small enough to take every value below the smallest subnormal and (with 53 digits)
    the longest float64 mantissa. (The --axes search makes factors short enough for each
    float64 product to be exact: the only rounding is then the last one.)"""
    rng = np.random.default_rng(seed)
    picked = rng.random(count)
    mantissas, powers = np.frexp(picked)
    picked = np.asarray(np.ldexp(np.floor(np.ldexp(mantissas, digits)), powers - digits))
    special = [1.0, 0.5, 2.0**-20, 2.0**-1074, 1.0 - 2.0 ** -min(digits, 53), 0.75]
    picked[: min(count, 6)] = special[: min(count, 6)]
    return picked


def all_codes(shape: tuple[int, ...], dtype: np.dtype, seed: int) -> np.ndarray:
    codes = np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)
    codes.reshape(-1)[:256] = np.arange(256, dtype=np.uint8)  # every code at least once
    return codes.view(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("shape", "scales_shape"),
    [((64, 4096), (64, 1)), ((8192, 33), (1, 33)), ((4, 2000, 40), (4, 1, 40))],
)
def test_the_same_bits_as_element_by_element(
    dtype: np.dtype, shape: tuple[int, ...], scales_shape: tuple[int, ...]
) -> None:
    chunk = all_codes(shape, dtype, seed=len(shape))
    scales = factors(int(np.prod(scales_shape)), seed=3).reshape(scales_shape)
    assert rounding._scale_by_tables(chunk, scales, 0) is not None  # the tables are used
    got = rounding.scale_chunk(chunk, scales)
    assert got.dtype == dtype
    assert got.shape == chunk.shape
    assert got.tobytes() == element_by_element(chunk, scales).tobytes()


@pytest.mark.parametrize("dtype", DTYPES[:2], ids=str)
def test_strided_chunks(dtype: np.dtype) -> None:
    whole = all_codes((128, 8192), dtype, seed=5)
    chunk = whole[::2, ::2]  # neither row nor column contiguous
    scales = factors(64, seed=6).reshape(64, 1)
    assert rounding._scale_by_tables(chunk, scales, 0) is not None
    assert rounding.scale_chunk(chunk, scales).tobytes() == (
        element_by_element(chunk, scales).tobytes()
    )


@pytest.mark.parametrize("dtype", DTYPES[:2], ids=str)
def test_tables_from_exactly_the_size_where_they_pay(dtype: np.dtype) -> None:
    rows = 3
    at_limit = rows * 256 * PER_ENTRY  # elements: exactly PER_ENTRY per table entry
    scales = factors(rows, seed=7).reshape(rows, 1)
    for per_row, used in ((at_limit // rows, True), (at_limit // rows - 1, False)):
        chunk = all_codes((rows, per_row), dtype, seed=per_row)
        assert (rounding._scale_by_tables(chunk, scales, 0) is not None) is used
        assert rounding.scale_chunk(chunk, scales).tobytes() == (
            element_by_element(chunk, scales).tobytes()
        )


def test_scales_that_do_not_broadcast_to_the_chunk_are_left_alone() -> None:
    dtype = np.dtype(ml_dtypes.float8_e4m3fn)
    chunk = all_codes((4, 4096), dtype, seed=8)
    assert rounding._scale_by_tables(chunk, np.full((4, 4096, 1), 0.5), 0) is None
    assert rounding._scale_by_tables(chunk, np.full((4, 1), 0.5), 1) is None


def nearest_even(value: Fraction, grid: list[tuple[Fraction, int]]) -> int:
    """The code of the representable magnitude nearest value, a tie to the even code."""
    best = min(grid, key=lambda entry: (abs(entry[0] - value), entry[1] % 2))
    return best[1]


@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e5m2"])
def test_against_exact_rounding(name: str) -> None:
    dtype = np.dtype(getattr(ml_dtypes, name))
    values = np.arange(256, dtype=np.uint8).view(dtype).astype(np.float64)
    positive = [(Fraction(float(values[c])), c) for c in range(128) if np.isfinite(values[c])]
    codes = np.arange(256, dtype=np.uint8)
    codes = codes[np.isfinite(values)]
    chunk = np.tile(codes, (12, 8)).view(dtype)  # every finite code in each row
    scales = factors(12, seed=9, digits=40).reshape(12, 1)
    got = rounding.scale_chunk(chunk, scales).view(np.uint8)
    for row in range(12):
        factor = Fraction(float(scales[row, 0]))
        for column in range(codes.size):
            code = int(codes[column])
            exact = Fraction(float(values[code])) * factor
            want = nearest_even(abs(exact), positive) | (code & 0x80)
            assert got[row, column] == want, (name, code, float(factor))
