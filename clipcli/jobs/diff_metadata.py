"""What `diff` reports beyond the tensors: file metadata and structure.

Each change is (key, value in A, value in B), None marking a side without it:
- a file metadata key, by its name (the recorded structure's own key excepted: the
  structure is compared object by object instead);
- `group /path`, for a group on one side only (an empty group lost in a conversion);
- `/path @name`, an attribute of a group or dataset, with its exact HDF5 type and value;
- `dataset /path`, a non-tensor dataset (its type, shape and values);
- `archive member NAME`, a .keras archive's other member (size and CRC32), so that
  .keras -> .h5 shows what the archive held beyond its weights.
A file without a recorded structure (npz, plain safetensors) counts as the groups its
tensor names imply, with no attributes, so HDF5 -> npz reports every attribute it lost.

A model directory's metadata is what one file joining its shards would hold (the
`__metadata__` every shard shares, e.g. format=pt), plus its index's own metadata but the
keys derived from the tensors (total_size, total_parameters): a directory and its
conversion to one file have the same metadata. An index key that the shards also carry
with another value is shown as `index KEY`.

Metadata is compared by meaning, once. A file's metadata is the key -> text mapping its
reader gives (safetensors `__metadata__`; for HDF5 the root attributes that hold one
string, as h5py reads them: variable or fixed length, ASCII or UTF-8, the padding its
type declares stripped, decoded as UTF-8), less the reader's own descriptions of the file
(Reader.descriptions: a PyTorch file's layout, byte order and ties, a GGUF header's
version and byte order), which describe this file, not the checkpoint: two torch.save of
one dict, or a file and its conversion, are the same. Two values are the same when their
texts are equal. A root attribute whose name is a metadata key on its side is that key, so it is
not compared again as `/ @name` with its HDF5 string type: safetensors `format=pt` and an
HDF5 root attribute `format` holding "pt" in any string type are the same, and an edited
value is reported once. Every other root attribute (numbers, arrays, text that is not
UTF-8) is structure, compared exactly.
Tensor datasets are compared by the tensor diff itself; their storage settings (chunks,
filters, maximum shape, fill value) are structure: `storage /path` when not those of a
plain file, so HDF5 -> npz reports the chunking and compression it lost.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Collection, Mapping
from typing import Any

import numpy as np

from clipcli.formats.base import Reader
from clipcli.formats.sharded.layout import DERIVED_INDEX_KEYS
from clipcli.formats.structure_record import STRUCTURE_KEY, Structure, storage_of

Change = tuple[str, str | None, str | None]


def file_changes(a: Reader, b: Reader) -> list[Change]:
    """Metadata changes, then structure changes, in A's order then B's new entries."""
    meta_a = {k: v for k, v in compared_metadata(a).items() if k != STRUCTURE_KEY}
    meta_b = {k: v for k, v in compared_metadata(b).items() if k != STRUCTURE_KEY}
    plain = _changes({k: (v, v) for k, v in meta_a.items()}, {k: (v, v) for k, v in meta_b.items()})
    members = _changes(_members(a), _members(b))
    return plain + _changes(_entries(a, meta_a.keys()), _entries(b, meta_b.keys())) + members


def compared_metadata(reader: Reader) -> dict[str, str]:
    """The file metadata a reader stands for (see the module's docstring)."""
    described = reader.descriptions()  # the reader's words about the file, not its metadata
    if reader.model_directory is None:
        return {k: v for k, v in reader.metadata.items() if k not in described}
    metadata = reader.joined_metadata()
    for key, value in reader.metadata.items():  # the index's (the one shard's, without one)
        if key in DERIVED_INDEX_KEYS or key in described or metadata.get(key) == value:
            continue
        metadata[key if key not in metadata else f"index {key}"] = value
    return metadata


def _members(reader: Reader) -> dict[str, Entry]:
    """A container's members beyond the tensors (.keras: config.json, assets)."""
    return {f"archive member {name}": (v, v) for name, v in reader.archive_members().items()}


Entry = tuple[str, str]  # (exact JSON, for comparing; readable text, for showing)


def _changes(a: Mapping[str, Entry], b: Mapping[str, Entry]) -> list[Change]:
    changes: list[Change] = []
    for key, (exact, shown) in a.items():
        other = b.get(key)
        if other is None:
            changes.append((key, shown, None))
        elif other[0] != exact:
            # Two values that read the same (NaN payloads) are shown exactly.
            changes.append((key, shown, other[1]) if shown != other[1] else (key, exact, other[0]))
    changes.extend((key, None, shown) for key, (_, shown) in b.items() if key not in a)
    return changes


def _entries(reader: Reader, metadata_keys: Collection[str]) -> dict[str, Entry]:
    """The structure's entries; root attributes that are metadata keys are left to the
    metadata comparison (see the module's docstring)."""
    structure = reader.structure()
    if structure is None or structure.document is None:
        return _implied(reader, structure)
    entries: dict[str, Entry] = {}
    for node in structure.nodes:
        path = node["path"]
        if node["kind"] == "group" and path != "/":
            entries[f"group {path}"] = ("group", "group")
        elif node["kind"] == "dataset" and not node["tensor"]:
            entries[f"dataset {path}"] = _value(node["type"], node["space"], node.get("data"))
        elif node["kind"] == "datatype":
            entries[f"datatype {path}"] = (_text(node["type"]), _type_name(node["type"]))
        if node["kind"] == "dataset":
            storage = storage_of(node)
            if storage:
                entries[f"storage {path}"] = (storage, storage)
        for attr in node.get("attrs", ()):
            if path == "/" and attr["name"] in metadata_keys:
                continue
            entries[f"{path} @{attr['name']}"] = _value(attr["type"], attr["space"], attr["data"])
    for dropped in structure.dropped:
        entries[f"(not comparable) {dropped}"] = ("present", "present")
    return entries


def _implied(reader: Reader, structure: Structure | None) -> dict[str, Entry]:
    entries: dict[str, Entry] = {}
    for info in reader.infos:
        parts = info.name.split("/")
        for end in range(1, len(parts)):
            entries[f"group /{'/'.join(parts[:end])}"] = ("group", "group")
    if structure is not None:
        for dropped in structure.dropped:
            entries[f"(not comparable) {dropped}"] = ("present", "present")
    return entries


def _text(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, sort_keys=True)


def _value(type_desc: Any, space: Any, data: Any) -> Entry:
    exact = _text({"type": type_desc, "space": space, "data": data})
    try:
        shown = f"{_type_name(type_desc)} {_shape(space)} = {_values(type_desc, data)}"
    except (KeyError, TypeError, ValueError):
        shown = exact
    return exact, shown


def _type_name(desc: Any) -> str:
    kind = desc["class"]
    if kind == "int":
        return f"{desc['order']}{'i' if desc['signed'] else 'u'}{desc['size']}"
    if kind == "float":
        return f"{desc['order']}f{desc['size']}"
    if kind == "string":
        cset = "utf-8" if desc["cset"] == 1 else "ascii"
        return f"vlen str ({cset})" if desc["size"] is None else f"S{desc['size']} ({cset})"
    return str(kind)


def _shape(space: Any) -> str:
    if space["class"] == "simple":
        return str(list(space["shape"]))
    return str(space["class"])


def _values(desc: Any, data: Any) -> str:
    if data is None:
        return "(no data)"
    if "strings" in data:
        strings = data["strings"]
        return _text(strings[0] if len(strings) == 1 else strings)
    raw = base64.b64decode(data["raw"])
    if desc["class"] in ("int", "float"):
        kind = "f" if desc["class"] == "float" else ("i" if desc["signed"] else "u")
        values = np.frombuffer(raw, dtype=f"{desc['order']}{kind}{desc['size']}").tolist()
        return _text(values[0] if len(values) == 1 else values)
    if desc["class"] == "string":
        size = desc["size"]
        items = [
            raw[i : i + size].rstrip(b"\x00 ").decode("utf-8", "replace")
            for i in range(0, len(raw), size)
        ]
        return _text(items[0] if len(items) == 1 else items)
    return f"base64 {data['raw']}"
