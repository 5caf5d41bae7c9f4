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
  Signals are recorded while staging (clipcli.system.interrupts) and acted on between chunks, and
  once more just before the rename; cleanup is never cut short by a second signal.
- No-clobber without --force: the rename is renameat2(RENAME_NOREPLACE) (for a directory
  without it: mkdir + rename over the empty directory), so something that appears at OUT
  during the run is left alone and the run exits 2.
- A --force directory swap is renameat2(RENAME_EXCHANGE): OUT is never absent. Where the
  filesystem lacks it, two renames, and the aside copy keeps a name the next run restores.
- Temp names are `.<OUT name>.<pid>-<random>.clipcli-tmp` (and `.clipcli-old` for an
  aside copy). SIGKILL cannot be caught, so the next run to the same OUT removes such
  entries of dead processes of the same user (and puts a stranded aside copy back: only
  a real directory, for a directory OUT; then the run stops, exit 2, OUT being back).
- OUT's directory is opened once, when OUT is checked, and never looked up by name again:
  the sweep, the work directory, the writer's files (through /proc/self/fd where there is
  one), the commit and the --force swap all act relative to that descriptor, and the
  input footprint is checked against it again just before the commit. A folder on OUT's
  path renamed or swapped for a link meanwhile (into IN's folder, say) is not followed:
  OUT lands in the directory that was checked.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import stat
from collections.abc import Iterable, Iterator
from pathlib import Path

from clipcli.errors import ClipcliError, UsageError, WriteError
from clipcli.formats import registry
from clipcli.formats.base import Writer
from clipcli.formats.opening import has_extension, writer_class
from clipcli.output.fsops import (
    ASIDE_SUFFIX,
    KEPT_SUFFIX,
    TEMP_SUFFIX,
    Keep,
    StaleTempHoldsInput,
    clear_directory,
    exchange,
    fsync_path,
    fsync_tree,
    hold_lock,
    remove_entry_at,
    remove_stale_temps,
    remove_tree,
    rename_noreplace,
    temp_prefix,
)
from clipcli.system import interrupts
from clipcli.system.footprint import InputFootprint
from clipcli.system.inputs import fd_path


class Refused(UsageError):
    """OUT cannot be written as asked (exit 2); nothing was touched."""


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# What `cp` (without -p) keeps of a source's mode: a file never its setuid, setgid or
# sticky bit (as root, cp of a 6755 file gives 0755), a directory (`cp -r`) its sticky bit
# but never setuid or setgid, which a new directory only inherits from a setgid parent.
FILE_PERMISSIONS = 0o777
DIRECTORY_PERMISSIONS = 0o1777
# What writing new content into an existing file clears (the kernel's rule for a writer
# without CAP_FSETID, i.e. `cp` over it as an ordinary user): setuid and setgid.
SET_ID_BITS = stat.S_ISUID | stat.S_ISGID


# ---------------------------------------------------------------- targets


# Enough to empty a staged model directory (a descriptor for each folder open on the way
# down, and one for each listing) when the run itself ran out of them.
_CLEANUP_DESCRIPTORS = 4


def _close_all(descriptors: list[int]) -> None:
    while descriptors:
        os.close(descriptors.pop())


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
        self.occupied = False  # check() found an entry at OUT that the commit would replace
        self._mode = 0o644
        self._file_modes: dict[str, int] = {}
        self._folder_modes: dict[str, int] = {}
        self._default_file_mode = 0o666
        self._mode_is_kept = False  # a replaced directory's own mode, setgid bit and all
        self._keep: Keep = frozenset()  # what the input resolves to: no cleanup touches it
        self._footprint: InputFootprint | None = None
        # OUT's directory, opened by check(): every later step is relative to it, so that
        # a folder on OUT's path swapped after the check is never followed.
        self._parent_fd = -1
        self._parent_path = self.parent  # a name for it that does not re-resolve OUT's path
        self._work_fd = -1  # the run's work directory while staged (holds its flock)
        self.notes: list[str] = []  # said after a successful commit

    def __del__(self) -> None:  # a check that no staging followed (a refusal, a dry run)
        with contextlib.suppress(Exception):
            self.release()

    def release(self) -> None:
        """Close OUT's opened directory; stage() does so when it ends."""
        if self._parent_fd >= 0:
            os.close(self._parent_fd)
            self._parent_fd = -1
            self._parent_path = self.parent

    def _open_parent(self) -> int:
        """Open OUT's directory (its path followed as given, once) and keep it open."""
        self.release()
        try:
            fd = _open_directory(self.parent)
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ENOTDIR):
                raise WriteError(f"{self.out}: directory {self.parent} does not exist") from None
            raise WriteError(
                f"{self.out}: cannot open the directory {self.parent}: {exc.strerror}"
            ) from None
        self._parent_fd = fd
        self._parent_path = _path_of(fd, self.parent)
        return fd

    def _in_parent(self, name: str) -> Path:
        """A path to `name` in OUT's opened directory, for steps that need a path."""
        return self._parent_path / name

    def writer_class(self) -> type[Writer]:
        """The format's writer for this target: by OUT's extension, or the model-directory
        writer."""
        return writer_class(self.out, self.is_directory)

    # -- checks, before any data is read

    def check(self, footprint: InputFootprint, expected_names: Iterable[str] = ()) -> None:
        """Refuse (exit 2) or fail (exit 5) before anything is read or written."""
        out = self.out
        if out.name in ("", ".", ".."):
            raise Refused(f"{out}: name the file or directory to write, not '.' or '..'")
        problem = footprint.overlap(out)
        if problem is not None:
            raise Refused(f"{out}: output {problem}; choose an OUT outside the input")
        self._keep = footprint.reached
        self._footprint = footprint
        parent = self._open_parent()
        try:
            self._check_opened(footprint, parent, frozenset(expected_names))
        except BaseException:
            self.release()
            raise

    def _check_opened(
        self, footprint: InputFootprint, parent: int, expected_names: frozenset[str]
    ) -> None:
        """check() on OUT's opened directory: what that directory is, not what its path
        named a moment ago, decides."""
        out = self.out
        self._refuse_overlap(footprint, parent)
        self._mode = self._new_mode(footprint)
        try:
            info = os.stat(out.name, dir_fd=parent, follow_symlinks=False)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise WriteError(f"{out}: cannot check the output path: {exc.strerror}") from None
        existing_dir = stat.S_ISDIR(info.st_mode)
        at_out = self._in_parent(out.name)
        if existing_dir and self.is_directory and _is_empty_directory(at_out, out):
            self._replace_empty_directory = True
            self._mode = stat.S_IMODE(info.st_mode)
            self._mode_is_kept = True
            return
        self.occupied = True
        if not self.force:
            raise Refused(f"{out}: already exists; pass --force to replace it")
        if existing_dir:
            self._check_replaceable_directory(expected_names)
        elif not self.is_directory and stat.S_ISREG(info.st_mode):
            # cp keeps a replaced file's mode, but new content drops setuid and setgid
            self._mode = stat.S_IMODE(info.st_mode) & ~SET_ID_BITS

    def _refuse_overlap(self, footprint: InputFootprint, parent: int) -> None:
        """The input footprint judged on OUT's opened directory (exit 2)."""
        problem = footprint.overlap_at(parent, self.out.name)
        if problem is not None:
            raise Refused(f"{self.out}: output {problem}; choose an OUT outside the input")

    def _check_replaceable_directory(self, expected: frozenset[str]) -> None:  # noqa: ARG002
        raise Refused(
            f"{self.out}: is a directory; --force replaces a file, not a directory "
            f"(name the file to write, e.g. {self.out / 'model.safetensors'})"
        )

    def _new_mode(self, footprint: InputFootprint) -> int:
        """cp's rule: a new OUT gets IN's permission bits, masked by the umask, without
        setuid, setgid or sticky (for a model directory IN joined into one file: its first
        file's)."""
        mode = footprint.root_mode
        if footprint.root_is_directory:
            mode = next(iter(footprint.modes.values()), 0o666)
        return mode & FILE_PERMISSIONS & ~_umask()

    # -- staging and the commit

    def temp_name(self, suffix: str = TEMP_SUFFIX) -> str:
        """A new temp entry's name in OUT's directory."""
        # os.urandom, as secrets.token_hex does, without importing secrets (hmac, hashlib,
        # random: ~4 ms of start-up for every command that imports this module)
        token = f"{os.getpid()}-{os.urandom(4).hex()}"
        return f"{temp_prefix(self.out)}{token}{suffix}"

    @contextlib.contextmanager
    def stage(self) -> Iterator[Path]:
        """Yield a new temp entry beside OUT; when the block ends normally, commit it as OUT.

        Every run works in a private directory beside OUT (`.<OUT>.<pid>-<hex>.clipcli-tmp`)
        on which it holds an flock while it lives: a later run removes such a directory
        only when no process has its pid and the lock can be taken (the directory exists
        a moment before its lock; a reused pid only leaves it for a later run). OUT, a
        file or a directory, is built inside it.
        Signals are deferred for the whole block. Any failure removes the work directory
        and leaves OUT as it was: OSError becomes WriteError (exit 5), a signal
        Interrupted."""
        with interrupts.deferred(writes=True):
            parent = self._parent_fd if self._parent_fd >= 0 else self._open_parent()
            try:
                yield from self._stage_at(parent)
            finally:
                self.release()

    def _stage_at(self, parent: int) -> Iterator[Path]:
        """stage() in OUT's opened directory."""
        try:
            put_back = remove_stale_temps(
                self.out, self._keep, parent=parent, out_is_directory=self.is_directory
            )
        except StaleTempHoldsInput as exc:
            raise Refused(
                f"{self.out}: the input lies in {exc.path}, which a killed clipcli run "
                "left for this OUT and which cleanup would remove; move the input out of "
                "it or choose another OUT"
            ) from None
        if put_back:  # OUT is there again, unlike when it was checked: check it anew
            raise Refused(
                f"{self.out}: a killed clipcli run had moved it aside; it is back in place "
                "and nothing was written; run again (with --force to replace it)"
            )
        work = self.temp_name()
        try:
            os.mkdir(work, 0o700, dir_fd=parent)
        except OSError as exc:
            raise WriteError(
                f"{self.out}: cannot create a directory in {self.parent}: {exc.strerror}"
            ) from None
        try:
            lock = hold_lock(work, parent=parent)
        except OSError as exc:  # out of descriptors (EMFILE), say
            remove_tree(Path(work), self._keep, parent=parent)
            raise _translated(exc, self.out) from None
        self._work_fd = lock
        # Descriptors held back for the cleanup below: removing a tree needs some, and the
        # failure may be that the run used up the rest (EMFILE).
        spares: list[int] = []
        try:
            while len(spares) < _CLEANUP_DESCRIPTORS:
                spares.append(os.dup(lock))
            # The writer gets a path through the work directory's descriptor: a name
            # on OUT's path swapped meanwhile cannot send its files elsewhere.
            staged = self._staged_in(_path_of(lock, self._in_parent(work)))
            yield staged
            interrupts.check()
            self._commit(staged)
            # Past the commit point nothing may fail the run or remove anything: a work
            # directory left (non-empty) is a dead run's to the next sweep.
            with contextlib.suppress(OSError):
                os.rmdir(work, dir_fd=parent)
        except BaseException as exc:
            # Emptied through the lock's descriptor, which is then freed: removing the
            # tree needs descriptors of its own, and the failure may be that there are
            # none left (EMFILE). OUT's staged file, or its folder while still empty,
            # goes without any; the empty work directory then needs none either.
            _close_all(spares)
            remove_entry_at(lock, self.out.name, self._keep)
            clear_directory(lock, self._keep)
            os.close(lock)
            lock = self._work_fd = -1
            remove_tree(Path(work), self._keep, parent=parent)
            raise _translated(exc, self.out) from None
        finally:
            _close_all(spares)
            if lock >= 0:
                os.close(lock)
                self._work_fd = -1

    def _staged_in(self, workdir: Path) -> Path:
        """The path the writer fills: a file inside the work directory."""
        return workdir / self.out.name

    def _commit(self, staged: Path) -> None:
        if self.durable:
            self._sync(staged)
        interrupts.check()  # the last moment at which a signal means "no output"
        self._set_mode(staged)
        if self._footprint is not None:  # OUT's directory may have moved since the check
            self._refuse_overlap(self._footprint, self._parent_fd)
        self._place(staged)  # the commit point
        interrupts.settle()  # OUT is whole: a signal from here on is moot
        if self.durable:
            with contextlib.suppress(OSError):
                os.fsync(self._parent_fd)

    def _sync(self, staged: Path) -> None:
        fsync_path(staged)

    def _set_mode(self, staged: Path) -> None:
        os.chmod(staged, self._mode)

    def _place(self, staged: Path) -> None:
        """The commit: the staged entry (in the work directory) renamed to OUT (in OUT's
        directory), both by their opened descriptors."""
        out = self.out
        if not self.force:
            try:
                rename_noreplace(
                    staged.name,
                    out.name,
                    self.is_directory,
                    src_dir=self._work_fd,
                    dst_dir=self._parent_fd,
                )
            except FileExistsError:
                raise Refused(
                    f"{out}: appeared while clipcli was writing; left alone, no output written"
                ) from None
            return
        try:
            os.replace(staged.name, out.name, src_dir_fd=self._work_fd, dst_dir_fd=self._parent_fd)
        except IsADirectoryError:
            raise Refused(
                f"{out}: became a directory while clipcli was writing; left alone, "
                "no output written"
            ) from None


class FileTarget(Target):
    """OUT is one checkpoint file; its extension names the format."""


class NewFileTarget(FileTarget):
    """A file that is no copy of the input (norms --plot): a new one gets 0o666 less the
    umask, as any file a program creates; a replaced one keeps its own mode, less setuid
    and setgid, as for FileTarget."""

    def _new_mode(self, footprint: InputFootprint) -> int:  # noqa: ARG002  (IN decides nothing)
        return 0o666 & ~_umask()


class DirectoryTarget(Target):
    """OUT is a model directory: shards, index and the input directory's other files."""

    is_directory = True
    kind = "directory"

    def check(self, footprint: InputFootprint, expected_names: Iterable[str] = ()) -> None:
        expected_names = frozenset(expected_names)
        super().check(footprint, expected_names)
        self._folder_modes = footprint.folder_modes(expected_names)

    def _new_mode(self, footprint: InputFootprint) -> int:
        """cp -r's rule (the setgid bit a setgid parent gives is added when the directory
        is made); a single-file IN's directory gets mkdir's mode."""
        if footprint.root_is_directory:
            self._file_modes = dict(footprint.modes)
            return footprint.root_mode & DIRECTORY_PERMISSIONS & ~_umask()
        self._default_file_mode = footprint.root_mode  # the one file of a one-file model
        return 0o777 & ~_umask()

    def _check_replaceable_directory(self, expected: frozenset[str]) -> None:
        strangers = _unexpected_entries(self._in_parent(self.out.name), expected, self.out)
        if strangers:
            shown = ", ".join(repr(name) for name in strangers[:5])
            more = f" and {len(strangers) - 5} more" if len(strangers) > 5 else ""
            raise Refused(
                f"{self.out}: holds {shown}{more}, which clipcli would not write there; "
                "--force replaces only a directory that holds nothing but clipcli's own "
                "output. Choose a new OUT"
            )
        self._mode = stat.S_IMODE(os.stat(self.out.name, dir_fd=self._parent_fd).st_mode)
        self._mode_is_kept = True
        self._expected = expected

    _expected: frozenset[str] = frozenset()

    def _staged_in(self, workdir: Path) -> Path:
        """OUT's directory inside the work directory, made with its final permission bits
        (and owner rwx, to be filled) as `mkdir` and `cp -r` make it: in a setgid parent it
        inherits the setgid bit, which a later chmod by a user outside the directory's
        group would silently drop. The private work directory hides it until the commit."""
        staged = workdir / self.out.name
        os.mkdir(staged, (self._mode | stat.S_IRWXU) & DIRECTORY_PERMISSIONS)
        return staged

    def _sync(self, staged: Path) -> None:
        fsync_tree(staged)

    def _commit(self, staged: Path) -> None:
        # cp -r: each file keeps its source's permission bits (masked by the umask, never
        # setuid, setgid or sticky), so a private shard does not become a world-readable
        # one inside the new directory; each folder its source folder's, deepest first.
        mask = _umask()
        for folder, _, files in os.walk(staged, topdown=False):
            for name in files:
                path = Path(folder, name)
                relative = path.relative_to(staged).as_posix()
                mode = self._file_modes.get(relative, self._default_file_mode)
                os.chmod(path, mode & FILE_PERMISSIONS & ~mask)
            relative = Path(folder).relative_to(staged).as_posix()
            if relative != ".":
                mode = self._folder_modes.get(relative, 0o777)
                _chmod_directory(Path(folder), mode & DIRECTORY_PERMISSIONS & ~mask)
        super()._commit(staged)

    def _set_mode(self, staged: Path) -> None:
        if self._mode_is_kept:
            os.chmod(staged, self._mode)
        else:
            _chmod_directory(staged, self._mode)

    def _place(self, staged: Path) -> None:
        out = self.out
        work, parent = self._work_fd, self._parent_fd
        if self._replace_empty_directory and not self.force:
            try:  # replaces an empty directory, and nothing else
                os.rename(staged.name, out.name, src_dir_fd=work, dst_dir_fd=parent)
            except OSError as exc:
                if exc.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                    raise Refused(
                        f"{out}: changed while clipcli was writing; left alone, no output written"
                    ) from None
                raise
            return
        if not self.force or not _lexists_at(parent, out.name):
            super()._place(staged)
            return
        self._swap(staged)

    def _swap(self, staged: Path) -> None:
        """Replace an existing OUT (--force) without a moment where OUT is absent."""
        out = self.out
        work, parent = self._work_fd, self._parent_fd
        at_out = self._in_parent(out.name)
        if _is_real_directory(at_out) and _unexpected_entries(at_out, self._expected, out):
            raise Refused(
                f"{out}: changed while clipcli was writing; left alone, no output written"
            )
        if exchange(staged.name, out.name, a_dir=work, b_dir=parent):
            old = staged  # the old OUT now sits at the staged name
            if _is_real_directory(old) and _unexpected_entries(old, self._expected, out):
                # something arrived in the old OUT meanwhile: undo
                exchange(staged.name, out.name, a_dir=work, b_dir=parent)
                raise Refused(
                    f"{out}: changed while clipcli was writing; left alone, no output written"
                )
            self._remove_replaced(old)
            return
        aside = self.temp_name(ASIDE_SUFFIX)
        # signals are deferred, so nothing stops between the two
        os.rename(out.name, aside, src_dir_fd=parent, dst_dir_fd=parent)
        try:
            os.rename(staged.name, out.name, src_dir_fd=work, dst_dir_fd=parent)
        except OSError:
            os.rename(aside, out.name, src_dir_fd=parent, dst_dir_fd=parent)
            raise
        self._remove_replaced(self._in_parent(aside))

    def _remove_replaced(self, old: Path) -> None:
        """Delete the replaced OUT by the names clipcli would have written, deepest first,
        never a name it does not know: a file someone put there after the last check
        survives, and the old directory is then kept (named *.clipcli-kept) and reported."""
        if not _is_real_directory(old):
            remove_tree(old, self._keep)
            return
        expected = self._expected

        def known(relative: str, info: os.stat_result) -> bool:
            return relative in expected and (
                stat.S_ISDIR(info.st_mode) or stat.S_ISREG(info.st_mode)
            )

        # Relative to the opened old directory, links never followed: a folder swapped for
        # a link meanwhile is not entered, a file swapped for one loses only the link.
        with contextlib.suppress(OSError):
            parent = os.open(old.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                remove_entry_at(parent, old.name, self._keep, known)
            finally:
                os.close(parent)
        if not os.path.lexists(old):
            return
        kept = self.temp_name(KEPT_SUFFIX)
        with contextlib.suppress(OSError):
            os.rename(old, self._in_parent(kept))
            self.notes.append(
                f"the replaced {self.out} held files clipcli did not write; "
                f"kept at {self.parent / kept}"
            )


def _chmod_directory(path: Path, mode: int) -> None:
    """Set a directory's permission bits, keeping the setgid bit that mkdir gave it in a
    setgid parent; no chmod at all where nothing changes (a chmod by a user outside the
    directory's group drops setgid)."""
    current = stat.S_IMODE(os.lstat(path).st_mode)
    wanted = mode | (current & stat.S_ISGID)
    if wanted != current:
        os.chmod(path, wanted)


def _open_directory(path: Path) -> int:
    """A descriptor of the directory at `path`: readable where allowed (to list and fsync
    it), else O_PATH (enough to create, rename and remove names in it: a directory with
    write and search permission but no read permission)."""
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except PermissionError:
        return os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)


def _path_of(fd: int, by_name: Path) -> Path:
    """A path that reaches exactly the directory open as `fd` (/proc/self/fd), or, where
    there is none (no /proc), its name as a fallback."""
    reopened = fd_path(fd)
    return by_name if reopened is None else Path(reopened)


def _lexists_at(directory: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=directory, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def _is_real_directory(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink()


def _is_empty_directory(path: Path, shown: Path | None = None) -> bool:
    """Whether `path` is a real, empty directory; `shown` names it in messages (`path`
    may be a /proc/self/fd path)."""
    if not _is_real_directory(path):
        return False
    try:
        with os.scandir(path) as entries:
            return next(entries, None) is None
    except OSError as exc:
        where = shown or path
        raise WriteError(f"{where}: cannot check the output path: {exc.strerror}") from None


def _unexpected_entries(
    directory: Path, expected: frozenset[str], shown: Path | None = None
) -> list[str]:
    """Entries (relative paths, at any depth) that clipcli would not write into this model
    directory: anything not in `expected`, and symlinks, FIFOs and the like. `shown` is
    the directory's name for messages (`directory` may be a /proc/self/fd path)."""
    strangers = []
    pending = [""]
    while pending:
        relative = pending.pop()
        try:
            with os.scandir(directory / relative) as entries:
                for entry in entries:
                    name = f"{relative}/{entry.name}" if relative else entry.name
                    if name not in expected:
                        strangers.append(name)
                    elif entry.is_dir(follow_symlinks=False):
                        pending.append(name)
                    elif not entry.is_file(follow_symlinks=False):
                        strangers.append(name)
        except OSError as exc:
            where = (shown or directory) / relative
            raise WriteError(f"{where}: cannot check the output path: {exc.strerror}") from None
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


# ---------------------------------------------------------------- choosing the target


def choose_target(
    out_text: str | os.PathLike[str], *, input_is_directory: bool, force: bool, durable: bool
) -> Target:
    """File or directory, from OUT's text: a known extension is a file; a trailing slash,
    or a model directory IN with an OUT that has no extension (or is a directory already),
    is a model directory. A single-file IN gets a directory OUT only when asked (trailing
    slash, or an existing empty one). An unknown extension is refused: `o.pt` or `b.gguf`
    is a file the user expects, not a directory of that name."""
    text = os.fspath(out_text)
    if text == "-":
        raise UsageError("OUT '-': writing to standard output is not supported; name a file")
    out = Path(text)
    asks_directory = text.endswith(("/", os.sep))
    if registry.output_format(out.name) is not None and not asks_directory:
        return FileTarget(out, force=force, durable=durable)
    if asks_directory or _is_empty_directory(out):
        return DirectoryTarget(out, force=force, durable=durable)
    if input_is_directory and (not has_extension(out) or _is_real_directory(out)):
        return DirectoryTarget(out, force=force, durable=durable)
    if _is_real_directory(out):
        raise Refused(
            f"{out}: is a directory; name the file to write inside it (e.g. "
            f"{out / 'clipped.safetensors'}), or give an empty directory or end OUT with / "
            "for a one-file model directory"
        )
    raise UsageError(
        f"{out}: unknown output extension; use {registry.accepted_extensions()}, "
        "or end OUT with / to write a model directory"
    )
