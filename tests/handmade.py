"""Checkpoint files written by hand for tests, independent of clipcli's own writers
(and able to hold bfloat16, which safetensors.numpy cannot save)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

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
    "float8_e4m3fnuz": "F8_E4M3FNUZ",
    "float8_e5m2fnuz": "F8_E5M2FNUZ",
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


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file, decoded by hand from the layout (numpy and
    ml_dtypes dtypes by name: safetensors.numpy cannot load bfloat16 or fp8)."""
    import ml_dtypes

    names = {code: name for name, code in SAFETENSORS_CODES.items()}
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype_name = names[entry["dtype"]]
        dtype = np.dtype(getattr(ml_dtypes, dtype_name, None) or dtype_name)
        begin, end = entry["data_offsets"]
        raw = data[8 + length + begin : 8 + length + end]
        tensors[name] = np.frombuffer(raw, dtype).reshape(entry["shape"])
    return tensors


def small_model(tmp_path: Path, name: str = "m.safetensors") -> Path:
    path = tmp_path / name
    save_file({"layers.0.w": np.ones((2, 2), np.float32)}, str(path))
    return path


# A tensor as the file holds it: (safetensors dtype code, shape, payload bytes), so that tests
# of layouts numpy cannot express (packed fp4, E8M0 bytes) write and read exactly what they mean.
RawTensors = dict[str, tuple[str, list[int], bytes]]


def write_raw_safetensors(path: Path, tensors: RawTensors) -> Path:
    header: dict[str, object] = {}
    offset = 0
    for name, (dtype, shape, payload) in tensors.items():
        header[name] = {
            "dtype": dtype,
            "shape": shape,
            "data_offsets": [offset, offset + len(payload)],
        }
        offset += len(payload)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(t[2] for t in tensors.values()))
    return path


def read_raw_safetensors(path: Path) -> RawTensors:
    """Every tensor of a safetensors file as (dtype code, shape, payload bytes), parsed from
    the format's definition: 8-byte little-endian header length, JSON header, data."""
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    header.pop("__metadata__", None)
    base = 8 + length
    return {
        name: (
            e["dtype"],
            e["shape"],
            data[base + e["data_offsets"][0] : base + e["data_offsets"][1]],
        )
        for name, e in header.items()
    }
