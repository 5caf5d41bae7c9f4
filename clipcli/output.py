"""OUT: the one way clipcli writes, from choosing the target to the commit point.

A target is chosen from OUT's text alone (`choose_target`), checked against the input
before any tensor is read (`check`), staged beside OUT under a temp name that carries the
process id (`stage`), and committed by one rename. Rules, each tested:

- Never over, into or around the input: OUT that is IN, lies inside IN (a directory), or
  contains IN is refused (exit 2), with or without --force, through symlinks and hard links.
- Never delete what clipcli did not create: without --force an existing OUT is refused;
  with it, a file (or symlink) is replaced, and a directory only when it holds nothing but
  names clipcli itself would write there (exit 2 otherwise, naming what is in the way).
- One commit point. Before it the old OUT is whole; after it the run reports success.
  Signals are recorded while staging (clipcli.interrupts) and acted on between chunks, and
  once more just before the rename; cleanup is never cut short by a second signal.
- No-clobber without --force: the rename is renameat2(RENAME_NOREPLACE) (for a directory
  without it: mkdir + rename over the empty directory), so something that appears at OUT
  during the run is left alone and the run exits 2.
- A --force directory swap is renameat2(RENAME_EXCHANGE): OUT is never absent. Where the
  filesystem lacks it, two renames, and the aside copy keeps a name the next run restores.
- Temp names are `.<OUT name>.<pid>-<random>.clipcli-tmp` (and `.clipcli-old` for an
  aside copy). SIGKILL cannot be caught, so the next run to the same OUT removes such
  entries of dead processes of the same user (and puts a stranded aside copy back).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import os
import re
import secrets
import shutil
import signal
import stat
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from clipcli import interrupts
from clipcli.errors import ClipcliError, UsageError, WriteError
from clipcli.io import format_from_extension

TEMP_SUFFIX = ".clipcli-tmp"
ASIDE_SUFFIX = ".clipcli-old"
KEPT_SUFFIX = ".clipcli-kept"
_NAME_ROOM = 160  # bytes of OUT's name kept in a temp name (NAME_MAX is 255 bytes)
_TEMP_TAIL = re.compile(r"^(?P<pid>\d+)-[0-9a-f]{8}(?P<kind>\.clipcli-(?:tmp|old))$")

AT_FDCWD = -100
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2


class Refused(UsageError):
    """OUT cannot be written as asked (exit 2); nothing was touched."""


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
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _is_inside(path: Path, root: Path) -> bool:
    return path == root or path.is_relative_to(root)


def _real(path: Path) -> Path:
    """The real path: symlinks resolved, including the last component."""
    return Path(os.path.realpath(path))


def _real_parent(path: Path) -> Path:
    """The path with its directory resolved but its last component as given (so that a
    symlink at OUT is itself what gets replaced)."""
    return Path(os.path.realpath(path.parent or "."), path.name)


# ---------------------------------------------------------------- the input, as OUT must avoid it


class InputFootprint:
    """What OUT must stay clear of: the input's root (a file, or the model directory) and
    every file read from it. Compared by real path and by device and inode, so that hard
    links and bind mounts (another path to the same directory) are caught too."""

    def __init__(self, root: Path, files: Iterable[Path]) -> None:
        files = list(files)
        self.root = _real(root)
        self.root_is_directory = self.root.is_dir()
        self.files = [_real(f) for f in files]
        self.inodes = {identity for p in [self.root, *self.files] if (identity := _inode(p))}
        self.root_inode = _inode(self.root)
        self.file_ancestors = [set(_ancestor_inodes(f)) for f in [self.root, *self.files]]
        try:
            self.root_mode = stat.S_IMODE(os.stat(self.root).st_mode)
        except OSError:
            self.root_mode = 0o666
        # Permission bits of each input file by its path inside the model directory.
        self.modes: dict[str, int] = {}
        for path in files:
            with contextlib.suppress(OSError, ValueError):
                relative = Path(path).relative_to(root).as_posix()
                self.modes[relative] = stat.S_IMODE(os.stat(path).st_mode)

    def overlap(self, out: Path) -> str | None:
        """Why writing OUT would touch the input, or None."""
        for candidate in {_real_parent(out), _real(out)}:
            if candidate == self.root or any(candidate == f for f in self.files):
                return "is the input"
            if self.root_is_directory and _is_inside(candidate, self.root):
                return "is inside the input directory"
            if _is_inside(self.root, candidate) or any(
                _is_inside(f, candidate) for f in self.files
            ):
                return "contains the input"
        out_inode = _inode(out)
        if out_inode is not None and out_inode in self.inodes:
            return "is the input (a link to it)"
        above = set(_ancestor_inodes(out.parent if str(out.parent) else Path(".")))
        if self.root_is_directory and self.root_inode in above:
            return "is inside the input directory (through another path to it)"
        if out_inode is not None and any(out_inode in up for up in self.file_ancestors):
            return "contains the input (through another path to it)"
        return None


def _inode(path: Path) -> tuple[int, int] | None:
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_dev, info.st_ino


def _ancestor_inodes(path: Path) -> Iterator[tuple[int, int]]:
    """(device, inode) of path and of every directory above it, as the kernel sees them
    (a bind mount shows the mounted directory's own identity)."""
    current = Path(os.path.abspath(path))
    while True:
        identity = _inode(current)
        if identity is not None:
            yield identity
        if current.parent == current:
            return
        current = current.parent


# ---------------------------------------------------------------- targets


class Target:
    """Where OUT goes and how it gets there; subclasses say what kind of entry it is."""

    is_directory = False
    kind = "file"

    def __init__(self, out: Path, *, force: bool, durable: bool) -> None:
        self.out = out
        self.force = force
        self.durable = durable
        self.parent = out.parent if str(out.parent) else Path(".")
        self._replace_empty_directory = False
        self._mode = 0o644
        self._file_modes: dict[str, int] = {}
        self._default_file_mode = 0o666
        self.notes: list[str] = []  # said after a successful commit

    # -- checks, before any data is read

    def check(self, footprint: InputFootprint, expected_names: Iterable[str] = ()) -> None:
        """Refuse (exit 2) or fail (exit 5) before anything is read or written."""
        out = self.out
        problem = footprint.overlap(out)
        if problem is not None:
            raise Refused(f"{out}: output {problem}; choose an OUT outside the input")
        if not self.parent.is_dir():
            raise WriteError(f"{out}: directory {self.parent} does not exist")
        self._mode = self._new_mode(footprint)
        try:
            info = os.lstat(out)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise WriteError(f"{out}: cannot check the output path: {exc.strerror}") from None
        existing_dir = stat.S_ISDIR(info.st_mode)
        if existing_dir and self.is_directory and _is_empty_directory(out):
            self._replace_empty_directory = True
            self._mode = stat.S_IMODE(info.st_mode)
            return
        if not self.force:
            raise Refused(f"{out}: already exists; pass --force to replace it")
        if existing_dir:
            self._check_replaceable_directory(frozenset(expected_names))
        elif not self.is_directory and stat.S_ISREG(info.st_mode):
            self._mode = stat.S_IMODE(info.st_mode)  # cp keeps a replaced file's mode

    def _check_replaceable_directory(self, expected: frozenset[str]) -> None:
        raise Refused(
            f"{self.out}: is a directory; --force replaces a file, not a directory "
            f"(name the file to write, e.g. {self.out / 'model.safetensors'})"
        )

    def _new_mode(self, footprint: InputFootprint) -> int:
        """cp's rule: a new OUT gets IN's permission bits, masked by the umask (for a model
        directory IN joined into one file: its first file's)."""
        mode = footprint.root_mode
        if footprint.root_is_directory:
            mode = next(iter(footprint.modes.values()), 0o666)
        return mode & ~_umask()

    # -- staging and the commit

    def temp_path(self, suffix: str = TEMP_SUFFIX) -> Path:
        token = f"{os.getpid()}-{secrets.token_hex(4)}"
        return self.parent / f"{temp_prefix(self.out)}{token}{suffix}"

    @contextlib.contextmanager
    def stage(self) -> Iterator[Path]:
        """Yield a new temp entry beside OUT; when the block ends normally, commit it as OUT.

        Every run works in a private directory beside OUT (`.<OUT>.<pid>-<hex>.clipcli-tmp`)
        on which it holds an flock while it lives: a later run removes such a directory
        only when it can take that lock, i.e. when its owner is gone (PID namespaces and
        reused PIDs cannot fool it). A file OUT is built inside it; a directory OUT is that
        directory. Signals are deferred for the whole block. Any failure removes the work
        directory and leaves OUT as it was: OSError becomes WriteError (exit 5), a signal
        Interrupted."""
        with interrupts.deferred():
            remove_stale_temps(self.out)
            workdir = self.temp_path()
            try:
                os.mkdir(workdir, 0o700)
            except OSError as exc:
                raise WriteError(
                    f"{self.out}: cannot create a directory in {self.parent}: {exc.strerror}"
                ) from None
            lock = _hold_lock(workdir)
            try:
                staged = self._staged_in(workdir)
                yield staged
                interrupts.check()
                self._commit(staged)
                if workdir != staged:
                    os.rmdir(workdir)
            except BaseException as exc:
                remove_tree(workdir)
                raise _translated(exc, self.out) from None
            finally:
                os.close(lock)

    def _staged_in(self, workdir: Path) -> Path:
        """The path the writer fills: a file inside the work directory."""
        return workdir / self.out.name

    def _commit(self, staged: Path) -> None:
        if self.durable:
            self._sync(staged)
        interrupts.check()  # the last moment at which a signal means "no output"
        os.chmod(staged, self._mode)
        self._place(staged)  # the commit point
        if self.durable:
            with contextlib.suppress(OSError):
                fsync_path(self.parent)

    def _sync(self, staged: Path) -> None:
        fsync_path(staged)

    def _place(self, staged: Path) -> None:
        out = self.out
        if not self.force:
            try:
                rename_noreplace(staged, out, self.is_directory)
            except FileExistsError:
                raise Refused(
                    f"{out}: appeared while clipcli was writing; left alone, no output written"
                ) from None
            return
        try:
            os.replace(staged, out)
        except IsADirectoryError:
            raise Refused(
                f"{out}: became a directory while clipcli was writing; left alone, "
                "no output written"
            ) from None


class FileTarget(Target):
    """OUT is one checkpoint file; its extension names the format."""


class DirectoryTarget(Target):
    """OUT is a model directory: shards, index and the input directory's other files."""

    is_directory = True
    kind = "directory"

    def _new_mode(self, footprint: InputFootprint) -> int:
        if footprint.root_is_directory:
            self._file_modes = dict(footprint.modes)
            return footprint.root_mode & ~_umask()
        self._default_file_mode = footprint.root_mode  # the one file of a one-file model
        return 0o777 & ~_umask()

    def _check_replaceable_directory(self, expected: frozenset[str]) -> None:
        strangers = _unexpected_entries(self.out, expected)
        if strangers:
            shown = ", ".join(repr(name) for name in strangers[:5])
            more = f" and {len(strangers) - 5} more" if len(strangers) > 5 else ""
            raise Refused(
                f"{self.out}: holds {shown}{more}, which clipcli would not write there; "
                "--force replaces only a directory that holds nothing but clipcli's own "
                "output. Choose a new OUT"
            )
        self._mode = stat.S_IMODE(os.stat(self.out).st_mode)
        self._expected = expected

    _expected: frozenset[str] = frozenset()

    def _staged_in(self, workdir: Path) -> Path:
        return workdir  # the work directory becomes OUT

    def _sync(self, staged: Path) -> None:
        fsync_tree(staged)

    def _commit(self, staged: Path) -> None:
        # cp -r: each file keeps its source's permission bits (masked by the umask), so a
        # private shard does not become a world-readable one inside the new directory.
        mask = _umask()
        for folder, _, files in os.walk(staged):
            for name in files:
                path = Path(folder, name)
                relative = path.relative_to(staged).as_posix()
                os.chmod(path, self._file_modes.get(relative, self._default_file_mode) & ~mask)
        super()._commit(staged)

    def _place(self, staged: Path) -> None:
        out = self.out
        if self._replace_empty_directory and not self.force:
            try:
                os.rename(staged, out)  # replaces an empty directory, and nothing else
            except OSError as exc:
                if exc.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                    raise Refused(
                        f"{out}: changed while clipcli was writing; left alone, no output written"
                    ) from None
                raise
            return
        if not self.force or not os.path.lexists(out):
            super()._place(staged)
            return
        self._swap(staged)

    def _swap(self, staged: Path) -> None:
        """Replace an existing OUT (--force) without a moment where OUT is absent."""
        out = self.out
        if _is_real_directory(out) and _unexpected_entries(out, self._expected):
            raise Refused(
                f"{out}: changed while clipcli was writing; left alone, no output written"
            )
        if exchange(staged, out):
            old = staged  # the old OUT now sits at the temp name
            if _is_real_directory(old) and _unexpected_entries(old, self._expected):
                exchange(staged, out)  # something arrived in the old OUT meanwhile: undo
                raise Refused(
                    f"{out}: changed while clipcli was writing; left alone, no output written"
                )
            self._remove_replaced(old)
            return
        aside = self.temp_path(ASIDE_SUFFIX)
        os.rename(out, aside)  # signals are deferred, so nothing stops between the two
        try:
            os.rename(staged, out)
        except OSError:
            os.rename(aside, out)
            raise
        self._remove_replaced(aside)

    def _remove_replaced(self, old: Path) -> None:
        """Delete the replaced OUT by the names clipcli would have written, deepest first,
        never a name it does not know: a file someone put there after the last check
        survives, and the old directory is then kept (named *.clipcli-kept) and reported."""
        if not _is_real_directory(old):
            remove_tree(old)
            return
        for name in sorted(self._expected, key=lambda n: n.count("/"), reverse=True):
            path = old / name
            with contextlib.suppress(OSError):
                if _is_real_directory(path):
                    os.rmdir(path)
                elif path.is_file() and not path.is_symlink():
                    path.unlink()
        try:
            os.rmdir(old)
        except OSError:
            kept = self.temp_path(KEPT_SUFFIX)
            with contextlib.suppress(OSError):
                os.rename(old, kept)
                old = kept
            self.notes.append(
                f"the replaced {self.out} held files clipcli did not write; kept at {old}"
            )


def _is_real_directory(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink()


def _is_empty_directory(path: Path) -> bool:
    if not _is_real_directory(path):
        return False
    with os.scandir(path) as entries:
        return next(entries, None) is None


def _unexpected_entries(directory: Path, expected: frozenset[str]) -> list[str]:
    """Entries (relative paths, at any depth) that clipcli would not write into this model
    directory: anything not in `expected`, and symlinks, FIFOs and the like."""
    strangers = []
    pending = [""]
    while pending:
        relative = pending.pop()
        with os.scandir(directory / relative) as entries:
            for entry in entries:
                name = f"{relative}/{entry.name}" if relative else entry.name
                if name not in expected:
                    strangers.append(name)
                elif entry.is_dir(follow_symlinks=False):
                    pending.append(name)
                elif not entry.is_file(follow_symlinks=False):
                    strangers.append(name)
    return sorted(strangers)


def _translated(exc: BaseException, out: Path) -> BaseException:
    if isinstance(exc, ClipcliError):
        return exc
    if isinstance(exc, KeyboardInterrupt):
        return interrupts.interrupted(signal.SIGINT)
    if isinstance(exc, OSError):
        reason = "disk full" if exc.errno == errno.ENOSPC else (exc.strerror or str(exc))
        return WriteError(f"{out}: writing failed: {reason}; no output written")
    return exc


# ---------------------------------------------------------------- stale temps of dead runs


def temp_prefix(out: Path) -> str:
    """`.<OUT name>.`, with a long name cut (by bytes) and a hash of the whole name added,
    so that temp names fit NAME_MAX and two long OUT names never share a prefix."""
    encoded = os.fsencode(out.name)
    if len(encoded) <= _NAME_ROOM:
        return f".{out.name}."
    digest = hashlib.sha256(encoded).hexdigest()[:12]
    cut = encoded[:_NAME_ROOM].decode("utf-8", "ignore")  # never half a character
    return f".{cut}~{digest}."


def _hold_lock(directory: Path) -> int:
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


# ---------------------------------------------------------------- choosing the target


def choose_target(
    out_text: str | os.PathLike[str], *, input_is_directory: bool, force: bool, durable: bool
) -> Target:
    """File or directory, from OUT's text: a known extension is a file; a trailing slash,
    or a model directory IN with an extensionless OUT, is a model directory. A single-file
    IN gets a directory OUT only when asked (trailing slash, or an existing empty one)."""
    text = os.fspath(out_text)
    if text == "-":
        raise UsageError("OUT '-': writing to standard output is not supported; name a file")
    out = Path(text)
    asks_directory = text.endswith(("/", os.sep))
    if format_from_extension(out) is not None and not asks_directory:
        return FileTarget(out, force=force, durable=durable)
    if asks_directory or input_is_directory or _is_empty_directory(out):
        return DirectoryTarget(out, force=force, durable=durable)
    if _is_real_directory(out):
        raise Refused(
            f"{out}: is a directory; name the file to write inside it (e.g. "
            f"{out / 'clipped.safetensors'}), or give an empty directory or end OUT with / "
            "for a one-file model directory"
        )
    raise UsageError(
        f"{out}: unknown output extension; use .npz, .safetensors, .h5 or .hdf5, "
        "or end OUT with / to write a model directory"
    )
