"""Copying bytes between files: the kernel's fast path where it works, a plain loop where not.

copy_file_range fails between filesystems (EXDEV on tmpfs -> ext4), on filesystems and
kernels that lack it (EOPNOTSUPP, ENOSYS, EINVAL), and may copy less than asked. Every
caller goes through `copy_range`, which falls back to pread/pwrite for the rest of the
range, so a fast path never decides whether a copy works.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from pathlib import Path

from clipcli.errors import InputError
from clipcli.system import interrupts

PIECE = 64 << 20  # bytes per kernel call: small enough to notice a stop request soon
PLAIN_PIECE = 4 << 20  # bytes per pread/pwrite in the fallback

# Errors that mean "the kernel cannot do this copy", not "the copy failed".
_NO_KERNEL_COPY = frozenset(
    {errno.EXDEV, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOSYS, errno.EBADF, errno.EPERM}
)


def _kernel_copy(source_fd: int, out_fd: int, count: int, offset: int, position: int) -> int:
    return os.copy_file_range(source_fd, out_fd, count, offset, position)


kernel_copy: Callable[[int, int, int, int, int], int] = _kernel_copy  # tests swap it


def copy_range(
    source_fd: int,
    out_fd: int,
    begin: int,
    end: int,
    position: int,
    *,
    source_name: object = "input",
    on_piece: Callable[[int, int], None] | None = None,
    stop: Callable[[], bool] | None = None,
) -> None:
    """Copy source bytes [begin, end) to `position` of out_fd.

    on_piece(position, length) is told of each piece written; stop() may end the copy early
    (the caller then discards the output). A source shorter than `end` is an InputError:
    the input changed or was truncated while being read."""
    use_kernel = True
    while begin < end:
        if stop is not None and stop():
            return
        piece = min(end - begin, PIECE if use_kernel else PLAIN_PIECE)
        sent = 0
        if use_kernel:
            try:
                sent = kernel_copy(source_fd, out_fd, piece, begin, position)
            except OSError as exc:
                if exc.errno not in _NO_KERNEL_COPY:
                    raise
                use_kernel = False
                continue
            if sent == 0:  # EOF, or a filesystem that copies nothing: let pread tell
                use_kernel = False
                continue
        else:
            data = os.pread(source_fd, piece, begin)
            if not data:
                raise InputError(source_name, "ends early: it was truncated while being read")
            sent = _pwrite_all(out_fd, data, position)
        if on_piece is not None:
            on_piece(position, sent)
        begin += sent
        position += sent


def _pwrite_all(fd: int, data: bytes, position: int) -> int:
    view = memoryview(data)
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], position + done)
    return done


def copy_file_sparse(source_fd: int, out_fd: int, source_name: object) -> None:
    """Copy a whole regular file into the empty out_fd, keeping holes as holes.

    Only the data regions (SEEK_DATA/SEEK_HOLE) are copied; the file is then extended to
    the source's size, so a 1 TB sparse file costs its data, not a terabyte."""
    size = os.fstat(source_fd).st_size
    for begin, end in _data_regions(source_fd, size):
        interrupts.check()
        copy_range(source_fd, out_fd, begin, end, begin, source_name=source_name, stop=_signalled)
        interrupts.check()
    if os.fstat(source_fd).st_size != size:
        raise InputError(source_name, "changed size while being copied")
    os.ftruncate(out_fd, size)


def _signalled() -> bool:
    return interrupts.pending() is not None


def _data_regions(fd: int, size: int) -> list[tuple[int, int]]:
    """[begin, end) of each stretch that holds data; the whole file where the filesystem
    cannot tell (no SEEK_DATA)."""
    if not hasattr(os, "SEEK_DATA"):
        return [(0, size)] if size else []
    regions: list[tuple[int, int]] = []
    offset = 0
    while offset < size:
        try:
            begin = os.lseek(fd, offset, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # only a hole from here to the end
                break
            if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
                return [(0, size)] if size else []
            raise
        end = min(os.lseek(fd, begin, os.SEEK_HOLE), size)
        if end <= begin:
            break
        regions.append((begin, end))
        offset = end
    return regions


def copy_side_file(source_fd: int, source_name: object, destination: Path) -> None:
    """A new file at destination with the source's bytes (holes kept), times and
    permission bits, as `cp` gives them: never setuid, setgid or sticky."""
    fd = os.open(destination, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        copy_file_sparse(source_fd, fd, source_name)
        info = os.fstat(source_fd)
        os.fchmod(fd, stat.S_IMODE(info.st_mode) & 0o777)
        os.utime(fd, ns=(info.st_atime_ns, info.st_mtime_ns))
    finally:
        os.close(fd)
