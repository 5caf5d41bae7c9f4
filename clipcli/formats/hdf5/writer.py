"""The HDF5 writer. With an HDF5 source it replicates the source file: every group,
dataset and named datatype with its creation settings (chunks, filters, fill value,
orders) and every attribute with its exact HDF5 type; non-tensor datasets are copied as
they are. Otherwise each tensor becomes a contiguous dataset at its name's path."""

from __future__ import annotations

import contextlib
import errno
import math
import os
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np

import clipcli.formats.hdf5.limits as limits
from clipcli.dtypes import from_ml_dtypes
from clipcli.errors import InputError, WriteError
from clipcli.formats.base import (
    Checkpoint,
    Reader,
    TensorInfo,
    Writer,
    numpy_size_overflows,
    rank_problem,
    utf8_encodable,
)
from clipcli.formats.hdf5.filters import describe_lossy
from clipcli.formats.hdf5.geometry import band_chunks, block_shape, flat_range_blocks
from clipcli.formats.hdf5.library import (
    input_errors,
    load_h5py,
    reason,
)
from clipcli.formats.hdf5.reader import Hdf5Reader
from clipcli.formats.hdf5.record_check import ReadyNode, check_attribute_budget, prepare
from clipcli.formats.hdf5.record_rebuild import (
    added_metadata,
    create_nodes,
    follow_metadata,
    root_texts,
)
from clipcli.formats.hdf5.replica import Replica, split_path
from clipcli.formats.structure_record import STRUCTURE_KEY
from clipcli.system.address_space import HDF5_BYTES, check_room

HDF5_MAX_ATTRIBUTES = 65535  # attributes per object when creation order is tracked
HDF5_MAX_ATTRIBUTE_NAME_BYTES = 65534  # plus the terminating NUL: a 16-bit length


def _dataset_path_problem(name: str) -> str | None:
    """Why a tensor name cannot be used as an HDF5 dataset path, or None."""
    if name.startswith("/"):
        return "it starts with '/'"
    parts = name.split("/")
    if any(part == "" for part in parts):
        return "it has an empty path component"
    for dots in (".", ".."):
        if dots in parts:
            return f"it has a {dots!r} path component"
    return None


def _input_bytes(source: Reader) -> int:
    """The size of the files a reader takes its data from (as opened): what a recorded
    structure's budgets are relative to."""
    return sum(identity.size for identity in source.source_identities().values())


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
        self.check_tensors(checkpoint.infos)
        # The source's structure decides the skeleton: an HDF5 source (the structure's
        # origin) is replicated object by object; a structure recorded in another format
        # (safetensors __metadata__) is rebuilt; otherwise a plain layout.
        structure = checkpoint.source.structure() if checkpoint.source is not None else None
        # Structure.origin is declared as set by the HDF5 reader only (its open file).
        origin = structure.origin if structure is not None else None
        self._source: Hdf5Reader | None = cast("Hdf5Reader | None", origin)
        self._rebuild: list[ReadyNode] | None = None
        if self._source is None and structure is not None and checkpoint.source is not None:
            source = checkpoint.source
            ready = prepare(structure, checkpoint.infos, source.path, _input_bytes(source))
            self._rebuild = ready if isinstance(ready, list) else None
            if self._rebuild is not None:
                recorded = structure.nodes[0].get("attrs") or []
                follow_metadata(self._rebuild[0], recorded, checkpoint.metadata, STRUCTURE_KEY)
                check_attribute_budget(
                    self._rebuild, self._added_metadata(self._rebuild[0]).values(), source.path
                )
        self._written: set[str] = set()
        self.file: Any = self._create_file()
        try:
            if self._source is not None:
                self._copy_structure(self._source)
            elif self._rebuild is not None:
                source_path = checkpoint.source.path if checkpoint.source else path
                with self._failing_quietly():
                    try:
                        create_nodes(self.file, self._rebuild)
                    except Exception as exc:
                        if _is_disk_failure(exc):
                            raise
                        raise InputError(
                            source_path,
                            f"cannot rebuild the recorded HDF5 structure: {reason(exc)}",
                        ) from None
                for key, value in self._added_metadata(self._rebuild[0]).items():
                    self.file.attrs[key] = value
            else:
                self._create_plain_layout()
        except BaseException:
            # The first failure is the one to report: the library, after it, may fail
            # again at close ("Can't decrement id ref count"), which must not mask it.
            self.abort()
            raise

    @classmethod
    def check_name(cls, name: str) -> str | None:
        parts = name.split("/")
        if name.startswith("/") or "" in parts or "." in parts or ".." in parts:
            return (
                "an HDF5 dataset path needs non-empty components, no '.' or '..' and no leading '/'"
            )
        # Each component but the last is a group; the reader refuses groups nested deeper
        # than MAX_DEPTH, so a path of more components would not read back.
        if len(parts) > limits.MAX_DEPTH:
            return (
                f"an HDF5 dataset path has at most {limits.MAX_DEPTH} components (groups nest "
                f"at most {limits.MAX_DEPTH - 1} deep under the root), and this one has "
                f"{len(parts)}"
            )
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
    def structure_losses(cls, source: Reader) -> list[str]:
        structure = source.structure()
        if structure is None or structure.origin is not None:
            return []  # nothing to keep, or replicated object by object
        ready = prepare(structure, source.infos, source.path, _input_bytes(source))
        if isinstance(ready, str):
            return [f"the HDF5 structure recorded in the input ({ready})"]
        return []

    @classmethod
    def copies_constants(cls, source: Reader) -> bool:
        structure = source.structure()
        return structure is not None and structure.origin is not None  # see copy_unchanged

    @classmethod
    def structure_notes(cls, source: Reader) -> list[str]:
        structure = source.structure()
        origin = structure.origin if structure is not None else None
        lossy = cast("Hdf5Reader", origin).lossy_filters if origin is not None else {}
        if not lossy:
            return []
        return [
            "written without the HDF5 filters that would change their values, so that OUT "
            f"holds the values measured: {describe_lossy(lossy)}"
        ]

    @classmethod
    def check_metadata(cls, metadata: Mapping[str, str], source: Reader) -> str | None:
        structure = source.structure() if source is not None else None
        if structure is not None and structure.origin is not None:
            return None  # copied attribute by attribute, with the source's own settings
        metadata = {k: v for k, v in metadata.items() if k != STRUCTURE_KEY}
        # A value the record's own root attribute shows is written as recorded, in its
        # exact type (a NUL-padded string may hold a NUL): only the others are written
        # as plain strings (record_rebuild.follow_metadata).
        recorded = root_texts(structure.nodes) if structure is not None else {}
        plain = {k: v for k, v in metadata.items() if recorded.get(k) != v}
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
            if key in plain and ("\x00" in value or not utf8_encodable(value)):
                return f"metadata key {key!r}: HDF5 strings hold no NUL byte and only UTF-8"
        # Each value is a variable-length string in the global heap, and the reader bounds
        # what attributes may read by their count times the largest heap object.
        largest = max((len(value.encode()) for value in plain.values()), default=0)
        if len(plain) * largest > limits.MAX_ATTRIBUTE_BYTES:
            return (
                f"{len(metadata)} metadata values of up to {largest} bytes would be over the "
                f"{limits.MAX_ATTRIBUTE_BYTES >> 20} MiB the HDF5 reader allows attributes "
                "(count x largest value)"
            )
        return None

    @classmethod
    def check_dtype(cls, info: TensorInfo) -> str | None:
        dtype = info.dtype
        if from_ml_dtypes(dtype) or dtype.kind == "V":  # ml_dtypes' types, or opaque bytes
            return f"HDF5 cannot hold {dtype.name}; write .safetensors instead"
        return None

    @classmethod
    def check_shape(cls, info: TensorInfo) -> str | None:
        """HDF5 holds at most 32 dimensions (H5S_MAX_RANK: h5py's create_dataset refuses
        more, "Dimensionality is too large"); h5py reads through numpy."""
        if (problem := rank_problem(len(info.shape), limits.MAX_RANK, "HDF5")) is not None:
            return problem
        if numpy_size_overflows(info.shape, info.dtype.itemsize):
            return f"h5py cannot read shape {list(info.shape)} back (numpy's size limit)"
        return super().check_shape(info)

    # -- skeleton -------------------------------------------------------------------------

    def _create_file(self) -> Any:
        """A new file whose root group orders links and attributes as the source's did."""
        h5py = load_h5py()
        h5f, h5p = h5py.h5f, h5py.h5p
        create_plist = h5p.create(h5p.FILE_CREATE)
        if self._source is not None:
            with input_errors(self._source.path, "cannot read the root group's settings"):
                root_plist = self._source.file["/"].id.get_create_plist()
                create_plist.set_link_creation_order(root_plist.get_link_creation_order())
                create_plist.set_attr_creation_order(root_plist.get_attr_creation_order())
        elif self._rebuild is not None:  # the recorded root group's orders
            root_plist = self._rebuild[0].plist
            create_plist.set_link_creation_order(root_plist.get_link_creation_order())
            create_plist.set_attr_creation_order(root_plist.get_attr_creation_order())
        else:  # keep the checkpoint's tensor order when read back
            order = h5p.CRT_ORDER_TRACKED | h5p.CRT_ORDER_INDEXED
            create_plist.set_link_creation_order(order)
            create_plist.set_attr_creation_order(order)
        access_plist = h5p.create(h5p.FILE_ACCESS)
        access_plist.set_fclose_degree(h5f.CLOSE_STRONG)
        access_plist.set_cache(
            0, limits.CHUNK_CACHE_SLOTS, limits.CHUNK_CACHE_BYTES, limits.CHUNK_CACHE_W0
        )
        check_room(HDF5_BYTES, "writing an HDF5 file")  # HDF5 crashes where malloc fails
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
        Replica(self.file, source, self._failing_quietly).copy_all()
        self._update_metadata(source)

    def _update_metadata(self, source: Hdf5Reader) -> None:
        """Root string attributes for metadata the caller changed; the rest was copied."""
        attrs = self.file.attrs
        for key, value in self.checkpoint.metadata.items():
            if source.metadata.get(key) != value:
                if key in attrs:
                    del attrs[key]
                attrs[key] = value

    def _add_metadata(self) -> None:
        """The checkpoint's metadata as root string attributes (the record's key excepted)."""
        for key, value in self.checkpoint.metadata.items():
            if key != STRUCTURE_KEY:
                self.file.attrs[key] = value

    def _added_metadata(self, root: ReadyNode) -> dict[str, str]:
        return added_metadata(root, self.checkpoint.metadata, STRUCTURE_KEY)

    def _create_plain_layout(self) -> None:
        """A dataset per tensor at its name's path, contiguous and uncompressed."""
        self._add_metadata()
        for info in self.checkpoint.infos:
            problem = _dataset_path_problem(info.name)
            if problem is not None:
                raise WriteError(f"tensor {info.name!r} cannot be an HDF5 dataset: {problem}")
            parent_path, name = split_path("/" + info.name)
            try:
                parent = self._require_group(parent_path)
                parent.create_dataset(name, shape=info.shape, dtype=info.dtype)
            except (ValueError, KeyError, TypeError) as exc:  # a name clash with another tensor
                raise WriteError(
                    f"tensor {info.name!r} cannot be an HDF5 dataset: {reason(exc)}"
                ) from None

    def _require_group(self, path: str) -> Any:
        """The group at path, creating missing ones so that they keep insertion order."""
        group = self.file["/"]
        for name in [part for part in path.split("/") if part]:
            if name not in group:
                group.create_group(name, track_order=True)
            group = group[name]
            if not isinstance(group, load_h5py().Group):
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
        dataset = self._opened_for_writing(info)
        if dataset.shape != info.shape:
            raise ValueError(f"tensor {info.name!r} has shape {info.shape}, not {dataset.shape}")
        position = 0
        for chunk in chunks:
            # Cast with NumPy's rules (round to nearest, overflow to inf), as other writers do.
            flat = np.ascontiguousarray(chunk, dtype=info.dtype).reshape(-1)
            end = position + flat.size
            offset = 0
            for block in flat_range_blocks(info.shape, position, end):
                shape_of_block = block_shape(block)
                count = math.prod(shape_of_block)
                piece = flat[offset : offset + count].reshape(shape_of_block)
                dataset.write_direct(piece, dest_sel=block or None)
                offset += count
            position = end
        if position != info.numel:
            raise ValueError(f"tensor {info.name!r} got {position} of {info.numel} elements")
        dataset.id.flush()  # a full disk shows here, not later in a destructor
        self._written.add(info.name)

    def _opened_for_writing(self, info: TensorInfo) -> Any:
        """The tensor's dataset, chunked ones opened with a chunk cache of the chunks that
        writing it in C-order pieces fills at once (geometry.band_chunks), not the file's
        64 MiB: row chunks of a [2, 2**25] held 64 MiB of them, half-compressed. Where two
        bands of chunks are over 64 MiB, one band and a chunk, up to MAX_BAND_BYTES (a
        band the reader reads whole): the cache lets go of chunks written in part
        (CHUNK_CACHE_W0), and a chunk let go is read, decoded and encoded again for each
        piece that crosses it."""
        h5py = load_h5py()
        dataset = self.file["/" + info.name]
        chunks = dataset.chunks
        if chunks is None:
            return dataset
        # Closed first: the library ignores the cache asked for by a second open of a
        # dataset already open, and gives the first open's.
        del dataset
        chunk_bytes = math.prod(chunks) * info.dtype.itemsize
        band = band_chunks(info.shape, chunks)
        cache = min(limits.CHUNK_CACHE_BYTES, band * chunk_bytes)
        if cache < band * chunk_bytes:
            one_band = (band // 2 + 1) * chunk_bytes
            cache = max(cache, min(one_band, limits.MAX_BAND_BYTES + chunk_bytes))
        access = h5py.h5p.create(h5py.h5p.DATASET_ACCESS)
        access.set_chunk_cache(limits.CHUNK_CACHE_SLOTS, cache, limits.CHUNK_CACHE_W0)
        return h5py.Dataset(h5py.h5d.open(self.file.id, ("/" + info.name).encode(), dapl=access))

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
        if original.chunks is None or info.name in self._source.lossy_filters:
            return False  # stored chunks are valid only under the very same filters
        copy = self.file["/" + info.name]
        with input_errors(source.path, "cannot list stored chunks", info.name):
            offsets = _stored_chunk_offsets(original.id)
        with self._failing_quietly():
            for offset in offsets:
                with input_errors(source.path, f"cannot read stored chunk {offset}", info.name):
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
        if self._rebuild is not None:
            self._check_reads_back()

    def _check_reads_back(self) -> None:
        """A file rebuilt from a record is opened with the HDF5 reader (every check it makes
        on a stranger's file) before the commit. The record's own checks bound what is
        known before writing; what only the written file shows (chunks compressed so well
        that OUT is too small for their number, a dataset stored over 200-fold smaller
        than it declares) is refused here: clipcli writes nothing it would refuse to read."""
        source = self.checkpoint.source
        try:
            Hdf5Reader(self.path, shown_as=Path("OUT")).close()
        except InputError as exc:
            raise InputError(
                source.path if source is not None else self.path,
                "the HDF5 structure recorded in __metadata__ makes an HDF5 file that clipcli "
                f"would refuse to read back ({exc})",
            ) from None

    def abort(self) -> None:
        self._silence()
        with contextlib.suppress(Exception):
            self.file.close()


_DISK_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO, errno.EROFS}


def _is_disk_failure(exc: BaseException) -> bool:
    """A failure of the output's storage (exit 5), not of what is being written."""
    converted = _with_errno(exc)
    return isinstance(converted, OSError) and converted.errno in _DISK_ERRNOS


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
