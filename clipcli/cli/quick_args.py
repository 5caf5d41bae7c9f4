"""Ordinary command lines, parsed without Typer.

Importing Typer (and the Click it vendors) costs ~30 ms, most of a shell loop's
`clipcli ls small.safetensors`. Most command lines are plain: a command, its paths, and
options spelled out. This parser takes exactly those and builds the command's request, as
Typer would; anything else (--help, a typo, a bad value, bundled short flags, `--`,
completion) gets None and goes to Typer, which parses it again and owns every usage error,
help text and message.

Both read the one table, clipcli/cli/declarations.py. tests/test_quick_args.py checks that
Typer's parameters are what the table declares and that both parsers build the same
request for random command lines.
"""

from __future__ import annotations

import os
from typing import Any

from clipcli.cli.declarations import COMMANDS, parameters, request, spellings

__all__ = ["COMMANDS", "parse"]


def parse(args: list[str]) -> tuple[str, Any] | None:
    """(command, its request) for an ordinary command line, or None for Typer to handle."""
    if not args or args[0] not in COMMANDS or _completing():
        return None
    command = args[0]
    options = spellings(command)
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
        option = options.get(spelling)
        if option is None:  # --help, --, an unknown option, -qf, -fjson
            return None
        parameter = option.parameter
        if option.flag is not None:
            if equals:  # Click: "Option '--force' does not take a value"
                return None
            values[parameter.name] = option.flag
            continue
        # Click takes the next argument as the value whatever it looks like (`--min -3`).
        text = attached if equals else next(rest, None)
        if text is None:
            return None
        try:
            value = parameter.parse(text)
        except ValueError:
            return None
        if parameter.many:
            values.setdefault(parameter.name, []).append(value)
        else:  # given twice: the last wins, as in Click
            values[parameter.name] = value
    arguments = [p for p in parameters(command) if p.positional]
    if len(positional) != len(arguments) or "" in positional:
        return None  # Typer says what is wrong (an empty PATH: is a variable unset?)
    for parameter, text in zip(arguments, positional, strict=True):
        values[parameter.name] = parameter.parse(text)
    return command, request(command, values)


def _completing() -> bool:
    """Shell completion asks through the environment; Typer answers it."""
    return any(name.startswith(("_CLIPCLI_COMPLETE", "_TYPER_COMPLETE")) for name in os.environ)
