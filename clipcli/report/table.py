"""Reports for people: a rich table that fits the terminal without wrapping a name.

The table is drawn here in rich's box style (rich itself is not imported for it: start-up
time). A table wider than the terminal first hides its least useful columns (Report.drop_order),
then shortens the names in the middle (`model.layers.1…self_attn.q_proj.weight`: the start
and the end of a name are what tell tensors apart). A name is never wrapped, and never cut
below NAME_MIN_CELLS; JSON and CSV always hold every column and the full names.
"""

from __future__ import annotations

import os
import unicodedata
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple, TextIO

from clipcli.errors import printable
from clipcli.report.model import Report, Value, object_text

PLAIN_TABLE_ROWS = 2000  # rich lays out big tables slowly (50,000 rows: seconds)
METADATA_VALUE_CHARS = 200  # a longer metadata value is shortened in the table (JSON has it all)
NAME_MIN_CELLS = 32  # columns in drop_late go before a name is cut below this
ELLIPSIS = "…"


def output_width(stream: TextIO) -> int | None:
    """The width to fit: the terminal's (rich's rule: COLUMNS, else the tty's size); for a
    pipe or file, COLUMNS if it is set, else none (a script's table is never cut)."""
    if stream.isatty():
        from rich.console import Console

        return int(Console(file=stream).width)
    columns = os.environ.get("COLUMNS", "")
    return int(columns) if columns.isdigit() and int(columns) > 0 else None


def can_draw(stream: TextIO, glyphs: str) -> bool:
    """Whether `stream`'s encoding holds these box or bar characters (LC_ALL=C, or
    PYTHONIOENCODING=ascii, does not: the table is then drawn in ASCII)."""
    try:
        glyphs.encode(getattr(stream, "encoding", None) or "utf-8")
    except (UnicodeEncodeError, LookupError):
        return False
    return True


def encodable(stream: TextIO, text: str) -> str:
    """`text` with what `stream`'s encoding cannot hold escaped (`w\\xe9`), so that the
    cells are measured as they will be written and the columns stay aligned."""
    encoding = getattr(stream, "encoding", None) or "utf-8"
    try:
        text.encode(encoding)
    except UnicodeEncodeError:
        return text.encode(encoding, "backslashreplace").decode(encoding)
    except LookupError:
        pass
    return text


# clipcli's own symbols in titles and footers, spelt in ASCII where the stream cannot hold
# them (`‖A−B‖` would otherwise be written as `\u2016A\u2212B\u2016`, wider than measured).
_ASCII_SYMBOLS = str.maketrans(
    {"‖": "||", "−": "-", "×": "x", "…": "...", "→": "->", "≤": "<=", "≥": ">=", "·": "*"}
)


def our_text(stream: TextIO, text: str) -> str:
    """A title or footer of clipcli's own, as `stream` can show it (names in it escaped)."""
    if can_draw(stream, text):
        return text
    return encodable(stream, text.translate(_ASCII_SYMBOLS))


# rich's HEAVY_HEAD box: the top line, the header's bar, the line under it, the rows' bar,
# the bottom line; rich's ASCII box for streams that cannot hold it.
BOX = "┏━┳┓┃┡━╇┩│└─┴┘"
_ASCII_BOX = str.maketrans(BOX, "+-++||-+||+-++")


def cell_text(value: Value) -> str:
    kind = type(value)  # the common kinds first: a table may have millions of cells
    if kind is float:
        return f"{value:.6g}"
    if kind is int:  # digits: printable as they are
        return str(value)
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, (tuple, list)):
        return "[" + ",".join(map(str, value)) + "]"
    if isinstance(value, dict):
        return printable(object_text(value))
    return printable(str(value))


def _column_texts(values: list[Value]) -> list[str]:
    """cell_text of each value, a column at a time (one kind of value, mostly)."""
    kinds = set(map(type, values))
    if kinds == {float}:
        return list(map("{:.6g}".format, values))
    if kinds == {int} or kinds == {tuple}:
        # Numbers of elements and shapes repeat (a mixture of experts' 100,000 tensors
        # have a few shapes): each text is made once and shared, not held once per row.
        texts: dict[Value, str] = {}
        return [texts.get(v) or texts.setdefault(v, cell_text(v)) for v in values]
    if kinds == {str}:
        return list(map(printable, values))  # type: ignore[arg-type]
    if kinds == {bool}:
        return ["yes" if value else "no" for value in values]
    return list(map(cell_text, values))


def cells(text: str) -> int:
    """Terminal cells `text` takes: East Asian wide and full-width characters take two,
    combining marks none (the text is already escaped: no control characters)."""
    if text.isascii():
        return len(text)
    return sum(_cell_width(ch) for ch in text)


def widest(texts: Sequence[str]) -> int:
    """max(cells(t) for t in texts), counting characters where all are ASCII."""
    if "".join(texts).isascii():
        return max(map(len, texts), default=0)
    return max(map(cells, texts), default=0)


def _cell_width(ch: str) -> int:
    if unicodedata.combining(ch):
        return 0
    return 2 if unicodedata.east_asian_width(ch) in ("W", "F") else 1


def middle_ellipsis(text: str, width: int) -> str:
    """`text` in at most `width` cells: its start, '…', its end (the end gets two thirds:
    `…q_proj.weight` says more than `model.layers.`)."""
    if cells(text) <= width:
        return text
    budget = max(width - 1, 2)
    head_budget = budget // 3
    head = _take(text, head_budget)
    tail = _take(text[::-1], budget - cells(head))[::-1]
    return head + ELLIPSIS + tail


def middle_ellipses(texts: Sequence[str], width: int) -> list[str]:
    """Every text in at most `width` cells, cut in the middle at one position for the
    whole list, chosen so that the shortened texts stay as distinct as the originals
    (`model.layers.1…self_attn.q_proj.weight` must not become the same for every layer):
    the default split (a third head, two thirds tail) when it keeps them apart, else the
    split nearest to it that keeps the most apart. Where one split cannot keep them all
    apart, each text still colliding keeps its digit runs (layer numbers) in the cut."""
    long = [t for t in texts if cells(t) > width]
    if not long:
        return list(texts)
    budget = max(width - 1, 2)
    default = budget // 3
    wanted = len(set(texts))

    def cut_at(head_budget: int) -> list[str]:
        return [_split(t, width, budget, head_budget) for t in texts]

    def next_to_a_number(head_budget: int) -> bool:  # `lay….8.self`: 8, 18 or 28?
        for text in long:
            head = _take(text, head_budget)
            tail = _take(text[::-1], budget - cells(head))[::-1]
            if head[-1:].isdigit() or any(ch.isdigit() for ch in tail[:2]):
                return True
        return False

    # Nearest splits first; a very long list tries fewer of them (it is rendered plain).
    order = sorted(range(budget + 1), key=lambda h: (abs(h - default), h))
    if len(long) > PLAIN_TABLE_ROWS:
        order = order[:8]
    best, best_score = list(texts), (-1, False)
    for head_budget in order:
        shortened = cut_at(head_budget)
        distinct = len(set(shortened))
        if distinct < best_score[0]:
            continue
        whole_numbers = distinct >= wanted and not next_to_a_number(head_budget)
        if (distinct, whole_numbers) > best_score:
            best, best_score = shortened, (distinct, whole_numbers)
        if whole_numbers or (distinct >= wanted and len(long) > PLAIN_TABLE_ROWS):
            break  # (a very long list takes the first split that keeps the names apart)
    best_distinct = best_score[0]
    if best_distinct < wanted:
        best = _keep_digits(texts, best, width)
    return best


def _split(text: str, width: int, budget: int, head_budget: int) -> str:
    if text.isascii():  # the common case, without counting cells
        if len(text) <= width:
            return text
        head = text[:head_budget]
        return head + ELLIPSIS + text[len(text) - (budget - len(head)) :]
    if cells(text) <= width:
        return text
    head = _take(text, head_budget)
    tail = _take(text[::-1], budget - cells(head))[::-1]
    return head + ELLIPSIS + tail


def _keep_digits(texts: Sequence[str], shortened: list[str], width: int) -> list[str]:
    """For the shortened texts that still collide: keep the digit runs that tell them
    apart, head…digits…tail, in the same width."""
    import re
    from collections import Counter

    seen = Counter(shortened)
    out = list(shortened)
    for i, (text, short) in enumerate(zip(texts, shortened, strict=True)):
        if seen[short] < 2:
            continue
        digits = ".".join(re.findall(r"\d+", text))
        if not digits:
            continue
        room = max(width - cells(digits) - 2, 2)  # two ellipses around the digits
        head = _take(text, room // 3)
        tail = _take(text[::-1], room - cells(head))[::-1]
        candidate = f"{head}{ELLIPSIS}{digits}{ELLIPSIS}{tail}"
        if cells(candidate) <= width:
            out[i] = candidate
    return out


def _take(text: str, width: int) -> str:
    if text.isascii():  # one cell per character (the text is escaped: no controls)
        return text[: max(width, 0)]
    taken, used = [], 0
    for ch in text:
        used += cells(ch)
        if used > width:
            break
        taken.append(ch)
    return "".join(taken)


# A NamedTuple, not a frozen dataclass: as immutable, and cheaper to define at import
# (start-up of norms in shell loops, issue 12 item 7).
class Layout(NamedTuple):
    """Which columns a table shows and how wide its names may be."""

    shown: tuple[int, ...]  # column indices, in report order (0, the name, always)
    name_width: int | None  # None: names in full
    hidden: tuple[str, ...]  # titles of the hidden columns, for the note under the table


def table_width(widths: Sequence[int]) -> int:
    """rich's default box: a border before each column and after the last, and one cell
    of padding on each side of every column."""
    return sum(widths) + 3 * len(widths) + 1


def fit(report: Report, texts: Sequence[Sequence[str]], width: int | None) -> Layout:
    natural = [
        max(cells(c.title), widest([row[i] for row in texts])) for i, c in enumerate(report.columns)
    ]
    shown = list(range(len(report.columns)))
    if width is None or table_width(natural) <= width:
        return Layout(tuple(shown), None, ())
    index = {c.key: i for i, c in enumerate(report.columns)}
    hidden: list[str] = []

    def room() -> int:  # cells left for the names
        return width - (table_width([natural[i] for i in shown]) - natural[0])

    def hide(key: str) -> None:
        shown.remove(index[key])
        hidden.append(report.columns[index[key]].title)

    early = [key for key in report.drop_order if key in index and key not in report.kept]
    # kept columns go last of all, after the names are cut to NAME_MIN_CELLS
    late = [key for key in report.drop_late if key in index and key not in report.kept]
    late += [key for key in report.drop_order if key in index and key in report.kept]
    late += [key for key in report.drop_late if key in index and key in report.kept]
    # A column that says the same on every row (dtype all float32, changed all yes) tells
    # no row apart: such columns go first, an empty one unsaid, the others with their one
    # value in the note; then the least useful ones.
    for key in constant_columns(report, texts):
        if room() >= natural[0]:
            break
        i = index[key]
        shown.remove(i)
        for keys in (early, late):
            if key in keys:
                keys.remove(key)
        value = texts[0][i]
        if value:
            hidden.append(f"{report.columns[i].title} (all {value})")
    while early and room() < natural[0]:
        hide(early.pop(0))
    while late and room() < min(natural[0], NAME_MIN_CELLS):
        hide(late.pop(0))
    if room() >= natural[0]:
        return Layout(tuple(shown), None, tuple(hidden))
    return Layout(tuple(shown), max(room(), NAME_MIN_CELLS), tuple(hidden))


def constant_columns(report: Report, texts: Sequence[Sequence[str]]) -> list[str]:
    """The keys of the columns (never the name's, nor a kept one's: four LayerNorm weights
    all of norm 8 are still what `--sort norm` shows) that read the same on every row of
    two or more: empty ones first, then in the order the report would drop them, then from
    the last column back."""
    if len(texts) < 2:
        return []
    keys = [c.key for c in report.columns]
    preference = [*report.drop_order, *report.drop_late, *reversed(keys)]
    constant = [
        i
        for i in range(1, len(keys))
        if keys[i] not in report.kept and len({row[i] for row in texts}) == 1
    ]
    constant.sort(key=lambda i: (texts[0][i] != "", preference.index(keys[i])))
    return [keys[i] for i in constant]


def render_table(report: Report, stream: TextIO, width: int | None) -> None:
    titles = tuple(c._replace(title=our_text(stream, c.title)) for c in report.columns)
    report = report._replace(columns=titles)  # measured as they will be written
    if width is None and len(report.rows) > PLAIN_TABLE_ROWS:
        _render_plain_streamed(report, stream)
        return
    by_column = _texts_by_column(report)
    texts = [list(row) for row in zip(*by_column, strict=True)] if report.rows else []
    if not "".join(text for row in texts for text in row).isascii():  # ASCII fits any stream
        texts = [[encodable(stream, text) for text in row] for row in texts]
    layout = fit(report, texts, width)
    columns = [report.columns[i] for i in layout.shown]
    shows_all = len(layout.shown) == len(report.columns)
    rows = texts if shows_all else [[row[i] for i in layout.shown] for row in texts]
    if layout.name_width is not None:
        names = middle_ellipses([row[0] for row in rows], layout.name_width)
        rows = [[name, *row[1:]] for name, row in zip(names, rows, strict=True)]
    notes = [our_text(stream, printable(line)) for line in report.footer]
    notes += [metadata_line(key, value, width) for key, value in report.metadata]
    notes += [metadata_change_line(*change, width) for change in report.metadata_changes]
    if layout.hidden:
        notes.append(
            f"hidden at {width} columns: {', '.join(layout.hidden)} (--format csv has all)"
        )
    # The title is a plain line, not the table's title: rich would wrap a long path to
    # the table's width, and a path is something people grep for.
    stream.write("".join(line + "\n" for line in title_lines(printable(report.title), width)))
    if not rows and report.empty:
        stream.write(report.empty + "\n")
    elif len(rows) > PLAIN_TABLE_ROWS:
        stream.write("".join(line + "\n" for line in _plain_lines(columns, rows)))
    else:
        _boxed_table(columns, rows, stream)
    # Built once and written once: a million metadata lines through console.print took
    # minutes. Footer lines are plain text (escaped), never markup.
    if notes:
        stream.write("".join(line + "\n" for note in notes for line in fit_line(note, width)))


def _texts_by_column(report: Report) -> list[list[str]]:
    """The cells' texts, a list per column, reading each row once (Rows makes a row
    each time it is read)."""
    rows = tuple(report.rows)
    return [_column_texts([row[i] for row in rows]) for i in range(len(report.columns))]


def _text_blocks(report: Report, stream: TextIO, escape: bool | None) -> Iterator[list[list[str]]]:
    """The cells' texts as they will be written, a block of rows at a time, a list per
    column: escaped where `stream` cannot hold them when `escape` is True, never when it
    is False, and in the blocks that are not all ASCII when it is None (which is the same
    where the stream holds ASCII: _holds_ascii)."""
    for start in range(0, len(report.rows), _ROWS_AT_ONCE):
        rows = report.rows[start : start + _ROWS_AT_ONCE]
        block = [_column_texts([row[i] for row in rows]) for i in range(len(report.columns))]
        if escape or (escape is None and not all("".join(t).isascii() for t in block)):
            block = [[encodable(stream, text) for text in texts] for texts in block]
        yield block


_PRINTABLE_ASCII = "".join(map(chr, range(32, 127)))


def _holds_ascii(stream: TextIO) -> bool:
    """Whether `stream`'s encoding holds every printable ASCII character (cp864 has no
    '%': attack s36b)."""
    return encodable(stream, _PRINTABLE_ASCII) == _PRINTABLE_ASCII


def _render_plain_streamed(report: Report, stream: TextIO) -> None:
    """render_table for a long table with no width to fit (a pipe or file, no COLUMNS):
    every column shown, names whole, plain rows (what fit() and _plain_lines give then).
    The rows are read twice, a block at a time: once for the columns' widths, once to
    write them; no text of a cell is held beyond its block (200,000 rows: ~150 MB less
    than a list per row and every line at once, and ~30 MB less than every cell's text)."""
    columns = report.columns
    # As the laid-out table: every cell escaped if any is not ASCII. Decided per block
    # where that is the same (the stream holds ASCII), else by a first look at every block.
    escape = None
    if not _holds_ascii(stream):
        blocks = _text_blocks(report, stream, False)
        escape = not all("".join(t).isascii() for block in blocks for t in block)
    widths = [widest([column.title]) for column in columns]
    ascii_only = all(column.title.isascii() for column in columns)
    for block in _text_blocks(report, stream, escape):
        widths = [max(w, widest(texts)) for w, texts in zip(widths, block, strict=True)]
        ascii_only = ascii_only and all("".join(texts).isascii() for texts in block)
    notes = [our_text(stream, printable(line)) for line in report.footer]
    notes += [metadata_line(key, value, None) for key, value in report.metadata]
    notes += [metadata_change_line(*change, None) for change in report.metadata_changes]
    stream.write("".join(line + "\n" for line in title_lines(printable(report.title), None)))
    stream.write(_plain_block(columns, widths, [[c.title] for c in columns], ascii_only))
    for block in _text_blocks(report, stream, escape):
        stream.write(_plain_block(columns, widths, block, ascii_only))
    if notes:
        stream.write("".join(line + "\n" for note in notes for line in fit_line(note, None)))


_ROWS_AT_ONCE = 4096


def _plain_block(
    columns: Sequence[Any], widths: list[int], block: list[list[str]], ascii_only: bool
) -> str:
    """Rows of a plain table, a list of texts per column: each line as _plain_lines makes it."""
    if ascii_only:  # one cell per character
        padded = [
            [text.rjust(w) if column.numeric else text.ljust(w) for text in texts]
            for column, w, texts in zip(columns, widths, block, strict=True)
        ]
    else:
        padded = [
            [_pad(text, w, right=column.numeric) for text in texts]
            for column, w, texts in zip(columns, widths, block, strict=True)
        ]
    return "".join("  ".join(parts).rstrip() + "\n" for parts in zip(*padded, strict=True))


def _boxed_table(columns: Sequence[Any], rows: Sequence[Sequence[str]], stream: TextIO) -> None:
    """The table in rich's default box (HEAVY_HEAD), drawn here: the cells are fitted
    already, and `ls` in a shell loop should not pay for importing rich (~30 ms)."""
    widths = [max([cells(c.title)] + [cells(r[i]) for r in rows]) for i, c in enumerate(columns)]

    def line(left: str, fill: str, middle: str, right: str) -> str:
        return left + middle.join(fill * (w + 2) for w in widths) + right + "\n"

    def row(texts: Sequence[str], bar: str) -> str:
        parts = [
            _pad(text, w, right=c.numeric)
            for text, w, c in zip(texts, widths, columns, strict=True)
        ]
        return bar + " " + f" {bar} ".join(parts) + " " + bar + "\n"

    box = BOX if can_draw(stream, BOX) else BOX.translate(_ASCII_BOX)
    out = [line(*box[0:4]), row([c.title for c in columns], box[4])]
    out.append(line(*box[5:9]))
    out += [row(texts, box[9]) for texts in rows]
    out.append(line(*box[10:14]))
    stream.write("".join(out))


def _plain_lines(columns: Sequence[Any], rows: Sequence[Sequence[str]]) -> list[str]:
    texts = [[c.title for c in columns], *rows]
    widths = [widest([row[i] for row in texts]) for i in range(len(columns))]
    if "".join(text for row in texts for text in row).isascii():  # one cell per character
        padded = [
            [text.rjust(w) if column.numeric else text.ljust(w) for text in texts_of_column]
            for column, w, texts_of_column in zip(
                columns, widths, zip(*texts, strict=True), strict=True
            )
        ]
        return ["  ".join(parts).rstrip() for parts in zip(*padded, strict=True)]
    lines = []
    for row in texts:
        parts = [
            _pad(text, w, right=column.numeric)
            for text, w, column in zip(row, widths, columns, strict=True)
        ]
        lines.append("  ".join(parts).rstrip())
    return lines


def _pad(text: str, width: int, right: bool) -> str:
    fill = " " * (width - cells(text))
    return fill + text if right else text + fill


def pipe_console(stream: TextIO, width: int) -> Any:
    """A rich Console on `stream` that lets a closed pipe surface as BrokenPipeError.

    rich's own handler points stdout at /dev/null and raises SystemExit(1), which is the
    --fail-above exit code; cli.py turns BrokenPipeError into a quiet exit 0 instead, as
    `head` expects of any Unix tool."""
    from rich.console import Console

    class PipeConsole(Console):
        def on_broken_pipe(self) -> None:
            raise BrokenPipeError

    return PipeConsole(file=stream, width=width, highlight=False)


def fit_line(line: str, width: int | None) -> list[str]:
    """A line under the table in lines of at most `width` cells: broken between words,
    continued two spaces in (a line that already fits is left as it is)."""
    if width is None or cells(line) <= width:
        return [line]
    import textwrap

    room = max(width, 8)
    wrapped = textwrap.wrap(
        line, room, subsequent_indent="  ", break_on_hyphens=False, drop_whitespace=True
    )
    out: list[str] = []
    for piece in wrapped:  # textwrap counts characters; wide characters take two cells
        while cells(piece) > room:
            head = _take(piece, room)
            out.append(head)
            piece = "  " + piece[len(head) :]
        out.append(piece)
    return out


def title_lines(title: str, width: int | None) -> list[str]:
    """The title on one line; if it is too wide, a diff's `A -> B` on two lines, and a
    path still too wide shortened in the middle (--format json has the paths whole)."""
    if width is None or cells(title) <= width:
        return [title]
    parts = title.split(" -> ", 1)
    lines = [parts[0]] + (["  -> " + parts[1]] if len(parts) == 2 else [])
    if all(cells(line) <= width for line in lines):
        return lines
    return [middle_ellipsis(line, max(width, 16)) for line in lines]


def _value_text(value: str | None) -> str:
    return "(absent)" if value is None else printable(value)


def metadata_change_line(key: str, a: str | None, b: str | None, width: int | None) -> str:
    """`metadata KEY: A -> B` (diff), values as they are (no quotes), `(absent)` for a key a
    side does not have; values cut to share the width, saying where the rest is."""
    key, ta, tb = shorten(printable(key)), _value_text(a), _value_text(b)
    line = f"metadata {key}: {ta} -> {tb}"
    if max(len(ta), len(tb)) <= METADATA_VALUE_CHARS and (width is None or cells(line) <= width):
        return line
    more, room = " (--format json has all)", METADATA_VALUE_CHARS
    if width is not None:
        key = middle_ellipsis(key, max(width // 3, 12))
        for more in (" (--format json has all)", " (--format json)"):
            fixed = cells(f"metadata {key}: ") + cells(" -> ") + cells(more)
            room = min(max((width - fixed) // 2, 6), METADATA_VALUE_CHARS)
            if room >= 10:
                break

    if (a is None) != (b is None):  # `(absent)` is never cut: the other side gets its room
        room += max(room - cells("(absent)"), 0)

    def cut(value: str | None, text: str) -> str:
        if value is None or cells(text) <= room:
            return text
        return _take(text, room - 1) + ELLIPSIS

    return f"metadata {key}: {cut(a, ta)} -> {cut(b, tb)}{more}"


def metadata_line(key: str, value: str, width: int | None) -> str:
    """`metadata KEY = VALUE` on one line: a long value (a Keras model_config is 20+ KB of
    JSON) is cut to the terminal's width, or to METADATA_VALUE_CHARS without one, saying
    how long it is; --format json has it whole."""
    key, value = shorten(printable(key)), printable(value)
    line = f"metadata {key} = {value}"
    if len(value) <= METADATA_VALUE_CHARS and (width is None or cells(line) <= width):
        return line
    more = f"… ({len(value):,} characters; --format json has all)"
    room = METADATA_VALUE_CHARS
    if width is not None:
        key = middle_ellipsis(key, max(width // 3, 12))
        if width - cells(f"metadata {key} = ") - cells(more) < 10:
            more = "… (--format json has all)"
        room = min(room, max(width - cells(f"metadata {key} = ") - cells(more), 6))
    return f"metadata {key} = {_take(value, room)}{more}"


def shorten(text: str, limit: int = METADATA_VALUE_CHARS) -> str:
    """The first `limit` characters and how many there were, for a value too long to show."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters; --format json shows all)"
