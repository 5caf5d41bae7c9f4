"""What the terminal, a pipe and a spreadsheet receive (issue 9, items 20-23), and the
exit-code boundary.

- Names, paths and metadata are data: hostile names (rich markup, ESC/BEL/CR/LF, U+202E and
  other format characters) come out escaped and literal in every command and format, and
  JSON gives them back exactly (checked with json.loads, not with clipcli).
- CSV text cells are OWASP-neutralised; numbers (negative ones too) stay numbers (checked
  with the csv module).
- A closed pipe is exit 0 with nothing on stderr (real shell pipelines).
- Internal errors are exit 70 with one line (a traceback only with CLIPCLI_DEBUG=1), never 2.
- A SIGINT at any moment of start-up is exit 130 and one line (real signals to a real
  `python -m clipcli`).
- Format limits known before writing are exit 2, naming the tensor or key, with nothing
  written (checked at the limit and one past it, and read back with numpy/h5py).
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import h5py
import numpy as np
import pytest

import clipcli

if TYPE_CHECKING:
    from conftest import Run

# ------------------------------------------------------------------ hostile names

HOSTILE = (
    "[/x]",
    "[link=https://e.com]x[/link]",
    "[bold]b",
    "esc\x1b[31mred",
    "bel\x07",
    "cr\rx",
    "nl\nx",
    "tab\tx",
    "rtl\u202etxt",
    "zw\u200bj",  # zero-width space (Cf)
    "ls\u2028ps\u2029",  # line and paragraph separators (Zl, Zp)
    "c1\x9bx",  # C1 CSI
    '=HYPERLINK("http://e.com","x")',
    "+cmd",
    "-2+3",
    "@SUM(A1)",
)
# Characters that must never reach the terminal or a file raw.
FORBIDDEN = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u200b-\u200f\u202a-\u202e\u2028\u2029]")


def _escaped(name: str) -> str:
    """Independent reference: Python's unicode_escape of every non-printable character."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in name)


@pytest.fixture
def hostile(tmp_path: Path, write_checkpoint: Callable[..., Path]) -> Path:
    tensors = {name: np.full((2,), float(i + 1), np.float32) for i, name in enumerate(HOSTILE)}
    metadata = {"[/k]\x1b": "[link=https://e.com]v[/link]\x07\u202e"}
    return write_checkpoint(tmp_path / "m.safetensors", tensors, metadata)


def _assert_clean(text: str) -> None:
    """No control or format character except the line ends (and tabs nowhere in names)."""
    bad = FORBIDDEN.findall(text.replace("\n", ""))
    assert not bad, f"raw control/format characters reached the output: {bad!r}"


COMMANDS = {
    "ls": ["ls", "{m}"],
    "norms": ["norms", "{m}"],
    "norms-sort-name": ["norms", "{m}", "--sort", "name"],
    "norms-group-by": ["norms", "{m}", "--group-by", "(?s)(.*)"],
    "clip": ["clip", "--global", "1", "{m}", "{out}"],
    "diff": ["diff", "{m}", "{m}"],
}


@pytest.mark.parametrize("fmt_", ["table", "json", "jsonl", "csv"])
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_hostile_names_are_printed_as_data(
    tmp_path: Path, hostile: Path, run_main: Callable[..., Run], command: str, fmt_: str
) -> None:
    argv = [a.format(m=hostile, out=tmp_path / "o.safetensors") for a in COMMANDS[command]]
    result = run_main(*argv, "--format", fmt_)
    assert result.code == 0, result.stderr
    assert result.stderr == ""
    _assert_clean(result.stdout)
    if fmt_ == "json":
        document = json.loads(result.stdout)
        rows = document.get("tensors", document.get("groups"))
        key = "group" if "groups" in document else "name"
        assert sorted(r[key] for r in rows) == sorted(HOSTILE)  # exactly, not escaped
        if command == "ls":
            assert document["metadata"] == {"[/k]\x1b": "[link=https://e.com]v[/link]\x07\u202e"}
    elif fmt_ == "jsonl":
        rows = [json.loads(line) for line in result.stdout.splitlines()]
        key = "group" if "group" in rows[0] else "name"
        assert sorted(r[key] for r in rows) == sorted(HOSTILE)
    elif fmt_ == "csv":
        rows = list(csv.reader(io.StringIO(result.stdout)))
        names = [row[0] for row in rows[1:]]
        assert sorted(names) == sorted(_csv_reference(n) for n in HOSTILE)
    else:
        for name in HOSTILE:
            assert _escaped(name) in result.stdout, name
        if command == "ls":
            assert "metadata [/k]\\x1b = [link=https://e.com]v[/link]\\x07\\u202e" in (
                result.stdout
            )


def _csv_reference(name: str) -> str:
    escaped = _escaped(name)
    return "'" + escaped if escaped[0] in "=+-@\t\r" else escaped


@pytest.mark.parametrize("group_by", [None, "(?s)(.*)"])
def test_hostile_names_in_the_chart(
    hostile: Path, run_main: Callable[..., Run], group_by: str | None
) -> None:
    extra = ["--group-by", group_by] if group_by else []
    result = run_main("norms", hostile, "--chart", "--limit", "3", *extra)
    assert result.code == 0, result.stderr
    assert result.stderr == ""
    _assert_clean(result.stdout)
    for name in HOSTILE:
        assert _escaped(name) in result.stdout, name


def test_hostile_path_in_title_footer_and_convert(
    tmp_path: Path, write_checkpoint: Callable[..., Path], run_main: Callable[..., Run]
) -> None:
    # The path shows '[bold]d\x1b[2J/e[/x]m.safetensors': markup across two components.
    directory = tmp_path / "[bold]d\x1b[2J" / "e["
    directory.mkdir(parents=True)
    src = write_checkpoint(directory / "x]m.safetensors", {"w": np.ones(2, np.float32)})
    for argv, shown in (
        (["ls", src], "e[/x]m.safetensors (safetensors)"),
        (["norms", src], "e[/x]m.safetensors (safetensors)"),
        (["norms", src, "--chart"], "e[/x]m.safetensors (safetensors)"),
        (["clip", "--global", "1", src, directory / "o\x07.safetensors"], "e[/o\\x07.safetensors"),
        (["convert", src, directory / "c\u202e.npz"], "e[/c\\u202e.npz: 1 tensor,"),
    ):
        result = run_main(*argv)
        assert result.code == 0, result.stderr
        _assert_clean(result.stdout)
        assert "[bold]d\\x1b[2J/" + shown in result.stdout, result.stdout


def test_hostile_names_in_error_lines(
    tmp_path: Path, run_main: Callable[..., Run], assert_one_error_line: Callable[..., str]
) -> None:
    missing = tmp_path / "[/x]\x1b[2J\n\u202e.safetensors"
    result = run_main("norms", missing)
    assert result.code == 3
    line = assert_one_error_line(result.stderr, "[/x]\\x1b[2J\\n\\u202e.safetensors")
    _assert_clean(line)


def test_progress_label_is_not_markup(capsys: pytest.CaptureFixture[str]) -> None:
    from clipcli.report.progress_bar import TerminalProgress

    progress = TerminalProgress(delay=0)
    progress.start("measuring [/x]\x1b[2J[link=https://e.com]x[/link]", 100)
    progress.advance(50)
    progress.finish()
    _assert_clean(capsys.readouterr().err.replace("\r", ""))


def test_long_metadata_values_are_shortened_in_the_table_only(
    tmp_path: Path, write_checkpoint: Callable[..., Path], run_main: Callable[..., Any]
) -> None:
    from clipcli.report.table import METADATA_VALUE_CHARS

    at_limit, over = "a" * METADATA_VALUE_CHARS, "b" * (METADATA_VALUE_CHARS + 1)
    src = write_checkpoint(
        tmp_path / "m.safetensors",
        {"w": np.ones(2, np.float32)},
        {"at": at_limit, "over": over},
    )
    table = run_main("ls", src).stdout
    assert f"metadata at = {at_limit}\n" in table
    assert f"metadata over = {over[:METADATA_VALUE_CHARS]}… ({len(over)} characters" in table
    assert over not in table
    assert run_main("ls", src, "--format", "json").json()["metadata"] == {
        "at": at_limit,
        "over": over,
    }


def test_many_metadata_keys_all_listed(
    tmp_path: Path, write_checkpoint: Callable[..., Path], run_main: Callable[..., Run]
) -> None:
    """ls renders the footer in one piece (benchmarks/ls_metadata.py times it); every key
    is there once, in the file's order."""
    metadata = {f"key{i}": f"value{i}" for i in range(20_000)}
    src = write_checkpoint(tmp_path / "m.safetensors", {"w": np.ones(2, np.float32)}, metadata)
    result = run_main("ls", src)
    lines = [line for line in result.stdout.splitlines() if line.startswith("metadata ")]
    assert sorted(lines) == sorted(f"metadata {k} = {v}" for k, v in metadata.items())


# ------------------------------------------------------------------ CSV


@pytest.mark.parametrize("first", list("=+-@\t\r\uff1d\uff0b\uff0d\uff20"))
def test_csv_formula_starts_are_neutralised(first: str) -> None:
    from clipcli.report.serialize import csv_text

    expected = _escaped(first + "x")
    assert csv_text(first + "x") == "'" + expected
    assert csv_text("x" + first) == _escaped("x" + first)  # only the first character counts


def test_csv_leaves_other_text_and_every_number_alone() -> None:
    from clipcli.report.serialize import csv_text
    from clipcli.report.serialize import csv_value as _csv_value

    for text in ("layers.0.weight", "'quoted", " =space first", "#", "%", "0", "1e5"):
        assert csv_text(text) == text
    assert _csv_value(-1.5) == "-1.5"
    assert _csv_value(-3) == "-3"
    assert _csv_value(float("-inf")) == "-inf"
    assert _csv_value(True) == "true"


def test_csv_negative_numbers_stay_numbers(
    tmp_path: Path, write_checkpoint: Callable[..., Path], run_main: Callable[..., Run]
) -> None:
    """diff of A against -A: cosine -1 and a name starting with '-' in the same rows."""
    a = np.array([1.0, 2.0], np.float32)
    src_a = write_checkpoint(tmp_path / "a.safetensors", {"-w": a})
    src_b = write_checkpoint(tmp_path / "b.safetensors", {"-w": -a})
    result = run_main("diff", src_a, src_b, "--format", "csv")
    rows = list(csv.DictReader(io.StringIO(result.stdout)))
    assert rows[0]["name"] == "'-w"
    assert float(rows[0]["cosine"]) == pytest.approx(-1.0)
    assert rows[0]["cosine"].startswith("-")


# ------------------------------------------------------------------ closed pipes


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Reports far larger than a pipe buffer (64 KiB): 1,500 tensors (a rich table, below
    PLAIN_TABLE_ROWS) and metadata."""
    from safetensors.numpy import save_file

    from clipcli.report.table import PLAIN_TABLE_ROWS

    assert PLAIN_TABLE_ROWS > 1500
    path = tmp_path_factory.mktemp("big") / "big.safetensors"
    tensors = {f"model.layers.{i}.weight": np.ones(2, np.float32) for i in range(1500)}
    save_file(tensors, str(path), metadata={f"k{i}": "v" * 40 for i in range(1500)})
    return path


def _pipeline(argv: list[str], reader: str) -> tuple[int, str]:
    """Run `python -m clipcli ARGV | READER` in a real shell; clipcli's status and stderr."""
    command = " ".join([sys.executable, "-m", "clipcli", *map(_quote, argv)])
    script = f'{command} 2>"$ERR" | {reader} >/dev/null; echo ${{PIPESTATUS[0]}}'
    # stderr goes to a private temp file, never into the working directory.
    with tempfile.TemporaryDirectory() as scratch:
        err = Path(scratch) / "stderr.txt"
        done = subprocess.run(
            ["bash", "-c", script],
            capture_output=True,
            text=True,
            timeout=120,
            env=dict(os.environ, ERR=str(err)),
        )
        return int(done.stdout.strip().splitlines()[-1]), err.read_text()


def _quote(arg: str) -> str:
    import shlex

    return shlex.quote(str(arg))


PIPED = {
    "ls": ["ls", "{m}"],
    "norms": ["norms", "{m}", "--fail-above", "1e9"],
    "group-by": ["norms", "{m}", "--group-by", "layer"],
    "chart": ["norms", "{m}", "--chart"],
    "diff": ["diff", "{m}", "{m}"],
    "clip": ["clip", "--global", "1", "--dry-run", "{m}", "{m}.safetensors"],
}


@pytest.mark.parametrize(
    ("command", "fmt_", "reader"),
    [
        ("norms", "table", "head -1"),  # the case: exit 1 before
        ("norms", "csv", "head -c 10"),
        ("ls", "table", "head -c 100"),  # closes in the middle of the rich table
        ("ls", "json", "true"),  # closes before the first byte
        ("chart", "table", "head -1"),
        ("diff", "jsonl", "head -1"),
        ("clip", "table", "head -1"),
        ("group-by", "table", "true"),
    ],
)
def test_closed_pipe_is_exit_0_and_silent(big: Path, command: str, fmt_: str, reader: str) -> None:
    argv = [a.format(m=big) for a in PIPED[command]]
    if command != "chart":
        argv += ["--format", fmt_]
    code, stderr = _pipeline(argv, reader)
    assert (code, stderr) == (0, "")


@pytest.mark.slow
@pytest.mark.parametrize("reader", ["head -1", "true", "head -c 5000"])
@pytest.mark.parametrize("fmt_", ["table", "json", "jsonl", "csv"])
@pytest.mark.parametrize("command", sorted(PIPED))
def test_closed_pipe_every_command_and_format(
    big: Path, command: str, fmt_: str, reader: str
) -> None:
    argv = [a.format(m=big) for a in PIPED[command]]
    if command != "chart":
        argv += ["--format", fmt_]
    elif fmt_ != "table":
        pytest.skip("--chart has one format")
    code, stderr = _pipeline(argv, reader)
    assert (code, stderr) == (0, "")


def test_closed_pipe_on_help(tmp_path: Path) -> None:
    code, stderr = _pipeline(["--help", str(tmp_path / "x")], "true")
    assert (code, stderr) == (0, "")


# ------------------------------------------------------------------ exit 70


@pytest.mark.parametrize(
    "error",
    [
        ValueError("boom [/x]\x1b"),
        KeyError("k"),
        RuntimeError("multi\nline"),
        OSError(5, "I/O error"),
        TypeError("t"),
        AssertionError(),
        RecursionError(),
    ],
    ids=lambda e: type(e).__name__,
)
def test_unexpected_exception_is_exit_70_one_line(
    tmp_path: Path,
    write_checkpoint: Callable[..., Path],
    run_main: Callable[..., Any],
    monkeypatch: pytest.MonkeyPatch,
    assert_one_error_line: Callable[..., str],
    error: BaseException,
) -> None:
    import clipcli.api
    import clipcli.formats.opening

    def broken(*_args: object, **_kwargs: object) -> None:
        raise error

    src = write_checkpoint(tmp_path / "m.safetensors", {"w": np.ones(2, np.float32)})
    monkeypatch.setattr(clipcli.api, "open_reader", broken)  # what ls reads through
    monkeypatch.setattr(clipcli.api, "measure", broken)
    monkeypatch.delenv("CLIPCLI_DEBUG", raising=False)
    for argv in (["ls", src], ["norms", src]):
        result = run_main(*argv)
        assert result.code == 70, result
        line = assert_one_error_line(result.stderr, "internal error", type(error).__name__)
        _assert_clean(line)


def test_internal_errors_never_exit_2(
    tmp_path: Path,
    write_checkpoint: Callable[..., Path],
    run_main: Callable[..., Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Exceptions that look like usage errors to Click, raised by a bug inside a command,
    are internal errors (70), not usage errors (2)."""
    import typer

    import clipcli.api

    src = write_checkpoint(tmp_path / "m.safetensors", {"w": np.ones(2, np.float32)})
    for error in (typer.BadParameter("x"), ValueError("--format"), LookupError()):

        def broken(*_args: object, error: Exception = error, **_kwargs: object) -> None:
            raise error

        monkeypatch.setattr(clipcli.api, "open_reader", broken)  # what ls reads through
        assert run_main("ls", src).code == 70


def test_internal_error_traceback_only_with_debug(
    tmp_path: Path, write_checkpoint: Callable[..., Path]
) -> None:
    src = write_checkpoint(tmp_path / "m.safetensors", {"w": np.ones(2, np.float32)})
    program = (
        "import sys, clipcli.formats.opening as e\n"
        "def broken(*a, **k): raise ZeroDivisionError('boom')\n"
        "e.open_reader = broken\n"
        "from clipcli.cli.entry import main\n"
        f"raise SystemExit(main(['ls', {str(src)!r}]))\n"
    )
    for debug in (False, True):
        env = dict(os.environ)
        env.pop("CLIPCLI_DEBUG", None)
        if debug:
            env["CLIPCLI_DEBUG"] = "1"
        done = subprocess.run(
            [sys.executable, "-c", program], capture_output=True, text=True, env=env, timeout=60
        )
        assert done.returncode == 70
        errors = [line for line in done.stderr.splitlines() if line.startswith("clipcli:")]
        assert errors == [
            "clipcli: error: internal error: ZeroDivisionError: boom "
            "(set CLIPCLI_DEBUG=1 for details)"
        ]
        assert ("Traceback (most recent call last)" in done.stderr) is debug
        assert done.stderr.endswith(errors[0] + "\n")


# ------------------------------------------------------------------ signals at start-up


def _launcher(how: str) -> list[str]:
    """`python -m clipcli`, or the installed `clipcli` console script (which must start in
    clipcli.__main__:run, where the guard is; an old editable install still points at
    clipcli.cli.entry:main until `pip install -e .` is run again)."""
    if how == "module":
        return [sys.executable, "-m", "clipcli"]
    script = Path(sys.executable).parent / "clipcli"
    if not script.exists() or "clipcli.__main__ import run" not in script.read_text():
        pytest.skip(f"{script} is missing or from an older install: reinstall with pip -e .")
    return [str(script)]


def _start_up_outcome(
    launcher: list[str], src: Path, delay: float, env: dict[str, str]
) -> tuple[int, str, str]:
    child = subprocess.Popen(
        [*launcher, "norms", str(src)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    time.sleep(delay)
    child.send_signal(signal.SIGINT)
    out, err = child.communicate(timeout=60)
    return child.returncode, out, err


_IMPORT_LOCK_CALLBACK = re.compile(
    r"Exception ignored in: <function _get_module_lock\.<locals>\.cb at 0x[0-9a-f]+>\n"
    r"Traceback \(most recent call last\):\n"
    r'  File "<frozen importlib\._bootstrap>", line \d+, in cb\n'
    r"KeyboardInterrupt: \n"
)


def _check_start_up_outcome(code: int, out: str, err: str, expected_out: str) -> None:
    """Allowed: one line and 130; finished before the signal (0, full report, no stderr);
    or interrupted by the interpreter before any clipcli code ran (killed by SIGINT before
    Python installed its handler, Python's own traceback with no frame from the clipcli
    package, or site reporting the interrupt while it ran a .pth file and going on):
    site, .pth files and runpy are not ours to guard."""
    # The package's own folder, not any path holding "clipcli" (a checkout named clipcli
    # puts its venv under /…/clipcli/.venv/, and the interpreter's frames live there).
    package = str(Path(clipcli.__file__).parent) + os.sep
    if code == 130:
        assert err == "clipcli: error: interrupted\n", err
    elif code == 0:
        assert out == expected_out
        if err:  # the interpreter swallowed it and said so, then ran on; not our code:
            # site running a .pth file, the start-up check of argv[0] (zipimport), or
            # importlib's module-lock callback while `clipcli.__main__` is being imported,
            # before run() can install the guard
            if _IMPORT_LOCK_CALLBACK.fullmatch(err):
                return
            if err.startswith("Failed checking if argv[0] is an import"):
                # Every frame the interpreter's own, frozen: zipimport's, or the path
                # hook's (FileFinder), whichever checks argv[0] when the signal lands.
                frames = [line for line in err.splitlines() if line.lstrip().startswith("File ")]
                assert frames, err
                assert all(f.lstrip().startswith('File "<frozen ') for f in frames), err
            else:
                assert err.startswith("Error processing line "), err
                assert ".pth" in err, err
            assert package not in err, err
    else:
        assert code in (-signal.SIGINT, 1), (code, err)
        assert package not in err, f"a traceback from clipcli's own code:\n{err}"
        assert out == ""


@pytest.mark.parametrize("how", ["module", "script"])
def test_sigint_during_start_up_is_one_line_and_130(
    tmp_path: Path, write_checkpoint: Callable[..., Path], how: str
) -> None:
    _sigint_during_start_up(tmp_path, write_checkpoint, how, steps=25)


def _sigint_during_start_up(
    tmp_path: Path, write_checkpoint: Callable[..., Path], how: str, steps: int | None
) -> None:
    """Ctrl-C at `steps` moments (None: every millisecond) spread over a whole run's time,
    measured here: start-up keeps getting faster, and a fixed range of delays would mostly
    land after the end."""
    launcher = _launcher(how)
    src = write_checkpoint(tmp_path / "m.safetensors", {"w": np.ones(2, np.float32)})
    env = dict(os.environ, COLUMNS="200")
    env.pop("CLIPCLI_DEBUG", None)
    run_times = []
    for _ in range(3):
        started = time.perf_counter()
        expected = subprocess.run(
            [*launcher, "norms", str(src)], capture_output=True, text=True, env=env
        ).stdout
        run_times.append(time.perf_counter() - started)
    whole_run = min(run_times)
    steps = steps or max(1, round(whole_run * 1000))
    codes: list[int] = []
    step = 0
    # The planned moments, then later ones until a signal lands in clipcli's own run (130)
    # or the run ends first (0): on a loaded machine a run takes longer than the quiet
    # one measured above, and every planned moment may land in the interpreter's start-up.
    while step <= steps or (130 not in codes and codes[-1] != 0):
        code, out, err = _start_up_outcome(launcher, src, whole_run * step / steps, env)
        _check_start_up_outcome(code, out, err, expected)
        codes.append(code)
        step += 1
    assert 130 in codes, codes  # some landed in clipcli's start-up, however long it took


def test_sigterm_during_start_up_is_one_line_and_143(
    tmp_path: Path, write_checkpoint: Callable[..., Path]
) -> None:
    """SIGTERM at moments spread over a measured whole run (start-up keeps getting
    faster: fixed delays would land after the end)."""
    src = write_checkpoint(tmp_path / "m.safetensors", {"w": np.ones(2, np.float32)})
    argv = [sys.executable, "-m", "clipcli", "norms", str(src)]
    run_times = []
    for _ in range(3):
        started = time.perf_counter()
        expected = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
        run_times.append(time.perf_counter() - started)
    whole_run = min(run_times)
    codes = []
    for fraction in (0.3, 0.45, 0.6, 0.75, 0.9):
        child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(whole_run * fraction)
        child.send_signal(signal.SIGTERM)
        out, err = child.communicate(timeout=60)
        codes.append(child.returncode)
        if child.returncode == 143:
            assert err == "clipcli: error: terminated by SIGTERM\n"
        elif child.returncode == 0:  # the run was over before the signal came
            assert (out, err) == (expected, "")
        else:  # before the guard: the interpreter's default, dying of the signal silently
            assert (child.returncode, out, err) == (-signal.SIGTERM, "", ""), err
    assert 143 in codes


@pytest.mark.slow
@pytest.mark.parametrize("how", ["module", "script"])
def test_sigint_during_start_up_every_millisecond(
    tmp_path: Path, write_checkpoint: Callable[..., Path], how: str
) -> None:
    _sigint_during_start_up(tmp_path, write_checkpoint, how, steps=None)


# ------------------------------------------------------------------ format limits: exit 2


def _refused(
    run_main: Callable[..., Run],
    listing: Callable[[Path], list[str]],
    directory: Path,
    argv: list[object],
    *fragments: str,
) -> None:
    before = listing(directory)
    result = run_main(*argv)
    assert result.code == 2, result
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("clipcli: error:"), lines
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0][:300])
    assert listing(directory) == before


def test_npz_member_name_at_the_zip_limit(
    tmp_path: Path,
    write_checkpoint: Callable[..., Path],
    run_main: Callable[..., Run],
    listing: Callable[[Path], list[str]],
) -> None:
    """A zip member name has a 16-bit length; the member is NAME.npy in UTF-8: 65,531
    bytes of name fit, 65,532 do not (ASCII, and two-byte characters)."""
    fits = {"a" * 65531: 1.0, "é" * 32765 + "a": 2.0}
    too_long = ["a" * 65532, "é" * 32766]
    for i, (name, value) in enumerate(fits.items()):
        src = write_checkpoint(tmp_path / f"ok{i}.safetensors", {name: np.full(2, value)})
        out = tmp_path / f"ok{i}.npz"
        result = run_main("convert", src, out)
        assert result.code == 0, result.stderr[:300]
        with np.load(out) as loaded:
            assert list(loaded.keys()) == [name]
            assert loaded[name].tolist() == [value, value]
    for i, name in enumerate(too_long):
        src = write_checkpoint(tmp_path / f"bad{i}.safetensors", {name: np.ones(2)})
        for argv in (
            ["convert", src, tmp_path / "o.npz"],
            ["clip", "--value", "1", src, tmp_path / "o.npz"],
        ):
            _refused(run_main, listing, tmp_path, argv, "o.npz", "65535 bytes", "65536")


@pytest.mark.parametrize(
    ("names", "fragment"),
    [
        (["a", "a/b"], "'a/b' needs 'a'"),
        (["a/b", "a"], "'a/b' needs 'a'"),
        (["x/y", "x/y/z/w"], "'x/y/z/w' needs 'x/y'"),
        (["a//b"], "non-empty components"),
        (["a/./b"], "no '.'"),
        (["."], "no '.'"),
        (["a/"], "non-empty components"),
    ],
)
def test_hdf5_path_limits_refused_before_writing(
    tmp_path: Path,
    write_checkpoint: Callable[..., Path],
    run_main: Callable[..., Run],
    listing: Callable[[Path], list[str]],
    names: list[str],
    fragment: str,
) -> None:
    src = write_checkpoint(tmp_path / "in.safetensors", {n: np.ones(2) for n in names})
    for argv in (
        ["convert", src, tmp_path / "o.h5"],
        ["clip", "--global", "1", src, tmp_path / "o.h5"],
    ):
        _refused(run_main, listing, tmp_path, argv, "o.h5", fragment)


def test_hdf5_paths_that_only_share_a_prefix_are_fine(
    tmp_path: Path, write_checkpoint: Callable[..., Path], run_main: Callable[..., Run]
) -> None:
    names = ["a", "ab/c", "a.b/c", "b/a", "b/ab"]
    src = write_checkpoint(tmp_path / "in.safetensors", {n: np.ones(2) for n in names})
    assert run_main("convert", src, tmp_path / "o.h5").code == 0
    found: list[str] = []
    with h5py.File(tmp_path / "o.h5") as handle:
        handle.visititems(lambda n, o: found.append(n) if isinstance(o, h5py.Dataset) else None)
    assert sorted(found) == sorted(names)


def test_hdf5_metadata_keys_over_the_limit(
    tmp_path: Path,
    write_checkpoint: Callable[..., Path],
    run_main: Callable[..., Run],
    listing: Callable[[Path], list[str]],
) -> None:
    from clipcli.formats.hdf5 import HDF5_MAX_ATTRIBUTES, Hdf5Writer

    src = write_checkpoint(
        tmp_path / "in.safetensors",
        {"w": np.ones(2)},
        {f"k{i}": "v" for i in range(HDF5_MAX_ATTRIBUTES + 1)},
    )
    _refused(
        run_main,
        listing,
        tmp_path,
        ["convert", src, tmp_path / "o.h5"],
        "o.h5",
        "metadata key 'k",
        "at most 65535",
    )
    at_limit = {f"k{i}": "v" for i in range(HDF5_MAX_ATTRIBUTES)}
    assert Hdf5Writer.check_metadata(at_limit, None) is None  # type: ignore[arg-type]


@pytest.mark.slow
def test_hdf5_metadata_keys_at_the_limit_are_written(
    tmp_path: Path, write_checkpoint: Callable[..., Path], run_main: Callable[..., Run]
) -> None:
    metadata = {f"k{i}": f"v{i}" for i in range(65535)}
    src = write_checkpoint(tmp_path / "in.safetensors", {"w": np.ones(2)}, metadata)
    assert run_main("convert", src, tmp_path / "o.h5").code == 0
    with h5py.File(tmp_path / "o.h5") as handle:
        assert {k: handle.attrs[k] for k in handle.attrs} == metadata


@pytest.mark.parametrize(
    ("metadata", "fragment"),
    [
        ({"k" * 65535: "v"}, "at most 65534 bytes"),
        ({"é" * 32768: "v"}, "at most 65534 bytes"),
        ({"k": "a\x00b"}, "NUL"),
        ({"k\x00": "v"}, "non-empty UTF-8"),
    ],
)
def test_hdf5_metadata_names_and_values_refused(
    tmp_path: Path,
    write_checkpoint: Callable[..., Path],
    run_main: Callable[..., Run],
    listing: Callable[[Path], list[str]],
    metadata: dict[str, str],
    fragment: str,
) -> None:
    src = write_checkpoint(tmp_path / "in.safetensors", {"w": np.ones(2)}, metadata)
    _refused(run_main, listing, tmp_path, ["convert", src, tmp_path / "o.h5"], "o.h5", fragment)


def test_hdf5_metadata_name_at_the_limit(
    tmp_path: Path, write_checkpoint: Callable[..., Path], run_main: Callable[..., Run]
) -> None:
    metadata = {"k" * 65534: "v", "é" * 32767: "w"}
    src = write_checkpoint(tmp_path / "in.safetensors", {"w": np.ones(2)}, metadata)
    assert run_main("convert", src, tmp_path / "o.h5").code == 0
    with h5py.File(tmp_path / "o.h5") as handle:
        assert {k: handle.attrs[k] for k in handle.attrs} == metadata


def test_lone_surrogate_names_refused_by_every_writer() -> None:
    """The safetensors reader already refuses a lone surrogate (exit 3); a writer must not
    depend on that: no format can store one as UTF-8 (zipfile and h5py would raise)."""
    from clipcli.formats.hdf5 import Hdf5Writer
    from clipcli.formats.npz import NpzWriter
    from clipcli.formats.safetensors import SafetensorsWriter
    from clipcli.formats.sharded import ShardedWriter

    for writer in (NpzWriter, Hdf5Writer, SafetensorsWriter, ShardedWriter):
        assert "surrogate" in (writer.check_name("w\ud800") or ""), writer
        assert writer.check_name("w\u202e\U0001f600") is None, writer


# ------------------------------------------------------------------ natural order


def _reference_natural(name: str) -> tuple[object, ...]:
    parts = re.split(r"([0-9]+)", name)
    return tuple(int(p) if i % 2 else p for i, p in enumerate(parts))


@pytest.mark.parametrize(
    "argv",
    [
        ["--sort", "name"],
        ["--group-by", "layer"],
        ["--chart", "--sort", "name"],
        ["--group-by", "layer", "--chart"],
    ],
)
def test_huge_layer_numbers_sort_naturally(
    tmp_path: Path,
    write_checkpoint: Callable[..., Path],
    run_main: Callable[..., Run],
    argv: list[str],
) -> None:
    """5,000-digit layer numbers: int() refuses more than 4,300 digits by default, so the
    reference lifts that limit and sorts by value."""
    layers = ["9" * 5000, "1" + "0" * 5000, "2", "10", "0" * 4400 + "7", "1²"]
    names = [f"model.layers.{n}.w" for n in layers]
    src = write_checkpoint(tmp_path / "m.safetensors", {n: np.ones(2) for n in names})
    result = run_main("norms", src, *argv, "--format", "json")
    if "--chart" in argv:
        result = run_main("norms", src, *argv)
    assert result.code == 0, result.stderr[:500]
    if "--chart" in argv:
        return
    rows = result.json().get("tensors") or result.json()["groups"]
    key = "name" if "tensors" in result.json() else "group"
    got = [r[key] for r in rows if r[key] != "(other)"]
    previous = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    try:
        expected = sorted(got, key=_reference_natural)
    finally:
        sys.set_int_max_str_digits(previous)
    assert got == expected


@pytest.mark.slow  # ~2 s: a big report into a closed pipe
def test_closed_pipe_keeps_the_fail_above_verdict(big: Path) -> None:
    """The report is cut short, the verdict is not: exit 1 and its one stderr line."""
    code, stderr = _pipeline(["norms", str(big), "--fail-above", "1"], "head -1")
    assert code == 1
    assert stderr.startswith("clipcli: global norm")
    assert stderr.count("\n") == 1
    code, stderr = _pipeline(["norms", str(big), "--fail-above", "1e9"], "head -1")
    assert (code, stderr) == (0, "")


@pytest.mark.parametrize("suffix", [".png", ".svg"])
def test_plot_labels_are_not_mathtext(
    tmp_path: Path, write_checkpoint: Callable[..., Path], run_main: Callable[..., Run], suffix: str
) -> None:
    """'$...$' in a name was parsed as mathtext: savefig raised, exit 70."""
    pytest.importorskip("matplotlib")
    names = ["$\\frac{a}{$", "a$b", "^{", "[/x]\x1b[2J", "\u202e"]
    src = write_checkpoint(tmp_path / "m.safetensors", {n: np.ones(2) for n in names})
    out = tmp_path / f"p{suffix}"
    result = run_main("norms", src, "--plot", out, "--group-by", "(?s)(.*)")
    assert (result.code, result.stderr) == (0, "")
    assert out.stat().st_size > 0
    if suffix == ".svg":
        assert "\x1b" not in out.read_text()


def test_big_chart_is_plain_text_with_the_same_bars(
    tmp_path: Path, write_checkpoint: Callable[..., Path], run_main: Callable[..., Run]
) -> None:
    """Above PLAIN_TABLE_ROWS bars the chart is written as plain text (rich took ~7 s for
    20,000): every bar still there, scaled to the largest norm, the limit mark in place,
    names escaped."""
    from clipcli.report.chart import BAR_WIDTH
    from clipcli.report.table import PLAIN_TABLE_ROWS

    n = PLAIN_TABLE_ROWS + 1
    tensors = {f"t{i:05d}": np.full(1, float(i)) for i in range(n)}
    tensors["z[/x]\x1b"] = np.full(1, float(n))  # sorts last, as safetensors stores names
    src = write_checkpoint(tmp_path / "m.safetensors", tensors)
    result = run_main("norms", src, "--chart", "--limit", str(n / 2))
    assert result.code == 0, result.stderr
    lines = result.stdout.splitlines()
    bars = [line for line in lines[1:] if line.startswith(" ")]
    assert len(bars) == n + 1
    mark = round((n / 2) / n * BAR_WIDTH)
    name_width = len("z[/x]\\x1b")  # the longest name, escaped
    for i, line in enumerate(bars[:-1]):
        name = line[1 : 1 + name_width].strip()
        bar = line[3 + name_width : 3 + name_width + BAR_WIDTH]
        norm = line.split()[-1]
        assert name == f"t{i:05d}"
        assert float(norm) == pytest.approx(i, rel=1e-5)
        assert bar[mark] == "│"
        assert bar.replace("│", "█" if round(i / n * BAR_WIDTH) > mark else " ").count(
            "█"
        ) == round(i / n * BAR_WIDTH)
    assert bars[-1].startswith(" z[/x]\\x1b ")
    over = sum(1 for v in range(n + 1) if v > n / 2)
    assert lines[-1] == f"limit {n / 2:g} (│): {over} of {n + 1} over"
