"""Progress bars: on stderr only for a terminal and work over the delay; never in pipes."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from clipcli import cli
from clipcli.progress import SILENT
from clipcli.report import TerminalProgress


def test_no_progress_when_stderr_is_not_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli._progress() is SILENT
    sample = Path(__file__).resolve().parent.parent / "sample_data" / "tiny_mlp.safetensors"
    assert cli.main(["norms", "-f", "json", str(sample)]) == 0
    assert capsys.readouterr().err == ""


def test_quiet_turns_progress_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.stderr.isatty", lambda: True, raising=False)
    assert cli._progress(quiet=True) is SILENT


def test_terminal_progress_shows_bytes_after_the_delay(monkeypatch: pytest.MonkeyPatch) -> None:
    screen = io.StringIO()
    from rich.console import Console

    monkeypatch.setattr(
        "rich.console.Console", lambda **_kw: Console(file=screen, force_terminal=True, width=100)
    )
    progress = TerminalProgress(delay=0.0)
    progress.start("measuring", 4 << 20)
    progress.advance(2 << 20)
    progress.advance(2 << 20)
    progress.finish()
    text = screen.getvalue()
    assert "measuring" in text
    assert "MiB" in text


def test_quick_passes_print_nothing() -> None:
    progress = TerminalProgress(delay=60.0)
    progress.start("measuring", 100)
    progress.advance(100)
    progress.finish()
    assert progress._bar is None
