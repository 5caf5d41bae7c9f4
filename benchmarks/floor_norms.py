"""The floor for `norms` on a .safetensors file: the least work that gives a correct answer.

Parse the header, np.memmap the data, and sum squares tensor by tensor, chunk by chunk, with
float64 accumulation (`c = x[i:i+n].astype(np.float64); s += c @ c`), single-threaded (BLAS
is pinned to one thread). No validation, no max|x|, no non-finite count, no report: it
prints the global L2 norm and, with --per-tensor, one `name norm` line per tensor.

    python benchmarks/floor_norms.py FILE.safetensors [--per-tensor]
"""

import os

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"  # single-threaded by definition; must precede `import numpy`

import json  # noqa: E402
import struct  # noqa: E402
import sys  # noqa: E402

import numpy as np  # noqa: E402

CHUNK = 1 << 20  # elements per chunk: 8 MiB of float64, cache-friendly and bounded


def dtype_of(name: str) -> np.dtype:
    if name == "BF16":  # imported only when needed, so fp32 runs don't pay for it
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype({"F64": np.float64, "F32": np.float32, "F16": np.float16}[name])


def main(path: str, per_tensor: bool) -> None:
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    header.pop("__metadata__", None)
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + length)
    total = 0.0
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        x = data[begin:end].view(dtype_of(entry["dtype"]))
        s = 0.0
        for i in range(0, x.size, CHUNK):
            c = x[i : i + CHUNK].astype(np.float64)
            s += float(c @ c)
        total += s
        if per_tensor:
            print(name, s**0.5)
    print(repr(total**0.5))


if __name__ == "__main__":
    main(sys.argv[1], "--per-tensor" in sys.argv[2:])
