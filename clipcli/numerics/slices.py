"""Per-slice norms and --axes scales: clip_by_norm with the norm taken over some axes, so
each slice (a row, a column, a filter) gets its own factor.

The whole tensor is in memory (the caller reads it); float64 working copies are made per
block of rows, so memory stays bounded by the tensor plus SLICE_BLOCK_BYTES.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

from clipcli.dtypes import is_small_float, mantissa_digits, real_dtype, smallest_subnormal
from clipcli.numerics.certain import split_sumsq, sumsq_error_bound, two_square
from clipcli.numerics.norms import accumulate_array, rescale_exponents
from clipcli.numerics.rounding import narrow_round, scale_chunk
from clipcli.numerics.scaling import WideBound
from clipcli.numerics.search import (
    AMBIGUOUS,
    U64,
    Margin,
    exact_product_bits,
    guesses,
    search_factors,
    worst_unit,
)
from clipcli.numerics.widening import widen, widen_real

# Working memory for the float64 copies that slice norms need, per block of slices.
SLICE_BLOCK_BYTES = 8 << 20


def slice_blocks(shape: tuple[int, ...], axes: tuple[int, ...]) -> list[tuple[slice, ...]]:
    """Index tuples cutting an array into contiguous blocks of rows (along axis 0), each
    small enough that its float64 copy fits SLICE_BLOCK_BYTES."""
    full = tuple(slice(None) for _ in shape)
    if not shape or math.prod(shape) * 8 <= SLICE_BLOCK_BYTES:
        return [full]
    per_row = max(1, math.prod(shape[1:])) * 8
    step = max(1, SLICE_BLOCK_BYTES // per_row)
    return [(slice(start, start + step),) + full[1:] for start in range(0, shape[0], step)]


def slice_norms(array: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
    """Norms over `axes` (keepdims), exact in float64; inf where a norm overflows."""
    sums, exps = slice_sumsq(array, axes)
    with np.errstate(over="ignore"):
        norms: np.ndarray = np.ldexp(np.sqrt(sums), exps)
    return norms


def slice_sumsq(array: np.ndarray, axes: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """(sums, exps) with keepdims: each slice's norm is sqrt(sums) * 2**exps, kept apart so
    that norms beyond float64's range still give exact ratios. Computed over blocks of rows
    so the float64 working copy stays bounded."""
    keep_shape = [1 if i in axes else n for i, n in enumerate(array.shape)]
    if array.size == 0:
        return np.zeros(keep_shape), np.zeros(keep_shape, dtype=np.int64)
    if len(axes) == array.ndim:
        acc = accumulate_array(array)
        return np.full(keep_shape, acc.ssq), np.full(keep_shape, acc.exp, dtype=np.int64)
    blocks = slice_blocks(array.shape, axes)
    if 0 not in axes:  # each block holds whole slices
        parts = [_scaled_sums(array[b], axes) for b in blocks]
        return (
            np.concatenate([p[1] for p in parts], axis=0),
            np.concatenate([p[0] for p in parts], axis=0),
        )
    # Slices run across blocks: find each slice's peak first, so that every block is
    # scaled by the same power of two and the partial sums simply add.
    peak = np.zeros(keep_shape)
    for block in blocks:
        peak = np.maximum(peak, _peaks(array[block], axes))
    exps = rescale_exponents(peak)
    total = np.zeros(keep_shape)
    for block in blocks:
        total += _sum_squares(array[block], axes, exps)
    return total, exps


def _wide_abs(array: np.ndarray) -> np.ndarray:
    """|x| as float64 (the modulus for complex)."""
    wide: np.ndarray = np.abs(widen(array))
    return wide


def _peaks(array: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
    peaks: np.ndarray = np.max(_wide_abs(array), axis=axes, keepdims=True)
    return peaks


def _sum_squares(array: np.ndarray, axes: tuple[int, ...], exps: np.ndarray) -> np.ndarray:
    magnitudes = _wide_abs(array)
    scaled = np.ldexp(magnitudes, -exps) if np.any(exps) else magnitudes
    sums: np.ndarray = np.sum(scaled * scaled, axis=axes, keepdims=True)
    return sums


def _scaled_sums(array: np.ndarray, axes: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """(exponents, scaled sums of squares) of the slices of one block."""
    exps = rescale_exponents(_peaks(array, axes))
    return exps, _sum_squares(array, axes, exps)


def axes_scales(
    array: np.ndarray, axes: tuple[int, ...], limit: float
) -> tuple[np.ndarray, np.ndarray]:
    """(per-slice norms, per-slice factors) with keepdims; factor 1.0 marks unchanged slices.

    Each slice over the limit gets the largest factor whose rounded slice has norm <= C,
    all slices searched at once (search_factors). For 8- and 16-bit floats the margin is
    exact: a histogram per slice would need 65,536 counts per slice, so the slice's own
    values serve as its (sparse) histogram, one float64 copy of the slices being clipped:
    memory bounded by the tensor, each search step one vectorised pass over that copy. For
    wider floats the rounding bound of WideBound is applied per slice, needing no pass.
    """
    sums, exps = slice_sumsq(array, axes)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        norms = np.ldexp(np.sqrt(sums), exps)
        # limit / norm from the scaled sums, so slices whose norm overflows still clip.
        ratios = np.where(
            sums > 0, np.ldexp(limit / np.sqrt(np.where(sums > 0, sums, 1.0)), -exps), np.inf
        )
    over = (ratios < 1.0 + AMBIGUOUS) & np.isfinite(sums)
    scales = np.ones(ratios.shape)
    if not np.any(over) or math.isinf(limit):
        return norms, scales
    near = over & (np.abs(ratios - 1.0) <= AMBIGUOUS)
    if np.any(near):
        # Within the sums' own rounding error of C: decide exactly (a norm equal to C stays).
        within = _rows_within_exactly(_rows(array, axes, near), limit)
        over[near] = ~within
        ratios = np.where(near, np.minimum(ratios, 1 - U64), ratios)
        if not np.any(over):
            return norms, scales
    bits = exact_product_bits([array.dtype])
    slice_numel = math.prod(array.shape[a] for a in axes)
    unit = worst_unit([array.dtype])
    if is_small_float(array.dtype) or mantissa_digits(array.dtype) == 53:
        # 8/16-bit: exact from the values; float64: the bound would cost ~slice_numel
        # ulps, so the rounded slices are summed with a certain error bound instead.
        margin = _slice_values_margin(array, axes, over, limit)
    else:
        # np.sum over each slice errs by at most slice_numel roundings (pairwise: fewer).
        bound = WideBound(1.0, unit, smallest_subnormal(array.dtype), slice_numel)
        rel_error = (slice_numel + 8) * U64
        slice_ratio = ratios[over] * (1 - rel_error)

        def margin(factors: np.ndarray) -> np.ndarray:
            w = bound.relative_norm(factors / slice_ratio, limit)
            result: np.ndarray = 1.0 - 2 * U64 - w * w * (1 + 4 * U64)
            return result

    lows, highs = guesses(ratios[over], unit)
    scales[over] = search_factors(margin, lows, highs, bits)
    return norms, scales


def _slice_values_margin(
    array: np.ndarray, axes: tuple[int, ...], over: np.ndarray, limit: float
) -> Margin:
    """margin(factors) for the slices marked `over`, from their values (8/16-bit floats)."""
    picked = _picked_slices(array, axes, over)
    values = widen_real(picked)
    per_slice = values.shape[1]
    flat = values.reshape(-1)
    slices = picked.shape[0]
    terms = per_slice + 4
    small = is_small_float(array.dtype)

    def margin(factors: np.ndarray) -> np.ndarray:
        each = np.repeat(factors, per_slice)  # complex: per real and imaginary part
        rounded = narrow_round(flat * each, real_dtype(array.dtype)).astype(np.float64)
        rounded = rounded.reshape(slices, per_slice)
        if not small:
            return _certain_rows_margin(rounded, limit)
        rounded /= limit
        sums = (rounded * rounded).sum(axis=1)
        result: np.ndarray = 1.0 - 2 * U64 - sums * (1 + terms * U64)
        return result

    return margin


def _picked_slices(array: np.ndarray, axes: tuple[int, ...], which: np.ndarray) -> np.ndarray:
    """The slices marked in `which` (keepdims shape) as rows of a 2-D array."""
    rest = [i for i in range(array.ndim) if i not in axes]
    moved = np.moveaxis(array, list(axes), list(range(array.ndim - len(axes), array.ndim)))
    rows = moved.reshape(math.prod(array.shape[i] for i in rest), -1)
    picked: np.ndarray = rows[which.reshape(-1)]
    return picked


def _rows(array: np.ndarray, axes: tuple[int, ...], which: np.ndarray) -> np.ndarray:
    """The marked slices as float64 rows (complex: re and im side by side), exact."""
    return widen_real(_picked_slices(array, axes, which))


def _rows_within_exactly(rows: np.ndarray, limit: float) -> np.ndarray:
    """Whether each float64 row's exact sum of squares is <= limit**2 (as fractions: slow,
    used only for slices whose measured norm is within rounding error of the limit)."""
    bound = Fraction(limit) ** 2
    return np.array(
        [sum((Fraction(v) ** 2 for v in row.tolist() if v), Fraction(0)) <= bound for row in rows],
        dtype=bool,
    )


def _certain_rows_margin(rows: np.ndarray, limit: float) -> np.ndarray:
    """1 - (a certain upper bound of each row's sum of squares) / limit**2, for float64
    rows (norms.split_sumsq: the only rounding left is in adding the tiny error terms,
    bounded explicitly)."""
    peak = np.max(np.abs(rows), axis=1)
    exps = np.frexp(np.where(peak > 0, peak, 1.0))[1]
    x = np.ldexp(rows, -exps[:, None])
    main, rest = split_sumsq(x)
    corr = rest.sum(axis=1)
    bound = sumsq_error_bound(x, rest)
    with np.errstate(over="ignore", invalid="ignore"):
        c = np.ldexp(np.full(rows.shape[0], limit), -exps)
        c_high, c_low = two_square(c)
        gap = (c_high - main) + (c_low - corr) - bound - 4 * U64 * U64 * c_high
        result = gap / c_high
    return np.where(np.isfinite(c_high), result, 1.0)


def scale_slices(array: np.ndarray, scales: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
    """array * scales (per slice), rounded to the dtype; one output copy, bounded temps."""
    out = np.empty_like(array)
    for block in slice_blocks(array.shape, axes):
        out[block] = scale_chunk(array[block], scales[_scale_index(block, axes)])
    return out


def _scale_index(block: tuple[slice, ...], axes: tuple[int, ...]) -> tuple[slice, ...]:
    """The same block in the keepdims scales array (size 1 along the reduced axes)."""
    return tuple(slice(None) if i in axes else part for i, part in enumerate(block))
