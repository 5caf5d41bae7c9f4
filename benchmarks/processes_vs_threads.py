"""Why bf16 clip stops scaling with threads, and what processes would give (issue 20).

clip's measuring pass counts each 8/16-bit float chunk's bit patterns with np.bincount,
whose min/max scan runs with the GIL held (RESULTS.md, "bf16 clip CPU"). This times that
count alone over a .safetensors file's data, 2 MiB per pread, split across N Python
threads, across N forked processes that each read their share (each its own GIL), and
across N forked processes fed by N threads of the parent (a chunk read by the parent,
copied into the process's shared slot, counted there, the counts read back: what fits
clipcli's readers, which hand out chunks), for N = 1, 2, 4 ... up to the cores, and
checks that all give the same counts. Not clipcli's code: the question is how much a
process pool could win before building one.

    python benchmarks/processes_vs_threads.py FILE.safetensors [--runs 3]
"""

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import json
import mmap
import multiprocessing
import queue
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


class Counter:
    """A forked process that counts the chunks put into its shared slot."""

    def __init__(self) -> None:
        self.area = mmap.mmap(-1, CHUNK + 65536 * 8)  # shared with the child: the slot
        to_child, from_parent = os.pipe()
        to_parent, from_child = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the child: count until the parent closes the pipe
            try:
                # Every other descriptor (the other children's pipes too: each must see EOF).
                low, high = sorted((to_child, from_child))
                os.closerange(3, low)
                os.closerange(low + 1, high)
                os.closerange(high + 1, 1024)
                data = np.frombuffer(self.area, np.uint16, CHUNK // 2)
                counts = np.frombuffer(self.area, np.int64, 65536, offset=CHUNK)
                while len(asked := os.read(to_child, 8)) == 8:
                    counts[:] = np.bincount(data[: struct.unpack("<Q", asked)[0]], minlength=65536)
                    os.write(from_child, b"k")
            finally:
                os._exit(0)
        os.close(to_child)
        os.close(from_child)
        self.send, self.receive = from_parent, to_parent
        self.data = np.frombuffer(self.area, np.uint16, CHUNK // 2)
        self.counts = np.frombuffer(self.area, np.int64, 65536, offset=CHUNK)

    def count(self, bits: np.ndarray) -> np.ndarray:
        self.data[: bits.size] = bits
        os.write(self.send, struct.pack("<Q", bits.size))
        if os.read(self.receive, 1) != b"k":
            raise RuntimeError("the counting process died")
        return self.counts.copy()

    def close(self) -> None:
        os.close(self.send)
        os.waitpid(self.pid, 0)
        os.close(self.receive)


def fed_by_parent(path: str, offsets: list[int], workers: int) -> np.ndarray:
    """The counts, each chunk read by one of `workers` threads and counted by a process."""
    counters = [Counter() for _ in range(workers)]
    free: queue.SimpleQueue[Counter] = queue.SimpleQueue()
    for counter in counters:
        free.put(counter)
    fd = os.open(path, os.O_RDONLY)

    def one(offset: int) -> np.ndarray:
        buffer = np.empty(CHUNK, np.uint8)
        got = os.preadv(fd, [memoryview(buffer)], offset)
        counter = free.get()
        try:
            return counter.count(buffer[: got - got % 2].view(np.uint16))
        finally:
            free.put(counter)

    try:
        with ThreadPoolExecutor(workers) as pool:
            return sum(pool.map(one, offsets))
    finally:
        os.close(fd)
        for counter in counters:
            counter.close()


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
    print("| workers | threads wall | processes wall | threads / processes | fed by the parent |")
    print("|---|---|---|---|---|")
    reference = count(args.path, offsets)  # also brings the file into the page cache
    fork = multiprocessing.get_context("fork")
    for workers in counts:
        shares = [(args.path, offsets[k::workers]) for k in range(workers)]
        walls = {"threads": [], "processes": [], "fed": []}
        for _ in range(args.runs):
            began = time.perf_counter()
            with ThreadPoolExecutor(workers) as pool:
                by_threads = sum(pool.map(count, *zip(*shares, strict=True)))
            walls["threads"].append(time.perf_counter() - began)
            began = time.perf_counter()
            with fork.Pool(workers) as pool:
                by_processes = sum(pool.starmap(count, shares))
            walls["processes"].append(time.perf_counter() - began)
            began = time.perf_counter()
            by_fed = fed_by_parent(args.path, offsets, workers)
            walls["fed"].append(time.perf_counter() - began)
            assert np.array_equal(by_threads, reference)
            assert np.array_equal(by_processes, reference)
            assert np.array_equal(by_fed, reference)
        threads, processes, fed = (float(np.median(walls[k])) for k in walls)
        print(
            f"| {workers} | {threads:.3f} s | {processes:.3f} s | {threads / processes:.2f} "
            f"| {fed:.3f} s |"
        )


if __name__ == "__main__":
    main()
