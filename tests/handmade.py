"""Checkpoint files written by hand for tests, independent of clipcli's own writers
(and able to hold bfloat16, which safetensors.numpy cannot save)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

SAFETENSORS_CODES = {
    "float16": "F16",
    "bfloat16": "BF16",
    "float32": "F32",
    "float64": "F64",
    "int64": "I64",
    "int32": "I32",
    "bool": "BOOL",
    "uint8": "U8",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "float8_e8m0fnu": "F8_E8M0",
    "complex64": "C64",
}


def write_safetensors(
    path: Path, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None
) -> Path:
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, array in tensors.items():
        header[name] = {
            "dtype": SAFETENSORS_CODES[array.dtype.name],
            "shape": list(array.shape),
            "data_offsets": [offset, offset + array.nbytes],
        }
        offset += array.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(text)) + text)
        for array in tensors.values():
            out.write(array.tobytes())
    return path
