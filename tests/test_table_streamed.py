"""A long table written to a pipe or file with no width to fit (no COLUMNS) is streamed a
block of rows at a time (report/table._render_plain_streamed), its rows read twice: it
must be byte for byte the table that the laid-out route writes when the width is ample
(every column shown, names whole, plain rows past PLAIN_TABLE_ROWS), for ASCII and
non-ASCII cells, on a UTF-8 stream and on an ASCII one; at PLAIN_TABLE_ROWS rows the table
is still boxed, one row more and it is plain.
"""

from __future__ import annotations

import io
from array import array

import pytest

from clipcli.report.model import Column, Report, Rows, Value
from clipcli.report.serialize import write_csv, write_json, write_jsonl
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


def _rows_of(rep: Report, reads: list[int]) -> Rows:
    """rep's rows made when read (model.Rows, as clip_report gives them), counting reads."""
    made = tuple(rep.rows)

    def row(position: int) -> tuple[Value, ...]:
        reads[position] += 1
        return made[position]

    return Rows(row, array("l", range(len(made))))


@pytest.mark.parametrize("encoding", ["utf-8", "ascii"])
@pytest.mark.parametrize("rows", [PLAIN_TABLE_ROWS, _ROWS_AT_ONCE * 2 + 3])
def test_rows_made_when_read_give_the_same_table(rows: int, encoding: str) -> None:
    """A report whose rows are made when read is drawn as the same report with a tuple of
    rows, JSON and CSV included; the streamed table reads each row twice (widths, then
    lines), the laid-out one once. Non-ASCII names only in the last block: the blocks
    before are ASCII, escaped or not per block as the whole table was."""
    plain = report(rows, wide_names=False)
    last = tuple(
        (f"{row[0]}é漢",) + tuple(row[1:]) if k >= _ROWS_AT_ONCE * 2 else row
        for k, row in enumerate(plain.rows)
    )
    rep = plain._replace(rows=last)
    for width in (None, 10**6):
        reads = [0] * rows
        lazy = rep._replace(rows=_rows_of(rep, reads))
        assert rendered(lazy, width, encoding) == rendered(rep, width, encoding)
        streamed = width is None and rows > PLAIN_TABLE_ROWS
        assert set(reads) == {2 if streamed else 1}
    lazy = rep._replace(rows=_rows_of(rep, [0] * rows))
    for write in (write_json, write_jsonl, write_csv):
        out, expected = io.StringIO(), io.StringIO()
        write(lazy, out)
        write(rep, expected)
        assert out.getvalue() == expected.getvalue()


def test_rows_read_as_a_tuple_does() -> None:
    made = tuple((f"t{k}", k * 0.5) for k in range(10))
    order = array("l", [3, 1, 4, 1, 5, 9, 2, 6])
    rows = Rows(made.__getitem__, order)
    expected = tuple(made[k] for k in order)
    assert len(rows) == len(expected)
    assert rows[0] == expected[0]
    assert rows[-1] == expected[-1]
    assert rows[2:5] == expected[2:5]
    assert rows[::-2] == expected[::-2]
    assert tuple(rows) == expected
    assert list(rows) == list(expected)
    assert rows == expected
    assert rows == list(expected)
    assert rows != expected[:-1]
    assert bool(Rows(made.__getitem__, array("l"))) is False
    assert bool(rows) is True
    assert repr(rows) == f"Rows({expected!r})"
    with pytest.raises(IndexError):
        rows[len(expected)]
    with pytest.raises(TypeError):
        hash(rows)


@pytest.mark.parametrize("wide_last", [False, True])
def test_a_stream_that_cannot_hold_ascii_is_escaped_as_one_table(wide_last: bool) -> None:
    """cp864 has no '%' (attack s36b): the streamed table escapes every cell or none, as
    the laid-out one does, not block by block: '%' in every name, a non-ASCII name only
    in the last block (or none at all)."""
    plain = report(_ROWS_AT_ONCE * 2 + 3, wide_names=False)
    rows = tuple(
        (f"p%{k}" + ("é" if wide_last and k == _ROWS_AT_ONCE * 2 + 1 else ""), *row[1:])
        for k, row in enumerate(plain.rows)
    )
    rep = plain._replace(rows=rows)
    streamed = rendered(rep, None, "cp864")
    assert streamed == rendered(rep, 10**6, "cp864")
