"""`clipcli clip` and `clipcli convert`: write OUT from IN."""

import contextlib
import sys
from typing import Annotated

import typer

from clipcli.commands.common import (
    AllowLargeSideFilesOpt,
    AllowLossyOpt,
    AllTensorsOpt,
    ExcludeOpt,
    FormatOpt,
    InArg,
    IncludeOpt,
    OutArg,
    emit,
    notify,
    print_report,
    progress,
    selection,
)
from clipcli.errors import UsageError, printable
from clipcli.report import OutputFormat
from clipcli.report.model import count

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
CONVERT_EPILOG = (
    "\b\nExamples:\n"
    "  clipcli convert model.npz model.safetensors\n"
    "  clipcli convert weights.h5 weights.safetensors --force"
)


def parse_axes(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(part) for part in text.split(",") if part.strip() != ""]
    except ValueError:
        raise UsageError(f"--axes takes comma-separated integers, got {text!r}") from None


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
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Print no report.")] = False,
    fmt: FormatOpt = OutputFormat.TABLE,
    allow_large_side_files: AllowLargeSideFilesOpt = False,
    all_tensors: AllTensorsOpt = False,
    allow_lossy: AllowLossyOpt = False,
) -> None:
    """Write a clipped copy of IN to OUT. Choose exactly one mode: --min/--max/--value,
    --norm [--axes], --average or --global [--use-norm]. Tensors within the limit, not
    selected, not floating point, or training state (optimizer slots, BatchNorm
    statistics; unless --all-tensors) are copied bit-identical."""
    from clipcli import interrupts
    from clipcli.api import clip
    from clipcli.report.builders import clip_report
    from clipcli.spec import build_spec

    if quiet and fmt is not OutputFormat.TABLE:  # a script asked for a report and for none
        raise UsageError(f"--quiet prints no report; it cannot be --format {fmt.value}")
    spec = build_spec(
        low=low,
        high=high,
        value=value,
        norm=norm,
        average=average,
        global_=global_,
        axes=parse_axes(axes),
        use_norm=use_norm,
        skip_nonfinite=skip_nonfinite,
        group_by=group_by,
        skip_low_rank=skip_low_rank,
    )
    # Signals are recorded from here to the end: acted on between chunks until OUT is
    # committed, moot after that (OUT is whole, so the run reports success).
    with interrupts.deferred():
        result = clip(
            src,
            out,
            spec,
            selection(include, exclude, all_tensors),
            dry_run=dry_run,
            force=force,
            durable=fsync,
            progress=progress(quiet),
            allow_large_side_files=allow_large_side_files,
            notify=notify,
            allow_lossy=allow_lossy,
        )
        if not quiet:
            # OUT '-' is the clipped file on stdout: the report goes to stderr instead.
            with contextlib.redirect_stdout(sys.stderr if out == "-" else sys.stdout):
                emit(lambda: print_report(clip_report(result), fmt))


def convert_command(
    src: InArg,
    out: OutArg,
    force: Annotated[bool, typer.Option(help="Replace an existing OUT (never IN).")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Print nothing on success.")] = False,
    allow_large_side_files: AllowLargeSideFilesOpt = False,
    allow_lossy: AllowLossyOpt = False,
) -> None:
    """Copy IN to OUT's format losslessly: same names, order, dtypes, shapes and values;
    metadata carried over where OUT's format can hold it. A dtype OUT cannot hold
    (bfloat16/fp8 into npz or HDF5) is refused."""
    from clipcli import interrupts
    from clipcli.api import convert

    with interrupts.deferred():  # as for clip
        infos = convert(
            src,
            out,
            force=force,
            progress=progress(quiet),
            allow_large_side_files=allow_large_side_files,
            notify=notify,
            allow_lossy=allow_lossy,
        )
        if not quiet:
            total = sum(i.nbytes for i in infos)
            listed = f"{count(len(infos), 'tensor')}, {count(total, 'byte')}"
            line = f"wrote {printable(str(out))}: {listed}"
            emit(lambda: print(line))
