"""What OUT must stay clear of: the input's files and folders, by path and by inode."""

from __future__ import annotations

import contextlib
import os
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
