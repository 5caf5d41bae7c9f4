"""`norms --chart`: horizontal bars of norms in the terminal, one per listed row."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TextIO

from clipcli.errors import printable
from clipcli.report.table import (
    PLAIN_TABLE_ROWS,
    can_draw,
    cells,
    encodable,
    middle_ellipses,
    pipe_console,
)

BAR_WIDTH = 40
BAR_MIN_WIDTH = 10  # a narrow terminal shortens the bars to this before the names
LABEL_MIN_CELLS = 32  # as for table names: bars shorten first
COUNTED, NOT_COUNTED = "█", "░"  # in the global norm, or listed but not in it
GLYPHS = COUNTED + NOT_COUNTED + "│" + "▸"  # and the limit's mark, and a bar cut at the edge
ASCII_GLYPHS = "#.|>"


def render_chart(
    title: str,
    labels: Sequence[str],
    norms: Sequence[float],
    limit: float | None,
    stream: TextIO,
    width: int | None = None,
    counted: Sequence[bool] | None = None,
) -> None:
    """Bars scaled to the largest norm (or the limit, if larger); the limit is a '│' mark.
    Bars of rows outside the global norm (integer tensors, training state) are drawn with
    '░' and never count as over the limit: a clip would not touch them."""
    counted = [True] * len(labels) if counted is None else list(counted)
    # Scaled to what the global norm counts: a large int64 buffer must not flatten the
    # weights' bars. Its own bar, on the same scale, is cut at the full width and marked
    # '▸' just past its end; its number is printed.
    finite = [n for n, c in zip(norms, counted, strict=True) if c and math.isfinite(n)]
    if not finite:  # nothing listed is in the global norm: the rows' own scale
        finite = [n for n in norms if math.isfinite(n)]
    top = max(finite + ([limit] if limit is not None else []), default=0.0)
    texts = [encodable(stream, printable(label)) for label in labels]
    values = [f"{norm:.6g}" for norm in norms]
    label_width = max((cells(t) for t in texts), default=0)
    norm_width = max((len(v) for v in values), default=0)
    bar_width = BAR_WIDTH
    if width is not None:  # " label  bar  norm": 5 cells around the three parts
        # The bars shrink (down to BAR_MIN_WIDTH) before any name is cut; then the names
        # are cut, never below LABEL_MIN_CELLS.
        spare = width - 5 - norm_width
        bar_width = max(BAR_MIN_WIDTH, min(BAR_WIDTH, spare - label_width))
        label_width = max(min(label_width, spare - bar_width), min(label_width, LABEL_MIN_CELLS))
    mark = round(limit / top * bar_width) if limit is not None and top > 0 else None
    position = None if mark is None else min(mark, bar_width - 1)
    # An ASCII-only stream (LC_ALL=C) gets ASCII bars instead of escapes.
    glyphs = GLYPHS if can_draw(stream, GLYPHS) else ASCII_GLYPHS
    lines = []
    shortened = middle_ellipses(texts, label_width)
    cut_bars = 0
    for label, norm, value, in_global in zip(shortened, norms, values, counted, strict=True):
        beyond = norm > top  # longer than the scale (+inf too): cut at the edge, marked
        length = (
            bar_width
            if not math.isfinite(norm) or beyond
            else min(bar_width, round(norm / top * bar_width))
            if top
            else 0
        )
        cut_bars += beyond
        over = in_global and limit is not None and not norm <= limit
        glyph = glyphs[0] if in_global else glyphs[1]
        bar = glyph * length + " " * (bar_width - length)
        if position is not None:
            bar = bar[:position] + glyphs[2] + bar[position + 1 :]
        pad = " " * (label_width - cells(label))
        gap = (glyphs[3] if beyond else " ") + " "
        lines.append((f" {label}{pad}  ", bar, f"{gap}{value.rjust(norm_width)}", over, in_global))
    stream.write(printable(title) + "\n")  # a plain line, as for tables: never wrapped
    if len(lines) > PLAIN_TABLE_ROWS or not lines:  # rich lays out 20,000 bars in ~7 s
        stream.write("".join(f"{a}{bar}{b}\n" for a, bar, b, _, _ in lines))
    else:
        _coloured(lines, position, stream, glyphs[2])
    if not all(counted):
        stream.write(f"{glyphs[1]} not in the global norm\n")
    if cut_bars:
        stream.write(f"{glyphs[3]} longer than the scale, cut at the edge\n")
    if limit is not None:
        over_count = sum(1 for n, c in zip(norms, counted, strict=True) if c and not n <= limit)
        stream.write(f"limit {limit:g} ({glyphs[2]}): {over_count} of {sum(counted)} over\n")


def _coloured(
    lines: list[tuple[str, str, str, bool, bool]],
    position: int | None,
    stream: TextIO,
    mark: str,
) -> None:
    """The same characters, with over-limit bars red, others green, the mark yellow."""
    from rich.text import Text

    width = max(cells(a) + len(bar) + len(b) for a, bar, b, _, _ in lines)
    console = pipe_console(stream, width)
    for before, bar, after, over, in_global in lines:
        line = Text(before)
        style = "red" if over else "green" if in_global else "dim"
        if position is None:
            line.append(bar, style=style)
        else:
            line.append(bar[:position], style=style)
            line.append(mark, style="bold yellow")
            line.append(bar[position + 1 :], style=style)
        line.append(after)
        console.print(line, no_wrap=True, crop=False, soft_wrap=True)
    console.file.flush()  # before the lines that bypass rich
