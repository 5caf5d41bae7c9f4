"""The GGUF header, parsed and validated by clipcli itself (no numpy, no `gguf` package).

Everything a hostile file could use to make a reader allocate, seek or loop is checked here
with Python ints against the file's size before it decides anything: counts, string and
array lengths, nesting, ranks, dimensions, ggml types, the alignment, and every tensor's
byte range. Only then does the reader hand bytes it read itself (pread) to
`gguf.quants.dequantize`; gguf's own GGUFReader, which memory-maps the whole file and
trusts its offsets, is never used.

Layout (GGUF v2/v3; llama.cpp's gguf.c is the reference for what is accepted): magic
`GGUF`, u32 version, u64 tensor count, u64 KV count, the KVs (key string, u32 value
type, value), the tensor infos (name, u32 n_dims, n_dims u64 `ne` (fastest dimension
first), u32 ggml type, u64 offset into the data section), padding to `general.alignment`,
then the data section: each tensor at its offset, padded to the alignment, in order.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable
from typing import NamedTuple

from clipcli.formats.base import NUMPY_MAX_BYTES

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # version 1 had 32-bit counts and is long gone
DEFAULT_ALIGNMENT = 32
# general.alignment: a power of two up to this (llama.cpp sets no bound; real files use 32).
MAX_ALIGNMENT = 1 << 20
MAX_TENSORS = 200_000  # as for safetensors
# ggml tensors have at most 4 dimensions (GGML_MAX_DIMS): llama.cpp refuses more.
MAX_DIMS = 4
# Arrays of arrays: llama.cpp reads none; gguf-py writes and reads them. A small depth.
MAX_NESTING = 4
# Scalar string values longer than this are summarised, not kept (a chat template is ~10 KB).
MAX_KEPT_STRING = 1 << 20
# Elements of an array shown by `ls` before "...".
SHOWN_ITEMS = 8
_WINDOW = 1 << 20  # bytes read at a time while walking the header

# ggml types: code -> (name, elements per block, bytes per block). From ggml.h /
# gguf.constants.GGML_QUANT_SIZES (tests/test_format_gguf.py checks they agree).
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    9: ("Q8_1", 32, 40),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66),
    17: ("IQ2_XS", 256, 74),
    18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18),
    21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82),
    23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1),
    25: ("I16", 1, 2),
    26: ("I32", 1, 4),
    27: ("I64", 1, 8),
    28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2),
    34: ("TQ1_0", 256, 54),
    35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17),
    40: ("NVFP4", 64, 36),
    41: ("Q1_0", 128, 18),
}
# Types stored element by element: their numpy dtype names.
PLAIN_TYPES = {
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F64": "float64",
    "I8": "int8",
    "I16": "int16",
    "I32": "int32",
    "I64": "int64",
}

# KV value types: code -> (name, struct format, size); STRING (8) and ARRAY (9) apart.
_SCALARS: dict[int, tuple[str, str, int]] = {
    0: ("uint8", "B", 1),
    1: ("int8", "b", 1),
    2: ("uint16", "H", 2),
    3: ("int16", "h", 2),
    4: ("uint32", "I", 4),
    5: ("int32", "i", 4),
    6: ("float32", "f", 4),
    7: ("bool", "?", 1),
    10: ("uint64", "Q", 8),
    11: ("int64", "q", 8),
    12: ("float64", "d", 8),
}
STRING = 8
ARRAY = 9
_UINT32 = 4
# The fewest bytes one value of a type takes: bounds an array's count by the bytes left.
_MIN_SIZE = {**{code: size for code, (_, _, size) in _SCALARS.items()}, STRING: 8, ARRAY: 12}
# The fewest bytes a KV (key length, type, 1-byte value) and a tensor info (name length,
# n_dims, type, offset) take: bound the counts by the bytes left.
_MIN_KV = 8 + 4 + 1
_MIN_TENSOR_INFO = 8 + 4 + 4 + 8


class MalformedGGUF(Exception):
    """The header breaks a rule; `tensor` names the tensor when there is one."""

    def __init__(self, problem: str, tensor: str | None = None) -> None:
        super().__init__(problem)
        self.tensor = tensor


class KV(NamedTuple):
    """One metadata value: `text` is what `ls` shows (arrays summarised), `value` the
    Python value of a scalar (None for arrays), `span` where the value lies in the file."""

    key: str
    type_name: str  # "uint32", "string", "array[string]", ...
    text: str
    value: int | float | bool | str | None
    span: tuple[int, int]
    length: int | None = None  # an array's length


class TensorEntry(NamedTuple):
    name: str
    ggml_type: int
    ne: tuple[int, ...]  # ggml order: fastest dimension first
    offset: int  # into the data section
    nbytes: int

    @property
    def type_name(self) -> str:
        return GGML_TYPES[self.ggml_type][0]

    @property
    def shape(self) -> tuple[int, ...]:
        """numpy order (slowest dimension first)."""
        return tuple(reversed(self.ne))

    @property
    def plain(self) -> bool:
        return self.type_name in PLAIN_TYPES


class Header(NamedTuple):
    version: int
    big_endian: bool
    kvs: dict[str, KV]
    tensors: list[TensorEntry]
    alignment: int
    data_start: int  # absolute offset of the data section
    file_size: int


def pad(size: int, alignment: int) -> int:
    return -(-size // alignment) * alignment


class _Cursor:
    """Reads the header through a window of pread bytes; every read is checked against the
    file's size first (Python ints: a length of 2**63 is refused, not allocated)."""

    def __init__(self, read_at: Callable[[int, int], bytes], file_size: int, order: str) -> None:
        self._read_at = read_at
        self.size = file_size
        self.pos = 0
        self.order = order
        self._window = b""
        self._window_start = 0

    def left(self) -> int:
        return self.size - self.pos

    def take(self, count: int, what: str) -> bytes:
        if count > self.left():
            raise MalformedGGUF(
                f"{what} of {count} bytes at offset {self.pos} runs past the end of the "
                f"{self.size}-byte file"
            )
        start = self.pos - self._window_start
        if start < 0 or start + count > len(self._window):
            if count > _WINDOW:
                data = self._read_at(self.pos, count)
                self._check_got(data, count)
                self.pos += count
                return data
            self._window = self._read_at(self.pos, min(_WINDOW, self.left()))
            self._window_start = self.pos
            start = 0
            self._check_got(self._window, count)
        self.pos += count
        return self._window[start : start + count]

    def _check_got(self, data: bytes, count: int) -> None:
        if len(data) < count:
            raise MalformedGGUF(f"file shrank while its header was read (offset {self.pos})")

    def skip(self, count: int, what: str) -> None:
        if count > self.left():
            raise MalformedGGUF(
                f"{what} of {count} bytes at offset {self.pos} runs past the end of the "
                f"{self.size}-byte file"
            )
        self.pos += count

    def skip_strings(self, count: int, what: str) -> None:
        """Skip `count` strings (u64 length, then its bytes), each length checked against
        the bytes left after it, as string_length does: the same walk in one tight loop
        over the window (a 256k-token vocabulary's is most of a GGUF header's cost)."""
        length_at = struct.Struct(self.order + "Q").unpack_from
        while count:
            if self.left() < 8:
                self.take(8, f"{what}: a string's length")  # raises: past the end
            start = self.pos - self._window_start
            if start < 0 or start + 8 > len(self._window):
                self._window = self._read_at(self.pos, min(_WINDOW, self.left()))
                self._window_start, start = self.pos, 0
                self._check_got(self._window, 8)
            window, end, base = self._window, len(self._window), self._window_start
            at = start
            while count and at + 8 <= end:
                (length,) = length_at(window, at)
                at += 8
                if length > self.size - (base + at):
                    self.pos = base + at
                    raise MalformedGGUF(
                        f"{what}: a string claims {length} bytes at offset {self.pos}; the "
                        f"file has {self.left()} left"
                    )
                at += length
                count -= 1
            self.pos = base + at

    def unpack(self, fmt: str, what: str) -> int | float:
        code = self.order + fmt
        (value,) = struct.unpack(code, self.take(struct.calcsize(code), what))
        return value  # type: ignore[no-any-return]

    def u32(self, what: str) -> int:
        return int(self.unpack("I", what))

    def u64(self, what: str) -> int:
        return int(self.unpack("Q", what))

    def string_length(self, what: str) -> int:
        length = self.u64(f"{what}'s length")
        if length > self.left():
            raise MalformedGGUF(
                f"{what} claims {length} bytes at offset {self.pos}; the file has "
                f"{self.left()} left"
            )
        return length

    def text(self, what: str) -> str:
        raw = self.take(self.string_length(what), what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise MalformedGGUF(f"{what} is not valid UTF-8") from None


def read_header(fd: int, file_size: int) -> Header:
    """Parse and validate the header of the GGUF file open at `fd`."""
    head = os.pread(fd, 8, 0)
    if head[:4] != MAGIC:
        raise MalformedGGUF("not a GGUF file (no GGUF magic)")
    if len(head) < 8:
        raise MalformedGGUF(f"file ends inside the GGUF header ({len(head)} bytes)")
    little, big = struct.unpack("<I", head[4:])[0], struct.unpack(">I", head[4:])[0]
    # Byte order by the version (as gguf-py and llama.cpp tell it): 3 read either way.
    if little in VERSIONS:
        order, version = "<", little
    elif big in VERSIONS:
        order, version = ">", big
    else:
        raise MalformedGGUF(f"GGUF version {little} is not supported (versions 2 and 3 are)")
    cursor = _Cursor(lambda offset, count: os.pread(fd, count, offset), file_size, order)
    cursor.skip(8, "magic and version")
    tensor_count = cursor.u64("tensor count")
    kv_count = cursor.u64("metadata count")
    if kv_count * _MIN_KV > cursor.left():
        raise MalformedGGUF(f"metadata count {kv_count} cannot fit in the {file_size}-byte file")
    if tensor_count > MAX_TENSORS:
        raise MalformedGGUF(f"tensor count {tensor_count} exceeds the {MAX_TENSORS} limit")
    kvs: dict[str, KV] = {}
    for index in range(kv_count):
        key = cursor.text(f"metadata key {index}")
        if key in kvs:
            raise MalformedGGUF(f"metadata key {key!r} appears twice")
        value_type = cursor.u32(f"type of metadata {key!r}")
        start = cursor.pos
        type_name, text, value, count = _value(cursor, value_type, key, 0)
        kvs[key] = KV(key, type_name, text, value, (start, cursor.pos), count)
    if tensor_count * _MIN_TENSOR_INFO > cursor.left():
        raise MalformedGGUF(f"tensor count {tensor_count} cannot fit in the {file_size}-byte file")
    alignment = _alignment(kvs)
    entries = [_tensor_info(cursor, index) for index in range(tensor_count)]
    data_start = pad(cursor.pos, alignment)
    _check_layout(entries, alignment, data_start, file_size)
    return Header(version, order == ">", kvs, entries, alignment, data_start, file_size)


def _value(
    cursor: _Cursor, value_type: int, key: str, depth: int
) -> tuple[str, str, int | float | bool | str | None, int | None]:
    """One value: (type name, text for `ls`, scalar value or None, array count or None)."""
    what = f"metadata {key!r}"
    if value_type in _SCALARS:
        name, fmt, _ = _SCALARS[value_type]
        if fmt == "?":
            flag = cursor.take(1, what)[0] != 0
            return name, "true" if flag else "false", flag, None
        number = cursor.unpack(fmt, what)
        return name, repr(number) if fmt in "fd" else str(number), number, None
    if value_type == STRING:
        length = cursor.string_length(what)
        if length > MAX_KEPT_STRING:
            cursor.skip(length, what)
            return "string", f"[a string of {length:,} bytes]", None, None
        raw = cursor.take(length, what)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise MalformedGGUF(f"{what} is not valid UTF-8") from None
        return "string", text, text, None
    if value_type == ARRAY:
        return _array(cursor, key, depth)
    raise MalformedGGUF(f"{what} has unknown value type {value_type}")


def _array(cursor: _Cursor, key: str, depth: int) -> tuple[str, str, None, int]:
    what = f"metadata {key!r}"
    if depth >= MAX_NESTING:
        raise MalformedGGUF(f"{what} nests arrays more than {MAX_NESTING} deep")
    item_type = cursor.u32(f"{what}'s item type")
    count = cursor.u64(f"{what}'s length")
    if item_type not in _MIN_SIZE:
        raise MalformedGGUF(f"{what} has unknown item type {item_type}")
    if count * _MIN_SIZE[item_type] > cursor.left():
        raise MalformedGGUF(
            f"{what} claims {count} items; the {cursor.size}-byte file cannot hold them"
        )
    shown: list[str] = []
    item_name = "string" if item_type == STRING else "array"
    if item_type in _SCALARS:
        item_name, _, size = _SCALARS[item_type]
        for _ in range(min(count, SHOWN_ITEMS)):
            shown.append(_value(cursor, item_type, key, depth + 1)[1])
        cursor.skip((count - len(shown)) * size, what)
    else:
        for index in range(count):
            if item_type == STRING:
                if index == SHOWN_ITEMS:  # the rest: lengths walked, bytes skipped
                    cursor.skip_strings(count - index, what)
                    break
                length = cursor.string_length(f"{what}[{index}]")
                raw = cursor.take(min(length, 64), what)
                cursor.skip(length - len(raw), what)
                shown.append(repr(raw.decode("utf-8", "replace")))
            else:
                item_type_name, text, _, _ = _value(cursor, ARRAY, key, depth + 1)
                if index < SHOWN_ITEMS:
                    shown.append(text)
                item_name = item_type_name
    more = ", ..." if count > len(shown) else ""
    text = f"[{count:,} x {item_name}: {', '.join(shown)}{more}]" if count else f"[0 x {item_name}]"
    return f"array[{item_name}]", text, None, count


def _alignment(kvs: dict[str, KV]) -> int:
    kv = kvs.get("general.alignment")
    if kv is None:
        return DEFAULT_ALIGNMENT
    if kv.type_name != _SCALARS[_UINT32][0] or not isinstance(kv.value, int):
        raise MalformedGGUF(f"general.alignment is a {kv.type_name}, not a uint32")
    value = kv.value
    if value == 0 or value & (value - 1) or value > MAX_ALIGNMENT:
        raise MalformedGGUF(
            f"general.alignment {value} is not a power of two up to {MAX_ALIGNMENT}"
        )
    return value


def _tensor_info(cursor: _Cursor, index: int) -> TensorEntry:
    name = cursor.text(f"tensor {index}'s name")
    if not name or "\x00" in name:
        raise MalformedGGUF(f"tensor {index}'s name is empty or holds a NUL byte")
    n_dims = cursor.u32("n_dims")
    if n_dims > MAX_DIMS:
        raise MalformedGGUF(f"{n_dims} dimensions; GGUF (ggml) holds at most {MAX_DIMS}", name)
    ne = tuple(cursor.u64("dimension") for _ in range(n_dims))
    ggml_type = cursor.u32("ggml type")
    offset = cursor.u64("offset")
    if ggml_type not in GGML_TYPES:
        raise MalformedGGUF(f"unknown ggml type {ggml_type}", name)
    type_name, block, type_size = GGML_TYPES[ggml_type]
    for dim in ne:
        # ggml's dimensions are int64: llama.cpp refuses negative ones (>= 2**63 as u64).
        if dim > NUMPY_MAX_BYTES:
            raise MalformedGGUF(f"dimension {dim} of ne {list(ne)} is past 2**63 - 1", name)
    if block > 1 and not ne:
        raise MalformedGGUF(f"{type_name} is a block type: it needs a dimension", name)
    if ne and ne[0] % block:
        raise MalformedGGUF(
            f"{type_name} rows hold whole blocks of {block}; ne[0] = {ne[0]} does not", name
        )
    numel = 1
    for dim in ne:
        numel *= dim  # Python ints: no overflow, judged below
    nbytes = numel // block * type_size
    if nbytes > NUMPY_MAX_BYTES or numel > NUMPY_MAX_BYTES:
        raise MalformedGGUF(f"ne {list(ne)} of {type_name} overflows ({nbytes} bytes)", name)
    return TensorEntry(name, ggml_type, ne, offset, nbytes)


def _check_layout(
    entries: list[TensorEntry], alignment: int, data_start: int, file_size: int
) -> None:
    """What llama.cpp's gguf.c requires: unique names, each tensor at the running padded
    end of the ones before it (aligned, in order, no overlap, no gap), and the data inside
    the file; bytes past the last tensor's padding are refused (as in safetensors)."""
    names: set[str] = set()
    expected = 0
    for entry in entries:
        if entry.name in names:
            raise MalformedGGUF("tensor name appears twice", entry.name)
        names.add(entry.name)
        if entry.offset % alignment:
            raise MalformedGGUF(
                f"data offset {entry.offset} is not a multiple of the alignment {alignment}",
                entry.name,
            )
        if entry.offset != expected:
            problem = "overlaps the previous tensor" if entry.offset < expected else "leaves a gap"
            raise MalformedGGUF(
                f"data offset {entry.offset} {problem} (expected {expected})", entry.name
            )
        if data_start + entry.offset + entry.nbytes > file_size:
            raise MalformedGGUF(
                f"data [{entry.offset}, {entry.offset + entry.nbytes}) runs past the end of "
                f"the file (the data section has {max(0, file_size - data_start)} bytes)",
                entry.name,
            )
        expected = entry.offset + pad(entry.nbytes, alignment)
    end = data_start + expected
    if file_size > end:  # it may end at the last tensor's end or at its padded end
        raise MalformedGGUF(f"trailing bytes: the tensors end at {end}, the file at {file_size}")


def array_values(
    read_at: Callable[[int, int], bytes], header: Header, begin: int, end: int
) -> list[object]:
    """The items of the array value stored at [begin, end) (a KV's span, checked when the
    header was read), decoded in full: strings must be UTF-8 (MalformedGGUF otherwise)."""
    cursor = _Cursor(read_at, end, ">" if header.big_endian else "<")
    cursor.pos = begin
    return _items(cursor, 0)


def _items(cursor: _Cursor, depth: int) -> list[object]:
    item_type = cursor.u32("item type")
    count = cursor.u64("array length")
    items: list[object] = []
    for _ in range(count):
        if item_type in _SCALARS:
            items.append(_value(cursor, item_type, "", depth)[2])
        elif item_type == STRING:
            items.append(cursor.text("string"))
        else:
            items.append(_items(cursor, depth + 1))
    return items
