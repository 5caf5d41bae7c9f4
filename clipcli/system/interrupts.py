"""Signals during a command: recorded when they arrive, acted on between chunks.

Python raises KeyboardInterrupt wherever the main thread happens to be, including inside
h5py's weakref callbacks, where the exception is printed and swallowed, so the run went on
and exited 0; SIGTERM and SIGHUP killed the process with no line and left its temps (a
.keras input's unpacked weights) behind. While a command runs (`deferred()`, from
boundary.run_command), SIGINT, SIGTERM, SIGHUP and every other signal whose default
action ends the process (`HANDLED`) only set a flag; the streaming loops
call `check()` between chunks, readers in their long unpacking loops, the report before
it is written, and the output target once more just before its commit point. The
exception unwinds through every `with`, so readers remove their temps. Once the result
is out (`settle()`: OUT committed) a signal is moot: the run reports success.

A signal that was ignored when the process started stays ignored (`nohup`, a shell's
background job ignoring SIGINT): clipcli.__main__ and cli leave it alone, and so does
`deferred()`. SIGPIPE and SIGXFSZ are not handled: CPython ignores both at start-up, so a
closed pipe and a file past RLIMIT_FSIZE arrive as OSError (EPIPE, EFBIG), which the
boundary already turns into one line (exit 0 for a reader gone, exit 5 for a write).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType

from clipcli.errors import ExitCode, Interrupted

# Every signal whose default action ends the process (a core dump too) and that clipcli
# can catch: without a handler each would end the run with no line and leave its temps.
# Not SIGPIPE, SIGXFSZ (see above), nor SIGKILL and SIGSTOP (cannot be caught).
_CATCHABLE_ENDINGS = (
    "SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGALRM", "SIGUSR1", "SIGUSR2", "SIGXCPU",
    "SIGVTALRM", "SIGPROF",
)  # fmt: skip
HANDLED = tuple(getattr(signal, name) for name in _CATCHABLE_ENDINGS if hasattr(signal, name))

_pending: list[int] = []  # signals received while deferred, oldest first
_deferring: list[bool] = []  # one per open deferred() block: True where it writes output
_settled: list[bool] = []  # non-empty once the result is out: later signals are moot
_halts: list[threading.Event] = []  # one per open halting() block: set, check() stops work


class Halted(BaseException):
    """Work stopped at check() because work beside it, in another thread, failed: never the
    run's own failure (halting()'s caller raises the failure that set the event). A
    BaseException, so that no `except Exception` turns it into an error of its own."""


def _record(signum: int, frame: FrameType | None) -> None:  # noqa: ARG001 - handler signature
    _pending.append(signum)


def pending() -> int | None:
    """The first signal received since `deferred()` began, if any."""
    return _pending[0] if _pending else None


def check() -> None:
    """Raise Interrupted if a signal arrived; cheap enough to call for every chunk."""
    if _pending and not _settled:
        raise interrupted(_pending[0])
    if _halts and _halts[-1].is_set():
        raise Halted


@contextlib.contextmanager
def halting(event: threading.Event) -> Iterator[None]:
    """While the block runs, check() in any thread raises Halted once `event` is set: the
    other shards written beside a failed one stop at their next chunk."""
    _halts.append(event)
    try:
        yield
    finally:
        _halts.remove(event)


def settle() -> None:
    """The run's output is complete (OUT committed): a signal from now on changes nothing."""
    if _deferring:
        _settled.append(True)


def interrupted(signum: int) -> Interrupted:
    """The failure a signal ends the run with: one line, exit 128 + its number (the shell's
    convention: 129 SIGHUP, 130 SIGINT, 131 SIGQUIT, 143 SIGTERM, ...)."""
    # A read-only command says what a signal at start-up says (clipcli.__main__).
    nothing_written = "; no output written" if True in _deferring else ""
    if signum == signal.SIGINT:
        return Interrupted("interrupted" + nothing_written, ExitCode.INTERRUPTED)
    name = signal.Signals(signum).name
    return Interrupted(f"terminated by {name}{nothing_written}", 128 + signum)


def ignored(signum: int) -> bool:
    """Whether `signum` is ignored. clipcli never sets SIG_IGN before its result is out
    (clipcli.__main__ does it only then), so an ignored signal is one that was ignored when
    the process started: the parent's choice (`nohup`), which no handler may undo."""
    return signal.getsignal(signum) == signal.SIG_IGN


@contextlib.contextmanager
def deferred(writes: bool = False) -> Iterator[None]:
    """Record the HANDLED signals instead of acting on them, until the block ends; one
    ignored since start-up stays ignored.

    Blocks nest: the outermost one installs the handlers and clears what was recorded at
    its end. `writes`: the block writes output, so an interruption says "no output
    written". Outside the main thread signals cannot be caught; the block then runs
    unprotected."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    outermost = not _deferring
    taken = [sig for sig in HANDLED if not ignored(sig)] if outermost else []
    previous = {sig: signal.signal(sig, _record) for sig in taken}
    _deferring.append(writes)
    try:
        yield
    finally:
        _deferring.pop()
        if outermost:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            _pending.clear()
            _settled.clear()
