"""Speed at scale (issue 20): clipcli against the floor, cp/dd and PyTorch, per thread count.

Generates seeded fp32 and bf16 checkpoints of --size GiB each (a single .safetensors file
and a model directory of --shards shards), then times, in one interleaved run (A B C A B C
...), clipcli at CLIPCLI_THREADS = 1, 2, 4 ... up to the usable cores against:

- the floor (`floor_norms.py`: memmap + float64 dot) on the fp32 file, with one thread and
  with as many threads as cores,
- `cp IN OUT && sync OUT`, `cp -r` + sync for the directory, `dd bs=8M conv=fsync`,
- a plain PyTorch script (safe_open + vector_norm; load, mul_, save_file, fsync) when torch
  is installed.

Every run is a whole process; the table gives the median wall time, the median CPU seconds
(user + sys, from wait4: > wall means more than one core) and the largest peak RSS.

    python benchmarks/scale.py                     # 1 GiB per checkpoint under $TMPDIR
    python benchmarks/scale.py --size 4 --runs 5   # a bigger machine
    python benchmarks/scale.py --keep /tmp/scale   # reuse the generated files next time
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from common import compile_clipcli

HERE = Path(__file__).resolve().parent
CLIPCLI = [sys.executable, "-m", "clipcli"]
FLOOR = [sys.executable, str(HERE / "floor_norms.py")]
SHAPE = (4096, 4096)  # 16 Mi elements per tensor
# --jobs: each group's key and title
JOBS = {
    "norms-fp32": "norms, fp32 file",
    "norms-bf16": "norms, bf16 file (same bytes)",
    "norms-dir": "norms, bf16 model directory",
    "clip-file": "clip --global 1.0, bf16 file",
    "noop-file": "no-op clip --global 1e30, bf16 file",
    "noop-norm-file": "no-op clip --norm 1e30, bf16 file",
    "clip-dir": "clip --global 1.0, bf16 model directory",
}

TORCH_NORMS = """
import sys, torch
from pathlib import Path
from safetensors import safe_open
total = torch.zeros((), dtype=torch.float64)
path = Path(sys.argv[1])
for file in sorted(path.glob("*.safetensors")) if path.is_dir() else [path]:
    with safe_open(str(file), framework="pt") as f:
        for name in f.keys():
            total += torch.linalg.vector_norm(f.get_tensor(name), dtype=torch.float64) ** 2
print(float(total.sqrt()))
"""

TORCH_CLIP = """
import os, sys, torch
from pathlib import Path
from safetensors.torch import load_file, save_file
src, dst, limit = Path(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3])
files = sorted(src.glob("*.safetensors")) if src.is_dir() else [src]
tensors = [load_file(str(f)) for f in files]
ssq = sum(float(torch.linalg.vector_norm(t, dtype=torch.float64)) ** 2
          for d in tensors for t in d.values())
scale = limit / max(ssq ** 0.5, limit)
if src.is_dir():
    dst.mkdir()
    for other in src.iterdir():
        if other.suffix != ".safetensors":
            (dst / other.name).write_bytes(other.read_bytes())
for f, d in zip(files, tensors):
    for t in d.values():
        t.mul_(scale)
    out = dst / f.name if src.is_dir() else dst
    save_file(d, str(out))
    fd = os.open(out, os.O_RDONLY); os.fsync(fd); os.close(fd)
"""


def write_safetensors(path: Path, dtype: str, tensors: int, seed: int, prefix: str = "") -> None:
    """Seeded standard-normal tensors of SHAPE; bf16 = the top half of the float32 bits."""
    if path.exists():
        return
    item = 4 if dtype == "F32" else 2
    numel = SHAPE[0] * SHAPE[1]
    header, offset = {}, 0
    for i in range(tensors):
        header[f"{prefix}model.layers.{i}.weight"] = {
            "dtype": dtype,
            "shape": list(SHAPE),
            "data_offsets": [offset, offset + numel * item],
        }
        offset += numel * item
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    rng = np.random.default_rng(seed)
    partial = path.with_suffix(".partial")
    with open(partial, "wb") as out:
        out.write(struct.pack("<Q", len(text)) + text)
        for _ in range(tensors):
            values = rng.standard_normal(numel, dtype=np.float32)
            if dtype == "BF16":
                values = (values.view(np.uint32) >> 16).astype(np.uint16)
            out.write(values.tobytes())
    partial.rename(path)


def write_directory(path: Path, tensors: int, shards: int) -> None:
    """A Hugging Face model directory: bf16 shards and their index."""
    if (path / "model.safetensors.index.json").exists():
        return
    path.mkdir(parents=True, exist_ok=True)
    per_shard = max(1, tensors // shards)
    weight_map = {}
    for shard in range(shards):
        name = f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"
        prefix = f"shard{shard}."
        write_safetensors(path / name, "BF16", per_shard, seed=100 + shard, prefix=prefix)
        for i in range(per_shard):
            weight_map[f"{prefix}model.layers.{i}.weight"] = name
    index = {"metadata": {"total_size": per_shard * shards * SHAPE[0] * SHAPE[1] * 2}}
    index["weight_map"] = weight_map
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


GNU_TIME = Path("/usr/bin/time")


def timed(
    argv: list[str], env: dict[str, str], before: list[str] | None
) -> tuple[float, float, int]:
    """(wall s, CPU s of the process and its waited-for children, peak RSS KiB).

    Peak RSS comes from GNU time where it is installed: a forked child's ru_maxrss starts at
    this process's own. Without it (a bare image), wait4's ru_maxrss is used, an upper bound.
    """
    if before:
        subprocess.run(before, check=True)
        os.sync()
    with tempfile.NamedTemporaryFile("r") as peak:
        wrapped = [str(GNU_TIME), "-o", peak.name, "-f", "%M", *argv]
        if not GNU_TIME.exists():
            wrapped = argv
        start = time.perf_counter()
        child = subprocess.Popen(
            wrapped, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        _, status, usage = os.wait4(child.pid, 0)
        wall = time.perf_counter() - start
        code = os.waitstatus_to_exitcode(status)
        error = child.stderr.read().decode() if child.stderr else ""
        if code not in (0, 1):
            raise SystemExit(f"{' '.join(argv)} failed ({code}): {error}")
        rss = int(peak.read().split()[-1]) if GNU_TIME.exists() else usage.ru_maxrss
    return wall, usage.ru_utime + usage.ru_stime, rss


def thread_counts(cores: int) -> list[int]:
    counts, n = [], 1
    while n < cores:
        counts.append(n)
        n *= 2
    return [*counts, cores]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=float, default=1.0, help="GiB per checkpoint")
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--keep", type=Path, help="folder for the files, kept for reuse")
    parser.add_argument("--threads", help="comma-separated thread counts (default 1,2,4..cores)")
    parser.add_argument(
        "--jobs",
        default=",".join(JOBS),
        help=f"comma-separated groups to run, of {', '.join(JOBS)} (default: all)",
    )
    parser.add_argument(
        "--default-threads",
        action="store_true",
        help="also run each clipcli row without CLIPCLI_THREADS (the machine's default)",
    )
    parser.add_argument("--json", type=Path, help="write every run's figures here (JSON)")
    args = parser.parse_args()
    jobs = set(args.jobs.split(","))
    if jobs - set(JOBS):
        parser.error(f"unknown jobs: {', '.join(sorted(jobs - set(JOBS)))}")
    compiled = compile_clipcli()  # as pip install does: no compiling inside the timed runs
    cores = len(os.sched_getaffinity(0))
    threads = [int(t) for t in args.threads.split(",")] if args.threads else thread_counts(cores)
    work = args.keep or Path(tempfile.mkdtemp(prefix="clipcli-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    fp32_tensors = max(1, round(args.size * 2**30 / (SHAPE[0] * SHAPE[1] * 4)))
    bf16_tensors = 2 * fp32_tensors
    f32, bf16, directory = work / "fp32.safetensors", work / "bf16.safetensors", work / "bf16-dir"
    if jobs & {"norms-fp32", "norms-bf16"}:  # the floor reads the fp32 file
        write_safetensors(f32, "F32", fp32_tensors, seed=1)
    if jobs & {"norms-bf16", "clip-file", "noop-file", "noop-norm-file"}:
        write_safetensors(bf16, "BF16", bf16_tensors, seed=2)
    if jobs & {"norms-dir", "clip-dir"}:
        write_directory(directory, bf16_tensors, args.shards)
    out, out_dir = work / "out.safetensors", work / "out-dir"
    clear = ["rm", "-rf", str(out), str(out_dir)]
    has_torch = subprocess.run([sys.executable, "-c", "import torch"], capture_output=True)
    torch = has_torch.returncode == 0

    def clipcli(*words: str) -> list[str]:
        return [*CLIPCLI, *words]

    groups: list[tuple[str, list[tuple[str, list[str], dict[str, str], list[str] | None]]]] = []
    base = dict(os.environ)

    def with_threads(n: int) -> dict[str, str]:
        return {**base, "CLIPCLI_THREADS": str(n)}

    def threaded(label: str, argv: list[str], before: list[str] | None = None) -> list:
        rows = [(f"{label}, {n} thr", argv, with_threads(n), before) for n in threads]
        if args.default_threads:
            unset = {k: v for k, v in base.items() if k != "CLIPCLI_THREADS"}
            rows.append((f"{label}, default threads", argv, unset, before))
        return rows

    many = [*FLOOR, str(f32), "--threads", str(cores)]
    floor_threaded = (f"floor ({cores} thr)", many, base, None)
    groups.append(
        (
            "norms, fp32 file",
            [
                ("floor (1 thread)", [*FLOOR, str(f32)], base, None),
                floor_threaded,
            ]
            + threaded("clipcli norms", clipcli("norms", "--format", "json", str(f32))),
        )
    )
    groups.append(
        (
            "norms, bf16 file (same bytes)",
            [("fp32 floor (same bytes)", [*FLOOR, str(f32)], base, None)]
            + threaded("clipcli norms", clipcli("norms", "--format", "json", str(bf16))),
        )
    )
    dir_norms = threaded("clipcli norms", clipcli("norms", "--format", "json", str(directory)))
    if torch:
        dir_norms.append(
            ("PyTorch script", [sys.executable, "-c", TORCH_NORMS, str(directory)], base, None)
        )
    groups.append(("norms, bf16 model directory", dir_norms))
    copy_sync = ["sh", "-c", 'cp "$0" "$1" && sync "$1"', str(bf16), str(out)]
    dd = ["dd", f"if={bf16}", f"of={out}", "bs=8M", "conv=fsync", "status=none"]
    for label, mode, limit in (
        ("clip --global 1.0", "--global", "1.0"),
        ("no-op clip --global 1e30", "--global", "1e30"),
        ("no-op clip --norm 1e30", "--norm", "1e30"),
    ):
        rows = [("cp + sync", copy_sync, base, clear), ("dd conv=fsync", dd, base, clear)]
        rows += threaded(label, clipcli("clip", mode, limit, str(bf16), str(out), "--quiet"), clear)
        groups.append((f"{label}, bf16 file", rows))
    copy_dir = ["sh", "-c", 'cp -r "$0" "$1" && sync -f "$1"', str(directory), str(out_dir)]
    rows = [("cp -r + sync", copy_dir, base, clear)]
    rows += threaded(
        "clip --global 1.0",
        clipcli("clip", "--global", "1.0", str(directory), f"{out_dir}/", "--quiet"),
        clear,
    )
    if torch:
        rows.append(
            (
                "PyTorch script",
                [sys.executable, "-c", TORCH_CLIP, str(directory), str(out_dir), "1.0"],
                base,
                clear,
            )
        )
    groups.append(("clip --global 1.0, bf16 model directory", rows))

    titles = {JOBS[key] for key in jobs}
    groups = [group for group in groups if group[0] in titles]
    everything: list[dict[str, object]] = []
    print(f"# scale benchmark: {cores} cores, {args.size:g} GiB per checkpoint, {args.runs} runs")
    print(f"load average before: {os.getloadavg()}, torch: {'yes' if torch else 'not installed'}")
    print(f"clipcli's modules: {'compiled to bytecode first' if compiled else 'compile FAILED'}")
    if not GNU_TIME.exists():
        print("no /usr/bin/time: peak RSS is wait4's, which counts this script's own at fork")
    print()
    print("| job | command | wall (median) | CPU s (median) | peak RSS | vs first row |")
    print("|---|---|---|---|---|---|")
    for title, commands in groups:
        for _, argv, env, before in commands:  # warm-up: page cache, bytecode
            timed(argv, env, before)
        results: dict[str, list[tuple[float, float, int]]] = {c[0]: [] for c in commands}
        for _ in range(args.runs):
            for label, argv, env, before in commands:
                results[label].append(timed(argv, env, before))
        first = statistics.median(r[0] for r in results[commands[0][0]])
        for label, runs in results.items():
            wall = statistics.median(r[0] for r in runs)
            cpu = statistics.median(r[1] for r in runs)
            rss = max(r[2] for r in runs) / 1024
            ratio = wall / first
            print(f"| {title} | {label} | {wall:.3f} s | {cpu:.2f} | {rss:.0f} MiB | {ratio:.2f} |")
            everything.append(
                {
                    "job": title,
                    "command": label,
                    "runs": [{"wall_s": w, "cpu_s": c, "peak_rss_kib": r} for w, c, r in runs],
                    "wall_median_s": wall,
                    "cpu_median_s": cpu,
                }
            )
        sys.stdout.flush()
        if args.json:  # after each group: a run cut short keeps what it measured
            meta = {"cores": cores, "size_gib": args.size, "runs": args.runs, "torch": torch}
            args.json.write_text(json.dumps({"machine": meta, "rows": everything}, indent=1))
    print(f"\nload average after: {os.getloadavg()}")
    subprocess.run(clear, check=True)
    if args.keep is None:
        shutil.rmtree(work)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
