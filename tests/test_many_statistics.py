"""Statistics of many tensors at once (issue 20, many tensors): the global norm and the
merged statistics of the factor search, summed as plain float64 where that is exact, must be
what the one-by-one ScaledSum gives, bit for bit, and the one-by-one loop must take over
exactly where the plain sum could differ."""

from __future__ import annotations

import math
import random
from fractions import Fraction
from typing import Any

import numpy as np
import pytest

from clipcli.numerics import norms
from clipcli.numerics.norms import (
    SAFE_HI,
    SAFE_LO,
    NormAccumulator,
    ScaledSum,
    accumulate_array,
    global_norm,
    merged,
)


def _one_by_one(parts: list[NormAccumulator]) -> NormAccumulator:
    together = NormAccumulator()
    for part in parts:
        together.merge(part)
    return together


def _padded(parts: list[NormAccumulator]) -> list[NormAccumulator]:
    """The parts, then enough fresh ones (no sum, no extreme, no element: they change
    nothing) for merged() to work on columns instead of merging one at a time."""
    return parts + [NormAccumulator() for _ in range(norms.MERGED_BY_COLUMNS)]


def _plain(parts: list[NormAccumulator]) -> bool:
    """Whether merged() sums these parts as plain float64."""
    return norms._plain_sum(parts, ScaledSum())


def _bits(value: float) -> str:
    return float(value).hex() if not math.isnan(value) else "nan"


def _fields(acc: NormAccumulator) -> tuple[object, ...]:
    return (
        _bits(acc.sumsq.mant),
        acc.sumsq.exp,
        _bits(acc.max_abs),
        acc.nonfinite,
        acc.nan_count,
        acc.inf_count,
        acc.numel,
        _bits(acc.min_value),
        _bits(acc.max_value),
    )


def _part(mant: float, exp: int, rng: random.Random) -> NormAccumulator:
    part = NormAccumulator()
    part.sumsq = ScaledSum(mant, exp)
    part.max_abs = rng.choice([0.0, 1.5, 3.0, rng.random()])
    part.min_value = rng.choice([-0.0, 0.0, -2.0, math.inf, -rng.random()])
    part.max_value = rng.choice([-0.0, 0.0, 2.0, -math.inf, rng.random()])
    part.numel = rng.randrange(5)
    part.nonfinite = part.inf_count = rng.randrange(2)
    return part


def _normalised(rng: random.Random, low: int, high: int) -> tuple[float, int]:
    if rng.random() < 0.1:
        return 0.0, rng.randrange(-3, 3)  # a zero sum, whatever its exponent
    return 0.5 + rng.random() / 2, rng.randrange(low, high + 1)


@pytest.mark.parametrize("seed", range(6))
def test_merged_is_the_one_by_one_merge_of_measured_tensors(seed: int) -> None:
    rng = np.random.default_rng(seed)
    parts = []
    for _ in range(300):
        size = int(rng.integers(0, 6))
        values = rng.standard_normal(size).astype(np.float32) * float(rng.choice([1e-30, 1, 1e30]))
        parts.append(accumulate_array(values))
    for some in (parts, _padded(parts)):  # one at a time, and on columns
        assert _fields(merged(some)) == _fields(_one_by_one(some))


@pytest.mark.parametrize("spread", [1, 60, 400, 900])
def test_merged_is_the_one_by_one_merge_across_exponents(spread: int) -> None:
    rng = random.Random(spread)
    parts = [_part(*_normalised(rng, -spread, spread), rng) for _ in range(2000)]
    assert _plain(parts)
    assert _fields(merged(parts)) == _fields(_one_by_one(parts))


@pytest.mark.parametrize(("exp", "plain"), [(900, True), (901, False), (-900, True), (-901, False)])
def test_plain_sum_up_to_its_exponent_limit_and_not_past_it(exp: int, plain: bool) -> None:
    rng = random.Random(exp)
    parts = _padded([_part(0.75, 0, rng), _part(0.625, exp, rng), _part(0.5, 3, rng)])
    assert _plain(parts) is plain
    assert _fields(merged(parts)) == _fields(_one_by_one(parts))


@pytest.mark.parametrize(
    "odd",
    [
        ScaledSum(math.inf, 0),
        ScaledSum(math.nan, 0),
        ScaledSum(-0.75, 2),  # not a sum of squares: partial sums could cancel
    ],
)
def test_merged_takes_the_loop_for_terms_the_plain_sum_cannot_carry(odd: ScaledSum) -> None:
    rng = random.Random(1)
    parts = _padded([_part(0.75, 4, rng), _part(0.5, 1, rng), _part(0.5, 2, rng)])
    parts[1].sumsq = odd
    assert not _plain(parts)
    assert _fields(merged(parts)) == _fields(_one_by_one(parts))


def test_merged_takes_the_loop_for_a_nan_extreme_and_for_histograms() -> None:
    rng = random.Random(2)
    parts = _padded([_part(0.75, 4, rng), _part(0.5, 1, rng)])
    parts[0].max_value = math.nan  # builtin max would depend on where it stands
    parts[1].max_value = 2.0  # one by one: max(-inf, nan) keeps -inf, then 2.0
    assert merged(parts).max_value == 2.0
    assert _fields(merged(parts)) == _fields(_one_by_one(parts))
    counting = NormAccumulator(keep_histogram=True)
    counting.add(np.array([1.0, 2.0], np.float16))
    some = _padded([counting, parts[1]])
    together, expected = merged(some), _one_by_one(some)
    assert _fields(together) == _fields(expected)
    assert together.counts is not None
    assert expected.counts is not None
    assert (together.counts == expected.counts).all()


def test_merged_of_nothing_is_a_fresh_accumulator() -> None:
    assert _fields(merged([])) == _fields(NormAccumulator())


@pytest.mark.parametrize("seed", range(5))
def test_global_norm_is_the_scaled_sum_in_order(seed: int) -> None:
    rng = np.random.default_rng(seed)
    values = (rng.random(5000) * 10.0 ** rng.integers(-100, 100, 5000)).tolist()
    values[::7] = [0.0] * len(values[::7])
    assert _bits(global_norm(values)) == _bits(norms._global_norm_scaled(values))
    # against exact arithmetic: n roundings of the squares and sums, one of the root
    exact = math.sqrt(sum(Fraction(v) ** 2 for v in values))
    assert abs(global_norm(values) - exact) <= exact * 2 * len(values) * 2.0**-53


@pytest.mark.parametrize(
    "edge",
    [SAFE_LO, SAFE_HI, math.nextafter(SAFE_LO, 0), math.nextafter(SAFE_HI, math.inf)],
)
def test_global_norm_at_and_past_the_safe_range(edge: float) -> None:
    values = [3.0, edge, 0.0, 1e-3, edge]
    assert _bits(global_norm(values)) == _bits(norms._global_norm_scaled(values))


@pytest.mark.parametrize(
    "values",
    [
        [],
        [0.0, 0.0],
        [1.0, math.inf],
        [math.nan, 2.0],
        [math.inf, math.nan],
        [1e300, 1e300],
        [1e-300, 2e-300],
        [5e-324],
        [-3.0, 4.0],
    ],
)
def test_global_norm_of_odd_values_is_the_scaled_sum(values: list[float]) -> None:
    assert _bits(global_norm(values)) == _bits(norms._global_norm_scaled(values))
    assert _bits(global_norm(iter(values))) == _bits(norms._global_norm_scaled(values))


@pytest.mark.parametrize(
    "extremes",
    [
        [0.0, -0.0],
        [-0.0, 0.0],
        [-0.0, -0.0, 0.0],
        [0.0, 0.0, -0.0, -1.0],
        [1.0, -0.0, 0.0],
        [math.inf],
        [-math.inf],
        [math.inf, -0.0],
        [-math.inf, 0.0, -0.0],
        [],
    ],
)
def test_merged_keeps_the_first_of_equal_extremes_as_the_loop_does(extremes: list[float]) -> None:
    """Zeros of either sign tie: the first one seen is kept, in each extreme, as merge()
    one part at a time keeps it (and the fresh accumulator's own value before any)."""
    parts = []
    for value in extremes:
        part = NormAccumulator()
        part.min_value = part.max_value = value
        part.max_abs = abs(value) if math.isfinite(value) else 0.0
        parts.append(part)
    # Fresh parts change no extreme: enough of them for merged() to work on columns.
    fresh = [NormAccumulator() for _ in range(norms.MERGED_BY_COLUMNS)]
    for order in (parts + fresh, fresh + parts, parts[::-1] + fresh, fresh + parts[::-1]):
        assert _fields(merged(order)) == _fields(_one_by_one(order))


def test_merged_works_on_columns_from_its_threshold_and_one_at_a_time_below(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Below MERGED_BY_COLUMNS parts merged() merges one at a time (numpy's fixed cost is
    ~26 us); from it, on columns. Both give the one-at-a-time statistics."""
    rng = random.Random(5)
    original, columns = norms._column, []

    def counted(*args: Any) -> np.ndarray:
        columns.append(args)
        return original(*args)

    monkeypatch.setattr(norms, "_column", counted)
    for count in (norms.MERGED_BY_COLUMNS - 1, norms.MERGED_BY_COLUMNS):
        parts = [_part(*_normalised(rng, -30, 30), rng) for _ in range(count)]
        columns.clear()
        assert _fields(merged(parts)) == _fields(_one_by_one(parts))
        assert bool(columns) is (count == norms.MERGED_BY_COLUMNS)
