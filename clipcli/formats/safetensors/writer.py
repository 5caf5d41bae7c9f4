"""The safetensors writer: header first, then one tensor at a time, with kernel copies of
unchanged tensors (made ahead on a background thread)."""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO

import numpy as np

from clipcli.formats.base import (
    Checkpoint,
    Reader,
    StoredBytes,
    TensorInfo,
    WritebackStarter,
    Writer,
    ordered_bytes,
)
from clipcli.formats.safetensors.header import (
    CODES,
    buffer_size_overflows,
    header_pieces,
    header_problem,
)
from clipcli.formats.structure_record import STRUCTURE_KEY
from clipcli.system.filecopy import copy_range


def with_structure(checkpoint: Checkpoint) -> dict[str, str]:
    """The checkpoint's metadata, plus the HDF5 structure of an HDF5 source under
    STRUCTURE_KEY (a safetensors source keeps the key it has, as all its metadata)."""
    metadata = dict(checkpoint.metadata)
    structure = checkpoint.source.structure() if checkpoint.source is not None else None
    if structure is None or structure.origin is None or STRUCTURE_KEY in metadata:
        return metadata
    if structure.document is not None and not structure.is_plain(metadata):
        metadata[STRUCTURE_KEY] = structure.to_text()
    return metadata


# A copy ahead is a task on a thread and two system calls (copy, writeback): worth it for
# tensors of some size only. Smaller ones are written in order, small neighbours together
# from one read (Writer.write_many): 200,000 one-element tensors copied ahead one by one
# took seconds of system time.
COPY_AHEAD_MIN_BYTES = 64 << 10


class SafetensorsWriter(Writer):
    format_name = "safetensors"

    @classmethod
    def structure_losses(cls, source: Reader) -> list[str]:
        """An HDF5 source's structure is kept under STRUCTURE_KEY, but for what has no
        portable description (references, sequences, names that are not UTF-8)."""
        structure = source.structure()
        if structure is None or structure.origin is None:
            return []
        return list(structure.dropped)

    def __init__(self, path: Path, checkpoint: Checkpoint, durable: bool = False) -> None:
        super().__init__(path, checkpoint, durable)
        self.check_tensors(checkpoint.infos)
        self._file: BinaryIO = self._open(path)
        pieces = header_pieces(checkpoint.infos, with_structure(checkpoint))
        header_bytes = sum(map(len, pieces))
        self._reserve(header_bytes + sum(info.nbytes for info in checkpoint.infos))
        self._file.writelines(pieces)
        del pieces
        # Where the next byte goes, kept here: the buffered file's tell() asks the kernel
        # (an lseek) on every call, one per tensor written (200,000 tensors: ~0.4 s).
        self._position = header_bytes
        self._writeback = WritebackStarter(self._file.fileno()) if durable else None
        # Tensors come in order (write_tensors): each goes where the one before it ended.
        # Kept apart: where each tensor that may be copied ahead goes (an offset of each of
        # 200,000 tiny tensors held 14 MB), and where the last one ends.
        self._ahead_offsets: dict[str, int] = {}
        position = header_bytes
        for info in checkpoint.infos:
            if info.nbytes >= COPY_AHEAD_MIN_BYTES:
                self._ahead_offsets[info.name] = position
            position += info.nbytes
        self._end = position
        self._ahead: dict[str, Future[None]] = {}
        self._copier: ThreadPoolExecutor | None = None
        self._threadless = False  # no thread could be started: no copying ahead
        self._stop = threading.Event()

    def _open(self, path: Path) -> BinaryIO:
        return open(path, "wb")

    def _reserve(self, total: int) -> None:
        """Reserving the whole file up front makes a full disk fail before any data is
        written, and spares the filesystem growing the file block by block."""
        try:
            os.posix_fallocate(self._file.fileno(), 0, total)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise
            # Filesystems without fallocate support (EOPNOTSUPP, EINVAL) just grow the file.

    def copy_ahead(self, source: Reader, info: TensorInfo) -> None:
        """Kernel-copy the tensor to its final offset on a background thread, so that when
        nothing changes the copy overlaps the measuring pass instead of following it."""
        stored = source.stored_bytes(info)
        if stored is None or info.nbytes < COPY_AHEAD_MIN_BYTES or self._threadless:
            return
        if self._copier is None:
            self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="clipcli-copy")
        try:
            self._ahead[info.name] = self._copier.submit(
                self._copy_stored, stored, stored.end, self._ahead_offsets[info.name]
            )
        except RuntimeError:
            # Its thread cannot be started (RLIMIT_NPROC): the tensor is copied in order
            # by write_tensors instead. The queued copy must never run: cancel it.
            self._copier.shutdown(wait=True, cancel_futures=True)
            self._copier = None
            self._threadless = True

    def _copy_stored(self, stored: StoredBytes, end: int, position: int) -> None:
        """Copy the source's bytes [stored.begin, end) to `position`, holding the source's
        descriptor for as long as it takes (on whichever thread runs it)."""
        with stored.in_use() as source_fd:
            self._copy_range(source_fd, stored.begin, end, position)

    def _copy_range(self, source_fd: int, begin: int, end: int, position: int) -> None:
        writeback = self._writeback  # started out of order when copying ahead
        copy_range(
            source_fd,
            self._file.fileno(),
            begin,
            end,
            position,
            source_name=self.checkpoint.source.path if self.checkpoint.source else "input",
            on_piece=writeback.start if writeback is not None else None,
            stop=self._stop.is_set,
        )

    def _settle(self, info: TensorInfo) -> bool:
        """Wait for a background copy of this tensor, if one was started; True if it was."""
        future = self._ahead.pop(info.name, None)
        if future is None:
            return False
        future.result()
        return True

    def _stop_copier(self) -> None:
        if self._copier is not None:
            self._stop.set()
            self._copier.shutdown(wait=True, cancel_futures=True)
            self._copier = None

    def _written(self) -> None:
        position = self._position  # counts buffered bytes: flush only when writeback is due
        if self._writeback is not None and self._writeback.due(position):
            self._file.flush()
            self._writeback.advance(position)

    @classmethod
    def check_dtype(cls, info: TensorInfo) -> str | None:
        if info.dtype_name not in CODES:
            return f"safetensors cannot hold {info.dtype_name}"
        return None

    @classmethod
    def check_shape(cls, info: TensorInfo) -> str | None:
        """safe_open takes any rank, but makes numpy arrays (numpy's limits: the default);
        and the official reader's u64 product of the dimensions, as our reader applies it."""
        if buffer_size_overflows(info.shape, info.dtype.itemsize):
            return f"shape {list(info.shape)} overflows the safetensors buffer size (u64)"
        return super().check_shape(info)

    @classmethod
    def check_name(cls, name: str) -> str | None:
        if name == "__metadata__":
            return "safetensors reserves the name __metadata__"
        return super().check_name(name)

    @classmethod
    def check_metadata(cls, metadata: Mapping[str, str], source: Reader) -> str | None:
        """The whole header as the writer will build it (the HDF5 structure record
        included) must read back: its size, tensor count and keys (header_problem)."""
        infos = list(source.infos)
        return header_problem(infos, with_structure(Checkpoint(infos, metadata, source)))

    def write(self, info: TensorInfo, chunks: Iterable[np.ndarray]) -> None:
        self._settle(info)  # a copy made ahead must not land on top of what we write now
        for chunk in chunks:
            data = ordered_bytes(chunk, info.dtype, "<")  # safetensors: little-endian
            self._file.write(data)
            self._position += data.nbytes
            self._written()

    def copy_unchanged_many(self, source: Reader, infos: Sequence[TensorInfo]) -> bool:
        """One kernel copy for tensors stored one after another in one file, which go one
        after another here too."""
        stored = [source.stored_bytes(info) for info in infos]
        first = stored[0]
        if first is None:
            return False
        end = first.begin
        for info, where in zip(infos, stored, strict=True):
            if where is None or where.path != first.path or where.begin != end:
                return False
            if where.end - where.begin != info.nbytes:  # laid out here at nbytes each
                return False
            end = where.end
        for info in infos:
            self._settle(info)
        self._file.flush()
        position = self._next_offset(infos[0])
        self._copy_stored(first, end, position)
        self._position = self._file.seek(position + end - first.begin)
        self._written()
        return True

    def copy_unchanged(self, source: Reader, info: TensorInfo) -> bool:
        """Copy an unchanged tensor's bytes file-to-file in the kernel, with no Python copy."""
        if not self._settle(info):
            stored = source.stored_bytes(info)
            if stored is None:
                return False
            self._file.flush()
            self._copy_stored(stored, stored.end, self._next_offset(info))
        self._position = self._file.seek(self._next_offset(info) + info.nbytes)
        self._written()
        return True

    def _next_offset(self, info: TensorInfo) -> int:
        """Where `info` goes: where the tensor before it ended (tensors come in order),
        which is where the header laid it out; checked where that offset is kept."""
        laid_out = self._ahead_offsets.get(info.name, self._position)
        if laid_out != self._position:
            raise RuntimeError(f"tensor {info.name!r} reached the writer out of order")
        return self._position

    def close(self) -> None:
        self._stop_copier()
        self._file.close()
        if self._position != self._end:  # every byte the header lays out, no more
            raise RuntimeError(
                f"wrote {self._position} bytes where the header lays out {self._end}"
            )

    def abort(self) -> None:
        self._stop_copier()
        self._file.close()
