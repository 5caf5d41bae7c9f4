"""The command line: the Typer app, its commands' registration, and the one error boundary.

The commands' bodies live in clipcli/commands/ (parse results in, a library call, a report
out). Every failure, wherever it happens (option parsing, a command, writing the report),
goes through `exit_code_for`: one stderr line `clipcli: error: ...` and a documented exit
code. Heavy modules (numpy, h5py, safetensors, rich) are imported inside the commands so
that `clipcli --help` starts fast.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import typer

from clipcli import __version__
from clipcli.commands import compare, inspect, write
from clipcli.commands.common import Stdout, finish_progress, reader_went_away
from clipcli.errors import ClipcliError, ExitCode, printable

EXIT_CODES_HELP = """\b
Exit codes:
  0    success
  1    --fail-above: the global norm exceeds the threshold
  2    usage error or refused request (bad option, OUT exists, OUT is IN)
  3    input unreadable, malformed or unsafe
  4    data refused (NaN/Inf where a norm is needed, axis out of range,
       quantized weights a clip would touch)
  5    writing failed; nothing was left behind
  70   internal error (set CLIPCLI_DEBUG=1 for the traceback)
  130  interrupted (143 for SIGTERM); nothing was left behind"""

_APP_SETTINGS: dict[str, Any] = {
    "name": "clipcli",
    "help": "Inspect L2 norms of checkpoint tensors (.npz, .safetensors, .h5/.hdf5) and write "
    "clipped copies, with TensorFlow's clip_by_value / clip_by_norm / clip_by_average_norm / "
    "clip_by_global_norm semantics.\n\n"
    "\b\nExamples:\n"
    "  clipcli ls model.safetensors\n"
    "  clipcli norms model.safetensors --sort norm --top 10\n"
    "  clipcli clip --global 5.0 in.safetensors out.safetensors\n"
    "  clipcli clip --norm 1.0 --axes 0 in.h5 out.h5\n\n" + EXIT_CODES_HELP,
    "no_args_is_help": True,
    "add_completion": True,
    "rich_markup_mode": None,
    "pretty_exceptions_enable": False,
    "context_settings": {"help_option_names": ["-h", "--help"]},
}
app = typer.Typer(**_APP_SETTINGS)

F = TypeVar("F", bound=Callable[..., None])

# ------------------------------------------------------------------ the error boundary

_failure_reported = False  # main() must not print a second line for the same failure


def exit_code_for(exc: BaseException, args: list[str] | None = None) -> int:
    """The one mapping from an exception family to its stderr line and exit code.

    `args` are the command-line arguments when the exception comes from main() (option
    parsing included), None when it comes from inside a command."""
    finish_progress()  # the bar's line ends first, so the message starts a line of its own
    if isinstance(exc, typer.Exit):  # a verdict (--fail-above: 1), or Click's own exit
        if isinstance(exc.__cause__, KeyboardInterrupt):  # Click's silent exit 130
            return _fail("interrupted", ExitCode.INTERRUPTED)
        return int(exc.exit_code)
    if isinstance(exc, BrokenPipeError):
        # The reader of our stdout went away (`| head -1`): not an error, as for any Unix
        # tool (Click would make it exit 1).
        return reader_went_away()
    if isinstance(exc, SystemExit):
        # Click's answer to a closed pipe while it prints (`clipcli --help | head -1`) is
        # exit 1, after wrapping stdout in PacifyFlushWrapper; that is not a failure.
        # (typer vendors click, so the class is recognised by name.)
        if type(sys.stdout).__name__ == "PacifyFlushWrapper":
            return reader_went_away()
        raise exc
    if isinstance(exc, ClipcliError):
        return _fail(str(exc), exc.exit_code)
    if isinstance(exc, KeyboardInterrupt | typer.Abort):
        # Outside a write there is nothing to clean up; inside one, the job cleaned up.
        return _fail("interrupted", ExitCode.INTERRUPTED)
    if isinstance(exc, typer.TyperException) and args is not None:
        # Click's usage errors, from option parsing (main() passes the arguments); raised
        # inside a command (args None), the same class is a bug: exit 70 below.
        return _fail(_usage_message(exc, args), ExitCode.USAGE)
    if isinstance(exc, Exception):  # last line of defence: a bug, one line, exit 70
        if os.environ.get("CLIPCLI_DEBUG"):
            traceback.print_exception(exc)
        message = f"internal error: {type(exc).__name__}: {exc} (set CLIPCLI_DEBUG=1 for details)"
        return _fail(message, ExitCode.INTERNAL)
    raise exc  # GeneratorExit and the like are not ours to report


def _within_boundary(command: F) -> F:
    """A command run by Typer directly (tests' CliRunner) reports its failures through the
    same boundary as main(), handing Click only the exit code."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        try:
            command(*args, **kwargs)
            sys.stdout.flush()  # a closed pipe must show here, not at interpreter exit
        except typer.Exit:
            raise
        except BaseException as exc:  # the boundary: every failure, one line
            raise typer.Exit(exit_code_for(exc)) from None

    return wrapper  # type: ignore[return-value]


def _fail(message: str, code: int) -> int:
    global _failure_reported
    _failure_reported = True
    with contextlib.suppress(OSError):  # stderr is gone too; the exit code still tells
        print(f"clipcli: error: {printable(message)}", file=sys.stderr, flush=True)
    return code


def _usage_message(exc: typer.TyperException, args: list[str]) -> str:
    """Click's usage error on one line, with the hint a newcomer needs."""
    message = exc.format_message().replace("\n", " ").rstrip(".")
    if "Got unexpected extra argument" in message and "--axes" in args:
        message += "; --axes takes one comma-separated list, e.g. --axes 0,1"
    elif "Missing argument" in message or "No such command" in message:
        command = next((a for a in args if not a.startswith("-")), "")
        message += f"; see 'clipcli {command} --help'".replace("  ", " ")
    return message


# ------------------------------------------------------------------ the commands

COMMANDS: dict[str, tuple[Callable[..., None], str]] = {
    "ls": (inspect.ls_command, inspect.LS_EPILOG),
    "norms": (inspect.norms_command, inspect.NORMS_EPILOG),
    "clip": (write.clip_command, write.CLIP_EPILOG),
    "convert": (write.convert_command, write.CONVERT_EPILOG),
    "diff": (compare.diff_command, compare.DIFF_EPILOG),
}


def _register(target: typer.Typer, names: Iterable[str]) -> typer.Typer:
    for name in names:
        body, epilog = COMMANDS[name]
        target.command(name, epilog=epilog)(_within_boundary(body))
    return target


_register(app, COMMANDS)


def _app_for(args: list[str]) -> typer.Typer:
    """The app to run: for `clipcli CMD ...`, one holding CMD alone, since Typer builds the
    Click parameters of every registered command on each start (~10 ms of a shell loop's
    `clipcli ls`); for anything else (--help, a typo), the whole app."""
    if args and args[0] in COMMANDS:
        one = typer.Typer(**_APP_SETTINGS)
        one.callback()(_group)  # a group still: with one command Typer would make it the root
        return _register(one, [args[0]])
    return app


def _group() -> None:
    """(the group callback of a one-command app: nothing to do)"""


# ------------------------------------------------------------------ the program


def _restore_signal_defaults() -> None:
    """Undo the start-up guard of `python -m clipcli` (__main__.py): from here on Ctrl-C is
    a KeyboardInterrupt that the boundary turns into one line and exit 130."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _keep_chunk_buffers() -> None:
    """Stop glibc from handing every multi-MiB chunk buffer back to the kernel.

    By default each 2-8 MiB temporary is mmapped and unmapped again, so every chunk pays
    for ~3000 fresh page faults: that made bf16 norms 4x slower in the main thread. Serving
    them from the heap and trimming it only above 256 MiB keeps them warm. One arena for
    all threads: a buffer freed by one worker is reused by the other, instead of each
    thread's arena keeping its own high-water mark (clip peak RSS on 0.5 -> 2 GiB files
    went 65 -> 71 MiB with per-thread arenas, 59 -> 61 MiB with one). Linux/glibc only.
    """
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 64 << 20)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 256 << 20)  # M_TRIM_THRESHOLD
        libc.mallopt(-8, 1)  # M_ARENA_MAX
    except (OSError, AttributeError):
        pass


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit code. Every failure is one stderr line."""
    global _failure_reported
    _failure_reported = False
    # Started with a stream closed (`>&-`, `2>&-`): Python has None there. Writes go to
    # /dev/null instead; a report that has nowhere to go is then exit 5, one line (lost
    # too, with stderr closed: the exit code still tells).
    Stdout.closed = sys.stdout is None
    if sys.stdout is None:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process
    if sys.stderr is None:
        sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        _restore_signal_defaults()
        for variable in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            # We thread over chunks ourselves; BLAS threads on top only spin and contend.
            os.environ.setdefault(variable, "1")
        _keep_chunk_buffers()
        if not args:
            args = ["--help"]
        if args == ["--version"]:
            print(f"clipcli {__version__}")
            return ExitCode.OK
        result = _app_for(args)(args=args, prog_name="clipcli", standalone_mode=False)
        sys.stdout.flush()
    except BaseException as exc:  # the boundary: every failure, one line
        return exit_code_for(exc, args)
    if result == ExitCode.INTERRUPTED and not _failure_reported:
        # Click turns a Ctrl-C outside our commands (while parsing) into a silent 130.
        return _fail("interrupted", ExitCode.INTERRUPTED)
    return int(result) if isinstance(result, int) else ExitCode.OK
