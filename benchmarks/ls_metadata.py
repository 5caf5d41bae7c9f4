"""`clipcli ls` on safetensors files with many metadata keys: is rendering linear?

    python benchmarks/ls_metadata.py                 # 10k, 100k, 1M keys, table/json/csv
    python benchmarks/ls_metadata.py 1000000 table   # one size, one format

Prints wall seconds per run and microseconds per key; linear rendering keeps the last
column flat as the key count grows (issue 9 item 17: 1M keys took 230 s when the footer
was printed one rich call per line). Files are written to a temporary directory.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file


def main() -> None:
    sizes = [int(sys.argv[1])] if len(sys.argv) > 1 else [10_000, 100_000, 1_000_000]
    formats = [sys.argv[2]] if len(sys.argv) > 2 else ["table", "json", "csv"]
    with tempfile.TemporaryDirectory() as tmp:
        print("keys       format  file MB  seconds  us/key")
        for n in sizes:
            path = Path(tmp) / f"meta{n}.safetensors"
            metadata = {f"key{i}": f"value{i}" for i in range(n)}
            save_file({"w": np.ones(2, np.float32)}, str(path), metadata=metadata)
            for fmt in formats:
                started = time.perf_counter()
                done = subprocess.run(
                    [sys.executable, "-m", "clipcli", "ls", str(path), "--format", fmt],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    check=False,
                )
                seconds = time.perf_counter() - started
                if done.returncode != 0:
                    sys.exit(f"clipcli failed: {done.stderr.decode()}")
                size_mb = path.stat().st_size / 1e6
                print(f"{n:<10} {fmt:<7} {size_mb:7.1f} {seconds:8.2f} {seconds / n * 1e6:7.2f}")


if __name__ == "__main__":
    main()
