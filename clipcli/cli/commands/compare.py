"""`clipcli diff`: compare two checkpoints tensor by tensor."""

import math

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
from clipcli.cli.declarations import DiffRequest
from clipcli.errors import printable


def diff(request: DiffRequest) -> None:
    fmt = report_format(request.fmt, request.as_json, request.quiet)
    check_threshold("--fail-above", request.fail_above)
    from clipcli import api
    from clipcli.report.builders import diff_report

    result = api.diff(
        request.path_a,
        request.path_b,
        selection(request.include, request.exclude, request.all_tensors),
        progress=progress(request.quiet),
        notify=notify,
    )
    if not request.quiet:
        emit(
            lambda: print_report(
                diff_report(result, request.changed_only, request.sort, request.top), fmt
            )
        )
    limit = request.fail_above
    if limit is not None:
        largest = result.largest_change
        change = None if largest is None else largest.rel_change
        over = None
        if largest is not None and change is not None and not change <= limit:  # nan too
            over = (largest.name, change)
        # Structure counts as much as values: a missing tensor, a changed shape or dtype,
        # and a changed metadata key, attribute, group or non-tensor dataset all fail it.
        other = result.n_structural + result.n_dtype_changed + len(result.metadata_changes)
        if other or over:
            verdict(fail_above_message(over, other, limit))


def fail_above_message(over: tuple[str, float] | None, other: int, limit: float) -> str:
    """The one stderr line of a failed `diff --fail-above`: the tensor whose relative
    change is over the limit (name, change), if any, and the count of other differences."""
    threshold = f"--fail-above {_exactly(limit)}"
    differences = f"{other} structure or metadata difference{'' if other == 1 else 's'}"
    fail = "fails" if other == 1 else "fail"
    if over is None:
        return f"clipcli: {differences} {fail} {threshold}"
    name, change = printable(over[0]), over[1]
    if math.isnan(change):
        value = f"relative change nan ({name}) fails {threshold}"
    else:
        shown = f"{change:.6g}"
        if float(shown) <= limit:  # rounded onto the limit: show the excess
            shown = repr(change)
        value = f"largest relative change {shown} ({name}) exceeds {threshold}"
    return f"clipcli: {value}" + (f", and {differences} {fail} it" if other else "")


def _exactly(x: float) -> str:
    """x short (0.01, 5) where that is x itself, else every digit it needs."""
    short = f"{x:g}"
    return short if float(short) == x else repr(x)
