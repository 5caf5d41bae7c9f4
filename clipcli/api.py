"""The library face of clipcli: ls, measure, clip, convert, diff. Nothing here prints.

Each job opens its input, checks what names alone decide (clipcli.jobs.scope), runs the
streaming passes (clipcli.jobs.pipeline) and returns a frozen result for clipcli.report.
`clip` measures, plans (clipcli.jobs.plan: a value, complete before the first byte is written),
then executes the plan into OUT's target (clipcli.output.target: one commit point).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from clipcli.errors import DataRefusedError, NotFiniteError, UsageError
from clipcli.formats.base import (
    Checkpoint,
    ListedTensor,
    NonTensorInfo,
    Reader,
    TensorInfo,
    Writer,
    archive_losses,
)
from clipcli.formats.opening import open_reader
from clipcli.jobs import scope
from clipcli.jobs.progress import SILENT, Progress
from clipcli.jobs.selection import EVERY_TENSOR, Selection
from clipcli.output import policy
from clipcli.system import interrupts, scratch
from clipcli.system.identity import InputGuard

if TYPE_CHECKING:
    import numpy as np

    from clipcli.jobs.diff import DiffResult  # diff's modules load when a diff runs
    from clipcli.jobs.measurement import Measurement
    from clipcli.jobs.pipeline import CountOnceOver
    from clipcli.jobs.plan import Outcome, Plan, Reason, TensorPlan
    from clipcli.jobs.spec import ClipSpec
    from clipcli.logical.view import QuantizedRows
    from clipcli.numerics.norms import NormAccumulator, Normed
    from clipcli.output.target import Target

# What clip and convert import in their functions, beyond what ls and norms need: norms
# imports this module too and never writes, and these cost it ~15 ms of start-up (issue
# 12, item 7). The CLI imports them up front for clip and convert (clipcli.__main__).
WRITING_MODULES = (
    "clipcli.jobs.execution",
    "clipcli.system.footprint",
    "clipcli.output.target",
    "clipcli.jobs.plan",
    "clipcli.jobs.spec",
    "clipcli.output.stream_target",
    "clipcli.formats.safetensors.writer",
    "clipcli.formats.safetensors.stream",
)


class Listing(NamedTuple):
    """What `ls` shows: read from headers only, no tensor data, no numpy."""

    format_name: str
    metadata: dict[str, str]
    tensors: list[ListedTensor]
    non_tensors: list[NonTensorInfo]
    shards: dict[str, str] | None  # tensor -> the file holding it, in a model directory
    quantized: QuantizedRows | None = None  # what rows say of quantized weights


def listing(path: Path, stored: bool = False) -> Listing:
    """The logical tensors (a quantized weight with its real shape), or with `stored`
    every stored tensor as it is."""
    with scratch.keeping_clear_of([path]), open_reader(path) as stored_reader:
        reader = stored_reader if stored else _listed_through(stored_reader)
        tensors = list(reader.listing)
        owners = {t.name: reader.shard_of(t.name) for t in tensors}
        shards = {k: v for k, v in owners.items() if v is not None}
        return Listing(
            reader.format_name,
            dict(reader.metadata),
            tensors,
            list(reader.non_tensors),
            shards if len(shards) == len(owners) and shards else None,
            _quantized_rows(reader),
        )


def _quantized_rows(reader: Reader) -> QuantizedRows | None:
    from clipcli.logical.reader import LogicalReader

    return reader.quantized_rows() if isinstance(reader, LogicalReader) else None


def _listed_through(reader: Reader) -> Reader:
    """The reader `ls` lists: the logical one where some scheme may claim a weight (that
    view reads small tensors, with numpy), else the stored one, from headers alone."""
    from clipcli.logical.quantized.markers import may_be_quantized

    if not may_be_quantized(reader):
        return reader
    from clipcli.logical import views

    return views.logical(reader)


def measure(
    path: Path,
    selection: Selection = EVERY_TENSOR,
    progress: Progress = SILENT,
    notify: scope.Notify = scope.ignore,
    group_by: str | None = None,
    stored: bool = False,
) -> Measurement:
    """Norms of the logical tensors (a quantized weight's real values); `stored`: of
    every stored tensor as it is."""
    from clipcli.logical import views

    held = _HeldLines(notify)  # as in clip: a failed measure says nothing before its error
    with scratch.keeping_clear_of([path]), open_reader(path) as reader:
        measured = measure_reader(
            reader if stored else views.logical(reader), selection, progress, held, group_by
        )
    held.release()
    return measured


def measure_reader(
    reader: Reader,
    selection: Selection = EVERY_TENSOR,
    progress: Progress = SILENT,
    notify: scope.Notify = scope.ignore,
    group_by: str | None = None,
) -> Measurement:
    from clipcli.jobs import pipeline

    selection = _with_parts(selection, reader)
    infos = selection.check(reader.infos, notify)
    selection.check_weights(infos, notify)
    scope.warn_quantized(reader.infos, _declaring_directory(reader), notify)
    for text in reader.warnings():
        notify("warning", text)
    for group in _overlap_groups(reader, selection):
        notify(
            "warning",
            f"{_listed_names(group)} view overlapping parts of one storage: the global norm "
            "counts their shared values once per tensor",
        )
    if group_by is not None:
        counted = [i.name for i in scope.floating(infos) if selection.left_out(i.name) is None]
        scope.check_groups(counted, group_by, notify)
    measured = pipeline.measure(reader, infos, selection.describe, progress)
    return measured._replace(quantized=_quantized_rows(reader))


def diff(
    path_a: Path,
    path_b: Path,
    selection: Callable[[str], bool] | None = None,
    *,
    chunk_elems: int | None = None,
    progress: Progress = SILENT,
    workers: int | None = None,
    notify: scope.Notify = scope.ignore,
) -> DiffResult:
    """Compare the checkpoints at path_a (the reference) and path_b, of any formats."""
    from clipcli.jobs import pipeline
    from clipcli.logical import views

    held = _HeldLines(notify)  # as in clip: a failed diff says nothing before its error
    with (
        scratch.keeping_clear_of([path_a, path_b]),  # one reader's sweep spares the other
        open_reader(path_a) as reader_a,
        open_reader(path_b) as reader_b,
    ):
        logical_a, logical_b = views.logical(reader_a), views.logical(reader_b)
        check_diff_scope(logical_a, logical_b, selection, held)
        result = pipeline.compare(
            logical_a,
            logical_b,
            selection,
            chunk_elems=chunk_elems,
            progress=progress,
            workers=workers,
        )
        shown = _shown_dtypes(result, _quantized_rows(logical_a), _quantized_rows(logical_b))
    held.release()
    return shown


def _shown_dtypes(
    result: DiffResult, rows_a: QuantizedRows | None, rows_b: QuantizedRows | None
) -> DiffResult:
    """A quantized weight's dtype in a diff row is the one its norms row shows (the dtype
    it dequantizes to, not the float64 it is compared in); `dtype changed` follows it,
    equal values or not."""
    if rows_a is None and rows_b is None:
        return result
    from clipcli.jobs.diff import CHANGED, DTYPE_CHANGED, SAME

    tensors = []
    for t in result.tensors:
        a = t.dtype_a if rows_a is None or t.dtype_a is None else rows_a.dtype(t.name, t.dtype_a)
        b = t.dtype_b if rows_b is None or t.dtype_b is None else rows_b.dtype(t.name, t.dtype_b)
        status = t.status
        if status in (SAME, CHANGED, DTYPE_CHANGED) and a != b:
            status = DTYPE_CHANGED  # equal values or not, as for two plain tensors
        elif status == DTYPE_CHANGED:
            status = CHANGED
        tensors.append(dataclasses.replace(t, dtype_a=a, dtype_b=b, status=status))
    return dataclasses.replace(result, tensors=tensors)


def check_diff_scope(
    a: Reader, b: Reader, selection: Callable[[str], bool] | None, notify: scope.Notify
) -> None:
    """Before reading data: refuse an empty selection over both files' names (exit 2), warn
    about patterns matching nothing and about quantized weights (compared as codes)."""
    include, exclude = getattr(selection, "include", ()), getattr(selection, "exclude", ())
    names = list(dict.fromkeys([i.name for i in a.infos] + [i.name for i in b.infos]))
    kept = [n for n in names if selection is None or selection(n)]
    scope.check_patterns(names, include, exclude, kept, notify)
    said: list[tuple[str, str]] = []  # A and B alike (e.g. a file and its copy): once
    for reader in (a, b):
        scope.warn_quantized(
            reader.infos, _declaring_directory(reader), lambda *message: said.append(message)
        )
        said.extend(("warning", text) for text in reader.warnings())
    for level, text in dict.fromkeys(said):
        notify(level, text)


# ---------------------------------------------------------------- clipping


# A NamedTuple, not a frozen dataclass: as immutable, and cheaper to define at import
# (start-up of norms in shell loops, issue 12 item 7).
class ClipRow(NamedTuple):
    """One tensor of a clip: what the plan decided and what the write pass did."""

    plan: TensorPlan
    outcome: Outcome

    @property
    def info(self) -> TensorInfo:
        return self.plan.info

    @property
    def reason(self) -> Reason:
        return self.plan.reason

    @property
    def before(self) -> NormAccumulator:
        return self.plan.before

    @property
    def after(self) -> Normed:
        return self.outcome.after

    @property
    def changed(self) -> bool:
        return self.outcome.changed


class ClipResult(NamedTuple):
    src: Path
    out: Path
    spec: ClipSpec
    dry_run: bool
    plan: Plan
    outcomes: tuple[Outcome, ...]
    quantized: QuantizedRows | None = None  # the dtypes quantized weights dequantize to

    @property
    def rows(self) -> list[ClipRow]:
        return [ClipRow(p, o) for p, o in zip(self.plan.tensors, self.outcomes, strict=True)]

    @property
    def used_norm(self) -> float | None:
        return self.plan.used_norm

    @property
    def global_before(self) -> float:
        return self.plan.global_before

    @property
    def global_after(self) -> float:
        from clipcli.numerics.norms import global_norm

        pairs = zip(self.plan.tensors, self.outcomes, strict=True)
        return global_norm(outcome.after.norm for p, outcome in pairs if p.in_global)

    def row(self, index: int) -> ClipRow:
        """rows[index], without making the others."""
        return ClipRow(self.plan.tensors[index], self.outcomes[index])

    def norms(self) -> tuple[Sequence[float], Sequence[float], float, float]:
        """Each tensor's norm before and after, then global_before and global_after: each
        norm worked out once for the report, which reads all four (200,000 tensors; as
        arrays of doubles, not lists of floats: 5 MB less each)."""
        from array import array
        from itertools import compress

        from clipcli.numerics.norms import global_norm

        tensors = self.plan.tensors
        before = array("d", (p.before.norm for p in tensors))
        after = array("d", (outcome.after.norm for outcome in self.outcomes))
        if len(after) != len(before):
            raise ValueError("a clip result with an outcome for every planned tensor expected")
        counted = [p.in_global for p in tensors]
        return (
            before,
            after,
            global_norm(compress(before, counted)),
            global_norm(compress(after, counted)),
        )


def clip(
    src: Path,
    out: str | Path,
    spec: ClipSpec,
    selection: Selection = EVERY_TENSOR,
    *,
    dry_run: bool = False,
    force: bool = False,
    durable: bool = True,
    progress: Progress = SILENT,
    allow_large_side_files: bool = False,
    notify: scope.Notify = scope.ignore,
    allow_lossy: bool = False,
) -> ClipResult:
    """Measure, plan, then write the clipped copy atomically (a dry run writes nothing).
    Signals are deferred for the whole run: acted on between chunks before the commit,
    moot after it."""
    from clipcli.jobs import execution  # WRITING_MODULES
    from clipcli.logical import views

    # Every line the job says (a note on training state, a pattern's warning, a loss
    # accepted) is held until it has succeeded: a refused or failed clip's stderr is its
    # one error line, whichever check refuses it (overlapping views, NaN/Inf, --axes).
    held = _HeldLines(notify)
    notify = held
    target = policy.target_for(src, out, force, durable)
    with (
        interrupts.deferred(writes=True),
        scratch.keeping_clear_of([src, out]),  # a sweep in $TMPDIR spares OUT's folder
        open_reader(src) as reader,
    ):
        writer_cls = policy.check_writable(reader, target)
        logical = views.logical(reader)
        _refuse_format_bound_parts(logical, writer_cls, target.out)  # before any loss line
        if not dry_run:
            _expect_all_elements(reader, writer_cls)  # the input's refusal before any loss
        losses = writer_cls.structure_losses(reader)
        losses += archive_losses(reader, writer_cls.format_name)
        losses += _join_losses(reader, writer_cls, target)
        policy.check_losses(losses, allow_lossy, notify, target.out)
        # Said once OUT is written (or the dry run is done): a failed run's stderr is its
        # one error line.
        notes = writer_cls.structure_notes(reader)
        check_clip_scope(logical, spec, selection, notify)
        if dry_run:
            # What the real run would refuse about OUT, refused here too; nothing is staged.
            # An existing OUT is not refused (nothing is written to it): it is judged as
            # with --force (a directory that holds other files, or IN, still is), and a
            # note says that the real run needs --force.
            check = target if force else policy.target_for(src, out, force=True, durable=durable)
            policy.check_target(reader, writer_cls, check, allow_large_side_files)
            check.release()
            if check.occupied and not force:
                notify("note", f"{target.out} exists: the run without --dry-run needs --force")
            # The input must not change from opening to the report, as a real run's to
            # its commit: a pass that reads at offsets (--axes groups) reads its bytes
            # apart from the in-order pass that checks an npz member's CRC (attack s47).
            guard = InputGuard(reader.source_identities())
            with _blaming_a_changed_input(guard):
                made = plan_clip(logical, spec, selection, progress)
                outcomes = _execute(
                    made, logical, reader, execution.DiscardingWriter(), progress, "computing"
                )
            guard.check("while it was being read")
        else:
            made, outcomes = _write_out(
                reader,
                writer_cls,
                target,
                lambda writer, guard: _plan_then_check(
                    logical, spec, selection, progress, writer, guard
                ),
                allow_large_side_files,
                progress,
                notify,
                logical,
            )
        for note in notes:
            notify("note", note)
    held.release()
    shown = _quantized_rows(logical)
    return ClipResult(src, target.out, spec, dry_run, made, tuple(outcomes), shown)


class _HeldLines:
    """A Notify that keeps its lines until release(), in order; dropped if never released."""

    def __init__(self, notify: scope.Notify) -> None:
        self._notify = notify
        self._lines: list[tuple[str, str]] = []

    def __call__(self, level: str, text: str) -> None:
        self._lines.append((level, text))

    def release(self) -> None:
        lines, self._lines = self._lines, []
        for level, text in lines:
            self._notify(level, text)


def plan_clip(
    reader: Reader,
    spec: ClipSpec,
    selection: Selection,
    progress: Progress = SILENT,
    writer: Writer | None = None,
) -> Plan:
    """Measure every tensor and decide what happens to it. Raises before OUT is touched.
    With a writer, tensors the plan will most likely leave alone are handed to its
    copy_ahead while the others are still being measured."""
    from clipcli.jobs import (
        execution,  # WRITING_MODULES
        pipeline,
    )
    from clipcli.jobs.plan import plan
    from clipcli.jobs.spec import Mode

    # Copying ahead hands stored tensors to the writer: only where logical ones are stored.
    ahead = None if _is_logical(reader) else writer
    hook = execution.copy_ahead_hook(spec, reader, ahead) if ahead is not None else None
    selection = _with_parts(selection, reader)
    measurement = pipeline.measure(
        reader,
        list(reader.infos),
        selection.describe,
        progress,
        histograms=_may_scale(selection)
        if spec.mode is not Mode.VALUE and spec.axes is None
        else None,
        on_measured=hook,
        count_once_over=None if _is_logical(reader) else _count_once_over(spec),
    )
    made = plan(measurement, spec, execution.output_check(reader))
    from clipcli.logical.reader import LogicalReader

    if isinstance(reader, LogicalReader):
        from clipcli.jobs import lowering

        lowering.check_lowerable(made, reader)  # refused before anything is written
    return made


def check_clip_scope(
    reader: Reader, spec: ClipSpec, selection: Selection, notify: scope.Notify
) -> None:
    """Everything about what the clip acts on that names alone decide, refused before any
    data is read: the selection, training state, quantized weights, --axes, --group-by."""
    from clipcli.jobs.spec import Mode  # WRITING_MODULES

    selection = _with_parts(selection, reader)
    selected = selection.check(reader.infos, notify)
    if _is_logical(reader):
        _check_ties(reader, selection)  # before the note on training state: one line
    acted_on = selection.check_weights(selected, notify, writes=True)
    targets = scope.floating(acted_on)  # a filter in order: the floating ones acted on
    scope.refuse_quantized(reader.infos, acted_on, _declaring_directory(reader))
    if _is_logical(reader):
        _refuse_unlowerable(reader, acted_on, spec.mode is Mode.VALUE)
        overlaps = _overlap_groups(reader, selection) if spec.mode is Mode.GLOBAL else []
        if overlaps:
            raise DataRefusedError(
                f"{reader.path}: {_listed_names(overlaps[0])} view overlapping parts of one "
                "storage, so one factor over their norms would count shared values more than "
                "once; clip them per tensor (--norm), or leave all but one out with --exclude"
            )
    if spec.mode is Mode.NORM and spec.axes is not None:
        scope.check_axes(targets, spec.axes, spec.skip_low_rank, notify)
    if spec.group_by is not None:
        scope.check_groups([i.name for i in targets], spec.group_by, notify)


def _declaring_directory(reader: Reader) -> Path | None:
    """The model directory whose config.json scope's quantization warnings should read:
    none behind a logical reader, whose view has read it and claimed the weights it names."""
    return None if _is_logical(reader) else reader.model_directory


def _refuse_unlowerable(reader: Reader, acted_on: list[TensorInfo], value: bool) -> None:
    """Exit 4, before any data is read, for a logical tensor of parts (a quantized weight)
    that a clip would act on and cannot act on through its stored tensors: --value is not
    linear in them, and the view says which scale factors it cannot carry (lowerable)."""
    from clipcli.logical.reader import LogicalReader

    assert isinstance(reader, LogicalReader)
    for info in acted_on:
        t = reader.by_name.get(info.name)
        if t is None or t.plain:
            continue
        if value:
            raise DataRefusedError(
                f"{t.info.name}: a {t.scheme} weight cannot be clipped by clamp through its "
                "stored tensors (--value is not linear in a quantized weight's scales); "
                "dequantize it first, or "
                "leave it out with --exclude"
            )
        why = reader.view.lowerable(t)
        if why is not None:
            raise DataRefusedError(
                f"{why}: the weight is quantized; dequantize it first, or leave it out "
                "with --exclude"
            )


def _plan_then_check(
    reader: Reader,
    spec: ClipSpec,
    selection: Selection,
    progress: Progress,
    writer: Writer,
    guard: InputGuard,
) -> Plan:
    made = plan_clip(reader, spec, selection, progress, writer)
    guard.check("between the measuring and the writing pass")
    return made


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
    dtype: str | None = None,
) -> list[TensorInfo]:
    """A lossless copy into OUT's format, metadata carried over where OUT can hold it.
    With `dtype` (bfloat16, float16, float32): the logical tensors instead, quantized
    weights dequantized and every real float tensor cast to it (clipcli.logical.cast);
    a cast that overflows is refused (exit 4) unless allow_lossy."""
    from clipcli.jobs.plan import copy_plan  # WRITING_MODULES

    held = _HeldLines(notify)  # as in clip: a failed convert's stderr is its one error line
    notify = held
    target_dtype = _cast_target(dtype)
    target = policy.target_for(src, out, force, durable)
    with (
        interrupts.deferred(writes=True),
        scratch.keeping_clear_of([src, out]),  # a sweep in $TMPDIR spares OUT's folder
        open_reader(src) as stored,
    ):
        if target_dtype is None:
            reader = _converted(stored, target.writer_class())
        else:
            reader = _cast_reader(stored, target_dtype, allow_lossy)
        _refuse_undecoded(stored, reader, dtype)
        writer_cls = policy.check_writable(reader, target)
        _expect_all_elements(reader, writer_cls)  # the input's refusal before any loss
        losses = writer_cls.structure_losses(reader)
        losses += archive_losses(reader, writer_cls.format_name)
        losses += _join_losses(reader, writer_cls, target)
        losses += _cast_losses(reader) if target_dtype is not None else []
        policy.check_losses(losses, allow_lossy, notify, target.out)
        notes = writer_cls.structure_notes(reader)  # said once OUT is written, as in clip
        copying = copy_plan(reader.infos)
        _write_out(
            reader,
            writer_cls,
            target,
            lambda _writer, _guard: copying,
            allow_large_side_files,
            progress,
            notify,
        )
        for note in notes:
            notify("note", note)
        if target_dtype is not None:
            _cast_notes(reader, notify, target.is_directory)
        converted = list(reader.infos)
    held.release()
    return converted


def _refuse_undecoded(stored: Reader, reader: Reader, dtype: str | None) -> None:
    """Exit 4 where convert would write real values (--dtype, or a GGUF file's logical
    tensors into another format) and some quantized weight is not decoded (scope)."""
    from clipcli.logical.cast import CastReader
    from clipcli.logical.reader import LogicalReader

    source = reader.source if isinstance(reader, CastReader) else reader
    if source is stored:
        if dtype is None:
            return  # the stored tensors, config.json as it is: lossless
        undecoded: list[tuple[str, str]] = []
        decoded = False
    else:
        assert isinstance(source, LogicalReader)
        undecoded = source.view.undecoded()
        decoded = any(not t.plain for t in source.logical)
    doing = f"convert --dtype {dtype}" if dtype is not None else "this convert"
    directory = None if decoded else stored.model_directory
    scope.refuse_undecoded(source.infos, undecoded, directory, doing)


def _join_losses(reader: Reader, writer_cls: type[Writer], target: Target) -> list[str]:
    """What OUT's metadata loses of IN's: nothing into a directory (the files are kept) or
    into IN's own format (its writer keeps the metadata as stored: GGUF's KV section)."""
    if target.is_directory or writer_cls.format_name == reader.format_name:
        return []
    return reader.join_losses()


def _converted(reader: Reader, writer_cls: type[Writer]) -> Reader:
    """What convert writes of `reader`: its stored tensors, or its logical ones where the
    view's stored parts mean something only in their own format (View.stored_format:
    GGUF's blocks) and OUT is another: a GGUF file into safetensors is dequantized."""
    from clipcli.logical import views

    logical = views.logical(reader)
    bound = getattr(logical, "view", None)
    if bound is not None and bound.stored_format not in (None, writer_cls.format_name):
        return logical
    return reader


def _refuse_format_bound_parts(reader: Reader, writer_cls: type[Writer], out: object) -> None:
    """Exit 2 for a clip whose stored parts mean something only in their own format (GGUF's
    blocks, View.stored_format) into another: clipped, they are written as they are stored."""
    from clipcli.logical.reader import LogicalReader

    if not isinstance(reader, LogicalReader):
        return
    bound = reader.view.stored_format
    if bound is not None and bound != writer_cls.format_name:
        raise UsageError(
            f"{out}: a clip of {reader.format_name} block-quantized tensors writes "
            f"{reader.format_name} only (their block scales are rescaled); to clip their "
            "values in another format, convert to it first (which dequantizes them)"
        )


def _cast_target(name: str | None) -> np.dtype[Any] | None:
    """convert --dtype NAME's dtype; a name convert does not write is a usage error."""
    if name is None:
        return None
    from clipcli.numerics.casting import CAST_TARGETS, cast_target

    found = cast_target(name)
    if found is None:
        choices = ", ".join(sorted(set(CAST_TARGETS.values())))
        raise UsageError(f"--dtype {name!r}: convert writes one of {choices}")
    return found


def _cast_reader(stored: Reader, dtype: np.dtype[Any], allow_lossy: bool) -> Reader:
    from clipcli.logical import views
    from clipcli.logical.cast import CastReader

    return CastReader(views.logical(stored), dtype, allow_overflow=allow_lossy)


def _cast_losses(reader: Reader) -> list[str]:
    from clipcli.logical.cast import CastReader

    assert isinstance(reader, CastReader)
    return reader.losses()


def _cast_notes(reader: Reader, notify: scope.Notify, wrote_directory: bool) -> None:
    from clipcli.logical.cast import CastReader

    assert isinstance(reader, CastReader)
    # Only a directory OUT gets the config.json (one file leaves it out, and says so).
    if wrote_directory and reader.rewritten_config() is not None:
        notify("note", "config.json written without its quantization_config (weights dequantized)")
    for over in reader.overflows:
        notify(
            "warning",
            f"{over.name}: {over.values} values overflowed {reader.target.name} (|x| up to "
            f"{over.largest:.6g}) and were written as +-inf (--allow-lossy)",
        )


# ---------------------------------------------------------------- writing OUT


def _is_logical(reader: Reader) -> bool:
    """A LogicalReader (a view that is not the identity), told apart without importing
    the logical layer for plain checkpoints' sake."""
    from clipcli.logical.reader import LogicalReader

    return isinstance(reader, LogicalReader)


def _count_once_over(spec: ClipSpec) -> CountOnceOver | None:
    """When the histograms of a clip's 8/16-bit floats are counted: once a tensor's own
    norm (--norm) or the global norm (--global) may be over the limit; from the start in
    the other modes (--average's limit depends on the tensor, --group-by's and --use-norm's
    factors on more than one norm)."""
    from clipcli.jobs import pipeline
    from clipcli.jobs.spec import Mode

    if spec.axes is not None or spec.use_norm is not None or spec.group_by is not None:
        return None
    if spec.mode is Mode.NORM:
        return pipeline.CountOnceOver(spec.limit, per_tensor=True)
    if spec.mode is Mode.GLOBAL:
        return pipeline.CountOnceOver(spec.limit, False, spec.skip_nonfinite)
    return None


def _may_scale(selection: Selection) -> Callable[[TensorInfo], bool]:
    """The tensors a clip may scale (selected, not kept apart: no scales, no training
    state): only they need the bit-pattern histograms of the factor search and of the
    outcome; thousands of float16 scales of a quantized model would each count 65,536."""

    def may_scale(info: TensorInfo) -> bool:
        return selection(info.name) and selection.left_out(info.name) is None

    return may_scale


def _with_parts(selection: Selection, reader: Reader) -> Selection:
    """`selection` with a logical reader's parts (scales, zero points) kept apart and its
    tied tensors counted once."""
    if not _is_logical(reader):
        return selection
    parts = getattr(reader, "part_roles", None)
    tied = getattr(reader, "tied", None)
    if parts:
        selection = dataclasses.replace(selection, parts=frozenset(parts))
    if tied:
        selection = dataclasses.replace(selection, tied=_counted_ties(selection, tied))
    return selection


def _counted_ties(selection: Selection, tied: Mapping[str, str]) -> dict[str, str]:
    """Each tie counted once among the names that count: of a tied group (a first name
    and the names tied to it, in file order), the first that is selected and not training
    state stands for the others that count. A name that does not count stands for none:
    a weight tied to an optimizer tensor before it, or the lm_head.weight that
    `--include 'lm_head*'` selects of a tied pair, is counted itself, not zero times."""
    groups: dict[str, list[str]] = {}
    for name, first in tied.items():
        groups.setdefault(first, [first]).append(name)
    counted_ties: dict[str, str] = {}
    for members in groups.values():
        counted = [n for n in members if selection(n) and selection.left_out(n) is None]
        if len(counted) > 1:
            counted_ties.update(dict.fromkeys(counted[1:], counted[0]))
    return counted_ties


def _overlap_groups(reader: Reader, selection: Selection) -> list[tuple[str, ...]]:
    """Groups of counted tensors (two or more) whose values overlap in part: views of one
    storage (clipcli.logical.pytorch)."""
    groups = getattr(reader, "overlapping", None) if _is_logical(reader) else None
    found = []
    for group in groups or ():
        counted = tuple(n for n in group if selection(n) and selection.left_out(n) is None)
        if len(counted) > 1:
            found.append(counted)
    return found


def _listed_names(names: tuple[str, ...], limit: int = 4) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _check_ties(reader: Reader, selection: Selection) -> None:
    """A tied tensor is written with its first one's bytes: both are acted on or neither
    (exit 2, before any data is read), or the copy would untie them."""
    for name, first in (getattr(reader, "tied", None) or {}).items():
        acted = [selection(n) and selection.left_out(n) is None for n in (name, first)]
        if acted[0] != acted[1]:
            chosen, other = (name, first) if acted[0] else (first, name)
            raise UsageError(
                f"{name} is tied to {first} (the same values, one storage): the selection "
                f"acts on {chosen} but not on {other}; select both or neither"
            )


def _execute(
    made: Plan,
    logical: Reader,
    reader: Reader,
    writer: Writer,
    progress: Progress,
    label: str = "writing",
) -> list[Outcome]:
    """Carry out a plan made on `logical`'s tensors: lowered to the stored tensors of
    `reader` when they differ, with the outcomes lifted back."""
    from clipcli.jobs import execution  # WRITING_MODULES
    from clipcli.logical.reader import LogicalReader

    if not isinstance(logical, LogicalReader):
        return execution.execute(made, reader, writer, progress, label)
    from clipcli.jobs import lowering

    lowered = lowering.lower(made, logical)
    scalers = lowering.stored_scalers(made, logical)
    outcomes = execution.execute(lowered, reader, writer, progress, label, scalers)
    return lowering.lift(made, lowered, outcomes, logical)


def _expect_all_elements(reader: Reader, writer_cls: type[Writer]) -> None:
    """Every element will be made (OUT holds no fill values): the input's budgets charged
    for them now (Reader.expect_all_elements, once per tensor however often asked). Asked
    before the structure's losses are listed: a record dropped for what the input itself
    is refused for would otherwise be named as a loss that --allow-lossy accepts, only for
    the run to be refused after it."""
    if not writer_cls.copies_constants(reader):
        reader.expect_all_elements()


@contextlib.contextmanager
def _blaming_a_changed_input(guard: InputGuard) -> Iterator[None]:
    """A value measured finite that a later pass reads as inf or NaN (NotFiniteError) is
    the input changing under the run: the input's identity then says so (exit 3, one
    line); if it did not change, the error stands (a fault of clipcli's, exit 70)."""
    try:
        yield
    except NotFiniteError:
        guard.check("while it was being read")
        raise


def _write_out(
    reader: Reader,
    writer_cls: type[Writer],
    target: Target,
    make_plan: Callable[[Writer, InputGuard], Plan],
    allow_large_side_files: bool,
    progress: Progress,
    notify: scope.Notify,
    logical: Reader | None = None,
) -> tuple[Plan, list[Outcome]]:
    """Write OUT through its target. The plan is made once the writer exists, so that it
    can start copying unchanged tensors early; a refusal while planning leaves nothing.
    The input must not change from opening to the commit (clipcli.system.identity)."""

    guard = InputGuard(reader.source_identities())
    policy.check_target(reader, writer_cls, target, allow_large_side_files)
    _expect_all_elements(reader, writer_cls)  # an input budget's refusal before OUT exists
    # Said once OUT is written (with the target's own notes): a failed run leaves nothing
    # out of anything, and its stderr is the one error line.
    left_out: list[str] = []
    if target.is_directory:
        left_out = [f"left out {where}: {why}" for where, why in reader.left_out_entries()]
    elif dropped := policy.files_beside_weights(reader):
        shown = ", ".join(dropped[:5]) + (
            f" and {len(dropped) - 5} more" if len(dropped) > 5 else ""
        )
        left_out = [f"OUT is one file: left out the model directory's other files ({shown})"]
    metadata = policy.output_metadata(reader, target.is_directory)
    with target.stage() as staged:
        writer = writer_cls(
            staged, Checkpoint(list(reader.infos), metadata, reader), target.durable
        )
        try:
            with _blaming_a_changed_input(guard):
                made = make_plan(writer, guard)
        except BaseException:
            writer.abort()
            raise
        with _blaming_a_changed_input(guard):
            outcomes = _execute(made, logical or reader, reader, writer, progress)
        guard.check("while it was being read")
    for note in [*left_out, *target.notes]:
        notify("note", note)
    return made, outcomes
