"""parallel.ordered_map: order, bounded lookahead, and one set of threads for the whole
process (issue 9 item 17: a pool per call cost 77-140 s on 200,000 one-element tensors)."""

from __future__ import annotations

import threading
import warnings

import pytest

from clipcli.system.parallel import ordered_map


def test_results_come_in_input_order() -> None:
    assert list(ordered_map(lambda x: x * x, range(1000), workers=4)) == [
        x * x for x in range(1000)
    ]


@pytest.mark.parametrize("items", [[], [7], [7, 8]])
def test_zero_one_and_two_items(items: list[int]) -> None:
    assert list(ordered_map(lambda x: x + 1, items, workers=2)) == [x + 1 for x in items]


def test_a_single_item_runs_in_the_calling_thread() -> None:
    (thread,) = ordered_map(lambda _: threading.current_thread(), [0], workers=2)
    assert thread is threading.current_thread()


def test_threads_are_shared_by_every_call() -> None:
    """Many calls, each of a few items: the work runs on at most `workers` threads in all."""
    seen: set[threading.Thread] = set()

    def record(_: int) -> None:
        seen.add(threading.current_thread())

    for _ in range(200):
        list(ordered_map(record, range(3), workers=2))
    assert len(seen) <= 2


def test_stopping_early_cancels_the_rest() -> None:
    started: list[int] = []
    results = ordered_map(started.append, range(10_000), workers=2)
    next(results)
    results.close()  # type: ignore[attr-defined]  # a generator; the caller stops: at most the lookahead was started
    assert len(started) <= 2 * 2 + 1


def test_a_forked_child_gets_its_own_threads() -> None:
    """The child of a fork has none of the parent's threads: it must not wait on them."""
    import os

    list(ordered_map(lambda x: x, range(10), workers=2))  # the parent's pool exists
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork() with threads (3.12+)
        pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through its exit status
        ok = False
        try:
            ok = list(ordered_map(lambda x: x + 1, range(10), workers=2)) == list(range(1, 11))
        finally:
            os._exit(0 if ok else 1)
    deadline = 100
    while deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.WIFEXITED(status)
            assert os.WEXITSTATUS(status) == 0
            return
        deadline -= 1
        threading.Event().wait(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    raise AssertionError("the forked child hung on the parent's thread pool")
