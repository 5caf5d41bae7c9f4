"""What OUT and cleanup must stay clear of: the input's files and folders, by path and by
inode, and the mount points a removal must not enter."""

from __future__ import annotations

import contextlib
import os
import re
import stat
from collections.abc import Iterable, Iterator
from pathlib import Path


def is_inside(path: Path, root: Path) -> bool:
    return path == root or path.is_relative_to(root)


def real(path: Path) -> Path:
    """The real path: symlinks resolved, including the last component."""
    return Path(os.path.realpath(path))


def real_parent(path: Path) -> Path:
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
        self.root = real(root)
        self.root_is_directory = self.root.is_dir()
        self.files = [real(f) for f in files]
        self.inodes = {identity for p in [self.root, *self.files] if (identity := _inode(p))}
        self.root_inode = _inode(self.root)
        self.file_ancestors = [set(_ancestor_inodes(f)) for f in [self.root, *self.files]]
        # Everything the input's paths pass through, as given and through every link: what
        # cleanup (clipcli.output.fsops) may neither remove nor move.
        self.reached = frozenset(resolution_inodes([root, *files]))
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

    def folder_modes(self, relative_paths: Iterable[str]) -> dict[str, int]:
        """Permission bits of the input directory's folders among these relative paths
        (an output directory's names), for its copies; links are no folders."""
        modes: dict[str, int] = {}
        if not self.root_is_directory:
            return modes
        for relative in relative_paths:
            with contextlib.suppress(OSError):
                info = os.lstat(self.root / relative)
                if stat.S_ISDIR(info.st_mode):
                    modes[relative] = stat.S_IMODE(info.st_mode)
        return modes

    def overlap(self, out: Path) -> str | None:
        """Why writing OUT would touch the input, or None."""
        for candidate in {real_parent(out), real(out)}:
            if candidate == self.root or any(candidate == f for f in self.files):
                return "is the input"
            if self.root_is_directory and is_inside(candidate, self.root):
                return "is inside the input directory"
            if is_inside(self.root, candidate) or any(is_inside(f, candidate) for f in self.files):
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

    def overlap_at(self, parent: int, name: str) -> str | None:
        """Why writing the entry `name` in the directory open as `parent` would touch the
        input, or None: `overlap`'s inode rules judged on the opened directory, whose
        ancestors are reached by '..' from the descriptor, so that a folder on OUT's path
        renamed or swapped for a link since OUT was named changes nothing."""
        above = set(ancestor_inodes_at(parent))
        if self.root_is_directory and self.root_inode in above:
            return "is inside the input directory"
        for follow in (False, True):
            try:
                info = os.stat(name, dir_fd=parent, follow_symlinks=follow)
            except OSError:
                continue
            identity = (info.st_dev, info.st_ino)
            if identity in self.inodes:
                return "is the input (a link to it)"
            if any(identity in up for up in self.file_ancestors):
                return "contains the input"
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


def ancestor_inodes_at(directory: int) -> Iterator[tuple[int, int]]:
    """(device, inode) of the directory open as `directory` and of every directory above
    it, found by opening '..' from each descriptor, as the kernel walks up (a mount's root
    leads to the folder it is mounted on); the walk ends at the root ('..' of the root is
    the root), at a directory already seen, or where '..' cannot be opened."""
    info = os.fstat(directory)
    seen = {(info.st_dev, info.st_ino)}
    yield info.st_dev, info.st_ino
    current = directory
    try:
        while True:
            try:
                above = os.open("..", _PATH_FLAGS, dir_fd=current)
            except OSError:
                return
            if current != directory:
                os.close(current)
            current = above
            info = os.fstat(current)
            identity = (info.st_dev, info.st_ino)
            if identity in seen:
                return
            seen.add(identity)
            yield identity
    finally:
        if current != directory:
            os.close(current)


# A descriptor only to look up names and fstat: no read permission needed.
_PATH_FLAGS = getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY | os.O_CLOEXEC

_MAX_LINKS = 40  # the kernel's own limit on links followed in one lookup (ELOOP)


def resolution_inodes(paths: Iterable[Path]) -> set[tuple[int, int]]:
    """(device, inode) of every entry the kernel passes through to reach each path: each
    directory from the root down, each symlink on the way (itself, then the entries its
    target passes through) and the entry reached. Entries that do not exist end a walk.
    A folder shared by many files (a model's side files) is walked once."""
    found: set[tuple[int, int]] = set()
    folders: dict[str, str | None] = {}  # as named -> real path (None: not reached)
    cwd = os.getcwd()  # the real cwd: its components are walked too
    for path in paths:
        folder, name = os.path.split(os.path.join(cwd, os.fspath(path)))
        if folder not in folders:
            folders[folder] = _walk("/", folder, found, [_MAX_LINKS])
        real_folder = folders[folder]
        if real_folder is not None and name:
            _walk(real_folder, name, found, [_MAX_LINKS])
    return found


def _walk(base: str, text: str, found: set[tuple[int, int]], links_left: list[int]) -> str | None:
    """Resolve `text` from the real directory `base` as the kernel does, lstat-ing every
    component into `found`; the real path reached, or None where the walk stopped."""
    current = "/" if text.startswith("/") else base
    with contextlib.suppress(OSError):
        info = os.lstat(current)
        found.add((info.st_dev, info.st_ino))
    for part in text.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            current = os.path.dirname(current)  # current is real, so this is its parent
            continue
        candidate = os.path.join(current, part)
        try:
            info = os.lstat(candidate)
        except OSError:
            return None
        found.add((info.st_dev, info.st_ino))
        if not stat.S_ISLNK(info.st_mode):
            current = candidate
            continue
        links_left[0] -= 1
        if links_left[0] < 0:
            return None
        try:
            target = os.readlink(candidate)
        except OSError:
            return None
        reached = _walk(current, target, found, links_left)
        if reached is None:
            return None
        current = reached
    return current


# ---------------------------------------------------------------- mount points cleanup must avoid

# mountinfo writes space, tab, newline and backslash in a path as three octal digits
_MOUNTINFO_ESCAPE = re.compile(rb"\\([0-7]{3})")


def mount_points() -> list[str] | None:
    """Every mount point of this process's mount namespace, as /proc/self/mountinfo lists
    them (its fifth field, escapes undone), relative to this process's root; None where
    it cannot be read (no /proc)."""
    try:
        with open("/proc/self/mountinfo", "rb") as handle:
            listed = handle.read()
    except OSError:
        return None
    points = []
    for line in listed.splitlines():
        fields = line.split(b" ")
        if len(fields) > 4:
            unescaped = _MOUNTINFO_ESCAPE.sub(lambda m: bytes([int(m[1], 8) & 0xFF]), fields[4])
            points.append(os.fsdecode(unescaped))
    return points


def holds_a_mount(parent: int, name: str) -> bool:
    """Whether a file system is mounted at the entry `name` of the directory open as
    `parent`, or anywhere below it. A bind mount of a folder of the same file system has
    the same device number as its surroundings, so only the kernel's list of mount points
    shows it. Where that list cannot be read (no /proc), False: the removal walks then
    rely on their own device check (os.path.ismount's test), which sees other file
    systems. Where the directory's own path cannot be known, True: leave it alone."""
    points = mount_points()
    if points is None:
        return False
    try:
        where = os.readlink(f"/proc/self/fd/{parent}")
    except OSError:
        return True
    if not where.startswith("/") or where.endswith(" (deleted)"):
        return True  # unreachable from our root, or removed: no path to compare
    entry = os.path.join(where, name) if name not in ("", ".") else where
    inside = entry.rstrip("/") + "/"
    return any(point == entry or point.startswith(inside) for point in points)
