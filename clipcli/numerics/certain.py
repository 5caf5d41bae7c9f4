"""Sums of squares with a rigorous error bound: for the final "<= C" decisions, where a
plain float64 dot product (off by ~1e-14, about 150 float64 roundings of the norm) cannot
tell. Each square is split exactly into two float64s (Dekker), the high parts are added
pairwise keeping each addition's exact error (TwoSum), and only those tiny errors are added
in plain float64, with their error bounded; small sets of them exactly, as fractions.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from fractions import Fraction

import numpy as np

from clipcli.errors import NotFiniteError
from clipcli.numerics.widening import widen_real


def two_square(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x*x as an exact sum high + low (Dekker's split; |x| well inside float64's range)."""
    high = x * x
    split = x * 134217729.0  # 2**27 + 1
    x_high = split - (split - x)
    x_low = x - x_high
    return high, ((x_high * x_high - high) + 2 * x_high * x_low) + x_low * x_low


# A count below 2**53 is split into a multiple of this (at most 27 significant bits) and a
# rest below it (at most 26): either part times a square of at most 26 significant bits is
# an exact float64.
_COUNT_SPLIT = 2.0**26
# Outside these limits C**2's Dekker split could overflow or lose bits: fractions instead.
_SPLIT_RANGE = (1e-140, 1e140)


def counted_squares_within(values: np.ndarray, counts: np.ndarray, limit: float) -> bool:
    """Whether sum(counts * values**2) <= limit**2, exactly. values: float64 of at most 13
    significant bits whose squares are normal float64s (8- and 16-bit floats' values, and
    products rounded to them); counts: float64 integers below 2**53. Each term is exact
    (the counts split in two), C**2 is split exactly (Dekker), and the terms are added up
    exactly (terms_at_most): ~1 ms for 65,536 terms, where fractions took a second."""
    split = limit_split(limit)
    if split is None:
        return _fractions_within(values, counts, limit)
    low, high = counted_terms(values, counts)
    return terms_at_most(low if high is None else np.concatenate([low, high]), split)


def terms_at_most(terms: np.ndarray, split: tuple[float, float]) -> bool:
    """Whether the exact sum of `terms` (float64, fewer than 2**40, each of magnitude at
    most 2**1000 / n: sigma below must be a float64; clipcli's terms, counts times squares
    of 8/16-bit values, are below 2**320) is at most high + low (limit_split), exactly.
    Attack s33ext found OverflowError past that (terms of 1e303 with n >= 2**15), and
    inputs built against it (a ladder of powers of two that cancel, one per pass, beside
    a million tiny terms) 10x slower than math.fsum; clipcli's nonnegative terms span
    ~570 bits, a few passes. The terms are
    added up by extraction (Rump, Ogita and Oishi's ExtractVector): with sigma a power of
    two at least 2 * n * max|t|, each q = (sigma + t) - sigma is exact and a multiple of
    2**-53 * sigma, so the q add up exactly in any order, and t - q is exact, of either
    sign, at most 2**-53 * sigma in size; the rests are extracted again. After each pass
    the exact sum of the parts so far and -C**2 (math.fsum: correctly rounded) decides
    wherever it is further from 0 than all that is left can move it (n * max|rest|), or
    the next pass runs. Each pass takes ~53 - log2(n) bits of the terms' range; math.fsum
    over the terms themselves cost ~260 ns a term where their exponents spread wide
    (attack s33num2: 13 ms for each of 49,501 bfloat16 squares spanning 1e60 to 1e-80)."""
    parts = [-split[0], -split[1]]
    for part, rest in _extracted(terms):
        parts.append(part)
        so_far = math.fsum(parts)  # the exact sum of the parts, correctly rounded
        left = rest.size * float(np.max(np.abs(rest))) * (1 + 2.0**-50) if rest.size else 0.0
        slack = abs(so_far) * 2.0**-52 + left
        if so_far - slack > 0.0:
            return False
        if so_far + slack < 0.0:
            return True
    return math.fsum(parts) <= 0.0


def _extracted(terms: np.ndarray) -> Iterator[tuple[float, np.ndarray]]:
    """The passes of extraction over float64 terms (terms_at_most's docstring): each the
    exact sum of the top bits it took, in one float64, and the exact nonzero rests left."""
    rest = terms.astype(np.float64, copy=True)
    spread = (2 * max(1, rest.size)).bit_length()
    while rest.size:
        largest = float(np.max(np.abs(rest)))
        if largest == 0.0:
            return
        sigma = math.ldexp(1.0, math.frexp(largest)[1] + spread)
        extracted = (sigma + rest) - sigma
        rest -= extracted
        rest = rest[rest != 0.0]
        yield float(np.sum(extracted)), rest


def limit_split(limit: float) -> tuple[float, float] | None:
    """limit**2 as an exact sum high + low, or None where the split could overflow or lose
    bits (limits outside 1e-140..1e140: decided with fractions)."""
    if not _SPLIT_RANGE[0] < limit < _SPLIT_RANGE[1]:
        return None
    high, low = two_square(np.asarray(limit))
    return float(high), float(low)


def counted_terms(values: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """counts * values**2 as exact float64 terms, elementwise: the terms of the counts below
    2**26, and those of the rest of each count (None when every count is below 2**26)."""
    squares = values * values
    high_counts = np.floor(counts / _COUNT_SPLIT) * _COUNT_SPLIT
    if not high_counts.any():
        return counts * squares, None
    return (counts - high_counts) * squares, high_counts * squares


def terms_within(terms: list[float], split: tuple[float, float]) -> bool:
    """Whether exact float64 terms sum to at most high + low (limit_split), exactly."""
    return math.fsum([*terms, -split[0], -split[1]]) <= 0.0


def _fractions_within(values: np.ndarray, counts: np.ndarray, limit: float) -> bool:
    exact = sum(
        (Fraction(v) ** 2 * int(c) for v, c in zip(values.tolist(), counts.tolist(), strict=True)),
        Fraction(0),
    )
    return exact <= Fraction(limit) ** 2


def split_sumsq(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For rows of values of magnitude at most 1: (main, rest) such that each row's sum of
    squares is exactly main + rest.sum(axis=1) (squares below 2**-1074 aside, see
    underflow_bound). Each square is split exactly into two float64s (Dekker), the high
    parts are added pairwise keeping each addition's exact error (TwoSum): only the tiny
    terms in `rest` are left to add."""
    high, low = two_square(x)
    main, errors = pairwise_two_sum(high)
    return main, np.concatenate([low, *errors], axis=1)


def pairwise_two_sum(level: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    """Each row of `level` added pairwise, each addition's exact error kept (TwoSum): the
    rows' float64 sums, and the errors (arrays of rows) whose sums make them exact."""
    errors = []
    while level.shape[1] > 1:
        if level.shape[1] % 2:
            level = np.pad(level, ((0, 0), (0, 1)))
        a, b = level[:, 0::2], level[:, 1::2]
        level = a + b
        b_part = level - a
        errors.append((a - (level - b_part)) + (b - b_part))
    return level[:, 0], errors


def underflow_bound(x: np.ndarray) -> np.ndarray:
    """Per row, what squares lost to underflow may miss: elements below 2**-400 (relative to
    the peak of 1) may have squares below float64's normal range."""
    result: np.ndarray = 4 * np.count_nonzero(np.abs(x) < 2.0**-400, axis=1) * 2.0**-1074
    return result


def sumsq_error_bound(x: np.ndarray, rest: np.ndarray) -> np.ndarray:
    """Per row, a bound of the error of main + (rest summed in plain float64): the float64
    sum of rest errs by at most (terms + 4) roundings of the sum of magnitudes."""
    rounding = rest_rounding_bound(rest.shape[1], np.abs(rest).sum(axis=1))
    result: np.ndarray = rounding + underflow_bound(x)
    return result


def rest_rounding_bound(terms: int, magnitudes: np.ndarray) -> np.ndarray:
    """Per row, how far the float64 sum of `terms` error terms, in any order of addition,
    may be from their exact sum, given the sum of their magnitudes: (terms + 4) roundings
    of it."""
    result: np.ndarray = (terms + 4) * 2.0**-53 * magnitudes * 2
    return result


# Up to this many error terms, CertainSumsq adds them as fractions: exact, so that a small
# tensor whose norm is exactly C is recognised as such. Past it, add() bounds their float64
# sum and add_exactly() is there for a decision that falls within the bound.
_EXACT_REST = 4096
# add_exactly() squares elements within 2**-_BAND of a band's largest together: their
# squares and Dekker parts stay normal float64s (x >= 2**-400 gives x_low**2 >= 2**-906).
_BAND = 400


def exact_sum(terms: np.ndarray) -> Fraction:
    """The exact sum of finite float64 terms (each of magnitude at most 2**1000 / n), by
    extraction (as terms_at_most, to the end): each pass adds the terms' top bits exactly,
    in one float64, and leaves exact rests. ~5 ns a term for a float32 chunk's error
    terms (2 passes), ~20 ns for a float64 chunk's (4); a pass per ~33 bits of spread."""
    return sum((Fraction(part) for part, _ in _extracted(terms[terms != 0.0])), Fraction(0))


def _finite_peak(magnitudes: np.ndarray) -> float:
    """The largest of nonzero magnitudes (NaN if any is NaN); NotFiniteError unless finite:
    only finite values are summed (the values of an input that changed while it was read
    reached Fraction as NaN, exit 70, attack s43)."""
    peak = float(magnitudes.max())
    if not math.isfinite(peak):
        raise NotFiniteError("a value to sum for a certain decision is inf or NaN")
    return peak


class CertainSumsq:
    """A sum of squares with a rigorous error bound, for the final "<= C" check of float64
    output (a plain float64 dot product errs by ~1e-14 there, about 150 float64 roundings
    of the norm). Each square is split exactly into two float64s (Dekker), the high parts
    are added pairwise with each addition's exact error kept (TwoSum), and only those tiny
    errors are added in plain float64, with their error bounded. Chunks combine exactly,
    as fractions. About 20 ns per element.

    A part may also come with a wider bound and the way to work it out exactly
    (add_bounded: the sum of squares of a quantized weight from its code counts, or of a
    chunk of over 2,048 values whose error terms add()'s bound covers): at_most then works
    that part out only when the bound cannot decide. A sum whose bound is 0 and that has
    no such part is exact (`exact`)."""

    def __init__(self) -> None:
        self.total = Fraction(0)
        self.bound = Fraction(0)
        # (total, bound, how to work the part out) of each part added with add_bounded
        self._loose: list[tuple[Fraction, Fraction, Callable[[], CertainSumsq]]] = []

    def copy(self) -> CertainSumsq:
        """Another sum equal to this one, that adding to leaves this one as it is."""
        other = CertainSumsq()
        other.total, other.bound, other._loose = self.total, self.bound, list(self._loose)
        return other

    def add(self, chunk: np.ndarray) -> None:
        magnitudes = np.abs(widen_real(chunk)).reshape(-1)
        magnitudes = magnitudes[magnitudes != 0]
        if magnitudes.size == 0:
            return
        exp = math.frexp(_finite_peak(magnitudes))[1]
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

    def add_exactly(self, chunk: np.ndarray) -> None:
        """The chunk's sum of squares, exactly (bound 0): a band of magnitudes at a time,
        each band's squares split as add() splits them and their error terms summed by
        extraction (exact_sum). For a decision add()'s bound could not make (a tensor of
        over 2,048 values whose norm is exactly C was clipped: attack s37b)."""
        magnitudes = np.abs(widen_real(chunk)).reshape(-1)
        magnitudes = magnitudes[magnitudes != 0]
        while magnitudes.size:
            exp = math.frexp(_finite_peak(magnitudes))[1]
            in_band = magnitudes >= math.ldexp(1.0, exp - _BAND)
            x = np.ldexp(magnitudes[in_band], -exp)[None, :]
            main, rest = split_sumsq(x)
            self.total += (Fraction(float(main[0])) + exact_sum(rest[0])) * Fraction(4) ** exp
            magnitudes = magnitudes[~in_band]

    @property
    def exact(self) -> bool:
        """Whether `total` is the exact sum of squares (no bound, no part to work out)."""
        return self.bound == 0 and not self._loose

    def add_bounded(
        self, total: Fraction, bound: Fraction, exact: Callable[[], CertainSumsq]
    ) -> None:
        """A part whose sum of squares is within `bound` of `total` (either side), and
        `exact()`, the same part summed exactly (or within a bound no wider), asked for
        only when a decision falls within the bound."""
        self.total += total
        self.bound += bound
        self._loose.append((total, bound, exact))

    def merge(self, other: CertainSumsq) -> None:
        self.total += other.total
        self.bound += other.bound
        self._loose.extend(other._loose)

    def at_most(self, limit: float | Fraction) -> bool:
        """Whether the norm is certainly <= limit."""
        square = Fraction(limit) ** 2
        if self.total + self.bound <= square:
            return True
        # Certainly over: each bound holds on either side, and the bound of a part worked
        # out again is no wider, so that would decide the same.
        if not self._loose or self.total - self.bound > square:
            return False
        self._work_out_loose()
        return self.total + self.bound <= square

    def _work_out_loose(self) -> None:
        loose, self._loose = self._loose, []
        for total, bound, exact in loose:
            part = exact()
            part._work_out_loose()
            self.total += part.total - total
            self.bound += part.bound - bound

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


# sumsq_each works out arrays of up to this many nonzero values together (a row each);
# longer ones go through add(). (Their rests stay far below _EXACT_REST: summed exactly.)
EACH_UP_TO = 1024


def sumsq_each(arrays: list[np.ndarray]) -> list[CertainSumsq]:
    """CertainSumsq().add(array) of each array, the same fractions bit for bit: the arrays
    of one dtype laid end to end, and those with the same number of nonzero values split
    and summed as the rows of one matrix (each row's operations are add()'s, element for
    element). A tie of a small tensor was ~50 us, mostly numpy calls on a few values
    (clip --norm of a clipped checkpoint of 200,000 tensors: every one a tie)."""
    results = [CertainSumsq() for _ in arrays]
    by_dtype: dict[np.dtype, list[int]] = {}
    for k, array in enumerate(arrays):
        if array.dtype.kind == "c" or array.size == 0:
            results[k].add(array)  # complex: two values an element; empty: nothing
        else:
            by_dtype.setdefault(array.dtype, []).append(k)
    for members in by_dtype.values():
        magnitudes = np.abs(widen_real(np.concatenate([arrays[k].reshape(-1) for k in members])))
        sizes = np.fromiter((arrays[k].size for k in members), np.intp, len(members))
        owner = np.repeat(np.arange(len(members)), sizes)
        kept = magnitudes != 0
        magnitudes, owner = magnitudes[kept], owner[kept]
        nonzero = np.bincount(owner, minlength=len(members))
        starts = np.zeros(len(members), np.intp)
        np.cumsum(nonzero[:-1], out=starts[1:])
        for n in np.unique(nonzero).tolist():
            rows = np.flatnonzero(nonzero == n)
            if n == 0:
                continue  # all zeros: add() adds nothing
            if n > EACH_UP_TO:
                for row in rows.tolist():
                    results[members[row]].add(arrays[members[row]])
                continue
            values = magnitudes[starts[rows][:, None] + np.arange(n)]
            _, exps = np.frexp(values.max(axis=1))
            x = np.ldexp(values, -exps[:, None])
            main, rest = split_sumsq(x)
            errors = underflow_bound(x)
            for row, top, part, error, exp in zip(
                rows.tolist(), main.tolist(), rest, errors.tolist(), exps.tolist(), strict=True
            ):
                exact = sum((Fraction(v) for v in part[part != 0].tolist()), Fraction(0))
                weight = Fraction(4) ** exp
                result = results[members[row]]
                result.total += (Fraction(top) + exact) * weight
                result.bound += Fraction(error) * weight
    return results
