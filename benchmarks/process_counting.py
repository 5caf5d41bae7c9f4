"""What counting the bit patterns in forked processes would give a real bf16 clip (issue 20).

clip's measuring pass counts each 8/16-bit float chunk's bit patterns with np.bincount in
the worker threads, and np.bincount holds the GIL for part of each call (its min/max scan
and its arguments): two threads count ~1.3-1.4x as fast as one, where two processes count
twice as fast (`processes_vs_threads.py`). This runs one whole `clipcli` command in this
process either as it is (`--counting threads`) or with `lookup.bit_pattern_counts`
replaced by one that hands each chunk to a process forked before the command starts, one
per worker thread and one for the main thread (`--counting processes`: the chunk copied
into a shared slot, the counts read back; processes_vs_threads.Counter). The written
bytes must be the same either way (cmp them). Not clipcli's code: the first design
measured (RESULTS.md, session 45), which lost on the 2-core VM: the hand-off of each chunk
(2 MiB copied in, 512 KiB of counts out, two pipe wake-ups) cost more than the GIL it
freed. The one built (clipcli.system.counting) has each helper read the chunk itself
through the reader's descriptor; compare it with `CLIPCLI_COUNTING_PROCESSES=0`.
Run this one with CLIPCLI_COUNTING_PROCESSES=0 too, so that the two do not mix.

    /usr/bin/time -f "%e s %U u %S s" python benchmarks/process_counting.py \
        --counting processes -- clip --no-fsync -q --global 1.0 IN.safetensors OUT.safetensors

(/usr/bin/time counts the children's CPU too: they are waited for before the exit.)
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"  # as clipcli runs (system/blas.py); must precede `import numpy`

import argparse  # noqa: E402
import queue  # noqa: E402

import numpy as np  # noqa: E402
from processes_vs_threads import CHUNK, Counter  # noqa: E402

from clipcli.cli.entry import main as clipcli_main  # noqa: E402
from clipcli.numerics import lookup  # noqa: E402
from clipcli.system.parallel import worker_count  # noqa: E402


def with_counting_processes(count: int) -> list[Counter]:
    """Fork `count` counters now (before clipcli starts a thread) and make
    lookup.bit_pattern_counts use them for 16-bit chunks that fit a slot."""
    counters = [Counter() for _ in range(count)]
    free: queue.SimpleQueue[Counter] = queue.SimpleQueue()
    for counter in counters:
        free.put(counter)
    in_thread = lookup.bit_pattern_counts

    def counted(chunk: np.ndarray) -> np.ndarray:
        if chunk.dtype.itemsize != 2 or chunk.nbytes > CHUNK:
            return in_thread(chunk)
        counter = free.get()  # the main thread counts too (a tensor's late chunks)
        try:
            counts: np.ndarray = counter.count(chunk.reshape(-1).view(np.uint16))
        finally:
            free.put(counter)
        return counts.astype(np.intp)

    lookup.bit_pattern_counts = counted
    return counters


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counting", choices=("threads", "processes"), required=True)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then clipcli's arguments")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    counters = with_counting_processes(worker_count() + 1) if args.counting == "processes" else []
    try:
        code = clipcli_main(command)
    finally:
        for counter in counters:
            counter.close()
    return code


if __name__ == "__main__":
    sys.exit(main())
