"""Every command and option of the command line, declared once, as data (issue 19).

A command's request is a frozen dataclass: its fields are the command's arguments and
options in --help order, each field's type is the value its body gets, and each field
carries its declaration (spellings, help, metavar, the values it accepts). COMMANDS names
each command's request, body, help and examples. Everything else is derived from here:

- typer_app.py generates the Typer app (--help, completion, Click's usage errors);
- quick_args.py parses ordinary command lines without importing Typer (start-up time);
- usage_hints.py knows which command has which option;
- the bodies (clipcli/cli/commands/) take the request: `clip(request: ClipRequest)`.

Adding an option is one field in its command's request, and its use in the body.

This module is imported by every run (the quick parser reads it): it imports neither Typer
nor the bodies. A field's type is read at run time, to parse its values.
"""

import dataclasses
import functools
import importlib
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, NamedTuple

from clipcli.report import ListingSortKey, OutputFormat, SortKey

DECLARED = "clipcli.declared"  # the key of a request field's declaration in its metadata


class Argument(NamedTuple):
    """A positional argument. An empty one is refused (exit 2) before Path('') turns it
    into '.', the current directory: `clipcli norms "$CKPT"` with CKPT unset must not read
    whatever is here."""

    metavar: str
    help: str

    def field(self) -> Any:
        return dataclasses.field(metadata={DECLARED: self})


class Option(NamedTuple):
    """An option. `names` as Typer takes them; none spells it from the field's name, as
    Typer does (`dry_run` is --dry-run, and a flag also gets --no-dry-run)."""

    names: tuple[str, ...]
    help: str
    default: Any = None
    metavar: str | None = None
    minimum: int | None = None  # an integer's least value
    choices: type[Enum] | None = None  # fewer values than the field's enum (ls: no norm)
    show_default: bool = True

    def field(self, **changes: Any) -> Any:
        """The dataclass field of one request; `changes` for this command alone (help)."""
        declared = self._replace(**changes)
        return dataclasses.field(default=declared.default, metadata={DECLARED: declared})


def option(*names: str, help: str, default: Any = None, **details: Any) -> Any:
    """A request field declared as an option of this command alone."""
    return Option(names, help, default, **details).field()


def flag(*names: str, help: str, default: bool = False) -> Any:
    """A bool option: given, it is True (--no-NAME sets False where it is spelled)."""
    return Option(names, help, default).field()


# ------------------------------------------------------------------ shared declarations

# Paths are taken as given, nothing checked on the file system: the readers say why they
# cannot open an input (exit 3), and --plot FILE is an output.
PATH = Argument(
    "PATH", "Checkpoint file, Hugging Face model directory, or *.safetensors.index.json."
)
IN = Argument("IN", "Input checkpoint file or model directory.")
# OUT is text, not a Path: a trailing "/" (write a model directory) must survive.
OUT = Argument(
    "OUT",
    "Output file (its extension picks the format), or a model directory: a name ending in "
    "/, or with no extension when IN is a model directory; '-' streams OUT to standard "
    "output as safetensors (a safetensors IN only; the report goes to stderr).",
)
FORMAT = Option(("--format", "-f"), "Report format.", OutputFormat.TABLE)
JSON = Option(("--json",), "Same as --format json.", False)
QUIET = Option(
    ("--quiet", "-q"),
    "Print no report: the exit code tells (1: --fail-above exceeded). Notes, warnings and "
    "errors still go to stderr.",
    False,
)
INCLUDE = Option(
    ("--include", "-i"),
    "Only tensors whose whole name matches this glob (repeatable; '*attn*' for a "
    "substring). A selection of nothing is refused (exit 2).",
    (),
)
EXCLUDE = Option(("--exclude", "-x"), "Skip tensors matching this glob (repeatable; wins).", ())
ALL_TENSORS = Option(
    ("--all-tensors",),
    "Also act on training state: optimizer slots and counters (optimizer_weights/, "
    "optimizer/, optimizer., optim_state) and BatchNorm running statistics. By default "
    "they are listed apart, left out of the global norm and copied bit for bit.",
    False,
)
STORED = Option(
    ("--stored",),
    "Show the tensors as stored: a quantized weight's codes, scales and zero points each as "
    "they are, instead of the weight they make up.",
    False,
)
# --sort and --top for every command that measures (norms, clip, diff).
SORT = Option(
    (),
    "Row order: name (natural: layers.2 before layers.10; the default), file order, norm "
    "(largest first, among what the global norm counts; the rest after; diff: ‖A−B‖), "
    "size. Groups come in name order unless sorted by norm.",
    SortKey.NAME,
)
TOP = Option((), "Show only the first N rows (tensors or groups).", minimum=1)
FAIL_ABOVE = Option((), "Exit 1 if the global norm exceeds X (or is NaN/Inf).", metavar="X")
GROUP_BY = Option(
    (),
    "Aggregate tensors into groups by this regex's first capture group (or whole match); "
    "'layer' is a preset for HF/Keras layer names.",
    metavar="REGEX",
)
FORCE = Option((), "Replace an existing OUT (never IN).", False)
ALLOW_LARGE_SIDE_FILES = Option(
    ("--allow-large-side-files",),
    "Copy a model directory's other files even over 1 GiB each (holes stay holes).",
    False,
)
ALLOW_LOSSY = Option(
    ("--allow-lossy",),
    "Write OUT even when its format cannot hold all of IN beyond the tensors (HDF5 "
    "attributes, groups and non-tensor datasets into .npz; file metadata into .npz; a model "
    "directory's index metadata, but total_size and total_parameters, into one file); one "
    "warning line names what was dropped. Without it that is refused (exit 2).",
    False,
)


# ------------------------------------------------------------------ the requests

# Each has a docstring: without one, @dataclass computes a signature for it (start-up time).


@dataclass(frozen=True)
class LsRequest:
    """`clipcli ls PATH [OPTIONS]`."""

    path: Path = PATH.field()
    fmt: OutputFormat = FORMAT.field()
    as_json: bool = JSON.field()
    quiet: bool = QUIET.field(
        help="Print no listing: the exit code tells whether the file can be read (3 if not). "
        "Notes, warnings and errors still go to stderr."
    )
    include: tuple[str, ...] = INCLUDE.field()
    exclude: tuple[str, ...] = EXCLUDE.field()
    sort: SortKey = SORT.field(
        choices=ListingSortKey,
        help="Row order: name (natural: layers.2 before layers.10; the default), file order, "
        "size. (ls reads no tensor data: for --sort norm, use norms.)",
    )
    stored: bool = STORED.field()


@dataclass(frozen=True)
class NormsRequest:
    """`clipcli norms PATH [OPTIONS]`."""

    path: Path = PATH.field()
    # With --plot FILE (or --chart) the table is printed only when --format asks for it.
    fmt: OutputFormat | None = FORMAT.field(
        default=None,
        help="Report format [default: table; with --plot, no report unless given].",
        show_default=False,
    )
    as_json: bool = JSON.field()
    quiet: bool = QUIET.field()
    include: tuple[str, ...] = INCLUDE.field()
    exclude: tuple[str, ...] = EXCLUDE.field()
    sort: SortKey = SORT.field()
    top: int | None = TOP.field()
    fail_above: float | None = FAIL_ABOVE.field()
    group_by: str | None = GROUP_BY.field()
    chart: bool = flag(help="Draw horizontal bars of the listed norms instead of the table.")
    limit: float | None = option(
        help="Mark this norm on --chart/--plot and colour what is over it.", metavar="C"
    )
    plot: Path | None = option(
        help="Write the listed norms as a picture to FILE.png or FILE.svg; needs matplotlib "
        "(clipcli's 'plot' extra).",
        metavar="FILE",
    )
    force: bool = FORCE.field(help="Replace an existing --plot FILE.")
    all_tensors: bool = ALL_TENSORS.field()
    stored: bool = STORED.field()


@dataclass(frozen=True)
class ClipRequest:
    """`clipcli clip IN OUT [OPTIONS]`."""

    src: Path = IN.field()
    out: str = OUT.field()
    low: float | None = option("--min", help="clip_by_value lower bound.", metavar="X")
    high: float | None = option("--max", help="clip_by_value upper bound.", metavar="Y")
    value: float | None = option("--value", help="Same as --min -V --max V.", metavar="V")
    norm: float | None = option("--norm", help="clip_by_norm: t * C / max(||t||, C).", metavar="C")
    axes: str | None = option(
        help="With --norm: axes to take the norm over, e.g. 0 or 0,-1.", metavar="A"
    )
    skip_low_rank: bool = flag(
        "--skip-low-rank",
        help="With --axes: leave tensors with too few dimensions for the axes (biases, norms) "
        "unchanged and report them as skipped, instead of refusing (exit 4).",
    )
    average: float | None = option(
        "--average", help="clip_by_average_norm: ||t|| / numel(t) <= C.", metavar="C"
    )
    global_: float | None = option(
        "--global", help="clip_by_global_norm over all selected tensors.", metavar="C"
    )
    use_norm: float | None = option(
        help="With --global: use this global norm instead of computing it.", metavar="N"
    )
    group_by: str | None = GROUP_BY.field(
        help="With --global: clip each group's global norm separately (per-layer clipping); "
        "groups as in `norms --group-by`, 'layer' is a preset."
    )
    include: tuple[str, ...] = INCLUDE.field()
    exclude: tuple[str, ...] = EXCLUDE.field()
    skip_nonfinite: bool = flag(
        help="Leave tensors holding NaN/Inf unchanged instead of refusing (exit 4)."
    )
    dry_run: bool = flag(help="Compute and report the plan; write nothing.")
    force: bool = FORCE.field()
    fsync: bool = flag(
        help="fsync OUT and its directory before reporting success. --no-fsync is faster for "
        "scratch outputs; the rename stays atomic either way.",
        default=True,
    )
    quiet: bool = QUIET.field(
        help="Print no report. Notes, warnings and errors still go to stderr."
    )
    fmt: OutputFormat = FORMAT.field()
    as_json: bool = JSON.field()
    sort: SortKey = SORT.field()
    top: int | None = TOP.field()
    allow_large_side_files: bool = ALLOW_LARGE_SIDE_FILES.field()
    all_tensors: bool = ALL_TENSORS.field()
    allow_lossy: bool = ALLOW_LOSSY.field()


@dataclass(frozen=True)
class ConvertRequest:
    """`clipcli convert IN OUT [OPTIONS]`."""

    src: Path = IN.field()
    out: str = OUT.field()
    force: bool = FORCE.field()
    quiet: bool = QUIET.field(
        help="Print no 'wrote' line. Notes, warnings and errors still go to stderr."
    )
    allow_large_side_files: bool = ALLOW_LARGE_SIDE_FILES.field()
    allow_lossy: bool = ALLOW_LOSSY.field()
    dtype: str | None = option(
        "--dtype",
        help="Write the real weights as bfloat16, float16 or float32: quantized weights "
        "dequantized (named as the weight, scales not written; config.json loses its "
        "quantization_config), other float tensors cast, rounded to nearest even. A cast "
        "that overflows to inf is refused (exit 4) unless --allow-lossy.",
        metavar="DTYPE",
    )


@dataclass(frozen=True)
class DiffRequest:
    """`clipcli diff A B [OPTIONS]`."""

    path_a: Path = Argument("A", "Reference checkpoint.").field()
    path_b: Path = Argument("B", "Checkpoint to compare with A.").field()
    fmt: OutputFormat = FORMAT.field()
    as_json: bool = JSON.field()
    quiet: bool = QUIET.field()
    include: tuple[str, ...] = INCLUDE.field()
    exclude: tuple[str, ...] = EXCLUDE.field()
    changed_only: bool = flag(help="List only tensors that are not bit-identical.")
    sort: SortKey = SORT.field()
    top: int | None = TOP.field()
    fail_above: float | None = FAIL_ABOVE.field(
        help="Exit 1 if any tensor's relative change ‖A−B‖/‖A‖ exceeds X, or a tensor is "
        "missing, extra, or changed dtype or shape."
    )
    all_tensors: bool = ALL_TENSORS.field(
        help="Count training state (optimizer slots and counters, BatchNorm running "
        "statistics) in the global figures too. Every tensor is compared either way."
    )


# ------------------------------------------------------------------ the commands


class Command(NamedTuple):
    request: type[Any]  # the frozen dataclass above that the body takes
    body: tuple[str, str]  # (module, function), imported for the command's run only
    help: str
    epilog: str  # the examples under --help


COMMANDS: dict[str, Command] = {
    "ls": Command(
        LsRequest,
        ("clipcli.cli.commands.inspect", "ls"),
        "List tensors (name, dtype, shape, bytes; the shard in a model directory), the total\n"
        "parameter count and file metadata, reading no tensor data.",
        "\b\nExamples:\n"
        "  clipcli ls model.safetensors --format json\n"
        "  clipcli ls model_dir/ --include '*.layers.0.*' --sort size",
    ),
    "norms": Command(
        NormsRequest,
        ("clipcli.cli.commands.inspect", "norms"),
        "Per-tensor L2 norm, max |x| and non-finite count, and the global norm over\n"
        "floating-point model weights (optimizer state and BatchNorm statistics are listed\n"
        "apart unless --all-tensors). Accumulated exactly in float64.",
        "\b\nExamples:\n"
        "  clipcli norms model.safetensors\n"
        "  clipcli norms model.safetensors --sort norm --top 5 --format json\n"
        "  clipcli norms m.safetensors --fail-above 5 ||\n"
        "      clipcli clip --global 5 m.safetensors o.safetensors",
    ),
    "clip": Command(
        ClipRequest,
        ("clipcli.cli.commands.write", "clip"),
        "Write a clipped copy of IN to OUT. Choose exactly one mode: --min/--max/--value,\n"
        "--norm [--axes], --average or --global [--use-norm]. Tensors within the limit, not\n"
        "selected, not floating point, or training state (optimizer slots, BatchNorm\n"
        "statistics; unless --all-tensors) are copied bit-identical.",
        "\b\nExamples:\n"
        "  clipcli clip --global 5.0 in.safetensors out.safetensors\n"
        "  clipcli clip --norm 1.0 --axes 0 in.h5 out.h5        # per-column max-norm\n"
        "  clipcli clip --norm 1 --axes 1 --include '*self_attn*' --skip-low-rank \\\n"
        "      in.safetensors out.safetensors                   # rows; biases left as they are\n"
        "  clipcli clip --average 0.01 in.npz out.npz\n"
        "  clipcli clip --value 3 --include '*.weight' in.safetensors out.safetensors\n"
        "  clipcli clip --global 1 --dry-run --format json in.safetensors out.safetensors",
    ),
    "convert": Command(
        ConvertRequest,
        ("clipcli.cli.commands.write", "convert"),
        "Copy IN to OUT's format losslessly: same names, order, dtypes, shapes and values;\n"
        "metadata carried over where OUT's format can hold it. A dtype OUT cannot hold\n"
        "(bfloat16/fp8 into npz or HDF5) is refused.",
        "\b\nExamples:\n"
        "  clipcli convert model.npz model.safetensors\n"
        "  clipcli convert weights.h5 weights.safetensors --force",
    ),
    "diff": Command(
        DiffRequest,
        ("clipcli.cli.commands.compare", "diff"),
        "Compare two checkpoints (any formats) tensor by tensor: ‖A−B‖, ‖A−B‖/‖A‖,\n"
        "max |A−B|, cosine similarity and ‖B‖/‖A‖ (the scale a norm clip applied), plus missing\n"
        "or extra tensors, dtype/shape changes and metadata changes. Streams both files.",
        "\b\nExamples:\n"
        "  clipcli diff model.safetensors clipped.safetensors\n"
        "  clipcli diff old.npz new.safetensors --changed-only --format json\n"
        "  clipcli diff base/ merged/ --fail-above 0.05   # exit 1 if any tensor moved > 5%",
    ),
}


# ------------------------------------------------------------------ what the table says


def _path(text: str) -> Path:
    """Typer's Path conversion is `Path(text)`, nothing resolved or checked; an empty path
    is refused (Path('') would be '.')."""
    if not text:
        raise ValueError(text)
    return Path(text)


def _text(text: str) -> str:
    return text


class Parameter(NamedTuple):
    """One field of a request, resolved: its declaration and what its type says."""

    name: str  # the request's field (and Click's parameter name)
    declared: Argument | Option
    value_type: Any  # the type of one value: float, int, str, Path, bool or an Enum
    optional: bool  # None when not given
    many: bool  # repeatable, gathered into a tuple in order

    @property
    def positional(self) -> bool:
        return isinstance(self.declared, Argument)

    @property
    def is_flag(self) -> bool:
        return self.value_type is bool

    def spellings(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(what sets it, what sets a flag False): Typer's spellings of the declaration."""
        if isinstance(self.declared, Argument):
            return (), ()
        if self.declared.names:
            return self.declared.names, ()
        long = "--" + self.name.replace("_", "-")
        return (long,), (("--no-" + long[2:],) if self.is_flag else ())

    def parse(self, text: str) -> Any:
        """One value from the command line's text, as Typer would give it to the body;
        ValueError where Typer refuses it (and says why)."""
        declared = self.declared
        if isinstance(declared, Option) and declared.choices is not None:
            return self.value_type(declared.choices(text).value)
        convert: Callable[[str], Any] = {Path: _path, str: _text}.get(
            self.value_type, self.value_type
        )
        value = convert(text)
        minimum = getattr(declared, "minimum", None)
        if minimum is not None and value < minimum:
            raise ValueError(text)
        return value


def _resolve(field: "dataclasses.Field[Any]", annotation: Any) -> Parameter:
    args = typing.get_args(annotation)
    optional = isinstance(annotation, types.UnionType) and type(None) in args
    if optional:
        (annotation,) = (arg for arg in args if arg is not type(None))
    many = typing.get_origin(annotation) is tuple
    if many:
        annotation = typing.get_args(annotation)[0]
    return Parameter(field.name, field.metadata[DECLARED], annotation, optional, many)


@functools.cache
def parameters(command: str) -> tuple[Parameter, ...]:
    """The command's arguments and options, in --help order."""
    request = COMMANDS[command].request
    types_of = typing.get_type_hints(request)  # (a request declared elsewhere may be text)
    return tuple(_resolve(f, types_of[f.name]) for f in dataclasses.fields(request))


class Spelling(NamedTuple):
    parameter: Parameter
    flag: bool | None  # what a flag's spelling sets it to; None: a value follows


@functools.cache
def spellings(command: str) -> dict[str, Spelling]:
    """The command's options by every spelling (--format and -f, --force and --no-force)."""
    table: dict[str, Spelling] = {}
    for parameter in parameters(command):
        on, off = parameter.spellings()
        for spelling in on:
            table[spelling] = Spelling(parameter, True if parameter.is_flag else None)
        for spelling in off:
            table[spelling] = Spelling(parameter, False)
    return table


def body_of(command: str) -> Callable[[Any], None]:
    """The command's body, imported now (for this command's run only)."""
    module, function = COMMANDS[command].body
    body: Callable[[Any], None] = getattr(importlib.import_module(module), function)
    return body


def request(command: str, values: dict[str, Any]) -> Any:
    """The command's request from parsed values (a repeatable option's as a list); what is
    not given takes its declared default."""
    given = {name: tuple(v) if isinstance(v, list) else v for name, v in values.items()}
    return COMMANDS[command].request(**given)
