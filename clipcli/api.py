"""The library face of clipcli: ls, measure, clip, convert, diff. Nothing here prints.

Each job opens its input, checks what names alone decide (clipcli.scope), runs the
streaming passes (clipcli.pipeline) and returns a frozen result for clipcli.report.
`clip` measures, plans (clipcli.plan: a value, complete before the first byte is written),
then executes the plan into OUT's target (clipcli.output: one commit point).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from clipcli import interrupts, pipeline, scope, scratch
from clipcli.errors import InputError, UsageError
from clipcli.formats.base import (
    Checkpoint,
    NonTensorInfo,
    Reader,
    TensorInfo,
    Writer,
    archive_losses,
)
from clipcli.formats.structure import check_losses
from clipcli.identity import InputGuard
from clipcli.io import open_reader
from clipcli.measurement import Measurement
from clipcli.numerics.norms import NormAccumulator, global_norm
from clipcli.progress import SILENT, Progress
from clipcli.selection import EVERY_TENSOR, Selection

if TYPE_CHECKING:
    from clipcli.diff import DiffResult  # diff's modules load when a diff runs
    from clipcli.output import Target
    from clipcli.plan import Outcome, Plan, Reason, TensorPlan
    from clipcli.spec import ClipSpec

# What clip and convert import in their functions, beyond what ls and norms need: norms
# imports this module too and never writes, and these cost it ~15 ms of start-up (issue
# 12, item 7). The CLI imports them up front for clip and convert (clipcli.__main__).
WRITING_MODULES = (
    "clipcli.execution",
    "clipcli.footprint",
    "clipcli.output",
    "clipcli.plan",
    "clipcli.spec",
    "clipcli.stream_target",
    "clipcli.formats.safetensors.writer",
    "clipcli.formats.safetensors.stream",
)


def list_tensors(
    path: Path,
) -> tuple[str, dict[str, str], list[TensorInfo], list[NonTensorInfo]]:
    with scratch.keeping_clear_of([path]), open_reader(path) as reader:
        return (
            reader.format_name,
            dict(reader.metadata),
            list(reader.infos),
            list(reader.non_tensors),
        )


def measure(
    path: Path,
    selection: Selection = EVERY_TENSOR,
    progress: Progress = SILENT,
    notify: scope.Notify = scope.ignore,
    group_by: str | None = None,
) -> Measurement:
    with scratch.keeping_clear_of([path]), open_reader(path) as reader:
        return measure_reader(reader, selection, progress, notify, group_by)


def measure_reader(
    reader: Reader,
    selection: Selection = EVERY_TENSOR,
    progress: Progress = SILENT,
    notify: scope.Notify = scope.ignore,
    group_by: str | None = None,
) -> Measurement:
    infos = selection.check(reader.infos, notify)
    selection.check_weights(infos, notify)
    scope.warn_quantized(reader.infos, reader.model_directory, notify)
    for text in reader.warnings():
        notify("warning", text)
    if group_by is not None:
        counted = [i.name for i in scope.floating(infos) if selection.left_out(i.name) is None]
        scope.check_groups(counted, group_by, notify)
    return pipeline.measure(reader, infos, selection.describe, progress)


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
    with (
        scratch.keeping_clear_of([path_a, path_b]),  # one reader's sweep spares the other
        open_reader(path_a) as reader_a,
        open_reader(path_b) as reader_b,
    ):
        check_diff_scope(reader_a, reader_b, selection, notify)
        return pipeline.compare(
            reader_a,
            reader_b,
            selection,
            chunk_elems=chunk_elems,
            progress=progress,
            workers=workers,
        )


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
            reader.infos, reader.model_directory, lambda *message: said.append(message)
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
    def after(self) -> NormAccumulator:
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
        pairs = zip(self.plan.tensors, self.outcomes, strict=True)
        return global_norm(outcome.after.norm for p, outcome in pairs if p.in_global)


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
    from clipcli import execution  # WRITING_MODULES

    target = _target(src, out, force, durable)
    with (
        interrupts.deferred(writes=True),
        scratch.keeping_clear_of([src, out]),  # a sweep in $TMPDIR spares OUT's folder
        open_reader(src) as reader,
    ):
        writer_cls = check_writable(reader, target)
        losses = writer_cls.structure_losses(reader)
        losses += archive_losses(reader, writer_cls.format_name)
        losses += [] if target.is_directory else reader.join_losses()
        check_losses(losses, allow_lossy, notify, target.out)
        # Said once OUT is written (or the dry run is done): a failed run's stderr is its
        # one error line.
        notes = writer_cls.structure_notes(reader)
        check_clip_scope(reader, spec, selection, notify)
        if dry_run:
            # What the real run would refuse about OUT, refused here too; nothing is staged.
            # An existing OUT is not refused (nothing is written to it): it is judged as
            # with --force (a directory that holds other files, or IN, still is), and a
            # note says that the real run needs --force.
            check = target if force else _target(src, out, force=True, durable=durable)
            _check_target(reader, writer_cls, check, allow_large_side_files)
            check.release()
            if check.occupied and not force:
                notify("note", f"{target.out} exists: the run without --dry-run needs --force")
            made = plan_clip(reader, spec, selection, progress)
            outcomes = execution.execute(
                made, reader, execution.DiscardingWriter(), progress, "computing"
            )
        else:
            made, outcomes = _write_out(
                reader,
                writer_cls,
                target,
                lambda writer, guard: _plan_then_check(
                    reader, spec, selection, progress, writer, guard
                ),
                allow_large_side_files,
                progress,
                notify,
            )
        for note in notes:
            notify("note", note)
    return ClipResult(src, target.out, spec, dry_run, made, tuple(outcomes))


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
    from clipcli import execution  # WRITING_MODULES
    from clipcli.plan import plan
    from clipcli.spec import Mode

    hook = execution.copy_ahead_hook(spec, reader, writer) if writer is not None else None
    measurement = pipeline.measure(
        reader,
        list(reader.infos),
        selection.describe,
        progress,
        histograms=spec.mode is not Mode.VALUE and spec.axes is None,
        on_measured=hook,
    )
    return plan(measurement, spec, execution.output_check(reader))


def check_clip_scope(
    reader: Reader, spec: ClipSpec, selection: Selection, notify: scope.Notify
) -> None:
    """Everything about what the clip acts on that names alone decide, refused before any
    data is read: the selection, training state, quantized weights, --axes, --group-by."""
    from clipcli.spec import Mode  # WRITING_MODULES

    selected = selection.check(reader.infos, notify)
    selection.check_weights(selected, notify, writes=True)
    targets = [i for i in scope.floating(selected) if selection.left_out(i.name) is None]
    acted_on = [i for i in selected if selection.left_out(i.name) is None]
    scope.refuse_quantized(reader.infos, acted_on, reader.model_directory)
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
) -> list[TensorInfo]:
    """A lossless copy into OUT's format, metadata carried over where OUT can hold it."""
    from clipcli.plan import copy_plan  # WRITING_MODULES

    target = _target(src, out, force, durable)
    with (
        interrupts.deferred(writes=True),
        scratch.keeping_clear_of([src, out]),  # a sweep in $TMPDIR spares OUT's folder
        open_reader(src) as reader,
    ):
        writer_cls = check_writable(reader, target)
        losses = writer_cls.structure_losses(reader)
        losses += archive_losses(reader, writer_cls.format_name)
        losses += [] if target.is_directory else reader.join_losses()
        check_losses(losses, allow_lossy, notify, target.out)
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
        return list(reader.infos)


# ---------------------------------------------------------------- writing OUT


def check_writable(reader: Reader, target: Target) -> type[Writer]:
    """The writer for OUT, once every limit of its format that is known before writing
    holds (names, dtypes, names together, metadata): a refusal is exit 2 naming the tensor
    or key, before anything is created."""
    cls = target.writer_class()
    for info, problem in cls.tensor_problems(reader.infos):
        raise UsageError(f"{target.out}: tensor {info.name!r}: {problem}")
    reason = cls.check_names([info.name for info in reader.infos]) or cls.check_metadata(
        _output_metadata(reader, target.is_directory), reader
    )
    if reason is not None:
        raise UsageError(f"{target.out}: {reason}")
    return cls


def _output_metadata(reader: Reader, to_directory: bool) -> dict[str, str]:
    return dict(reader.metadata) if to_directory else reader.joined_metadata()


SIDE_FILE_LIMIT = 1 << 30  # bytes: configs and tokenizers are far smaller
# All side files together (a model's configs and tokenizers are tens of files and MBs):
# the per-file limit alone lets 100,000 files of 1 GiB through.
SIDE_FILES_MAX_COUNT = 10_000
SIDE_FILES_MAX_BYTES = 4 << 30


def _check_side_files(reader: Reader, allow_large: bool) -> None:
    """A model directory's other files are copied; one of absurd size is refused unless
    allowed, since a sparse 1 TB file would otherwise fill the disk; so are too many or too
    many bytes in all (exit 3), and a hard link with a name outside the directory (exit 3)."""
    if linked := reader.side_files_linked_elsewhere():
        path, links = linked[0]
        raise InputError(
            path,
            f"is a hard link with {links} names, some outside the model directory, so it may "
            "be any file of yours; not copied (copy the directory without hard links)",
        )
    opened = reader.source_identities()  # the files the copy will read, not the names now
    side_files = reader.side_files()
    if len(side_files) > SIDE_FILES_MAX_COUNT:
        raise InputError(
            reader.path,
            f"has {len(side_files)} other files to copy beside the weights; "
            f"at most {SIDE_FILES_MAX_COUNT} are copied",
        )
    if allow_large:
        return
    for path in side_files:
        size = opened[path].size
        if size > SIDE_FILE_LIMIT:
            raise UsageError(
                f"{path}: side file of {size} bytes is over the {SIDE_FILE_LIMIT >> 30} GiB "
                "limit for files copied beside the weights; pass --allow-large-side-files"
            )
    total = sum(opened[path].size for path in side_files)
    if total > SIDE_FILES_MAX_BYTES:  # a refusal the flag lifts, as for one large file
        raise UsageError(
            f"{reader.path}: its other files hold {total} bytes together, over the "
            f"{SIDE_FILES_MAX_BYTES >> 30} GiB copied beside the weights; "
            "pass --allow-large-side-files",
        )


def _target(src: Path, out: str | Path, force: bool, durable: bool) -> Target:
    from clipcli.output import choose_target  # WRITING_MODULES
    from clipcli.stream_target import STDOUT, StdoutTarget

    if str(out) == STDOUT:  # safetensors streamed to standard output (stream_target)
        return StdoutTarget(force=force, durable=durable)
    is_directory = src.is_dir() or src.name.endswith(".index.json")
    return choose_target(out, input_is_directory=is_directory, force=force, durable=durable)


def _check_target(
    reader: Reader, writer_cls: type[Writer], target: Target, allow_large_side_files: bool
) -> None:
    """Everything about OUT that is refused before any tensor data is read: OUT against
    the input (never IN, inside it or around it), what is in the way at OUT, side files."""
    from clipcli.footprint import InputFootprint  # WRITING_MODULES

    footprint = InputFootprint(reader.path, reader.source_files())
    target.check(footprint, writer_cls.output_names(reader))
    if target.is_directory:
        _check_side_files(reader, allow_large_side_files)


def _files_beside_weights(reader: Reader) -> list[str]:
    """A model directory's files that are neither its shards nor its index (config,
    tokenizer, weights in other forms), relative to it: none of them goes into one file."""
    directory = reader.model_directory
    if directory is None:
        return []
    copied = [path.relative_to(directory).as_posix() for path in reader.side_files()]
    return copied + [where for where, _ in reader.left_out_entries()]


def _write_out(
    reader: Reader,
    writer_cls: type[Writer],
    target: Target,
    make_plan: Callable[[Writer, InputGuard], Plan],
    allow_large_side_files: bool,
    progress: Progress,
    notify: scope.Notify,
) -> tuple[Plan, list[Outcome]]:
    """Write OUT through its target. The plan is made once the writer exists, so that it
    can start copying unchanged tensors early; a refusal while planning leaves nothing.
    The input must not change from opening to the commit (clipcli.identity)."""
    from clipcli import execution  # WRITING_MODULES

    guard = InputGuard(reader.source_identities())
    _check_target(reader, writer_cls, target, allow_large_side_files)
    if not writer_cls.copies_constants(reader):
        reader.expect_all_elements()  # an input budget's refusal comes before OUT exists
    # Said once OUT is written (with the target's own notes): a failed run leaves nothing
    # out of anything, and its stderr is the one error line.
    left_out: list[str] = []
    if target.is_directory:
        left_out = [f"left out {where}: {why}" for where, why in reader.left_out_entries()]
    elif dropped := _files_beside_weights(reader):
        shown = ", ".join(dropped[:5]) + (
            f" and {len(dropped) - 5} more" if len(dropped) > 5 else ""
        )
        left_out = [f"OUT is one file: left out the model directory's other files ({shown})"]
    metadata = _output_metadata(reader, target.is_directory)
    with target.stage() as staged:
        writer = writer_cls(
            staged, Checkpoint(list(reader.infos), metadata, reader), target.durable
        )
        try:
            made = make_plan(writer, guard)
        except BaseException:
            writer.abort()
            raise
        outcomes = execution.execute(made, reader, writer, progress)
        guard.check("while it was being read")
    for note in [*left_out, *target.notes]:
        notify("note", note)
    return made, outcomes
