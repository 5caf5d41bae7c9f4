"""What every command's body shares: the selection, stderr notes, progress, output."""

import contextlib
import math
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from clipcli.errors import ExitCode, UsageError, Verdict, WriteError, printable
from clipcli.report import OutputFormat
from clipcli.system import interrupts

if TYPE_CHECKING:
    from clipcli.jobs.selection import Selection


def selection(
    include: Sequence[str], exclude: Sequence[str], all_tensors: bool = False
) -> "Selection":
    from clipcli.jobs.selection import Selection

    return Selection(tuple(include), tuple(exclude), all_tensors)


class _Held:
    """The notes and warnings of the command running now, in the order they were said."""

    lines: list[tuple[str, str]] = []


def notify(level: str, text: str) -> None:
    """A warning or note from the library (any command, the CLI's own checks too): held
    until the command has succeeded (release_notes), so that a failed run's stderr is its
    one `clipcli: error:` line, whichever step fails (a read error, a NaN refusal, a full
    stdout, a signal). A --fail-above verdict is no failure: the lines come before it."""
    _Held.lines.append((level, text))


def release_notes() -> None:
    """Print the held lines: the command succeeded (or reached its --fail-above verdict).
    The progress bar is finished first: on a terminal the lines start a row of their own
    (where the bar was), not after the codes that erased it."""
    lines, _Held.lines = _Held.lines, []
    finish_progress()
    for level, text in lines:
        _print_note(level, text)


def drop_notes() -> None:
    """Forget the held lines: the command failed, its one error line says why."""
    _Held.lines = []


def verdict(line: str) -> NoReturn:
    """A --fail-above verdict (exit 1): the held lines, then its own line on stderr."""
    release_notes()
    print(line, file=sys.stderr)
    raise Verdict(ExitCode.CONDITION)


def _print_note(level: str, text: str) -> None:
    """One note: one line on stderr, stdout stays the report. On a terminal a line too
    long for it is broken between words (continued two spaces in), so that the terminal
    does not break it inside one."""
    line = f"clipcli: {level}: {printable(text)}"
    width = terminal_width(sys.stderr)
    if width is not None:
        from clipcli.report.table import fit_line

        line = "\n".join(fit_line(line, width))
    print(line, file=sys.stderr)


def terminal_width(stream: Any) -> int | None:
    """The width of the terminal `stream` is (rich's rule: COLUMNS, else the terminal's
    size); None when it is no terminal (a pipe or file: a script's lines stay whole)."""
    import os

    try:
        if not stream.isatty():
            return None
        columns = os.environ.get("COLUMNS", "")
        if columns.isdigit() and int(columns) > 0:
            return int(columns)
        return os.get_terminal_size(stream.fileno()).columns or None
    except (AttributeError, ValueError, OSError):
        return None


def progress(quiet: bool = False) -> Any:
    """A terminal progress bar when stderr is a terminal, else the silent default."""
    from clipcli.jobs.progress import SILENT

    if quiet or not sys.stderr.isatty():
        return SILENT
    from clipcli.report.progress_bar import TerminalProgress

    return TerminalProgress()


def check_threshold(flag: str, value: float | None) -> None:
    """A NaN threshold can never be exceeded: refuse it rather than never fail."""
    if value is not None and math.isnan(value):
        raise UsageError(f"{flag} nan can never be exceeded; give a number")


def report_format(fmt: OutputFormat, as_json: bool, quiet: bool = False) -> OutputFormat:
    """The report's format: --json is --format json (the spelling gh and kubectl users
    reach for); refused when it contradicts --format, or when --quiet asks for no report."""
    if as_json:
        if fmt not in (OutputFormat.TABLE, OutputFormat.JSON):
            raise UsageError(f"--json is --format json; it cannot be --format {fmt.value} too")
        fmt = OutputFormat.JSON
    if quiet and fmt is not OutputFormat.TABLE:  # a script asked for a report and for none
        asked = "--json" if as_json else f"--format {fmt.value}"
        raise UsageError(f"--quiet prints no report; it cannot be {asked}")
    return fmt


ESCAPE = "clipcli.escape"


def _escape(exc: UnicodeError) -> tuple[bytes, int]:
    """What the stream's encoding cannot hold, as backslash escapes (`w\\xe9`); bytes that
    surrogateescape carried in from a file name go out as they came in."""
    if not isinstance(exc, UnicodeEncodeError):
        raise exc
    out = bytearray()
    for ch in exc.object[exc.start : exc.end]:
        if 0xDC80 <= ord(ch) <= 0xDCFF:
            out.append(ord(ch) - 0xDC00)
        else:
            out += ch.encode("ascii", "backslashreplace")
    return bytes(out), exc.end


def escape_unencodable() -> None:
    """stdout and stderr never fail to encode: under LC_ALL=C (PYTHONUTF8=0) or
    PYTHONIOENCODING=ascii a name like 'wé' made the report raise UnicodeEncodeError
    (exit 70, after clip had committed OUT). What the encoding cannot hold is escaped."""
    import codecs

    codecs.register_error(ESCAPE, _escape)
    for stream in (sys.stdout, sys.stderr):
        if getattr(stream, "errors", None) in ("strict", "surrogateescape"):
            with contextlib.suppress(AttributeError, ValueError, OSError):
                stream.reconfigure(errors=ESCAPE)  # type: ignore[union-attr]


class Stdout:
    """Whether the process started with stdout closed (`>&-`); set by cli.main()."""

    closed = False


def emit(write: Callable[[], None]) -> None:
    """Write the report; if the reader closes the pipe, stop writing but finish the command:
    a --fail-above verdict still decides the exit code (`norms --fail-above 5 m | head -1`
    in a pipefail script must still say 1 when the norm is over)."""
    finish_progress()  # the bar's line ends before the report starts
    interrupts.check()  # a signal that came while reading ends the run before the report
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
    """End the progress bar's line, if one was ever drawn (never imports rich for it): what
    comes next (notes, the error line, the report) starts a line of its own."""
    bars = sys.modules.get("clipcli.report.progress_bar")
    if bars is not None:
        bars.close_all()
        bars.start_clean_line()


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
