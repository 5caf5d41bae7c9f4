"""An HDF5 file rebuilt from a recorded structure (clipcli.formats.hdf5.record_read describes
the fields): every node checked field by field and turned into library objects first
(prepare, in record_check), so that malformed content is refused before anything is created,
then created in order (create_nodes)."""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from typing import Any

from clipcli.formats.hdf5.library import load_h5py
from clipcli.formats.hdf5.portable import Json
from clipcli.formats.hdf5.record_check import (
    LAYOUTS,
    MAX_FILTERS,
    ReadyAttribute,
    ReadyNode,
    _values,
    prepare,
    space_points_of,
)

__all__ = [
    "LAYOUTS",
    "MAX_FILTERS",
    "ReadyAttribute",
    "ReadyNode",
    "added_metadata",
    "create_nodes",
    "follow_metadata",
    "root_texts",
    "prepare",
    "space_points_of",
]


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


_PLAIN_STRING: Json = {"class": "string", "size": None, "cset": 1, "pad": 0}


def follow_metadata(
    root: ReadyNode, recorded: Sequence[Json], metadata: Mapping[str, str], reserved: str
) -> None:
    """What the user sees in __metadata__ wins over the record: a root string attribute
    whose metadata key was edited is written with the edited value (as a plain UTF-8
    string), one whose key was deleted is not restored; unchanged ones keep their exact
    recorded type. (The record's own key, `reserved`, is no attribute's metadata.)"""
    kept: list[ReadyAttribute] = []
    for ready, attr in zip(root.attributes, recorded, strict=True):
        name = attr["name"]
        text = _recorded_text(attr)
        if name == reserved:
            kept.append(ready)
        elif text is None:
            # Not text, so not in __metadata__ when recorded: a key of that name there now
            # was put there by the user, and wins as for an edit.
            kept.append(ready if name not in metadata else _plain(name, metadata[name]))
        elif name not in metadata:
            continue  # deleted from __metadata__: not restored
        elif metadata[name] == text:
            kept.append(ready)
        else:
            kept.append(_plain(name, metadata[name]))
    root.attributes = kept


def added_metadata(root: ReadyNode, metadata: Mapping[str, str], reserved: str) -> dict[str, str]:
    """The metadata a rebuild adds as root string attributes: all but the record's own
    key (`reserved`) and the attributes the recorded root already creates."""
    created = {attr.name.decode() for attr in root.attributes}
    return {key: value for key, value in metadata.items() if key != reserved and key not in created}


def _plain(name: str, value: str) -> ReadyAttribute:
    """A root attribute holding `value` as a plain UTF-8 string (a metadata value)."""
    return _values(_PLAIN_STRING, {"class": "scalar"}, {"strings": [value]}, name.encode("utf-8"))


def root_texts(nodes: Sequence[object]) -> dict[str, str]:
    """The metadata value each root attribute of a record shows as (those that are text),
    read before the record is checked: anything malformed is left out here (prepare()
    refuses it)."""
    root = nodes[0] if nodes else None
    attrs = root.get("attrs") if isinstance(root, dict) else None
    texts: dict[str, str] = {}
    for attr in attrs if isinstance(attrs, list) else []:
        if not isinstance(attr, dict) or not isinstance(attr.get("name"), str):
            continue
        try:
            text = _recorded_text(attr)
        except (ValueError, TypeError, IndexError):  # bad base64 or fields: malformed
            continue
        if text is not None:
            texts[attr["name"]] = text
    return texts


def _recorded_text(attr: Json) -> str | None:
    """The metadata value a root attribute shows as (a scalar string that is UTF-8 text),
    as the HDF5 reader reads it; None for an attribute that is not metadata."""
    desc, data = attr.get("type"), attr.get("data")
    if not isinstance(desc, dict) or desc.get("class") != "string":
        return None
    if attr.get("space") != {"class": "scalar"} or not isinstance(data, dict):
        return None
    if desc.get("size") is None:
        strings = data.get("strings")
        return strings[0] if isinstance(strings, list) and isinstance(strings[0], str) else None
    raw = base64.b64decode(data.get("raw", ""), validate=True)
    # As h5py reads it: the library converts the file's padding to NUL padding (a
    # NUL-terminated string ends at its first NUL, a space-padded one loses its trailing
    # spaces), and numpy's bytes drop the trailing NULs. Compared otherwise, a
    # space-padded attribute read as metadata never matched its record, so it was
    # rebuilt as a plain variable-length string (found by attack s33rec).
    h5t = load_h5py().h5t
    pad = desc.get("pad")
    if pad == h5t.STR_NULLTERM:
        raw = raw.split(b"\x00", 1)[0]
    elif pad == h5t.STR_SPACEPAD:
        raw = raw.rstrip(b" ")
    try:
        return raw.rstrip(b"\x00").decode("utf-8")
    except UnicodeDecodeError:
        return None
