"""OUT '-': the clipped safetensors file streamed to standard output.

safetensors is the one format that streams: its header, written first, holds every offset,
and clipping changes no name, dtype or shape, so the header is known before the first
tensor is written. The plan is complete (every refusal made) before the first byte goes
out; what can still fail after that (a read error, the input changing, a signal, the
reader of the pipe going away) ends the run with its usual non-zero exit and a stream
cut short, which a safetensors reader refuses (its size no longer matches the header).
So a pipeline must check clipcli's exit status (`set -o pipefail`).

Refused (exit 2): standard output that is a terminal (binary data), that is the input
file itself, and inputs that are not one safetensors file (no other format streams).
"""

from __future__ import annotations

import contextlib
import os
import stat
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

from clipcli.errors import ClipcliError, UsageError, WriteError
from clipcli.formats.base import Writer
from clipcli.output.target import Refused, Target
from clipcli.system import interrupts
from clipcli.system.footprint import InputFootprint

STDOUT = "-"
_NOTHING_WRITTEN = "no output written"


class StdoutTarget(Target):
    """OUT is the process's standard output; nothing is staged, renamed or replaced."""

    kind = "stream"

    def writer_class(self) -> type[Writer]:
        # On first use, as io.writer_class does: norms imports this module (through api)
        # and never writes.
        from clipcli.formats.safetensors.stream import SafetensorsStreamWriter

        return SafetensorsStreamWriter  # the one format that streams

    def __init__(self, *, force: bool, durable: bool) -> None:  # noqa: ARG002
        super().__init__(Path(STDOUT), force=force, durable=False)

    def check(self, footprint: InputFootprint, expected_names: Iterable[str] = ()) -> None:  # noqa: ARG002
        fd = _stdout_fd()
        try:
            info = os.fstat(fd)
        except OSError:
            raise WriteError("OUT '-': standard output is closed") from None
        if os.isatty(fd):
            raise UsageError(
                "OUT '-': standard output is a terminal; redirect it to a file or a pipe "
                "(clipcli clip ... - > out.safetensors)"
            )
        if footprint.root_is_directory:
            raise UsageError(
                "OUT '-': a model directory does not stream; name an OUT directory instead"
            )
        if stat.S_ISREG(info.st_mode) and (info.st_dev, info.st_ino) in footprint.inodes:
            raise Refused("OUT '-': standard output is the input file; choose another OUT")

    @contextlib.contextmanager
    def stage(self) -> Iterator[Path]:
        """The writer writes straight to standard output; there is nothing to commit."""
        from clipcli.formats.safetensors.stream import SafetensorsStreamWriter  # as above

        sys.stdout.flush()  # nothing of ours may follow the binary data out of order
        try:
            yield Path(STDOUT)
            interrupts.settle()  # the whole stream is out: a later signal is moot
        except ClipcliError as exc:
            # "no output written" is true of a staged file, not of a stream: say what went.
            sent = SafetensorsStreamWriter.bytes_sent()
            text = str(exc)
            if sent and text.endswith(_NOTHING_WRITTEN):
                exc.args = (
                    text[: -len(_NOTHING_WRITTEN)]
                    + f"the stream on standard output was cut short after {sent} bytes",
                )
            raise


def _stdout_fd() -> int:
    try:
        return sys.stdout.fileno()
    except (AttributeError, ValueError, OSError):
        return 1
