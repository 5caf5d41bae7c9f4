"""Elementwise operations on 8- and 16-bit floats through lookup tables.

ml_dtypes converts, compares and rounds 8-bit floats one element at a time: here 6 ns per
element to widen to float32, 6 ns to clip and 16 ns to scale and round back. But an 8-bit
float has only 256 values (a float16 65,536), and everything clipcli does to one is
elementwise (widening, clamping, scaling then rounding), so an operation is computed once
on all the values, with the very same functions, and looked up per element with np.take
(0.7 ns for a 256-entry table, 1 ns for a 128 KiB float16 one). The result is identical
by construction. numpy's float16 is no better off: np.clip on it compares in software at
11 ns/element.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from clipcli.dtypes import all_values, bits_dtype, float32_values


def as_float32(chunk: np.ndarray) -> np.ndarray:
    """An 8-bit float chunk widened to float32: exact for every value, NaN included."""
    wide: np.ndarray = np.take(float32_values(chunk.dtype), chunk.view(np.uint8))
    return wide


def table_of(dtype: np.dtype[Any], elementwise: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """elementwise() of every value of the 1- or 2-byte dtype, in that dtype, as its bits.
    A wider result (ml_dtypes' np.clip returns float32) is cast back, as a writer would."""
    with np.errstate(all="ignore"):  # the table holds NaN and extremes a chunk may not
        table = np.asarray(elementwise(all_values(dtype)))
        table = np.ascontiguousarray(table.astype(dtype, copy=False))
    if table.shape != (256**dtype.itemsize,):
        raise ValueError(f"not an elementwise map: all values gave shape {table.shape}")
    bits: np.ndarray = table.view(bits_dtype(dtype))
    return bits


# Elements from which an 8-bit chunk is counted and looked up two codes at a time (below
# it the pair path's few extra calls cost more than they save).
PAIRED_FROM = 4096


def look_up(chunk: np.ndarray, table: np.ndarray) -> np.ndarray:
    """The chunk's elements replaced by table[bits] (a table from table_of)."""
    if table.dtype.itemsize == 1 and chunk.size >= PAIRED_FROM:
        return _look_up_pairs(chunk, table)
    looked_up: np.ndarray = np.take(table, chunk.view(table.dtype))
    return looked_up.view(chunk.dtype)


def _look_up_pairs(chunk: np.ndarray, table: np.ndarray) -> np.ndarray:
    """look_up of an 8-bit chunk two codes at a time, through a 65,536-entry table of
    code pairs: half the elements for np.take to widen and gather (its cost is per
    element, not per byte). Each byte still becomes table[byte]."""
    codes = np.ascontiguousarray(chunk).reshape(-1).view(np.uint8)
    out = np.empty(codes.size, np.uint8)
    even = codes.size - codes.size % 2
    pairs = codes[:even].view(np.uint16)
    # mode="clip": out= is then written directly (mode="raise" buffers it); every uint16
    # indexes the 65,536-entry table, so nothing is ever clipped.
    np.take(_pair_table(table.tobytes()), pairs, out=out[:even].view(np.uint16), mode="clip")
    out[even:] = np.take(table, codes[even:])
    return out.reshape(chunk.shape).view(chunk.dtype)


@functools.lru_cache(maxsize=16)
def _pair_table(table_bytes: bytes) -> np.ndarray:
    """The table of code pairs of a 256-entry table (its bytes: the cache's key): the
    entry for the two bytes b0 b1, read as one native uint16, is table[b0] table[b1] in
    the same byte order, whatever the machine's."""
    table = np.frombuffer(table_bytes, np.uint8)
    pairs = np.arange(65536, dtype=np.uint16).view(np.uint8)  # each pair's bytes, in order
    paired: np.ndarray = np.take(table, pairs).view(np.uint16)
    paired.flags.writeable = False
    return paired


def bit_pattern_counts(chunk: np.ndarray) -> np.ndarray:
    """How many elements of an 8- or 16-bit chunk hold each bit pattern (intp, one entry
    per pattern), as np.bincount of its bits counts them. An 8-bit chunk is counted two
    codes at a time (bincount's cost is per element): the counts of each pair, summed
    over either code of the pair."""
    bits = chunk.reshape(-1).view(bits_dtype(chunk.dtype))
    if chunk.dtype.itemsize != 1 or bits.size < PAIRED_FROM:
        counts: np.ndarray = np.bincount(bits, minlength=256**chunk.dtype.itemsize)
        return counts
    bits = np.ascontiguousarray(bits)
    even = bits.size - bits.size % 2
    pairs = np.bincount(bits[:even].view(np.uint16), minlength=65536).reshape(256, 256)
    # A pair's uint16 is first + 256 * second code (little-endian) or the reverse: either
    # way each code is a row index once and a column index once, so the sum of the two
    # marginals counts every element of the pairs exactly once.
    counts = pairs.sum(axis=0)
    counts += pairs.sum(axis=1)
    counts += np.bincount(bits[even:], minlength=256)
    return counts


def by_table(chunk: np.ndarray, elementwise: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """elementwise(chunk) in the chunk's dtype, computed on all values and looked up.
    `elementwise` must treat each element on its own (scaling, clamping)."""
    return look_up(chunk, table_of(chunk.dtype, elementwise))
