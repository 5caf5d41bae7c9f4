"""How much one stored HDF5 chunk can decode to, before the library decodes it.

The library decodes a whole chunk through its filter pipeline to read any element of it,
and its decompressors size their buffers from the data, not from the chunk: gzip grows
its buffer to whatever the stream gives (a 1 MB chunk inflating to 1 GiB), h5py's LZF
grows it by the stored size until the stream fits, and szip allocates what the stream's
first four bytes declare (up to 4 GiB). Only the decompressor can grow a chunk, so the
rules are:

- a pipeline has at most one decompressor, and after it (in write order: decoded before
  it on reading) only filters that keep a chunk's size (fletcher32, shuffle), so that
  the stored bytes, undone by those, are the decompressor's own stream;
- n-bit and scale-offset decode to the elements their parameters declare: those must be
  the chunk's;
- a chunk whose decompressor could, at its greatest ratio, take more than a third of the
  file's memory budget (a growing buffer, the one it replaces and the chunk) is decoded
  here first, a piece at a time or by counting, and refused when it gives more than its
  chunk holds. Few chunks of a file can be that big: ~20 of them at most.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

import clipcli.formats.hdf5.limits as limits
from clipcli.formats.hdf5.filters import (
    DEFLATE,
    FLETCHER32,
    LZF,
    NBIT,
    SCALEOFFSET,
    SHUFFLE,
    SZIP,
    name_of,
)

DECOMPRESSORS = frozenset({DEFLATE, LZF, SZIP})
# Filters that may follow the decompressor in write order: a checksum's 4 bytes at the
# end, a byte shuffle. Undone here before the stream is looked at.
KEEP_SIZE = frozenset({FLETCHER32, SHUFFLE})
# Deflate gives at most ~1032 bytes per stored byte (a 258-byte match in 2 bits).
DEFLATE_MAX_RATIO = 1032
# LZF at most 88 (a 3-byte token copies 264 bytes). h5py's filter was thought to stop
# at 100 MiB: attack bomb14att decoded a 12 MB file's 4 KiB chunk to 1 GB through it.
LZF_MAX_RATIO = 88
# A stream may give a little more than the chunk where another filter came first (a
# checksum's 4 bytes); anything past this is not a chunk of this dataset.
DECODE_SLACK = 4096
_PIECE = 4 << 20


def pipeline_problem(
    codes: Sequence[int],
    values: Sequence[Sequence[int]],
    chunk_elements: int,
    element_bytes: int,
) -> str | None:
    """Why a dataset's filter pipeline (codes and parameters, in write order) could decode
    a chunk to more than it holds, unchecked; None when it cannot."""
    problem = order_problem(codes)
    if problem is not None:
        return problem
    for code, parameters in zip(codes, values, strict=True):
        if code not in (NBIT, SCALEOFFSET):
            continue
        declared = tuple(parameters[2:5:2]) if len(parameters) >= 5 else None
        if declared != (chunk_elements, element_bytes):
            return (
                f"its {name_of(code)} filter declares chunks other than its own "
                f"(parameters {list(parameters[:5])}, chunks of {chunk_elements} elements of "
                f"{element_bytes} bytes)"
            )
    return None


def order_problem(codes: Sequence[int]) -> str | None:
    """Why filters in this write order could decode a chunk past any bound checked here:
    two decompressors, or a filter after the decompressor that does not keep sizes."""
    found = [code for code in codes if code in DECOMPRESSORS]
    if len(found) > 1:
        shown = ", then ".join(name_of(code) for code in found)
        return f"its filters compress twice ({shown}): what a chunk decodes to cannot be bounded"
    if found:
        after = [code for code in codes[codes.index(found[0]) + 1 :] if code not in KEEP_SIZE]
        if after:
            return (
                f"its filters apply {name_of(after[0])} after {name_of(found[0])}: what a "
                "chunk decodes to cannot be bounded"
            )
    return None


def applied(count: int, mask: int) -> list[int]:
    """The positions (of `count` filters, in write order) of the filters a chunk was
    stored through: bit i of its filter mask set means filter i was skipped for it."""
    return [i for i in range(count) if not mask >> i & 1]


def decode_limit(file_size: int) -> int:
    """The most a chunk's decompressor may give at its greatest ratio without a check
    here: a third of the file's memory budget (limits.expansion_budget)."""
    return limits.expansion_budget(file_size) // 3


def worst_output(code: int, stored: int) -> int:
    """The most a decompressor can give for `stored` bytes (szip: what its header says,
    up to 4 GiB, so always looked at)."""
    if code == DEFLATE:
        return DEFLATE_MAX_RATIO * stored
    if code == LZF:
        return LZF_MAX_RATIO * stored
    return 1 << 32


def decoded_bytes(
    raw: bytes, codes: Sequence[int], values: Sequence[Sequence[int]], most: int
) -> int:
    """How many bytes the chunk's decompressor gives for the stored chunk `raw` (stored
    through `codes`, with `values`, in write order), counted up to `most` only. The
    filters after the decompressor are undone first (fletcher32: its checksum dropped;
    shuffle: the bytes put back)."""
    data = raw
    at = next(i for i, code in enumerate(codes) if code in DECOMPRESSORS)
    for code, parameters in reversed(list(zip(codes[at + 1 :], values[at + 1 :], strict=True))):
        if code == FLETCHER32:
            data = data[:-4]
        elif code == SHUFFLE:
            data = unshuffled(data, parameters[0] if parameters else 1)
    if codes[at] == DEFLATE:
        return inflated_bytes(data, most)
    if codes[at] == LZF:
        return lzf_bytes(data, most)
    return int.from_bytes(data[:4], "little") if len(data) >= 4 else 0  # szip's header


def unshuffled(data: bytes, element_bytes: int) -> bytes:
    """HDF5's shuffle undone: the first byte of every element, then every second, ...
    back into elements; the bytes past the last whole element stay as they are."""
    if element_bytes <= 1 or len(data) < element_bytes:
        return data
    count = len(data) // element_bytes
    whole = np.frombuffer(data, np.uint8, count * element_bytes)
    return whole.reshape(element_bytes, count).T.tobytes() + data[count * element_bytes :]


def inflated_bytes(raw: bytes, most: int) -> int:
    """How many bytes the zlib stream at the start of `raw` inflates to, counted up to
    `most` only (a piece at a time: memory stays one piece). A stream that does not
    decode counts what it gave: the library then refuses it as a corrupt chunk."""
    import zlib

    inflater = zlib.decompressobj()
    total = 0
    data = raw
    try:
        while total < most and not inflater.eof:
            piece = inflater.decompress(data, min(_PIECE, most - total))
            total += len(piece)
            data = inflater.unconsumed_tail
            if not piece and not data:
                break
    except zlib.error:
        pass
    return total


def lzf_bytes(raw: bytes, most: int) -> int:
    """How many bytes an LZF stream gives, counted from its tokens up to `most` only
    (nothing is copied): a control byte below 32 is a run of that many + 1 literal bytes,
    any other a back reference of (control >> 5) + 2 bytes, 7 meaning a length byte
    follows, then one byte of the offset."""
    total = position = 0
    end = len(raw)
    while position < end and total < most:
        control = raw[position]
        position += 1
        if control < 32:
            position += control + 1
            total += control + 1
            continue
        length = control >> 5
        if length == 7:
            if position >= end:
                break
            length += raw[position]
            position += 1
        position += 1  # the offset's low byte
        total += length + 2
    return min(total, most)
