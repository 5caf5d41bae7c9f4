"""The peak RSS of a clipcli run, measured from outside: the command runs as the only
child of a small probe process, whose RUSAGE_CHILDREN maximum is that child's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

# Runs the command as its only child and prints that child's peak RSS (KiB) last.
_PEAK_PROBE = (
    "import resource, subprocess, sys\n"
    "done = subprocess.run(sys.argv[1:], stdin=subprocess.DEVNULL, capture_output=True,"
    " text=True)\n"
    "sys.stderr.write(done.stderr)\n"
    "print(done.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
)


def peak_rss(*args: str | Path) -> tuple[int, int, str]:
    """(exit code, peak RSS in bytes, stderr) of `python -m clipcli args` in a child."""
    probe = subprocess.run(
        [sys.executable, "-c", _PEAK_PROBE, sys.executable, "-m", "clipcli", *map(str, args)],
        capture_output=True,
        text=True,
        check=True,
    )
    code, kib = probe.stdout.split()
    return int(code), int(kib) * 1024, probe.stderr
