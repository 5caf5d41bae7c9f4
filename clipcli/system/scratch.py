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
import re
import stat
from collections.abc import Collection, Iterable, Iterator
from pathlib import Path

from clipcli.errors import WriteError
from clipcli.system.inputs import out_of_descriptors, pread_into

# Where temporary files go when TMPDIR is not set, in this order. Never the working
# directory (tempfile's last resort): that is often the input's own folder.
FALLBACK_DIRECTORIES = ("/tmp", "/var/tmp", "/usr/tmp")
_ADVICE = "set TMPDIR to a writable directory with room"
_ATTEMPTS = 100  # names tried before giving up (each a random 32 bits: never exhausted)


def directory() -> str:
    """The temporary directory: $TMPDIR where it is set, and then nothing else (a
    missing, non-directory or read-only TMPDIR is the user's to fix, not a reason to
    write elsewhere); where it is not set, the first usable of FALLBACK_DIRECTORIES.
    WriteError (exit 5) naming it, or them, where none is usable."""
    chosen = os.environ.get("TMPDIR")
    if chosen:
        where = os.path.abspath(chosen)
        problem = _unusable(where)
        if problem is not None:
            raise WriteError(f"no usable temporary directory: TMPDIR {where} {problem}; {_ADVICE}")
        return where
    problems = []
    for where in FALLBACK_DIRECTORIES:
        problem = _unusable(where)
        if problem is None:
            return where
        problems.append(f"{where} {problem}")
    raise WriteError(
        f"no usable temporary directory: TMPDIR is not set and {', '.join(problems)}; {_ADVICE}"
    )


def _unusable(where: str) -> str | None:
    """Why `where` cannot hold temporary files, or None."""
    try:
        info = os.stat(where)
    except FileNotFoundError:
        return "does not exist"
    except OSError as exc:
        return f"cannot be reached ({exc.strerror})"
    if not stat.S_ISDIR(info.st_mode):
        return "is not a directory"
    effective = os.access in os.supports_effective_ids
    if os.access(where, os.W_OK | os.X_OK, effective_ids=effective):
        return None
    with contextlib.suppress(OSError):
        if os.statvfs(where).f_flag & os.ST_RDONLY:
            return "is on a read-only file system"
    return "is not writable"


def _shown() -> str:
    """The temporary directory's name for a message, never failing."""
    chosen = os.environ.get("TMPDIR")
    if chosen:
        return os.path.abspath(chosen)
    usable = [where for where in FALLBACK_DIRECTORIES if _unusable(where) is None]
    return usable[0] if usable else ", ".join(FALLBACK_DIRECTORIES)


def failure(exc: OSError, where: str | None = None) -> WriteError:
    """A write into the temporary directory `where` failed: exit 5, naming it."""
    where = _shown() if where is None else where
    no_descriptor = out_of_descriptors(exc, f"temporary directory {where}")
    if no_descriptor is not None:  # no fault of the directory: do not send the user to TMPDIR
        return no_descriptor
    reason = "disk full" if exc.errno == errno.ENOSPC else (exc.strerror or str(exc))
    return WriteError(f"temporary directory {where}: cannot write: {reason}; {_ADVICE}")


def _new_name(prefix: str) -> str:
    """`<prefix><pid>-<8 hex>`: the pid says which run made it (sweep_abandoned)."""
    return f"{prefix}{os.getpid()}-{os.urandom(4).hex()}"


@contextlib.contextmanager
def temp_file(prefix: str) -> Iterator[int]:
    """The descriptor of a new, unnamed temporary file, closed (and so gone) at the end."""
    fd, _ = unnamed_file(prefix)
    try:
        yield fd
    finally:
        os.close(fd)


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
                raise failure(exc, where) from None
    for _ in range(_ATTEMPTS):
        path = os.path.join(where, _new_name(prefix))
        try:
            fd = os.open(path, flags | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            continue
        except OSError as exc:
            raise failure(exc, where) from None
        try:
            os.unlink(path)
        except OSError as exc:
            os.close(fd)
            raise failure(exc, where) from None
        return fd, False
    raise WriteError(f"temporary directory {where}: cannot find a free name; {_ADVICE}")


def name_unnamed(fd: int, directory: PrivateDirectory, name: str) -> Path:
    """Give the unnamed (O_TMPFILE) file `fd` the name `name` in `directory` (linkat
    through /proc/self/fd), for a library that opens files by name only; the path."""
    try:  # a dir_fd makes os.link call linkat, which follows the /proc link (link does not)
        os.link(f"/proc/self/fd/{fd}", name, dst_dir_fd=directory.fd, follow_symlinks=True)
    except OSError as exc:
        raise failure(exc, str(directory.path.parent)) from None
    return directory.path / name


# ---------------------------------------------------------------- what the sweeps must not touch

# The paths the running job named (every input and OUT), set by the job (clipcli.api):
# a sweep of scratch directories leaves alone whatever they resolve to, whichever input a
# reader that sweeps happens to be opened for.
_named_paths: tuple[str, ...] = ()


@contextlib.contextmanager
def keeping_clear_of(paths: Iterable[str | os.PathLike[str]]) -> Iterator[None]:
    """While the block runs, no sweep of scratch directories removes anything `paths`
    (every input of the job, and OUT) resolve to, lie in or lead through."""
    global _named_paths
    before = _named_paths
    _named_paths = (*before, *(os.fspath(path) for path in paths))
    try:
        yield
    finally:
        _named_paths = before


def _named_identities() -> tuple[set[tuple[int, int]], set[tuple[int, int]]]:
    """(device, inode) of every entry the named paths pass through and reach, and of the
    named paths that are directories (a model directory IN, a directory OUT)."""
    from clipcli.system.footprint import resolution_inodes  # only when a sweep has a candidate

    reached = resolution_inodes(Path(path) for path in _named_paths)
    folders = set()
    for path in _named_paths:
        with contextlib.suppress(OSError):
            info = os.stat(path)
            if stat.S_ISDIR(info.st_mode):
                folders.add((info.st_dev, info.st_ino))
    return reached, folders


# ---------------------------------------------------------------- private directories


class PrivateDirectory:
    """A new 0700 directory in the temporary directory, `<prefix><pid>-<hex>`, locked
    (flock) for as long as this run holds it, to hold files named `members`. SIGKILL
    cannot be caught, so such a directory can outlive its run; the next run with the same
    prefix removes those whose run is gone (`sweep_abandoned`)."""

    ATTEMPTS = 8  # a sweeping run can remove a new directory before its lock is taken

    def __init__(
        self, prefix: str, members: Collection[str], keep: os.stat_result | None = None
    ) -> None:
        where = directory()
        sweep_abandoned(where, prefix, members, keep)
        for _ in range(self.ATTEMPTS):
            path = os.path.join(where, _new_name(prefix))
            try:
                os.mkdir(path, 0o700)
            except FileExistsError:
                continue
            except OSError as exc:
                raise failure(exc, where) from None
            try:
                fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError as exc:  # out of descriptors: the new directory must not stay
                with contextlib.suppress(OSError):
                    os.rmdir(path)
                raise failure(exc, where) from None
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


_RUN_TAIL = re.compile(r"^(?P<pid>[0-9]+)-[0-9a-f]{8}$")


def sweep_abandoned(
    where: str, prefix: str, members: Collection[str], keep: os.stat_result | None = None
) -> None:
    """Remove the `<prefix><pid>-<hex>` directories in `where` that dead runs left. Only a
    directory that is all of these is removed; any other is left alone, without a word
    (it is no business of this run's):

    - a real directory (never reached through a link) of this user, on `where`'s file
      system, with no file system mounted in it (a bind mount looks like a folder);
    - abandoned: no process has its pid and its lock can be taken (a run makes its
      directory a moment before it locks it; a reused pid only leaves it for later);
    - holding nothing but what clipcli puts there: files named in `members`, regular,
      with one link each, of this user;
    - clear of the job: neither it nor a file in it is `keep` (the input being read) or
      anything the job's named paths (keeping_clear_of: every input, OUT) pass through
      or reach, and it lies in none of the named directories."""
    try:
        base = os.open(where, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        names = [name for name in os.listdir(base) if name.startswith(prefix)]
        protected: tuple[set[tuple[int, int]], set[tuple[int, int]]] | None = None
        for name in names:
            match = _RUN_TAIL.match(name[len(prefix) :])
            if match is None or process_alive(int(match["pid"])):
                continue
            with contextlib.suppress(OSError):
                found = _candidate(base, name, members)
                if found is None:
                    continue
                fd, files = found
                try:
                    if protected is None:  # the named paths are walked once, if at all
                        protected = _named_identities()
                        if keep is not None:
                            protected[0].add((keep.st_dev, keep.st_ino))
                    if _clear_of(fd, files, *protected):
                        _remove_checked(base, name, fd, files)
                finally:
                    os.close(fd)
    finally:
        os.close(base)


def _candidate(
    base: int, name: str, members: Collection[str]
) -> tuple[int, list[tuple[str, os.stat_result]]] | None:
    """(locked descriptor, (name, lstat) of each file) when the entry `name` in the
    directory open as `base` is an unlocked directory of this user holding nothing but
    `members`; None otherwise. The lock is held until the descriptor is closed."""
    info = os.stat(name, dir_fd=base, follow_symlinks=False)
    where = os.fstat(base)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_dev != where.st_dev:
        return None
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=base)
    try:
        if not os.path.samestat(os.fstat(fd), info) or _lock(fd) is not True:
            os.close(fd)
            return None  # replaced meanwhile, its run is alive, or there is no lock to ask
        files = []
        for entry in os.listdir(fd):
            found = os.stat(entry, dir_fd=fd, follow_symlinks=False)
            if (
                entry not in members
                or not stat.S_ISREG(found.st_mode)
                or found.st_nlink != 1
                or found.st_uid != os.geteuid()
                or found.st_dev != info.st_dev
            ):
                os.close(fd)
                return None
            files.append((entry, found))
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(fd)
        raise
    return fd, files


def _clear_of(
    fd: int,
    files: list[tuple[str, os.stat_result]],
    reached: set[tuple[int, int]],
    folders: set[tuple[int, int]],
) -> bool:
    """Whether the directory open as `fd` and its `files` are clear of the job: none is
    reached by a named path, the directory lies in no named directory, and nothing is
    mounted at or in it."""
    from clipcli.system.footprint import ancestor_inodes_at, holds_a_mount

    infos = [os.fstat(fd), *(info for _, info in files)]
    if any((info.st_dev, info.st_ino) in reached for info in infos):
        return False
    if any(identity in folders for identity in ancestor_inodes_at(fd)):
        return False
    return not holds_a_mount(fd, ".")


def _remove_checked(base: int, name: str, fd: int, files: list[tuple[str, os.stat_result]]) -> None:
    """Unlink the checked files (each only while still the file that was checked), then
    the directory, which rmdir removes only when nothing else arrived."""
    for entry, info in files:
        if os.path.samestat(os.stat(entry, dir_fd=fd, follow_symlinks=False), info):
            os.unlink(entry, dir_fd=fd)
    os.rmdir(name, dir_fd=base)


def process_alive(pid: int) -> bool:
    """Whether `pid` may be a live process here: only "no such process" says it is not
    (another user's, or a PID out of range, counts as alive: an entry is then only left)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True
    return True


def write_at(fd: int, data: bytes | memoryview, position: int) -> None:
    """All of `data` at `position` in a scratch file (a full disk can write part of it)."""
    view = memoryview(data).cast("B")
    try:
        while view:
            written = os.pwrite(fd, view, position)
            view, position = view[written:], position + written
    except OSError as exc:
        raise failure(exc) from None


def read_at(fd: int, buffer: memoryview, position: int) -> None:
    """`buffer` filled from a scratch file at `position`: what write_at put there. A file
    that ends first was cut by someone else (it has no name, only a descriptor): exit 5,
    as for a scratch write that fails."""
    view = buffer.cast("B")
    try:
        done = pread_into(fd, view, position)
    except OSError as exc:
        raise failure(exc) from None
    if done < len(view):
        raise WriteError(f"a temporary file in {_shown()} was cut short while in use")


def size_of(fd: int) -> int:
    """A scratch file's size in bytes."""
    try:
        return os.fstat(fd).st_size
    except OSError as exc:
        raise failure(exc) from None


def open_new(path: str | os.PathLike[str]) -> int:
    """A new file in a scratch directory, for writing."""
    try:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise failure(exc) from None
