"""An order-preserving, bounded-lookahead thread map.

numpy releases the GIL in casts, reductions and dot products, and pread releases it too,
so threads use several cores without copying data between processes; the hand-overs of
the GIL between numpy calls limit it to about four (DEFAULT_MAX_THREADS).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import queue
import stat
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Generic, TypeVar, cast

from clipcli.system.address_space import has_room

T = TypeVar("T")
R = TypeVar("R")


# Where a cgroup (v2) limits the CPU time of this process: "max 100000" or "QUOTA PERIOD".
CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


# Set in threads that share the workers with others (sharing()): how many share them.
_sharing = threading.local()


def worker_count() -> int:
    """The threads one ordered_map may keep busy: all of them (machine_worker_count), or,
    in a thread that shares them with others (sharing()), its share, at least one."""
    return max(1, machine_worker_count() // getattr(_sharing, "slots", 1))


@contextlib.contextmanager
def sharing(slots: int) -> Iterator[None]:
    """In this thread, one of `slots` threads that share the workers (a model directory's
    shards written side by side): its ordered_map keeps at most its share of items in
    flight, 2 * (workers // slots), so that all of them together hold no more than one
    stream does; with a share of one it runs inline. The threads that do the work are
    still the one pool of all the workers, shared."""
    _sharing.slots = slots
    try:
        yield
    finally:
        del _sharing.slots


# The default's ceiling, measured: numpy releases the GIL for each call, but every chunk
# still takes it back several times (a read, max, min, a widening copy and a dot per 256 Ki
# elements, each a hand-over between threads). Past about four threads those hand-overs
# queue: on two 16-core machines every job was fastest at 4 threads and slower at 8 and 16
# (norms of a 2 GiB fp32 file 0.85 s at 4, 0.95 s at 16; a bf16 model directory's clip
# 3.4 s at 4, 3.9 s at 16, with 50% more CPU), and even the bare floor (astype + dot in a
# thread pool) only gained 2.1x from 16 threads (benchmarks/RESULTS.md, issue 20, device
# run). CLIPCLI_THREADS still sets any count up to MAX_THREADS.
DEFAULT_MAX_THREADS = 4
# The most CLIPCLI_THREADS gives: each worker keeps up to two chunks in flight (a few MiB
# each), so a count of 10**23 would try to start threads until the kernel refused and then
# read a whole file into memory at once. 64 is 16 times the fastest count measured.
MAX_THREADS = 64


def machine_worker_count() -> int:
    """CLIPCLI_THREADS if set to a whole number of ASCII digits, at least 1 and at most
    MAX_THREADS (a larger one is MAX_THREADS; anything else is ignored); else the cores
    this process may use, at most DEFAULT_MAX_THREADS: the CPUs it may run on
    (sched_getaffinity: taskset, cpusets), fewer where a cgroup CPU quota allows less (a
    container given 2 CPUs of a 64-core host)."""
    configured = os.environ.get("CLIPCLI_THREADS", "")
    # isdigit() alone also holds for '²' and other digits int() refuses; and a count of
    # thousands of digits is a huge number, never converted.
    if configured.isascii() and configured.isdigit():
        digits = configured.lstrip("0")  # int() refuses 4,301 digits, leading zeros too
        if len(digits) > len(str(MAX_THREADS)):
            return MAX_THREADS
        if digits:
            return min(int(digits), MAX_THREADS)
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    quota = cgroup_cpu_quota(CGROUP_CPU_MAX)
    if quota is not None:
        cores = min(cores, quota)
    return max(1, min(cores, DEFAULT_MAX_THREADS))


# cpu.max holds "max PERIOD" or "QUOTA PERIOD": a few bytes. More is not such a file.
CPU_MAX_BYTES = 64


def cgroup_cpu_quota(path: Path) -> int | None:
    """The whole CPUs a cgroup v2 cpu.max allows (its quota / its period, rounded up), or
    None where there is no such file, no quota ("max") or the file is not understood.

    Opened without blocking and read only as a regular file of at most CPU_MAX_BYTES: the
    path is outside clipcli's inputs, and a FIFO there would block the open (no signal
    ends that wait), /dev/zero an unbounded read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        raw = os.read(fd, CPU_MAX_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(raw) > CPU_MAX_BYTES or not raw.isascii():
        return None
    fields = raw.decode("ascii").split()
    if len(fields) != 2 or not all(f.isdigit() for f in fields):
        return None  # "max 100000" (no quota) or malformed
    quota, period = int(fields[0]), int(fields[1])
    if quota <= 0 or period <= 0:
        return None
    return -(-quota // period)


_NOTHING: Any = object()


class _Task(Generic[R]):
    """One item's work: run by a worker thread, or cancelled before it starts.

    Two plain locks, not an Event: an Event's wait and set run a Condition in Python
    (several microseconds under the GIL per chunk, a serial cost that grows with the
    thread count); acquiring a lock is one C call. `_claim` is taken by whichever of run()
    and cancel() comes first; `_finished` is held from creation until the task is done or
    cancelled, so waiting for it is acquiring it."""

    __slots__ = ("_fn", "_item", "_claim", "_finished", "_cancelled", "_value", "_error")

    def __init__(self, fn: Callable[[Any], R], item: Any) -> None:
        self._fn: Callable[[Any], R] | None = fn
        self._item = item
        self._claim = threading.Lock()
        self._finished = threading.Lock()
        self._finished.acquire()
        self._cancelled = False
        self._value: Any = None
        self._error: BaseException | None = None

    def run(self) -> None:
        if not self._claim.acquire(blocking=False):  # cancelled
            return
        fn, item = self._fn, self._item
        self._fn = self._item = None  # what they hold can go once done
        try:
            assert fn is not None
            self._value = fn(item)
        except BaseException as exc:  # handed to the caller, in order, by result()
            self._error = exc
        finally:
            self._finished.release()

    def cancel(self) -> bool:
        """Cancel it if no thread has started it; False if one has (wait() for it)."""
        if self._cancelled or self._claim.acquire(blocking=False):
            if not self._cancelled:
                self._cancelled = True
                self._fn = self._item = None
                self._finished.release()
            return True
        return False

    def wait(self) -> None:
        with self._finished:
            pass

    def result(self) -> R:
        self.wait()
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return cast(R, self._value)


class _Workers:
    """Threads that run tasks from one queue, started up front. A thread that cannot be
    started (RLIMIT_NPROC reached, no address space left for its stack) is simply not
    there: `size` says how many are, and ordered_map runs inline when none is."""

    def __init__(self, count: int) -> None:
        self._queue: queue.SimpleQueue[_Task[Any]] = queue.SimpleQueue()
        self.size = len(start_threads(self._serve, count, "clipcli"))

    def submit(self, task: _Task[Any]) -> None:
        self._queue.put(task)

    def _serve(self) -> None:
        while True:
            self._queue.get().run()


_POOLS: dict[tuple[int, int], _Workers] = {}
_POOLS_LOCK = threading.Lock()


def _pool(workers: int) -> _Workers:
    """One set of threads per worker count for the whole process: a checkpoint of 200,000
    tiny tensors is 200,000 calls, and starting threads per call cost ~0.4 ms each
    (77-140 s). Keyed by process id too: a forked child inherits the dict but not the
    threads, and work submitted to the parent's would never run. A set that started no
    thread at all is not kept: a later call tries again."""
    key = (os.getpid(), workers)
    with _POOLS_LOCK:
        pool = _POOLS.get(key)
        if pool is None:
            pool = _Workers(workers)
            if pool.size:
                _POOLS[key] = pool
        return pool


def ordered_map(
    fn: Callable[[T], R], items: Iterable[T], workers: int | None = None
) -> Iterator[R]:
    """fn over items in worker threads, yielding results in input order.

    At most 2 items per worker thread that could be started (at most `workers`) are in
    flight, so memory stays bounded however long the input is. With one worker it runs
    inline, with no threads at all; where no thread can be started (RLIMIT_NPROC, no
    address space for one), too. The threads are shared by every call (fn must not
    itself wait on ordered_map). When the caller stops early, items not started are
    cancelled and the running ones are waited for, so no work on this call's items
    outlives it.
    """
    workers = worker_count() if workers is None else workers
    if workers <= 1:
        yield from map(fn, items)
        return
    iterator = iter(items)
    first = next(iterator, _NOTHING)
    if first is _NOTHING:
        return
    second = next(iterator, _NOTHING)
    if second is _NOTHING:
        # One item (a tensor of one chunk): nothing to overlap, and handing it to a thread
        # and back costs more than most such items take.
        yield fn(first)
        return
    everything = itertools.chain((first, second), iterator)
    pool = _pool(machine_worker_count() if hasattr(_sharing, "slots") else workers)
    if not pool.size:  # not one thread could be started: this one does the work
        yield from map(fn, everything)
        return
    # Two items per worker, of the threads that are there: where fewer could be started
    # than asked for (RLIMIT_NPROC), no more is read ahead than they can work on.
    in_flight = 2 * min(workers, pool.size)
    pending: deque[_Task[R]] = deque()
    try:
        for item in everything:
            task: _Task[R] = _Task(fn, item)
            pool.submit(task)
            pending.append(task)
            if len(pending) >= in_flight:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        for task in pending:
            if not task.cancel():
                task.wait()


def loaded(loaders: Iterable[Callable[[], R]], workers: int | None = None) -> Iterator[R]:
    """Each loader called in worker threads, results in order (ordered_map of calls)."""
    return ordered_map(_called, loaders, workers)


def _called(loader: Callable[[], R]) -> R:
    return loader()


def start_threads(target: Callable[[], None], count: int, name: str) -> list[threading.Thread]:
    """Up to `count` threads running target(), started now; fewer where no more can be
    started (RLIMIT_NPROC): the caller, which runs target() too, does their share."""
    started = []
    for index in range(count):
        thread = threading.Thread(target=target, name=f"{name}_{index}", daemon=True)
        if not _started(thread):
            break
        started.append(thread)
    return started


# Address space a new thread needs: its stack (8 MiB by default) and its first chunks.
THREAD_ROOM = 24 << 20


def _started(thread: threading.Thread) -> bool:
    """Start `thread`; False where it cannot be: the kernel refuses it (RLIMIT_NPROC), or
    an address-space limit leaves less than THREAD_ROOM. The second is checked first: a
    thread whose own start-up then fails for memory dies before it says it has started,
    and Thread.start() waits for that forever (no signal ends the wait)."""
    if not has_room(THREAD_ROOM):
        return False
    try:
        thread.start()
    except RuntimeError:  # "can't start new thread"
        return False
    return True
