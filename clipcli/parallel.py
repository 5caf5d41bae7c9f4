"""An order-preserving, bounded-lookahead thread map.

numpy releases the GIL in casts, reductions and dot products, and pread releases it too,
so threads use both cores without copying data between processes.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

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


def ordered_map(
    fn: Callable[[T], R], items: Iterable[T], workers: int | None = None
) -> Iterator[R]:
    """fn over items in worker threads, yielding results in input order.

    At most 2 * workers items are in flight, so memory stays bounded however long the
    input is. With one worker it runs inline, with no threads at all.
    """
    workers = worker_count() if workers is None else workers
    if workers <= 1:
        yield from map(fn, items)
        return
    pending: deque[Future[R]] = deque()
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="clipcli") as pool:
        try:
            for item in items:
                pending.append(pool.submit(fn, item))
                if len(pending) >= 2 * workers:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for future in pending:
                future.cancel()
