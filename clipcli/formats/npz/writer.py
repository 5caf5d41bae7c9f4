"""NpzWriter: tensors written as .npy members of a zip, as np.savez would."""

from __future__ import annotations

import contextlib
import zipfile
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from clipcli.dtypes import from_ml_dtypes
from clipcli.formats.base import (
    Checkpoint,
    Reader,
    TensorInfo,
    Writer,
    byte_view,
    numpy_size_overflows,
)
from clipcli.formats.npz.metadata import framework_tag_notes, metadata_losses
from clipcli.formats.npz.npyheader import _npy_header
from clipcli.formats.zipsafe import member_key, member_name_problem

# The zip headers give a member name a 16-bit length; np.savez adds '.npy' to the key.
ZIP_NAME_BYTES = 0xFFFF


class NpzWriter(Writer):
    format_name = "npz"

    def __init__(self, path: Path, checkpoint: Checkpoint, durable: bool = False) -> None:
        super().__init__(path, checkpoint, durable)
        compress = checkpoint.compressed
        self._zip = zipfile.ZipFile(
            path, "w", zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED, allowZip64=True
        )

    @classmethod
    def structure_losses(cls, source: Reader) -> list[str]:
        """npz holds tensors and nothing else: file metadata and any structure are lost.
        The metadata is what one file would hold (a model directory's shards joined: its
        index's derived total_size and total_parameters are no loss; join_losses names the
        rest of the index's)."""
        return super().structure_losses(source) + metadata_losses(source.joined_metadata())

    @classmethod
    def structure_notes(cls, source: Reader) -> list[str]:
        return framework_tag_notes(source.joined_metadata(), "npz")

    @classmethod
    def check_dtype(cls, info: TensorInfo) -> str | None:
        if from_ml_dtypes(info.dtype):
            return f"npz cannot hold {info.dtype.name}; write .safetensors instead"
        return None

    @classmethod
    def check_shape(cls, info: TensorInfo) -> str | None:
        """np.load makes the array: numpy's rank and size limits, nothing more."""
        if (problem := super().check_shape(info)) is not None:
            return f"np.load cannot read it back: {problem}"
        if numpy_size_overflows(info.shape, info.dtype.itemsize):
            return f"np.load cannot make an array of shape {list(info.shape)} (numpy's size limit)"
        return None

    @classmethod
    def check_name(cls, name: str) -> str | None:
        # The member is NAME.npy, judged by the very rule the zip readers apply.
        escape = member_name_problem(f"{name}.npy")
        if escape is not None or name.endswith("/"):
            return f"a zip member must not escape the archive: {escape or 'a trailing /'}"
        problem = super().check_name(name)
        if problem is None and len(f"{name}.npy".encode()) > ZIP_NAME_BYTES:
            return (
                f"a zip member name holds at most {ZIP_NAME_BYTES} bytes, and this one "
                f"(with '.npy', as UTF-8) has {len(f'{name}.npy'.encode())}"
            )
        return problem

    @classmethod
    def check_names(cls, names: Sequence[str]) -> str | None:
        """Members that normalise alike ('a/b', 'a//b', 'a/./b', 'a\\b') are one file to an
        extracting tool; and np.load(out)[K] takes the member named K before K + '.npy',
        so tensors 'a' and 'a.npy' (members 'a.npy', 'a.npy.npy') would read crossed."""
        present = set(names)
        seen: dict[str, str] = {}
        for name in names:
            if f"{name}.npy" in present:
                return (
                    f"tensors {name!r} and {name + '.npy'!r} cannot both be npz members: "
                    f"np.load(...)[{name + '.npy'!r}] would return {name!r}"
                )
            key = member_key(f"{name}.npy")
            if key in seen:
                return (
                    f"tensors {seen[key]!r} and {name!r} would be one zip member once "
                    f"normalised ({key!r})"
                )
            seen[key] = name
        return None

    def write(self, info: TensorInfo, chunks: Iterable[np.ndarray]) -> None:
        with self._zip.open(f"{info.name}.npy", "w", force_zip64=True) as member:
            member.write(_npy_header(info))
            for chunk in chunks:
                member.write(byte_view(chunk, info.dtype))

    def close(self) -> None:
        self._zip.close()

    def abort(self) -> None:
        with contextlib.suppress(OSError, ValueError, zipfile.BadZipFile):
            self._zip.close()
