"""The safetensors reader: parses and validates the header, then reads with pread."""

from __future__ import annotations

import bisect
import contextlib
import functools
import json
import math
import operator
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from clipcli.errors import InputError
from clipcli.formats.base import (
    NUMPY_MAX_BYTES,
    NUMPY_MAX_RANK,
    FileRange,
    Listed,
    ListedTensor,
    RangeLoader,
    Reader,
    StoredBytes,
    TensorInfo,
    default_chunk_elems,
    numpy_shape_problem,
    rank_problem,
)
from clipcli.formats.safetensors.header import (
    _PACKED,
    _U64,
    CODES,
    DTYPE_NAMES,
    ITEMSIZES,
    MAX_HEADER_BYTES,
    MAX_TENSORS,
    CompactBlock,
    CompactHeader,
    Entry,
    NotCompact,
    _is_int,
    as_json_value,
    buffer_size_overflows,
    compact_header,
    dtype_of,
    header_object,
)
from clipcli.formats.safetensors.offsets import TensorOffsets
from clipcli.formats.structure_record import (
    STRUCTURE_KEY,
    MalformedStructure,
    Structure,
    parse_structure,
)
from clipcli.system.identity import FileIdentity
from clipcli.system.inputs import open_input, pread_into

if TYPE_CHECKING:
    import numpy as np

_U64_MAX = 2**64 - 1
# loader_of_many reads at most this much at once, gaps included (a few small tensors with
# an unselected big one between them are read one by one).
MANY_SPAN_BYTES = 4 << 20
_BYTE_RANGE = operator.itemgetter(1, 2)  # of (Listed, begin, end): a stable sort keeps ties


def _plain_kind(code: str, dims: str) -> tuple[str, tuple[int, ...], int] | None:
    """(dtype name, shape, nbytes) of a compact entry's dtype code and dimensions when
    _parse_plain_entry would take them as they are (a known code, rank and size within the
    limits, no 0 dimension: none exceeds NUMPY_MAX_BYTES then); None otherwise."""
    itemsize = ITEMSIZES.get(code)
    shape = tuple(map(int, dims.split(","))) if dims else ()
    if itemsize is None or len(shape) > NUMPY_MAX_RANK or 0 in shape:
        return None
    nbytes = math.prod(shape) * itemsize
    return (DTYPE_NAMES[code], shape, nbytes) if nbytes * 8 <= _U64_MAX else None


def _shown(value: object, limit: int = 200) -> str:
    """repr cut to `limit` characters: a rejected field may be megabytes long."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}..."


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


class SafetensorsReader(Reader):
    """Parses and validates the header in the constructor, then reads with pread.

    The header is validated and listed (`listing`) without numpy, so that `clipcli ls`
    does not load it; `infos`, with numpy dtypes, is built on first use.

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
            self._listing, self._offsets, self._metadata = self._parse(self._file)
            self._infos: list[TensorInfo] | None = None
            self._infos_made = threading.Lock()  # made once, whichever thread asks first
            self._structure: Structure | None = None
        except BaseException:
            self._file.close()
            raise

    def source_identities(self) -> dict[Path, FileIdentity]:
        return {self.path: self._identity}

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

    @contextlib.contextmanager
    def _in_use(self) -> Iterator[int]:
        """The descriptor, held open (not released) until the block ends."""
        fd = self._acquire()
        try:
            yield fd
        finally:
            self._done()

    def _done(self) -> None:
        with self._lock:
            self._users -= 1
            if not self._users and self._close_when_idle and self._file is not None:
                self._file.close()
                self._file = None
                self._close_when_idle = False

    def _fail(self, problem: str, tensor: str | None = None) -> InputError:
        return InputError(self.path, problem, tensor)

    def _parse(self, handle: BinaryIO) -> tuple[list[Listed], TensorOffsets, dict[str, str]]:
        """The tensors (in file order), where each begins in the file, and the metadata."""
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
        # A lone surrogate can only be spelled as an escape from \uD800 to \uDFFF: a
        # header without one needs no look at each of its names.
        escapes_surrogate = b"\\ud" in raw or b"\\uD" in raw
        compact = None if escapes_surrogate else compact_header(text)
        parsed = None if compact is None else self._parse_compact(compact)
        if parsed is not None:
            del text, raw, compact
            metadata, entries = parsed
            return self._laid_out(entries, header_len, file_size, metadata)
        try:
            header = json.loads(text, object_pairs_hook=header_object)
        except RecursionError:
            raise self._fail("header JSON is nested too deeply") from None
        except ValueError as exc:
            raise self._fail(f"header is not valid JSON: {exc}") from None
        del text
        header = as_json_value(header)
        if not isinstance(header, dict):
            raise self._fail("header is not a JSON object")
        if escapes_surrogate:
            _refuse_surrogates(self, header)
        del raw
        metadata = self._parse_metadata(as_json_value(header.pop("__metadata__", None)))
        if len(header) > MAX_TENSORS:
            raise self._fail(f"header lists {len(header)} tensors; the limit is {MAX_TENSORS}")
        entries = [self._parse_entry(name, entry) for name, entry in header.items()]
        del header
        return self._laid_out(entries, header_len, file_size, metadata)

    def _laid_out(
        self,
        entries: list[tuple[Listed, int, int]],
        header_len: int,
        file_size: int,
        metadata: dict[str, str],
    ) -> tuple[list[Listed], TensorOffsets, dict[str, str]]:
        """The entries checked to tile the data section exactly, in file order."""
        entries.sort(key=_BYTE_RANGE)
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
        listing = [info for info, _, _ in entries]
        # Where each tensor begins in the file; it ends nbytes later (checked above).
        offsets = TensorOffsets(
            [info.name for info in listing], (8 + header_len + begin for _, begin, _ in entries)
        )
        return listing, offsets, metadata

    def _parse_metadata(self, raw: object) -> dict[str, str]:
        if raw is None:
            return {}
        if not isinstance(raw, dict):
            raise self._fail("__metadata__ is not an object")
        for key, value in raw.items():
            if not isinstance(value, str):
                raise self._fail(f"__metadata__[{key!r}] is not a string")
        return dict(raw)

    def _parse_entry(self, name: str, entry: object) -> tuple[Listed, int, int]:
        if type(entry) is Entry:
            return self._parse_plain_entry(name, entry)
        if not isinstance(entry, dict):
            raise self._fail("header entry is not an object", name)
        code = entry.get("dtype")
        if isinstance(code, str) and code in _PACKED:
            raise self._fail(f"dtype {code} (packed sub-byte floats) is not supported", name)
        if not isinstance(code, str) or code not in DTYPE_NAMES:
            raise self._fail(f"unknown dtype {code!r}", name)
        shape = entry.get("shape")
        if not isinstance(shape, list):
            raise self._fail(f"shape {_shown(shape)} is not a list", name)
        # The rank first: a shape of millions of dimensions is refused unread, unprinted.
        if (problem := rank_problem(len(shape))) is not None:
            raise self._fail(problem, name)
        if not all(_is_int(d) and d >= 0 for d in shape):
            raise self._fail(f"shape {_shown(shape)} is not a list of non-negative integers", name)
        # safe_open accepts any dimension below 2**64, but no numpy array (clipcli's chunks,
        # np and torch loaders) can have one of 2**63 or more, even beside a 0.
        if (problem := numpy_shape_problem(shape)) is not None:
            raise self._fail(problem, name)
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
        if buffer_size_overflows(shape, ITEMSIZES[code]):
            raise self._fail(f"shape {shape} overflows (computing its buffer size)", name)
        nbytes = math.prod(shape) * ITEMSIZES[code]
        if end - begin != nbytes:
            raise self._fail(
                f"data_offsets span {end - begin} bytes but {code} {shape} needs {nbytes}", name
            )
        return Listed(name, DTYPE_NAMES[code], tuple(shape), nbytes), begin, end

    def _parse_plain_entry(self, name: str, entry: Entry) -> tuple[Listed, int, int]:
        """A plainly typed entry (header_object): only the sizes are left to check."""
        code, shape, begin, end = entry
        itemsize = ITEMSIZES[code]
        numel = math.prod(shape)
        # Every dimension >= 1: no partial product exceeds the whole (buffer_size_overflows).
        fits = numel * itemsize * 8 <= _U64_MAX and 0 not in shape
        if fits and max(shape, default=0) <= NUMPY_MAX_BYTES and end - begin == numel * itemsize:
            return Listed(name, DTYPE_NAMES[code], shape, numel * itemsize), begin, end
        return self._parse_entry(name, entry.as_dict())  # says which check fails

    def _parse_compact(
        self, compact: CompactHeader
    ) -> tuple[dict[str, str], list[tuple[Listed, int, int]]] | None:
        """The metadata and entries of a compact header, as the JSON route would give them
        or with the error it would raise; None when a block turns out not to be compact
        (the JSON route reads the header then: a problem it finds comes first, so the
        first entry's error waits until every block is known to be compact)."""
        failure: InputError | None = None
        entries: list[tuple[Listed, int, int]] = []
        try:
            metadata = self._parse_metadata(as_json_value(compact.metadata))
        except InputError as exc:
            failure, metadata = exc, {}
        count = 0
        try:
            for block in compact.blocks():
                count += len(block.names)
                if count > MAX_TENSORS:
                    return None  # the JSON route refuses it, in its words
                if failure is None:
                    try:
                        entries += self._parse_compact_entries(block)
                    except InputError as exc:
                        failure = exc
        except NotCompact:
            return None
        if failure is not None:
            raise failure
        return metadata, entries

    def _parse_compact_entries(self, found: CompactBlock) -> list[tuple[Listed, int, int]]:
        """_parse_plain_entry over compact_header's columns, each dtype and shape worked out
        once: an entry that is not plainly typed, or fails a check, goes to _parse_entry as
        the JSON parser gives it."""
        entries: list[tuple[Listed, int, int]] = []
        append, make = entries.append, Listed._make
        kinds: dict[tuple[str, str], tuple[str, tuple[int, ...], int] | None] = {}
        columns = zip(found.names, found.codes, found.dims, found.begins, found.ends, strict=True)
        for name, code, dims, first, last in columns:
            begin, end = int(first), int(last)
            key = (code, dims)
            kind = kinds[key] if key in kinds else kinds.setdefault(key, _plain_kind(code, dims))
            if kind is not None and end - begin == kind[2]:
                append((make((name, *kind)), begin, end))
                continue
            shape = [int(d) for d in dims.split(",")] if dims else []
            entry = {"dtype": code, "shape": shape, "data_offsets": [begin, end]}
            append(self._parse_entry(name, entry))
        return entries

    @property
    def listing(self) -> Sequence[ListedTensor]:
        # The infos themselves once they exist (their fields are the listing's): one record
        # of each tensor, not two. Making a listing again from the infos instead cost 0.3 s
        # of CPU on 200,000 tensors (the quantized markers list names after the infos).
        # The listing read first: the infos are set before it is let go (infos()).
        listing, infos = self._listing, self._infos
        return listing if infos is None else infos

    @property
    def infos(self) -> list[TensorInfo]:
        if self._infos is None:
            with self._infos_made:  # two threads asking first get the same infos
                if self._infos is None:  # numpy (and ml_dtypes for BF16/F8) from here on
                    listing = self._listing
                    dtypes = {
                        name: dtype_of(CODES[name]) for name in {t.dtype_name for t in listing}
                    }
                    make = TensorInfo._make
                    self._infos = [
                        make((name, dtypes[dtype], shape, nbytes))
                        for name, dtype, shape, nbytes in listing
                    ]
                    self._listing = []  # `listing` is the infos from here on
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
        begin = self._offsets.begin(info.name)
        return begin, begin + info.nbytes

    def stored_bytes(self, info: TensorInfo) -> StoredBytes:
        begin, end = self.byte_range(info)
        return StoredBytes(self.path, self._in_use, begin, end)

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
        read = functools.partial(self.read_bytes, info)
        for start in range(begin, end, step):
            where = FileRange(self._in_use, start, min(start + step, end))
            yield RangeLoader(read, info.dtype, where)

    def elements_loader(
        self, info: TensorInfo, start: int, stop: int
    ) -> Callable[[], np.ndarray] | None:
        begin, end = self.byte_range(info)
        size = info.dtype.itemsize
        if not 0 <= start <= stop <= info.numel or begin + stop * size > end:
            raise ValueError(f"elements [{start}, {stop}) are not in tensor {info.name!r}")
        return functools.partial(self.read_bytes, info, begin + start * size, begin + stop * size)

    def loader_of_many(self, infos: Sequence[TensorInfo]) -> Callable[[], list[np.ndarray]] | None:
        """One pread for tensors stored in this order with at most MANY_SPAN_BYTES from the
        first one's start to the last one's end (what lies between, unasked, is read too)."""
        begins = self._offsets.begins([info.name for info in infos])
        end = begins[0]
        for begin, info in zip(begins, infos, strict=True):
            if begin < end:
                return None
            end = begin + info.nbytes
        if end - begins[0] > MANY_SPAN_BYTES:
            return None
        return functools.partial(self._read_many, list(infos), begins, end)

    def _read_many(self, infos: list[TensorInfo], begins: list[int], end: int) -> list[np.ndarray]:
        start = begins[0]
        ends = [begin + info.nbytes for begin, info in zip(begins, infos, strict=True)]

        def cut_short(at: int) -> str:  # the first tensor not wholly read when the file ends
            return infos[min(bisect.bisect_right(ends, at), len(infos) - 1)].name

        raw = self._pread(start, end, cut_short)
        return [
            raw[begin - start : begin - start + info.nbytes].view(info.dtype)
            for begin, info in zip(begins, infos, strict=True)
        ]

    def read_bytes(self, info: TensorInfo, start: int, stop: int) -> np.ndarray:
        """Elements stored in the absolute byte range [start, stop), read with pread."""
        return self._pread(start, stop, info.name).view(info.dtype)

    def _pread(self, start: int, stop: int, name: str | Callable[[int], str]) -> np.ndarray:
        """The bytes [start, stop) of the file, read with pread (`name`: the tensor a short
        read is blamed on, or what names it from the offset where the file ended).

        pread into a fresh buffer keeps the resident set bounded, where a memory map
        would count every touched page of a multi-GB file.
        """
        import numpy as np  # here, not at the top: listing a header needs no numpy

        raw = np.empty(stop - start, dtype=np.uint8)
        fd = self._acquire()  # not _in_use(): a generator's context costs each small read
        try:
            done = pread_into(fd, memoryview(raw), start)  # type: ignore[arg-type]
        finally:
            self._done()
        if done < raw.size:
            blamed = name if isinstance(name, str) else name(start + done)
            raise self._fail("file shrank while reading", blamed)
        return raw

    def read(self, info: TensorInfo) -> np.ndarray:
        begin, end = self.byte_range(info)
        return self.read_bytes(info, begin, end).reshape(info.shape)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._file is not None:
                self._file.close()
                self._file = None
