"""Progress bars (issue 12, item 4): on stderr only for a terminal, shown from a pass's first
byte, one unit system (binary: MiB, MiB/s), the sync to disk labelled, and the bar's line
finished on every exit (a real SIGINT to a real process on a pseudo-terminal)."""

from __future__ import annotations

import io
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from handmade import write_safetensors
from rich.console import Console

from clipcli.cli import entry as cli
from clipcli.cli.commands.common import progress as cli_progress
from clipcli.jobs.progress import SILENT
from clipcli.report.progress_bar import SYNC_LABEL, TerminalProgress, binary_size

SAMPLE = Path(__file__).resolve().parent.parent / "sample_data" / "tiny_mlp.safetensors"
CSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def test_no_progress_when_stderr_is_not_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_progress() is SILENT
    assert cli.main(["norms", "-f", "json", str(SAMPLE)]) == 0
    assert capsys.readouterr().err == ""


def test_quiet_turns_progress_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.stderr.isatty", lambda: True, raising=False)
    assert cli_progress(quiet=True) is SILENT


@pytest.fixture
def screen(monkeypatch: pytest.MonkeyPatch) -> io.StringIO:
    """What the bar draws, on a 100-column terminal."""
    text = io.StringIO()
    monkeypatch.setattr(
        "rich.console.Console",
        lambda **_kw: Console(file=text, force_terminal=True, width=100),
    )
    return text


def test_bar_is_shown_from_the_first_byte_in_binary_units(screen: io.StringIO) -> None:
    bar = TerminalProgress()
    bar.start("measuring", 4 << 20)
    assert bar._bar is not None  # before any byte is done
    bar.advance(2 << 20)
    bar.close()
    text = screen.getvalue()
    assert "measuring" in text
    assert "MiB" in text
    assert not re.search(r"\b[kMGT]B\b", text)  # no decimal units beside the binary ones


def test_sync_after_writing_is_labelled_until_closed(screen: io.StringIO) -> None:
    bar = TerminalProgress()
    bar.start("writing", 1 << 20)
    bar.advance(1 << 20)
    bar.finish()  # the last byte is written; the sync to disk follows
    assert bar._bar is not None
    bar._bar.refresh()
    assert SYNC_LABEL in screen.getvalue()
    bar.close()
    assert bar._bar is None


@pytest.mark.parametrize(
    ("n", "text"),
    [(0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (1536, "1.5 KiB"), (1 << 30, "1.0 GiB")],
)
def test_binary_sizes(n: int, text: str) -> None:
    assert binary_size(n) == text


# Each chunk's progress report sleeps, so that a 48 MiB file takes seconds on any machine;
# everything else is the real program.
SLOW_RUN = (
    "import time\n"
    "from clipcli.report import progress_bar\n"
    "advance = progress_bar.TerminalProgress.advance\n"
    "def slow(self, n):\n"
    "    time.sleep(0.1)\n"
    "    advance(self, n)\n"
    "progress_bar.TerminalProgress.advance = slow\n"
    "import sys; sys.argv[0] = 'clipcli'\n"
    "from clipcli.__main__ import run\n"
    "run()\n"
)


def _read_until(fd: int, pattern: bytes, seconds: float) -> bytes:
    seen = b""
    deadline = time.monotonic() + seconds
    while pattern not in seen and time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.1)
        if ready:
            try:
                seen += os.read(fd, 65536)
            except OSError:  # the child closed the terminal
                break
    return seen


@pytest.mark.slow
def test_ctrl_c_finishes_the_bar_line(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    model = write_safetensors(
        tmp_path / "m.safetensors",
        {f"w{i}": rng.standard_normal(1 << 20).astype(np.float32) for i in range(12)},
    )
    main_fd, terminal = pty.openpty()
    env = dict(os.environ, COLUMNS="100", TERM="xterm")
    child = subprocess.Popen(
        [sys.executable, "-c", SLOW_RUN, "norms", str(model)],
        stdin=subprocess.DEVNULL,
        stdout=terminal,
        stderr=terminal,
        env=env,
    )
    os.close(terminal)
    try:
        shown = _read_until(main_fd, b"MiB", 30)
        assert b"measuring" in shown, shown  # the bar is up
        child.send_signal(signal.SIGINT)
        shown += _read_until(main_fd, b"interrupted", 30)
        assert child.wait(30) == 130
        shown += _read_until(main_fd, b"\n\n", 0.5)
    finally:
        child.kill()
        os.close(main_fd)
    text = shown.decode("utf-8", "replace")
    before, _, after = text.rpartition("clipcli: error: interrupted")
    assert before, text
    # Once the escape sequences are taken out, the bar's last characters are followed by a
    # carriage return or a newline: the message starts at column 0, on its own line; the
    # bar is not drawn again after it, and the cursor it hid is shown again.
    assert CSI.sub("", before)[-1:] in ("\r", "\n"), repr(before[-200:])
    assert after.strip() == "", repr(after)
    assert before.rfind("\x1b[?25h") > before.rfind("\x1b[?25l"), repr(before[-200:])


def test_clip_to_a_file_finishes_the_bar_before_the_report(tmp_path: Path) -> None:
    """The job drops its TerminalProgress when it returns; the bar must still be closed
    (line ended, cursor shown, never drawn again) before the report, with stdout a file
    and stderr a real terminal."""
    main_fd, terminal = pty.openpty()
    env = dict(os.environ, COLUMNS="80", TERM="xterm")
    report = tmp_path / "rep.txt"
    out = tmp_path / "o.safetensors"
    with report.open("w") as stdout:
        child = subprocess.Popen(
            [sys.executable, "-m", "clipcli", "clip", "--norm", "1", str(SAMPLE), str(out)],
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=terminal,
            env=env,
        )
        os.close(terminal)
        try:
            shown = b""
            deadline = time.monotonic() + 60
            while child.poll() is None and time.monotonic() < deadline:
                shown += _read_until(main_fd, b"\x00", 0.2)
            shown += _read_until(main_fd, b"\x00", 0.3)
            assert child.wait(30) == 0
        finally:
            child.kill()
            os.close(main_fd)
    text = shown.decode("utf-8", "replace")
    assert "writing" in text or "measuring" in text, repr(text)  # a bar was drawn
    assert text.rfind("\x1b[?25h") > text.rfind("\x1b[?25l"), repr(text[-300:])
    after = text[text.rfind("\x1b[?25h") :]
    for drawn in ("MiB", "KiB", SYNC_LABEL):
        assert drawn not in after, repr(after)
    assert "wrote" in report.read_text()


@pytest.mark.parametrize("width", [12, 20, 40, 60, 80, 120])
@pytest.mark.parametrize("label", ["measuring", SYNC_LABEL, "comparing model-00001-of-00009"])
def test_bar_line_fits_the_terminal(width: int, label: str) -> None:
    from rich.cells import cell_len

    from clipcli.report.progress_bar import bar_line

    pieces = bar_line(label, 284 << 20, 320 << 20, 1.8 * (1 << 30), width)
    line = "".join(text for text, _style in pieces)
    assert cell_len(line) <= width - 1, (width, line)
    if width >= 80 and len(label) < 20:  # room for everything: bar, sizes, speed, time left
        assert "━" in line
        assert "GiB/s" in line
        assert "left" in line
    if width >= 40:
        assert label in line  # the label is cut only when nothing else is left to drop


@pytest.mark.parametrize("width", [20, 60, 80])
def test_drawn_bar_is_one_line(monkeypatch: pytest.MonkeyPatch, width: int) -> None:
    text = io.StringIO()
    monkeypatch.setattr(
        "rich.console.Console",
        lambda **_kw: Console(file=text, force_terminal=True, width=width),
    )
    bar = TerminalProgress()
    bar.start("writing", 320 << 20)
    for _ in range(3):
        bar.advance(64 << 20)
        time.sleep(0.05)  # so that rich measures a speed and a time left
    assert bar._bar is not None
    bar._bar.refresh()
    bar.close()
    drawn = CSI.sub("", text.getvalue())
    for line in re.split(r"[\r\n]", drawn):
        assert len(line) <= width - 1, (width, line)
