"""A long table written to a pipe or file with no width to fit (no COLUMNS) is streamed a
block of rows at a time from its column texts (report/table._render_plain_streamed): it
must be byte for byte the table that the laid-out route writes when the width is ample
(every column shown, names whole, plain rows past PLAIN_TABLE_ROWS), for ASCII and
non-ASCII cells, on a UTF-8 stream and on an ASCII one; at PLAIN_TABLE_ROWS rows the table
is still boxed, one row more and it is plain.
"""

from __future__ import annotations

import io

import pytest

from clipcli.report.model import Column, Report
from clipcli.report.table import _ROWS_AT_ONCE, PLAIN_TABLE_ROWS, render_table

COLUMNS = (
    Column("name", "tensor"),
    Column("dtype", "dtype"),
    Column("shape", "shape"),
    Column("numel", "numel", numeric=True),
    Column("norm", "norm", numeric=True),
    Column("flag", "in global"),
    Column("role", "role"),
)


def report(rows: int, wide_names: bool) -> Report:
    made = tuple(
        (
            f"model.layers.{i % 61}.experts.{i}.w"
            + ("漢é\u0301" if wide_names and i % 7 == 0 else ""),
            "float32" if i % 3 else "bfloat16",
            [i % 5, 3],
            (i % 5) * 3,
            float("nan") if i % 11 == 0 else i * 1.5e-3,
            bool(i % 2),
            None if i % 13 == 0 else "weight",
        )
        for i in range(rows)
    )
    return Report(
        "/some/path.safetensors (safetensors)",
        COLUMNS,
        made,
        footer=("global L2 norm 1.5 over 3 floating-point tensors ‖·‖",),
        metadata=(("format", "pt"), ("note", "é\ttab")),
    )


def rendered(rep: Report, width: int | None, encoding: str) -> str:
    raw = io.BytesIO()
    stream = io.TextIOWrapper(raw, encoding=encoding, errors="backslashreplace", newline="")
    render_table(rep, stream, width)
    stream.flush()
    return raw.getvalue().decode(encoding)


@pytest.mark.parametrize("encoding", ["utf-8", "ascii"])
@pytest.mark.parametrize("wide_names", [False, True])
@pytest.mark.parametrize(
    "rows", [PLAIN_TABLE_ROWS, PLAIN_TABLE_ROWS + 1, _ROWS_AT_ONCE, _ROWS_AT_ONCE * 2 + 3]
)
def test_streamed_table_is_the_laid_out_one(rows: int, wide_names: bool, encoding: str) -> None:
    rep = report(rows, wide_names)
    streamed = rendered(rep, None, encoding)
    assert streamed == rendered(rep, 10**6, encoding)  # the laid-out route, ample width
    lines = streamed.splitlines()
    boxed = rows <= PLAIN_TABLE_ROWS
    assert lines[1][0] in "┏+" if boxed else lines[1].startswith("tensor")
    assert sum(line.startswith(("model.", "│ model.", "| model.")) for line in lines) == rows
