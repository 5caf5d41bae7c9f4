"""Signals during a command: recorded when they arrive, acted on between chunks.

Python raises KeyboardInterrupt wherever the main thread happens to be, including inside
h5py's weakref callbacks, where the exception is printed and swallowed, so the run went on
and exited 0; SIGTERM and SIGHUP killed the process with no line and left its temps (a
.keras input's unpacked weights) behind. While a command runs (`deferred()`, from
boundary.run_command), SIGINT, SIGTERM and SIGHUP only set a flag; the streaming loops
call `check()` between chunks, readers in their long unpacking loops, the report before
it is written, and the output target once more just before its commit point. The
exception unwinds through every `with`, so readers remove their temps. Once the result
is out (`settle()`: OUT committed) a signal is moot: the run reports success.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType

from clipcli.errors import ExitCode, Interrupted

HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

_pending: list[int] = []  # signals received while deferred, oldest first
_deferring: list[bool] = []  # one per open deferred() block: True where it writes output
_settled: list[bool] = []  # non-empty once the result is out: later signals are moot


def _record(signum: int, frame: FrameType | None) -> None:  # noqa: ARG001 - handler signature
    _pending.append(signum)


def pending() -> int | None:
    """The first signal received since `deferred()` began, if any."""
    return _pending[0] if _pending else None


def check() -> None:
    """Raise Interrupted if a signal arrived; cheap enough to call for every chunk."""
    if _pending and not _settled:
        raise interrupted(_pending[0])


def settle() -> None:
    """The run's output is complete (OUT committed): a signal from now on changes nothing."""
    if _deferring:
        _settled.append(True)


def interrupted(signum: int) -> Interrupted:
    # A read-only command says what a signal at start-up says (clipcli.__main__).
    nothing_written = "; no output written" if True in _deferring else ""
    if signum == signal.SIGINT:
        return Interrupted("interrupted" + nothing_written, ExitCode.INTERRUPTED)
    name = signal.Signals(signum).name
    return Interrupted(f"terminated by {name}{nothing_written}", ExitCode(128 + signum))


@contextlib.contextmanager
def deferred(writes: bool = False) -> Iterator[None]:
    """Record SIGINT/SIGTERM/SIGHUP instead of acting on them, until the block ends.

    Blocks nest: the outermost one installs the handlers and clears what was recorded at
    its end. `writes`: the block writes output, so an interruption says "no output
    written". Outside the main thread signals cannot be caught; the block then runs
    unprotected."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    outermost = not _deferring
    previous = {sig: signal.signal(sig, _record) for sig in HANDLED} if outermost else {}
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
