"""An order-preserving, bounded-lookahead thread map.

numpy releases the GIL in casts, reductions and dot products, and pread releases it too,
so threads use both cores without copying data between processes.
"""

from __future__ import annotations

import functools
import itertools
import os
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Generic, TypeVar, cast

T = TypeVar("T")
R = TypeVar("R")


def worker_count() -> int:
    """CLIPCLI_THREADS if set, else the usable cores (at most 8: memory bandwidth saturates)."""
    configured = os.environ.get("CLIPCLI_THREADS")
    if configured and configured.isdigit() and int(configured) > 0:
        return int(configured)
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, 8))


_NOTHING: Any = object()


class _Task(Generic[R]):
    """One item's work: run by a worker thread, or cancelled before it starts."""

    __slots__ = ("_fn", "_done", "_lock", "_state", "_value", "_error")

    def __init__(self, fn: Callable[[], R]) -> None:
        self._fn = fn
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._state = "pending"  # -> running -> done, or -> cancelled
        self._value: Any = None
        self._error: BaseException | None = None

    def run(self) -> None:
        with self._lock:
            if self._state != "pending":
                return
            self._state = "running"
        try:
            self._value = self._fn()
        except BaseException as exc:  # handed to the caller, in order, by result()
            self._error = exc
        finally:
            self._state = "done"
            self._fn = None  # type: ignore[assignment]  # what it holds can go now
            self._done.set()

    def cancel(self) -> bool:
        """Cancel it if no thread has started it; False if one has (wait() for it)."""
        with self._lock:
            if self._state == "pending":
                self._state = "cancelled"
                self._done.set()
            return self._state == "cancelled"

    def wait(self) -> None:
        self._done.wait()

    def result(self) -> R:
        self._done.wait()
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
        self.size = 0
        for index in range(count):
            thread = threading.Thread(target=self._serve, name=f"clipcli_{index}", daemon=True)
            try:
                thread.start()
            except RuntimeError:  # "can't start new thread"
                break
            self.size += 1

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

    At most 2 * workers items are in flight, so memory stays bounded however long the
    input is. With one worker it runs inline, with no threads at all; where no thread can
    be started (RLIMIT_NPROC), too. The threads are shared by every call (fn must not
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
    pool = _pool(workers)
    if not pool.size:  # not one thread could be started: this one does the work
        yield from map(fn, everything)
        return
    pending: deque[_Task[R]] = deque()
    try:
        for item in everything:
            task: _Task[R] = _Task(functools.partial(fn, item))
            pool.submit(task)
            pending.append(task)
            if len(pending) >= 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        for task in pending:
            if not task.cancel():
                task.wait()
