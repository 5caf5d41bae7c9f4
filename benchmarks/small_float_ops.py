"""numpy's float16 and ml_dtypes' fp8 operations against clipcli.float16's integer versions
and clipcli.lookup's tables: speed, and (with --exhaustive) agreement on all 2**32
float32 values rounded to float16.

    python benchmarks/small_float_ops.py                 # ms per million elements, 1 thread
    python benchmarks/small_float_ops.py --exhaustive    # + every float32 -> float16, ~6 min

The timed data: 2**20 standard normals as float16; "subnormal results" scales them by 6e-5
first, as `clip --global` does on a big fp16 checkpoint, so most results are float16
subnormals, which numpy rounds at ~70 ns each.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import ml_dtypes
import numpy as np

from clipcli.numerics import float16, lookup, rounding
from clipcli.numerics.norms import accumulate

N = 1 << 20


def per_million(fn: Callable[[], object], repeat: int = 10) -> float:
    """Milliseconds per call on N = 2**20 elements, after one warm-up call."""
    fn()
    started = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - started) / repeat * 1e3


def timings() -> None:
    half = np.random.default_rng(0).standard_normal(N).astype(np.float16)
    wide = half.astype(np.float32)
    tiny = wide * np.float32(6e-5)
    lo, hi = np.float16(-0.5), np.float16(0.5)
    rows = [
        ("max", lambda: half.max(), lambda: float16.bits_as_float32(half).max()),
        ("cast to float32", lambda: half.astype(np.float32), lambda: float16.bits_as_float32(half)),
        (
            "clip to [-0.5, 0.5]",
            lambda: np.clip(half, lo, hi),
            lambda: rounding.clamp_chunk(half, lo, hi),
        ),
        ("float32 -> float16", lambda: wide.astype(np.float16), lambda: float16.from_float32(wide)),
        (
            "float32 -> float16, subnormal results",
            lambda: tiny.astype(np.float16),
            lambda: float16.from_float32(tiny),
        ),
    ]
    eight = (np.random.default_rng(0).standard_normal(N) * 10).astype(ml_dtypes.float8_e4m3fn)
    lo8, hi8 = rounding.value_bounds(eight.dtype, -0.5, 0.5)
    rows += [
        (
            "fp8 e4m3fn: cast to float32",
            lambda: eight.astype(np.float32),
            lambda: lookup.as_float32(eight),
        ),
        (
            "fp8 e4m3fn: clip",
            lambda: np.clip(eight, lo8, hi8),
            lambda: rounding.clamp_chunk(eight, lo8, hi8),
        ),
        (
            "fp8 e4m3fn: scale by 0.3 and round",
            lambda: rounding._scale(eight, 0.3, 0),
            lambda: rounding.scale_chunk(eight, 0.3),
        ),
        (
            "fp8 e4m3fn: norm statistics",
            lambda: accumulate([eight.astype(np.float32)]),
            lambda: accumulate([eight]),
        ),
    ]
    print("| operation, ms per million elements | numpy / ml_dtypes | clipcli |")
    print("|---|---|---|")
    with np.errstate(under="ignore"):
        for label, theirs, ours in rows:
            print(f"| {label} | {per_million(theirs):.2f} | {per_million(ours):.2f} |")


def exhaustive() -> int:
    """Every float32 bit pattern rounded by numpy and by float16.from_float32."""
    step = 1 << 24
    base = np.arange(step, dtype=np.uint32)
    mismatches = 0
    started = time.perf_counter()
    for start in range(0, 1 << 32, step):
        values = (base + np.uint32(start)).view(np.float32)
        with np.errstate(all="ignore"):
            expected = values.astype(np.float16).view(np.uint16)
        mismatches += int(
            np.count_nonzero(float16.from_float32(values).view(np.uint16) != expected)
        )
    seconds = time.perf_counter() - started
    print(f"all 2**32 float32 values -> float16: {mismatches} mismatches ({seconds:.0f} s)")
    return mismatches


if __name__ == "__main__":
    timings()
    if "--exhaustive" in sys.argv[1:]:
        sys.exit(1 if exhaustive() else 0)
