"""An order-preserving, bounded-lookahead thread map.

numpy releases the GIL in casts, reductions and dot products, and pread releases it too,
so threads use both cores without copying data between processes.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from concurrent.futures import Future, ThreadPoolExecutor

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
_POOLS: dict[tuple[int, int], ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def _pool(workers: int) -> ThreadPoolExecutor:
    """One executor per worker count for the whole process: a checkpoint of 200,000 tiny
    tensors is 200,000 calls, and starting a pool per call cost ~0.4 ms each (77-140 s).
    Keyed by process id too: a forked child inherits the dict but not the threads, and
    work submitted to the parent's pool would never run."""
    # Imported with the first pool: concurrent.futures loads logging (~3 ms), which a run
    # that measures inline (a small file, one worker) never needs.
    from concurrent.futures import ThreadPoolExecutor

    key = (os.getpid(), workers)
    with _POOLS_LOCK:
        pool = _POOLS.get(key)
        if pool is None:
            pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="clipcli")
            _POOLS[key] = pool
        return pool


def ordered_map(
    fn: Callable[[T], R], items: Iterable[T], workers: int | None = None
) -> Iterator[R]:
    """fn over items in worker threads, yielding results in input order.

    At most 2 * workers items are in flight, so memory stays bounded however long the
    input is. With one worker it runs inline, with no threads at all. The threads are
    shared by every call (fn must not itself wait on ordered_map). When the caller stops
    early, items not started are cancelled and the running ones are waited for, so no
    work on this call's items outlives it.
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
    pool = _pool(workers)
    from concurrent.futures import wait  # loaded by _pool

    pending: deque[Future[R]] = deque()
    try:
        for item in itertools.chain((first, second), iterator):
            pending.append(pool.submit(fn, item))
            if len(pending) >= 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        running = [future for future in pending if not future.cancel()]
        wait(running)
