"""The safetensors writer of OUT '-': the same file, written in order to standard output."""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO

from clipcli.errors import WriteError
from clipcli.formats.base import Checkpoint, Reader, TensorInfo
from clipcli.formats.safetensors.writer import SafetensorsWriter


class SafetensorsStreamWriter(SafetensorsWriter):
    """The same file, written strictly in order to standard output (a pipe or a file the
    shell opened): no reservation, no kernel copies, no writes at offsets. The path it is
    given is ignored; the descriptor is a duplicate of 1, so closing it closes no stdout."""

    def __init__(self, path: Path, checkpoint: Checkpoint, durable: bool = False) -> None:  # noqa: ARG002
        super().__init__(path, checkpoint, durable=False)

    stream: _CountingStream | None = None  # the last stream opened (one per process run)

    def _open(self, path: Path) -> BinaryIO:  # noqa: ARG002
        raw = _CountingStream(os.dup(1), "wb")
        SafetensorsStreamWriter.stream = raw
        return io.BufferedWriter(raw)

    @classmethod
    def bytes_sent(cls) -> int:
        """Bytes the last stream has written to standard output so far."""
        return 0 if cls.stream is None else cls.stream.sent

    def abort(self) -> None:
        # What is still buffered cannot go out (the failure was likely the stream's own):
        # closing tries once more, and that second failure is not the one to report.
        with contextlib.suppress(Exception):
            super().abort()

    def _reserve(self, total: int) -> None:
        pass  # a pipe cannot be reserved

    @classmethod
    def check_metadata(cls, metadata: Mapping[str, str], source: Reader) -> str | None:
        if source.format_name != "safetensors":
            return (
                f"standard output carries safetensors only, and IN is {source.format_name}; "
                "name an OUT file to convert"
            )
        return super().check_metadata(metadata, source)

    def copy_ahead(self, source: Reader, info: TensorInfo) -> None:
        pass  # kernel copies write at offsets, which a stream has not

    def copy_unchanged(self, source: Reader, info: TensorInfo) -> bool:  # noqa: ARG002
        return False  # streamed chunk by chunk, in order

    def copy_unchanged_many(self, source: Reader, infos: Sequence[TensorInfo]) -> bool:  # noqa: ARG002
        return False  # streamed in order

    def _written(self) -> None:
        pass  # no writeback hints: a pipe has no pages to start writing


class _CountingStream(io.FileIO):
    """Standard output's duplicate, counting what it has written; a failed write is a
    WriteError (exit 5) saying how much went out: the stream is then cut short, which a
    safetensors reader refuses, and the run must not end with exit 0."""

    sent = 0

    def write(self, data: Any) -> int:
        try:
            written = super().write(data)
        except BrokenPipeError:
            raise WriteError(
                f"OUT '-': standard output closed after {self.sent} bytes; the stream is cut short"
            ) from None
        except OSError as exc:
            raise WriteError(
                f"OUT '-': writing to standard output failed after {self.sent} bytes "
                f"({exc.strerror or exc}); the stream is cut short"
            ) from None
        self.sent += written or 0
        return written or 0
