"""NormAccumulator keeps its rarely set fields (non-finite counts, the bit-pattern
histogram) apart, in an object shared by every accumulator that never set one: a write to
one accumulator must never show in another, and the class must still construct, compare
and print as the dataclass it was."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from clipcli.numerics.norms import NormAccumulator, ScaledSum, accumulate

RARE = {
    "inf_count": 3,
    "nonfinite": 5,
    "nan_count": 2,
    "keep_histogram": True,
    "counts": np.arange(4),
    "histogram": (np.arange(2, dtype=np.uint16), np.ones(2, dtype=np.uint32)),
    "hist_dtype": np.dtype(np.float16),
}
DEFAULTS = {
    "inf_count": 0,
    "nonfinite": 0,
    "nan_count": 0,
    "keep_histogram": False,
    "counts": None,
    "histogram": None,
    "hist_dtype": None,
}


def _assert_defaults(acc: NormAccumulator) -> None:
    for name, value in DEFAULTS.items():
        assert getattr(acc, name) is value or getattr(acc, name) == value, name


@pytest.mark.parametrize("name", RARE)
def test_a_write_to_one_accumulator_shows_in_no_other(name: str) -> None:
    before, written, after = NormAccumulator(), NormAccumulator(), None
    setattr(written, name, RARE[name])
    after = NormAccumulator()
    assert getattr(written, name) is RARE[name]
    for other in (before, after, NormAccumulator(ScaledSum(0.5, 1), 1.0, 0, 0, 0, 1, 1.0, 1.0)):
        _assert_defaults(other)
    for other_name in DEFAULTS.keys() - {name}:  # the written one's other fields
        assert getattr(written, other_name) is DEFAULTS[other_name] or (
            getattr(written, other_name) == DEFAULTS[other_name]
        )


def test_adding_non_finite_values_and_histograms_changes_only_that_accumulator() -> None:
    plain = accumulate([np.array([1.0, 2.0], np.float32)])
    with_inf = accumulate([np.array([1.0, np.inf, np.nan], np.float32)])
    counted = NormAccumulator(keep_histogram=True)
    counted.add(np.array([1.0, 2.0, 2.0], ml_dtypes.bfloat16))
    counted.add(np.array([3.0], ml_dtypes.bfloat16))  # counts += on the same array
    counted.finish()
    assert (with_inf.inf_count, with_inf.nan_count, with_inf.nonfinite) == (1, 1, 2)
    assert counted.histogram is not None
    assert counted.counts is None
    assert counted.histogram[1].tolist() == [1, 2, 1]
    assert math.isnan(with_inf.norm)
    assert counted.norm == math.sqrt(18.0)
    _assert_defaults(plain)
    _assert_defaults(NormAccumulator())
    merged = NormAccumulator()
    merged.merge(with_inf)
    assert (merged.inf_count, merged.nan_count, merged.nonfinite) == (1, 1, 2)
    _assert_defaults(plain)


def test_constructs_compares_and_prints_as_the_dataclass_did() -> None:
    fields = (ScaledSum(0.5, 3), 2.0, 1, 1, 0, 7, -2.0, math.inf)
    a, b = NormAccumulator(*fields), NormAccumulator(*fields)
    assert a == b
    assert a is not b
    assert a != NormAccumulator(*fields[:5], 8, *fields[6:])
    assert NormAccumulator(keep_histogram=True) != NormAccumulator()
    assert NormAccumulator() == NormAccumulator(hist_dtype=None, counts=None)
    assert (a.inf_count, a.nonfinite, a.numel, a.min_value, a.max_value) == (
        1,
        1,
        7,
        -2.0,
        math.inf,
    )
    assert repr(NormAccumulator()) == (
        "NormAccumulator(sumsq=ScaledSum(mant=0.0, exp=0), max_abs=0.0, inf_count=0, "
        "nonfinite=0, nan_count=0, numel=0, min_value=inf, max_value=-inf, "
        "keep_histogram=False, counts=None, histogram=None, hist_dtype=None)"
    )
    with pytest.raises(TypeError):
        hash(a)
    with pytest.raises(AttributeError):
        a.unknown = 1  # type: ignore[attr-defined]  # slots: no stray fields


def test_writing_a_default_value_makes_no_object_of_its_own() -> None:
    """merge() adds every count, zeros included: an accumulator that only ever holds the
    defaults shares the one object, and one that then holds something else gets its own."""
    acc, other = NormAccumulator(), NormAccumulator()
    acc.merge(other)
    acc.nonfinite = 0
    acc.counts = None
    acc.keep_histogram = False
    assert acc._unusual is other._unusual
    acc.nan_count = 1
    assert acc._unusual is not other._unusual
    assert (acc.nan_count, other.nan_count, NormAccumulator().nan_count) == (1, 0, 0)
