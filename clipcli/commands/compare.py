"""`clipcli diff`: compare two checkpoints tensor by tensor."""

import sys
from pathlib import Path

from clipcli.commands.common import (
    check_threshold,
    emit,
    notify,
    print_report,
    progress,
    selection,
)
from clipcli.errors import ExitCode, Verdict
from clipcli.report import OutputFormat, SortKey


def diff(
    path_a: Path,
    path_b: Path,
    fmt: OutputFormat = OutputFormat.TABLE,
    include: list[str] | None = None,
    exclude: list[str] | None = None,
    changed_only: bool = False,
    sort: SortKey = SortKey.NAME,
    top: int | None = None,
    fail_above: float | None = None,
) -> None:
    check_threshold("--fail-above", fail_above)
    from clipcli import api
    from clipcli.report.builders import diff_report

    result = api.diff(
        path_a, path_b, selection(include, exclude), progress=progress(), notify=notify
    )
    emit(lambda: print_report(diff_report(result, changed_only, sort, top), fmt))
    if fail_above is not None:
        worst = result.max_rel_change
        # Structure counts as much as values: a missing tensor, a changed shape or dtype,
        # and a changed metadata key, attribute, group or non-tensor dataset all fail it.
        other = result.n_structural + result.n_dtype_changed + len(result.metadata_changes)
        if other or (worst is not None and not worst <= fail_above):
            print(
                f"clipcli: largest relative change {worst if worst is not None else 'n/a'} "
                f"or {other} structure and metadata differences exceed --fail-above "
                f"{fail_above:g}",
                file=sys.stderr,
            )
            raise Verdict(ExitCode.CONDITION)
