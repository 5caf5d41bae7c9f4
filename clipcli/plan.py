"""Pure planning: the validated clip request (ClipSpec) and the plan, a frozen value.

`plan(measurement, spec, check)` decides, for every tensor, an Action and the Reason for
it; the report alone turns reasons into words, and no decision ever reads a display
string. `clipcli.pipeline.execute` carries the plan out and reports what happened
(Outcome) without editing it. Nothing here reads a file: the one data pass a factor
search may need (float32 and wider) is the `check` callback the caller supplies.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum

from clipcli import roles
from clipcli.dtypes import is_floating
from clipcli.errors import DataRefusedError, UsageError
from clipcli.factor import Factor, OutputCheck, search_factor, tf_factor
from clipcli.formats.base import TensorInfo
from clipcli.groups import compile_group_by, group_key
from clipcli.measurement import Measurement, TensorStats
from clipcli.numerics import rounding, scaling
from clipcli.numerics.norms import NormAccumulator, global_norm


class Mode(str, Enum):
    VALUE = "value"
    NORM = "norm"
    AVERAGE = "average"
    GLOBAL = "global"


@dataclass(frozen=True)
class ClipSpec:
    """A validated clipping request."""

    mode: Mode
    limit: float = math.inf  # C for the norm modes
    low: float = -math.inf  # value mode bounds
    high: float = math.inf
    axes: tuple[int, ...] | None = None
    use_norm: float | None = None
    skip_nonfinite: bool = False
    group_by: str | None = None  # --global within each group of tensors
    skip_low_rank: bool = False  # --axes: leave tensors of too low a rank unchanged

    def describe_limit(self) -> str:
        if self.mode is Mode.VALUE:
            return f"[{self.low:g}, {self.high:g}]"
        return f"{self.limit:g}"


def _check_positive(flag: str, value: float) -> None:
    if math.isnan(value) or value <= 0:
        raise UsageError(f"{flag} must be a positive number, got {value:g}")


def build_spec(
    *,
    low: float | None = None,
    high: float | None = None,
    value: float | None = None,
    norm: float | None = None,
    average: float | None = None,
    global_: float | None = None,
    axes: Sequence[int] | None = None,
    use_norm: float | None = None,
    skip_nonfinite: bool = False,
    group_by: str | None = None,
    skip_low_rank: bool = False,
) -> ClipSpec:
    """Turn the CLI flags into a ClipSpec, refusing conflicts and bad values (exit 2)."""
    chosen = {
        "--min/--max": low is not None or high is not None,
        "--value": value is not None,
        "--norm": norm is not None,
        "--average": average is not None,
        "--global": global_ is not None,
    }
    modes = [flag for flag, given in chosen.items() if given]
    if not modes:
        raise UsageError("choose a mode: --min/--max, --value, --norm, --average or --global")
    if len(modes) > 1:
        raise UsageError(f"choose one mode, got {' and '.join(modes)}")
    if axes is not None and norm is None:
        raise UsageError("--axes is valid only with --norm")
    if skip_low_rank and axes is None:
        raise UsageError("--skip-low-rank is valid only with --norm --axes")
    if use_norm is not None and global_ is None:
        raise UsageError("--use-norm is valid only with --global")
    if group_by is not None:
        if global_ is None:
            raise UsageError("--group-by is valid only with --global (per-group global norm)")
        if use_norm is not None:
            raise UsageError("--use-norm and --group-by cannot be combined")
        compile_group_by(group_by)
    if value is not None:
        _check_positive("--value", value)
        low, high = -value, value
    if low is not None or high is not None:
        lo = -math.inf if low is None else low
        hi = math.inf if high is None else high
        if math.isnan(lo) or math.isnan(hi):
            raise UsageError("--min and --max must be numbers, got nan")
        if lo > hi:
            raise UsageError(f"--min {lo:g} is greater than --max {hi:g}")
        return ClipSpec(Mode.VALUE, low=lo, high=hi, skip_nonfinite=skip_nonfinite)
    if norm is not None:
        _check_positive("--norm", norm)
        checked_axes = None
        if axes is not None:
            if not axes:
                raise UsageError("--axes needs at least one axis")
            if len(set(axes)) != len(axes):
                raise UsageError(f"--axes has a duplicate axis: {','.join(map(str, axes))}")
            checked_axes = tuple(axes)
        return ClipSpec(
            Mode.NORM,
            limit=norm,
            axes=checked_axes,
            skip_nonfinite=skip_nonfinite,
            skip_low_rank=skip_low_rank,
        )
    if average is not None:
        _check_positive("--average", average)
        return ClipSpec(Mode.AVERAGE, limit=average, skip_nonfinite=skip_nonfinite)
    assert global_ is not None
    _check_positive("--global", global_)
    if use_norm is not None:
        _check_positive("--use-norm", use_norm)
        if math.isinf(use_norm):  # TF's factor C / inf is 0: every tensor zeroed
            raise UsageError("--use-norm must be finite; --use-norm inf would zero every tensor")
    return ClipSpec(
        Mode.GLOBAL,
        limit=global_,
        use_norm=use_norm,
        skip_nonfinite=skip_nonfinite,
        group_by=group_by,
    )


def normalize_axes(axes: tuple[int, ...], shape: tuple[int, ...], name: str) -> tuple[int, ...]:
    """Resolve negative axes against one tensor's rank; out of range is refused data (exit 4)."""
    rank = len(shape)
    resolved = []
    for axis in axes:
        if not -rank <= axis < rank:
            raise DataRefusedError(
                f"tensor {name!r} with shape {list(shape)} has no axis {axis} (rank {rank})"
            )
        resolved.append(axis % rank)
    if len(set(resolved)) != len(resolved):
        raise DataRefusedError(f"tensor {name!r}: --axes {axes} name the same axis twice")
    return tuple(resolved)


def tensor_limit(spec: ClipSpec, numel: int) -> float:
    """The norm a single tensor may have: C, or C * numel for TF's average norm."""
    if spec.mode is Mode.AVERAGE:
        return spec.limit * numel
    return spec.limit


def axes_fit(axes: Sequence[int], shape: Sequence[int]) -> bool:
    """Whether every axis names a dimension of a tensor of this shape."""
    return all(-len(shape) <= axis < len(shape) for axis in axes)


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
    LEFT_OUT = "left out"  # optimizer state or a buffer (clipcli.roles)
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


@dataclass(frozen=True)
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

    @property
    def in_global(self) -> bool:
        """Counted in the global norm (and in the factor of --global)."""
        return self.reason not in _OUTSIDE and self.reason is not Reason.NONFINITE_SKIPPED

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


@dataclass(frozen=True)
class Outcome:
    """What the write pass did to one tensor."""

    after: NormAccumulator = field(default_factory=NormAccumulator)
    changed: bool = False
    slices_clipped: int = 0  # AXES only
    slices: int = 0


def copy_plan(infos: Iterable[TensorInfo]) -> Plan:
    """Every tensor copied as it is (convert)."""
    empty = NormAccumulator()
    tensors = tuple(TensorPlan(i, empty, Action.KEEP, Reason.CONVERTED) for i in infos)
    return Plan(None, tensors)


def outside_reason(t: TensorStats) -> Reason | None:
    """Why a tensor is outside every norm and clip, None if it counts."""
    if not t.selected:
        return Reason.NOT_SELECTED
    if t.role is not roles.Role.WEIGHT:
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
    decided: dict[int, TensorPlan] = {}
    counted: list[tuple[int, TensorStats]] = []
    for index, t in enumerate(measurement.tensors):
        reason = outside_reason(t)
        if reason is None:
            counted.append((index, t))
        else:
            decided[index] = TensorPlan(t.info, t.stats, Action.KEEP, reason, t.role)
    if spec.mode is not Mode.VALUE:
        counted = _skip_nonfinite(measurement, counted, spec, decided)
    members = [t for _, t in counted]
    if spec.mode is Mode.VALUE:
        made = _plan_value(measurement, members, spec)
    elif spec.mode is Mode.NORM and spec.axes is not None:
        made = _plan_axes(measurement, members, spec)
    elif spec.mode in (Mode.NORM, Mode.AVERAGE):
        made = [
            _scaled(t, search_factor([t], tensor_limit(spec, t.info.numel), check)) for t in members
        ]
    elif spec.group_by is not None:
        made = _plan_groups(members, spec, check)
    elif spec.use_norm is not None:
        factor = tf_factor(spec.use_norm, spec.limit, [t.info.dtype for t in members])
        made = [_scaled(t, factor if t.stats.norm > 0 else None) for t in members]
    else:
        factor = search_factor(members, spec.limit, check)
        made = [_scaled(t, factor if t.stats.ssq > 0 else None) for t in members]
    decided.update(zip((index for index, _ in counted), made, strict=True))
    tensors = tuple(decided[index] for index in range(len(measurement.tensors)))
    used = None
    if spec.mode is Mode.GLOBAL and spec.group_by is None:
        counts = (p.before.norm for p in tensors if p.in_global)
        used = spec.use_norm if spec.use_norm is not None else global_norm(counts)
    return Plan(spec, tensors, used)


def _skip_nonfinite(
    measurement: Measurement,
    counted: list[tuple[int, TensorStats]],
    spec: ClipSpec,
    decided: dict[int, TensorPlan],
) -> list[tuple[int, TensorStats]]:
    """Tensors with NaN/Inf cannot be measured against a norm: refused (exit 4), or with
    --skip-nonfinite left unchanged and out of the global norm."""
    bad = [(index, t) for index, t in counted if t.stats.nonfinite]
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
    return [(index, t) for index, t in counted if not t.stats.nonfinite]


def _scaled(t: TensorStats, factor: Factor | None, group: str | None = None) -> TensorPlan:
    if factor is not None:
        return TensorPlan(
            t.info,
            t.stats,
            Action.SCALE,
            Reason.OVER_LIMIT,
            factor=factor.mantissa,
            exponent=factor.exponent,
            group=group,
        )
    reason = Reason.ZERO_TENSOR if t.stats.norm == 0 else Reason.WITHIN_LIMIT
    return TensorPlan(t.info, t.stats, Action.KEEP, reason, group=group)


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


def _plan_groups(
    members: Sequence[TensorStats], spec: ClipSpec, check: OutputCheck
) -> list[TensorPlan]:
    """--global within each --group-by group: one factor per group."""
    assert spec.group_by is not None
    pattern = compile_group_by(spec.group_by)
    groups: dict[str, list[TensorStats]] = {}
    for t in members:
        groups.setdefault(group_key(t.info.name, pattern), []).append(t)
    factors = {name: search_factor(group, spec.limit, check) for name, group in groups.items()}
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

    def unchanged(self, t: TensorStats) -> bool:
        spec = self.spec
        if outside_reason(t) is not None:
            return True
        if t.stats.nonfinite or spec.axes is not None or spec.group_by is not None:
            return False
        if spec.mode is Mode.GLOBAL:
            if spec.use_norm is not None:
                return scaling.tf_scale(spec.use_norm, spec.limit) is None
            self._so_far.merge(t.stats)
            return self._so_far.limit_ratio(spec.limit) >= 1.0
        if spec.mode is Mode.VALUE:
            try:
                return value_decision(spec, t)[0] is Action.KEEP
            except DataRefusedError:
                return False
        return t.stats.limit_ratio(tensor_limit(spec, t.info.numel)) >= 1.0
