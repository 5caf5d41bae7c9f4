"""`clipcli clip` and `clipcli convert`: write OUT from IN."""

import contextlib
import sys
from collections.abc import Iterator

from clipcli.cli.commands.common import (
    emit,
    notify,
    print_report,
    progress,
    report_format,
    selection,
)
from clipcli.cli.declarations import ClipRequest, ConvertRequest
from clipcli.errors import UsageError, WriteError, printable
from clipcli.report.builders import written_to
from clipcli.words import count


def parse_axes(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(part) for part in text.split(",") if part.strip() != ""]
    except ValueError:
        raise UsageError(f"--axes takes comma-separated integers, got {text!r}") from None


def clip(request: ClipRequest) -> None:
    from clipcli.api import clip
    from clipcli.jobs.spec import build_spec
    from clipcli.report.builders import clip_report
    from clipcli.system import interrupts

    fmt = report_format(request.fmt, request.as_json, request.quiet)
    spec = build_spec(
        low=request.low,
        high=request.high,
        value=request.value,
        norm=request.norm,
        average=request.average,
        global_=request.global_,
        axes=parse_axes(request.axes),
        use_norm=request.use_norm,
        skip_nonfinite=request.skip_nonfinite,
        group_by=request.group_by,
        skip_low_rank=request.skip_low_rank,
    )
    # Signals are recorded from here to the end: acted on between chunks until OUT is
    # committed, moot after that (OUT is whole, so the run reports success).
    with interrupts.deferred(writes=True):
        result = clip(
            request.src,
            request.out,
            spec,
            selection(request.include, request.exclude, request.all_tensors),
            dry_run=request.dry_run,
            force=request.force,
            durable=request.fsync,
            progress=progress(request.quiet),
            allow_large_side_files=request.allow_large_side_files,
            notify=notify,
            allow_lossy=request.allow_lossy,
        )
        if not request.quiet:
            # OUT '-' is the clipped file on stdout: the report goes to stderr instead.
            with (
                contextlib.redirect_stdout(sys.stderr if request.out == "-" else sys.stdout),
                _written_anyway(None if request.dry_run or request.out == "-" else request.out),
            ):
                emit(lambda: print_report(clip_report(result, request.sort, request.top), fmt))


def convert(request: ConvertRequest) -> None:
    from clipcli.api import convert
    from clipcli.system import interrupts

    with interrupts.deferred(writes=True):  # as for clip
        infos = convert(
            request.src,
            request.out,
            force=request.force,
            progress=progress(request.quiet),
            allow_large_side_files=request.allow_large_side_files,
            notify=notify,
            allow_lossy=request.allow_lossy,
            dtype=request.dtype,
        )
        if not request.quiet:
            total = sum(i.nbytes for i in infos)
            listed = f"{count(len(infos), 'tensor')}, {count(total, 'byte')}"
            line = f"wrote {printable(written_to(str(request.out)))}: {listed}"
            # as for clip: OUT '-' is the file on stdout, so the line goes to stderr
            with (
                contextlib.redirect_stdout(sys.stderr if request.out == "-" else sys.stdout),
                _written_anyway(None if request.out == "-" else request.out),
            ):
                emit(lambda: print(line))


@contextlib.contextmanager
def _written_anyway(out: str | None) -> Iterator[None]:
    """The report comes after OUT is committed: if it cannot be written (stdout full or
    closed), the run still fails (exit 5: a script asked for a report it did not get), but
    the line says that OUT is there and whole, since exit 5 otherwise means nothing was."""
    try:
        yield
    except WriteError as exc:
        if out is None:
            raise
        raise WriteError(f"{exc}; {out} was written and is complete") from None
