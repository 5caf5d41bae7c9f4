"""`clipcli diff`: compare two checkpoints tensor by tensor."""

import sys
from pathlib import Path
from typing import Annotated

import typer

from clipcli.commands.common import (
    ExcludeOpt,
    FormatOpt,
    IncludeOpt,
    check_threshold,
    emit,
    notify,
    print_report,
    progress,
    selection,
)
from clipcli.errors import ExitCode
from clipcli.report import OutputFormat

DIFF_EPILOG = (
    "\b\nExamples:\n"
    "  clipcli diff model.safetensors clipped.safetensors\n"
    "  clipcli diff old.npz new.safetensors --changed-only --format json\n"
    "  clipcli diff base/ merged/ --fail-above 0.05   # exit 1 if any tensor moved > 5%"
)


def diff_command(
    path_a: Annotated[Path, typer.Argument(metavar="A", help="Reference checkpoint.")],
    path_b: Annotated[Path, typer.Argument(metavar="B", help="Checkpoint to compare with A.")],
    fmt: FormatOpt = OutputFormat.TABLE,
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
    check_threshold("--fail-above", fail_above)
    from clipcli import api
    from clipcli.report.builders import diff_report

    result = api.diff(
        path_a, path_b, selection(include, exclude), progress=progress(), notify=notify
    )
    emit(lambda: print_report(diff_report(result, changed_only), fmt))
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
            raise typer.Exit(ExitCode.CONDITION)
