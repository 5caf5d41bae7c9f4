"""The Typer app, for `--help`, shell completion, Click's usage errors, and every command
line that clipcli/cli/quick_args.py does not take: generated from the commands and options
declared in clipcli/cli/declarations.py, reporting failures through the one boundary
(boundary.py).

Ordinary command lines skip Typer altogether (its import alone costs ~30 ms of a shell
loop's `clipcli ls`); cli.main() chooses.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from typer._click.types import StringParamType
from typer.core import TyperCommand
from typer.main import TyperPath  # type: ignore[attr-defined]  # typer's own Path type

from clipcli import __version__
from clipcli.cli.boundary import run_command
from clipcli.cli.declarations import (
    COMMANDS,
    Option,
    Parameter,
    body_of,
    parameters,
    request,
)
from clipcli.errors import ExitCode, WriteError
from clipcli.formats.registry import readable_suffixes_text

EXIT_CODES_HELP = """\b
Exit codes:
  0    success
  1    --fail-above: the global norm exceeds the threshold
  2    usage error or refused request (bad option, OUT exists, OUT is IN)
  3    input unreadable, malformed or unsafe
  4    data refused (NaN/Inf where a norm is needed, axis out of range,
       quantized weights a clip would touch)
  5    writing failed; nothing was left behind
  70   internal error (set CLIPCLI_DEBUG=1 for the traceback)
  130  interrupted (143 for SIGTERM, 128+N for signal N); nothing was left behind"""

_APP_SETTINGS: dict[str, Any] = {
    "name": "clipcli",
    "help": f"Inspect L2 norms of checkpoint tensors ({readable_suffixes_text()}) and write "
    "clipped copies, with TensorFlow's clip_by_value / clip_by_norm / clip_by_average_norm / "
    "clip_by_global_norm semantics.\n\n"
    "\b\nExamples:\n"
    "  clipcli ls model.safetensors\n"
    "  clipcli norms model.safetensors --sort norm --top 10\n"
    "  clipcli clip --global 5.0 in.safetensors out.safetensors\n"
    "  clipcli clip --norm 1.0 --axes 0 in.h5 out.h5\n\n" + EXIT_CODES_HELP,
    "no_args_is_help": True,
    "add_completion": True,
    "rich_markup_mode": None,
    "pretty_exceptions_enable": False,
    "context_settings": {"help_option_names": ["-h", "--help"]},
}
app = typer.Typer(**_APP_SETTINGS)


class _Command(TyperCommand):
    """A command whose usage line names its arguments as the help and the README do
    (`clipcli ls [OPTIONS] PATH`): Typer would write a required one `{PATH}`."""

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        return [
            piece[1:-1] if piece.startswith("{") and piece.endswith("}") else piece
            for piece in super().collect_usage_pieces(ctx)
        ]


def _print_version(value: bool) -> None:
    if value:
        print(f"clipcli {__version__}")
        raise typer.Exit()


VersionOpt = Annotated[
    bool,
    typer.Option(
        "--version",
        "-V",
        help="Print the version and exit.",
        is_eager=True,
        callback=_print_version,
    ),
]


def _options(version: VersionOpt = False) -> None:
    """(the group's own options: --version, which its callback answers before any command)"""


# ------------------------------------------------------------------ the commands, generated

# An empty argument is refused (exit 2) before Path('') turns it into '.', the current
# directory: `clipcli norms "$CKPT"` with CKPT unset must not read whatever is here.
EMPTY_PATH = "an empty path (is a variable unset?)"


class _GivenPath(TyperPath):
    """Typer's path type (nothing checked on the file system), refusing ''."""

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        if value == "":
            self.fail(EMPTY_PATH, param, ctx)
        return super().convert(value, param, ctx)


class _GivenText(StringParamType):
    """Click's text type, refusing '' (OUT is text: its trailing '/' must survive)."""

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        if value == "":
            self.fail(EMPTY_PATH, param, ctx)
        return super().convert(value, param, ctx)


def _typer_parameter(parameter: Parameter) -> inspect.Parameter:
    """The declaration as Typer takes it: `name: Annotated[type, typer.Option(...)] = default`."""
    declared = parameter.declared
    value_type = parameter.value_type
    # Paths are taken as given. readable=False turns off Click's own `os.access` check,
    # which would call an unreadable input a usage error (exit 2) and an unreadable --plot
    # FILE (an output) unusable; the readers say why they cannot open an input (exit 3).
    given_path = {"readable": False, "click_type": _GivenPath(readable=False)}
    if not isinstance(declared, Option):  # a positional argument: required, never empty
        checked = given_path if value_type is Path else {"click_type": _GivenText()}
        info = typer.Argument(
            metavar=declared.metavar, help=declared.help, show_default=False, **checked
        )
        return inspect.Parameter(
            parameter.name,
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
            annotation=Annotated[value_type, info],
        )
    details: dict[str, Any] = {"help": declared.help}
    if declared.metavar is not None:
        details["metavar"] = declared.metavar
    if declared.minimum is not None:
        details["min"] = declared.minimum
    if not declared.show_default:
        details["show_default"] = False
    if value_type is Path:
        details.update(given_path)
    default = declared.default
    if parameter.many:  # Typer gathers a repeatable option into a list, None if not given
        value_type, default = list[value_type], None  # type: ignore[valid-type]
    elif declared.choices is not None:
        value_type = declared.choices
        default = None if default is None else declared.choices(default.value)
    annotation = value_type | None if parameter.optional or parameter.many else value_type
    return inspect.Parameter(
        parameter.name,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
        default=default,
        annotation=Annotated[annotation, typer.Option(*declared.names, **details)],
    )


def _from_typer(parameter: Parameter, value: Any) -> Any:
    """What Typer parsed, as the request holds it."""
    if parameter.many:
        return tuple(value or ())
    choices = getattr(parameter.declared, "choices", None)
    if choices is not None and value is not None:
        return parameter.value_type(value.value)
    return value


def _callback(name: str) -> Callable[..., None]:
    """The command as Typer calls it: the parsed values become the request, which the
    body gets inside the same boundary as main()'s (its failures: one line, an exit code;
    Click gets only the code)."""
    declared = parameters(name)

    def command(**values: Any) -> None:
        def body() -> None:
            built = {p.name: _from_typer(p, values[p.name]) for p in declared}
            body_of(name)(request(name, built))

        code = run_command(body)
        if code != ExitCode.OK:
            raise typer.Exit(code)

    command.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [_typer_parameter(p) for p in declared]
    )
    command.__doc__ = COMMANDS[name].help
    command.__name__ = command.__qualname__ = f"{name}_command"
    return command


# ------------------------------------------------------------------ the app


def _register(target: typer.Typer, names: list[str]) -> typer.Typer:
    for name in names:
        target.command(name, epilog=COMMANDS[name].epilog, cls=_Command)(_callback(name))
    return target


app.callback()(_options)
_register(app, list(COMMANDS))


def _app_for(args: list[str]) -> typer.Typer:
    """The app to run: for `clipcli CMD ...`, one holding CMD alone, since Typer builds the
    Click parameters of every registered command on each start (~10 ms); for anything
    else (--help, a typo), the whole app."""
    if args and args[0] in COMMANDS:
        one = typer.Typer(**_APP_SETTINGS)
        one.callback()(_options)  # a group still: with one command Typer would make it the root
        return _register(one, [args[0]])
    return app


def run(args: list[str]) -> Any:
    """Parse `args` with Typer and run the command; Click's exceptions propagate to the
    caller's boundary (standalone_mode=False)."""
    try:
        return _app_for(args)(args=args, prog_name="clipcli", standalone_mode=False)
    except BrokenPipeError:
        raise  # the reader went away: exit 0, as for a report
    except OSError as exc:
        # Commands report their own failures through the boundary (_within_boundary), so
        # what reaches here is Click's own printing: help, completion (`--help >/dev/full`).
        raise WriteError(f"standard output: cannot write: {exc.strerror or exc}") from None
