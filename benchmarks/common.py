"""Constants and helpers every benchmark module shares: paths, sizes, how clipcli is run,
logging and human-readable sizes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
PY = sys.executable
MIB = 1 << 20
GIB = 1 << 30
SECTIONS = ("norms", "formats", "clip", "rss", "axes", "startup")
GEN_CHUNK = 8 << 20  # elements generated at a time: bounded memory for any tensor size


def clipcli_command() -> list[str]:
    """The installed console script next to this interpreter (what users run), else -m."""
    script = Path(PY).parent / "clipcli"
    if script.exists():
        return [str(script)]
    found = shutil.which("clipcli")
    return [found] if found else [PY, "-m", "clipcli"]


CLIPCLI = clipcli_command()


def human(n: int) -> str:
    for unit, size in (("GiB", GIB), ("MiB", MIB), ("KiB", 1024)):
        if n >= size:
            value = n / size
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.2f} {unit}"
    return f"{n} B"


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def compile_clipcli(pythonpath: str | None = None) -> bool:
    """Compile the clipcli package that `pythonpath` (else the installed one) imports to
    bytecode, as `pip install` does, before anything is timed. An editable install under
    PYTHONDONTWRITEBYTECODE=1 (this sandbox sets it) compiles every module it imports from
    source on every run: ~70 ms of a `clipcli norms` that an installed copy never pays,
    a quarter of a 1 GiB fp32 norms run on 2 cores. True when it compiled."""
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    code = (
        "import clipcli, compileall, os, sys; "
        "sys.exit(not compileall.compile_dir(os.path.dirname(clipcli.__file__), quiet=1))"
    )
    return subprocess.run([PY, "-c", code], env=env, capture_output=True).returncode == 0
