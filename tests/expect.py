"""Small assertions shared by the test modules (importable: tests/ is on sys.path)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path


def one_error_line(err: str) -> str:
    """The single `clipcli: error:` line that every failure prints, and nothing else."""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("clipcli: error: ")
    return lines[0]


def listing(directory: Path) -> list[str]:
    """Entry names, sorted: what a failed run must leave exactly as it found."""
    return sorted(p.name for p in directory.iterdir())


def tree(root: Path) -> dict[str, bytes | str]:
    """Every entry under root, links not followed: file bytes, link targets, folders (what
    a run must leave exactly as it found, compared whole)."""
    found: dict[str, bytes | str] = {}
    for folder, dirs, files in os.walk(root):
        for name in sorted([*dirs, *files]):
            path = Path(folder, name)
            key = str(path.relative_to(root))
            if path.is_symlink():
                found[key] = "-> " + os.readlink(path)
            elif path.is_dir():
                found[key] = "dir"
            else:
                found[key] = path.read_bytes()
    return found


# The repository, found from this file, so that tests pass from any working directory.
REPO_ROOT = Path(__file__).resolve().parent.parent
SAMPLE_DATA = REPO_ROOT / "sample_data"


def signalled_where_it_stops(script: str, args: list[str], signum: int) -> tuple[int, str]:
    """Run `python -c script *args`, which stops itself (SIGSTOP) at a known point; send it
    `signum` there, let it go on, and return its exit status and stderr."""
    child = subprocess.Popen(
        [sys.executable, "-c", script, *args],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        _, status = os.waitpid(child.pid, os.WUNTRACED)
        assert os.WIFSTOPPED(status), status
        os.kill(child.pid, signum)
        os.kill(child.pid, signal.SIGCONT)
        _, err = child.communicate(timeout=300)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    return child.returncode, err
