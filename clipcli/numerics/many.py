"""Statistics of many small tensors at once (checkpoints of 100,000 tensors and more).

NormAccumulator.add costs a few microseconds of Python and numpy calls per tensor, which is
nothing beside a tensor of megabytes and everything beside one of a few elements. Here the
tensors of one to SHORT elements of a dtype on add()'s fast path are measured together, in
a handful of vectorised passes; every other tensor goes through add() itself.

The results are add()'s, bit for bit: the values are widened exactly (as add widens them),
max and min are exact whatever the order, and a sum of at most two exact float64 squares is
rounded once, whoever adds it. Longer tensors would be summed in another order than add's
dot product, so they are left to add.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from clipcli.dtypes import is_bfloat16, is_float8
from clipcli.numerics import float16, lookup
from clipcli.numerics.norms import SAFE_HI, SAFE_LO, NormAccumulator, ScaledSum, accumulate

SHORT = 2  # elements


def accumulate_each(arrays: Sequence[np.ndarray]) -> list[NormAccumulator]:
    """A finished NormAccumulator for each flat array, as add() would make it."""
    accumulators: list[NormAccumulator | None] = [None] * len(arrays)
    short, others = _short_by_dtype(arrays)
    for index in others:
        accumulators[index] = accumulate((arrays[index],))
    for dtype, indices in short.items():
        made = _measure_short(dtype, [arrays[i] for i in indices])
        for index, acc in zip(indices, made, strict=True):
            accumulators[index] = acc
    return accumulators  # type: ignore[return-value]  # every index was filled above


def _short_by_dtype(
    arrays: Sequence[np.ndarray],
) -> tuple[dict[np.dtype[Any], list[int]], list[int]]:
    """The positions of the short arrays (_is_short), by dtype, and those of every other
    array."""
    short: dict[np.dtype[Any], list[int]] = {}
    others: list[int] = []
    for index, array in enumerate(arrays):
        if _is_short(array):
            short.setdefault(array.dtype, []).append(index)
        else:
            others.append(index)
    return short, others


def _is_short(array: np.ndarray) -> bool:
    """One to SHORT elements of a dtype add() widens to float32, or one float64 element."""
    if array.dtype == np.float64:
        return array.size == 1
    return 0 < array.size <= SHORT and _widening(array.dtype) is not None


def _widening(dtype: np.dtype[Any]) -> float | None:
    """For a dtype that add() widens to float32 on its fast path: the magnitude from which
    the widened values are not the data's (float16's bit trick: inf and NaN), else None."""
    if dtype == np.float32 or is_bfloat16(dtype) or is_float8(dtype):
        return np.inf
    if dtype == np.float16:
        return float16.TRICK_NONFINITE
    return None


def _as_float32(flat: np.ndarray) -> np.ndarray:
    """The values exactly, as float32 (float16's non-finite values excepted)."""
    if flat.dtype == np.float32:
        return flat
    if flat.dtype == np.float16:
        return float16.bits_as_float32(flat)
    if is_float8(flat.dtype):
        return lookup.as_float32(flat)
    return flat.astype(np.float32)


def norms_each(arrays: Sequence[np.ndarray]) -> list[float]:
    """The L2 norm of each flat array: accumulate_each(arrays)[k].norm, bit for bit,
    without making an accumulator of each short one. A sum of one or two squares of
    float32 values lies within float64's normal range (2**-298 to 2**256), where
    NormAccumulator.norm's sqrt of the sum's mantissa, scaled back by a power of two, is
    the correctly rounded sqrt of the sum itself."""
    norms: list[float | None] = [None] * len(arrays)
    short, others = _short_by_dtype(arrays)
    for index in others:
        norms[index] = accumulate((arrays[index],)).norm
    for dtype, indices in short.items():
        members = [arrays[i] for i in indices]
        columns = _ShortColumns.of(dtype, members)
        roots = np.sqrt(columns.sums).tolist()
        for index, array, on_fast_path, root in zip(
            indices, members, columns.fast.tolist(), roots, strict=True
        ):
            norms[index] = root if on_fast_path else accumulate((array,)).norm
    return norms  # type: ignore[return-value]  # every index was filled above


class _ShortColumns(NamedTuple):
    """What add() works out of each of many short tensors of one dtype, at once: their
    sizes, largest and smallest values, float64 sums of squares, and whether each is on
    add()'s fast path (finite, the widened values the data's own)."""

    sizes: np.ndarray
    highs: np.ndarray
    lows: np.ndarray
    sums: np.ndarray
    fast: np.ndarray

    @classmethod
    def of(cls, dtype: np.dtype[Any], arrays: list[np.ndarray]) -> _ShortColumns:
        if dtype == np.float64:
            return cls._of_float64(arrays)
        bound = _widening(dtype)
        assert bound is not None
        sizes = np.fromiter((a.size for a in arrays), np.intp, len(arrays))
        starts = np.zeros(len(arrays), np.intp)
        np.cumsum(sizes[:-1], out=starts[1:])
        values = _as_float32(np.concatenate(arrays))
        with np.errstate(invalid="ignore"):  # a signalling NaN widens quietly, as in add()
            wide = values.astype(np.float64)
        if len(values) == len(arrays):  # one element each (200,000 of them): no reductions
            highs = lows = values
            sums = wide * wide
        else:
            highs = np.maximum.reduceat(values, starts)
            lows = np.minimum.reduceat(values, starts)
            sums = np.add.reduceat(wide * wide, starts)
        with np.errstate(invalid="ignore"):  # NaN compares False: add() takes those
            fast = (-bound < lows) & (highs < bound)
        return cls(sizes, highs, lows, sums, fast)

    @classmethod
    def _of_float64(cls, arrays: list[np.ndarray]) -> _ShortColumns:
        """One float64 element each (a float64 checkpoint of 193,600 tensors spent 3 s in
        add() a tensor at a time). add() squares x once, unscaled where |x| is within
        [SAFE_LO, SAFE_HI] or 0 (rescale_exponent 0): x * x here is that product, and the
        others (NaN, inf, extreme magnitudes) go to add() itself. Two elements would not
        do: add()'s dot product may fuse a multiply into its add."""
        values = np.concatenate(arrays)
        magnitudes = np.abs(values)
        with np.errstate(over="ignore", under="ignore", invalid="ignore"):
            sums = values * values
            fast = ((magnitudes >= SAFE_LO) & (magnitudes <= SAFE_HI)) | (values == 0)
        return cls(np.ones(len(arrays), np.intp), values, values, sums, fast)


def _measure_short(dtype: np.dtype[Any], arrays: list[np.ndarray]) -> list[NormAccumulator]:
    sizes, highs, lows, sums, fast = _ShortColumns.of(dtype, arrays)
    # frexp of each sum at once: (0.0, 0) for a zero sum, which is ScaledSum()'s own state.
    mants, exps = np.frexp(sums)
    high_list = highs.tolist()
    # One element each: the same floats, held once (~5 MB for 200,000 tensors).
    low_list = high_list if lows is highs else lows.tolist()
    rows = zip(
        arrays,
        fast.tolist(),
        high_list,
        low_list,
        mants.tolist(),
        exps.tolist(),
        sizes.tolist(),
        strict=True,
    )
    made = []
    for array, on_fast_path, high, low, mant, exp, numel in rows:
        if not on_fast_path:
            made.append(accumulate((array,)))
            continue
        # What add() makes of one finite chunk in a fresh accumulator, built at once (every
        # field up to max_value given: 200,000 tensors): the sum as ScaledSum.add(sumsq, 0)
        # carries it, the extremes as max/min against the fresh ones keep them (a finite
        # high is > -inf, a finite low < inf); no infinity, NaN nor non-finite value.
        made.append(
            NormAccumulator(ScaledSum(mant, exp), max(0.0, high, -low), 0, 0, 0, numel, low, high)
        )
    return made
