"""Per-slice norms and --axes scales: clip_by_norm with the norm taken over some axes, so
each slice (a row, a column, a filter) gets its own factor.

The whole tensor is in memory (the caller reads it); float64 working copies are made per
block of rows, so memory stays bounded by the tensor plus SLICE_BLOCK_BYTES.
"""

from __future__ import annotations

import functools
import itertools
import math
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, NamedTuple, Protocol, TypeVar, cast

import numpy as np

from clipcli.dtypes import (
    bits_dtype,
    is_floating,
    is_small_float,
    mantissa_digits,
    parts_per_element,
    real_dtype,
    smallest_subnormal,
    smallest_without_zero,
)
from clipcli.errors import DataRefusedError
from clipcli.numerics import sign_magnitude
from clipcli.numerics.certain import (
    CertainSumsq,
    counted_squares_within,
    counted_terms,
    limit_split,
    pairwise_two_sum,
    rest_rounding_bound,
    split_sumsq,
    terms_at_most,
    terms_within,
    two_square,
    underflow_bound,
)
from clipcli.numerics.norms import NormAccumulator, accumulate_array, rescale_exponents
from clipcli.numerics.rounding import narrow_round, rounded_as_float64, scale_chunk
from clipcli.numerics.scaling import (
    Factor,
    OutputSumsq,
    Problem,
    WideBound,
    decided_without_output,
    each_factor,
    refuse_unreachable,
)
from clipcli.numerics.search import (
    AMBIGUOUS,
    U64,
    Margin,
    Narrow,
    exact_product_bits,
    grid_step_below,
    guesses,
    on_grid,
    search_factors,
    worst_unit,
)
from clipcli.numerics.widening import widen, widen_real

# Working memory for the float64 copies that slice norms need, per block of slices.
SLICE_BLOCK_BYTES = 8 << 20


def slice_blocks(shape: tuple[int, ...]) -> list[tuple[slice, ...]]:
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
    keep_shape = list(keepdims_shape(array.shape, axes))
    if array.size == 0:
        return np.zeros(keep_shape), np.zeros(keep_shape, dtype=np.int64)
    if len(axes) == array.ndim:
        acc = accumulate_array(array)
        return np.full(keep_shape, acc.ssq), np.full(keep_shape, acc.exp, dtype=np.int64)
    blocks = slice_blocks(array.shape)
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
    """|x| as float64 (the modulus for complex), a new array."""
    wide: np.ndarray = widen(array)
    magnitudes: np.ndarray = (
        np.abs(wide)
        if wide is array or wide.dtype.kind == "c"
        else np.abs(wide, out=wide)  # a copy widen made: no second float64 copy
    )
    return magnitudes


def _peaks(array: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
    peaks: np.ndarray = np.max(_wide_abs(array), axis=axes, keepdims=True)
    return peaks


def _sum_squares(array: np.ndarray, axes: tuple[int, ...], exps: np.ndarray) -> np.ndarray:
    magnitudes = _wide_abs(array)
    scaled = np.ldexp(magnitudes, -exps) if np.any(exps) else magnitudes
    # Squared in place (both are this function's own arrays): one float64 copy of the
    # block rather than two, where boxes are worked out side by side.
    np.multiply(scaled, scaled, out=scaled)
    sums: np.ndarray = np.sum(scaled, axis=axes, keepdims=True)
    return sums


def _scaled_sums(array: np.ndarray, axes: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """(exponents, scaled sums of squares) of the slices of one block."""
    exps = rescale_exponents(_peaks(array, axes))
    return exps, _sum_squares(array, axes, exps)


def axes_scales(
    array: np.ndarray, axes: tuple[int, ...], limit: float, name: str = "tensor"
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
    return scales_from_sums(
        sums,
        exps,
        limit,
        array.dtype,
        array.shape,
        axes,
        lambda near: _rows_within_exactly(_rows(array, axes, near), limit),
        lambda over: _picked_slices(array, axes, over),
        name,
    )


def held_axes_scales(
    array: np.ndarray, axes: tuple[int, ...], limit: float, name: str = "tensor"
) -> np.ndarray:
    """The factors (keepdims) of a tensor held whole: long slices (counts_long_slices, the
    tensor being one box) are searched as the streamed path searches them, each as
    `clip --norm` searches a tensor; others by axes_scales. A float64 [2**20] at a limit
    within an ulp of its norm took 5 s deciding the tie on its values (attack s42)."""
    if counts_long_slices(array.shape, axes, array.dtype, box_elements(array.dtype)):
        return box_axes_scales(array, axes, array.dtype, limit, name)
    return axes_scales(array, axes, limit, name)[1]


_F = TypeVar("_F", bound=Callable[..., Any])


def _without_float_warnings(fn: _F) -> _F:
    """fn run with numpy's floating-point warnings off. Limits far below (or above) the
    data's scale take the margins' relative squares past float64's range: inf is over the
    limit, NaN never fits, 0 fits, all of them decided as they should be; numpy's warnings
    of it are not clipcli's to print (stderr holds clipcli's lines only: --norm 1e-300
    --axes 0 printed a RuntimeWarning, attack s33num2)."""

    @functools.wraps(fn)
    def quiet(*args: Any, **kwargs: Any) -> Any:
        with np.errstate(all="ignore"):
            return fn(*args, **kwargs)

    return cast(_F, quiet)


@_without_float_warnings
def scales_from_sums(
    sums: np.ndarray,
    exps: np.ndarray,
    limit: float,
    dtype: np.dtype[Any],
    shape: tuple[int, ...],
    axes: tuple[int, ...],
    within_exactly: Callable[[np.ndarray], np.ndarray],
    picked: Callable[[np.ndarray], np.ndarray],
    name: str = "tensor",
    first: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """axes_scales from the slices' sums of squares (slice_sumsq), whatever holds the data:
    within_exactly(near) says, for the slices marked `near` (in C order), whether each
    one's exact sum of squares is <= limit**2; picked(over) gives the slices marked `over`
    as rows (only asked for 8/16-bit floats and float64, whose margin needs the values).
    DataRefusedError (exit 4) when a slice needs clipping and no factor can do it (a dtype
    without zero), naming the tensor (`name`) and the slice (`first` is the number of the
    first slice of `sums` in the tensor), as group_factor refuses a tensor."""
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
        within = within_exactly(near)
        over[near] = ~within
        ratios = np.where(near, np.minimum(ratios, 1 - U64), ratios)
        if not np.any(over):
            return norms, scales
    slice_numel = math.prod(shape[a] for a in axes)
    if smallest_without_zero(dtype) is not None:
        # Without this the search rounds the slice to its smallest values, over the limit
        # (--norm 1e-300 --axes 1 on float8_e8m0fnu wrote norms of 2e-38, exit 0). After
        # the exact decision: a slice at the least norm its dtype allows, equal to the
        # limit, is within it and kept.
        number = first + int(np.flatnonzero(over)[0])
        refuse_unreachable([_SliceExtent(f"{name} (slice {number})", dtype, slice_numel)], limit)
    bits = exact_product_bits([dtype])
    unit = worst_unit([dtype])
    if is_small_float(dtype):  # exact from the values, narrowed as the search closes in
        rounding = _SliceRounding.of(picked(over), limit)
        lows, highs = rounding.guesses(ratios[over], unit, bits)
        scales[over] = search_factors(
            rounding.margin,
            lows,
            highs,
            bits,
            next_change=rounding.next_change,
            narrow=rounding.within,
        )
        return norms, scales
    if mantissa_digits(dtype) == 53:
        # float64: the bound would cost ~slice_numel ulps, so the rounded slices are
        # summed with a certain error bound instead.
        margin = _slice_values_margin(picked(over), dtype, limit)
    else:
        # np.sum over each slice errs by at most one rounding a value (pairwise: fewer);
        # a complex element's parts are two values, rounded apart (attack s36).
        values = slice_numel * parts_per_element(dtype)
        bound = WideBound(1.0, unit, smallest_subnormal(dtype), values)
        rel_error = (values + 8) * U64
        slice_ratio = ratios[over] * (1 - rel_error)

        def margin(factors: np.ndarray) -> np.ndarray:
            w = bound.relative_norm(factors / slice_ratio, limit)
            result: np.ndarray = 1.0 - 2 * U64 - w * w * (1 + 4 * U64)
            return result

    lows, highs = guesses(ratios[over], unit)
    scales[over] = search_factors(margin, lows, highs, bits)
    return norms, scales


# Values whose margins _slice_values_margin works out at once: each step makes some six
# float64 temporaries of them (the products, their rounding, the scaled rows, the split
# sums), which over a whole window of gathered values (64 MiB) took complex128 columns,
# [2^16, 2^10] --axes 0, to 296 MB. At 2**20 values (8 MiB a temporary) the certain
# margin ran from memory at 16-19 ns a value; at 2**17 (1 MiB) from cache at 9.5-10
# (float64 --axes 1 of [1024, 2**17] searches five margins a box). Each row's margin
# depends on that row alone, so the block changes no factor; a row longer than this is
# worked out a piece of this many values at a time (_long_row_margin).
MARGIN_BLOCK_VALUES = 1 << 17


def _slice_values_margin(picked: np.ndarray, dtype: np.dtype[Any], limit: float) -> Margin:
    """margin(factors) for float64 slices given as rows, from their values, a block of
    rows (MARGIN_BLOCK_VALUES) at a time; a row longer than that a piece at a time
    (_long_row_margin)."""
    values = widen_real(picked)  # complex: real and imaginary parts side by side
    per_block = max(1, MARGIN_BLOCK_VALUES // max(1, values.shape[1]))
    rounds_to = real_dtype(dtype)
    if values.shape[1] > MARGIN_BLOCK_VALUES:
        peaks = np.max(np.abs(values), axis=1)

        def long_rows_margin(factors: np.ndarray) -> np.ndarray:
            return np.array(
                [
                    _long_row_margin(row, float(factor), float(peak), rounds_to, limit)
                    for row, factor, peak in zip(values, factors, peaks, strict=True)
                ]
            )

        return long_rows_margin

    def margin(factors: np.ndarray) -> np.ndarray:
        result = np.empty(values.shape[0])
        for start in range(0, values.shape[0], per_block):
            rows = slice(start, start + per_block)
            rounded = rounded_as_float64(values[rows] * factors[rows, None], rounds_to)
            result[rows] = _certain_rows_margin(rounded, limit)
        return result

    return margin


def _long_row_margin(
    row: np.ndarray, factor: float, peak: float, dtype: np.dtype[Any], limit: float
) -> float:
    """_certain_rows_margin of one row scaled by `factor` and rounded to `dtype`, worked
    out MARGIN_BLOCK_VALUES values at a time, so that its temporaries are a piece's, not
    the row's (float64 columns of 2**20 values, --axes 0: 8 MiB each, some ten of them at
    once, took a 1 GiB [2**20, 128] to 205 MB). `peak` is the row's largest magnitude:
    rounding is monotone and symmetric, so the rounded row's is its product rounded. The
    plain sum of squares decides where it can (the same test, for any order of its
    additions). Otherwise the split sums are those of the row taken whole, bit for bit:
    the pieces are aligned blocks of the pairwise tree (MARGIN_BLOCK_VALUES rounded down
    to a power of two), their error terms go where the whole row's go (_pairwise_layout),
    and the pieces' sums are added pairwise as the whole row's levels add them. (Bounds
    worked out piece by piece gave another factor, one ulp apart, on a row crafted
    between the two: attack s43b.)"""
    block = 1 << (MARGIN_BLOCK_VALUES.bit_length() - 1)  # a power of two: aligned blocks
    pieces = range(0, row.size, block)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore", under="ignore"):
        top = float(rounded_as_float64(np.array([peak * factor]), dtype)[0])
        exp = math.frexp(top if top > 0 else 1.0)[1]
        c = np.ldexp(np.full(1, limit), -exp)  # float64 arithmetic: c * c may be 0 or inf

        def scaled(start: int) -> np.ndarray:
            piece = row[start : start + block]
            x: np.ndarray = np.ldexp(rounded_as_float64(piece * factor, dtype), -exp)
            return x

        total = np.full(1, sum(float(np.dot(x, x)) for x in map(scaled, pieces)))
        ratio = total / (c * c)
        if _plainly_decided(ratio, c * c, row.size)[0]:
            return float(1.0 - ratio[0])
        offsets = _pairwise_layout(row.size)
        rest = np.zeros((1, offsets[-1]))  # the whole row's error terms, as split_sumsq's
        mains = np.empty((1, len(pieces)))
        underflow = np.zeros(1)  # exact: a sum of multiples of 2**-1072
        for k, start in enumerate(pieces):
            x = scaled(start)[None, :]
            high, low = two_square(x)
            main, errors = pairwise_two_sum(high)
            mains[0, k] = main[0]
            rest[0, start : start + low.shape[1]] = low[0]
            for level, error in enumerate(errors, start=1):
                at = offsets[level] + start // 2**level
                rest[0, at : at + error.shape[1]] = error[0]
            underflow += underflow_bound(x)
        main_sum, errors = pairwise_two_sum(mains)
        first = block.bit_length()  # the level the pieces' sums are added at
        for level, error in enumerate(errors, start=first):
            rest[0, offsets[level] : offsets[level] + error.shape[1]] = error[0]
        return float(_split_margin(main_sum, rest, underflow, c)[0])


def _pairwise_layout(size: int) -> list[int]:
    """Where split_sumsq's error terms of a row of `size` values lie: the squares' low
    parts from 0, then each level L's (the additions of level L - 1's values in pairs,
    the odd one out with a padding 0) from entry L; the last entry is how many there are
    in all."""
    offsets = [0, size]
    length = size
    while length > 1:
        length = (length + length % 2) // 2
        offsets.append(offsets[-1] + length)
    return offsets


# Values per slice from which _SliceRounding sorts a slice's codes with numpy's stable
# (radix) sort rather than its default one. Per 2**20 float16 codes (one thread): rows of 2
# 9.8 ms stable against 2.4 default, of 256 3.6 against 0.5, of 1,024 2.7 against 3.8, of
# 11,008 2.6 against 10.8.
RADIX_SORT_FROM = 1024


@dataclass(frozen=True)
class _SliceRounding:
    """margin(factors) for slices of 8/16-bit floats given as rows: each slice's exact sum
    of its rounded products, from its own histogram of magnitudes, as _HistogramBound
    (numerics.scaling) does for a whole tensor, with next_change and within per slice.
    within(low, high) sums the values whose rounded product is the same at both ends of
    their slice's bracket (the same all through: rounding is monotone) once into `fixed`;
    each later step rounds only the others. A bfloat16 [4096, 11008] clipped with --axes 1
    took 25 s rounding every value of every slice some 40 times; its slices hold ~1,000
    distinct magnitudes each.

    Where a margin is close enough to 0 for the float64 sum's rounding to decide its sign
    (fixed + the moving values' sum adds a slice's terms in another order than the whole
    histogram does), the sign is decided exactly (_whole_margin). Each slice's factor is
    then the largest on the search's grid whose output's exact norm is <= limit: it
    depends on the slice alone, not on the search's history or the slices searched beside
    it (an attack found a float16 slice whose factor moved a step with the narrowing)."""

    dtype: np.dtype[Any]  # the dtype the products round to
    limit: float
    slices: int
    terms: int  # values per slice (and 4): the float64 sums' error bound
    magnitudes: np.ndarray  # float64, exact, nonzero: distinct per slice, still moving
    counts: np.ndarray  # float64: how many times each is in its slice
    owner: np.ndarray  # the slice of each (nondecreasing)
    fixed: np.ndarray  # per slice: sum of count * (round(v * s) / limit)**2, settled values
    whole: tuple[np.ndarray, np.ndarray, np.ndarray]  # magnitudes, counts, each slice's start
    begins: np.ndarray  # where each slice's moving values start (and, last, their end)
    # The last few margins asked for (factors, margins): the search asks for every slice's
    # margin at each step, and keeps most slices' factors from one step to the next (a
    # slice whose guesses bracket its answer waits at its low end while others go on).
    # A slice whose factor was asked for before gets that margin again, without rounding
    # its values: a float16 box of 2**20 elements went through ~7 roundings of all its
    # values, most of them for slices already bracketed.
    recent: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list, compare=False)

    @staticmethod
    def of(picked: np.ndarray, limit: float) -> _SliceRounding:
        """From the slices' values as rows (finite: slices with inf or NaN are never over
        the limit). Each row's magnitudes are sorted by their bits (the order of their
        values) and counted."""
        slices, per_slice = picked.shape
        bits = picked.view(bits_dtype(picked.dtype))
        layout = sign_magnitude.layout(picked.dtype)
        if layout is not None:  # |x| is x's code without the sign bit (np.abs: 9x slower)
            magnitudes_bits = bits & np.asarray(layout.half - 1, bits.dtype)
        else:
            magnitudes_bits = np.abs(picked).view(bits.dtype)
        # Codes are integers, so any sort gives the same rows. numpy's stable sort of 16-bit
        # codes is a radix sort, with a cost per row that short rows do not amortise.
        if per_slice >= RADIX_SORT_FROM:
            codes = np.sort(magnitudes_bits, axis=1, kind="stable")
        else:
            codes = np.sort(magnitudes_bits, axis=1)
        flat = codes.reshape(-1)
        first = np.empty(flat.size, bool)
        first[:1] = True
        np.not_equal(flat[1:], flat[:-1], out=first[1:])
        first[::per_slice] = True  # every row starts its own runs
        starts = np.flatnonzero(first)
        counts = np.empty(starts.size)
        np.subtract(starts[1:], starts[:-1], out=counts[:-1])
        counts[-1:] = flat.size - starts[-1:]
        magnitudes = widen(flat[starts].view(picked.dtype))
        zeros = magnitudes == 0  # (not code 0: float8_e8m0fnu's is 2**-127)
        if zeros.any():
            starts, counts, magnitudes = starts[~zeros], counts[~zeros], magnitudes[~zeros]
        begins = np.searchsorted(starts, np.arange(slices + 1) * per_slice)
        owner = np.repeat(np.arange(slices), np.diff(begins))
        return _SliceRounding(
            picked.dtype,
            limit,
            slices,
            per_slice + 4,
            magnitudes,
            counts,
            owner,
            np.zeros(slices),
            (magnitudes, counts, begins),
            begins,
        )

    def guesses(
        self, ratios: np.ndarray, unit: float, bits: int
    ) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Brackets around each slice's answer, nearest first. A slice's rounding errors
        shift its answer from TF's factor r by about unit / sqrt(3 * its elements) (2**-14
        for a bfloat16 row of 11,008), far past search.guesses' nearest rungs, and every
        rung missed is a pass over all the values. So the rounded output is summed once at
        r and the answer estimated from it (the sum grows as s**2); the rungs sit at 0.5, 2
        and 8 spreads on either side of the estimate, and the search's own widest rungs
        stay as the last resort. Measured per box of 2**20 elements: a bfloat16 row of
        11,008 46 -> 29 ms, float16 113 -> 68 ms, bfloat16 rows of 16 578 -> 292 ms,
        float16 pairs 783 -> 649 ms. Slices of CROSSINGS_FROM values or more are first
        guessed where that sum crosses limit**2 as the values' roundings change one by one
        (_crossing): the answer itself, or a step above it, wherever the float64 sums decide
        it right (bfloat16 rows of 4,096: 40 -> 15 ms a box). Each factor is the same
        whatever the guesses: the search is exact."""
        # The spread: unit * sqrt(sum of w**2 / 3), w a value's share of its slice's sum.
        squares = self.magnitudes * self.magnitudes
        sums = _segment_sums(self.counts * squares, self.begins)
        fourths = _segment_sums(self.counts * squares * squares, self.begins)
        with np.errstate(all="ignore"):
            spread = unit * np.sqrt(fourths / 3) / sums
        spread = np.where(np.isfinite(spread), np.minimum(spread, unit), unit)
        lows, highs = guesses(ratios, unit)
        if self.terms - 4 < CROSSINGS_FROM:
            with np.errstate(all="ignore"):
                at_ratio = 1.0 - self.margin(ratios)  # the rounded sum of squares / limit**2
                estimate = ratios / np.sqrt(at_ratio)
            estimate = np.where(np.isfinite(estimate) & (estimate > 0), estimate, ratios)
            return (
                [estimate * (1 - c * spread) for c in (0.5, 2, 8)] + lows[-1:],
                [estimate * (1 + c * spread) for c in (0.5, 2, 8)] + highs[-1:],
            )
        crossing, estimate = self._crossing(ratios, spread, unit, bits)
        low_rungs = [estimate * (1 - c * spread) for c in (0.5, 2, 8)]
        high_rungs = [estimate * (1 + c * spread) for c in (0.5, 2, 8)]
        found = np.isfinite(crossing)
        return (
            [
                np.where(found, crossing, low_rungs[0]),
                np.where(
                    found, grid_step_below(np.where(found, crossing, 0.0), bits), low_rungs[1]
                ),
                *low_rungs,
                *lows[-1:],
            ],
            [np.where(found, crossing, high_rungs[0]), *high_rungs, *highs[-1:]],
        )

    def _crossing(
        self, ratios: np.ndarray, spread: np.ndarray, unit: float, bits: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """(crossing, estimate) per slice. The crossing: where its rounded output's sum of
        squares crosses limit**2 within a quarter of the dtype's relative spacing (unit / 2)
        of TF's factor (NaN where it does not), from the factors at which its values'
        roundings change: a value's product crosses the midpoint of two neighbours of the
        dtype, a step of count * (upper**2 - lower**2). Within that window no value
        crosses twice. The search takes it, and the step below it, as its first guesses:
        one of the two is the answer wherever the float64 sums decide the crossing right,
        and two margins then bracket it to a single step, where the bisection took ~30 per
        box. The estimate: TF's factor scaled by how far the output's sum of squares there
        is from limit**2 (the sum grows as s**2).

        The steps are looked through in a window reaching past the estimate by NEAR_SPREADS
        spreads first, then, for the slices whose crossing is not in it, in the whole window: a
        slice left to the bisection costs a box as much as all the others (~30 margins),
        and the whole window holds a third of float16 rows' values."""
        start = on_grid(ratios, bits)
        codes = narrow_round(self.magnitudes * start[self.owner], self.dtype)
        here = widen(codes)
        scaled = here / self.limit
        sums = self.fixed + _segment_sums(self.counts * scaled * scaled, self.begins)
        fits = sums <= 1.0
        with np.errstate(all="ignore"):
            estimate = start / np.sqrt(sums)
            near = np.abs(estimate / start - 1.0) * 1.5 + NEAR_SPREADS * spread
        estimate = np.where(np.isfinite(estimate) & (estimate > 0), estimate, ratios)
        near = np.where(np.isfinite(near), np.minimum(near, unit / 2), unit / 2)
        # Upward from a slice that fits (the first step that takes it over), downward
        # from one that does not (the last step down that brings it within). A product
        # or neighbour past the ends (inf, NaN, a code wrapped below 0) is no step.
        up = fits[self.owner]
        code = codes.view(bits_dtype(self.dtype))
        one = np.asarray(1, code.dtype)
        with np.errstate(all="ignore"):
            there = widen(np.where(up, code + one, code - one).view(self.dtype))
            steps = np.where(up, there > here, (there < here) & (code > 0))
            middle = (here + there) * 0.5  # exact: the products cross it at `at` below
            steps &= np.isfinite(middle)  # neither end overflowed to inf (or is NaN)
        crossing = np.full(self.slices, np.nan)
        whole = np.full(self.slices, unit / 2)
        for width in (near, whole):
            # The steps within the window, of the slices still without a crossing: all of
            # them at first, then the few slices' own values, where the first window was
            # not the whole one already (short slices' often is).
            without = np.isnan(crossing) if width is near else np.isnan(crossing) & (near < whole)
            missing = np.flatnonzero(without)
            if not missing.size:
                break
            at = None if missing.size == self.slices else _positions(self.begins, missing)[0]
            owner, magnitudes, mid, upward, stepping = (
                (self.owner, self.magnitudes, middle, up, steps)
                if at is None
                else (self.owner[at], self.magnitudes[at], middle[at], up[at], steps[at])
            )
            reach = magnitudes * (start * np.where(fits, 1 + width, 1 - width))[owner]
            stepping = stepping & np.where(upward, mid <= reach, mid >= reach)
            picked = np.flatnonzero(stepping) if at is None else at[stepping]
            self._first_step_over(picked, start, width, sums, fits, here, there, crossing)
        return crossing, estimate

    def _first_step_over(
        self,
        picked: np.ndarray,
        start: np.ndarray,
        width: np.ndarray,
        sums: np.ndarray,
        fits: np.ndarray,
        here: np.ndarray,
        there: np.ndarray,
        crossing: np.ndarray,
    ) -> None:
        """_crossing's steps `picked` (value positions) taken in order from each slice's
        start until its sum crosses 1: the factor of that step into `crossing`. Sorting
        every step (a tenth of a box's values) cost more than the bisection it saves; so
        they are first summed by cells of their slice's window, and only the cell where
        the sum crosses 1 is sorted."""
        if not picked.size:
            return
        owner, magnitudes = self.owner[picked], self.magnitudes[picked]
        at = (here[picked] + there[picked]) * 0.5 / magnitudes
        after_step, before_step = there[picked] / self.limit, here[picked] / self.limit
        step = (after_step * after_step - before_step * before_step) * self.counts[picked]
        distance = np.abs(at / start[owner] - 1.0) / width[owner]  # 0 .. 1, nearest first
        cells = int(np.clip(picked.size // (4 * self.slices), 1, 64))
        cell = np.minimum(distance * cells, cells - 1).astype(np.intp)
        per_cell = np.bincount(owner * cells + cell, step, self.slices * cells)
        per_cell = per_cell.reshape(self.slices, cells)
        after = np.cumsum(per_cell, axis=1)
        after += sums[:, None]
        crossed = np.where(fits[:, None], after > 1.0, after <= 1.0)
        found = np.asarray(crossed.any(axis=1))
        first_cell = np.argmax(crossed, axis=1)
        every = np.arange(self.slices)
        before = after[every, first_cell] - per_cell[every, first_cell]
        inside = np.flatnonzero(found[owner] & (cell == first_cell[owner]))
        if not inside.size:
            return
        owner, at, step = owner[inside], at[inside], step[inside]
        order = np.lexsort((distance[inside], owner))
        owner, at, step = owner[order], at[order], step[order]
        firsts = np.flatnonzero(np.r_[True, owner[1:] != owner[:-1]])
        running = np.cumsum(step)
        running -= np.repeat(running[firsts] - step[firsts], np.diff(np.r_[firsts, owner.size]))
        totals = before[owner] + running
        hits = np.flatnonzero(np.where(fits[owner], totals > 1.0, totals <= 1.0))
        if hits.size:
            first_hit = hits[np.r_[True, owner[hits][1:] != owner[hits][:-1]]]
            crossing[owner[first_hit]] = at[first_hit]

    def _rounded(self, factors: np.ndarray) -> np.ndarray:
        each = factors[self.owner]
        rounded: np.ndarray = rounded_as_float64(self.magnitudes * each, self.dtype)
        return rounded

    def margin(self, factors: np.ndarray) -> np.ndarray:
        result = np.empty(self.slices)
        todo = np.ones(self.slices, bool)
        for known, margins in reversed(self.recent):
            same = todo & (factors == known)
            result[same] = margins[same]
            todo &= ~same
        if todo.all():
            result = self._margin_of(factors, None)
        elif todo.any():
            which = np.flatnonzero(todo)
            result[which] = self._margin_of(factors, which)
        if len(self.recent) >= 4:
            del self.recent[0]
        self.recent.append((factors.copy(), result.copy()))
        return result

    def _margin_of(self, factors: np.ndarray, which: np.ndarray | None) -> np.ndarray:
        """The margins of the slices `which` (None: every slice), worked out: each slice's
        terms are summed in the same order either way, so a margin does not depend on the
        slices asked for with it."""
        if which is None:
            begins = self.begins
            magnitudes, counts, fixed = self.magnitudes, self.counts, self.fixed
            each = factors[self.owner]
        else:
            at, _ = _positions(self.begins, which)
            begins = _begins_of(self.begins[which + 1] - self.begins[which])
            magnitudes, counts, fixed = self.magnitudes[at], self.counts[at], self.fixed[which]
            each = factors[self.owner[at]]
        rounded = rounded_as_float64(magnitudes * each, self.dtype) / self.limit
        squares = rounded * rounded * counts  # exact: a count times a square
        sums = fixed + _segment_sums(squares, begins)
        result: np.ndarray = 1.0 - 2 * U64 - sums * (1 + self.terms * U64)
        # Two orders of adding a slice's terms differ by at most ~terms roundings of it.
        close = np.flatnonzero(np.abs(result) <= 4 * self.terms * U64)
        if close.size:
            slices = close if which is None else which[close]
            result[close] = self._whole_margin(factors, slices)
        return result

    def _whole_margin(self, factors: np.ndarray, which: np.ndarray) -> np.ndarray:
        """The margin of the slices `which`, its sign decided exactly over each one's whole
        histogram (the float64 sum can put either sign within its error bound). Each term
        count * round(v * s)**2 is an exact float64 (a square of at most 11 significant
        bits, times a count), and limit**2 is split exactly in two (Dekker): one term
        against them is a subtraction (slices of one magnitude: one element, or equal
        ones, whose best output often lands exactly on the limit), more are added up
        exactly (math.fsum, or extraction for long slices: certain.terms_at_most). Limits
        too far out for the split are decided with fractions (counted_squares_within)."""
        magnitudes, counts, begins = self.whole
        lengths = begins[which + 1] - begins[which]
        ends = np.cumsum(lengths)
        at, local = _positions(begins, which)
        wide = rounded_as_float64(magnitudes[at] * factors[which][local], self.dtype)
        scaled = wide / self.limit
        counted = counts[at]
        sums = _segment_sums(scaled * scaled * counted, _begins_of(lengths))
        approximate = 1.0 - 2 * U64 - sums * (1 + self.terms * U64)
        fits = np.empty(which.size, bool)
        split = limit_split(self.limit)
        if split is None:  # limits too far out for the split: fractions, slice by slice
            for k in range(which.size):
                part = slice(ends[k] - lengths[k], ends[k])
                fits[k] = counted_squares_within(wide[part], counted[part], self.limit)
            return np.where(fits, np.maximum(approximate, 0.0), np.minimum(approximate, -U64 * U64))
        low_terms, high_terms = counted_terms(wide, counted)
        rest = np.ones(which.size, bool)
        if high_terms is None:
            # One term is a subtraction: t - c_high is exact when t is within a factor of
            # 2 of it (slices of one magnitude: one element, or equal ones, whose best
            # output often lands exactly on the limit).
            c_high, c_low = split
            single = lengths == 1
            t = low_terms[ends[single] - 1]
            near = (t >= c_high / 2) & (t <= 2 * c_high)
            fits[single] = np.where(near, (t - c_high) <= c_low, t <= c_high)
            rest = ~single
        # More terms: math.fsum per slice, the terms worked out once for all of them (a
        # numpy call per slice made 200,000 rows of [6, 8] at a tie 7x slower: s33num).
        for k in np.flatnonzero(rest).tolist():
            begin, end = int(ends[k] - lengths[k]), int(ends[k])
            own = low_terms[begin:end]
            if high_terms is not None:
                own = np.concatenate([own, high_terms[begin:end]])
            # A long slice's terms are added up by extraction (math.fsum costs ~260 ns a
            # term where their exponents spread wide).
            if own.size > EXTRACT_FROM_TERMS:
                fits[k] = terms_at_most(own, split)
            else:
                fits[k] = terms_within(own.tolist(), split)
        return np.where(fits, np.maximum(approximate, 0.0), np.minimum(approximate, -U64 * U64))

    def next_change(self, factors: np.ndarray) -> np.ndarray:
        """Per slice, a lower bound of the smallest factor above its own at which any of
        its moving values' rounded product changes (inf: none moves)."""
        first = np.full(self.slices, np.inf)
        if not self.magnitudes.size:
            return first
        rounded = narrow_round(self.magnitudes * factors[self.owner], self.dtype)
        uint = bits_dtype(self.dtype)
        up = (rounded.view(uint) + np.asarray(1, uint)).view(self.dtype)
        with np.errstate(all="ignore"):
            here, there = widen(rounded), widen(up)
            there = np.where(np.isfinite(there) & (there > here), there, np.inf)
            crossing = (here + there) / 2 / self.magnitudes
        starts = np.flatnonzero(np.r_[True, self.owner[1:] != self.owner[:-1]])
        first[self.owner[starts]] = np.minimum.reduceat(crossing, starts)
        result: np.ndarray = first * (1 - 4 * U64)
        return result

    def within(self, low: np.ndarray, high: np.ndarray) -> tuple[Margin, Margin, Narrow]:
        at_low, at_high = self._rounded(low), self._rounded(high)
        settled = at_low == at_high
        rounded = at_low[settled] / self.limit
        settled_before = np.concatenate([[0], np.cumsum(settled)])  # settled values before
        fixed = self.fixed + _segment_sums(
            rounded * rounded * self.counts[settled], settled_before[self.begins]
        )
        moving = ~settled
        owner = self.owner[moving]
        narrowed = _SliceRounding(
            self.dtype,
            self.limit,
            self.slices,
            self.terms,
            self.magnitudes[moving],
            self.counts[moving],
            owner,
            fixed,
            self.whole,
            np.searchsorted(owner, np.arange(self.slices + 1)),
        )
        return narrowed.margin, narrowed.next_change, narrowed.within


# Values per slice from which the search's first guesses are the crossings
# (_SliceRounding._crossing). Shorter slices' answers lie further from TF's factor, in
# wider windows of more values, and the few slices whose crossing is not found keep the
# bisection going for the box. CPU per box of 2**20 values, estimate's rungs against
# crossings (min of 3, benchmarks/RESULTS.md session 48): bfloat16 rows of 128 86 / 104
# ms, 512 57 / 67, 1,024 43 / 46, 2,048 31 / 20, 4,096 40 / 15; float16 rows of 128 93 /
# 86, 1,024 75 / 67, 4,096 59 / 44; float8_e4m3fn rows of 1,024 19 / 14.
CROSSINGS_FROM = 1024
# How far past the estimate, in spreads, the first window of crossings reaches (then the
# whole window for the slices left): 8 spreads took bfloat16 rows of 4,096 21 ms a box, 2
# spreads 15 (fewer values to step through; a few more slices look again).
NEAR_SPREADS = 2


# From this many terms a slice's exact sum goes through extraction first (a few numpy
# passes, ~20 us each) rather than math.fsum alone.
EXTRACT_FROM_TERMS = 256


def _segment_sums(values: np.ndarray, begins: np.ndarray) -> np.ndarray:
    """For each segment values[begins[k]:begins[k + 1]] (begins nondecreasing, its last
    the end of `values`), its sum; 0 for an empty one. np.add.reduceat over the nonempty
    segments: ~0.2 ns a value, where bincount with weights over the segments' owners took
    3.6 (the float16 --axes search summed every slice's moving values that way at each
    step). A segment's sum depends on its own values alone, so a margin does not depend
    on the slices asked for with it."""
    sums = np.zeros(begins.size - 1)
    starts = begins[:-1]
    nonempty = starts < begins[1:]
    if nonempty.any():
        sums[nonempty] = np.add.reduceat(values, starts[nonempty])
    return sums


def _begins_of(lengths: np.ndarray) -> np.ndarray:
    """Where each of segments of these lengths, laid end to end, begins (and, last, their
    end)."""
    begins = np.zeros(lengths.size + 1, np.intp)
    np.cumsum(lengths, out=begins[1:])
    return begins


def _positions(begins: np.ndarray, which: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The positions of the values of the slices `which` (in order), given where each
    slice's values begin (begins[k] to begins[k + 1]), and for each the index into
    `which` of its slice."""
    lengths = begins[which + 1] - begins[which]
    ends = np.cumsum(lengths)
    local = np.repeat(np.arange(which.size), lengths)
    at = np.repeat(begins[which], lengths) + (
        np.arange(local.size) - np.repeat(ends - lengths, lengths)
    )
    return at, local


def _picked_slices(array: np.ndarray, axes: tuple[int, ...], which: np.ndarray) -> np.ndarray:
    """The slices marked in `which` (keepdims shape) as rows of a 2-D array."""
    picked: np.ndarray = _slice_rows(array, axes)[which.reshape(-1)]
    return picked


def _slice_rows(array: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
    """The array's slices over `axes` (or their pieces, in a box) as the rows of a 2-D
    array, in C order of the slices: a view where the reduced axes are the last ones."""
    moved = np.moveaxis(array, list(axes), list(range(array.ndim - len(axes), array.ndim)))
    return moved.reshape(math.prod(n for i, n in enumerate(array.shape) if i not in axes), -1)


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


# Where limit**2 (scaled as the rows are) lies in this range, a row's plain float64 sum of
# squares may decide its margin: c * c is then within one rounding of c**2, and what
# squares lose below float64's normal range (2**-1074 each at most) is far below it.
_PLAIN_DECIDES = (2.0**-900, 2.0**900)


def _certain_rows_margin(rows: np.ndarray, limit: float) -> np.ndarray:
    """1 - (a certain upper bound of each row's sum of squares) / limit**2, for float64
    rows, or, where the row's plain float64 sum of squares is far enough from limit**2
    for its rounding to leave no doubt, 1 - that sum / limit**2 (the same sign). Such rows
    cost ~1 ns a value; the others take the split sums (norms.split_sumsq: the only
    rounding left is in adding the tiny error terms, bounded explicitly), ~10 ns. The
    search's first guesses, 2**-24 either side of TF's factor, are all decided plainly:
    two of the five margins a float64 slice's search takes."""
    peak = np.max(np.abs(rows), axis=1)
    exps = np.frexp(np.where(peak > 0, peak, 1.0))[1]
    x = np.ldexp(rows, -exps[:, None])
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        c = np.ldexp(np.full(rows.shape[0], limit), -exps)
        # einsum: no temporary of the squares (a row of a gathered column can be 8 MiB).
        ratio = np.einsum("ij,ij->i", x, x) / (c * c)
    plain = _plainly_decided(ratio, c * c, rows.shape[1])
    result: np.ndarray = 1.0 - ratio
    split = np.flatnonzero(~plain)
    if split.size == x.shape[0]:
        result = _split_rows_margin(x, c)  # every row: no copy of them
    elif split.size:
        result[split] = _split_rows_margin(x[split], c[split])
    return result


def _plainly_decided(ratio: np.ndarray, csq: np.ndarray, terms: int) -> np.ndarray:
    """Where the plain ratio (sum of `terms` squares) / csq, both in float64, is certainly
    on the same side of 1 as the exact one. Each square rounds once and the sum adds
    terms - 1 times, in whatever order: the sum is within gamma(terms) of the exact one
    (Higham, 3.1); c * c and the quotient round once each. A slack of (terms + 4) * U64 *
    1.01 covers them all while terms * U64 is small (rows of up to 2**40 values: 2**-13)."""
    slack = (terms + 4) * U64 * 1.01
    usable = (csq >= _PLAIN_DECIDES[0]) & (csq <= _PLAIN_DECIDES[1]) & np.isfinite(ratio)
    decided: np.ndarray = usable & ((ratio * (1 + slack) < 1.0) | (ratio * (1 - slack) > 1.0))
    return decided


def _split_rows_margin(x: np.ndarray, c: np.ndarray) -> np.ndarray:
    """_certain_rows_margin's certain bound for rows scaled to peaks in [0.5, 1), against
    the limit scaled alike (c)."""
    main, rest = split_sumsq(x)
    return _split_margin(main, rest, underflow_bound(x), c)


def _split_margin(
    main: np.ndarray, rest: np.ndarray, underflow: np.ndarray, c: np.ndarray
) -> np.ndarray:
    """Per row, 1 - (a certain upper bound of main + the sum of rest's terms, and what
    underflow may have lost) / c**2 (split_sumsq's parts of rows scaled as c is). `rest`
    is overwritten: its magnitudes are summed in place."""
    corr = rest.sum(axis=1)
    bound = rest_rounding_bound(rest.shape[1], np.abs(rest, out=rest).sum(axis=1)) + underflow
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        c_high, c_low = two_square(c)
        gap = (c_high - main) + (c_low - corr) - bound - 4 * U64 * U64 * c_high
        result = gap / c_high
    return np.where(np.isfinite(c_high), result, 1.0)


def scale_slices(array: np.ndarray, scales: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
    """array * scales (per slice), rounded to the dtype; one output copy, bounded temps."""
    out = np.empty_like(array)
    for block in slice_blocks(array.shape):
        out[block] = scale_chunk(array[block], scales[_scale_index(block, axes)])
    return out


def _scale_index(block: tuple[slice, ...], axes: tuple[int, ...]) -> tuple[slice, ...]:
    """The same block in the keepdims scales array (size 1 along the reduced axes)."""
    return tuple(slice(None) if i in axes else part for i, part in enumerate(block))


# ---------------------------------------------------------------- a tensor read in pieces
#
# --axes on a tensor too big to hold (a 1 GiB tensor was held twice: 2.1 GB RSS): the data
# comes as boxes, each a contiguous stretch of the C-order tensor that is itself a block of
# it, array[i0, ..., i(d-1), a:b, :, ..., :], at most STREAM_BOX_ELEMENTS long. Every pass
# over the tensor (`Boxes`, called once per pass) visits the boxes in order; the slices'
# sums of squares add up over them, then a last pass scales box by box. Memory: the
# per-slice arrays and one box with its float64 copies, whatever the tensor's size.
# Where each box holds whole slices (boxes_hold_whole_slices: most --axes uses), the
# per-slice arrays are a box's too: its factors are found and used box by box, so the
# memory stays flat however many slices the tensor has (25 million slices of a 100 MB
# float16 tensor took 4.4 GB with whole-tensor arrays).

STREAM_BOX_ELEMENTS = 1 << 20


def box_elements(dtype: np.dtype[Any]) -> int:
    """The box size for `dtype`: STREAM_BOX_ELEMENTS up to 8 bytes an element, fewer for
    wider ones, so that a box's float64 working copies take no more than a float64 box's
    (complex128 rows with --axes 1 took 242 MB with boxes of 2**20 elements, 16 MiB)."""
    return max(1, STREAM_BOX_ELEMENTS * 8 // max(8, dtype.itemsize))


BoxIndex = tuple[int | slice, ...]
Box = tuple[np.ndarray, BoxIndex]  # a box shaped as a block, and its index


class Boxes(Protocol):
    """A pass over a tensor's boxes, in order, read anew on each call. Given `only` (a test
    of a box's index), the pass yields just the boxes it accepts and may leave the others
    unread (a reader with random access does): a check of one long slice's output read the
    whole tensor for it, a pass per float64 row ([64, 2**21] with --axes 1: 64 GiB read)."""

    def __call__(self, only: Callable[[BoxIndex], bool] | None = None) -> Iterator[Box]: ...


def accepted(boxes: Iterable[Box], only: Callable[[BoxIndex], bool] | None) -> Iterator[Box]:
    """The boxes whose index `only` accepts (all of them without it), for passes over boxes
    that are at hand or read in order anyway."""
    return iter(boxes) if only is None else (box for box in boxes if only(box[1]))


def box_indices(shape: tuple[int, ...], budget: int) -> list[tuple[int | slice, ...]]:
    """The index of each box of an array of `shape`, in C order: ints on the leading axes,
    a slice on one axis, whole axes after it; every box at most `budget` elements (a last
    axis longer than the budget is itself cut into ranges)."""
    if math.prod(shape) == 0:
        return []
    axis = cut_axis(shape, budget)
    if axis < 0:
        return [tuple(slice(None) for _ in shape)]
    row = math.prod(shape[axis + 1 :])
    step = max(1, budget // row)
    rest = tuple(slice(None) for _ in shape[axis + 1 :])
    return [
        (*lead, slice(start, min(start + step, shape[axis])), *rest)
        for lead in itertools.product(*(range(n) for n in shape[:axis]))
        for start in range(0, shape[axis], step)
    ]


def cut_axis(shape: tuple[int, ...], budget: int) -> int:
    """The axis box_indices cuts into ranges (the last whose rows, with the axes after
    it, exceed the budget; never one of length 1), -1 when the whole array is one box."""
    depth = len(shape)
    while depth > 0 and math.prod(shape[depth - 1 :]) <= budget:
        depth -= 1
    return depth - 1


def boxes_hold_whole_slices(shape: tuple[int, ...], axes: tuple[int, ...], budget: int) -> bool:
    """Whether each box of `shape` holds whole slices for `axes`: the boxes cut an axis
    before every reduced one (rows of a matrix for --axes 1, filters for --axes 1 2 3),
    so the slices' factors can be found box by box, in the memory of one box. A reduced
    axis of length 1 is whole in any box."""
    cut = cut_axis(shape, budget)
    return all(a > cut or shape[a] == 1 for a in axes)


def box_shape(shape: tuple[int, ...], index: tuple[int | slice, ...]) -> tuple[int, ...]:
    """The shape of a box as a block: 1 on the leading axes."""
    return tuple(
        1 if isinstance(part, int) else len(range(*part.indices(n)))
        for part, n in zip(index, shape, strict=True)
    )


class BoxPart(NamedTuple):
    """A part of a box (split_box): its values, its index in the tensor (`at`), and where
    it lies in the box (as an index of the box, or of the box's keepdims results)."""

    values: np.ndarray
    at: BoxIndex
    within: tuple[slice, ...]


def split_box(
    box: np.ndarray, index: BoxIndex, axes: tuple[int, ...], parts: int
) -> tuple[int, list[BoxPart]]:
    """(axis, parts): a box that holds whole slices cut into up to `parts` parts along its
    first axis that is not reduced and spans more than one index; each still holds whole
    slices, whose factors are the box's, and np.concatenate(parts, axis) is the box. Axis
    -1 and the box as its one part where no axis can be cut."""
    for axis, extent in enumerate(box.shape):
        part = index[axis]
        if axis in axes or extent < 2 or not isinstance(part, slice):
            continue
        count = min(parts, extent)
        bounds = [extent * k // count for k in range(count + 1)]
        start = part.start or 0
        pieces = []
        for low, high in itertools.pairwise(bounds):
            within = (slice(None),) * axis + (slice(low, high),)
            at = index[:axis] + (slice(start + low, start + high),) + index[axis + 1 :]
            pieces.append(BoxPart(box[within], at, within))
        return axis, pieces
    return -1, [BoxPart(box, index, ())]


def box_region(index: tuple[int | slice, ...], axes: tuple[int, ...]) -> tuple[slice, ...]:
    """Where a box's per-slice results go in the keepdims arrays (size 1 on `axes`)."""
    return tuple(
        slice(0, 1) if i in axes else (slice(part, part + 1) if isinstance(part, int) else part)
        for i, part in enumerate(index)
    )


def box_slices(index: BoxIndex, shape: tuple[int, ...], axes: tuple[int, ...]) -> range:
    """The slices (numbered in C order) a box holds elements of: always consecutive ones,
    since a box fixes the leading axes, cuts one and takes the rest whole."""
    keep = keepdims_shape(shape, axes)
    bounds = [part.indices(n)[:2] for part, n in zip(box_region(index, axes), keep, strict=True)]
    first = int(np.ravel_multi_index([begin for begin, _ in bounds], keep))
    last = int(np.ravel_multi_index([end - 1 for _, end in bounds], keep))
    return range(first, last + 1)


def holding_any_of(
    shape: tuple[int, ...], axes: tuple[int, ...], span: slice
) -> Callable[[BoxIndex], bool] | None:
    """The `only` of a pass over the slices of `span`: whether a box holds elements of any
    of them; None (every box, read in order) where the span is all the slices."""
    if span.start == 0 and span.stop == math.prod(keepdims_shape(shape, axes)):
        return None

    def holds(index: BoxIndex) -> bool:
        held = box_slices(index, shape, axes)
        return bool(held.start < span.stop and span.start < held.stop)

    return holds


def _overlap(held: range, span: slice) -> tuple[slice, slice]:
    """Where the slices both `held` by a box and in `span` lie: in an array over the span,
    and in the box's own per-slice array."""
    begin, end = max(held.start, span.start), min(held.stop, span.stop)
    return slice(begin - span.start, end - span.start), slice(begin - held.start, end - held.start)


def streamed_sumsq(
    boxes: Boxes,
    shape: tuple[int, ...],
    axes: tuple[int, ...],
    dtype: np.dtype[Any],
    span: slice | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """slice_sumsq of the tensor the boxes hold (keepdims), or, given a `span` of slices,
    of those slices alone (flat), from the boxes that hold them. Only float64 data (real
    part) can need rescaling: its slices' peaks take a pass of their own first; narrower
    data cannot overflow or underflow float64 squares, and its exponents are all 0."""
    keep_shape = keepdims_shape(shape, axes)
    whole = span is None
    span = slice(0, math.prod(keep_shape)) if span is None else span
    only = holding_any_of(shape, axes, span)
    size = span.stop - span.start
    exps = np.zeros(size, dtype=np.int8)  # all 0 (one byte a slice: there may be 10**8)
    if real_dtype(dtype).itemsize >= 8:
        peak = np.zeros(size)
        for box, index in boxes(only):
            at, part = _overlap(box_slices(index, shape, axes), span)
            peak[at] = np.maximum(peak[at], _peaks(box, axes).reshape(-1)[part])
        exps = _small_exponents(peak)
        del peak  # before the sums are made: float64 [2, 2**26] --axes 0 held both
    total = np.zeros(size)
    for box, index in boxes(only):
        held = box_slices(index, shape, axes)
        at, part = _overlap(held, span)
        box_exps = np.zeros(keepdims_shape(box.shape, axes), exps.dtype)
        box_exps.reshape(-1)[part] = exps[at]
        # The box's slices outside the span have no exponent of theirs (0): their squares,
        # left out, may overflow.
        partial = len(held) > part.stop - part.start
        with np.errstate(over="ignore") if partial else np.errstate():
            total[at] += _sum_squares(box, axes, box_exps).reshape(-1)[part]
    if whole:
        return total.reshape(keep_shape), exps.reshape(keep_shape)
    return total, exps


# Peaks whose exponents _small_exponents works out at once (its temporaries: some 30
# bytes a peak; 67 million slices of a float64 [2, 2**26] peaked at 1.97 GB).
EXPONENT_BLOCK = 1 << 20


def _small_exponents(peaks: np.ndarray) -> np.ndarray:
    """rescale_exponents of each peak as int16 (float64's exponents lie within +-1100),
    a block of EXPONENT_BLOCK at a time: 2 bytes a slice kept, not 8."""
    flat = peaks.reshape(-1)
    exps = np.empty(flat.size, np.int16)
    for start in range(0, flat.size, EXPONENT_BLOCK):
        block = slice(start, start + EXPONENT_BLOCK)
        exps[block] = rescale_exponents(flat[block])
    return exps.reshape(peaks.shape)


def streamed_picked(
    boxes: Boxes,
    shape: tuple[int, ...],
    axes: tuple[int, ...],
    dtype: np.dtype[Any],
    span: slice,
) -> np.ndarray:
    """The slices numbered span.start to span.stop - 1 (in C order) of the tensor the boxes
    hold, as rows in the same order, gathered in one pass over the boxes that hold them
    (memory: those slices)."""
    rest = [i for i in range(len(shape)) if i not in axes]
    picked = np.empty((span.stop - span.start, math.prod(shape[a] for a in axes)), dtype)
    for box, index in boxes(holding_any_of(shape, axes, span)):
        ranges = _box_ranges(index, shape)
        slice_ids = _raveled([ranges[i] for i in rest], [shape[i] for i in rest])
        inside = (slice_ids >= span.start) & (slice_ids < span.stop)
        if not np.any(inside):
            continue
        columns = _raveled([ranges[a] for a in axes], [shape[a] for a in axes])
        rows = _slice_rows(box, axes)
        at = slice_ids[inside] - span.start
        if _ascending_run(at) and _ascending_run(columns):
            # A block of consecutive slices and consecutive places in them (a box of rows:
            # whole slices for --axes 1, a piece of every column for --axes 0): a copy of
            # one rectangle, where the scatter below cost ~10% of a bfloat16 --axes 1 run.
            # slice_ids ascend, so the slices inside are one run of the box's rows.
            first = int(np.argmax(inside))
            _copy_rectangle(
                picked[at[0] : at[0] + at.size, columns[0] : columns[0] + columns.size],
                rows[first : first + at.size],
            )
        else:
            picked[at[:, None], columns[None, :]] = rows[inside]
    return picked


# Columns per strip of _copy_rectangle: each row of the target then reads this many
# elements a row of the box apart, on as many pages (few enough for the TLB).
TRANSPOSE_STRIP = 8
# Target rows (slices) from which strips pay: a strip is a Python step, which a few rows
# of 8 elements do not amortise (float16 [2**25, 4] with --axes 0 took twice as long),
# and below this the plain copy's reads are close enough together anyway. Measured on
# 2**20-element boxes, float16 and float32: plain 0.9-1.1 ns/element against strips'
# 1.1-1.2 at 128 rows, 1.1-1.9 against 0.9-1.0 at 256, 3.1-3.3 against 0.9-1.1 at 4,096.
STRIPS_FROM_ROWS = 256


def _copy_rectangle(target: np.ndarray, source: np.ndarray) -> None:
    """target[...] = source for 2-D arrays of one shape. A source read across its rows (a
    box's columns, for --axes 0) is copied a strip of TRANSPOSE_STRIP columns at a time:
    numpy copies in the target's order, so each target row reads one element from each of
    the box's rows, a page apart (a TLB miss each); a strip keeps that to a few pages.
    1.0-1.5 ns/element instead of 5-11 (float64 and bfloat16 [512, 4096] boxes). Few
    target rows (a tall, narrow tensor's few columns) are copied in one go."""
    if (
        source.shape[0] < STRIPS_FROM_ROWS
        or source.shape[1] <= TRANSPOSE_STRIP
        or source.strides[1] == source.itemsize
    ):
        target[...] = source
        return
    for start in range(0, source.shape[1], TRANSPOSE_STRIP):
        strip = slice(start, start + TRANSPOSE_STRIP)
        target[:, strip] = source[:, strip]


def _box_ranges(index: tuple[int | slice, ...], shape: tuple[int, ...]) -> list[range]:
    """The positions a box at `index` spans along each axis."""
    return [
        range(part, part + 1) if isinstance(part, int) else range(*part.indices(n))
        for part, n in zip(index, shape, strict=True)
    ]


def _ascending_run(indices: np.ndarray) -> bool:
    """Whether the indices are k, k + 1, k + 2, ... (one at least)."""
    return (
        bool(indices.size)
        and int(indices[-1]) - int(indices[0]) == indices.size - 1
        and (indices.size < 2 or bool(np.all(np.diff(indices) == 1)))
    )


def _raveled(ranges: list[range], shape: list[int]) -> np.ndarray:
    """The C-order flat indices, in `shape`, of the block that `ranges` spans, in C order."""
    if not ranges:
        return np.zeros(1, np.intp)
    # Ranges as aranges: np.ix_ makes arrays of Python ranges element by element (~27 ns
    # each: a box of float64 rows of 2**17 values spent 3.5 ms a box on its columns).
    axes = [np.arange(r.start, r.stop, r.step, dtype=np.intp) for r in ranges]
    flat: np.ndarray = np.ravel_multi_index(np.ix_(*axes), shape).reshape(-1)
    return flat


# Slices whose factors are worked out together (scales_from_sums), at most: its temporaries
# are ~12 float64 arrays of this many, and 8/16-bit floats and float64 search the values of
# the slices over the limit: at most SLICE_PIECE_VALUES of them. A search of 8/16-bit
# float slices keeps more (brackets, guesses, its recent margins: ~80 float64 arrays of
# slices or values at its peak): with pieces of 2**16 instead of 2**18, bfloat16 pairs
# ([2, 2**21] and [2, 2**23] with --axes 0) peaked at 126 and 206 MB instead of 211 and
# 303, in the same CPU time.
SLICE_PIECE = 1 << 16
SLICE_PIECE_VALUES = 1 << 20
# The values of consecutive pieces' slices are gathered together, in one pass over the
# tensor, at most this many bytes of them: a pass per piece made [2, 32M] float16 with
# --axes 0 take 213 s, growing with the square of the slices.
SLICE_WINDOW_BYTES = 64 << 20


def slice_pieces(slice_count: int, slice_numel: int, share: int = 1) -> list[slice]:
    """Ranges of slices (in C order) small enough for one scales_from_sums, each of at
    most a `share` of its values (pieces worked out side by side); its factors are each
    slice's own, so any cut gives the same ones."""
    values = max(1, SLICE_PIECE_VALUES // share)
    step = max(1, min(SLICE_PIECE, values // max(1, slice_numel)))
    return [slice(start, min(start + step, slice_count)) for start in range(0, slice_count, step)]


# How pieces of slices are worked out: the factors of each piece, in order, as map(fn,
# pieces) gives them (the default); the caller may pass a map that works them out side by
# side in worker threads (jobs.execution: system.parallel.ordered_map) and how many share
# the work, each piece then cut to that share of the values.
PieceMap = Callable[[Callable[[slice], np.ndarray], Iterable[slice]], Iterable[np.ndarray]]


def streamed_axes_scales(
    boxes: Boxes,
    shape: tuple[int, ...],
    axes: tuple[int, ...],
    dtype: np.dtype[Any],
    limit: float,
    between: Callable[[], None] = lambda: None,
    name: str = "tensor",
    first: int = 0,
    span: slice | None = None,
    side_by_side: tuple[PieceMap, int] = (map, 1),
) -> np.ndarray:
    """axes_scales' factors of the tensor the boxes hold (keepdims), or, given a `span` of
    its slices (slice_groups), of those slices alone (flat), from the boxes that hold
    them: one pass for the sums (two for float64), then the factors a piece of slices
    (slice_pieces) at a time.
    Where a piece needs its slices' values (those within rounding error of the limit; for
    8/16-bit floats and float64, every slice over it), one pass gathers the values of a
    window of pieces (SLICE_WINDOW_BYTES). Memory beyond a box: 9 bytes a slice kept (the
    sums, whose array each piece's factors then take over; float64: 10, the sums and
    their exponents; 13 at the peak, measured), a window's values and what one piece
    needs. between() is called before each piece's factors are searched (the caller's
    signal check: a window of float16 pairs is 64 pieces and ~9 s of searching, with no
    box read in between). Long slices
    (counts_long_slices) are measured and searched each as a tensor of its own instead
    (_counted_axes_scales)."""
    if counts_long_slices(shape, axes, dtype, box_elements(dtype)):
        assert span is None  # slice_groups: long slices are few, one group
        return _counted_axes_scales(boxes, shape, axes, dtype, limit, between, name, first)
    sums, exps = streamed_sumsq(boxes, shape, axes, dtype, span)
    all_sums, all_exps = sums.reshape(-1), exps.reshape(-1)
    slice_numel = math.prod(shape[a] for a in axes)
    base = 0 if span is None else span.start  # the number of the first slice of all_sums

    mapping, share = side_by_side
    pieces = [
        slice(base + piece.start, base + piece.stop)
        for piece in slice_pieces(all_sums.size, slice_numel, share)
    ]
    window_slices = max(1, SLICE_WINDOW_BYTES // max(1, slice_numel * dtype.itemsize))
    for window in _windows(pieces, window_slices):
        gathered = _Gathered(boxes, shape, axes, dtype, slice(window[0].start, window[-1].stop))

        def factors_of(piece: slice, gathered: _Gathered = gathered) -> np.ndarray:
            picked = gathered.picker(piece)
            own = slice(piece.start - base, piece.stop - base)  # the piece in all_sums
            return scales_from_sums(
                all_sums[own],
                all_exps[own],
                limit,
                dtype,
                shape,
                axes,
                _exact_check(picked, limit),
                picked,
                name,
                first + piece.start,
            )[1]

        def checked(window: list[slice] = window) -> Iterator[slice]:
            for piece in window:
                between()  # before each piece is searched (handed to a worker)
                yield piece

        for piece, factors in zip(window, mapping(factors_of, checked()), strict=True):
            # This piece's sums are used up (another piece's, being searched, are not).
            all_sums[piece.start - base : piece.stop - base] = factors
    return sums  # now the factors


# Float slices whose values take at least this many bytes are measured and searched as
# `clip --norm` measures and searches a whole tensor (8/16-bit floats on their histograms
# of bit patterns), where a box holds at most COUNTED_PIECES_PER_BOX pieces of slices.
# Gathering such slices' values held each whole, with float64 working copies: [2, 2**28]
# bfloat16 with --axes 1 took 2.7 GB and 50 s, float64 [2, 2**26] 5.8 GB and 57 s.
# A histogram is 8 bytes a bit pattern (512 KiB for 16 bits) however long the
# slice, but each piece costs a count of its own (~40 us), so with many short pieces in a
# box (long columns of a wide matrix) the gathered values are cheaper. Measured on bf16
# columns of 2**21 values, --axes 0, every column clipped: 64 columns, counted 3.0 s of
# CPU and 80 MiB against gathered 3.5 s and 133 MiB; 256 columns, 16.0 s against 11.7.
LONG_SLICE_BYTES = 4 << 20
COUNTED_PIECES_PER_BOX = 64


# Slices whose sums and factors streamed_axes_scales works out together, at most, where a
# tensor has more (slice_groups): it keeps ~9 bytes a slice while they are searched, and
# their caller keeps the factors elsewhere. Two-element bfloat16 columns, [2, 2**26] with
# --axes 0, held 676 MiB at once, 10 bytes a slice.
SLICE_GROUP = 1 << 21


def slice_groups(
    shape: tuple[int, ...], axes: tuple[int, ...], dtype: np.dtype[Any]
) -> list[slice]:
    """Spans of consecutive slices (in C order) that streamed_axes_scales can work out one
    at a time (its `span`), each at most SLICE_GROUP slices: one span of them all where
    they are no more, or long (counts_long_slices: few). A box holds consecutive slices
    (box_slices), at most box_elements of them, so a pass over a group's boxes reads each
    box at most twice in all the groups' passes."""
    count = math.prod(keepdims_shape(shape, axes))
    if count <= SLICE_GROUP or counts_long_slices(shape, axes, dtype, box_elements(dtype)):
        return [slice(0, count)]
    return [slice(start, min(start + SLICE_GROUP, count)) for start in range(0, count, SLICE_GROUP)]


def counts_long_slices(
    shape: tuple[int, ...], axes: tuple[int, ...], dtype: np.dtype[Any], budget: int
) -> bool:
    """Whether streamed_axes_scales searches the slices each as a tensor of its own: float
    slices of LONG_SLICE_BYTES or more, at most COUNTED_PIECES_PER_BOX in a box of
    box_indices(shape, budget)."""
    slice_numel = math.prod(shape[a] for a in axes)
    if not is_floating(dtype) or slice_numel * dtype.itemsize < LONG_SLICE_BYTES:
        return False
    first = box_shape(shape, box_indices(shape, budget)[0])
    pieces = math.prod(n for i, n in enumerate(first) if i not in axes)
    return pieces <= COUNTED_PIECES_PER_BOX


def _counted_axes_scales(
    boxes: Boxes,
    shape: tuple[int, ...],
    axes: tuple[int, ...],
    dtype: np.dtype[Any],
    limit: float,
    between: Callable[[], None],
    name: str,
    first: int,
) -> np.ndarray:
    """streamed_axes_scales' factors (keepdims) for counts_long_slices: each slice that
    may be over the limit is measured as `clip --norm` measures a tensor (NormAccumulator)
    and searched as a tensor of its own (scaling.each_factor: the factor `clip --norm`
    gives the slice as a 1-D tensor). 8/16-bit floats: the slices' sums of squares first
    (streamed_sumsq), then the bit patterns of those that may be over the limit counted, a
    window of SLICE_WINDOW_BYTES of histograms a pass. Wider floats keep no histogram (a
    NormAccumulator is ~1 KB): every slice is measured in one pass. Where the searches
    need outputs' norms (a tie, float64's check of its factor), one pass over the boxes
    that hold those slices answers every slice's question at once (_lockstep_factors)."""
    slice_count = math.prod(n for i, n in enumerate(shape) if i not in axes)
    scales = np.ones(slice_count)
    if math.isinf(limit):
        return scales.reshape(keepdims_shape(shape, axes))
    if is_small_float(dtype):
        windows = _candidate_windows(boxes, shape, axes, dtype, limit)
    else:
        windows = [np.arange(slice_count)]
    slice_numel = math.prod(shape[a] for a in axes)

    for window in windows:
        counted = {int(k): NormAccumulator(keep_histogram=True) for k in window}
        for slice_id, piece in _pieces_of(boxes, shape, axes, window):
            counted[slice_id].add(piece)
        problems = []
        for slice_id, stats in counted.items():
            stats.finish()
            label = f"{name} (slice {first + slice_id})"  # what messages say (a refusal)
            problems.append(
                ([_CountedSlice(label, dtype, slice_numel, stats, slice_id)], limit, None)
            )
        found = _lockstep_factors(problems, boxes, shape, axes, between)
        for slice_id, factor in zip(counted, found, strict=True):
            if factor is not None:
                scales[slice_id] = math.ldexp(factor.mantissa, factor.exponent)
    return scales.reshape(keepdims_shape(shape, axes))


def _candidate_windows(
    boxes: Boxes, shape: tuple[int, ...], axes: tuple[int, ...], dtype: np.dtype[Any], limit: float
) -> list[np.ndarray]:
    """The 8/16-bit float slices that may be over the limit (their sums' ratio within
    CANDIDATE_SLACK of it, or under), in windows of SLICE_WINDOW_BYTES of histograms. Sums
    of 8/16-bit floats are exact to far better than CANDIDATE_SLACK, so no slice over the
    limit is left out; a candidate within it is left alone by the exact search."""
    sums = streamed_sumsq(boxes, shape, axes, dtype)[0].reshape(-1)  # exponents all 0
    # A zero sum's ratio is inf, and so is one past float64 (--norm 1e300 over a slice of
    # subnormals): neither is a candidate. No warning reaches stderr (attack s44).
    with np.errstate(divide="ignore", over="ignore"):
        ratios = limit / np.sqrt(sums)
    candidates = np.flatnonzero(np.isfinite(sums) & (sums > 0) & (ratios < 1 + CANDIDATE_SLACK))
    per_window = max(1, SLICE_WINDOW_BYTES // (8 * 256**dtype.itemsize))
    return [candidates[k : k + per_window] for k in range(0, candidates.size, per_window)]


class _SliceExtent(NamedTuple):
    """A slice as refuse_unreachable's member (scaling.Extent)."""

    name: str
    dtype: np.dtype[Any]
    numel: int


class _CountedSlice(NamedTuple):
    """A long slice as the factor search's member (scaling.Measured), with its number (C
    order of the slices) for the pass over its output the search may ask for."""

    name: str
    dtype: np.dtype[Any]
    numel: int
    stats: NormAccumulator  # finished (8/16-bit floats: with the slice's histogram)
    number: int
    rounded_elsewhere: bool = False
    power_of_two: bool = False


# How far below the limit a slice's float64 norm may be and the slice still be counted:
# 8/16-bit values' squares are exact in float64, so the sums err by at most a rounding
# per addition (~2**-53 * the values, far less for pairwise sums).
CANDIDATE_SLACK = 2.0**-20


def _pieces_of(
    boxes: Boxes, shape: tuple[int, ...], axes: tuple[int, ...], wanted: np.ndarray
) -> Iterator[tuple[int, np.ndarray]]:
    """(slice number, its values in one box) for the slices numbered in `wanted` (C order
    of the slices), in one pass over the boxes: every value of each such slice once."""
    rest = [i for i in range(len(shape)) if i not in axes]
    want = np.zeros(math.prod(shape[i] for i in rest), bool)
    want[wanted] = True

    def slice_ids_of(index: BoxIndex) -> np.ndarray:
        ranges = _box_ranges(index, shape)
        return _raveled([ranges[i] for i in rest], [shape[i] for i in rest])

    def holds_one(index: BoxIndex) -> bool:
        return bool(want[slice_ids_of(index)].any())

    for box, index in boxes(only=holds_one):
        slice_ids = slice_ids_of(index)
        inside = np.flatnonzero(want[slice_ids])
        if not inside.size:
            continue
        rows = _slice_rows(box, axes)
        for k in inside.tolist():
            # Contiguous (a column's piece is a strided view): complex values are measured
            # through a view of their parts, which needs it.
            yield int(slice_ids[k]), np.ascontiguousarray(rows[k])


class _Unanswered(Exception):
    """A search asked for an output's sum of squares that no pass has worked out yet."""

    def __init__(self, question: _Question) -> None:
        super().__init__(question)
        self.question = question


class _Question(NamedTuple):
    """What a counted slice's search asks (scaling.OutputSumsq): the certain sum of squares
    of the slice scaled by mantissa * 2**exponent and rounded as the write pass rounds it."""

    slice_id: int
    mantissa: float
    exponent: int


def _lockstep_factors(
    problems: Sequence[Problem[_CountedSlice]],
    boxes: Boxes,
    shape: tuple[int, ...],
    axes: tuple[int, ...],
    between: Callable[[], None],
) -> list[Factor | None]:
    """each_factor's factor of each problem (one counted slice each), the checks of the
    outputs made for all the slices together: a pass over the boxes per slice made float64
    [2**21, 64] with --axes 0 read its 1 GiB 64 times or more. Each search is run until it
    asks about an output no pass has summed yet (_Unanswered); one pass over the boxes
    holding those slices then sums every output asked for, and the searches that asked are
    run again from their start, given what is known from memory. A search is a function of
    its slice's statistics and of these answers alone, so run again it asks the same
    questions in the same order and finds the factor each_factor finds, bit for bit: each
    answer is the sum _output_sums makes of the slice alone."""
    answers: dict[_Question, CertainSumsq] = {}

    def output_sumsq_of(of: Sequence[_CountedSlice]) -> OutputSumsq:
        def answered(members: Sequence[int], factor: Factor) -> CertainSumsq:
            if not members:  # an exact tie decided on the histogram: nothing to read
                return CertainSumsq()
            question = _Question(of[0].number, factor.mantissa, factor.exponent)
            known = answers.get(question)
            if known is None:
                raise _Unanswered(question)
            return known.copy()  # a search may add to a sum it is given (scaling's ties)

        return answered

    found: list[Factor | None] = [None] * len(problems)
    # The searches that ask nothing (on histograms, on the rounding bound) are searched
    # together, in one batch, as each_factor searches them: one at a time they took ~7 ms
    # each (float8 [128, 2048, 2048] with --axes 1,2: 0.04 -> 0.9 s, attack s44).
    quiet = [
        place
        for place, (members, limit, _) in enumerate(problems)
        if decided_without_output(members, limit)
    ]
    batch = each_factor([problems[place] for place in quiet], output_sumsq_of, between=between)
    for place, factor in zip(quiet, batch, strict=True):
        found[place] = factor
    searched = set(quiet)
    waiting = [place for place in range(len(problems)) if place not in searched]
    # A refusal (a slice no factor brings within the limit) is raised once the searches
    # before it are done: the one raised is the first in order, as one search after
    # another would have raised it.
    refused: DataRefusedError | None = None
    while waiting:
        asked: list[_Question] = []
        still = []
        for place in waiting:
            search = each_factor([problems[place]], output_sumsq_of, between=between)
            try:
                found[place] = next(search)
            except _Unanswered as unanswered:
                asked.append(unanswered.question)
                still.append(place)
            except DataRefusedError as refusal:
                refused = refusal
                break  # the searches after it are not needed
        answers.update(_output_sums(boxes, shape, axes, asked))
        waiting = still
    if refused is not None:
        raise refused
    return found


def _output_sums(
    boxes: Boxes, shape: tuple[int, ...], axes: tuple[int, ...], questions: Sequence[_Question]
) -> dict[_Question, CertainSumsq]:
    """The answer to each question, in one pass over the boxes that hold the slices asked
    about: each slice's pieces in the order the boxes come, a block at a time, whichever
    other slices are asked about with it."""
    totals = {question: CertainSumsq() for question in questions}
    by_slice: dict[int, list[_Question]] = {}
    for question in questions:
        by_slice.setdefault(question.slice_id, []).append(question)
    if not by_slice:
        return totals
    wanted = np.array(sorted(by_slice), dtype=np.intp)
    for slice_id, piece in _pieces_of(boxes, shape, axes, wanted):
        for question in by_slice[slice_id]:
            # A block at a time: CertainSumsq.add makes some ten float64 temporaries of
            # what it is given (a complex64 box's took a tie of two long rows to 219 MB).
            for start in range(0, piece.size, CHECK_BLOCK_ELEMENTS):
                block = piece[start : start + CHECK_BLOCK_ELEMENTS]
                totals[question].add(scale_chunk(block, question.mantissa, question.exponent))
    return totals


CHECK_BLOCK_ELEMENTS = 1 << 18


def _windows(pieces: list[slice], window_slices: int) -> list[list[slice]]:
    """Consecutive pieces grouped so that each group spans at most window_slices slices
    (one piece at least)."""
    windows: list[list[slice]] = []
    for piece in pieces:
        if windows and piece.stop - windows[-1][0].start <= window_slices:
            windows[-1].append(piece)
        else:
            windows.append([piece])
    return windows


class _Gathered:
    """The values of a span of slices as rows, gathered in one pass the first time a piece
    of the span asks for some (most pieces of float32 data never do)."""

    def __init__(
        self,
        boxes: Boxes,
        shape: tuple[int, ...],
        axes: tuple[int, ...],
        dtype: np.dtype[Any],
        span: slice,
    ) -> None:
        self._gather = functools.partial(streamed_picked, boxes, shape, axes, dtype, span)
        self._span = span
        self._rows: np.ndarray | None = None
        # Pieces searched side by side ask at once: one of them gathers, the others wait
        # for its rows (two gathers held two windows and read the tensor twice).
        self._gathering = threading.Lock()

    def picker(self, piece: slice) -> Callable[[np.ndarray], np.ndarray]:
        """picked(which) for scales_from_sums on a piece of the span: `which` marks
        slices of the piece; their values as rows."""

        def picked(which: np.ndarray) -> np.ndarray:
            with self._gathering:
                if self._rows is None:
                    self._rows = self._gather()
            start = piece.start - self._span.start
            rows: np.ndarray = self._rows[start : start + piece.stop - piece.start][which]
            return rows

        return picked


def _exact_check(
    picked: Callable[[np.ndarray], np.ndarray], limit: float
) -> Callable[[np.ndarray], np.ndarray]:
    """within_exactly(near) for scales_from_sums, from the slices' values."""
    return lambda near: _rows_within_exactly(widen_real(picked(near)), limit)


def keepdims_shape(shape: tuple[int, ...], axes: tuple[int, ...]) -> tuple[int, ...]:
    """The keepdims shape of per-slice results: 1 along the reduced axes."""
    return tuple(1 if i in axes else n for i, n in enumerate(shape))


def box_axes_scales(
    box: np.ndarray,
    axes: tuple[int, ...],
    dtype: np.dtype[Any],
    limit: float,
    name: str = "tensor",
    first: int = 0,
) -> np.ndarray:
    """The factors of a box that holds whole slices (boxes_hold_whole_slices), keepdims
    on the box: the ones streamed_axes_scales gives these slices over the whole tensor,
    bit for bit (each slice's sum of squares comes from its own box alone, added to 0, and
    each slice's factor is searched for on its own). first: the number of the box's first
    slice in the tensor, for a refusal's message."""
    whole = tuple(slice(None) for _ in box.shape)

    def boxes(only: Callable[[BoxIndex], bool] | None = None) -> Iterator[Box]:
        return accepted([(box, whole)], only)

    return streamed_axes_scales(boxes, box.shape, axes, dtype, limit, name=name, first=first)
