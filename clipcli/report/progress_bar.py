"""The terminal progress bar (stderr, only when it is a terminal).

One bar per pass, shown from its first byte: binary units throughout (MiB, GiB, MiB/s).
When the writing pass is done the bar stays, labelled, while the output is synced to disk
(that can take seconds); close() ends the line on every exit, errors and Ctrl-C included,
so that the next message starts on a line of its own.
"""

from __future__ import annotations

import time
from typing import Any

from clipcli.errors import printable
from clipcli.progress import Progress

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


def close_all() -> None:
    """Finish every bar's line (the error boundary calls this before it prints)."""
    for bar in list(_open_bars):
        bar.close()


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

    def _open(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, ProgressColumn, TextColumn
        from rich.text import Text

        class Sizes(ProgressColumn):
            def render(self, task: Any) -> Text:
                done = binary_size(task.completed)
                total = binary_size(task.total or 0)
                speed = f"{binary_size(task.speed)}/s" if task.speed else ""
                left = ""
                if task.speed and task.total:
                    seconds = max(task.total - task.completed, 0) / task.speed
                    left = f"{int(seconds // 60)}:{int(seconds % 60):02d} left"
                return Text(f"{done} / {total}  {speed}  {left}".rstrip())

        self._bar = Progress(
            TextColumn("{task.description}", markup=False),  # labels hold file names
            BarColumn(),
            Sizes(),
            console=Console(stderr=True),
            transient=True,
        )
        _open_bars.add(self)
        self._bar.start()
        self._task = self._bar.add_task(self._label, total=self._total, completed=self._done)
