"""The command line: parse options, call the API, render the report, map errors to exit codes.

No numerics here. Heavy modules (numpy, h5py, safetensors) are imported inside the
commands so that `clipcli --help` starts fast.
"""

from __future__ import annotations

import functools
import math
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from clipcli import __version__
from clipcli.errors import ClipcliError, ExitCode, UsageError, WriteError, printable
from clipcli.report import OutputFormat, SortKey

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
  130  interrupted (143 for SIGTERM); nothing was left behind"""

app = typer.Typer(
    name="clipcli",
    help="Inspect L2 norms of checkpoint tensors (.npz, .safetensors, .h5/.hdf5) and write "
    "clipped copies, with TensorFlow's clip_by_value / clip_by_norm / clip_by_average_norm / "
    "clip_by_global_norm semantics.\n\n"
    "\b\nExamples:\n"
    "  clipcli ls model.safetensors\n"
    "  clipcli norms model.safetensors --sort norm --top 10\n"
    "  clipcli clip --global 5.0 in.safetensors out.safetensors\n"
    "  clipcli clip --norm 1.0 --axes 0 in.h5 out.h5\n\n" + EXIT_CODES_HELP,
    no_args_is_help=True,
    add_completion=True,
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

F = TypeVar("F", bound=Callable[..., None])


def _reports_errors(command: F) -> F:
    """Every failure inside a command becomes one stderr line and its exit code, whether
    the app runs through main() or through Typer directly (tests' CliRunner)."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        try:
            command(*args, **kwargs)
            sys.stdout.flush()  # a closed pipe must show here, not at interpreter exit
        except BrokenPipeError:
            # The reader of our stdout went away (`| head -1`): not an error, as for any
            # Unix tool. Caught here because Click would turn it into exit 1.
            raise typer.Exit(_reader_went_away()) from None
        except ClipcliError as exc:
            raise typer.Exit(_fail(str(exc), exc.exit_code)) from None
        except KeyboardInterrupt:
            # Outside a write (measuring, reporting) there is nothing to clean up; Typer
            # would turn this into a silent exit 130, so say it.
            raise typer.Exit(_fail("interrupted", ExitCode.INTERRUPTED)) from None
        except (typer.Exit, typer.Abort):
            raise
        except Exception as exc:  # noqa: BLE001 - last line of defence: one line, exit 70
            raise typer.Exit(_internal_error(exc)) from None

    return wrapper  # type: ignore[return-value]


PathArg = Annotated[
    Path,
    typer.Argument(
        help="Checkpoint file, Hugging Face model directory, or *.safetensors.index.json.",
        show_default=False,
    ),
]
InArg = Annotated[
    Path,
    typer.Argument(
        metavar="IN", help="Input checkpoint file or model directory.", show_default=False
    ),
]
OutArg = Annotated[
    str,  # not Path: a trailing "/" (write a model directory) must survive
    typer.Argument(
        metavar="OUT",
        help="Output file (its extension picks the format), or a model directory: a "
        "name ending in /, or with no extension when IN is a model directory.",
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

AllowLargeSideFilesOpt = Annotated[
    bool,
    typer.Option(
        "--allow-large-side-files",
        help="Copy a model directory's other files even over 1 GiB each (holes stay holes).",
    ),
]


def _selection(
    include: list[str] | None, exclude: list[str] | None, all_tensors: bool = False
) -> object:
    from clipcli.selection import Selection

    return Selection(tuple(include or ()), tuple(exclude or ()), all_tensors)


def _notify(level: str, text: str) -> None:
    """A warning or note from the library: one line on stderr, stdout stays the report."""
    print(f"clipcli: {level}: {printable(text)}", file=sys.stderr)


def _progress(quiet: bool = False) -> Any:
    """A terminal progress bar when stderr is a terminal, else the silent default."""
    from clipcli.progress import SILENT
    from clipcli.report import TerminalProgress

    if quiet or not sys.stderr.isatty():
        return SILENT
    return TerminalProgress()


_stdout_closed = False  # set by main()


def _emit(write: Callable[[], None]) -> None:
    """Write the report; if the reader closes the pipe, stop writing but finish the command:
    a --fail-above verdict still decides the exit code (`norms --fail-above 5 m | head -1`
    in a pipefail script must still say 1 when the norm is over)."""
    if _stdout_closed:  # started with stdout closed (`>&-`)
        raise WriteError("standard output is closed; the report cannot be written")
    try:
        write()
        sys.stdout.flush()
    except BrokenPipeError:
        _reader_went_away()
    except OSError as exc:  # /dev/full, a failing disk under a redirect
        reason = exc.strerror or str(exc)
        raise WriteError(f"standard output: cannot write the report: {reason}") from None


def _print(report: object, fmt: OutputFormat) -> None:
    from clipcli.report import Report, render

    assert isinstance(report, Report)
    render(report, fmt, sys.stdout)


@app.command("ls", epilog="Example: clipcli ls model.safetensors --format json")
@_reports_errors
def ls_command(
    path: PathArg,
    fmt: Annotated[
        OutputFormat, typer.Option("--format", "-f", help="Report format.")
    ] = OutputFormat.TABLE,
) -> None:
    """List tensors (name, dtype, shape, bytes) and file metadata, reading no tensor data."""
    from clipcli.api import list_tensors
    from clipcli.report import ls_report

    file_format, metadata, infos = list_tensors(path)
    _emit(lambda: _print(ls_report(str(path), file_format, metadata, infos), fmt))


@app.command(
    "norms",
    epilog="\b\nExamples:\n"
    "  clipcli norms model.safetensors\n"
    "  clipcli norms model.safetensors --sort norm --top 5 --format json\n"
    "  clipcli norms m.safetensors --fail-above 5 ||\n"
    "      clipcli clip --global 5 m.safetensors o.safetensors",
)
@_reports_errors
def norms_command(
    path: PathArg,
    fmt: Annotated[
        OutputFormat, typer.Option("--format", "-f", help="Report format.")
    ] = OutputFormat.TABLE,
    include: IncludeOpt = None,
    exclude: ExcludeOpt = None,
    sort: Annotated[
        SortKey,
        typer.Option(
            help="Row order: file order, name (layers.2 before layers.10), norm (largest "
            "first), size. Groups come in name order unless sorted by norm."
        ),
    ] = SortKey.FILE,
    top: Annotated[int | None, typer.Option(help="Show only the first N rows.", min=1)] = None,
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
        bool, typer.Option(help="Draw horizontal bars of the norms instead of the table.")
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
            help="Write a norm profile (per group with --group-by) to FILE.png or FILE.svg; "
            "needs the 'plot' extra (matplotlib).",
            metavar="FILE",
        ),
    ] = None,
    all_tensors: AllTensorsOpt = False,
) -> None:
    """Per-tensor L2 norm, max |x| and non-finite count, and the global norm over
    floating-point model weights (optimizer state and BatchNorm statistics are listed
    apart unless --all-tensors). Accumulated exactly in float64."""
    from clipcli.api import measure
    from clipcli.report import groups_report, norms_report, render_chart
    from clipcli.selection import Selection

    if group_by is not None:
        from clipcli.groups import compile_group_by

        compile_group_by(group_by)
    selection = _selection(include, exclude, all_tensors)
    assert isinstance(selection, Selection)
    measurement = measure(path, selection, _progress(), _notify, group_by)
    if group_by is not None:
        report = groups_report(measurement, group_by, sort)
    else:
        report = norms_report(measurement, sort, top)
    # Charts show what the global norm is made of: groups, or the floating-point tensors.
    records = report.records()
    if group_by is None:
        records = [r for r in records if r["in_global"]]
    labels = [str(r[report.columns[0].key]) for r in records]
    values = [float(r["norm"]) for r in records]  # type: ignore[arg-type]
    if chart:
        _emit(lambda: render_chart(report.title, labels, values, limit, sys.stdout))
    else:
        _emit(lambda: _print(report, fmt))
    if plot is not None:
        from clipcli.plot import plot_profile

        plot_profile(plot, report.title, labels, values, limit)
    if fail_above is not None:
        g = measurement.global_norm
        if math.isnan(g) or g > fail_above:
            print(
                f"clipcli: global norm {g:.6g} exceeds --fail-above {fail_above:g}",
                file=sys.stderr,
            )
            raise typer.Exit(ExitCode.CONDITION)


def _parse_axes(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(part) for part in text.split(",") if part.strip() != ""]
    except ValueError:
        raise UsageError(f"--axes takes comma-separated integers, got {text!r}") from None


@app.command(
    "clip",
    epilog="\b\nExamples:\n"
    "  clipcli clip --global 5.0 in.safetensors out.safetensors\n"
    "  clipcli clip --norm 1.0 --axes 0 in.h5 out.h5        # per-column max-norm\n"
    "  clipcli clip --norm 1 --axes 1 --include '*self_attn*' --skip-low-rank \\\n"
    "      in.safetensors out.safetensors                   # rows; biases left as they are\n"
    "  clipcli clip --average 0.01 in.npz out.npz\n"
    "  clipcli clip --value 3 --include '*.weight' in.safetensors out.safetensors\n"
    "  clipcli clip --global 1 --dry-run --format json in.safetensors out.safetensors",
)
@_reports_errors
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
    fmt: Annotated[
        OutputFormat, typer.Option("--format", "-f", help="Report format.")
    ] = OutputFormat.TABLE,
    allow_large_side_files: AllowLargeSideFilesOpt = False,
    all_tensors: AllTensorsOpt = False,
) -> None:
    """Write a clipped copy of IN to OUT. Choose exactly one mode: --min/--max/--value,
    --norm [--axes], --average or --global [--use-norm]. Tensors within the limit, not
    selected, not floating point, or training state (optimizer slots, BatchNorm
    statistics; unless --all-tensors) are copied bit-identical."""
    from clipcli import interrupts
    from clipcli.api import clip
    from clipcli.plan import build_spec
    from clipcli.report import clip_report
    from clipcli.selection import Selection

    spec = build_spec(
        low=low,
        high=high,
        value=value,
        norm=norm,
        average=average,
        global_=global_,
        axes=_parse_axes(axes),
        use_norm=use_norm,
        skip_nonfinite=skip_nonfinite,
        group_by=group_by,
        skip_low_rank=skip_low_rank,
    )
    selection = _selection(include, exclude, all_tensors)
    assert isinstance(selection, Selection)
    # Signals are recorded from here to the end: acted on between chunks until OUT is
    # committed, moot after that (OUT is whole, so the run reports success).
    with interrupts.deferred():
        result = clip(
            src,
            out,
            spec,
            selection,
            dry_run=dry_run,
            force=force,
            durable=fsync,
            progress=_progress(quiet),
            allow_large_side_files=allow_large_side_files,
            notify=_notify,
        )
        if not quiet:
            _emit(lambda: _print(clip_report(result), fmt))


@app.command(
    "convert",
    epilog="\b\nExamples:\n"
    "  clipcli convert model.npz model.safetensors\n"
    "  clipcli convert weights.h5 weights.safetensors --force",
)
@_reports_errors
def convert_command(
    src: InArg,
    out: OutArg,
    force: Annotated[bool, typer.Option(help="Replace an existing OUT (never IN).")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Print nothing on success.")] = False,
    allow_large_side_files: AllowLargeSideFilesOpt = False,
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
            progress=_progress(quiet),
            allow_large_side_files=allow_large_side_files,
            notify=_notify,
        )
        if not quiet:
            total = sum(i.nbytes for i in infos)
            line = f"wrote {printable(str(out))}: {len(infos)} tensors, {total} bytes"
            _emit(lambda: print(line))


@app.command(
    "diff",
    epilog="\b\nExamples:\n"
    "  clipcli diff model.safetensors clipped.safetensors\n"
    "  clipcli diff old.npz new.safetensors --changed-only --format json\n"
    "  clipcli diff base/ merged/ --fail-above 0.05   # exit 1 if any tensor moved > 5%",
)
@_reports_errors
def diff_command(
    path_a: Annotated[Path, typer.Argument(metavar="A", help="Reference checkpoint.")],
    path_b: Annotated[Path, typer.Argument(metavar="B", help="Checkpoint to compare with A.")],
    fmt: Annotated[
        OutputFormat, typer.Option("--format", "-f", help="Report format.")
    ] = OutputFormat.TABLE,
    include: IncludeOpt = None,
    exclude: ExcludeOpt = None,
    changed_only: Annotated[
        bool, typer.Option(help="List only tensors that are not bit-identical.")
    ] = False,
    fail_above: Annotated[
        float | None,
        typer.Option(
            help="Exit 1 if any tensor's relative change ‖A−B‖/‖A‖ exceeds X, or a tensor "
            "is missing, extra, or changed dtype or shape.",
            metavar="X",
        ),
    ] = None,
) -> None:
    """Compare two checkpoints (any formats) tensor by tensor: ‖A−B‖, ‖A−B‖/‖A‖,
    max |A−B|, cosine similarity and ‖B‖/‖A‖ (the scale a norm clip applied), plus missing
    or extra tensors, dtype/shape changes and metadata changes. Streams both files."""
    from clipcli import api
    from clipcli.report import diff_report
    from clipcli.selection import Selection

    selection = _selection(include, exclude)
    assert isinstance(selection, Selection)
    result = api.diff(path_a, path_b, selection, progress=_progress(), notify=_notify)
    _emit(lambda: _print(diff_report(result, changed_only), fmt))
    if fail_above is not None:
        worst = result.max_rel_change
        if result.n_structural or (worst is not None and not worst <= fail_above):
            print(
                f"clipcli: largest relative change {worst if worst is not None else 'n/a'} "
                f"or {result.n_structural} structural differences exceed --fail-above "
                f"{fail_above:g}",
                file=sys.stderr,
            )
            raise typer.Exit(ExitCode.CONDITION)


_failure_reported = False  # main() must not print a second line for the same failure


def _fail(message: str, code: int) -> int:
    global _failure_reported
    _failure_reported = True
    try:
        print(f"clipcli: error: {printable(message)}", file=sys.stderr, flush=True)
    except OSError:  # stderr is gone too; the exit code still tells
        pass
    return code


def _reader_went_away() -> int:
    """stdout's reader closed the pipe: exit 0, quietly. stdout is pointed at /dev/null so
    that the interpreter's final flush of what is still buffered cannot fail and print."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no real stdout (tests capture it): nothing to flush
        pass
    return ExitCode.OK


def _restore_signal_defaults() -> None:
    """Undo the start-up guard of `python -m clipcli` (__main__.py): from here on Ctrl-C is
    a KeyboardInterrupt that the boundaries below turn into one line and exit 130."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _internal_error(exc: BaseException) -> int:
    if os.environ.get("CLIPCLI_DEBUG"):
        traceback.print_exc()
    message = f"internal error: {type(exc).__name__}: {exc} (set CLIPCLI_DEBUG=1 for details)"
    return _fail(message, ExitCode.INTERNAL)


def _keep_chunk_buffers() -> None:
    """Stop glibc from handing every multi-MiB chunk buffer back to the kernel.

    By default each 2-8 MiB temporary is mmapped and unmapped again, so every chunk pays
    for ~3000 fresh page faults: that made bf16 norms 4x slower in the main thread. Serving
    them from the heap and trimming it only above 256 MiB keeps them warm. One arena for
    all threads: a buffer freed by one worker is reused by the other, instead of each
    thread's arena keeping its own high-water mark (clip peak RSS on 0.5 -> 2 GiB files
    went 65 -> 71 MiB with per-thread arenas, 59 -> 61 MiB with one). Linux/glibc only.
    """
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 64 << 20)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 256 << 20)  # M_TRIM_THRESHOLD
        libc.mallopt(-8, 1)  # M_ARENA_MAX
    except (OSError, AttributeError):
        pass


def _usage_message(exc: typer.TyperException, args: list[str]) -> str:
    """Click's usage error on one line, with the hint a newcomer needs."""
    message = exc.format_message().replace("\n", " ").rstrip(".")
    if "Got unexpected extra argument" in message and "--axes" in args:
        message += "; --axes takes one comma-separated list, e.g. --axes 0,1"
    elif "Missing argument" in message or "No such command" in message:
        command = next((a for a in args if not a.startswith("-")), "")
        message += f"; see 'clipcli {command} --help'".replace("  ", " ")
    return message


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit code. Every failure is one stderr line."""
    global _failure_reported
    _failure_reported = False
    global _stdout_closed
    # Started with a stream closed (`>&-`, `2>&-`): Python has None there. Writes go to
    # /dev/null instead; a report that has nowhere to go is then exit 5, one line (lost
    # too, with stderr closed: the exit code still tells).
    _stdout_closed = sys.stdout is None
    if sys.stdout is None:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process
    if sys.stderr is None:
        sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process
    try:
        _restore_signal_defaults()
        for variable in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            # We thread over chunks ourselves; BLAS threads on top only spin and contend.
            os.environ.setdefault(variable, "1")
        _keep_chunk_buffers()
        args = sys.argv[1:] if argv is None else list(argv)
        if not args:
            args = ["--help"]
        if args == ["--version"]:
            print(f"clipcli {__version__}")
            return ExitCode.OK
        result = app(args=args, prog_name="clipcli", standalone_mode=False)
        sys.stdout.flush()
    except ClipcliError as exc:
        return _fail(str(exc), exc.exit_code)
    except typer.Exit as exc:
        if isinstance(exc.__cause__, KeyboardInterrupt):  # Click's silent exit 130
            return _fail("interrupted", ExitCode.INTERRUPTED)
        return int(exc.exit_code)
    except SystemExit:
        # Click's answer to a closed pipe while it prints (`clipcli --help | head -1`) is
        # exit 1, after wrapping stdout in PacifyFlushWrapper; that is not a failure.
        # (typer vendors click, so the class is recognised by name.)
        if type(sys.stdout).__name__ == "PacifyFlushWrapper":
            return _reader_went_away()
        raise
    except typer.TyperException as exc:  # usage errors from option parsing
        return _fail(_usage_message(exc, args), ExitCode.USAGE)
    except (typer.Abort, KeyboardInterrupt):
        return _fail("interrupted", ExitCode.INTERRUPTED)
    except BrokenPipeError:
        return _reader_went_away()
    except Exception as exc:  # noqa: BLE001 - last line of defence: one line, exit 70
        return _internal_error(exc)
    if result == ExitCode.INTERRUPTED and not _failure_reported:
        # Click turns a Ctrl-C outside our commands (while parsing) into a silent 130.
        return _fail("interrupted", ExitCode.INTERRUPTED)
    return int(result) if isinstance(result, int) else ExitCode.OK
