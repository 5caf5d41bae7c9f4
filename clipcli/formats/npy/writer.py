"""NpyWriter: one tensor written as np.save would, its header first, then its data streamed."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from clipcli.formats.base import Checkpoint, Reader, TensorInfo, Writer, byte_view
from clipcli.formats.npy.reader import TENSOR_NAME
from clipcli.formats.npz.metadata import framework_tag_notes, metadata_losses
from clipcli.formats.npz.npyheader import _npy_header
from clipcli.formats.npz.writer import NpzWriter


class NpyWriter(Writer):
    format_name = "npy"

    def __init__(self, path: Path, checkpoint: Checkpoint, durable: bool = False) -> None:
        super().__init__(path, checkpoint, durable)
        if (problem := self.check_names([i.name for i in checkpoint.infos])) is not None:
            raise ValueError(problem)  # callers refuse first (api.check_writable)
        self.check_tensors(checkpoint.infos)
        self._file = open(path, "wb")  # noqa: SIM115 - closed by close() or abort()

    @classmethod
    def check_names(cls, names: Sequence[str]) -> str | None:
        if len(names) != 1:
            return (
                f"a .npy file holds exactly one array, and IN has {len(names)} tensors; "
                "write .npz or .safetensors instead"
            )
        return None

    @classmethod
    def check_name(cls, name: str) -> str | None:  # noqa: ARG003 - the name is not stored
        return None

    # np.load's limits are npz's: the same dtypes and shapes, checked the same way.
    check_dtype = NpzWriter.check_dtype
    check_shape = NpzWriter.check_shape

    @classmethod
    def structure_losses(cls, source: Reader) -> list[str]:
        """A .npy file holds one array: file metadata and any structure are lost."""
        return super().structure_losses(source) + metadata_losses(source.joined_metadata())

    @classmethod
    def structure_notes(cls, source: Reader) -> list[str]:
        notes = [
            f"a .npy file names no tensor: {info.name!r} reads back as {TENSOR_NAME!r}"
            for info in source.infos[:1]
            if info.name != TENSOR_NAME
        ]
        return notes + framework_tag_notes(source.joined_metadata(), "npy")

    def write(self, info: TensorInfo, chunks: Iterable[np.ndarray]) -> None:
        self._file.write(_npy_header(info))
        for chunk in chunks:
            self._file.write(byte_view(chunk, info.dtype))

    def close(self) -> None:
        self._file.close()

    def abort(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self._file.close()
