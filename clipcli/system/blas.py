"""The BLAS thread count, set before numpy loads."""

from __future__ import annotations

import os

BLAS_THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def single_threaded_blas() -> None:
    """One BLAS thread unless the user set otherwise: we thread over chunks ourselves, and
    BLAS threads on top only spin and contend (norms of 512 MiB of float16 on a busy
    2-core machine: 3.9 s, not 0.7 s). BLAS reads these once, when numpy loads: called
    before anything imports it (clipcli.__main__), and again by main() for callers that
    did not come through there."""
    for variable in BLAS_THREAD_VARIABLES:
        os.environ.setdefault(variable, "1")
