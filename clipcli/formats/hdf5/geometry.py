"""Flat C-order ranges of a tensor as rectangular HDF5 hyperslabs."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np


def flat_range_blocks(shape: Sequence[int], start: int, stop: int) -> Iterator[tuple[slice, ...]]:
    """Rectangular blocks that together cover the flat C-order range [start, stop), in order.

    Every block has one slice per dimension (slice(i, i + 1) for a single index), so reading
    each block and ravelling it gives consecutive pieces of the range. A range needs at most
    2 * rank - 1 blocks (one for rank 0): a partial head row per dimension, one block of whole
    rows, and a partial tail row per dimension.
    """
    shape = tuple(shape)
    numel = math.prod(shape)
    if not 0 <= start <= stop <= numel:
        raise ValueError(f"range [{start}, {stop}) is not inside a tensor of {numel} elements")
    return _range_blocks(shape, start, stop)


def _range_blocks(shape: tuple[int, ...], start: int, stop: int) -> Iterator[tuple[slice, ...]]:
    if start == stop:
        return
    if not shape:
        yield ()
        return
    row_size = math.prod(shape[1:])  # > 0, since the range is not empty
    first_row, head = divmod(start, row_size)
    last_row, tail = divmod(stop, row_size)
    if first_row == last_row:  # the range lies inside one row
        for inner in _range_blocks(shape[1:], head, tail):
            yield (slice(first_row, first_row + 1), *inner)
        return
    if head:  # finish the partly covered first row
        for inner in _range_blocks(shape[1:], head, row_size):
            yield (slice(first_row, first_row + 1), *inner)
        first_row += 1
    if first_row < last_row:  # whole rows
        yield (slice(first_row, last_row), *(slice(0, dim) for dim in shape[1:]))
    if tail:  # start of the partly covered last row
        for inner in _range_blocks(shape[1:], 0, tail):
            yield (slice(last_row, last_row + 1), *inner)


def aligned_step(shape: tuple[int, ...], chunk_elems: int) -> int:
    """The largest multiple of prod(shape[k:]) that is <= chunk_elems, for the smallest k
    whose trailing slab fits: pieces then start on slab boundaries and most are one block.
    Needs every dimension >= 1."""
    slab = 1
    for dim in reversed(shape):
        if slab * dim > chunk_elems:
            break
        slab *= dim
    return chunk_elems // slab * slab


def block_shape(block: tuple[slice, ...]) -> tuple[int, ...]:
    return tuple(part.stop - part.start for part in block)


def band_chunks(shape: Sequence[int], chunks: Sequence[int]) -> int:
    """The chunks that reading `shape` in C-order pieces may need kept decoded at once:
    every chunk of two bands along the first axis whose chunks hold more than one index
    of it (a piece may end inside one band, whose chunks the next piece goes on with, and
    begin the next). Axes before it are chunked one index at a time: their bands' chunks
    are read one after another (row chunks (1, 2**18) of a [2, 2**27] need two chunks, not
    two rows of 512 each: a 64 MiB cache, 60 MiB more at every read). Two where every
    axis is chunked one index at a time, and for rank 0."""
    for axis, (dim, chunk) in enumerate(zip(shape, chunks, strict=True)):
        if min(dim, chunk) > 1:
            later = zip(shape[axis + 1 :], chunks[axis + 1 :], strict=True)
            return 2 * max(1, math.prod(-(-d // c) for d, c in later))
    return 2


class BandReader:
    """C-order pieces of a chunked dataset cut from bands of whole chunks along its first
    axis (`rows` rows each), read one band at a time. The library then decodes each
    chunk once and can let it go, whatever the pieces; the pieces keep their bounds, so
    sums over them associate as before."""

    def __init__(self, dataset: Any, shape: tuple[int, ...], dtype: Any, rows: int) -> None:
        self._dataset = dataset
        self._shape = shape
        self._dtype = dtype
        self._rows = rows
        self._row_size = math.prod(shape[1:])
        self._first = -1  # the band held: its first row, and its values in C order
        self._values: np.ndarray | None = None
        self._buffer: np.ndarray | None = None

    def piece(self, start: int, stop: int) -> np.ndarray:
        """Elements [start, stop) of the dataset in C order."""
        out = np.empty(stop - start, dtype=self._dtype)
        at = start
        while at < stop:
            first = at // self._row_size // self._rows * self._rows
            values = self._band(first)
            begin = first * self._row_size
            take = min(stop, begin + values.size) - at
            out[at - start : at - start + take] = values[at - begin : at - begin + take]
            at += take
        return out

    def _band(self, first: int) -> np.ndarray:
        if first != self._first or self._values is None:
            last = min(first + self._rows, self._shape[0])
            if self._buffer is None:  # one buffer for every band: no fresh pages each time
                self._buffer = np.empty((self._rows, *self._shape[1:]), dtype=self._dtype)
            band = self._buffer[: last - first]
            self._first = -1  # the buffer is being overwritten: no band held until read
            self._dataset.read_direct(band, source_sel=np.s_[first:last])
            self._first, self._values = first, band.reshape(-1)
        return self._values
