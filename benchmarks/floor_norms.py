"""The physical floor for `norms`: mmap the safetensors data, sum squares chunk by chunk with
float64 accumulation, single-threaded. No validation, no report: the least work possible."""

import json
import struct
import sys

import ml_dtypes
import numpy as np

DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F64": np.float64}
CHUNK = 1 << 20

path = sys.argv[1]
with open(path, "rb") as handle:
    (length,) = struct.unpack("<Q", handle.read(8))
    header = json.loads(handle.read(length))
header.pop("__metadata__", None)
data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + length)
total = 0.0
for entry in header.values():
    begin, end = entry["data_offsets"]
    x = data[begin:end].view(DTYPES[entry["dtype"]])
    for i in range(0, x.size, CHUNK):
        c = x[i : i + CHUNK].astype(np.float64)
        total += float(c @ c)
print(total**0.5)
