"""Every dtype fact, asked one way: float or not, finfo, the ml_dtypes floats.

The numerics and the formats both sit on this module; it imports nothing of clipcli's.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def is_numeric(dtype: np.dtype[Any]) -> bool:
    """bool, integer, float (incl. ml_dtypes' bf16/fp8) or complex; nothing else is a tensor."""
    if dtype.kind in "biufc":
        return True
    return dtype.kind == "V" and is_ml_float(dtype)


def finfo(dtype: np.dtype[Any]) -> Any:
    """Float limits for numpy's and ml_dtypes' floats alike."""
    import ml_dtypes

    return ml_dtypes.finfo(dtype)  # type: ignore[no-untyped-call]


def is_ml_float(dtype: np.dtype[Any]) -> bool:
    """True for the ml_dtypes floats (bfloat16, float8_*, float4/6 variants)."""
    try:
        finfo(dtype)
    except (ValueError, TypeError):
        return False
    return dtype.kind == "V" or dtype.type.__module__.startswith("ml_dtypes")


def is_floating(dtype: np.dtype[Any]) -> bool:
    """Floating point or complex: the tensors that norms, clipping and the global norm act on."""
    return dtype.kind in "fc" or is_ml_float(dtype)
