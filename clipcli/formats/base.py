"""The interface every format module implements.

A Reader lists TensorInfo without reading data, then hands out one tensor at a time,
either whole (`read`) or as consecutive flat C-order chunks (`chunks`) so that memory
stays bounded. A Writer is told every tensor up front and then receives the tensors in
that order, each as an iterable of flat C-order chunks.
"""

from __future__ import annotations

import math
import os
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, BinaryIO, ClassVar, NamedTuple, Self

from clipcli.errors import InputError
from clipcli.formats.structure_record import Structure

if TYPE_CHECKING:
    # numpy is imported where data is handled, not here: `clipcli ls` of a safetensors
    # file lists its header (Reader.listing) without loading numpy at all.
    import numpy as np

    from clipcli.numerics.norms import NormAccumulator
    from clipcli.system.identity import FileIdentity

# numpy's dtype.name is computed in Python on every call (~2 us): a checkpoint of 200,000
# tensors asks it several times per tensor (rows, writer checks, headers), so each dtype's
# name is kept once here (no numpy import: the dtype object is the key).
_DTYPE_NAMES: dict[Any, str] = {}


def name_of_dtype(dtype: np.dtype[Any]) -> str:
    """dtype.name, computed once per dtype."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = dtype.name
    return name


# Target size of one chunk in bytes. Large enough to amortise Python overhead,
# small enough that a float64 copy of it stays in L2/L3 cache.
# A developer's knob for benchmarks/thread_knobs.py (not a user option: chunk bounds decide
# how sums associate, so a changed size changes the last bits of a norm).
_CHUNK_BYTES_KNOB = os.environ.get("CLIPCLI_CHUNK_BYTES", "")
CHUNK_BYTES = (
    int(_CHUNK_BYTES_KNOB)
    if _CHUNK_BYTES_KNOB.isdigit() and 0 < int(_CHUNK_BYTES_KNOB) <= 1 << 30
    else 1 << 21
)


# The immutable records below are NamedTuples, not frozen dataclasses: the same fields,
# equality and hashing, but defining one costs ~0.05 ms at import instead of ~0.4 ms
# (dataclasses compile their methods), and every command imports this module (start-up in
# shell loops, issue 12 item 7).
class TensorInfo(NamedTuple):
    name: str
    dtype: np.dtype[Any]
    shape: tuple[int, ...]
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def dtype_name(self) -> str:
        """numpy's name, independent of byte order: float32, bfloat16, float8_e4m3fn, ..."""
        return name_of_dtype(self.dtype)


class Listed(NamedTuple):
    """What `ls` shows of a tensor: read from a header alone, no numpy needed (a
    safetensors file is listed without loading it: start-up time in shell loops)."""

    name: str
    dtype_name: str  # numpy's name: float32, bfloat16, float8_e4m3fn, ...
    shape: tuple[int, ...]
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


# What Reader.listing gives of each tensor: a Listed read from a header alone, or the
# TensorInfo itself once a reader has made its infos (the same name, dtype_name, shape and
# nbytes, held once: two records of each of 200,000 tensors were 15 MB more).
ListedTensor = Listed | TensorInfo


def byte_view(array: np.ndarray, dtype: np.dtype[Any]) -> memoryview:
    """The array's bytes as `dtype`, C-contiguous, without a copy where none is needed."""
    import numpy as np

    data = array if array.dtype == dtype else array.astype(dtype)
    return memoryview(np.ascontiguousarray(data).view(np.uint8))  # type: ignore[arg-type]


# '<' or '>': this machine's byte order (what a dtype's '=' and '|' mean).
_NATIVE_ORDER = "<" if sys.byteorder == "little" else ">"


def _byte_order(dtype: np.dtype[Any]) -> str:
    """'<' or '>': where a dtype's multi-byte units keep their low byte."""
    order: str = dtype.byteorder
    return order if order in "<>" else _NATIVE_ORDER


def ordered_bytes(array: np.ndarray, dtype: np.dtype[Any], order: str) -> memoryview:
    """The array's values as `dtype`, laid out in byte order `order` ('<' or '>'),
    C-contiguous. A format that declares one byte order (PyTorch's `byteorder` record,
    a GGUF header, safetensors) must get the values in that order whatever order the
    source stored them in (a '>f4' npz member, a big-endian HDF5 dataset): writing the
    source's bytes as they are would make every value another one."""
    import numpy as np

    if (
        (array.dtype is dtype or array.dtype == dtype)  # '<f4' is float32 here, '>f4' is not
        and _byte_order(dtype) == order  # '<' (safetensors' own dtypes) or '=' on this machine
        and array.ndim  # a 0-d array comes out 1-d below
        and array.flags.c_contiguous
    ):  # as it stands (200,000 tiny tensors: the common case, spared the questions below)
        return memoryview(array.view(np.uint8))  # type: ignore[arg-type]
    same_values = name_of_dtype(array.dtype) == name_of_dtype(dtype)
    data = np.ascontiguousarray(array if same_values else array.astype(dtype))
    # A complex value is two floats, each swapped on its own.
    unit = data.dtype.itemsize // 2 if data.dtype.kind == "c" else data.dtype.itemsize
    if unit > 1 and _byte_order(data.dtype) != order:
        data = data.view(f"u{unit}").byteswap()  # bfloat16 and fp8 too: numpy has no '>'
    return memoryview(data.view(np.uint8))  # type: ignore[arg-type]


def default_chunk_elems(dtype: np.dtype[Any]) -> int:
    return max(1, CHUNK_BYTES // max(1, dtype.itemsize))


class FileRange(NamedTuple):
    """The bytes [start, stop) of an open file that a chunk loader reads with pread.
    in_use() holds the descriptor open (never released or reused) while the caller reads
    through it, and yields it: another process may then read the same bytes (the measuring
    pass counts 8/16-bit float chunks in helper processes, system.counting)."""

    in_use: Callable[[], AbstractContextManager[int]]
    start: int
    stop: int


class RangeLoader:
    """A chunk loader whose chunk is the bytes of a FileRange (`where`) as they are, viewed
    as `dtype`: called, it reads them as the reader does (read(start, stop))."""

    __slots__ = ("_read", "dtype", "where")

    def __init__(
        self, read: Callable[[int, int], np.ndarray], dtype: np.dtype[Any], where: FileRange
    ) -> None:
        self._read = read
        self.dtype = dtype
        self.where = where

    def __call__(self) -> np.ndarray:
        return self._read(self.where.start, self.where.stop)


class StoredBytes(NamedTuple):
    """Where a tensor's bytes lie in a file, stored as safetensors stores them (C order,
    little-endian, nothing between): what a kernel copy may take byte for byte."""

    path: Path
    # The descriptor, held open while the block runs (reopened, and checked to be the same
    # file, if it was released): a copy must hold it where it runs. A number taken before
    # and used later, on the copier's thread, could by then be another shard's (a model
    # directory keeps 64 shards open: a tensor was copied from shard 65, exit 0: s47c).
    in_use: Callable[[], AbstractContextManager[int]]
    begin: int
    end: int


class Shard(NamedTuple):
    name: str  # a plain file name
    infos: list[TensorInfo]
    metadata: Mapping[str, str]  # the shard's own __metadata__


class DirectoryLayout(NamedTuple):
    """A model directory's shape, for writing another like it: the shards with their
    tensors, the index (if any), and the other files and folders that go beside them."""

    root: Path
    shards: list[Shard]
    index_name: str | None
    index_document: dict[str, Any] | None  # a copy, free to edit
    side_folders: list[Path]  # under root, parents before children
    side_files: list[Path]  # under root
    open_side_file: Callable[[Path], BinaryIO]  # checked again when opened

    def output_names(self) -> frozenset[str]:
        """Every path (relative, '/'-separated) a copy of this directory holds."""
        names = {shard.name for shard in self.shards}
        if self.index_name is not None:
            names.add(self.index_name)
        for path in [*self.side_folders, *self.side_files]:
            names.add(path.relative_to(self.root).as_posix())
        return frozenset(names)


class NonTensorInfo(NamedTuple):
    """A stored object that is not a tensor (an HDF5 string dataset such as a vocabulary,
    a compound table, an empty dataspace): listed, never measured or clipped, and carried
    through unchanged where the output format can hold it."""

    name: str
    kind: str  # what it holds, for people: "a variable-length string dtype"
    shape: tuple[int, ...] | None  # None: an empty (null) dataspace
    nbytes: int  # as declared in the file
    copyable: bool = True  # False: it cannot be carried to another file (references)
    variable_length: bool = False


class Checkpoint:
    """What a writer needs besides the tensors: metadata, and the reader whose format
    extras (declared on Reader: compression, directory layout, stored bytes) it may use.

    (A plain class, not a dataclass: importing dataclasses pulls in inspect, ~4 ms of a
    shell loop's `clipcli ls`, which otherwise loads neither.)"""

    def __init__(
        self,
        infos: list[TensorInfo],
        metadata: Mapping[str, str] | None = None,
        source: Reader | None = None,
    ) -> None:
        self.infos = infos
        self.metadata: Mapping[str, str] = {} if metadata is None else metadata
        self.source = source

    @property
    def compressed(self) -> bool:
        """The source was compressed (an npz written with savez_compressed)."""
        return self.source is not None and self.source.compressed

    @property
    def layout(self) -> DirectoryLayout | None:
        """The source's model-directory layout, None for a single file."""
        return self.source.directory_layout() if self.source is not None else None


class ReaderCore(ABC):
    """What every format implements: its tensors listed without reading data, their
    chunks, and the identities of the files it opened. The rest of Reader is optional
    capabilities, each with a default that fits a plain one-file format."""

    format_name: ClassVar[str]

    def __init__(self, path: Path) -> None:
        self.path = path

    @property
    @abstractmethod
    def infos(self) -> list[TensorInfo]:
        """Tensors in file order, without reading their data."""

    @property
    def listing(self) -> Sequence[ListedTensor]:
        """What `ls` shows of the tensors, in file order. A reader that can list without
        numpy (safetensors) answers this without building `infos`."""
        return [Listed(i.name, i.dtype_name, i.shape, i.nbytes) for i in self.infos]

    @property
    def metadata(self) -> Mapping[str, str]:
        """File-level string metadata (safetensors __metadata__, HDF5 root attributes)."""
        return {}

    @abstractmethod
    def chunks(self, info: TensorInfo, chunk_elems: int | None = None) -> Iterator[np.ndarray]:
        """Consecutive 1-D C-order pieces of the tensor, each at most chunk_elems long."""

    def read(self, info: TensorInfo) -> np.ndarray:
        """The whole tensor, shaped. Costs memory equal to the tensor."""
        import numpy as np

        out = np.empty(info.numel, dtype=info.dtype)
        pos = 0
        for piece in self.chunks(info):
            out[pos : pos + piece.size] = piece
            pos += piece.size
        return out.reshape(info.shape)

    def warnings(self) -> list[str]:
        """What a measurement of this file leaves out or reads otherwise than asked (one
        warning line each): GGUF block types that cannot be dequantized."""
        return []

    def source_files(self) -> list[Path]:
        """Every file this reader takes data from (checked for changes during a clip)."""
        return [self.path]

    def source_identities(self) -> dict[Path, FileIdentity]:
        """Each of source_files() with the identity of the file the reader really opened:
        fstat of its own descriptor, taken at the open. The input guard compares the names
        with these, so a file renamed over IN after the open (while the old one is still
        read) is caught; an identity taken by name later would watch the newcomer. A
        reader that cannot say fails loudly rather than leave its files unwatched."""
        raise NotImplementedError(f"{type(self).__name__} records no source identities")

    def joined_metadata(self) -> dict[str, str]:
        """The metadata for one file that holds every tensor (a directory's shards joined
        keep their own metadata, not the index's)."""
        return dict(self.metadata)

    def descriptions(self) -> frozenset[str]:
        """The keys of `metadata` that are the reader's own description of this file (its
        layout, version, byte order, ties: shown by `ls`), not metadata the file holds:
        no writer carries them and `diff` does not compare them."""
        return frozenset()

    def close(self) -> None:  # noqa: B027 - optional hook
        pass

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class FastReading:
    """Optional: faster ways to the same values (random access for worker threads, many
    small tensors in one read, a constant tensor without its data, a kernel copy of the
    stored bytes)."""

    def chunk_loaders(
        self,
        info: TensorInfo,  # noqa: ARG002 - default of an interface method
    ) -> Iterator[Callable[[], np.ndarray]] | None:
        """Thread-safe loaders of the same pieces as `chunks`, for readers with random access
        (so that worker threads read in parallel); None when reading must be sequential."""
        return None

    def loader_of_many(
        self,
        infos: Sequence[TensorInfo],  # noqa: ARG002 - default of an interface method
    ) -> Callable[[], list[np.ndarray]] | None:
        """A thread-safe loader of several whole tensors at once, each flat, in the order
        given, for a reader that reads them in one go (small tensors stored near each other
        in one file: one read instead of one per tensor); None where it cannot, and the
        caller reads them one by one. Asked for small tensors only (a few MiB in all)."""
        return None

    def elements_loader(
        self,
        info: TensorInfo,  # noqa: ARG002 - default of an interface method
        start: int,  # noqa: ARG002
        stop: int,  # noqa: ARG002
    ) -> Callable[[], np.ndarray] | None:
        """A thread-safe loader of the tensor's elements [start, stop) in C order, flat
        (0 <= start <= stop <= numel), for readers with random access; None where reading
        must be sequential. --axes reads just the boxes that hold one long slice with it."""
        return None

    def measured_loaders(
        self,
        info: TensorInfo,  # noqa: ARG002 - default of an interface method
    ) -> Iterator[Callable[[], NormAccumulator]] | None:
        """Thread-safe loaders of the statistics of the tensor's pieces, measured without
        making its values (clipcli.logical: a quantized weight through per-block tables);
        None (stored readers): measuring reads chunks."""
        return None

    def constant(self, info: TensorInfo) -> np.ndarray | None:  # noqa: ARG002 - interface
        """The one value every element of the tensor holds, when the format says so without
        reading them (an unallocated HDF5 dataset: its fill value), as a 0-d array of the
        tensor's dtype; None otherwise. Measuring then needs no data."""
        return None

    def expect_all_elements(self) -> None:
        """Every element of every tensor is about to be made (written to a format that
        holds no fill values): a reader whose budgets left constant tensors out (see
        `constant`) charges them now, refusing before anything is written."""
        return None  # the default: every element was counted at opening

    def stored_bytes(self, info: TensorInfo) -> StoredBytes | None:  # noqa: ARG002 - interface
        """Where the tensor's bytes lie as safetensors stores them, for a kernel copy;
        None when they are not stored so."""
        return None


class HoldsStructure:
    """Optional: what a file holds beyond its tensors (HDF5 groups and attributes, the
    other members of a .keras archive), and whether its tensors were compressed."""

    def structure(self) -> Structure | None:
        """The file's structure beyond its tensors (HDF5 groups, attributes, non-tensor
        datasets), carried through conversions; None when the format has none."""
        return None

    @property
    def non_tensors(self) -> list[NonTensorInfo]:
        """Stored objects that are not tensors, in file order (HDF5 only, so far)."""
        return []

    def archive_members(self) -> dict[str, str]:
        """Members of a container that only a writer of the same format keeps (a .keras
        archive's config.json, metadata.json, assets), each with a summary of its content
        (size and CRC) for `diff`; empty for formats that are one file of tensors."""
        return {}

    @property
    def compressed(self) -> bool:
        """Whether the tensors were stored compressed (a copy should be too)."""
        return False


class ModelDirectoryLayout:
    """Optional: a Hugging Face model directory (shards, an index, side files)."""

    @property
    def model_directory(self) -> Path | None:
        """The Hugging Face model directory being read, where a config.json may live."""
        return None

    def directory_layout(self) -> DirectoryLayout | None:
        """The model directory's layout, for an output directory like it; None for a file."""
        return None

    def side_files(self) -> list[Path]:
        """Files that are not tensors but belong with them in an output directory."""
        return []

    def side_files_linked_elsewhere(self) -> list[tuple[Path, int]]:
        """Side files that are hard links with a name outside the directory read, each
        with its link count (never copied: their content could be any file)."""
        return []

    def left_out_entries(self) -> list[tuple[str, str]]:
        """(relative path, why) of each entry a copy of the directory leaves out."""
        return []

    def shard_of(self, name: str) -> str | None:  # noqa: ARG002 - interface
        """The file of a model directory that holds the tensor, None for one file."""
        return None

    def join_losses(self) -> list[str]:
        """What joining into one file drops of the metadata (a model directory's index
        metadata and the __metadata__ its shards do not share); empty for a file."""
        return []


class Reader(ReaderCore, FastReading, HoldsStructure, ModelDirectoryLayout):
    """A format's reader: the core, plus every optional capability's default (a new
    format overrides only what it has)."""


class Writer(ABC):
    format_name: ClassVar[str]

    def __init__(self, path: Path, checkpoint: Checkpoint, durable: bool = False) -> None:
        self.path = path
        self.checkpoint = checkpoint
        # The caller will fsync the file: writers that can start writeback early should.
        self.durable = durable

    @classmethod
    def check_dtype(cls, info: TensorInfo) -> str | None:  # noqa: ARG003 - interface default
        """Why this format cannot hold the tensor's dtype, or None if it can."""
        return None

    @classmethod
    def check_shape(cls, info: TensorInfo) -> str | None:
        """Why this format, or its official reader, cannot hold a tensor of this shape
        (rank, dimensions, size), or None. By default numpy's limits, which every reader
        keeps: a format that holds less says so."""
        return numpy_shape_problem(info.shape)

    def check_tensors(self, infos: Iterable[TensorInfo]) -> None:
        """The writers' own guard (callers check first, naming OUT: api.check_writable)."""
        for _, reason in self.tensor_problems(infos, names=False):
            raise ValueError(reason)

    @classmethod
    def tensor_problems(
        cls, infos: Iterable[TensorInfo], names: bool = True
    ) -> Iterator[tuple[TensorInfo, str]]:
        """Each tensor this format cannot hold, with why: its name (if `names`), its dtype
        or its shape. The dtype and shape checks are asked once per (dtype, shape): a
        checkpoint of 200,000 tensors has a few dozen of them."""
        verdicts: dict[tuple[Any, tuple[int, ...]], str | None] = {}
        for info in infos:
            reason = cls.check_name(info.name) if names else None
            if reason is None:
                key = (info.dtype, info.shape)
                if key not in verdicts:
                    verdicts[key] = cls.check_dtype(info) or cls.check_shape(info)
                reason = verdicts[key]
            if reason is not None:
                yield info, reason

    @classmethod
    def check_name(cls, name: str) -> str | None:
        """Why this format cannot store a tensor under this name, or None if it can."""
        if not name or "\x00" in name:
            return "an empty name or a NUL byte cannot be stored"
        if not utf8_encodable(name):
            return "a name with a lone surrogate (not valid UTF-8) cannot be stored"
        return None

    @classmethod
    def check_names(cls, names: Sequence[str]) -> str | None:  # noqa: ARG003 - interface
        """Why this format cannot store these names together (a clash), or None if it can."""
        return None

    @classmethod
    def check_metadata(
        cls,
        metadata: Mapping[str, str],  # noqa: ARG003 - default of an interface method
        source: Reader,  # noqa: ARG003 - default of an interface method
    ) -> str | None:
        """Why this format cannot store this metadata (copied from `source`), or None."""
        return None

    @classmethod
    def output_names(cls, source: Reader) -> frozenset[str]:  # noqa: ARG003 - interface
        """Every path (relative) this writer creates in an output directory for `source`;
        empty for a writer of one file."""
        return frozenset()

    @classmethod
    def structure_losses(cls, source: Reader) -> list[str]:
        """What of the source's structure this format would drop (refused unless the user
        accepts the loss). By default a format keeps no structure: everything beyond the
        tensors and file metadata that the source holds is lost."""
        structure = source.structure()
        if structure is None:
            return []
        try:
            # Root string attributes travel as file metadata, which the writer keeps or
            # reports on its own (check_metadata, npz's own losses).
            trivial = structure.is_trivial(root_attributes_ok=source.metadata)
            storage = structure.storage_settings()
        except InputError:
            if structure.origin is not None:
                raise
            # A record in another format's metadata that is not a valid one: only the
            # HDF5 writer reads it (and refuses it); here it is a metadata key like others.
            return []
        losses = [] if trivial else [f"the HDF5 structure ({structure.summary()})"]
        if storage:
            shown = "; ".join(f"{path!r}: {text}" for path, text in list(storage.items())[:3])
            more = f"; and {len(storage) - 3} more" if len(storage) > 3 else ""
            losses.append(f"the storage settings of {len(storage)} datasets ({shown}{more})")
        return losses

    @classmethod
    def copies_constants(cls, source: Reader) -> bool:  # noqa: ARG003 - interface
        """True when an unchanged constant tensor of `source` (Reader.constant) is written
        without its elements being made (HDF5 to HDF5: unallocated, with its fill value)."""
        return False

    @classmethod
    def structure_notes(cls, source: Reader) -> list[str]:  # noqa: ARG003 - interface
        """What this format writes otherwise than the source stores it, no value changed
        (one note line each): e.g. without a lossy HDF5 filter."""
        return []

    @abstractmethod
    def write(self, info: TensorInfo, chunks: Iterable[np.ndarray]) -> None:
        """Write the next tensor (in checkpoint order) from flat C-order chunks."""

    def write_many(self, infos: Sequence[TensorInfo], arrays: Sequence[np.ndarray]) -> None:
        """Write the next tensors (in checkpoint order), each whole, as one flat array:
        small tensors, handed over together. A writer that can write them in one go
        should (one write instead of one per tensor)."""
        for info, array in zip(infos, arrays, strict=True):
            self.write(info, [array])

    def copy_unchanged_many(
        self,
        source: Reader,  # noqa: ARG002 - default of an interface method
        infos: Sequence[TensorInfo],  # noqa: ARG002 - default of an interface method
    ) -> bool:
        """copy_unchanged for the next tensors together (small ones, stored one after
        another): one copy instead of one per tensor. False: the caller writes them."""
        return False

    def copy_unchanged(
        self,
        source: Reader,  # noqa: ARG002 - default of an interface method
        info: TensorInfo,  # noqa: ARG002 - default of an interface method
    ) -> bool:
        """Write the next tensor straight from `source` if this format can do it faster
        than chunk by chunk (e.g. a kernel copy); False means the caller streams it."""
        return False

    def copy_ahead(self, source: Reader, info: TensorInfo) -> None:  # noqa: B027 - optional
        """A hint, given while tensors are still being measured, that `info` will probably
        be unchanged: a writer that knows where it goes may start copying it now, in the
        background. write() or copy_unchanged() for it must still follow, in order."""

    def parts(self) -> list[list[TensorInfo]] | None:
        """The tensors, in checkpoint order, cut into parts that go to separate files (a
        model directory's shards), each written by part_writer() apart from the others and
        in any order relative to them; None where the output is one stream."""
        return None

    def part_writer(self, number: int) -> Writer:
        """The writer of part `number` of parts(): its tensors in order, then close_part."""
        raise NotImplementedError(f"{type(self).__name__} has no parts")

    def close_part(self, number: int) -> None:
        """Finish part `number`; close() follows once every part is finished."""
        raise NotImplementedError(f"{type(self).__name__} has no parts")

    @abstractmethod
    def close(self) -> None:
        """Finish the file. Called only when every tensor was written."""

    def abort(self) -> None:  # noqa: B027 - optional hook
        """Release handles after a failure; the caller deletes the file."""


WRITEBACK_STEP = 64 << 20


class WritebackStarter:
    """Has the kernel start writing a file's dirty pages every WRITEBACK_STEP bytes.

    sync_file_range(SYNC_FILE_RANGE_WRITE) only queues the writes and returns, so the disk
    works while we compute and the final fsync waits for the tail alone, instead of for
    the whole file. Linux only; elsewhere it does nothing.
    """

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._started = 0
        self._call: Callable[..., int] | None = None
        try:
            import ctypes

            call = ctypes.CDLL(None, use_errno=True).sync_file_range
            call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
            self._call = call
        except (OSError, AttributeError):
            pass

    def due(self, written_to: int) -> bool:
        return self._call is not None and written_to - self._started >= WRITEBACK_STEP

    def advance(self, written_to: int) -> None:
        """Start writeback of everything written since the last call, once a step is due."""
        if not self.due(written_to):
            return
        self.start(self._started, written_to - self._started)
        self._started = written_to

    def start(self, offset: int, length: int) -> None:
        """Start writeback of one range now (e.g. one written out of order)."""
        if self._call is not None and length > 0:
            self._call(self._fd, offset, length, 2)  # SYNC_FILE_RANGE_WRITE


NUMPY_MAX_BYTES = 2**63 - 1  # np.intp
# numpy's NPY_MAXDIMS (numpy 2): np.empty((1,) * 65), np.load and safe_open(framework="np")
# refuse more dimensions. Every reader refuses them, so no shape past it reaches a writer.
NUMPY_MAX_RANK = 64


def rank_problem(rank: int, limit: int = NUMPY_MAX_RANK, holder: str = "numpy") -> str | None:
    """Why a shape of `rank` dimensions is too many for `holder`, or None."""
    if rank > limit:
        return f"shape has {rank} dimensions; {holder} holds at most {limit}"
    return None


def numpy_shape_problem(shape: Sequence[int]) -> str | None:
    """What no numpy array could have, whatever its dtype: more dimensions than numpy holds,
    or a dimension past np.intp (also beside a 0, where the array would hold nothing). The
    rank is judged before any dimension, so a shape of millions is never looked through
    (or printed)."""
    if (problem := rank_problem(len(shape))) is not None:
        return problem
    for dim in shape:
        if dim > NUMPY_MAX_BYTES:
            return f"dimension {dim} of shape {list(shape)} is past numpy's limit (2**63 - 1)"
    return None


def numpy_size_overflows(shape: Sequence[int], itemsize: int) -> bool:
    """numpy's rule for making an array (np.load, h5py's reads): the itemsize times every
    dimension, a 0 counted as 1, must fit in np.intp; so (2**32, 2**32, 0) is refused,
    not an empty array. Measured with numpy 2: (2**62, 2, 0) of int8 is refused."""
    return max(itemsize, 1) * math.prod(max(int(d), 1) for d in shape) > NUMPY_MAX_BYTES


def utf8_encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def archive_losses(source: Reader, writer_format: str) -> list[str]:
    """The source container's other members, lost in any other format than its own."""
    members = list(source.archive_members())
    if not members or writer_format == source.format_name:
        return []
    shown = ", ".join(repr(name) for name in members[:5])
    more = f" and {len(members) - 5} more" if len(members) > 5 else ""
    return [
        f"the {source.format_name} archive's other members ({shown}{more}); "
        f"only a .{source.format_name} OUT keeps them"
    ]
