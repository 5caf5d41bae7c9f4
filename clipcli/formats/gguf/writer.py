"""GgufWriter: a GGUF v3 file, header first (every tensor's type, shape and offset are
known up front), then each tensor's bytes streamed in order, each padded to the alignment.

From a GGUF file (clip, or convert GGUF to GGUF) the output keeps the source's version,
byte order, alignment and every metadata key byte for byte (the KV section is copied as it
is stored, so types, arrays and order are exactly the source's), and each tensor keeps its
ggml type and `ne`: a block-quantized tensor arrives as its uint8 rows of blocks (the
stored tensor of the reader; a clip has rewritten the scale fields inside them). From any
other format: version 3, little-endian, alignment 32, file metadata as string values, the
plain types GGUF has (F32, F16, BF16, F64, I8..I64).
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from clipcli.formats.base import (
    Checkpoint,
    Reader,
    TensorInfo,
    Writer,
    ordered_bytes,
    rank_problem,
)
from clipcli.formats.gguf.header import (
    DEFAULT_ALIGNMENT,
    GGML_TYPES,
    MAGIC,
    MAX_DIMS,
    PLAIN_TYPES,
    STRING,
    pad,
)
from clipcli.formats.gguf.reader import GgufReader

if TYPE_CHECKING:
    import numpy as np

VERSION = 3
# llama.cpp's GGML_MAX_NAME (64, with the terminating NUL): a longer name is refused there.
MAX_NAME_BYTES = 63
# numpy dtype name -> ggml type code, for the plain types.
_PLAIN_CODES = {
    dtype: next(code for code, (n, _, _) in GGML_TYPES.items() if n == name)
    for name, dtype in PLAIN_TYPES.items()
}
# gguf.GGUFReader files the header's own fields as metadata keys GGUF.version,
# GGUF.tensor_count and GGUF.kv_count, and refuses a file whose metadata names one again:
# the namespace is the reader's, so no key in it is written.
READER_NAMESPACE = "GGUF."
_KV_START = 4 + 4 + 8 + 8  # magic, version, tensor count, KV count
_COPY_STEP = 1 << 20


class _Planned(NamedTuple):
    name: bytes
    ggml_type: int
    ne: tuple[int, ...]
    offset: int
    nbytes: int


class GgufWriter(Writer):
    format_name = "gguf"

    def __init__(self, path: Path, checkpoint: Checkpoint, durable: bool = False) -> None:
        super().__init__(path, checkpoint, durable)
        self.check_tensors(checkpoint.infos)  # callers refuse first (api.check_writable)
        source = checkpoint.source
        self._source = source if isinstance(source, GgufReader) else None
        if self._source is not None:
            header = self._source.header
            self._order = ">" if header.big_endian else "<"
            self._alignment = header.alignment
            self._version = header.version
        else:
            self._order, self._alignment, self._version = "<", DEFAULT_ALIGNMENT, VERSION
        self._planned = self._plan(checkpoint.infos)
        self._next = 0
        self._file = open(path, "wb")  # noqa: SIM115 - closed by close() or abort()
        try:
            self._write_header(checkpoint.metadata)
        except BaseException:
            self.abort()
            raise

    # ------------------------------------------------------------ what it can hold

    @classmethod
    def check_dtype(cls, info: TensorInfo) -> str | None:
        # uint8: a GGUF source's rows of blocks (check_metadata refuses any other).
        if info.dtype.name in _PLAIN_CODES or info.dtype.name == "uint8":
            return None
        return (
            f"GGUF holds {', '.join(_PLAIN_CODES)} and block-quantized tensors, "
            f"not {info.dtype_name}"
        )

    @classmethod
    def check_shape(cls, info: TensorInfo) -> str | None:
        return rank_problem(len(info.shape), MAX_DIMS, "GGUF (ggml)") or super().check_shape(info)

    @classmethod
    def check_name(cls, name: str) -> str | None:
        problem = super().check_name(name)
        if problem is None and len(name.encode("utf-8")) > MAX_NAME_BYTES:
            return (
                f"a GGUF tensor name holds at most {MAX_NAME_BYTES} bytes "
                "(llama.cpp's GGML_MAX_NAME)"
            )
        return problem

    @classmethod
    def check_metadata(cls, metadata: Mapping[str, str], source: Reader) -> str | None:
        """A GGUF source's metadata is copied as stored. Any other source: its keys become
        string values, but never `general.alignment` (GGUF's own, a uint32) nor a key in
        READER_NAMESPACE, which gguf's reader would refuse; and it cannot
        have uint8 tensors (GGUF has no such type: only a GGUF source's blocks are)."""
        if isinstance(source, GgufReader):
            return None
        if "general.alignment" in metadata:
            return "metadata key 'general.alignment' is GGUF's own (a uint32), not a string"
        for key in metadata:
            if key.startswith(READER_NAMESPACE):
                return (
                    f"metadata key {key!r} is in GGUF's own namespace ({READER_NAMESPACE}*: "
                    "gguf's reader names the header's version and counts so, and refuses "
                    "a file whose metadata repeats them)"
                )
        for info in source.infos:
            if info.dtype.name == "uint8":
                return f"tensor {info.name!r}: GGUF has no uint8 type"
        return None

    @classmethod
    def structure_losses(cls, source: Reader) -> list[str]:
        """From a GGUF file nothing is lost: its metadata is copied as stored."""
        if isinstance(source, GgufReader):
            return []
        return super().structure_losses(source)

    # ------------------------------------------------------------ the header

    def _plan(self, infos: Sequence[TensorInfo]) -> list[_Planned]:
        planned, offset = [], 0
        for info in infos:
            ggml_type, ne = self._type_of(info)
            planned.append(_Planned(info.name.encode("utf-8"), ggml_type, ne, offset, info.nbytes))
            offset += pad(info.nbytes, self._alignment)
        return planned

    def _type_of(self, info: TensorInfo) -> tuple[int, tuple[int, ...]]:
        """The tensor's ggml type and `ne` (fastest dimension first)."""
        if self._source is not None:
            entry = self._source.entry(info.name)
            stored = GgufReader.stored_info(entry)
            if stored.dtype != info.dtype or stored.shape != info.shape:
                raise ValueError(f"{info.name!r} is not the GGUF source's stored tensor")
            return entry.ggml_type, entry.ne
        if info.dtype.name not in _PLAIN_CODES:
            raise ValueError(f"{info.name!r}: {info.dtype_name} has no GGUF type")
        return _PLAIN_CODES[info.dtype.name], tuple(reversed(info.shape))

    def _pack(self, fmt: str, *values: int) -> bytes:
        return struct.pack(self._order + fmt, *values)

    def _string(self, text: bytes) -> bytes:
        return self._pack("Q", len(text)) + text

    def _write_header(self, metadata: Mapping[str, str]) -> None:
        out = self._file
        head = MAGIC + self._pack("I", self._version) + self._pack("Q", len(self._planned))
        written = 0
        if self._source is not None:
            header = self._source.header
            out.write(head + self._pack("Q", len(header.kvs)))
            end = max((kv.span[1] for kv in header.kvs.values()), default=_KV_START)
            self._copy_source(_KV_START, end)
            written = end
        else:
            out.write(head + self._pack("Q", len(metadata)))
            written = _KV_START
            for key, value in metadata.items():
                record = (
                    self._string(key.encode("utf-8"))
                    + self._pack("I", STRING)
                    + self._string(value.encode("utf-8"))
                )
                out.write(record)
                written += len(record)
        for p in self._planned:
            record = (
                self._string(p.name)
                + self._pack("I", len(p.ne))
                + b"".join(self._pack("Q", d) for d in p.ne)
                + self._pack("I", p.ggml_type)
                + self._pack("Q", p.offset)
            )
            out.write(record)
            written += len(record)
        out.write(bytes(pad(written, self._alignment) - written))

    def _copy_source(self, begin: int, end: int) -> None:
        """The source's bytes [begin, end): inside it (its header was checked so)."""
        assert self._source is not None
        for start in range(begin, end, _COPY_STEP):
            want = min(_COPY_STEP, end - start)
            data = self._source.read_at(start, want)
            if len(data) != want:
                raise ValueError("the GGUF source shrank while its metadata was copied")
            self._file.write(data)

    # ------------------------------------------------------------ the tensors

    def write(self, info: TensorInfo, chunks: Iterable[np.ndarray]) -> None:
        planned = self._planned[self._next]
        if planned.name != info.name.encode("utf-8"):
            raise ValueError(f"{info.name!r} written out of order")
        self._next += 1
        done = 0
        for chunk in chunks:
            # The header's byte order, whatever order the source stored the values in.
            data = ordered_bytes(chunk, info.dtype, self._order)
            self._file.write(data)
            done += data.nbytes
        if done != planned.nbytes:
            raise ValueError(f"{info.name!r}: {done} bytes written, {planned.nbytes} expected")
        self._file.write(bytes(pad(done, self._alignment) - done))

    def close(self) -> None:
        if self._next != len(self._planned):
            raise ValueError(f"{len(self._planned) - self._next} tensors were not written")
        self._file.close()  # the caller fsyncs

    def abort(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self._file.close()
