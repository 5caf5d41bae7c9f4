"""Extremes and float64 values of 8- and 16-bit floats from their bits, for norms.

Measuring a bfloat16 chunk the float32 way (widen to float32, then max, min, widen again
to float64, dot) spent 0.3 of its 0.5 ns/element before the float64 dot. But these floats
are sign-magnitude: among the codes with the sign bit clear, a larger code is a larger
value; among those with it set, a larger code is a more negative one; and inf and NaN are
the top codes of each half. So one integer max over the bits as signed and one over them as
unsigned name the largest and the most negative value, and whether any inf or NaN is
there, at ~0.04 ns/element each (a zero extreme of both signs aside: finite_extremes). Every
dtype is checked against that description on all of its codes once (`layout`); one that
does not fit it (the fnuz floats, whose NaN is -0's code; the sign-less float8_e8m0fnu) is
measured the float32 way.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import numpy as np

from clipcli.dtypes import finfo, float64_values, is_bfloat16, is_small_float


class Layout(NamedTuple):
    """What finite_extremes and scaled_values need of one dtype."""

    half: int  # the first code with the sign bit set
    values: np.ndarray  # float64 value of each code
    finite: np.ndarray  # bool, per code
    # float32 by moving bits (see scaled_values): the left shift that puts the code's
    # exponent and mantissa in float32's place, the mask that clears the sign's extra
    # copies, and the power of two k such that the float32 read is value * 2**-k. None:
    # widened by ml_dtypes' cast, unscaled.
    to_float32: tuple[int, np.int32, int] | None


@functools.cache
def layout(dtype: np.dtype[Any]) -> Layout | None:
    """The dtype's layout, or None when its codes are not ordered as described above."""
    if not (is_small_float(dtype) and dtype.isnative):
        return None
    values = float64_values(dtype)
    half = values.size // 2
    finite = np.isfinite(values)
    for side, sign in ((values[:half], 1.0), (values[half:], -1.0)):
        count = int(np.count_nonzero(np.isfinite(side)))
        kept = side[:count] * sign  # magnitudes, +0 first (-0 * -1 is +0)
        if count == 0 or np.isfinite(side[count:]).any() or kept[0] != 0.0:
            return None
        if not (np.diff(kept) > 0).all():  # strictly increasing
            return None
    if is_bfloat16(dtype):
        return Layout(half, values, finite, None)
    to_float32 = _bit_move(dtype, values, finite)
    return None if to_float32 is None else Layout(half, values, finite, to_float32)


def _bit_move(
    dtype: np.dtype[Any], values: np.ndarray, finite: np.ndarray
) -> tuple[int, np.int32, int] | None:
    """float32 by moving bits for a sign-magnitude float with IEEE-style subnormals: its
    sign-extended code shifted left so that the mantissa ends at float32's and the sign's
    copies masked off read as the value times a power of two (the difference of the
    exponent biases). Only returned when that holds exactly for every finite code."""
    bits = dtype.itemsize * 8
    mantissa = int(finfo(dtype).nmant)
    shift = 23 - mantissa
    magnitude_bits = bits - 1 + shift  # exponent and mantissa land in bits 0 .. this - 1
    if shift < 0 or magnitude_bits > 31:
        return None
    mask = np.int32(np.uint32(0x80000000 | ((1 << magnitude_bits) - 1)).view(np.int32))
    # The smallest normal code (exponent field 1) reads as float32's smallest normal.
    gap = math.frexp(values[1 << mantissa])[1] - math.frexp(2.0**-126)[1]
    codes = np.arange(values.size, dtype=np.uint32).astype(f"u{dtype.itemsize}")
    moved = _moved(
        codes.view(f"i{dtype.itemsize}"), (shift, mask, gap), np.empty(codes.size, np.int32)
    )
    with np.errstate(invalid="ignore"):  # NaN codes may move to NaN: not compared
        read = np.ldexp(moved.astype(np.float64), gap)
    if not np.array_equal(read[finite], values[finite]):
        return None
    return shift, mask, gap


def _moved(signed: np.ndarray, how: tuple[int, np.int32, int], bits: np.ndarray) -> np.ndarray:
    """The codes' values times 2**-gap, as float32, in `bits` (int32, as many elements)."""
    shift, mask, _ = how
    # A sign-extending copy, then shifts in place: np.left_shift(..., dtype=np.int32)
    # casts through a buffer of its own and took half again as long.
    np.copyto(bits, signed)
    bits <<= shift
    bits &= mask
    return bits.view(np.float32)


def finite_extremes(chunk: np.ndarray, facts: Layout) -> tuple[float, float] | None:
    """(largest, smallest) value of a non-empty 1-D chunk of the layout's dtype, or None if
    it holds inf or NaN, or if a zero extreme meets values of the other sign: which of 0.0
    and -0.0 numpy's max and min return where both are there depends on their order, and
    the chunk is then measured as numpy measures it (the same statistics as before, and
    as numerics.many's). A zero extreme of a one-signed chunk is that sign's zero."""
    unsigned = chunk.view(f"u{chunk.dtype.itemsize}")
    signed = chunk.view(f"i{chunk.dtype.itemsize}")
    top_unsigned, top_signed = int(unsigned.max()), int(signed.max())
    # The largest code with the sign bit clear is the largest value (when there is one);
    # the largest code with it set is the most negative value.
    has_non_negative, has_negative = top_signed >= 0, top_unsigned >= facts.half
    largest = top_signed if has_non_negative else int(signed.min()) + 2 * facts.half
    most_negative = top_unsigned if has_negative else int(unsigned.min())
    if not (facts.finite[largest] and facts.finite[most_negative]):
        return None
    high, low = float(facts.values[largest]), float(facts.values[most_negative])
    if (high == 0.0 or low == 0.0) and has_non_negative and has_negative:
        return None
    return high, low


def scaled_values(chunk: np.ndarray, facts: Layout, bits: np.ndarray) -> tuple[np.ndarray, int]:
    """(values, k): the chunk's values times 2**-k, exactly, in an array numpy's copyto
    widens to float64 fast: bfloat16 as it is (ml_dtypes' cast, k = 0), the others moved
    bit by bit into float32 in `bits` (int32, chunk.size elements, overwritten; the caller
    owns it: norms reuses one per thread). Squares and sums of these are those of the
    values times 4**-k, bit for bit (a power of two far from float64's limits changes no
    rounding). inf and NaN are not carried: callers check with finite_extremes first."""
    if facts.to_float32 is None:
        return chunk, 0
    signed = chunk.view(f"i{chunk.dtype.itemsize}")
    return _moved(signed, facts.to_float32, bits), facts.to_float32[2]
