"""Issue 20, "Many tensors" and "--axes in bounded memory": CPU seconds and peak RSS.

    python benchmarks/many_tiny_tensors.py [--tensors N] [--axes-mib M] [--slices-mib S]
                                           [--runs R] [--other NAME=CHECKOUT ...] [--dir DIR]

Rows (each a whole `python -m clipcli` process, timed with /usr/bin/time: CPU = user +
system seconds, the figure to trust on a shared machine; peak RSS = %M):

- norms (table), norms --format json, clip --global 1 (durable, as users run it) on a
  safetensors file of N one-element float32 tensors (default 200,000: 14 MB); diff of it
  against a copy (every pair bit-identical) and against half its values (4 in 5 changed);
  clip --norm 1 of what clip --norm 1 made of it (4 in 5 tensors exactly at the limit);
- clip --norm 1 --axes 0 --no-fsync on one float32 tensor of M MiB (default 1024:
  [M * 256, 1024]), every column clipped; and --axes 1 on it (M * 256 rows);
- clip --norm 1 --axes 1 on a float32 tensor of S MiB of two-element rows (default 100:
  [S * 131072, 2], 13 million slices, each box holding whole ones), and --axes 0 on one of
  two rows ([2, S * 131072]: the boxes cut every slice), most slices clipped;
- clip --norm 0.5 --axes 1 on one bfloat16 [4096, 11008] tensor (an MLP matrix of a 7B
  model, 90 MB; `--no-bf16`: left out), every row clipped, and --global 0.5 on it; and
  --axes 1 on the same normals in float16.

`--other NAME=CHECKOUT` runs the same commands with another checkout's clipcli (its
directory on PYTHONPATH, run from outside any checkout), interleaved with this one, e.g.
`--other main=/work/main` for a before/after table. Targets (issue 20, 2 cores): norms
<= 3 s and clip --global <= 5 s of CPU at <= 200 MiB; --axes <= 200 MiB (on a 1 GiB tensor;
the slices rows show how memory grows with the number of slices).
The generated files are kept in --dir (default: a temporary directory, removed).
"""

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

import numpy as np
from common import compile_clipcli

HERE = Path(__file__).resolve().parent.parent  # this checkout


def write_tiny(path: Path, count: int, scale: float = 1.0, cap: int = 4) -> None:
    """count one-element float32 tensors t0, t1, ... holding min(i % 5, cap) * scale
    (safetensors by hand)."""
    header = {
        f"t{i}": {"dtype": "F32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]}
        for i in range(count)
    }
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    values = (np.minimum(np.arange(count) % 5, cap) * scale).astype("<f4")
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(text)) + text + values.tobytes())


def write_small_bf16(path: Path, count: int, numel: int = 64) -> None:
    """count bfloat16 tensors b0, b1, ... of `numel` seeded standard normals each (a
    per-tensor clip of many small 16-bit tensors: a factor search and a scaling each)."""
    header = {
        f"b{i}": {
            "dtype": "BF16",
            "shape": [numel],
            "data_offsets": [2 * numel * i, 2 * numel * (i + 1)],
        }
        for i in range(count)
    }
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    rows = np.random.default_rng(1).standard_normal(count * numel).astype(np.float32)
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(text)) + text)
        out.write((rows.view(np.uint32) >> 16).astype("<u2").tobytes())  # truncated


def write_single(path: Path, mib: int) -> None:
    """One float32 tensor of [mib * 256, 1024], seeded standard normals, in 32 MiB steps."""
    rows = mib * 256
    header = {"w": {"dtype": "F32", "shape": [rows, 1024], "data_offsets": [0, rows * 4096]}}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    rng = np.random.default_rng(0)
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(text)) + text)
        for start in range(0, rows, 8192):
            step = min(8192, rows - start)
            out.write(rng.standard_normal((step, 1024), dtype=np.float32).tobytes())


def write_pairs(path: Path, mib: int, rows: bool) -> None:
    """A float32 tensor of mib MiB of seeded standard normals: [n, 2] (rows) or [2, n]."""
    count = mib * 131072
    shape = [count, 2] if rows else [2, count]
    header = {"w": {"dtype": "F32", "shape": shape, "data_offsets": [0, count * 8]}}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    rng = np.random.default_rng(1)
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(text)) + text)
        for start in range(0, 2 * count, 1 << 22):
            step = min(1 << 22, 2 * count - start)
            out.write(rng.standard_normal(step, dtype=np.float32).tobytes())


def write_bf16_matrix(path: Path, code: str = "BF16") -> None:
    """One bfloat16 (code "F16": float16) tensor of [4096, 11008], seeded normals of
    standard deviation 0.02."""
    header = {"w": {"dtype": code, "shape": [4096, 11008], "data_offsets": [0, 4096 * 11008 * 2]}}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    rng = np.random.default_rng(2)
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(text)) + text)
        for _ in range(0, 4096, 256):
            rows = (rng.standard_normal((256, 11008)) * 0.02).astype(np.float32)
            if code == "F16":
                out.write(rows.astype("<f2").tobytes())
            else:
                out.write((rows.view(np.uint32) >> 16).astype("<u2").tobytes())  # truncated


def run(checkout: Path, args: list[str], scratch: Path) -> tuple[float, float, int]:
    """(CPU s, wall s, peak RSS KiB) of one `python -m clipcli ARGS` with that checkout."""
    env = dict(os.environ, PYTHONPATH=str(checkout))
    timer = ["/usr/bin/time", "-f", "%U %S %e %M", "-o", str(scratch / "time.txt")]
    command = [*timer, sys.executable, "-m", "clipcli", *args]
    subprocess.run(command, env=env, cwd=scratch, stdout=subprocess.DEVNULL, check=True)
    user, system, wall, rss = (scratch / "time.txt").read_text().split()[-4:]
    return float(user) + float(system), float(wall), int(rss)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tensors", type=int, default=200_000)
    parser.add_argument("--axes-mib", type=int, default=1024)
    parser.add_argument("--slices-mib", type=int, default=100)
    parser.add_argument("--no-bf16", action="store_true")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--other", action="append", default=[], metavar="NAME=CHECKOUT")
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    trees = [("this", HERE)] + [
        (name, Path(path).resolve()) for name, path in (o.split("=", 1) for o in args.other)
    ]
    for _, checkout in trees:
        compile_clipcli(str(checkout))  # as pip install does: no compiling in the timed runs
    with tempfile.TemporaryDirectory() as temporary:
        scratch = args.dir or Path(temporary)
        scratch.mkdir(parents=True, exist_ok=True)
        tiny = scratch / f"tiny-{args.tensors}.safetensors"
        single = scratch / f"single-{args.axes_mib}mib.safetensors"
        if not tiny.exists():
            write_tiny(tiny, args.tensors)
        # diff's B sides: the same values (every pair bit-identical), and half of them
        # (every nonzero pair changed)
        tiny_copy = scratch / f"tiny-{args.tensors}-copy.safetensors"
        tiny_half = scratch / f"tiny-{args.tensors}-half.safetensors"
        if not tiny_copy.exists():
            write_tiny(tiny_copy, args.tensors)
        if not tiny_half.exists():
            write_tiny(tiny_half, args.tensors, 0.5)
        # what clip --norm 1 makes of `tiny`: every nonzero tensor exactly at the limit
        tiny_ties = scratch / f"tiny-{args.tensors}-ties.safetensors"
        if not tiny_ties.exists():
            write_tiny(tiny_ties, args.tensors, cap=1)
        small_bf16 = scratch / f"bf16-{args.tensors // 10}x64.safetensors"
        if not small_bf16.exists():
            write_small_bf16(small_bf16, args.tensors // 10)
        if args.axes_mib and not single.exists():
            write_single(single, args.axes_mib)
        pairs = {
            rows: scratch
            / f"pairs-{'rows' if rows else 'columns'}-{args.slices_mib}mib.safetensors"
            for rows in (True, False)
        }
        for rows, path in pairs.items():
            if args.slices_mib and not path.exists():
                write_pairs(path, args.slices_mib, rows)
        matrix = scratch / "bf16-4096x11008.safetensors"
        if not args.no_bf16 and not matrix.exists():
            write_bf16_matrix(matrix)
        half = scratch / "f16-4096x11008.safetensors"
        if not args.no_bf16 and not half.exists():
            write_bf16_matrix(half, "F16")
        out = str(scratch / "out.safetensors")
        jobs = [
            (f"norms, {args.tensors:,} one-element tensors", ["norms", str(tiny)]),
            (f"norms --format json, {args.tensors:,}", ["norms", "--format", "json", str(tiny)]),
            (
                f"clip --global 1, {args.tensors:,}",
                ["clip", "--global", "1", "--quiet", "--force", str(tiny), out],
            ),
            (  # the report of every tensor, to /dev/null: the streamed plain table
                f"clip --global 1 with its table, {args.tensors:,}",
                ["clip", "--global", "1", "--force", str(tiny), out],
            ),
            (  # a factor search per tensor
                f"clip --norm 0.5, {args.tensors:,}",
                ["clip", "--norm", "0.5", "--quiet", "--force", str(tiny), out],
            ),
            (  # paired small tensors read and compared many at a time
                f"diff, {args.tensors:,} pairs, bit-identical",
                ["diff", str(tiny), str(tiny_copy)],
            ),
            (
                f"diff, {args.tensors:,} pairs, 4 in 5 changed",
                ["diff", str(tiny), str(tiny_half)],
            ),
            (  # a clipped checkpoint clipped again: 160,000 ties, decided exactly
                f"clip --norm 1 again, {args.tensors:,} (4 in 5 at the limit)",
                ["clip", "--norm", "1", "--quiet", "--force", str(tiny_ties), out],
            ),
            (  # the same on 16-bit tensors: exact searches on their histograms
                f"clip --norm 5, {args.tensors // 10:,} bfloat16 tensors of 64",
                ["clip", "--norm", "5", "--quiet", "--force", str(small_bf16), out],
            ),
        ]
        if args.axes_mib:
            axes = ["clip", "--norm", "1", "--axes", "0", "--quiet", "--force", "--no-fsync"]
            jobs.append(
                (
                    f"clip --norm 1 --axes 0, one {args.axes_mib} MiB tensor",
                    [*axes, str(single), out],
                )
            )
            axes_1 = [*axes[:3], "--axes", "1", *axes[5:]]
            jobs.append(
                (
                    f"clip --norm 1 --axes 1, one {args.axes_mib} MiB tensor",
                    [*axes_1, str(single), out],
                )
            )
        if args.slices_mib:
            n = args.slices_mib * 131072
            axes = ["clip", "--norm", "1", "--quiet", "--force", "--no-fsync"]
            jobs.append(
                (
                    f"clip --norm 1 --axes 1, [{n:,}, 2] float32",
                    [*axes, "--axes", "1", str(pairs[True]), out],
                )
            )
            jobs.append(
                (
                    f"clip --norm 1 --axes 0, [2, {n:,}] float32",
                    [*axes, "--axes", "0", str(pairs[False]), out],
                )
            )
        if not args.no_bf16:
            flags = ["--quiet", "--force", "--no-fsync"]
            jobs.append(
                (
                    "clip --norm 0.5 --axes 1, bfloat16 [4096, 11008]",
                    ["clip", "--norm", "0.5", "--axes", "1", *flags, str(matrix), out],
                )
            )
            jobs.append(
                (
                    "clip --global 0.5, bfloat16 [4096, 11008]",
                    ["clip", "--global", "0.5", *flags, str(matrix), out],
                )
            )
            jobs.append(
                (
                    "clip --norm 0.5 --axes 1, float16 [4096, 11008]",
                    ["clip", "--norm", "0.5", "--axes", "1", *flags, str(half), out],
                )
            )
        results: dict[tuple[str, str], list[tuple[float, float, int]]] = {}
        for _ in range(args.runs):  # interleaved: drift in the machine hits every tree alike
            for label, job in jobs:
                for name, checkout in trees:
                    results.setdefault((label, name), []).append(run(checkout, job, scratch))
        load = " ".join(f"{x:.2f}" for x in os.getloadavg())
        print(f"load average after: {load}; {args.runs} runs\n")
        print("| job | tree | CPU s (median, min) | wall s (median) | peak RSS |")
        print("|---|---|---|---|---|")
        for label, _ in jobs:
            for name, _ in trees:
                runs = results[(label, name)]
                cpu = [r[0] for r in runs]
                print(
                    f"| {label} | {name} | {statistics.median(cpu):.2f} ({min(cpu):.2f}) | "
                    f"{statistics.median(r[1] for r in runs):.2f} | "
                    f"{max(r[2] for r in runs) / 1024:.0f} MiB |"
                )


if __name__ == "__main__":
    main()
