"""The progress interface the jobs report to; the terminal bar lives in report.py."""

from __future__ import annotations


class Progress:
    """Told how many bytes each pass will read and how many are done; silent by default."""

    def start(self, label: str, total_bytes: int) -> None:
        pass

    def advance(self, nbytes: int) -> None:
        pass

    def finish(self) -> None:
        pass


SILENT = Progress()
