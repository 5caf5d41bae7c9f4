"""An HDF5 file's structure as a portable document (clipcli.formats.structure_record), and an
HDF5 file rebuilt from one.

Node fields (version 1), in the file's own walk order:
- every node: "path" (absolute), "kind" (group, dataset, datatype), "cset" (the link
  name's character set), "attrs": [{"name", "type", "space", "data"}] in the object's
  attribute order.
- group: "links" and "attr_order" (creation-order flags); the root's come from the file.
- dataset: "type", "space", "layout" (compact, contiguous, chunked), "chunks", "filters"
  ([[code, flags, [values]]], lossless filters only: clipcli.formats.hdf5.filters), "fill"
  (base64 of the fill value, numeric types only),
  "fill_time", "alloc_time", "attr_order", "track_times", "tensor" (true: the data is the
  tensor of that name; false: "data" holds it).
- datatype: "type".
Types and dataspaces are described by clipcli.formats.hdf5.portable. "data" is
{"raw": base64 of the values in the file's own type} or {"strings": [...]} for
variable-length strings (each a str when the bytes are UTF-8, else {"b64": ...}), or null
for an empty dataspace.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

import clipcli.formats.hdf5.limits as limits
from clipcli.formats.base import NonTensorInfo, TensorInfo
from clipcli.formats.hdf5.filters import is_lossless
from clipcli.formats.hdf5.library import input_errors, load_h5py
from clipcli.formats.hdf5.nontensor import RowSlice
from clipcli.formats.hdf5.portable import (
    Json,
    Unportable,
    describe_space,
    describe_type,
    holds_variable_string,
    space_points,
)
from clipcli.formats.structure_record import (
    MAX_STRUCTURE_BYTES,
    STRUCTURE_FORMAT,
    STRUCTURE_KEY,
    STRUCTURE_VERSION,
    Structure,
)
from clipcli.system import interrupts


class Hdf5Source(Protocol):
    """What read_structure needs of the HDF5 reader (which imports this module)."""

    path: Path
    file: Any

    @property
    def nodes(self) -> Sequence[Any]: ...  # Hdf5Node: .path, .kind

    @property
    def non_tensors(self) -> list[NonTensorInfo]: ...

    @property
    def infos(self) -> list[TensorInfo]: ...

    @property
    def metadata(self) -> Mapping[str, str]: ...

    def non_tensor_rows(self, item: NonTensorInfo) -> Iterator[RowSlice]: ...


# ---------------------------------------------------------------------- reading


class _OverCap(Exception):
    pass


class _Recorded:
    """What the record's values will take encoded, at least, so far: past the cap the
    record can never be kept, so reading stops there rather than after encoding all of it
    (six 40 MiB attributes of zeros in a 1.2 MB .keras took 1.44 GB to encode first)."""

    def __init__(self) -> None:
        self.bytes = 0

    def add(self, encoded: int) -> None:
        self.bytes += encoded
        if self.bytes > MAX_STRUCTURE_BYTES:
            raise _OverCap

    def add_raw(self, raw: int) -> None:
        """raw bytes, recorded in base64: 4 characters per 3 bytes."""
        self.add(raw * 4 // 3)


def read_structure(reader: Hdf5Source) -> Structure:
    """Every node of the reader's file, with what could not be described listed apart."""
    dropped: list[str] = []
    non_tensors = {item.name: item for item in reader.non_tensors}
    nodes: list[Json] = []
    recorded = _Recorded()
    for node in reader.nodes:
        with input_errors(reader.path, f"cannot read object {node.path!r}"):
            obj = reader.file[node.path]
            try:
                described = _describe_node(
                    reader, obj, node.path, node.kind, non_tensors, dropped, recorded
                )
            except _OverCap:
                return Structure(
                    None,
                    [
                        f"the HDF5 structure (its values alone over the {MAX_STRUCTURE_BYTES}"
                        "-byte cap, encoded)"
                    ],
                    origin=reader,
                )
        if described is not None:
            nodes.append(described)
    document = {"format": STRUCTURE_FORMAT, "version": STRUCTURE_VERSION, "nodes": nodes}
    structure = Structure(document, dropped, origin=reader)
    size = len(structure.to_text().encode("utf-8"))
    if size > MAX_STRUCTURE_BYTES:
        return Structure(
            None,
            [f"the HDF5 structure ({size} bytes encoded, over the {MAX_STRUCTURE_BYTES}-byte cap)"],
            origin=reader,
        )
    if _whole_record_problem(structure, reader, size) is None:
        return structure
    # Some part breaks a reading rule: each is checked alone, those outside are dropped.
    nodes = _within_the_rules(nodes, dropped)
    document = {"format": STRUCTURE_FORMAT, "version": STRUCTURE_VERSION, "nodes": nodes}
    structure = Structure(document, dropped, origin=reader)
    problem = _whole_record_problem(structure, reader, len(structure.to_text().encode("utf-8")))
    if problem is not None:
        return Structure(None, [f"the HDF5 structure ({problem})"], origin=reader)
    return structure


# ---------------------------------------------------------------------- the reading rules
#
# A record is read back by clipcli.formats.hdf5.record_check, which refuses one that breaks
# any of its rules (a forged record is malformed). So a record is checked by those same
# rules before it is kept: whole first (what reading it back will do), and where that
# fails each node and attribute alone, dropping and naming those outside the rules as any
# other part that cannot be recorded, then whole again (the budgets: past them, the whole
# record is dropped). An .h5 with a 2 MB fixed-length string attribute had clipped to
# safetensors with exit 0 and no word, and converting that OUT back was then exit 3
# (THREAT_MODEL item 22).


def _within_the_rules(nodes: list[Json], dropped: list[str]) -> list[Json]:
    """The nodes and attributes that record_check takes one by one; the others named in
    `dropped`. A group's own fields are flags any record may hold (and its children
    need it): a failing group is left for the whole record's check to refuse."""
    kept = []
    for node in nodes:
        path = node["path"]
        attributes = []
        for attribute in node["attrs"]:
            problem = _attribute_problem(attribute)
            if problem is None:
                attributes.append(attribute)
            else:
                dropped.append(f"attribute {attribute['name']!r} of {path!r} ({problem})")
        node = {**node, "attrs": attributes}
        problem = None if node["kind"] == "group" else _node_problem(node)
        if problem is None:
            kept.append(node)
        else:
            what = "named datatype" if node["kind"] == "datatype" else node["kind"]
            dropped.append(f"{what} {path!r} ({problem})")
    return kept


def _attribute_problem(attribute: Json) -> str | None:
    """Why record_check would refuse this attribute of a record, or None."""
    from clipcli.formats.hdf5 import record_check

    try:
        record_check.prepare_attribute(attribute)
    except record_check.REFUSALS as exc:
        return f"outside what a structure record may hold: {exc}"
    return None


def _node_problem(node: Json) -> str | None:
    """The same for a node's own fields (its attributes are checked one by one)."""
    from clipcli.formats.hdf5 import record_check

    try:
        record_check.prepare_node({**node, "attrs": []})
    except record_check.REFUSALS as exc:
        return f"outside what a structure record may hold: {exc}"
    return None


def _whole_record_problem(structure: Structure, reader: Hdf5Source, size: int) -> str | None:
    """The rules over the whole record (the tree, the chunk and allocation budgets), taken
    against the smallest OUT that can hold it, the tensors' bytes and the record itself:
    its budgets grow with the size of the file it is read back from."""
    from clipcli.formats.hdf5 import record_check, record_rebuild

    metadata = reader.metadata  # what OUT's __metadata__ will hold beside the record
    recorded = structure.nodes[0]["attrs"] if structure.nodes else []

    def follow_root(root: record_check.ReadyNode) -> dict[str, str]:
        record_rebuild.follow_metadata(root, recorded, metadata, STRUCTURE_KEY)
        return record_rebuild.added_metadata(root, metadata, STRUCTURE_KEY)

    infos = reader.infos
    problem = record_check.record_problem(
        structure, infos, size + sum(info.nbytes for info in infos), follow_root
    )
    return None if problem is None else f"outside what a structure record may hold: {problem}"


def _describe_node(
    reader: Hdf5Source,
    obj: Any,
    path: str,
    kind: str,
    non_tensors: dict[str, NonTensorInfo],
    dropped: list[str],
    recorded: _Recorded,
) -> Json | None:
    node: Json = {"path": path, "kind": kind, "cset": _link_cset(reader, path)}
    if kind == "group":
        plist = obj.id.get_create_plist()
        node["links"] = int(plist.get_link_creation_order())
        node["attr_order"] = int(plist.get_attr_creation_order())
    elif kind == "datatype":
        try:
            node["type"] = describe_type(obj.id)
        except Unportable as exc:
            dropped.append(f"named datatype {path!r} ({exc})")
            return None
    else:
        item = non_tensors.get(path[1:])
        try:
            node.update(_describe_dataset(obj))
            if item is not None:
                node["data"] = _dataset_data(reader, item, node["type"], recorded)
        except Unportable as exc:
            dropped.append(f"dataset {path!r} ({exc})")
            return None
        node["tensor"] = item is None
    node["attrs"] = _describe_attributes(obj, path, dropped, recorded)
    return node


def _link_cset(reader: Hdf5Source, path: str) -> int:
    if path == "/":
        return 0
    parent, _, name = path.rpartition("/")
    group = reader.file[parent or "/"]  # kept alive: the link proxy does not hold it
    return int(group.id.links.get_info(name.encode("utf-8")).cset)


def _describe_dataset(dataset: Any) -> Json:
    h5d = load_h5py().h5d
    plist = dataset.id.get_create_plist()
    type_id = dataset.id.get_type()
    layout = plist.get_layout()
    names = {h5d.COMPACT: "compact", h5d.CONTIGUOUS: "contiguous", h5d.CHUNKED: "chunked"}
    if layout not in names:
        raise Unportable(f"layout {layout}")
    desc = describe_type(type_id)
    filters = []
    for index in range(plist.get_nfilters()):
        code, flags, values, _name = plist.get_filter(index)
        parameters = [int(v) for v in values]
        # A lossy filter is not recorded: the tensors hold the values read, and HDF5 OUT
        # must hold exactly those (a record asking for one is refused, record_check).
        if is_lossless(int(code), parameters, desc["class"] == "int"):
            filters.append([int(code), int(flags), parameters])
    fill = None
    if desc["class"] in ("int", "float") and plist.fill_value_defined():
        value = np.zeros((), dtype=dataset.dtype)
        plist.get_fill_value(value)
        fill = base64.b64encode(value.tobytes()).decode("ascii")
    return {
        "type": desc,
        "space": describe_space(dataset.id.get_space()),
        "layout": names[layout],
        "chunks": None if layout != h5d.CHUNKED else [int(c) for c in plist.get_chunk()],
        "filters": filters,
        "fill": fill,
        "fill_time": int(plist.get_fill_time()),
        "alloc_time": int(plist.get_alloc_time()),
        "attr_order": int(plist.get_attr_creation_order()),
        "track_times": bool(plist.get_obj_track_times()),
    }


def _dataset_data(
    reader: Hdf5Source, item: NonTensorInfo, desc: Json, recorded: _Recorded
) -> Json | None:
    if item.shape is None:
        return None
    if item.variable_length and not holds_variable_string(desc):
        raise Unportable("variable-length data inside another type")
    if item.nbytes > MAX_STRUCTURE_BYTES:
        raise Unportable(f"{item.nbytes} bytes, over the recorded structure's cap")
    strings: list[Any] = []
    raw: list[bytes] = []
    size = 0
    for piece in reader.non_tensor_rows(item):
        interrupts.check()  # a dataset of millions of strings: seconds of Python
        if item.variable_length:
            strings.extend(_string(v) for v in piece.values.reshape(-1))
            size += sum(len(v) for v in piece.values.reshape(-1))
        else:
            raw.append(piece.values.tobytes())
            size += piece.values.nbytes
        if size > MAX_STRUCTURE_BYTES:  # stop reading: it could never be recorded
            raise Unportable(f"over {MAX_STRUCTURE_BYTES} bytes, the recorded structure's cap")
    # Charged once kept: a dataset over the cap on its own is dropped, the record kept.
    if item.variable_length:
        recorded.add(size)
        return {"strings": strings}
    recorded.add_raw(size)
    return {"raw": base64.b64encode(b"".join(raw)).decode("ascii")}


def _string(value: object) -> Any:
    raw = value.encode("utf-8", "surrogateescape") if isinstance(value, str) else bytes(value)  # type: ignore[call-overload]
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return {"b64": base64.b64encode(raw).decode("ascii")}


def _describe_attributes(
    obj: Any, path: str, dropped: list[str], recorded: _Recorded
) -> list[Json]:
    h5py = load_h5py()
    attributes = []
    for name in list(obj.attrs):
        if not isinstance(name, str):
            dropped.append(f"attribute {name!r} of {path!r} (a name that is not UTF-8)")
            continue
        attr = obj.attrs.get_id(name)
        try:
            desc = describe_type(attr.get_type())
        except Unportable as exc:
            dropped.append(f"attribute {name!r} of {path!r} ({exc})")
            continue
        space = describe_space(attr.get_space())
        raw_size = space_points(space) * int(attr.get_type().get_size())
        if raw_size > limits.MAX_ATTRIBUTE_BYTES:
            dropped.append(f"attribute {name!r} of {path!r} ({raw_size} bytes, over the cap)")
            continue
        data: Json | None = None
        if space["class"] != "null":
            shape = tuple(space.get("shape", ()))
            if holds_variable_string(desc):
                values = np.empty(shape, dtype=attr.dtype)
                attr.read(values, mtype=h5py.h5t.py_create(attr.dtype))
                strings = [_string(v) for v in values.reshape(-1)]
                recorded.add(sum(len(v) for v in values.reshape(-1)))
                data = {"strings": strings}
            else:
                recorded.add_raw(raw_size)  # before reading it
                type_id = attr.get_type()
                raw = np.zeros((*shape, int(type_id.get_size())), dtype=np.uint8)
                attr.read(raw, mtype=type_id.copy())
                data = {"raw": base64.b64encode(raw.tobytes()).decode("ascii")}
        attributes.append({"name": name, "type": desc, "space": space, "data": data})
    return attributes
