"""Reports: results as frozen rows, rendered as a rich table, JSON or CSV."""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, TextIO

from clipcli.errors import printable

if TYPE_CHECKING:  # keep `clipcli --help` from importing numpy
    from clipcli.api import ClipResult, ClipRow
    from clipcli.diff import DiffResult
    from clipcli.formats.base import TensorInfo
    from clipcli.groups import NaturalKey
    from clipcli.measurement import Measurement, TensorStats


class OutputFormat(str, Enum):
    TABLE = "table"
    JSON = "json"
    JSONL = "jsonl"
    CSV = "csv"


class SortKey(str, Enum):
    FILE = "file"
    NAME = "name"
    NORM = "norm"
    SIZE = "size"


Value = str | int | float | bool | list[int] | None


@dataclass(frozen=True)
class Column:
    key: str
    title: str
    numeric: bool = False


@dataclass(frozen=True)
class Report:
    """Rows of one table plus the summary fields that go around it."""

    title: str
    columns: tuple[Column, ...]
    rows: tuple[tuple[Value, ...], ...]
    summary: tuple[tuple[str, Any], ...] = ()  # JSON-only fields around the rows
    footer: tuple[str, ...] = ()
    rows_key: str = "tensors"  # the JSON key holding the rows

    def records(self) -> list[dict[str, Value]]:
        return [dict(zip((c.key for c in self.columns), row, strict=True)) for row in self.rows]


def _json_number(value: Value) -> Value:
    """JSON has no NaN or Infinity; they become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _cell(value: Value) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, list):
        return "[" + ",".join(map(str, value)) + "]"
    return printable(str(value))


def render(report: Report, fmt: OutputFormat, stream: TextIO, width: int | None = None) -> None:
    if fmt is OutputFormat.JSON:
        document: dict[str, Any] = {key: _json_number(value) for key, value in report.summary}
        document[report.rows_key] = [
            {k: _json_number(v) for k, v in record.items()} for record in report.records()
        ]
        stream.write(json.dumps(document, allow_nan=False) + "\n")
    elif fmt is OutputFormat.JSONL:
        # One row per line, the same objects as the JSON rows, for line-by-line tools.
        for record in report.records():
            line = {k: _json_number(v) for k, v in record.items()}
            stream.write(json.dumps(line, allow_nan=False) + "\n")
    elif fmt is OutputFormat.CSV:
        buffer = io.StringIO()
        out = csv.writer(buffer, lineterminator="\n")
        out.writerow([c.key for c in report.columns])
        for row in report.rows:
            out.writerow(["" if v is None else _csv_value(v) for v in row])
        stream.write(buffer.getvalue())
    else:
        _render_table(report, stream, width)


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


def _csv_value(value: Value) -> str:
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


PLAIN_TABLE_ROWS = 2000  # rich lays out big tables slowly (50,000 rows: seconds)
METADATA_VALUE_CHARS = 200  # a longer metadata value is shortened in the table (JSON has it all)


def _stdout_console(stream: TextIO, width: int | None) -> Any:
    """A rich Console on `stream` that lets a closed pipe surface as BrokenPipeError.

    rich's own handler points stdout at /dev/null and raises SystemExit(1), which is the
    --fail-above exit code; cli.py turns BrokenPipeError into a quiet exit 0 instead, as
    `head` expects of any Unix tool."""
    from rich.console import Console

    class PipeConsole(Console):
        def on_broken_pipe(self) -> None:
            raise BrokenPipeError

    if width is None and not stream.isatty():
        # Piped or redirected: never wrap or cut names to fit an imaginary 80-column screen.
        width = 4096
    return PipeConsole(file=stream, width=width, highlight=False)


def text_cell(text: str) -> Any:
    """Data for a rich table: a Text object (never parsed as markup, so a name like
    '[/x]' or '[link=...]' is shown as is) with control and format characters escaped."""
    from rich.text import Text

    return Text(printable(text))


def _plain_lines(report: Report) -> list[str]:
    cells = [[c.title for c in report.columns]] + [[_cell(v) for v in row] for row in report.rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(report.columns))]
    lines = [printable(report.title)]
    for row in cells:
        parts = [
            text.rjust(w) if column.numeric else text.ljust(w)
            for text, w, column in zip(row, widths, report.columns, strict=True)
        ]
        lines.append("  ".join(parts).rstrip())
    return lines


def _write_footer(report: Report, stream: TextIO) -> None:
    # Built once and written once: a million metadata lines through console.print took
    # minutes. Footer lines are plain text (escaped), never markup.
    if report.footer:
        stream.write("".join(printable(line) + "\n" for line in report.footer))


def _render_table(report: Report, stream: TextIO, width: int | None) -> None:
    if len(report.rows) > PLAIN_TABLE_ROWS:
        stream.write("".join(line + "\n" for line in _plain_lines(report)))
        _write_footer(report, stream)
        return
    from rich.table import Table

    table = Table()
    for column in report.columns:
        table.add_column(
            column.title,
            justify="right" if column.numeric else "left",
            no_wrap=column.numeric,
            overflow="fold",
        )
    for row in report.rows:
        table.add_row(*(text_cell(_cell(v)) for v in row))
    # The title is a plain line, not the table's title: rich would wrap a long path to
    # the table's width, and a path is something people grep for.
    stream.write(printable(report.title) + "\n")
    console = _stdout_console(stream, width)
    console.print(table)
    console.file.flush()  # what rich wrote goes out before the footer, which bypasses it
    _write_footer(report, stream)


def shorten(text: str, limit: int = METADATA_VALUE_CHARS) -> str:
    """The first `limit` characters and how many there were, for a value too long to show."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters; --format json shows all)"


# ------------------------------------------------------------------ builders

LS_COLUMNS = (
    Column("name", "tensor"),
    Column("dtype", "dtype"),
    Column("shape", "shape"),
    Column("numel", "numel", numeric=True),
    Column("bytes", "bytes", numeric=True),
)


def ls_report(path: str, fmt: str, metadata: dict[str, str], infos: Sequence[TensorInfo]) -> Report:
    rows = tuple((i.name, i.dtype_name, list(i.shape), i.numel, i.nbytes) for i in infos)
    total = sum(i.nbytes for i in infos)
    footer = [f"{len(infos)} tensors, {total} bytes"]
    footer += [f"metadata {shorten(k)} = {shorten(v)}" for k, v in metadata.items()]
    return Report(
        f"{path} ({fmt})",
        LS_COLUMNS,
        rows,
        (("path", path), ("format", fmt), ("metadata", metadata), ("total_bytes", total)),
        tuple(footer),
    )


NORM_COLUMNS = (
    Column("name", "tensor"),
    Column("dtype", "dtype"),
    Column("shape", "shape"),
    Column("numel", "numel", numeric=True),
    Column("norm", "norm", numeric=True),
    Column("max_abs", "max|x|", numeric=True),
    Column("nonfinite", "nonfinite", numeric=True),
    Column("in_global", "global"),
    Column("role", "role"),  # weight, optimizer or buffer (clipcli.roles)
)


def _natural_key(name: str) -> NaturalKey:
    # Imported here: clipping imports numpy, which `clipcli --help` must not pay for.
    from clipcli.groups import natural_key

    return natural_key(name)


_SORTS: dict[SortKey, Callable[[TensorStats], Any]] = {  # noqa: F821
    SortKey.NAME: lambda t: _natural_key(t.info.name),
    SortKey.NORM: lambda t: -t.norm if not math.isnan(t.norm) else -math.inf,
    SortKey.SIZE: lambda t: -t.info.nbytes,
}


def norms_report(m: Measurement, sort: SortKey = SortKey.FILE, top: int | None = None) -> Report:
    tensors = list(m.tensors)
    if sort is not SortKey.FILE:
        tensors.sort(key=_SORTS[sort])
    if top is not None:
        tensors = tensors[:top]
    rows = tuple(
        (
            t.info.name,
            t.info.dtype_name,
            list(t.info.shape),
            t.info.numel,
            t.norm,
            t.stats.largest_magnitude,
            t.stats.nonfinite,
            t.in_global,
            t.role.value,
        )
        for t in tensors
    )
    g = m.global_norm
    counted = sum(t.in_global for t in m.tensors)
    footer = (f"global L2 norm {g:.6g} over {_count(counted, 'floating-point tensor')}",)
    return Report(
        f"{m.path} ({m.format})",
        NORM_COLUMNS,
        rows,
        (("path", str(m.path)), ("format", m.format), ("global_norm", g)),
        footer,
    )


CLIP_COLUMNS = (
    Column("name", "tensor"),
    Column("dtype", "dtype"),
    Column("norm_before", "before", numeric=True),
    Column("norm_after", "after", numeric=True),
    Column("scale", "scale", numeric=True),
    Column("changed", "changed"),
    Column("note", "note"),
)


# The note column of `clip`: each plan reason in words (clipcli.plan.Reason).
REASON_TEXT = {
    "not selected": "not selected",
    "left out": "{role}, left unchanged",
    "not floating point": "not floating point",
    "non-finite skipped": "non-finite, skipped",
    "low rank skipped": "skipped: too few dimensions for --axes",
    "complex unordered": "complex: no order to clamp by",
    "within range": "within range",
    "within limit": "within limit",
    "zero tensor": "zero tensor",
    "over limit": "",
    "over range": "",
    "per slice": "{clipped} of {slices} slices clipped",
    "converted": "copied",
}


def clip_note(row: ClipRow) -> str:
    """The note for one tensor of a clip: its plan's reason, with its group if any."""
    text = REASON_TEXT[row.reason.value].format(
        role=row.plan.role.description,
        clipped=row.outcome.slices_clipped,
        slices=row.outcome.slices,
    )
    if row.plan.group is None:
        return text
    return f"{text}, group {row.plan.group}" if text else f"group {row.plan.group}"


def clip_report(result: ClipResult) -> Report:
    rows = tuple(
        (
            r.info.name,
            r.info.dtype_name,
            r.before.norm,
            r.after.norm,
            r.plan.scale,
            r.changed,
            clip_note(r),
        )
        for r in result.rows
    )
    spec = result.spec
    changed = sum(r.changed for r in result.rows)
    verb = "would change" if result.dry_run else "changed"
    footer = [
        f"global L2 norm {result.global_before:.6g} -> {result.global_after:.6g}",
        f"{verb} {changed} of {len(result.rows)} tensors"
        + ("" if result.dry_run else f"; wrote {result.out}"),
    ]
    summary: tuple[tuple[str, Value], ...] = (
        ("src", str(result.src)),
        ("out", str(result.out)),
        ("mode", spec.mode.value),
        ("limit", spec.limit if spec.mode.value != "value" else None),
        ("min", spec.low if spec.mode.value == "value" else None),
        ("max", spec.high if spec.mode.value == "value" else None),
        ("axes", list(spec.axes) if spec.axes is not None else None),
        ("used_norm", result.used_norm),
        ("dry_run", result.dry_run),
        ("global_norm_before", result.global_before),
        ("global_norm_after", result.global_after),
        ("changed", changed),
    )
    title = f"clip {spec.mode.value} {spec.describe_limit()}: {result.src}"
    return Report(title, CLIP_COLUMNS, rows, summary, tuple(footer))


GROUP_COLUMNS = (
    Column("group", "group"),
    Column("tensors", "tensors", numeric=True),
    Column("norm", "norm", numeric=True),
    Column("share", "share of global²", numeric=True),
)


def groups_report(m: Measurement, group_by: str, sort: SortKey = SortKey.FILE) -> Report:
    groups = m.groups(group_by)
    if sort is SortKey.NORM:
        groups.sort(key=lambda g: -g.norm if not math.isnan(g.norm) else -math.inf)
    rows = tuple((g.name, g.tensors, g.norm, g.share) for g in groups)
    g = m.global_norm
    return Report(
        f"{m.path} ({m.format}) grouped by {group_by}",
        GROUP_COLUMNS,
        rows,
        (("path", str(m.path)), ("format", m.format), ("global_norm", g), ("group_by", group_by)),
        (f"global L2 norm {g:.6g} over {_count(len(groups), 'group')}",),
        rows_key="groups",
    )


BAR_WIDTH = 40


def render_chart(
    title: str,
    labels: Sequence[str],
    norms: Sequence[float],
    limit: float | None,
    stream: TextIO,
    width: int | None = None,
) -> None:
    """Horizontal bars of norms, scaled to the largest (or the limit, if larger); the limit
    is drawn as a '│' mark and bars over it are red."""
    finite = [n for n in norms if math.isfinite(n)]
    top = max(finite + ([limit] if limit is not None else []), default=0.0)
    mark = round(limit / top * BAR_WIDTH) if limit is not None and top > 0 else None
    position = None if mark is None else min(mark, BAR_WIDTH - 1)
    rows = []
    for label, norm in zip(labels, norms, strict=True):
        length = (
            BAR_WIDTH if not math.isfinite(norm) else round(norm / top * BAR_WIDTH) if top else 0
        )
        over = limit is not None and not norm <= limit
        rows.append((printable(label), length, over, f"{norm:.6g}"))
    stream.write(printable(title) + "\n")  # a plain line, as for tables: never wrapped
    if len(rows) > PLAIN_TABLE_ROWS:
        _plain_chart(rows, position, stream)  # rich lays out 20,000 bars in ~7 s
    else:
        _rich_chart(rows, position, stream, width)
    if limit is not None:
        over_count = sum(1 for n in norms if not n <= limit)
        stream.write(f"limit {limit:g} (│): {over_count} of {len(norms)} over\n")


ChartRow = tuple[str, int, bool, str]  # label (escaped), bar length, over the limit, norm


def _rich_chart(
    rows: list[ChartRow], position: int | None, stream: TextIO, width: int | None
) -> None:
    from rich.table import Table
    from rich.text import Text

    table = Table(box=None, show_header=False)
    table.add_column("name", overflow="fold")
    table.add_column("bar", no_wrap=True)
    table.add_column("norm", justify="right", no_wrap=True)
    for label, length, over, norm in rows:
        bar = Text("█" * length, style="red" if over else "green")
        bar.append(" " * (BAR_WIDTH - length))
        if position is not None:
            bar = bar[:position] + Text("│", style="bold yellow") + bar[position + 1 :]
        table.add_row(Text(label), bar, norm)
    console = _stdout_console(stream, width)
    console.print(table)
    console.file.flush()  # before the limit line, which bypasses rich


def _plain_chart(rows: list[ChartRow], position: int | None, stream: TextIO) -> None:
    """The same bars as plain text, built once (no colours: over-limit bars are still the
    ones that cross the mark)."""
    name_width = max(len(label) for label, _, _, _ in rows)
    norm_width = max(len(norm) for _, _, _, norm in rows)
    lines = []
    for label, length, _, norm in rows:
        bar = "█" * length + " " * (BAR_WIDTH - length)
        if position is not None:
            bar = bar[:position] + "│" + bar[position + 1 :]
        lines.append(f" {label.ljust(name_width)}  {bar}  {norm.rjust(norm_width)} \n")
    stream.write("".join(lines))


class TerminalProgress:
    """A rich progress bar on stderr per pass (bytes, throughput, ETA), shown only once a
    pass has run for `delay` seconds so quick jobs print nothing."""

    def __init__(self, delay: float = 1.0) -> None:
        self.delay = delay
        self._bar: Any = None
        self._task: Any = None
        self._label = ""
        self._total = 0
        self._done = 0
        self._started = 0.0

    def start(self, label: str, total_bytes: int) -> None:
        import time

        self.finish()
        self._label, self._total, self._done = printable(label), total_bytes, 0
        self._started = time.monotonic()

    def advance(self, nbytes: int) -> None:
        import time

        self._done += nbytes
        if self._bar is None:
            if time.monotonic() - self._started < self.delay:
                return
            self._open()
        self._bar.update(self._task, completed=self._done)

    def _open(self) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        self._bar = Progress(
            TextColumn("{task.description}", markup=False),  # labels hold file names
            BarColumn(),
            DownloadColumn(binary_units=True),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            console=Console(stderr=True),
            transient=True,
        )
        self._bar.start()
        self._task = self._bar.add_task(self._label, total=self._total, completed=self._done)

    def finish(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


DIFF_COLUMNS = (
    Column("name", "tensor"),
    Column("status", "status"),
    Column("dtype_a", "dtype A"),
    Column("dtype_b", "dtype B"),
    Column("norm_a", "norm A", numeric=True),
    Column("norm_b", "norm B", numeric=True),
    Column("diff_norm", "‖A−B‖", numeric=True),
    Column("rel_change", "‖A−B‖/‖A‖", numeric=True),
    Column("max_abs_diff", "max|A−B|", numeric=True),
    Column("cosine", "cosine", numeric=True),
    Column("norm_ratio", "‖B‖/‖A‖", numeric=True),
)


def diff_report(result: DiffResult, changed_only: bool = False) -> Report:
    rows = tuple(
        (
            t.name,
            t.status,
            t.dtype_a,
            t.dtype_b,
            t.norm_a,
            t.norm_b,
            t.diff_norm,
            t.rel_change,
            t.max_abs_diff,
            t.cosine,
            t.norm_ratio,
        )
        for t in result.tensors
        if not (changed_only and t.status == "same")
    )
    counts = {status: n for status, n in result.counts.items() if n}
    shared = any(t.compared for t in result.tensors)
    difference = (
        f"‖A−B‖ {result.global_diff_norm:.6g} (relative {result.global_rel_change:.6g})"
        if shared
        else "A and B share no tensor to compare"
    )
    footer = [
        f"global norm A {result.global_norm_a:.6g}, B {result.global_norm_b:.6g}, {difference}",
        ", ".join(f"{n} {status}" for status, n in counts.items()) or "no tensors",
    ]
    footer += [
        f"metadata {shorten(key)}: {shorten(repr(a))} -> {shorten(repr(b))}"
        for key, a, b in result.metadata_changes
    ]
    summary: tuple[tuple[str, Any], ...] = (
        ("path_a", str(result.path_a)),
        ("path_b", str(result.path_b)),
        ("format_a", result.format_a),
        ("format_b", result.format_b),
        ("global_norm_a", result.global_norm_a),
        ("global_norm_b", result.global_norm_b),
        ("global_diff_norm", result.global_diff_norm),
        ("global_rel_change", result.global_rel_change),
        ("max_rel_change", result.max_rel_change),
        ("identical", result.identical),
        ("counts", dict(result.counts)),
        (
            "metadata_changes",
            [{"key": k, "a": a, "b": b} for k, a, b in result.metadata_changes],
        ),
    )
    return Report(
        f"diff {result.path_a} ({result.format_a}) -> {result.path_b} ({result.format_b})",
        DIFF_COLUMNS,
        rows,
        summary,
        tuple(footer),
    )


def _count(n: int, noun: str) -> str:
    """'1 group', '2 groups'."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
