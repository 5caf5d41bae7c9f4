"""The terminal progress bar (stderr, only when it is a terminal).

One bar per pass, shown from its first byte: binary units throughout (MiB, GiB, MiB/s).
When the writing pass is done the bar stays, labelled, while the output is synced to disk
(that can take seconds); close() ends the line on every exit, errors and Ctrl-C included,
so that the next message starts on a line of its own.
"""

from __future__ import annotations

import math
import time
from typing import Any

from clipcli.errors import printable
from clipcli.jobs.progress import Progress

UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
SYNC_LABEL = "syncing to disk"

# The bars on screen, held strongly: a command may drop its TerminalProgress once the job
# returns, while rich's refresh thread keeps drawing it; close_all() must still find it.
_open_bars: set[TerminalProgress] = set()


def binary_size(n: float) -> str:
    """1536 -> '1.5 KiB': one unit system for sizes and speeds."""
    for unit in UNITS:
        if abs(n) < 1024 or unit == UNITS[-1]:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


class _Erased:
    """The terminal a bar was erased on since the last start_clean_line(), if any: the
    cursor then sits at the start of the bar's row, after the codes that erased it (rich's
    transient stop)."""

    on: Any = None


def close_all() -> None:
    """Finish every bar's line (the error boundary calls this before it prints)."""
    for bar in list(_open_bars):
        bar.close()


def start_clean_line() -> None:
    """After an erased bar, what stderr says next starts a line of its own in the byte
    stream too (a terminal log, `script`, a test reading the terminal), not after the
    erasing codes: up one row and down again with a newline puts the cursor back at the
    start of the bar's row, so no blank row is left on screen."""
    import contextlib
    import sys

    erased_on, _Erased.on = _Erased.on, None
    if erased_on is None or erased_on is not sys.stderr:  # stderr is another stream now
        return
    with contextlib.suppress(OSError, ValueError):  # stderr gone: the exit code tells
        sys.stderr.write("\x1b[1A\n")
        sys.stderr.flush()


class TerminalProgress(Progress):
    """A rich progress bar on stderr: label, bar, done/total, speed, time left.

    `delay` (seconds) holds a pass's bar back; the CLI shows it at once (0)."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self._bar: Any = None
        self._task: Any = None
        self._label = ""
        self._total = 0
        self._done = 0
        self._started = 0.0
        self._stream: Any = None  # the terminal the bar is drawn on

    def start(self, label: str, total_bytes: int) -> None:
        self.close()
        self._label, self._total, self._done = printable(label), total_bytes, 0
        self._started = time.monotonic()
        if self.delay <= 0:
            self._open()

    def advance(self, nbytes: int) -> None:
        self._done += nbytes
        if self._bar is None:
            if time.monotonic() - self._started < self.delay:
                return
            self._open()
        self._bar.update(self._task, completed=self._done)

    def finish(self) -> None:
        """The pass has read its last byte. A writing pass is followed by the sync to disk:
        its bar stays, saying so, until the next pass or close()."""
        if self._bar is not None and self._label == "writing":
            self._bar.update(self._task, completed=self._total, description=SYNC_LABEL)
            return
        self.close()

    def close(self) -> None:
        if self._bar is not None:
            bar, self._bar = self._bar, None
            _open_bars.discard(self)
            bar.stop()
            _Erased.on = self._stream

    def _open(self) -> None:
        from rich.console import Console
        from rich.progress import Progress, ProgressColumn
        from rich.text import Text

        console = Console(stderr=True)
        self._stream = console.file if console.is_terminal else None  # before rich wraps it
        glyphs = bar_glyphs(
            console.color_system is not None and not console.no_color, console.encoding
        )

        class Line(ProgressColumn):
            """The whole line in one column, laid out for the terminal's width now."""

            def render(self, task: Any) -> Text:
                parts = bar_line(
                    str(task.description),
                    int(task.completed),
                    int(task.total or 0),
                    task.speed,
                    console.width,
                    glyphs,
                )
                text = Text(no_wrap=True, overflow="crop")
                for piece, style in parts:
                    text.append(piece, style=style)
                return text

        bar = Progress(Line(), console=console, transient=True)
        try:
            bar.start()  # rich redraws from a thread of its own
        except RuntimeError:  # no thread can be started (RLIMIT_NPROC): no bar, same run
            self.delay = math.inf
            return
        self._bar = bar
        _open_bars.add(self)
        self._task = self._bar.add_task(self._label, total=self._total, completed=self._done)


BAR_MIN, BAR_MAX = 10, 40


def _time_left(done: int, total: int, speed: float | None) -> str:
    if not speed or not total:
        return ""
    seconds = max(total - done, 0) / speed
    return f"{int(seconds // 60)}:{int(seconds % 60):02d} left"


# The bar's filled and empty cells. In colour both are rich's line, told apart by colour;
# without colour (NO_COLOR, a dumb terminal) they must differ in shape, and a stream that
# cannot encode the blocks (LC_ALL=C) gets ASCII.
COLOUR_GLYPHS, PLAIN_GLYPHS, ASCII_GLYPHS = "━━", "█░", "#-"


def bar_glyphs(colour: bool, encoding: str | None) -> str:
    """The filled and empty glyph for a terminal with or without colour."""
    glyphs = COLOUR_GLYPHS if colour else PLAIN_GLYPHS
    try:
        glyphs.encode(encoding or "utf-8")
    except (UnicodeEncodeError, LookupError):
        return ASCII_GLYPHS
    return glyphs


def bar_line(
    label: str,
    done: int,
    total: int,
    speed: float | None,
    width: int,
    glyphs: str = COLOUR_GLYPHS,
) -> list[tuple[str, str]]:
    """The bar's line as (text, style) pieces, at most width - 1 cells (the last column
    would wrap on some terminals). The least useful parts go first: the speed, then the
    time left, then the total, then the bar itself (down to 10 cells before that), and
    last the label is cut. `glyphs` are the filled and the empty cell (bar_glyphs)."""
    from rich.cells import cell_len

    room = max(width - 1, 1)
    sizes = f"{binary_size(done)} / {binary_size(total)}"
    speed_text = f"{binary_size(speed)}/s" if speed else ""
    left = _time_left(done, total, speed)
    layouts = (
        (sizes, speed_text, left),
        (sizes, "", left),
        (sizes, "", ""),
        (binary_size(done), "", ""),
    )
    for with_bar in (True, False):
        for figures in layouts:
            tail = "  ".join(part for part in figures if part)
            fixed = cell_len(label) + 1 + cell_len(tail) + (1 if with_bar else 0)
            bar_cells = min(BAR_MAX, room - fixed) if with_bar else 0
            if with_bar and bar_cells < BAR_MIN:
                continue
            if fixed > room:
                continue
            pieces: list[tuple[str, str]] = [(label + " ", "progress.description")]
            if with_bar:
                filled = bar_cells if not total else min(bar_cells, bar_cells * done // total)
                pieces += [
                    (glyphs[0] * filled, "bar.complete"),
                    (glyphs[1] * (bar_cells - filled), "bar.back"),
                    (" ", ""),
                ]
            pieces.append((tail, "progress.download"))
            return pieces
    cut = max(room - 1, 0)
    return [(_cut_cells(label, cut) + "…" if cell_len(label) > room else label, "")]


def _cut_cells(text: str, cells: int) -> str:
    from rich.cells import cell_len

    while text and cell_len(text) > cells:
        text = text[:-1]
    return text
