"""The measuring threads' sum of squares lets go of the GIL (issue 20, "threads that scale").

NormAccumulator summed each chunk's squares with `wide @ wide`. matmul makes the same BLAS
call as np.dot, with the same bits, but holds the GIL through it: the worker threads'
dots ran one at a time, a serial part of every chunk whatever the thread count.

The test judges an event, not time: with a switch interval of a minute, a thread that
holds the GIL keeps it until it lets go itself. Another thread, ready to run, records
whether the main thread was inside the sum of squares when it got the GIL; it can only
get it inside if the sum lets go. A reference op known to hold the GIL shows the test
tells the two apart.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from clipcli.numerics.norms import sum_of_squares

CALLS = 2000  # a chance each: the other thread needs a CPU while one call runs


@pytest.fixture
def long_switch_interval() -> Iterator[None]:
    before = sys.getswitchinterval()
    sys.setswitchinterval(60.0)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def _ran_inside(op: Callable[[np.ndarray], object], values: np.ndarray) -> bool:
    """Whether another Python thread ran while this one was inside op(values)."""
    inside = False
    seen: list[bool] = []
    ready = threading.Event()

    def other() -> None:
        ready.wait()  # blocks without the GIL; once set, waits for the GIL
        seen.append(inside)

    thread = threading.Thread(target=other)
    thread.start()
    ready.set()
    for _ in range(CALLS):
        inside = True
        op(values)
        inside = False
        if seen:
            break
    thread.join()  # lets go of the GIL: the other thread runs by now at the latest
    return seen == [True]


@pytest.mark.usefixtures("long_switch_interval")
def test_the_sum_of_squares_lets_other_threads_run() -> None:
    values = np.random.default_rng(1).standard_normal(1 << 21)
    assert _ran_inside(sum_of_squares, values)
    assert sum_of_squares(values) == float(values @ values)  # the same bits as before


@pytest.mark.usefixtures("long_switch_interval")
def test_an_op_that_holds_the_gil_is_told_apart() -> None:
    values = np.random.default_rng(1).standard_normal(1 << 21)
    assert not _ran_inside(lambda v: v @ v, values)
