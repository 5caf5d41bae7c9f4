"""Inputs the user may not read, run as an ordinary user would run them.

The tests run as root, for whom every file is readable; here clipcli runs with every
capability dropped (util-linux `setpriv`), so that file modes apply to it. An unreadable
input is exit 3 with the reason, whichever parser took the command line: the quick parser
(clipcli/cli/quick_args.py) or Typer, which is reached here through `-fjson`, a bundled short
option the quick parser leaves to it. (Typer's own readability check, a usage error, is
turned off: it judged inputs before the readers could say why, and judged --plot FILE, an
output, by whether it could be read.)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from clipcli.cli import quick_args

SETPRIV = shutil.which("setpriv")
pytestmark = pytest.mark.skipif(
    SETPRIV is None or os.geteuid() != 0, reason="needs root and util-linux setpriv"
)


def run_unprivileged(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    assert SETPRIV is not None
    drop = [SETPRIV, "--inh-caps=-all", "--bounding-set=-all"]
    return subprocess.run(
        [*drop, sys.executable, "-m", "clipcli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, COLUMNS="120"),
    )


@pytest.fixture
def place(tmp_path: Path) -> Path:
    tmp_path.chmod(0o755)
    tensors = {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}
    save_file(tensors, str(tmp_path / "m.safetensors"))
    save_file(tensors, str(tmp_path / "locked.safetensors"))
    (tmp_path / "locked.safetensors").chmod(0o000)
    (tmp_path / "shut").mkdir()
    save_file(tensors, str(tmp_path / "shut" / "model.safetensors"))
    (tmp_path / "shut").chmod(0o311)  # may be entered, not listed
    (tmp_path / "closed").mkdir()
    save_file(tensors, str(tmp_path / "closed" / "a.safetensors"))
    (tmp_path / "closed").chmod(0o644)  # may be listed, not entered
    return tmp_path


def test_the_process_really_cannot_read(place: Path) -> None:
    done = subprocess.run(
        [SETPRIV or "", "--inh-caps=-all", "--bounding-set=-all", "cat", "locked.safetensors"],
        cwd=place,
        capture_output=True,
    )
    assert done.returncode != 0  # else the tests below prove nothing


@pytest.mark.parametrize(
    ("args", "reason"),
    [
        (["ls", "locked.safetensors"], "locked.safetensors: cannot read: Permission denied"),
        (["norms", "locked.safetensors"], "locked.safetensors: cannot read: Permission denied"),
        (
            ["diff", "m.safetensors", "locked.safetensors"],
            "locked.safetensors: cannot read: Permission denied",
        ),
        (["ls", "shut"], "shut: cannot list the directory: Permission denied"),
        (["norms", "shut"], "shut: cannot list the directory: Permission denied"),
        (["ls", "closed"], "closed: cannot enter the directory: Permission denied"),
        (["ls", "closed/a.safetensors"], "closed/a.safetensors: cannot read: Permission denied"),
        (
            ["diff", "m.safetensors", "closed/a.safetensors"],
            "closed/a.safetensors: cannot read: Permission denied",
        ),
    ],
)
@pytest.mark.parametrize("parser", ["quick", "typer"])
def test_an_unreadable_input_is_exit_3_with_its_reason(
    place: Path, args: list[str], reason: str, parser: str
) -> None:
    line = [*args, "--format", "json"] if parser == "quick" else [*args, "-fjson"]
    assert (quick_args.parse(line) is not None) == (parser == "quick")
    done = run_unprivileged(line, place)
    assert (done.returncode, done.stdout, done.stderr) == (3, "", f"clipcli: error: {reason}\n")


@pytest.mark.parametrize("command", ["clip", "convert"])
def test_an_unreadable_in_writes_nothing(place: Path, command: str) -> None:
    mode = ["--global", "1"] if command == "clip" else []
    done = run_unprivileged([command, *mode, "locked.safetensors", "out.safetensors"], place)
    assert done.returncode == 3
    assert done.stderr == "clipcli: error: locked.safetensors: cannot read: Permission denied\n"
    assert sorted(p.name for p in place.iterdir()) == [
        "closed",
        "locked.safetensors",
        "m.safetensors",
        "shut",
    ]


def test_a_side_folder_that_cannot_be_entered_is_exit_3(place: Path) -> None:
    model = place / "model"
    model.mkdir()
    save_file({"w": np.ones(3, np.float32)}, str(model / "model.safetensors"))
    (model / "sub").mkdir()
    (model / "sub" / "notes.txt").write_text("x")
    (model / "sub").chmod(0o644)
    for args in (["ls", "model"], ["clip", "--global", "1", "model", "out/"]):
        done = run_unprivileged(args, place)
        assert (done.returncode, done.stdout) == (3, ""), done.stderr
        assert (
            done.stderr == "clipcli: error: model/sub/notes.txt: cannot read: Permission denied\n"
        )
    assert not (place / "out").exists()


def test_an_out_directory_that_cannot_be_listed_is_exit_5(place: Path) -> None:
    locked = place / "out" / "locked"
    locked.mkdir(parents=True)
    locked.chmod(0o300)  # may be entered and written, not listed
    done = run_unprivileged(["convert", "-q", "m.safetensors", "out/locked/"], place)
    assert (done.returncode, done.stdout) == (5, "")
    assert done.stderr == (
        "clipcli: error: out/locked: cannot check the output path: Permission denied\n"
    )


def test_plot_may_replace_a_file_it_cannot_read(place: Path) -> None:
    """--plot FILE is an output: with --force it is replaced, readable or not (Click used
    to refuse it as 'not readable'); without --force it is kept."""
    picture = place / "p.svg"
    picture.write_text("old")
    picture.chmod(0o200)
    kept = run_unprivileged(["norms", "m.safetensors", "--plot", "p.svg"], place)
    assert kept.returncode == 2
    assert "exists" in kept.stderr
    assert picture.read_text() == "old"
    pytest.importorskip("matplotlib")
    done = run_unprivileged(["norms", "m.safetensors", "--plot", "p.svg", "--force"], place)
    assert done.returncode == 0, done.stderr
    assert picture.read_text().startswith("<?xml")


def test_plot_with_a_home_that_cannot_be_written_says_nothing(place: Path) -> None:
    """A service account's $HOME may be read-only: matplotlib then logs that it made a
    temporary cache directory (several lines); stderr holds errors only."""
    pytest.importorskip("matplotlib")
    home = place / "home"
    home.mkdir()
    home.chmod(0o555)
    assert SETPRIV is not None
    done = subprocess.run(
        [SETPRIV, "--inh-caps=-all", "--bounding-set=-all", sys.executable, "-m", "clipcli"]
        + ["norms", "m.safetensors", "--plot", "p.png", "--format", "json"],
        cwd=place,
        capture_output=True,
        text=True,
        timeout=120,
        env={
            **{k: v for k, v in os.environ.items() if not k.startswith(("XDG_", "MPL"))},
            "HOME": str(home),
        },
    )
    assert (done.returncode, done.stderr) == (0, "")
    assert (place / "p.png").read_bytes().startswith(b"\x89PNG")
