"""Small assertions shared by the test modules (importable: tests/ is on sys.path)."""

from __future__ import annotations

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


# The repository, found from this file, so that tests pass from any working directory.
REPO_ROOT = Path(__file__).resolve().parent.parent
SAMPLE_DATA = REPO_ROOT / "sample_data"
