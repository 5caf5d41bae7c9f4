"""The safetensors header: the dtype table, the limits the official reader keeps, and the
header the writer builds (the reader validates headers: reader.py)."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Mapping
from typing import Any

import ml_dtypes
import numpy as np

from clipcli.formats.base import TensorInfo

MAX_HEADER_BYTES = 100_000_000  # the official reader's limit
MAX_TENSORS = 200_000  # real checkpoints hold at most tens of thousands
_U64 = struct.Struct("<Q")

DTYPES: dict[str, np.dtype[Any]] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "I16": np.dtype("<i2"),
    "U16": np.dtype("<u2"),
    "I32": np.dtype("<i4"),
    "U32": np.dtype("<u4"),
    "I64": np.dtype("<i8"),
    "U64": np.dtype("<u8"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"),
    "C64": np.dtype("<c8"),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
    "F8_E4M3FNUZ": np.dtype(ml_dtypes.float8_e4m3fnuz),
    "F8_E5M2FNUZ": np.dtype(ml_dtypes.float8_e5m2fnuz),
}
# Sub-byte types are packed two (or four thirds) to a byte; numpy cannot view them.
_PACKED = {"F4", "F6_E2M3", "F6_E3M2"}
CODES = {dtype.name: code for code, dtype in DTYPES.items()}


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate key {key!r}")
        result[key] = value
    return result


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def build_header(infos: Iterable[TensorInfo], metadata: Mapping[str, str]) -> bytes:
    """Compact JSON with __metadata__ first, space-padded to 8 bytes, like the official writer."""
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for info in infos:
        header[info.name] = {
            "dtype": CODES[info.dtype.name],
            "shape": list(info.shape),
            "data_offsets": [offset, offset + info.nbytes],
        }
        offset += info.nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return _U64.pack(len(text)) + text
