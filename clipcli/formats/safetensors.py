"""safetensors: our own header parser (validated as the official reader does) and a
streaming writer (header first, then one tensor at a time), which covers bf16 and fp8 that
`safetensors.numpy` cannot load.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import io
import json
import math
import os
import struct
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO

import ml_dtypes
import numpy as np

from clipcli.errors import InputError, WriteError
from clipcli.filecopy import copy_range
from clipcli.formats.base import (
    Checkpoint,
    Reader,
    StoredBytes,
    TensorInfo,
    WritebackStarter,
    Writer,
    byte_view,
    default_chunk_elems,
)
from clipcli.formats.structure import (
    STRUCTURE_KEY,
    MalformedStructure,
    Structure,
    parse_structure,
)
from clipcli.identity import FileIdentity
from clipcli.inputs import open_input

MAX_HEADER_BYTES = 100_000_000  # the official reader's limit
MAX_TENSORS = 200_000  # real checkpoints hold at most tens of thousands
_U64 = struct.Struct("<Q")

DTYPES: dict[str, np.dtype[Any]] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "I16": np.dtype("<i2"),
    "U16": np.dtype("<u2"),
    "I32": np.dtype("<i4"),
    "U32": np.dtype("<u4"),
    "I64": np.dtype("<i8"),
    "U64": np.dtype("<u8"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"),
    "C64": np.dtype("<c8"),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
    "F8_E4M3FNUZ": np.dtype(ml_dtypes.float8_e4m3fnuz),
    "F8_E5M2FNUZ": np.dtype(ml_dtypes.float8_e5m2fnuz),
}
# Sub-byte types are packed two (or four thirds) to a byte; numpy cannot view them.
_PACKED = {"F4", "F6_E2M3", "F6_E3M2"}
CODES = {dtype.name: code for code, dtype in DTYPES.items()}


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate key {key!r}")
        result[key] = value
    return result


def _refuse_surrogates(reader: SafetensorsReader, header: dict[str, Any]) -> None:
    """JSON escapes can spell lone UTF-16 surrogates, which are not Unicode text; the
    official (Rust) reader refuses them, and they could not be written back as UTF-8."""
    texts = list(header)
    metadata = header.get("__metadata__")
    if isinstance(metadata, dict):
        texts += [*metadata, *(v for v in metadata.values() if isinstance(v, str))]
    for text in texts:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise reader._fail(f"name or metadata {text!r} holds a lone UTF-16 surrogate") from None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class SafetensorsReader(Reader):
    """Parses and validates the header in the constructor, then reads with pread.

    The file may be released (its descriptor closed) and is reopened on the next read, so a
    model directory of thousands of shards needs only a bounded number of descriptors. A
    reopened file must be the one parsed: same device, inode, size and mtime.
    """

    format_name = "safetensors"

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self._lock = threading.Lock()
        self._users = 0  # reads in progress on the descriptor
        self._close_when_idle = False
        self._closed = False  # close() is final; release() is not
        self._file: BinaryIO | None = open_input(path)  # closed by close() or release()
        try:
            self._identity = FileIdentity.of_stat(os.fstat(self._file.fileno()))
            self._infos, self._offsets, self._metadata = self._parse(self._file)
            self._structure: Structure | None = None
        except BaseException:
            self._file.close()
            raise

    @property
    def is_open(self) -> bool:
        return self._file is not None

    def _ensure_open(self) -> BinaryIO:
        """The open file, reopened (and checked to be the same file) after release()."""
        if self._file is None:
            if self._closed:
                raise ValueError(f"{self.path}: reader is closed")
            handle = open_input(self.path)
            if FileIdentity.of_stat(os.fstat(handle.fileno())) != self._identity:
                handle.close()
                raise self._fail("file changed since its header was read")
            self._file = handle
        return self._file

    def release(self) -> None:
        """Close the descriptor now, or once the reads in progress are done."""
        with self._lock:
            if self._users:
                self._close_when_idle = True
            elif self._file is not None:
                self._file.close()
                self._file = None

    def _acquire(self) -> int:
        with self._lock:
            self._close_when_idle = False
            self._users += 1
            try:
                return self._ensure_open().fileno()
            except BaseException:
                self._users -= 1
                raise

    def _done(self) -> None:
        with self._lock:
            self._users -= 1
            if not self._users and self._close_when_idle and self._file is not None:
                self._file.close()
                self._file = None
                self._close_when_idle = False

    def _fail(self, problem: str, tensor: str | None = None) -> InputError:
        return InputError(self.path, problem, tensor)

    def _parse(
        self, handle: BinaryIO
    ) -> tuple[list[TensorInfo], dict[str, tuple[int, int]], dict[str, str]]:
        file_size = os.fstat(handle.fileno()).st_size
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise self._fail(f"file is {len(prefix)} bytes; a safetensors file has at least 8")
        (header_len,) = _U64.unpack(prefix)
        if header_len > MAX_HEADER_BYTES:
            raise self._fail(f"header length {header_len} exceeds the {MAX_HEADER_BYTES} limit")
        if 8 + header_len > file_size:
            raise self._fail(
                f"header length {header_len} runs past the end of the {file_size}-byte file"
            )
        raw = handle.read(header_len)
        if raw.count(b'"data_offsets"') > MAX_TENSORS:
            # Checked on the bytes: parsing a million entries alone would take seconds.
            raise self._fail(f"header lists more than {MAX_TENSORS} tensors")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self._fail("header is not valid UTF-8") from None
        try:
            header = json.loads(text, object_pairs_hook=_reject_duplicates)
        except RecursionError:
            raise self._fail("header JSON is nested too deeply") from None
        except ValueError as exc:
            raise self._fail(f"header is not valid JSON: {exc}") from None
        if not isinstance(header, dict):
            raise self._fail("header is not a JSON object")
        _refuse_surrogates(self, header)
        metadata = self._parse_metadata(header.pop("__metadata__", None))
        if len(header) > MAX_TENSORS:
            raise self._fail(f"header lists {len(header)} tensors; the limit is {MAX_TENSORS}")
        entries = [self._parse_entry(name, entry) for name, entry in header.items()]
        entries.sort(key=lambda item: (item[1], item[2]))
        expected = 0
        for info, begin, end in entries:
            if begin != expected:
                problem = "overlaps the previous tensor" if begin < expected else "leaves a gap"
                raise self._fail(f"data_offsets [{begin}, {end}] {problem}", info.name)
            expected = end
        if 8 + header_len + expected != file_size:
            actual = file_size - 8 - header_len
            kind = "trailing bytes" if actual > expected else "missing bytes (truncated file)"
            raise self._fail(f"{kind}: tensors need {expected} data bytes, file has {actual}")
        infos = [info for info, _, _ in entries]
        offsets = {
            info.name: (8 + header_len + begin, 8 + header_len + end)
            for info, begin, end in entries
        }
        return infos, offsets, metadata

    def _parse_metadata(self, raw: object) -> dict[str, str]:
        if raw is None:
            return {}
        if not isinstance(raw, dict):
            raise self._fail("__metadata__ is not an object")
        for key, value in raw.items():
            if not isinstance(value, str):
                raise self._fail(f"__metadata__[{key!r}] is not a string")
        return dict(raw)

    def _parse_entry(self, name: str, entry: object) -> tuple[TensorInfo, int, int]:
        if not isinstance(entry, dict):
            raise self._fail("header entry is not an object", name)
        code = entry.get("dtype")
        if isinstance(code, str) and code in _PACKED:
            raise self._fail(f"dtype {code} (packed sub-byte floats) is not supported", name)
        if not isinstance(code, str) or code not in DTYPES:
            raise self._fail(f"unknown dtype {code!r}", name)
        shape = entry.get("shape")
        if not isinstance(shape, list) or not all(_is_int(d) and 0 <= d < 2**64 for d in shape):
            raise self._fail(f"shape {shape!r} is not a list of non-negative integers", name)
        offsets = entry.get("data_offsets")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(_is_int(o) and o >= 0 for o in offsets)
        ):
            raise self._fail(f"data_offsets {offsets!r} is not two non-negative integers", name)
        begin, end = offsets
        if begin > end:
            raise self._fail(f"data_offsets [{begin}, {end}] has begin > end", name)
        dtype = DTYPES[code]
        numel = math.prod(shape)
        nbytes = numel * dtype.itemsize
        if nbytes >= 2**63:
            raise self._fail(f"shape {shape} overflows", name)
        if end - begin != nbytes:
            raise self._fail(
                f"data_offsets span {end - begin} bytes but {code} {shape} needs {nbytes}", name
            )
        return TensorInfo(name, dtype, tuple(shape), nbytes), begin, end

    @property
    def infos(self) -> list[TensorInfo]:
        return self._infos

    @property
    def metadata(self) -> Mapping[str, str]:
        return self._metadata

    def structure(self) -> Structure | None:
        """The HDF5 structure recorded under STRUCTURE_KEY by a conversion from HDF5, read
        on first use (ls and norms never need it); malformed is an InputError then."""
        text = self._metadata.get(STRUCTURE_KEY)
        if text is None:
            return None
        if self._structure is None:
            self._structure = Structure(load=lambda: self._parse_structure(text))
        return self._structure

    def _parse_structure(self, text: str) -> Structure:
        try:
            return parse_structure(text)
        except MalformedStructure as exc:
            raise self._fail(f"__metadata__[{STRUCTURE_KEY!r}] is malformed: {exc}") from None

    def byte_range(self, info: TensorInfo) -> tuple[int, int]:
        """Absolute [begin, end) of the tensor's bytes in the file."""
        return self._offsets[info.name]

    def stored_bytes(self, info: TensorInfo) -> StoredBytes:
        begin, end = self.byte_range(info)
        return StoredBytes(self.path, self.fileno, begin, end)

    def fileno(self) -> int:
        """The open descriptor (reopened if released); valid until the next release()."""
        with self._lock:
            return self._ensure_open().fileno()

    def chunks(self, info: TensorInfo, chunk_elems: int | None = None) -> Iterator[np.ndarray]:
        for load in self._loaders(info, chunk_elems):
            yield load()

    def chunk_loaders(self, info: TensorInfo) -> Iterator[Callable[[], np.ndarray]]:
        return self._loaders(info, None)

    def _loaders(
        self, info: TensorInfo, chunk_elems: int | None
    ) -> Iterator[Callable[[], np.ndarray]]:
        begin, end = self.byte_range(info)
        step = (chunk_elems or default_chunk_elems(info.dtype)) * info.dtype.itemsize
        for start in range(begin, end, step):
            yield functools.partial(self.read_bytes, info, start, min(start + step, end))

    def read_bytes(self, info: TensorInfo, start: int, stop: int) -> np.ndarray:
        """Elements stored in the absolute byte range [start, stop), read with pread.

        pread into a fresh buffer keeps the resident set bounded, where a memory map
        would count every touched page of a multi-GB file.
        """
        raw = np.empty(stop - start, dtype=np.uint8)
        view = memoryview(raw)  # type: ignore[arg-type]
        done = 0
        fd = self._acquire()
        try:
            while done < len(view):
                got = os.preadv(fd, [view[done:]], start + done)
                if got == 0:
                    raise self._fail("file shrank while reading", info.name)
                done += got
        finally:
            self._done()
        return raw.view(info.dtype)

    def read(self, info: TensorInfo) -> np.ndarray:
        begin, end = self.byte_range(info)
        return self.read_bytes(info, begin, end).reshape(info.shape)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._file is not None:
                self._file.close()
                self._file = None


def build_header(infos: Iterable[TensorInfo], metadata: Mapping[str, str]) -> bytes:
    """Compact JSON with __metadata__ first, space-padded to 8 bytes, like the official writer."""
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for info in infos:
        header[info.name] = {
            "dtype": CODES[info.dtype.name],
            "shape": list(info.shape),
            "data_offsets": [offset, offset + info.nbytes],
        }
        offset += info.nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return _U64.pack(len(text)) + text


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
        for info in checkpoint.infos:
            if (reason := self.check_dtype(info)) is not None:
                raise ValueError(reason)
        self._file: BinaryIO = self._open(path)
        header = build_header(checkpoint.infos, with_structure(checkpoint))
        self._reserve(len(header) + sum(info.nbytes for info in checkpoint.infos))
        self._file.write(header)
        self._writeback = WritebackStarter(self._file.fileno()) if durable else None
        self._offsets: dict[str, int] = {}
        position = len(header)
        for info in checkpoint.infos:
            self._offsets[info.name] = position
            position += info.nbytes
        self._ahead: dict[str, Future[None]] = {}
        self._copier: ThreadPoolExecutor | None = None
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
        if stored is None or not info.nbytes:
            return
        if self._copier is None:
            self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="clipcli-copy")
        self._ahead[info.name] = self._copier.submit(
            self._copy_range, stored.fileno(), stored.begin, stored.end, self._offsets[info.name]
        )

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
        position = self._file.tell()  # counts buffered bytes: flush only when writeback is due
        if self._writeback is not None and self._writeback.due(position):
            self._file.flush()
            self._writeback.advance(position)

    @classmethod
    def check_dtype(cls, info: TensorInfo) -> str | None:
        if info.dtype.name not in CODES:
            return f"safetensors cannot hold {info.dtype.name}"
        return None

    @classmethod
    def check_name(cls, name: str) -> str | None:
        if name == "__metadata__":
            return "safetensors reserves the name __metadata__"
        return super().check_name(name)

    def write(self, info: TensorInfo, chunks: Iterable[np.ndarray]) -> None:
        self._settle(info)  # a copy made ahead must not land on top of what we write now
        little = info.dtype.newbyteorder("<") if info.dtype.byteorder == ">" else info.dtype
        for chunk in chunks:
            self._file.write(byte_view(chunk, little))
            self._written()

    def copy_unchanged(self, source: Reader, info: TensorInfo) -> bool:
        """Copy an unchanged tensor's bytes file-to-file in the kernel, with no Python copy."""
        if not self._settle(info):
            stored = source.stored_bytes(info)
            if stored is None:
                return False
            self._file.flush()
            self._copy_range(stored.fileno(), stored.begin, stored.end, self._offsets[info.name])
        self._file.seek(self._offsets[info.name] + info.nbytes)
        self._written()
        return True

    def close(self) -> None:
        self._stop_copier()
        self._file.close()

    def abort(self) -> None:
        self._stop_copier()
        self._file.close()


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
