"""Opening input files safely: never a FIFO, a device, a socket or a kernel pseudo-file.

Every file clipcli reads (a checkpoint, a shard, an index, a side file listed for copying)
is opened here. The checks are made on the opened descriptor, not on the name, so a name
swapped for a FIFO between a check and the open cannot make clipcli block:

- O_NONBLOCK: opening a FIFO that nobody writes to returns at once instead of waiting for
  a writer (for regular files the flag changes nothing; it is cleared after the check).
- fstat on the descriptor must say S_ISREG; anything else is closed and refused.
- /proc, /sys and /dev hold "regular" files whose content is the kernel's (environment
  variables, memory maps), never a checkpoint: refused by their resolved path (except
  inside /dev/shm, an ordinary tmpfs) before the open, and again after it by where the
  descriptor really leads (`real_path_of`) and by its device (procfs, sysfs): a symlink
  swapped in between would otherwise lead the open into /proc/self/environ.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import stat
from pathlib import Path
from typing import BinaryIO

from clipcli.errors import InputError, WriteError
from clipcli.system.identity import FileIdentity

# Pseudo-filesystems: reading these never yields a checkpoint and may yield secrets.
PSEUDO_ROOTS = (Path("/proc"), Path("/sys"), Path("/dev"))
# ...except /dev/shm, an ordinary tmpfs where people do keep checkpoints for speed (its
# FIFOs and sockets are still refused by the S_ISREG check on the descriptor).
ORDINARY_UNDER_DEV = Path("/dev/shm")
_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)
_FLAGS |= getattr(os, "O_CLOEXEC", 0)


def is_pseudo_path(path: Path) -> bool:
    """True when the resolved path lies in /proc, /sys or /dev."""
    try:
        real = path.resolve()
    except (OSError, RuntimeError):
        return False
    return _under_pseudo_root(real)


def _under_pseudo_root(real: Path) -> bool:
    if real.is_relative_to(ORDINARY_UNDER_DEV) and real != ORDINARY_UNDER_DEV:
        return False
    return any(real == root or real.is_relative_to(root) for root in PSEUDO_ROOTS)


@functools.cache
def _kernel_devices() -> frozenset[int]:
    """st_dev of the procfs and sysfs mounted at /proc and /sys. A file on either is the
    kernel's whatever its name: a bind mount of /proc elsewhere keeps the device, and is
    not under /proc by name. (/dev is left to the name check: where /dev/shm is no mount
    of its own, it shares /dev's device and must stay readable.)"""
    devices = set()
    for root in ("/proc", "/sys"):
        with contextlib.suppress(OSError):
            if os.path.ismount(root):  # an empty /proc on the root file system is not one
                devices.add(os.stat(root).st_dev)
    return frozenset(devices)


def is_kernel_file(fd: int, path: Path) -> bool:
    """True when the opened descriptor leads into /proc, /sys or /dev (by where it really
    lies, `real_path_of`) or onto the procfs or sysfs device."""
    return os.fstat(fd).st_dev in _kernel_devices() or _under_pseudo_root(real_path_of(fd, path))


# The process or the system has no descriptor left (RLIMIT_NOFILE, `ulimit -n`): the
# environment refused a resource, as for a full disk (exit 5), not a fault of the input.
OUT_OF_DESCRIPTORS = (errno.EMFILE, errno.ENFILE)


def out_of_descriptors(exc: BaseException, path: object = None) -> WriteError | None:
    """The exit-5 failure for an error that says no descriptor is left, else None."""
    if not isinstance(exc, OSError) or exc.errno not in OUT_OF_DESCRIPTORS:
        return None
    where = f"{path}: cannot open: " if path is not None else ""
    reason = exc.strerror or "Too many open files"
    return WriteError(f"{where}out of file descriptors ({reason}); raise the limit (ulimit -n)")


def open_input_fd(path: Path) -> int:
    """A read-only descriptor of the regular file `path`; InputError (exit 3) otherwise."""
    if is_pseudo_path(path):
        raise InputError(path, "is a kernel or device file (/proc, /sys, /dev); not read")
    try:
        fd = os.open(path, _FLAGS)
    except FileNotFoundError:
        problem = "is a dangling symlink" if os.path.islink(path) else "no such file"
        raise InputError(path, problem) from None
    except IsADirectoryError:
        raise InputError(path, "is a directory, expected a checkpoint file") from None
    except OSError as exc:
        raise out_of_descriptors(exc, path) or InputError(
            path, f"cannot read: {exc.strerror}"
        ) from None
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise InputError(path, "is a directory, expected a checkpoint file")
        if not stat.S_ISREG(info.st_mode):
            raise InputError(path, f"is not a regular file ({_kind(info.st_mode)})")
        if is_kernel_file(fd, path):  # a link swapped in after the name was checked
            raise InputError(path, "is a kernel or device file (/proc, /sys, /dev); not read")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_input(path: Path) -> BinaryIO:
    """open_input_fd as a buffered binary file object."""
    fd = open_input_fd(path)
    try:
        return os.fdopen(fd, "rb")
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(fd)
        raise


def read_input(path: Path, limit: int, expected: Path | None = None) -> tuple[bytes, FileIdentity]:
    """The whole regular file and the identity of the file read (its descriptor's),
    refusing one larger than `limit` bytes before reading it, and (with `expected`, a
    resolved path checked beforehand) one that is not that file."""
    with open_input(path) as handle:
        info = os.fstat(handle.fileno())
        if expected is not None and not os.path.samestat(os.stat(expected), info):
            raise InputError(path, "changed while it was being opened; refusing it")
        if info.st_size > limit:
            raise InputError(path, f"is {info.st_size} bytes; the limit is {limit}")
        try:
            return handle.read(limit + 1)[:limit], FileIdentity.of_stat(info)
        except OSError as exc:
            raise InputError(path, f"cannot read: {exc.strerror}") from None


def pread_into(fd: int, buffer: memoryview, offset: int) -> int:
    """`buffer` filled from the file at `offset` with preadv, one call after another
    (a call may read less than asked): the bytes read, fewer than asked only where the
    file ends first. OSError is the caller's to word."""
    done = 0
    while done < len(buffer):
        got = os.preadv(fd, [buffer[done:]], offset + done)
        if got == 0:
            break
        done += got
    return done


def fd_path(fd: int) -> str | None:
    """A name that reopens exactly this descriptor's file (Linux /proc/self/fd), for a
    library that insists on opening by name; None where there is no such name."""
    name = f"/proc/self/fd/{fd}"
    try:
        if os.path.samestat(os.stat(name), os.fstat(fd)):
            return name
    except OSError:
        pass
    return None


def opened_path(fd: int) -> Path | None:
    """The path of the file behind a descriptor as the kernel names it (Linux
    /proc/self/fd), only when that name leads to this very file now; None where there is
    no such name: no /proc, a file removed since (the kernel appends " (deleted)", which
    a real file name may also end with, so the name is tried rather than the suffix
    trusted), or renamed away."""
    try:
        name = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None
    if not name.startswith("/"):
        return None
    try:
        if os.path.samestat(os.stat(name), os.fstat(fd)):
            return Path(name)
    except OSError:
        pass
    return None


def real_path_of(fd: int, path: Path) -> Path:
    """Where the file opened as `path` really lies: the kernel's name for the descriptor,
    or where there is none (no /proc, a file removed or renamed since the open), `path`
    resolved, accepted only when it leads to this very file. Otherwise the file was
    swapped or removed while being opened and nothing vouches for where it lies: refused
    (exit 3), never waved through."""
    real = opened_path(fd)
    if real is not None:
        return real
    try:
        resolved = path.resolve(strict=True)
        if os.path.samestat(os.stat(resolved), os.fstat(fd)):
            return resolved
    except (OSError, RuntimeError):  # RuntimeError: a symlink loop
        pass
    raise InputError(path, "was removed or replaced while being opened; refusing it")


def _kind(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a file"
