"""safetensors: our own header parser (validated as the official reader does) and a
streaming writer (header first, then one tensor at a time), which covers bf16 and fp8 that
`safetensors.numpy` cannot load.

header: the dtype table, limits and the header the writer builds; reader: parsing,
validation and pread; writer: the file writer; stream: the writer of OUT '-'.
"""

from clipcli.formats.safetensors.header import (
    CODES,
    DTYPES,
    MAX_HEADER_BYTES,
    MAX_TENSORS,
    build_header,
)
from clipcli.formats.safetensors.reader import SafetensorsReader
from clipcli.formats.safetensors.stream import SafetensorsStreamWriter
from clipcli.formats.safetensors.writer import SafetensorsWriter, with_structure

__all__ = [
    "CODES",
    "DTYPES",
    "MAX_HEADER_BYTES",
    "MAX_TENSORS",
    "SafetensorsReader",
    "SafetensorsStreamWriter",
    "SafetensorsWriter",
    "build_header",
    "with_structure",
]
