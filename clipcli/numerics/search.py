"""The search for the largest factor that fits: one bisection for every mode.

A candidate factor has a fixed number of significant bits (so that value * factor is exact
in float64 and the output is rounded once); candidates are ordered integer keys, so the
search is a bisection over integers, several independent problems at once (one per slice
for --axes, one for a tensor or a group). What "fits" means comes from the caller as
`margin(factors)`: scaling.py builds it from histograms and rounding bounds, slices.py from
the slices' values.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from clipcli.dtypes import mantissa_digits, unit_roundoff

# ---------------------------------------------------------------- the one scale search
#
# The factor applied to a tensor (or slice, group, checkpoint) is the largest uniform one
# whose *rounded* output has norm <= C. The rounded output's norm never decreases as the
# factor grows (each element is rounded to nearest, a monotone map), so bisection finds
# it. What the search needs is `margin(s)`: 1 - (an upper bound of ||round(s*x)||^2) / C^2,
# >= 0 exactly when the factor s certainly fits. For 8- and 16-bit floats it is computed
# exactly from a histogram of bit patterns (no pass over the data); for float32/float64
# members from their measured norm and a rigorous rounding bound.

U64 = 2.0**-53  # float64 unit roundoff
# Relative distance from C within which a measured norm might be on either side of it.
AMBIGUOUS = 1e-9


def exact_product_bits(dtypes: Sequence[np.dtype[Any]]) -> int:
    """Significant bits a factor may have so that value * factor is exact in float64 for
    every value of these dtypes: the product then rounds once, to the dtype, as promised.
    (float64 itself rounds once in the product; it does not restrict the factor.)"""
    digits = [mantissa_digits(d) for d in dtypes if mantissa_digits(d) < 53]
    return 53 - max(digits) if digits else 53


def truncate_factor(scale: float, bits: int) -> float:
    """`scale` rounded toward zero to `bits` significant bits."""
    return float(on_grid(np.asarray([scale], np.float64), bits)[0])


def on_grid(scales: np.ndarray, bits: int) -> np.ndarray:
    """Non-negative factors truncated to `bits` significant bits: the search's candidates."""
    return _factor_of(_key_of(scales, bits), bits)


def grid_step_below(scales: np.ndarray, bits: int) -> np.ndarray:
    """The candidate one step below each factor's truncation (0 stays 0)."""
    return _factor_of(np.maximum(_key_of(scales, bits) - 1, 0), bits)


def _key_of(scales: np.ndarray, bits: int) -> np.ndarray:
    """Order-preserving integer keys of non-negative factors with `bits` significant bits
    (truncating the rest): consecutive keys are consecutive candidate factors."""
    keys: np.ndarray = np.ascontiguousarray(scales, np.float64).view(np.int64) >> (53 - bits)
    return keys


def _factor_of(keys: np.ndarray, bits: int) -> np.ndarray:
    factors: np.ndarray = (keys << (53 - bits)).view(np.float64)
    return factors


Margin = Callable[[np.ndarray], np.ndarray]
# (low factors, high factors) -> (margin, next_change, narrow) for factors between them.
Narrow = Callable[[np.ndarray, np.ndarray], tuple[Margin, Margin | None, "Narrow"]]


def search_factors(
    margin: Margin,
    lows: Sequence[np.ndarray],
    highs: Sequence[np.ndarray],
    bits: int,
    max_evals: int = 400,
    next_change: Margin | None = None,
    narrow: Narrow | None = None,
) -> np.ndarray:
    """For each of several independent problems, the largest factor s with `bits`
    significant bits and margin(s) >= 0, all searched at once (margin takes and returns
    one value per problem). Factor 0 always fits (a zero output); factor 1 never does (the
    caller only asks for data over its limit). `lows` and `highs` are guesses, nearest
    first, checked in turn: a problem whose low guesses all fail starts from 0, one whose
    high guesses all fit from 1. Bisection alternates with interpolation in s^2 (the
    output's squared norm is nearly proportional to it), and, given `next_change(s)` (a
    lower bound of the next factor above s at which the rounded output changes at all),
    with jumps just past that change; the answer is exact either way. Given `narrow`, once
    the guesses bracket the answer and whenever the bracket has shrunk 16-fold since,
    margin and next_change are replaced by narrow(low, high)'s, which need only be right
    for factors between those two (cheaper: most values round the same way all through a
    narrow bracket)."""
    one = _key_of(np.ones(1), bits)[0]
    lo = np.zeros(len(lows[0]), np.int64)
    m_lo = np.ones(len(lows[0]))
    hi = np.full(lo.shape, one)
    m_hi = -np.ones(lo.shape)
    found_lo = np.zeros(lo.shape, bool)
    found_hi = np.zeros(lo.shape, bool)
    for guess in lows:
        keys = np.minimum(_key_of(np.maximum(guess, 0.0), bits), one - 1)
        todo = ~found_lo
        m = margin(_factor_of(np.where(todo, keys, lo), bits))
        fits = todo & (m >= 0)
        # A low guess that fails bounds the answer from above (factor 0 is never one: it
        # fits by definition, even where a dtype without zero makes its margin NaN).
        over = todo & ~(m >= 0) & (keys > 0) & (keys < hi)
        lo, m_lo = np.where(fits, keys, lo), np.where(fits, m, m_lo)
        hi, m_hi = np.where(over, keys, hi), np.where(over, m, m_hi)
        found_lo, found_hi = found_lo | fits, found_hi | over
        if found_lo.all():
            break
    for guess in highs:
        keys = np.minimum(np.maximum(_key_of(np.minimum(guess, 1.0), bits) + 1, lo + 1), one)
        todo = ~found_hi & (keys < hi)
        if not todo.any():
            break
        m = margin(_factor_of(np.where(todo, keys, lo), bits))
        over = todo & ~(m >= 0)
        fits = todo & (m >= 0)
        hi, m_hi, found_hi = np.where(over, keys, hi), np.where(over, m, m_hi), found_hi | over
        lo, m_lo = np.where(fits, keys, lo), np.where(fits, m, m_lo)
    narrowed_at = None  # the bracket's width when margin was last narrowed
    for step in range(max_evals):
        gap = hi - lo
        active = gap > 1
        if not np.any(active):
            break
        widest = int(np.max(gap))
        if narrow is not None and (narrowed_at is None or widest <= narrowed_at // 16):
            margin, next_change, narrow = narrow(_factor_of(lo, bits), _factor_of(hi, bits))
            narrowed_at = widest
        middle = lo + gap // 2
        if next_change is not None and step % 3 == 1:
            # Jump to just past the next change of the output above lo: if that fits, a
            # whole run of equal outputs is skipped; if not, the answer is within a few keys.
            with np.errstate(all="ignore"):
                changes = next_change(_factor_of(lo, bits)) * (1 + 16 * U64)
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


def guesses(
    ratios: np.ndarray, unit: float, fine: bool = False
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Brackets around TF's factor: rounding errors of many elements mostly cancel, so the
    answer is usually within 2**-24 or 2**-20 of it; one rounding of every element moves the
    output by at most u (subnormal results aside: then 0 and 1 are the last resort). `fine`
    adds rungs between 2**-20 and 2u: each costs one margin when the nearer ones fail, and
    a tight bracket saves several (a big float16 tensor's answer is often ~2**-19 below)."""
    rungs = [2.0**-24, 2.0**-20]
    rungs += [rung for rung in (2.0**-17, 2.0**-14) if fine and rung < 2 * unit]
    lows = [ratios * (1 - rung) for rung in rungs] + [ratios * (1 - 2 * unit)]
    highs = [ratios * (1 + 2.0**-24), ratios * (1 + 4 * unit)]
    return lows, highs


def worst_unit(dtypes: Sequence[np.dtype[Any]]) -> float:
    return max((unit_roundoff(d) for d in dtypes), default=0.0)
