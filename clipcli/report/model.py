"""What a report is: frozen rows under named columns, plus the lines around them.

Builders (builders.py) turn results into a Report; renderers (table.py, serialize.py)
turn a Report into text. Nothing here imports numpy or rich.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from enum import Enum
from typing import Any, NamedTuple, overload


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


class ListingSortKey(str, Enum):
    """ls's row orders: SortKey without norm, since ls reads no tensor data (so that
    `ls --help` offers only what ls accepts)."""

    FILE = "file"
    NAME = "name"
    SIZE = "size"


# A dict: a row's `quantization` object (JSON), shown by its scheme or role elsewhere.
# A tuple or list of ints: a shape (the rows hold the TensorInfo's own tuple: a list made
# per row of 200,000 held ~14 MB).
Value = str | int | float | bool | tuple[int, ...] | list[int] | dict[str, Any] | None


Row = tuple[Value, ...]


class Rows(Sequence[Row]):
    """A report's rows, each made when it is read: row(p) for each position p, in order.
    200,000 rows of 7 cells held at once were ~24 MB (a tuple and a float or two each)
    on top of the plan they are read from; renderers read them a block at a time. Reads
    as a tuple of rows does: len, indexing, slices (a tuple), iteration and ==."""

    __slots__ = ("_positions", "_row")

    def __init__(self, row: Callable[[int], Row], positions: Sequence[int]) -> None:
        self._row = row
        self._positions = positions

    def __len__(self) -> int:
        return len(self._positions)

    @overload
    def __getitem__(self, index: int) -> Row: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[Row, ...]: ...
    def __getitem__(self, index: int | slice) -> Row | tuple[Row, ...]:
        if isinstance(index, slice):
            return tuple(map(self._row, self._positions[index]))
        return self._row(self._positions[index])

    def __iter__(self) -> Iterator[Row]:
        return map(self._row, self._positions)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, str):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]  # as a list's: rows are compared, not keyed

    def __repr__(self) -> str:
        return f"Rows({tuple(self)!r})"


# Column and Report are NamedTuples rather than frozen dataclasses: immutable all the same,
# and ~1 ms less start-up for every command that reports (issue 12, item 7).
class Column(NamedTuple):
    key: str
    title: str
    numeric: bool = False


class Report(NamedTuple):
    """Rows of one table plus the summary fields that go around it.

    The first column names the row (a tensor or a group): in a narrow table it is never
    dropped, wrapped or cut to nothing. `drop_order` lists the other columns' keys, least
    useful first: the order in which a table too wide for the terminal hides them before
    it shortens any name. `drop_late` lists the columns hidden only when the names would
    otherwise be cut below a readable width. `kept` lists the command's primary figures and
    the --sort key's column: never hidden for reading the same on every row, and hidden
    only after the names are shortened (a kept column in drop_order goes last, as if late)."""

    title: str
    columns: tuple[Column, ...]
    rows: Sequence[Row]  # a tuple, or Rows made when read
    summary: tuple[tuple[str, Any], ...] = ()  # JSON-only fields around the rows
    footer: tuple[str, ...] = ()
    rows_key: str = "tensors"  # the JSON key holding the rows
    drop_order: tuple[str, ...] = ()
    drop_late: tuple[str, ...] = ()
    kept: tuple[str, ...] = ()
    metadata: tuple[tuple[str, str], ...] = ()  # shown under a table one line each, shortened
    # diff: (key, value in A, value in B), None where a side has no such key; one line each
    metadata_changes: tuple[tuple[str, str | None, str | None], ...] = ()
    empty: str = ""  # said in a table instead of drawing one with no rows (JSON/CSV: [])

    def records(self) -> list[dict[str, Value]]:
        keys = tuple(c.key for c in self.columns)
        return [dict(zip(keys, row, strict=True)) for row in self.rows]


def json_number(value: Any) -> Any:
    """JSON has no NaN or Infinity; they become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def object_text(value: dict[str, Any]) -> str:
    """A row's `quantization` object in a table or CSV cell: its scheme, or a part's role."""
    return str(value.get("scheme") or value.get("role") or "")
