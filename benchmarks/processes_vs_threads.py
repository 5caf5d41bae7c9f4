"""Why bf16 clip stops scaling with threads, and what processes would give (issue 20).

clip's measuring pass counts each 8/16-bit float chunk's bit patterns with np.bincount,
whose min/max scan runs with the GIL held (RESULTS.md, "bf16 clip CPU"). This times that
count alone over a .safetensors file's data, 2 MiB per pread, split across N Python
threads and across N forked processes (each its own GIL), for N = 1, 2, 4 ... up to the
cores, and checks that both give the same counts. Not clipcli's code: the question is
how much a process pool could win before building one.

    python benchmarks/processes_vs_threads.py FILE.safetensors [--runs 3]
"""

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import json
import multiprocessing
import struct
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

CHUNK = 2 << 20


def count(path: str, offsets: list[int]) -> np.ndarray:
    """Bit-pattern counts of the 16-bit values in the chunks at `offsets`."""
    fd = os.open(path, os.O_RDONLY)
    try:
        total = np.zeros(65536, np.int64)
        buffer = np.empty(CHUNK, np.uint8)
        for offset in offsets:
            got = os.preadv(fd, [memoryview(buffer)], offset)
            total += np.bincount(buffer[: got - got % 2].view(np.uint16), minlength=65536)
        return total
    finally:
        os.close(fd)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    with open(args.path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        json.loads(handle.read(length))  # a .safetensors header: the data follows it
    start, end = 8 + length, os.path.getsize(args.path)
    offsets = list(range(start, end, CHUNK))
    cores = os.cpu_count() or 1
    counts = [1]
    while counts[-1] * 2 <= cores:
        counts.append(counts[-1] * 2)
    if counts[-1] != cores:
        counts.append(cores)
    print(f"# {args.path}: {end - start} bytes, {cores} cores, medians of {args.runs} runs")
    print("| workers | threads wall | processes wall | threads / processes |")
    print("|---|---|---|---|")
    reference = count(args.path, offsets)  # also brings the file into the page cache
    fork = multiprocessing.get_context("fork")
    for workers in counts:
        shares = [(args.path, offsets[k::workers]) for k in range(workers)]
        walls = {"threads": [], "processes": []}
        for _ in range(args.runs):
            began = time.perf_counter()
            with ThreadPoolExecutor(workers) as pool:
                by_threads = sum(pool.map(count, *zip(*shares, strict=True)))
            walls["threads"].append(time.perf_counter() - began)
            began = time.perf_counter()
            with fork.Pool(workers) as pool:
                by_processes = sum(pool.starmap(count, shares))
            walls["processes"].append(time.perf_counter() - began)
            assert np.array_equal(by_threads, reference)
            assert np.array_equal(by_processes, reference)
        threads, processes = (float(np.median(walls[k])) for k in ("threads", "processes"))
        print(f"| {workers} | {threads:.3f} s | {processes:.3f} s | {threads / processes:.2f} |")


if __name__ == "__main__":
    main()
