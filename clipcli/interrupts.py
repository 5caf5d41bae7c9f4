"""Signals during a write: recorded when they arrive, acted on between chunks.

Python raises KeyboardInterrupt wherever the main thread happens to be, including inside
h5py's weakref callbacks, where the exception is printed and swallowed, so the run went on
and exited 0. While a write is under way (`deferred()`), SIGINT, SIGTERM and SIGHUP only
set a flag; the streaming loops call `check()` between chunks, and the output target calls
it once more just before its commit point. After the commit point the signal is moot: the
output is whole and the run reports success.
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
_deferring: list[bool] = []  # non-empty while a deferred() block runs


def _record(signum: int, frame: FrameType | None) -> None:  # noqa: ARG001 - handler signature
    _pending.append(signum)


def pending() -> int | None:
    """The first signal received since `deferred()` began, if any."""
    return _pending[0] if _pending else None


def check() -> None:
    """Raise Interrupted if a signal arrived; cheap enough to call for every chunk."""
    if _pending:
        raise interrupted(_pending[0])


def interrupted(signum: int) -> Interrupted:
    if signum == signal.SIGINT:
        return Interrupted("interrupted; no output written", ExitCode.INTERRUPTED)
    name = signal.Signals(signum).name
    return Interrupted(f"terminated by {name}; no output written", ExitCode(128 + signum))


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Record SIGINT/SIGTERM/SIGHUP instead of acting on them, until the block ends.

    Outside the main thread signals cannot be caught; the block then runs unprotected."""
    if threading.current_thread() is not threading.main_thread() or _deferring:
        yield  # not catchable here, or an outer block already defers (and clears at its end)
        return
    previous = {sig: signal.signal(sig, _record) for sig in HANDLED}
    _deferring.append(True)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _deferring.clear()
        _pending.clear()
