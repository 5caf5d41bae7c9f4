"""HDF5 through h5py: a reader that refuses anything pointing outside the file, and a writer
that replicates the source file's groups, attributes and dataset storage settings.

h5py follows soft links, external links, external storage and virtual datasets silently;
that is how CVE-2026-1669 leaked local files through Keras. The reader therefore classifies
every link before touching its target and inspects every dataset's storage before any data
is read. Anything it cannot vouch for is an InputError naming the object.

Decisions worth knowing:
- Objects are listed in the file's own link order (creation order when a group tracks it,
  else name order), depth first, so tensor order is deterministic.
- An object reachable by two hard links is refused (it would be one tensor under two names,
  and a group linked into itself would make the walk endless).
- Declared vs stored size: a dataset declaring more than MAX_DECLARED_BYTES (1 TiB) is
  refused outright; one declaring more than SPARSE_CHECK_BYTES (64 MiB) is refused when
  that is over MAX_EXPANSION (200) times its allocated storage, the npz zip-bomb rule.
  Contiguous data must lie inside the file. Groups may nest at most MAX_DEPTH (64) deep.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from clipcli.dtypes import from_ml_dtypes, is_numeric
from clipcli.errors import InputError, WriteError
from clipcli.formats.base import (
    Checkpoint,
    Reader,
    TensorInfo,
    Writer,
    default_chunk_elems,
    utf8_encodable,
)
from clipcli.inputs import fd_path, open_input_fd

MAX_DECLARED_BYTES = 1 << 40  # 1 TiB: no checkpoint tensor is this large
# The npz reader's zip-bomb rule, for the same reason: real tensors compress ~1.1:1, so a
# dataset inflating more than 200-fold to more than 64 MiB is almost surely a bomb (gzip of
# zeros reaches ~1000:1 and would take minutes to decode).
SPARSE_CHECK_BYTES = 64 << 20
MAX_EXPANSION = 200
MAX_DEPTH = 64  # real checkpoints nest a handful of groups; thousands is an attack
# HDF5 decodes a whole chunk to read any part of it (h5py's automatic chunks are <= 1 MiB).
MAX_CHUNK_BYTES = 256 << 20
# Variable-length attribute data (strings) read in all: Keras' names take kilobytes.
MAX_ATTRIBUTE_BYTES = 64 << 20


def expansion_budget(file_size: int) -> int:
    """The most bytes all datasets of a file of this size may declare together: the npz
    rule (200 times the file, plus 64 MiB so that small all-zero files still read)."""
    return MAX_EXPANSION * file_size + SPARSE_CHECK_BYTES


# One raw-data chunk cache per open dataset (we keep at most a couple open at a time).
# Large enough to hold a row of HDF5 chunks while we stream C-order pieces through them,
# so each compressed chunk is decoded (or encoded) once rather than once per piece.
CHUNK_CACHE_BYTES = 64 << 20
HEAP_SCAN_WINDOW = 16 << 20  # global-heap search: bytes read at a time
CHUNK_CACHE_SLOTS = 12_401  # a prime, as HDF5 recommends, ~100x the chunks that fit
CHUNK_CACHE_W0 = 1.0  # evict fully read/written chunks first: we never revisit them

# What h5py raises for malformed or unsupported content (UnicodeDecodeError is a ValueError).
_H5PY_ERRORS = (OSError, ValueError, TypeError, KeyError, RuntimeError)

NodeKind = Literal["group", "dataset", "datatype"]


@functools.cache
def _h5py() -> Any:
    """Import h5py on first use, with HDF5 filter plugins disabled.

    A plugin directory named by the environment (HDF5_PLUGIN_PATH) is code that HDF5
    dlopen()s when a file asks for a filter it does not know. The file comes from a
    stranger, so that is arbitrary code execution on their say-so. HDF5 reads
    HDF5_PLUGIN_PRELOAD once, when the library initialises at import; "::" is its
    documented value for "load no plugins". In case h5py was imported before this
    function ran, we also empty the plugin search path, which has the same effect.
    """
    os.environ.setdefault("HDF5_PLUGIN_PRELOAD", "::")
    import h5py
    import h5py.h5pl

    while h5py.h5pl.size() > 0:
        h5py.h5pl.remove(0)
    return h5py


def _reason(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


@contextlib.contextmanager
def _input_errors(path: Path, doing: str, tensor: str | None = None) -> Iterator[None]:
    """Turn h5py's exceptions into an InputError that says what we were doing."""
    try:
        yield
    except _H5PY_ERRORS as exc:
        raise InputError(path, f"{doing}: {_reason(exc)}", tensor) from None


# ---------------------------------------------------------------------------------------
# Flat C-order ranges as rectangular hyperslabs


def flat_range_blocks(shape: Sequence[int], start: int, stop: int) -> Iterator[tuple[slice, ...]]:
    """Rectangular blocks that together cover the flat C-order range [start, stop), in order.

    Every block has one slice per dimension (slice(i, i + 1) for a single index), so reading
    each block and ravelling it gives consecutive pieces of the range. A range needs at most
    2 * rank - 1 blocks (one for rank 0): a partial head row per dimension, one block of whole
    rows, and a partial tail row per dimension.
    """
    shape = tuple(shape)
    numel = math.prod(shape)
    if not 0 <= start <= stop <= numel:
        raise ValueError(f"range [{start}, {stop}) is not inside a tensor of {numel} elements")
    return _range_blocks(shape, start, stop)


def _range_blocks(shape: tuple[int, ...], start: int, stop: int) -> Iterator[tuple[slice, ...]]:
    if start == stop:
        return
    if not shape:
        yield ()
        return
    row_size = math.prod(shape[1:])  # > 0, since the range is not empty
    first_row, head = divmod(start, row_size)
    last_row, tail = divmod(stop, row_size)
    if first_row == last_row:  # the range lies inside one row
        for inner in _range_blocks(shape[1:], head, tail):
            yield (slice(first_row, first_row + 1), *inner)
        return
    if head:  # finish the partly covered first row
        for inner in _range_blocks(shape[1:], head, row_size):
            yield (slice(first_row, first_row + 1), *inner)
        first_row += 1
    if first_row < last_row:  # whole rows
        yield (slice(first_row, last_row), *(slice(0, dim) for dim in shape[1:]))
    if tail:  # start of the partly covered last row
        for inner in _range_blocks(shape[1:], 0, tail):
            yield (slice(last_row, last_row + 1), *inner)


def _aligned_step(shape: tuple[int, ...], chunk_elems: int) -> int:
    """The largest multiple of prod(shape[k:]) that is <= chunk_elems, for the smallest k
    whose trailing slab fits: pieces then start on slab boundaries and most are one block.
    Needs every dimension >= 1."""
    slab = 1
    for dim in reversed(shape):
        if slab * dim > chunk_elems:
            break
        slab *= dim
    return chunk_elems // slab * slab


def _block_shape(block: tuple[slice, ...]) -> tuple[int, ...]:
    return tuple(part.stop - part.start for part in block)


# ---------------------------------------------------------------------------------------
# Reader


@dataclass(frozen=True)
class Hdf5Node:
    """One object of the source file, for the writer to replicate. path is absolute."""

    path: str
    kind: NodeKind


def _join(parent: str, name: str) -> str:
    return f"/{name}" if parent == "/" else f"{parent}/{name}"


def _object_key(obj: Any) -> tuple[int, int]:
    """Identity of an HDF5 object: the same for every hard link that reaches it."""
    info = _h5py().h5o.get_info(obj.id)
    return (int(info.fileno), int(info.addr))


def _unsupported_dtype(dtype: np.dtype[Any]) -> str | None:
    """What kind of non-tensor dtype this is, or None for a numeric one."""
    h5py = _h5py()
    string = h5py.check_string_dtype(dtype)
    if string is not None:
        kind = "variable-length" if string.length is None else "fixed-length"
        return f"a {kind} string dtype"
    if h5py.check_ref_dtype(dtype) is not None:
        return "a reference dtype"
    if h5py.check_vlen_dtype(dtype) is not None:
        return "a variable-length dtype"
    if h5py.check_enum_dtype(dtype) is not None:  # h5py reports bool without enum metadata
        return "an enum dtype"
    if dtype.fields is not None:
        return f"a compound dtype ({len(dtype.fields)} fields)"
    if dtype.subdtype is not None:
        return f"an array dtype ({dtype})"
    if dtype.kind == "V" and not is_numeric(dtype):
        return "an opaque dtype"
    if not is_numeric(dtype):
        return f"dtype {dtype}"
    return None


def _utf8_text(value: object) -> str | None:
    """value as a str if it is text that round-trips through UTF-8, else None."""
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            return None
    if isinstance(value, str):
        try:
            value.encode("utf-8")  # h5py smuggles invalid bytes in as lone surrogates
        except UnicodeEncodeError:
            return None
        return value
    return None


class Hdf5Reader(Reader):
    """Opens read-only and validates the whole file up front, reading no tensor data.

    For the writer it exposes `file` (the h5py.File), `nodes` (every group, dataset and named
    datatype in walk order) and `dataset(name)`.
    """

    format_name = "hdf5"

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        h5py = _h5py()
        # Our own descriptor, opened without blocking and checked to be a regular file;
        # the library then opens that very file through /proc/self/fd, so a name swapped
        # for a FIFO or another file after the check is never what HDF5 reads.
        self._fd = open_input_fd(path)
        try:
            self._open_file(h5py, fd_path(self._fd) or os.fspath(path))
        except BaseException:
            os.close(self._fd)
            raise
        try:
            self._file_size = os.fstat(self._fd).st_size
            self._data_ranges: list[tuple[int, int]] = []
            self._unallocated: set[str] = set()  # datasets with no storage: all fill value
            with _input_errors(path, "cannot read the file's structure"):
                self.nodes, self._infos = self._walk()
            # Walking reads no attribute values, so no global heap has been touched yet.
            self._check_expansion()
            largest_object = _check_global_heaps(path, self._fd, self._file_size, self._data_ranges)
            with _input_errors(path, "cannot inspect attributes"):
                self._check_attribute_budget(largest_object)
            self._metadata = self._read_metadata()
        except BaseException:
            self.close()
            raise
        self._by_name = {info.name: info for info in self._infos}

    def _open_file(self, h5py: Any, name: str) -> None:
        # Lock where the filesystem can, but do not fail where it cannot (NFS, Lustre).
        locking = "best-effort" if h5py.version.hdf5_version_tuple >= (1, 12, 1) else None
        with _input_errors(self.path, "cannot open as HDF5"):
            self.file: Any = h5py.File(
                name,
                "r",
                locking=locking,
                rdcc_nbytes=CHUNK_CACHE_BYTES,
                rdcc_nslots=CHUNK_CACHE_SLOTS,
                rdcc_w0=CHUNK_CACHE_W0,
            )

    @property
    def infos(self) -> list[TensorInfo]:
        return self._infos

    @property
    def metadata(self) -> Mapping[str, str]:
        return self._metadata

    def _fail(self, problem: str, tensor: str | None = None) -> InputError:
        return InputError(self.path, problem, tensor)

    # -- structure ------------------------------------------------------------------------

    def _walk(self) -> tuple[list[Hdf5Node], list[TensorInfo]]:
        """Every object reachable by hard links, depth first in link order."""
        h5py = _h5py()
        root = self.file["/"]
        nodes = [Hdf5Node("/", "group")]
        infos: list[TensorInfo] = []
        first_path = {_object_key(root): "/"}
        # An explicit stack: a hostile file may nest groups deeper than Python recursion.
        stack: list[tuple[str, Any, Iterator[Any]]] = [("/", root, self._member_names(root, "/"))]
        while stack:
            parent_path, group, names = stack[-1]
            name = next(names, None)
            if name is None:
                stack.pop()
                continue
            path = _join(parent_path, name)
            obj = self._open_hard_link(group, name, path)
            with _input_errors(self.path, f"cannot inspect object {path!r}"):
                key = _object_key(obj)
            if key in first_path:
                raise self._fail(
                    f"object {path!r} is a second hard link to {first_path[key]!r}; "
                    "objects linked more than once are refused"
                )
            first_path[key] = path
            if isinstance(obj, h5py.Group):
                if len(stack) >= MAX_DEPTH:
                    raise self._fail(
                        f"groups nest deeper than {MAX_DEPTH} levels at {path[:80]!r}…"
                    )
                nodes.append(Hdf5Node(path, "group"))
                stack.append((path, obj, self._member_names(obj, path)))
            elif isinstance(obj, h5py.Dataset):
                nodes.append(Hdf5Node(path, "dataset"))
                infos.append(self._check_dataset(obj, path))
            elif isinstance(obj, h5py.Datatype):
                nodes.append(Hdf5Node(path, "datatype"))
            else:
                raise self._fail(f"object {path!r} is of an unknown HDF5 object type")
        return nodes, infos

    def _member_names(self, group: Any, path: str) -> Iterator[str]:
        """The group's link names in its own order (h5py uses creation order if tracked)."""
        with _input_errors(self.path, f"cannot list group {path!r}"):
            names = list(group)
        for name in names:
            if not isinstance(name, str):  # h5py hands back undecodable names as bytes
                raise self._fail(f"group {path!r} has a link name that is not UTF-8: {name!r}")
        return iter(names)

    def _open_hard_link(self, group: Any, name: str, path: str) -> Any:
        """The object behind a hard link; any other kind of link is refused unfollowed."""
        h5py = _h5py()
        with _input_errors(self.path, f"cannot read the link {path!r}"):
            link = group.get(name, getlink=True)
        if isinstance(link, h5py.SoftLink):
            raise self._fail(
                f"object {path!r} is a soft link to {link.path!r}; links are not followed"
            )
        if isinstance(link, h5py.ExternalLink):
            raise self._fail(
                f"object {path!r} is an external link to {link.path!r} in file "
                f"{link.filename!r}; links to other files are not followed"
            )
        if not isinstance(link, h5py.HardLink):
            raise self._fail(f"object {path!r} is a link of an unsupported kind")
        with _input_errors(self.path, f"cannot open object {path!r}"):
            return group[name]

    # -- datasets -------------------------------------------------------------------------

    def _check_dataset(self, dataset: Any, path: str) -> TensorInfo:
        """Refuse anything that reads outside the file or is not a bounded numeric tensor."""
        name = path[1:]
        with _input_errors(self.path, "cannot inspect dataset", name):
            if dataset.is_virtual:
                raise self._fail(
                    "is a virtual dataset (its data comes from other datasets or files); "
                    "not followed",
                    name,
                )
            external = dataset.external
            if external:
                raise self._fail(
                    f"uses external storage in file {external[0][0]!r}; not followed", name
                )
            dtype = self._dataset_dtype(dataset, name)
            if dataset.shape is None:
                raise self._fail("has an empty (null) dataspace, so it holds no tensor", name)
            shape = tuple(int(dim) for dim in dataset.shape)
            info = TensorInfo(name, dtype, shape, math.prod(shape) * dtype.itemsize)
            create_plist = dataset.id.get_create_plist()
            self._check_filters(create_plist, name)
            self._check_storage(dataset, create_plist, info)
        return info

    def _dataset_dtype(self, dataset: Any, name: str) -> np.dtype[Any]:
        try:
            dtype: np.dtype[Any] = dataset.dtype
        except TypeError as exc:  # e.g. HDF5 types with no NumPy counterpart
            raise self._fail(f"has an HDF5 type h5py cannot represent ({exc})", name) from None
        if dtype.kind in "fc":
            self._check_float_layout(dataset.id.get_type(), dtype, name)
        problem = _unsupported_dtype(dtype)
        if problem is not None:
            raise self._fail(f"has {problem}; only numeric tensors are supported", name)
        return dtype

    def _check_float_layout(self, type_id: Any, dtype: np.dtype[Any], name: str) -> None:
        """An HDF5 float type describes its bits (offset, precision, sign, exponent and
        mantissa fields); h5py maps it to a NumPy dtype by size alone. Fields that are not
        the standard IEEE layout of that size (a fuzzed file: bit offset 0xEA00 in a 32-bit
        float) make the library's conversion read and write out of bounds. Refuse them."""
        h5t = _h5py().h5t
        if isinstance(type_id, h5t.TypeCompoundID):  # complex: check each member
            for index in range(type_id.get_nmembers()):
                member = type_id.get_member_type(index)
                self._check_float_layout(member, np.dtype(f"f{member.get_size()}"), name)
            return
        if not isinstance(type_id, h5t.TypeFloatID):
            return
        standard = h5t.py_create(np.dtype(f"<f{type_id.get_size()}"))
        layout = (type_id.get_offset(), type_id.get_precision(), type_id.get_fields())
        expected = (standard.get_offset(), standard.get_precision(), standard.get_fields())
        if layout != expected:
            raise self._fail(
                f"has a {dtype.itemsize}-byte float type with a non-standard bit layout "
                f"(offset, precision, fields {layout}); malformed or not IEEE",
                name,
            )

    def _check_filters(self, create_plist: Any, name: str) -> None:
        h5z = _h5py().h5z
        for index in range(create_plist.get_nfilters()):
            code = create_plist.get_filter(index)[0]
            if not h5z.filter_avail(code):
                raise self._fail(f"uses unavailable HDF5 filter {code}", name)

    def _check_storage(self, dataset: Any, create_plist: Any, info: TensorInfo) -> None:
        declared = info.nbytes
        if declared > MAX_DECLARED_BYTES:
            raise self._fail(
                f"declares {declared} bytes, over the {MAX_DECLARED_BYTES}-byte (1 TiB) limit",
                info.name,
            )
        stored = int(dataset.id.get_storage_size())
        if stored == 0 and declared:
            self._unallocated.add(info.name)
        if declared > SPARSE_CHECK_BYTES and declared > MAX_EXPANSION * stored:
            raise self._fail(
                f"declares {declared} bytes but stores only {stored}; refusing to expand "
                f"data more than {MAX_EXPANSION}-fold",
                info.name,
            )
        if create_plist.get_layout() == _h5py().h5d.CONTIGUOUS:
            offset = dataset.id.get_offset()  # None while no storage is allocated
            if offset is not None and offset + stored > self._file_size:
                raise self._fail(
                    f"data at bytes [{offset}, {offset + stored}) runs past the end of the "
                    f"{self._file_size}-byte file",
                    info.name,
                )
            if offset is not None:
                self._data_ranges.append((offset, offset + stored))
        if create_plist.get_layout() == _h5py().h5d.CHUNKED:
            # The library decodes a whole chunk to read any element of it: memory per read
            # is one chunk, whatever our 2 MiB pieces ask for.
            chunk_bytes = math.prod(create_plist.get_chunk()) * info.dtype.itemsize
            if chunk_bytes > MAX_CHUNK_BYTES:
                raise self._fail(
                    f"HDF5 chunks of {chunk_bytes} bytes exceed the {MAX_CHUNK_BYTES >> 20} MiB "
                    "limit (each read decodes a whole chunk in memory)",
                    info.name,
                )
        if create_plist.get_layout() == _h5py().h5d.CHUNKED and hasattr(
            dataset.id, "chunk_iter"
        ):  # HDF5 >= 1.14: one pass over the chunk index; older ones scan the chunks too
            chunks: list[tuple[int, int]] = []
            dataset.id.chunk_iter(lambda chunk: chunks.append((chunk.byte_offset, chunk.size)))
            for offset, size in chunks:
                # A stored chunk of 0 bytes, or one past the end, makes the library's
                # filters read nothing or garbage: fletcher32 on an empty chunk segfaults.
                if size <= 0 or offset + size > self._file_size:
                    raise self._fail(
                        f"a stored chunk at byte {offset} of {size} bytes is empty or runs "
                        f"past the end of the {self._file_size}-byte file",
                        info.name,
                    )
                self._data_ranges.append((offset, offset + size))
        if create_plist.get_layout() == _h5py().h5d.CONTIGUOUS:
            maxshape = dataset.maxshape
            if maxshape is not None and tuple(maxshape) != info.shape:
                raise self._fail(
                    f"is contiguous but declares a maximum shape {tuple(maxshape)} other than "
                    f"its shape {info.shape}, which HDF5 does not allow (malformed)",
                    info.name,
                )

    def _check_expansion(self) -> None:
        """The whole file's budget: every dataset, allocated or not, is produced in full by
        the library when read (an unallocated one as fill value), so the declared bytes of
        all datasets together may be at most expansion_budget(file size). Per-dataset rules
        alone let 10,000 datasets of 64 MiB each through from a 3 MB file."""
        total = sum(info.nbytes for info in self._infos)
        budget = expansion_budget(self._file_size)
        if total > budget:
            raise self._fail(
                f"datasets declare {total} bytes in all, more than {MAX_EXPANSION} times the "
                f"{self._file_size}-byte file plus {SPARSE_CHECK_BYTES >> 20} MiB ({budget}); "
                "refusing to expand it"
            )

    def _check_attribute_budget(self, largest_heap_object: int) -> None:
        """Variable-length attribute values live in global heap objects, and any number of
        elements may point at the same object: 1,500 strings naming one 1 MiB object read
        as 1.5 GB. Reading an attribute reads all its elements at once, so the bound is
        taken before any is read: elements x the largest heap object in the file."""
        elements = 0
        for node in self.nodes:
            obj = self.file[node.path]
            for name in obj.attrs:
                attr = obj.attrs.get_id(name)
                if _holds_vlen(attr.get_type()):
                    elements += max(1, int(attr.get_space().get_simple_extent_npoints()))
        worst = elements * largest_heap_object
        if worst > MAX_ATTRIBUTE_BYTES:
            raise self._fail(
                f"{elements} variable-length attribute values may each read a heap object of "
                f"{largest_heap_object} bytes ({worst} in all, over the "
                f"{MAX_ATTRIBUTE_BYTES >> 20} MiB limit for attributes); refusing it"
            )

    def is_unallocated(self, name: str) -> bool:
        """True when the dataset has no storage at all: every element is its fill value."""
        return name in self._unallocated

    # -- metadata -------------------------------------------------------------------------

    def _read_metadata(self) -> dict[str, str]:
        """Root attributes that hold one string (str, or bytes that are UTF-8)."""
        h5py = _h5py()
        attrs = self.file.attrs
        metadata: dict[str, str] = {}
        with _input_errors(self.path, "cannot read root attributes"):
            names = list(attrs)
            for name in names:
                if not isinstance(name, str):  # h5py gives names that are not UTF-8 as bytes
                    continue
                attr = attrs.get_id(name)
                try:
                    dtype = attr.dtype
                except TypeError:  # no NumPy counterpart: certainly not a string
                    continue
                if attr.shape != () or h5py.check_string_dtype(dtype) is None:
                    continue
                text = _utf8_text(attrs[name])
                if text is not None:
                    metadata[name] = text
        return metadata

    # -- data -----------------------------------------------------------------------------

    def dataset(self, name: str) -> Any:
        """The h5py Dataset of a tensor (its path was checked to be hard links only)."""
        if name not in self._by_name:
            raise KeyError(name)
        with _input_errors(self.path, "cannot open dataset", name):
            return self.file["/" + name]

    def chunks(self, info: TensorInfo, chunk_elems: int | None = None) -> Iterator[np.ndarray]:
        if chunk_elems is None:
            chunk_elems = default_chunk_elems(info.dtype)
        if chunk_elems < 1:
            raise ValueError(f"chunk_elems must be positive, got {chunk_elems}")
        if info.numel == 0:
            return
        dataset = self.dataset(info.name)
        step = _aligned_step(info.shape, chunk_elems)
        for start in range(0, info.numel, step):
            stop = min(start + step, info.numel)
            with _input_errors(self.path, f"cannot read elements [{start}, {stop})", info.name):
                piece = self._read_range(dataset, info, start, stop)
            yield piece

    @staticmethod
    def _read_range(dataset: Any, info: TensorInfo, start: int, stop: int) -> np.ndarray:
        """Elements [start, stop) in C order, each block read straight into its place in one
        array of the tensor's own dtype and byte order (no per-block copies to concatenate)."""
        out = np.empty(stop - start, dtype=info.dtype)
        offset = 0
        for block in flat_range_blocks(info.shape, start, stop):
            block_shape = _block_shape(block)
            count = math.prod(block_shape)
            target = out[offset : offset + count].reshape(block_shape)
            dataset.read_direct(target, source_sel=block or None)  # () is a scalar's whole
            offset += count
        return out

    def read(self, info: TensorInfo) -> np.ndarray:
        """The whole dataset in one HDF5 read (the fast path for small tensors)."""
        dataset = self.dataset(info.name)
        out = np.empty(info.shape, dtype=info.dtype)
        if out.size:
            with _input_errors(self.path, "cannot read data", info.name):
                dataset.read_direct(out)
        return out

    def close(self) -> None:
        try:
            self.file.close()
        finally:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


# ---------------------------------------------------------------------------------------
# Writer


def _holds_vlen(type_id: Any) -> bool:
    """True if an HDF5 type holds variable-length data (strings or sequences) anywhere."""
    h5t = _h5py().h5t
    kind = type_id.get_class()
    if kind == h5t.VLEN or (kind == h5t.STRING and type_id.is_variable_str()):
        return True
    if kind == h5t.COMPOUND:
        return any(_holds_vlen(type_id.get_member_type(i)) for i in range(type_id.get_nmembers()))
    if kind == h5t.ARRAY:
        return _holds_vlen(type_id.get_super())
    return False


def _holds_references(type_id: Any) -> bool:
    """True if an HDF5 type contains object or region references anywhere inside."""
    h5t = _h5py().h5t
    kind = type_id.get_class()
    if kind == h5t.REFERENCE:
        return True
    if kind == h5t.COMPOUND:
        return any(
            _holds_references(type_id.get_member_type(i)) for i in range(type_id.get_nmembers())
        )
    if kind in (h5t.ARRAY, h5t.VLEN):
        return _holds_references(type_id.get_super())
    return False


def _name_bytes(name: str | bytes) -> bytes:
    """h5py gives names as str, or as bytes when they are not UTF-8; HDF5 wants bytes."""
    return name if isinstance(name, bytes) else name.encode("utf-8")


def _split(path: str) -> tuple[str, str]:
    parent, _, name = path.rpartition("/")
    return parent or "/", name


HDF5_MAX_ATTRIBUTES = 65535  # attributes per object when creation order is tracked
HDF5_MAX_ATTRIBUTE_NAME_BYTES = 65534  # plus the terminating NUL: a 16-bit length


def _dataset_path_problem(name: str) -> str | None:
    """Why a tensor name cannot be used as an HDF5 dataset path, or None."""
    if name.startswith("/"):
        return "it starts with '/'"
    parts = name.split("/")
    if any(part == "" for part in parts):
        return "it has an empty path component"
    if any(part == "." for part in parts):
        return "it has a '.' path component"
    return None


@dataclass
class _AttributeCopy:
    """An attribute read from the source: its exact HDF5 type, dataspace and raw values."""

    name: bytes
    type_id: Any
    space: Any
    values: np.ndarray | None  # None for an empty (null) dataspace
    memory_type: Any


def _stored_chunk_offsets(dataset_id: Any) -> list[tuple[int, ...]]:
    """Where each allocated chunk of a chunked dataset starts."""
    offsets: list[tuple[int, ...]] = []
    if hasattr(dataset_id, "chunk_iter"):  # HDF5 >= 1.14: one pass over the chunk index
        dataset_id.chunk_iter(lambda chunk: offsets.append(chunk.chunk_offset))
    else:
        for index in range(dataset_id.get_num_chunks()):
            offsets.append(dataset_id.get_chunk_info(index).chunk_offset)
    return offsets


class Hdf5Writer(Writer):
    """Creates the whole skeleton (groups, datasets, attributes) in the constructor; write()
    then fills one dataset. With an Hdf5Reader as the source the skeleton is an exact copy of
    the source's; otherwise each tensor becomes a contiguous dataset at its name's path."""

    format_name = "hdf5"

    def __init__(self, path: Path, checkpoint: Checkpoint, durable: bool = False) -> None:
        super().__init__(path, checkpoint, durable)
        for info in checkpoint.infos:
            if (reason := self.check_dtype(info)) is not None:
                raise ValueError(reason)
        source = checkpoint.source
        self._source = source if isinstance(source, Hdf5Reader) else None
        self._written: set[str] = set()
        self.file: Any = self._create_file()
        try:
            if self._source is not None:
                self._copy_structure(self._source)
            else:
                self._create_plain_layout()
        except BaseException:
            self.file.close()
            raise

    @classmethod
    def check_name(cls, name: str) -> str | None:
        parts = name.split("/")
        if name.startswith("/") or "" in parts or "." in parts:
            return "an HDF5 dataset path needs non-empty components, no '.' and no leading '/'"
        return super().check_name(name)

    @classmethod
    def check_names(cls, names: Sequence[str]) -> str | None:
        # A path is a dataset or a group, not both: `a` and `a/b` cannot both be tensors.
        datasets = set(names)
        for name in names:
            parts = name.split("/")
            for end in range(1, len(parts)):
                prefix = "/".join(parts[:end])
                if prefix in datasets:
                    return (
                        f"tensor {name!r} needs {prefix!r} to be an HDF5 group, but {prefix!r} "
                        "is a tensor too"
                    )
        return None

    @classmethod
    def check_metadata(cls, metadata: Mapping[str, str], source: Reader) -> str | None:
        if isinstance(source, Hdf5Reader):
            return None  # copied attribute by attribute, with the source's own settings
        # Root attributes, created in tracked order (measured with h5py 3 / HDF5 1.14:
        # the 65,536th fails with "attribute creation index can't be incremented", a
        # 65,535-byte name with "decoded name length is invalid").
        for index, (key, value) in enumerate(metadata.items()):
            if index >= HDF5_MAX_ATTRIBUTES:
                return (
                    f"metadata key {key!r}: HDF5 holds at most {HDF5_MAX_ATTRIBUTES} metadata "
                    f"keys (root attributes), and this checkpoint has {len(metadata)}"
                )
            if not key or "\x00" in key or not utf8_encodable(key):
                return f"metadata key {key!r}: an HDF5 attribute name must be non-empty UTF-8"
            if len(key.encode()) > HDF5_MAX_ATTRIBUTE_NAME_BYTES:
                return (
                    f"metadata key {key[:40]!r}...: an HDF5 attribute name holds at most "
                    f"{HDF5_MAX_ATTRIBUTE_NAME_BYTES} bytes of UTF-8"
                )
            if "\x00" in value or not utf8_encodable(value):
                return f"metadata key {key!r}: HDF5 strings hold no NUL byte and only UTF-8"
        return None

    @classmethod
    def check_dtype(cls, info: TensorInfo) -> str | None:
        dtype = info.dtype
        if from_ml_dtypes(dtype) or dtype.kind == "V":  # ml_dtypes' types, or opaque bytes
            return f"HDF5 cannot hold {dtype.name}; write .safetensors instead"
        return None

    # -- skeleton -------------------------------------------------------------------------

    def _create_file(self) -> Any:
        """A new file whose root group orders links and attributes as the source's did."""
        h5py = _h5py()
        h5f, h5p = h5py.h5f, h5py.h5p
        create_plist = h5p.create(h5p.FILE_CREATE)
        if self._source is not None:
            with _input_errors(self._source.path, "cannot read the root group's settings"):
                root_plist = self._source.file["/"].id.get_create_plist()
                create_plist.set_link_creation_order(root_plist.get_link_creation_order())
                create_plist.set_attr_creation_order(root_plist.get_attr_creation_order())
        else:  # keep the checkpoint's tensor order when read back
            order = h5p.CRT_ORDER_TRACKED | h5p.CRT_ORDER_INDEXED
            create_plist.set_link_creation_order(order)
            create_plist.set_attr_creation_order(order)
        access_plist = h5p.create(h5p.FILE_ACCESS)
        access_plist.set_fclose_degree(h5f.CLOSE_STRONG)
        access_plist.set_cache(0, CHUNK_CACHE_SLOTS, CHUNK_CACHE_BYTES, CHUNK_CACHE_W0)
        file_id = h5f.create(
            os.fsencode(self.path), h5f.ACC_TRUNC, fcpl=create_plist, fapl=access_plist
        )
        return h5py.File(file_id)

    def _copy_structure(self, source: Hdf5Reader) -> None:
        """Every group, dataset and named datatype of the source, with all attributes."""
        source_names = {info.name: info.shape for info in source.infos}
        ours = {info.name: info.shape for info in self.checkpoint.infos}
        if ours != source_names:
            raise ValueError("an HDF5 source needs the checkpoint to list exactly its datasets")
        for node in source.nodes:
            with _input_errors(source.path, f"cannot copy object {node.path!r}"):
                original = source.file[node.path]
            if node.path == "/":
                copy = self.file["/"]
            else:
                copy = self._create_like(source, original, node)
            self._copy_attributes(source, original, copy, node.path)
        self._update_metadata(source)

    def _create_like(self, source: Hdf5Reader, original: Any, node: Hdf5Node) -> Any:
        """An object at node.path with the original's creation settings (not its data)."""
        h5py = _h5py()
        parent_path, name = _split(node.path)
        parent_id, name_bytes = self.file[parent_path].id, _name_bytes(name)
        with _input_errors(source.path, f"cannot read the settings of {node.path!r}"):
            link_plist = self._link_plist(source.file[parent_path], name)
            if node.kind == "group":
                group_plist = original.id.get_create_plist()  # link/attribute ordering
            elif node.kind == "dataset":
                # Layout, chunks, filters (compression, shuffle, fletcher32, scaleoffset,
                # ...), fill value and attribute ordering all live in this property list.
                dataset_plist = original.id.get_create_plist()
                type_id = original.id.get_type().copy()  # a copy is never a committed type
                space = original.id.get_space()  # shape and maxshape
            else:
                type_id = original.id.copy()
        if node.kind == "group":
            h5py.h5g.create(parent_id, name_bytes, lcpl=link_plist, gcpl=group_plist)
        elif node.kind == "dataset":
            h5py.h5d.create(
                parent_id, name_bytes, type_id, space, dcpl=dataset_plist, lcpl=link_plist
            )
        else:
            type_id.commit(parent_id, name_bytes, lcpl=link_plist)
        return self.file[node.path]

    def _link_plist(self, source_parent: Any, name: str) -> Any:
        """A link creation property list with the source link's character set."""
        h5p = _h5py().h5p
        link_plist = h5p.create(h5p.LINK_CREATE)
        link_plist.set_create_intermediate_group(False)
        cset = source_parent.id.links.get_info(_name_bytes(name)).cset
        link_plist.set_char_encoding(cset)
        return link_plist

    def _copy_attributes(self, source: Hdf5Reader, original: Any, copy: Any, path: str) -> None:
        """Attributes in the source's order, with their exact HDF5 types (fixed-length byte
        strings stay fixed-length, padding and character set included)."""
        with _input_errors(source.path, f"cannot list the attributes of {path!r}"):
            names = list(original.attrs)
        for name in names:
            attribute = self._read_attribute(source, original, name, path)
            h5a = _h5py().h5a
            created = h5a.create(copy.id, attribute.name, attribute.type_id, attribute.space)
            if attribute.values is not None:
                created.write(attribute.values, mtype=attribute.memory_type)

    def _read_attribute(
        self, source: Hdf5Reader, original: Any, name: str | bytes, path: str
    ) -> _AttributeCopy:
        h5py = _h5py()
        with _input_errors(source.path, f"cannot read attribute {name!r} of {path!r}"):
            attr = original.attrs.get_id(name)
            type_id = attr.get_type().copy()
            if _holds_references(type_id):
                raise InputError(
                    source.path,
                    f"attribute {name!r} of {path!r} holds HDF5 references, which cannot "
                    "be copied to another file",
                )
            space = attr.get_space()
            dtype = attr.dtype
            memory_type = h5py.h5t.py_create(dtype)
            if space.get_simple_extent_type() == h5py.h5s.NULL:
                return _AttributeCopy(_name_bytes(name), type_id, space, None, memory_type)
            shape = attr.shape
            if dtype.subdtype is not None:  # NumPy has no array-typed elements: unfold them
                dtype, inner_shape = dtype.subdtype
                shape = shape + inner_shape
            # Read without h5py's str decoding: variable-length strings stay raw bytes.
            values = np.zeros(shape, dtype=dtype)
            attr.read(values, mtype=memory_type)
        return _AttributeCopy(_name_bytes(name), type_id, space, values, memory_type)

    def _update_metadata(self, source: Hdf5Reader) -> None:
        """Root string attributes for metadata the caller changed; the rest was copied."""
        attrs = self.file.attrs
        for key, value in self.checkpoint.metadata.items():
            if source.metadata.get(key) != value:
                if key in attrs:
                    del attrs[key]
                attrs[key] = value

    def _create_plain_layout(self) -> None:
        """A dataset per tensor at its name's path, contiguous and uncompressed."""
        for key, value in self.checkpoint.metadata.items():
            self.file.attrs[key] = value
        for info in self.checkpoint.infos:
            problem = _dataset_path_problem(info.name)
            if problem is not None:
                raise WriteError(f"tensor {info.name!r} cannot be an HDF5 dataset: {problem}")
            parent_path, name = _split("/" + info.name)
            try:
                parent = self._require_group(parent_path)
                parent.create_dataset(name, shape=info.shape, dtype=info.dtype)
            except (ValueError, KeyError, TypeError) as exc:  # a name clash with another tensor
                raise WriteError(
                    f"tensor {info.name!r} cannot be an HDF5 dataset: {_reason(exc)}"
                ) from None

    def _require_group(self, path: str) -> Any:
        """The group at path, creating missing ones so that they keep insertion order."""
        group = self.file["/"]
        for name in [part for part in path.split("/") if part]:
            if name not in group:
                group.create_group(name, track_order=True)
            group = group[name]
            if not isinstance(group, _h5py().Group):
                raise ValueError(f"{group.name!r} is a dataset, not a group")
        return group

    # -- data -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def _failing_quietly(self) -> Iterator[None]:
        """After the first failure (a full disk), point the library's file descriptor at
        /dev/null: otherwise every later flush, in h5py's object destructors and at
        close, fails again, prints a traceback it cannot raise, and the library ends in
        "Slist already enabled?" and a segfault at exit. The file is discarded anyway."""
        try:
            yield
        except BaseException as exc:
            self._silence()
            raise _with_errno(exc) from None

    def _silence(self) -> None:
        with contextlib.suppress(Exception):
            fd = self.file.id.get_vfd_handle()
            sink = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(sink, fd)
            finally:
                os.close(sink)

    def write(self, info: TensorInfo, chunks: Iterable[np.ndarray]) -> None:
        with self._failing_quietly():
            self._write(info, chunks)

    def _write(self, info: TensorInfo, chunks: Iterable[np.ndarray]) -> None:
        dataset = self.file["/" + info.name]
        if dataset.shape != info.shape:
            raise ValueError(f"tensor {info.name!r} has shape {info.shape}, not {dataset.shape}")
        position = 0
        for chunk in chunks:
            # Cast with NumPy's rules (round to nearest, overflow to inf), as other writers do.
            flat = np.ascontiguousarray(chunk, dtype=info.dtype).reshape(-1)
            end = position + flat.size
            offset = 0
            for block in flat_range_blocks(info.shape, position, end):
                block_shape = _block_shape(block)
                count = math.prod(block_shape)
                piece = flat[offset : offset + count].reshape(block_shape)
                dataset.write_direct(piece, dest_sel=block or None)
                offset += count
            position = end
        if position != info.numel:
            raise ValueError(f"tensor {info.name!r} got {position} of {info.numel} elements")
        dataset.id.flush()  # a full disk shows here, not later in a destructor
        self._written.add(info.name)

    def copy_unchanged(self, source: Reader, info: TensorInfo) -> bool:
        """Copy a chunked dataset's stored (compressed) chunks byte for byte, skipping the
        decode and re-encode. The output dataset has the source's exact filter pipeline, so
        the raw chunks are valid there. Other layouts go through write()."""
        if self._source is None or source is not self._source:
            return False
        if self._source.is_unallocated(info.name):
            # All fill value: the copy, created with the source's fill value and allocation
            # time, reads the same with nothing written, and stays as small as the source.
            self._written.add(info.name)
            return True
        original = self._source.dataset(info.name)
        if original.chunks is None:
            return False
        copy = self.file["/" + info.name]
        with _input_errors(source.path, "cannot list stored chunks", info.name):
            offsets = _stored_chunk_offsets(original.id)
        with self._failing_quietly():
            for offset in offsets:
                with _input_errors(source.path, f"cannot read stored chunk {offset}", info.name):
                    filter_mask, raw = original.id.read_direct_chunk(offset)
                copy.id.write_direct_chunk(offset, raw, filter_mask)
            copy.id.flush()
        self._written.add(info.name)
        return True

    def close(self) -> None:
        try:
            missing = [i.name for i in self.checkpoint.infos if i.name not in self._written]
            if missing:
                raise RuntimeError(f"closing with {len(missing)} tensors unwritten: {missing[:3]}")
            with self._failing_quietly():
                self.file.flush()
        finally:
            self.file.close()

    def abort(self) -> None:
        self._silence()
        with contextlib.suppress(Exception):
            self.file.close()


def _with_errno(exc: BaseException) -> BaseException:
    """The library reports a failed write (a full disk) as a RuntimeError or a bare OSError
    whose text carries the C errno ("errno = 28"); give it back its errno, so that it is
    reported as what it is (exit 5, "disk full") and not as a bug."""
    if not isinstance(exc, (RuntimeError, OSError)) or getattr(exc, "errno", None):
        return exc
    found = re.search(r"errno = (\d+)", str(exc))
    if found is None:
        return exc
    code = int(found.group(1))
    return OSError(code, os.strerror(code))


def _check_global_heaps(
    path: Path, fd: int, size: int, data_ranges: Sequence[tuple[int, int]]
) -> int:
    """Refuse global heap collections (where variable-length strings live) whose objects do
    not tile the collection: libhdf5 loops forever reading one whose free-space object has
    size 0 (found by the fuzzer). Checked on the raw bytes before any attribute is read.

    Only the bytes outside the datasets' storage are searched: tensor data is most of a
    checkpoint, and may contain b"GCOL" by chance. The rest is read a window at a time, so
    memory stays bounded whatever is left to scan.

    Time is linear in the file size: real collections never overlap and every object header
    is 16 bytes, so walking every real collection visits at most size / 16 objects. A file
    whose b"GCOL" candidates (in attribute bytes, say) claim overlapping collections would
    make the walks quadratic; once the walks together exceed twice that bound, the file is
    refused instead.

    Returns the size of the largest heap object found (for the attribute budget).
    """
    budget = _HeapWalkBudget(2 * (size // 16) + (1 << 17))
    for begin, end in _gaps(size, data_ranges):
        for window in range(begin, end, HEAP_SCAN_WINDOW):
            stop = min(window + HEAP_SCAN_WINDOW, end)
            # A match starting before `stop` may end up to 3 bytes past it.
            text = os.pread(fd, min(stop + 3, size) - window, window)
            start = text.find(b"GCOL")
            while 0 <= start < stop - window:
                if _corrupt_collection(fd, window + start, size, budget):
                    raise InputError(path, "corrupt HDF5 global heap (zero-size free space)")
                if budget.remaining < 0:
                    raise InputError(
                        path,
                        "global heap signatures claim overlapping collections "
                        f"(more than {budget.total} heap objects to check); refusing it",
                    )
                start = text.find(b"GCOL", start + 4)
    return budget.largest_object


class _HeapWalkBudget:
    """Heap object headers that the scan may still look at, over all collections, and the
    largest object seen whose data lies inside its collection."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.remaining = total
        self.largest_object = 0


def _gaps(size: int, ranges: Sequence[tuple[int, int]]) -> Iterator[tuple[int, int]]:
    """The parts of [0, size) that no range covers."""
    position = 0
    for begin, end in sorted(ranges):
        if begin > position:
            yield position, min(begin, size)
        position = max(position, end)
    if position < size:
        yield position, size


def _corrupt_collection(fd: int, start: int, size: int, budget: _HeapWalkBudget) -> bool:
    """Whether the collection at `start` has a zero-size free-space object short of its end.
    Objects are indexed by 16 bits, so no real collection holds more than 65,535.
    Each object header looked at costs one unit of `budget`; the walk stops when it is spent
    (the caller then refuses the file)."""
    import struct

    if start + 16 > size:
        return False
    (collection,) = struct.unpack("<Q", os.pread(fd, 8, start + 8))
    end = min(start + collection, size)
    position = start + 16
    block_start, block = 0, b""
    for _ in range(1 << 16):
        if not collection or position + 16 > end:
            return False
        budget.remaining -= 1
        if budget.remaining < 0:
            return False
        if not block_start <= position <= block_start + len(block) - 16:
            # Read ahead: most objects are small, so one pread serves many headers.
            block_start, block = position, os.pread(fd, min(1 << 16, end - position), position)
        index, _, _, length = struct.unpack_from("<HHIQ", block, position - block_start)
        if index == 0:  # the free space: it must reach the collection's end
            return bool(length == 0 and start + collection - position > 16)
        if position + 16 + length <= end:
            budget.largest_object = max(budget.largest_object, length)
        position += 16 + ((length + 7) // 8) * 8
    return True
