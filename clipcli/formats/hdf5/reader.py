"""The HDF5 reader: opens read-only, walks every object by hard links only, checks every
dataset (clipcli.formats.hdf5.safety) and the global heaps (heap) before any data is read,
then hands out tensors in C-order pieces."""

from __future__ import annotations

import contextlib
import functools
import math
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import clipcli.formats.hdf5.limits as limits
from clipcli.errors import InputError
from clipcli.formats.base import NonTensorInfo, Reader, TensorInfo, default_chunk_elems
from clipcli.formats.hdf5.geometry import BandReader, aligned_step, block_shape, flat_range_blocks
from clipcli.formats.hdf5.heap import check_global_heaps
from clipcli.formats.hdf5.library import (
    NodeKind,
    filter_room,
    input_errors,
    link_name_problem,
    load_h5py,
    utf8_text,
)
from clipcli.formats.hdf5.nontensor import RowSlice, VlenBudget, read_rows
from clipcli.formats.hdf5.record_read import read_structure
from clipcli.formats.hdf5.safety import DatasetChecks
from clipcli.formats.structure_record import STRUCTURE_KEY, Structure
from clipcli.system.address_space import HDF5_BYTES, check_room
from clipcli.system.heap import give_back_freed_memory
from clipcli.system.identity import FileIdentity
from clipcli.system.inputs import fd_path, open_input_fd


@dataclass(frozen=True)
class Hdf5Node:
    """One object of the source file, for the writer to replicate. path is absolute."""

    path: str
    kind: NodeKind


def _join(parent: str, name: str) -> str:
    return f"/{name}" if parent == "/" else f"{parent}/{name}"


def _object_key(obj: Any) -> tuple[tuple[int, int], int]:
    """Identity of an HDF5 object (the same for every hard link that reaches it), and the
    bytes its header and attributes take in the file, read from its header without
    loading them (the library loads every attribute of an object to list them: 240 MB of
    them in a 1.2 MB .keras took 330 MB to list)."""
    info = load_h5py().h5o.get_info(obj.id)
    attributes = info.meta_size.attr
    stored = int(info.hdr.space.total) + int(attributes.heap_size) + int(attributes.index_size)
    return (int(info.fileno), int(info.addr)), stored


class Hdf5Reader(Reader):
    """Opens read-only and validates the whole file up front, reading no tensor data.

    For the writer it exposes `file` (the h5py.File), `nodes` (every group, dataset and named
    datatype in walk order) and `dataset(name)`.
    """

    format_name = "hdf5"

    def __init__(
        self, path: Path, shown_as: Path | None = None, budget_size: int | None = None
    ) -> None:
        """shown_as: the name messages give the file (a weights file unpacked from a
        .keras archive is named after the archive, not after its temp copy). budget_size:
        the size its budgets (expansion, chunks, decoding, variable-length data) are taken
        from where smaller than the file: a .keras archive's, since the zip rules already
        let the unpacked member be 200 times the archive, and budgets taken from the
        member would allow 200 times that again (a 61 KB archive held 1.2 GB)."""
        super().__init__(shown_as or path)
        h5py = load_h5py()
        # Our own descriptor, opened without blocking and checked to be a regular file;
        # the library then opens that very file through /proc/self/fd, so a name swapped
        # for a FIFO or another file after the check is never what HDF5 reads. Without
        # /proc it opens the name, and its own descriptor is checked to be that file.
        self._fd = open_input_fd(path)  # the real file
        try:
            self._identity = FileIdentity.of_stat(os.fstat(self._fd))
            self._open_file(h5py, fd_path(self._fd) or os.fspath(path))
        except BaseException:
            os.close(self._fd)
            raise
        try:
            self._check_library_opened_ours()
            self._file_size = os.fstat(self._fd).st_size
            self._checks = DatasetChecks(self.path, self._file_size, budget_size)
            self._non_tensors: list[NonTensorInfo] = []
            with input_errors(self.path, "cannot read the file's structure"):
                self.nodes, self._infos = self._walk()
            # Walking reads no attribute values, so no global heap has been touched yet.
            self._checks.check_expansion()
            self.largest_heap_object = check_global_heaps(
                self.path, self._fd, self._file_size, self._checks.data_ranges
            )
            with input_errors(self.path, "cannot inspect attributes"):
                self._checks.check_attribute_budget(
                    self.file, [node.path for node in self.nodes], self.largest_heap_object
                )
            self._metadata = self._read_metadata()
        except BaseException:
            self.close()
            raise
        self._by_name = {info.name: info for info in self._infos}
        self._vlen_budget = VlenBudget(self.path, self._checks.budget_size)
        self._expanded: set[str] = set()  # unallocated tensors whose elements were made
        self._expanded_bytes = 0
        self._structure: Structure | None = None
        self._held: tuple[str, Any] | None = None  # elements_loader's dataset, by tensor
        self._held_lock = threading.Lock()

    def _open_file(self, h5py: Any, name: str) -> None:
        # Lock where the filesystem can, but do not fail where it cannot (NFS, Lustre).
        locking = "best-effort" if h5py.version.hdf5_version_tuple >= (1, 12, 1) else None
        check_room(HDF5_BYTES, "opening an HDF5 file")  # HDF5 crashes where malloc fails
        with input_errors(self.path, "cannot open as HDF5"):
            self.file: Any = h5py.File(
                name,
                "r",
                locking=locking,
                rdcc_nbytes=limits.CHUNK_CACHE_BYTES,
                rdcc_nslots=limits.CHUNK_CACHE_SLOTS,
                rdcc_w0=limits.CHUNK_CACHE_W0,
            )

    def _check_library_opened_ours(self) -> None:
        """The file HDF5 opened must be the one our descriptor holds (and identifies for
        the input guard): a name the library reopens may have been swapped meanwhile."""
        with input_errors(self.path, "cannot open as HDF5"):
            library_fd = self.file.id.get_vfd_handle()
        if not os.path.samestat(os.fstat(library_fd), os.fstat(self._fd)):
            raise InputError(self.path, "was replaced while being opened; refusing it")

    def source_identities(self) -> dict[Path, FileIdentity]:
        return {self.path: self._identity}

    @property
    def infos(self) -> list[TensorInfo]:
        return self._infos

    @property
    def metadata(self) -> Mapping[str, str]:
        return self._metadata

    @property
    def non_tensors(self) -> list[NonTensorInfo]:
        return self._non_tensors

    def _fail(self, problem: str, tensor: str | None = None) -> InputError:
        return InputError(self.path, problem, tensor)

    # -- structure ------------------------------------------------------------------------

    def _walk(self) -> tuple[list[Hdf5Node], list[TensorInfo]]:
        """Every object reachable by hard links, depth first in link order."""
        h5py = load_h5py()
        root = self.file["/"]
        nodes = [Hdf5Node("/", "group")]
        infos: list[TensorInfo] = []
        root_key, stored = _object_key(root)
        first_path = {root_key: "/"}
        self._check_headers(stored, "/")
        # An explicit stack: a hostile file may nest groups deeper than Python recursion.
        stack: list[tuple[str, Any, Iterator[Any]]] = [("/", root, self._member_names(root, "/"))]
        budget = limits.object_budget(self._checks.budget_size)
        while stack:
            parent_path, group, names = stack[-1]
            name = next(names, None)
            if name is None:
                stack.pop()
                continue
            if len(nodes) >= budget:
                raise self._fail(
                    f"holds more than {budget} objects, over the budget of one per "
                    f"{limits.BYTES_PER_OBJECT} bytes of {self._checks.budget_words} plus "
                    f"{limits.FREE_OBJECTS}; refusing it (every object costs time to read)"
                )
            path = _join(parent_path, name)
            obj = self._open_hard_link(group, name, path)
            with input_errors(self.path, f"cannot inspect object {path!r}"):
                key, size = _object_key(obj)
            stored += size
            self._check_headers(stored, path)
            if key[0] != root_key[0]:  # names are checked: this is the backstop
                raise self._fail(
                    f"object {path!r} lies in another file; only this file's objects are read"
                )
            if key in first_path:
                raise self._fail(
                    f"object {path!r} is a second hard link to {first_path[key]!r}; "
                    "objects linked more than once are refused"
                )
            first_path[key] = path
            if isinstance(obj, h5py.Group):
                if len(stack) >= limits.MAX_DEPTH:
                    raise self._fail(
                        f"groups nest deeper than {limits.MAX_DEPTH} levels at {path[:80]!r}…"
                    )
                nodes.append(Hdf5Node(path, "group"))
                stack.append((path, obj, self._member_names(obj, path)))
            elif isinstance(obj, h5py.Dataset):
                nodes.append(Hdf5Node(path, "dataset"))
                checked = self._checks.check_dataset(obj, path)
                if isinstance(checked, TensorInfo):
                    infos.append(checked)
                else:
                    self._non_tensors.append(checked)
            elif isinstance(obj, h5py.Datatype):
                nodes.append(Hdf5Node(path, "datatype"))
            else:
                raise self._fail(f"object {path!r} is of an unknown HDF5 object type")
        return nodes, infos

    def _check_headers(self, stored: int, path: str) -> None:
        headers = limits.header_budget(self._checks.budget_size)
        if stored > headers:
            raise self._fail(
                f"its objects' headers and attributes take more than {headers} bytes (at "
                f"{path!r}), over {self._checks.budget_words} plus "
                f"{limits.FREE_HEADER_BYTES >> 20} MiB; refusing it before any is listed"
            )

    def _member_names(self, group: Any, path: str) -> Iterator[str]:
        """The group's link names in its own order (h5py uses creation order if tracked),
        each checked to be one plain path component before anything is opened through it:
        the library reads any name as a path (library.link_name_problem)."""
        with input_errors(self.path, f"cannot list group {path!r}"):
            count = len(group)
            budget = limits.object_budget(self._checks.budget_size)
            if count > budget:  # more links than the file may have objects: not listed
                raise self._fail(
                    f"group {path!r} holds {count} links, over the file's budget of "
                    f"{budget} objects (one per {limits.BYTES_PER_OBJECT} bytes of "
                    f"{self._checks.budget_words} plus {limits.FREE_OBJECTS})"
                )
            names = list(group)
        seen: set[str] = set()
        for name in names:
            if not isinstance(name, str):  # h5py hands back undecodable names as bytes
                raise self._fail(f"group {path!r} has a link name that is not UTF-8: {name!r}")
            problem = link_name_problem(name)
            if problem is not None:
                raise self._fail(
                    f"group {path!r} has a link named {name!r}: {problem}; refused before "
                    "anything is opened through it"
                )
            if name in seen:  # a name lookup finds only one of them: the other is hidden
                raise self._fail(f"group {path!r} lists the link name {name!r} twice")
            seen.add(name)
        return iter(names)

    def _open_hard_link(self, group: Any, name: str, path: str) -> Any:
        """The object behind a hard link; any other kind of link is refused unfollowed."""
        h5py = load_h5py()
        with input_errors(self.path, f"cannot read the link {path!r}"):
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
        with input_errors(self.path, f"cannot open object {path!r}"):
            return group[name]

    # -- datasets -------------------------------------------------------------------------

    def structure(self) -> Structure:
        """The whole file's structure (read once: attributes and non-tensor values)."""
        if self._structure is None:
            self._structure = Structure(origin=self, load=lambda: read_structure(self))
        return self._structure

    def non_tensor_rows(self, item: NonTensorInfo) -> Iterator[RowSlice]:
        """A non-tensor dataset's values, a bounded slice of rows at a time."""
        dataset = self._opened(item.name)
        rows = read_rows(dataset, item, self.largest_heap_object, self._vlen_budget)
        while True:
            with input_errors(self.path, "cannot read the non-tensor dataset", item.name):
                piece = next(rows, None)
            if piece is None:
                return
            yield piece

    def is_unallocated(self, name: str) -> bool:
        """True when the dataset has no storage at all: every element is its fill value."""
        return name in self._checks.unallocated

    def constant(self, info: TensorInfo) -> np.ndarray | None:
        """The fill value of an unallocated tensor (every element is it), read from the
        dataset's creation settings; None for a tensor with stored data."""
        if info.name not in self._checks.fill_only:
            return None
        value = np.zeros((), dtype=info.dtype)
        with input_errors(self.path, "cannot read the fill value", info.name):
            self.dataset(info.name).id.get_create_plist().get_fill_value(value)
        return value

    def _constant_elements(self, info: TensorInfo) -> np.ndarray | None:
        """An unallocated tensor's fill value, once its elements are asked for: charged,
        once per tensor, to the expansion budget that allocated datasets count against at
        opening (a 3 MB file of 10,000 unallocated 64 MiB datasets measures in no time, but
        writing it all out would make 640 GB of it)."""
        value = self.constant(info)
        if value is None or info.name in self._expanded:
            return value
        budget = limits.expansion_budget(self._checks.budget_size)
        total = self._checks.declared_total + self._expanded_bytes + info.nbytes
        if total > budget:
            raise self._fail(
                f"its unallocated datasets would expand to more than {budget} bytes in all "
                f"with the stored ones ({limits.MAX_EXPANSION} times {self._checks.budget_words} "
                f"plus {limits.SPARSE_CHECK_BYTES >> 20} MiB); refusing to expand them "
                "(they are measured from their fill value, and copied to HDF5 unallocated "
                "when unchanged)",
                info.name,
            )
        self._expanded.add(info.name)
        self._expanded_bytes += info.nbytes
        return value

    def expect_all_elements(self) -> None:
        for info in self._infos:
            if info.numel:
                self._constant_elements(info)

    @property
    def lossy_filters(self) -> dict[str, list[int]]:
        """Datasets (by name) stored with filters not known to be lossless, and their codes:
        a copy writes them without those filters, so that it holds the values read."""
        return self._checks.lossy

    # -- metadata -------------------------------------------------------------------------

    def _read_metadata(self) -> dict[str, str]:
        """Root attributes that hold one string (str, or bytes that are UTF-8). A root
        attribute named STRUCTURE_KEY is not metadata: that key is clipcli's own record of
        the HDF5 structure, which a user attribute must never replace or forge; it stays an
        attribute, kept (escaped) inside the recorded structure like any other."""
        h5py = load_h5py()
        attrs = self.file.attrs
        metadata: dict[str, str] = {}
        with input_errors(self.path, "cannot read root attributes"):
            names = list(attrs)
            for name in names:
                if not isinstance(name, str):  # h5py gives names that are not UTF-8 as bytes
                    continue
                if name == STRUCTURE_KEY:
                    continue
                attr = attrs.get_id(name)
                try:
                    dtype = attr.dtype
                except TypeError:  # no NumPy counterpart: certainly not a string
                    continue
                if attr.shape != () or h5py.check_string_dtype(dtype) is None:
                    continue
                text = utf8_text(attrs[name])
                if text is not None:
                    metadata[name] = text
        return metadata

    # -- data -----------------------------------------------------------------------------

    def dataset(self, name: str) -> Any:
        """The h5py Dataset of a tensor (its path was checked to be hard links only)."""
        if name not in self._by_name:
            raise KeyError(name)
        return self._opened(name)

    def _opened(self, name: str) -> Any:
        """A checked dataset, opened with a chunk cache of what its reads need kept
        decoded (DatasetChecks.cache_bytes), not the file's 64 MiB: the library holds a
        decoded chunk at its real size while counting its chunk's, so a cache of many
        small chunks that each decode to megabytes held gigabytes."""
        h5py = load_h5py()
        with input_errors(self.path, "cannot open dataset", name):
            cache = self._checks.cache_bytes.get(name)
            if cache is None:
                return self.file["/" + name]
            access = h5py.h5p.create(h5py.h5p.DATASET_ACCESS)
            access.set_chunk_cache(limits.CHUNK_CACHE_SLOTS, cache, limits.CHUNK_CACHE_W0)
            return h5py.Dataset(h5py.h5d.open(self.file.id, ("/" + name).encode(), dapl=access))

    def chunks(self, info: TensorInfo, chunk_elems: int | None = None) -> Iterator[np.ndarray]:
        if chunk_elems is None:
            chunk_elems = default_chunk_elems(info.dtype)
        if chunk_elems < 1:
            raise ValueError(f"chunk_elems must be positive, got {chunk_elems}")
        if info.numel == 0:
            return
        value = self._constant_elements(info)
        step = aligned_step(info.shape, chunk_elems)
        if value is not None:  # all fill value: made here, not read through the library
            for start in range(0, info.numel, step):
                yield np.full(min(step, info.numel - start), value, dtype=info.dtype)
            return
        if self._held is not None:  # read in order now: the runs' decoded chunks let go
            self._held = None
            give_back_freed_memory()  # the heap keeps them otherwise (system.heap)
        dataset = self.dataset(info.name)
        room = filter_room(dataset, info)
        rows = self._checks.band_rows.get(info.name)
        bands = None if rows is None else BandReader(dataset, info.shape, info.dtype, rows)
        for start in range(0, info.numel, step):
            stop = min(start + step, info.numel)
            with self._reading_elements(info, start, stop, room):
                if bands is not None:
                    piece = bands.piece(start, stop)
                else:
                    piece = self._read_range(dataset, info, start, stop)
            yield piece

    def elements_loader(
        self, info: TensorInfo, start: int, stop: int
    ) -> Callable[[], np.ndarray] | None:
        """Elements [start, stop) in C order, read as hyperslabs: the library decodes the
        chunks they touch, through the dataset's own chunk cache (DatasetChecks.
        cache_bytes: the decoding budget counts that many chunks held at once; a cache of a
        band's chunks for runs shorter than a band held a band of decompression bombs,
        ~4 GB from a 9 MB file, attack s47). None for a tensor read a band at a time: its
        chunks span rows that runs would decode again for each run. An unallocated
        tensor's runs are its fill value, charged (once) when the first run is made, as
        chunks() charges it."""
        if not 0 <= start <= stop <= info.numel:
            raise ValueError(f"elements [{start}, {stop}) are not in tensor {info.name!r}")
        if info.name in self._checks.fill_only:
            return functools.partial(self._fill_run, info, stop - start)
        if info.name in self._checks.band_rows:
            return None
        return functools.partial(self._read_elements, info, start, stop)

    def _fill_run(self, info: TensorInfo, count: int) -> np.ndarray:
        value = self._constant_elements(info)
        assert value is not None  # fill_only: no storage
        return np.full(count, value, dtype=info.dtype)

    def _read_elements(self, info: TensorInfo, start: int, stop: int) -> np.ndarray:
        with self._held_lock:  # one tensor's dataset held open: its chunk cache is reused
            if self._held is None or self._held[0] != info.name:
                self._held = None  # its cache let go before the next one fills
                self._held = info.name, self._opened(info.name)
            dataset = self._held[1]
        with self._reading_elements(info, start, stop, filter_room(dataset, info)):
            return self._read_range(dataset, info, start, stop)

    def _reading_elements(
        self, info: TensorInfo, start: int, stop: int, room: int
    ) -> contextlib.AbstractContextManager[None]:
        """The library's failures reading elements [start, stop) as one line (InputError;
        out of memory where a filter needed `room` bytes)."""
        return input_errors(
            self.path,
            f"cannot read elements [{start}, {stop})",
            info.name,
            reading_data=True,
            filter_room=room,
        )

    @staticmethod
    def _read_range(dataset: Any, info: TensorInfo, start: int, stop: int) -> np.ndarray:
        """Elements [start, stop) in C order, each block read straight into its place in one
        array of the tensor's own dtype and byte order (no per-block copies to concatenate)."""
        out = np.empty(stop - start, dtype=info.dtype)
        offset = 0
        for block in flat_range_blocks(info.shape, start, stop):
            shape_of_block = block_shape(block)
            count = math.prod(shape_of_block)
            target = out[offset : offset + count].reshape(shape_of_block)
            dataset.read_direct(target, source_sel=block or None)  # () is a scalar's whole
            offset += count
        return out

    def read(self, info: TensorInfo) -> np.ndarray:
        """The whole dataset in one HDF5 read (the fast path for small tensors)."""
        value = self._constant_elements(info) if info.numel else None
        if value is not None:
            return np.full(info.shape, value, dtype=info.dtype)
        dataset = self.dataset(info.name)
        out = np.empty(info.shape, dtype=info.dtype)
        if out.size:
            room = filter_room(dataset, info)
            with input_errors(
                self.path, "cannot read data", info.name, reading_data=True, filter_room=room
            ):
                dataset.read_direct(out)
        return out

    def close(self) -> None:
        self._held = None
        try:
            self.file.close()
        finally:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
