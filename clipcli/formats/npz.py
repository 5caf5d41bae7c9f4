""".npz: a zip of .npy members, read member by member without np.load and never unpickled.

Every member's .npy header is parsed and checked against the member's stored size before
any data is read, so a header declaring 10**12 elements over 8 bytes of data is refused
at once instead of allocating terabytes (np.load allocates the declared shape first).
"""

from __future__ import annotations

import ast
import contextlib
import math
import os
import struct
import tempfile
import zipfile
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any

import numpy as np

from clipcli.dtypes import from_ml_dtypes, is_numeric
from clipcli.errors import InputError
from clipcli.formats.base import (
    CHUNK_BYTES,
    Checkpoint,
    Reader,
    TensorInfo,
    Writer,
    byte_view,
    default_chunk_elems,
)
from clipcli.inputs import open_input

NPY_MAGIC = b"\x93NUMPY"
MAX_HEADER_BYTES = 10_000  # numpy's own default cap for np.load
# Expansion budget, on the whole file: the members may together inflate to at most
# BOMB_RATIO times the file's size, plus BOMB_MIN_BYTES (so a small file of all-zero
# tensors still reads). Real tensors compress ~1.1:1, all-zero ones ~1000:1 but are rarely
# large; inflating 200 bytes per byte read costs ~1 s per MB of file at zlib's speed.
BOMB_RATIO = 200
BOMB_MIN_BYTES = 64 << 20
# Column-major (Fortran-order) members: read whole below this size, else transposed
# through temporary files a tile of FORTRAN_TILE_BYTES at a time.
FORTRAN_IN_MEMORY_BYTES = 32 << 20
FORTRAN_TILE_BYTES = 4 << 20
# numpy writes members stored or deflated; the others (bzip2 ~20 MB/s, lzma) are refused.
COMPRESSION_METHODS = {zipfile.ZIP_STORED: "stored", zipfile.ZIP_DEFLATED: "deflate"}
_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")
_DATA_DESCRIPTOR_FLAG = 0x08
_READ_ERRORS = (
    OSError,
    EOFError,
    zipfile.BadZipFile,
    zlib.error,
    ValueError,
    RuntimeError,  # NotImplementedError among them: zipfile's 'zip file version 25.5'
)


def expansion_budget(file_size: int) -> int:
    """The most bytes all members of a file of this size may inflate to, together."""
    return BOMB_RATIO * file_size + BOMB_MIN_BYTES


class _Member:
    """Where one tensor's bytes sit inside the zip."""

    def __init__(self, info: zipfile.ZipInfo, data_offset: int, fortran: bool) -> None:
        self.zip_info = info
        self.data_offset = data_offset  # bytes of .npy header before the data
        self.fortran = fortran


class NpzReader(Reader):
    format_name = "npz"

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self._handle = open_input(path)  # closed by close()
        try:
            self._zip = zipfile.ZipFile(self._handle)
        except (zipfile.BadZipFile, OSError, EOFError, ValueError, RuntimeError) as exc:
            self._handle.close()
            raise InputError(path, f"not a valid npz (zip) file: {exc}") from None
        try:
            self._infos, self._members = self._scan()
        except BaseException:
            self.close()
            raise

    def _scan(self) -> tuple[list[TensorInfo], dict[str, _Member]]:
        infos: list[TensorInfo] = []
        members: dict[str, _Member] = {}
        seen: set[str] = set()
        check_zip_layout(self.path, self._handle.fileno(), self._zip)
        for entry in self._zip.infolist():
            name = entry.filename
            if name in seen:
                raise InputError(self.path, f"duplicate member {name!r}")
            seen.add(name)
            if name.endswith("/"):
                raise InputError(self.path, f"member {name!r} is a directory")
            if not name.endswith(".npy"):
                raise InputError(self.path, f"member {name!r} is not a .npy array")
            if name.startswith("/") or ".." in name.replace("\\", "/").split("/"):
                raise InputError(self.path, f"member name {name!r} escapes the archive")
            tensor = name[: -len(".npy")]
            if tensor in seen:
                raise InputError(self.path, f"both {tensor!r} and {name!r} are members")
            info, member = self._parse_member(entry, tensor)
            infos.append(info)
            members[tensor] = member
        return infos, members

    def _parse_member(self, entry: zipfile.ZipInfo, tensor: str) -> tuple[TensorInfo, _Member]:
        try:
            with self._zip.open(entry) as stream:
                dtype, shape, fortran, header_len = _read_npy_header(stream)
        except InputProblem as exc:
            raise InputError(self.path, str(exc), tensor) from None
        except _READ_ERRORS as exc:
            raise InputError(self.path, f"cannot read member header: {exc}", tensor) from None
        numel = math.prod(shape)
        nbytes = numel * dtype.itemsize
        if nbytes >= 2**62:
            raise InputError(self.path, f"shape {list(shape)} overflows", tensor)
        if entry.file_size != header_len + nbytes:
            actual = entry.file_size - header_len
            raise InputError(
                self.path,
                f"shape {list(shape)} of {dtype.name} needs {nbytes} data bytes "
                f"but the member holds {actual}",
                tensor,
            )
        info = TensorInfo(tensor, dtype, tuple(shape), nbytes)
        return info, _Member(entry, header_len, fortran)

    @property
    def infos(self) -> list[TensorInfo]:
        return self._infos

    @property
    def compressed(self) -> bool:
        return any(m.zip_info.compress_type != zipfile.ZIP_STORED for m in self._members.values())

    def chunks(self, info: TensorInfo, chunk_elems: int | None = None) -> Iterator[np.ndarray]:
        member = self._members[info.name]
        if member.fortran:
            yield from self._fortran_chunks(info, member, chunk_elems)
            return
        step = (chunk_elems or default_chunk_elems(info.dtype)) * info.dtype.itemsize
        if member.zip_info.compress_type == zipfile.ZIP_STORED:
            yield from self._stored_chunks(info, member, step)
            return
        try:
            with self._zip.open(member.zip_info) as stream:
                _read_exactly(stream, member.data_offset)
                remaining = info.nbytes
                while remaining > 0:
                    data = _read_exactly(stream, min(step, remaining))
                    remaining -= len(data)
                    yield np.frombuffer(data, dtype=info.dtype)
                if stream.read(1):
                    raise InputProblem("extra bytes after the array data")
        except InputProblem as exc:
            raise InputError(self.path, str(exc), info.name) from None
        except _READ_ERRORS as exc:
            raise InputError(self.path, f"cannot read data: {exc}", info.name) from None

    def _stored_chunks(self, info: TensorInfo, member: _Member, step: int) -> Iterator[np.ndarray]:
        """An uncompressed member read straight from the file with pread, checking its CRC as
        zipfile would: ~40% faster than zipfile's buffered stream for multi-GB members."""
        entry = member.zip_info
        fd = self._handle.fileno()
        local = os.pread(fd, 30, entry.header_offset)
        if len(local) != 30 or local[:4] != b"PK\x03\x04":
            raise InputError(self.path, "bad zip local header", info.name)
        name_len, extra_len = struct.unpack("<HH", local[26:30])
        start = entry.header_offset + 30 + name_len + extra_len
        if start + entry.compress_size > os.fstat(fd).st_size:
            raise InputError(self.path, "member data runs past the end of the file", info.name)
        crc = zlib.crc32(os.pread(fd, member.data_offset, start))
        position, remaining = start + member.data_offset, info.nbytes
        while remaining > 0:
            raw = np.empty(min(step, remaining), dtype=np.uint8)
            view = memoryview(raw)  # type: ignore[arg-type]
            got = os.preadv(fd, [view], position)
            if got != raw.size:
                raise InputError(self.path, "truncated member data", info.name)
            crc = zlib.crc32(view, crc)
            position += got
            remaining -= got
            if remaining == 0 and crc != entry.CRC:
                raise InputError(self.path, "CRC mismatch: the member data is corrupt", info.name)
            yield raw.view(info.dtype)

    def _fortran_chunks(
        self, info: TensorInfo, member: _Member, chunk_elems: int | None
    ) -> Iterator[np.ndarray]:
        """C-order chunks of a member stored column-major (np.save of a transposed array).

        Any C-order chunk draws on elements spread over the whole stored data, so the data
        must be at hand at random. Small members are read into memory (2 copies at most,
        FORTRAN_IN_MEMORY_BYTES each); larger ones are transposed on disk, from the npz
        itself when stored, else from a temporary file they are inflated into, so the
        resident set stays bounded whatever the member's size (a 14 MB npz inflating one
        1.3 GB Fortran member peaked at 2.6 GB before). A memory map would not do: the
        kernel maps 64 KiB around every page fault, so strided reads map the whole file."""
        step = chunk_elems or default_chunk_elems(info.dtype)
        if info.nbytes <= FORTRAN_IN_MEMORY_BYTES:
            flat = self._read_member_data(info, member)
            whole = flat.reshape(info.shape[::-1]).T.reshape(-1)  # one C-order copy
            del flat
            for start in range(0, whole.size, step):
                yield whole[start : start + step]
            return
        with contextlib.ExitStack() as stack:
            try:
                if member.zip_info.compress_type == zipfile.ZIP_STORED:
                    fd, offset = self._handle.fileno(), self._stored_data_start(info, member)
                else:
                    spill = stack.enter_context(tempfile.TemporaryFile(prefix="clipcli-fortran-"))
                    self._inflate_into(info, member, spill)
                    fd, offset = spill.fileno(), 0
                yield from _transposed_chunks(fd, offset, info, step)
            except InputProblem as exc:
                raise InputError(self.path, str(exc), info.name) from None
            except OSError as exc:
                problem = f"cannot reorder column-major data in {tempfile.gettempdir()}"
                raise InputError(self.path, f"{problem}: {exc.strerror}", info.name) from None

    def _stored_data_start(self, info: TensorInfo, member: _Member) -> int:
        entry = member.zip_info
        local = os.pread(self._handle.fileno(), 30, entry.header_offset)
        if len(local) != 30 or local[:4] != b"PK\x03\x04":
            raise InputError(self.path, "bad zip local header", info.name)
        name_len, extra_len = struct.unpack("<HH", local[26:30])
        start = int(entry.header_offset) + 30 + name_len + extra_len
        # zipfile checks the CRC as it streams; reading through a mapping, we check it here.
        crc = 0
        for piece in range(start, start + int(entry.compress_size), CHUNK_BYTES):
            length = min(CHUNK_BYTES, start + int(entry.compress_size) - piece)
            data = os.pread(self._handle.fileno(), length, piece)
            if len(data) != length:
                raise InputError(self.path, "truncated member data", info.name)
            crc = zlib.crc32(data, crc)
        if crc != entry.CRC:
            raise InputError(self.path, "CRC mismatch: the member data is corrupt", info.name)
        return int(start + member.data_offset)

    def _inflate_into(self, info: TensorInfo, member: _Member, spill: IO[bytes]) -> None:
        """The member's array bytes, decompressed a piece at a time into `spill`."""
        try:
            with self._zip.open(member.zip_info) as stream:
                _read_exactly(stream, member.data_offset)
                remaining = info.nbytes
                while remaining > 0:
                    data = _read_exactly(stream, min(CHUNK_BYTES, remaining))
                    spill.write(data)
                    remaining -= len(data)
                if stream.read(1):
                    raise InputProblem("extra bytes after the array data")
            spill.flush()
        except InputProblem as exc:
            raise InputError(self.path, str(exc), info.name) from None
        except _READ_ERRORS as exc:
            raise InputError(self.path, f"cannot read data: {exc}", info.name) from None

    def _read_member_data(self, info: TensorInfo, member: _Member) -> np.ndarray:
        try:
            with self._zip.open(member.zip_info) as stream:
                _read_exactly(stream, member.data_offset)
                data = _read_exactly(stream, info.nbytes)
        except InputProblem as exc:
            raise InputError(self.path, str(exc), info.name) from None
        except _READ_ERRORS as exc:
            raise InputError(self.path, f"cannot read data: {exc}", info.name) from None
        return np.frombuffer(data, dtype=info.dtype)

    def read(self, info: TensorInfo) -> np.ndarray:
        member = self._members[info.name]
        if member.fortran:  # the whole tensor in C order, built from bounded chunks
            return super().read(info)
        return self._read_member_data(info, member).reshape(info.shape)

    def close(self) -> None:
        self._zip.close()
        self._handle.close()


def _transposed_chunks(fd: int, offset: int, info: TensorInfo, step: int) -> Iterator[np.ndarray]:
    """C-order chunks of the tensor whose column-major data is at `offset` in `fd`.

    Column-major data of shape (s0, ..., sn) is the C-order data of (sn, ..., s0). Viewed
    as a matrix (sn*...*s1, s0), one transpose gives (s0, sn*...*s1): for each i0, the
    column-major data of the sub-tensor [i0, ...]. So rank - 1 batched transposes, each a
    pass through a temporary file in tiles of FORTRAN_TILE_BYTES, give C order; then the
    result is read sequentially. Memory: two tiles and one chunk; disk: twice the tensor."""
    shape, itemsize = info.shape, info.dtype.itemsize
    with contextlib.ExitStack() as stack:
        source, source_offset = fd, offset
        for level in range(max(0, len(shape) - 1)):
            target = stack.enter_context(tempfile.TemporaryFile(prefix="clipcli-fortran-"))
            batch = math.prod(shape[:level])
            cols = shape[level]
            rows = math.prod(shape[level + 1 :])
            _transpose_batches(source, source_offset, target.fileno(), batch, rows, cols, itemsize)
            source, source_offset = target.fileno(), 0
        for start in range(0, info.numel, step):
            count = min(step, info.numel - start)
            data = _pread_exactly(source, count * itemsize, source_offset + start * itemsize)
            yield np.frombuffer(data, dtype=info.dtype)


def _transpose_batches(
    source: int, offset: int, target: int, batch: int, rows: int, cols: int, itemsize: int
) -> None:
    """For each of `batch` consecutive (rows, cols) C-order matrices at `offset` in
    `source`, write its (cols, rows) transpose at the same place in `target`, a tile at a
    time: a tile's rows are read (one pread when they are whole rows, so contiguous) and
    its columns written (one pwrite when whole)."""
    if not rows or not cols:
        return
    tile = max(1, FORTRAN_TILE_BYTES // itemsize)
    side = max(1, math.isqrt(tile))
    tile_cols = cols if cols * min(rows, side) <= tile else min(cols, side)
    tile_rows = min(rows, max(1, tile // tile_cols))
    matrix = rows * cols * itemsize
    if rows * cols <= tile:  # small matrices: many in one read, transpose and write
        group = max(1, tile // (rows * cols))
        for first in range(0, batch, group):
            count = min(group, batch - first)
            raw = _pread_exactly(source, count * matrix, offset + first * matrix)
            several = np.frombuffer(raw, np.uint8).reshape(count, rows, cols, itemsize)
            os.pwrite(target, several.transpose(0, 2, 1, 3).tobytes(), first * matrix)
        return
    for index in range(batch):
        base = index * matrix
        for row0 in range(0, rows, tile_rows):
            row1 = min(rows, row0 + tile_rows)
            for col0 in range(0, cols, tile_cols):
                col1 = min(cols, col0 + tile_cols)
                width = (col1 - col0) * itemsize
                if col0 == 0 and col1 == cols:
                    raw = _pread_exactly(
                        source, (row1 - row0) * width, offset + base + row0 * cols * itemsize
                    )
                else:
                    raw = b"".join(
                        _pread_exactly(
                            source, width, offset + base + (row * cols + col0) * itemsize
                        )
                        for row in range(row0, row1)
                    )
                block = np.frombuffer(raw, np.uint8).reshape(row1 - row0, col1 - col0, itemsize)
                flipped = np.ascontiguousarray(block.transpose(1, 0, 2))
                if row0 == 0 and row1 == rows:
                    os.pwrite(target, flipped.tobytes(), base + col0 * rows * itemsize)
                else:
                    for col in range(col0, col1):
                        os.pwrite(
                            target,
                            flipped[col - col0].tobytes(),
                            base + (col * rows + row0) * itemsize,
                        )


def _pread_exactly(fd: int, size: int, position: int) -> bytes:
    data = os.pread(fd, size, position)
    while len(data) < size:
        more = os.pread(fd, size - len(data), position + len(data))
        if not more:
            raise InputProblem("the data ended early")
        data += more
    return data


def _zip64_sizes(extra: bytes, size: int, compressed: int) -> tuple[int, int]:
    """(uncompressed, compressed) from a local header's ZIP64 extra field, which holds
    the 8-byte values of exactly those of the two that are 0xFFFFFFFF, in that order."""
    position = 0
    while position + 4 <= len(extra):
        field_id, length = struct.unpack_from("<HH", extra, position)
        if field_id == 0x0001:
            values = extra[position + 4 : position + 4 + length]
            offset = 0
            if size == 0xFFFFFFFF and offset + 8 <= len(values):
                (size,) = struct.unpack_from("<Q", values, offset)
                offset += 8
            if compressed == 0xFFFFFFFF and offset + 8 <= len(values):
                (compressed,) = struct.unpack_from("<Q", values, offset)
            return size, compressed
        position += 4 + length
    return size, compressed


def _has_zip64_field(extra: bytes) -> bool:
    position = 0
    while position + 4 <= len(extra):
        field_id, length = struct.unpack_from("<HH", extra, position)
        if field_id == 0x0001:
            return True
        position += 4 + length
    return False


def check_zip_layout(path: Path, fd: int, archive: zipfile.ZipFile) -> None:
    """Each member's bytes are its own and inside the file, and together they inflate
    to at most expansion_budget(file size).

    The central directory is what zipfile trusts; a hostile zip can make it claim more
    than the file holds: members whose data overlap or share bytes (one compressed
    block read as a thousand members), a local header that disagrees with its central
    entry (another name, method or size), a stored member whose two sizes differ, data
    running into the central directory or past the end. Each member's span (local
    header, name, extra field, data, data descriptor) is computed from its local
    header and the spans must be disjoint and lie before the central directory.
    """
    entries = archive.infolist()
    file_size = os.fstat(fd).st_size
    directory_start = getattr(archive, "start_dir", file_size)
    spans: list[tuple[int, int, str]] = []
    total = 0
    for entry in entries:
        name = entry.filename
        tensor = name[: -len(".npy")] if name.endswith(".npy") else name
        if entry.compress_type not in COMPRESSION_METHODS:
            raise InputError(
                path,
                f"compression method {entry.compress_type} is not one numpy writes "
                "(stored or deflate)",
                tensor,
            )
        if entry.compress_type == zipfile.ZIP_STORED and entry.compress_size != entry.file_size:
            raise InputError(
                path,
                f"stored member claims {entry.file_size} bytes but holds {entry.compress_size}",
                tensor,
            )
        if not 0 <= entry.header_offset < file_size:
            raise InputError(
                path,
                f"local header offset {entry.header_offset} is outside the file",
                tensor,
            )
        try:
            begin, end = _member_span(path, fd, entry, tensor, file_size)
        except (OSError, OverflowError, ValueError) as exc:
            raise InputError(path, f"cannot read the local header: {exc}", tensor) from None
        if end > min(directory_start, file_size):
            raise InputError(
                path,
                "member data runs into the central directory or past the end",
                tensor,
            )
        spans.append((begin, end, tensor))
        total += entry.file_size
    spans.sort()
    for (_, end, first), (begin, _, second) in zip(spans, spans[1:], strict=False):
        if begin < end:
            raise InputError(
                path,
                f"members {first!r} and {second!r} overlap (share bytes); refusing a "
                "zip that claims more data than it holds",
            )
    budget = expansion_budget(file_size)
    if total > budget:
        raise InputError(
            path,
            f"members inflate to {total} bytes in all, more than {BOMB_RATIO} times the "
            f"{file_size}-byte file plus {BOMB_MIN_BYTES >> 20} MiB ({budget}); "
            "refusing what looks like a zip bomb",
        )


def _member_span(
    path: Path, fd: int, entry: zipfile.ZipInfo, tensor: str, file_size: int
) -> tuple[int, int]:
    """[begin, end) of the member's local header, data and data descriptor."""
    local = os.pread(fd, _LOCAL_HEADER.size, entry.header_offset)
    if len(local) != _LOCAL_HEADER.size or local[:4] != b"PK\x03\x04":
        raise InputError(path, "bad zip local header", tensor)
    (_, _, flags, method, _, _, crc, compressed, size, name_len, extra_len) = _LOCAL_HEADER.unpack(
        local
    )
    raw_name = os.pread(fd, name_len, entry.header_offset + _LOCAL_HEADER.size)
    central_name = entry.orig_filename
    encoding = "utf-8" if entry.flag_bits & 0x800 else "cp437"
    if raw_name.decode(encoding, "replace") != central_name or method != entry.compress_type:
        raise InputError(
            path,
            "local header disagrees with the central directory (name or method)",
            tensor,
        )
    data_start = entry.header_offset + _LOCAL_HEADER.size + name_len + extra_len
    if not flags & _DATA_DESCRIPTOR_FLAG:
        if 0xFFFFFFFF in (compressed, size):  # ZIP64: the sizes are in the extra field
            extra = os.pread(fd, extra_len, data_start - extra_len)
            size, compressed = _zip64_sizes(extra, size, compressed)
        if (compressed, size, crc) != (entry.compress_size, entry.file_size, entry.CRC):
            raise InputError(
                path,
                "local header disagrees with the central directory (sizes or CRC)",
                tensor,
            )
    end = data_start + entry.compress_size
    if end > file_size:
        raise InputError(path, "member data runs past the end of the file", tensor)
    if flags & _DATA_DESCRIPTOR_FLAG:
        # An optional signature, the CRC and two sizes of 4 bytes each, or 8 in ZIP64.
        extra = os.pread(fd, extra_len, data_start - extra_len)
        end += (4 if os.pread(fd, 4, end) == b"PK\x07\x08" else 0) + (
            20 if _has_zip64_field(extra) else 12
        )
    return entry.header_offset, end


class InputProblem(ValueError):
    """A malformed .npy member; the reader adds the file and tensor."""


def _read_exactly(stream: IO[bytes], size: int) -> bytes:
    data = stream.read(size)
    if len(data) != size:
        raise InputProblem(f"truncated member: expected {size} more bytes, got {len(data)}")
    return data


def _read_npy_header(stream: IO[bytes]) -> tuple[np.dtype[Any], tuple[int, ...], bool, int]:
    """(dtype, shape, fortran_order, header length) of a .npy stream, parsed with a size cap
    and `ast.literal_eval` (no code runs, no pickle)."""
    prefix = stream.read(8)
    if len(prefix) < 8 or not prefix.startswith(NPY_MAGIC):
        raise InputProblem("member does not start with the .npy magic")
    major = prefix[6]
    if major == 1:
        size_bytes = 2
    elif major in (2, 3):
        size_bytes = 4
    else:
        raise InputProblem(f"unsupported .npy format version {major}.{prefix[7]}")
    header_len = int.from_bytes(_read_exactly(stream, size_bytes), "little")
    if header_len > MAX_HEADER_BYTES:
        raise InputProblem(f".npy header of {header_len} bytes exceeds the {MAX_HEADER_BYTES} cap")
    raw = _read_exactly(stream, header_len)
    try:
        text = raw.decode("utf-8" if major == 3 else "latin1")
        header = ast.literal_eval(text)
    except (UnicodeDecodeError, ValueError, SyntaxError, MemoryError, RecursionError):
        raise InputProblem(".npy header is not a valid Python literal") from None
    if not isinstance(header, dict) or set(header) != {"descr", "fortran_order", "shape"}:
        raise InputProblem(".npy header must hold exactly descr, fortran_order and shape")
    shape = header["shape"]
    if not isinstance(shape, tuple) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise InputProblem(f".npy shape {shape!r} is not a tuple of non-negative integers")
    if not isinstance(header["fortran_order"], bool):
        raise InputProblem(".npy fortran_order is not a bool")
    descr = header["descr"]
    if not isinstance(descr, str):
        # Lists describe structured dtypes: never tensors.
        raise InputProblem(f"dtype {descr!r} is not numeric (structured)")
    try:
        dtype = np.dtype(descr)
    except (TypeError, ValueError):
        raise InputProblem(f"unknown dtype {descr!r}") from None
    if dtype.hasobject:
        raise InputProblem(f"dtype {descr!r} holds Python objects; refusing to unpickle")
    if not is_numeric(dtype):
        raise InputProblem(f"dtype {descr!r} is not numeric")
    return dtype, shape, header["fortran_order"], 8 + size_bytes + header_len


def _npy_header(info: TensorInfo) -> bytes:
    header = {
        "descr": np.lib.format.dtype_to_descr(info.dtype),
        "fortran_order": False,
        "shape": info.shape,
    }
    text = repr(header).encode("latin1")
    # numpy pads header + newline so the data starts on a 64-byte boundary.
    for version, size_bytes in ((1, 2), (2, 4)):
        fixed = 8 + size_bytes
        padded = text + b" " * (-(fixed + len(text) + 1) % 64) + b"\n"
        if len(padded) < 2 ** (8 * size_bytes):
            return (
                NPY_MAGIC
                + bytes([version, 0])
                + len(padded).to_bytes(size_bytes, "little")
                + padded
            )
    raise ValueError("npy header too large")


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
        """npz holds tensors and nothing else: file metadata and any structure are lost."""
        losses = super().structure_losses(source)
        if source.metadata:
            losses.append(f"file metadata ({len(source.metadata)} keys)")
        return losses

    @classmethod
    def check_dtype(cls, info: TensorInfo) -> str | None:
        if from_ml_dtypes(info.dtype):
            return f"npz cannot hold {info.dtype.name}; write .safetensors instead"
        return None

    @classmethod
    def check_name(cls, name: str) -> str | None:
        parts = name.replace("\\", "/").split("/")
        if name.startswith("/") or ".." in parts or name.endswith("/"):
            return "a zip member must not escape the archive (absolute path or '..')"
        problem = super().check_name(name)
        if problem is None and len(f"{name}.npy".encode()) > ZIP_NAME_BYTES:
            return (
                f"a zip member name holds at most {ZIP_NAME_BYTES} bytes, and this one "
                f"(with '.npy', as UTF-8) has {len(f'{name}.npy'.encode())}"
            )
        return problem

    def write(self, info: TensorInfo, chunks: Iterable[np.ndarray]) -> None:
        with self._zip.open(f"{info.name}.npy", "w", force_zip64=True) as member:
            member.write(_npy_header(info))
            for chunk in chunks:
                member.write(byte_view(chunk, info.dtype))

    def close(self) -> None:
        self._zip.close()

    def abort(self) -> None:
        try:
            self._zip.close()
        except (OSError, ValueError, zipfile.BadZipFile):
            pass
