"""The HDF5 writer's copy of an HDF5 source, object by object: each group, dataset and named
datatype created with the source's own creation settings (chunks, lossless filters, fill
value, orders, link character set), each attribute with its exact HDF5 type, and non-tensor
datasets copied value for value. Tensor data is written afterwards by the writer."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import numpy as np

from clipcli.errors import InputError
from clipcli.formats.base import NonTensorInfo
from clipcli.formats.hdf5.library import holds_references, input_errors, load_h5py, name_bytes
from clipcli.formats.hdf5.nontensor import write_rows
from clipcli.formats.hdf5.reader import Hdf5Node, Hdf5Reader


@dataclass
class _AttributeCopy:
    """An attribute read from the source: its exact HDF5 type, dataspace and raw values."""

    name: bytes
    type_id: Any
    space: Any
    values: np.ndarray | None  # None for an empty (null) dataspace
    memory_type: Any


def split_path(path: str) -> tuple[str, str]:
    parent, _, name = path.rpartition("/")
    return parent or "/", name


class Replica:
    """Fills `file` with the structure of `source`; `quietly` wraps writes so that a
    failure (a full disk) leaves the library quiet (see Hdf5Writer._failing_quietly)."""

    def __init__(
        self,
        file: Any,
        source: Hdf5Reader,
        quietly: Callable[[], AbstractContextManager[None]],
    ) -> None:
        self.file = file
        self._source = source
        self._quietly = quietly

    def copy_all(self) -> None:
        source = self._source
        non_tensors = {item.name: item for item in source.non_tensors}
        for node in source.nodes:
            with input_errors(source.path, f"cannot copy object {node.path!r}"):
                original = source.file[node.path]
            copy = self.file["/"] if node.path == "/" else self._create_like(source, original, node)
            self._copy_attributes(source, original, copy, node.path)
            item = non_tensors.get(node.path[1:]) if node.kind == "dataset" else None
            if item is not None:
                self._copy_non_tensor(source, item, copy)

    def _copy_non_tensor(self, source: Hdf5Reader, item: NonTensorInfo, copy: Any) -> None:
        """A dataset that is not a tensor, copied value for value with its own type."""
        if not item.copyable:
            raise InputError(
                source.path,
                "holds HDF5 references, which cannot be copied to another file",
                item.name,
            )
        rank = 0 if item.shape is None else len(item.shape)
        with self._quietly():
            for piece in source.non_tensor_rows(item):
                write_rows(copy.id, piece, rank)

    def _create_like(self, source: Hdf5Reader, original: Any, node: Hdf5Node) -> Any:
        """An object at node.path with the original's creation settings (not its data)."""
        h5py = load_h5py()
        parent_path, name = split_path(node.path)
        parent_id, link_name = self.file[parent_path].id, name_bytes(name)
        with input_errors(source.path, f"cannot read the settings of {node.path!r}"):
            link_plist = self._link_plist(source.file[parent_path], name)
            if node.kind == "group":
                group_plist = original.id.get_create_plist()  # link/attribute ordering
            elif node.kind == "dataset":
                # Layout, chunks, filters (compression, shuffle, fletcher32, scaleoffset,
                # ...), fill value and attribute ordering all live in this property list.
                dataset_plist = original.id.get_create_plist()
                # ...except a filter not known to be lossless: the copy holds the values
                # read and measured, not what the filter would turn them into.
                for code in source.lossy_filters.get(node.path[1:], ()):
                    dataset_plist.remove_filter(code)
                type_id = original.id.get_type().copy()  # a copy is never a committed type
                space = original.id.get_space()  # shape and maxshape
            else:
                type_id = original.id.copy()
        if node.kind == "group":
            h5py.h5g.create(parent_id, link_name, lcpl=link_plist, gcpl=group_plist)
        elif node.kind == "dataset":
            h5py.h5d.create(
                parent_id, link_name, type_id, space, dcpl=dataset_plist, lcpl=link_plist
            )
        else:
            type_id.commit(parent_id, link_name, lcpl=link_plist)
        return self.file[node.path]

    def _link_plist(self, source_parent: Any, name: str) -> Any:
        """A link creation property list with the source link's character set."""
        h5p = load_h5py().h5p
        link_plist = h5p.create(h5p.LINK_CREATE)
        link_plist.set_create_intermediate_group(False)
        cset = source_parent.id.links.get_info(name_bytes(name)).cset
        link_plist.set_char_encoding(cset)
        return link_plist

    def _copy_attributes(self, source: Hdf5Reader, original: Any, copy: Any, path: str) -> None:
        """Attributes in the source's order, with their exact HDF5 types (fixed-length byte
        strings stay fixed-length, padding and character set included)."""
        with input_errors(source.path, f"cannot list the attributes of {path!r}"):
            names = list(original.attrs)
        for name in names:
            attribute = self._read_attribute(source, original, name, path)
            h5a = load_h5py().h5a
            created = h5a.create(copy.id, attribute.name, attribute.type_id, attribute.space)
            if attribute.values is not None:
                created.write(attribute.values, mtype=attribute.memory_type)

    def _read_attribute(
        self, source: Hdf5Reader, original: Any, name: str | bytes, path: str
    ) -> _AttributeCopy:
        h5py = load_h5py()
        with input_errors(source.path, f"cannot read attribute {name!r} of {path!r}"):
            attr = original.attrs.get_id(name)
            type_id = attr.get_type().copy()
            if holds_references(type_id):
                raise InputError(
                    source.path,
                    f"attribute {name!r} of {path!r} holds HDF5 references, which cannot "
                    "be copied to another file",
                )
            space = attr.get_space()
            dtype = attr.dtype
            memory_type = h5py.h5t.py_create(dtype)
            if space.get_simple_extent_type() == h5py.h5s.NULL:
                return _AttributeCopy(name_bytes(name), type_id, space, None, memory_type)
            shape = attr.shape
            if dtype.subdtype is not None:  # NumPy has no array-typed elements: unfold them
                dtype, inner_shape = dtype.subdtype
                shape = shape + inner_shape
            # Read without h5py's str decoding: variable-length strings stay raw bytes.
            values = np.zeros(shape, dtype=dtype)
            attr.read(values, mtype=memory_type)
        return _AttributeCopy(name_bytes(name), type_id, space, values, memory_type)
