"""The program's entry point (`clipcli` and `python -m clipcli`): guard start-up against
signals, then run the CLI.

Importing the CLI (numpy; typer too for what the quick parser does not take) takes tens of
milliseconds, before main() has set up its error boundary. A Ctrl-C there would print a
KeyboardInterrupt traceback, so until main() takes over, SIGINT, SIGTERM, SIGHUP and the
other signals that would end the process print the one documented line and exit 128 + N
(130/143/129, 131 for SIGQUIT, ...): nothing has been opened yet, so there is nothing to
clean up. main() then records them until the command acts on them (clipcli.system.interrupts).
A signal ignored when the process started (`nohup`, a background job's SIGINT) is left
ignored, here and for the whole run.

What runs before this module (the interpreter's start-up, site and .pth files, runpy or the
console script finding the package) is not clipcli's code: a signal there gets Python's own
behaviour. This module imports nothing that the interpreter has not already loaded.
"""

# The guard goes up first, before anything else this module does: every statement before
# it is a moment where Ctrl-C would be a KeyboardInterrupt traceback from our own frame.
# _signal, not signal: the signal module imports enum, which alone takes milliseconds.
import os
import sys

# A signal that lands in this module's own first moments, before the guard is up, is
# raised by Python's handler in our frame as KeyboardInterrupt: caught here, it is the
# guard's one line and exit code too (a full test run caught one on the line that decides
# whether to guard). os and sys were loaded by the interpreter: binding them calls nothing.
try:
    import _signal  # type: ignore[import-not-found]  # no stub; same API as signal

    INTERRUPTED_LINE = b"clipcli: error: interrupted\n"
    # The signals whose default action ends the process and that can be caught: those that
    # clipcli.system.interrupts.HANDLED records during a command (SIGPIPE and SIGXFSZ are ignored by
    # CPython itself). Their names are spelt out: the signal module's enum is not loaded yet.
    # SIGINT first: it is the one a person sends.
    _ENDING_NAMES = (
        "SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGALRM", "SIGUSR1", "SIGUSR2", "SIGXCPU",
        "SIGVTALRM", "SIGPROF",
    )  # fmt: skip

    def _exit_during_start_up(signum: int, _frame: object) -> None:
        if signum == _signal.SIGINT:
            os.write(2, INTERRUPTED_LINE)
        else:
            name = next((n for n in _ENDING_NAMES if getattr(_signal, n, None) == signum), "")
            os.write(2, f"clipcli: error: terminated by {name or signum}\n".encode())
        os._exit(128 + signum)

    def _guard_start_up() -> None:
        """Guard every ending signal, except one ignored when the process started: the parent
        asked for it to be ignored (`nohup`, a shell running a background job), and the check
        is made before anything is installed, so later checks (clipcli.system.interrupts.ignored)
        still see the inherited SIG_IGN."""
        for name in _ENDING_NAMES:
            signum = getattr(_signal, name, None)
            if signum is not None and _signal.getsignal(signum) != _signal.SIG_IGN:
                _signal.signal(signum, _exit_during_start_up)

    # As a program (`python -m clipcli`, or the `clipcli` console script, which imports this
    # module and then calls run()), the guard goes up as this module loads: a signal between
    # the import and run()'s first line would otherwise be a KeyboardInterrupt traceback from
    # our own frames. Imported by anything else (a test), the process's handlers stay as
    # they are.
    # (str methods, not os.path.basename: its Python frames in posixpath widened the window a
    # signal can land in before the guard is up; a full test run caught one there.)
    if __name__ == "__main__" or (sys.argv and sys.argv[0].rpartition("/")[2] == "clipcli"):
        _guard_start_up()
except KeyboardInterrupt:
    if not (__name__ == "__main__" or (sys.argv and sys.argv[0].rpartition("/")[2] == "clipcli")):
        raise
    os.write(2, b"clipcli: error: interrupted\n")
    os._exit(130)

import errno  # after the guard: built in, like os and sys

TYPE_CHECKING = False  # typing is not loaded yet: start-up time (mypy reads it as True)
if TYPE_CHECKING:
    from collections.abc import Callable

GUARDED = tuple(getattr(_signal, n) for n in _ENDING_NAMES if hasattr(_signal, n))


def _print_version(line: bytes) -> int:
    """Write the version line; its exit code. As for a report: a reader that went away is
    not an error (0), stdout closed or failing is exit 5 with one line."""
    try:
        os.write(1, line)
    except BrokenPipeError:
        return 0
    except OSError as exc:
        reason = " is closed" if exc.errno == errno.EBADF else f": cannot write: {exc.strerror}"
        try:  # noqa: SIM105 - contextlib is not loaded yet: start-up time
            os.write(2, f"clipcli: error: standard output{reason}\n".encode())
        except OSError:
            pass
        return 5
    return 0


# Exit 5, as for a full disk: the environment refused a resource. The input is not at
# fault (exit 3 would tell a script to give up on the file), and a run with more memory
# can succeed.
OUT_OF_MEMORY = 5


def _exit_out_of_memory(detail: str) -> None:
    try:  # noqa: SIM105 - contextlib is not loaded yet: start-up time
        os.write(2, f"clipcli: error: out of memory{detail}\n".encode())
    except (OSError, MemoryError):
        pass
    os._exit(OUT_OF_MEMORY)


def _start_up_refused_memory(
    exc: BaseException, classify: "Callable[[BaseException], bool] | None"
) -> bool:
    """Whether start-up's `exc` is memory running out. `classify` is
    address_space.refused_memory, None when even that small module could not load: then
    only a MemoryError or an ENOMEM says so. Classifying can itself run out of memory:
    memory is short then, whatever `exc` was."""
    if classify is None:
        return isinstance(exc, MemoryError) or getattr(exc, "errno", None) == errno.ENOMEM
    try:
        return classify(exc)
    except MemoryError:
        return True


class _RoomForNumpy:
    """An import hook that checks, before numpy loads, that the address-space limit
    leaves room for it (clipcli.system.address_space: else OpenBLAS calls exit(1) from C)."""

    @staticmethod
    def find_spec(name: str, path: object = None, target: object = None) -> None:  # noqa: ARG004
        if name == "numpy":
            sys.meta_path.remove(_RoomForNumpy)  # once is enough
            from clipcli.system.address_space import NUMPY_BYTES, check_room

            check_room(NUMPY_BYTES, "loading numpy")


def run() -> None:
    """Run the CLI as a program and exit with its code (never returns)."""
    _guard_start_up()
    if sys.argv[1:] in (["--version"], ["-V"]):  # for shell loops: no CLI import at all
        from clipcli import __version__

        raise SystemExit(_print_version(f"clipcli {__version__}\n".encode()))

    classify: Callable[[BaseException], bool] | None = None
    detail: Callable[[BaseException], str] | None = None
    try:
        # The classifier first, while little is loaded: the handler below imports nothing
        # (an import there failed for want of memory and chained a second traceback).
        from clipcli.system import address_space

        classify, detail = address_space.refused_memory, address_space.memory_detail
        from clipcli.system.blas import single_threaded_blas

        single_threaded_blas()  # before anything imports numpy (_preload does)
        sys.meta_path.insert(0, _RoomForNumpy)
        from clipcli.cli.entry import main

        _preload(sys.argv[1:])
    except (MemoryError, ImportError, SystemError, ValueError, OSError) as exc:
        # Before main()'s boundary: as it would say. SystemError and ValueError too:
        # CPython's compile() of a module with no bytecode cached (PYTHONDONTWRITEBYTECODE,
        # a fresh install) can fail under an address-space limit, "returned NULL without
        # setting an exception" (seen importing clipcli.report.builders at `prlimit --as`
        # 16 MiB) or "field 'target' is required for AnnAssign" (15 MiB); and importlib's
        # listing of a folder, OSError ENOMEM (13 MiB).
        if not _start_up_refused_memory(exc, classify):
            raise
        _exit_out_of_memory("" if detail is None else detail(exc))
    try:
        code = main()
    except KeyboardInterrupt:  # landed between main()'s boundary and here
        os.write(2, INTERRUPTED_LINE)
        code = 130
    # The outcome is decided and reported: a late signal must not add a traceback to it.
    for signum in GUARDED:
        _signal.signal(signum, _signal.SIG_IGN)
    if code > 128 or code == OUT_OF_MEMORY:
        # Ended by a signal (128 + N): CPython 3.11 marks a KeyboardInterrupt "unhandled"
        # when it passes through exec() of a string (dataclasses and namedtuple do that
        # while importing), even though main() handled it; the interpreter would then kill
        # itself with SIGINT at exit instead of returning 130. Out of memory (or a write
        # refused): the interpreter's finalization, short of memory itself, printed
        # "MemoryError: " lines after the one line (attack s38, `prlimit --as` 19,250
        # KiB). Cleanup already ran inside main(); flush and leave.
        for stream in (sys.stdout, sys.stderr):
            try:  # noqa: SIM105 - contextlib is not loaded yet: start-up time
                stream.flush()
            except (OSError, ValueError, MemoryError):
                pass
        os._exit(code)
    raise SystemExit(code)


# What each command imports on first use, beyond clipcli.cli.entry itself. ls lists headers
# only: it needs no job module (start-up time in shell loops, issue 12 item 7).
_READERS = ("clipcli.formats.opening",)  # and the reader of each path's format: _formats_of()
_REPORT = ("clipcli.report.builders", "clipcli.report.table", "clipcli.report.serialize")
_PRELOAD = {
    "ls": (*_READERS, *_REPORT, "clipcli.jobs.groups"),
    "norms": (*_READERS, *_REPORT, "clipcli.api", "clipcli.report.chart"),
    "clip": (*_READERS, *_REPORT, "clipcli.api", "clipcli.system.interrupts"),
    "convert": (*_READERS, "clipcli.api", "clipcli.system.interrupts"),
    "diff": (*_READERS, *_REPORT, "clipcli.api"),
}


def _formats_of(command: str, args: list[str]) -> tuple[str, ...]:
    """The reader modules the inputs among `args` need, by suffix (formats.registry: the
    content decides in the end, and a suffix that disagrees with it is refused): `ls
    m.safetensors` in a shell loop should not import the npz and HDF5 readers. clip and
    convert also write OUT, in any format: all of them, with the model-directory writer
    (imported on first use)."""
    from clipcli.formats import registry

    if command in ("clip", "convert"):
        return (*registry.every_preload(), "clipcli.formats.sharded.writer")
    modules: tuple[str, ...] = ()
    for arg in args:
        if arg.startswith("-") or not os.path.exists(arg):  # options, their values
            continue
        if os.path.isdir(arg) or arg.endswith(".index.json"):
            modules += registry.MODEL_DIRECTORY.preload
        else:
            modules += registry.preload_for_path(arg)
    return modules


def _preload(args: list[str]) -> None:
    """Import, while the guard holds, what the command would otherwise import on first use.

    A KeyboardInterrupt raised while an import finishes can land in importlib's module-lock
    weakref callback, where Python prints "Exception ignored" and drops it: the run went on
    and exited 0 (seen about once in 300 Ctrl-Cs). With the imports done here, the commands
    import nothing more, except h5py on first use of an HDF5 file (16 ms, not worth making
    every safetensors run pay). --help and the like skip this: they stay fast."""
    if not args or args[0].startswith("-"):
        return
    import contextlib
    import encodings.ascii  # h5py decodes attributes with it
    import encodings.cp437  # noqa: F401 - zipfile decodes npz member names with it

    from clipcli.cli.declarations import COMMANDS

    body = (COMMANDS[args[0]].body[0],) if args[0] in COMMANDS else ()
    for module in (*body, *_PRELOAD.get(args[0], ()), *_formats_of(args[0], args[1:])):
        __import__(module)
    if args[0] in ("clip", "convert"):  # api imports what writes OUT on first use
        from clipcli.api import WRITING_MODULES

        for module in WRITING_MODULES:
            __import__(module)
    if {"-i", "--include", "-x", "--exclude"} & set(args):  # ls: the selection
        __import__("clipcli.jobs.selection")
    from clipcli.cli.quick_args import parse

    if parse(args) is None:  # Typer will parse it (cli.main); the quick parser would not
        __import__("clipcli.cli.typer_app")
        # Click imports its help option on the first parse (typer vendors click).
        with contextlib.suppress(ImportError):
            __import__("typer._click.decorators")
    if "--chart" in args or (sys.stderr is not None and sys.stderr.isatty()):  # rich: bars
        import io

        from rich.console import Console
        from rich.table import Table

        import clipcli.report.progress_bar  # noqa: F401

        # rich loads its emoji and character-width tables on the first render.
        table = Table()
        table.add_column("x")
        table.add_row("x ✓")
        Console(file=io.StringIO(), width=40).print(table)


if __name__ == "__main__":
    run()
