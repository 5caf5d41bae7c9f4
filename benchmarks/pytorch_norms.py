"""`clipcli norms` of a zip-format PyTorch `.bin` against the same bytes in safetensors
(issue 22): CPU seconds and peak RSS, flat from 512 MiB to 2 GiB.

    python benchmarks/pytorch_norms.py [--size-mib 2048] [--runs 5] [--keep DIR]

Generates a seeded fp32 safetensors file of --size-mib MiB (tensors of 32 MiB, as the
large matrices of a real model) and a 512 MiB one, converts each to a `.bin` with clipcli
itself (torch's zip layout: stored, 64-byte aligned records), and times `clipcli norms` on
each, the commands taking turns (a warm-up run each first, page cache warm). Reported per
command: the median CPU seconds (user + sys of the process, from wait4) and wall seconds,
and the peak RSS. Targets: `.bin` CPU <= 1.3 x safetensors CPU on the same bytes; the
`.bin`'s peak RSS at the big size <= 1.10 x at 512 MiB. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

TENSOR_MIB = 32


def clipcli() -> list[str]:
    return [sys.executable, "-m", "clipcli"]


def make(directory: Path, size_mib: int) -> tuple[Path, Path]:
    from safetensors.numpy import save_file

    safetensors = directory / f"w{size_mib}.safetensors"
    pytorch = directory / f"w{size_mib}.bin"
    if not safetensors.exists():
        rng = np.random.default_rng(size_mib)
        elems = TENSOR_MIB * (1 << 20) // 4
        tensors = {
            f"layers.{n}.weight": rng.standard_normal(elems, dtype=np.float32).reshape(-1, 1024)
            for n in range(size_mib // TENSOR_MIB)
        }
        save_file(tensors, safetensors)
        del tensors
    if not pytorch.exists():
        subprocess.run([*clipcli(), "convert", "-q", str(safetensors), str(pytorch)], check=True)
    return safetensors, pytorch


def run_once(argv: list[str]) -> tuple[float, float, int]:
    """(CPU seconds, wall seconds, peak RSS in KiB) of one process."""
    start = time.perf_counter()
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"failed: {' '.join(argv)}: {process.stderr.read().decode()}")  # type: ignore[union-attr]
    process.stderr.close()  # type: ignore[union-attr]
    return usage.ru_utime + usage.ru_stime, wall, usage.ru_maxrss


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=2048)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--keep", type=Path)
    args = parser.parse_args()
    directory = args.keep or Path(tempfile.mkdtemp(prefix="clipcli-pytorch-bench-"))
    directory.mkdir(parents=True, exist_ok=True)
    # Made in a child process: a child's peak RSS (wait4) starts from its parent's at the
    # fork, and making the arrays here would lift every measured command's to their size.
    here = str(Path(__file__).resolve().parent)
    for size in (512, args.size_mib):
        call = (
            f"import sys; sys.path.insert(0, {here!r}); import pytorch_norms; "
            f"pytorch_norms.make(pytorch_norms.Path({str(directory)!r}), {size})"
        )
        subprocess.run([sys.executable, "-c", call], check=True)
    small_safe, small_bin = make(directory, 512)
    big_safe, big_bin = make(directory, args.size_mib)
    commands = {
        name: [*clipcli(), "norms", "--format", "json", str(path)]
        for name, path in [
            ("safetensors", big_safe),
            ("bin", big_bin),
            ("bin 512 MiB", small_bin),
            ("safetensors 512 MiB", small_safe),
        ]
    }
    results: dict[str, list[tuple[float, float, int]]] = {name: [] for name in commands}
    for argv in commands.values():
        run_once(argv)  # warm-up: page cache
    for _ in range(args.runs):
        for name, argv in commands.items():
            results[name].append(run_once(argv))
    cpu = {name: statistics.median(r[0] for r in runs) for name, runs in results.items()}
    wall = {name: statistics.median(r[1] for r in runs) for name, runs in results.items()}
    rss = {name: max(r[2] for r in runs) // 1024 for name, runs in results.items()}
    size = f"{args.size_mib / 1024:g} GiB"
    print(f"fp32, {args.size_mib // TENSOR_MIB} tensors of {TENSOR_MIB} MiB; {args.runs} runs")
    print(f"load average: {os.getloadavg()}\n")
    print("| command | CPU s | wall s | peak RSS |")
    print("|---|---|---|---|")
    for name in commands:
        shown = name if "512" in name else f"{name} {size}"
        print(f"| norms, {shown} | {cpu[name]:.3f} | {wall[name]:.3f} | {rss[name]} MiB |")
    ratio = cpu["bin"] / cpu["safetensors"]
    growth = rss["bin"] / rss["bin 512 MiB"]
    print(f"\n.bin / safetensors CPU, {size}: {ratio:.2f} (target <= 1.3: {ratio <= 1.3})")
    print(f".bin peak RSS {size} / 512 MiB: {growth:.2f} (target <= 1.10: {growth <= 1.10})")
    return 0 if ratio <= 1.3 and growth <= 1.10 else 1


if __name__ == "__main__":
    sys.exit(main())
