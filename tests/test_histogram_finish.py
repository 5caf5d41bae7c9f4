"""NormAccumulator.finish turns a tensor's bit-pattern counts into its statistics and
histogram, looking up only the codes present (a pass over all 65,536 codes per table cost
~400 us a tensor). The reference below is written from the values themselves: Python
floats of every code (ml_dtypes' own table), the counts of NaN and infinities, the
smallest and largest value present with +0.0 before -0.0 where both are (codes in
ascending order break ties), the finite nonzero codes ascending with their counts, and
the sum of count * value**2 summed as numpy sums that very array."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from clipcli.numerics.norms import NormAccumulator

SMALL = [np.float16, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2]


def _bits(value: float) -> str:
    return float(value).hex() + ("-" if math.copysign(1.0, value) < 0 else "+")


@pytest.mark.parametrize("dtype", SMALL, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("case", range(8))
def test_finish_from_the_codes_present(dtype: type, case: int) -> None:
    rng = np.random.default_rng(case * 31 + np.dtype(dtype).itemsize)
    codes = 1 << (8 * np.dtype(dtype).itemsize)
    uint = np.uint16 if codes > 256 else np.uint8
    every: np.ndarray = np.arange(codes, dtype=uint).view(dtype)
    with np.errstate(invalid="ignore"):
        table = every.astype(np.float64)
    zero_plus, zero_minus = 0, codes // 2  # +0.0 and -0.0
    picks = rng.choice(codes, size=int(rng.integers(1, 50)), replace=False).tolist()
    picks += [[], [zero_plus], [zero_minus], [zero_plus, zero_minus]][case % 4]
    if case % 3 == 0:
        picks += [int(k) for k in np.flatnonzero(np.isnan(table))[:2]]
    values = every[np.repeat(np.asarray(sorted(set(picks))), rng.integers(1, 4, len(set(picks))))]
    rng.shuffle(values)

    acc = NormAccumulator(keep_histogram=True)
    with np.errstate(all="ignore"):
        acc.add(values)
    acc.finish()

    present = sorted(set(values.view(uint).tolist()))
    count = {code: int(np.sum(values.view(uint) == code)) for code in present}
    assert acc.nan_count == sum(count[c] for c in present if math.isnan(table[c]))
    assert acc.inf_count == sum(count[c] for c in present if math.isinf(table[c]))
    ordered = sorted((c for c in present if not math.isnan(table[c])), key=lambda c: (table[c], c))
    if ordered:
        assert _bits(acc.min_value) == _bits(table[ordered[0]])
        assert _bits(acc.max_value) == _bits(table[ordered[-1]])
    used = [c for c in present if math.isfinite(table[c]) and table[c] != 0]
    assert acc.histogram is not None
    assert acc.histogram[0].tolist() == used
    assert acc.histogram[1].tolist() == [count[c] for c in used]
    if used:
        kept = np.asarray([count[c] for c in used], np.float64)
        squares = np.asarray([table[c] ** 2 for c in used])
        assert math.ldexp(acc.sumsq.mant, acc.sumsq.exp) == float(np.sum(kept * squares))
        assert acc.max_abs == max(abs(table[c]) for c in used)
