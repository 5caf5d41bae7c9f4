"""The factor search: one uniform scale for a tensor, a group or the whole checkpoint.

The factor is the largest one whose rounded output has norm <= C (DESIGN.md section 2).
For 8- and 16-bit floats the measuring pass's bit-pattern histograms make the search
exact without reading data again; for float32 and wider, the limit is decided or the
factor verified by a pass over the data, which the caller supplies as an OutputCheck
(clipcli.pipeline reads the file; a unit test may use arrays in memory). The pure
arithmetic is clipcli.numerics.scaling's; this module only strings the steps together.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np

from clipcli.errors import DataRefusedError
from clipcli.formats.base import TensorInfo
from clipcli.measurement import TensorStats
from clipcli.numerics import lookup
from clipcli.numerics import scaling as clipping
from clipcli.numerics.norms import CertainSumsq, NormAccumulator

# The sum of squares of these tensors with every value scaled by mantissa * 2**exponent
# and rounded to its dtype, with a certain error bound.
OutputCheck = Callable[[Sequence[TensorInfo], float, int], CertainSumsq]


@dataclass(frozen=True)
class Factor:
    """mantissa * 2**exponent (the exponent is nonzero only for ratios below 1e-300)."""

    mantissa: float
    exponent: int = 0


def search_factor(
    members: Sequence[TensorStats], limit: float, check: OutputCheck
) -> Factor | None:
    """The factor for `members` together, None when they are within the limit already.
    It applies to the members with a nonzero sum of squares only: a zero tensor is left
    bit-identical. Refuses (exit 4) a limit that a dtype without zero cannot reach."""
    together = NormAccumulator()
    for member in members:
        together.merge(member.stats)
    ratio = together.limit_ratio(limit)
    if together.ssq == 0.0 or math.isinf(limit) or ratio > 1 + clipping.AMBIGUOUS:
        return None
    live = [m for m in members if m.stats.ssq > 0]
    refuse_unreachable([m.info for m in live], limit)
    if abs(ratio - 1) <= clipping.AMBIGUOUS:
        # The measured norm is within its own rounding error of C: decide exactly, so that
        # a norm equal to C is left alone and one a hair above it is clipped.
        if within_exactly(live, limit, check):
            return None
        ratio = min(ratio, 1 - 2.0**-53)
    elif not ratio < 1.0:
        return None
    dtypes = [m.info.dtype for m in live]
    if ratio < clipping.TINY_RATIO or all(clipping.mantissa_digits(d) == 53 for d in dtypes):
        factor = _verified_factor(live, together, limit, check)
    else:
        chosen = clipping.choose_factor(
            limit, ratio, _histograms(live), _wide_bound(live, limit), dtypes
        )
        assert chosen is not None
        factor = Factor(chosen)
    if factor.mantissa == 0 and any(clipping.smallest_without_zero(d) for d in dtypes):
        refuse_unreachable([m.info for m in live], 0.0)  # never round a zero-less dtype by 0
    return factor


def tf_factor(use_norm: float, limit: float, dtypes: Sequence[np.dtype[Any]]) -> Factor | None:
    """--use-norm: TF's factor C / N to as many bits as keep every product exact, so that
    each value is rounded once (below 2**-29 relative for float32, 2**-42 for float16)."""
    scale = clipping.tf_scale(use_norm, limit)
    if scale is None:
        return None
    return Factor(clipping.truncate_factor(scale, clipping.exact_product_bits(dtypes)))


def refuse_unreachable(infos: Sequence[TensorInfo], limit: float) -> None:
    """A dtype with no zero (float8_e8m0fnu: powers of two only) cannot scale below its
    smallest value: when even that gives a norm over the limit, no factor works, and the
    rounding would write NaN. Refused (exit 4), as for value bounds no value can meet."""
    floor = Fraction(0)
    zeroless = []
    for info in infos:
        smallest = clipping.smallest_without_zero(info.dtype)
        if smallest is not None:
            floor += Fraction(smallest) ** 2 * info.numel
            zeroless.append(info.name)
    # At the floor itself the search has no room (every factor below the first change
    # gives the floor): refuse there too, with a hair of margin, rather than write NaN.
    if zeroless and floor * (1 + Fraction(1, 2**20)) >= Fraction(limit) ** 2:
        names = ", ".join(repr(name) for name in zeroless[:3])
        more = f" and {len(zeroless) - 3} more" if len(zeroless) > 3 else ""
        smallest = clipping.smallest_without_zero(infos[0].dtype) or 0
        raise DataRefusedError(
            f"{names}{more}: a dtype without zero (every value at least its smallest, "
            f"{smallest:g}) cannot be scaled to a norm of {limit:g}: the least it can reach "
            f"is {math.sqrt(floor):g}; choose a larger limit or exclude these tensors"
        )


def within_exactly(members: Sequence[TensorStats], limit: float, check: OutputCheck) -> bool:
    """Whether the norm of `members` together is <= limit: exact over histograms (as
    fractions), with a certain bound over the rest (one more pass over those tensors)."""
    total = Fraction(0)
    for member in members:
        if member.stats.histogram is not None:
            bits, counts = member.stats.histogram
            values = lookup.float64_values(member.info.dtype)[bits]
            for value, count in zip(values.tolist(), counts.tolist(), strict=True):
                total += Fraction(value) ** 2 * count
    wide = [m.info for m in members if m.stats.histogram is None]
    sumsq = check(wide, 1.0, 0)
    sumsq.total += total
    return sumsq.at_most(limit)


def _histograms(members: Sequence[TensorStats]) -> list[clipping.Histogram]:
    """The 8- and 16-bit members' bit-pattern counts, one histogram per dtype."""
    by_dtype: dict[np.dtype[Any], list[tuple[np.ndarray, np.ndarray]]] = {}
    for member in members:
        if member.stats.histogram is not None:
            by_dtype.setdefault(member.info.dtype, []).append(member.stats.histogram)
    result = []
    for dtype, parts in by_dtype.items():
        bits = np.concatenate([p[0] for p in parts])
        counts = np.concatenate([p[1] for p in parts]).astype(np.float64)
        total = np.bincount(bits, weights=counts, minlength=256**dtype.itemsize)
        present = np.flatnonzero(total)
        values = lookup.float64_values(dtype)[present]
        result.append(clipping.Histogram(dtype, values, total[present]))
    return result


def _wide_bound(members: Sequence[TensorStats], limit: float) -> clipping.WideBound | None:
    """The rounding bound for the float32/float64/complex members (no histogram)."""
    wide = [m for m in members if m.stats.histogram is None]
    if not wide:
        return None
    stats = NormAccumulator()
    for member in wide:
        stats.merge(member.stats)
    return clipping.WideBound.of(
        stats.limit_ratio(limit), [m.info.dtype for m in wide], sum(m.info.numel for m in wide)
    )


def _verified_factor(
    members: Sequence[TensorStats], together: NormAccumulator, limit: float, check: OutputCheck
) -> Factor:
    """float64 (and factors below 2**-900): TF's factor, checked by a pass over the rounded
    output with a certain bound on its norm (CertainSumsq), shrunk by the measured overshoot
    once if needed, else the factor the rounding bound guarantees."""
    ratio = together.limit_ratio(limit)
    if ratio >= clipping.TINY_RATIO:
        mantissa, exponent = ratio, 0
    else:
        mantissa, exponent = together.limit_ratio_parts(limit)
    first = mantissa
    infos = [m.info for m in members]
    for _ in range(2):
        sumsq = check(infos, mantissa, exponent)
        if sumsq.at_most(limit):
            return Factor(mantissa, exponent)
        over = sumsq.over(limit)
        if not math.isfinite(over) or over <= 0:
            break
        mantissa = mantissa / over * (1 - 2.0**-51)
    bound = clipping.WideBound.of(1.0, [m.info.dtype for m in members], together.numel)
    headroom = 1 - math.sqrt(bound.numel) * bound.step / 2 / limit
    safe = first * bound.ratio * max(headroom, 0.0) / (1 + bound.unit) * (1 - 2.0**-50)
    return Factor(safe, exponent)
