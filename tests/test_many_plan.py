"""The per-tensor records of a plan made lighter for checkpoints of 200,000 tensors (issue
20, many tensors): each tensor's norm worked out once when it is measured, the global norm
the plan scales by taken over the counted tensors themselves, and the plan's records with
__slots__. What a plan decides must not move."""

from __future__ import annotations

import dataclasses
from fractions import Fraction

import numpy as np
import pytest
from test_plan import measured, memory_check

from clipcli.jobs.plan import Flushes, Outcome, Reason, TensorPlan, plan
from clipcli.jobs.selection import Selection
from clipcli.jobs.spec import ClipSpec, Mode
from clipcli.numerics.norms import global_norm


def _arrays() -> dict[str, np.ndarray]:
    return {
        "a.weight": np.array([3.0, 4.0], np.float32),
        "b.weight": np.array([1.0, -2.0, 2.0], np.float32),
        "c.weight": np.zeros(2, np.float32),  # a zero tensor: counted, kept
        "d.weight": np.array([np.nan, 1.0], np.float32),  # skipped: outside the norm
        "e.weight": np.array([6.0], np.float32),  # tied to a.weight below: counted once
        "optimizer.state.0.exp_avg": np.array([100.0], np.float32),  # left out
        "steps": np.array([7], np.int64),  # not floating point
        "f.weight": np.array([0.5, 0.25], np.float16),
    }


def test_each_tensor_norm_is_its_statistics_norm() -> None:
    measurement, _ = measured(_arrays())
    for t in measurement.tensors:
        assert repr(t.norm) == repr(t.stats.norm)


@pytest.mark.parametrize("limit", [1.0, 8.0, 1e6])
def test_the_norm_a_global_plan_scales_by_is_the_global_norm_of_its_counted_tensors(
    limit: float,
) -> None:
    arrays = _arrays()
    selection = Selection(tied={"e.weight": "a.weight"})
    measurement, _ = measured(arrays, selection)
    spec = ClipSpec(Mode.GLOBAL, limit=limit, skip_nonfinite=True)
    made = plan(measurement, spec, memory_check(arrays))
    counted = [p for p in made.tensors if p.in_global]
    assert [p.info.name for p in counted] == ["a.weight", "b.weight", "c.weight", "f.weight"]
    assert repr(made.used_norm) == repr(global_norm(p.before.norm for p in counted))
    assert repr(made.used_norm) == repr(made.global_before)
    # 9 + 16 + 1 + 4 + 4 + 0.25 + 0.0625, exactly: the two norms' squares round once each
    exact = Fraction(9 + 16 + 1 + 4 + 4) + Fraction(5, 16)
    assert made.used_norm is not None
    assert abs(Fraction(made.used_norm) ** 2 - exact) <= exact * Fraction(1, 2**50)
    reasons = {p.info.name: p.reason for p in made.tensors}
    assert reasons["c.weight"] is Reason.ZERO_TENSOR
    assert reasons["d.weight"] is Reason.NONFINITE_SKIPPED
    assert reasons["optimizer.state.0.exp_avg"] is Reason.LEFT_OUT
    assert reasons["steps"] is Reason.NOT_FLOATING


def test_the_records_made_per_tensor_hold_no_dict_and_stay_frozen() -> None:
    measurement, _ = measured(_arrays())
    made = plan(
        measurement, ClipSpec(Mode.GLOBAL, limit=1.0, skip_nonfinite=True), memory_check(_arrays())
    )
    record = made.tensors[0]
    assert isinstance(record, TensorPlan)
    for value in (record, Outcome(), Flushes()):
        assert not hasattr(value, "__dict__")
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.factor = 2.0  # type: ignore[misc]
    assert dataclasses.replace(record, factor=0.5).factor == 0.5


def test_the_shared_nothing_flushed_cannot_be_added_to() -> None:
    """Outcomes made without flushes of their own share NOTHING_FLUSHED (200,000 tensors):
    adding to it would count one tensor's flushes for every other, so it refuses."""
    from clipcli.jobs.plan import NOTHING_FLUSHED

    assert Outcome().flushes is NOTHING_FLUSHED
    with pytest.raises(TypeError):
        NOTHING_FLUSHED.add(1, 0)
    assert (NOTHING_FLUSHED.to_zero, NOTHING_FLUSHED.to_subnormal) == (0, 0)
    own = Flushes()
    own.add(2, 3)
    assert (own.to_zero, own.to_subnormal) == (2, 3)
