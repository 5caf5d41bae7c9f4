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
from pathlib import Path
from typing import TypeVar

import numpy as np

from clipcli import interrupts, roles, scope
from clipcli.dtypes import is_floating
from clipcli.errors import DataRefusedError, UsageError
from clipcli.formats.base import Checkpoint, Reader, TensorInfo, Writer
from clipcli.formats.sharded import ShardedReader, ShardedWriter, output_names
from clipcli.identity import InputGuard
from clipcli.io import open_reader, writer_class
from clipcli.numerics import rounding, scaling, slices
from clipcli.numerics.certain import CertainSumsq
from clipcli.numerics.norms import (
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


def list_tensors(path: Path) -> tuple[str, dict[str, str], list[TensorInfo]]:
    with open_reader(path) as reader:
        return reader.format_name, dict(reader.metadata), list(reader.infos)


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
    members = [scaling.Member(p.info.name, p.info.dtype, p.info.numel, p.before) for p in plans]
    infos = [p.info for p in plans]
    factor = scaling.group_factor(
        members, limit, lambda which, f: _output_sumsq(reader, [infos[i] for i in which], f)
    )
    if factor is None:
        return
    for plan in plans:
        if plan.before.ssq > 0:
            plan.scale, plan.scale_exp = factor.mantissa, factor.exponent


def _output_sumsq(
    reader: Reader, infos: Sequence[TensorInfo], factor: scaling.Factor
) -> CertainSumsq:
    def scaled(chunk: np.ndarray) -> CertainSumsq:
        check = CertainSumsq()
        check.add(rounding.scale_chunk(chunk, factor.mantissa, factor.exponent))
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
                return scaling.tf_scale(spec.use_norm, spec.limit) is None
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
    low, high = rounding.value_bounds(info.dtype, spec.low, spec.high)
    return stats.min_value < float(low) or stats.max_value > float(high)


def _plan_global(reader: Reader, targets: Sequence[TensorPlan], spec: ClipSpec) -> None:
    if spec.use_norm is not None:
        dtypes = [p.info.dtype for p in targets]
        scale = scaling.given_norm_factor(spec.use_norm, spec.limit, dtypes)
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
        return lambda chunk: rounding.scale_chunk(chunk, scale, exponent)
    if plan.action == "clamp":
        low, high = rounding.value_bounds(plan.info.dtype, spec.low, spec.high)
        return lambda chunk: rounding.clamp_chunk(chunk, low, high)
    return None


def _clip_slices(reader: Reader, plan: TensorPlan, spec: ClipSpec) -> list[np.ndarray]:
    """--axes: the whole tensor in memory, each slice scaled on its own."""
    array = reader.read(plan.info)
    _, scales = slices.axes_scales(array, plan.axes, spec.limit)
    changed = scales != 1.0
    plan.changed = bool(np.any(changed))
    plan.note = f"{int(np.count_nonzero(changed))} of {scales.size} slices clipped"
    if plan.changed:
        array = slices.scale_slices(array, scales, plan.axes)
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
    cls: type[Writer] = ShardedWriter if target.is_directory else writer_class(target.out)
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
) -> ClipResult:
    """Plan, then (unless dry_run) write the clipped copy atomically. Signals are deferred
    for the whole run: acted on between chunks before the commit, moot after it."""
    target = _target(src, out, force, durable)
    with interrupts.deferred(), open_reader(src) as reader:
        writer_cls = check_writable(reader, target)
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
) -> list[TensorInfo]:
    """A lossless copy into OUT's format, metadata carried over where OUT can hold it."""
    target = _target(src, out, force, durable)
    with interrupts.deferred(), open_reader(src) as reader:
        writer_cls = check_writable(reader, target)
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
