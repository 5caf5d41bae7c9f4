"""8-bit floats (the fp8 types and e8m0) through 256-entry tables.

ml_dtypes converts, compares and rounds 8-bit floats one element at a time: here 6 ns per
element to widen to float32, 6 ns to clip and 16 ns to scale and round back. But an 8-bit
float has only 256 values, and everything clipcli does to one is elementwise (widening,
clamping, scaling then rounding), so each operation is computed once on all 256 values,
with the very same functions, and looked up per element with np.take (0.7 ns). The result
is identical by construction.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from clipcli.formats.base import is_ml_float


@functools.cache
def is_float8(dtype: np.dtype[Any]) -> bool:
    return dtype.itemsize == 1 and is_ml_float(dtype)


@functools.cache
def _all_values(dtype: np.dtype[Any]) -> np.ndarray:
    """The 256 values of the dtype, in byte order 0x00..0xFF."""
    values = np.arange(256, dtype=np.uint8).view(dtype)
    values.flags.writeable = False
    return values


@functools.cache
def _float32_values(dtype: np.dtype[Any]) -> np.ndarray:
    with np.errstate(invalid="ignore"):  # NaN entries
        table = _all_values(dtype).astype(np.float32)
    table.flags.writeable = False
    return table


def as_float32(chunk: np.ndarray) -> np.ndarray:
    """The chunk widened to float32: exact for every value, NaN included."""
    wide: np.ndarray = np.take(_float32_values(chunk.dtype), chunk.view(np.uint8))
    return wide


def by_table(chunk: np.ndarray, elementwise: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """elementwise(chunk) in the chunk's dtype, computed on the 256 values and looked up.
    `elementwise` must treat each element on its own (scaling, clamping). A wider result
    (ml_dtypes' np.clip returns float32) is cast back, as the writer would have cast it."""
    with np.errstate(all="ignore"):  # the table holds NaN and extremes the chunk may not
        table = np.asarray(elementwise(_all_values(chunk.dtype)))
        table = np.ascontiguousarray(table.astype(chunk.dtype, copy=False))
    if table.shape != (256,):
        raise ValueError(f"not an elementwise map: 256 values gave shape {table.shape}")
    looked_up: np.ndarray = np.take(table.view(np.uint8), chunk.view(np.uint8))
    return looked_up.view(chunk.dtype)
