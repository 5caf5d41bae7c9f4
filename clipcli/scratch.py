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
import fcntl
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

from clipcli.errors import WriteError
from clipcli.inputs import out_of_descriptors


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
    no_descriptor = out_of_descriptors(exc, f"temporary directory {directory()}")
    if no_descriptor is not None:  # no fault of the directory: do not send the user to TMPDIR
        return no_descriptor
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


def unnamed_file(prefix: str) -> tuple[int, bool]:
    """A new temporary file for reading and writing, with no name: its descriptor (the
    caller's to close) and whether a name can be given to it later (`name_unnamed`: an
    O_TMPFILE file). Where the file system lacks O_TMPFILE it is created and unlinked at
    once, and cannot be named again. Either way it is gone with its last descriptor,
    whatever ends the process, SIGKILL included."""
    where = directory()
    flags = os.O_RDWR | os.O_CLOEXEC
    if hasattr(os, "O_TMPFILE"):
        try:  # without O_EXCL, so that linkat can name it
            return os.open(where, flags | os.O_TMPFILE, 0o600), True
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.ENOENT):
                raise failure(exc) from None
    try:
        with tempfile.TemporaryFile(prefix=prefix, dir=where, buffering=0) as handle:
            return os.dup(handle.fileno()), False
    except OSError as exc:
        raise failure(exc) from None


def name_unnamed(fd: int, directory: PrivateDirectory, name: str) -> Path:
    """Give the unnamed (O_TMPFILE) file `fd` the name `name` in `directory` (linkat
    through /proc/self/fd), for a library that opens files by name only; the path."""
    try:  # a dir_fd makes os.link call linkat, which follows the /proc link (link does not)
        os.link(f"/proc/self/fd/{fd}", name, dst_dir_fd=directory.fd, follow_symlinks=True)
    except OSError as exc:
        raise failure(exc) from None
    return directory.path / name


class PrivateDirectory:
    """A new 0700 directory in the temporary directory, `<prefix><random>`, locked
    (flock) for as long as this run holds it. SIGKILL cannot be caught, so such a directory
    can outlive its run; the next run with the same prefix removes those whose lock it can
    take (`sweep_abandoned`): their run is gone."""

    ATTEMPTS = 8  # a sweeping run can remove a new directory before its lock is taken

    def __init__(self, prefix: str, keep: os.stat_result | None = None) -> None:
        where = directory()
        sweep_abandoned(where, prefix, keep)
        for _ in range(self.ATTEMPTS):
            try:
                path = tempfile.mkdtemp(prefix=prefix, dir=where)
            except OSError as exc:
                raise failure(exc) from None
            try:
                fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except OSError as exc:  # out of descriptors: the new directory must not stay
                with contextlib.suppress(OSError):
                    os.rmdir(path)
                raise failure(exc) from None
            if _lock(fd) is not False and os.fstat(fd).st_nlink > 0:  # still there, ours now
                self.path, self.fd = Path(path), fd
                return
            os.close(fd)
        raise WriteError(f"temporary directory {where}: cannot keep a directory of its own")

    def cleanup(self) -> None:
        """Remove the directory and what it holds (files this run put there)."""
        if self.fd < 0:
            return
        with contextlib.suppress(OSError):
            _empty_and_remove(self.fd, self.path)
        os.close(self.fd)
        self.fd = -1


def _lock(fd: int) -> bool | None:
    """True: locked; False: another run holds it; None: the file system has no flock
    (the owner goes on; a sweep must then leave the directory alone)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:
        return None
    return True


def _empty_and_remove(fd: int, path: Path) -> None:
    for name in os.listdir(fd):
        os.unlink(name, dir_fd=fd)  # files only: a directory inside makes rmdir fail
    os.rmdir(path)


def sweep_abandoned(where: str, prefix: str, keep: os.stat_result | None = None) -> None:
    """Remove `prefix*` directories in `where` left by dead runs: owned by this user,
    real directories (never followed through a link), whose lock can be taken. One that
    holds `keep` (the input being read, copied out of such a directory by hand) is left."""
    try:
        names = [name for name in os.listdir(where) if name.startswith(prefix)]
    except OSError:
        return
    for name in names:
        path = Path(where, name)
        with contextlib.suppress(OSError):
            info = os.lstat(path)
            if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
                continue
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                if not os.path.samestat(os.fstat(fd), info) or _lock(fd) is not True:
                    continue  # replaced meanwhile, or its run is alive
                if keep is not None and any(
                    os.path.samestat(os.stat(entry, dir_fd=fd, follow_symlinks=False), keep)
                    for entry in os.listdir(fd)
                ):
                    continue
                _empty_and_remove(fd, path)
            finally:
                os.close(fd)


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
