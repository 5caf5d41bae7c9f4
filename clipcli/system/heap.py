"""The C heap (glibc): giving back a one-off peak of freed memory.

clipcli keeps freed chunk buffers in the heap so that the next chunk reuses them warm
(cli/entry.py: M_MMAP_THRESHOLD 64 MiB, M_TRIM_THRESHOLD 256 MiB). The price: a one-off
peak of temporaries stays resident for the rest of the run. Parsing the header of a
checkpoint of 200,000 tensors is such a peak (its bytes, its text, the fields split out of
it and the entries built from them: ~47 MB of a 142 MiB resident set, freed when the reader
is built), and `norms` of that checkpoint then peaked at 230 MiB instead of ~185.
"""

from __future__ import annotations

import functools
from typing import Any


def give_back_freed_memory() -> None:
    """Return the heap's free memory to the kernel (glibc's malloc_trim(0)); nothing where
    the C library has no such call. Live allocations are untouched: only free pages go."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Any:
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): no trim, nothing to do
        return None
