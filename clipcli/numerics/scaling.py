"""The scale factor of a tensor, a group or the whole checkpoint: the one entry point of
clip_by_norm, clip_by_average_norm and clip_by_global_norm's factor (group_factor), and of
--use-norm's (given_norm_factor). --axes has its own entry in slices.py, on the same search.

The formulas are TensorFlow's. Where we differ, on purpose:
- a tensor within its limit is left bit-identical (TF's t*c/c moves it by about 1 ulp);
- the factor is the largest uniform one whose *rounded* output has norm <= C (TF's C/N is
  where the search starts), which makes clipping idempotent: clip(clip(x)) == clip(x).

How the largest factor is found, by the members' dtypes:
- 8- and 16-bit floats: exactly, from the histogram of bit patterns the measuring pass kept
  (NormAccumulator.histogram): the rounded output of any factor is known without a pass;
- float32 (with or without the above): the search runs on a rigorous rounding bound
  (WideBound) computed from the measured norm;
- float64 members only, or factors below 2**-900: TF's factor checked by a pass over the
  rounded output (the caller's OutputSumsq) with a certain bound on its norm, shrunk once
  by the measured overshoot if needed, else the factor the rounding bound guarantees.
A measured norm within its own rounding error of C is decided exactly first, so that a
norm equal to C is left alone and one a hair above it is clipped.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, NamedTuple, Protocol, TypeVar

import numpy as np

from clipcli.dtypes import (
    bits_dtype,
    float64_values,
    mantissa_digits,
    parts_per_element,
    smallest_subnormal,
    smallest_without_zero,
    unit_roundoff,
)
from clipcli.errors import DataRefusedError
from clipcli.numerics.certain import (
    CertainSumsq,
    counted_squares_within,
    counted_terms,
    exact_sum,
)
from clipcli.numerics.norms import CACHE_BLOCK, NormAccumulator, merged
from clipcli.numerics.rounding import narrow_round, rounded_as_float64
from clipcli.numerics.search import (
    AMBIGUOUS,
    U64,
    Margin,
    Narrow,
    exact_product_bits,
    guesses,
    search_factors,
    worst_unit,
)
from clipcli.numerics.widening import widen

# Each float64 dot product of NormAccumulator covers CACHE_BLOCK elements: its sum of
# squares is off by at most that many roundings, the merged blocks by one more each.
_DOT_TERMS = CACHE_BLOCK
# Below this, limit / norm is kept as a mantissa and a power of two (Factor.exponent).
TINY_RATIO = 2.0**-900
# A quotient mantissa * 2**exponent (mantissa in (0.5, 2)) from this exponent up is a
# normal float64.
TINY_EXPONENT = -1021


# ---------------------------------------------------------------- the entry points


class Extent(Protocol):
    """What refuse_unreachable reads of each member: its name, dtype and size."""

    @property
    def name(self) -> str: ...
    @property
    def dtype(self) -> np.dtype[Any]: ...
    @property
    def numel(self) -> int: ...


class Measured(Extent, Protocol):
    """What the factor search reads of each member: a Member, or any record that tells
    the same (the planner's own per-tensor statistics, so that --global over 200,000
    tensors makes no record of each: 19 MB at the clip's peak)."""

    @property
    def stats(self) -> NormAccumulator: ...
    @property
    def rounded_elsewhere(self) -> bool: ...
    @property
    def power_of_two(self) -> bool: ...


# A NamedTuple, not a frozen dataclass: cheaper to make, and as immutable.
class Member(NamedTuple):
    """One tensor that takes part in a factor: what the measuring pass found out."""

    name: str  # for messages
    dtype: np.dtype[Any]
    numel: int
    stats: NormAccumulator  # finished (NormAccumulator.finish), histogram kept if 8/16-bit
    # Its output is not its values rounded to `dtype` (a quantized weight: its stored
    # scales are rounded, each to its own dtype): no bound of `dtype`'s rounding holds, so
    # every factor for a group that holds it is checked by a pass over the output.
    rounded_elsewhere: bool = False
    # Its output takes the factor rounded down to a power of two and is decoded exactly
    # (E8M0 scales: MXFP4): no decoding rounding to leave room for.
    power_of_two: bool = False


@dataclass(frozen=True)
class Factor:
    """Scale by mantissa * 2**exponent (rounding.scale_chunk(chunk, mantissa, exponent));
    the exponent carries factors below float64's range (C / ||t|| under 1e-308)."""

    mantissa: float
    exponent: int = 0


# A pass over members[i] for i in the given indices, each chunk scaled by the factor and
# rounded as the write pass will (rounding.scale_chunk), returning the output's certain sum
# of squares (CertainSumsq). The only reading the search may need; the caller provides it.
OutputSumsq = Callable[[Sequence[int], Factor], CertainSumsq]


def tf_scale(norm: float, limit: float) -> float | None:
    """TF's factor C / max(norm, C); None when the tensor stays as it is."""
    if norm <= limit or norm == 0.0 or math.isinf(limit) or not math.isfinite(norm):
        return None
    return limit / norm


def given_norm_factor(use_norm: float, limit: float) -> Factor | None:
    """--global C --use-norm N: TF's factor C / max(N, C), as given: the quotient rounded
    once to 53 significant bits (exactly float64's C / N wherever that is a normal float64;
    below, the exponent is kept apart rather than losing bits to a subnormal). Each value is
    then rounded once from its exact product with it (rounding.scale_chunk), in every dtype.
    None when nothing changes. Zero tensors stay as they are."""
    if tf_scale(use_norm, limit) is None:
        return None
    limit_fraction, limit_exp = math.frexp(limit)
    norm_fraction, norm_exp = math.frexp(use_norm)
    mantissa = limit_fraction / norm_fraction  # in (0.5, 2): one rounding, never subnormal
    exponent = limit_exp - norm_exp
    if exponent >= TINY_EXPONENT:
        return Factor(math.ldexp(mantissa, exponent))  # exact: a normal float64
    return Factor(mantissa, exponent)


def group_factor(
    members: Sequence[Measured],
    limit: float,
    output_sumsq: OutputSumsq,
    exact_limit: Fraction | None = None,
    over_exactly: bool = False,
) -> Factor | None:
    """The largest uniform factor whose rounded output, over all members together, has
    norm <= limit; None to leave them as they are (within the limit, a zero norm, C = inf).
    Apply it to the members whose norm is nonzero: a zero tensor stays bit-identical.
    DataRefusedError (exit 4) when no factor can reach the limit (a dtype without zero).
    over_exactly: the members' measured norm is within rounding error of the limit and
    already known, exactly, to be over it (each_factor decides such ties together)."""
    together = merged([member.stats for member in members])
    ratio = together.limit_ratio(limit)
    if together.sumsq.mant == 0.0 or math.isinf(limit) or ratio > 1 + AMBIGUOUS:
        return None
    live_members = [m for m in members if m.stats.sumsq.mant != 0.0]
    if abs(ratio - 1) <= AMBIGUOUS:
        # The measured norm is within its own rounding error of C: decide exactly, so that
        # a norm equal to C is left alone and one a hair above it is clipped.
        # exact_limit: the limit as a real number when the float `limit` is its rounding
        # down (--average's C * n): a norm between the two is within, so kept.
        within = exact_limit if exact_limit is not None else Fraction(limit)
        if not over_exactly and _within_exactly(_live(members), members, within, output_sumsq):
            return None
        ratio = min(ratio, 1 - U64)
    elif not ratio < 1.0:
        return None
    # Over the limit (exactly, where it was close): a member at the least norm its dtype
    # allows, equal to the limit, is within it and kept, not refused.
    refuse_unreachable(live_members, limit)
    # Each dtype once, in order (what is asked of them is a max, any or all: a list of
    # 200,000 was ~2 MB of the plan's heap).
    dtypes = list(dict.fromkeys(m.dtype for m in live_members))
    if (
        ratio < TINY_RATIO
        or all(mantissa_digits(d) == 53 for d in dtypes)
        or any(m.rounded_elsewhere for m in live_members)
    ):
        factor = _verified_factor(_live(members), members, together, limit, output_sumsq)
    else:
        chosen = _histogram_factor(
            limit, ratio, _histograms(live_members), _wide_bound(live_members, limit), dtypes
        )
        assert chosen is not None
        factor = Factor(chosen)
    if factor.mantissa == 0 and any(smallest_without_zero(d) for d in dtypes):
        refuse_unreachable(live_members, 0.0)  # never round a zero-less dtype by 0 (NaN)
    return factor


# each_factor searches this many problems at a time: their records and the search's arrays
# stay small (200,000 at once raised a clip's peak by ~45 MB), and a search over a block
# costs ~60 numpy calls whatever its size.
EACH_BLOCK = 4096

AnyMeasured = TypeVar("AnyMeasured", bound=Measured)
# One factor search: the members scaled together, the limit (the float their output is
# scaled to) and the exact limit group_factor decides by (None: the limit itself).
Problem = tuple[Sequence[AnyMeasured], float, Fraction | None]


def each_factor(
    problems: Iterable[Problem[AnyMeasured]],
    output_sumsq_of: Callable[[Sequence[AnyMeasured]], OutputSumsq],
    stored_sumsq_each: StoredSumsqEach[AnyMeasured] | None = None,
    between: Callable[[], None] = lambda: None,
) -> Iterator[Factor | None]:
    """group_factor(members, limit, output_sumsq_of(members), exact) of each problem, in
    order: the same factors bit for bit. --norm and --average have a problem per tensor,
    --group-by one per group. `between` is called between pieces of work (a search, a
    batch, a part of the histograms): the caller acts on signals there (1,500 float16
    tensors of 65,536 values held a SIGTERM for 20 s of searching: attack s38).

    The problems whose search runs on the rounding bound alone (no member with a histogram
    or rounded elsewhere, not float64 only, clearly over their limit) are searched
    together, one problem each, in one search_factors call per block of EACH_BLOCK and set
    of dtypes: a bisection of thousands of problems at once rather than one of ~100 us for
    each (200,000 one-element tensors). Given stored_sumsq_each (the sums of squares of
    many groups of members as stored, in one go), the block's ties (a measured norm within
    rounding error of its limit: a clipped checkpoint clipped again) are decided together
    too, instead of by a pass each (~50 us a small tensor)."""
    digits: dict[np.dtype[Any], int] = {}  # by dtype: _bound_digits
    queue = iter(problems)
    while block := list(itertools.islice(queue, EACH_BLOCK)):
        factors: list[Factor | None] = [None] * len(block)
        together: dict[frozenset[np.dtype[Any]], _Batch] = {}  # by the live members' dtypes
        counted: dict[np.dtype[Any], _HistogramBatch] = {}  # by their one dtype
        ties: list[int] = []  # places
        for place, (members, limit, exact) in enumerate(block):
            searched = _bounded_search(members, limit, digits)
            if searched is _LEFT_ALONE:
                continue
            if searched is _TIE and stored_sumsq_each is not None:
                ties.append(place)
                continue
            if isinstance(searched, _OnBound):
                batch = together.setdefault(searched.dtypes, _Batch([], [], [], [], []))
                batch.places.append(place)
                batch.ratios.append(searched.ratio)
                batch.wide_ratios.append(searched.wide_ratio)
                batch.numels.append(searched.numel)
                batch.limits.append(limit)
                continue
            if isinstance(searched, _OnHistograms):
                histograms = counted.setdefault(searched.dtype, _HistogramBatch([], [], [], []))
                histograms.places.append(place)
                histograms.ratios.append(searched.ratio)
                histograms.limits.append(limit)
                histograms.histograms.append(searched.histograms)
                continue
            factors[place] = group_factor(members, limit, output_sumsq_of(members), exact)
            between()
        for dtypes, batch in together.items():
            found = _bound_factors(batch, dtypes)
            for place, factor in zip(batch.places, found.tolist(), strict=True):
                factors[place] = Factor(factor)
            between()
        for dtype, histograms in counted.items():
            for part in _by_values(histograms):
                found = _histogram_factors(part, dtype)
                for place, factor in zip(part.places, found.tolist(), strict=True):
                    factors[place] = Factor(factor)
                between()
        if ties:
            assert stored_sumsq_each is not None
            tied = [block[place] for place in ties]
            for place, within in zip(
                ties, _each_within_exactly(tied, stored_sumsq_each), strict=True
            ):
                if not within:  # a hair over: searched as group_factor searches it
                    members, limit, exact = block[place]
                    output_sumsq = output_sumsq_of(members)
                    factors[place] = group_factor(members, limit, output_sumsq, exact, True)
                    between()
        yield from factors


# The sums of squares of groups of members, each group's values as stored (rounded by a
# factor of 1), with a certain error bound: one CertainSumsq per group, in order, in one
# go (small tensors read many at a time).
StoredSumsqEach = Callable[[Sequence[Sequence[AnyMeasured]]], list[CertainSumsq]]


def _each_within_exactly(
    problems: Sequence[Problem[AnyMeasured]], stored_sumsq_each: StoredSumsqEach[AnyMeasured]
) -> list[bool]:
    """group_factor's exact decision of each tie (_within_exactly), the passes over the
    members without histograms made in one go."""
    lives = [_live(members) for members, _, _ in problems]
    wide = [
        [members[i] for i in live if members[i].stats.histogram is None]
        for live, (members, _, _) in zip(lives, problems, strict=True)
    ]
    sums = stored_sumsq_each(wide)
    decided = []
    for live, check, (members, limit, exact) in zip(lives, sums, problems, strict=True):
        check.total += _histogram_sumsq(live, members)
        decided.append(check.at_most(exact if exact is not None else Fraction(limit)))
    return decided


class _Batch(NamedTuple):
    """The problems of a block searched together, one entry each."""

    places: list[int]  # in the block
    ratios: list[float]  # limit / norm of the members (group_factor's ratio)
    wide_ratios: list[float]  # limit / norm of the live members (its WideBound's)
    numels: list[int]  # values the live members round (_rounded_values)
    limits: list[float]


class _HistogramBatch(NamedTuple):
    """The problems of a block whose members are all 8- or 16-bit floats of one dtype,
    searched together on their histograms, one entry each."""

    places: list[int]  # in the block
    ratios: list[float]  # limit / norm (group_factor's ratio)
    limits: list[float]
    histograms: list[list[tuple[np.ndarray, np.ndarray]]]  # of the live members


class _OnBound(NamedTuple):
    ratio: float
    wide_ratio: float
    numel: int
    dtypes: frozenset[np.dtype[Any]]


class _OnHistograms(NamedTuple):
    ratio: float
    dtype: np.dtype[Any]
    histograms: list[tuple[np.ndarray, np.ndarray]]


_LEFT_ALONE = "left alone"
_TIE = "a tie"


def decided_without_output(members: Sequence[Measured], limit: float) -> bool:
    """Whether each_factor (given no stored_sumsq_each) decides the problem (members,
    limit) without asking for an output's sum of squares: left alone, or searched in a
    batch on the rounding bound or on histograms."""
    searched = _bounded_search(members, limit, {})
    return searched is _LEFT_ALONE or isinstance(searched, _OnBound | _OnHistograms)


def _bounded_search(
    members: Sequence[Measured], limit: float, digits: dict[np.dtype[Any], int]
) -> _OnBound | _OnHistograms | str | None:
    """What group_factor(members, limit, ...) would do, where it needs no pass: _LEFT_ALONE
    (within the limit, a zero norm); _OnBound, a search on the rounding bound alone
    (_bound_factors); _OnHistograms, the exact search on the histograms of members of one
    8- or 16-bit dtype (_histogram_factors); _TIE, a measured norm within rounding error
    of the limit (decided exactly); None for the rest (group_factor itself).
    `digits`: _bound_digits of each dtype met so far."""
    kept = 0  # members with a histogram
    for member in members:
        dtype = member.dtype
        if dtype not in digits:
            digits[dtype] = _bound_digits(dtype)
        if not digits[dtype] or member.rounded_elsewhere or member.power_of_two:
            return None
        kept += member.stats.histogram is not None
    if kept not in (0, len(members)) or math.isinf(limit):
        return None  # members with histograms beside others: group_factor
    together = merged([member.stats for member in members])
    ratio = together.limit_ratio(limit)
    if together.sumsq.mant == 0.0 or ratio > 1 + AMBIGUOUS:
        return _LEFT_ALONE
    if abs(ratio - 1) <= AMBIGUOUS:
        return _TIE  # decided exactly: by a pass over the members without histograms
    if not TINY_RATIO <= ratio < 1.0:
        return None  # verified by a pass
    if len(members) == 1:  # --norm, --average: live, since its norm is not zero
        live: Sequence[Measured] = members
        wide = together
    else:
        live = [member for member in members if member.stats.sumsq.mant != 0.0]
        # group_factor's WideBound is of the live members: the same merge if all are
        wide = together if len(live) == len(members) else merged([m.stats for m in live])
    dtypes = frozenset(member.dtype for member in live)
    if kept:
        if len(dtypes) != 1:
            return None
        histograms = [m.stats.histogram for m in live]
        return _OnHistograms(ratio, next(iter(dtypes)), histograms)  # type: ignore[arg-type]
    if all(digits[dtype] == 53 for dtype in dtypes):
        return None  # float64 only: verified by a pass
    return _OnBound(ratio, wide.limit_ratio(limit), _rounded_values(live), dtypes)


def _bound_digits(dtype: np.dtype[Any]) -> int:
    """The significant bits of a dtype that group_factor may search on the rounding
    bound; 0 for a dtype without zero (which group_factor may refuse)."""
    return mantissa_digits(dtype) if smallest_without_zero(dtype) is None else 0


def _bound_factors(batch: _Batch, dtypes: frozenset[np.dtype[Any]]) -> np.ndarray:
    """The factors _histogram_factor finds for problems without histograms, one problem
    per entry of the batch: the margin of _HistogramBound with a WideBound alone."""
    numel = np.asarray(batch.numels, np.int64)
    limit = np.asarray(batch.limits, np.float64)
    bound_ratio = _bound_ratio(np.asarray(batch.wide_ratios, np.float64), numel)
    unit = max(unit_roundoff(dtype) for dtype in dtypes)
    step = max(smallest_subnormal(dtype) for dtype in dtypes)

    def margin(scales: np.ndarray) -> np.ndarray:
        norms = _relative_norm(scales, bound_ratio, unit, step, numel, limit)
        with np.errstate(over="ignore"):
            upper = (norms * norms) * (1 + 4 * U64)
        result: np.ndarray = 1.0 - 2 * U64 - upper
        return result

    ratio = np.asarray(batch.ratios, np.float64)
    lows, highs = guesses(ratio, worst_unit(list(dtypes)), fine=True)
    return search_factors(margin, lows, highs, exact_product_bits(list(dtypes)))


# _histogram_factors searches the problems of a batch this many distinct values at a time:
# its float64 arrays (a dozen, one entry a value) stay ~0.5 MB each, where a block of 4,096
# tensors of 64 values raised a clip's peak by 11 MB.
HISTOGRAM_VALUES_AT_ONCE = 1 << 16


def _by_values(batch: _HistogramBatch) -> Iterator[_HistogramBatch]:
    """The batch in parts of at most HISTOGRAM_VALUES_AT_ONCE values (a problem with more
    is a part of its own), in order."""
    start, values = 0, 0
    for k, histograms in enumerate(batch.histograms):
        size = sum(bits.size for bits, _ in histograms)
        if values and values + size > HISTOGRAM_VALUES_AT_ONCE:
            yield _part_of(batch, start, k)
            start, values = k, 0
        values += size
    if start < len(batch.places):
        yield _part_of(batch, start, len(batch.places))


def _part_of(batch: _HistogramBatch, start: int, stop: int) -> _HistogramBatch:
    return _HistogramBatch(
        batch.places[start:stop],
        batch.ratios[start:stop],
        batch.limits[start:stop],
        batch.histograms[start:stop],
    )


def _histogram_factors(batch: _HistogramBatch, dtype: np.dtype[Any]) -> np.ndarray:
    """The factors _histogram_factor finds for problems whose members are all of one 8-
    or 16-bit dtype, one problem per entry: the largest factor on the search's grid whose
    rounded output has an exact norm <= the limit. That factor is defined by the data
    alone, so this search (every problem's sums at once, no narrowing) finds the one
    _HistogramBound finds: each margin is certain outside a band around zero and decided
    exactly within it (counted_squares_within), as there."""
    table = float64_values(dtype)
    values_of, counts_of = [], []
    for histograms in batch.histograms:
        values_of.append(np.concatenate([table[bits] for bits, _ in histograms]))
        counts_of.append(np.concatenate([counts for _, counts in histograms]))
    lengths = np.fromiter((v.size for v in values_of), np.int64, len(values_of))
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    values = np.concatenate(values_of)
    counts = np.concatenate(counts_of).astype(np.float64)
    limit = np.asarray(batch.limits, np.float64)
    each_limit = np.repeat(limit, lengths)
    terms = lengths.astype(np.float64)  # the float64 sums' error bound, as _HistogramBound's
    del values_of, counts_of

    def margin(scales: np.ndarray) -> np.ndarray:
        rounded = rounded_as_float64(values * np.repeat(scales, lengths), dtype)
        with np.errstate(over="ignore"):  # inf: over the limit, as _HistogramBound's
            scaled = rounded / each_limit
            total = np.add.reduceat(counts * (scaled * scaled), starts)
            result: np.ndarray = 1.0 - 2 * U64 - _summed_upper(total, terms)
        for p in np.flatnonzero(_undecided(result, terms)).tolist():
            part = slice(int(starts[p]), int(starts[p] + lengths[p]))
            within = counted_squares_within(rounded[part], counts[part], float(limit[p]))
            result[p] = _decided(result[p], within)
        return result

    ratio = np.asarray(batch.ratios, np.float64)
    lows, highs = guesses(ratio, worst_unit([dtype]), fine=True)
    return search_factors(margin, lows, highs, exact_product_bits([dtype]))


# ---------------------------------------------------------------- the steps


def _live(members: Sequence[Measured]) -> list[int]:
    """The positions of the members whose norm is nonzero: made only on the paths that
    need positions (a list of 200,000 ints was ~7 MB of the plan's heap)."""
    return [i for i, m in enumerate(members) if m.stats.sumsq.mant != 0.0]


def refuse_unreachable(members: Sequence[Extent], limit: float) -> None:
    """A dtype with no zero (float8_e8m0fnu: powers of two only) cannot scale below its
    smallest value: when even that gives a norm over the limit, no factor works, and the
    rounding would write NaN. Refused (exit 4), as for value bounds no value can meet."""
    floor = Fraction(0)
    zeroless = []
    least = math.inf  # the smallest value of the zero-less members' dtypes, for the message
    for member in members:
        smallest = smallest_without_zero(member.dtype)
        if smallest is not None:
            floor += Fraction(smallest) ** 2 * member.numel
            zeroless.append(member.name)
            least = min(least, smallest)
    # At the floor itself the search has no room (every factor below the first change
    # gives the floor): refuse there too, with a hair of margin, rather than write NaN.
    if zeroless and floor * (1 + Fraction(1, 2**20)) >= Fraction(limit) ** 2:
        names = ", ".join(repr(name) for name in zeroless[:3])
        more = f" and {len(zeroless) - 3} more" if len(zeroless) > 3 else ""
        raise DataRefusedError(
            f"{names}{more}: a dtype without zero (every value at least its smallest, "
            f"{least:g}) cannot be scaled to a norm of {limit:g}: the least it can reach "
            f"is {math.sqrt(floor):g}; choose a larger limit or exclude these tensors"
        )


def _within_exactly(
    live: Sequence[int], members: Sequence[Measured], limit: Fraction, output_sumsq: OutputSumsq
) -> bool:
    """Whether the norm of the live members together is <= limit: exact over histograms
    (as fractions), with a certain bound over the rest (one more pass over those)."""
    wide = [i for i in live if members[i].stats.histogram is None]
    check = output_sumsq(wide, Factor(1.0))
    check.total += _histogram_sumsq(live, members)
    return check.at_most(limit)


def _histogram_sumsq(live: Sequence[int], members: Sequence[Measured]) -> Fraction:
    """The exact sum of squares of the live members with histograms: counts times squares
    as exact float64 terms (counted_terms), added exactly (exact_sum). A fraction per
    value took a second per 65,536 distinct values, and a signal waited for the end of a
    run of float16 ties (attack s37b: 60-80 s)."""
    values, counts = [], []
    for i in live:
        histogram = members[i].stats.histogram
        if histogram is not None:
            values.append(float64_values(members[i].dtype)[histogram[0]])
            counts.append(histogram[1])
    if not values:
        return Fraction(0)
    low, high = counted_terms(np.concatenate(values), np.concatenate(counts).astype(np.float64))
    return exact_sum(low if high is None else np.concatenate([low, high]))


def _histograms(members: Sequence[Measured]) -> list[Histogram]:
    """The 8- and 16-bit members' bit-pattern counts, one histogram per dtype."""
    by_dtype: dict[np.dtype[Any], list[tuple[np.ndarray, np.ndarray]]] = {}
    for member in members:
        if member.stats.histogram is not None:
            by_dtype.setdefault(member.dtype, []).append(member.stats.histogram)
    result = []
    for dtype, parts in by_dtype.items():
        bits = np.concatenate([p[0] for p in parts])
        counts = np.concatenate([p[1] for p in parts]).astype(np.float64)
        total = np.bincount(bits, weights=counts, minlength=256**dtype.itemsize)
        present = np.flatnonzero(total != 0)  # a bool array first: ~7x faster
        values = float64_values(dtype)[present]
        result.append(Histogram(dtype, values, total[present]))
    return result


def _wide_bound(members: Sequence[Measured], limit: float) -> WideBound | None:
    """The rounding bound for the float32/float64/complex members (no histogram)."""
    wide = [m for m in members if m.stats.histogram is None]
    if not wide:
        return None
    ratio = merged([m.stats for m in wide]).limit_ratio(limit)
    return WideBound.of(ratio, list(dict.fromkeys(m.dtype for m in wide)), _rounded_values(wide))


def _rounded_values(members: Sequence[Measured]) -> int:
    """How many values the members' output rounds, each on its own: two per complex
    element (its parts round apart: a complex64 tensor of subnormals was bounded as if
    each element moved by half a step, not by half a step in each part, and written over
    its limit; attack s36)."""
    return sum(m.numel * parts_per_element(m.dtype) for m in members)


def _verified_factor(
    live: Sequence[int],
    members: Sequence[Measured],
    together: NormAccumulator,
    limit: float,
    output_sumsq: OutputSumsq,
) -> Factor:
    """float64, members rounded elsewhere (Member.rounded_elsewhere) and factors below
    2**-900: TF's
    factor, checked by a pass over the rounded output with a certain bound on its norm
    (CertainSumsq), then moved as the checks say (_apart_factor), or shrunk by the
    measured overshoot once, else the factor the rounding bound guarantees. Only a factor
    whose check passed is returned."""
    live_members = [members[i] for i in live]
    apart = any(m.rounded_elsewhere for m in live_members)
    # A member rounded apart may be decoded with one rounding per value (NVFP4's division
    # by its global scale, relative error <= 2**-53): checked against a hair less than C,
    # its exact values stay within C.
    # Power-of-two members decode exactly: a group of those alone is checked against C.
    inexact = any(m.rounded_elsewhere and not m.power_of_two for m in live_members)
    target = Fraction(limit) * (1 - Fraction(1, 2**50)) if inexact else Fraction(limit)

    def checked(mantissa: float, exponent: int) -> tuple[bool, float]:
        """Whether the rounded output is certainly within, and its norm / limit."""
        check = output_sumsq(live, Factor(mantissa, exponent))
        return check.at_most(target), check.over(limit)

    ratio = together.limit_ratio(limit)
    if ratio >= TINY_RATIO:
        mantissa, exponent = ratio, 0
    else:
        mantissa, exponent = together.limit_ratio_parts(limit)
    if apart:
        unit = max(COARSEST_SCALE_UNIT, *(unit_roundoff(m.dtype) for m in live_members))
        found = _apart_factor(mantissa, exponent, unit, checked)
        if found is not None:
            return Factor(found, exponent)
        return _shrinking(mantissa, exponent, checked, limit)
    first = mantissa
    for _ in range(2):
        ok, over = checked(mantissa, exponent)
        if ok:
            return Factor(mantissa, exponent)
        if not math.isfinite(over) or over <= 0:
            break
        mantissa = mantissa / over * (1 - 2.0**-51)
    bound = WideBound.of(1.0, [members[i].dtype for i in live], together.numel)
    headroom = 1 - math.sqrt(bound.numel) * bound.step / 2 / limit
    safe = first * bound.ratio * max(headroom, 0.0) / (1 + bound.unit) * (1 - 2.0**-50)
    if checked(safe, exponent)[0]:
        return Factor(safe, exponent)
    return _shrinking(safe, exponent, checked, limit)


# Checks one factor (mantissa, exponent) by a pass over the rounded output: whether its
# norm is certainly within the limit, and norm / limit.
Checked = Callable[[float, int], tuple[bool, float]]


def _shrinking(mantissa: float, exponent: int, checked: Checked, limit: float) -> Factor:
    """The last resort: shrink with margins wider than any dtype's rounding (a quantized
    weight's scales falling to subnormals, clipcli.logical), each one verified, never
    returning an unchecked factor."""
    for margin in (2.0**-40, 2.0**-22, 2.0**-16, 2.0**-12, 2.0**-10, 2.0**-8, 2.0**-6, 2.0**-3):
        _, over = checked(mantissa, exponent)
        if math.isfinite(over) and over > 0:
            mantissa = mantissa / max(over, 1.0) * (1 - margin)
        else:
            mantissa *= 1 - margin
        if checked(mantissa, exponent)[0]:
            return Factor(mantissa, exponent)
    raise DataRefusedError(f"no factor found whose rounded output stays within the limit {limit:g}")


# The largest unit roundoff of a stored scale a factor is rounded in: fp8 e4m3's (NVFP4's
# block scales, 3 mantissa bits); bfloat16, float16 and float32 scales round finer.
COARSEST_SCALE_UNIT = 2.0**-4

# Verified passes spent on a group with members rounded elsewhere (a quantized weight's
# scales): the rounding of every scale moves with the factor, so no bound makes the search
# exact; each pass is a certain check of what the write pass will make of one factor.
APART_PASSES = 10
# Margins below the measured overshoot, one more per check still over: as fine as a
# float32 scale's rounding first, as coarse as an fp8 one's last (never below the bound
# first / (1 + u), which holds unless scales fall to subnormals).
APART_MARGINS = (2.0**-50, 2.0**-30, 2.0**-22, 2.0**-16, 2.0**-12, 2.0**-8, 2.0**-5, 2.0**-3)


def _apart_factor(first: float, exponent: int, unit: float, checked: Checked) -> float | None:
    """The largest factor found within the limit in APART_PASSES checks, from TF's
    `first`: moved by the measured norm / limit while every check is on one side (by at
    most 1 + u, the rounding unit: round(f * s) is within f * s * (1 + u) for normal
    results), then halving the gap between a factor within and one over. None when no
    check passed (scales falling to subnormals: _shrinking takes over)."""
    low, high = 0.0, math.inf  # the largest factor within, the least over
    guess = first
    misses = 0  # checks over the limit before one within
    for _ in range(APART_PASSES):
        ok, over = checked(guess, exponent)
        if ok:
            low = guess
        else:
            high = guess
        measured = over if math.isfinite(over) and over > 0 else None
        if math.isinf(high):  # none over yet: up by the room measured
            step = min(1 / measured, 1 + unit) if measured is not None else 1 + unit
            following = low * step * (1 + 2.0**-52)
        elif low == 0.0:  # none within yet: down by the overshoot and a growing margin
            step = max(measured, 1.0) if measured is not None else 1 + unit
            margin = APART_MARGINS[min(misses, len(APART_MARGINS) - 1)]
            following = max(high / step * (1 - margin), first / (1 + unit) * (1 - 2.0**-50))
            if following >= high:  # the rounding bound itself was over: subnormal scales
                following = high * (1 - margin)
            misses += 1
        else:
            following = low + (high - low) / 2
        if not low < following < high:
            break
        guess = following
    return low if low > 0.0 else None


# ---------------------------------------------------------------- margins for the search


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
        return WideBound(
            _bound_ratio(stats_norm_ratio, numel),
            max(unit_roundoff(d) for d in dtypes),
            max(smallest_subnormal(d) for d in dtypes),
            numel,
        )

    def relative_norm(self, scales: np.ndarray, limit: float) -> np.ndarray:
        """An upper bound of ||round(s*x)|| / limit for each factor s."""
        return _relative_norm(scales, self.ratio, self.unit, self.step, self.numel, limit)


def _relative_norm(
    scales: np.ndarray,
    ratio: float | np.ndarray,
    unit: float,
    step: float,
    numel: int | np.ndarray,
    limit: float | np.ndarray,
) -> np.ndarray:
    """WideBound.relative_norm, for one group or for many at once (each_factor: ratio,
    numel and limit one per member); the same operations in the same order either way, so
    the same bits."""
    with np.errstate(over="ignore"):
        root = np.sqrt(np.asarray(numel, np.float64))
        rel: np.ndarray = scales / ratio * (1 + unit) + root * (step / 2 / limit)
    return (rel * (1 + 4 * U64)).astype(np.float64)


def _bound_ratio(ratio: float | np.ndarray, numel: int | np.ndarray) -> Any:
    """limit / (an upper bound of the exact norm) from limit / (the measured norm): the
    measured norm's own error is at most one rounding per term of each dot product of up
    to _DOT_TERMS squares, and one per block merged after (rigorous, if pessimistic)."""
    error = (_DOT_TERMS + numel // _DOT_TERMS + 8) * U64
    return ratio * (1 - error)


@dataclass(frozen=True)
class Histogram:
    """How often each finite nonzero value of an 8- or 16-bit float occurs."""

    dtype: np.dtype[Any]
    values: np.ndarray  # float64, exact
    counts: np.ndarray  # float64 (exact below 2**53)


@dataclass(frozen=True)
class _HistogramBound:
    """margin(s) for one group: exact over its histograms, the rounding bound over its
    wide members; and next_change(s), a lower bound of the smallest factor above s at which
    any histogram value's rounded product changes (the product reaching the midpoint to the
    next larger magnitude). within(low, high) is the same for factors in [low, high] only:
    values whose rounded product is the same at both ends (monotone: the same all through)
    are summed once into `fixed`, and each later step rounds the few others alone.

    Without wide members, a margin close enough to 0 for the float64 sums' rounding to
    decide its sign is decided exactly over the whole histograms (`whole`), as each
    slice's is with --axes (slices._SliceRounding): the factor is the largest on the
    search's grid whose output's exact norm is <= limit, ties included ([6, 8] in float16
    at C = 5 is written [3, 4], not [3, 3.998])."""

    limit: float
    histograms: tuple[Histogram, ...]
    wide: WideBound | None
    terms: int  # distinct values in the whole group: the float64 sum's error bound
    whole: tuple[Histogram, ...]  # the histograms before any narrowing
    fixed: float = 0.0  # sum of count * (round(v * s) / limit)**2 over settled values
    recent: dict[tuple[int, float], np.ndarray] = field(default_factory=dict, compare=False)
    # Exact decisions by the output they were made on: a bisection near a tie probes many
    # factors that round to one same output (attack s33num: 23 exact sums of 100,000
    # terms for one tensor, most of them repeats). Within a narrowing the settled values
    # round the same way throughout, so the moving values' roundings name the output.
    decided: dict[bytes, bool] = field(default_factory=dict, compare=False)
    # The same by the whole output, shared by every narrowing of the search.
    decided_whole: dict[bytes, bool] = field(default_factory=dict, compare=False)

    def margin(self, scales: np.ndarray) -> np.ndarray:
        s = float(scales[0])
        total = self.fixed
        for hist in self.histograms:
            # np.sum, not a BLAS dot: that spins up threads, 1.5 ms for 30,000 terms.
            with np.errstate(over="ignore"):  # inf: over the limit
                total += float(np.sum(hist.counts * self._squares(hist, s)))
        upper = _summed_upper(total, self.terms)
        if self.wide is not None:
            w = float(self.wide.relative_norm(np.asarray([s]), self.limit)[0])
            upper = (upper + w * w) * (1 + 4 * U64)
        result = 1.0 - 2 * U64 - upper
        # fixed and the moving values' sums add the terms in another order than the whole
        # histograms: within this band either sign is possible, so it is decided exactly.
        if self.wide is None and _undecided(result, self.terms):
            result = _decided(result, self._exactly_within(s))
        return np.asarray([result])

    def _exactly_within(self, s: float) -> bool:
        """Whether the output of factor s over the whole histograms has norm <= limit."""
        key = b"".join(self._rounded(hist, s).tobytes() for hist in self.histograms)
        known = self.decided.get(key)
        if known is None:
            rounded = np.concatenate([self._rounded(hist, s) for hist in self.whole])
            whole_key = rounded.tobytes()
            known = self.decided_whole.get(whole_key)
            if known is None:
                counts = np.concatenate([h.counts for h in self.whole])
                known = counted_squares_within(rounded, counts, self.limit)
                _remember(self.decided_whole, whole_key, known)
            _remember(self.decided, key, known)
        return known

    def _squares(self, hist: Histogram, s: float) -> np.ndarray:
        # Outputs far over a tiny limit overflow to inf: a margin of -inf, never a warning
        # (attack s36: C = 1e-118 printed "overflow encountered in multiply").
        with np.errstate(over="ignore"):
            rounded = self._rounded(hist, s) / self.limit
            squares: np.ndarray = rounded * rounded
        return squares

    def _rounded(self, hist: Histogram, s: float) -> np.ndarray:
        """round(v * s) for the histogram's values, as float64; the last few are kept, so
        that within() reuses the roundings at the bracket's ends."""
        key = (id(hist), s)
        rounded = self.recent.get(key)
        if rounded is None:
            rounded = rounded_as_float64(hist.values * s, hist.dtype)
            if len(self.recent) >= 8:
                del self.recent[next(iter(self.recent))]
            self.recent[key] = rounded
        return rounded

    def next_change(self, scales: np.ndarray) -> np.ndarray:
        s = float(scales[0])
        first = math.inf
        for hist in self.histograms:
            if not hist.values.size:
                continue
            magnitudes = np.abs(hist.values)
            rounded = narrow_round(magnitudes * s, hist.dtype)
            uint = bits_dtype(hist.dtype)
            up = (rounded.view(uint) + np.asarray(1, uint)).view(hist.dtype)
            with np.errstate(all="ignore"):
                here, there = widen(rounded), widen(up)
                there = np.where(np.isfinite(there) & (there > here), there, np.inf)
                crossing = (here + there) / 2 / magnitudes
            first = min(first, float(np.min(crossing)) * (1 - 4 * U64))
        return np.asarray([first])

    def within(self, low: np.ndarray, high: np.ndarray) -> tuple[Margin, Margin | None, Narrow]:
        s_low, s_high = float(low[0]), float(high[0])
        fixed = self.fixed
        moving = []
        for hist in self.histograms:
            at_low, at_high = self._rounded(hist, s_low), self._rounded(hist, s_high)
            settled = at_low == at_high
            with np.errstate(over="ignore"):  # inf: over the limit, as in margin
                rounded = at_low[settled] / self.limit
                fixed += float(np.sum(hist.counts[settled] * (rounded * rounded)))
            moving.append(Histogram(hist.dtype, hist.values[~settled], hist.counts[~settled]))
        narrowed = _HistogramBound(
            self.limit,
            tuple(moving),
            self.wide,
            self.terms,
            self.whole,
            fixed,
            decided_whole=self.decided_whole,
        )
        changes = narrowed.next_change if self.wide is None else None
        return narrowed.margin, changes, narrowed.within


# The margin rule of both histogram searches (_HistogramBound and _histogram_factors): for
# a float64 total (a float, or one per problem) of `terms` counted squares.


def _summed_upper(total: Any, terms: Any) -> Any:
    """An upper bound of the exact sum: the float64 sum errs by at most (terms + 3)
    roundings of its total."""
    return total * (1 + (terms + 4) * U64)


def _undecided(margin: Any, terms: Any) -> Any:
    """Whether the margin is so near zero that either sign is possible: then decided
    exactly (counted_squares_within)."""
    return abs(margin) <= 4 * (terms + 8) * U64


def _decided(margin: float, within: bool) -> float:
    """An undecided margin given the sign the exact decision says."""
    return max(margin, 0.0) if within else min(margin, -U64 * U64)


def _remember(decided: dict[bytes, bool], key: bytes, fits: bool) -> None:
    """Keep a decision, and at most the 8 latest (each key is an output's bytes)."""
    if len(decided) >= 8:
        del decided[next(iter(decided))]
    decided[key] = fits


def _histogram_factor(
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
    terms = sum(hist.values.size for hist in histograms)
    bound = _HistogramBound(limit, tuple(histograms), wide, terms, tuple(histograms))
    lows, highs = guesses(np.asarray([ratio]), worst_unit(dtypes), fine=True)
    changes = bound.next_change if wide is None and histograms else None
    narrow = bound.within if histograms else None
    factors = search_factors(bound.margin, lows, highs, bits, next_change=changes, narrow=narrow)
    return float(factors[0])
