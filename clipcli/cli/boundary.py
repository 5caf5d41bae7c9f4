"""The one error boundary: every failure, wherever it happens (option parsing, a command,
writing the report), becomes one stderr line `clipcli: error: ...` and a documented exit
code. cli.main() and the Typer app's commands (typer_app.py) both report through here.

Click's exceptions (Typer vendors Click) are recognised only when Typer is loaded: a run
that the quick parser took (clipcli/cli/quick_args.py) never imports it, so none can occur.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable
from typing import Any

from clipcli.cli.commands.common import (
    drop_notes,
    finish_progress,
    reader_went_away,
    release_notes,
)
from clipcli.errors import ClipcliError, ExitCode, Verdict, printable
from clipcli.system import interrupts
from clipcli.system.address_space import memory_detail, refused_memory
from clipcli.system.inputs import out_of_descriptors


class _Reported:
    """Whether a failure's line was printed in this run: main() must not print a second."""

    failure = False


def reset() -> None:
    _Reported.failure = False
    drop_notes()  # a run before this one in the same process (tests) left them


def failure_reported() -> bool:
    return _Reported.failure


def exit_code_for(exc: BaseException, args: list[str] | None = None) -> int:
    """The one mapping from an exception family to its stderr line and exit code.

    `args` are the command-line arguments when the exception comes from main() (option
    parsing included), None when it comes from inside a command."""
    finish_progress()  # the bar's line ends first, so the message starts a line of its own
    if isinstance(exc, Verdict):  # --fail-above: the command has said why (notes first)
        return int(exc.exit_code)
    if isinstance(exc, BrokenPipeError):
        # The reader of our stdout went away (`| head -1`): not an error, as for any Unix
        # tool (Click would make it exit 1); the notes of the run still come.
        with contextlib.suppress(OSError):
            release_notes()
        return reader_went_away()
    drop_notes()  # a failure's stderr is its one line, whatever was said before it
    typer: Any = sys.modules.get("typer")
    if typer is not None:
        code = _click_exit_code(typer, exc, args)
        if code is not None:
            return code
    if isinstance(exc, ClipcliError):
        return fail(str(exc), exc.exit_code)
    if refused_memory(exc):
        # As for a full disk (exit 5): the environment refused a resource (`ulimit -v`, a
        # container's memory); the input is not at fault. A write staged so far is gone.
        return fail(f"out of memory{memory_detail(exc)}", ExitCode.WRITE_FAILED)
    no_descriptor = out_of_descriptors(exc)  # e.g. importing a module (h5py) at `ulimit -n`
    if no_descriptor is not None:
        return fail(str(no_descriptor), no_descriptor.exit_code)
    if isinstance(exc, KeyboardInterrupt):
        # Outside a write there is nothing to clean up; inside one, the job cleaned up.
        return fail("interrupted", ExitCode.INTERRUPTED)
    if isinstance(exc, Exception):  # last line of defence: a bug, one line, exit 70
        if os.environ.get("CLIPCLI_DEBUG"):
            import traceback  # only here: it loads linecache and tokenize (~3 ms)

            traceback.print_exception(exc)
        message = f"internal error: {type(exc).__name__}: {exc} (set CLIPCLI_DEBUG=1 for details)"
        return fail(message, ExitCode.INTERNAL)
    raise exc  # SystemExit, GeneratorExit and the like are not ours to report


def run_command(body: Callable[[], None]) -> int:
    """Run a command's body inside the boundary; its exit code. What it raises comes from
    inside the command, not from parsing (a Click exception there is a bug: exit 70).
    cli.main() runs what the quick parser took through here, the Typer app its commands.
    Signals are recorded for the whole command (clipcli.system.interrupts): acted on between
    chunks, they unwind through the readers, which remove their temps."""
    drop_notes()  # none from an earlier command in this process (the Typer app in tests)
    try:
        with interrupts.deferred():
            interrupts.check()  # one that came while the command line was parsed
            body()
            sys.stdout.flush()  # a closed pipe must show here, not at interpreter exit
            release_notes()  # the command succeeded: now its notes and warnings
    except BaseException as exc:  # the boundary: every failure, one line
        return exit_code_for(exc)
    return ExitCode.OK


def _click_exit_code(typer: Any, exc: BaseException, args: list[str] | None) -> int | None:
    """Click's exceptions and exits, or None for any other exception."""
    if isinstance(exc, typer.Exit):  # Click's own exit (--help, completion)
        if isinstance(exc.__cause__, KeyboardInterrupt):  # Click's silent exit 130
            return fail("interrupted", ExitCode.INTERRUPTED)
        return int(exc.exit_code)
    if isinstance(exc, SystemExit) and type(sys.stdout).__name__ == "PacifyFlushWrapper":
        # Click's answer to a closed pipe while it prints (`clipcli --help | head -1`) is
        # exit 1, after wrapping stdout in PacifyFlushWrapper; that is not a failure.
        return reader_went_away()
    if isinstance(exc, typer.Abort):  # Click's Ctrl-C
        return fail("interrupted", ExitCode.INTERRUPTED)
    if isinstance(exc, typer.TyperException) and args is not None:
        # Click's usage errors, from option parsing (main() passes the arguments); raised
        # inside a command (args None), the same class is a bug: exit 70.
        return fail(usage_message(exc, args), ExitCode.USAGE)
    return None


def fail(message: str, code: int) -> int:
    """Print the run's one failure line; returns `code`."""
    _Reported.failure = True
    with contextlib.suppress(OSError):  # stderr is gone too; the exit code still tells
        print(f"clipcli: error: {printable(message)}", file=sys.stderr, flush=True)
    return code


def usage_message(exc: Any, args: list[str]) -> str:
    """Click's usage error on one line, with the hint a newcomer needs (what to type)."""
    from clipcli.cli.usage_hints import hinted

    return hinted(str(exc.format_message()).replace("\n", " ").rstrip("."), args)
