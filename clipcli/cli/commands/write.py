"""`clipcli clip` and `clipcli convert`: write OUT from IN."""

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

from clipcli.cli.commands.common import (
    emit,
    notify,
    print_report,
    progress,
    report_format,
    selection,
)
from clipcli.errors import UsageError, WriteError, printable
from clipcli.report import OutputFormat, SortKey
from clipcli.report.builders import written_to
from clipcli.words import count

CONVERT_EPILOG = (
    "\b\nExamples:\n"
    "  clipcli convert model.npz model.safetensors\n"
    "  clipcli convert weights.h5 weights.safetensors --force"
)


def parse_axes(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(part) for part in text.split(",") if part.strip() != ""]
    except ValueError:
        raise UsageError(f"--axes takes comma-separated integers, got {text!r}") from None


def clip(
    src: Path,
    out: str,
    low: float | None = None,
    high: float | None = None,
    value: float | None = None,
    norm: float | None = None,
    axes: str | None = None,
    skip_low_rank: bool = False,
    average: float | None = None,
    global_: float | None = None,
    use_norm: float | None = None,
    group_by: str | None = None,
    include: list[str] | None = None,
    exclude: list[str] | None = None,
    skip_nonfinite: bool = False,
    dry_run: bool = False,
    force: bool = False,
    fsync: bool = True,
    quiet: bool = False,
    fmt: OutputFormat = OutputFormat.TABLE,
    as_json: bool = False,
    sort: SortKey = SortKey.NAME,
    top: int | None = None,
    allow_large_side_files: bool = False,
    all_tensors: bool = False,
    allow_lossy: bool = False,
) -> None:
    from clipcli.api import clip
    from clipcli.jobs.spec import build_spec
    from clipcli.report.builders import clip_report
    from clipcli.system import interrupts

    fmt = report_format(fmt, as_json, quiet)
    spec = build_spec(
        low=low,
        high=high,
        value=value,
        norm=norm,
        average=average,
        global_=global_,
        axes=parse_axes(axes),
        use_norm=use_norm,
        skip_nonfinite=skip_nonfinite,
        group_by=group_by,
        skip_low_rank=skip_low_rank,
    )
    # Signals are recorded from here to the end: acted on between chunks until OUT is
    # committed, moot after that (OUT is whole, so the run reports success).
    with interrupts.deferred(writes=True):
        result = clip(
            src,
            out,
            spec,
            selection(include, exclude, all_tensors),
            dry_run=dry_run,
            force=force,
            durable=fsync,
            progress=progress(quiet),
            allow_large_side_files=allow_large_side_files,
            notify=notify,
            allow_lossy=allow_lossy,
        )
        if not quiet:
            # OUT '-' is the clipped file on stdout: the report goes to stderr instead.
            with (
                contextlib.redirect_stdout(sys.stderr if out == "-" else sys.stdout),
                _written_anyway(None if dry_run or out == "-" else out),
            ):
                emit(lambda: print_report(clip_report(result, sort, top), fmt))


def convert(
    src: Path,
    out: str,
    force: bool = False,
    quiet: bool = False,
    allow_large_side_files: bool = False,
    allow_lossy: bool = False,
    dtype: str | None = None,
) -> None:
    from clipcli.api import convert
    from clipcli.system import interrupts

    with interrupts.deferred(writes=True):  # as for clip
        infos = convert(
            src,
            out,
            force=force,
            progress=progress(quiet),
            allow_large_side_files=allow_large_side_files,
            notify=notify,
            allow_lossy=allow_lossy,
            dtype=dtype,
        )
        if not quiet:
            total = sum(i.nbytes for i in infos)
            listed = f"{count(len(infos), 'tensor')}, {count(total, 'byte')}"
            line = f"wrote {printable(written_to(str(out)))}: {listed}"
            # as for clip: OUT '-' is the file on stdout, so the line goes to stderr
            with (
                contextlib.redirect_stdout(sys.stderr if out == "-" else sys.stdout),
                _written_anyway(None if out == "-" else out),
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
