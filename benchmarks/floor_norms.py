"""The floor for `norms` on a .safetensors file: the least work that gives a correct answer.

Parse the header, np.memmap the data, and sum squares tensor by tensor, chunk by chunk, with
float64 accumulation (`c = x[i:i+n].astype(np.float64); s += np.dot(c, c)`), BLAS pinned to one
thread. No validation, no max|x|, no non-finite count, no report: it prints the global L2
norm and, with --per-tensor, one `name norm` line per tensor.

With --threads N the same chunks go to N Python threads (the cast and the dot release the
GIL), the many-core floor issue 20's "<= 1.5x the 16-thread floor" is measured against.

    python benchmarks/floor_norms.py FILE.safetensors [--per-tensor] [--threads N]
"""

import os

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"  # single-threaded by definition; must precede `import numpy`

import json  # noqa: E402
import struct  # noqa: E402
import sys  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402

import numpy as np  # noqa: E402

CHUNK = 1 << 20  # elements per chunk: 8 MiB of float64, cache-friendly and bounded


def dtype_of(name: str) -> np.dtype:
    if name == "BF16":  # imported only when needed, so fp32 runs don't pay for it
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype({"F64": np.float64, "F32": np.float32, "F16": np.float16}[name])


def chunk_sumsq(x: np.ndarray, i: int) -> float:
    c = x[i : i + CHUNK].astype(np.float64)
    # np.dot, not c @ c: the same bits, but matmul holds the GIL through the BLAS call, so
    # the threaded floor's dots ran one at a time (benchmarks/gil_ops.py).
    return float(np.dot(c, c))


def main(path: str, per_tensor: bool, threads: int) -> None:
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    header.pop("__metadata__", None)
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + length)
    tensors = []
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        tensors.append((name, data[begin:end].view(dtype_of(entry["dtype"]))))
    total = 0.0
    if threads <= 1:
        sums = [sum(chunk_sumsq(x, i) for i in range(0, x.size, CHUNK)) for _, x in tensors]
    else:
        with ThreadPoolExecutor(threads) as pool:
            parts = [
                [pool.submit(chunk_sumsq, x, i) for i in range(0, x.size, CHUNK)]
                for _, x in tensors
            ]
            sums = [sum(f.result() for f in fs) for fs in parts]
    for (name, _), s in zip(tensors, sums, strict=True):
        total += s
        if per_tensor:
            print(name, s**0.5)
    print(repr(total**0.5))


if __name__ == "__main__":
    argv = sys.argv[1:]
    n = int(argv[argv.index("--threads") + 1]) if "--threads" in argv else 1
    main(argv[0], "--per-tensor" in argv, n)
