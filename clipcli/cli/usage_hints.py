"""What to type instead: the hint that ends a usage error's one line.

Click (through Typer) finds the usage errors; its own suggestions were wrong for what
newcomers reach for (issue 23, item 8): `clipcli version` was told to try
`clipcli version --help`, `norms --json` to try `--sort`. Each hint here is a command line
or an option to type, built from what the user typed. Command lines are quoted for a POSIX
shell (shlex); the boundary escapes control characters when it prints the line.

Which command has which option is read from the declarations (clipcli/cli/declarations.py),
which the Typer app is generated from: no Typer import is needed to know it.
"""

from __future__ import annotations

from collections.abc import Sequence

from clipcli.cli.declarations import COMMANDS, Spelling, spellings
from clipcli.report import OutputFormat

CLI = "clipcli"
OUT_OPTIONS = ("-o", "--output", "--out")  # what `cp`-style OUT is often spelled as
ONE_PATH = ("ls", "norms")


def hinted(message: str, args: Sequence[str]) -> str:
    """Click's usage error `message` (one line, no final full stop) for `args`, with the
    hint that says what to type instead."""
    command = _command_named(args)
    if message.startswith("No such command"):
        return _no_such_command(args)
    if message.startswith("No such option:"):
        option = message.removeprefix("No such option:").strip().split(" ", 1)[0]
        if command is not None:
            return f"No such option: {option}; {_option_hint(command, option, args)}"
        named = next((a for a in args if a in COMMANDS), None)
        if named is not None and option not in ("-V", "--version"):  # `clipcli -q norms m`
            at = list(args).index(named)
            line = _line([named, *args[:at], *args[at + 1 :]])
            return f"No such option: {option}; options go after the command: {line}"
    if message.startswith("Got unexpected extra argument") and command is not None:
        return f"{message}; {_extra_argument_hint(command, args)}"
    if (
        command == "ls"
        and message.startswith("Invalid value for '--sort'")
        and _value_of(args, "--sort") == "norm"
    ):
        _, rest = _without_option(args[1:], "--sort")
        line = _line(["norms", "--sort", "norm", *rest])
        return f"ls reads no tensor data, so it cannot sort by norm; type: {line}"
    if message.startswith("Missing argument"):
        return f"{message}; see '{_help_of(command)}'"
    return message


# ------------------------------------------------------------------ commands


def _no_such_command(args: Sequence[str]) -> str:
    import difflib

    at = next((i for i, a in enumerate(args) if not a.startswith("-")), 0)
    name = args[at] if args else ""
    said = f"No such command {name!r}"
    if name in ("version", "--version"):
        return f"{said}; for the version, type: {CLI} --version"
    if name == "help":
        asked = args[at + 1] if at + 1 < len(args) else None
        return f"{said}; for help, type: {_help_of(asked if asked in COMMANDS else None)}"
    close = difflib.get_close_matches(name, list(COMMANDS), n=1, cutoff=0.6)
    if close:
        return f"{said}; did you mean: {_line([*args[:at], close[0], *args[at + 1 :]])}"
    names = ", ".join(COMMANDS)
    if "." in name or "/" in name:  # a path where the command goes
        line = _line(["ls", *args[at:]])
        return f"{said}; a command comes first ({names}), e.g. {line}"
    return f"{said}; the commands are {names} (see '{CLI} --help')"


# ------------------------------------------------------------------ options


def _option_hint(command: str, option: str, args: Sequence[str]) -> str:
    table = spellings(command)
    bare = option.lstrip("-")
    if option in ("-V", "--version"):
        return f"the version is clipcli's own option: {CLI} --version"
    if option in OUT_OPTIONS or option.startswith("--output="):
        return _out_hint(command, option, args)
    if bare in {f.value for f in OutputFormat} and option.startswith("--"):
        if "--format" in table:
            return f"type --format {bare}"
        return f"{command} prints one line, no report to format"
    others = [name for name in COMMANDS if option in spellings(name)]
    if others:
        return f"{command} has no {option}; {_joined(others)} {_have(others)} it"
    close = _close_options(table, option)
    if close:
        return f"did you mean {_joined(close, 'or')}? (see '{_help_of(command)}')"
    return f"see '{_help_of(command)}'"


def _out_hint(command: str, option: str, args: Sequence[str]) -> str:
    """OUT is a positional argument (cp's `SRC DST`), never an option: the line again with
    OUT in its place; for a report, a redirection."""
    value, rest = _without_option(args, option)
    if command in ("clip", "convert"):
        positionals = _positionals(spellings(command), rest[1:])
        if value is not None and len(positionals) == 1:
            at = rest.index(positionals[0], 1)
            line = _line([*rest[: at + 1], value, *rest[at + 1 :]])
            return f"OUT is the argument after IN, not an option; type: {line}"
        return f"OUT is the argument after IN, not an option: {CLI} {command} IN OUT"
    target = value if value is not None else "FILE"
    return (
        f"{command} writes its report to standard output; redirect it: "
        f"{_line(rest)} > {_line([target], bare=True)}"
    )


def _close_options(table: dict[str, Spelling], option: str) -> list[str]:
    import difflib

    if not option.startswith("--"):
        return []
    spelled = [s for s in table if s.startswith("--")]
    return difflib.get_close_matches(option, spelled, n=2, cutoff=0.6)


# ------------------------------------------------------------------ arguments


def _extra_argument_hint(command: str, args: Sequence[str]) -> str:
    if "--axes" in args and command == "clip":
        return "--axes takes one comma-separated list, e.g. --axes 0,1"
    paths = _positionals(spellings(command), list(args[1:]))
    if command in ONE_PATH:
        shown = " ".join(_line([p], bare=True) for p in paths)
        options = [a for a in args[1:] if a not in paths]
        each = _line([command, *options], bare=True)
        return (
            f"{command} reads one PATH; for several, run it once per file: "
            f'for f in {shown}; do {CLI} {each} "$f"; done'
        )
    if command == "diff":
        return f"diff compares two checkpoints: {CLI} diff A B"
    return f"{command} takes IN and OUT (see '{_help_of(command)}')"


# ------------------------------------------------------------------ pieces


def _command_named(args: Sequence[str]) -> str | None:
    return args[0] if args and args[0] in COMMANDS else None


def _help_of(command: str | None) -> str:
    return f"{CLI} {command} --help" if command else f"{CLI} --help"


def _line(args: Sequence[str], bare: bool = False) -> str:
    import shlex

    text = shlex.join(args)
    return text if bare else f"{CLI} {text}"


def _joined(names: Sequence[str], word: str = "and") -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} {word} {names[-1]}"


def _have(names: Sequence[str]) -> str:
    return "has" if len(names) == 1 else "have"


def _value_of(args: Sequence[str], option: str) -> str | None:
    for at, token in enumerate(args):
        if token == option and at + 1 < len(args):
            return args[at + 1]
        if token.startswith(option + "="):
            return token.partition("=")[2]
    return None


def _without_option(args: Sequence[str], option: str) -> tuple[str | None, list[str]]:
    """The value given to `option` (as `-o X`, `-oX`, `--output X` or `--output=X`) and
    the arguments without it."""
    name = option.partition("=")[0]
    rest: list[str] = []
    value: str | None = None
    tokens = iter(args)
    for token in tokens:
        if token == name:
            value = next(tokens, None)
        elif token.startswith(name + "="):
            value = token.partition("=")[2]
        elif name == "-o" and token.startswith("-o") and len(token) > 2:
            value = token[2:]
        else:
            rest.append(token)
    return value, rest


def _positionals(table: dict[str, Spelling], args: Sequence[str]) -> list[str]:
    """The positional arguments among `args`: what is neither an option nor its value."""
    found: list[str] = []
    tokens = iter(args)
    for token in tokens:
        if token == "--":
            found.extend(tokens)
        elif token == "-" or not token.startswith("-"):
            found.append(token)
        else:
            option = table.get(token)
            if option is not None and option.flag is None:
                next(tokens, None)  # its value
    return found
