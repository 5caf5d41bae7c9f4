"""The one way clipcli maps memory: part of a file (a reader), or a page shared with a
helper process (system.counting).

A map that the address space cannot hold (`ulimit -v`, RLIMIT_AS: mmap fails with
ENOMEM) is the environment refusing memory, not the input being unreadable: it is raised
as MemoryError, which the boundary reports as out of memory (exit 5), as it does for an
allocation. Any other failure is the caller's to word (the file, e.g. a map past its end).
"""

from __future__ import annotations

import errno
import mmap


def map_read_only(fd: int, length: int, offset: int) -> mmap.mmap:
    """`length` bytes of the file from `offset` (a multiple of mmap.ALLOCATIONGRANULARITY),
    mapped read-only; MemoryError when the address space cannot take them."""
    try:
        return mmap.mmap(fd, length, access=mmap.ACCESS_READ, offset=offset)
    except OSError as exc:
        if exc.errno == errno.ENOMEM:
            raise MemoryError(
                f"cannot map {length >> 20} MiB of the file: {exc.strerror}"
            ) from None
        raise


def map_shared(length: int) -> mmap.mmap:
    """`length` bytes of anonymous memory shared with the processes forked after it;
    MemoryError when the address space cannot take them."""
    try:
        return mmap.mmap(-1, length)
    except OSError as exc:
        if exc.errno == errno.ENOMEM:
            raise MemoryError(f"cannot map {length} bytes: {exc.strerror}") from None
        raise
