"""What the reader checks on every dataset before any data is read: nothing that reads
outside the file (virtual datasets, external storage), standard IEEE float layouts,
available filters, and declared sizes bounded by what the file stores.

A dataset of a numeric dtype is a tensor (TensorInfo). Any other dataset (strings, vlen,
compound, enum, opaque, references, an empty dataspace) is a NonTensor: listed, never
measured or clipped, carried through unchanged where the output can hold it. The storage
rules apply to both alike.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import clipcli.formats.hdf5.limits as limits
from clipcli.errors import InputError
from clipcli.formats.base import NonTensorInfo, TensorInfo, numpy_size_overflows
from clipcli.formats.hdf5 import decoding
from clipcli.formats.hdf5.filters import lossy_filters, name_of
from clipcli.formats.hdf5.geometry import band_chunks
from clipcli.formats.hdf5.library import (
    holds_references,
    holds_vlen,
    input_errors,
    load_h5py,
    unsupported_dtype,
)


@dataclass(frozen=True)
class Declared:
    """A dataset's name, shape (None: empty dataspace) and declared bytes in the file."""

    name: str
    shape: tuple[int, ...] | None
    nbytes: int


class DatasetChecks:
    """Checks each dataset of one file and collects what the file-wide checks need: the
    byte ranges holding dataset storage, and the datasets with no storage at all."""

    def __init__(self, path: Path, file_size: int, budget_size: int | None = None) -> None:
        """budget_size: the size the budgets are taken from, where smaller than the file
        (Hdf5Reader's budget_size: a .keras archive's)."""
        self.path = path
        self.file_size = file_size  # where stored bytes may lie
        self.budget_size = file_size if budget_size is None else min(budget_size, file_size)
        self.budget_words = (
            f"the {file_size}-byte file"
            if self.budget_size == file_size
            else f"the {self.budget_size}-byte archive it came from"
        )
        self.data_ranges: list[tuple[int, int]] = []
        self.unallocated: set[str] = set()  # datasets with no storage: all fill value
        # Unallocated tensors with a defined fill value: measured from that value and never
        # read, so outside the expansion and chunk budgets until something asks for their
        # elements (the reader then charges them to the expansion budget).
        self.fill_only: set[str] = set()
        # Datasets stored with filters not known to be lossless (clipcli.formats.hdf5.filters):
        # never written with them again.
        self.lossy: dict[str, list[int]] = {}
        self.declared_total = 0
        # Chunked datasets: the chunk cache each is read with (bytes), no more than the
        # chunks its C-order pieces need kept decoded (the library keeps a decoded buffer
        # at its real size, counting only its chunk's: small bombs added up to 4 GB).
        self.cache_bytes: dict[str, int] = {}
        # Compressed tensors of rank 2 and more read a band of chunks (rows along the first
        # axis) at a time, by this many rows, where a band fits the chunk cache's bytes.
        self.band_rows: dict[str, int] = {}
        self.declared_chunks = 0  # every chunk of every chunked dataset's shape

    def _fail(self, problem: str, tensor: str | None = None) -> InputError:
        return InputError(self.path, problem, tensor)

    def check_dataset(self, dataset: Any, path: str) -> TensorInfo | NonTensorInfo:
        """Refuse anything that reads outside the file or is not bounded; classify the rest."""
        name = path[1:]
        with input_errors(self.path, "cannot inspect dataset", name):
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
            type_id = dataset.id.get_type()
            shape = None if dataset.shape is None else tuple(int(d) for d in dataset.shape)
            problem = self._non_tensor_kind(type_id, shape is None, name)
            element_bytes = int(type_id.get_size())
            numel = 0 if shape is None else math.prod(shape)
            if shape is not None and numpy_size_overflows(shape, element_bytes):
                # h5py reads through numpy, which refuses it: (2**32, 2**32, 0) is no tensor.
                raise self._fail(f"shape {list(shape)} overflows numpy's size limit", name)
            declared = Declared(name, shape, numel * element_bytes)
            create_plist = dataset.id.get_create_plist()
            self._check_filters(create_plist, type_id, name)
            tensor = problem is None and shape is not None
            self._check_storage(dataset, create_plist, declared, element_bytes, tensor)
            if declared.name not in self.fill_only:
                self.declared_total += declared.nbytes
            if problem is None and shape is not None:
                dtype: np.dtype[Any] = dataset.dtype
                return TensorInfo(name, dtype, shape, numel * dtype.itemsize)
            return NonTensorInfo(
                name,
                problem or "an empty (null) dataspace",
                shape,
                declared.nbytes,
                copyable=not holds_references(type_id),
                variable_length=holds_vlen(type_id),
            )

    def _non_tensor_kind(self, type_id: Any, null_space: bool, name: str) -> str | None:
        """What makes this dataset a non-tensor (non_tensor_kind), or None for a tensor;
        a float type's bit layout is checked first."""
        try:
            dtype: np.dtype[Any] | None = type_id.dtype
        except TypeError:  # no NumPy counterpart: no float to check
            dtype = None
        if dtype is not None and dtype.kind in "fc":
            self._check_float_layout(type_id, dtype, name)
        return non_tensor_kind(type_id, null_space)

    def _check_float_layout(self, type_id: Any, dtype: np.dtype[Any], name: str) -> None:
        """An HDF5 float type describes its bits (offset, precision, sign, exponent and
        mantissa fields); h5py maps it to a NumPy dtype by size alone. Fields that are not
        the standard IEEE layout of that size (a fuzzed file: bit offset 0xEA00 in a 32-bit
        float) make the library's conversion read and write out of bounds. Refuse them."""
        h5t = load_h5py().h5t
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

    def _check_filters(self, create_plist: Any, type_id: Any, name: str) -> None:
        h5py = load_h5py()
        for index in range(create_plist.get_nfilters()):
            code = create_plist.get_filter(index)[0]
            if not h5py.h5z.filter_avail(code):
                raise self._fail(f"uses unavailable HDF5 filter {code}", name)
        lossy = lossy_filters(create_plist, type_id.get_class() == h5py.h5t.INTEGER)
        if lossy:
            self.lossy[name] = lossy

    def _check_storage(
        self, dataset: Any, create_plist: Any, info: Declared, element_bytes: int, tensor: bool
    ) -> None:
        h5d = load_h5py().h5d
        declared = info.nbytes
        if declared > limits.MAX_DECLARED_BYTES:
            raise self._fail(
                f"declares {declared} bytes, over the {limits.MAX_DECLARED_BYTES}-byte (1 TiB) "
                "limit",
                info.name,
            )
        stored = int(dataset.id.get_storage_size())
        if stored == 0 and declared:
            self.unallocated.add(info.name)
            if tensor and create_plist.fill_value_defined() != h5d.FILL_VALUE_UNDEFINED:
                self.fill_only.add(info.name)
        expands = declared > limits.SPARSE_CHECK_BYTES and declared > limits.MAX_EXPANSION * stored
        if expands and info.name not in self.fill_only:
            raise self._fail(
                f"declares {declared} bytes but stores only {stored}; refusing to expand "
                f"data more than {limits.MAX_EXPANSION}-fold",
                info.name,
            )
        layout = create_plist.get_layout()
        if layout == h5d.CONTIGUOUS:
            offset = dataset.id.get_offset()  # None while no storage is allocated
            if offset is not None and offset + stored > self.file_size:
                raise self._fail(
                    f"data at bytes [{offset}, {offset + stored}) runs past the end of the "
                    f"{self.file_size}-byte file",
                    info.name,
                )
            if offset is not None:
                self.data_ranges.append((offset, offset + stored))
            maxshape = dataset.maxshape
            if info.shape is not None and maxshape is not None and tuple(maxshape) != info.shape:
                raise self._fail(
                    f"is contiguous but declares a maximum shape {tuple(maxshape)} other than "
                    f"its shape {info.shape}, which HDF5 does not allow (malformed)",
                    info.name,
                )
        if layout == h5d.CHUNKED:
            self._check_chunks(dataset, create_plist, info.name, element_bytes, tensor)

    def _check_chunks(
        self, dataset: Any, create_plist: Any, name: str, element_bytes: int, tensor: bool
    ) -> None:
        # The library decodes a whole chunk to read any element of it: memory per read
        # is one chunk, whatever our 2 MiB pieces ask for.
        chunk_shape: tuple[int, ...] = tuple(create_plist.get_chunk())
        chunk_elements = math.prod(chunk_shape)
        chunk_bytes = chunk_elements * element_bytes
        if chunk_bytes > limits.MAX_CHUNK_BYTES:
            raise self._fail(
                f"HDF5 chunks of {chunk_bytes} bytes exceed the "
                f"{limits.MAX_CHUNK_BYTES >> 20} MiB limit (each read decodes a whole chunk "
                "in memory)",
                name,
            )
        # Counted before the chunk index is walked: listing 10**8 chunks costs too. An
        # unallocated tensor has no chunk to list and is never read through the library.
        if name not in self.fill_only:
            self.declared_chunks += chunk_count(dataset.shape, chunk_shape)
            self.check_chunk_count()
        filters = [create_plist.get_filter(i) for i in range(create_plist.get_nfilters())]
        codes = [int(f[0]) for f in filters]
        values = [[int(v) for v in f[2]] for f in filters]
        problem = decoding.pipeline_problem(codes, values, chunk_elements, element_bytes)
        if problem is not None:
            raise self._fail(f"{problem}; refusing it", name)
        shape: tuple[int, ...] = tuple(dataset.shape or ())
        band = band_chunks(shape, chunk_shape)
        if tensor and band > 2 and any(c in decoding.DECOMPRESSORS for c in codes):
            rows = min(chunk_shape[0], shape[0])
            band_bytes = rows * math.prod(shape[1:]) * element_bytes
            cache_holds_bands = band * chunk_bytes <= limits.CHUNK_CACHE_BYTES
            if 0 < band_bytes <= limits.CHUNK_CACHE_BYTES or (
                0 < band_bytes <= limits.MAX_BAND_BYTES and not cache_holds_bands
            ):
                # Read a band of chunks at a time (Hdf5Reader.chunks): each chunk decoded
                # once, then let go; the library holds at most two.
                self.band_rows[name] = int(rows)
                band = 2
            elif name not in self.fill_only and not cache_holds_bands:  # over MAX_BAND_BYTES
                raise self._fail(
                    f"its compressed chunks {list(chunk_shape)} of shape {list(shape)} are "
                    f"read in order {band // 2 * chunk_bytes} bytes of them at once, over "
                    f"the {limits.CHUNK_CACHE_BYTES >> 20} MiB cache, and a band of its rows "
                    f"is {band_bytes} bytes, over {limits.MAX_BAND_BYTES >> 20} MiB: each "
                    "chunk would be decoded again for every piece that crosses it; refusing "
                    "it (rechunk it with h5repack -l, or store it uncompressed)",
                    name,
                )
        self.cache_bytes[name] = min(limits.CHUNK_CACHE_BYTES, band * chunk_bytes)
        # At most this many chunks are held decoded at once: each may take its share of
        # the limit.
        held = max(1, min(band, limits.CHUNK_CACHE_BYTES // chunk_bytes))
        if not tensor:
            # A non-tensor is read a slice of NON_TENSOR_SLICE_BYTES at a time, and the
            # library kept every chunk such a slice decodes (attack bomb15att: 200 small
            # bombs in a compound dataset held 3.4 GB): each may be held.
            held = max(held, limits.NON_TENSOR_SLICE_BYTES // chunk_bytes + 2)
        if not hasattr(dataset.id, "chunk_iter"):
            return  # HDF5 < 1.14: the library scans the chunks itself
        chunks: list[tuple[int, int, int, tuple[int, ...]]] = []
        dataset.id.chunk_iter(
            lambda chunk: chunks.append(
                (chunk.byte_offset, chunk.size, chunk.filter_mask, chunk.chunk_offset)
            )
        )
        limit = decoding.decode_limit(self.budget_size) // max(1, min(held, len(chunks)))
        for offset, size, mask, where in chunks:
            # A stored chunk of 0 bytes, or one past the end, makes the library's
            # filters read nothing or garbage: fletcher32 on an empty chunk segfaults.
            if size <= 0 or offset + size > self.file_size:
                raise self._fail(
                    f"a stored chunk at byte {offset} of {size} bytes is empty or runs "
                    f"past the end of the {self.file_size}-byte file",
                    name,
                )
            self.data_ranges.append((offset, offset + size))
            kept = decoding.applied(len(codes), mask)
            through = [codes[i] for i in kept]
            decompressor = next((c for c in through if c in decoding.DECOMPRESSORS), None)
            if decompressor is not None and decoding.worst_output(decompressor, size) > limit:
                stored_with = [values[i] for i in kept]
                self._check_decoding(dataset, where, size, through, stored_with, chunk_bytes, name)

    def _check_decoding(
        self,
        dataset: Any,
        where: tuple[int, ...],
        size: int,
        codes: list[int],
        values: list[list[int]],
        chunk_bytes: int,
        name: str,
    ) -> None:
        """Decode a stored chunk's stream here first (clipcli.formats.hdf5.decoding) and
        refuse it when it gives more than its chunk holds: a decompression bomb."""
        with input_errors(self.path, "cannot read a stored chunk", name, reading_data=True):
            _, raw = dataset.id.read_direct_chunk(where)
        allowed = chunk_bytes + decoding.DECODE_SLACK
        if decoding.decoded_bytes(raw, codes, values, allowed + 1) > allowed:
            decompressor = next(c for c in codes if c in decoding.DECOMPRESSORS)
            raise self._fail(
                f"a stored chunk of {size} bytes decodes ({name_of(decompressor)}) past "
                f"{allowed} bytes, more than its {chunk_bytes}-byte chunk holds (a "
                "decompression bomb)",
                name,
            )

    def check_expansion(self) -> None:
        """The whole file's budget: every dataset is produced in full by the library when
        read, so the declared bytes of all datasets together may be at most
        expansion_budget(file size). Per-dataset rules alone let 10,000 datasets of 64 MiB
        each through from a 3 MB file. Unallocated tensors (fill_only) are not read: they
        count only once their elements are asked for (Hdf5Reader.constant_elements)."""
        total = self.declared_total
        budget = limits.expansion_budget(self.budget_size)
        if total > budget:
            raise self._fail(
                f"datasets declare {total} bytes in all, more than {limits.MAX_EXPANSION} "
                f"times {self.budget_words} plus "
                f"{limits.SPARSE_CHECK_BYTES >> 20} MiB ({budget}); refusing to expand it"
            )

    def check_chunk_count(self) -> None:
        """The whole file's chunk budget (limits.chunk_budget): the library's memory and
        work grow with the number of chunks, which bytes alone do not bound."""
        budget = limits.chunk_budget(self.budget_size)
        if self.declared_chunks > budget:
            raise self._fail(
                f"datasets declare more than {budget} HDF5 chunks in all ({self.declared_chunks}"
                f" so far), over the budget of one per {limits.BYTES_PER_CHUNK} bytes of "
                f"{self.budget_words} plus {limits.FREE_CHUNKS}; refusing it (every "
                "chunk costs memory and time to read)"
            )

    def check_attribute_budget(
        self, file: Any, object_paths: Sequence[str], largest_heap_object: int
    ) -> None:
        """Variable-length attribute values live in global heap objects, and any number of
        elements may point at the same object: 1,500 strings naming one 1 MiB object read
        as 1.5 GB. Reading an attribute reads all its elements at once, so the bound is
        taken before any is read: elements x the largest heap object in the file.
        An object listing an attribute name twice is refused: h5py opens attributes by
        name, which finds only one of them (the other is hidden, or written twice)."""
        elements = 0
        for path in object_paths:
            obj = file[path]
            names = list(obj.attrs)
            seen: set[str | bytes] = set()
            for name in names:
                if name in seen:
                    raise self._fail(f"object {path!r} lists the attribute name {name!r} twice")
                seen.add(name)
                attr = obj.attrs.get_id(name)
                elements += vlen_attribute_elements(attr.get_type(), attr.get_space())
        problem = attribute_budget_problem(elements, largest_heap_object)
        if problem is not None:
            raise self._fail(f"{problem}; refusing it")


def non_tensor_kind(type_id: Any, null_space: bool) -> str | None:
    """What makes a dataset of this HDF5 type a non-tensor, or None for a tensor: the one
    rule the reader lists datasets by, and that a structure record's non-tensor datasets
    are held to (record_check), so that a record never adds a dataset OUT's reader would
    measure or clip as a weight."""
    try:
        dtype: np.dtype[Any] = type_id.dtype
    except TypeError:  # e.g. HDF5 types with no NumPy counterpart
        return "an HDF5 type with no NumPy counterpart"
    problem = unsupported_dtype(dtype)
    if problem is None and null_space:
        return "an empty (null) dataspace"
    return problem


def vlen_attribute_elements(type_id: Any, space: Any) -> int:
    """The elements an attribute counts against the attribute budget: each may point at
    the largest heap object of the file (at least one, whatever its dataspace)."""
    if not holds_vlen(type_id):
        return 0
    return max(1, int(space.get_simple_extent_npoints()))


def attribute_budget_problem(elements: int, largest_heap_object: int) -> str | None:
    """Why a file with this many variable-length attribute elements and this largest global
    heap object is over the attribute budget (elements x largest), or None."""
    worst = elements * largest_heap_object
    if worst <= limits.MAX_ATTRIBUTE_BYTES:
        return None
    return (
        f"{elements} variable-length attribute values may each read a heap object of "
        f"{largest_heap_object} bytes ({worst} in all, over the "
        f"{limits.MAX_ATTRIBUTE_BYTES >> 20} MiB limit for attributes)"
    )


def chunk_count(shape: Sequence[int] | None, chunks: Sequence[int]) -> int:
    """Chunks that cover a dataset's shape (0 when it has no elements)."""
    if not shape:
        return 0 if shape is None else 1
    return math.prod(-(-int(size) // int(chunk)) for size, chunk in zip(shape, chunks, strict=True))
