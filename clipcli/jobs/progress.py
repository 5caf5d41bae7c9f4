"""The progress interface the jobs report to; the terminal bar lives in report.py."""

from __future__ import annotations

import threading


class Progress:
    """Told how many bytes each pass will read and how many are done; silent by default."""

    def start(self, label: str, total_bytes: int) -> None:
        pass

    def advance(self, nbytes: int) -> None:
        pass

    def finish(self) -> None:
        pass


SILENT = Progress()


class LockedProgress(Progress):
    """A progress told by several threads (a model directory's shards written at once)."""

    def __init__(self, progress: Progress) -> None:
        self._progress = progress
        self._lock = threading.Lock()

    def start(self, label: str, total_bytes: int) -> None:
        with self._lock:
            self._progress.start(label, total_bytes)

    def advance(self, nbytes: int) -> None:
        with self._lock:
            self._progress.advance(nbytes)

    def finish(self) -> None:
        with self._lock:
            self._progress.finish()
