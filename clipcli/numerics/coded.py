"""Statistics of values stored as 8-bit codes times a scale per block, without the values.

A block of codes under one scale holds at most 256 distinct values: code_value x scale.
So the statistics of a run of rows (sum of squares, max |x|, extremes, NaN and infinity
counts) follow from how often each code occurs in each block (one np.bincount over the
codes, offset by their block) and a 256-entry table of values per block: the same
products a decoder makes, so every value, NaN and infinity (inf x 0 = NaN, an overflowing
product = inf) is the decoder's. No float64 array of the run's size is made: one pass
over the codes instead of a widening, a multiply and NormAccumulator.add's three passes.
Packed 4-bit codes under 8-bit scale codes (MXFP4, NVFP4: blocks of 32 or 16 values, too
few for a table each) are counted per (scale code, code) pair instead: blocks of one scale
code share their 16 values, so one table of 256 x 16 serves a run (nibble_counts).

The sum of squares is count x value**2 summed over the distinct values, scaled by the one
rule (norms.rescale_exponent) of the run's largest finite magnitude, as NormAccumulator
scales a chunk: the same float64 sum with rescaling, grouped by value.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

from clipcli.numerics.norms import NormAccumulator, rescale_exponent

CODES = 256  # values of an 8-bit code
COUNT_PIECE = 1 << 18  # codes per np.bincount call (its intp copy: 2 MiB)


def tables_pay(blocks: int, elements: int) -> bool:
    """True when counting codes per block costs less than decoding them: the blocks hold
    CODES elements or more on average (a table and its counts per block are CODES
    entries; smaller blocks would make more table entries than values)."""
    return blocks * CODES <= elements


def block_code_counts(
    codes: np.ndarray, first_row: int, block_rows: int, block_columns: int
) -> np.ndarray:
    """How often each code occurs in each block of `codes` (uint8 [rows, columns], rows
    first_row.. of a tensor cut into blocks of block_rows x block_columns, edge blocks
    partial): int64 [row blocks of these rows, column blocks, CODES], row blocks counted
    from the one first_row lies in."""
    rows, columns = codes.shape
    first_block = first_row // block_rows
    row_blocks = (first_row + rows - 1) // block_rows - first_block + 1 if rows else 0
    column_blocks = -(-columns // block_columns)
    bins = row_blocks * column_blocks * CODES
    index_type = np.uint16 if bins <= 1 << 16 else np.uint32 if bins <= 1 << 32 else np.intp
    if column_blocks > 1:
        column_offset = (np.arange(columns) // block_columns * CODES).astype(index_type)
        index = np.add(codes, column_offset[None, :], dtype=index_type)
    else:
        index = codes.astype(index_type)
    if row_blocks > 1:
        row_of = (np.arange(first_row, first_row + rows) // block_rows - first_block).astype(
            index_type
        )
        index += (row_of * (column_blocks * CODES))[:, None]
    flat = index.reshape(-1)
    # np.bincount widens its input to intp: in pieces, so that copy stays small.
    counts = np.bincount(flat[:COUNT_PIECE], minlength=bins)
    for begin in range(COUNT_PIECE, flat.size, COUNT_PIECE):
        counts += np.bincount(flat[begin : begin + COUNT_PIECE], minlength=bins)
    return counts.reshape(row_blocks, column_blocks, CODES)


def nibble_counts(packed: np.ndarray, scale_codes: np.ndarray, block: int) -> np.ndarray:
    """How often each (scale code, 4-bit code) pair occurs: int64 [CODES, 16]. `packed`
    is uint8 [rows, n], two codes a byte (both counted), `scale_codes` uint8 [rows,
    ceil(2n / block)], the 8-bit scale of each block of `block` codes (even: a byte's two
    codes share a block). Blocks of one scale code share their table, so a run of any
    size needs one table of CODES x 16 values, whatever its block size."""
    width = packed.shape[1]
    per_block = block // 2  # bytes per block
    scale_of_byte = np.repeat(scale_codes.astype(np.uint16) << 4, per_block, axis=1)
    scale_of_byte = scale_of_byte[:, :width]
    counts = np.zeros(CODES * 16, dtype=np.int64)
    for nibble in (packed & 0x0F, packed >> 4):
        index = np.bitwise_or(scale_of_byte, nibble, dtype=np.uint16).reshape(-1)
        for begin in range(0, index.size, COUNT_PIECE):
            counts += np.bincount(index[begin : begin + COUNT_PIECE], minlength=CODES * 16)
    return counts.reshape(CODES, 16)


def table_statistics(counts: np.ndarray, values: np.ndarray) -> NormAccumulator:
    """The statistics NormAccumulator.add gives for a chunk holding counts[i] copies of
    values[i] (any shapes of equal size; float64 values, NaN and inf included)."""
    counts = counts.reshape(-1)
    present = np.flatnonzero(counts != 0)  # a bool array first: ~7x faster
    held = counts[present]
    shown = values.reshape(-1)[present]
    acc = NormAccumulator()
    acc.numel = int(held.sum())
    nan = np.isnan(shown)
    infinite = np.isinf(shown)
    acc.nan_count = int(held[nan].sum())
    acc.inf_count = int(held[infinite].sum())
    acc.nonfinite = acc.nan_count + acc.inf_count
    ordered = shown[~nan]  # extremes of the non-NaN values, infinities included
    if ordered.size:
        acc.max_value = float(ordered.max())
        acc.min_value = float(ordered.min())
    finite = ~(nan | infinite)
    magnitudes = np.abs(shown[finite])
    if magnitudes.size == 0:
        return acc
    peak = float(magnitudes.max())
    acc.max_abs = peak
    if peak == 0.0:
        return acc
    exp = rescale_exponent(peak)
    scaled = np.ldexp(magnitudes, -exp) if exp else magnitudes
    # counts below 2**53 are exact in float64; each term count x v**2 rounds once.
    # np.sum, not a BLAS dot: on a few thousand entries its threads spin for milliseconds.
    terms = scaled * scaled
    terms *= held[finite]
    acc.add_sumsq(float(np.sum(terms)), exp)
    return acc


# Terms summed by one np.sum in bounded_table_sumsq: its error is then at most 7 float64
# roundings of their sum, whatever order numpy adds them in.
_PIECE = 8


def bounded_table_sumsq(counts: np.ndarray, values: np.ndarray) -> tuple[Fraction, Fraction] | None:
    """The sum of squares of a run holding counts[i] copies of values[i], and a bound of
    its error on either side (about 2**-48 of it): the factor search's check of a quantized
    weight from its code counts (clipcli.numerics.certain.CertainSumsq.add_bounded). None
    when a counted value is NaN or infinite (the caller decodes).

    Each term count x v**2 (v scaled by the power of two of the largest, so at most 1)
    rounds at most three times (a count of 2**53 or more, as code energies are, once to
    float64); pieces of _PIECE terms are added by np.sum (at most 7 roundings of a sum of
    nonnegative terms) and the pieces by math.fsum (correctly rounded): the sum is within
    3 + 7 + 1 roundings of the exact one, bounded by 32. A value below 2**-400
    of the largest (its square may leave float64's normal range) is counted in the bound
    instead, as its largest possible square."""
    counts = counts.reshape(-1)
    present = np.flatnonzero(counts != 0)  # a bool array first: ~7x faster
    magnitudes = np.abs(values.reshape(-1)[present])
    if not np.isfinite(magnitudes).all():
        return None
    peak = float(magnitudes.max()) if magnitudes.size else 0.0
    if peak == 0.0:
        return Fraction(0), Fraction(0)
    exp = math.frexp(peak)[1]
    scaled = np.ldexp(magnitudes, -exp)  # exact: every value kept is 2**-400 or more
    held = counts[present].astype(np.float64)  # exact below 2**53, else rounded once
    tiny = scaled < 2.0**-400
    tiny_count = int(counts[present][tiny].sum()) if tiny.any() else 0
    if tiny_count:
        scaled, held = scaled[~tiny], held[~tiny]
    terms = scaled * scaled
    terms *= held
    pad = -terms.size % _PIECE
    if pad:
        terms = np.concatenate([terms, np.zeros(pad)])
    total = math.fsum(terms.reshape(-1, _PIECE).sum(axis=1).tolist())
    weight = Fraction(4) ** exp
    bound = Fraction(total) * Fraction(1, 2**48) + tiny_count * Fraction(1, 2**800)
    return Fraction(total) * weight, bound * weight
