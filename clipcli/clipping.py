"""Pure clipping semantics: the four modes, their options, and scale factors. No I/O.

The formulas are TensorFlow's (clip_by_value, clip_by_norm, clip_by_average_norm,
clip_by_global_norm). Where we differ, on purpose:
- limits must be positive (TF zeroes or flips the sign of the tensor);
- a tensor within its limit is left bit-identical (TF's t*c/c moves it by about 1 ulp);
- the scale is chosen so that the *rounded* output's norm never exceeds the limit, which
  makes clipping idempotent: clip(clip(x)) == clip(x).
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import numpy as np

from clipcli import float16, lookup
from clipcli.errors import DataRefusedError, UsageError
from clipcli.formats.base import finfo, is_floating
from clipcli.norms import (
    slice_blocks,
    slice_norms,
    slice_sumsq,
    smallest_subnormal,
    unit_roundoff,
)

# Relative slack for errors of the float64 norm itself (~1e-13 for any size).
_NORM_SLACK = 1e-12
# A provably safe scale this close to TF's is used directly; lower precisions refine.
_FIDELITY = 1e-6
# Extra shrink per refinement step, past the measured overshoot: a few float64 ulps.
_REFINE_STEP = 2.0**-53


# `--group-by layer`: one alternative per layout (FORMATS.md, "Layouts met in real
# checkpoints"); the first that matches names the group. Anchored ones come first.
LAYER_PRESET = (
    # legacy Keras full model: model_weights/dense_1/dense_1/kernel:0 -> dense_1
    r"^model_weights/([^/]+)/"
    # Keras 3, flat and nested: layers/dense/vars/0 -> dense,
    # block1/layers/conv2d/vars/0 -> block1/layers/conv2d
    r"|^(?:layers/)?((?:[^/]+/)*?[^/]+)/vars/\d+$"
    # Keras 2 save_weights: dense_1/dense_1/kernel:0 at the root -> dense_1
    r"|^([^/]+)/.+:\d+$"
    # HF/PyTorch: model.layers.3.mlp..., transformer.h.3..., encoder.layer.3..., blocks.3...
    r"|^(.*?\b(?:layers|layer|blocks|block|h)[._/]\d+)(?=[._/])"
)
OTHER_GROUP = "(other)"


def compile_group_by(text: str) -> re.Pattern[str]:
    """The --group-by regex ('layer' is the built-in preset); a bad regex is a usage error."""
    try:
        return re.compile(LAYER_PRESET if text == "layer" else text)
    except re.error as exc:
        raise UsageError(f"--group-by {text!r} is not a valid regex: {exc}") from None


def group_key(name: str, pattern: re.Pattern[str]) -> str:
    """The first capture group that matched, else the whole match; OTHER_GROUP if none."""
    match = pattern.search(name)
    if match is None:
        return OTHER_GROUP
    for captured in match.groups():
        if captured is not None:
            return captured
    return match.group(0)


NaturalKey = tuple[str | tuple[int, str, int], ...]


def natural_key(name: str) -> NaturalKey:
    """Sort key that compares digit runs as numbers: layers.2 before layers.10.

    A run is compared by (digit count without leading zeros, those digits, full length),
    which orders numbers of any length without int(): Python refuses to convert more than
    4300 digits, and a tensor name is data that may hold a 5,000-digit layer number. Only
    ASCII digits form runs; '²' or '٣' stay text. split() with one group alternates text
    (even positions) and runs (odd positions), so equal positions always hold equal types.
    """
    key: list[str | tuple[int, str, int]] = []
    for position, part in enumerate(_DIGITS.split(name)):
        if position % 2:
            digits = part.lstrip("0")
            key.append((len(digits), digits, len(part)))
        else:
            key.append(part)
    return tuple(key)


def group_order(name: str) -> tuple[bool, NaturalKey]:
    """Groups in natural name order, with the tensors that matched no group last."""
    return name == OTHER_GROUP, natural_key(name)


_DIGITS = re.compile(r"([0-9]+)")


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


def tf_scale(norm: float, limit: float) -> float | None:
    """TF's factor C / max(norm, C); None when the tensor stays as it is."""
    if norm <= limit or norm == 0.0 or math.isinf(limit) or not math.isfinite(norm):
        return None
    return limit / norm


def safe_scale(limit: float, norm: float, numel: int, dtypes: Sequence[np.dtype[Any]]) -> float:
    """A scale for which the rounded output's norm provably stays within `limit`.

    Rounding each scaled element to its dtype moves it by at most u*|x| (normal values) or
    half a subnormal step; by the triangle inequality the output norm is then at most
    s*norm*(1+u) + sqrt(numel)*step/2.
    """
    u = max((unit_roundoff(d) for d in dtypes), default=0.0)
    if any(d.itemsize <= 2 and is_floating(d) for d in dtypes):
        u += unit_roundoff(np.dtype(np.float32))  # computed in float32 before the last rounding
    step = max((smallest_subnormal(d) for d in dtypes), default=0.0)
    headroom = limit * (1 - _NORM_SLACK) - math.sqrt(numel) * step / 2
    return max(headroom, 0.0) / (norm * (1 + u))


def choose_scale(
    limit: float,
    ratio: float,
    numel: int,
    dtypes: Sequence[np.dtype[Any]],
    output_norm: Callable[[float], float],
    tries: int = 3,
) -> float | None:
    """The scale to apply, or None to leave the data unchanged. `ratio` is limit / norm
    (NormAccumulator.limit_ratio), so norms beyond float64's range still clip.

    TF's factor is used when rounding provably cannot push the output over the limit (or
    nearly: float32 and float64). For float16/bf16/fp8 that guarantee would cost up to 12%
    of the norm, so we try TF's factor and shrink it only if the rounded output measures
    over the limit, falling back to the guaranteed factor after `tries` attempts.
    """
    if not ratio < 1.0 or math.isinf(limit):  # within the limit, a zero norm, or C = inf
        return None
    tf = ratio
    guaranteed = safe_scale(limit, 1.0, numel, dtypes) * ratio / limit
    u = max((unit_roundoff(d) for d in dtypes), default=0.0)
    if tf - guaranteed <= tf * min(_FIDELITY, 4 * u):
        # float32: the provable factor is within a few ulps of TF's, so take it directly.
        return guaranteed
    # float64 (whose provable factor would cost 1e-12, the float64 norm's own error) and
    # 16/8-bit floats (where it would cost up to 12%): try TF's factor and shrink it only
    # as far as the measured, rounded output requires.
    scale = tf
    for _ in range(tries):
        measured = output_norm(scale)
        if measured <= limit:
            return scale
        scale = max(scale * limit / measured * (1 - _REFINE_STEP), guaranteed)
    return guaranteed


def compute_dtype(dtype: np.dtype[Any]) -> np.dtype[Any]:
    """float64 for float32/float64 (and complex), float32 for 16-bit and 8-bit floats."""
    if dtype.kind == "c":
        return np.dtype(np.complex128)
    if dtype.itemsize <= 2:
        return np.dtype(np.float32)
    return np.dtype(np.float64)


# Below this, limit / norm is kept as a mantissa and a power of two (see TINY_RATIO users).
TINY_RATIO = 2.0**-900


def scale_chunk(chunk: np.ndarray, scale: float | np.ndarray, exponent: int = 0) -> np.ndarray:
    """chunk * scale * 2**exponent, computed wide and rounded once to the chunk's dtype.
    The exponent carries factors too small for a float64 (C / ||t|| below 1e-308)."""
    if np.ndim(scale) == 0 and (chunk.dtype == np.float16 or lookup.is_float8(chunk.dtype)):
        return lookup.look_up(chunk, _scale_table(chunk.dtype, float(scale), exponent))
    return _scale(chunk, scale, exponent)


@functools.lru_cache(maxsize=16)
def _scale_table(dtype: np.dtype[Any], scale: float, exponent: int) -> np.ndarray:
    """Every value of an 8- or 16-bit float scaled as _scale does, as bits. One table per
    scale serves every chunk: a global clip has one scale for the whole checkpoint."""
    table = lookup.table_of(dtype, lambda values: _scale(values, scale, exponent))
    table.flags.writeable = False
    return table


def _scale(chunk: np.ndarray, scale: float | np.ndarray, exponent: int) -> np.ndarray:
    work = compute_dtype(chunk.dtype)
    if exponent:
        work = np.dtype(np.complex128 if work.kind == "c" else np.float64)
        # Fold the mantissa's own power of two into the exponent: a mantissa like 1e16
        # would overflow a float64 element near 1e300 before the exponent brings it down.
        scale, shift = math.frexp(float(scale))
        exponent += shift
    factor = np.asarray(scale, dtype=np.float64).astype(
        work.char.lower() if work.kind == "c" else work
    )
    wide = None
    if work == np.float32 and chunk.dtype == np.float16:
        wide = float16.finite_as_float32(chunk)
    if wide is None:
        wide = chunk.astype(work)
    wide *= factor
    if exponent:
        if wide.dtype.kind == "c":
            wide = np.ldexp(wide.real, exponent) + 1j * np.ldexp(wide.imag, exponent)
        else:
            np.ldexp(wide, exponent, out=wide)
    if chunk.dtype == np.float16 and wide.dtype == np.float32:
        return float16.from_float32(wide)  # numpy's cast: 70 ns per subnormal result
    scaled: np.ndarray = wide.astype(chunk.dtype)
    return scaled


def value_bounds(dtype: np.dtype[Any], low: float, high: float) -> tuple[np.ndarray, np.ndarray]:
    """[low, high] shrunk to the nearest values the dtype can hold, so clamping never overshoots."""
    lo = _representable(dtype, low, toward=1)
    hi = _representable(dtype, high, toward=-1)
    if float(lo) > float(hi):
        raise DataRefusedError(
            f"no {dtype.name} value lies in [{low:g}, {high:g}]; value clipping is impossible"
        )
    return lo, hi


def _representable(dtype: np.dtype[Any], value: float, toward: int) -> np.ndarray:
    """The dtype value (0-d) nearest `value` that is >= it (toward=1) or <= it (toward=-1)."""
    info_max = float(finfo(dtype).max)
    if math.isinf(value) or abs(value) > info_max:
        # Beyond the dtype's range: the nearest value on the allowed side is either its
        # largest finite value or an infinity (built directly: a cast would warn of overflow).
        if (value > 0) == (toward < 0) and math.isfinite(value):
            return np.asarray(math.copysign(info_max, value)).astype(dtype)
        return np.asarray(math.copysign(math.inf, value)).astype(dtype)
    candidate = np.asarray(value).astype(dtype)
    if (float(candidate) - value) * toward >= 0:
        return candidate
    return _next_toward(candidate, toward)


def _next_toward(value: np.ndarray, direction: int) -> np.ndarray:
    """The adjacent representable value (sign-magnitude float bit patterns)."""
    uint = np.dtype(f"u{value.dtype.itemsize}")
    bits = int(value.view(uint))
    sign_bit = 1 << (8 * value.dtype.itemsize - 1)
    negative = bool(bits & sign_bit)
    magnitude = bits & ~sign_bit
    if magnitude == 0:
        bits = 1 if direction > 0 else sign_bit | 1
    elif negative == (direction > 0):
        bits -= 1
    else:
        bits += 1
    return np.asarray(bits, dtype=uint).view(value.dtype)


def clamp_chunk(chunk: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Elementwise clamp in the tensor's own dtype; NaN stays NaN, infinities are clamped."""
    if chunk.dtype == np.float16 or lookup.is_float8(chunk.dtype):
        bounds = (np.asarray(bound, dtype=chunk.dtype).tobytes() for bound in (lo, hi))
        return lookup.look_up(chunk, _clamp_table(chunk.dtype, *bounds))
    clamped: np.ndarray = np.clip(chunk, lo, hi)
    return clamped


@functools.lru_cache(maxsize=16)
def _clamp_table(dtype: np.dtype[Any], lo_bits: bytes, hi_bits: bytes) -> np.ndarray:
    """Every value of an 8- or 16-bit float clamped by np.clip, as bits. Keyed by the bounds'
    bits, since -0.0 == 0.0 yet np.clip returns the bound itself; one table serves the run."""
    lo, hi = (np.frombuffer(bits, dtype=dtype)[0] for bits in (lo_bits, hi_bits))
    table = lookup.table_of(dtype, lambda values: np.clip(values, lo, hi))
    table.flags.writeable = False
    return table


def axes_scales(
    array: np.ndarray, axes: tuple[int, ...], limit: float
) -> tuple[np.ndarray, np.ndarray]:
    """(per-slice norms, per-slice scales) with keepdims; scale 1.0 marks unchanged slices.

    Slices of 16-bit and 8-bit floats are measured after rounding and shrunk where the
    rounded slice came out over the limit, as in choose_scale.
    """
    sums, exps = slice_sumsq(array, axes)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        norms = np.ldexp(np.sqrt(sums), exps)
        # limit / norm from the scaled sums, so slices whose norm overflows still clip.
        ratios = np.where(
            sums > 0, np.ldexp(limit / np.sqrt(np.where(sums > 0, sums, 1.0)), -exps), np.inf
        )
        over = (ratios < 1.0) & np.isfinite(sums)
        scales = np.where(over, ratios, 1.0)
        # safe_scale is inversely proportional to the norm: one call gives every slice's.
        slice_numel = math.prod(array.shape[a] for a in axes)
        unit = safe_scale(limit, 1.0, slice_numel, [array.dtype])
        guaranteed = np.where(over, unit * ratios / limit, 1.0)
    if np.all(scales - guaranteed <= scales * min(_FIDELITY, 4 * unit_roundoff(array.dtype))):
        return norms, guaranteed  # float32: as in choose_scale
    for _ in range(3):
        measured = slice_norms_scaled(array, scales, axes)
        too_big = over & (measured > limit)
        if not np.any(too_big):
            return norms, scales
        shrunk = scales * limit / np.where(too_big, measured, 1.0) * (1 - _REFINE_STEP)
        scales = np.where(too_big, np.maximum(shrunk, guaranteed), scales)
    measured = slice_norms_scaled(array, scales, axes)
    return norms, np.where(over & (measured > limit), guaranteed, scales)


def slice_norms_scaled(array: np.ndarray, scales: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
    """Slice norms of the rounded, scaled array (one temporary copy of it)."""
    return slice_norms(scale_slices(array, scales, axes), axes)


def scale_slices(array: np.ndarray, scales: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
    """array * scales (per slice), rounded to the dtype; one output copy, bounded temps."""
    out = np.empty_like(array)
    for block in slice_blocks(array.shape, axes):
        out[block] = scale_chunk(array[block], scales[_scale_index(block, axes)])
    return out


def _scale_index(block: tuple[slice, ...], axes: tuple[int, ...]) -> tuple[slice, ...]:
    """The same block in the keepdims scales array (size 1 along the reduced axes)."""
    return tuple(slice(None) if i in axes else part for i, part in enumerate(block))
