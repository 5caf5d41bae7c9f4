"""The 8- and 16-bit float dtypes numpy and ml_dtypes have, for tests that go through each."""

from __future__ import annotations

import ml_dtypes
import numpy as np

# The OCP formats first, then the others ml_dtypes has (fnuz: no -0, NaN in its place;
# e8m0fnu: powers of two, no sign).
FP8_NAMES = [
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3",
    "float8_e3m4",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float8_e4m3b11fnuz",
    "float8_e8m0fnu",
]
SMALL_FLOAT_NAMES = [
    "bfloat16",
    "float16",
    *FP8_NAMES,
    "float4_e2m1fn",
    "float6_e2m3fn",
    "float6_e3m2fn",
]


def dtypes_of(names: list[str]) -> list[np.dtype]:
    """The named dtypes this ml_dtypes has (float16 is numpy's)."""
    if "float16" in names:
        names = [name for name in names if name != "float16"]
        return [np.dtype(np.float16), *dtypes_of(names)]
    return [np.dtype(getattr(ml_dtypes, name)) for name in names if hasattr(ml_dtypes, name)]
