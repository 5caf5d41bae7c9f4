"""Issue 9 item 17: `clip` on 200,000 one-element tensors (a 14 MB safetensors file).

    python benchmarks/many_tiny_tensors.py [--tensors N]

Times one `clipcli clip --global 1` process (wall seconds and peak RSS via /usr/bin/time
where present). Measured on the shared 2-core machine, 2026-11-23: 91.8 s before (a
thread pool per tensor), 41.7 s with one shared pool, 20.4 s with one-chunk tensors run
inline as well.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tensors", type=int, default=200_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        src = Path(scratch) / "many.safetensors"
        save_file(
            {f"t{i}": np.array([float(i % 5)], np.float32) for i in range(args.tensors)},
            str(src),
        )
        command = [sys.executable, "-m", "clipcli", "clip", "--global", "1", "--quiet"]
        command += [str(src), str(Path(scratch) / "out.safetensors")]
        timer = shutil.which("time") or "/usr/bin/time"
        if Path(timer).exists():
            command = [timer, "-f", "%e s wall, %M KB peak RSS", *command]
        start = time.monotonic()
        subprocess.run(command, check=True)
        print(f"{args.tensors} one-element tensors: {time.monotonic() - start:.1f} s")


if __name__ == "__main__":
    main()
