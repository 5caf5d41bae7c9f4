"""Reports for scripts: JSON, JSON lines and CSV, with every column and full names."""

from __future__ import annotations

import io
import json
from typing import Any, TextIO

from clipcli.errors import printable
from clipcli.report.model import Report, Value, json_number


def write_json(report: Report, stream: TextIO) -> None:
    document: dict[str, Any] = {key: json_number(value) for key, value in report.summary}
    document[report.rows_key] = [
        {k: json_number(v) for k, v in record.items()} for record in report.records()
    ]
    stream.write(json.dumps(document, allow_nan=False) + "\n")


def write_jsonl(report: Report, stream: TextIO) -> None:
    """One row per line, the same objects as the JSON rows, for line-by-line tools."""
    for record in report.records():
        line = {k: json_number(v) for k, v in record.items()}
        stream.write(json.dumps(line, allow_nan=False) + "\n")


def write_csv(report: Report, stream: TextIO) -> None:
    import csv  # only for --format csv: every ls and norms run imports this module

    buffer = io.StringIO()
    out = csv.writer(buffer, lineterminator="\n")
    out.writerow([c.key for c in report.columns])
    for row in report.rows:
        out.writerow(["" if v is None else csv_value(v) for v in row])
    stream.write(buffer.getvalue())


# OWASP "CSV injection": a spreadsheet runs a text cell starting with one of these as a
# formula (=HYPERLINK(...), +cmd|..., -2+3, @SUM(...)); tab and CR are on the list because
# some importers strip them first. Full-width forms are included because some spreadsheets
# fold them to ASCII. Such a cell gets a leading "'", which spreadsheets show as text.
CSV_FORMULA_STARTS = frozenset("=+-@\t\r\uff1d\uff0b\uff0d\uff20")


def csv_text(text: str) -> str:
    """A text cell for CSV: control and format characters escaped (printable), and a cell
    that a spreadsheet would run as a formula prefixed with a quote."""
    # The raw first character decides: a leading tab or CR is escaped to '\t'/'\r' text
    # anyway, but the quote then also tells a reader that the cell was altered.
    if text and text[0] in CSV_FORMULA_STARTS:
        return "'" + printable(text)
    return printable(text)


def csv_value(value: Value) -> str:
    # Only str cells are text: numbers (a norm of -1.5 included) stay numbers.
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "x".join(map(str, value))
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, int):
        return str(value)
    return csv_text(str(value))
