"""The program: main() runs one command line and returns its exit code.

Commands and options are declared once, in declarations.py. An ordinary command line (a
command, its paths, options spelled out) is parsed by quick_args.py into the command's
request, which goes straight to its body in clipcli/cli/commands/; anything else (--help,
completion, a usage error) goes to the Typer app generated from the same declarations
(typer_app.py), whose import alone would cost a shell loop ~30 ms. Either way every
failure passes the one boundary (boundary.py): one stderr line `clipcli: error: ...` and a
documented exit code.
"""

from __future__ import annotations

import gc
import os
import signal
import sys
import threading

from clipcli import __version__
from clipcli.cli import boundary, quick_args
from clipcli.cli.commands.common import Stdout, emit, escape_unencodable
from clipcli.cli.declarations import body_of
from clipcli.errors import ExitCode
from clipcli.system import interrupts
from clipcli.system.blas import single_threaded_blas

# ------------------------------------------------------------------ the program


def _restore_signal_defaults() -> None:
    """Undo the start-up guard of `python -m clipcli` (__main__.py): from here on Ctrl-C is
    a KeyboardInterrupt that the boundary turns into one line and exit 130. A signal
    ignored since start-up (`nohup`, a background job's SIGINT) stays ignored."""
    if threading.current_thread() is threading.main_thread():
        if not interrupts.ignored(signal.SIGINT):
            signal.signal(signal.SIGINT, signal.default_int_handler)
        if not interrupts.ignored(signal.SIGTERM):
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


# The cyclic collector's thresholds for its two older generations (Python's default: 10
# and 10). See _collect_old_objects_rarely.
OLD_GENERATIONS_THRESHOLDS = (100, 100)


def _collect_old_objects_rarely() -> None:
    """Have the cyclic garbage collector look at long-lived objects 10x less often.

    A checkpoint of 200,000 tensors makes a few million objects (header entries, tensor
    records, statistics, report rows) that all live to the end of the run, and each full
    collection walks every one of them: with the default thresholds that was a third of
    `clip`'s CPU time (9.3 -> 6.6 s on 200,000 one-element tensors). clipcli's data is
    freed by reference counting (chunks hold no cycles), so collecting the young
    generation as usual is enough; the old ones still get collected, later."""
    gc.set_threshold(gc.get_threshold()[0], *OLD_GENERATIONS_THRESHOLDS)


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit code. Every failure is one stderr line."""
    boundary.reset()
    # Started with a stream closed (`>&-`, `2>&-`): Python has None there. Writes go to
    # /dev/null instead; a report that has nowhere to go is then exit 5, one line (lost
    # too, with stderr closed: the exit code still tells).
    Stdout.closed = sys.stdout is None
    if sys.stdout is None:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process
    if sys.stderr is None:
        sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process
    escape_unencodable()
    args = sys.argv[1:] if argv is None else list(argv)
    if not args:
        args = ["--help"]
    try:
        _restore_signal_defaults()
        single_threaded_blas()
        _keep_chunk_buffers()
        _collect_old_objects_rarely()
        # SIGINT, SIGTERM and SIGHUP are recorded from here on; the command acts on them
        # between chunks (boundary.run_command), so readers remove their temps.
        with interrupts.deferred():
            result = _run(args)
    except BaseException as exc:  # the boundary: every failure, one line
        return boundary.exit_code_for(exc, args)
    if result == ExitCode.INTERRUPTED and not boundary.failure_reported():
        # Click turns a Ctrl-C outside our commands (while parsing) into a silent 130.
        return boundary.fail("interrupted", ExitCode.INTERRUPTED)
    return int(result) if isinstance(result, int) else ExitCode.OK


def _run(args: list[str]) -> object:
    """The command line's exit code (or what the Typer app returned for it)."""
    if args in (["--version"], ["-V"]):  # (__main__ answers it before importing this module)
        emit(lambda: print(f"clipcli {__version__}"))
        return ExitCode.OK
    parsed = quick_args.parse(args)
    if parsed is not None:
        command, request = parsed
        return boundary.run_command(lambda: body_of(command)(request))
    from clipcli.cli import typer_app

    result = typer_app.run(args)
    sys.stdout.flush()
    return result
