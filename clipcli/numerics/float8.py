"""float32 to the 8-bit floats on the integer bits, bit for bit what ml_dtypes gives.

ml_dtypes converts to an 8-bit float one element at a time, 6-10 ns each. Where no table
per factor serves (a factor per column for --axes 0, the --axes search's roundings of a
slice's values), that cast was most of an fp8 --axes clip. The sign-magnitude fp8 formats
(float8_e4m3fn, e5m2, e4m3, e3m4) round like float16 does (float16.from_float32): on
the integer bits for normal results, by the FPU's own rounding of an added power of two
for subnormal ones, ~2 ns/element. Each dtype is checked once against ml_dtypes on
every value's neighbourhood before it is used (`layout`); one that does not fit (the
fnuz formats, whose NaN is -0's code; e8m0fnu, which has no sign) keeps ml_dtypes' cast.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import numpy as np

from clipcli.dtypes import finfo, float64_values
from clipcli.numerics import sign_magnitude

_U32 = np.uint32
_F32_INF = _U32(0x7F80_0000)
# Elements per block: uint32 work buffers of 512 KiB, reused, stay in cache.
_ROUND_BLOCK = 1 << 17


class _Layout(NamedTuple):
    shift: int  # float32 mantissa bits below the format's last one
    rebias: np.uint32  # float32's exponent bias minus the format's, in the code's place
    below_half: np.uint32  # just under half a step, in float32's bits
    smallest_normal: np.uint32  # float32 bits of the format's smallest normal value
    magic: np.float32  # its ulp is the format's subnormal step (see _round_block)
    overflow: np.uint32  # the code (sign aside) of a finite value rounded past the
    # largest: the code after the largest finite value's (inf, or the fn formats' NaN)


def from_float32(single: np.ndarray, dtype: np.dtype[Any]) -> np.ndarray | None:
    """float32 values rounded to the 8-bit float `dtype` (nearest, ties to even), bit for
    bit ml_dtypes' cast, inf and NaN included (those few elements are cast by ml_dtypes
    itself); None for a dtype this does not serve."""
    found = layout(dtype)
    if found is None:
        return None
    flat = np.ascontiguousarray(single, np.float32).reshape(-1)
    out = np.empty(flat.size, np.uint8)
    size = min(_ROUND_BLOCK, flat.size)
    buffers = [np.empty(size, _U32) for _ in range(3)]
    odd = False
    for start in range(0, flat.size, _ROUND_BLOCK):
        bits = flat[start : start + _ROUND_BLOCK].view(_U32)
        odd |= _round_block(bits, found, *(b[: bits.size] for b in buffers))
        np.copyto(out[start : start + bits.size], buffers[1][: bits.size], casting="unsafe")
    narrow = out.view(dtype)
    if odd:  # inf or NaN in: ml_dtypes decides those (NaN payloads, inf's own code)
        special = (flat.view(_U32) & _U32(0x7FFF_FFFF)) >= _F32_INF
        with np.errstate(invalid="ignore", over="ignore"):
            narrow[special] = flat[special].astype(dtype)
    shaped: np.ndarray = narrow.reshape(np.shape(single))
    return shaped


def _round_block(
    bits: np.ndarray, constants: _Layout, magnitude: np.ndarray, code: np.ndarray, sub: np.ndarray
) -> bool:
    """The codes of the float32 `bits` into `code` (the other two are scratch); whether
    any was inf or NaN (its code here is a stand-in: the caller replaces it)."""
    np.bitwise_and(bits, _U32(0x7FFF_FFFF), out=magnitude)
    special = bool(magnitude.max() >= _F32_INF) if magnitude.size else False
    # Normal results: round to nearest even on the integer bits, then rebias the exponent
    # (a value below the normal range wraps around here: the subnormal code replaces it).
    np.right_shift(magnitude, constants.shift, out=code)
    code &= _U32(1)
    code += magnitude
    code += constants.below_half
    code >>= constants.shift
    code -= constants.rebias
    # Subnormal results: adding `magic` in float32 rounds the value to the format's
    # subnormal step by the FPU's own round-to-nearest-even; the low bits are the code
    # (the smallest normal's, where it rounds up to it).
    with np.errstate(invalid="ignore", over="ignore"):  # inf/NaN lanes: replaced later
        np.add(magnitude.view(np.float32), constants.magic, out=sub.view(np.float32))
    sub -= constants.magic.view(_U32)
    # Blend without np.copyto(where=)'s branches, which mispredict where values straddle
    # the smallest normal: all ones where the magnitude is below it (an arithmetic shift
    # of the difference, which fits int32: magnitudes are below 2**31).
    np.subtract(magnitude, constants.smallest_normal, out=magnitude)
    below = magnitude.view(np.int32)
    below >>= 31
    sub ^= code
    sub &= magnitude
    code ^= sub
    np.minimum(code, constants.overflow, out=code)  # past the largest: the overflow code
    np.right_shift(bits, 24, out=magnitude)
    magnitude &= _U32(0x80)
    code |= magnitude  # the sign
    return special


@functools.cache
def layout(dtype: np.dtype[Any]) -> _Layout | None:
    """The constants of a sign-magnitude 8-bit float whose every code this rounding gets
    right: None unless the checks on all its values' neighbourhoods pass."""
    if dtype.itemsize != 1 or sign_magnitude.layout(dtype) is None:
        return None
    info = finfo(dtype)
    mantissa = int(info.nmant)
    smallest_normal = float(info.smallest_normal)
    step = float(info.smallest_subnormal)
    bias = 2 - math.frexp(smallest_normal)[1]  # frexp(2**(1 - bias)) is (0.5, 2 - bias)
    with np.errstate(invalid="ignore", over="ignore"):
        top = int(np.asarray(float(info.max), np.float32).astype(dtype).view(np.uint8))
        past = int(np.asarray(np.inf, np.float32).astype(dtype).view(np.uint8)) & 0x7F
    if past != top + 1:
        return None
    constants = _Layout(
        shift=23 - mantissa,
        rebias=_U32((127 - bias) << mantissa),
        below_half=_U32((1 << (22 - mantissa)) - 1),
        smallest_normal=_U32(int(np.asarray(smallest_normal, np.float32).view(_U32))),
        magic=np.float32(step * 2.0**23),
        overflow=_U32(past),
    )
    return constants if _agrees_with_ml_dtypes(dtype, constants) else None


def _agrees_with_ml_dtypes(dtype: np.dtype[Any], constants: _Layout) -> bool:
    """Whether this rounding gives ml_dtypes' codes on every finite value of the dtype,
    every midpoint between neighbours and the float32 values either side of each, the
    largest value and past it, and float32's extremes and subnormals."""
    values = float64_values(dtype)
    finite = np.unique(np.abs(values[np.isfinite(values)]))
    middles = (finite[1:] + finite[:-1]) / 2
    largest = finite[-1]
    beyond = [largest * 1.0625, largest * 1.5, largest * 4, 3.0e38, 2.0**-149, 2.0**-126]
    points = np.concatenate([finite, middles, [largest + (largest - finite[-2]) / 2], beyond])
    single = points.astype(np.float32)
    around = single.view(_U32)
    single = np.concatenate(
        [single, (around + _U32(1)).view(np.float32), (around - _U32(1)).view(np.float32)]
    )
    single = np.concatenate([single, -single])
    single = single[np.isfinite(single)]
    with np.errstate(invalid="ignore", over="ignore"):
        want = single.astype(dtype).view(np.uint8)
    codes = np.empty(single.size, np.uint8)
    buffers = [np.empty(single.size, _U32) for _ in range(3)]
    _round_block(single.view(_U32), constants, *buffers)
    np.copyto(codes, buffers[1], casting="unsafe")
    return bool(np.array_equal(codes, want))
