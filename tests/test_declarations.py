"""Each command and option is declared once, as data (issue 19, part 3):
clipcli/cli/declarations.py. The Typer app, the quick parser and the usage hints derive
from it, and the bodies take one frozen request per command.

The last test adds a flag to clip the way a developer would (one field in its request)
and checks that --help, both parsers, Click's usage errors and the hints all know it.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Iterator
from typing import Any

import pytest
import typer.main

from clipcli.cli import declarations, quick_args, typer_app
from clipcli.cli.declarations import (
    COMMANDS,
    ClipRequest,
    Command,
    Option,
    body_of,
    option,
    parameters,
    spellings,
)
from clipcli.cli.entry import main
from clipcli.report import SortKey

Click = Any  # typer vendors click


def click_params(name: str) -> dict[str, Click]:
    group = typer.main.get_command(typer_app.app)
    return {p.name: p for p in group.commands[name].params}  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_body_takes_its_frozen_request(name: str) -> None:
    request = COMMANDS[name].request
    given = {p.name: p.parse("a") for p in parameters(name) if p.positional}
    built = declarations.request(name, given)
    assert type(built) is request
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.quiet = True
    body = body_of(name)
    hints = typing.get_type_hints(body)
    assert hints == {"request": request, "return": type(None)}


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_typer_says_what_the_table_declares(name: str) -> None:
    """Help, metavar and default of every Click parameter are the declaration's (the
    spellings and the values each takes: tests/test_quick_args.py)."""
    params = click_params(name)
    assert list(params) == [p.name for p in parameters(name)]
    for parameter in parameters(name):
        param, declared = params[parameter.name], parameter.declared
        assert param.help == declared.help, parameter.name
        if isinstance(declared, Option):
            assert param.metavar == declared.metavar, parameter.name
            assert param.show_default is declared.show_default, parameter.name
            assert param.default == (None if parameter.many else declared.default)
        else:
            assert (param.metavar, param.required) == (declared.metavar, True)


def test_a_shared_option_is_declared_once() -> None:
    """--include is one declaration, taken by four commands; a command may say it its own
    way (ls's --quiet) without declaring the option again."""
    taking = [name for name in COMMANDS if "--include" in spellings(name)]
    assert taking == ["ls", "norms", "clip", "diff"]
    declared = {spellings(name)["--include"].parameter.declared for name in taking}
    assert declared == {declarations.INCLUDE}
    quiet = {name: spellings(name)["-q"].parameter.declared for name in COMMANDS}
    assert quiet["norms"] == quiet["diff"] == declarations.QUIET
    assert quiet["ls"] == declarations.QUIET._replace(help=quiet["ls"].help)


def test_ls_takes_fewer_orders_and_gets_a_sort_key() -> None:
    """ls --sort offers no `norm` (it reads no data); its body gets a SortKey either way."""
    parsed = quick_args.parse(["ls", "m", "--sort", "size"])
    assert parsed is not None
    assert parsed[1].sort is SortKey.SIZE
    assert quick_args.parse(["ls", "m", "--sort", "norm"]) is None  # Typer refuses it


# ------------------------------------------------------------------ one more flag


@dataclasses.dataclass(frozen=True)
class ClipWithDemo(ClipRequest):
    """ClipRequest and one more field: all a new clip flag needs besides its use."""

    demo: float | None = option("--demo", help="A demonstration flag.", metavar="D")


@pytest.fixture
def clip_with_demo(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    """clip declared with --demo; its body records the request it gets."""
    received: list[Any] = []
    command = COMMANDS["clip"]
    monkeypatch.setitem(COMMANDS, "clip", Command(ClipWithDemo, *command[1:]))
    monkeypatch.setattr("clipcli.cli.commands.write.clip", received.append)
    parameters.cache_clear()
    spellings.cache_clear()
    yield received
    parameters.cache_clear()
    spellings.cache_clear()


def test_a_new_clip_flag_is_one_field(
    clip_with_demo: list[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    line = ["clip", "in.safetensors", "out.safetensors", "--global", "1", "--demo", "2.5"]
    # The quick parser takes it ...
    parsed = quick_args.parse(line)
    assert parsed is not None
    assert parsed[1].demo == 2.5
    assert main(line) == 0
    # ... and so does Typer (`--` sends the line there); the body gets the same request.
    assert main([*line[:1], "--global", "1", "--demo", "2.5", "--", *line[1:3]]) == 0
    first, second = clip_with_demo
    assert first == second == parsed[1]
    assert isinstance(first, ClipWithDemo)
    # --help lists it, Click refuses a bad value, and the hints know which command has it.
    capsys.readouterr()
    assert main(["clip", "--help"]) == 0
    assert "--demo D" in capsys.readouterr().out
    assert main([*line[:-1], "x"]) == 2
    assert "Invalid value for '--demo': 'x' is not a valid float" in capsys.readouterr().err
    assert main(["norms", "m", "--demo", "1"]) == 2
    assert "norms has no --demo; clip has it" in capsys.readouterr().err
