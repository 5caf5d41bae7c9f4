"""Every command's arguments and options as Typer declares them, with their help.

Each declaration hands its parsed values to the command's body in clipcli/cli/commands/, which
takes plain values. typer_app.py registers the declarations on the app. Ordinary command
lines never import this module: clipcli/cli/quick_args.py parses them without Typer, and
tests/test_quick_args.py holds the two to the same options, defaults and values.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from typer._click.types import StringParamType
from typer.main import TyperPath  # type: ignore[attr-defined]  # typer's own Path type

from clipcli.cli.commands import compare, inspect, write
from clipcli.report import ListingSortKey, OutputFormat, SortKey

F = TypeVar("F", bound=Callable[..., None])

# The declaration of each command, by name, with its epilog (the examples under --help).
COMMANDS: dict[str, tuple[Callable[..., None], str]] = {}


def _command(name: str, epilog: str) -> Callable[[F], F]:
    def declare(declaration: F) -> F:
        COMMANDS[name] = (declaration, epilog)
        return declaration

    return declare


LS_EPILOG = (
    "\b\nExamples:\n"
    "  clipcli ls model.safetensors --format json\n"
    "  clipcli ls model_dir/ --include '*.layers.0.*' --sort size"
)

CLIP_EPILOG = (
    "\b\nExamples:\n"
    "  clipcli clip --global 5.0 in.safetensors out.safetensors\n"
    "  clipcli clip --norm 1.0 --axes 0 in.h5 out.h5        # per-column max-norm\n"
    "  clipcli clip --norm 1 --axes 1 --include '*self_attn*' --skip-low-rank \\\n"
    "      in.safetensors out.safetensors                   # rows; biases left as they are\n"
    "  clipcli clip --average 0.01 in.npz out.npz\n"
    "  clipcli clip --value 3 --include '*.weight' in.safetensors out.safetensors\n"
    "  clipcli clip --global 1 --dry-run --format json in.safetensors out.safetensors"
)

DIFF_EPILOG = (
    "\b\nExamples:\n"
    "  clipcli diff model.safetensors clipped.safetensors\n"
    "  clipcli diff old.npz new.safetensors --changed-only --format json\n"
    "  clipcli diff base/ merged/ --fail-above 0.05   # exit 1 if any tensor moved > 5%"
)


# ------------------------------------------------------------------ shared declarations

# Paths are taken as given: readable=False turns off Click's own `os.access` check, which
# would call an unreadable input a usage error (exit 2) and an unreadable --plot FILE (an
# output) unusable. The readers say why they cannot open an input: exit 3, as documented.
# (quick_args.py converts paths the same way: Path(text), nothing checked.)
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


def _given_path() -> _GivenPath:
    return _GivenPath(readable=False)


PathArg = Annotated[
    Path,
    typer.Argument(
        metavar="PATH",
        help="Checkpoint file, Hugging Face model directory, or *.safetensors.index.json.",
        show_default=False,
        readable=False,
        click_type=_given_path(),
    ),
]
InArg = Annotated[
    Path,
    typer.Argument(
        metavar="IN",
        help="Input checkpoint file or model directory.",
        show_default=False,
        readable=False,
        click_type=_given_path(),
    ),
]
OutArg = Annotated[
    str,  # not Path: a trailing "/" (write a model directory) must survive
    typer.Argument(
        metavar="OUT",
        help="Output file (its extension picks the format), or a model directory: a "
        "name ending in /, or with no extension when IN is a model directory; '-' streams "
        "OUT to standard output as safetensors (a safetensors IN only; the report goes to "
        "stderr).",
        show_default=False,
        click_type=_GivenText(),
    ),
]
FormatOpt = Annotated[OutputFormat, typer.Option("--format", "-f", help="Report format.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Same as --format json.")]
ReportQuietOpt = Annotated[
    bool,
    typer.Option(
        "--quiet",
        "-q",
        help="Print no report: the exit code tells (1: --fail-above exceeded). Notes, "
        "warnings and errors still go to stderr.",
    ),
]
# norms: with --plot FILE (or --chart) the table is printed only when --format asks for it.
NormsFormatOpt = Annotated[
    OutputFormat | None,
    typer.Option(
        "--format",
        "-f",
        help="Report format [default: table; with --plot, no report unless given].",
        show_default=False,
    ),
]
IncludeOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--include",
        "-i",
        help="Only tensors whose whole name matches this glob (repeatable; '*attn*' for a "
        "substring). A selection of nothing is refused (exit 2).",
    ),
]
ExcludeOpt = Annotated[
    list[str] | None,
    typer.Option("--exclude", "-x", help="Skip tensors matching this glob (repeatable; wins)."),
]
AllTensorsOpt = Annotated[
    bool,
    typer.Option(
        "--all-tensors",
        help="Also act on training state: optimizer slots and counters (optimizer_weights/, "
        "optimizer/, optimizer., optim_state) and BatchNorm running statistics. By default "
        "they are listed apart, left out of the global norm and copied bit for bit.",
    ),
]
# One declaration of --sort and --top for every command that measures (norms, clip, diff).
SortOpt = Annotated[
    SortKey,
    typer.Option(
        help="Row order: name (natural: layers.2 before layers.10; the default), file order, "
        "norm (largest first, among what the global norm counts; the rest after; diff: "
        "‖A−B‖), size. Groups come in name order unless sorted by norm."
    ),
]
TopOpt = Annotated[
    int | None, typer.Option(help="Show only the first N rows (tensors or groups).", min=1)
]
AllowLargeSideFilesOpt = Annotated[
    bool,
    typer.Option(
        "--allow-large-side-files",
        help="Copy a model directory's other files even over 1 GiB each (holes stay holes).",
    ),
]


AllowLossyOpt = Annotated[
    bool,
    typer.Option(
        "--allow-lossy",
        help="Write OUT even when its format cannot hold all of IN beyond the tensors (HDF5 "
        "attributes, groups and non-tensor datasets into .npz; file metadata into .npz; a "
        "model directory's index metadata, but total_size and total_parameters, into one "
        "file); one warning line names what was dropped. Without it that is refused (exit 2).",
    ),
]


# ------------------------------------------------------------------ the commands


@_command("ls", LS_EPILOG)
def ls_command(
    path: PathArg,
    fmt: FormatOpt = OutputFormat.TABLE,
    as_json: JsonOpt = False,
    quiet: Annotated[
        bool,
        typer.Option(
            "--quiet",
            "-q",
            help="Print no listing: the exit code tells whether the file can be read (3 if "
            "not). Notes, warnings and errors still go to stderr.",
        ),
    ] = False,
    include: IncludeOpt = None,
    exclude: ExcludeOpt = None,
    sort: Annotated[
        ListingSortKey,
        typer.Option(
            help="Row order: name (natural: layers.2 before layers.10; the default), file "
            "order, size. (ls reads no tensor data: for --sort norm, use norms.)"
        ),
    ] = ListingSortKey.NAME,
) -> None:
    """List tensors (name, dtype, shape, bytes; the shard in a model directory), the total
    parameter count and file metadata, reading no tensor data."""
    inspect.ls(
        path=path,
        fmt=fmt,
        as_json=as_json,
        quiet=quiet,
        include=include,
        exclude=exclude,
        sort=SortKey(sort.value),
    )


@_command("norms", inspect.NORMS_EPILOG)
def norms_command(
    path: PathArg,
    fmt: NormsFormatOpt = None,
    as_json: JsonOpt = False,
    quiet: ReportQuietOpt = False,
    include: IncludeOpt = None,
    exclude: ExcludeOpt = None,
    sort: SortOpt = SortKey.NAME,
    top: TopOpt = None,
    fail_above: Annotated[
        float | None,
        typer.Option(help="Exit 1 if the global norm exceeds X (or is NaN/Inf).", metavar="X"),
    ] = None,
    group_by: Annotated[
        str | None,
        typer.Option(
            help="Aggregate tensors into groups by this regex's first capture group (or whole "
            "match); 'layer' is a preset for HF/Keras layer names.",
            metavar="REGEX",
        ),
    ] = None,
    chart: Annotated[
        bool,
        typer.Option(help="Draw horizontal bars of the listed norms instead of the table."),
    ] = False,
    limit: Annotated[
        float | None,
        typer.Option(
            help="Mark this norm on --chart/--plot and colour what is over it.", metavar="C"
        ),
    ] = None,
    plot: Annotated[
        Path | None,
        typer.Option(
            help="Write the listed norms as a picture to FILE.png or FILE.svg; needs "
            "matplotlib (clipcli's 'plot' extra).",
            metavar="FILE",
            readable=False,
            click_type=_given_path(),
        ),
    ] = None,
    force: Annotated[bool, typer.Option(help="Replace an existing --plot FILE.")] = False,
    all_tensors: AllTensorsOpt = False,
) -> None:
    """Per-tensor L2 norm, max |x| and non-finite count, and the global norm over
    floating-point model weights (optimizer state and BatchNorm statistics are listed
    apart unless --all-tensors). Accumulated exactly in float64."""
    inspect.norms(
        path=path,
        fmt=fmt,
        as_json=as_json,
        quiet=quiet,
        include=include,
        exclude=exclude,
        sort=sort,
        top=top,
        fail_above=fail_above,
        group_by=group_by,
        chart=chart,
        limit=limit,
        plot=plot,
        force=force,
        all_tensors=all_tensors,
    )


@_command("clip", CLIP_EPILOG)
def clip_command(
    src: InArg,
    out: OutArg,
    low: Annotated[
        float | None, typer.Option("--min", help="clip_by_value lower bound.", metavar="X")
    ] = None,
    high: Annotated[
        float | None, typer.Option("--max", help="clip_by_value upper bound.", metavar="Y")
    ] = None,
    value: Annotated[
        float | None, typer.Option("--value", help="Same as --min -V --max V.", metavar="V")
    ] = None,
    norm: Annotated[
        float | None,
        typer.Option("--norm", help="clip_by_norm: t * C / max(||t||, C).", metavar="C"),
    ] = None,
    axes: Annotated[
        str | None,
        typer.Option(help="With --norm: axes to take the norm over, e.g. 0 or 0,-1.", metavar="A"),
    ] = None,
    skip_low_rank: Annotated[
        bool,
        typer.Option(
            "--skip-low-rank",
            help="With --axes: leave tensors with too few dimensions for the axes (biases, "
            "norms) unchanged and report them as skipped, instead of refusing (exit 4).",
        ),
    ] = False,
    average: Annotated[
        float | None,
        typer.Option("--average", help="clip_by_average_norm: ||t|| / numel(t) <= C.", metavar="C"),
    ] = None,
    global_: Annotated[
        float | None,
        typer.Option(
            "--global", help="clip_by_global_norm over all selected tensors.", metavar="C"
        ),
    ] = None,
    use_norm: Annotated[
        float | None,
        typer.Option(
            help="With --global: use this global norm instead of computing it.", metavar="N"
        ),
    ] = None,
    group_by: Annotated[
        str | None,
        typer.Option(
            help="With --global: clip each group's global norm separately (per-layer "
            "clipping); groups as in `norms --group-by`, 'layer' is a preset.",
            metavar="REGEX",
        ),
    ] = None,
    include: IncludeOpt = None,
    exclude: ExcludeOpt = None,
    skip_nonfinite: Annotated[
        bool,
        typer.Option(help="Leave tensors holding NaN/Inf unchanged instead of refusing (exit 4)."),
    ] = False,
    dry_run: Annotated[
        bool, typer.Option(help="Compute and report the plan; write nothing.")
    ] = False,
    force: Annotated[bool, typer.Option(help="Replace an existing OUT (never IN).")] = False,
    fsync: Annotated[
        bool,
        typer.Option(
            help="fsync OUT and its directory before reporting success. --no-fsync is faster "
            "for scratch outputs; the rename stays atomic either way."
        ),
    ] = True,
    quiet: Annotated[
        bool,
        typer.Option(
            "--quiet",
            "-q",
            help="Print no report. Notes, warnings and errors still go to stderr.",
        ),
    ] = False,
    fmt: FormatOpt = OutputFormat.TABLE,
    as_json: JsonOpt = False,
    sort: SortOpt = SortKey.NAME,
    top: TopOpt = None,
    allow_large_side_files: AllowLargeSideFilesOpt = False,
    all_tensors: AllTensorsOpt = False,
    allow_lossy: AllowLossyOpt = False,
) -> None:
    """Write a clipped copy of IN to OUT. Choose exactly one mode: --min/--max/--value,
    --norm [--axes], --average or --global [--use-norm]. Tensors within the limit, not
    selected, not floating point, or training state (optimizer slots, BatchNorm
    statistics; unless --all-tensors) are copied bit-identical."""
    write.clip(
        src=src,
        out=out,
        low=low,
        high=high,
        value=value,
        norm=norm,
        axes=axes,
        skip_low_rank=skip_low_rank,
        average=average,
        global_=global_,
        use_norm=use_norm,
        group_by=group_by,
        include=include,
        exclude=exclude,
        skip_nonfinite=skip_nonfinite,
        dry_run=dry_run,
        force=force,
        fsync=fsync,
        quiet=quiet,
        fmt=fmt,
        as_json=as_json,
        sort=sort,
        top=top,
        allow_large_side_files=allow_large_side_files,
        all_tensors=all_tensors,
        allow_lossy=allow_lossy,
    )


@_command("convert", write.CONVERT_EPILOG)
def convert_command(
    src: InArg,
    out: OutArg,
    force: Annotated[bool, typer.Option(help="Replace an existing OUT (never IN).")] = False,
    quiet: Annotated[
        bool,
        typer.Option(
            "--quiet",
            "-q",
            help="Print no 'wrote' line. Notes, warnings and errors still go to stderr.",
        ),
    ] = False,
    allow_large_side_files: AllowLargeSideFilesOpt = False,
    allow_lossy: AllowLossyOpt = False,
    dtype: Annotated[
        str | None,
        typer.Option(
            "--dtype",
            metavar="DTYPE",
            help="Write the real weights as bfloat16, float16 or float32: quantized "
            "weights dequantized (named as the weight, scales not written; config.json "
            "loses its quantization_config), other float tensors cast, rounded to nearest "
            "even. A cast that overflows to inf is refused (exit 4) unless --allow-lossy.",
        ),
    ] = None,
) -> None:
    """Copy IN to OUT's format losslessly: same names, order, dtypes, shapes and values;
    metadata carried over where OUT's format can hold it. A dtype OUT cannot hold
    (bfloat16/fp8 into npz or HDF5) is refused. With --dtype: dequantized and cast."""
    write.convert(
        src=src,
        out=out,
        force=force,
        quiet=quiet,
        allow_large_side_files=allow_large_side_files,
        allow_lossy=allow_lossy,
        dtype=dtype,
    )


@_command("diff", DIFF_EPILOG)
def diff_command(
    path_a: Annotated[
        Path,
        typer.Argument(
            metavar="A", help="Reference checkpoint.", readable=False, click_type=_given_path()
        ),
    ],
    path_b: Annotated[
        Path,
        typer.Argument(
            metavar="B",
            help="Checkpoint to compare with A.",
            readable=False,
            click_type=_given_path(),
        ),
    ],
    fmt: FormatOpt = OutputFormat.TABLE,
    as_json: JsonOpt = False,
    quiet: ReportQuietOpt = False,
    include: IncludeOpt = None,
    exclude: ExcludeOpt = None,
    changed_only: Annotated[
        bool, typer.Option(help="List only tensors that are not bit-identical.")
    ] = False,
    sort: SortOpt = SortKey.NAME,
    top: TopOpt = None,
    fail_above: Annotated[
        float | None,
        typer.Option(
            help="Exit 1 if any tensor's relative change ‖A−B‖/‖A‖ exceeds X, or a tensor "
            "is missing, extra, or changed dtype or shape.",
            metavar="X",
        ),
    ] = None,
    all_tensors: Annotated[
        bool,
        typer.Option(
            "--all-tensors",
            help="Count training state (optimizer slots and counters, BatchNorm running "
            "statistics) in the global figures too. Every tensor is compared either way.",
        ),
    ] = False,
) -> None:
    """Compare two checkpoints (any formats) tensor by tensor: ‖A−B‖, ‖A−B‖/‖A‖,
    max |A−B|, cosine similarity and ‖B‖/‖A‖ (the scale a norm clip applied), plus missing
    or extra tensors, dtype/shape changes and metadata changes. Streams both files."""
    compare.diff(
        path_a=path_a,
        path_b=path_b,
        fmt=fmt,
        as_json=as_json,
        quiet=quiet,
        include=include,
        exclude=exclude,
        changed_only=changed_only,
        sort=sort,
        top=top,
        fail_above=fail_above,
        all_tensors=all_tensors,
    )
