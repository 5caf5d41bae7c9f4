"""Usage errors say what to type instead (issue 23, item 8 and "things users reached for").

Each case is a command line a newcomer typed; the one error line must carry the hint they
need, never the misleading one Click offered (`clipcli version --help`, `--sort` for
`--json`). Where the hint is a command line, it is run: it must do what was asked.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import numpy as np
import pytest
from expect import one_error_line
from handmade import write_safetensors

from clipcli.cli.entry import main


@pytest.fixture
def model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.chdir(tmp_path)  # hints quote the names as typed: keep them short
    write_safetensors(tmp_path / "m.safetensors", {"layers.0.w": np.full(4, 2.0, np.float32)})
    return "m.safetensors"


def error_of(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    capsys.readouterr()
    assert main(argv) == 2
    return one_error_line(capsys.readouterr().err).removeprefix("clipcli: error: ")


def suggested_line(error: str, after: str) -> list[str]:
    """The command line the hint says to type (what follows `after`), as argv."""
    line = shlex.split(error.split(after, 1)[1])
    assert line[0] == "clipcli"
    return line[1:]


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["version"], "No such command 'version'; for the version, type: clipcli --version"),
        (["help"], "No such command 'help'; for help, type: clipcli --help"),
        (["help", "norms"], "No such command 'help'; for help, type: clipcli norms --help"),
        (
            ["frobnicate"],
            "No such command 'frobnicate'; the commands are ls, norms, clip, convert, diff "
            "(see 'clipcli --help')",
        ),
        (
            ["m.safetensors"],
            "No such command 'm.safetensors'; a command comes first (ls, norms, clip, "
            "convert, diff), e.g. clipcli ls m.safetensors",
        ),
    ],
)
def test_a_wrong_command_gets_the_hint_it_needs(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    error = error_of(argv, capsys)
    assert error == expected
    assert "version --help" not in error


def test_a_misspelt_command_suggests_the_line_with_the_nearest_command(
    model: str, capsys: pytest.CaptureFixture[str]
) -> None:
    error = error_of(["nroms", model, "--top", "1"], capsys)
    assert error.startswith("No such command 'nroms'; did you mean: ")
    assert "nroms --help" not in error
    line = suggested_line(error, "did you mean: ")
    assert line == ["norms", model, "--top", "1"]
    assert main(line) == 0


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["norms", "m.safetensors", "--csv"], "No such option: --csv; type --format csv"),
        (["diff", "a", "b", "--jsonl"], "No such option: --jsonl; type --format jsonl"),
        (
            ["convert", "a", "b.npz", "--json"],
            "No such option: --json; convert prints one line, no report to format",
        ),
        (
            ["norms", "m.safetensors", "--version"],
            "No such option: --version; the version is clipcli's own option: clipcli --version",
        ),
        (
            ["ls", "m.safetensors", "--fail-above", "3"],
            "No such option: --fail-above; ls has no --fail-above; norms and diff have it",
        ),
        (
            ["convert", "a", "b", "--dry-run"],
            "No such option: --dry-run; convert has no --dry-run; clip has it",
        ),
        (
            ["clip", "a", "b", "--glob", "1"],
            "No such option: --glob; did you mean --global or --group-by? "
            "(see 'clipcli clip --help')",
        ),
        (["ls", "m", "--zzz"], "No such option: --zzz; see 'clipcli ls --help'"),
    ],
)
def test_a_wrong_option_gets_the_hint_it_needs(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert error_of(argv, capsys) == expected


def test_an_option_before_the_command_is_moved_after_it(
    model: str, capsys: pytest.CaptureFixture[str]
) -> None:
    error = error_of(["-q", "norms", model], capsys)
    assert error.startswith("No such option: -q; options go after the command: ")
    line = suggested_line(error, "after the command: ")
    assert line == ["norms", "-q", model]
    assert main(line) == 0


@pytest.mark.parametrize(
    "spelling",
    [
        ["-o", "o.safetensors"],
        ["-oo.safetensors"],
        ["--output", "o.safetensors"],
        ["--output=o.safetensors"],
    ],
)
def test_out_as_an_option_is_refused_with_the_line_to_type(
    spelling: list[str], model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """OUT is positional (cp's SRC DST); `-o` is refused (exit 2, nothing written) with
    the same line, OUT in its place: that line works."""
    argv = ["clip", "--global", "1", model, *spelling]
    error = error_of(argv, capsys)
    assert "OUT is the argument after IN, not an option; type: " in error
    assert not (tmp_path / "o.safetensors").exists()
    line = suggested_line(error, "; type: ")
    assert line == ["clip", "--global", "1", model, "o.safetensors"]
    assert main(line) == 0
    assert (tmp_path / "o.safetensors").exists()


def test_convert_with_o_names_the_line_to_type(
    model: str, capsys: pytest.CaptureFixture[str]
) -> None:
    error = error_of(["convert", model, "-o", "o.npz"], capsys)
    assert suggested_line(error, "; type: ") == ["convert", model, "o.npz"]


def test_a_report_written_with_o_is_a_redirection(
    model: str, capsys: pytest.CaptureFixture[str]
) -> None:
    error = error_of(["norms", model, "-o", "report.json", "--json"], capsys)
    assert error == (
        "No such option: -o; norms writes its report to standard output; redirect it: "
        "clipcli norms m.safetensors --json > report.json"
    )


@pytest.mark.parametrize("command", ["ls", "norms"])
def test_several_paths_are_refused_with_a_loop_to_type(
    command: str, model: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """One PATH per run (one report, one --fail-above verdict): several are refused (exit
    2), and the hint is a shell loop over them with the options kept."""
    error = error_of([command, model, "b.safetensors", "--sort", "name"], capsys)
    assert error == (
        "Got unexpected extra argument(s) (b.safetensors); "
        f"{command} reads one PATH; for several, run it once per file: "
        f'for f in m.safetensors b.safetensors; do clipcli {command} --sort name "$f"; done'
    )


def test_diff_with_three_paths_says_it_compares_two(capsys: pytest.CaptureFixture[str]) -> None:
    error = error_of(["diff", "a", "b", "c"], capsys)
    assert (
        error
        == "Got unexpected extra argument(s) (c); diff compares two checkpoints: clipcli diff A B"
    )


def test_ls_sort_norm_names_the_norms_line(model: str, capsys: pytest.CaptureFixture[str]) -> None:
    error = error_of(["ls", model, "--sort", "norm", "-i", "layers.*"], capsys)
    assert error.startswith("ls reads no tensor data, so it cannot sort by norm; type: ")
    line = suggested_line(error, "; type: ")
    assert line == ["norms", "--sort", "norm", model, "-i", "layers.*"]
    assert main(line) == 0


def test_the_existing_hints_stay(capsys: pytest.CaptureFixture[str]) -> None:
    assert error_of(["ls"], capsys) == "Missing argument 'PATH'; see 'clipcli ls --help'"
    error = error_of(["clip", "--norm", "1", "--axes", "0", "1", "a", "b"], capsys)
    assert error.endswith("; --axes takes one comma-separated list, e.g. --axes 0,1")


def test_a_hostile_argument_stays_on_the_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    error = error_of(["nroms", "a\nb\x1b[31m"], capsys)
    assert "\n" not in error
    assert "\x1b" not in error


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
