"""Small things a newcomer trips on (issue 12, item 6)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from expect import one_error_line
from handmade import write_safetensors

from clipcli import __version__
from clipcli.cli.entry import main


def test_version_through_main_and_as_a_program(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"clipcli {__version__}\n"
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; sys.argv[1:] = ['--version'];from clipcli.__main__ import run; run()",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert (done.returncode, done.stdout, done.stderr) == (0, f"clipcli {__version__}\n", "")


def test_version_loads_no_cli_module() -> None:
    """`clipcli --version` answers before typer, rich or numpy are imported."""
    code = (
        "import sys; sys.argv[1:] = ['--version']\n"
        "from clipcli.__main__ import run\n"
        "try:\n    run()\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in ('typer', 'rich', 'numpy', 'clipcli.cli.entry')"
        " if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.stdout.strip().endswith("[]"), done.stdout


@pytest.mark.parametrize(
    ("argv", "hint"),
    [
        (["clip"], "see 'clipcli clip --help'"),
        (["norms"], "see 'clipcli norms --help'"),
        (
            ["clip", "--norm", "1", "--axes", "0", "1", "in.safetensors", "out.safetensors"],
            "--axes takes one comma-separated list, e.g. --axes 0,1",
        ),
    ],
)
def test_usage_errors_say_what_to_do(
    argv: list[str], hint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    assert hint in one_error_line(capsys.readouterr().err)


def test_one_group_is_singular(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_safetensors(tmp_path / "m.safetensors", {"layers.0.w": np.ones(4, np.float32)})
    assert main(["norms", str(path), "--group-by", "layer"]) == 0
    out = capsys.readouterr().out
    assert "over 1 group\n" in out
    assert "over 1 groups" not in out


def test_diff_of_files_that_share_no_tensor_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    np.savez(tmp_path / "a.npz", x=np.ones(3))
    np.savez(tmp_path / "b.npz", y=np.ones(3))
    assert main(["diff", str(tmp_path / "a.npz"), str(tmp_path / "b.npz")]) == 0
    out = capsys.readouterr().out
    assert "A and B share no tensor to compare" in out
    assert "relative 0" not in out
