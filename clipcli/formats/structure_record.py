"""A checkpoint's structure beyond its tensors, carried between formats.

An HDF5 file is more than its datasets: groups (empty ones too), attributes on every group
and dataset with their exact HDF5 types (Keras' `layer_names`, `weight_names`,
`model_config`), and datasets that are not tensors (a vocabulary). Converting to
safetensors keeps all of it under ONE `__metadata__` key, STRUCTURE_KEY, whose value is
versioned JSON:

    {"format": "clipcli.hdf5_structure", "version": 1, "nodes": [ {node}, ... ]}

one node per HDF5 object in the file's own order (see clipcli/formats/hdf5/record_read.py for
the fields), so that converting back to HDF5 rebuilds the same file. What a format cannot
hold (npz holds no metadata at all; some HDF5 types have no portable description) is a
"loss": refused unless the user accepts it (--allow-lossy), and then named in one line.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

STRUCTURE_KEY = "clipcli.hdf5_structure"
STRUCTURE_FORMAT = "clipcli.hdf5_structure"
STRUCTURE_VERSION = 1
# The encoded JSON: far above what Keras files need (a 20 KB model_config, kilobytes of
# names), and low enough that the whole safetensors header stays under the official
# reader's 100,000,000-byte limit with 200,000 tensor entries beside it.
MAX_STRUCTURE_BYTES = 50_000_000
MAX_NODES = 1_000_000


class MalformedStructure(ValueError):
    """The recorded structure is not valid JSON of the documented form."""


class Structure:
    """The structure as a JSON document (None when nothing could be kept), what could not
    be encoded (each entry names the object and why), and, for an HDF5 source, the open
    reader itself (`origin`), from which the HDF5 writer copies settings byte for byte. Only
    the HDF5 reader sets `origin` (the declared extra the HDF5 writer asks for; a structure
    recorded in another format has none and is rebuilt).

    A structure may be given as a loader, run on first use: an HDF5 copy to HDF5 never
    needs the document, and reading it costs every attribute and non-tensor value."""

    def __init__(
        self,
        document: dict[str, Any] | None = None,
        dropped: list[str] | None = None,
        origin: Any = None,
        load: Callable[[], Structure] | None = None,
    ) -> None:
        self._document = document
        self._dropped = dropped or []
        self.origin = origin
        self._load = load

    def _loaded(self) -> None:
        if self._load is not None:
            load, self._load = self._load, None
            loaded = load()
            self._document, self._dropped = loaded.document, loaded.dropped

    @property
    def document(self) -> dict[str, Any] | None:
        self._loaded()
        return self._document

    @property
    def dropped(self) -> list[str]:
        self._loaded()
        return self._dropped

    def to_text(self) -> str:
        return json.dumps(self.document, separators=(",", ":"), ensure_ascii=False)

    @property
    def nodes(self) -> list[dict[str, Any]]:
        return [] if self.document is None else list(self.document["nodes"])

    def summary(self) -> str:
        """What the structure holds, in a few words (for a loss message), and what could
        not be recorded of it, named (those parts are lost too where the whole structure
        is: a model directory's shards keep none of it)."""
        dropped = self.dropped
        shown = "; ".join(dropped[:3]) + (
            f"; and {len(dropped) - 3} more" if len(dropped) > 3 else ""
        )
        if self.document is None:
            return shown or "nothing recorded"
        nodes = self.nodes
        attributes = sum(len(node.get("attrs", ())) for node in nodes)
        groups = sum(node["kind"] == "group" and node["path"] != "/" for node in nodes)
        others = [n["path"][1:] for n in nodes if n["kind"] == "dataset" and not n["tensor"]]
        parts = [f"{attributes} attributes", f"{groups} groups"]
        root = nodes[0].get("attrs", []) if nodes else []
        if any(attr.get("name") == STRUCTURE_KEY for attr in root):
            parts[0] += f" (root attribute {STRUCTURE_KEY!r} among them)"
        if others:
            parts.append(f"{len(others)} non-tensor datasets ({_names(others)})")
        if dropped:
            parts.append(f"and what no record could hold: {shown}")
        return ", ".join(parts)

    def storage_settings(self) -> dict[str, str]:
        """Datasets stored otherwise than a plain file stores them (contiguous, unfiltered,
        fixed shape, zero fill value), each with its settings in a few words: chunks,
        filters, maximum shape and fill value are part of the structure."""
        settings: dict[str, str] = {}
        for node in self.nodes:
            if node.get("kind") == "dataset":
                described = storage_of(node)
                if described:
                    settings[node["path"]] = described
        return settings

    def is_plain(self, metadata: Mapping[str, str]) -> bool:
        """True when writing the tensors plainly (a contiguous dataset per tensor, root
        string attributes from the metadata) rebuilds everything recorded: then a
        conversion need not record the structure at all (safetensors -> HDF5 ->
        safetensors stays byte for byte the same)."""
        if not self.is_trivial(root_attributes_ok=metadata):
            return False
        return all(
            node["layout"] == "contiguous" and not node["filters"]
            for node in self.nodes
            if node["kind"] == "dataset"
        )

    def is_trivial(self, root_attributes_ok: Mapping[str, str] | None = None) -> bool:
        """True when a plain file of the tensors would hold everything: no attributes, no
        non-tensor datasets, no group that the tensors' paths do not imply."""
        nodes = self.nodes
        if self.dropped or self.document is None:
            return False
        for node in nodes:
            attrs = node.get("attrs") or []
            if node["path"] == "/" and root_attributes_ok is not None:
                attrs = [a for a in attrs if not _is_metadata_string(a, root_attributes_ok)]
            if attrs:
                return False
        if any(node["kind"] == "dataset" and not node["tensor"] for node in nodes):
            return False
        if any(node["kind"] == "datatype" for node in nodes):
            return False
        implied = {"/"}
        for node in nodes:
            if node["kind"] == "dataset":
                parts = node["path"].split("/")
                implied.update("/".join(parts[:end]) or "/" for end in range(1, len(parts)))
        return all(node["path"] in implied for node in nodes if node["kind"] == "group")


# How h5py (and so the HDF5 writer's plain layout) stores a str attribute.
_PLAIN_STRING = {"class": "string", "size": None, "cset": 1, "pad": 0}


def _is_metadata_string(attr: dict[str, Any], metadata: Mapping[str, str]) -> bool:
    """A root attribute that the metadata key of the same name recreates exactly."""
    data = attr.get("data") or {}
    return (
        attr.get("type") == _PLAIN_STRING
        and attr.get("space") == {"class": "scalar"}
        and data.get("strings") == [metadata.get(attr.get("name", ""))]
    )


_FILTER_NAMES = {1: "gzip", 2: "shuffle", 3: "fletcher32", 4: "szip", 5: "nbit", 6: "scaleoffset"}
_FILTER_NAMES[32000] = "lzf"


def storage_of(node: dict[str, Any]) -> str:
    """A dataset node's storage settings in a few words; empty for a plain one."""
    parts: list[str] = []
    layout = node.get("layout")
    if layout == "chunked":
        parts.append(f"chunks {node.get('chunks')}")
    elif layout != "contiguous":
        parts.append(f"{layout} layout")
    for code, _flags, values in node.get("filters") or []:
        name = _FILTER_NAMES.get(code, f"filter {code}")
        parts.append(f"{name} {values}" if code == 1 else name)
    space = node.get("space") or {}
    if space.get("class") == "simple" and space.get("maxshape") != space.get("shape"):
        parts.append(f"maximum shape {space.get('maxshape')}")
    fill = node.get("fill")
    if isinstance(fill, str):
        import base64  # here, not at the top: listing a plain safetensors file needs none

        if base64.b64decode(fill).strip(b"\x00"):
            parts.append(f"fill value (base64) {fill}")
    return ", ".join(parts)


def _names(names: Sequence[str], limit: int = 3) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def parse_structure(text: str) -> Structure:
    """A structure recorded by STRUCTURE_KEY; MalformedStructure if it is not one. Only
    the envelope is checked here; the HDF5 writer checks every node before it writes."""
    if len(text) > MAX_STRUCTURE_BYTES:
        raise MalformedStructure(f"over the {MAX_STRUCTURE_BYTES}-byte limit")
    try:
        document = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise MalformedStructure(f"not JSON ({exc})") from None
    if not isinstance(document, dict) or document.get("format") != STRUCTURE_FORMAT:
        raise MalformedStructure("not a clipcli HDF5 structure")
    if document.get("version") != STRUCTURE_VERSION:
        raise MalformedStructure(
            f"version {document.get('version')!r}; this clipcli reads version {STRUCTURE_VERSION}"
        )
    nodes = document.get("nodes")
    if not isinstance(nodes, list) or not 1 <= len(nodes) <= MAX_NODES:
        raise MalformedStructure(f"'nodes' is not a list of 1 to {MAX_NODES} objects")
    for node in nodes:
        if not (
            isinstance(node, dict)
            and isinstance(node.get("path"), str)
            and node.get("kind") in ("group", "dataset", "datatype")
            and isinstance(node.get("attrs", []), list)
            and (node.get("kind") != "dataset" or isinstance(node.get("tensor"), bool))
        ):
            raise MalformedStructure("a node without a path, kind or attribute list")
    return Structure(document)
