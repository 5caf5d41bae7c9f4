"""Why norms stop scaling past 4 threads (issue 20): one sweep of the developer knobs on a
many-core machine, in one run.

    OUT=/some/dir python benchmarks/thread_knobs.py [--size-gib 2] [--runs 2]

Writes a 2 GiB float32 and a 2 GiB bfloat16 safetensors file under $TMPDIR, then times
`clipcli norms FILE -q` (whole processes, median wall and CPU of --runs after a warm-up)
for CLIPCLI_THREADS x (CLIPCLI_CHUNK_BYTES, CLIPCLI_CACHE_BLOCK) x
CLIPCLI_SWITCH_INTERVAL_US, beside two floors on the same bytes: one thread (memmap,
float64 blocks, dot) and every core (the same in a thread pool). First come the fixed
costs (a bare interpreter, `import numpy`, clipcli on a 16-byte file), which a whole-process
time on a small file includes at every thread count, and the page cache's own pread
bandwidth at 1, 4 and every thread (2 MiB reads into one reused buffer per thread, no
arithmetic). Prints a markdown table and writes it, with every run as JSON, under $OUT.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

FLOOR = r"""
import sys, numpy as np
from concurrent.futures import ThreadPoolExecutor
path, offset, count, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
data = np.memmap(path, dtype=np.float32, mode="r", offset=offset, shape=(count,))
block = 1 << 18
def part(lo, hi):
    total = 0.0
    for start in range(lo, hi, block):
        wide = data[start:min(start + block, hi)].astype(np.float64)
        total += float(np.dot(wide, wide))  # matmul would hold the GIL
    return total
step = -(-count // threads)
step = -(-step // block) * block
with ThreadPoolExecutor(threads) as pool:
    parts = list(pool.map(lambda lo: part(lo, min(lo + step, count)), range(0, count, step)))
print(sum(parts) ** 0.5)
"""

PREAD = r"""
import os, sys, numpy as np
from concurrent.futures import ThreadPoolExecutor
path, threads = sys.argv[1], int(sys.argv[2])
size, piece = os.path.getsize(path), 1 << 21
fd = os.open(path, os.O_RDONLY)
def part(k):
    buffer = np.empty(piece, np.uint8)
    for at in range(k * piece, size, threads * piece):
        os.preadv(fd, [buffer[: min(piece, size - at)]], at)
with ThreadPoolExecutor(threads) as pool:
    list(pool.map(part, range(threads)))
"""


def write_file(path: Path, dtype: str, elements: int) -> None:
    header = json.dumps(
        {
            "w": {
                "dtype": dtype,
                "shape": [elements],
                "data_offsets": [0, elements * (4 if dtype == "F32" else 2)],
            }
        }
    ).encode()
    header += b" " * (-len(header) % 8)
    rng = np.random.default_rng(0)
    with open(path, "wb") as handle:
        handle.write(len(header).to_bytes(8, "little") + header)
        step = 1 << 24
        for start in range(0, elements, step):
            values = rng.standard_normal(min(step, elements - start), dtype=np.float32)
            if dtype == "BF16":
                values = (values.view(np.uint32) >> 16).astype(np.uint16)
            handle.write(values.tobytes())


def timed(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    start = time.perf_counter()
    child = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - start
    if status != 0:
        raise SystemExit(f"{argv} failed: {child.stderr.read().decode() if child.stderr else ''}")
    return wall, usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size-gib", type=float, default=2.0)
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    out = Path(os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    cores = len(os.sched_getaffinity(0))
    work = Path(tempfile.mkdtemp())
    size = int(args.size_gib * (1 << 30))
    fp32, bf16 = work / "fp32.safetensors", work / "bf16.safetensors"
    write_file(fp32, "F32", size // 4)
    write_file(bf16, "BF16", size // 2)
    offset = 8 + int.from_bytes(fp32.read_bytes()[:8], "little")
    base = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    for name in (
        "CLIPCLI_THREADS",
        "CLIPCLI_CHUNK_BYTES",
        "CLIPCLI_CACHE_BLOCK",
        "CLIPCLI_SWITCH_INTERVAL_US",
    ):
        base.pop(name, None)
    clipcli = [sys.executable, "-m", "clipcli", "norms"]
    cases: list[tuple[str, list[str], dict[str, str]]] = []
    tiny = work / "tiny.npz"
    np.savez(tiny, w=np.arange(4, dtype=np.float32))
    cases.append(("start-up: python -c pass", [sys.executable, "-c", "pass"], {}))
    cases.append(("start-up: import numpy", [sys.executable, "-c", "import numpy"], {}))
    cases.append(("start-up: clipcli norms of a 16-byte npz", [*clipcli, str(tiny), "-q"], {}))
    for threads in sorted({1, 4, cores}):
        cases.append(
            (
                f"pread only, {threads} thr",
                [sys.executable, "-c", PREAD, str(fp32), str(threads)],
                {},
            )
        )
    for threads in (1, cores):
        cases.append(
            (
                f"floor, {threads} thr",
                [sys.executable, "-c", FLOOR, str(fp32), str(offset), str(size // 4), str(threads)],
                {},
            )
        )
    layouts = [
        ("2M", "256K", 1 << 21, 1 << 18),
        ("8M", "256K", 1 << 23, 1 << 18),
        ("8M", "1M", 1 << 23, 1 << 20),
        ("32M", "1M", 1 << 25, 1 << 20),
        ("32M", "4M", 1 << 25, 1 << 22),
    ]
    for chunk_name, block_name, chunk, block in layouts:
        for threads in sorted({1, 4, 8, 16, cores}):
            env = {
                "CLIPCLI_THREADS": str(threads),
                "CLIPCLI_CHUNK_BYTES": str(chunk),
                "CLIPCLI_CACHE_BLOCK": str(block),
            }
            cases.append(
                (
                    f"fp32 chunk {chunk_name} block {block_name}, {threads} thr",
                    [*clipcli, str(fp32), "-q"],
                    env,
                )
            )
    for switch in ("100", "20000"):
        env = {"CLIPCLI_THREADS": str(cores), "CLIPCLI_SWITCH_INTERVAL_US": switch}
        cases.append(
            (
                f"fp32 default layout, switch {switch} us, {cores} thr",
                [*clipcli, str(fp32), "-q"],
                env,
            )
        )
    for chunk_name, block_name, chunk, block in (layouts[0], layouts[2], layouts[3]):
        for threads in (1, 4, cores):
            env = {
                "CLIPCLI_THREADS": str(threads),
                "CLIPCLI_CHUNK_BYTES": str(chunk),
                "CLIPCLI_CACHE_BLOCK": str(block),
            }
            cases.append(
                (
                    f"bf16 chunk {chunk_name} block {block_name}, {threads} thr",
                    [*clipcli, str(bf16), "-q"],
                    env,
                )
            )
    results = []
    deadline = time.monotonic() + float(os.environ.get("DEADLINE_S", "330"))
    for label, argv, extra in cases:
        if time.monotonic() > deadline:
            print(f"stopped at the deadline before: {label}", flush=True)
            break
        env = dict(base, **extra)
        timed(argv, env)  # warm-up
        runs = [timed(argv, env) for _ in range(args.runs)]
        row = {
            "case": label,
            "wall": statistics.median(r[0] for r in runs),
            "cpu": statistics.median(r[1] for r in runs),
        }
        results.append(row)
        print(
            f"| {label} | {row['wall']:.3f} s | {row['cpu']:.2f} |",
            flush=True,
        )
        (out / "thread_knobs.json").write_text(
            json.dumps({"cores": cores, "size_gib": args.size_gib, "results": results}, indent=1)
        )
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
