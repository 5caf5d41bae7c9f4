"""The clip request: the mode and its limits, validated from the CLI flags (ClipSpec),
and the per-tensor facts that follow from it alone (axes, the limit of one tensor)."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from fractions import Fraction

from clipcli.errors import DataRefusedError, UsageError
from clipcli.jobs.groups import compile_group_by


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
    """The norm a single tensor is scaled to: exact_limit rounded down to a float (the
    float product C * numel may round up past the exact one, and the limit is a promise:
    a float64 tensor scaled to a limit 1 ulp too generous exceeds it)."""
    if spec.mode is not Mode.AVERAGE or not math.isfinite(spec.limit):
        # C itself (a float is its own exact value): asked of each of 200,000 tensors
        # while they are measured, where making the Fraction cost ~5 us.
        return float(spec.limit) if math.isfinite(spec.limit) else math.inf
    return _average_limit(spec.limit, numel)


@functools.lru_cache(maxsize=256)
def _average_limit(limit: float, numel: int) -> float:
    """--average's C * numel rounded down to a float (a tensor's size recurs: each
    expert's tensors have one of a few)."""
    exact = Fraction(limit) * numel
    try:
        value = float(exact)
    except OverflowError:
        return math.inf
    return math.nextafter(value, 0.0) if Fraction(value) > exact else value


def exact_limit(spec: ClipSpec, numel: int) -> Fraction | None:
    """The per-tensor limit as a real number: what "within the limit" is decided against
    (tensor_limit is its rounding down, the target a clipped tensor is scaled to); None for
    an infinite limit (nothing is over it)."""
    if not math.isfinite(spec.limit):
        return None
    if spec.mode is Mode.AVERAGE:
        return Fraction(spec.limit) * numel
    return Fraction(spec.limit)


def axes_fit(axes: Sequence[int], shape: Sequence[int]) -> bool:
    """Whether every axis names a dimension of a tensor of this shape."""
    return all(-len(shape) <= axis < len(shape) for axis in axes)
