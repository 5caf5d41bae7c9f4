"""Every dtype fact, asked one way: float or not, finfo, the ml_dtypes floats, precision and
range, and the tables of every value of an 8- or 16-bit type.

The numerics and the formats both sit on this module; it imports nothing of clipcli's.
Answers are cached per dtype: some are asked once per chunk on the hot path, and asking
ml_dtypes (finfo, a cast of inf) costs microseconds.

ml_dtypes itself is imported only when a question is about one of its types (dtype_named
with an ml_dtypes name, finfo of an ml_dtypes float): importing it costs about 5 ms, which a
shell loop of `clipcli ls` over float32 files should not pay (issue 12, item 7). A dtype of
ml_dtypes exists only once ml_dtypes is imported, so every other question can tell one apart
without it.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

# --------------------------------------------------------------------- dtypes by name

# ml_dtypes' floats that the formats name (safetensors' BF16 and F8 codes).
ML_FLOAT_NAMES = frozenset(
    {
        "bfloat16",
        "float8_e5m2",
        "float8_e4m3fn",
        "float8_e8m0fnu",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
    }
)


@functools.cache
def dtype_named(name: str) -> np.dtype[Any]:
    """The dtype numpy names `name` (float32, int16, bfloat16, float8_e4m3fn, ...),
    little-endian; ml_dtypes is imported only for one of its own names."""
    if name in ML_FLOAT_NAMES:
        import ml_dtypes  # only now: its import costs ~5 ms (see the module's docstring)

        ml_type: type[Any] = getattr(ml_dtypes, name)
        return np.dtype(ml_type)
    return np.dtype(name).newbyteorder("<")


# --------------------------------------------------------------------- what kind of dtype


@functools.cache
def from_ml_dtypes(dtype: np.dtype[Any]) -> bool:
    """A type defined by ml_dtypes (its floats, and its int2/int4 too): formats that know
    only numpy's types cannot hold these. ml_dtypes' floats report kind "V", except some
    (float8_e5m2) that report "f", so the kind cannot tell; the type's module can."""
    return dtype.type.__module__.split(".")[0] == "ml_dtypes"


@functools.cache
def is_ml_float(dtype: np.dtype[Any]) -> bool:
    """True for the ml_dtypes floats (bfloat16, float8_*, float4/6 variants)."""
    if not from_ml_dtypes(dtype):
        return False
    try:
        finfo(dtype)
    except (ValueError, TypeError):  # ml_dtypes' integers
        return False
    return True


@functools.cache
def is_floating(dtype: np.dtype[Any]) -> bool:
    """Floating point or complex: the tensors that norms, clipping and the global norm act on."""
    return dtype.kind in "fc" or is_ml_float(dtype)


@functools.cache
def is_numeric(dtype: np.dtype[Any]) -> bool:
    """bool, integer, float (incl. ml_dtypes' bf16/fp8) or complex; nothing else is a tensor."""
    if dtype.kind in "biufc":
        return True
    return dtype.kind == "V" and is_ml_float(dtype)


@functools.cache
def is_bfloat16(dtype: np.dtype[Any]) -> bool:
    return dtype.type.__name__ == "bfloat16" and from_ml_dtypes(dtype)


@functools.cache
def is_float8(dtype: np.dtype[Any]) -> bool:
    """The 8-bit floats (all of ml_dtypes')."""
    return dtype.itemsize == 1 and is_ml_float(dtype)


@functools.cache
def is_small_float(dtype: np.dtype[Any]) -> bool:
    """A real float of 8 or 16 bits (float16, bfloat16, fp8): few enough values that an
    elementwise operation is computed once for all of them and looked up (value_table)."""
    return dtype.itemsize <= 2 and dtype.kind != "c" and is_floating(dtype)


def real_dtype(dtype: np.dtype[Any]) -> np.dtype[Any]:
    """The dtype of the real and imaginary parts of a complex dtype; others as they are."""
    if dtype.kind == "c":
        return np.dtype(np.float32 if dtype.itemsize == 8 else np.float64)
    return dtype


def parts_per_element(dtype: np.dtype[Any]) -> int:
    """How many values one element holds that round each on its own: a complex element's
    real and imaginary parts (2), any other element (1)."""
    return 2 if dtype.kind == "c" else 1


def bits_dtype(dtype: np.dtype[Any]) -> np.dtype[Any]:
    """The unsigned integer dtype of the same size: a view as it gives the bit patterns."""
    return np.dtype(f"u{dtype.itemsize}")


# --------------------------------------------------------------------- precision and range


def finfo(dtype: np.dtype[Any]) -> Any:
    """Float limits for numpy's and ml_dtypes' floats alike (the real part's for complex).
    numpy's own floats ask numpy (ml_dtypes.finfo gives the same answers for them, but
    importing ml_dtypes for a float32 file costs ~5 ms)."""
    real = real_dtype(dtype)
    if not from_ml_dtypes(real):
        return np.finfo(real)
    import ml_dtypes

    return ml_dtypes.finfo(real)  # type: ignore[no-untyped-call]


@functools.cache
def mantissa_digits(dtype: np.dtype[Any]) -> int:
    """Significant bits of the (real) float dtype, the implicit one included."""
    return int(finfo(dtype).nmant) + 1


@functools.cache
def unit_roundoff(dtype: np.dtype[Any]) -> float:
    """Half the machine epsilon: the largest relative error of rounding to this dtype;
    0.0 for a dtype that is not floating point (nothing is rounded)."""
    if not is_floating(dtype):
        return 0.0
    return float(finfo(dtype).eps) / 2


@functools.cache
def smallest_subnormal(dtype: np.dtype[Any]) -> float:
    """The smallest positive value (of the real part); 0.0 for non-floats."""
    if not is_floating(dtype):
        return 0.0
    return float(finfo(dtype).smallest_subnormal)


@functools.cache
def has_infinity(dtype: np.dtype[Any]) -> bool:
    """Whether the float dtype holds +-inf (most fp8 types do not: inf casts to NaN)."""
    with np.errstate(all="ignore"):
        return bool(np.isinf(np.asarray(math.inf).astype(dtype).astype(np.float64)))


@functools.cache
def smallest_without_zero(dtype: np.dtype[Any]) -> float | None:
    """The smallest positive value of a float dtype that cannot hold zero (e8m0fnu: powers
    of two only), or None for every dtype that can."""
    if dtype.kind == "c":
        return None
    with np.errstate(invalid="ignore"):
        zero = np.zeros(1, np.float32).astype(dtype).astype(np.float64)[0]
    if zero == 0:
        return None
    values = float64_values(dtype)
    return float(values[values > 0].min())


# --------------------------------------------------------------------- every value of a type


@functools.cache
def all_values(dtype: np.dtype[Any]) -> np.ndarray:
    """Every value of a 1- or 2-byte dtype, indexed by its own bits (read-only)."""
    count = 256**dtype.itemsize
    if dtype.itemsize > 2:
        raise ValueError(f"{dtype} has {count} values: too many to list")
    table: np.ndarray = np.arange(count, dtype=np.uint32).astype(bits_dtype(dtype)).view(dtype)
    table.flags.writeable = False
    return table


@functools.cache
def float32_values(dtype: np.dtype[Any]) -> np.ndarray:
    """Every value of an 8- or 16-bit float as float32 (exact), indexed by its bits."""
    with np.errstate(invalid="ignore"):  # NaN entries
        table = all_values(dtype).astype(np.float32)
    table.flags.writeable = False
    return table


@functools.cache
def float64_values(dtype: np.dtype[Any]) -> np.ndarray:
    """Every value of an 8- or 16-bit float as float64 (exact), indexed by its bits."""
    with np.errstate(invalid="ignore"):  # signalling NaN entries
        table = float32_values(dtype).astype(np.float64)
    table.flags.writeable = False
    return table
