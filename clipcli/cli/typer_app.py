"""The Typer app, for `--help`, shell completion, Click's usage errors, and every command
line that clipcli/cli/quick_args.py does not take: the commands declared in options.py,
reporting their failures through the one boundary (boundary.py).

Ordinary command lines skip Typer altogether (its import alone costs ~30 ms of a shell
loop's `clipcli ls`); cli.main() chooses.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import typer
from typer.core import TyperCommand

from clipcli import __version__
from clipcli.cli.boundary import run_command
from clipcli.cli.options import COMMANDS
from clipcli.errors import ExitCode, WriteError

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
    "help": "Inspect L2 norms of checkpoint tensors (.npz, .safetensors, .h5/.hdf5) and write "
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

F = TypeVar("F", bound=Callable[..., None])


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


def _within_boundary(command: F) -> F:
    """A command run by Typer directly (tests' CliRunner) reports its failures through the
    same boundary as main(), handing Click only the exit code."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        code = run_command(lambda: command(*args, **kwargs))
        if code != ExitCode.OK:
            raise typer.Exit(code)

    return wrapper  # type: ignore[return-value]


# ------------------------------------------------------------------ the app


def _register(target: typer.Typer, names: list[str]) -> typer.Typer:
    for name in names:
        declaration, epilog = COMMANDS[name]
        target.command(name, epilog=epilog, cls=_Command)(_within_boundary(declaration))
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
