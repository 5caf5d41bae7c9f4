"""Pure clipping semantics: the four modes, their options, and scale factors. No I/O.

The formulas are TensorFlow's (clip_by_value, clip_by_norm, clip_by_average_norm,
clip_by_global_norm). Where we differ, on purpose:
- limits must be positive (TF zeroes or flips the sign of the tensor);
- a tensor within its limit is left bit-identical (TF's t*c/c moves it by about 1 ulp);
- the scale is chosen so that the *rounded* output's norm never exceeds the limit, which
  makes clipping idempotent: clip(clip(x)) == clip(x).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np

from clipcli.dtypes import finfo
from clipcli.errors import DataRefusedError
from clipcli.numerics import float16, lookup
from clipcli.numerics.norms import (
    slice_blocks,
    slice_sumsq,
    smallest_subnormal,
    unit_roundoff,
)

# Elements per float64 dot product in NormAccumulator (norms.CACHE_BLOCK): each block's
# sum of squares is off by at most 2**18 roundings, the merged blocks by one more each.
_DOT_TERMS = 1 << 18


def tf_scale(norm: float, limit: float) -> float | None:
    """TF's factor C / max(norm, C); None when the tensor stays as it is."""
    if norm <= limit or norm == 0.0 or math.isinf(limit) or not math.isfinite(norm):
        return None
    return limit / norm


# ---------------------------------------------------------------- the one scale search
#
# The factor applied to a tensor (or slice, group, checkpoint) is the largest uniform one
# whose *rounded* output has norm <= C. The rounded output's norm never decreases as the
# factor grows (each element is rounded to nearest, a monotone map), so bisection finds
# it. What the search needs is `margin(s)`: 1 - (an upper bound of ||round(s*x)||^2) / C^2,
# >= 0 exactly when the factor s certainly fits. For 8- and 16-bit floats it is computed
# exactly from a histogram of bit patterns (no pass over the data); for float32/float64
# members from their measured norm and a rigorous rounding bound.

_U64 = 2.0**-53  # float64 unit roundoff
# Relative distance from C within which a measured norm might be on either side of it.
AMBIGUOUS = 1e-9


@functools.cache
def smallest_without_zero(dtype: np.dtype[Any]) -> float | None:
    """The smallest positive value of a float dtype that cannot hold zero (e8m0fnu), or
    None for every dtype that can."""
    if dtype.kind == "c":
        return None
    with np.errstate(invalid="ignore"):
        zero = np.zeros(1, np.float32).astype(dtype).astype(np.float64)[0]
    if zero == 0:
        return None
    return float(lookup.float64_values(dtype)[lookup.float64_values(dtype) > 0].min())


def real_dtype(dtype: np.dtype[Any]) -> np.dtype[Any]:
    if dtype.kind == "c":
        return np.dtype(np.float32 if dtype.itemsize == 8 else np.float64)
    return dtype


def mantissa_digits(dtype: np.dtype[Any]) -> int:
    """Significant bits of the (real) dtype, the implicit one included."""
    return int(finfo(real_dtype(dtype)).nmant) + 1


def exact_product_bits(dtypes: Sequence[np.dtype[Any]]) -> int:
    """Significant bits a factor may have so that value * factor is exact in float64 for
    every value of these dtypes: the product then rounds once, to the dtype, as promised.
    (float64 itself rounds once in the product; it does not restrict the factor.)"""
    digits = [mantissa_digits(d) for d in dtypes if mantissa_digits(d) < 53]
    return 53 - max(digits) if digits else 53


def truncate_factor(scale: float, bits: int) -> float:
    """`scale` rounded toward zero to `bits` significant bits."""
    return float(_factor_of(_key_of(np.asarray([scale], np.float64), bits), bits)[0])


def _key_of(scales: np.ndarray, bits: int) -> np.ndarray:
    """Order-preserving integer keys of non-negative factors with `bits` significant bits
    (truncating the rest): consecutive keys are consecutive candidate factors."""
    keys: np.ndarray = np.ascontiguousarray(scales, np.float64).view(np.int64) >> (53 - bits)
    return keys


def _factor_of(keys: np.ndarray, bits: int) -> np.ndarray:
    factors: np.ndarray = (keys << (53 - bits)).view(np.float64)
    return factors


Margin = Callable[[np.ndarray], np.ndarray]


def search_factors(
    margin: Margin,
    lows: Sequence[np.ndarray],
    highs: Sequence[np.ndarray],
    bits: int,
    max_evals: int = 400,
    next_change: Margin | None = None,
) -> np.ndarray:
    """For each of several independent problems, the largest factor s with `bits`
    significant bits and margin(s) >= 0, all searched at once (margin takes and returns
    one value per problem). Factor 0 always fits (a zero output); factor 1 never does (the
    caller only asks for data over its limit). `lows` and `highs` are guesses, nearest
    first, checked in turn: a problem whose low guesses all fail starts from 0, one whose
    high guesses all fit from 1. Bisection alternates with interpolation in s^2 (the
    output's squared norm is nearly proportional to it), and, given `next_change(s)` (a
    lower bound of the next factor above s at which the rounded output changes at all),
    with jumps just past that change; the answer is exact either way."""
    one = _key_of(np.ones(1), bits)[0]
    lo = np.zeros(len(lows[0]), np.int64)
    m_lo = np.ones(len(lows[0]))
    found = np.zeros(len(lows[0]), bool)
    for guess in lows:
        keys = np.minimum(_key_of(np.maximum(guess, 0.0), bits), one - 1)
        m = margin(_factor_of(np.where(found, lo, keys), bits))
        ok = ~found & (m >= 0)
        lo, m_lo, found = np.where(ok, keys, lo), np.where(ok, m, m_lo), found | ok
        if found.all():
            break
    hi = np.full(lo.shape, one)
    m_hi = -np.ones(lo.shape)
    found = np.zeros(lo.shape, bool)
    for guess in highs:
        keys = np.minimum(np.maximum(_key_of(np.minimum(guess, 1.0), bits) + 1, lo + 1), one)
        todo = ~found & (keys < one)
        if not todo.any():
            break
        m = margin(_factor_of(np.where(todo, keys, lo), bits))
        over = todo & ~(m >= 0)
        fits = todo & (m >= 0)
        hi, m_hi, found = np.where(over, keys, hi), np.where(over, m, m_hi), found | over
        lo, m_lo = np.where(fits, keys, lo), np.where(fits, m, m_lo)
    for step in range(max_evals):
        gap = hi - lo
        active = gap > 1
        if not np.any(active):
            break
        middle = lo + gap // 2
        if next_change is not None and step % 3 == 1:
            # Jump to just past the next change of the output above lo: if that fits, a
            # whole run of equal outputs is skipped; if not, the answer is within a few keys.
            with np.errstate(all="ignore"):
                changes = next_change(_factor_of(lo, bits)) * (1 + 16 * _U64)
            changes = np.where(np.isfinite(changes), changes, _factor_of(middle, bits))
            middle = np.clip(_key_of(changes, bits) + 1, lo + 1, hi - 1)
        elif step % (3 if next_change is not None else 2) == 0:
            # Interpolate margin (linear in s^2) between the ends for the crossing.
            s_lo, s_hi = _factor_of(lo, bits), _factor_of(hi, bits)
            with np.errstate(all="ignore"):
                t = m_lo / (m_lo - m_hi)
                guess = np.sqrt(s_lo * s_lo + t * (s_hi * s_hi - s_lo * s_lo))
                guess = np.where(np.isfinite(guess), guess, _factor_of(middle, bits))
            middle = np.clip(_key_of(guess, bits), lo + 1, hi - 1)
        candidate = np.where(active, middle, lo)
        m = margin(_factor_of(candidate, bits))
        ok = m >= 0
        lo, m_lo = np.where(active & ok, candidate, lo), np.where(active & ok, m, m_lo)
        hi, m_hi = np.where(active & ~ok, candidate, hi), np.where(active & ~ok, m, m_hi)
    return _factor_of(lo, bits)


def narrow_round(wide: np.ndarray, dtype: np.dtype[Any]) -> np.ndarray:
    """float64 (complex128) values rounded once, to nearest with ties to even, to `dtype`.

    numpy rounds float64 to float32 and float16 directly, but ml_dtypes (bfloat16, fp8)
    goes through float32, rounding twice. Rounding to float32 *to odd* first (truncate,
    then set the last bit if anything was cut off) keeps enough information that the
    second rounding, to any format at least two bits narrower, is the correct one."""
    if dtype.kind == "c" or dtype.itemsize >= 4:
        narrowed: np.ndarray = wide.astype(dtype)
        return narrowed
    if dtype == np.float16 and wide.dtype == np.float64:
        # Cheaper on the bits: cut the float64 mantissa to float32's 23 bits, keeping a
        # sticky bit, then an exact cast. Below float32's normal range (2**-126) the cast
        # rounds again, but such values are far below float16's half-step and become 0.
        bits64 = wide.view(np.uint64)
        sticky = (bits64 & np.uint64(0x1FFFFFFF)) != 0
        cut = (bits64 & ~np.uint64(0x1FFFFFFF)).view(np.float64)
        with np.errstate(over="ignore", under="ignore", invalid="ignore"):
            single = cut.astype(np.float32)
        single.view(np.uint32)[...] |= sticky
        return float16.from_float32(single)
    with np.errstate(over="ignore", invalid="ignore"):
        single = wide.astype(np.float32)
        finite = np.isfinite(single)
        back = single.astype(np.float64)
    bits = single.view(np.uint32)
    bits -= (np.abs(back) > np.abs(wide)) & finite  # rounded up in magnitude: truncate
    bits |= (back != wide) & finite  # inexact: make it odd (sticky bit)
    if dtype == np.float16:
        return float16.from_float32(single)
    smallest = smallest_without_zero(dtype)
    if smallest is not None:
        # No zero to round to (e8m0fnu): a positive value that float32 flushed to 0 would
        # become NaN; it rounds to the dtype's smallest value, as any other tiny one does.
        single[(single == 0) & (wide > 0)] = smallest
    with np.errstate(over="ignore", invalid="ignore"):
        result: np.ndarray = single.astype(dtype)
    return result


@dataclass(frozen=True)
class WideBound:
    """What the search needs to know of a group's float32/float64 members without
    reading them again: ||round(s*x)|| <= s*norm*(1+u) + sqrt(numel)*step/2, where step
    is the smallest subnormal (each element moves by at most u|sx| or half a step)."""

    ratio: float  # limit / (an upper bound of their exact norm)
    unit: float  # largest unit roundoff of their dtypes
    step: float  # largest smallest-subnormal of their dtypes
    numel: int

    @staticmethod
    def of(stats_norm_ratio: float, dtypes: Sequence[np.dtype[Any]], numel: int) -> WideBound:
        # The measured norm's own error: each dot product of up to _DOT_TERMS squares,
        # the blocks then merged one by one (a rigorous, if pessimistic, bound).
        error = (_DOT_TERMS + numel // _DOT_TERMS + 8) * _U64
        return WideBound(
            stats_norm_ratio * (1 - error),
            max(unit_roundoff(d) for d in dtypes),
            max(smallest_subnormal(d) for d in dtypes),
            numel,
        )

    def relative_norm(self, scales: np.ndarray, limit: float) -> np.ndarray:
        """An upper bound of ||round(s*x)|| / limit for each factor s."""
        with np.errstate(over="ignore"):
            rel: np.ndarray = scales / self.ratio * (1 + self.unit) + math.sqrt(self.numel) * (
                self.step / 2 / limit
            )
        return (rel * (1 + 4 * _U64)).astype(np.float64)


@dataclass(frozen=True)
class Histogram:
    """How often each finite nonzero value of an 8- or 16-bit float occurs."""

    dtype: np.dtype[Any]
    values: np.ndarray  # float64, exact
    counts: np.ndarray  # float64 (exact below 2**53)


def histogram_margin(
    limit: float, histograms: Sequence[Histogram], wide: WideBound | None
) -> Margin:
    """margin(s) for one group: exact over its histograms, the bound over the rest."""

    def margin(scales: np.ndarray) -> np.ndarray:
        s = float(scales[0])
        total, terms = 0.0, 0
        for hist in histograms:
            rounded = narrow_round(hist.values * s, hist.dtype).astype(np.float64) / limit
            # np.sum, not a BLAS dot: that spins up threads, 1.5 ms for 30,000 terms.
            total += float(np.sum(hist.counts * (rounded * rounded)))
            terms += hist.values.size
        # The float64 sum above errs by at most (terms + 3) roundings of its total.
        upper = total * (1 + (terms + 4) * _U64)
        if wide is not None:
            w = float(wide.relative_norm(np.asarray([s]), limit)[0])
            upper = (upper + w * w) * (1 + 4 * _U64)
        return np.asarray([1.0 - 2 * _U64 - upper])

    return margin


def histogram_next_change(histograms: Sequence[Histogram]) -> Margin:
    """A lower bound of the smallest factor above s at which any histogram value's rounded
    product changes: the product reaching the midpoint to the next larger magnitude."""

    def next_change(scales: np.ndarray) -> np.ndarray:
        s = float(scales[0])
        first = math.inf
        for hist in histograms:
            magnitudes = np.abs(hist.values)
            rounded = narrow_round(magnitudes * s, hist.dtype)
            uint = f"u{hist.dtype.itemsize}"
            up = (rounded.view(uint) + np.asarray(1, uint)).view(hist.dtype)
            with np.errstate(all="ignore"):
                here, there = rounded.astype(np.float64), up.astype(np.float64)
                there = np.where(np.isfinite(there) & (there > here), there, np.inf)
                crossing = (here + there) / 2 / magnitudes
            first = min(first, float(np.min(crossing)) * (1 - 4 * _U64))
        return np.asarray([first])

    return next_change


def choose_factor(
    limit: float,
    ratio: float,
    histograms: Sequence[Histogram],
    wide: WideBound | None,
    dtypes: Sequence[np.dtype[Any]],
) -> float | None:
    """The largest factor whose rounded output (8/16-bit members exactly, through their
    histograms; float32/float64 members through `wide`) has norm <= limit; None to leave
    the data as it is. `ratio` is limit / norm (NormAccumulator.limit_ratio)."""
    if not ratio < 1.0 or math.isinf(limit):  # within the limit, a zero norm, or C = inf
        return None
    bits = exact_product_bits(dtypes)
    margin = histogram_margin(limit, histograms, wide)
    lows, highs = _guesses(np.asarray([ratio]), _worst_unit(dtypes))
    changes = histogram_next_change(histograms) if wide is None and histograms else None
    return float(search_factors(margin, lows, highs, bits, next_change=changes)[0])


def _guesses(ratios: np.ndarray, unit: float) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Brackets around TF's factor: rounding errors of many elements mostly cancel, so the
    answer is usually within 2**-24 or 2**-20 of it; one rounding of every element moves the output
    by at most u (subnormal results aside: then 0 and 1 are the last resort)."""
    lows = [ratios * (1 - 2.0**-24), ratios * (1 - 2.0**-20), ratios * (1 - 2 * unit)]
    highs = [ratios * (1 + 2.0**-24), ratios * (1 + 4 * unit)]
    return lows, highs


def _worst_unit(dtypes: Sequence[np.dtype[Any]]) -> float:
    return max((unit_roundoff(d) for d in dtypes), default=0.0)


# Below this, limit / norm is kept as a mantissa and a power of two (see TINY_RATIO users).
TINY_RATIO = 2.0**-900


def scale_chunk(chunk: np.ndarray, scale: float | np.ndarray, exponent: int = 0) -> np.ndarray:
    """chunk * scale * 2**exponent, computed wide and rounded once to the chunk's dtype.
    The exponent carries factors too small for a float64 (C / ||t|| below 1e-308)."""
    if np.ndim(scale) == 0 and (chunk.dtype == np.float16 or lookup.is_float8(chunk.dtype)):
        return lookup.look_up(chunk, _scale_table(chunk.dtype, float(scale), exponent))
    return _scale(chunk, scale, exponent)


@functools.lru_cache(maxsize=16)
def _scale_table(dtype: np.dtype[Any], scale: float, exponent: int) -> np.ndarray:
    """Every value of an 8- or 16-bit float scaled as _scale does, as bits. One table per
    scale serves every chunk: a global clip has one scale for the whole checkpoint."""
    table = lookup.table_of(dtype, lambda values: _scale(values, scale, exponent))
    table.flags.writeable = False
    return table


def _scale(chunk: np.ndarray, scale: float | np.ndarray, exponent: int) -> np.ndarray:
    """chunk * scale * 2**exponent in float64 (complex128), rounded once to the chunk's
    dtype. The search gives factors with few enough bits that the product is exact for
    8- to 32-bit floats, so the only rounding is the last one (narrow_round)."""
    if exponent:
        # Fold the mantissa's own power of two into the exponent: a mantissa like 1e16
        # would overflow a float64 element near 1e300 before the exponent brings it down.
        scale, shift = math.frexp(float(scale))
        exponent += shift
    factor = np.asarray(scale, dtype=np.float64)
    wide = widen_exact(chunk)
    if wide.dtype.kind == "c":
        # Part by part: z * (s + 0j) computes re*0 + im*s, which turns -0.0 into +0.0.
        out = np.empty(np.broadcast_shapes(wide.shape, factor.shape), np.complex128)
        out.real = np.ldexp(wide.real * factor, exponent)
        out.imag = np.ldexp(wide.imag * factor, exponent)
        return narrow_round(out, chunk.dtype)
    wide = wide * factor
    if exponent:
        wide = np.ldexp(wide, exponent)
    return narrow_round(wide, chunk.dtype)


def widen_exact(chunk: np.ndarray) -> np.ndarray:
    """The chunk as float64 (complex128 for complex), every value exact."""
    if chunk.dtype.kind == "c":
        return chunk.astype(np.complex128)
    if chunk.dtype == np.float16:
        bits = float16.finite_as_float32(chunk)
        if bits is not None:
            return bits.astype(np.float64)
    if lookup.is_float8(chunk.dtype):
        return lookup.as_float32(chunk).astype(np.float64)
    with np.errstate(invalid="ignore"):
        if chunk.dtype.kind == "V":
            return chunk.astype(np.float32).astype(np.float64)
        return chunk.astype(np.float64)


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


def _has_infinity(dtype: np.dtype[Any]) -> bool:
    with np.errstate(all="ignore"):
        return bool(np.isinf(np.asarray(math.inf).astype(dtype).astype(np.float64)))


def _representable(dtype: np.dtype[Any], value: float, toward: int) -> np.ndarray | None:
    """The dtype value (0-d) nearest `value` that is >= it (toward=1) or <= it (toward=-1);
    None if there is none (above the largest value, or below the smallest)."""
    info = finfo(dtype)
    top, bottom = float(info.max), float(info.min)  # bottom > 0 for unsigned fp8 (e8m0)
    if value == math.inf or value == -math.inf:
        if (value > 0) == (toward > 0):  # a bound that excludes everything
            return np.asarray(value).astype(dtype) if _has_infinity(dtype) else None
        if _has_infinity(dtype):
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
    uint = np.dtype(f"u{value.dtype.itemsize}")
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
    if chunk.dtype.itemsize <= 2:  # float16, bfloat16, fp8: through a table
        bounds = (np.asarray(bound, dtype=chunk.dtype).tobytes() for bound in (lo, hi))
        return lookup.look_up(chunk, _clamp_table(chunk.dtype, *bounds))
    return _clamp(chunk, lo, hi)


def _clamp(chunk: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    wide = widen_exact(chunk) if chunk.dtype.itemsize <= 2 else chunk
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
        ratios = np.where(near, np.minimum(ratios, 1 - _U64), ratios)
        if not np.any(over):
            return norms, scales
    bits = exact_product_bits([array.dtype])
    slice_numel = math.prod(array.shape[a] for a in axes)
    unit = _worst_unit([array.dtype])
    if array.dtype.itemsize <= 2 or mantissa_digits(array.dtype) == 53:
        # 8/16-bit: exact from the values; float64: the bound would cost ~slice_numel
        # ulps, so the rounded slices are summed with a certain error bound instead.
        margin = _slice_values_margin(array, axes, over, limit)
    else:
        # np.sum over each slice errs by at most slice_numel roundings (pairwise: fewer).
        bound = WideBound(1.0, unit, smallest_subnormal(array.dtype), slice_numel)
        rel_error = (slice_numel + 8) * _U64
        slice_ratio = ratios[over] * (1 - rel_error)

        def margin(factors: np.ndarray) -> np.ndarray:
            w = bound.relative_norm(factors / slice_ratio, limit)
            result: np.ndarray = 1.0 - 2 * _U64 - w * w * (1 + 4 * _U64)
            return result

    lows, highs = _guesses(ratios[over], unit)
    scales[over] = search_factors(margin, lows, highs, bits)
    return norms, scales


def _slice_values_margin(
    array: np.ndarray, axes: tuple[int, ...], over: np.ndarray, limit: float
) -> Margin:
    """margin(factors) for the slices marked `over`, from their values (8/16-bit floats)."""
    picked = _picked_slices(array, axes, over)
    values = widen_exact(picked)
    if values.dtype.kind == "c":
        values = values.view(np.float64)
    per_slice = values.shape[1]
    flat = values.reshape(-1)
    slices = picked.shape[0]
    terms = per_slice + 4

    def margin(factors: np.ndarray) -> np.ndarray:
        each = np.repeat(factors, per_slice)  # complex: per real and imaginary part
        rounded = narrow_round(flat * each, real_dtype(array.dtype)).astype(np.float64)
        rounded = rounded.reshape(slices, per_slice)
        if array.dtype.itemsize > 2:
            return _certain_rows_margin(rounded, limit)
        rounded /= limit
        sums = (rounded * rounded).sum(axis=1)
        result: np.ndarray = 1.0 - 2 * _U64 - sums * (1 + terms * _U64)
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
    values = widen_exact(_picked_slices(array, axes, which))
    if values.dtype.kind == "c":
        values = values.view(np.float64)
    return values


def _rows_within_exactly(rows: np.ndarray, limit: float) -> np.ndarray:
    """Whether each float64 row's exact sum of squares is <= limit**2 (as fractions: slow,
    used only for slices whose measured norm is within rounding error of the limit)."""
    bound = Fraction(limit) ** 2
    return np.array(
        [sum((Fraction(v) ** 2 for v in row.tolist() if v), Fraction(0)) <= bound for row in rows],
        dtype=bool,
    )


def _two_square(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x*x as an exact sum high + low (Dekker's split; |x| well inside float64's range)."""
    high = x * x
    split = x * 134217729.0  # 2**27 + 1
    x_high = split - (split - x)
    x_low = x - x_high
    return high, ((x_high * x_high - high) + 2 * x_high * x_low) + x_low * x_low


def _certain_rows_margin(rows: np.ndarray, limit: float) -> np.ndarray:
    """1 - (a certain upper bound of each row's sum of squares) / limit**2, for float64
    rows: squares split exactly, added pairwise keeping each addition's exact error (TwoSum),
    so the only rounding left is in summing those errors, bounded explicitly."""
    peak = np.max(np.abs(rows), axis=1)
    exps = np.frexp(np.where(peak > 0, peak, 1.0))[1]
    x = np.ldexp(rows, -exps[:, None])
    high, low = _two_square(x)
    errors = [low]
    level = high
    while level.shape[1] > 1:
        if level.shape[1] % 2:
            level = np.pad(level, ((0, 0), (0, 1)))
        a, b = level[:, 0::2], level[:, 1::2]
        level = a + b
        b_part = level - a
        errors.append((a - (level - b_part)) + (b - b_part))
    rest = np.concatenate(errors, axis=1)
    main, corr = level[:, 0], rest.sum(axis=1)
    underflows = np.count_nonzero(np.abs(x) < 2.0**-400, axis=1)  # squares may underflow
    bound = (rest.shape[1] + 4) * _U64 * np.abs(rest).sum(axis=1) * 2 + 4 * underflows * 2.0**-1074
    with np.errstate(over="ignore", invalid="ignore"):
        c = np.ldexp(np.full(rows.shape[0], limit), -exps)
        c_high, c_low = _two_square(c)
        gap = (c_high - main) + (c_low - corr) - bound - 4 * _U64 * _U64 * c_high
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
