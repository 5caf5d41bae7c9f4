"""A scan of the raw file bytes for corrupt HDF5 global heap collections (where
variable-length strings live), done before the library reads any attribute."""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator, Sequence
from pathlib import Path

import clipcli.formats.hdf5.limits as limits
from clipcli.errors import InputError


def check_global_heaps(
    path: Path, fd: int, size: int, data_ranges: Sequence[tuple[int, int]]
) -> int:
    """Refuse global heap collections (where variable-length strings live) whose objects do
    not tile the collection: libhdf5 loops forever reading one whose free-space object has
    size 0 (found by the fuzzer). Checked on the raw bytes before any attribute is read.

    Only the bytes outside the datasets' storage are searched: tensor data is most of a
    checkpoint, and may contain b"GCOL" by chance. The rest is read a window at a time, so
    memory stays bounded whatever is left to scan.

    Time is linear in the file size: real collections never overlap and every object header
    is 16 bytes, so walking every real collection visits at most size / 16 objects. A file
    whose b"GCOL" candidates (in attribute bytes, say) claim overlapping collections would
    make the walks quadratic; once the walks together exceed twice that bound, the file is
    refused instead.

    Returns the size of the largest heap object found (for the attribute budget).
    """
    budget = _HeapWalkBudget(2 * (size // 16) + (1 << 17))
    for begin, end in _gaps(size, data_ranges):
        for window in range(begin, end, limits.HEAP_SCAN_WINDOW):
            stop = min(window + limits.HEAP_SCAN_WINDOW, end)
            # A match starting before `stop` may end up to 3 bytes past it.
            text = os.pread(fd, min(stop + 3, size) - window, window)
            start = text.find(b"GCOL")
            while 0 <= start < stop - window:
                if _corrupt_collection(fd, window + start, size, budget):
                    raise InputError(path, "corrupt HDF5 global heap (zero-size free space)")
                if budget.remaining < 0:
                    raise InputError(
                        path,
                        "global heap signatures claim overlapping collections "
                        f"(more than {budget.total} heap objects to check); refusing it",
                    )
                start = text.find(b"GCOL", start + 4)
    return budget.largest_object


class _HeapWalkBudget:
    """Heap object headers that the scan may still look at, over all collections, and the
    largest object seen whose data lies inside its collection."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.remaining = total
        self.largest_object = 0


def _gaps(size: int, ranges: Sequence[tuple[int, int]]) -> Iterator[tuple[int, int]]:
    """The parts of [0, size) that no range covers."""
    position = 0
    for begin, end in sorted(ranges):
        if begin > position:
            yield position, min(begin, size)
        position = max(position, end)
    if position < size:
        yield position, size


def _corrupt_collection(fd: int, start: int, size: int, budget: _HeapWalkBudget) -> bool:
    """Whether the collection at `start` has a zero-size free-space object short of its end.
    Objects are indexed by 16 bits, so no real collection holds more than 65,535.
    Each object header looked at costs one unit of `budget`; the walk stops when it is spent
    (the caller then refuses the file)."""

    if start + 16 > size:
        return False
    (collection,) = struct.unpack("<Q", os.pread(fd, 8, start + 8))
    end = min(start + collection, size)
    position = start + 16
    block_start, block = 0, b""
    for _ in range(1 << 16):
        if not collection or position + 16 > end:
            return False
        budget.remaining -= 1
        if budget.remaining < 0:
            return False
        if not block_start <= position <= block_start + len(block) - 16:
            # Read ahead: most objects are small, so one pread serves many headers.
            block_start, block = position, os.pread(fd, min(1 << 16, end - position), position)
        index, _, _, length = struct.unpack_from("<HHIQ", block, position - block_start)
        if index == 0:  # the free space: it must reach the collection's end
            return bool(length == 0 and start + collection - position > 16)
        if position + 16 + length <= end:
            budget.largest_object = max(budget.largest_object, length)
        position += 16 + ((length + 7) // 8) * 8
    return True
