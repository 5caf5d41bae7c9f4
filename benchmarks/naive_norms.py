"""The script a user would write for `norms`: load everything, norm each tensor in float64.

    python benchmarks/naive_norms.py FILE.safetensors

safetensors.numpy.load_file cannot return bfloat16 (numpy has no such dtype: "data type
'bfloat16' not understood"), so for files holding BF16 tensors this script parses the
file by hand instead -- read it whole, view each tensor's bytes as ml_dtypes.bfloat16 --
and then does exactly the same per-tensor work. Prints the global L2 norm.
"""

import json
import struct
import sys

import numpy as np


def load_by_hand(path: str) -> dict[str, np.ndarray]:
    import ml_dtypes

    dtypes = {"BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32}
    with open(path, "rb") as handle:
        blob = handle.read()
    (length,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + length])
    header.pop("__metadata__", None)
    base = 8 + length
    return {
        name: np.frombuffer(
            blob,
            dtype=dtypes[e["dtype"]],
            count=int(np.prod(e["shape"])),
            offset=base + e["data_offsets"][0],
        ).reshape(e["shape"])
        for name, e in header.items()
    }


def load(path: str) -> dict[str, np.ndarray]:
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        dtypes = {e["dtype"] for k, e in json.loads(handle.read(length)).items() if k[:2] != "__"}
    if "BF16" in dtypes:
        return load_by_hand(path)
    from safetensors.numpy import load_file

    return load_file(path)


tensors = load(sys.argv[1])
norms = {name: float(np.linalg.norm(v.astype(np.float64))) for name, v in tensors.items()}
print(repr(sum(n * n for n in norms.values()) ** 0.5))
