"""NpyReader: one .npy file, its header checked before any data is read."""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from clipcli.errors import InputError
from clipcli.formats.base import (
    Reader,
    StoredBytes,
    TensorInfo,
    default_chunk_elems,
    numpy_size_overflows,
)
from clipcli.formats.npz import reader as npz_reader
from clipcli.formats.npz.fortran import _transposed_chunks
from clipcli.formats.npz.npyheader import InputProblem, _read_npy_header
from clipcli.system.identity import FileIdentity
from clipcli.system.inputs import open_input

TENSOR_NAME = "array"  # a .npy file names no tensor (see the package's docstring)


class NpyReader(Reader):
    format_name = "npy"

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self._handle = open_input(path)  # closed by close()
        try:
            stat = os.fstat(self._handle.fileno())
            self._identity = FileIdentity.of_stat(stat)
            self._info, self._data_offset, self._fortran = self._scan(stat.st_size)
        except BaseException:
            self._handle.close()
            raise

    def _scan(self, file_size: int) -> tuple[TensorInfo, int, bool]:
        """The header, parsed from the file's start, and the data it declares checked
        against the bytes the file holds: a header declaring 10**12 elements over 8 bytes
        is refused here, before anything is allocated (np.load allocates first)."""
        try:
            dtype, shape, fortran, header_len = _read_npy_header(self._handle)
        except InputProblem as exc:
            raise InputError(self.path, str(exc).replace("member", "file")) from None
        except OSError as exc:
            raise InputError(self.path, f"cannot read: {exc.strerror}") from None
        nbytes = math.prod(shape) * dtype.itemsize
        # numpy's rule too (np.load makes the array): (2**32, 2**32, 0) is refused, not empty.
        if nbytes >= 2**62 or numpy_size_overflows(shape, dtype.itemsize):
            raise InputError(self.path, f"shape {list(shape)} overflows", TENSOR_NAME)
        if file_size != header_len + nbytes:
            raise InputError(
                self.path,
                f"shape {list(shape)} of {dtype.name} needs {nbytes} data bytes "
                f"but the file holds {file_size - header_len}",
                TENSOR_NAME,
            )
        return TensorInfo(TENSOR_NAME, dtype, tuple(shape), nbytes), header_len, fortran

    @property
    def infos(self) -> list[TensorInfo]:
        return [self._info]

    def chunks(self, info: TensorInfo, chunk_elems: int | None = None) -> Iterator[np.ndarray]:
        step = chunk_elems or default_chunk_elems(info.dtype)
        try:
            if not self._fortran:
                yield from self._stored_chunks(info, step)
            elif info.nbytes <= npz_reader.FORTRAN_IN_MEMORY_BYTES:
                # Column-major: any C-order chunk draws on the whole data. Small: in memory.
                flat = next(self._stored_chunks(info, max(1, info.numel)), None)
                whole = flat if flat is not None else np.empty(0, info.dtype)
                whole = whole.reshape(info.shape[::-1]).T.reshape(-1)  # one C-order copy
                for start in range(0, whole.size, step):
                    yield whole[start : start + step]
            else:  # large: transposed on disk a tile at a time, as npz does
                yield from _transposed_chunks(self._handle.fileno(), self._data_offset, info, step)
        except InputProblem as exc:
            raise InputError(self.path, str(exc), info.name) from None
        except OSError as exc:
            raise InputError(self.path, f"cannot read data: {exc.strerror}", info.name) from None

    def _stored_chunks(self, info: TensorInfo, step: int) -> Iterator[np.ndarray]:
        fd = self._handle.fileno()
        position, remaining = self._data_offset, info.nbytes
        step_bytes = step * info.dtype.itemsize
        while remaining > 0:
            raw = np.empty(min(step_bytes, remaining), dtype=np.uint8)
            got = os.preadv(fd, [memoryview(raw)], position)  # type: ignore[arg-type]
            if got != raw.size:  # the file shrank since its size was checked
                raise InputProblem("the data ended early")
            position += got
            remaining -= got
            yield raw.view(info.dtype)

    def stored_bytes(self, info: TensorInfo) -> StoredBytes | None:
        """C-order little-endian data (or single bytes) is stored as safetensors stores it."""
        if self._fortran or info.dtype.str[0] not in "<|":
            return None
        begin = self._data_offset
        fd = self._handle.fileno()  # open until close(): never released

        def opened() -> contextlib.AbstractContextManager[int]:
            return contextlib.nullcontext(fd)

        return StoredBytes(self.path, opened, begin, begin + info.nbytes)

    def source_identities(self) -> dict[Path, FileIdentity]:
        return {self.path: self._identity}

    def close(self) -> None:
        self._handle.close()
