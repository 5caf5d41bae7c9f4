"""Pure numerics: exact L2 norms accumulated in float64, with no overflow or underflow.

Every input chunk is widened to float64 (squares of any float32/float16/bf16/fp8/int
value are exact-ish and finite in float64). Only float64 input can overflow (1e200²) or
underflow (1e-200²); such chunks are rescaled by a power of two first (the one rule,
rescale_exponent), and sums are carried as mantissa * 2**exponent (ScaledSum).
"""

from __future__ import annotations

import functools
import math
import operator
import os
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, Protocol, TypeVar, overload

import numpy as np

from clipcli.dtypes import bits_dtype, float64_values, is_bfloat16, is_float8, is_small_float
from clipcli.numerics import float16, lookup, sign_magnitude
from clipcli.numerics.widening import widen_real

# Elements per piece inside NormAccumulator.add: 2 MiB of float64.
# Elements per cache block (the developer's knob CLIPCLI_CACHE_BLOCK is for
# benchmarks/thread_knobs.py only: blocks decide how sums associate).
_CACHE_BLOCK_KNOB = os.environ.get("CLIPCLI_CACHE_BLOCK", "")
CACHE_BLOCK = (
    int(_CACHE_BLOCK_KNOB)
    if _CACHE_BLOCK_KNOB.isdigit() and 0 < int(_CACHE_BLOCK_KNOB) <= 1 << 30
    else 1 << 18
)

# Each thread's buffers for the hot path (the float64 widening, float16/fp8's moved bits):
# a fresh 2 MiB array per block is a malloc and free in the one arena every thread shares
# (system.parallel: lock traffic that grows with the thread count) and a buffer that is
# cold in this core's cache.
_SCRATCH = threading.local()


def _scratch(name: str, dtype: type[np.generic], size: int) -> np.ndarray:
    """`size` elements of this thread's buffer `name` (CACHE_BLOCK elements of dtype), or a
    fresh array where more are asked for: valid until this thread's next call for name."""
    if size > CACHE_BLOCK:
        return np.empty(size, dtype)
    buffer = getattr(_SCRATCH, name, None)
    if buffer is None:
        buffer = np.empty(CACHE_BLOCK, dtype)
        setattr(_SCRATCH, name, buffer)
    part: np.ndarray = buffer[:size]
    return part


def sum_of_squares(wide: np.ndarray) -> float:
    """The float64 dot product of a 1-D float64 array with itself. np.dot, not `wide @
    wide`: the same BLAS call and the same bits, but matmul holds the GIL through it and
    np.dot lets go, so worker threads measuring chunks run their dots side by side
    (measured: a spinning Python thread beside a 2**18-value dot waits ~5 ms, the switch
    interval, for np.dot's and never for matmul's)."""
    return float(np.dot(wide, wide))


def _widened(chunk: np.ndarray) -> np.ndarray:
    """A 1-D chunk as float64, exactly (the same values astype gives), in this thread's
    buffer when it fits: valid until this thread's next call."""
    wide = _scratch("wide", np.float64, chunk.size)
    np.copyto(wide, chunk)
    return wide


# ---------------------------------------------------------------- the one scaled sum
#
# float64 squares overflow above 2**511 and lose precision below 2**-511, and a dot product
# of up to 2**63 terms must not overflow either; so data whose largest magnitude lies
# outside [SAFE_LO, SAFE_HI] is scaled by a power of two first (exact), and sums are carried
# as mant * 2**exp. One rule and one carrier for every sum of squares and product in
# clipcli: per tensor (NormAccumulator), per slice (slices.py) and A·B (diff).
SAFE_HI = 2.0**400
SAFE_LO = 2.0**-400


def rescale_exponent(peak: float) -> int:
    """The power of two to divide data by before squaring, given its largest magnitude:
    0 inside the safe range (and for 0 or non-finite peaks), else the peak's exponent."""
    if SAFE_LO <= peak <= SAFE_HI or peak == 0.0 or not math.isfinite(peak):
        return 0
    return math.frexp(peak)[1]


def rescale_exponents(peaks: np.ndarray) -> np.ndarray:
    """rescale_exponent of each peak, as int64."""
    usable = np.isfinite(peaks) & (peaks > 0) & ((peaks < SAFE_LO) | (peaks > SAFE_HI))
    exps: np.ndarray = np.frexp(np.where(usable, peaks, 1.0))[1].astype(np.int64)
    exps[~usable] = 0
    return exps


@dataclass(slots=True)  # slots: ~300 bytes less per tensor (checkpoints of 200,000)
class ScaledSum:
    """A float64 sum carried as mant * 2**exp (mant normalised to [0.5, 1) in magnitude,
    signed), so that no sum of scaled terms overflows or underflows."""

    mant: float = 0.0
    exp: int = 0

    def add(self, mant: float, exp: int) -> None:
        """Add mant * 2**exp."""
        if mant == 0.0:
            return
        if self.mant == 0.0:
            total, at = mant, exp
        elif exp > self.exp:
            total, at = mant + math.ldexp(self.mant, self.exp - exp), exp
        else:
            total, at = self.mant + math.ldexp(mant, exp - self.exp), self.exp
        if math.isfinite(total) and total != 0.0:
            frac, shift = math.frexp(total)
            self.mant, self.exp = frac, at + shift
        else:
            self.mant, self.exp = total, at

    def merge(self, other: ScaledSum) -> None:
        self.add(other.mant, other.exp)


def scaled_dot(a: np.ndarray, b: np.ndarray, max_a: float, max_b: float) -> tuple[float, int]:
    """a·b of float64 arrays as (mant, exp) meaning mant * 2**exp, given their largest
    magnitudes; each side rescaled by the one rule when its values are extreme."""
    if max_a == 0.0 or max_b == 0.0:
        return 0.0, 0
    exp_a, exp_b = rescale_exponent(max_a), rescale_exponent(max_b)
    scaled_a = np.ldexp(a, -exp_a) if exp_a else a
    scaled_b = np.ldexp(b, -exp_b) if exp_b else b
    return float(np.dot(scaled_a, scaled_b)), exp_a + exp_b


# A NamedTuple, not a frozen dataclass: as immutable, and cheaper to define at import
# (start-up of norms in shell loops, issue 12 item 7).
class _Patterns(NamedTuple):
    """What finish() needs of every bit pattern of an 8- or 16-bit float, computed once per
    dtype (finish runs once per tensor: 65,536-entry passes add up over thousands)."""

    # Each indexed by code: finish() looks up only the codes a tensor holds (a pass over
    # all 65,536 codes per table cost ~400 us a tensor: 20,000 small bf16 tensors, 8 s).
    is_nan: np.ndarray  # bool
    is_inf: np.ndarray  # bool
    is_used: np.ndarray  # bool: a finite nonzero value
    rank: np.ndarray  # the code's place in by_value; -1 for NaN
    magnitudes: np.ndarray  # |value|
    squares: np.ndarray  # value**2, exact
    sorted_values: np.ndarray  # the non-NaN codes' values in ascending order, ties by code


@functools.cache
def _patterns(dtype: np.dtype[Any]) -> _Patterns:
    values = float64_values(dtype)
    nan = np.isnan(values)
    finite = np.isfinite(values)
    with np.errstate(invalid="ignore", over="ignore"):
        magnitudes = np.abs(values)
        squares = values * values
    by_value = np.flatnonzero(~nan)
    by_value = by_value[np.argsort(values[by_value], kind="stable")]
    rank = np.full(values.size, -1, np.int32)
    rank[by_value] = np.arange(by_value.size, dtype=np.int32)
    return _Patterns(
        is_nan=nan,
        is_inf=np.isinf(values),
        is_used=finite & (values != 0),
        rank=rank,
        magnitudes=magnitudes,
        squares=squares,
        sorted_values=values[by_value],
    )


class Normed(Protocol):
    """What the report asks of a tensor's statistics after a clip: its L2 norm."""

    @property
    def norm(self) -> float: ...


class KnownNorm:
    """A finished tensor's L2 norm and nothing else: the outcome of a small tensor written
    together with others (numerics.many.norms_each). ~64 bytes where a NormAccumulator
    holds ~220: 200,000 of them are ~30 MB of a clip's peak."""

    __slots__ = ("norm",)

    def __init__(self, norm: float) -> None:
        self.norm = norm

    def __repr__(self) -> str:
        return f"KnownNorm({self.norm!r})"


class _Unusual:
    """What few accumulators need beyond the sum and extremes: the counts of non-finite
    values and the bit-pattern histogram. Held apart so that the accumulator of an ordinary
    small tensor is 6 slots, not 12 (200,000 tensors: ~9 MB of a clip's peak)."""

    __slots__ = (
        "inf_count",
        "nonfinite",
        "nan_count",
        "keep_histogram",
        "counts",
        "histogram",
        "hist_dtype",
    )

    def __init__(self) -> None:
        self.inf_count = self.nonfinite = self.nan_count = 0
        self.keep_histogram = False
        self.counts: np.ndarray | None = None
        self.histogram: tuple[np.ndarray, np.ndarray] | None = None
        self.hist_dtype: np.dtype[Any] | None = None


_ORDINARY = _Unusual()  # read, never written: what an accumulator without one holds
_T = TypeVar("_T")


def _write_unusual(held: NormAccumulator, value: object, name: str) -> None:
    if held._unusual is _ORDINARY:  # the shared one is never written: a copy of its own
        if getattr(_ORDINARY, name) is value:  # 0, False, None: as it stands (merge() adds 0)
            return
        held._unusual = _Unusual()
    setattr(held._unusual, name, value)


class _UnusualField(property, Generic[_T]):
    """A field of NormAccumulator kept in its _Unusual. Read in C (a property over an
    attrgetter: 200,000 tensors are read several times each; a Python __get__ cost 0.3 s)."""

    def __init__(self, name: str) -> None:
        super().__init__(
            operator.attrgetter(f"_unusual.{name}"), functools.partial(_write_unusual, name=name)
        )

    if TYPE_CHECKING:  # what the property's C code does, typed

        @overload
        def __get__(self, held: None, owner: type | None = None) -> _UnusualField[_T]: ...
        @overload
        def __get__(self, held: NormAccumulator, owner: type | None = None) -> _T: ...
        def __get__(self, held: object, owner: type | None = None) -> Any: ...
        def __set__(self, held: NormAccumulator, value: _T) -> None: ...


class NormAccumulator:
    """Running sum of squares, max |x| and non-finite count of a tensor."""

    # Written by hand, not as a dataclass: the rarely set fields live in one _Unusual.
    __slots__ = ("sumsq", "max_abs", "numel", "min_value", "max_value", "_unusual")
    # The fields in the dataclass's order: its ==, repr and positional arguments.
    _FIELDS = (
        "sumsq",
        "max_abs",
        "inf_count",
        "nonfinite",
        "nan_count",
        "numel",
        "min_value",
        "max_value",
        "keep_histogram",
        "counts",
        "histogram",
        "hist_dtype",
    )

    def __init__(
        self,
        sumsq: ScaledSum | None = None,
        max_abs: float = 0.0,  # over the finite values (what sums are scaled by)
        inf_count: int = 0,
        nonfinite: int = 0,
        nan_count: int = 0,
        numel: int = 0,
        # Extremes of the non-NaN values (infinities included): what value clipping acts on.
        min_value: float = math.inf,
        max_value: float = -math.inf,
        # Clip planning of 8- and 16-bit floats counts each bit pattern instead (np.bincount,
        # ~1.3 ns/element): the statistics above then come from the counts in finish(), and
        # the counts let the scale search compute any factor's rounded output exactly.
        keep_histogram: bool = False,
        counts: np.ndarray | None = None,  # dense, per bit pattern, while accumulating
        histogram: tuple[np.ndarray, np.ndarray] | None = None,  # (bit patterns, counts)
        hist_dtype: np.dtype[Any] | None = None,
    ) -> None:
        self.sumsq = ScaledSum() if sumsq is None else sumsq
        self.max_abs = max_abs
        self.numel = numel
        self.min_value = min_value
        self.max_value = max_value
        self._unusual = _ORDINARY
        if inf_count or nonfinite or nan_count or keep_histogram:
            self.inf_count, self.nonfinite, self.nan_count = inf_count, nonfinite, nan_count
            self.keep_histogram = keep_histogram
        if counts is not None or histogram is not None or hist_dtype is not None:
            self.counts, self.histogram, self.hist_dtype = counts, histogram, hist_dtype

    inf_count = _UnusualField[int]("inf_count")
    nonfinite = _UnusualField[int]("nonfinite")
    nan_count = _UnusualField[int]("nan_count")
    keep_histogram = _UnusualField[bool]("keep_histogram")
    counts = _UnusualField["np.ndarray | None"]("counts")
    histogram = _UnusualField["tuple[np.ndarray, np.ndarray] | None"]("histogram")
    hist_dtype = _UnusualField["np.dtype[Any] | None"]("hist_dtype")

    def _values(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in self._FIELDS)

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        assert isinstance(other, NormAccumulator)
        return self._values() == other._values()

    __hash__ = None  # type: ignore[assignment]  # mutable, as the dataclass was

    def __repr__(self) -> str:
        shown = ", ".join(f"{name}={getattr(self, name)!r}" for name in self._FIELDS)
        return f"NormAccumulator({shown})"

    @property
    def ssq(self) -> float:
        """The sum of squares is ssq * 4**exp (ssq in [0.5, 2), or 0)."""
        return math.ldexp(self.sumsq.mant, self.sumsq.exp % 2)

    @property
    def exp(self) -> int:
        return self.sumsq.exp // 2

    def add_sumsq(self, ssq: float, exp: int) -> None:
        """Add ssq * 4**exp."""
        self.sumsq.add(ssq, 2 * exp)

    def add(self, chunk: np.ndarray) -> None:
        """Accumulate one chunk of any numeric dtype and shape."""
        if chunk.ndim != 1:
            # Statistics do not depend on the shape; the dot products below need 1-D.
            chunk = chunk.reshape(-1)
        if self.keep_histogram and is_small_float(chunk.dtype):
            self.add_counts(lookup.bit_pattern_counts(chunk), chunk.dtype, chunk.size)
            return
        if chunk.size > CACHE_BLOCK:
            # Work through big chunks in pieces whose float64 copy stays in L2 cache:
            # the widen / reduce / dot passes then run from cache instead of memory.
            for start in range(0, chunk.size, CACHE_BLOCK):
                self.add(chunk[start : start + CACHE_BLOCK])
            return
        if chunk.size == 0:
            return
        if (layout := sign_magnitude.layout(chunk.dtype)) is not None:
            # Hot path of the 8- and 16-bit floats: extremes from the bits, then as below.
            extremes = sign_magnitude.finite_extremes(chunk, layout)
            if extremes is not None:
                bits = _scratch("bits", np.int32, chunk.size)
                self._add_finite(*sign_magnitude.scaled_values(chunk, layout, bits), *extremes)
                return
        # Hot path of float32 (and of the 8- and 16-bit floats the bits left undecided):
        # every value is exact in float32, and squares cannot overflow or underflow in
        # float64. numpy's float16 max/min/cast run at 1-5 ns/element, so float16 goes
        # through float32 too.
        bound = math.inf
        if is_bfloat16(chunk.dtype):
            chunk = chunk.astype(np.float32)  # exact, NaN and inf included
        elif is_float8(chunk.dtype):
            chunk = lookup.as_float32(chunk)  # exact; ml_dtypes' cast is 9x slower
        narrow = chunk
        if chunk.dtype == np.float16:
            chunk, bound = float16.bits_as_float32(chunk), float16.TRICK_NONFINITE
        if chunk.dtype.kind == "f" and chunk.dtype.itemsize == 4:
            high, low = float(chunk.max()), float(chunk.min())
            if -bound < low and high < bound:  # also False for NaN
                self._add_finite(chunk, 0, high, low)
                return
        chunk = narrow  # float16 with inf/NaN: the bit trick's stand-ins are not the values
        self.numel += chunk.size
        wide = widen_real(chunk)
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
                # The NaNs taken out first: np.nanmax warns "All-NaN slice encountered"
                # (a stray stderr line) where a float64 signalling NaN meets a number.
                values = wide[~np.isnan(wide)]
                if values.size:
                    high, low = float(values.max()), float(values.min())
                    self.max_value = max(self.max_value, high)
                    self.min_value = min(self.min_value, low)
            chunk = chunk[finite]
            if chunk.size == 0:
                return
            wide = widen_real(chunk)
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
        exp = rescale_exponent(chunk_max)
        scaled = np.ldexp(wide, -exp) if exp else wide
        self.add_sumsq(sum_of_squares(scaled), exp)

    def _add_finite(self, chunk: np.ndarray, exp: int, high: float, low: float) -> None:
        """Add a chunk of finite values, given as values * 2**-exp (anything _widened makes
        float64 exactly, whose squares cannot overflow or underflow there), and their
        extremes."""
        wide = _widened(chunk)
        self.add_sumsq(sum_of_squares(wide), exp)
        self.numel += chunk.size
        self.max_value = max(self.max_value, high)
        self.min_value = min(self.min_value, low)
        self.max_abs = max(self.max_abs, high, -low)

    def add_counts(self, counts: np.ndarray, dtype: np.dtype[Any], numel: int) -> None:
        """Accumulate a chunk of `numel` elements of an 8/16-bit float dtype given as its
        bit-pattern counts (lookup.bit_pattern_counts of it, intp; made elsewhere, as
        system.counting makes them), as add() of the chunk does with keep_histogram."""
        if self.counts is None:
            self.counts = counts
        else:
            self.counts += counts
        self.numel += numel
        self.hist_dtype = dtype

    def add_repeated(self, value: np.ndarray, count: int) -> None:
        """Accumulate `count` copies of one value (a tensor known to hold nothing else) in
        constant time: each statistic of one copy, times count. The sum of squares is one
        float64 product away from exact (relative error <= 2**-53)."""
        one = NormAccumulator(keep_histogram=self.keep_histogram)
        one.add(value.reshape(1))
        one.sumsq.mant *= count
        if one.sumsq.mant:
            frac, shift = math.frexp(one.sumsq.mant)
            one.sumsq.mant, one.sumsq.exp = frac, one.sumsq.exp + shift
        if one.counts is not None:
            one.counts = one.counts.astype(np.int64) * count
        one.numel *= count
        one.nonfinite *= count
        one.nan_count *= count
        one.inf_count *= count
        self.merge(one)

    def finish(self) -> None:
        """Turn the bit-pattern counts (if any) into the statistics and a sparse histogram."""
        if self.counts is None:
            return
        counts, self.counts = self.counts, None
        assert self.hist_dtype is not None
        facts = _patterns(self.hist_dtype)
        # The codes present, ascending. (A bool array first: np.flatnonzero of 65,536 int64
        # counts took ~120 us, of their != 0 ~18 us; 20,000 small bf16 tensors, 2 s.)
        codes = np.flatnonzero(counts != 0)
        present = counts[codes]
        nan_count = int(present[facts.is_nan[codes]].sum())
        inf_count = int(present[facts.is_inf[codes]].sum())
        self.nan_count += nan_count
        self.inf_count += inf_count
        self.nonfinite += nan_count + inf_count
        ranks = facts.rank[codes]
        ranks = ranks[ranks >= 0]  # in value order: the first and last present
        if ranks.size:
            self.min_value = min(self.min_value, float(facts.sorted_values[ranks.min()]))
            self.max_value = max(self.max_value, float(facts.sorted_values[ranks.max()]))
        used = facts.is_used[codes]
        bits = codes[used]
        kept = present[used]
        if bits.size:
            self.max_abs = max(self.max_abs, float(facts.magnitudes[bits].max()))
            # v**2 is exact in float64 for 16-bit v, and so is count * v**2 below 2**53.
            # np.sum, not a BLAS dot (which spins up threads: ms for a histogram).
            self.add_sumsq(float(np.sum(kept * facts.squares[bits])), 0)
        # Kept until planning is done, so stored small: 6 bytes per distinct value.
        count_type = np.uint32 if self.numel < 2**32 else np.int64
        self.histogram = (bits.astype(bits_dtype(self.hist_dtype)), kept.astype(count_type))

    @property
    def largest_magnitude(self) -> float:
        """max|x| as reported: inf when an infinity is present (NaN does not count)."""
        return math.inf if self.inf_count else self.max_abs

    def merge(self, other: NormAccumulator) -> None:
        if other._unusual is not _ORDINARY:  # non-finite counts or bit-pattern counts
            self._merge_unusual(other)
        self.sumsq.merge(other.sumsq)
        self.max_abs = max(self.max_abs, other.max_abs)
        self.numel += other.numel
        self.min_value = min(self.min_value, other.min_value)
        self.max_value = max(self.max_value, other.max_value)

    def _merge_unusual(self, other: NormAccumulator) -> None:
        """merge()'s part for the rarely set fields (an accumulator without them has zero
        counts and no histogram: adding them would change nothing, at ~1 us a merge)."""
        if other.counts is not None:
            self.keep_histogram, self.hist_dtype = True, other.hist_dtype
            if self.counts is None:
                self.counts = other.counts.copy()
            else:
                self.counts += other.counts
        self.nonfinite += other.nonfinite
        self.nan_count += other.nan_count
        self.inf_count += other.inf_count

    @property
    def norm(self) -> float:
        """The L2 norm: nan if any value is NaN, inf if any is infinite or it overflows."""
        if self.nan_count:
            return math.nan
        if self.nonfinite:
            return math.inf
        # finite_norm spelt out: a clip of 200,000 tensors asks ~5 norms of each.
        mant, exp = self.sumsq.mant, self.sumsq.exp
        if mant == 0.0:
            return 0.0
        try:
            return math.ldexp(math.sqrt(math.ldexp(mant, exp % 2)), exp // 2)
        except OverflowError:
            return math.inf

    def limit_ratio(self, limit: float) -> float:
        """limit / norm, exact even when the norm itself overflows float64 (1e308 values);
        inf for a zero norm."""
        if self.sumsq.mant == 0.0:
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
        if self.sumsq.mant == 0.0:
            return 0.0
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


# Checkpoints of 200,000 tensors merge and sum 200,000 statistics at a time (the global
# norm, the factor search): a ScaledSum.add each is ~1.5 us of Python. Where every term and
# every partial sum is a normal float64, carrying the sum as mant * 2**exp changes nothing:
# each add rounds a + b once, at a power-of-two scale, and rounding to nearest does not
# depend on that scale between float64's smallest normal and its largest. So the sum is
# then float64's own sum in the same order (np.cumsum adds one term after the other, unlike
# np.sum's pairwise order), bit for bit; anything else takes the one-by-one loop.
# Nonzero terms within [2**-900, 2**900] (their squares' exponents for the norms) and
# fewer than 2**100 of them: every partial sum of nonnegative terms stays normal.
_PLAIN_EXP = 900


def global_norm(norms: Iterable[float]) -> float:
    """sqrt(sum of squares) of per-tensor norms, without overflow: the norm of their
    squares added in order, each rounded once (as ScaledSum adds them)."""
    values = np.fromiter(norms, np.float64)
    values = values[values != 0]
    magnitudes = np.abs(values)
    if values.size == 0:
        return 0.0
    if np.all(magnitudes >= SAFE_LO) and np.all(magnitudes <= SAFE_HI):  # NaN: False
        return math.sqrt(float(np.cumsum(values * values)[-1]))
    return _global_norm_scaled(values.tolist())


def _global_norm_scaled(norms: Iterable[float]) -> float:
    """global_norm one value at a time, in the scaled sum (any magnitude, inf and NaN)."""
    acc = NormAccumulator()
    for value in norms:
        if value:
            exp = math.frexp(value)[1]
            acc.add_sumsq(math.ldexp(value, -exp) ** 2, exp)
    return acc.norm


# Parts from which merged() works on columns: ~26 us of numpy calls whatever the count, then
# ~0.6 us a part, where merge() one at a time costs ~0.6 us a part (a factor searched for
# each of 200,000 tensors merges one part each time: 26 us against 1).
MERGED_BY_COLUMNS = 512


def merged(parts: Sequence[NormAccumulator]) -> NormAccumulator:
    """A fresh NormAccumulator into which every part was merged, in order: the same
    statistics, bit for bit, as NormAccumulator().merge(part) for each part in turn."""
    together = NormAccumulator()
    if len(parts) < MERGED_BY_COLUMNS or any(part.counts is not None for part in parts):
        return _merged_one_by_one(parts, together)
    # Each field as one float64 array, no list of floats first, and the extremes' arrays
    # let go before the sums' are made: 200,000 parts held five lists and their arrays at
    # once (~25 MB of a clip's heap, resident from then on).
    peaks, lows, highs = (_column(parts, name) for name in ("max_abs", "min_value", "max_value"))
    # A NaN extreme would make the builtin max and min depend on where it stands.
    if np.isnan(peaks).any() or np.isnan(lows).any() or np.isnan(highs).any():
        return _merged_one_by_one(parts, together)
    max_abs = _first_extreme(peaks, 0.0, highest=True)
    min_value = _first_extreme(lows, math.inf, highest=False)
    max_value = _first_extreme(highs, -math.inf, highest=True)
    del peaks, lows, highs
    if not _plain_sum(parts, together.sumsq):
        return _merged_one_by_one(parts, together)
    together.max_abs, together.min_value, together.max_value = max_abs, min_value, max_value
    together.nonfinite = sum(part.nonfinite for part in parts)
    together.nan_count = sum(part.nan_count for part in parts)
    together.inf_count = sum(part.inf_count for part in parts)
    together.numel = sum(part.numel for part in parts)
    return together


def _column(parts: Sequence[NormAccumulator], name: str) -> np.ndarray:
    read = operator.attrgetter(name)
    return np.fromiter((read(part) for part in parts), np.float64, len(parts))


def _first_extreme(values: np.ndarray, start: float, highest: bool) -> float:
    """What merge() one part at a time leaves (the builtin max or min of start, then the
    values in order, none NaN): the first of equal extremes, so the first zero's sign where
    0.0 and -0.0 tie (start first)."""
    if values.size == 0:
        return start
    found = float(values.max() if highest else values.min())
    if (found <= start) if highest else (found >= start):
        return start
    if found == 0.0:
        found = float(values[np.argmax(values == 0.0)])  # the first zero, with its sign
    return found


def _merged_one_by_one(parts: Sequence[NormAccumulator], into: NormAccumulator) -> NormAccumulator:
    for part in parts:
        into.merge(part)
    return into


def _plain_sum(parts: Sequence[NormAccumulator], into: ScaledSum) -> bool:
    """The parts' sums added in order as plain float64 (see _PLAIN_EXP) into the fresh
    `into`; False, leaving it alone, where that could differ from ScaledSum.add one by one
    (extreme exponents, negative or non-finite terms). Each array is let go as soon as it
    is used (200,000 parts: 1.6 MB each)."""
    mants = np.fromiter((part.sumsq.mant for part in parts), np.float64, len(parts))
    exps = np.fromiter((part.sumsq.exp for part in parts), np.int64, len(parts))
    live = mants != 0
    if mants.size >= 2**100 or not np.all(np.isfinite(mants) & (mants >= 0)):
        return False
    mants, exps = mants[live], exps[live]
    if np.any(np.abs(exps) > _PLAIN_EXP):
        return False
    terms = np.ldexp(mants, exps)
    del mants, exps
    if terms.size:
        total = float(np.cumsum(terms, out=terms)[-1])
        into.mant, into.exp = math.frexp(total)
    return True
