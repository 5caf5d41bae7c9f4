"""Time `clip --norm 1` and `clip --global 1` on one bf16 and one fp16 safetensors file,
for this checkout and (optionally) another clipcli source tree, e.g. the commit before the
histogram scale search (issue 10):

    mkdir /tmp/old && git archive 50cd0a5 | tar -x -C /tmp/old
    python benchmarks/scale_search.py --size-mib 1024 --other /tmp/old

Files come from gen_files.py's generator, as run.py's do (seeded standard normals, 128
tensors of [rows, 1024]);
each command runs --runs times with --no-fsync; median and least wall and CPU time are printed.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import MIB  # noqa: E402
from gen_files import Checkpoint, write_safetensors  # noqa: E402


def timed(argv: list[str], src_root: Path) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the child: user + system). On a shared machine the CPU
    time is the steadier figure; the wall time is what a user waits."""
    env = dict(os.environ, PYTHONPATH=str(src_root))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(argv, check=True, env=env, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size-mib", type=int, default=512)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/clipcli-scale-bench"))
    parser.add_argument("--other", type=Path, help="another clipcli source tree to compare")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dtypes", nargs="+", default=["BF16", "F16"], choices=["BF16", "F16"])
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    trees = {"this": HERE.parent}
    if args.other:
        trees["other"] = args.other
    for dtype in args.dtypes:
        rows = args.size_mib * MIB // 128 // 2 // 1024
        path = args.dir / f"{dtype.lower()}-{args.size_mib}mib.safetensors"
        write_safetensors(Checkpoint(path, "safetensors", dtype, 128, (rows, 1024)), seed=1)
        out = args.dir / "out.safetensors"
        for mode in (["--norm", "1"], ["--global", "1"]):
            for label, root in trees.items():
                argv = [sys.executable, "-m", "clipcli", "clip", *mode, str(path), str(out)]
                argv += ["--force", "--no-fsync", "-q"]
                samples = [timed(argv, root) for _ in range(args.runs)]
                walls = [w for w, _ in samples]
                cpus = [c for _, c in samples]
                print(
                    f"{dtype} {args.size_mib} MiB clip {' '.join(mode)} [{label}]: "
                    f"wall median {statistics.median(walls):.2f} s (min {min(walls):.2f}), "
                    f"CPU median {statistics.median(cpus):.2f} s (min {min(cpus):.2f})",
                    flush=True,
                )
        out.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
