"""CPU nanoseconds per element (and per byte) of each per-chunk step of norms and clip, by
dtype, on one thread: what `clipcli norms` / `clip` pay for each element beyond reading
and writing it (issue 20, "CPU per element, per dtype"). CPU time, not wall: it holds on a
busy machine. `PYTHONPATH=OTHER` times another checkout's clipcli.

    python benchmarks/per_element.py
"""

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # as clipcli's entry point sets it

import time

import ml_dtypes
import numpy as np

from clipcli.numerics import rounding
from clipcli.numerics.norms import NormAccumulator, accumulate

CHUNK = 1 << 20  # elements per chunk, as the readers hand out 2 MiB of bf16
FACTOR = 0.6875  # a factor as the search makes them (few bits: the product is exact)
# Per-row factors of up to 45 significant bits, as the --axes search makes them.
ROW_FACTORS = (0.5 + np.random.default_rng(1).random((CHUNK // 4096, 1)) / 2).view(np.int64)
ROW_FACTORS = ((ROW_FACTORS >> 8) << 8).view(np.float64)
# ... and per column (--axes 0 of a [256, 4096] box: too many factors for fp8's tables).
COLUMN_FACTORS = (0.5 + np.random.default_rng(2).random((1, 4096)) / 2).view(np.int64)
COLUMN_FACTORS = ((COLUMN_FACTORS >> 8) << 8).view(np.float64)


def per_element(fn, array: np.ndarray) -> float:
    best = float("inf")
    for _ in range(3):
        start = time.process_time()
        for at in range(0, array.size, CHUNK):
            fn(array[at : at + CHUNK])
        best = min(best, time.process_time() - start)
    return best / array.size * 1e9


def main() -> None:
    samples = np.random.default_rng(0).standard_normal(8 * CHUNK, dtype=np.float32)
    arrays = {
        "float32": samples,
        "bfloat16": (samples.view(np.uint32) >> 16).astype(np.uint16).view(ml_dtypes.bfloat16),
        "float16": samples.astype(np.float16),
        "float8_e4m3fn": samples.astype(ml_dtypes.float8_e4m3fn),
    }
    steps = {
        "norms: NormAccumulator.add": lambda c: NormAccumulator().add(c),
        "clip measure (histograms)": lambda c: NormAccumulator(keep_histogram=True).add(c),
        "clip write: scale_chunk": lambda c: rounding.scale_chunk(c, FACTOR),
        # --axes: a factor per slice (here per row of 4,096): rounded on the fly, no table
        "clip write --axes: a factor per row": lambda c: rounding.scale_chunk(
            c.reshape(-1, 4096), ROW_FACTORS[: c.size // 4096]
        ),
        "clip write --axes: a factor per column": lambda c: rounding.scale_chunk(
            c.reshape(-1, 4096), COLUMN_FACTORS
        ),
        "clip write: flushes": lambda c: rounding.flushes(c, c),
        "clip write: outcome stats": lambda c: accumulate([c]),
    }
    print("| step | " + " | ".join(f"{name} ns/el (ns/B)" for name in arrays) + " |")
    print("|---|" + "---|" * len(arrays))
    for label, fn in steps.items():
        cells = []
        for array in arrays.values():
            ns = per_element(fn, array)
            cells.append(f"{ns:.2f} ({ns / array.itemsize:.2f})")
        print(f"| {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
