"""Time `clip --norm 1` and `clip --global 1` on one bf16 and one fp16 safetensors file,
for this checkout and (optionally) another clipcli source tree, e.g. the commit before the
histogram scale search (issue 10):

    mkdir /tmp/old && git archive 50cd0a5 | tar -x -C /tmp/old
    python benchmarks/scale_search.py --size-mib 1024 --other before=/tmp/old

Files come from run.py's generator (seeded standard normals, 128 tensors of [rows, 1024]);
each command runs --runs times with --no-fsync, the trees interleaved; median and least wall
and CPU time are printed.
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

from run import MIB, Checkpoint, write_safetensors  # noqa: E402


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
    parser.add_argument(
        "--other",
        action="append",
        default=[],
        metavar="[LABEL=]TREE",
        help="another clipcli source tree to compare (repeatable)",
    )
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dtypes", nargs="+", default=["BF16", "F16"], choices=["BF16", "F16"])
    parser.add_argument(
        "--modes", nargs="+", default=["norm", "global"], choices=["norm", "global"]
    )
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    trees = {"this": HERE.parent}
    for other in args.other:
        label, _, tree = other.rpartition("=")
        trees[label or f"other{len(trees)}"] = Path(tree)
    for dtype in args.dtypes:
        rows = args.size_mib * MIB // 128 // 2 // 1024
        path = args.dir / f"{dtype.lower()}-{args.size_mib}mib.safetensors"
        write_safetensors(Checkpoint(path, "safetensors", dtype, 128, (rows, 1024)), seed=1)
        out = args.dir / "out.safetensors"
        for mode in ([f"--{name}", "1"] for name in args.modes):
            argv = [sys.executable, "-m", "clipcli", "clip", *mode, str(path), str(out)]
            argv += ["--force", "--no-fsync", "-q"]
            # Interleaved (A B C A B C ...), so drift in the machine's load hits all alike.
            samples: dict[str, list[tuple[float, float]]] = {label: [] for label in trees}
            for _ in range(args.runs):
                for label, root in trees.items():
                    samples[label].append(timed(argv, root))
            for label, runs in samples.items():
                walls = [w for w, _ in runs]
                cpus = [c for _, c in runs]
                print(
                    f"{dtype} {args.size_mib} MiB clip {' '.join(mode)} [{label}]: "
                    f"wall median {statistics.median(walls):.2f} s (min {min(walls):.2f}), "
                    f"CPU median {statistics.median(cpus):.2f} s (min {min(cpus):.2f})",
                    flush=True,
                )
        out.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
