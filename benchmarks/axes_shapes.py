"""Issue 20, "--axes in bounded memory", by shape: peak RSS and CPU of `clip --norm --axes`
on one tensor of --gib GiB per shape, where the slices are few and long, many and tiny,
or long columns of a wide matrix (the target: <= 200 MiB on a 1 GiB tensor, any shape).

    python benchmarks/axes_shapes.py [--gib 1] [--runs 1] [--other NAME=CHECKOUT ...]
        [--only NAME ...] [--keep DIR] [--container npz|h5|pt]

Each row is one whole `python -m clipcli` process (--no-fsync, warm page cache), this
checkout and every --other one (PYTHONPATH=CHECKOUT) interleaved; the limit is half the
slices' typical norm, so every slice is clipped (or, where a shape says so, the norm
of its first row: a tie within the sums' rounding, which only an exact decision
settles). Seeded standard normals, written a piece
at a time (the generator never holds a tensor). --container: the tensor converted to that
format by this checkout's `clipcli convert` (npz and HDF5 hold no bfloat16: those shapes
are left out), to measure its reader's path."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import ml_dtypes
import numpy as np
from common import GIB, PY, REPO, compile_clipcli, log
from timing import Cmd, Failure, run_once

PIECE = 1 << 24  # values generated at a time

# name: (dtype, shape for 1 GiB as a function of the element count n, axes)
SHAPES = {
    "two long rows, bf16 [2, n/2] --axes 1": ("BF16", lambda n: (2, n // 2), "1"),
    "one 1-D bf16 slice [n] --axes 0": ("BF16", lambda n: (n,), "0"),
    "two long columns, bf16 [n/2, 2] --axes 0": ("BF16", lambda n: (n // 2, 2), "0"),
    "16 long columns, f16 [n/16, 16] --axes 0": ("F16", lambda n: (n // 16, 16), "0"),
    "wide columns, bf16 [n/8192, 8192] --axes 0": ("BF16", lambda n: (n // 8192, 8192), "0"),
    "two long rows, f32 [2, n/2] --axes 1": ("F32", lambda n: (2, n // 2), "1"),
    "two long rows, f64 [2, n/2] --axes 1": ("F64", lambda n: (2, n // 2), "1"),
    "one 1-D f64 slice [n] --axes 0": ("F64", lambda n: (n,), "0"),
    "16 long rows, f64 [16, n/16] --axes 1": ("F64", lambda n: (16, n // 16), "1"),
    "8 long columns, f32 [n/8, 8] --axes 0": ("F32", lambda n: (n // 8, 8), "0"),
    "128 columns, f64 [n/128, 128] --axes 0": ("F64", lambda n: (n // 128, 128), "0"),
    "1024 rows of 2**17, f64 [n/2**17, 2**17] --axes 1": ("F64", lambda n: (n >> 17, 1 << 17), "1"),
    "two long rows, f32 [2, n/2] --axes 1, limit = row 0's norm": (
        "F32",
        lambda n: (2, n // 2),
        "1",
    ),
    "two-element columns, bf16 [2, n/2] --axes 0": ("BF16", lambda n: (2, n // 2), "0"),
    "two-element columns, f32 [2, n/2] --axes 0": ("F32", lambda n: (2, n // 2), "0"),
    "rows of 4096, bf16 [n/4096, 4096] --axes 1": ("BF16", lambda n: (n // 4096, 4096), "1"),
    "rows of 4096, f32 [n/4096, 4096] --axes 1": ("F32", lambda n: (n // 4096, 4096), "1"),
}
DTYPES = {"BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32, "F64": np.float64}


def write_tensor(path: Path, code: str, shape: tuple[int, ...], seed: int) -> float:
    """Writes the tensor; returns the float64 norm of its first row (a limit at a tie)."""
    dtype = np.dtype(DTYPES[code])
    row = int(np.prod(shape[1:]))
    row_sumsq = 0.0
    count = int(np.prod(shape))
    header = json.dumps(
        {"w": {"dtype": code, "shape": list(shape), "data_offsets": [0, count * dtype.itemsize]}}
    ).encode()
    header += b" " * (-len(header) % 8)
    rng = np.random.default_rng(seed)
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(header)) + header)
        for start in range(0, count, PIECE):
            size = min(PIECE, count - start)
            values = rng.standard_normal(size, dtype=np.float32).astype(dtype)
            if start < row:
                head = values[: row - start].astype(np.float64)
                row_sumsq += float(np.dot(head, head))
            out.write(values.tobytes())
    return float(np.sqrt(row_sumsq))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--other", action="append", default=[], help="NAME=CHECKOUT")
    parser.add_argument("--only", action="append", default=[], help="a shape's name, in part")
    parser.add_argument("--keep", type=Path, help="generate (and keep) the files here")
    parser.add_argument("--container", choices=["npz", "h5", "pt"], help="convert to this first")
    args = parser.parse_args()
    trees = {"this": REPO} | {k: Path(v) for k, v in (o.split("=", 1) for o in args.other)}
    for root in trees.values():
        compile_clipcli(str(root))  # as pip install does: no compiling in the timed runs
    chosen = {k: v for k, v in SHAPES.items() if not args.only or any(o in k for o in args.only)}
    where = args.keep or Path(tempfile.mkdtemp(prefix="axes_shapes_"))
    where.mkdir(parents=True, exist_ok=True)
    print(f"# clip --norm --axes, {args.gib:g} GiB per tensor, {args.runs} run(s), median")
    print("| shape | tree | wall s | CPU s | peak RSS MiB |")
    print("|---|---|---|---|---|")
    for seed, (name, (code, shape_of, axes)) in enumerate(chosen.items()):
        if code == "BF16" and args.container in ("npz", "h5"):
            continue
        itemsize = np.dtype(DTYPES[code]).itemsize
        shape = shape_of(int(args.gib * GIB) // itemsize)
        src = where / f"{code}-{'x'.join(map(str, shape))}-{seed}.safetensors"
        log(f"writing {src}")
        first_row_norm = write_tensor(src, code, shape, seed)
        if args.container:
            stored = src.with_suffix(f".{args.container}")
            log(f"converting to {stored}")
            os.environ["PYTHONPATH"] = str(REPO)
            convert = [PY, "-m", "clipcli", "convert", "-q", "--force", str(src), str(stored)]
            subprocess.run(convert, check=True)
            src.unlink()
            src = stored
        slice_numel = int(np.prod([shape[int(a)] for a in axes.split(",")]))
        limit = f"{0.5 * slice_numel**0.5:.6g}"
        if "limit = row 0's norm" in name:  # within rounding error of it: decided exactly
            limit = repr(first_row_norm)
        out = where / f"out{src.suffix}"
        argv = ["clip", "--norm", limit, "--axes", axes, "-q", "--force", "--no-fsync"]
        samples: dict[str, list] = {tree: [] for tree in trees}
        for _ in range(args.runs):
            for tree, root in trees.items():
                os.environ["PYTHONPATH"] = str(root)
                try:
                    samples[tree].append(
                        run_once(Cmd([PY, "-m", "clipcli", *argv, str(src), str(out)], out))
                    )
                except Failure as failure:
                    log(f"{name} ({tree}): {failure}")
        for tree, got in samples.items():
            if got:
                wall = statistics.median(s.wall for s in got)
                cpu = statistics.median(s.cpu for s in got)
                rss = max(s.rss for s in got)
                print(f"| {name} | {tree} | {wall:.2f} | {cpu:.2f} | {rss:.0f} |", flush=True)
        if args.keep is None:
            src.unlink()
    for out in where.glob("out.*"):
        out.unlink()
    if args.keep is None:
        where.rmdir()


if __name__ == "__main__":
    sys.exit(main())
