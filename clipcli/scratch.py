"""Scratch space in the temporary directory ($TMPDIR), for readers that must unpack or
reorder data before they can hand it out (a .keras archive's weights, column-major npz
members).

The temporary directory belongs to the environment, not to the input: when it is missing,
full or read-only, the run fails with exit 5 (as for a full disk), naming the directory,
never exit 3 blaming the input or exit 70. Every write goes through here so that a
failing write is told apart from a failing read of the input.
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from collections.abc import Iterator

from clipcli.errors import WriteError


def directory() -> str:
    """The temporary directory, as tempfile chooses it ($TMPDIR, else /tmp, /var/tmp, ...)."""
    try:
        return tempfile.gettempdir()
    except OSError as exc:  # none of the candidates is usable
        raise WriteError(
            f"no usable temporary directory ({exc.strerror or exc}); "
            "set TMPDIR to a writable directory with room"
        ) from None


def failure(exc: OSError) -> WriteError:
    """A write into the temporary directory failed: exit 5, naming it."""
    reason = "disk full" if exc.errno == errno.ENOSPC else (exc.strerror or str(exc))
    return WriteError(
        f"temporary directory {directory()}: cannot write: {reason}; "
        "set TMPDIR to a writable directory with room"
    )


@contextlib.contextmanager
def temp_file(prefix: str) -> Iterator[int]:
    """The descriptor of a new, unnamed temporary file, closed (and so gone) at the end."""
    where = directory()
    try:
        handle = tempfile.TemporaryFile(prefix=prefix, dir=where, buffering=0)  # noqa: SIM115 - closed below
    except OSError as exc:
        raise failure(exc) from None
    with handle:
        yield handle.fileno()


def temp_directory(prefix: str) -> tempfile.TemporaryDirectory[str]:
    """A new private temporary directory; the caller cleans it up."""
    where = directory()
    try:
        return tempfile.TemporaryDirectory(prefix=prefix, dir=where)
    except OSError as exc:
        raise failure(exc) from None


def write_at(fd: int, data: bytes | memoryview, position: int) -> None:
    """All of `data` at `position` in a scratch file (a full disk can write part of it)."""
    view = memoryview(data).cast("B")
    try:
        while view:
            written = os.pwrite(fd, view, position)
            view, position = view[written:], position + written
    except OSError as exc:
        raise failure(exc) from None


def open_new(path: str | os.PathLike[str]) -> int:
    """A new file in a scratch directory, for writing."""
    try:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise failure(exc) from None
