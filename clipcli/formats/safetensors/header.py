"""The safetensors header: the dtype table, the limits the official reader keeps, and the
header the writer builds (the reader validates headers: reader.py)."""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from json.encoder import encode_basestring
from typing import TYPE_CHECKING, Any, NamedTuple

from clipcli.formats.base import TensorInfo, utf8_encodable

if TYPE_CHECKING:
    import numpy as np

MAX_HEADER_BYTES = 100_000_000  # the official reader's limit
MAX_TENSORS = 200_000  # real checkpoints hold at most tens of thousands
_U64 = struct.Struct("<Q")

# Each code's dtype, by numpy's name (little-endian, as safetensors stores), and its bytes
# per element. Plain data: `ls` validates and lists a header without numpy. dtype_of()
# makes the dtype on first use: BF16 and F8 are ml_dtypes' types, and ml_dtypes is
# imported only for a header that names one (clipcli.dtypes.dtype_named).
DTYPE_NAMES: dict[str, str] = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "I16": "int16",
    "U16": "uint16",
    "I32": "int32",
    "U32": "uint32",
    "I64": "int64",
    "U64": "uint64",
    "F16": "float16",
    "BF16": "bfloat16",
    "F32": "float32",
    "F64": "float64",
    "C64": "complex64",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E8M0": "float8_e8m0fnu",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
}
ITEMSIZES: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "I16": 2,
    "U16": 2,
    "I32": 4,
    "U32": 4,
    "I64": 8,
    "U64": 8,
    "F16": 2,
    "BF16": 2,
    "F32": 4,
    "F64": 8,
    "C64": 8,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "F8_E8M0": 1,
    "F8_E4M3FNUZ": 1,
    "F8_E5M2FNUZ": 1,
}
# Sub-byte types are packed two (or four thirds) to a byte; numpy cannot view them.
_PACKED = {"F4", "F6_E2M3", "F6_E3M2"}
CODES = {name: code for code, name in DTYPE_NAMES.items()}  # by numpy's dtype.name


def dtype_of(code: str) -> np.dtype[Any]:
    """The dtype of a code of DTYPE_NAMES."""
    from clipcli.dtypes import dtype_named  # numpy: when data is handled, not to list

    return dtype_named(DTYPE_NAMES[code])


class Entry(NamedTuple):
    """A tensor's header entry as the JSON parser hands it over when it is plainly typed
    (dtype a known code, shape and data_offsets lists of non-negative ints): a tuple of
    ~200 bytes instead of a dict of ~650, for headers of 200,000 tensors. The reader checks
    the rest (sizes, offsets) and names the tensor; as_dict() gives the entry back."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    def as_dict(self) -> dict[str, Any]:
        return {
            "dtype": self.dtype,
            "shape": list(self.shape),
            "data_offsets": [self.begin, self.end],
        }


_ENTRY_KEYS = frozenset({"dtype", "shape", "data_offsets"})
_CODE_OF = {code: code for code in ITEMSIZES}  # one str per code, not one per tensor
_RANK_LIMIT = 64  # formats.base.NUMPY_MAX_RANK: more dimensions go to the reader's checks


def header_object(pairs: list[tuple[str, Any]]) -> dict[str, Any] | Entry:
    """The JSON parser's object_pairs_hook: a duplicate key is refused (ValueError); a
    plainly typed tensor entry becomes an Entry, every other object a dict."""
    result = dict(pairs)
    if len(result) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise ValueError(f"duplicate key {key!r}")
            seen.add(key)
    if len(result) != 3 or result.keys() != _ENTRY_KEYS:
        return result
    code, shape, offsets = result["dtype"], result["shape"], result["data_offsets"]
    if (
        type(code) is str
        and code in _CODE_OF
        and type(shape) is list
        and len(shape) <= _RANK_LIMIT
        and all(type(d) is int and d >= 0 for d in shape)
        and type(offsets) is list
        and len(offsets) == 2
        and type(offsets[0]) is int
        and type(offsets[1]) is int
        and 0 <= offsets[0] <= offsets[1]
    ):
        return Entry(_CODE_OF[code], tuple(shape), offsets[0], offsets[1])
    return result


# The compact spelling of a header that every common writer uses (the official Rust
# writer, json.dumps with separators=(",", ":"), clipcli's build_header): no whitespace, no
# escape in a name, each entry's keys in this order, integers without sign, fraction or
# leading zero. Such a header is read by two regular expressions (~3x faster than json.loads
# with header_object for 200,000 entries); anything else goes through json.loads.
# At most 20 digits (2**64 has 20): a longer number is json.loads's (int() limits digits).
_INT = "(?:0|[1-9][0-9]{0,19})"
# One entry; each G opens a field's group. JSON refuses control characters in a string.
_ENTRY_FORM = (
    r'"G[^"\\\x00-\x1f]*)":\{"dtype":"G[A-Z0-9_]+)","shape":\[G(?:I(?:,I)*)?)\],'
    r'"data_offsets":\[GI),GI)\]\}'
).replace("I", _INT)
_ENTRY_AND_COMMA = re.compile(_ENTRY_FORM.replace("G", "(") + ",")
_METADATA_KEY = '"__metadata__":'
_JSON_SPACE = " \t\n\r"


class CompactBlock(NamedTuple):
    """Consecutive entries of a compactly spelled header, their fields in columns, in the
    header's order, as the text spells them ("w", "F32", "2,3", "0", "24")."""

    names: list[str]  # distinct across the header, none of them __metadata__
    codes: list[str]
    dims: list[str]
    begins: list[str]
    ends: list[str]


class NotCompact(Exception):
    """The header turned out not to be spelled compactly: json.loads reads it."""


class CompactHeader(NamedTuple):
    """A compactly spelled header: its metadata as json.loads with header_object gives it,
    and its entries a block at a time (blocks(): NotCompact where a block is not)."""

    metadata: Any
    blocks: Callable[[], Iterator[CompactBlock]]


def compact_header(text: str) -> CompactHeader | None:
    """The header when it may be spelled compactly; None for one that is not (json.loads
    decides then, and words the errors): whitespace between tokens, escapes in names,
    __metadata__ anywhere but first, a duplicate, other keys or values, no tensor. Some
    of this is found only a block at a time (NotCompact from blocks())."""
    text = text.rstrip(_JSON_SPACE)
    if not text.startswith("{") or not text.endswith("}"):
        return None
    position = 1
    metadata: Any = None
    if text.startswith(_METADATA_KEY, 1):
        try:
            metadata, position = _METADATA_DECODER.raw_decode(text, 1 + len(_METADATA_KEY))
        except (ValueError, RecursionError):
            return None
        if text[position : position + 1] != ",":
            return None
        position += 1
    if position >= len(text) - 1:
        return None  # no tensor
    return CompactHeader(metadata, lambda: _blocks(text, position, len(text) - 1))


# Entries split at a time: all 200,000 entries' fields at once held ~60 MB of strings.
_BLOCK_CHARS = 1 << 18
# How an entry ends and the next begins in a compact header: nowhere else (a name holds no
# '"', and a shape's "]" is followed by ',"').
_BETWEEN_ENTRIES = ']},"'


def _blocks(text: str, start: int, stop: int) -> Iterator[CompactBlock]:
    """text[start:stop] as blocks of entries, each cut after an entry's comma; NotCompact
    as soon as a block is not entries alone, or repeats a name."""
    seen: set[str] = set()
    while start < stop:
        cut = text.find(_BETWEEN_ENTRIES, start + _BLOCK_CHARS, stop)
        end = stop if cut < 0 else cut + len(_BETWEEN_ENTRIES) - 1  # after the comma
        # Split at every entry followed by a comma: the block is entries alone when every
        # piece between two of them is empty. Fields come in groups of 5 after each piece.
        pieces = _ENTRY_AND_COMMA.split(text[start:end] + ("," if end == stop else ""))
        if len(pieces) < 6 or any(pieces[0::6]):
            raise NotCompact
        names = pieces[1::6]
        before = len(seen)
        seen.update(names)
        if len(seen) - before != len(names) or "__metadata__" in names:
            raise NotCompact
        yield CompactBlock(names, pieces[2::6], pieces[3::6], pieces[4::6], pieces[5::6])
        start = end


_METADATA_DECODER = json.JSONDecoder(object_pairs_hook=header_object)


def as_json_value(value: Any) -> Any:
    """An object of the parsed header as the JSON held it (an Entry back as a dict)."""
    return value.as_dict() if type(value) is Entry else value


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_U64_MAX = 2**64 - 1


def buffer_size_overflows(shape: Sequence[int], itemsize: int) -> bool:
    """The official reader's rule (tensor.rs): the dimensions multiplied left to right in
    u64, checked at every step, even when a later one is 0, then by the bits per element:
    [2**32, 2**32, 0] overflows there, while [0, 2**64 - 1, 2] does not."""
    numel = 1
    for dim in shape:
        numel *= dim
        if numel > _U64_MAX:
            return True
    return numel * itemsize * 8 > _U64_MAX


# The entries of the last header that header_length measured within MAX_HEADER_BYTES, as
# texts of _PIECES_AT_ONCE entries joined by commas, with the tensors they describe: the
# writer's checks measure the header that the writer then builds, of the same tensors
# (200,000 entries: ~0.25 s of formatting each time). One kept, taken by the next build.
_measured: tuple[tuple[TensorInfo, ...], list[str]] | None = None


def build_header(infos: Iterable[TensorInfo], metadata: Mapping[str, str]) -> bytes:
    """Compact JSON with __metadata__ first, space-padded to 8 bytes, like the official
    writer, after its 8-byte length."""
    return b"".join(header_pieces(infos, metadata))


def header_pieces(infos: Iterable[TensorInfo], metadata: Mapping[str, str]) -> list[bytes]:
    """build_header's bytes in pieces, to be written one after another: the header of
    200,000 tensors is ~14 MB, which joined, encoded, padded and prefixed in one piece was
    made four times over (and left ~20 MB more of freed heap that the process kept)."""
    global _measured
    infos = tuple(infos)
    measured, _measured = _measured, None
    texts: list[str] = [_metadata_text(metadata)] if metadata else []
    if measured is not None and measured[0] == infos:
        texts += measured[1]
        measured = None
    else:
        texts += _batches(infos)
    pieces = [b"{"]
    for k in range(len(texts)):
        if k:
            pieces.append(b",")
        pieces.append(texts[k].encode("utf-8"))
        texts[k] = ""  # each text let go once encoded
    pieces.append(b"}")
    length = sum(map(len, pieces))
    pieces.append(b" " * (-length % 8))
    return [_U64.pack(length + len(pieces[-1])), *pieces]


def _batches(infos: Iterable[TensorInfo]) -> Iterator[str]:
    """The entries' texts joined by commas, _PIECES_AT_ONCE at a time."""
    batch: list[str] = []
    for text in _entry_texts(infos):
        batch.append(text)
        if len(batch) == _PIECES_AT_ONCE:
            yield ",".join(batch)
            batch = []
    if batch:
        yield ",".join(batch)


def _metadata_text(metadata: Mapping[str, str]) -> str:
    return '"__metadata__":' + json.dumps(dict(metadata), separators=(",", ":"), ensure_ascii=False)


def _entry_texts(infos: Iterable[TensorInfo]) -> Iterator[str]:
    """`"name":{"dtype":..,"shape":[..],"data_offsets":[..]}` of each tensor, laid out one
    after another, exactly as json.dumps(separators=(",", ":"), ensure_ascii=False) spells
    the entry (the name through json's own string encoder): one format per tensor instead
    of three containers and the encoder's walk over them (200,000 tensors: ~1 s less)."""
    offset = 0
    quoted, codes = encode_basestring, CODES
    for info in infos:
        end = offset + info.nbytes
        shape = ",".join(map(str, info.shape))
        code = codes[info.dtype_name]
        offsets = f"[{offset},{end}]"
        yield f'{quoted(info.name)}:{{"dtype":"{code}","shape":[{shape}],"data_offsets":{offsets}}}'
        offset = end


def _json_bytes(value: object) -> int:
    return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode("utf-8"))


def header_length(infos: Iterable[TensorInfo], metadata: Mapping[str, str]) -> int:
    """len(build_header(infos, metadata)) - 8, summed a piece at a time: 100 MB of
    metadata is measured without building the 100 MB header."""
    global _measured
    infos = tuple(infos)
    pieces = 0
    total = 2  # the braces
    if metadata:
        inner = sum(_json_bytes(k) + 1 + _json_bytes(v) for k, v in metadata.items())
        total += _json_bytes("__metadata__") + 1 + 2 + inner + len(metadata) - 1
        pieces += 1
    batches: list[str] = []  # kept for build_header while the header stays within limits
    joined = 0  # batches measured, each with its own commas
    for text in _batches(infos):
        total += _add_batch(text, batches, total)
        joined += 1
    pieces += len(infos)
    # The commas between pieces, less those inside the batches (len(batch) - 1 each).
    total += max(pieces - 1, 0) - (len(infos) - joined)
    padded = total + -total % 8
    # Kept where header_problem lets the writer build it.
    _measured = (infos, batches) if padded <= MAX_HEADER_BYTES else None
    return padded


def _add_batch(text: str, batches: list[str], so_far: int) -> int:
    """The UTF-8 length of a batch's entries joined by commas (their commas counted), the
    text kept in `batches` until the header so far passes MAX_HEADER_BYTES."""
    length = len(text) if text.isascii() else len(text.encode("utf-8"))
    if so_far + length <= MAX_HEADER_BYTES:
        batches.append(text)
    else:
        batches.clear()
    return length


# Entries measured together: one encode per entry would cost more than the entry's text.
_PIECES_AT_ONCE = 4096


def header_problem(infos: Sequence[TensorInfo], metadata: Mapping[str, str]) -> str | None:
    """Why a file of these tensors and this __metadata__ would not read back, with the
    official reader (header at most MAX_HEADER_BYTES, unique keys, __metadata__ reserved,
    UTF-8) or with ours (at most MAX_TENSORS tensors), or None."""
    if len(infos) > MAX_TENSORS:
        return (
            f"safetensors files hold at most {MAX_TENSORS} tensors here, and this has {len(infos)}"
        )
    names: set[str] = set()
    for info in infos:
        if info.name in names or info.name == "__metadata__":
            return f"tensor name {info.name!r} is repeated or reserved (__metadata__)"
        names.add(info.name)
    for key, value in metadata.items():
        if not (utf8_encodable(key) and utf8_encodable(value)):
            return f"metadata key {key!r}: safetensors holds UTF-8 text only"
    length = header_length(infos, metadata)
    if length > MAX_HEADER_BYTES:
        return (
            f"the safetensors header would be {length} bytes (tensor names, shapes and "
            f"{len(metadata)} metadata keys), over the official reader's limit of "
            f"{MAX_HEADER_BYTES}"
        )
    return None
