"""Rounding in a tensor's own dtype: scaling and clamping chunks, each value rounded once.

- narrow_round: float64 to any float dtype with a single rounding (ml_dtypes rounds twice).
- scale_chunk: chunk * factor, computed exactly in float64 and rounded once.
- value_bounds / clamp_chunk: clip_by_value's bounds shrunk to values the dtype holds, and
  the clamp that keeps every element within them (and NaN) bit for bit.
8- and 16-bit floats go through tables of all their values (lookup.py), one per factor or
pair of bounds, built by the very same functions.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import ml_dtypes
import numpy as np

from clipcli.dtypes import (
    all_values,
    bits_dtype,
    finfo,
    has_infinity,
    is_small_float,
    mantissa_digits,
    smallest_without_zero,
)
from clipcli.errors import DataRefusedError
from clipcli.numerics import float8, float16, lookup
from clipcli.numerics.norms import NormAccumulator
from clipcli.numerics.widening import widen


def narrow_round(wide: np.ndarray, dtype: np.dtype[Any]) -> np.ndarray:
    """float64 (complex128) values rounded once, to nearest with ties to even, to `dtype`.

    numpy rounds float64 to float32 and float16 directly, but ml_dtypes (bfloat16, fp8)
    goes through float32, rounding twice. Rounding to float32 *to odd* first (truncate,
    then set the last bit if anything was cut off) keeps enough information that the
    second rounding, to any format at least two bits narrower, is the correct one."""
    if dtype.kind == "c" or dtype.itemsize >= 4:
        with np.errstate(over="ignore", invalid="ignore"):  # past the range: +-inf, counted
            narrowed: np.ndarray = wide.astype(dtype)
        return narrowed
    if dtype == np.float16 and wide.dtype == np.float64:
        return _by_blocks(_to_float16, wide, dtype)
    if dtype == BFLOAT16 and wide.dtype == np.float64:
        return _to_bfloat16(wide)
    return _through_float32(wide, dtype)


def _to_float16(wide: np.ndarray) -> np.ndarray:
    """narrow_round to float16, cheaper on the bits: cut the float64 mantissa to float32's
    23 bits, keeping a sticky bit, then an exact cast. Below float32's normal range
    (2**-126) the cast rounds again, but such values are far below float16's half-step and
    become 0."""
    bits64 = wide.view(np.uint64)
    sticky = (bits64 & np.uint64(0x1FFFFFFF)) != 0
    cut = (bits64 & ~np.uint64(0x1FFFFFFF)).view(np.float64)
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        single = cut.astype(np.float32)
    if not np.isfinite(single).all():
        # Past float32's range (|x| >= 2**128) the cut became +-inf, which float16
        # keeps; a sticky bit there would make it NaN. A NaN cut to inf keeps its bit.
        sticky &= ~(np.isinf(single) & np.isfinite(wide))
    single.view(np.uint32)[...] |= sticky
    return float16.from_float32(single)


def _by_blocks(
    round_to: Callable[[np.ndarray], np.ndarray], wide: np.ndarray, dtype: np.dtype[Any]
) -> np.ndarray:
    """round_to over blocks of _SCALE_BLOCK elements into one output: its temporaries stay
    in cache instead of being fresh pages the size of the whole array (a float16 --axes
    clip rounds 2**20 values a box, 6 ns/element where a block costs ~2)."""
    flat = np.ascontiguousarray(wide).reshape(-1)  # 1-D: numpy gives 0-D results as scalars
    if flat.size <= _SCALE_BLOCK:
        whole: np.ndarray = round_to(flat).reshape(np.shape(wide))
        return whole
    out = np.empty(flat.size, dtype)
    for start in range(0, flat.size, _SCALE_BLOCK):
        out[start : start + _SCALE_BLOCK] = round_to(flat[start : start + _SCALE_BLOCK])
    shaped: np.ndarray = out.reshape(np.shape(wide))
    return shaped


BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
# float64 bit patterns: the magnitude's mask, bfloat16's smallest normal (2**-126), infinity.
_MAGNITUDE = np.uint64(0x7FFF_FFFF_FFFF_FFFF)
_BFLOAT16_NORMAL = np.uint64(0x3810_0000_0000_0000)
_FLOAT64_INF = np.uint64(0x7FF0_0000_0000_0000)
# bfloat16 keeps 7 of float64's 52 stored mantissa bits: 45 are rounded off.
_BFLOAT16_CUT = 45


def _round_mantissa(bits: np.ndarray, cut: int, out: np.ndarray) -> None:
    """float64 bits (uint64) rounded to nearest, ties to even, with their last `cut`
    mantissa bits cleared, into `out`: adding just under half a step plus the kept part's
    last bit carries into the exponent exactly where rounding up does. Right for results
    in the target's normal range (and past it: a larger exponent); subnormal results, inf
    and NaN are the caller's."""
    np.right_shift(bits, np.uint64(cut), out=out)
    out &= np.uint64(1)
    out += bits
    out += np.uint64((1 << (cut - 1)) - 1)
    out &= ~np.uint64((1 << cut) - 1)


def _to_bfloat16(wide: np.ndarray) -> np.ndarray:
    """narrow_round to bfloat16 on the bits: round float64's mantissa to bfloat16's 8
    significant bits, to nearest with ties to even (_round_mantissa), then an exact cast to
    float32, whose top 16 bits are the bfloat16. Right for zeros and for bfloat16's normal
    range, past its largest value too (the cast gives +-inf); below 2**-126 the step is
    fixed, not relative, and NaN's payload could be cut to inf: those few elements go
    through _through_float32. Block by block through buffers that stay in cache (a fresh
    page costs more than the arithmetic on it): ~1 ns/element against 6-9 (rounding the
    search's products was most of a bfloat16 --axes clip's CPU)."""
    flat = np.ascontiguousarray(wide).reshape(-1)
    out = np.empty(flat.size, np.uint16)
    work = np.empty(min(_SCALE_BLOCK, flat.size), np.uint64)
    single = np.empty(work.size, np.float32)
    odd_blocks = []
    for start in range(0, flat.size, _SCALE_BLOCK):
        bits = flat[start : start + _SCALE_BLOCK].view(np.uint64)
        rounded, narrow = work[: bits.size], single[: bits.size]
        _round_mantissa(bits, _BFLOAT16_CUT, rounded)
        with np.errstate(all="ignore"):  # the odd elements are worked out again below
            np.copyto(narrow, rounded.view(np.float64), casting="unsafe")
        top = narrow.view(np.uint32)
        top >>= np.uint32(16)
        out[start : start + bits.size] = top
        # Zeros are plain: as magnitude - 1 they wrap to the top.
        np.bitwise_and(bits, _MAGNITUDE, out=rounded)
        if rounded.max() >= _FLOAT64_INF:
            odd_blocks.append(start)
            continue
        rounded -= np.uint64(1)
        if rounded.min() < _BFLOAT16_NORMAL - np.uint64(1):
            odd_blocks.append(start)
    result = out.view(BFLOAT16)
    for start in odd_blocks:
        piece = flat[start : start + _SCALE_BLOCK]
        magnitude = piece.view(np.uint64) & _MAGNITUDE
        odd = (magnitude - np.uint64(1) < _BFLOAT16_NORMAL - np.uint64(1)) | (
            magnitude >= _FLOAT64_INF
        )
        result[start : start + piece.size][odd] = _through_float32(piece[odd], BFLOAT16)
    shaped: np.ndarray = result.reshape(np.shape(wide))
    return shaped


def rounded_as_float64(wide: np.ndarray, dtype: np.dtype[Any]) -> np.ndarray:
    """widen(narrow_round(wide, dtype)): float64 values rounded once to `dtype`, as float64.
    The factor searches round products this way at every step, and need the float64 values,
    not the dtype's bits: for bfloat16, float16 and the sign-magnitude fp8 formats the
    rounding is done on float64's own bits (_on_float64_bits), without the trip through
    float32 and the dtype and back."""
    grid = _float64_grid(dtype) if wide.dtype == np.float64 else None
    if grid is not None and wide.size:
        rounded = _on_float64_bits(wide, grid)
        if rounded is not None:
            return rounded
    return widen(narrow_round(wide, dtype))


class _Grid(NamedTuple):
    """A float format's values, as _on_float64_bits rounds to them."""

    cut: int  # float64 mantissa bits below the format's last one
    smallest_normal: float
    step: float  # the subnormals' spacing (the smallest positive value)
    largest: float  # the largest finite value
    past: float  # what a value rounded past it becomes (sign aside): inf, or NaN (e4m3fn)


@functools.cache
def _float64_grid(dtype: np.dtype[Any]) -> _Grid | None:
    """The grid of bfloat16, float16 and the fp8 formats float8.from_float32 serves
    (sign-magnitude, -0 included, subnormals); None for the others, which take
    narrow_round."""
    if dtype not in (BFLOAT16, np.dtype(np.float16)) and float8.layout(dtype) is None:
        return None
    info = finfo(dtype)
    with np.errstate(invalid="ignore", over="ignore"):
        past = float(np.asarray(math.inf, np.float32).astype(dtype).astype(np.float64))
    return _Grid(
        52 - int(info.nmant),
        float(info.smallest_normal),
        float(info.smallest_subnormal),
        float(info.max),
        abs(past),
    )


def _on_float64_bits(wide: np.ndarray, grid: _Grid) -> np.ndarray | None:
    """Finite float64 values rounded to the grid, to nearest with ties to even, as float64;
    None if any is inf or NaN (narrow_round's business). Normal results: the mantissa
    rounded on the bits (_round_mantissa, as _to_bfloat16 does); below the
    smallest normal the step is fixed: np.rint of the value in steps (exact: a power of
    two); past the largest finite value, what the dtype's own rounding gives there. Block
    by block, the magnitudes in a buffer that stays in cache."""
    flat = np.ascontiguousarray(wide).reshape(-1)
    out = np.empty(flat.size, np.float64)
    magnitude = np.empty(min(_SCALE_BLOCK, flat.size), np.uint64)
    subnormal = np.empty(magnitude.size, np.float64)
    smallest_normal = np.float64(grid.smallest_normal).view(np.uint64)
    largest = np.float64(grid.largest).view(np.uint64)
    for start in range(0, flat.size, _SCALE_BLOCK):
        bits = flat[start : start + _SCALE_BLOCK].view(np.uint64)
        size = bits.size
        mag, rounded = magnitude[:size], out[start : start + size].view(np.uint64)
        np.bitwise_and(bits, _MAGNITUDE, out=mag)
        top = mag.max()
        if top >= _FLOAT64_INF:
            return None
        _round_mantissa(bits, grid.cut, rounded)
        if mag.min() < smallest_normal:
            piece = flat[start : start + size]
            small = mag < smallest_normal
            if np.count_nonzero(small) * _PICKED_BELOW > size:
                _blend_subnormals(piece, rounded, mag, subnormal[:size], grid)
            else:  # a few: picked out by index (most bfloat16 and float16 data)
                steps = np.rint(piece[small] / grid.step)
                rounded.view(np.float64)[small] = steps * grid.step
        if top > largest:  # some may have rounded past it (a tie may round down to it)
            np.bitwise_and(rounded, _MAGNITUDE, out=mag)
            over = mag > largest
            signs = flat[start : start + size][over]
            rounded.view(np.float64)[over] = np.copysign(grid.past, signs)
    shaped: np.ndarray = out.reshape(np.shape(wide))
    return shaped


# Subnormal results are picked out by index while they are at most 1 in this many of a
# block (~8 ns each), and blended into every element's result beyond (~1.5 ns an element).
_PICKED_BELOW = 8


def _blend_subnormals(
    values: np.ndarray, rounded: np.ndarray, magnitude: np.ndarray, work: np.ndarray, grid: _Grid
) -> None:
    """Where a value's magnitude is below the grid's smallest normal, its rounding to the
    subnormal step (np.rint of the value in steps: exact, a power of two) replaces the one
    in `rounded` (bits). Computed for every element and blended on the bits: fp8 data has
    many values down there, and picking them out by index cost ~8 ns a value. `magnitude`
    (the values' magnitude bits) is used up."""
    with np.errstate(over="ignore"):  # a large value's steps overflow: not blended in
        np.multiply(values, 1.0 / grid.step, out=work)
    np.rint(work, out=work)
    work *= grid.step
    # All ones where the magnitude is below the smallest normal: the difference wraps to a
    # negative int64 there (magnitudes are below 2**63), and an arithmetic shift spreads
    # its sign.
    magnitude -= np.float64(grid.smallest_normal).view(np.uint64)
    below = magnitude.view(np.int64)
    below >>= 63
    blend = work.view(np.uint64)
    blend ^= rounded
    blend &= magnitude
    rounded ^= blend


def _through_float32(wide: np.ndarray, dtype: np.dtype[Any]) -> np.ndarray:
    """narrow_round through float32 rounded to odd, for dtypes at most 16 bits wide."""
    with np.errstate(over="ignore", invalid="ignore"):
        single = wide.astype(np.float32)
        finite = np.isfinite(single)
        back = single.astype(np.float64)
    bits = single.view(np.uint32)
    bits -= (np.abs(back) > np.abs(wide)) & finite  # rounded up in magnitude: truncate
    bits |= (back != wide) & finite  # inexact: make it odd (sticky bit)
    if dtype == np.float16:
        return float16.from_float32(single)
    if dtype.itemsize == 1 and (narrow := float8.from_float32(single, dtype)) is not None:
        return narrow
    smallest = smallest_without_zero(dtype)
    if smallest is not None:
        # No zero to round to (e8m0fnu: 2**-127 and up). Below float32's normal range the
        # result is decided here: ml_dtypes rounds float32 subnormals up (1.2 * 2**-127
        # became 2**-126), and a value float32 flushed to 0 would become NaN. The nearest
        # of the two smallest values, a tie going up as ml_dtypes rounds e8m0 ties; below
        # the smallest, the smallest (a positive value never becomes NaN).
        tiny = (wide > 0) & (wide < 2.0**-126)
        if np.any(tiny):
            single[tiny] = np.where(wide[tiny] < 1.5 * smallest, smallest, 2 * smallest)
    with np.errstate(over="ignore", invalid="ignore"):
        result: np.ndarray = single.astype(dtype)
    return result


def power_of_two_steps(mantissa: float, exponent: int) -> int:
    """k >= 0 such that 2**-k is the largest power of two at or below the factor
    mantissa * 2**exponent (0 for a factor of 1 or more): the step a power-of-two scale
    (E8M0: MXFP4) takes, rounded down so that the scaled values never exceed the exact
    factor's. Exact: frexp splits the mantissa without rounding."""
    if not mantissa > 0 or not math.isfinite(mantissa):
        raise ValueError(f"a factor of {mantissa!r} * 2**{exponent} has no power of two")
    _, shift = math.frexp(mantissa)  # mantissa = fraction * 2**shift, fraction in [0.5, 1)
    return max(0, 1 - shift - exponent)


def scale_chunk(chunk: np.ndarray, scale: float | np.ndarray, exponent: int = 0) -> np.ndarray:
    """chunk * scale * 2**exponent, computed wide and rounded once to the chunk's dtype.
    The exponent carries factors too small for a float64 (C / ||t|| below 1e-308)."""
    if np.ndim(scale) == 0 and is_small_float(chunk.dtype):
        # bfloat16 included: ml_dtypes rounds float32 to bfloat16 one element at a time
        # (with narrow_round's passes, 13 ns/element; the table lookup is ~1 ns).
        table = _made_table(chunk.dtype, float(scale), exponent, chunk.size)
        if table is not None:
            return lookup.look_up(chunk, table)
        with np.errstate(all="ignore"):  # as the table is made: the same values, bit for bit
            return _scale(chunk, scale, exponent)
    if (
        np.ndim(scale) == 0
        and chunk.dtype.kind == "f"
        and chunk.dtype.itemsize >= 4
        and _product_is_exact(float(scale), exponent, chunk.dtype)
        and (exponent == 0 or chunk.dtype.itemsize == 4)
    ):
        return _scale_in_blocks(chunk, float(scale), exponent)
    small = is_small_float(chunk.dtype)
    if small and np.ndim(scale) and np.size(scale) == 1 and np.ndim(scale) <= chunk.ndim:
        # One factor for the whole chunk (a box within one long slice, --axes): the same
        # values as broadcasting it, through the table above.
        return scale_chunk(chunk, float(np.asarray(scale).reshape(-1)[0]), exponent)
    if np.ndim(scale) and small:
        looked_up = _scale_by_tables(chunk, np.asarray(scale, np.float64), exponent)
        if looked_up is not None:
            return looked_up
    if np.ndim(scale) and chunk.ndim and chunk.size > _SCALE_BLOCK:
        return _scale_rows_in_blocks(chunk, np.asarray(scale), exponent)
    return _scale(chunk, scale, exponent)


# An 8/16-bit float chunk with a factor per slice has a table of each factor's results
# when it holds at least this many elements per table entry: an entry costs what scaling
# and rounding an element costs (~10 ns), a lookup ~1.5.
FACTOR_TABLES_FROM = 4


def _scale_by_tables(chunk: np.ndarray, scales: np.ndarray, exponent: int) -> np.ndarray | None:
    """scale_chunk of an 8/16-bit float chunk by scales broadcast against it (--axes: a
    factor per slice) through a table of each factor's results on all the dtype's values:
    _scale of the same value by the same factor, so the same bits, looked up instead of
    rounded one element at a time. 8-bit tables (256 values) are made for the chunk;
    16-bit ones are _scale_table's, kept from box to box (a box across a few long slices:
    every box of the tensor has the same factors), so at most as many factors as it keeps.
    None where it would not pay (FACTOR_TABLES_FROM: boxes of whole slices have factors of
    their own, whose tables would be used once), or scales do not broadcast to the chunk's
    shape."""
    values = 256**chunk.dtype.itemsize
    if scales.size * values * FACTOR_TABLES_FROM > chunk.size or exponent:
        return None  # (factors per slice come with no exponent: _scale takes none)
    if np.broadcast_shapes(scales.shape, chunk.shape) != chunk.shape:
        return None
    bits = bits_dtype(chunk.dtype)
    if chunk.dtype.itemsize == 1:
        with np.errstate(all="ignore"):  # as _scale_table: the tables hold NaN and extremes
            tables = _scale(all_values(chunk.dtype), scales.reshape(-1, 1), exponent)
        entries = tables.view(bits).reshape(-1)
    elif scales.size <= _KEPT_TABLES:
        entries = np.concatenate([_scale_table(chunk.dtype, f, 0) for f in scales.ravel().tolist()])
    else:
        return None
    first_entries = (np.arange(scales.size, dtype=np.intp) * values).reshape(scales.shape)
    where = np.add(chunk.view(bits), first_entries, dtype=np.intp)
    looked_up: np.ndarray = np.take(entries, where)
    return looked_up.view(chunk.dtype)


def _scale_rows_in_blocks(chunk: np.ndarray, scales: np.ndarray, exponent: int) -> np.ndarray:
    """_scale with a factor per slice (--axes: scales broadcast against the chunk), a block
    of leading rows at a time: the same operations on each element, their temporaries
    (the widened values, the products, the rounding's) in cache instead of fresh pages the
    size of the whole box (a bfloat16 box of 2**20 values: ~14 ns/element, now ~4)."""
    rows = max(1, _SCALE_BLOCK // max(1, chunk.size // chunk.shape[0]))
    per_row = scales.ndim == chunk.ndim and scales.shape[0] == chunk.shape[0]
    out = np.empty(chunk.shape, chunk.dtype)
    for start in range(0, chunk.shape[0], rows):
        part = scales[start : start + rows] if per_row else scales
        out[start : start + rows] = _scale(chunk[start : start + rows], part, exponent)
    return out


# Elements per block of _scale_in_blocks: a 512 KiB float64 buffer, reused, stays in L2.
_SCALE_BLOCK = 1 << 16


def _scale_in_blocks(chunk: np.ndarray, scale: float, exponent: int) -> np.ndarray:
    """_scale for float32 and float64 with a factor whose float64 product is exact (or, for
    float64, is the one rounding): the same operations (multiply in float64, ldexp, one
    cast to the dtype) block by block through one buffer that stays in cache, instead of
    three whole-chunk float64 temporaries (fresh pages: 4 ns/element, now ~1)."""
    flat = np.ascontiguousarray(chunk).reshape(-1)
    out = np.empty(flat.size, chunk.dtype)
    if exponent:
        # As _scale: the mantissa's own power of two goes into the exponent.
        scale, shift = math.frexp(scale)
        exponent += shift
    factor = np.float64(scale)
    buffer = np.empty(min(_SCALE_BLOCK, flat.size), np.float64)
    # A tensor holding NaN is never scaled: a (signalling) NaN here comes from an input
    # that changed while it was read, which the identity check then refuses in one line;
    # numpy's "invalid value" warning would be a second (attack s43).
    with np.errstate(invalid="ignore"):
        for start in range(0, flat.size, _SCALE_BLOCK):
            piece = flat[start : start + _SCALE_BLOCK]
            wide = buffer[: piece.size]
            np.multiply(piece, factor, out=wide)
            if exponent:
                np.ldexp(wide, exponent, out=wide)
            out[start : start + piece.size] = wide  # the one rounding, as narrow_round's
    return out.reshape(chunk.shape)


# A chunk of at least 1/TABLE_SHARE of its dtype's values has a table made for its factor;
# a smaller one is scaled directly unless the table is made already: --norm gives each
# tensor its own factor, and 20,000 small bfloat16 tensors each paid for a 65,536-value
# table (~150 us) to scale a few hundred values.
TABLE_SHARE = 16


def _made_table(dtype: np.dtype[Any], scale: float, exponent: int, size: int) -> np.ndarray | None:
    """_scale_table's table for this factor if it was made lately or is worth making.
    (Either way the values are the same: only the cost differs.)"""
    key = (dtype, scale, exponent)
    with _TABLES_LOCK:  # threads scale chunks
        made = key in _TABLES_MADE
        if not made and size * TABLE_SHARE >= 256**dtype.itemsize:
            _TABLES_MADE[key] = made = True
            if len(_TABLES_MADE) > 16:
                del _TABLES_MADE[next(iter(_TABLES_MADE))]
    return _scale_table(dtype, scale, exponent) if made else None


# The factors of the tables made last (a dict as an ordered set), as many as _scale_table
# keeps.
_TABLES_MADE: dict[tuple[np.dtype[Any], float, int], bool] = {}
_TABLES_LOCK = threading.Lock()


_KEPT_TABLES = 16  # _scale_table's cache


@functools.lru_cache(maxsize=_KEPT_TABLES)
def _scale_table(dtype: np.dtype[Any], scale: float, exponent: int) -> np.ndarray:
    """Every value of an 8- or 16-bit float scaled as _scale does, as bits. One table per
    scale serves every chunk: a global clip has one scale for the whole checkpoint."""
    table = lookup.table_of(dtype, lambda values: _scale(values, scale, exponent))
    table.flags.writeable = False
    return table


def _scale(chunk: np.ndarray, scale: float | np.ndarray, exponent: int) -> np.ndarray:
    """chunk * scale * 2**exponent, rounded once to the chunk's dtype. A factor short
    enough for the float64 product to be exact (the search's factors) takes one
    multiplication; any other (--use-norm's C / N, all 53 bits) is carried exactly
    (exact_scaled) so that the only rounding is still the last one (narrow_round)."""
    wide = widen(chunk)
    if np.ndim(scale) == 0 and not _product_is_exact(float(scale), exponent, chunk.dtype):
        if wide.dtype.kind == "c":
            out = np.empty(wide.shape, np.complex128)
            out.real = exact_scaled(wide.real, float(scale), exponent, chunk.dtype)
            out.imag = exact_scaled(wide.imag, float(scale), exponent, chunk.dtype)
            return narrow_round(out, chunk.dtype)
        scaled = exact_scaled(wide, float(scale), exponent, chunk.dtype)
        if smallest_without_zero(chunk.dtype) is not None:
            scaled[scaled == 0] = 5e-324  # see below: no zero to round to
        return narrow_round(scaled, chunk.dtype)
    if exponent:
        # Fold the mantissa's own power of two into the exponent: a mantissa like 1e16
        # would overflow a float64 element near 1e300 before the exponent brings it down.
        scale, shift = math.frexp(float(scale))
        exponent += shift
    factor = np.asarray(scale, dtype=np.float64)
    if wide.dtype.kind == "c":
        # Part by part: z * (s + 0j) computes re*0 + im*s, which turns -0.0 into +0.0.
        out = np.empty(np.broadcast_shapes(wide.shape, factor.shape), np.complex128)
        out.real = np.ldexp(wide.real * factor, exponent)
        out.imag = np.ldexp(wide.imag * factor, exponent)
        return narrow_round(out, chunk.dtype)
    wide = wide * factor
    if exponent:
        wide = np.ldexp(wide, exponent)
    if smallest_without_zero(chunk.dtype) is not None:
        # Every value of a dtype without zero is positive (or NaN): a product that
        # underflowed float64 is a tiny positive value, which rounds to the smallest.
        wide[wide == 0] = 5e-324
    return narrow_round(wide, chunk.dtype)


def _product_is_exact(scale: float, exponent: int, dtype: np.dtype[Any]) -> bool:
    """Whether value * scale (then * 2**exponent) rounds once on the plain path: the
    float64 product is exact, or, for float64 itself, is the one rounding."""
    if scale == 0.0 or not math.isfinite(scale):
        return True
    digits = mantissa_digits(dtype)
    if digits >= 53:
        # float64 rounds once in the product; with an exponent a subnormal result would
        # be rounded a second time by ldexp.
        return exponent == 0
    numerator = abs(scale.as_integer_ratio()[0])
    return numerator.bit_length() + digits <= 53


# ---------------------------------------------------------------- exact products
#
# x * m for float64 x and m exactly, as p + err (Dekker's product: p = fl(x * m), err the
# exact remainder), valid while no partial product overflows or underflows: callers keep
# both in [0.25, 1) (float64 data) or x within float32's range and m in [0.5, 1).
_SPLITTER = 134217729.0  # 2**27 + 1: splits a float64 into two 26-bit halves
_FLOAT64_NORMAL = 2.0**-1022
_FLOAT64_TINIEST_EXP = -1074  # the smallest subnormal is 2**-1074


def _split(values: np.ndarray | float) -> tuple[Any, Any]:
    c = _SPLITTER * values
    high = c - (c - values)
    return high, values - high


def _two_product(x: np.ndarray, m: float) -> tuple[np.ndarray, np.ndarray]:
    product = x * m
    x_high, x_low = _split(x)
    m_high, m_low = _split(m)
    error = ((x_high * m_high - product) + x_high * m_low + x_low * m_high) + x_low * m_low
    return product, error


def exact_scaled(wide: np.ndarray, scale: float, exponent: int, dtype: np.dtype[Any]) -> np.ndarray:
    """Real float64 values times scale * 2**exponent, from the exact product: rounded
    once to float64 for a float64 dtype, else rounded to odd in float64 (53 bits), which
    narrow_round then rounds once more, correctly, to any narrower dtype."""
    mantissa, shift = math.frexp(scale)
    exponent += shift
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        if mantissa_digits(dtype) >= 53:
            return _float64_scaled(wide, mantissa, exponent)
        # mantissa = head + tail, head short enough that value * head is exact and tail
        # with at most the dtype's digits, so value * tail is exact too: their sum,
        # rounded, and its error (Fast2Sum: |value * head| >= |value * tail|) are the
        # exact product in four operations.
        cut = 53 - mantissa_digits(dtype)
        head = math.ldexp(math.floor(math.ldexp(mantissa, cut)), -cut)
        high, low = wide * head, wide * (mantissa - head)
        product = high + low
        error = low - (product - high)
        inexact = (error != 0) & np.isfinite(product)
        if np.any(inexact):
            bits = product.view(np.uint64)
            # Round to odd: truncate toward zero (one step down in magnitude where the
            # remainder points the other way), then set the last bit if anything was cut.
            toward_zero = inexact & ((error < 0) != (product < 0))
            bits -= toward_zero.astype(np.uint64)
            bits |= inexact.astype(np.uint64)
        # Far below every narrower dtype's smallest value, the scaled result may round
        # again in float64's subnormals: it becomes 0 (or e8m0's smallest) either way.
        result: np.ndarray = np.ldexp(product, exponent) if exponent else product
        return result


def _float64_scaled(wide: np.ndarray, mantissa: float, exponent: int) -> np.ndarray:
    """wide * mantissa * 2**exponent, each element rounded once to float64: the product
    of the normalised fraction (one rounding) moved by the exponents where the result is
    normal, and rounded on the subnormal grid from the exact product where it is not."""
    fraction, power = np.frexp(wide)
    result: np.ndarray = np.ldexp(fraction * mantissa, power + exponent)
    low = np.flatnonzero(np.isfinite(wide) & (wide != 0) & (np.abs(result) < _FLOAT64_NORMAL))
    if low.size:
        product, error = _two_product(fraction[low], mantissa)
        # In units of the smallest subnormal: an integer n to find, ties to even.
        units = power[low].astype(np.int64) + exponent - _FLOAT64_TINIEST_EXP
        scaled = np.ldexp(product, units)
        rest = np.ldexp(error, units)
        nearest = np.rint(scaled)
        off = scaled - nearest
        # Only an exact tie can be decided by the remainder (it is below half a unit of
        # `scaled`, and so below the distance to the next tie otherwise).
        beyond_tie = (np.abs(off) == 0.5) & (rest != 0) & ((rest > 0) == (off > 0))
        nearest = np.where(beyond_tie, nearest + np.sign(off), nearest)  # -0.0 stays -0.0
        result[low] = np.ldexp(nearest, _FLOAT64_TINIEST_EXP)
    return result


def value_bounds(dtype: np.dtype[Any], low: float, high: float) -> tuple[np.ndarray, np.ndarray]:
    """[low, high] shrunk to the nearest values the dtype can hold, so clamping never
    overshoots. A missing bound (+-inf) is the dtype's own extreme: an infinity where it
    has one, else its largest (smallest) finite value, as fp8 types have no infinity.
    Refused (DataRefusedError) when no finite value of the dtype lies in [low, high]."""
    lo = _representable(dtype, low, toward=1)
    hi = _representable(dtype, high, toward=-1)
    if lo is None or hi is None or float(lo) > float(hi) or float(lo) == math.inf:
        raise DataRefusedError(
            f"no {dtype.name} value lies in [{low:g}, {high:g}]; value clipping is impossible"
        )
    if float(hi) == -math.inf:
        raise DataRefusedError(
            f"no {dtype.name} value lies in [{low:g}, {high:g}]; value clipping is impossible"
        )
    return lo, hi


def _representable(dtype: np.dtype[Any], value: float, toward: int) -> np.ndarray | None:
    """The dtype value (0-d) nearest `value` that is >= it (toward=1) or <= it (toward=-1);
    None if there is none (above the largest value, or below the smallest)."""
    info = finfo(dtype)
    top, bottom = float(info.max), float(info.min)  # bottom > 0 for unsigned fp8 (e8m0)
    if value == math.inf or value == -math.inf:
        if (value > 0) == (toward > 0):  # a bound that excludes everything
            return np.asarray(value).astype(dtype) if has_infinity(dtype) else None
        if has_infinity(dtype):
            return np.asarray(value).astype(dtype)
        return np.asarray(top if value > 0 else bottom).astype(dtype)
    if value > top:
        return np.asarray(top).astype(dtype) if toward < 0 else None
    if value < bottom:
        return np.asarray(bottom).astype(dtype) if toward > 0 else None
    with np.errstate(all="ignore"):
        candidate = np.asarray(value).astype(dtype)
    if (float(candidate) - value) * toward >= 0:
        return candidate
    return _next_toward(candidate, toward)


def _next_toward(value: np.ndarray, direction: int) -> np.ndarray:
    """The adjacent representable value (sign-magnitude float bit patterns; unsigned types
    such as float8_e8m0fnu have no sign bit and simply count up)."""
    uint = bits_dtype(value.dtype)
    bits = int(value.view(uint))
    if float(finfo(value.dtype).min) > 0:
        return np.asarray(bits + direction, dtype=uint).view(value.dtype)
    sign_bit = 1 << (8 * value.dtype.itemsize - 1)
    negative = bool(bits & sign_bit)
    magnitude = bits & ~sign_bit
    if magnitude == 0:
        bits = 1 if direction > 0 else sign_bit | 1
    elif negative == (direction > 0):
        bits -= 1
    else:
        bits += 1
    return np.asarray(bits, dtype=uint).view(value.dtype)


def clamp_chunk(chunk: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Elementwise clamp in the tensor's own dtype. An element within [lo, hi] keeps its
    bits (-0.0 on a bound of 0 included), and so does NaN, payload and all: only elements
    strictly below lo or above hi are replaced, by the bound."""
    if is_small_float(chunk.dtype):  # float16, bfloat16, fp8: through a table
        bounds = (np.asarray(bound, dtype=chunk.dtype).tobytes() for bound in (lo, hi))
        return lookup.look_up(chunk, _clamp_table(chunk.dtype, *bounds))
    return _clamp(chunk, lo, hi)


def _clamp(chunk: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    wide = widen(chunk) if is_small_float(chunk.dtype) else chunk
    clamped = chunk.copy()
    with np.errstate(invalid="ignore"):
        np.copyto(clamped, np.asarray(lo, chunk.dtype), where=wide < float(lo))
        np.copyto(clamped, np.asarray(hi, chunk.dtype), where=wide > float(hi))
    return clamped


@functools.lru_cache(maxsize=16)
def _clamp_table(dtype: np.dtype[Any], lo_bits: bytes, hi_bits: bytes) -> np.ndarray:
    """Every value of an 8- or 16-bit float clamped as _clamp does, as bits. Keyed by the
    bounds' bits, since -0.0 == 0.0; one table serves the run."""
    lo, hi = (np.frombuffer(bits, dtype=dtype)[0] for bits in (lo_bits, hi_bits))
    table = lookup.table_of(dtype, lambda values: _clamp(values, lo, hi))
    table.flags.writeable = False
    return table


# ---------------------------------------------------------------- what the rounding lost


def flushes(before: np.ndarray, after: np.ndarray) -> tuple[int, int]:
    """How many values the rounding took from nonzero to zero, and how many it made
    subnormal (exponent field zero, mantissa not) that were not before; complex part by
    part. Read from the bit patterns, so it costs two integer passes and no float work.
    A dtype without zero (float8_e8m0fnu) has neither: (0, 0)."""
    dtype = after.dtype
    if smallest_without_zero(dtype) is not None:
        return 0, 0
    if dtype.kind == "c":
        before = before.view(before.real.dtype)
        after = after.view(after.real.dtype)
        dtype = after.dtype
    nmant = int(finfo(dtype).nmant)
    unsigned = bits_dtype(dtype)
    mask = unsigned.type((1 << (8 * dtype.itemsize - 1)) - 1)  # every bit but the sign
    subnormal_below = unsigned.type(1 << nmant)
    new = np.bitwise_and(after.reshape(-1).view(unsigned), mask)
    # Scaled weights seldom reach the bottom of the range: look at the rest only where the
    # output is zero or subnormal (one comparison over the chunk, then the few found).
    low = np.flatnonzero(new < subnormal_below)
    if not low.size:
        return 0, 0
    new = new[low]
    old = np.bitwise_and(before.reshape(-1).view(unsigned)[low], mask)
    to_zero = int(np.count_nonzero((new == 0) & (old != 0)))
    old_subnormal = (old != 0) & (old < subnormal_below)
    to_subnormal = int(np.count_nonzero((new != 0) & ~old_subnormal))
    return to_zero, to_subnormal


def scaled_statistics(
    before: NormAccumulator, dtype: np.dtype[Any], scale: float, exponent: int
) -> tuple[NormAccumulator, tuple[int, int]] | None:
    """The statistics of an 8- or 16-bit float tensor scaled by scale * 2**exponent (as
    scale_chunk scales it) and what the rounding flushed (as flushes counts it), read off
    the tensor's bit-pattern histogram (NormAccumulator.histogram) instead of a pass over
    the written data: every occurrence of a pattern becomes the same pattern. None where
    the tensor has no histogram. The sum of squares is that of finish(): the exact
    count * v**2 of each pattern summed in float64 (a pass over the data sums float64
    squares chunk by chunk: the two may differ in the last bits)."""
    if before.histogram is None or not is_small_float(dtype) or before.numel >= 2**53:
        return None
    bits, counts = before.histogram  # the finite nonzero patterns and their counts
    unsigned = bits_dtype(dtype)
    inputs = bits.astype(unsigned).view(dtype)
    outputs = scale_chunk(inputs, scale, exponent).view(unsigned)
    dense = np.zeros(256**dtype.itemsize, np.int64)
    np.add.at(dense, outputs.astype(np.intp), counts.astype(np.int64))
    # Zeros, NaN and infinities are not in the histogram; scaling keeps each what it is.
    zeros = before.numel - int(counts.sum(dtype=np.int64)) - before.nan_count - before.inf_count
    values = np.zeros(1, dtype)
    dense[int(values.view(unsigned)[0])] += zeros
    if before.nan_count:
        values[0] = np.nan
        dense[int(values.view(unsigned)[0])] += before.nan_count
    if before.inf_count:  # how many of each sign is not kept: only that each is there
        minus = before.min_value == -math.inf
        plus = before.inf_count - minus if before.max_value == math.inf else 0
        for value, count in ((np.inf, plus), (-np.inf, before.inf_count - plus)):
            values[0] = value
            dense[int(values.view(unsigned)[0])] += count
    after = NormAccumulator(keep_histogram=True)
    after.counts, after.numel, after.hist_dtype = dense, before.numel, dtype
    after.finish()
    after.histogram = None  # not needed past this point
    return after, _counted_flushes(inputs, outputs.view(dtype), counts)


def _counted_flushes(before: np.ndarray, after: np.ndarray, counts: np.ndarray) -> tuple[int, int]:
    """flushes() of distinct values, each standing for `counts` occurrences."""
    if smallest_without_zero(after.dtype) is not None:
        return 0, 0
    nmant = int(finfo(after.dtype).nmant)
    unsigned = bits_dtype(after.dtype)
    mask = unsigned.type((1 << (8 * after.dtype.itemsize - 1)) - 1)
    subnormal_below = unsigned.type(1 << nmant)
    new = np.bitwise_and(after.view(unsigned), mask)
    old = np.bitwise_and(before.view(unsigned), mask)
    weights = counts.astype(np.int64)
    to_zero = int(weights[(new == 0) & (old != 0)].sum())
    old_subnormal = (old != 0) & (old < subnormal_below)
    to_subnormal = int(weights[(new != 0) & (new < subnormal_below) & ~old_subnormal].sum())
    return to_zero, to_subnormal
