"""Constants and helpers every benchmark module shares: paths, sizes, how clipcli is run,
logging and human-readable sizes."""

from __future__ import annotations

import shutil
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
