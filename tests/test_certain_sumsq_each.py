"""certain.sumsq_each: the certain sums of squares of many small arrays at once (ties
decided together), the very fractions CertainSumsq.add gives each array alone (total and
bound, exactly), and against an exact reference (fractions of the values, no clipcli code):
the total is within the bound of it."""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from clipcli.numerics import certain
from clipcli.numerics.certain import CertainSumsq, sumsq_each

DTYPES: list[Any] = [
    np.float32,
    np.float64,
    np.float16,
    ml_dtypes.bfloat16,
    ml_dtypes.float8_e4m3fn,
    ">f4",
    np.complex64,
]


def alone(array: np.ndarray) -> CertainSumsq:
    result = CertainSumsq()
    result.add(array)
    return result


def exact(array: np.ndarray) -> Fraction:
    if array.dtype.kind == "c":
        parts = array.astype(np.complex128).reshape(-1).view(np.float64)
    else:
        parts = array.astype(np.float64).reshape(-1)
    return sum((Fraction(float(v)) ** 2 for v in parts), Fraction(0))


def small_arrays(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    arrays = []
    for k in range(400):
        dtype = DTYPES[k % len(DTYPES)]
        size = int(rng.choice([0, 1, 1, 2, 3, 5, 17, 64, 300]))
        values = rng.standard_normal(size) * float(rng.choice([1e-3, 1.0, 1e3]))
        if np.dtype(dtype).kind == "c":
            values = values + 1j * rng.standard_normal(size)
        if dtype is ml_dtypes.float8_e4m3fn:
            values = np.clip(values, -448, 448)  # no infinity: past it is NaN
        array = values.astype(dtype)
        if size and k % 5 == 0:
            array[rng.integers(0, size)] = 0  # zeros are left out of the rows
        if size and k % 7 == 0:
            array[:] = 0
        arrays.append(array)
    arrays.append(np.array([5e-324, 1e300, -1e-300], np.float64))  # underflowing squares
    arrays.append(np.array([1e-45, -0.0, 3e38], np.float32))
    arrays.append(np.array([-0.0], np.float64))
    return arrays


@pytest.mark.parametrize("seed", range(3))
def test_each_is_add_alone_fraction_for_fraction(seed: int) -> None:
    arrays = small_arrays(seed)
    for array, together in zip(arrays, sumsq_each(arrays), strict=True):
        by_itself = alone(array)
        assert (together.total, together.bound) == (by_itself.total, by_itself.bound)
        assert abs(together.total - exact(array)) <= together.bound


@pytest.mark.parametrize("extra", [-1, 0, 1])
def test_rows_at_the_limit_of_nonzero_values(extra: int) -> None:
    """EACH_UP_TO nonzero values are a row; one more goes through add(); zeros beside
    them do not count."""
    n = certain.EACH_UP_TO + extra
    rng = np.random.default_rng(n)
    arrays = []
    for dtype in (np.float32, np.float64):
        values = rng.standard_normal(n + 3).astype(dtype)
        values[[0, 5, -1]] = 0
        arrays.append(values)
        arrays.append(rng.standard_normal(n).astype(dtype))
    for array, together in zip(arrays, sumsq_each(arrays), strict=True):
        by_itself = alone(array)
        assert (together.total, together.bound) == (by_itself.total, by_itself.bound)


def test_a_norm_exactly_at_the_limit_is_within() -> None:
    """[3, 4] has norm 5 exactly: at_most(5) holds, at_most(5 - ulp) does not."""
    arrays = [np.array([3.0, 4.0], np.float32), np.array([0.0, 3.0, 0.0, 4.0])]
    for result in sumsq_each(arrays):
        assert result.at_most(5.0)
        assert not result.at_most(np.nextafter(5.0, 0.0))
