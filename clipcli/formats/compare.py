"""What `diff` reports beyond the tensors: file metadata and structure.

Each change is (key, value in A, value in B), None marking a side without it:
- a file metadata key, by its name (the recorded structure's own key excepted: the
  structure is compared object by object instead);
- `group /path`, for a group on one side only (an empty group lost in a conversion);
- `/path @name`, an attribute of a group or dataset, with its exact HDF5 type and value;
- `dataset /path`, a non-tensor dataset (its type, shape and values).
A file without a recorded structure (npz, plain safetensors) counts as the groups its
tensor names imply, with no attributes, so HDF5 -> npz reports every attribute it lost.
Tensor datasets are compared by the tensor diff itself; their storage settings (chunks,
compression) are not content and are not compared.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from clipcli.formats.base import Reader
from clipcli.formats.structure import STRUCTURE_KEY, Structure

Change = tuple[str, str | None, str | None]


def file_changes(a: Reader, b: Reader) -> list[Change]:
    """Metadata changes, then structure changes, in A's order then B's new entries."""
    meta_a = {k: v for k, v in a.metadata.items() if k != STRUCTURE_KEY}
    meta_b = {k: v for k, v in b.metadata.items() if k != STRUCTURE_KEY}
    return _changes(meta_a, meta_b) + _changes(_entries(a), _entries(b))


def _changes(a: Mapping[str, str], b: Mapping[str, str]) -> list[Change]:
    changes: list[Change] = [
        (key, value, b.get(key)) for key, value in a.items() if b.get(key) != value
    ]
    changes.extend((key, None, value) for key, value in b.items() if key not in a)
    return changes


def _entries(reader: Reader) -> dict[str, str]:
    structure = reader.structure()
    if structure is None or structure.document is None:
        return _implied(reader, structure)
    entries: dict[str, str] = {}
    for node in structure.nodes:
        path = node["path"]
        if node["kind"] == "group" and path != "/":
            entries[f"group {path}"] = "group"
        elif node["kind"] == "dataset" and not node["tensor"]:
            entries[f"dataset {path}"] = _text(
                {"type": node["type"], "space": node["space"], "data": node.get("data")}
            )
        elif node["kind"] == "datatype":
            entries[f"datatype {path}"] = _text(node["type"])
        for attr in node.get("attrs", ()):
            entries[f"{path} @{attr['name']}"] = _text(
                {"type": attr["type"], "space": attr["space"], "data": attr["data"]}
            )
    for dropped in structure.dropped:
        entries[f"(not comparable) {dropped}"] = "present"
    return entries


def _implied(reader: Reader, structure: Structure | None) -> dict[str, str]:
    entries: dict[str, str] = {}
    for info in reader.infos:
        parts = info.name.split("/")
        for end in range(1, len(parts)):
            entries[f"group /{'/'.join(parts[:end])}"] = "group"
    if structure is not None:
        for dropped in structure.dropped:
            entries[f"(not comparable) {dropped}"] = "present"
    return entries


def _text(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, sort_keys=True)
