"""The GGUF reader: clipcli's own header parser (header.py) validates the file, then tensor
bytes are read with pread and block-quantized ones dequantized with `gguf.quants`.

The reader's tensors (`infos`, `stored_infos`) are the stored ones: F32/F16/BF16/F64/I8..I64
as their numpy dtypes, block types as uint8 rows of whole blocks, all in numpy order
(ggml's `ne` reversed). The block-quantized tensors' real values (float32, dequantized a
bounded run of blocks at a time: blocks.py, `values`) are what jobs measure, through
clipcli.logical.gguf's GGUFView.

The `gguf` package is imported only here, only when a quantized tensor is dequantized (it
loads yaml, ~60 ms): `ls` of a GGUF file needs neither it nor numpy.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clipcli.errors import InputError
from clipcli.formats.base import (
    FileRange,
    Listed,
    RangeLoader,
    Reader,
    StoredBytes,
    TensorInfo,
    default_chunk_elems,
)
from clipcli.formats.gguf.header import (
    GGML_TYPES,
    PLAIN_TYPES,
    SHOWN_ITEMS,
    Header,
    MalformedGGUF,
    TensorEntry,
    array_values,
    read_header,
)
from clipcli.system.identity import FileIdentity
from clipcli.system.inputs import open_input, pread_into

if TYPE_CHECKING:
    import numpy as np

    from clipcli.formats.gguf.blocks import BlockTypes

# A metadata array larger than this in the file is not carried into another format's
# metadata (a vocabulary of 256k tokens is ~4 MB): join_losses names it.
MAX_CARRIED_ARRAY_BYTES = 16 << 20


class GgufReader(Reader):
    """Validates the whole header in the constructor (header.read_header), then reads
    tensor bytes with pread on its own descriptor."""

    format_name = "gguf"

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self._file = open_input(path)
        self._lock = threading.Lock()
        try:
            stat = os.fstat(self._file.fileno())
            self._identity = FileIdentity.of_stat(stat)
            try:
                self.header: Header = read_header(self._file.fileno(), stat.st_size)
            except MalformedGGUF as exc:
                raise InputError(path, str(exc), exc.tensor) from None
            except OSError as exc:
                raise InputError(path, f"cannot read: {exc.strerror}") from None
            self._entries = {entry.name: entry for entry in self.header.tensors}
            self._blocks: BlockTypes | None = None
            self._stored: list[TensorInfo] | None = None
            self._carried: tuple[dict[str, str], list[str]] | None = None
            self._shown: dict[str, str] | None = None
        except BaseException:
            self._file.close()
            raise

    def _fail(self, problem: str, tensor: str | None = None) -> InputError:
        return InputError(self.path, problem, tensor)

    def source_identities(self) -> dict[Path, FileIdentity]:
        return {self.path: self._identity}

    # -- what `ls` shows: no numpy, no gguf

    @property
    def listing(self) -> list[Listed]:
        """Each tensor's ggml type (numpy's name for the plain ones), its shape in numpy
        order and its stored bytes."""
        return [
            Listed(e.name, PLAIN_TYPES.get(e.type_name, e.type_name), e.shape, e.nbytes)
            for e in self.header.tensors
        ]

    @property
    def metadata(self) -> Mapping[str, str]:
        """Every metadata key; a long array summarised by its length, first items and a
        digest of all its bytes (so that `diff` sees a change past the first items)."""
        if self._shown is None:
            shown = {"gguf.version": str(self.header.version)}
            if self.header.big_endian:
                shown["gguf.byte_order"] = "big-endian"
            for key, kv in self.header.kvs.items():
                text = kv.text
                if kv.length is not None and kv.length > SHOWN_ITEMS:
                    text = f"{text[:-1]} (blake2b {self._digest(*kv.span)})]"
                shown[key] = text
            self._shown = shown
        return self._shown

    def _digest(self, begin: int, end: int) -> str:
        import hashlib  # only for long arrays: a run over other formats never needs it

        digest = hashlib.blake2b(digest_size=16)
        for start in range(begin, end, 1 << 20):
            chunk = self.read_at(start, min(1 << 20, end - start))
            if len(chunk) != min(1 << 20, end - start):
                raise self._fail("file shrank while its metadata was read")
            digest.update(chunk)
        return digest.hexdigest()

    def descriptions(self) -> frozenset[str]:
        """The header's version and byte order, unless a key of the file has the name."""
        return frozenset(
            key for key in ("gguf.version", "gguf.byte_order") if key not in self.header.kvs
        ) & frozenset(self.metadata)

    def joined_metadata(self) -> dict[str, str]:
        """For another format's metadata: scalars as text, arrays as JSON (exact values)."""
        return dict(self._carried_metadata()[0])

    def join_losses(self) -> list[str]:
        dropped = self._carried_metadata()[1]
        if not dropped:
            return []
        shown = ", ".join(repr(key) for key in dropped[:3])
        more = f" and {len(dropped) - 3} more" if len(dropped) > 3 else ""
        return [f"GGUF metadata arrays too large or not UTF-8 text ({shown}{more})"]

    def _carried_metadata(self) -> tuple[dict[str, str], list[str]]:
        if self._carried is None:
            carried: dict[str, str] = {}
            dropped: list[str] = []
            for key, kv in self.header.kvs.items():
                begin, end = kv.span
                if kv.length is None and kv.value is not None:
                    carried[key] = kv.text
                    continue
                if end - begin > MAX_CARRIED_ARRAY_BYTES or kv.type_name == "string":
                    dropped.append(key)  # a string over header.MAX_KEPT_STRING, or a big array
                    continue
                try:
                    values = array_values(self.read_at, self.header, begin, end)
                except MalformedGGUF:  # not UTF-8
                    dropped.append(key)
                    continue
                carried[key] = json.dumps(values, ensure_ascii=False)
            self._carried = carried, dropped
        return self._carried

    def read_at(self, offset: int, count: int) -> bytes:
        """Up to `count` bytes of the file at `offset` (the header's spans: checked)."""
        return os.pread(self._file.fileno(), count, offset)

    # -- stored and logical tensors

    def entry(self, name: str) -> TensorEntry:
        return self._entries[name]

    @property
    def stored_infos(self) -> list[TensorInfo]:
        """The tensors as stored: plain types typed, block types as uint8 rows of blocks."""
        if self._stored is None:
            self._stored = [self.stored_info(e) for e in self.header.tensors]
        return self._stored

    @staticmethod
    def stored_info(entry: TensorEntry) -> TensorInfo:
        import numpy as np

        from clipcli.dtypes import dtype_named

        if entry.plain:
            dtype = dtype_named(PLAIN_TYPES[entry.type_name])
            return TensorInfo(entry.name, dtype, entry.shape, entry.nbytes)
        _, block, type_size = GGML_TYPES[entry.ggml_type]
        shape = (*entry.shape[:-1], entry.ne[0] // block * type_size)
        return TensorInfo(entry.name, np.dtype(np.uint8), shape, entry.nbytes)

    @property
    def blocks(self) -> BlockTypes:
        if self._blocks is None:
            from clipcli.formats.gguf.blocks import BlockTypes

            self._blocks = BlockTypes(self.header, self.stored_infos)
        return self._blocks

    @property
    def infos(self) -> list[TensorInfo]:
        """The stored tensors (stored_infos): block types as uint8 rows of whole blocks.
        Their values (float32) are clipcli.logical.gguf's GGUFView, through `values`."""
        return self.stored_infos

    def warnings(self) -> list[str]:
        """What a measurement leaves out: block types gguf.quants cannot dequantize."""
        return self.blocks.warnings()

    def chunks(self, info: TensorInfo, chunk_elems: int | None = None) -> Iterator[np.ndarray]:
        """The stored bytes or elements; a block type's chunks hold whole blocks (but one
        block cut to `chunk_elems` when that is shorter)."""
        return self._cut(self._loaders(info, chunk_elems, decoded=False), chunk_elems)

    def values(self, info: TensorInfo, chunk_elems: int | None = None) -> Iterator[np.ndarray]:
        """The values of the value tensor `info` (blocks.BlockTypes: float32, dequantized a
        bounded run of blocks at a time; a plain tensor's are its stored ones)."""
        return self._cut(self._loaders(info, chunk_elems, decoded=True), chunk_elems)

    def chunk_loaders(self, info: TensorInfo) -> Iterator[Callable[[], np.ndarray]]:
        return self._loaders(info, None, decoded=False)

    @staticmethod
    def _cut(
        loaders: Iterator[Callable[[], np.ndarray]], chunk_elems: int | None
    ) -> Iterator[np.ndarray]:
        for load in loaders:
            piece = load()
            if chunk_elems is None or piece.size <= chunk_elems:
                yield piece
            else:  # a block type's one block is longer than asked
                for start in range(0, piece.size, chunk_elems):
                    yield piece[start : start + chunk_elems]

    def _loaders(
        self, info: TensorInfo, chunk_elems: int | None, *, decoded: bool
    ) -> Iterator[Callable[[], np.ndarray]]:
        entry = self._entries[info.name]
        begin = self.header.data_start + entry.offset
        end = begin + entry.nbytes
        decode = self.blocks.decoder(entry, info) if decoded else None
        _, block, type_size = GGML_TYPES[entry.ggml_type]
        if decode is None:  # as stored: plain, or blocks as bytes
            step = (chunk_elems or default_chunk_elems(info.dtype)) * info.dtype.itemsize
            if block > 1:  # whole blocks: what GGUFView rescales field by field
                step = max(type_size, step // type_size * type_size)
            read = functools.partial(self._read_as, info.dtype)
            # Chunks of stored bytes may be counted by another process (system.counting),
            # as a safetensors file's.
            as_stored = self._as_stored(entry)
            for start in range(begin, end, step):
                if as_stored:
                    where = FileRange(self._in_use, start, min(start + step, end))
                    yield RangeLoader(read, info.dtype, where)
                else:
                    yield functools.partial(read, start, min(start + step, end))
            return
        blocks = max(1, (chunk_elems or default_chunk_elems(info.dtype)) // block)
        step = blocks * type_size
        for start in range(begin, end, step):
            yield functools.partial(
                self._read_decoded, decode, start, min(start + step, end), info.name
            )

    def elements_loader(
        self, info: TensorInfo, start: int, stop: int
    ) -> Callable[[], np.ndarray] | None:
        """A plain tensor's elements [start, stop) (its bytes lie in C order); None for a
        block type."""
        entry = self._entries[info.name]
        if not entry.plain:
            return None
        if not 0 <= start <= stop <= info.numel:
            raise ValueError(f"elements [{start}, {stop}) are not in tensor {info.name!r}")
        begin, size = self.header.data_start + entry.offset, info.dtype.itemsize
        first, last = begin + start * size, begin + stop * size
        return functools.partial(self._read_as, info.dtype, first, last)

    def _read_as(self, dtype: np.dtype[Any], start: int, stop: int) -> np.ndarray:
        raw = self.pread(start, stop)
        if self.header.big_endian and dtype.itemsize > 1:
            # Swapped as unsigned ints of the same width: bfloat16 (ml_dtypes) too.
            size = dtype.itemsize
            return raw.view(f">u{size}").astype(f"<u{size}").view(dtype)
        return raw.view(dtype)

    def _read_decoded(
        self, decode: Callable[[np.ndarray], np.ndarray], start: int, stop: int, name: str
    ) -> np.ndarray:
        raw = self.pread(start, stop, name)
        return decode(raw)

    def pread(self, start: int, stop: int, name: str | None = None) -> np.ndarray:
        """The bytes [start, stop) of the file (inside it: checked by the header)."""
        import numpy as np

        raw = np.empty(stop - start, dtype=np.uint8)
        view = memoryview(raw)  # type: ignore[arg-type]
        if pread_into(self._file.fileno(), view, start) < raw.size:
            raise self._fail("file shrank while reading", name)
        return raw

    def _as_stored(self, entry: TensorEntry) -> bool:
        """Whether the tensor's bytes are its values as they are (plain, little-endian):
        what a kernel copy may take and another process may count."""
        return entry.plain and not self.header.big_endian

    def stored_bytes(self, info: TensorInfo) -> StoredBytes | None:
        """A plain little-endian tensor's bytes, as safetensors stores them."""
        entry = self._entries[info.name]
        if not self._as_stored(entry):
            return None
        begin = self.header.data_start + entry.offset
        return StoredBytes(self.path, self._in_use, begin, begin + entry.nbytes)

    @contextlib.contextmanager
    def _in_use(self) -> Iterator[int]:
        """The descriptor (open until close(): never released while the reader lives)."""
        yield self._file.fileno()

    def close(self) -> None:
        with self._lock:
            self._file.close()
