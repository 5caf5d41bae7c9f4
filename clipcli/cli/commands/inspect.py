"""`clipcli ls` and `clipcli norms`: read a checkpoint, write nothing but a report (and a
--plot picture)."""

import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from clipcli.cli.commands.common import (
    check_threshold,
    emit,
    notify,
    print_report,
    progress,
    report_format,
    selection,
)
from clipcli.errors import ExitCode, UsageError, Verdict, printable
from clipcli.report import OutputFormat, SortKey

if TYPE_CHECKING:
    from clipcli.system.footprint import InputFootprint

NORMS_EPILOG = (
    "\b\nExamples:\n"
    "  clipcli norms model.safetensors\n"
    "  clipcli norms model.safetensors --sort norm --top 5 --format json\n"
    "  clipcli norms m.safetensors --fail-above 5 ||\n"
    "      clipcli clip --global 5 m.safetensors o.safetensors"
)


def ls(
    path: Path,
    fmt: OutputFormat = OutputFormat.TABLE,
    as_json: bool = False,
    quiet: bool = False,
    include: list[str] | None = None,
    exclude: list[str] | None = None,
    sort: SortKey = SortKey.NAME,
    stored: bool = False,
) -> None:
    fmt = report_format(fmt, as_json, quiet)
    if sort is SortKey.NORM:
        raise UsageError(
            "ls reads no tensor data, so it cannot sort by norm; use norms --sort norm"
        )
    from clipcli import api  # imports no numpy and no measuring or writing module
    from clipcli.report.builders import ls_report

    listed = api.listing(path, stored)
    chosen = list(listed.tensors)
    if include or exclude:
        chosen = selection(include, exclude).check(listed.tensors, notify)
    report = ls_report(
        str(path),
        listed.format_name,
        listed.metadata,
        chosen,
        sort,
        listed.shards,
        listed_of=len(listed.tensors),
        non_tensors=listed.non_tensors,
        quantized=listed.quantized,
    )
    if not quiet:  # the listing was still read and checked: exit 3 for a malformed file
        emit(lambda: print_report(report, fmt))


def norms(
    path: Path,
    fmt: OutputFormat | None = None,
    as_json: bool = False,
    quiet: bool = False,
    include: list[str] | None = None,
    exclude: list[str] | None = None,
    sort: SortKey = SortKey.NAME,
    top: int | None = None,
    fail_above: float | None = None,
    group_by: str | None = None,
    chart: bool = False,
    limit: float | None = None,
    plot: Path | None = None,
    force: bool = False,
    all_tensors: bool = False,
    stored: bool = False,
) -> None:
    # Every option acts or is refused here, before any data is read.
    if fmt is not None or as_json:  # none given: a table, or with --plot alone no report
        fmt = report_format(fmt or OutputFormat.TABLE, as_json, quiet)
    if chart and quiet:
        raise UsageError("--quiet prints no report; it cannot be --chart")
    if chart and fmt not in (None, OutputFormat.TABLE):
        raise UsageError(f"--chart draws for the terminal; it cannot be --format {fmt.value}")
    if limit is not None and not (chart or plot is not None):
        raise UsageError("--limit marks a norm on --chart or --plot; give one of them")
    check_threshold("--limit", limit)
    if limit is not None and not (math.isfinite(limit) and limit > 0):
        raise UsageError(f"--limit {limit:g}: a norm to mark must be positive and finite")
    check_threshold("--fail-above", fail_above)
    if force and plot is None:
        raise UsageError("--force replaces an existing --plot FILE; give --plot")
    if group_by is not None:
        from clipcli.jobs.groups import compile_group_by

        compile_group_by(group_by)
        if sort is SortKey.SIZE:  # groups have no size of their own to sort by
            raise UsageError("--sort size orders tensors; groups sort by name or norm")
    if plot is not None:
        from clipcli.report.plot import check_plot_target

        check_plot_target(plot, force)
        overlap = _input_footprint(path).overlap(plot)
        if overlap is not None:  # the input is never written over, --force or not
            raise UsageError(f"--plot {plot} {overlap}; choose another file")

    from clipcli.api import measure
    from clipcli.report.builders import bars_of, groups_report, norms_report

    measurement = measure(
        path, selection(include, exclude, all_tensors), progress(quiet), notify, group_by, stored
    )
    if group_by is not None:
        report = groups_report(measurement, group_by, sort, top)
    else:
        report = norms_report(measurement, sort, top)
    bars = bars_of(report)  # the chart and the plot draw exactly the rows listed
    if chart:
        from clipcli.report.chart import render_chart
        from clipcli.report.table import output_width

        width = output_width(sys.stdout)
        emit(
            lambda: render_chart(
                report.title, bars.labels, bars.norms, limit, sys.stdout, width, bars.counted
            )
        )
    elif not quiet and (fmt is not None or plot is None):  # --plot alone: the picture
        emit(lambda: print_report(report, fmt or OutputFormat.TABLE))
    if plot is not None:
        from clipcli.output.target import NewFileTarget
        from clipcli.report.plot import render_plot

        picture = render_plot(bars, limit, group_by is not None, plot.suffix)
        target = NewFileTarget(plot, force=force, durable=False)  # a picture, not a copy
        target.check(_input_footprint(path))
        with target.stage() as staged:  # whole or not at all; no-clobber without --force
            staged.write_bytes(picture)
        if not quiet and fmt in (None, OutputFormat.TABLE):
            # The report for people says what was written, as clip's and convert's do;
            # JSON, JSONL and CSV stay data only.
            line = f"wrote {printable(str(plot))}"
            emit(lambda: print(line))
    if fail_above is not None:
        g = measurement.global_norm
        if math.isnan(g) or g > fail_above:
            print(
                f"clipcli: global norm {g:.6g} exceeds --fail-above {fail_above:g}",
                file=sys.stderr,
            )
            raise Verdict(ExitCode.CONDITION)


def _input_footprint(path: Path) -> "InputFootprint":
    """What --plot must stay clear of, from names alone (no data read): the file, or the
    model directory (given as itself or as its index file) and every file in it, so that
    a link to a shard is caught too."""
    from clipcli.system.footprint import InputFootprint

    root = path.parent if path.name.endswith(".index.json") else path
    files = [p for p in root.iterdir() if p.is_file()] if root.is_dir() else [path]
    return InputFootprint(root, files)
