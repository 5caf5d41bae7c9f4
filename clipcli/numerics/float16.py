"""float16 conversions on the integer bits, bit for bit what numpy gives.

numpy has no SIMD loops for float16: its max/min/compare run at about 5 ns/element here,
its casts at 1-2 ns, and a cast to float16 whose result is an inexact subnormal at about
70 ns (each one raises the underflow flag with a float operation on a subnormal, which x86
runs in microcode). Clipping a float16 checkpoint by a small global limit makes most values
subnormal, so that cast alone took 20 s for 512 MiB. The integer versions below cost
0.2-1.7 ns/element whatever the values, and the tests check them against numpy on every
float16 value (and, for float32 -> float16, on patterns covering every exponent).
"""

from __future__ import annotations

import numpy as np

# float16 bits shifted into a float32 read as value * 2**-112 (normal and subnormal alike).
_EXPONENT_GAP = np.float32(2.0**112)
# ... and float16 inf/NaN (exponent 31) read as finite values at least this large.
TRICK_NONFINITE = 65536.0


def bits_as_float32(chunk: np.ndarray) -> np.ndarray:
    """float16 to float32 by moving bits: exact for every finite value, 5x faster than numpy's
    cast. inf and NaN come out as finite values of magnitude >= TRICK_NONFINITE: callers check."""
    # Sign-extending int16 -> int32 and shifting by 13 puts the sign in bit 31 and the
    # exponent and mantissa in bits 13-27; the mask clears the sign's copies in bits 28-30.
    bits: np.ndarray = np.left_shift(chunk.view(np.int16), 13, dtype=np.int32)
    bits &= np.int32(-0x70000001)  # 0x8FFFFFFF
    wide: np.ndarray = bits.view(np.float32)
    wide *= _EXPONENT_GAP  # a power of two: exact
    return wide


def finite_as_float32(chunk: np.ndarray) -> np.ndarray | None:
    """float16 widened by moving bits; None if the chunk holds inf or NaN, which the bit
    trick does not carry (the caller then uses numpy's cast)."""
    wide = bits_as_float32(chunk)
    if wide.size and max(float(wide.max()), -float(wide.min())) >= TRICK_NONFINITE:
        return None
    return wide


_U32 = np.uint32
_HALF_INF_AT = _U32((127 + 16) << 23)  # |x| >= 65536.0: inf, or NaN
_F32_INF = _U32(255 << 23)
_SUBNORMAL_BELOW = np.int32(113 << 23)  # |x| < 2**-14: the float16 is subnormal or zero
_MAGIC_BITS = _U32(((127 - 15) + (23 - 10) + 1) << 23)  # 0.5: its ulp is float16's 2**-24
_MAGIC = _MAGIC_BITS.view(np.float32)
_REBIAS = _U32((((15 - 127) << 23) + 0xFFF) & 0xFFFFFFFF)  # exponent 127 -> 15, round bias
# Elements per block: three uint32 work buffers of 512 KiB, reused, stay in cache.
_ROUND_BLOCK = 1 << 17


def from_float32(wide: np.ndarray) -> np.ndarray:
    """float32 rounded to float16 (nearest, ties to even), bit for bit numpy's cast including
    inf, NaN payloads and overflow to inf, at 1.2-1.7 ns/element whatever the values.
    After F. Giesen's float_to_half_fast3_rtne (public domain), in place in reused buffers:
    a fresh array per step made it 2-5x slower (allocation and page faults)."""
    flat = np.ascontiguousarray(wide).reshape(-1)
    out = np.empty(flat.size, np.uint16)
    size = min(_ROUND_BLOCK, flat.size)
    buffers = [np.empty(size, _U32) for _ in range(3)]
    for start in range(0, flat.size, _ROUND_BLOCK):
        bits = flat[start : start + _ROUND_BLOCK].view(_U32)
        _round_block(bits, *(b[: bits.size] for b in buffers))
        np.copyto(out[start : start + bits.size], buffers[1][: bits.size], casting="unsafe")
    narrow: np.ndarray = out.view(np.float16).reshape(np.shape(wide))
    return narrow


def _round_block(
    bits: np.ndarray, magnitude: np.ndarray, half: np.ndarray, sub: np.ndarray
) -> None:
    """The float16 bits of the float32 `bits`, into `half` (the other two are scratch)."""
    np.bitwise_and(bits, _U32(0x7FFFFFFF), out=magnitude)
    # Normal results: rebias the exponent and round to nearest even on the integer bits.
    np.right_shift(magnitude, 13, out=half)
    half &= _U32(1)
    half += magnitude
    half += _REBIAS
    half >>= 13
    # Subnormal results: adding 0.5 in float32 rounds the value to float16's subnormal
    # step (2**-24) by the FPU's own round-to-nearest-even; the low bits are the float16.
    with np.errstate(invalid="ignore"):  # a signalling NaN (its lane is replaced below)
        np.add(magnitude.view(np.float32), _MAGIC, out=sub.view(np.float32))
    sub -= _MAGIC_BITS
    special = extreme = None
    if magnitude.size and magnitude.max() >= _HALF_INF_AT:  # rare: inf, NaN, overflow
        special = magnitude >= _HALF_INF_AT
        payload = np.maximum((magnitude & _U32(0x7FFFFF)) >> 13, _U32(1))  # NaN stays NaN
        extreme = np.where(magnitude > _F32_INF, _U32(0x7C00) + payload, _U32(0x7C00))
    small = magnitude.view(np.int32)
    small -= _SUBNORMAL_BELOW
    small >>= 31  # arithmetic shift: all ones where the result is subnormal
    sub ^= half  # blend half and sub without np.where's branches
    sub &= magnitude
    half ^= sub
    if special is not None and extreme is not None:
        np.copyto(half, extreme, where=special)
    np.right_shift(bits, 16, out=magnitude)
    magnitude &= _U32(0x8000)
    half |= magnitude  # the sign
