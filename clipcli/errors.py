"""Exceptions that carry their exit code; only clipcli/cli/boundary.py turns them into output."""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    CONDITION = 1  # --fail-above exceeded
    USAGE = 2
    BAD_INPUT = 3
    REFUSED_DATA = 4
    WRITE_FAILED = 5
    INTERNAL = 70
    HANGUP = 129  # SIGHUP
    INTERRUPTED = 130  # SIGINT
    TERMINATED = 143  # SIGTERM


def printable(text: str) -> str:
    """Escape control characters (newlines, ANSI escapes) so a hostile name stays on one line."""
    if text.isprintable():
        return text
    return "".join(
        ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in text
    )


class ClipcliError(Exception):
    """Base class: the message is one line, the exit code says what kind of failure it is."""

    exit_code: int = ExitCode.INTERNAL  # an ExitCode, or 128 + N for signal N (Interrupted)

    def __init__(self, message: str) -> None:
        super().__init__(printable(message))


class UsageError(ClipcliError):
    """Bad option values, conflicting modes, OUT exists, OUT is IN."""

    exit_code = ExitCode.USAGE


class InputError(ClipcliError):
    """The input is unreadable, malformed or unsafe."""

    exit_code = ExitCode.BAD_INPUT

    def __init__(self, path: object, problem: str, tensor: str | None = None) -> None:
        where = f"{path}" if tensor is None else f"{path}: tensor {tensor!r}"
        super().__init__(f"{where}: {problem}")


class NotFiniteError(ValueError):
    """A value summed for a decision that only finite values reach (a clip's check of its
    output) is inf or NaN: the input changed while it was read (clipcli.api asks the input's
    identity), else a fault of clipcli's (exit 70)."""


class DataRefusedError(ClipcliError):
    """The data cannot be processed as asked: non-finite values, axes out of range."""

    exit_code = ExitCode.REFUSED_DATA


class WriteError(ClipcliError):
    """Writing the output failed; nothing was left behind."""

    exit_code = ExitCode.WRITE_FAILED


class Interrupted(ClipcliError):
    """A signal arrived (SIGINT, SIGTERM, ...); the partial output was removed. Exit code
    128 + the signal's number."""

    exit_code: int = ExitCode.INTERRUPTED

    def __init__(self, message: str, exit_code: int = ExitCode.INTERRUPTED) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class Verdict(Exception):
    """Not a failure: the command ran, said what it found, and its answer is an exit code
    (--fail-above exceeded: 1). The boundary exits with it and prints nothing more."""

    def __init__(self, exit_code: ExitCode) -> None:
        super().__init__(int(exit_code))
        self.exit_code = exit_code
