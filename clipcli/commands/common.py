"""What every command shares: option types, the selection, stderr notes, progress, output."""

import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from clipcli.errors import UsageError, WriteError, printable
from clipcli.report import OutputFormat

if TYPE_CHECKING:
    from clipcli.selection import Selection

PathArg = Annotated[
    Path,
    typer.Argument(
        help="Checkpoint file, Hugging Face model directory, or *.safetensors.index.json.",
        show_default=False,
    ),
]
InArg = Annotated[
    Path,
    typer.Argument(
        metavar="IN", help="Input checkpoint file or model directory.", show_default=False
    ),
]
OutArg = Annotated[
    str,  # not Path: a trailing "/" (write a model directory) must survive
    typer.Argument(
        metavar="OUT",
        help="Output file (its extension picks the format), or a model directory: a "
        "name ending in /, or with no extension when IN is a model directory; '-' streams "
        "a safetensors IN's clipped copy to standard output (the report goes to stderr).",
        show_default=False,
    ),
]
FormatOpt = Annotated[OutputFormat, typer.Option("--format", "-f", help="Report format.")]
IncludeOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--include",
        "-i",
        help="Only tensors whose whole name matches this glob (repeatable; '*attn*' for a "
        "substring). A selection of nothing is refused (exit 2).",
    ),
]
ExcludeOpt = Annotated[
    list[str] | None,
    typer.Option("--exclude", "-x", help="Skip tensors matching this glob (repeatable; wins)."),
]
AllTensorsOpt = Annotated[
    bool,
    typer.Option(
        "--all-tensors",
        help="Also act on training state: optimizer slots and counters (optimizer_weights/, "
        "optimizer/, optimizer., optim_state) and BatchNorm running statistics. By default "
        "they are listed apart, left out of the global norm and copied bit for bit.",
    ),
]
AllowLargeSideFilesOpt = Annotated[
    bool,
    typer.Option(
        "--allow-large-side-files",
        help="Copy a model directory's other files even over 1 GiB each (holes stay holes).",
    ),
]


AllowLossyOpt = Annotated[
    bool,
    typer.Option(
        "--allow-lossy",
        help="Write OUT even when its format cannot hold all of IN beyond the tensors (HDF5 "
        "attributes, groups and non-tensor datasets into .npz; file metadata into .npz); "
        "one warning line names what was dropped. Without it that is refused (exit 2).",
    ),
]


def selection(
    include: list[str] | None, exclude: list[str] | None, all_tensors: bool = False
) -> "Selection":
    from clipcli.selection import Selection

    return Selection(tuple(include or ()), tuple(exclude or ()), all_tensors)


def notify(level: str, text: str) -> None:
    """A warning or note from the library: one line on stderr, stdout stays the report."""
    print(f"clipcli: {level}: {printable(text)}", file=sys.stderr)


def progress(quiet: bool = False) -> Any:
    """A terminal progress bar when stderr is a terminal, else the silent default."""
    from clipcli.progress import SILENT

    if quiet or not sys.stderr.isatty():
        return SILENT
    from clipcli.report.progress_bar import TerminalProgress

    return TerminalProgress()


def check_threshold(flag: str, value: float | None) -> None:
    """A NaN threshold can never be exceeded: refuse it rather than never fail."""
    if value is not None and math.isnan(value):
        raise UsageError(f"{flag} nan can never be exceeded; give a number")


class Stdout:
    """Whether the process started with stdout closed (`>&-`); set by cli.main()."""

    closed = False


def emit(write: Callable[[], None]) -> None:
    """Write the report; if the reader closes the pipe, stop writing but finish the command:
    a --fail-above verdict still decides the exit code (`norms --fail-above 5 m | head -1`
    in a pipefail script must still say 1 when the norm is over)."""
    finish_progress()  # the bar's line ends before the report starts
    if Stdout.closed:
        raise WriteError("standard output is closed; the report cannot be written")
    try:
        write()
        sys.stdout.flush()
    except BrokenPipeError:
        reader_went_away()
    except OSError as exc:  # /dev/full, a failing disk under a redirect
        reason = exc.strerror or str(exc)
        raise WriteError(f"standard output: cannot write the report: {reason}") from None


def print_report(report: Any, fmt: OutputFormat) -> None:
    from clipcli.report import render

    render(report, fmt, sys.stdout)


def finish_progress() -> None:
    """End the progress bar's line, if one was ever drawn (never imports rich for it)."""
    bars = sys.modules.get("clipcli.report.progress_bar")
    if bars is not None:
        bars.close_all()


def reader_went_away() -> int:
    """stdout's reader closed the pipe: exit 0, quietly. stdout is pointed at /dev/null so
    that the interpreter's final flush of what is still buffered cannot fail and print."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no real stdout (tests capture it): nothing to flush
        pass
    return 0
