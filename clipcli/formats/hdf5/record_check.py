"""The structure record of an HDF5 file (clipcli.formats.hdf5.record_read describes the
fields) checked before a rebuild: every node checked field by field and turned into library
objects (prepare), so that malformed content is refused before anything is created;
rebuild.py creates them."""

from __future__ import annotations

import base64
import binascii
import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import clipcli.formats.hdf5.limits as limits
from clipcli.errors import InputError
from clipcli.formats.base import TensorInfo, numpy_size_overflows, utf8_encodable
from clipcli.formats.hdf5 import decoding
from clipcli.formats.hdf5.filters import DEFLATE, SZIP, is_lossless, name_of
from clipcli.formats.hdf5.library import load_h5py
from clipcli.formats.hdf5.portable import (
    Json,
    Malformed,
    build_space,
    build_type,
    describe_type,
    holds_variable_string,
    space_points,
)
from clipcli.formats.hdf5.safety import (
    attribute_budget_problem,
    chunk_count,
    non_tensor_kind,
    vlen_attribute_elements,
)
from clipcli.formats.structure_record import Structure
from clipcli.system import interrupts

LAYOUTS = {"compact": 0, "contiguous": 1, "chunked": 2}
# Variable-length strings checked between two looks for a signal (~1 us each).
STRINGS_BETWEEN_CHECKS = 1 << 16
# A variable-length element as the file stores it: a 4-byte length and a global heap ID
# (an 8-byte collection address and a 4-byte index); its bytes live in the heap.
VLEN_STORED_BYTES = 16


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
    structure: Structure, infos: Sequence[TensorInfo], source: Path, input_bytes: int
) -> list[ReadyNode] | str:
    """The nodes to create, every field checked; a str says why the structure does not
    fit these tensors (then it is not used). Malformed content is an InputError, and so
    is a record that would make OUT larger than the input's expansion budget
    (input_bytes: the size of the files it was read from)."""
    nodes = structure.nodes
    try:
        ready = _prepared(nodes, infos, input_bytes)
    except REFUSALS as exc:
        raise _malformed(source, exc) from None
    return _check_fit(nodes, ready, infos) or ready


def record_problem(
    structure: Structure,
    infos: Sequence[TensorInfo],
    input_bytes: int,
    follow_root: Callable[[ReadyNode], dict[str, str]],
) -> str | None:
    """Why reading this record back into HDF5 would refuse it, or None: for the side that
    writes a record (clipcli.formats.hdf5.record_read), which must never write one that it
    then refuses to read. Every check the HDF5 writer makes of it: prepare() (malformed,
    or not these tensors' record) and the attribute budget, with the root's attributes
    as follow_root(root) leaves them (the metadata beside the record: edited values win,
    and it returns the metadata added as root attributes). Each node's library objects are
    freed once it has passed (all of them at once held ~13 KB a node: 100 MB for a Keras
    file of 8,000)."""
    nodes = structure.nodes
    added: dict[str, str] = {}
    try:
        _check_tree(nodes)
        sizes: list[int] = []
        shapes: list[tuple[int, ...] | None] = []
        uses: list[tuple[int, int]] = []
        for index, node in enumerate(nodes):
            prepared = prepare_node(node)
            if index == 0:
                added = follow_root(prepared)
            sizes.append(_element_size(prepared))
            shapes.append(_space_shape(prepared))
            uses.append(_heap_use(prepared))
        _check_chunk_budget(nodes, infos)
        _check_allocation(nodes, sizes, input_bytes)
    except REFUSALS as exc:
        return str(exc)
    return _fit_problem(nodes, shapes, infos) or _attribute_budget_problem(uses, added.values())


# What a malformed record raises while it is checked.
REFUSALS = (Malformed, KeyError, TypeError, ValueError, binascii.Error)


def _prepared(
    nodes: Sequence[Json], infos: Sequence[TensorInfo], input_bytes: int
) -> list[ReadyNode]:
    _check_tree(nodes)
    ready = [prepare_node(node) for node in nodes]
    _check_chunk_budget(nodes, infos)
    _check_allocation(nodes, [_element_size(node) for node in ready], input_bytes)
    return ready


def _element_size(node: ReadyNode) -> int:
    """A dataset's bytes per element in the file; 0 for other nodes."""
    return int(node.type_id.get_size()) if node.kind == "dataset" else 0


def _space_shape(node: ReadyNode) -> tuple[int, ...] | None:
    """A tensor dataset's dataspace shape (() for a scalar); None for other nodes."""
    return tuple(node.space.shape or ()) if node.tensor else None


def _malformed(source: Path, exc: BaseException | str) -> InputError:
    return InputError(source, f"the HDF5 structure recorded in __metadata__ is malformed: {exc}")


def _check_allocation(nodes: Sequence[Json], sizes: Sequence[int], input_bytes: int) -> None:
    """The bytes OUT's datasets allocate, charged to the readers' expansion budget
    (limits.expansion_budget of the input's size) before anything is written: a chunked
    dataset allocates every chunk its extent touches in full (a one-element tensor in a
    256 MiB chunk is 256 MiB on disk), any other its elements."""
    allocated = 0
    for node, element in zip(nodes, sizes, strict=True):
        if node["kind"] != "dataset":
            continue
        if holds_variable_string(node["type"]):
            element = VLEN_STORED_BYTES  # the in-memory size is a pointer's
        if node["layout"] == "chunked":
            shape, chunks = node["space"]["shape"], node["chunks"]
            allocated += chunk_count(shape, chunks) * math.prod(chunks) * element
        else:
            allocated += space_points(node["space"]) * element
    budget = limits.expansion_budget(input_bytes)
    if allocated > budget:
        raise Malformed(
            f"its datasets would allocate {allocated} bytes in OUT, more than "
            f"{limits.MAX_EXPANSION} times the {input_bytes}-byte input plus "
            f"{limits.SPARSE_CHECK_BYTES} bytes ({budget})"
        )


def check_attribute_budget(
    ready: Sequence[ReadyNode], added_metadata: Iterable[str], source: Path
) -> None:
    """The HDF5 reader's attribute budget (safety.attribute_budget_problem), taken on what
    the rebuild writes: every variable-length attribute element counted as the reader
    counts it, times the largest variable-length string OUT's global heap will hold (those
    of attributes, of non-tensor datasets and the metadata values written as root
    attributes, added_metadata). Past it, OUT would be a file clipcli refuses to read."""
    problem = _attribute_budget_problem(map(_heap_use, ready), added_metadata)
    if problem is not None:
        raise _malformed(source, problem)


def _heap_use(node: ReadyNode) -> tuple[int, int]:
    """A node's variable-length attribute elements, and the longest variable-length string
    among its attributes and values."""
    elements = 0
    largest = 0
    values = [node.data] if node.data is not None else []
    for item in [*node.attributes, *values]:
        if not item.raw and item.values is not None:
            largest = max([largest, *(len(v) for v in item.values.reshape(-1))])
    for attr in node.attributes:
        elements += vlen_attribute_elements(attr.type_id, attr.space)
    return elements, largest


def _attribute_budget_problem(
    uses: Iterable[tuple[int, int]], added_metadata: Iterable[str]
) -> str | None:
    elements = 0
    largest = 0
    for node_elements, node_largest in uses:
        elements += node_elements
        largest = max(largest, node_largest)
    for value in added_metadata:  # each a scalar variable-length string
        elements += 1
        largest = max(largest, len(value.encode("utf-8")))
    return attribute_budget_problem(elements, largest)


def _check_chunk_budget(nodes: Sequence[Json], infos: Sequence[TensorInfo]) -> None:
    """The HDF5 reader's chunk budget (limits.chunk_budget), taken on the bytes the record
    describes (the tensors' and the non-tensor values'), as the input's size: chunking by
    one element would make an 800 KB input cost gigabytes to write, and an OUT that
    clipcli itself refuses to read."""
    described = sum(info.nbytes for info in infos)
    chunks = 0
    for node in nodes:
        if node["kind"] != "dataset":
            continue
        if not node["tensor"]:
            described += space_points(node["space"]) * int(build_type(node["type"]).get_size())
        if node["layout"] == "chunked":
            chunks += chunk_count(node["space"]["shape"], node["chunks"])
    budget = limits.chunk_budget(described)
    if chunks > budget:
        raise Malformed(
            f"its datasets declare {chunks} HDF5 chunks in all, over the budget of one per "
            f"{limits.BYTES_PER_CHUNK} bytes of the {described} bytes it describes plus "
            f"{limits.FREE_CHUNKS} ({budget})"
        )


def _check_tree(nodes: Sequence[Json]) -> None:
    """The paths form one tree: the root group first, every other object an absolute
    path of plain link names (no empty, '.', '..' or NUL component) under a group listed
    before it, each object once. Anything else is a malformed record (exit 3), not a loss."""
    if not nodes or nodes[0].get("path") != "/" or nodes[0].get("kind") != "group":
        raise Malformed("it does not start at the root group")
    seen_groups = {"/"}
    seen: set[str] = {"/"}
    # The reader refuses groups nested MAX_DEPTH levels below the root (Hdf5Reader._walk).
    for node in nodes[1:]:
        path = node.get("path")
        if not isinstance(path, str) or not path.startswith("/"):
            raise Malformed(f"object path {path!r} is not absolute")
        parent, _, name = path.rpartition("/")
        if name in ("", ".", "..") or "\x00" in name or not utf8_encodable(name):
            raise Malformed(f"object path {path!r} has an invalid link name {name!r}")
        if path in seen:
            raise Malformed(f"it lists object {path!r} twice")
        if (parent or "/") not in seen_groups:
            raise Malformed(f"object {path!r} does not follow its parent group")
        seen.add(path)
        if node.get("kind") == "group":
            if path.count("/") >= limits.MAX_DEPTH:
                raise Malformed(
                    f"groups nest deeper than {limits.MAX_DEPTH} levels (the root and "
                    f"{limits.MAX_DEPTH - 1} below it: clipcli reads no deeper) at {path[:80]!r}"
                )
            seen_groups.add(path)


def _check_fit(
    nodes: Sequence[Json], ready: list[ReadyNode], infos: Sequence[TensorInfo]
) -> str | None:
    return _fit_problem(nodes, [_space_shape(r) for r in ready], infos)


def _fit_problem(
    nodes: Sequence[Json], shapes: Sequence[tuple[int, ...] | None], infos: Sequence[TensorInfo]
) -> str | None:
    """Why the record does not describe these tensors as they are, or None. A tensor's
    dataset must hold exactly its values: its dataspace is the tensor's shape and its
    type is the tensor's own (tensor_type_problem). Any other difference would change
    values on the way into OUT (int32 for uint32, an int compound for complex64).
    shapes: each tensor dataset's dataspace shape, None for every other node."""
    tensors = {
        n["path"][1:]: (n, shape)
        for n, shape in zip(nodes, shapes, strict=True)
        if shape is not None
    }
    if set(tensors) != {info.name for info in infos}:
        return "its datasets are not the checkpoint's tensors"
    for info in infos:
        node, shape = tensors[info.name]
        space = node["space"]
        expected_class = "scalar" if info.shape == () else "simple"
        if space["class"] != expected_class or shape != info.shape:
            return f"dataset {info.name!r} has another shape than the tensor"
        problem = tensor_type_problem(node["type"], info.dtype)
        if problem is not None:
            return f"dataset {info.name!r} {problem}"
    return None


def tensor_type_problem(desc: Json, dtype: np.dtype[Any]) -> str | None:
    """Why an HDF5 type (described) may not hold a tensor of this dtype, or None. The
    allow-list: exactly the type h5py makes for the dtype, in either byte order (one
    order throughout: HDF5 converts it exactly, and h5py reads a compound of mixed orders
    back as no complex dtype); for bool also the enum h5py reads as bool (members FALSE = 0
    and TRUE = 1 in any order, over a signed or unsigned byte)."""
    expected = describe_type(load_h5py().h5t.py_create(dtype))
    orders = _orders(desc)
    if len(orders) > 1:
        return "declares a type of mixed byte orders"
    if _canonical(desc, dtype.kind == "b") != _canonical(expected, dtype.kind == "b"):
        return f"declares type {_short(desc)}, not the tensor's {dtype.name}"
    return None


def _orders(desc: object) -> set[str]:
    """The byte orders a described type uses (1-byte types have none that matters)."""
    if isinstance(desc, dict):
        found = {o for k, o in desc.items() if k == "order" and desc.get("size") != 1}
        for value in desc.values():
            found |= _orders(value)
        return {str(o) for o in found}
    if isinstance(desc, list):
        return set().union(*(_orders(item) for item in desc)) if desc else set()
    return set()


def _canonical(desc: object, boolean: bool) -> object:
    """The description with byte orders dropped (and, for bool, the enum's member order
    and its base's sign), for comparison."""
    if isinstance(desc, list):
        return [_canonical(item, boolean) for item in desc]
    if not isinstance(desc, dict):
        return desc
    ignored = {"order"} | ({"signed"} if boolean else set())
    out = {k: _canonical(v, boolean) for k, v in desc.items() if k not in ignored}
    if boolean and desc.get("class") == "enum" and isinstance(desc.get("members"), list):
        out["members"] = sorted(map(tuple, desc["members"]))
    return out


def _short(desc: Json) -> str:
    text = json.dumps(desc, separators=(",", ":"))
    return text if len(text) <= 120 else text[:117] + "..."


def prepare_node(node: Json) -> ReadyNode:
    h5p = load_h5py().h5p
    kind, path = node["kind"], node["path"]
    cset = node.get("cset", 0)
    if not _is_int(cset) or cset not in (0, 1):
        raise Malformed(f"character set {cset!r}")
    attributes = [prepare_attribute(a) for a in node["attrs"]]
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
        if not isinstance(tensor, bool):
            raise Malformed(f"'tensor' {tensor!r} of {path!r}")
        if not tensor:  # its values are recorded: all of them (null only for no points)
            _check_non_tensor(node, type_id)
            if node.get("data") is None and space_points(node["space"]):
                points = space_points(node["space"])
                raise Malformed(
                    f"non-tensor dataset {path!r} records no values for {points} elements"
                )
            data = _values(node["type"], node["space"], node.get("data"), b"")
        elif node.get("data") is not None:
            raise Malformed(f"tensor dataset {path!r} records values")
    return ReadyNode(path, kind, cset, plist, type_id, space, attributes, data, tensor)


def _check_non_tensor(node: Json, type_id: Any) -> None:
    """A record's non-tensor dataset must be one the HDF5 reader lists as a non-tensor
    (safety.non_tensor_kind, the reader's own rule): a numeric one would be read from OUT
    as a weight that is no tensor of the input (measured, in the global norm, never
    clipped). clipcli never records one, so it is forged: malformed, never ignored. And
    its dataspace must be one numpy can make (the reader's rule for every dataset)."""
    space = node["space"]
    if non_tensor_kind(type_id, space["class"] == "null") is None:
        raise Malformed(
            f"non-tensor dataset {node['path']!r} has a numeric type: OUT's reader would "
            "read it as a tensor, and a record may only describe the tensors there are"
        )
    shape = space.get("shape", ())
    if numpy_size_overflows(shape, int(type_id.get_size())):
        raise Malformed(f"dataset {node['path']!r} of shape {shape!r} overflows numpy's size limit")


def _order_flags(value: object) -> int:
    h5p = load_h5py().h5p
    allowed = {0, h5p.CRT_ORDER_TRACKED, h5p.CRT_ORDER_TRACKED | h5p.CRT_ORDER_INDEXED}
    if value not in allowed or isinstance(value, bool):
        raise Malformed(f"creation order flags {value!r}")
    return int(str(value))


def _dataset_plist(node: Json, type_id: Any, space: Any) -> Any:
    h5p, h5d = load_h5py().h5p, load_h5py().h5d
    plist = h5p.create(h5p.DATASET_CREATE)
    layout = LAYOUTS.get(node["layout"])
    if layout is None:
        raise Malformed(f"layout {node['layout']!r}")
    shape = tuple(space.shape or ())
    maxshape = tuple(space.get_simple_extent_dims(True)) if shape else ()
    chunks = node.get("chunks")
    filters = node.get("filters")
    if not isinstance(filters, list):
        raise Malformed("filters are not a list")
    if node["layout"] == "chunked":
        rank = len(shape)
        if not isinstance(chunks, list) or len(chunks) != rank or rank == 0:
            raise Malformed("chunk shape")
        if not all(_is_int(c) and 1 <= c < 1 << 32 for c in chunks):
            raise Malformed(f"chunk dimensions {chunks!r}")
        unlimited = load_h5py().h5s.UNLIMITED
        for chunk, top in zip(chunks, maxshape, strict=True):
            if top != unlimited and chunk > top:
                raise Malformed(
                    f"chunk dimensions {chunks!r} larger than the dataset's maximum "
                    f"{node['space'].get('maxshape')!r}"
                )
        if int(np.prod(chunks, dtype=object)) * type_id.get_size() > limits.MAX_CHUNK_BYTES:
            raise Malformed("chunks over the size limit")
        plist.set_chunk(tuple(chunks))
    else:
        if chunks is not None:
            raise Malformed(f"chunk dimensions {chunks!r} on a {node['layout']} dataset")
        if filters:
            raise Malformed(f"filters on a {node['layout']} dataset (only chunked ones have them)")
        if maxshape != shape:
            raise Malformed(f"an extensible dataspace on a {node['layout']} dataset")
        if layout == LAYOUTS["compact"] and space_points_of(space) * type_id.get_size() > 64000:
            raise Malformed("a compact dataset over 64,000 bytes")
        plist.set_layout(layout)
    if len(filters) > MAX_FILTERS:
        raise Malformed(f"{len(filters)} filters; HDF5 holds at most {MAX_FILTERS}")
    integer = node["type"].get("class") == "int"
    made = [_filter(entry, chunks, integer) for entry in filters]
    # What the reader would refuse in OUT (hdf5/decoding), refused in the record first.
    problem = decoding.order_problem([code for code, _, _ in made])
    if problem is not None:
        raise Malformed(f"a dataset whose {problem.removeprefix('its ')}")
    for code, flags, values in made:
        plist.set_filter(code, flags, values)
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
    if not (
        _is_int(node["fill_time"])
        and node["fill_time"] in fill_times
        and _is_int(node["alloc_time"])
        and node["alloc_time"] in alloc_times
    ):
        raise Malformed("fill or allocation time")
    if not isinstance(node["track_times"], bool):
        raise Malformed(f"track_times {node['track_times']!r}")
    plist.set_fill_time(node["fill_time"])
    plist.set_alloc_time(node["alloc_time"])
    plist.set_attr_creation_order(_order_flags(node["attr_order"]))
    plist.set_obj_track_times(bool(node["track_times"]))
    return plist


MAX_FILTERS = 32  # H5Z_MAX_NFILTERS


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def space_points_of(space: Any) -> int:
    return int(np.prod(space.shape or (), dtype=object)) if space.shape is not None else 0


def _filter(
    entry: object, chunks: list[int] | None, integer_type: bool
) -> tuple[int, int, tuple[int, ...]]:
    """One [code, flags, [values]] entry, checked: a filter known to give back every value
    exactly (clipcli.formats.hdf5.filters: a record only describes how the values are
    stored, never changes them), that this library can encode, the optional/mandatory
    flag, parameters that are 32-bit unsigned integers and, for the filters whose
    parameters the user sets (deflate, szip), values the filter accepts."""
    h5z = load_h5py().h5z
    if not isinstance(entry, list) or len(entry) != 3:
        raise Malformed(f"filter entry {entry!r}")
    code, flags, values = entry
    if not isinstance(values, list) or len(values) > 64:
        raise Malformed("filter parameters")
    if not _is_int(code) or not all(_is_int(v) for v in values):
        raise Malformed(f"filter {code!r} with parameters {values!r}")
    if not is_lossless(code, values, integer_type):
        raise Malformed(
            f"{name_of(code)} with parameters {values!r} is not known to keep every value "
            "exactly (lossy filters are never written)"
        )
    if not h5z.filter_avail(code):
        raise Malformed(f"filter {code!r} is not available")
    if not h5z.get_filter_info(code) & h5z.FILTER_CONFIG_ENCODE_ENABLED:
        raise Malformed(f"filter {code!r} cannot encode here")
    if not _is_int(flags) or flags not in (0, 1):
        raise Malformed(f"filter flags {flags!r}")
    if not all(0 <= v < 1 << 32 for v in values):
        raise Malformed(f"filter parameters {values!r}")
    if code == DEFLATE and (len(values) != 1 or values[0] > 9):
        raise Malformed(f"deflate (gzip) parameters {values!r}; the level is 0 to 9")
    if code == SZIP:
        points = int(np.prod(chunks or [0], dtype=object))
        if len(values) not in (2, 4):
            raise Malformed(f"szip parameters {values!r}")
        block = values[1]
        if block % 2 or not 2 <= block <= 32 or block > points:
            raise Malformed(f"szip pixels per block {block} (even, 2 to 32, at most a chunk)")
    return code, flags, tuple(values)


def _numeric_dtype(desc: Json) -> np.dtype[Any]:
    kind = {"int": "i" if desc.get("signed") else "u", "float": "f"}[desc["class"]]
    return np.dtype(f"{desc['order']}{kind}{desc['size']}")


def prepare_attribute(attr: Json) -> ReadyAttribute:
    name = attr["name"]
    if (
        not isinstance(name, str)
        or not name
        or "\x00" in name
        or not utf8_encodable(name)
        or len(name.encode("utf-8")) > 65534
    ):
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
            if not index % STRINGS_BETWEEN_CHECKS:
                interrupts.check()  # millions of strings: seconds of Python
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
    """A variable-length string's bytes; HDF5 ends one at its first NUL, so a NUL inside
    could not be written as recorded."""
    if isinstance(item, str) and utf8_encodable(item):
        raw = item.encode("utf-8")
    elif isinstance(item, dict) and isinstance(item.get("b64"), str):
        raw = base64.b64decode(item["b64"], validate=True)
    else:
        raise Malformed("a string that is neither UTF-8 text nor {'b64': ...}")
    if b"\x00" in raw:
        raise Malformed(f"a variable-length string holding a NUL byte: {raw[:40]!r}")
    return raw
