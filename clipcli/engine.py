"""The library API behind the CLI: measure a checkpoint, plan a clip, stream it out.

It joins the pure numerics (norms, clipping) with the format readers and writers.
Pass 1 measures every tensor; the plan (selection, refusals, scales) is then complete
before pass 2 writes the first byte.
"""

from __future__ import annotations

import collections
import fnmatch
import functools
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import TypeVar

import numpy as np

from clipcli import interrupts, roles, scope
from clipcli.dtypes import is_floating
from clipcli.errors import DataRefusedError, UsageError
from clipcli.formats.base import Checkpoint, NonTensorInfo, Reader, TensorInfo, Writer
from clipcli.formats.sharded import ShardedReader, ShardedWriter, output_names
from clipcli.formats.structure import check_losses
from clipcli.identity import InputGuard
from clipcli.io import open_reader, writer_class
from clipcli.numerics import lookup
from clipcli.numerics import scaling as clipping
from clipcli.numerics.norms import (
    CertainSumsq,
    NormAccumulator,
    accumulate,
    accumulate_array,
    global_norm,
)
from clipcli.output import InputFootprint, Target, choose_target
from clipcli.parallel import ordered_map
from clipcli.plan import (
    ClipSpec,
    Mode,
    compile_group_by,
    group_key,
    group_order,
    normalize_axes,
    tensor_limit,
)
from clipcli.progress import SILENT, Progress
from clipcli.stream_target import STDOUT, StdoutTarget

R = TypeVar("R")


@dataclass(frozen=True)
class Selection:
    """--include/--exclude globs on tensor names; exclude wins."""

    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    all_tensors: bool = False  # --all-tensors: training state counts too (clipcli.roles)

    def __call__(self, name: str) -> bool:
        if self.include and not any(fnmatch.fnmatchcase(name, g) for g in self.include):
            return False
        return not any(fnmatch.fnmatchcase(name, g) for g in self.exclude)

    def left_out(self, name: str) -> roles.Role | None:
        """The role that keeps a tensor out of norms and clipping, None if it counts."""
        if self.all_tensors:
            return None
        role = roles.classify(name)
        return None if role is roles.Role.WEIGHT else role

    def check(self, infos: Sequence[TensorInfo], notify: scope.Notify) -> list[TensorInfo]:
        """The selected tensors; an empty selection is refused (exit 2) before any data is
        read, and patterns that match nothing are warned about."""
        selected = [info for info in infos if self(info.name)]
        names = [info.name for info in infos]
        scope.check_patterns(names, self.include, self.exclude, [i.name for i in selected], notify)
        return selected

    def check_weights(self, selected: Sequence[TensorInfo], notify: scope.Notify) -> None:
        """Training state is left out (one note line); a selection of nothing else is
        refused (exit 2)."""
        kept_out = scope.left_out(selected, self.all_tensors)
        scope.check_roles(selected, kept_out)
        note = scope.left_out_note(kept_out)
        if note is not None:
            notify("note", note)


@dataclass(frozen=True)
class TensorStats:
    info: TensorInfo
    stats: NormAccumulator
    in_global: bool
    role: roles.Role = roles.Role.WEIGHT

    @property
    def norm(self) -> float:
        return self.stats.norm


@dataclass(frozen=True)
class GroupStats:
    name: str
    tensors: int
    norm: float
    share: float  # of the global norm squared


@dataclass(frozen=True)
class Measurement:
    path: Path
    format: str
    metadata: dict[str, str]
    tensors: list[TensorStats]

    @property
    def global_norm(self) -> float:
        return global_norm(t.norm for t in self.tensors if t.in_global)

    def groups(self, group_by: str) -> list[GroupStats]:
        """Floating-point tensors aggregated by --group-by, in natural name order (layer 2
        before layer 10; file order is no guide: safetensors and h5py sort names as text)."""
        pattern = compile_group_by(group_by)
        members: dict[str, list[float]] = {}
        for t in self.tensors:
            if t.in_global:
                members.setdefault(group_key(t.info.name, pattern), []).append(t.norm)
        total = self.global_norm
        result = []
        for name, norms in sorted(members.items(), key=lambda item: group_order(item[0])):
            norm = global_norm(norms)
            share = (norm / total) ** 2 if total > 0 and math.isfinite(total) else math.nan
            result.append(GroupStats(name, len(norms), norm, share))
        return result


def chunk_sources(reader: Reader, info: TensorInfo) -> Iterator[Callable[[], np.ndarray]]:
    """Loaders of the tensor's chunks: parallel reads where the reader allows them, else
    chunks read here in order and handed over as they are."""
    loaders = reader.chunk_loaders(info)
    if loaders is not None:
        return loaders
    return (functools.partial(_identity, chunk) for chunk in reader.chunks(info))


def _identity(chunk: np.ndarray) -> np.ndarray:
    return chunk


def map_chunks(reader: Reader, info: TensorInfo, fn: Callable[[np.ndarray], R]) -> Iterator[R]:
    """fn over the tensor's chunks in worker threads, results in order."""
    return ordered_map(lambda load: fn(load()), chunk_sources(reader, info))


def _chunk_stats(chunk: np.ndarray, histograms: bool = False) -> tuple[NormAccumulator, int]:
    stats = NormAccumulator(keep_histogram=histograms)
    stats.add(chunk)
    return stats, chunk.nbytes


def measure_all(
    reader: Reader,
    infos: Sequence[TensorInfo],
    progress: Progress = SILENT,
    label: str = "measuring",
    on_measured: Callable[[int, NormAccumulator], None] | None = None,
    histograms: bool = False,
) -> list[NormAccumulator]:
    """Statistics of every tensor, chunks measured in worker threads across tensor bounds.
    on_measured(index, stats) is called for each tensor, in order, as soon as it is done.
    With `histograms`, 8- and 16-bit float tensors also count their bit patterns (for
    the scale search: NormAccumulator.histogram)."""
    stats = [NormAccumulator() for _ in infos]
    stream = ((i, load) for i, info in enumerate(infos) for load in chunk_sources(reader, info))
    progress.start(label, sum(info.nbytes for info in infos))
    given = on_measured or _ignore

    def notify(index: int, finished: NormAccumulator) -> None:
        finished.finish()
        given(index, finished)

    done = 0  # tensors before this index are complete (empty ones have no chunks at all)
    for index, (partial, nbytes) in ordered_map(
        lambda item: (item[0], _chunk_stats(item[1](), histograms)), stream
    ):
        for finished in range(done, index):
            notify(finished, stats[finished])
        done = index
        interrupts.check()
        stats[index].merge(partial)
        progress.advance(nbytes)
    for finished in range(done, len(infos)):
        notify(finished, stats[finished])
    progress.finish()
    return stats


def _ignore(index: int, stats: NormAccumulator) -> None:
    pass


def measure_reader(
    reader: Reader,
    selection: Selection = Selection(),
    progress: Progress = SILENT,
    notify: scope.Notify = scope.ignore,
    group_by: str | None = None,
) -> Measurement:
    infos = selection.check(reader.infos, notify)
    selection.check_weights(infos, notify)
    scope.warn_quantized(reader.infos, model_directory(reader), notify)
    if group_by is not None:
        counted = [i.name for i in scope.floating(infos) if selection.left_out(i.name) is None]
        scope.check_groups(counted, group_by, notify)
    rows = []
    for info, stats in zip(infos, measure_all(reader, infos, progress), strict=True):
        role = selection.left_out(info.name)
        counts = is_floating(info.dtype) and role is None
        rows.append(TensorStats(info, stats, counts, role or roles.Role.WEIGHT))
    return Measurement(reader.path, reader.format_name, dict(reader.metadata), rows)


def measure(
    path: Path,
    selection: Selection = Selection(),
    progress: Progress = SILENT,
    notify: scope.Notify = scope.ignore,
    group_by: str | None = None,
) -> Measurement:
    with open_reader(path) as reader:
        return measure_reader(reader, selection, progress, notify, group_by)


def model_directory(reader: Reader) -> Path | None:
    """The Hugging Face model directory being read, where a config.json may live."""
    return reader.directory if isinstance(reader, ShardedReader) else None


def list_tensors(
    path: Path,
) -> tuple[str, dict[str, str], list[TensorInfo], list[NonTensorInfo]]:
    with open_reader(path) as reader:
        return (
            reader.format_name,
            dict(reader.metadata),
            list(reader.infos),
            list(reader.non_tensors),
        )


# ---------------------------------------------------------------- clipping


@dataclass
class TensorPlan:
    info: TensorInfo
    before: NormAccumulator
    selected: bool
    action: str = "keep"  # keep | scale | clamp | axes
    scale: float | None = None
    note: str = ""
    after: NormAccumulator = field(default_factory=NormAccumulator)
    changed: bool = False
    axes: tuple[int, ...] = ()
    group: str | None = None
    scale_exp: int = 0  # the scale is scale * 2**scale_exp (for ratios below 1e-300)
    role: roles.Role = roles.Role.WEIGHT  # training state is copied unchanged by default

    @property
    def in_global(self) -> bool:
        return (
            self.selected
            and self.role is roles.Role.WEIGHT
            and is_floating(self.info.dtype)
            and self.note != "non-finite, skipped"
        )


@dataclass(frozen=True)
class ClipResult:
    src: Path
    out: Path
    spec: ClipSpec
    dry_run: bool
    plans: list[TensorPlan]
    used_norm: float | None  # the G that --global scaled by

    @property
    def global_before(self) -> float:
        return global_norm(p.before.norm for p in self.plans if p.in_global)

    @property
    def global_after(self) -> float:
        return global_norm(p.after.norm for p in self.plans if p.in_global)


def _refuse_nonfinite(path: Path, plans: Sequence[TensorPlan], spec: ClipSpec) -> None:
    if spec.mode is Mode.VALUE:
        return
    bad = [p for p in plans if p.selected and is_floating(p.info.dtype) and p.before.nonfinite]
    if not bad:
        return
    if spec.skip_nonfinite:
        for plan in bad:
            plan.note = "non-finite, skipped"
        return
    listed = ", ".join(f"{p.info.name!r} ({p.before.nonfinite} non-finite)" for p in bad)
    raise DataRefusedError(
        f"{path}: NaN/Inf values where a norm is needed: {listed}; "
        "pass --skip-nonfinite to leave them"
    )


def plan_clip(
    reader: Reader,
    spec: ClipSpec,
    selection: Selection,
    progress: Progress = SILENT,
    copy_ahead: Callable[[TensorInfo], None] | None = None,
) -> list[TensorPlan]:
    """Measure every tensor and decide what happens to it. Raises before OUT is touched.

    copy_ahead, if given, is told of each tensor that is already known (or, in global
    mode, likely) to stay unchanged, while the others are still being measured."""
    infos = list(reader.infos)
    hook = _unchanged_hook(infos, spec, selection, copy_ahead) if copy_ahead else None
    plans = [
        TensorPlan(info, stats, selection(info.name))
        for info, stats in zip(
            infos,
            measure_all(
                reader,
                infos,
                progress,
                on_measured=hook,
                histograms=spec.mode is not Mode.VALUE and spec.axes is None,
            ),
            strict=True,
        )
    ]
    for plan in plans:
        role = selection.left_out(plan.info.name) if plan.selected else None
        if not plan.selected:
            plan.note = "not selected"
        elif role is not None:
            plan.role = role
            plan.note = f"{role.description}, left unchanged"
        elif not is_floating(plan.info.dtype):
            plan.note = "not floating point"
    targets = [p for p in plans if p.in_global]
    _refuse_nonfinite(reader.path, targets, spec)
    targets = [p for p in targets if not p.note]
    if spec.mode is Mode.VALUE:
        _plan_value(reader.path, targets, spec)
    elif spec.mode is Mode.NORM and spec.axes is not None:
        problems = []
        for plan in targets:
            if spec.skip_low_rank and not scope.axes_fit(spec.axes, plan.info.shape):
                plan.note = "skipped: too few dimensions for --axes"
                plan.action = "skip"
                continue
            try:
                plan.axes = normalize_axes(spec.axes, plan.info.shape, plan.info.name)
            except DataRefusedError as exc:
                problems.append(str(exc))
            plan.action = "axes"
        if problems:  # name every tensor the axes do not fit, not just the first
            raise DataRefusedError(f"{reader.path}: " + "; ".join(problems))
    elif spec.mode in (Mode.NORM, Mode.AVERAGE):
        for plan in targets:
            limit = tensor_limit(spec, plan.info.numel)
            _set_factor(reader, [plan], limit)
    elif spec.group_by is not None:
        pattern = compile_group_by(spec.group_by)
        groups: dict[str, list[TensorPlan]] = {}
        for plan in targets:
            groups.setdefault(group_key(plan.info.name, pattern), []).append(plan)
        for group, members in groups.items():
            _plan_global(reader, members, spec)
            for plan in members:
                plan.group = group
                plan.note = f"group {group}"
    else:
        _plan_global(reader, targets, spec)
    for plan in targets:
        if plan.scale is not None:
            plan.action, plan.changed = "scale", True
        elif spec.mode is not Mode.VALUE and plan.action not in ("axes", "skip"):
            reason = "zero tensor" if plan.before.norm == 0 else "within limit"
            plan.note = reason + (f", group {plan.group}" if plan.group else "")
    return plans


def _set_factor(reader: Reader, plans: Sequence[TensorPlan], limit: float) -> None:
    """One factor for `plans` (a tensor, a group or the checkpoint): the largest uniform one
    whose rounded output has norm <= limit. Zero tensors keep no scale (bit-identical)."""
    together = NormAccumulator()
    for plan in plans:
        together.merge(plan.before)
    ratio = together.limit_ratio(limit)
    if together.ssq == 0.0 or math.isinf(limit) or ratio > 1 + clipping.AMBIGUOUS:
        return
    live = [p for p in plans if p.before.ssq > 0]
    _refuse_unreachable(live, limit)
    if abs(ratio - 1) <= clipping.AMBIGUOUS:
        # The measured norm is within its own rounding error of C: decide exactly, so that
        # a norm equal to C is left alone and one a hair above it is clipped.
        if _within_exactly(reader, live, limit):
            return
        ratio = min(ratio, 1 - 2.0**-53)
    elif not ratio < 1.0:
        return
    dtypes = [p.info.dtype for p in live]
    exponent = 0
    if ratio < clipping.TINY_RATIO or all(clipping.mantissa_digits(d) == 53 for d in dtypes):
        scale, exponent = _verified_factor(reader, live, together, limit)
    else:
        chosen = clipping.choose_factor(
            limit, ratio, _histograms(live), _wide_bound(live, limit), dtypes
        )
        assert chosen is not None
        scale = chosen
    if scale == 0 and any(clipping.smallest_without_zero(p.info.dtype) for p in live):
        _refuse_unreachable(live, 0.0)  # never round a zero-less dtype by 0 (NaN)
    for plan in live:
        plan.scale, plan.scale_exp = scale, exponent


def _refuse_unreachable(plans: Sequence[TensorPlan], limit: float) -> None:
    """A dtype with no zero (float8_e8m0fnu: powers of two only) cannot scale below its
    smallest value: when even that gives a norm over the limit, no factor works, and the
    rounding would write NaN. Refused (exit 4), as for value bounds no value can meet."""
    floor = Fraction(0)
    zeroless = []
    for plan in plans:
        smallest = clipping.smallest_without_zero(plan.info.dtype)
        if smallest is not None:
            floor += Fraction(smallest) ** 2 * plan.info.numel
            zeroless.append(plan.info.name)
    # At the floor itself the search has no room (every factor below the first change
    # gives the floor): refuse there too, with a hair of margin, rather than write NaN.
    if zeroless and floor * (1 + Fraction(1, 2**20)) >= Fraction(limit) ** 2:
        names = ", ".join(repr(name) for name in zeroless[:3])
        more = f" and {len(zeroless) - 3} more" if len(zeroless) > 3 else ""
        smallest = clipping.smallest_without_zero(plans[0].info.dtype) or 0
        raise DataRefusedError(
            f"{names}{more}: a dtype without zero (every value at least its smallest, "
            f"{smallest:g}) cannot be scaled to a norm of {limit:g}: the least it can reach "
            f"is {math.sqrt(floor):g}; choose a larger limit or exclude these tensors"
        )


def _within_exactly(reader: Reader, plans: Sequence[TensorPlan], limit: float) -> bool:
    """Whether the norm of `plans` together is <= limit: exact over histograms (as
    fractions), with a certain bound over the rest (one more pass over those tensors)."""
    total = Fraction(0)
    for plan in plans:
        if plan.before.histogram is not None:
            bits, counts = plan.before.histogram
            values = lookup.float64_values(plan.info.dtype)[bits]
            for value, count in zip(values.tolist(), counts.tolist(), strict=True):
                total += Fraction(value) ** 2 * count
    wide = [p.info for p in plans if p.before.histogram is None]
    check = _output_sumsq(reader, wide, 1.0, 0)
    check.total += total
    return check.at_most(limit)


def _histograms(plans: Sequence[TensorPlan]) -> list[clipping.Histogram]:
    """The 8- and 16-bit members' bit-pattern counts, one histogram per dtype."""
    by_dtype: dict[np.dtype, list[tuple[np.ndarray, np.ndarray]]] = {}
    for plan in plans:
        if plan.before.histogram is not None:
            by_dtype.setdefault(plan.info.dtype, []).append(plan.before.histogram)
    result = []
    for dtype, parts in by_dtype.items():
        bits = np.concatenate([p[0] for p in parts])
        counts = np.concatenate([p[1] for p in parts]).astype(np.float64)
        total = np.bincount(bits, weights=counts, minlength=256**dtype.itemsize)
        present = np.flatnonzero(total)
        values = lookup.float64_values(dtype)[present]
        result.append(clipping.Histogram(dtype, values, total[present]))
    return result


def _wide_bound(plans: Sequence[TensorPlan], limit: float) -> clipping.WideBound | None:
    """The rounding bound for the float32/float64/complex members (no histogram)."""
    wide = [p for p in plans if p.before.histogram is None]
    if not wide:
        return None
    stats = NormAccumulator()
    for plan in wide:
        stats.merge(plan.before)
    return clipping.WideBound.of(
        stats.limit_ratio(limit), [p.info.dtype for p in wide], sum(p.info.numel for p in wide)
    )


def _verified_factor(
    reader: Reader, plans: Sequence[TensorPlan], together: NormAccumulator, limit: float
) -> tuple[float, int]:
    """float64 (and factors below 2**-900): TF's factor, checked by a pass over the rounded
    output with a certain bound on its norm (CertainSumsq), shrunk by the measured overshoot
    once if needed, else the factor the rounding bound guarantees. As (mantissa, exponent)."""
    ratio = together.limit_ratio(limit)
    if ratio >= clipping.TINY_RATIO:
        mantissa, exponent = ratio, 0
    else:
        mantissa, exponent = together.limit_ratio_parts(limit)
    first = mantissa
    for _ in range(2):
        check = _output_sumsq(reader, [p.info for p in plans], mantissa, exponent)
        if check.at_most(limit):
            return mantissa, exponent
        over = check.over(limit)
        if not math.isfinite(over) or over <= 0:
            break
        mantissa = mantissa / over * (1 - 2.0**-51)
    dtypes = [p.info.dtype for p in plans]
    bound = clipping.WideBound.of(1.0, dtypes, together.numel)
    headroom = 1 - math.sqrt(bound.numel) * bound.step / 2 / limit
    safe = first * bound.ratio * max(headroom, 0.0) / (1 + bound.unit) * (1 - 2.0**-50)
    return safe, exponent


def _output_sumsq(
    reader: Reader, infos: Sequence[TensorInfo], scale: float, exponent: int
) -> CertainSumsq:
    def scaled(chunk: np.ndarray) -> CertainSumsq:
        check = CertainSumsq()
        check.add(clipping.scale_chunk(chunk, scale, exponent))
        return check

    total = CertainSumsq()
    for info in infos:
        for partial in map_chunks(reader, info, scaled):
            total.merge(partial)
    return total


def _unchanged_hook(
    infos: Sequence[TensorInfo],
    spec: ClipSpec,
    selection: Selection,
    copy_ahead: Callable[[TensorInfo], None],
) -> Callable[[int, NormAccumulator], None]:
    """Calls copy_ahead for each measured tensor that the plan will most likely leave alone.

    Per-tensor modes know this for sure from the tensor alone. In global mode the norm so far
    only grows, so tensors are passed on while it is within the limit and never after: when
    the whole checkpoint is within the limit (nothing changes) every tensor is copied during
    the measuring pass, and when it is not, only the prefix measured before the limit was
    crossed gets copied in vain. The plan, not this guess, decides what is written."""
    so_far = NormAccumulator()

    def unchanged(info: TensorInfo, stats: NormAccumulator) -> bool:
        if not selection(info.name) or not is_floating(info.dtype):
            return True
        if selection.left_out(info.name) is not None:
            return True
        if stats.nonfinite or spec.axes is not None or spec.group_by is not None:
            return False
        if spec.mode is Mode.GLOBAL:
            if spec.use_norm is not None:
                return clipping.tf_scale(spec.use_norm, spec.limit) is None
            so_far.merge(stats)
            return so_far.limit_ratio(spec.limit) >= 1.0
        if spec.mode is Mode.VALUE:
            try:
                return info.dtype.kind == "c" or not _needs_clamp(info, stats, spec)
            except DataRefusedError:
                return False
        return stats.limit_ratio(tensor_limit(spec, info.numel)) >= 1.0

    def on_measured(index: int, stats: NormAccumulator) -> None:
        if unchanged(infos[index], stats):
            copy_ahead(infos[index])

    return on_measured


def _plan_value(path: object, targets: Sequence[TensorPlan], spec: ClipSpec) -> None:
    problems = []
    for plan in targets:
        if plan.info.dtype.kind == "c":
            plan.note = "complex: no order to clamp by"
            continue
        try:
            clamp = _needs_clamp(plan.info, plan.before, spec)
        except DataRefusedError as exc:
            problems.append(f"tensor {plan.info.name!r}: {exc}")
            continue
        if clamp:
            plan.action, plan.changed = "clamp", True
        else:
            plan.note = "within range"
    if problems:  # name every tensor that cannot be clamped, not just the first
        raise DataRefusedError(f"{path}: " + "; ".join(problems))


def _needs_clamp(info: TensorInfo, stats: NormAccumulator, spec: ClipSpec) -> bool:
    """Whether value mode changes this real tensor. DataRefusedError if it has values and
    its dtype holds none in [min, max]; an empty tensor has nothing to clamp either way."""
    if not stats.numel:
        return False
    low, high = clipping.value_bounds(info.dtype, spec.low, spec.high)
    return stats.min_value < float(low) or stats.max_value > float(high)


def _plan_global(reader: Reader, targets: Sequence[TensorPlan], spec: ClipSpec) -> None:
    if spec.use_norm is not None:
        scale = clipping.tf_scale(spec.use_norm, spec.limit)
        if scale is not None:
            # TF's factor to as many bits as keep every product exact, so that each value
            # is rounded once (below 2**-29 relative for float32, 2**-42 for float16).
            bits = clipping.exact_product_bits([p.info.dtype for p in targets])
            scale = clipping.truncate_factor(scale, bits)
        for plan in targets:
            # A zero tensor stays bit-identical whatever the scale.
            plan.scale = scale if plan.before.norm > 0 else None
    else:
        _set_factor(reader, targets, spec.limit)


def _transform(plan: TensorPlan, spec: ClipSpec) -> Callable[[np.ndarray], np.ndarray] | None:
    """What the write pass applies to each chunk of this tensor; None copies it as it is."""
    if plan.action == "scale":
        assert plan.scale is not None
        scale, exponent = plan.scale, plan.scale_exp
        return lambda chunk: clipping.scale_chunk(chunk, scale, exponent)
    if plan.action == "clamp":
        low, high = clipping.value_bounds(plan.info.dtype, spec.low, spec.high)
        return lambda chunk: clipping.clamp_chunk(chunk, low, high)
    return None


def _clip_slices(reader: Reader, plan: TensorPlan, spec: ClipSpec) -> list[np.ndarray]:
    """--axes: the whole tensor in memory, each slice scaled on its own."""
    array = reader.read(plan.info)
    _, scales = clipping.axes_scales(array, plan.axes, spec.limit)
    changed = scales != 1.0
    plan.changed = bool(np.any(changed))
    plan.note = f"{int(np.count_nonzero(changed))} of {scales.size} slices clipped"
    if plan.changed:
        array = clipping.scale_slices(array, scales, plan.axes)
        plan.after = accumulate_array(array)
    return [array.reshape(-1)]


def _measured(
    chunks: Iterator[tuple[np.ndarray, NormAccumulator]], acc: NormAccumulator, progress: Progress
) -> Iterator[np.ndarray]:
    for chunk, partial in chunks:
        interrupts.check()
        acc.merge(partial)
        progress.advance(chunk.nbytes)
        yield chunk


def _with_stats(
    transform: Callable[[np.ndarray], np.ndarray], chunk: np.ndarray
) -> tuple[np.ndarray, NormAccumulator]:
    out = transform(chunk)
    return out, accumulate([out])


def _write_all(
    reader: Reader,
    writer: Writer | None,
    plans: Sequence[TensorPlan],
    spec: ClipSpec | None,
    progress: Progress = SILENT,
) -> None:
    """Stream every tensor to the writer (with None, only compute and measure the output)."""
    progress.start("writing" if writer else "computing", sum(p.info.nbytes for p in plans))
    for plan in plans:
        interrupts.check()
        info = plan.info
        transform = _transform(plan, spec) if spec is not None else None
        if spec is not None and plan.action == "axes":
            sliced = _clip_slices(reader, plan, spec)
            progress.advance(info.nbytes)
            if writer is not None:
                writer.write(info, sliced)
        elif transform is not None:
            pairs = map_chunks(reader, info, functools.partial(_with_stats, transform))
            chunks = _measured(pairs, plan.after, progress)
            if writer is not None:
                writer.write(info, chunks)
            else:
                collections.deque(chunks, maxlen=0)
        elif writer is None or writer.copy_unchanged(reader, info):
            progress.advance(info.nbytes)
        else:
            writer.write(info, _counted(reader.chunks(info), progress))
        if not plan.changed:
            plan.after = plan.before
    progress.finish()


def _counted(chunks: Iterable[np.ndarray], progress: Progress) -> Iterator[np.ndarray]:
    for chunk in chunks:
        interrupts.check()
        progress.advance(chunk.nbytes)
        yield chunk


def check_writable(reader: Reader, target: Target) -> type[Writer]:
    """The writer for OUT, once every limit of its format that is known before writing
    holds (names, dtypes, names together, metadata): a refusal is exit 2 naming the tensor
    or key, before anything is created."""
    cls: type[Writer] = (
        target.writer
        if isinstance(target, StdoutTarget)
        else ShardedWriter
        if target.is_directory
        else writer_class(target.out)
    )
    for info in reader.infos:
        reason = cls.check_name(info.name) or cls.check_dtype(info)
        if reason is not None:
            raise UsageError(f"{target.out}: tensor {info.name!r}: {reason}")
    reason = cls.check_names([info.name for info in reader.infos]) or cls.check_metadata(
        _output_metadata(reader, target.is_directory), reader
    )
    if reason is not None:
        raise UsageError(f"{target.out}: {reason}")
    return cls


def _output_metadata(reader: Reader, to_directory: bool) -> dict[str, str]:
    # Shards joined into one file keep the shards' own __metadata__, not the index's.
    if not to_directory and isinstance(reader, ShardedReader):
        return reader.common_shard_metadata()
    return dict(reader.metadata)


SIDE_FILE_LIMIT = 1 << 30  # bytes: configs and tokenizers are far smaller


def _check_side_files(reader: Reader, allow_large: bool) -> None:
    """A model directory's other files are copied; one of absurd size is refused unless
    allowed, since a sparse 1 TB file would otherwise fill the disk."""
    if allow_large:
        return
    for path in reader.side_files():
        size = path.stat().st_size
        if size > SIDE_FILE_LIMIT:
            raise UsageError(
                f"{path}: side file of {size} bytes is over the {SIDE_FILE_LIMIT >> 30} GiB "
                "limit for files copied beside the weights; pass --allow-large-side-files"
            )


def _target(src: Path, out: str | Path, force: bool, durable: bool) -> Target:
    if str(out) == STDOUT:  # safetensors streamed to standard output (stream_target)
        return StdoutTarget(force=force, durable=durable)
    is_directory = src.is_dir() or src.name.endswith(".index.json")
    return choose_target(out, input_is_directory=is_directory, force=force, durable=durable)


def clip(
    src: Path,
    out: str | Path,
    spec: ClipSpec,
    selection: Selection = Selection(),
    *,
    dry_run: bool = False,
    force: bool = False,
    durable: bool = True,
    progress: Progress = SILENT,
    allow_large_side_files: bool = False,
    notify: scope.Notify = scope.ignore,
    allow_lossy: bool = False,
) -> ClipResult:
    """Plan, then (unless dry_run) write the clipped copy atomically. Signals are deferred
    for the whole run: acted on between chunks before the commit, moot after it."""
    target = _target(src, out, force, durable)
    with interrupts.deferred(), open_reader(src) as reader:
        writer_cls = check_writable(reader, target)
        check_losses(writer_cls.structure_losses(reader), allow_lossy, notify, target.out)
        check_clip_scope(reader, spec, selection, notify)
        if dry_run:
            plans = plan_clip(reader, spec, selection, progress)
            _write_all(reader, None, plans, spec, progress)
        else:
            plans = _write_file(
                reader,
                writer_cls,
                target,
                lambda writer, guard: _plan_then_check(
                    reader, spec, selection, progress, writer, guard
                ),
                spec,
                allow_large_side_files,
                progress,
                notify,
            )
        used = None
        if spec.mode is Mode.GLOBAL and spec.group_by is None:
            used = (
                spec.use_norm
                if spec.use_norm is not None
                else global_norm(p.before.norm for p in plans if p.in_global)
            )
    return ClipResult(src, target.out, spec, dry_run, plans, used)


def check_clip_scope(
    reader: Reader, spec: ClipSpec, selection: Selection, notify: scope.Notify
) -> None:
    """Everything about what the clip acts on that names alone decide, refused before any
    data is read: the selection, training state, quantized weights, --axes, --group-by."""
    selected = selection.check(reader.infos, notify)
    selection.check_weights(selected, notify)
    targets = [i for i in scope.floating(selected) if selection.left_out(i.name) is None]
    acted_on = [i for i in selected if selection.left_out(i.name) is None]
    scope.refuse_quantized(reader.infos, acted_on, model_directory(reader))
    if spec.mode is Mode.NORM and spec.axes is not None:
        scope.check_axes(targets, spec.axes, spec.skip_low_rank, notify)
    if spec.group_by is not None:
        scope.check_groups([i.name for i in targets], spec.group_by, notify)


def _plan_then_check(
    reader: Reader,
    spec: ClipSpec,
    selection: Selection,
    progress: Progress,
    writer: Writer,
    guard: InputGuard,
) -> list[TensorPlan]:
    plans = plan_clip(
        reader, spec, selection, progress, functools.partial(writer.copy_ahead, reader)
    )
    guard.check("between the measuring and the writing pass")
    return plans


def _write_file(
    reader: Reader,
    writer_cls: type[Writer],
    target: Target,
    make_plans: Callable[[Writer, InputGuard], list[TensorPlan]],
    spec: ClipSpec | None,
    allow_large_side_files: bool,
    progress: Progress,
    notify: scope.Notify,
) -> list[TensorPlan]:
    """Write OUT through its target. The plans are made once the writer exists, so that it
    can start copying unchanged tensors early; a refusal while planning leaves nothing.
    The input must not change from opening to the commit (clipcli.identity)."""
    guard = InputGuard(reader.source_files())
    target.check(InputFootprint(reader.path, reader.source_files()), output_names(reader))
    if target.is_directory:
        _check_side_files(reader, allow_large_side_files)
        if isinstance(reader, ShardedReader):
            for entry in reader.skipped_files():
                where = entry.relative_to(reader.directory).as_posix()
                notify("note", f"left out {where}: {reader.left_out_reason(entry)}")
    metadata = _output_metadata(reader, target.is_directory)
    with target.stage() as staged:
        writer = writer_cls(
            staged, Checkpoint(list(reader.infos), metadata, reader), target.durable
        )
        try:
            plans = make_plans(writer, guard)
            _write_all(reader, writer, plans, spec, progress)
            interrupts.check()
            writer.close()
        except BaseException:
            writer.abort()
            raise
        guard.check("while it was being read")
    for note in target.notes:
        notify("note", note)
    return plans


def convert(
    src: Path,
    out: str | Path,
    *,
    force: bool = False,
    durable: bool = True,
    progress: Progress = SILENT,
    allow_large_side_files: bool = False,
    notify: scope.Notify = scope.ignore,
    allow_lossy: bool = False,
) -> list[TensorInfo]:
    """A lossless copy into OUT's format, metadata carried over where OUT can hold it."""
    target = _target(src, out, force, durable)
    with interrupts.deferred(), open_reader(src) as reader:
        writer_cls = check_writable(reader, target)
        check_losses(writer_cls.structure_losses(reader), allow_lossy, notify, target.out)
        plans = [TensorPlan(info, NormAccumulator(), True) for info in reader.infos]
        _write_file(
            reader,
            writer_cls,
            target,
            lambda _writer, _guard: plans,
            None,
            allow_large_side_files,
            progress,
            notify,
        )
        return list(reader.infos)
