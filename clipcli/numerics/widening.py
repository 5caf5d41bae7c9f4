"""Any numeric chunk as float64, every value exact: the one way the numerics widen data.

float64 holds every value of every narrower float and of the integers clipcli measures
(int64 beyond 2**53 aside, which rounds once). Each dtype takes its fastest exact path:
float16 through its bits (numpy's cast runs at 1-2 ns/element), fp8 through a 256-entry
table (ml_dtypes casts one element at a time), bfloat16 through float32 (straight to
float64 a NaN warns).
"""

from __future__ import annotations

import numpy as np

from clipcli.dtypes import from_ml_dtypes, is_float8
from clipcli.numerics import float16, lookup


def widen(chunk: np.ndarray) -> np.ndarray:
    """The chunk as float64 (complex128 for complex), every value exact, NaN included."""
    if chunk.dtype == np.float64 or chunk.dtype == np.complex128:
        return chunk
    if chunk.dtype.kind == "c":
        with np.errstate(invalid="ignore"):  # a signalling NaN part stays NaN (attack s43b)
            return chunk.astype(np.complex128)
    if chunk.dtype == np.float16:
        bits = float16.finite_as_float32(chunk)
        if bits is not None:
            return bits.astype(np.float64)
    if is_float8(chunk.dtype):
        return lookup.as_float32(chunk).astype(np.float64)
    with np.errstate(invalid="ignore"):  # a signalling NaN stays NaN: nothing to warn of
        if from_ml_dtypes(chunk.dtype):
            return chunk.astype(np.float32).astype(np.float64)
        return chunk.astype(np.float64)


def widen_real(chunk: np.ndarray) -> np.ndarray:
    """The chunk as float64, a complex one as its real and imaginary parts side by side
    (sum |z|**2 is then the plain sum of squares)."""
    wide = widen(chunk)
    if wide.dtype.kind == "c":
        return wide.view(np.float64)
    return wide
