"""File-system steps of writing OUT: no-clobber renames and swaps (renameat2, with
fallbacks), fsync, removal of what this run made, and temp names with the cleanup of
temps that dead runs left. clipcli.output puts them together into targets.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

TEMP_SUFFIX = ".clipcli-tmp"
ASIDE_SUFFIX = ".clipcli-old"
KEPT_SUFFIX = ".clipcli-kept"
_NAME_ROOM = 160  # bytes of OUT's name kept in a temp name (NAME_MAX is 255 bytes)
_TEMP_TAIL = re.compile(r"^(?P<pid>\d+)-[0-9a-f]{8}(?P<kind>\.clipcli-(?:tmp|old))$")

AT_FDCWD = -100
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2


# ---------------------------------------------------------------- renameat2


def _load_renameat2() -> Callable[[str, str, int], None] | None:
    try:
        call = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]

    def renameat2(old: str, new: str, flags: int) -> None:
        if call(AT_FDCWD, os.fsencode(old), AT_FDCWD, os.fsencode(new), flags) != 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code), new)

    return renameat2


renameat2 = _load_renameat2()  # None where libc lacks it; tests set it to None for fallbacks

_UNSUPPORTED = (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP)


def rename_noreplace(src: Path, dst: Path, is_directory: bool) -> None:
    """Move src to dst only if dst does not exist; FileExistsError otherwise."""
    if renameat2 is not None:
        try:
            renameat2(str(src), str(dst), RENAME_NOREPLACE)
            return
        except OSError as exc:
            if exc.errno == errno.EEXIST:
                raise FileExistsError(errno.EEXIST, "exists", str(dst)) from None
            if exc.errno not in _UNSUPPORTED:
                raise
    if is_directory:
        os.mkdir(dst)  # FileExistsError if anything is there; then replace our empty one
        try:
            os.rename(src, dst)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.rmdir(dst)  # only if still empty, i.e. still ours
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                raise FileExistsError(errno.EEXIST, "exists", str(dst)) from None
            raise
        return
    try:
        os.link(src, dst)  # fails if dst exists, atomically
    except FileExistsError:
        raise
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EMLINK, errno.EXDEV):
            raise
        if os.path.lexists(dst):  # a filesystem without links: check, then rename
            raise FileExistsError(errno.EEXIST, "exists", str(dst)) from None
        os.rename(src, dst)
        return
    os.unlink(src)


def exchange(a: Path, b: Path) -> bool:
    """Atomically swap two existing paths; False where the filesystem cannot."""
    if renameat2 is None:
        return False
    try:
        renameat2(str(a), str(b), RENAME_EXCHANGE)
    except OSError as exc:
        if exc.errno in _UNSUPPORTED:
            return False
        raise
    return True


# ---------------------------------------------------------------- small file-system helpers


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under root, then root itself."""
    for directory, _, files in os.walk(root):
        for name in files:
            fsync_path(Path(directory, name))
        fsync_path(Path(directory))


def remove_tree(path: Path) -> None:
    """Remove a file, link or directory tree that this run created; errors are ignored."""
    if path.is_dir() and not path.is_symlink():
        try:  # empty (a failure before anything was written): needs no descriptor (EMFILE)
            os.rmdir(path)
        except OSError:
            shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


# ---------------------------------------------------------------- stale temps of dead runs


def temp_prefix(out: Path) -> str:
    """`.<OUT name>.`, with a long name cut (by bytes) and a hash of the whole name added,
    so that temp names fit NAME_MAX and two long OUT names never share a prefix."""
    encoded = os.fsencode(out.name)
    if len(encoded) <= _NAME_ROOM:
        return f".{out.name}."
    import hashlib  # only for a long OUT name: hashlib loads OpenSSL (~3 ms of start-up)

    digest = hashlib.sha256(encoded).hexdigest()[:12]
    cut = encoded[:_NAME_ROOM].decode("utf-8", "ignore")  # never half a character
    return f".{cut}~{digest}."


def hold_lock(directory: Path) -> int:
    """An open descriptor of `directory` holding an exclusive flock (where supported)."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    with contextlib.suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def _abandoned(path: Path, pid: int) -> bool:
    """Whether no live clipcli run owns this temp entry: its lock can be taken (the owner
    is gone), or, where there is no lock to ask (an aside file, no flock), no process
    with its pid runs."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return not _alive(pid)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:
        return not _alive(pid)
    finally:
        os.close(fd)
    return True


def remove_stale_temps(out: Path) -> None:
    """Remove temp entries for OUT left by clipcli runs that no longer run (SIGKILL, power
    loss), and put back an aside copy of OUT that a dead run stranded. Only entries named
    exactly for this OUT, owned by this user, and abandoned by their run."""
    parent = out.parent if str(out.parent) else Path(".")
    prefix = temp_prefix(out)
    try:
        entries = [e for e in os.scandir(parent) if e.name.startswith(prefix)]
    except OSError:
        return
    for entry in entries:
        match = _TEMP_TAIL.match(entry.name[len(prefix) :])
        if match is None:
            continue
        path = Path(parent, entry.name)
        with contextlib.suppress(OSError):
            if entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
            if not _abandoned(path, int(match["pid"])):
                continue
            if match["kind"] == ASIDE_SUFFIX and not os.path.lexists(out):
                os.rename(path, out)
                continue
            remove_tree(path)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True
