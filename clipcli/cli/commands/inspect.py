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
    verdict,
)
from clipcli.cli.declarations import LsRequest, NormsRequest
from clipcli.errors import UsageError, printable
from clipcli.report import OutputFormat, SortKey

if TYPE_CHECKING:
    from clipcli.system.footprint import InputFootprint


def ls(request: LsRequest) -> None:
    fmt = report_format(request.fmt, request.as_json, request.quiet)
    if request.sort is SortKey.NORM:
        raise UsageError(
            "ls reads no tensor data, so it cannot sort by norm; use norms --sort norm"
        )
    from clipcli import api  # imports no numpy and no measuring or writing module
    from clipcli.report.builders import ls_report

    listed = api.listing(request.path, request.stored)
    chosen = list(listed.tensors)
    if request.include or request.exclude:
        chosen = selection(request.include, request.exclude).check(listed.tensors, notify)
    report = ls_report(
        str(request.path),
        listed.format_name,
        listed.metadata,
        chosen,
        request.sort,
        listed.shards,
        listed_of=len(listed.tensors),
        non_tensors=listed.non_tensors,
        quantized=listed.quantized,
    )
    if not request.quiet:  # the listing was still read and checked: exit 3 for a malformed file
        emit(lambda: print_report(report, fmt))


def norms(request: NormsRequest) -> None:
    fmt = request.fmt
    # Every option acts or is refused here, before any data is read.
    if fmt is not None or request.as_json:  # none given: a table, or with --plot alone no report
        fmt = report_format(fmt or OutputFormat.TABLE, request.as_json, request.quiet)
    if request.chart and request.quiet:
        raise UsageError("--quiet prints no report; it cannot be --chart")
    if request.chart and fmt not in (None, OutputFormat.TABLE):
        raise UsageError(f"--chart draws for the terminal; it cannot be --format {fmt.value}")
    if request.limit is not None and not (request.chart or request.plot is not None):
        raise UsageError("--limit marks a norm on --chart or --plot; give one of them")
    check_threshold("--limit", request.limit)
    if request.limit is not None and not (math.isfinite(request.limit) and request.limit > 0):
        raise UsageError(f"--limit {request.limit:g}: a norm to mark must be positive and finite")
    check_threshold("--fail-above", request.fail_above)
    if request.force and request.plot is None:
        raise UsageError("--force replaces an existing --plot FILE; give --plot")
    if request.group_by is not None:
        from clipcli.jobs.groups import compile_group_by

        compile_group_by(request.group_by)
        if request.sort is SortKey.SIZE:  # groups have no size of their own to sort by
            raise UsageError("--sort size orders tensors; groups sort by name or norm")
    if request.plot is not None:
        from clipcli.report.plot import check_plot_target

        check_plot_target(request.plot, request.force)
        overlap = _input_footprint(request.path).overlap(request.plot)
        if overlap is not None:  # the input is never written over, --force or not
            raise UsageError(f"--plot {request.plot} {overlap}; choose another file")

    from clipcli.api import measure
    from clipcli.report.builders import bars_of, groups_report, norms_report

    chosen = selection(request.include, request.exclude, request.all_tensors)
    measurement = measure(
        request.path, chosen, progress(request.quiet), notify, request.group_by, request.stored
    )
    if request.group_by is not None:
        report = groups_report(measurement, request.group_by, request.sort, request.top)
    else:
        report = norms_report(measurement, request.sort, request.top)
    # The chart and the plot draw exactly the rows listed (three tuples of every row: made
    # only for them).
    bars = bars_of(report) if request.chart or request.plot is not None else None
    if bars is not None and request.chart:
        from clipcli.report.chart import render_chart
        from clipcli.report.table import output_width

        width = output_width(sys.stdout)
        emit(
            lambda: render_chart(
                report.title,
                bars.labels,
                bars.norms,
                request.limit,
                sys.stdout,
                width,
                bars.counted,
            )
        )
    elif not request.quiet and (
        fmt is not None or request.plot is None
    ):  # --plot alone: the picture
        emit(lambda: print_report(report, fmt or OutputFormat.TABLE))
    if bars is not None and request.plot is not None:
        from clipcli.output.target import NewFileTarget
        from clipcli.report.plot import render_plot

        picture = render_plot(
            bars, request.limit, request.group_by is not None, request.plot.suffix
        )
        target = NewFileTarget(
            request.plot, force=request.force, durable=False
        )  # a picture, not a copy
        target.check(_input_footprint(request.path))
        with target.stage() as staged:  # whole or not at all; no-clobber without --force
            staged.write_bytes(picture)
        if not request.quiet and fmt in (None, OutputFormat.TABLE):
            # The report for people says what was written, as clip's and convert's do;
            # JSON, JSONL and CSV stay data only.
            line = f"wrote {printable(str(request.plot))}"
            emit(lambda: print(line))
    if request.fail_above is not None:
        g = measurement.global_norm
        if math.isnan(g) or g > request.fail_above:
            verdict(f"clipcli: global norm {g:.6g} exceeds --fail-above {request.fail_above:g}")


def _input_footprint(path: Path) -> "InputFootprint":
    """What --plot must stay clear of, from names alone (no data read): the file, or the
    model directory (given as itself or as its index file) and every file in it, so that
    a link to a shard is caught too."""
    from clipcli.system.footprint import InputFootprint

    root = path.parent if path.name.endswith(".index.json") else path
    files = [p for p in root.iterdir() if p.is_file()] if root.is_dir() else [path]
    return InputFootprint(root, files)
