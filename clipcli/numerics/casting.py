"""`convert --dtype`: real float values cast to bfloat16, float16 or float32, each value
rounded once, to nearest with ties to even; and what a narrowing cast made infinite.

Any real float chunk goes through float64 (exact: widening.widen) and
rounding.narrow_round (one rounding: ml_dtypes alone would round float64 to bfloat16
twice). A float32 chunk cast to bfloat16 or float16 is rounded once by its direct cast.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from clipcli.dtypes import dtype_named, is_floating
from clipcli.numerics.rounding import narrow_round
from clipcli.numerics.widening import widen

# What --dtype accepts: numpy's names, and the short ones people type.
CAST_TARGETS = {
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "f16": "float16",
    "half": "float16",
    "float32": "float32",
    "fp32": "float32",
    "f32": "float32",
    "float": "float32",
}


def cast_target(name: str) -> np.dtype[Any] | None:
    """The dtype --dtype NAME asks for, None when it is not one convert writes."""
    canonical = CAST_TARGETS.get(name.strip().lower())
    return None if canonical is None else dtype_named(canonical)


def castable(dtype: np.dtype[Any]) -> bool:
    """Real floats are cast; integers, bool and complex tensors are written as they are."""
    return dtype.kind != "c" and is_floating(dtype)


class Cast(NamedTuple):
    values: np.ndarray  # the chunk in the target dtype
    overflowed: int  # finite values that became +-inf
    largest: float  # the largest finite |x| of those (0.0 when none)


def cast_chunk(chunk: np.ndarray, target: np.dtype[Any]) -> Cast:
    """`chunk` (any real float dtype) in `target`, each value rounded once to nearest, ties
    to even; NaN stays NaN, +-inf stays +-inf."""
    if chunk.dtype == target:
        return Cast(chunk, 0, 0.0)
    if chunk.dtype == np.float32 and target.itemsize <= 4:
        with np.errstate(over="ignore", invalid="ignore"):
            values: np.ndarray = chunk.astype(target)  # numpy and ml_dtypes: one rounding
        wide = chunk
    else:
        wide = widen(chunk)
        values = narrow_round(wide, target)
    if target.itemsize >= wide.dtype.itemsize:  # widening: exact, nothing overflows
        return Cast(values, 0, 0.0)
    overflowed = _overflowed(wide, values)
    if not overflowed.any():
        return Cast(values, 0, 0.0)
    over = np.abs(wide[overflowed])
    return Cast(values, int(over.size), float(over.max()))


def _overflowed(wide: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Where a finite input became infinite."""
    if values.dtype.kind == "f":
        infinite = np.isinf(values)
    else:  # bfloat16: exponent all ones, mantissa zero (no ufunc round trip through float32)
        assert values.dtype.itemsize == 2
        infinite = (values.view(np.uint16) & np.uint16(0x7FFF)) == np.uint16(0x7F80)
    if not infinite.any():
        return np.asarray(infinite)
    finite_before: np.ndarray = np.isfinite(wide)
    return np.asarray(infinite & finite_before)
