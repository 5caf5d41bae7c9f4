"""a − b, element by element, each difference rounded once to float64 from its exact value.

float64 holds every value of every float dtype and every integer up to 2**53, so for those
pairs float64 subtraction is already the correctly rounded difference. int64 and uint64
values beyond 2**53 are rounded when widened: 2**60 and 2**60 + 1 both become 2**60 and a
change of one would vanish (and int64 a − b itself can overflow). Pairs with such a side
are computed exactly instead, in int64 parts that cannot overflow:

* an integer x is high * 2**32 + low with low in [0, 2**32) (uint64 against int64 too);
  the differences of the parts are exact, and so is the rounding of high * 2**32 + low
  (round_parts: one float64 addition of two exactly representable halves);
* a float f against a wide integer goes through f's integer part the same way; its
  fraction (|f| < 2**52 when it has one) is subtracted with one rounding (see
  _int_minus_float); floats beyond 2**90 against integers beyond 2**53 (values no
  checkpoint of weights holds) are done in Python integers, one element at a time.

A difference beyond float64's range (1e308 − −1e308) is returned halved with shift 1, so
that norms of it stay finite: the caller scales its sums back by 2**shift.
"""

from __future__ import annotations

import numpy as np

from clipcli.numerics.widening import widen

# Integers up to this magnitude are exact in float64.
EXACT_INTEGER = 2**53
_PART_BITS = 32
_PART_MASK = (1 << _PART_BITS) - 1
# Floats up to this magnitude split into int64 parts whose differences cannot overflow.
_SPLIT_LIMIT = 2.0**90
# From this magnitude on, f − x rounds to f for every 64-bit integer x: |x| < 2**64 is under
# a quarter of f's unit in the last place, so even at a power of two x cannot reach halfway.
_DOMINANT = 2.0**118


def difference(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, int]:
    """(d, shift): float64 d with a − b = d * 2**shift, each element rounded once.

    a and b are real (complex callers pass real and imaginary parts side by side), of any
    numeric dtype, of equal size. NaN and infinities follow IEEE arithmetic (inf − inf is
    NaN). shift is 1 when some difference of finite values lies beyond float64's range:
    then every element is the halved difference."""
    flat_a, flat_b = a.reshape(-1), b.reshape(-1)
    if _is_wide_integer(flat_a.dtype) or _is_wide_integer(flat_b.dtype):
        return _exact_difference(flat_a, flat_b), 0
    wide_a, wide_b = widen(flat_a), widen(flat_b)
    with np.errstate(invalid="ignore", over="ignore"):  # inf − inf, 1e308 − −1e308
        result = wide_a - wide_b
        overflowed = np.isinf(result) & np.isfinite(wide_a) & np.isfinite(wide_b)
        if not np.any(overflowed):
            return result, 0
        # Halving is exact but for subnormals, whose error (2**-1075) no difference that
        # overflows can feel: it is far below half a unit of every such difference.
        halved: np.ndarray = wide_a * 0.5 - wide_b * 0.5
    return halved, 1


def _is_wide_integer(dtype: np.dtype) -> bool:
    """int64 / uint64: integers that float64 does not hold exactly."""
    return dtype.kind in "iu" and dtype.itemsize > 4


def _exact_difference(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a_integral, b_integral = a.dtype.kind in "iub", b.dtype.kind in "iub"
    if a_integral and b_integral:
        high_a, low_a = integer_parts(a)
        high_b, low_b = integer_parts(b)
        return round_parts(high_a - high_b, low_a - low_b)
    if a_integral:
        return _int_minus_float(a, widen(b))
    return -_int_minus_float(b, widen(a))  # rounding to nearest is symmetric: exact


def integer_parts(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Integers (or bools) as int64 (high, low): x = high * 2**32 + low, low in [0, 2**32)."""
    if x.dtype.kind == "u" and x.dtype.itemsize > 4:
        unsigned = x.astype(np.uint64)
        high = (unsigned >> np.uint64(_PART_BITS)).astype(np.int64)
        low = (unsigned & np.uint64(_PART_MASK)).astype(np.int64)
        return high, low
    signed = x.astype(np.int64)
    return signed >> _PART_BITS, signed & _PART_MASK  # >> floors: low stays non-negative


def round_parts(high: np.ndarray, low: np.ndarray) -> np.ndarray:
    """high * 2**32 + low (int64, |high| < 2**62, |low| < 2**52) rounded once to float64.

    high's own rounding error (at most 2**8) is moved into the low part, which stays below
    2**53 and so exact; one float64 addition of the two exact halves then rounds once."""
    rough = high.astype(np.float64)
    rest = high - rough.astype(np.int64)
    tail = (rest << _PART_BITS) + low
    result: np.ndarray = np.ldexp(rough, _PART_BITS) + tail.astype(np.float64)
    return result


def _int_minus_float(x: np.ndarray, f: np.ndarray) -> np.ndarray:
    """x − f for integers x and float64 f, each rounded once."""
    with np.errstate(invalid="ignore", over="ignore"):
        result: np.ndarray = x.astype(np.float64) - f  # exact-then-rounded where |x| <= 2**53
    wide_x = (
        (x > EXACT_INTEGER) | (x < -EXACT_INTEGER) if x.dtype.kind == "i" else x > EXACT_INTEGER
    )
    todo = np.flatnonzero(wide_x & np.isfinite(f))
    if not todo.size:
        return result
    xs, fs = x[todo], f[todo]
    magnitude = np.abs(fs)
    dominant = magnitude >= _DOMINANT
    result[todo[dominant]] = -fs[dominant]
    split = magnitude < _SPLIT_LIMIT
    if np.any(split):
        result[todo[split]] = _split_minus(xs[split], fs[split])
    by_hand = np.flatnonzero(~split & ~dominant)
    for i in by_hand:  # 2**90 <= |f| < 2**118: integer-valued, Python integers are exact
        result[todo[i]] = float(int(xs[i]) - int(fs[i]))
    return result


def _split_minus(x: np.ndarray, f: np.ndarray) -> np.ndarray:
    """x − f for integers x beyond 2**53 and finite |f| < 2**90, each rounded once."""
    whole = np.trunc(f)
    fraction = f - whole  # exact; nonzero only where |f| < 2**52
    whole_high = np.floor(np.ldexp(whole, -_PART_BITS))
    whole_low = whole - np.ldexp(whole_high, _PART_BITS)  # exact, in [0, 2**32)
    high_x, low_x = integer_parts(x)
    high = high_x - whole_high.astype(np.int64)
    low = low_x - whole_low.astype(np.int64)
    result = round_parts(high, low)  # x − whole, right where there is no fraction
    has_fraction = np.flatnonzero(fraction != 0)
    if not has_fraction.size:
        return result
    high, low, fraction = high[has_fraction], low[has_fraction], fraction[has_fraction]
    # Normalise to D = high * 2**32 + low with low in [0, 2**32), to compare D with 2**53.
    high = high + (low >> _PART_BITS)
    low = low & _PART_MASK
    limit = EXACT_INTEGER >> _PART_BITS
    exact = (high >= -limit) & ((high < limit) | ((high == limit) & (low == 0)))
    # |D| <= 2**53: D is a float64, and D − fraction is one IEEE subtraction.
    small = ((high << _PART_BITS) + low).astype(np.float64) - fraction
    # |D| > 2**53: D − fraction lies strictly between two integers where the float64 grid
    # and its midpoints are integers, so it rounds as that interval's midpoint does:
    # (2D − sign(fraction)) / 2, itself an integer computed exactly and rounded once.
    step = np.sign(fraction).astype(np.int64)
    large = round_parts(2 * high, 2 * low - step) * 0.5
    result[has_fraction] = np.where(exact, small, large)
    return result
