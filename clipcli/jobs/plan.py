"""Pure planning: the plan, a frozen value made from a measurement and a ClipSpec.

`plan(measurement, spec, check)` decides, for every tensor, an Action and the Reason for
it; the report alone turns reasons into words, and no decision ever reads a display
string. `clipcli.jobs.pipeline.execute` carries the plan out and reports what happened
(Outcome) without editing it. Nothing here reads a file: the one data pass a factor
search may need (float32 and wider) is the `check` callback the caller supplies.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from fractions import Fraction

from clipcli.dtypes import is_floating
from clipcli.errors import DataRefusedError
from clipcli.formats.base import TensorInfo
from clipcli.jobs import roles
from clipcli.jobs.factor import Factor, OutputCheck, search_each_factor, search_factor, tf_factor
from clipcli.jobs.groups import compile_group_by, group_key
from clipcli.jobs.measurement import Measurement, TensorStats
from clipcli.jobs.spec import ClipSpec, Mode, axes_fit, exact_limit, normalize_axes, tensor_limit
from clipcli.numerics import rounding, scaling
from clipcli.numerics.norms import NormAccumulator, Normed, global_norm

# ---------------------------------------------------------------- the plan


class Action(str, Enum):
    """What the write pass does to one tensor."""

    KEEP = "keep"  # copied bit for bit
    SCALE = "scale"  # every value times one factor, rounded once
    CLAMP = "clamp"  # values clamped to [min, max]
    AXES = "axes"  # each slice along --axes scaled on its own (whole tensor in memory)


class Reason(str, Enum):
    """Why a tensor gets its Action; clipcli.report renders each one."""

    NOT_SELECTED = "not selected"  # by --include/--exclude
    LEFT_OUT = "left out"  # optimizer state or a buffer (clipcli.jobs.roles)
    NOT_FLOATING = "not floating point"
    NONFINITE_SKIPPED = "non-finite skipped"  # --skip-nonfinite
    LOW_RANK_SKIPPED = "low rank skipped"  # --skip-low-rank
    COMPLEX_UNORDERED = "complex unordered"  # value mode: no order to clamp by
    WITHIN_RANGE = "within range"
    WITHIN_LIMIT = "within limit"
    ZERO_TENSOR = "zero tensor"
    OVER_LIMIT = "over limit"  # scaled
    OVER_RANGE = "over range"  # clamped
    PER_SLICE = "per slice"  # --axes: the outcome says how many slices changed
    CONVERTED = "converted"  # convert: copied into another format, no clip asked


# Tensors that never enter the global norm nor any factor.
_OUTSIDE = frozenset({Reason.NOT_SELECTED, Reason.LEFT_OUT, Reason.NOT_FLOATING})


@dataclass(frozen=True, slots=True)  # slots: one per tensor, 200,000 of them
class TensorPlan:
    info: TensorInfo
    before: NormAccumulator
    action: Action
    reason: Reason
    role: roles.Role = roles.Role.WEIGHT
    factor: float | None = None  # SCALE: factor * 2**exponent
    exponent: int = 0
    axes: tuple[int, ...] = ()  # AXES: resolved against this tensor's rank
    group: str | None = None  # --group-by: the group whose norm decided
    # SCALE: the factor was rounded down to a power of two (E8M0 scales: MXFP4)
    power_of_two: bool = False
    tied_to: str | None = None  # the plan of this earlier tensor, whose values it shares

    @property
    def in_global(self) -> bool:
        """Counted in the global norm (and in the factor of --global); a tied tensor is
        counted once, as the tensor it is tied to."""
        return (
            self.reason not in _OUTSIDE
            and self.reason is not Reason.NONFINITE_SKIPPED
            and self.tied_to is None
        )

    @property
    def unchanged(self) -> bool:
        """Written bit for bit, whatever the data (AXES may turn out unchanged too)."""
        return self.action is Action.KEEP

    @property
    def scale(self) -> float | None:
        """The factor applied (SCALE only), for the report."""
        return None if self.factor is None else math.ldexp(self.factor, self.exponent)


@dataclass(frozen=True)
class Plan:
    spec: ClipSpec | None  # None: a plain copy (convert)
    tensors: tuple[TensorPlan, ...]
    used_norm: float | None = None  # the G that --global scaled by

    @property
    def global_before(self) -> float:
        return global_norm(p.before.norm for p in self.tensors if p.in_global)


@dataclass(slots=True)
class Flushes:
    """Values the rounding of a scaled tensor took to zero, or newly to a subnormal (filled
    in while the tensor streams, as Outcome.after is)."""

    to_zero: int = 0
    to_subnormal: int = 0

    def add(self, to_zero: int, to_subnormal: int) -> None:
        self.to_zero += to_zero
        self.to_subnormal += to_subnormal


class _NothingFlushed(Flushes):
    """Flushes that stay at zero: shared by the outcomes settled at once with nothing
    flushed (small tensors written together, 200,000 of them), so never added to."""

    __slots__ = ()

    def add(self, to_zero: int, to_subnormal: int) -> None:  # noqa: ARG002
        raise TypeError("NOTHING_FLUSHED is shared: an outcome that streams has its own")


NOTHING_FLUSHED: Flushes = _NothingFlushed()


def _nothing_flushed() -> Flushes:
    return NOTHING_FLUSHED


@dataclass(frozen=True, slots=True)
class Outcome:
    """What the write pass did to one tensor. `after`: the statistics of what was written
    (a NormAccumulator, which a streamed tensor fills in as it goes, or just its norm)."""

    after: Normed = field(default_factory=NormAccumulator)
    changed: bool = False
    slices_clipped: int = 0  # AXES only
    slices: int = 0
    # NOTHING_FLUSHED unless given: an outcome that counts flushes as it streams is made
    # with a Flushes of its own (a new one for each of 200,000 unchanged tensors cost
    # ~0.8 us and 48 bytes apiece).
    flushes: Flushes = field(default_factory=_nothing_flushed)


def copy_plan(infos: Iterable[TensorInfo]) -> Plan:
    """Every tensor copied as it is (convert)."""
    empty = NormAccumulator()
    tensors = tuple(TensorPlan(i, empty, Action.KEEP, Reason.CONVERTED) for i in infos)
    return Plan(None, tensors)


def outside_reason(t: TensorStats) -> Reason | None:
    """Why a tensor is outside every norm and clip, None if it counts."""
    if not t.selected:
        return Reason.NOT_SELECTED
    if t.role.kept_apart:
        return Reason.LEFT_OUT
    if not is_floating(t.info.dtype):
        return Reason.NOT_FLOATING
    return None


def value_decision(spec: ClipSpec, t: TensorStats) -> tuple[Action, Reason]:
    """Value mode for one counted tensor. DataRefusedError if it has values and its dtype
    holds none in [min, max]; an empty tensor has nothing to clamp either way."""
    if t.info.dtype.kind == "c":
        return Action.KEEP, Reason.COMPLEX_UNORDERED
    if t.stats.numel:
        low, high = rounding.value_bounds(t.info.dtype, spec.low, spec.high)
        if t.stats.min_value < float(low) or t.stats.max_value > float(high):
            return Action.CLAMP, Reason.OVER_RANGE
    return Action.KEEP, Reason.WITHIN_RANGE


def plan(measurement: Measurement, spec: ClipSpec, check: OutputCheck) -> Plan:
    """Decide what happens to every tensor. Raises (exit 4) before anything is written:
    non-finite values where a norm is needed, axes that do not fit, unreachable limits."""
    # By position (a list, not a dict: 200,000 tensors), filled in below.
    decided: list[TensorPlan | None] = [None] * len(measurement.tensors)
    # Positions, as an array: pairs with the stats cost 12 MB on 200,000 tensors, and a
    # list of ints 7 MB (an int object each).
    counted = array("l")
    position: dict[str, int] | None = None  # name -> index, made once a tie is met
    tied: list[tuple[int, TensorStats, int]] = []  # follow the plan of the tensor tied to
    for index, t in enumerate(measurement.tensors):
        if t.tied_to is not None:
            if position is None:
                position = {u.info.name: k for k, u in enumerate(measurement.tensors)}
            if t.tied_to in position:
                tied.append((index, t, position[t.tied_to]))
                continue
        reason = outside_reason(t)
        if reason is None:
            counted.append(index)
        else:
            decided[index] = TensorPlan(t.info, t.stats, Action.KEEP, reason, t.role)
    if spec.mode is not Mode.VALUE:
        counted = _skip_nonfinite(measurement, counted, spec, decided)
    members = [measurement.tensors[index] for index in counted]
    if spec.mode is Mode.VALUE:
        made = _plan_value(measurement, members, spec)
    elif spec.mode is Mode.NORM and spec.axes is not None:
        made = _plan_axes(measurement, members, spec)
    elif spec.mode in (Mode.NORM, Mode.AVERAGE):
        made = _plan_each(members, spec, check)
    elif spec.group_by is not None:
        made = _plan_groups(members, spec, check)
    elif spec.use_norm is not None:
        factor = tf_factor(spec.use_norm, spec.limit)
        made = [_scaled(t, factor if t.norm > 0 else None) for t in members]
    else:
        factor = search_factor(members, spec.limit, check)
        made = [_scaled(t, factor if t.stats.ssq > 0 else None) for t in members]
    made = _powers_of_two(made, check)
    for index, made_plan in zip(counted, made, strict=True):
        decided[index] = made_plan
    for index, t, first in tied:
        # The same values as `first`: the same action and factor, so the same bytes out.
        first_plan = decided[first]
        assert first_plan is not None  # a tie names an untied tensor, planned above
        decided[index] = replace(first_plan, info=t.info, before=t.stats, tied_to=t.tied_to)
    tensors = tuple(_every_one(decided))
    used = None
    if spec.mode is Mode.GLOBAL and spec.group_by is None:
        # The plans in the global norm are those of `members`, in the same order (each
        # counted tensor's plan comes from _scaled; tied and skipped ones are outside).
        counts = (t.norm for t in members)
        used = spec.use_norm if spec.use_norm is not None else global_norm(counts)
    return Plan(spec, tensors, used)


def _every_one(decided: list[TensorPlan | None]) -> list[TensorPlan]:
    """The plans, every position filled (each tensor is outside, counted or tied)."""
    if any(p is None for p in decided):  # `is`: `None in` would call each plan's __eq__
        raise AssertionError("a tensor was left without a plan")
    return decided  # type: ignore[return-value]  # no None, checked above


def _skip_nonfinite(
    measurement: Measurement,
    counted: array[int],
    spec: ClipSpec,
    decided: list[TensorPlan | None],
) -> array[int]:
    """Tensors with NaN/Inf cannot be measured against a norm: refused (exit 4), or with
    --skip-nonfinite left unchanged and out of the global norm. `counted`: positions in
    the measurement."""
    tensors = measurement.tensors
    bad = [(index, tensors[index]) for index in counted if tensors[index].stats.nonfinite]
    if not bad:
        return counted
    if not spec.skip_nonfinite:
        listed = ", ".join(f"{t.info.name!r} ({t.stats.nonfinite} non-finite)" for _, t in bad)
        raise DataRefusedError(
            f"{measurement.path}: NaN/Inf values where a norm is needed: {listed}; "
            "pass --skip-nonfinite to leave them"
        )
    for index, t in bad:
        decided[index] = TensorPlan(t.info, t.stats, Action.KEEP, Reason.NONFINITE_SKIPPED)
    return array("l", (index for index in counted if not tensors[index].stats.nonfinite))


def _powers_of_two(made: list[TensorPlan], check: OutputCheck) -> list[TensorPlan]:
    """Each scaled tensor whose stored scales hold powers of two only (the check's
    optional power_of_two: MXFP4) with its factor f as it is applied: 2**-k <= f, the
    largest power of two at or below it. The factor search checked the output at that
    very step (the view scales by it), so a group's bound holds; the tensor's own part
    of it is at or below the plan's, since 2**-k <= f and its scaling is exact."""
    is_power = getattr(check, "power_of_two", None)
    if is_power is None:
        return made
    rounded = []
    for p in made:
        if p.action is Action.SCALE and p.factor is not None and is_power(p.info):
            steps = rounding.power_of_two_steps(p.factor, p.exponent)
            p = replace(p, factor=1.0, exponent=-steps, power_of_two=True)
        rounded.append(p)
    return rounded


def _scaled(t: TensorStats, factor: Factor | None, group: str | None = None) -> TensorPlan:
    if factor is not None:
        # Positional: one per tensor of 200,000, keywords cost more to pass.
        return TensorPlan(
            t.info,
            t.stats,
            Action.SCALE,
            Reason.OVER_LIMIT,
            roles.Role.WEIGHT,
            factor.mantissa,
            factor.exponent,
            (),
            group,
        )
    reason = Reason.ZERO_TENSOR if t.norm == 0 else Reason.WITHIN_LIMIT
    return TensorPlan(t.info, t.stats, Action.KEEP, reason, roles.Role.WEIGHT, None, 0, (), group)


def _plan_value(
    measurement: Measurement, members: Sequence[TensorStats], spec: ClipSpec
) -> list[TensorPlan]:
    made, problems = [], []
    for t in members:
        try:
            action, reason = value_decision(spec, t)
        except DataRefusedError as exc:
            problems.append(f"tensor {t.info.name!r}: {exc}")
            continue
        made.append(TensorPlan(t.info, t.stats, action, reason))
    if problems:  # name every tensor that cannot be clamped, not just the first
        raise DataRefusedError(f"{measurement.path}: " + "; ".join(problems))
    return made


def _plan_axes(
    measurement: Measurement, members: Sequence[TensorStats], spec: ClipSpec
) -> list[TensorPlan]:
    assert spec.axes is not None
    made, problems = [], []
    for t in members:
        if spec.skip_low_rank and not axes_fit(spec.axes, t.info.shape):
            made.append(TensorPlan(t.info, t.stats, Action.KEEP, Reason.LOW_RANK_SKIPPED))
            continue
        try:
            axes = normalize_axes(spec.axes, t.info.shape, t.info.name)
        except DataRefusedError as exc:
            problems.append(str(exc))
            continue
        made.append(TensorPlan(t.info, t.stats, Action.AXES, Reason.PER_SLICE, axes=axes))
    if problems:  # name every tensor the axes do not fit, not just the first
        raise DataRefusedError(f"{measurement.path}: " + "; ".join(problems))
    return made


def _plan_each(
    members: Sequence[TensorStats], spec: ClipSpec, check: OutputCheck
) -> list[TensorPlan]:
    """--norm and --average: each tensor scaled to its own limit, which depends on its
    size alone (worked out once per size: a Fraction each for 200,000 tensors was ~10 us)."""
    limits: dict[int, tuple[float, Fraction | None]] = {}

    def limit_of(t: TensorStats) -> tuple[float, Fraction | None]:
        numel = t.info.numel
        found = limits.get(numel)
        if found is None:
            found = limits[numel] = (tensor_limit(spec, numel), exact_limit(spec, numel))
        return found

    factors = search_each_factor((((t,), *limit_of(t)) for t in members), check)
    return [_scaled(t, factor) for t, factor in zip(members, factors, strict=True)]


def _plan_groups(
    members: Sequence[TensorStats], spec: ClipSpec, check: OutputCheck
) -> list[TensorPlan]:
    """--global within each --group-by group: one factor per group."""
    assert spec.group_by is not None
    pattern = compile_group_by(spec.group_by)
    groups: dict[str, list[TensorStats]] = {}
    for t in members:
        groups.setdefault(group_key(t.info.name, pattern), []).append(t)
    problems = ((group, spec.limit, None) for group in groups.values())
    factors = dict(zip(groups, search_each_factor(problems, check), strict=True))
    made = []
    for t in members:
        group = group_key(t.info.name, pattern)
        factor = factors[group]
        made.append(_scaled(t, factor if t.stats.ssq > 0 else None, group))
    return made


class EarlyVerdict:
    """The plan's rules applied while tensors are still being measured, for copying
    unchanged tensors ahead: True for a tensor the plan will most likely leave alone.

    Per-tensor modes know this for sure from the tensor alone. In global mode the norm so
    far only grows, so tensors are passed on while it is within the limit and never after:
    when the whole checkpoint is within the limit every tensor is copied during the
    measuring pass, and when it is not, only the prefix measured before the limit was
    crossed gets copied in vain. The plan, not this guess, decides what is written."""

    def __init__(self, spec: ClipSpec) -> None:
        self.spec = spec
        self._so_far = NormAccumulator()
        self._crossed = False  # the global norm so far is over the limit: it stays so

    def unchanged(self, t: TensorStats) -> bool:
        spec = self.spec
        if outside_reason(t) is not None:
            return True
        if t.stats.nonfinite or spec.axes is not None or spec.group_by is not None:
            return False
        if spec.mode is Mode.GLOBAL:
            if spec.use_norm is not None:
                return scaling.tf_scale(spec.use_norm, spec.limit) is None
            if self._crossed:
                return False
            self._so_far.merge(t.stats)
            within = self._so_far.limit_ratio(spec.limit) >= 1.0
            self._crossed = not within
            return within
        if spec.mode is Mode.VALUE:
            try:
                return value_decision(spec, t)[0] is Action.KEEP
            except DataRefusedError:
                return False
        return t.stats.limit_ratio(tensor_limit(spec, t.info.numel)) >= 1.0
