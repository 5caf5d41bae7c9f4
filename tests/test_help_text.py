"""--help offers what the commands accept and names things as the README does (issue 23,
item 12): `ls --sort` lists no `norm`, `convert` calls OUT '-' no "clipped copy", the
top-level help lists --version/-V, and usage lines say PATH, IN, OUT, A, B (not `{path}`).

Help is Click's own text: checked through main() and, for the choices, on the Click
parameters themselves.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import typer.main
from conftest import RunCli

from clipcli import __version__
from clipcli.cli import typer_app
from clipcli.cli.entry import main
from clipcli.cli.quick_args import COMMANDS
from clipcli.report import SortKey


def help_of(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    capsys.readouterr()
    assert main([*argv, "--help"]) == 0
    return capsys.readouterr().out


USAGE = {
    "ls": "Usage: clipcli ls [OPTIONS] PATH",
    "norms": "Usage: clipcli norms [OPTIONS] PATH",
    "clip": "Usage: clipcli clip [OPTIONS] IN OUT",
    "convert": "Usage: clipcli convert [OPTIONS] IN OUT",
    "diff": "Usage: clipcli diff [OPTIONS] A B",
}


@pytest.mark.parametrize("command", sorted(USAGE))
def test_usage_lines_name_the_arguments(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    text = help_of([command], capsys)
    assert text.splitlines()[0] == USAGE[command]
    assert "{" not in text.splitlines()[0]
    argument = USAGE[command].split()[-1]
    assert re.search(rf"^  {argument} ", text, re.MULTILINE), text  # the Arguments section


def test_every_command_is_covered() -> None:
    assert set(USAGE) == set(COMMANDS)


def test_ls_offers_only_the_orders_it_accepts(capsys: pytest.CaptureFixture[str]) -> None:
    text = help_of(["ls"], capsys)
    assert "--sort <file|name|size>" in text
    assert "norm|" not in text
    group = typer.main.get_command(typer_app.app)
    sort = next(p for p in group.commands["ls"].params if p.name == "sort")  # type: ignore[attr-defined]
    assert tuple(sort.type.choices) == tuple(k.value for k in SortKey if k is not SortKey.NORM)
    # norms still offers every order
    assert "--sort <file|name|norm|size>" in help_of(["norms"], capsys)


@pytest.mark.parametrize("command", ["clip", "convert"])
def test_out_dash_is_described_for_both_commands(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    text = " ".join(help_of([command], capsys).split())
    assert "clipped copy to standard output" not in text
    assert "'-' streams OUT to standard output as safetensors" in text


@pytest.mark.parametrize("spelling", ["--version", "-V"])
def test_version_is_listed_and_answers(spelling: str, capsys: pytest.CaptureFixture[str]) -> None:
    text = help_of([], capsys)
    assert "-V, --version" in text
    assert main([spelling]) == 0
    assert capsys.readouterr().out == f"clipcli {__version__}\n"
    # Through Typer too (the group's eager option), whatever follows it.
    assert main([spelling, "ls"]) == 0
    assert capsys.readouterr().out == f"clipcli {__version__}\n"


def test_dash_v_as_a_program_loads_no_cli_module() -> None:
    """`clipcli -V` answers as `--version` does, before typer, rich or numpy load."""
    code = (
        "import sys; sys.argv[1:] = ['-V']\n"
        "from clipcli.__main__ import run\n"
        "try:\n    run()\nexcept SystemExit as exc:\n    assert exc.code == 0\n"
        "print(sorted(m for m in ('typer', 'rich', 'numpy', 'clipcli.cli.entry')"
        " if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout == f"clipcli {__version__}\n[]\n"


@pytest.mark.parametrize("command", ["ls", "norms", "clip", "diff"])
def test_new_flags_are_in_the_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    text = help_of([command], capsys)
    assert "--json" in text
    assert "-q, --quiet" in text


@pytest.mark.parametrize("command", ["ls", "norms", "clip", "convert", "diff"])
def test_quiet_help_says_exactly_what_it_silences(run_main: RunCli, command: str) -> None:
    done = run_main(command, "--help")
    text = " ".join(done.stdout.replace("│", " ").split())
    assert "Notes, warnings and errors still go to stderr." in text
    assert "Print nothing on success" not in text
