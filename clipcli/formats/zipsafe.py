"""Zip safety, for every zip reader (npz, .keras; PyTorch's zips next): the zip layout
checked before any member is read (each member's name naming one file that stays inside
the archive, its bytes its own and inside the file, the local headers agreeing with the
central directory), the expansion budget that refuses zip bombs (formats.expansion's
policy), and members opened so that no read inflates more than the member declares."""

from __future__ import annotations

import bz2
import contextlib
import lzma
import os
import stat
import struct
import zipfile
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO

from clipcli.errors import InputError
from clipcli.formats import expansion

# Expansion budget, on the whole file: the members may together inflate to at most
# BOMB_RATIO times the file's size, plus BOMB_MIN_BYTES: the one policy of
# formats.expansion (inflating 200 bytes per byte read costs ~1 s per MB of file at zlib's
# speed). Read at each call: a test moves the zip limit here.
BOMB_RATIO = expansion.RATIO
BOMB_MIN_BYTES = expansion.FREE_BYTES
# numpy writes members stored or deflated; np.load also reads bzip2 and lzma (zipfile does),
# which are inflated here through a bounded stream (BoundedMember) under the same budget.
COMPRESSION_METHODS = {
    zipfile.ZIP_STORED: "stored",
    zipfile.ZIP_DEFLATED: "deflate",
    zipfile.ZIP_BZIP2: "bzip2",
    zipfile.ZIP_LZMA: "lzma",
}
_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")
_ENCRYPTED_FLAG = 0x01
_DATA_DESCRIPTOR_FLAG = 0x08
_UTF8_FLAG = 0x800
_INPUT_BLOCK = 64 << 10  # compressed bytes fed to a decompressor at a time


def member_key(name: str, fold_case: bool = False) -> str:
    """The file an extracting tool (unzip, a zip library's extractall) writes the member to:
    backslashes read as separators, empty and '.' components dropped, so './x', 'x', 'a//x',
    'a/./x', 'a\\x' and 'x/' are one file; with fold_case, letter case folded too (a
    case-insensitive filesystem, macOS's and Windows' default, merges 'X' and 'x')."""
    parts = [part for part in name.replace("\\", "/").split("/") if part not in ("", ".")]
    key = "/".join(parts)
    return key.casefold() if fold_case else key


def member_name_problem(name: str) -> str | None:
    """Why a member name alone is refused (it escapes the archive, holds a NUL, names no
    file), or None; the npz writer asks the same of the names it will write."""
    parts = name.replace("\\", "/").split("/")
    if name.startswith(("/", "\\")) or ".." in parts:
        return "escapes the archive (absolute path or '..')"
    if "\x00" in name:
        return "holds a NUL byte"
    if not member_key(name):
        return "names no file (only '/' and '.')"
    return None


def check_member_names(path: Path, entries: Sequence[zipfile.ZipInfo], fold_case: bool) -> None:
    """Every member names its own file, inside the archive.

    Two members that normalise alike (member_key) are one file to whoever extracts the zip
    and two to a reader that looks members up by exact name: clipcli would measure one
    while unzip extracts the other, and a clip would carry the hidden one unclipped. The
    key is taken of zipfile's name, which ends at a NUL byte as unzip's does."""
    seen: dict[str, str] = {}
    for entry in entries:
        name = entry.orig_filename
        key = member_key(entry.filename, fold_case)
        if key in seen:
            raise InputError(
                path,
                f"members {seen[key]!r} and {name!r} are duplicates: both name the file "
                f"{key!r} once extracted",
            )
        seen[key] = name
        problem = member_name_problem(name)
        if problem is not None:
            raise InputError(path, f"member name {name!r} {problem}")


_UNIX_TYPES = {
    stat.S_IFLNK: "symbolic link",
    stat.S_IFCHR: "character device",
    stat.S_IFBLK: "block device",
    stat.S_IFIFO: "FIFO",
    stat.S_IFSOCK: "socket",
}


def unix_file_type(entry: zipfile.ZipInfo) -> str | None:
    """What a member's Unix mode (the high 16 bits of its external attributes) says it is,
    when that is anything but a regular file or a directory (or no mode at all): an
    extracting tool would make a symbolic link (pointing anywhere) or a device of it."""
    kind = stat.S_IFMT(entry.external_attr >> 16)
    if kind in (0, stat.S_IFREG, stat.S_IFDIR):
        return None
    return _UNIX_TYPES.get(kind, f"special file (mode {kind:o})")


_END_RECORD = b"PK\x05\x06"
_END_RECORD_SIZE = 22
_MAX_COMMENT = 0xFFFF


def end_record_problem(fd: int) -> str | None:
    """Why the zip's end record (end of central directory) is ambiguous, or None.

    The end record is found by searching back from the end of the file, and its comment
    (up to 64 KiB) may hold anything, another end record included. zipfile takes the last
    signature it finds (as unzip and torch do); a reader that checks the comment's length
    takes the record whose comment ends the file. When those differ, or two records end
    the file, a torch.save zip reads as an empty npz to some and as a checkpoint to
    others. Trailing bytes after a zip with no such second record are left as zipfile
    reads them."""
    size = os.fstat(fd).st_size
    window = min(size, _END_RECORD_SIZE + _MAX_COMMENT)
    tail = os.pread(fd, window, size - window)
    found: list[int] = []
    ending: list[int] = []
    position = tail.find(_END_RECORD)
    while position != -1:
        found.append(position)
        if position + _END_RECORD_SIZE <= len(tail):
            (comment,) = struct.unpack_from("<H", tail, position + 20)
            if position + _END_RECORD_SIZE + comment == len(tail):
                ending.append(position)
        position = tail.find(_END_RECORD, position + 1)
    if ending and (len(ending) > 1 or ending[-1] != found[-1]):
        return (
            f"its zip has {len(found)} end-of-central-directory records, one inside the "
            "comment of another: which members it holds depends on which record a reader "
            "takes; refusing an ambiguous zip"
        )
    return None


def expansion_budget(file_size: int) -> int:
    """The most bytes all members of a file of this size may inflate to, together."""
    return expansion.budget(file_size, BOMB_RATIO, BOMB_MIN_BYTES)


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


def check_zip_layout(
    path: Path, fd: int, archive: zipfile.ZipFile, fold_case: bool = False
) -> None:
    """Each member names its own file (check_member_names), its bytes are its own and
    inside the file, and together the members inflate to at most expansion_budget(file size).

    The central directory is what zipfile trusts; a hostile zip can make it claim more
    than the file holds: members whose data overlap or share bytes (one compressed
    block read as a thousand members), a local header that disagrees with its central
    entry (another name, method or size), a stored member whose two sizes differ, data
    running into the central directory or past the end. Each member's span (local
    header, name, extra field, data, data descriptor) is computed from its local
    header and the spans must be disjoint and lie before the central directory.
    """
    entries = archive.infolist()
    check_member_names(path, entries, fold_case)
    problem = end_record_problem(fd)
    if problem is not None:
        raise InputError(path, problem)
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
                f"compression method {entry.compress_type} is not one numpy reads "
                "(stored, deflate, bzip2 or lzma)",
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
    # Compared as bytes, in the central directory's encoding (cp437 and strict UTF-8 both
    # encode back to the bytes they were decoded from), and with the same UTF-8 flag: a tool
    # that reads local headers (a streaming unzip) must see the very name clipcli listed.
    encoding = "utf-8" if entry.flag_bits & _UTF8_FLAG else "cp437"
    try:
        central_raw = entry.orig_filename.encode(encoding)
    except UnicodeEncodeError:  # zipfile decoded it with another encoding than the flag says
        central_raw = None
    if (
        raw_name != central_raw
        or (flags ^ entry.flag_bits) & _UTF8_FLAG
        or method != entry.compress_type
    ):
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


@contextlib.contextmanager
def open_member(
    archive: zipfile.ZipFile, fd: int, entry: zipfile.ZipInfo
) -> Iterator[BoundedMember | IO[bytes]]:
    """A stream of the member's content that never inflates more than it declares.

    zipfile inflates deflate with a bound on each call's output, but hands a whole block of
    bzip2 or lzma input to the decompressor at once: a few kilobytes of bzip2 inflate to
    gigabytes in one call, before any size check. Those two go through BoundedMember,
    which asks the decompressor for at most what the caller reads."""
    if entry.compress_type in (zipfile.ZIP_BZIP2, zipfile.ZIP_LZMA):
        yield BoundedMember(fd, entry)
    else:
        with archive.open(entry) as stream:
            yield stream


class BoundedMember:
    """A bzip2 or lzma member, read from the file with pread and inflated with a bound on
    every call's output: it yields at most the member's declared size (plus one byte, to
    show a member longer than declared), and its CRC is checked at the end, as zipfile's."""

    def __init__(self, fd: int, entry: zipfile.ZipInfo) -> None:
        if entry.flag_bits & _ENCRYPTED_FLAG:
            raise zipfile.BadZipFile(f"member {entry.filename!r} is encrypted")
        local = os.pread(fd, _LOCAL_HEADER.size, entry.header_offset)
        if len(local) != _LOCAL_HEADER.size or local[:4] != b"PK\x03\x04":
            raise zipfile.BadZipFile("bad zip local header")
        name_len, extra_len = _LOCAL_HEADER.unpack(local)[-2:]
        self._fd = fd
        self._position = entry.header_offset + _LOCAL_HEADER.size + name_len + extra_len
        self._left = entry.compress_size  # compressed bytes not yet read from the file
        self._size = entry.file_size
        self._crc_expected = entry.CRC
        self._produced = 0
        self._crc = 0
        self._pending = b""  # compressed bytes read but not yet taken by the decompressor
        self._finished = False
        self._decompressor: bz2.BZ2Decompressor | lzma.LZMADecompressor
        if entry.compress_type == zipfile.ZIP_BZIP2:
            self._decompressor = bz2.BZ2Decompressor()
        else:
            self._decompressor = self._lzma_decompressor()

    def _take(self, size: int) -> bytes:
        data = os.pread(self._fd, min(size, self._left), self._position)
        if len(data) != min(size, self._left):
            raise EOFError("member data runs past the end of the file")
        self._position += len(data)
        self._left -= len(data)
        return data

    def _lzma_decompressor(self) -> lzma.LZMADecompressor:
        """A zip lzma member starts with its own header (APPNOTE 5.8.8): version (2 bytes),
        properties size (2), then LZMA1's properties: lc/lp/pb in one byte, the dictionary
        size in four. The stream after it is raw LZMA1."""
        header = self._take(4)
        if len(header) != 4:
            raise zipfile.BadZipFile("truncated lzma member header")
        (properties_size,) = struct.unpack_from("<H", header, 2)
        properties = self._take(properties_size)
        if properties_size != 5 or len(properties) != 5 or properties[0] >= 9 * 5 * 5:
            raise zipfile.BadZipFile("bad lzma properties in the member header")
        lc_lp_pb = properties[0]
        lzma1 = {
            "id": lzma.FILTER_LZMA1,
            "lc": lc_lp_pb % 9,
            "lp": lc_lp_pb // 9 % 5,
            "pb": lc_lp_pb // 45,
            # The decoder allocates the whole dictionary up front, and the header may ask
            # for 4 GiB. No valid stream looks back further than its own output, so the
            # member's declared size (inside the budget) is dictionary enough (4 KiB at least).
            "dict_size": max(4096, min(int.from_bytes(properties[1:], "little"), self._size)),
        }
        return lzma.LZMADecompressor(lzma.FORMAT_RAW, filters=[lzma1])

    def read(self, size: int = -1) -> bytes:
        wanted = self._size - self._produced
        if size >= 0:
            wanted = min(wanted, size)
        pieces: list[bytes] = []
        got = 0
        while got < wanted:
            piece = self._inflate(wanted - got)
            if not piece and self._decompressor.eof:
                raise EOFError(f"member holds {self._produced + got} of {self._size} bytes")
            pieces.append(piece)
            got += len(piece)
        data = b"".join(pieces)
        self._produced += len(data)
        self._crc = zlib.crc32(data, self._crc)
        if self._produced == self._size and not self._finished:
            self._finish()
        return data

    def _inflate(self, limit: int) -> bytes:
        """At most `limit` bytes more (b"" at the end of the compressed stream)."""
        if self._decompressor.eof:
            return b""
        if self._decompressor.needs_input and not self._pending:
            if self._left == 0:
                raise EOFError("the compressed data ends before the member does")
            self._pending = self._take(_INPUT_BLOCK)
        piece = self._decompressor.decompress(self._pending, limit)
        self._pending = b""
        return piece

    def _finish(self) -> None:
        """Once the declared size is out: the compressed stream must end there (one byte
        more is a member longer than declared), and the CRC must match."""
        while not self._decompressor.eof:
            if self._inflate(1):
                raise zipfile.BadZipFile(f"member inflates past its declared {self._size} bytes")
        if self._crc != self._crc_expected:
            raise zipfile.BadZipFile("CRC mismatch: the member data is corrupt")
        self._finished = True
