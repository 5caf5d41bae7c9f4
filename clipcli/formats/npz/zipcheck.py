"""The zip layout of an npz (or .keras) file checked before any member is read: each member's
bytes its own and inside the file, the local headers agreeing with the central directory, and
the expansion budget that refuses zip bombs."""

from __future__ import annotations

import os
import struct
import zipfile
from pathlib import Path

from clipcli.errors import InputError

# Expansion budget, on the whole file: the members may together inflate to at most
# BOMB_RATIO times the file's size, plus BOMB_MIN_BYTES (so a small file of all-zero
# tensors still reads). Real tensors compress ~1.1:1, all-zero ones ~1000:1 but are rarely
# large; inflating 200 bytes per byte read costs ~1 s per MB of file at zlib's speed.
BOMB_RATIO = 200
BOMB_MIN_BYTES = 64 << 20
# numpy writes members stored or deflated; the others (bzip2 ~20 MB/s, lzma) are refused.
COMPRESSION_METHODS = {zipfile.ZIP_STORED: "stored", zipfile.ZIP_DEFLATED: "deflate"}
_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")
_DATA_DESCRIPTOR_FLAG = 0x08


def expansion_budget(file_size: int) -> int:
    """The most bytes all members of a file of this size may inflate to, together."""
    return BOMB_RATIO * file_size + BOMB_MIN_BYTES


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
