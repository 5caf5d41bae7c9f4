"""Pure numerics: exact L2 norms accumulated in float64, with no overflow or underflow.

Every input chunk is widened to float64 (squares of any float32/float16/bf16/fp8/int
value are exact-ish and finite in float64). Only float64 input can overflow (1e200²) or
underflow (1e-200²); such chunks are rescaled by a power of two first, so the sum of
squares is carried as `ssq * 4**exp`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np

from clipcli.dtypes import finfo, is_floating
from clipcli.numerics import float16, lookup

# Elements per piece inside NormAccumulator.add: 2 MiB of float64.
CACHE_BLOCK = 1 << 18
# float64 squares lose precision below 2**-511 and overflow above 2**511; scale outside.
_SAFE_HI = 2.0**500
_SAFE_LO = 2.0**-500


def _as_real(chunk: np.ndarray) -> np.ndarray:
    """A real view for complex data (sum |z|² == sum of squares of re and im)."""
    if chunk.dtype.kind == "c":
        return chunk.view(chunk.real.dtype)
    return chunk


def _is_bfloat16(dtype: np.dtype[Any]) -> bool:
    return dtype.type.__name__ == "bfloat16"  # dtype.name is computed in Python: 10x slower


def widen(chunk: np.ndarray) -> np.ndarray:
    """The chunk as float64 (real view for complex), values unchanged."""
    chunk = _as_real(chunk)
    if chunk.dtype == np.float64:
        return chunk
    if lookup.is_float8(chunk.dtype):
        return lookup.as_float32(chunk).astype(np.float64)
    with np.errstate(invalid="ignore"):  # a signalling NaN stays NaN: nothing to warn of
        if chunk.dtype.kind == "V":
            # ml_dtypes' bfloat16 casts fast to float32; straight to float64 a NaN warns.
            return chunk.astype(np.float32).astype(np.float64)
        return chunk.astype(np.float64)


@dataclass
class NormAccumulator:
    """Running sum of squares (as ssq * 4**exp), max |x| and non-finite count of a tensor."""

    ssq: float = 0.0
    exp: int = 0
    max_abs: float = 0.0  # over the finite values (what sums are scaled by)
    inf_count: int = 0
    nonfinite: int = 0
    nan_count: int = 0
    numel: int = 0
    # Extremes of the non-NaN values (infinities included): what value clipping acts on.
    min_value: float = math.inf
    max_value: float = -math.inf
    # Clip planning of 8- and 16-bit floats counts each bit pattern instead (np.bincount,
    # ~1.3 ns/element): the statistics above then come from the counts in finish(), and
    # the counts let the scale search compute any factor's rounded output exactly.
    keep_histogram: bool = False
    counts: np.ndarray | None = None  # dense, per bit pattern, while accumulating
    histogram: tuple[np.ndarray, np.ndarray] | None = None  # (bit patterns, counts), nonzero
    hist_dtype: np.dtype[Any] | None = None

    def add_sumsq(self, ssq: float, exp: int) -> None:
        if ssq == 0.0:
            return
        if self.ssq == 0.0:
            self.ssq, self.exp = ssq, exp
        elif exp > self.exp:
            self.ssq = ssq + math.ldexp(self.ssq, 2 * (self.exp - exp))
            self.exp = exp
        else:
            self.ssq += math.ldexp(ssq, 2 * (exp - self.exp))

    def add(self, chunk: np.ndarray) -> None:
        """Accumulate one chunk of any numeric dtype."""
        if self.keep_histogram and chunk.dtype.itemsize <= 2 and is_floating(chunk.dtype):
            counts = np.bincount(
                chunk.reshape(-1).view(f"u{chunk.dtype.itemsize}"),
                minlength=256**chunk.dtype.itemsize,
            )
            self.counts = counts if self.counts is None else self.counts + counts
            self.numel += chunk.size
            self.hist_dtype = chunk.dtype
            return
        if chunk.size > CACHE_BLOCK and chunk.ndim == 1:
            # Work through big chunks in pieces whose float64 copy stays in L2 cache:
            # the widen / reduce / dot passes then run from cache instead of memory.
            for start in range(0, chunk.size, CACHE_BLOCK):
                self.add(chunk[start : start + CACHE_BLOCK])
            return
        if chunk.size == 0:
            return
        # Hot path (16- and 32-bit floats): every value is exact in float32, and squares
        # cannot overflow or underflow in float64. numpy's float16 max/min/cast run at
        # 1-5 ns/element, so float16 goes through float32 too.
        bound = math.inf
        if _is_bfloat16(chunk.dtype):
            chunk = chunk.astype(np.float32)  # exact, NaN and inf included
        elif lookup.is_float8(chunk.dtype):
            chunk = lookup.as_float32(chunk)  # exact; ml_dtypes' cast is 9x slower
        narrow = chunk
        if chunk.dtype == np.float16:
            chunk, bound = float16.bits_as_float32(chunk), float16.TRICK_NONFINITE
        if chunk.dtype.kind == "f" and chunk.dtype.itemsize == 4:
            high, low = float(chunk.max()), float(chunk.min())
            if -bound < low and high < bound:  # also False for NaN
                wide = chunk.astype(np.float64)
                self.add_sumsq(float(wide @ wide), 0)
                self.numel += chunk.size
                self.max_value = max(self.max_value, high)
                self.min_value = min(self.min_value, low)
                self.max_abs = max(self.max_abs, high, -low)
                return
        chunk = narrow  # float16 with inf/NaN: the bit trick's stand-ins are not the values
        self.numel += chunk.size
        wide = widen(chunk)
        # Extremes on the narrow data where numpy orders it fast (fewer bytes to scan).
        kind, itemsize = chunk.dtype.kind, chunk.dtype.itemsize
        ordered = chunk if kind in "iub" or (kind == "f" and itemsize >= 4) else wide
        high, low = float(np.max(ordered)), float(np.min(ordered))
        if not (math.isfinite(high) and math.isfinite(low)):
            finite = np.isfinite(chunk)
            self.nonfinite += int(chunk.size - np.count_nonzero(finite))
            self.nan_count += int(np.count_nonzero(np.isnan(chunk)))
            self.inf_count += int(np.count_nonzero(np.isinf(chunk)))
            if chunk.dtype.kind != "c":
                has_values = not np.all(np.isnan(wide))
                if has_values:
                    high, low = float(np.nanmax(wide)), float(np.nanmin(wide))
                    self.max_value = max(self.max_value, high)
                    self.min_value = min(self.min_value, low)
            chunk = chunk[finite]
            if chunk.size == 0:
                return
            wide = widen(chunk)
            high, low = float(np.max(wide)), float(np.min(wide))
        elif chunk.dtype.kind != "c":
            self.max_value = max(self.max_value, high)
            self.min_value = min(self.min_value, low)
        # |z| of complex64 in float64: in float32 it rounds (and underflows near 1e-45).
        chunk_max = (
            float(np.max(np.abs(chunk.astype(np.complex128))))
            if chunk.dtype.kind == "c"
            else max(high, -low)
        )
        self.max_abs = max(self.max_abs, chunk_max)
        if chunk_max == 0.0:
            return
        if _SAFE_LO <= chunk_max <= _SAFE_HI:
            self.add_sumsq(float(np.dot(wide, wide)), 0)
        else:
            exp = math.frexp(chunk_max)[1]
            scaled = np.ldexp(wide, -exp)
            self.add_sumsq(float(np.dot(scaled, scaled)), exp)

    def finish(self) -> None:
        """Turn the bit-pattern counts (if any) into the statistics and a sparse histogram."""
        if self.counts is None:
            return
        counts, self.counts = self.counts, None
        assert self.hist_dtype is not None
        values = lookup.float64_values(self.hist_dtype)
        present = counts > 0
        nan = np.isnan(values)
        finite = np.isfinite(values)
        self.nan_count += int(counts[nan].sum())
        self.nonfinite += int(counts[~finite].sum())
        self.inf_count += int(counts[np.isinf(values)].sum())
        ordered = values[present & ~nan]
        if ordered.size:
            self.max_value = max(self.max_value, float(ordered.max()))
            self.min_value = min(self.min_value, float(ordered.min()))
        used = present & finite & (values != 0)
        bits = np.flatnonzero(used)
        kept = counts[bits]
        magnitudes = np.abs(values[bits])
        if bits.size:
            self.max_abs = max(self.max_abs, float(magnitudes.max()))
            # v**2 is exact in float64 for 16-bit v, and so is count * v**2 below 2**53.
            # np.sum, not a BLAS dot (which spins up threads: ms for a histogram).
            self.add_sumsq(float(np.sum(kept * (magnitudes * magnitudes))), 0)
        # Kept until planning is done, so stored small: 6 bytes per distinct value.
        count_type = np.uint32 if self.numel < 2**32 else np.int64
        self.histogram = (bits.astype(f"u{self.hist_dtype.itemsize}"), kept.astype(count_type))

    @property
    def largest_magnitude(self) -> float:
        """max|x| as reported: inf when an infinity is present (NaN does not count)."""
        return math.inf if self.inf_count else self.max_abs

    def merge(self, other: NormAccumulator) -> None:
        if other.counts is not None:
            self.keep_histogram, self.hist_dtype = True, other.hist_dtype
            self.counts = other.counts if self.counts is None else self.counts + other.counts
        self.add_sumsq(other.ssq, other.exp)
        self.max_abs = max(self.max_abs, other.max_abs)
        self.nonfinite += other.nonfinite
        self.nan_count += other.nan_count
        self.inf_count += other.inf_count
        self.numel += other.numel
        self.min_value = min(self.min_value, other.min_value)
        self.max_value = max(self.max_value, other.max_value)

    @property
    def norm(self) -> float:
        """The L2 norm: nan if any value is NaN, inf if any is infinite or it overflows."""
        if self.nan_count:
            return math.nan
        if self.nonfinite:
            return math.inf
        return self.finite_norm

    def limit_ratio(self, limit: float) -> float:
        """limit / norm, exact even when the norm itself overflows float64 (1e308 values);
        inf for a zero norm."""
        if self.ssq == 0.0:
            return math.inf
        try:
            return math.ldexp(limit / math.sqrt(self.ssq), -self.exp)
        except OverflowError:
            return math.inf

    def limit_ratio_parts(self, limit: float) -> tuple[float, int]:
        """limit / norm as (m, e) with value m * 2**e, for ratios below float64's range
        (the limit's own power of two is taken out first: a subnormal limit has few bits)."""
        fraction, exp = math.frexp(limit)
        return fraction / math.sqrt(self.ssq), exp - self.exp

    @property
    def finite_norm(self) -> float:
        """The L2 norm of the finite values; inf if it does not fit in float64."""
        try:
            return math.ldexp(math.sqrt(self.ssq), self.exp)
        except OverflowError:
            return math.inf


def accumulate(chunks: Iterable[np.ndarray]) -> NormAccumulator:
    acc = NormAccumulator()
    for chunk in chunks:
        acc.add(chunk)
    return acc


def accumulate_array(array: np.ndarray) -> NormAccumulator:
    """Statistics of an in-memory array, in pieces so the float64 copy stays small."""
    flat = array.reshape(-1)
    step = 1 << 18
    return accumulate(flat[i : i + step] for i in range(0, flat.size, step))


def l2_norm(array: np.ndarray) -> float:
    """Exact L2 norm of a whole array (finite values only)."""
    return accumulate_array(array).norm


def global_norm(norms: Iterable[float]) -> float:
    """sqrt(sum of squares) of per-tensor norms, without overflow."""
    acc = NormAccumulator()
    for value in norms:
        if value:
            exp = math.frexp(value)[1]
            acc.add_sumsq(math.ldexp(value, -exp) ** 2, exp)
    return acc.norm


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
    exps = _exponents(peak)
    total = np.zeros(keep_shape)
    for block in blocks:
        total += _sum_squares(array[block], axes, exps)
    return total, exps


def _wide_abs(array: np.ndarray) -> np.ndarray:
    """|x| as float64 (the modulus for complex)."""
    wide: np.ndarray = (
        np.abs(array.astype(np.complex128)) if array.dtype.kind == "c" else np.abs(widen(array))
    )
    return wide


def _peaks(array: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
    peaks: np.ndarray = np.max(_wide_abs(array), axis=axes, keepdims=True)
    return peaks


def _exponents(peak: np.ndarray) -> np.ndarray:
    safe = np.where((peak > 0) & np.isfinite(peak), peak, 1.0)
    exps: np.ndarray = np.frexp(safe)[1]
    return exps


def _sum_squares(array: np.ndarray, axes: tuple[int, ...], exps: np.ndarray) -> np.ndarray:
    scaled = np.ldexp(_wide_abs(array), -exps)
    sums: np.ndarray = np.sum(scaled * scaled, axis=axes, keepdims=True)
    return sums


def _scaled_sums(array: np.ndarray, axes: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """(exponents, scaled sums of squares) of the slices of one block."""
    exps = _exponents(_peaks(array, axes))
    return exps, _sum_squares(array, axes, exps)


def unit_roundoff(dtype: np.dtype[Any]) -> float:
    """Half the machine epsilon: the largest relative error of rounding to this dtype."""
    if not is_floating(dtype):
        return 0.0
    if dtype.kind == "c":
        dtype = np.dtype(dtype.char.lower()) if dtype.char in "FD" else np.dtype(np.float64)
    return float(finfo(dtype).eps) / 2


def smallest_subnormal(dtype: np.dtype[Any]) -> float:
    if not is_floating(dtype):
        return 0.0
    if dtype.kind == "c":
        dtype = np.dtype(np.float32) if dtype.itemsize == 8 else np.dtype(np.float64)
    return float(finfo(dtype).smallest_subnormal)


# Up to this many error terms, CertainSumsq adds them as fractions: exact, so that a small
# tensor whose norm is exactly C is recognised as such.
_EXACT_REST = 4096


class CertainSumsq:
    """A sum of squares with a rigorous error bound, for the final "<= C" check of float64
    output (a plain float64 dot product errs by ~1e-14 there, about 150 float64 roundings
    of the norm). Each square is split exactly into two float64s (Dekker), the high parts
    are added pairwise with each addition's exact error kept (TwoSum), and only those tiny
    errors are added in plain float64, with their error bounded. Chunks combine exactly,
    as fractions. About 20 ns per element."""

    def __init__(self) -> None:
        self.total = Fraction(0)
        self.bound = Fraction(0)

    def add(self, chunk: np.ndarray) -> None:
        magnitudes = np.abs(widen(chunk)).reshape(-1)
        magnitudes = magnitudes[magnitudes != 0]
        if magnitudes.size == 0:
            return
        exp = math.frexp(float(magnitudes.max()))[1]
        x = np.ldexp(magnitudes, -exp)  # below 1; tiny ones may underflow (bounded below)
        high = x * x
        split = x * 134217729.0  # 2**27 + 1
        x_high = split - (split - x)
        x_low = x - x_high
        low = ((x_high * x_high - high) + 2 * x_high * x_low) + x_low * x_low
        errors = [low]
        level = high
        while level.size > 1:
            if level.size % 2:
                level = np.append(level, 0.0)
            a, b = level[0::2], level[1::2]
            level = a + b
            b_part = level - a
            errors.append((a - (level - b_part)) + (b - b_part))
        rest = np.concatenate(errors)
        terms = rest.size + 4
        # Squares of elements below 2**-400 (relative to the peak) may underflow.
        underflows = int(np.count_nonzero(x < 2.0**-400))
        error = terms * 2.0**-53 * float(np.sum(np.abs(rest))) * 2 + 4 * underflows * 2.0**-1074
        weight = Fraction(4) ** exp
        if rest.size <= _EXACT_REST:  # small: add the exact errors exactly (a norm == C)
            exact = sum((Fraction(v) for v in rest[rest != 0].tolist()), Fraction(0))
            error = 4 * underflows * 2.0**-1074
        else:
            exact = Fraction(float(np.sum(rest)))
        self.total += (Fraction(float(level[0])) + exact) * weight
        self.bound += Fraction(error) * weight

    def merge(self, other: CertainSumsq) -> None:
        self.total += other.total
        self.bound += other.bound

    def at_most(self, limit: float) -> bool:
        """Whether the norm is certainly <= limit."""
        return self.total + self.bound <= Fraction(limit) ** 2

    def over(self, limit: float) -> float:
        """norm / limit (the bound aside), computed exactly before the last rounding."""
        try:
            return math.sqrt(self.total / Fraction(limit) ** 2)
        except OverflowError:
            return math.inf

    @property
    def norm(self) -> float:
        """The norm (the bound aside), inf beyond float64's range."""
        if self.total <= 0:
            return 0.0
        half = (self.total.numerator.bit_length() - self.total.denominator.bit_length()) // 2
        try:
            return math.ldexp(math.sqrt(self.total / Fraction(4) ** half), half)
        except OverflowError:
            return math.inf
