"""An HDF5 file rebuilt from a recorded structure (clipcli.formats.hdf5.structure describes
the fields): every node checked field by field and turned into library objects first
(prepare), so that malformed content is refused before anything is created, then created
in order (create_nodes)."""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import clipcli.formats.hdf5.limits as limits
from clipcli.errors import InputError
from clipcli.formats.base import TensorInfo
from clipcli.formats.hdf5.library import load_h5py
from clipcli.formats.hdf5.portable import (
    Json,
    Malformed,
    build_space,
    build_type,
    holds_variable_string,
    space_points,
)
from clipcli.formats.structure import Structure

LAYOUTS = {"compact": 0, "contiguous": 1, "chunked": 2}


@dataclass
class ReadyAttribute:
    name: bytes
    type_id: Any
    space: Any
    values: np.ndarray | None
    memory_type: Any
    raw: bool = True  # values hold the element's bytes as a last axis (else objects)


@dataclass
class ReadyNode:
    """A node checked and turned into library objects, ready to create."""

    path: str
    kind: str
    cset: int
    plist: Any  # group or dataset creation property list (None for a datatype)
    type_id: Any
    space: Any
    attributes: list[ReadyAttribute]
    data: ReadyAttribute | None  # a non-tensor dataset's values
    tensor: bool


def prepare(
    structure: Structure, infos: Sequence[TensorInfo], source: Path
) -> list[ReadyNode] | str:
    """The nodes to create, every field checked; a str says why the structure does not
    fit these tensors (then it is not used). Malformed content is an InputError."""
    try:
        ready = [_prepare_node(node) for node in structure.nodes]
    except (Malformed, KeyError, TypeError, ValueError, binascii.Error) as exc:
        raise InputError(
            source, f"the HDF5 structure recorded in __metadata__ is malformed: {exc}"
        ) from None
    return _check_fit(ready, infos) or ready


def _check_fit(ready: list[ReadyNode], infos: Sequence[TensorInfo]) -> str | None:
    if not ready or ready[0].path != "/" or ready[0].kind != "group":
        return "it does not start at the root group"
    paths = [node.path for node in ready]
    if len(set(paths)) != len(paths):
        return "it lists an object twice"
    seen = {"/"}
    for node in ready[1:]:
        parent = node.path.rpartition("/")[0] or "/"
        name = node.path.rpartition("/")[2]
        if not node.path.startswith("/") or name in ("", ".", "..") or parent not in seen:
            return f"object {node.path!r} does not follow its parent group"
        if node.kind == "group":
            seen.add(node.path)
    tensors = {n.path[1:]: n for n in ready if n.kind == "dataset" and n.tensor}
    if set(tensors) != {info.name for info in infos}:
        return "its datasets are not the checkpoint's tensors"
    for info in infos:
        node = tensors[info.name]
        if tuple(node.space.shape or ()) != info.shape:
            return f"dataset {info.name!r} has another shape than the tensor"
        if node.type_id.get_size() != info.dtype.itemsize or not _same_kind(node, info):
            return f"dataset {info.name!r} has another type than the tensor"
    return None


def _same_kind(node: ReadyNode, info: TensorInfo) -> bool:
    h5t = load_h5py().h5t
    kind = node.type_id.get_class()
    expected = {
        "f": h5t.FLOAT,
        "i": h5t.INTEGER,
        "u": h5t.INTEGER,
        "b": h5t.ENUM,
        "c": h5t.COMPOUND,
    }
    return bool(expected.get(info.dtype.kind) == kind)


def _prepare_node(node: Json) -> ReadyNode:
    h5p = load_h5py().h5p
    kind, path = node["kind"], node["path"]
    cset = node.get("cset", 0)
    if cset not in (0, 1):
        raise Malformed(f"character set {cset!r}")
    attributes = [_prepare_attribute(a) for a in node["attrs"]]
    if len(attributes) > 65535:
        raise Malformed("more than 65,535 attributes on one object")
    if len({attr.name for attr in attributes}) != len(attributes):
        raise Malformed(f"an attribute name repeated on {path!r}")
    plist = type_id = space = data = None
    tensor = False
    if kind == "group":
        plist = h5p.create(h5p.GROUP_CREATE)
        plist.set_link_creation_order(_order_flags(node.get("links")))
        plist.set_attr_creation_order(_order_flags(node.get("attr_order")))
    elif kind == "datatype":
        type_id = build_type(node["type"])
    else:
        type_id = build_type(node["type"])
        space = build_space(node["space"])
        plist = _dataset_plist(node, type_id, space)
        tensor = node["tensor"]
        if not tensor and node.get("data") is not None:
            data = _values(node["type"], node["space"], node["data"], b"")
    return ReadyNode(path, kind, cset, plist, type_id, space, attributes, data, tensor)


def _order_flags(value: object) -> int:
    h5p = load_h5py().h5p
    allowed = {0, h5p.CRT_ORDER_TRACKED, h5p.CRT_ORDER_TRACKED | h5p.CRT_ORDER_INDEXED}
    if value not in allowed or isinstance(value, bool):
        raise Malformed(f"creation order flags {value!r}")
    return int(str(value))


def _dataset_plist(node: Json, type_id: Any, space: Any) -> Any:
    h5p, h5z, h5d = load_h5py().h5p, load_h5py().h5z, load_h5py().h5d
    plist = h5p.create(h5p.DATASET_CREATE)
    layout = LAYOUTS.get(node["layout"])
    if layout is None:
        raise Malformed(f"layout {node['layout']!r}")
    if node["layout"] == "chunked":
        chunks = node["chunks"]
        rank = len(space.shape or ())
        if not isinstance(chunks, list) or len(chunks) != rank or rank == 0:
            raise Malformed("chunk shape")
        if not all(isinstance(c, int) and 1 <= c < 1 << 32 for c in chunks):
            raise Malformed("chunk dimensions")
        if int(np.prod(chunks, dtype=object)) * type_id.get_size() > limits.MAX_CHUNK_BYTES:
            raise Malformed("chunks over the size limit")
        plist.set_chunk(tuple(chunks))
    else:
        plist.set_layout(layout)
    for entry in node["filters"]:
        code, flags, values = entry
        if not isinstance(code, int) or not h5z.filter_avail(code):
            raise Malformed(f"filter {code!r} is not available")
        if not isinstance(values, list) or len(values) > 64:
            raise Malformed("filter parameters")
        plist.set_filter(code, int(flags), tuple(int(v) for v in values))
    if node.get("fill") is not None:
        dtype = _numeric_dtype(node["type"])
        raw = base64.b64decode(node["fill"], validate=True)
        if len(raw) != dtype.itemsize:
            raise Malformed("fill value size")
        plist.set_fill_value(np.frombuffer(raw, dtype=dtype).reshape(()).copy())
    fill_times = {h5d.FILL_TIME_ALLOC, h5d.FILL_TIME_NEVER, h5d.FILL_TIME_IFSET}
    alloc_times = {
        h5d.ALLOC_TIME_DEFAULT,
        h5d.ALLOC_TIME_EARLY,
        h5d.ALLOC_TIME_LATE,
        h5d.ALLOC_TIME_INCR,
    }
    if node["fill_time"] not in fill_times or node["alloc_time"] not in alloc_times:
        raise Malformed("fill or allocation time")
    plist.set_fill_time(node["fill_time"])
    plist.set_alloc_time(node["alloc_time"])
    plist.set_attr_creation_order(_order_flags(node["attr_order"]))
    plist.set_obj_track_times(bool(node["track_times"]))
    return plist


def _numeric_dtype(desc: Json) -> np.dtype[Any]:
    kind = {"int": "i" if desc.get("signed") else "u", "float": "f"}[desc["class"]]
    return np.dtype(f"{desc['order']}{kind}{desc['size']}")


def _prepare_attribute(attr: Json) -> ReadyAttribute:
    name = attr["name"]
    if not isinstance(name, str) or not name or len(name.encode("utf-8")) > 65534:
        raise Malformed(f"attribute name {name!r}")
    values = _values(attr["type"], attr["space"], attr["data"], name.encode("utf-8"))
    return values


def _values(type_desc: Json, space_desc: Json, data: object, name: bytes) -> ReadyAttribute:
    """Type, dataspace and the values in a buffer of exactly the size they need."""
    h5py = load_h5py()
    type_id = build_type(type_desc)
    space = build_space(space_desc)
    points = space_points(space_desc)
    if data is None:
        if points:
            raise Malformed("values missing")
        return ReadyAttribute(name, type_id, space, None, type_id)
    if not isinstance(data, dict):
        raise Malformed("values are not an object")
    shape = tuple(space_desc.get("shape", ()))
    if holds_variable_string(type_desc):
        strings = data.get("strings")
        if not isinstance(strings, list) or len(strings) != points:
            raise Malformed("the number of strings does not match the dataspace")
        dtype = h5py.string_dtype(encoding="utf-8" if type_desc["cset"] == 1 else "ascii")
        values = np.empty(points, dtype=dtype)
        for index, item in enumerate(strings):
            values[index] = _string_bytes(item)
        memory_type = h5py.h5t.py_create(dtype)
        return ReadyAttribute(name, type_id, space, values.reshape(shape), memory_type, raw=False)
    raw_text = data.get("raw")
    if not isinstance(raw_text, str):
        raise Malformed("raw values are not base64 text")
    raw = base64.b64decode(raw_text, validate=True)
    size = int(type_id.get_size())
    if len(raw) != points * size:
        raise Malformed(f"{len(raw)} bytes of values for {points} elements of {size} bytes")
    values = np.frombuffer(raw, dtype=np.uint8).reshape((*shape, size)).copy()
    return ReadyAttribute(name, type_id, space, values, type_id.copy())


def _string_bytes(item: object) -> bytes:
    if isinstance(item, str):
        return item.encode("utf-8")
    if isinstance(item, dict) and isinstance(item.get("b64"), str):
        return base64.b64decode(item["b64"], validate=True)
    raise Malformed("a string that is neither text nor {'b64': ...}")


def create_nodes(file: Any, ready: Sequence[ReadyNode]) -> None:
    """Create every node in order, with its attributes and any non-tensor values."""
    h5py = load_h5py()
    h5p = h5py.h5p
    for node in ready:
        if node.path == "/":
            obj_id = file["/"].id
        else:
            parent, _, name = node.path.rpartition("/")
            parent_id = file[parent or "/"].id
            lcpl = h5p.create(h5p.LINK_CREATE)
            lcpl.set_char_encoding(node.cset)
            link = name.encode("utf-8")
            if node.kind == "group":
                obj_id = h5py.h5g.create(parent_id, link, lcpl=lcpl, gcpl=node.plist)
            elif node.kind == "datatype":
                node.type_id.commit(parent_id, link, lcpl=lcpl)
                obj_id = file[node.path].id
            else:
                obj_id = h5py.h5d.create(
                    parent_id, link, node.type_id, node.space, dcpl=node.plist, lcpl=lcpl
                )
                if node.data is not None:
                    _write_values(obj_id, node.data)
        for attr in node.attributes:
            created = h5py.h5a.create(obj_id, attr.name, attr.type_id, attr.space)
            if attr.values is not None and attr.values.size:
                created.write(attr.values, mtype=attr.memory_type)


def _write_values(dataset_id: Any, data: ReadyAttribute) -> None:
    h5s = load_h5py().h5s
    values = data.values
    if values is None or not values.size:
        return
    shape = values.shape[:-1] if data.raw else values.shape
    memory_space = h5s.create_simple(shape) if shape else h5s.create(h5s.SCALAR)
    dataset_id.write(memory_space, dataset_id.get_space(), values, data.memory_type)
