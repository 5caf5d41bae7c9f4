"""Which of the numpy calls clipcli's worker threads make let go of the GIL, and how
NormAccumulator.add scales with threads on chunks already in memory (issue 20, "threads
that scale").

    python benchmarks/gil_ops.py [--threads 1,2,4] [--mib 256]

Part 1, per call on 2**20 values: its time alone, then its time while another Python
thread spins. A call that lets go of the GIL waits for the spinning thread's switch
interval (~5 ms) to get it back (3 ms or more longer); one that holds it runs about as
fast as alone. (`a @ a` on 1-D float64 holds it; np.dot, the same BLAS call, lets go.)
Calls shorter than ~100 us or longer than ~4 ms cannot be told apart this way: the
spinning thread may not wake within the one, and takes its turn inside the other.

Part 2: NormAccumulator.add on chunks of 2 MiB (clipcli's CHUNK_BYTES) of seeded
standard normals, --mib of them in all, split among N threads; wall seconds and CPU
seconds, the best of 3. No file is read: the thread scaling of the measuring code alone.
Run with PYTHONPATH=<checkout> for another tree's code.
"""

from __future__ import annotations

import os

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"  # as clipcli runs (system/blas.py); must precede `import numpy`

import argparse  # noqa: E402
import resource  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

from clipcli.numerics.norms import NormAccumulator  # noqa: E402


def _spinning_slowdown(op: Callable[[], object]) -> tuple[float, float]:
    """(seconds per call alone, seconds per call beside a spinning Python thread)."""
    op()
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < 0.2:
        op()
        calls += 1
    alone = (time.perf_counter() - start) / calls
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    spinner = threading.Thread(target=spin)
    spinner.start()
    start = time.perf_counter()
    for _ in range(20):
        op()
    beside = (time.perf_counter() - start) / 20
    stop.set()
    spinner.join()
    return alone, beside


def gil_table() -> None:
    n = 1 << 20
    rng = np.random.default_rng(0)
    f64 = rng.standard_normal(n)
    f32 = f64.astype(np.float32)
    bf16 = f64.astype(ml_dtypes.bfloat16)
    out = np.empty(n)
    ops: dict[str, Callable[[], object]] = {
        "np.dot(a, a), float64": lambda: np.dot(f64, f64),
        "a @ a, float64": lambda: f64 @ f64,
        "copyto bfloat16 -> float64": lambda: np.copyto(out, bf16),
        "copyto float32 -> float64": lambda: np.copyto(out, f32),
        "max of uint16 bits": lambda: bf16.view(np.uint16).max(),
        "max float32": lambda: f32.max(),
        "bincount of uint16 bits": lambda: np.bincount(bf16.view(np.uint16), minlength=1 << 16),
    }
    print("| call (2**20 values) | alone, us | beside a spinning thread, us | the GIL |")
    print("|---|---|---|---|")
    for name, op in ops.items():
        alone, beside = _spinning_slowdown(op)
        if alone > 4e-3:
            verdict = "cannot tell (too long)"
        elif beside - alone > 3e-3:
            verdict = "let go"
        else:
            verdict = "held" if alone >= 1e-4 else "cannot tell (too short)"
        print(f"| {name} | {alone * 1e6:.0f} | {beside * 1e6:.0f} | {verdict} |")


def scaling_table(threads: list[int], mib: int) -> None:
    rng = np.random.default_rng(1)
    print("\n| dtype | threads | wall s | CPU s | speed-up |")
    print("|---|---|---|---|---|")
    for dtype in (np.float32, ml_dtypes.bfloat16, np.float16):
        values_per_chunk = (2 << 20) // np.dtype(dtype).itemsize
        chunks = [rng.standard_normal(values_per_chunk).astype(dtype) for _ in range(mib // 2)]
        one = None
        for count in threads:
            best = (float("inf"), 0.0)
            for _ in range(3):
                parts = [chunks[k::count] for k in range(count)]

                def work(part: list[np.ndarray]) -> None:
                    for chunk in part:
                        NormAccumulator().add(chunk)

                workers = [threading.Thread(target=work, args=(p,)) for p in parts]
                used = resource.getrusage(resource.RUSAGE_SELF)
                start = time.perf_counter()
                for w in workers:
                    w.start()
                for w in workers:
                    w.join()
                wall = time.perf_counter() - start
                after = resource.getrusage(resource.RUSAGE_SELF)
                cpu = after.ru_utime - used.ru_utime + after.ru_stime - used.ru_stime
                best = min(best, (wall, cpu))
            one = one or best[0]
            name = np.dtype(dtype).name
            print(f"| {name} | {count} | {best[0]:.3f} | {best[1]:.3f} | {one / best[0]:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cores = len(os.sched_getaffinity(0))
    default = ",".join(str(1 << k) for k in range(cores.bit_length()) if 1 << k <= cores)
    parser.add_argument("--threads", default=default)
    parser.add_argument("--mib", type=int, default=256)
    args = parser.parse_args()
    gil_table()
    scaling_table([int(t) for t in args.threads.split(",")], args.mib)


if __name__ == "__main__":
    main()
