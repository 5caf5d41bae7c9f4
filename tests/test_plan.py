"""clipcli.jobs.plan: the plan is a frozen value made from a measurement, without files.

Arrays live in memory (ArrayReader); expected norms come from exact fractions. Every
Action and every Reason is reached by some plan here, and every Reason is rendered by
the report.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from clipcli.api import ClipRow
from clipcli.formats.base import Reader, TensorInfo
from clipcli.jobs.execution import DiscardingWriter, execute
from clipcli.jobs.factor import OutputCheck
from clipcli.jobs.measurement import Measurement
from clipcli.jobs.plan import Action, EarlyVerdict, Outcome, Plan, Reason, copy_plan, plan
from clipcli.jobs.roles import Role
from clipcli.jobs.selection import EVERY_TENSOR, Selection
from clipcli.jobs.spec import ClipSpec, Mode, build_spec
from clipcli.numerics.certain import CertainSumsq
from clipcli.numerics.norms import NormAccumulator
from clipcli.numerics.rounding import scale_chunk
from clipcli.report import builders as report

RNG = np.random.default_rng(1313)


class ArrayReader(Reader):
    """A checkpoint held in memory, read in chunks of 3 elements."""

    format_name = "memory"

    def __init__(self, arrays: dict[str, np.ndarray]) -> None:
        super().__init__(Path("memory"))
        self.arrays = arrays
        self._infos = [TensorInfo(name, a.dtype, a.shape, a.nbytes) for name, a in arrays.items()]

    @property
    def infos(self) -> list[TensorInfo]:
        return self._infos

    def chunks(self, info: TensorInfo, chunk_elems: int | None = None) -> Iterator[np.ndarray]:
        flat = self.arrays[info.name].reshape(-1)
        step = chunk_elems or 3
        for start in range(0, flat.size, step):
            yield flat[start : start + step]


def measured(
    arrays: dict[str, np.ndarray], selection: Selection = EVERY_TENSOR
) -> tuple[Measurement, ArrayReader]:
    reader = ArrayReader(arrays)
    rows = []
    for info in reader.infos:
        stats = NormAccumulator(keep_histogram=True)
        stats.add(arrays[info.name].reshape(-1))
        stats.finish()
        rows.append(selection.describe(info, stats))
    return Measurement(reader.path, "memory", {}, rows), reader


def memory_check(arrays: dict[str, np.ndarray]) -> OutputCheck:
    def check(infos: Sequence[TensorInfo], mantissa: float, exponent: int) -> CertainSumsq:
        total = CertainSumsq()
        for info in infos:
            total.add(scale_chunk(arrays[info.name].reshape(-1), mantissa, exponent))
        return total

    return check


def plan_of(
    arrays: dict[str, np.ndarray], spec: ClipSpec, selection: Selection = EVERY_TENSOR
) -> Plan:
    measurement, _ = measured(arrays, selection)
    return plan(measurement, spec, memory_check(arrays))


def exact_norm(values: np.ndarray) -> Fraction:
    """The squared norm, exactly."""
    return sum((Fraction(float(v)) ** 2 for v in values.reshape(-1).tolist()), Fraction(0))


def reasons(made: Plan) -> dict[str, Reason]:
    return {t.info.name: t.reason for t in made.tensors}


def test_norm_exactly_at_the_limit_is_kept_and_a_hair_above_is_scaled() -> None:
    arrays = {"w": np.array([3.0, 4.0], np.float32)}  # norm exactly 5
    assert exact_norm(arrays["w"]) == 25
    (kept,) = plan_of(arrays, ClipSpec(Mode.NORM, limit=5.0)).tensors
    assert (kept.action, kept.reason, kept.factor) == (Action.KEEP, Reason.WITHIN_LIMIT, None)
    below = math.nextafter(5.0, 0.0)
    (scaled,) = plan_of(arrays, ClipSpec(Mode.NORM, limit=below)).tensors
    assert (scaled.action, scaled.reason) == (Action.SCALE, Reason.OVER_LIMIT)
    assert scaled.scale is not None
    out = (arrays["w"].astype(np.float64) * scaled.scale).astype(np.float32)
    assert exact_norm(out) <= Fraction(below) ** 2


def test_global_exactly_at_the_limit_is_kept_and_a_hair_above_is_scaled() -> None:
    arrays: dict[str, np.ndarray] = {
        "a": np.array([3.0], np.float16),
        "b": np.array([4.0], np.float64),
    }
    kept = plan_of(arrays, ClipSpec(Mode.GLOBAL, limit=5.0))
    assert {t.action for t in kept.tensors} == {Action.KEEP}
    assert kept.used_norm == 5.0
    scaled = plan_of(arrays, ClipSpec(Mode.GLOBAL, limit=math.nextafter(5.0, 0.0)))
    assert {t.action for t in scaled.tensors} == {Action.SCALE}
    assert len({t.scale for t in scaled.tensors}) == 1  # one factor for the checkpoint


def test_value_mode_at_the_bound_is_kept_and_past_it_clamped() -> None:
    arrays = {"w": np.array([-2.0, 2.0], np.float32)}
    (at,) = plan_of(arrays, build_spec(low=-2.0, high=2.0)).tensors
    assert (at.action, at.reason) == (Action.KEEP, Reason.WITHIN_RANGE)
    (past,) = plan_of(arrays, build_spec(low=-2.0, high=math.nextafter(2.0, 0.0))).tensors
    assert (past.action, past.reason) == (Action.CLAMP, Reason.OVER_RANGE)


def test_nonfinite_skipped_is_decided_by_reason_and_left_out_of_the_global_norm() -> None:
    arrays: dict[str, np.ndarray] = {
        "bad": np.array([np.nan, 1.0], np.float32),
        "ok": np.array([3.0, 4.0], np.float32),
    }
    made = plan_of(arrays, build_spec(global_=1.0, skip_nonfinite=True))
    bad, ok = made.tensors
    assert (bad.action, bad.reason, bad.in_global) == (Action.KEEP, Reason.NONFINITE_SKIPPED, False)
    assert ok.action is Action.SCALE
    assert made.used_norm == 5.0 == made.global_before


def test_group_members_carry_their_group() -> None:
    arrays = {
        "layers.0.w": np.array([3.0, 4.0], np.float32),
        "layers.1.w": np.array([0.5], np.float32),
    }
    made = plan_of(arrays, build_spec(global_=1.0, group_by="layer"))
    assert [(t.group, t.action) for t in made.tensors] == [
        ("layers.0", Action.SCALE),
        ("layers.1", Action.KEEP),
    ]


def test_the_plan_is_frozen_and_execute_leaves_it_as_it_was() -> None:
    arrays = {
        "big": RNG.standard_normal(10).astype(np.float32) * 10,
        "small": np.array([0.1, 0.2], np.float32),
        "m": RNG.standard_normal((3, 4)).astype(np.float32) * 10,
    }
    measurement, reader = measured(arrays)
    for spec in (
        build_spec(norm=1.0),
        build_spec(norm=1.0, axes=[1], skip_low_rank=True),
        build_spec(value=1.0),
    ):
        made = plan(measurement, spec, memory_check(arrays))
        before = [dataclasses.astuple(t)[2:] for t in made.tensors]
        with pytest.raises(dataclasses.FrozenInstanceError):
            made.tensors[0].action = Action.KEEP  # type: ignore[misc]
        outcomes = execute(made, reader, DiscardingWriter())
        assert [dataclasses.astuple(t)[2:] for t in made.tensors] == before
        assert [o.changed for o in outcomes] == [t.action is not Action.KEEP for t in made.tensors]


def test_execute_reports_norm_after_and_slices() -> None:
    arrays = {"m": np.array([[3.0, 4.0], [0.3, 0.4]], np.float32)}
    measurement, reader = measured(arrays)
    made = plan(measurement, build_spec(norm=1.0, axes=[1]), memory_check(arrays))
    (outcome,) = execute(made, reader, DiscardingWriter())
    assert (outcome.changed, outcome.slices_clipped, outcome.slices) == (True, 1, 2)
    assert outcome.after.norm <= math.sqrt(1.0 + 0.25) * (1 + 1e-7)


@pytest.mark.parametrize(
    "spec",
    [build_spec(norm=1.0), build_spec(average=0.5), build_spec(value=1.0), build_spec(global_=1e9)],
    ids=["norm", "average", "value", "global-within"],
)
def test_copy_ahead_verdict_agrees_with_the_plan(spec: ClipSpec) -> None:
    arrays = {f"t{i}": RNG.standard_normal(4).astype(np.float32) * i for i in range(6)}
    arrays["step"] = np.array([3], np.int64)
    measurement, _ = measured(arrays)
    made = plan(measurement, spec, memory_check(arrays))
    verdict = EarlyVerdict(spec)
    early = [verdict.unchanged(t) for t in measurement.tensors]
    assert early == [t.action is Action.KEEP for t in made.tensors]


def every_reason_plan() -> list[tuple[Plan, list[Outcome]]]:
    """Plans that between them reach every Action and every Reason."""
    arrays: dict[str, np.ndarray] = {
        "w": np.array([3.0, 4.0], np.float32),
        "zero": np.zeros(2, np.float32),
        "tiny": np.array([0.25], np.float32),
        "step": np.array([1], np.int64),
        "skipped.w": np.ones(2, np.float32),
        "optimizer/dense/kernel/m": np.ones(2, np.float32),
        "nan": np.array([np.nan], np.float32),
        "vec": np.ones(3, np.float32),
        "mat": np.array([[3.0, 3.0], [0.1, 0.1]], np.float32),
        "c": np.array([1 + 1j], np.complex64),
    }
    selection = Selection(exclude=("skipped.*",))
    measurement, reader = measured(arrays, selection)
    specs = [
        build_spec(norm=1.0, skip_nonfinite=True),
        build_spec(norm=1.0, axes=[1], skip_low_rank=True, skip_nonfinite=True),
        build_spec(value=0.5),
    ]
    result = []
    for spec in specs:
        made = plan(measurement, spec, memory_check(arrays))
        result.append((made, execute(made, reader, DiscardingWriter())))
    copied = copy_plan(reader.infos)
    result.append((copied, execute(copied, reader, DiscardingWriter())))
    return result


def test_every_action_and_reason_is_reachable() -> None:
    plans = [made for made, _ in every_reason_plan()]
    assert {t.action for p in plans for t in p.tensors} == set(Action)
    assert {t.reason for p in plans for t in p.tensors} == set(Reason)


def test_every_reason_is_rendered_by_the_report() -> None:
    assert set(report.REASON_TEXT) == {reason.value for reason in Reason}
    notes = {}
    for made, outcomes in every_reason_plan():
        for tensor, outcome in zip(made.tensors, outcomes, strict=True):
            notes[tensor.reason] = report.clip_note(ClipRow(tensor, outcome))
    assert notes[Reason.NOT_SELECTED] == "not selected"
    assert notes[Reason.LEFT_OUT] == f"{Role.OPTIMIZER.description}, left unchanged"
    assert notes[Reason.NONFINITE_SKIPPED] == "non-finite, skipped"
    assert notes[Reason.PER_SLICE] == "1 of 2 slices clipped"
    assert notes[Reason.OVER_LIMIT] == ""
    assert all("{" not in note for note in notes.values())
