"""Reports for scripts: JSON, JSON lines and CSV, with every column and full names."""

from __future__ import annotations

import io
import json
from collections.abc import Iterable
from typing import Any, TextIO

from clipcli.errors import printable
from clipcli.report.model import Report, Row, Value, json_number, object_text

# Rows turned into JSON at a time: 200,000 rows made into dicts at once held ~80 MB more.
JSON_ROWS_AT_ONCE = 4096


def write_json(report: Report, stream: TextIO) -> None:
    document: dict[str, Any] = {key: json_number(value) for key, value in report.summary}
    if report.rows_key in document:  # the rows would not come last: the document at once
        document[report.rows_key] = _json_ready(_records(report, report.rows))
        stream.write(json.dumps(document, allow_nan=False) + "\n")
        return
    # The rows come last, a few thousand at a time, as json.dumps writes a list.
    document[report.rows_key] = []
    head = json.dumps(document, allow_nan=False)
    stream.write(head[: -len("]}")])
    for start in range(0, len(report.rows), JSON_ROWS_AT_ONCE):
        text = _json_list(_records(report, report.rows[start : start + JSON_ROWS_AT_ONCE]))
        stream.write((", " if start else "") + text[1:-1])
    stream.write("]}\n")


def write_jsonl(report: Report, stream: TextIO) -> None:
    """One row per line, the same objects as the JSON rows, for line-by-line tools."""
    for start in range(0, len(report.rows), JSON_ROWS_AT_ONCE):
        records = _json_ready(_records(report, report.rows[start : start + JSON_ROWS_AT_ONCE]))
        stream.write("".join(json.dumps(r, allow_nan=False) + "\n" for r in records))


def _records(report: Report, rows: Iterable[Row]) -> list[dict[str, Value]]:
    keys = tuple(c.key for c in report.columns)
    return [dict(zip(keys, row, strict=True)) for row in rows]


def _json_ready(records: list[dict[str, Value]]) -> list[dict[str, Value]]:
    """JSON has no NaN or infinity: they become null (json_number)."""
    return [{k: json_number(v) for k, v in record.items()} for record in records]


def _json_list(records: list[dict[str, Value]]) -> str:
    """json.dumps of the records, NaN and infinity as null. Most rows hold neither: the
    records are dumped as they are, and looked through only when that is refused."""
    try:
        return json.dumps(records, allow_nan=False)
    except ValueError:  # a non-finite float (the only ValueError rows can raise)
        return json.dumps(_json_ready(records), allow_nan=False)


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
    if isinstance(value, (tuple, list)):
        return "x".join(map(str, value))
    if isinstance(value, dict):
        return csv_text(object_text(value))
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, int):
        return str(value)
    return csv_text(str(value))
