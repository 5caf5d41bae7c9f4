"""One error boundary (issue 13): every exception family maps to the same stderr line and
exit code whether the command runs through `main(argv)` or through Typer directly; the
report package does no math and stays light; cli.py stays small."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from handmade import write_safetensors
from typer.testing import CliRunner

import clipcli.api
from clipcli.cli.entry import main
from clipcli.cli.typer_app import app
from clipcli.errors import (
    DataRefusedError,
    ExitCode,
    InputError,
    Interrupted,
    UsageError,
    WriteError,
)

PACKAGE = Path(__file__).resolve().parent.parent / "clipcli"

# exception raised inside a command -> (exit code, what the one stderr line says; None:
# nothing on stderr)
FAMILIES: list[tuple[Callable[[], BaseException], int, str | None]] = [
    (lambda: UsageError("bad option"), ExitCode.USAGE, "bad option"),
    (lambda: InputError("m", "broken header"), ExitCode.BAD_INPUT, "broken header"),
    (lambda: DataRefusedError("NaN"), ExitCode.REFUSED_DATA, "NaN"),
    (lambda: WriteError("disk full"), ExitCode.WRITE_FAILED, "disk full"),
    (lambda: Interrupted("interrupted"), ExitCode.INTERRUPTED, "interrupted"),
    (lambda: Interrupted("SIGTERM", ExitCode.TERMINATED), ExitCode.TERMINATED, "SIGTERM"),
    (lambda: KeyboardInterrupt(), ExitCode.INTERRUPTED, "interrupted"),
    (lambda: BrokenPipeError(), ExitCode.OK, None),
    (lambda: ValueError("bug"), ExitCode.INTERNAL, "internal error: ValueError: bug"),
]


@pytest.mark.parametrize(("make", "code", "says"), FAMILIES)
def test_every_family_maps_the_same_through_main_and_typer(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    make: Callable[[], BaseException],
    code: int,
    says: str | None,
) -> None:
    path = write_safetensors(tmp_path / "m.safetensors", {"w": np.ones(2, np.float32)})

    def broken(*_args: object, **_kwargs: object) -> None:
        raise make()

    monkeypatch.setattr(clipcli.api, "measure", broken)
    monkeypatch.delenv("CLIPCLI_DEBUG", raising=False)
    capsys.readouterr()
    assert main(["norms", str(path)]) == code
    err = capsys.readouterr().err
    through_typer = CliRunner().invoke(app, ["norms", str(path)])
    assert through_typer.exit_code == code
    for stderr in (err, through_typer.stderr):
        if says is None:
            assert stderr == ""
        else:
            lines = stderr.splitlines()
            assert len(lines) == 1, stderr
            assert lines[0].startswith("clipcli: error: "), stderr
            assert says in lines[0]


def test_every_exit_code_is_documented_in_help() -> None:
    from clipcli.cli.typer_app import EXIT_CODES_HELP

    documented = {
        int(line.split()[0])
        for line in EXIT_CODES_HELP.splitlines()[2:]
        if line[:3].strip().isdigit()
    }
    assert {c.value for c in ExitCode} - documented <= {ExitCode.HANGUP, ExitCode.TERMINATED}


def test_cli_module_is_small() -> None:
    assert len((PACKAGE / "cli" / "entry.py").read_text().splitlines()) <= 400


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_report_package_imports_no_numerics() -> None:
    """The report renders numbers it is given; sort keys come from plan.py."""
    for path in sorted((PACKAGE / "report").glob("*.py")):
        forbidden = {
            name
            for name in _imports(path)
            if name.startswith(("clipcli.numerics", "clipcli.dtypes", "numpy"))
        }
        assert not forbidden, (path.name, forbidden)


def test_importing_the_report_loads_neither_numpy_nor_rich() -> None:
    code = (
        "import sys, clipcli.report, clipcli.report.builders, clipcli.report.chart, "
        "clipcli.report.table, clipcli.report.serialize, clipcli.report.progress_bar, "
        "clipcli.report.plot\n"
        "print(sorted(m for m in ('numpy', 'rich', 'matplotlib') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_a_name_too_long_is_exit_3(run_subprocess: Callable[..., Any]) -> None:
    name = "a" * 300 + ".safetensors"
    done = run_subprocess("ls", name)
    assert (done.code, done.stdout) == (3, "")
    assert done.stderr == f"clipcli: error: {name}: cannot read: File name too long\n"


@pytest.mark.parametrize("args", [["--version"], ["--help"], ["ls", "--help"], []])
def test_version_and_help_on_a_full_stdout_are_exit_5(args: list[str]) -> None:
    with open("/dev/full", "w") as full:
        done = subprocess.run(
            [sys.executable, "-m", "clipcli", *args],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    assert done.returncode == 5
    assert done.stderr == "clipcli: error: standard output: cannot write: No space left on device\n"


def test_version_to_a_closed_stdout_or_a_closed_pipe() -> None:
    closed = subprocess.run(
        f"{sys.executable} -m clipcli --version >&-", shell=True, capture_output=True, text=True
    )
    assert (closed.returncode, closed.stderr) == (5, "clipcli: error: standard output is closed\n")
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader went away: not an error
    try:
        gone = subprocess.run(
            [sys.executable, "-m", "clipcli", "--version"],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    finally:
        os.close(write_end)
    assert (gone.returncode, gone.stderr) == (0, "")


SAMPLE = Path(__file__).resolve().parent.parent / "sample_data"


@pytest.mark.parametrize("limit", [5, 6, 7])
@pytest.mark.parametrize(
    ("source", "out"),
    [
        ("tiny_mlp.npz", "f.safetensors"),
        ("tiny_mlp.npz", "d/"),
        ("tiny_mlp_keras.h5", "k.h5"),
        ("tiny_mlp.safetensors", "f.h5"),
    ],
)
def test_out_of_file_descriptors_is_exit_5_and_leaves_nothing(
    tmp_path: Path, limit: int, source: str, out: str
) -> None:
    """`ulimit -n` too low for the run: one line, exit 5, no work directory left behind
    (the lock's descriptor is freed first, and an empty work directory needs none)."""
    import resource

    def low_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

    done = subprocess.run(
        [sys.executable, "-m", "clipcli", "convert", str(SAMPLE / source), out],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=low_limit,
    )
    left = sorted(p.name for p in tmp_path.iterdir())
    if done.returncode == 0:  # enough descriptors after all: OUT is whole
        assert left == [out.rstrip("/")]
    else:  # 5 when writing ran out, 3 when reading IN did ("cannot read ...: Too many ...")
        assert done.returncode in (3, 5), done.stderr
        assert "Too many open files" in done.stderr
        assert done.stderr.count("\n") == 1
        assert done.stderr.startswith("clipcli: error: "), done.stderr
        assert left == []


def test_a_report_that_cannot_be_printed_after_the_commit_says_out_is_whole(
    tmp_path: Path,
) -> None:
    from safetensors.numpy import load_file

    out = tmp_path / "o.safetensors"
    with open("/dev/full", "w") as full:
        done = subprocess.run(
            [sys.executable, "-m", "clipcli", "clip", "--global", "1"]
            + [str(SAMPLE / "tiny_mlp.safetensors"), str(out)],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    assert done.returncode == 5
    assert done.stderr == (
        "clipcli: error: standard output: cannot write the report: No space left on device; "
        f"{out} was written and is complete\n"
    )
    assert set(load_file(str(out))) == set(load_file(str(SAMPLE / "tiny_mlp.safetensors")))


def test_main_version_on_a_failing_stdout_is_one_line_and_5(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """main(["--version"]) in process (the program answers --version before loading
    main): a stdout that fails is exit 5 with one line, as for a report, not exit 70."""
    import errno
    import io

    class Full(io.StringIO):
        def write(self, _text: str) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

    capsys.readouterr()
    monkeypatch.setattr(sys, "stdout", Full())
    assert main(["--version"]) == 5
    assert capsys.readouterr().err == (
        "clipcli: error: standard output: cannot write the report: No space left on device\n"
    )
