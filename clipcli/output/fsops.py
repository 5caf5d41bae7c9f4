"""File-system steps of writing OUT: no-clobber renames and swaps (renameat2, with
fallbacks), fsync, removal of what this run made, and temp names with the cleanup of
temps that dead runs left. clipcli.output.target puts them together into targets.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import re
import stat
from collections.abc import Callable
from pathlib import Path

from clipcli.system.footprint import holds_a_mount
from clipcli.system.scratch import process_alive

TEMP_SUFFIX = ".clipcli-tmp"
ASIDE_SUFFIX = ".clipcli-old"
KEPT_SUFFIX = ".clipcli-kept"
_NAME_ROOM = 160  # bytes of OUT's name kept in a temp name (NAME_MAX is 255 bytes)
_TEMP_TAIL = re.compile(r"^(?P<pid>\d+)-[0-9a-f]{8}(?P<kind>\.clipcli-(?:tmp|old))$")

Keep = frozenset[tuple[int, int]]  # (device, inode) of entries no removal may touch
Wanted = Callable[[str, os.stat_result], bool]  # (relative path, lstat) -> remove it?
_DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_MAX_DEPTH = 64  # deeper than anything clipcli writes (side folders stop at 16)

AT_FDCWD = -100
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2


# ---------------------------------------------------------------- renameat2


def _load_renameat2() -> Callable[..., None] | None:
    try:
        call = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]

    def renameat2(
        old: str, new: str, flags: int, old_dir: int = AT_FDCWD, new_dir: int = AT_FDCWD
    ) -> None:
        if call(old_dir, os.fsencode(old), new_dir, os.fsencode(new), flags) != 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code), new)

    return renameat2


renameat2 = _load_renameat2()  # None where libc lacks it; tests set it to None for fallbacks

_UNSUPPORTED = (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP)


def rename_noreplace(
    src: str | Path,
    dst: str | Path,
    is_directory: bool,
    *,
    src_dir: int | None = None,
    dst_dir: int | None = None,
) -> None:
    """Move src to dst only if dst does not exist; FileExistsError otherwise. With
    `src_dir`/`dst_dir`, the names are looked up in those opened directories, never
    through their paths again."""
    if renameat2 is not None:
        try:
            renameat2(str(src), str(dst), RENAME_NOREPLACE, _at(src_dir), _at(dst_dir))
            return
        except OSError as exc:
            if exc.errno == errno.EEXIST:
                raise FileExistsError(errno.EEXIST, "exists", str(dst)) from None
            if exc.errno not in _UNSUPPORTED:
                raise
    if is_directory:
        # FileExistsError if anything is there; then replace our empty one
        os.mkdir(dst, dir_fd=dst_dir)
        try:
            os.rename(src, dst, src_dir_fd=src_dir, dst_dir_fd=dst_dir)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.rmdir(dst, dir_fd=dst_dir)  # only if still empty, i.e. still ours
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                raise FileExistsError(errno.EEXIST, "exists", str(dst)) from None
            raise
        return
    try:  # fails if dst exists, atomically
        os.link(src, dst, src_dir_fd=src_dir, dst_dir_fd=dst_dir, follow_symlinks=False)
    except FileExistsError:
        raise
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EMLINK, errno.EXDEV):
            raise
        if _lexists(dst, dst_dir):  # a filesystem without links: check, then rename
            raise FileExistsError(errno.EEXIST, "exists", str(dst)) from None
        os.rename(src, dst, src_dir_fd=src_dir, dst_dir_fd=dst_dir)
        return
    os.unlink(src, dir_fd=src_dir)


def exchange(
    a: str | Path, b: str | Path, *, a_dir: int | None = None, b_dir: int | None = None
) -> bool:
    """Atomically swap two existing entries (names in the opened directories `a_dir` and
    `b_dir` where given); False where the filesystem cannot."""
    if renameat2 is None:
        return False
    try:
        renameat2(str(a), str(b), RENAME_EXCHANGE, _at(a_dir), _at(b_dir))
    except OSError as exc:
        if exc.errno in _UNSUPPORTED:
            return False
        raise
    return True


def _at(directory: int | None) -> int:
    return AT_FDCWD if directory is None else directory


def _lexists(name: str | Path, directory: int | None) -> bool:
    try:
        os.stat(name, dir_fd=directory, follow_symlinks=False)
    except FileNotFoundError:
        return False
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


def remove_tree(path: Path, keep: Keep = frozenset(), *, parent: int | None = None) -> None:
    """Remove a file, link or directory tree that clipcli created; errors are ignored.
    Nothing in `keep` (device, inode: what the input resolves to) is removed, links are
    never followed, and no other file system mounted inside is entered. With `parent`,
    `path` is a name in that opened directory (its path is not looked up again)."""
    with contextlib.suppress(OSError):  # empty (a failure before anything was written):
        os.rmdir(path, dir_fd=parent)  # needs no descriptor (EMFILE)
        return
    if parent is not None:
        remove_entry_at(parent, path.name, keep)
        return
    try:
        opened = os.open(path.parent, _DIRECTORY_FLAGS)
    except OSError:
        return
    try:
        remove_entry_at(opened, path.name, keep)
    finally:
        os.close(opened)


def _identity(info: os.stat_result) -> tuple[int, int]:
    return info.st_dev, info.st_ino


def _same_entry(a: os.stat_result, b: os.stat_result) -> bool:
    """Device, inode and file type: a freed inode is soon reused, often for a link."""
    return _identity(a) == _identity(b) and stat.S_IFMT(a.st_mode) == stat.S_IFMT(b.st_mode)


def _everything(relative: str, info: os.stat_result) -> bool:  # noqa: ARG001
    return True


def remove_entry_at(parent: int, name: str, keep: Keep, wanted: Wanted = _everything) -> None:
    """Remove `name` in the directory open as `parent`: a file or link by unlinkat, a
    directory by removing what `wanted` accepts inside it (deepest first), then rmdir,
    which only succeeds when nothing is left. Each entry is looked at without following
    links and skipped when it is in `keep` or on another device, so that a name swapped
    for a link meanwhile is unlinked as a link and never followed. A directory with a
    file system mounted at or below it (a bind mount of a folder of the same file system
    looks like any folder) is left whole."""
    with contextlib.suppress(OSError):
        info = os.stat(name, dir_fd=parent, follow_symlinks=False)
        if _identity(info) in keep:
            return
        if not stat.S_ISDIR(info.st_mode):
            os.unlink(name, dir_fd=parent)
            return
        with contextlib.suppress(OSError):  # empty: needs no descriptor (EMFILE)
            os.rmdir(name, dir_fd=parent)
            return
        if holds_a_mount(parent, name):
            return
        _clear_directory_at(parent, name, info, "", keep, wanted, 0)
        os.rmdir(name, dir_fd=parent)


def _clear_directory_at(
    parent: int,
    name: str,
    info: os.stat_result,
    prefix: str,
    keep: Keep,
    wanted: Wanted,
    depth: int,
) -> None:
    if depth >= _MAX_DEPTH:
        return
    fd = os.open(name, _DIRECTORY_FLAGS | os.O_NOFOLLOW, dir_fd=parent)
    try:
        if _identity(os.fstat(fd)) != _identity(info):  # replaced since it was looked at
            return
        _clear_opened(fd, info, prefix, keep, wanted, depth)
    finally:
        os.close(fd)


def clear_directory(fd: int, keep: Keep = frozenset()) -> None:
    """Remove everything inside the directory open as `fd`, as remove_entry_at does
    (links unlinked, never followed; nothing in `keep`; no other file system entered,
    nothing removed where one is mounted inside); errors are ignored. Needs no
    descriptor for the directory itself."""
    with contextlib.suppress(OSError):
        if not holds_a_mount(fd, "."):
            _clear_opened(fd, os.fstat(fd), "", keep, _everything, 0)


def _clear_opened(
    fd: int, info: os.stat_result, prefix: str, keep: Keep, wanted: Wanted, depth: int
) -> None:
    with os.scandir(fd) as entries:
        names = [entry.name for entry in entries]
    for child in names:
        relative = prefix + child
        with contextlib.suppress(OSError):
            found = os.stat(child, dir_fd=fd, follow_symlinks=False)
            if (
                _identity(found) in keep
                or found.st_dev != info.st_dev
                or not wanted(relative, found)
            ):
                continue
            if stat.S_ISDIR(found.st_mode):
                _clear_directory_at(fd, child, found, relative + "/", keep, wanted, depth + 1)
                os.rmdir(child, dir_fd=fd)
            else:
                os.unlink(child, dir_fd=fd)


def _holds_any_at(parent: int, name: str, info: os.stat_result, keep: Keep, depth: int) -> bool:
    """Whether the entry `name` (a link not followed), or anything inside it on the same
    device, is one of `keep`. OSError where it cannot be looked at in full."""
    if _identity(info) in keep:
        return True
    if not stat.S_ISDIR(info.st_mode) or depth >= _MAX_DEPTH:
        return False
    fd = os.open(name, _DIRECTORY_FLAGS | os.O_NOFOLLOW, dir_fd=parent)
    try:
        opened = os.fstat(fd)
        if _identity(opened) in keep:
            return True
        with os.scandir(fd) as entries:
            children = [(entry.name, entry.stat(follow_symlinks=False)) for entry in entries]
        return any(
            _identity(found) in keep
            or (found.st_dev == opened.st_dev and _holds_any_at(fd, child, found, keep, depth + 1))
            for child, found in children
        )
    finally:
        os.close(fd)


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


def hold_lock(directory: str | Path, *, parent: int | None = None) -> int:
    """An open descriptor of `directory` (a name in the opened directory `parent`, where
    given; a link is not followed) holding an exclusive flock (where supported)."""
    fd = os.open(directory, _DIRECTORY_FLAGS | os.O_NOFOLLOW, dir_fd=parent)
    with contextlib.suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


class StaleTempHoldsInput(Exception):
    """A dead run's temp entry that the sweep would remove or move holds (or is, or is a
    link on the way to) what the input resolves to; nothing was touched."""

    def __init__(self, path: Path) -> None:
        super().__init__(str(path))
        self.path = path


def _abandoned(parent: int, name: str, pid: int) -> bool:
    """Whether no live clipcli run owns this temp entry: no process with its pid runs,
    and its lock can be taken (where it can be asked: a directory on a file system with
    flock). Both, because a run creates its work directory before it can lock it, and
    sets OUT's old copy aside unlocked: a live run always has its pid running. The lock
    answers where the pid cannot (another PID namespace); a reused pid only leaves an
    entry for a later sweep, never removes a live one."""
    if process_alive(pid):
        return False
    try:
        fd = os.open(name, _DIRECTORY_FLAGS | os.O_NOFOLLOW, dir_fd=parent)
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:
        return True
    finally:
        os.close(fd)
    return True


def _stale_entries(parent: int, prefix: str) -> list[tuple[str, os.stat_result, str]]:
    """(name, lstat, kind) of the temp entries for OUT's prefix in `parent` that belong to
    this user and that no live run owns."""
    stale = []
    with os.scandir(parent) as entries:
        names = [entry.name for entry in entries if entry.name.startswith(prefix)]
    for name in names:
        match = _TEMP_TAIL.match(name[len(prefix) :])
        if match is None:
            continue
        with contextlib.suppress(OSError):
            info = os.stat(name, dir_fd=parent, follow_symlinks=False)
            if info.st_uid == os.getuid() and _abandoned(parent, name, int(match["pid"])):
                stale.append((name, info, match["kind"]))
    return stale


def remove_stale_temps(
    out: Path, keep: Keep = frozenset(), *, parent: int | None = None, out_is_directory: bool
) -> bool:
    """Remove temp entries for OUT left by clipcli runs that no longer run (SIGKILL, power
    loss), and put back an aside copy of OUT that a dead run stranded; whether one was
    put back. Only entries named exactly for this OUT, owned by this user, and abandoned
    by their run; none with a file system mounted at or below it.

    `keep` is what the input resolves to (device, inode of every entry on the way to each
    of its files): when a stale entry is, holds or leads to one of them, nothing at all is
    removed or moved and StaleTempHoldsInput names the entry. Everything is done relative
    to OUT's opened directory and never through a link, so an entry swapped for a link
    after the check is at worst unlinked as a link. `parent`, where given, is OUT's
    directory as the run opened it when it checked OUT (its path is not looked up again).

    clipcli sets aside only a directory OUT, and only as a real directory: an aside entry
    is put back only when it is one and OUT is a directory target; anything else under an
    aside name (a file, a link, a directory where OUT is a file) is no copy of clipcli's
    and is left alone, neither moved nor removed."""
    parent_path = out.parent if str(out.parent) else Path(".")
    if parent is not None:
        return _remove_stale_temps_at(parent, parent_path, out, keep, out_is_directory)
    try:
        opened = os.open(parent_path, _DIRECTORY_FLAGS)
    except OSError:
        return False
    try:
        return _remove_stale_temps_at(opened, parent_path, out, keep, out_is_directory)
    finally:
        os.close(opened)


def _remove_stale_temps_at(
    parent: int, parent_path: Path, out: Path, keep: Keep, out_is_directory: bool
) -> bool:
    try:
        stale = _stale_entries(parent, temp_prefix(out))
    except OSError:
        return False
    checked = []
    for name, info, kind in stale:  # every entry first: a refusal leaves all in place
        try:
            holds = _holds_any_at(parent, name, info, keep, 0)
        except OSError:
            continue  # not to be looked at in full: not to be removed either
        if holds:
            raise StaleTempHoldsInput(parent_path / name)
        if kind == ASIDE_SUFFIX and not (out_is_directory and stat.S_ISDIR(info.st_mode)):
            continue  # no copy clipcli set aside: left alone
        if stat.S_ISDIR(info.st_mode) and holds_a_mount(parent, name):
            continue  # a file system mounted inside is no temp of clipcli's
        checked.append((name, info, kind))
    put_back = False
    for name, info, kind in checked:
        with contextlib.suppress(OSError):
            now = os.stat(name, dir_fd=parent, follow_symlinks=False)
            if not _same_entry(now, info):
                continue  # replaced since the check: not the entry that was checked
            if kind == ASIDE_SUFFIX and _put_back(parent, name, out.name, info):
                put_back = True
                continue
            remove_entry_at(parent, name, keep)
    return put_back


def _put_back(parent: int, name: str, out_name: str, info: os.stat_result) -> bool:
    """Rename a stranded aside copy (the real directory `info`) back to OUT if nothing is
    at OUT; whether it was. Should the name have been swapped for another entry since
    it was checked, that entry is moved back and nothing is put back."""
    if renameat2 is not None:
        try:
            renameat2(name, out_name, RENAME_NOREPLACE, parent, parent)
        except OSError as exc:
            if exc.errno == errno.EEXIST:
                return False
            if exc.errno not in _UNSUPPORTED:
                raise
        else:
            return _is_the_checked(parent, name, out_name, info)
    try:
        os.stat(out_name, dir_fd=parent, follow_symlinks=False)
        return False
    except FileNotFoundError:
        os.rename(name, out_name, src_dir_fd=parent, dst_dir_fd=parent)
        return _is_the_checked(parent, name, out_name, info)


def _is_the_checked(parent: int, name: str, out_name: str, info: os.stat_result) -> bool:
    """After a put-back: whether OUT is the checked aside directory; if not (swapped
    meanwhile), it goes back under its aside name, untouched."""
    now = os.stat(out_name, dir_fd=parent, follow_symlinks=False)
    if _same_entry(now, info):
        return True
    is_directory = stat.S_ISDIR(now.st_mode)
    rename_noreplace(out_name, name, is_directory, src_dir=parent, dst_dir=parent)
    return False
