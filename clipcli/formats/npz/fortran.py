"""Column-major (Fortran-order) member data put in C order on disk, a tile at a time."""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator

import numpy as np

from clipcli.formats.base import TensorInfo
from clipcli.formats.npz.npyheader import InputProblem
from clipcli.system import interrupts, scratch

# Larger column-major members are transposed through temporary files a tile of
# FORTRAN_TILE_BYTES at a time (smaller ones are read whole; see reader.py).
FORTRAN_TILE_BYTES = 4 << 20


def _transposed_chunks(fd: int, offset: int, info: TensorInfo, step: int) -> Iterator[np.ndarray]:
    """C-order chunks of the tensor whose column-major data is at `offset` in `fd`.

    Column-major data of shape (s0, ..., sn) is the C-order data of (sn, ..., s0). Viewed
    as a matrix (sn*...*s1, s0), one transpose gives (s0, sn*...*s1): for each i0, the
    column-major data of the sub-tensor [i0, ...]. So rank - 1 batched transposes, each a
    pass through a temporary file in tiles of FORTRAN_TILE_BYTES, give C order; then the
    result is read sequentially. Memory: two tiles and one chunk; disk: twice the tensor."""
    shape, itemsize = info.shape, info.dtype.itemsize
    with contextlib.ExitStack() as stack:
        source, source_offset = fd, offset
        for level in range(max(0, len(shape) - 1)):
            target = stack.enter_context(scratch.temp_file("clipcli-fortran-"))
            batch = math.prod(shape[:level])
            cols = shape[level]
            rows = math.prod(shape[level + 1 :])
            _transpose_batches(source, source_offset, target, batch, rows, cols, itemsize)
            source, source_offset = target, 0
        for start in range(0, info.numel, step):
            count = min(step, info.numel - start)
            data = _pread_exactly(source, count * itemsize, source_offset + start * itemsize)
            yield np.frombuffer(data, dtype=info.dtype)


def _transpose_batches(
    source: int, offset: int, target: int, batch: int, rows: int, cols: int, itemsize: int
) -> None:
    """For each of `batch` consecutive (rows, cols) C-order matrices at `offset` in
    `source`, write its (cols, rows) transpose at the same place in `target`, a tile at a
    time: a tile's rows are read (one pread when they are whole rows, so contiguous) and
    its columns written (one pwrite when whole)."""
    if not rows or not cols:
        return
    tile = max(1, FORTRAN_TILE_BYTES // itemsize)
    side = max(1, math.isqrt(tile))
    tile_cols = cols if cols * min(rows, side) <= tile else min(cols, side)
    tile_rows = min(rows, max(1, tile // tile_cols))
    matrix = rows * cols * itemsize
    if rows * cols <= tile:  # small matrices: many in one read, transpose and write
        group = max(1, tile // (rows * cols))
        for first in range(0, batch, group):
            count = min(group, batch - first)
            raw = _pread_exactly(source, count * matrix, offset + first * matrix)
            several = np.frombuffer(raw, np.uint8).reshape(count, rows, cols, itemsize)
            interrupts.check()  # a tile at a time: a signal must not wait for the whole pass
            scratch.write_at(target, several.transpose(0, 2, 1, 3).tobytes(), first * matrix)
        return
    for index in range(batch):
        base = index * matrix
        for row0 in range(0, rows, tile_rows):
            row1 = min(rows, row0 + tile_rows)
            for col0 in range(0, cols, tile_cols):
                interrupts.check()
                col1 = min(cols, col0 + tile_cols)
                width = (col1 - col0) * itemsize
                if col0 == 0 and col1 == cols:
                    raw = _pread_exactly(
                        source, (row1 - row0) * width, offset + base + row0 * cols * itemsize
                    )
                else:
                    raw = b"".join(
                        _pread_exactly(
                            source, width, offset + base + (row * cols + col0) * itemsize
                        )
                        for row in range(row0, row1)
                    )
                block = np.frombuffer(raw, np.uint8).reshape(row1 - row0, col1 - col0, itemsize)
                flipped = np.ascontiguousarray(block.transpose(1, 0, 2))
                if row0 == 0 and row1 == rows:
                    scratch.write_at(target, flipped.tobytes(), base + col0 * rows * itemsize)
                else:
                    for col in range(col0, col1):
                        scratch.write_at(
                            target,
                            flipped[col - col0].tobytes(),
                            base + (col * rows + row0) * itemsize,
                        )


def _pread_exactly(fd: int, size: int, position: int) -> bytes:
    data = os.pread(fd, size, position)
    while len(data) < size:
        more = os.pread(fd, size - len(data), position + len(data))
        if not more:
            raise InputProblem("the data ended early")
        data += more
    return data
