"""safetensors: our own header parser (validated as the official reader does) and a
streaming writer (header first, then one tensor at a time), which covers bf16 and fp8 that
`safetensors.numpy` cannot load.

header: the dtype table, limits and the header the writer builds; reader: parsing,
validation and pread; writer: the file writer; stream: the writer of OUT '-'.

The writers are imported on first use of their names (PEP 562 module __getattr__): reading
a file (`ls`, `norms`) needs neither, and they pull in the copy thread pool, kernel copies
and the interrupt machinery (about 8 ms of start-up; issue 12, item 7).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from clipcli.formats.safetensors.header import (
    CODES,
    DTYPE_NAMES,
    MAX_HEADER_BYTES,
    MAX_TENSORS,
    build_header,
    dtype_of,
)
from clipcli.formats.safetensors.reader import SafetensorsReader

if TYPE_CHECKING:
    from clipcli.formats.safetensors.stream import SafetensorsStreamWriter
    from clipcli.formats.safetensors.writer import SafetensorsWriter, with_structure

_WRITING = {
    "SafetensorsWriter": "clipcli.formats.safetensors.writer",
    "with_structure": "clipcli.formats.safetensors.writer",
    "SafetensorsStreamWriter": "clipcli.formats.safetensors.stream",
}


def __getattr__(name: str) -> Any:
    if name in _WRITING:
        import importlib

        return getattr(importlib.import_module(_WRITING[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CODES",
    "DTYPE_NAMES",
    "MAX_HEADER_BYTES",
    "MAX_TENSORS",
    "SafetensorsReader",
    "SafetensorsStreamWriter",
    "SafetensorsWriter",
    "build_header",
    "dtype_of",
    "with_structure",
]
