"""Sums of squares with a rigorous error bound: for the final "<= C" decisions, where a
plain float64 dot product (off by ~1e-14, about 150 float64 roundings of the norm) cannot
tell. Each square is split exactly into two float64s (Dekker), the high parts are added
pairwise keeping each addition's exact error (TwoSum), and only those tiny errors are added
in plain float64, with their error bounded; small sets of them exactly, as fractions.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

from clipcli.numerics.widening import widen_real


def two_square(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x*x as an exact sum high + low (Dekker's split; |x| well inside float64's range)."""
    high = x * x
    split = x * 134217729.0  # 2**27 + 1
    x_high = split - (split - x)
    x_low = x - x_high
    return high, ((x_high * x_high - high) + 2 * x_high * x_low) + x_low * x_low


def split_sumsq(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For rows of values of magnitude at most 1: (main, rest) such that each row's sum of
    squares is exactly main + rest.sum(axis=1) (squares below 2**-1074 aside, see
    underflow_bound). Each square is split exactly into two float64s (Dekker), the high
    parts are added pairwise keeping each addition's exact error (TwoSum): only the tiny
    terms in `rest` are left to add."""
    high, low = two_square(x)
    errors = [low]
    level = high
    while level.shape[1] > 1:
        if level.shape[1] % 2:
            level = np.pad(level, ((0, 0), (0, 1)))
        a, b = level[:, 0::2], level[:, 1::2]
        level = a + b
        b_part = level - a
        errors.append((a - (level - b_part)) + (b - b_part))
    return level[:, 0], np.concatenate(errors, axis=1)


def underflow_bound(x: np.ndarray) -> np.ndarray:
    """Per row, what squares lost to underflow may miss: elements below 2**-400 (relative to
    the peak of 1) may have squares below float64's normal range."""
    result: np.ndarray = 4 * np.count_nonzero(np.abs(x) < 2.0**-400, axis=1) * 2.0**-1074
    return result


def sumsq_error_bound(x: np.ndarray, rest: np.ndarray) -> np.ndarray:
    """Per row, a bound of the error of main + (rest summed in plain float64): the float64
    sum of rest errs by at most (terms + 4) roundings of the sum of magnitudes."""
    rounding = (rest.shape[1] + 4) * 2.0**-53 * np.abs(rest).sum(axis=1) * 2
    result: np.ndarray = rounding + underflow_bound(x)
    return result


# Up to this many error terms, CertainSumsq adds them as fractions: exact, so that a small
# tensor whose norm is exactly C is recognised as such.
_EXACT_REST = 4096


class CertainSumsq:
    """A sum of squares with a rigorous error bound, for the final "<= C" check of float64
    output (a plain float64 dot product errs by ~1e-14 there, about 150 float64 roundings
    of the norm). Each square is split exactly into two float64s (Dekker), the high parts
    are added pairwise with each addition's exact error kept (TwoSum), and only those tiny
    errors are added in plain float64, with their error bounded. Chunks combine exactly,
    as fractions. About 20 ns per element."""

    def __init__(self) -> None:
        self.total = Fraction(0)
        self.bound = Fraction(0)

    def add(self, chunk: np.ndarray) -> None:
        magnitudes = np.abs(widen_real(chunk)).reshape(-1)
        magnitudes = magnitudes[magnitudes != 0]
        if magnitudes.size == 0:
            return
        exp = math.frexp(float(magnitudes.max()))[1]
        x = np.ldexp(magnitudes, -exp)[None, :]  # below 1; tiny ones may underflow
        main, rest = split_sumsq(x)
        weight = Fraction(4) ** exp
        if rest.shape[1] <= _EXACT_REST:  # small: add the exact errors exactly (a norm == C)
            exact = sum((Fraction(v) for v in rest[0][rest[0] != 0].tolist()), Fraction(0))
            error = float(underflow_bound(x)[0])
        else:
            exact = Fraction(float(np.sum(rest)))
            error = float(sumsq_error_bound(x, rest)[0])
        self.total += (Fraction(float(main[0])) + exact) * weight
        self.bound += Fraction(error) * weight

    def merge(self, other: CertainSumsq) -> None:
        self.total += other.total
        self.bound += other.bound

    def at_most(self, limit: float | Fraction) -> bool:
        """Whether the norm is certainly <= limit."""
        return self.total + self.bound <= Fraction(limit) ** 2

    def over(self, limit: float) -> float:
        """norm / limit (the bound aside), computed exactly before the last rounding."""
        try:
            return math.sqrt(self.total / Fraction(limit) ** 2)
        except OverflowError:
            return math.inf

    @property
    def norm(self) -> float:
        """The norm (the bound aside), inf beyond float64's range."""
        if self.total <= 0:
            return 0.0
        half = (self.total.numerator.bit_length() - self.total.denominator.bit_length()) // 2
        try:
            return math.ldexp(math.sqrt(self.total / Fraction(4) ** half), half)
        except OverflowError:
            return math.inf
