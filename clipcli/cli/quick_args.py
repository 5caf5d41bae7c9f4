"""Ordinary command lines, parsed without Typer.

Importing Typer (and the Click it vendors) costs ~30 ms, about a quarter of a shell loop's
`clipcli ls small.safetensors`. Most command lines are plain: a command, its paths, and
options spelled out. This parser takes exactly those and gives the command's body the
values Typer would; anything else (--help, a typo, a bad value, bundled short flags, `--`,
completion) gets None and goes to Typer, which parses it again and owns every usage error,
help text and message.

The option table below restates what options.py declares for Typer. tests/test_quick_args
checks it against Typer's own parameters (names, flags, types, choices, bounds, defaults)
and checks that both parsers give the same values for random command lines.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from clipcli.report import ListingSortKey, OutputFormat, SortKey

Convert = Callable[[str], Any]  # raises ValueError on a value Typer would refuse
ON, OFF = "on", "off"  # a flag's two spellings: --force sets True, --no-force False


def _at_least_one(text: str) -> int:
    number = int(text)
    if number < 1:
        raise ValueError(text)
    return number


def _string(text: str) -> str:
    return text


def _listing_sort(text: str) -> SortKey:
    """ls's --sort: Typer's choices are ListingSortKey's; the body takes a SortKey."""
    return SortKey(ListingSortKey(text).value)


def _path(text: str) -> Path:
    """An empty path is Typer's to refuse (Path('') would be '.', the current directory)."""
    if not text:
        raise ValueError(text)
    return Path(text)


# Typer's Path conversion is `Path(text)`: nothing is resolved or checked while parsing.
_OPTION_KINDS: dict[str, Convert] = {
    "str": _string,
    "float": float,
    "count": _at_least_one,
    "path": _path,
    "format": OutputFormat,
    "sort": SortKey,
    "listing-sort": _listing_sort,
}


class Option:
    """One spelling of an option: the body's parameter it sets, and how."""

    __slots__ = ("convert", "flag", "many", "param")

    def __init__(self, param: str, kind: str, many: bool = False) -> None:
        self.param = param
        self.flag = kind if kind in (ON, OFF) else None
        self.convert = None if self.flag else _OPTION_KINDS[kind]
        self.many = many


class Command:
    """A command's positional parameters (in order, with their conversion) and options by
    spelling."""

    __slots__ = ("options", "positionals")

    def __init__(self, positionals: list[tuple[str, Convert]], options: dict[str, Option]):
        self.positionals = positionals
        self.options = options


def _spellings(*entries: tuple[str, str, str]) -> dict[str, Option]:
    """(spellings separated by spaces, parameter, kind) -> {spelling: Option}. A kind
    "str*" is a repeatable string option, gathered into a list in order."""
    table: dict[str, Option] = {}
    for spellings, param, kind in entries:
        many = kind.endswith("*")
        for spelling in spellings.split():
            table[spelling] = Option(param, kind.rstrip("*"), many)
    return table


_FORMAT = ("--format -f", "fmt", "format")
_JSON = ("--json", "as_json", ON)
_INCLUDE = ("--include -i", "include", "str*")
_EXCLUDE = ("--exclude -x", "exclude", "str*")
_ALL_TENSORS = ("--all-tensors", "all_tensors", ON)
_FORCE = ("--force", "force", ON)
_NO_FORCE = ("--no-force", "force", OFF)
_QUIET = ("--quiet -q", "quiet", ON)
_LARGE_SIDE_FILES = ("--allow-large-side-files", "allow_large_side_files", ON)
_LOSSY = ("--allow-lossy", "allow_lossy", ON)
_SORT = ("--sort", "sort", "sort")
_TOP = ("--top", "top", "count")

COMMANDS: dict[str, Command] = {
    "ls": Command(
        [("path", Path)],
        _spellings(_FORMAT, _JSON, _QUIET, _INCLUDE, _EXCLUDE, ("--sort", "sort", "listing-sort")),
    ),
    "norms": Command(
        [("path", Path)],
        _spellings(
            _FORMAT,
            _JSON,
            _QUIET,
            _INCLUDE,
            _EXCLUDE,
            _SORT,
            _TOP,
            ("--fail-above", "fail_above", "float"),
            ("--group-by", "group_by", "str"),
            ("--chart", "chart", ON),
            ("--no-chart", "chart", OFF),
            ("--limit", "limit", "float"),
            ("--plot", "plot", "path"),
            _FORCE,
            _NO_FORCE,
            _ALL_TENSORS,
        ),
    ),
    "clip": Command(
        [("src", Path), ("out", _string)],
        _spellings(
            ("--min", "low", "float"),
            ("--max", "high", "float"),
            ("--value", "value", "float"),
            ("--norm", "norm", "float"),
            ("--axes", "axes", "str"),
            ("--skip-low-rank", "skip_low_rank", ON),
            ("--average", "average", "float"),
            ("--global", "global_", "float"),
            ("--use-norm", "use_norm", "float"),
            ("--group-by", "group_by", "str"),
            _INCLUDE,
            _EXCLUDE,
            ("--skip-nonfinite", "skip_nonfinite", ON),
            ("--no-skip-nonfinite", "skip_nonfinite", OFF),
            ("--dry-run", "dry_run", ON),
            ("--no-dry-run", "dry_run", OFF),
            _FORCE,
            _NO_FORCE,
            ("--fsync", "fsync", ON),
            ("--no-fsync", "fsync", OFF),
            _QUIET,
            _FORMAT,
            _JSON,
            _SORT,
            _TOP,
            _LARGE_SIDE_FILES,
            _ALL_TENSORS,
            _LOSSY,
        ),
    ),
    "convert": Command(
        [("src", Path), ("out", _string)],
        _spellings(
            _FORCE, _NO_FORCE, _QUIET, _LARGE_SIDE_FILES, _LOSSY, ("--dtype", "dtype", "str")
        ),
    ),
    "diff": Command(
        [("path_a", Path), ("path_b", Path)],
        _spellings(
            _FORMAT,
            _JSON,
            _QUIET,
            _INCLUDE,
            _EXCLUDE,
            ("--changed-only", "changed_only", ON),
            ("--no-changed-only", "changed_only", OFF),
            _SORT,
            _TOP,
            ("--fail-above", "fail_above", "float"),
            _ALL_TENSORS,
        ),
    ),
}


def parse(args: list[str]) -> tuple[str, dict[str, Any]] | None:
    """(command, its body's keyword arguments) for an ordinary command line, or None for
    Typer to handle. Options not given are left out: the body's defaults apply."""
    if not args or args[0] not in COMMANDS or _completing():
        return None
    command = COMMANDS[args[0]]
    positional: list[str] = []
    values: dict[str, Any] = {}
    rest = iter(args[1:])
    for token in rest:
        if token == "-" or not token.startswith("-"):
            positional.append(token)
            continue
        # `--name=value` for long options; a short one is looked up whole, so `-f=json`
        # and bundles like -qf or -fjson are not found and go to Typer.
        spelling, equals, attached = token.partition("=") if token[1] == "-" else (token, "", "")
        option = command.options.get(spelling)
        if option is None:  # --help, --, an unknown option, -qf, -fjson
            return None
        if option.flag is not None:
            if equals:  # Click: "Option '--force' does not take a value"
                return None
            values[option.param] = option.flag == ON
            continue
        # Click takes the next argument as the value whatever it looks like (`--min -3`).
        text = attached if equals else next(rest, None)
        if text is None:
            return None
        try:
            value = option.convert(text)  # type: ignore[misc]  # not a flag: set
        except ValueError:
            return None
        if option.many:
            values.setdefault(option.param, []).append(value)
        else:  # given twice: the last wins, as in Click
            values[option.param] = value
    if len(positional) != len(command.positionals) or "" in positional:
        return None  # Typer says what is wrong (an empty PATH: is a variable unset?)
    for (param, convert), text in zip(command.positionals, positional, strict=True):
        values[param] = convert(text)
    return args[0], values


def _completing() -> bool:
    """Shell completion asks through the environment; Typer answers it."""
    return any(name.startswith(("_CLIPCLI_COMPLETE", "_TYPER_COMPLETE")) for name in os.environ)
