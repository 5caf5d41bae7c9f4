"""Reports: results as frozen rows (model), built per command (builders), rendered as a
table that fits the terminal (table), JSON/CSV (serialize), bars (chart), a picture (plot),
and the terminal progress bar (progress_bar).

Importing this package is cheap (no rich, numpy or matplotlib): the CLI's option types
live here. The report does no math on tensors; it imports no numerics.
"""

from __future__ import annotations

from typing import TextIO

from clipcli.report.model import Column, ListingSortKey, OutputFormat, Report, SortKey, Value

__all__ = ["Column", "ListingSortKey", "OutputFormat", "Report", "SortKey", "Value", "render"]


def render(report: Report, fmt: OutputFormat, stream: TextIO, width: int | None = None) -> None:
    """Write `report` to `stream`; a table fits `width` (default: the terminal's)."""
    from clipcli.report import serialize, table

    if fmt is OutputFormat.JSON:
        serialize.write_json(report, stream)
    elif fmt is OutputFormat.JSONL:
        serialize.write_jsonl(report, stream)
    elif fmt is OutputFormat.CSV:
        serialize.write_csv(report, stream)
    else:
        table.render_table(report, stream, table.output_width(stream) if width is None else width)
