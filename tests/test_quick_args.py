"""The quick parser (clipcli/cli/quick_args.py) against the parser of record, Typer.

Ordinary command lines skip Typer for start-up time (issue 12, item 7). That is only safe
if the quick parser never gives a command's body a request Typer would not. Both read the
one table (clipcli/cli/declarations.py): here Typer's own parameters, generated from it,
are checked against what the table says the quick parser takes, random command lines are
parsed both ways into requests, and real runs are compared through both paths.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import typer.main
from conftest import RunCli
from expect import one_error_line
from hypothesis import given
from hypothesis import strategies as st
from safetensors.numpy import save_file

from clipcli.cli import boundary, quick_args, typer_app
from clipcli.cli.declarations import COMMANDS, Spelling, parameters, request, spellings
from clipcli.cli.entry import main
from clipcli.report import ListingSortKey, OutputFormat, SortKey

Click = Any  # typer vendors click; its classes are recognised by name below


def click_command(name: str) -> Click:
    group = typer.main.get_command(typer_app.app)
    return group.commands[name]  # type: ignore[attr-defined]


def kind_of(param: Click) -> str:
    """The quick table's kind for a Click parameter, from Click's own description of it."""
    type_name = type(param.type).__name__
    # clipcli's own subclasses (which refuse an empty path) count as what they extend
    bases = [cls.__name__ for cls in type(param.type).__mro__]
    type_name = next((k for k in bases if k in ("TyperPath", "StringParamType")), type_name)
    if type_name == "FloatParamType":
        return "float"
    if type_name == "IntRange":
        assert (param.type.min, param.type.max, param.type.min_open) == (1, None, False)
        return "count"
    if type_name == "StringParamType":
        return "str*" if param.multiple else "str"
    if type_name == "TyperPath":
        # Taken as given, as quick_args takes it: Click checks nothing on the file system.
        checks = vars(param.type)
        assert not any(checks[k] for k in ("exists", "readable", "writable", "resolve_path"))
        assert checks["file_okay"]
        assert checks["dir_okay"]
        assert checks["type"] is None  # (Typer then makes the Path)
        return "path"
    if type_name == "TyperChoice":
        choices = tuple(param.type.choices)
        kinds = (("format", OutputFormat), ("sort", SortKey), ("listing-sort", ListingSortKey))
        for kind, enum in kinds:
            if choices == tuple(e.value for e in enum):
                assert param.type.case_sensitive
                return kind
    raise AssertionError(f"{param.name}: no quick kind for {type_name}")


# The quick parser's kind of value, by the type the table declares (its choices, if fewer).
KINDS = {
    float: "float",
    int: "count",
    str: "str",
    Path: "path",
    OutputFormat: "format",
    SortKey: "sort",
    ListingSortKey: "listing-sort",
}


def quick_kind(option: Spelling) -> str:
    if option.flag is not None:
        return "on" if option.flag else "off"
    parameter = option.parameter
    choices = getattr(parameter.declared, "choices", None)
    kind = KINDS[choices or parameter.value_type]
    if kind == "count":
        assert parameter.declared.minimum == 1  # type: ignore[union-attr]
    return kind + ("*" if parameter.many else "")


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_the_quick_table_is_typers_table(name: str) -> None:
    command = click_command(name)
    options = spellings(name)
    expected: dict[str, tuple[str, str]] = {}
    arguments: list[tuple[str, str]] = []
    for param in command.params:
        if type(param).__name__ == "TyperArgument":
            assert param.nargs == 1
            assert param.required
            arguments.append((param.name, kind_of(param)))
        elif getattr(param, "is_flag", False):
            assert not param.multiple
            assert param.type.name == "boolean"
            expected.update(dict.fromkeys(param.opts, (param.name, "on")))
            expected.update(dict.fromkeys(param.secondary_opts, (param.name, "off")))
        else:
            assert param.nargs == 1
            assert not param.secondary_opts
            expected.update({spelling: (param.name, kind_of(param)) for spelling in param.opts})
    actual = {spelling: (o.parameter.name, quick_kind(o)) for spelling, o in options.items()}
    assert actual == expected
    positionals = [p for p in parameters(name) if p.positional]
    assert [(p.name, KINDS[p.value_type]) for p in positionals] == arguments


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_requests_default_to_typers_defaults(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The quick parser leaves out what is not given; the request's own defaults must then
    be what Typer would have passed, and its fields are Typer's parameters, in order."""
    fields = [f.name for f in dataclasses.fields(COMMANDS[name].request)]
    assert fields == [p.name for p in click_command(name).params]
    positionals = [p for p in parameters(name) if p.positional]
    from_typer = request_from_typer([name, *("a" for _ in positionals)], monkeypatch)
    assert text_of(from_typer) == text_of(
        request(name, {p.name: p.parse("a") for p in positionals})
    )


# ------------------------------------------------------------------ random command lines


def request_from_typer(args: list[str], monkeypatch: pytest.MonkeyPatch) -> Any:
    """The request Typer hands the body for `args` (raises Click's error if it refuses
    them)."""
    seen: list[Any] = []
    module, function = COMMANDS[args[0]].body
    monkeypatch.setattr(f"{module}.{function}", seen.append)
    typer_app.run(args)
    (built,) = seen
    return built


def text_of(built: Any) -> str:
    """A request as text to compare: a NaN equals a NaN, -0.0 is not 0.0, a tuple is not
    a list, and an enum says which it is."""
    return repr(built)


TRICKY = ["-", "--", "-x", "-q", "=", "a=b", "--force", "--help", "-1", "1e3", "nan", "inf"]
TEXT = st.one_of(st.sampled_from(TRICKY), st.text(max_size=6))
VALUES: dict[str, st.SearchStrategy[str]] = {
    "str": TEXT,
    "float": st.one_of(st.floats().map(repr), st.sampled_from(["1_0", " 2", "0x1", "-0"]), TEXT),
    "count": st.one_of(st.integers(-2, 20).map(str), TEXT),
    "path": TEXT,
    "format": st.one_of(st.sampled_from([*(f.value for f in OutputFormat), "JSON"]), TEXT),
    "sort": st.one_of(st.sampled_from([*(s.value for s in SortKey), "Name"]), TEXT),
    "listing-sort": st.one_of(st.sampled_from([*(s.value for s in SortKey), "Name"]), TEXT),
}


@st.composite
def command_lines(draw: st.DrawFn, ordinary: bool = False) -> list[str]:
    """A command with options in any order among its positionals. Ordinary lines spell
    every option out with a plain value; others mix in '=' forms, strange values, a
    missing value, a positional too many or too few."""
    name = draw(st.sampled_from(sorted(COMMANDS)))
    options = spellings(name)
    plain = st.text(alphabet="abcXYZ019._/", min_size=1, max_size=8)
    # Positionals keep their order; '-' is OUT on stdout (`clip IN -`).
    positionals = [p for p in parameters(name) if p.positional]
    units = [[draw(st.one_of(plain, st.just("-")))] for _ in positionals]
    if not ordinary and draw(st.booleans()):
        units = units[: draw(st.integers(0, len(units)))] + [
            [t] for t in draw(st.lists(TEXT, max_size=1))
        ]
    last: list[str] = []  # an option with no value after it, only ever at the end
    for spelling in draw(st.lists(st.sampled_from(sorted(options)), max_size=5)):
        option = options[spelling]
        at = draw(st.integers(0, len(units)))
        if option.flag is not None:
            units.insert(at, [spelling])
            continue
        kind = quick_kind(option).rstrip("*")
        if ordinary:
            value = {
                "str": draw(plain),
                "path": draw(plain),
                "float": repr(draw(st.floats(allow_nan=False, allow_infinity=False))),
                "count": str(draw(st.integers(1, 99))),
                "format": draw(st.sampled_from([f.value for f in OutputFormat])),
                "sort": draw(st.sampled_from([s.value for s in SortKey])),
                "listing-sort": draw(st.sampled_from([s.value for s in ListingSortKey])),
            }[kind]
        else:
            value = draw(VALUES[kind])
        if not ordinary and draw(st.booleans()):  # -f=json is "=json" to Click
            units.insert(at, [f"{spelling}={value}"])
        elif not ordinary and draw(st.integers(0, 20)) == 0:
            last = [spelling]
        else:
            units.insert(at, [spelling, value])
    tokens = [token for unit in units for token in unit] + last
    return [name, *tokens]


@given(args=command_lines())
def test_what_the_quick_parser_takes_typer_parses_alike(args: list[str]) -> None:
    parsed = quick_args.parse(args)
    with pytest.MonkeyPatch.context() as monkeypatch:
        try:
            from_typer = request_from_typer(args, monkeypatch)
        except Exception:  # Click refused the line: the quick parser must not take it
            from_typer = None
    if from_typer is None:
        assert parsed is None, f"Typer refused {args}, the quick parser took it"
        return
    if parsed is not None:
        name, built = parsed
        assert name == args[0]
        assert text_of(built) == text_of(from_typer), args


@pytest.mark.parametrize(
    "args",
    [
        ["norms", "m", "--top", "3", "--top", "5"],  # the last wins
        ["norms", "m", "--force", "--no-force", "--plot", "p.png"],
        ["norms", "m", "--no-chart", "--chart"],
        ["clip", "a", "-", "--min", "-3", "--max", "-1"],  # values that look like options
        ["ls", "m", "--include", "--help", "-x", "-i"],
        ["ls", "m", "-i", "a", "--include=b", "-i", "", "--exclude", "c"],
        ["ls", "m", "--sort=size"],  # (an empty PATH: both refuse, see below)
        ["diff", "a", "b", "--fail-above", "1_0", "--fail-above", " 2"],
        ["clip", "a", "b", "--value", "nan", "--axes", "0,-1", "--no-fsync", "--fsync"],
        ["convert", "a", "b/", "-q", "--no-force"],
    ],
)
def test_known_command_lines_parse_alike(args: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    parsed = quick_args.parse(args)
    assert parsed is not None
    _, built = parsed
    assert text_of(built) == text_of(request_from_typer(args, monkeypatch))


@given(args=command_lines(ordinary=True))
def test_the_quick_parser_takes_ordinary_command_lines(args: list[str]) -> None:
    assert quick_args.parse(args) is not None, args


@pytest.mark.parametrize(
    "args",
    [
        ["ls", "m.safetensors", "--help"],
        ["ls", "-h"],
        ["ls"],
        ["ls", "a", "b"],
        ["norms", "m", "--top", "0"],
        ["norms", "m", "-fjson"],
        ["clip", "-qf", "json", "a", "b"],
        ["clip", "a", "b", "--", "--force"],
        ["norms", "m", "--chart=yes"],
        ["norms", "m", "--format", "JSON"],
        ["lsx", "m"],
        ["ls", "m", "--include"],  # no value follows
        ["ls", "m", "-f=json"],  # Click: the value "=json"
        ["ls", "m", "-i=a"],
        ["clip", "a", "b", "--global", "1", "--group-by"],
        ["--version", "ls"],
    ],
)
def test_unusual_command_lines_go_to_typer(args: list[str]) -> None:
    assert quick_args.parse(args) is None


def test_completion_goes_to_typer(monkeypatch: pytest.MonkeyPatch) -> None:
    assert quick_args.parse(["ls", "m"]) is not None
    monkeypatch.setenv("_CLIPCLI_COMPLETE", "complete_bash")
    assert quick_args.parse(["ls", "m"]) is None


# ------------------------------------------------------------------ whole runs, both ways


def run_through_typer(args: list[str]) -> int:
    """main() as it would run if the quick parser took nothing."""
    boundary.reset()
    try:
        result = typer_app.run(args)
        sys.stdout.flush()
    except BaseException as exc:
        return boundary.exit_code_for(exc, args)
    return int(result) if isinstance(result, int) else 0


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from safetensors.numpy import save_file

    rng = np.random.default_rng(12)
    path = tmp_path_factory.mktemp("quick") / "m.safetensors"
    tensors = {
        "layers.0.weight": rng.standard_normal((8, 4)).astype(np.float32),
        "layers.0.bias": rng.standard_normal(8).astype(np.float32),
        "layers.1.weight": (10 * rng.standard_normal((4, 8))).astype(np.float32),
    }
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path


def both_ways(
    args: Callable[[Path], list[str]], model: Path, capsys: pytest.CaptureFixture[str]
) -> Iterator[tuple[int, str, str]]:
    line = args(model)
    assert quick_args.parse(line) is not None  # main() takes the quick path
    for run in (main, run_through_typer):
        out = model.parent / "out.safetensors"
        out.unlink(missing_ok=True)
        capsys.readouterr()
        code = run(line)
        captured = capsys.readouterr()
        yield code, captured.out, captured.err


@pytest.mark.parametrize(
    "args",
    [
        lambda m: ["ls", str(m)],
        lambda m: ["ls", str(m), "--format", "json", "--sort", "name", "-i", "layers.0.*"],
        lambda m: ["norms", str(m), "--top", "2", "--sort", "norm", "-f", "csv"],
        lambda m: ["norms", str(m), "--group-by", "layer", "--format=json"],
        lambda m: ["norms", str(m), "--fail-above", "1"],  # a verdict: exit 1
        lambda m: ["norms", str(m), "--limit", "3"],  # refused in the body: exit 2
        lambda m: ["norms", str(m), "-i", "nothing*"],  # refused selection: exit 2
        lambda m: ["norms", str(m.parent / "missing.safetensors")],  # exit 3
        lambda m: ["clip", str(m), str(m.parent / "out.safetensors"), "--global", "1"],
        lambda m: ["clip", str(m), str(m.parent / "out.safetensors"), "--min", "-1"],
        lambda m: ["clip", str(m), str(m), "--norm", "1", "--force"],  # OUT is IN: exit 2
        lambda m: ["convert", str(m), str(m.parent / "out.safetensors"), "-q"],
        lambda m: ["diff", str(m), str(m), "--changed-only"],
    ],
)
def test_runs_are_the_same_through_either_parser(
    args: Callable[[Path], list[str]], model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    quick, through_typer = both_ways(args, model, capsys)
    assert quick == through_typer


def test_an_ordinary_run_never_imports_typer(model: Path) -> None:
    """The point of the quick parser (measured in benchmarks/startup.py): checked in a
    fresh interpreter, as a shell loop runs it."""
    code = (
        "import sys\n"
        "from clipcli.cli.entry import main\n"
        f"assert main(['norms', {str(model)!r}, '--format', 'json']) == 0\n"
        "assert 'typer' not in sys.modules, 'typer was imported'\n"
        "assert main(['norms', '--help']) == 0\n"
        "assert 'typer' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


# --------------------------------------------------- issue 23, item 10: an empty path

EMPTY_LINES = [
    ["ls", ""],
    ["ls", "", "--sort=size"],
    ["norms", ""],
    ["norms", "", "--top", "3"],
    ["norms", "m.npz", "--plot", ""],
    ["norms", "m.npz", "--plot="],
    ["clip", "--global", "1", "", "o.npz"],
    ["clip", "--global", "1", "m.npz", ""],
    ["convert", "", "o.npz"],
    ["convert", "m.npz", ""],
    ["diff", "", "m.npz"],
    ["diff", "m.npz", ""],
]


@pytest.mark.parametrize("args", EMPTY_LINES)
def test_an_empty_path_is_a_usage_error(
    args: list[str], tmp_path: Path, run_main: RunCli, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Never the current directory: here it holds a checkpoint that must not be read."""
    np.savez(tmp_path / "m.npz", w=np.ones(3))
    save_file({"w": np.ones(3, np.float32)}, tmp_path / "model.safetensors")
    monkeypatch.chdir(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    done = run_main(*args)
    assert done.code == 2
    assert "an empty path (is a variable unset?)" in one_error_line(done.stderr)
    assert done.stdout == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.parametrize("args", EMPTY_LINES)
def test_both_parsers_refuse_an_empty_path(args: list[str], cli: RunCli) -> None:
    """The quick parser hands such a line to Typer, and Typer itself refuses it."""
    assert quick_args.parse(args) is None
    done = cli(*args)  # Typer's app directly (CliRunner)
    assert done.code == 2
    assert "an empty path (is a variable unset?)" in done.stderr
