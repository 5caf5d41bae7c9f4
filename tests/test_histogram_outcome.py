"""A scaled 8/16-bit float tensor's outcome read off its histogram (issue 20, bf16 clip cost).

rounding.scaled_statistics gives the written tensor's statistics and flush counts from the
measuring pass's bit-pattern counts, so the write pass only scales. Checked here against
plain numpy on the scaled data and exact rational arithmetic (fractions.Fraction), with
zeros of both signs, NaN, both infinities, subnormals and values the factor flushes."""

from __future__ import annotations

import math
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest

from clipcli.jobs import execution
from clipcli.numerics import rounding
from clipcli.numerics.norms import NormAccumulator

DTYPES = [
    np.dtype(ml_dtypes.bfloat16),
    np.dtype(np.float16),
    np.dtype(ml_dtypes.float8_e4m3fn),
    np.dtype(ml_dtypes.float8_e5m2),
]


def _data(dtype: np.dtype, specials: bool) -> np.ndarray:
    rng = np.random.default_rng(7)
    wide = rng.standard_normal(50_000) * np.exp2(rng.integers(-30, 8, 50_000))
    values = wide.astype(np.float32).astype(dtype)
    if specials:
        values[:40] = 0.0
        values[40:50] = -0.0
        values[50:53] = np.nan
        if np.isinf(np.float64(np.array(np.inf).astype(dtype))):
            values[53:57] = np.inf
            values[57:58] = -np.inf
    rng.shuffle(values)
    return values


def _measured(values: np.ndarray) -> NormAccumulator:
    acc = NormAccumulator(keep_histogram=True)
    for start in range(0, values.size, 7_000):  # several chunks, as the measuring pass
        acc.add(values[start : start + 7_000])
    acc.finish()
    return acc


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("specials", [False, True])
@pytest.mark.parametrize(
    ("scale", "exponent"), [(0.75, 0), (0.5, -3), (0.9, -110), (0.6, -12), (1.0, 0)]
)
def test_statistics_and_flushes_from_the_histogram_are_those_of_the_data(
    dtype: np.dtype, specials: bool, scale: float, exponent: int
) -> None:
    values = _data(dtype, specials)
    known = rounding.scaled_statistics(_measured(values), dtype, scale, exponent)
    assert known is not None
    after, flushed = known
    out = rounding.scale_chunk(values, scale, exponent)  # what the write pass writes
    wide = out.astype(np.float64)
    finite = wide[np.isfinite(wide)]
    assert after.numel == out.size
    assert after.nan_count == int(np.isnan(wide).sum())
    assert after.inf_count == int(np.isinf(wide).sum())
    assert after.nonfinite == after.nan_count + after.inf_count
    assert after.max_abs == (float(np.abs(finite).max()) if finite.size else 0.0)
    assert after.max_value == float(np.nanmax(wide))
    assert after.min_value == float(np.nanmin(wide))
    exact = sum((Fraction(float(v)) ** 2 for v in finite), Fraction(0))
    if after.nan_count:
        assert math.isnan(after.norm)
    elif after.inf_count:
        assert after.norm == math.inf
    else:
        assert after.norm == pytest.approx(math.sqrt(exact), rel=1e-15, abs=0.0)
    # Flushes, from the bit patterns (sign bit off): nonzero -> zero, -> newly subnormal.
    bits = np.dtype(f"u{dtype.itemsize}")
    sign = 1 << (8 * dtype.itemsize - 1)
    nmant = int(ml_dtypes.finfo(dtype).nmant)  # type: ignore[no-untyped-call]
    old = values.view(bits).astype(np.int64) & (sign - 1)
    new = out.view(bits).astype(np.int64) & (sign - 1)
    old_subnormal = (old != 0) & (old < (1 << nmant))
    new_subnormal = (new != 0) & (new < (1 << nmant))
    to_zero = int(((new == 0) & (old != 0)).sum())
    to_subnormal = int((new_subnormal & ~old_subnormal).sum())
    assert flushed == (to_zero, to_subnormal) == rounding.flushes(values, out)
    if dtype == np.dtype(ml_dtypes.bfloat16) and exponent == -110:
        assert to_zero > 0  # the case is exercised


def test_no_histogram_no_outcome() -> None:
    acc = NormAccumulator()
    acc.add(np.ones(10, np.float32))
    acc.finish()
    assert rounding.scaled_statistics(acc, np.dtype(np.float32), 0.5, 0) is None


def test_the_outcome_is_read_off_from_a_quarter_million_elements() -> None:
    """At HISTOGRAM_OUTCOME_MIN elements the histogram gives the outcome; one fewer, the
    write pass counts it (cheaper than 65,536-pattern work for a small tensor)."""
    from clipcli.formats.base import TensorInfo
    from clipcli.jobs.plan import Action, Reason, TensorPlan

    assert execution.HISTOGRAM_OUTCOME_MIN == 1 << 18
    dtype = np.dtype(ml_dtypes.bfloat16)
    for numel, read_off in ((1 << 18, True), ((1 << 18) - 1, False)):
        values = np.ones(numel, dtype)
        info = TensorInfo("w", dtype, (numel,), numel * 2)
        plan = TensorPlan(info, _measured(values), Action.SCALE, Reason.OVER_LIMIT, factor=0.5)
        outcome = execution._scaled_outcome(plan)
        assert (outcome is not None) is read_off
        if outcome is not None:
            assert outcome.after.norm == math.sqrt(numel) * 0.5
