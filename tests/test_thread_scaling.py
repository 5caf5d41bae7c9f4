"""Issue 20, threads that scale: the default thread count follows the machine (affinity and
a cgroup CPU quota) up to the measured ceiling of DEFAULT_MAX_THREADS, CLIPCLI_THREADS sets
any count, and the task hand-off stays correct."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Generator
from pathlib import Path
from typing import cast

import pytest

from clipcli.system import parallel


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("100000 100000\n", 1),  # exactly one CPU
        ("100001 100000\n", 2),  # just past one: a second thread has work
        ("200000 100000\n", 2),
        ("1600000 100000\n", 16),
        ("50000 100000\n", 1),  # half a CPU: still one thread
        ("max 100000\n", None),  # no quota
        ("garbage\n", None),
        ("0 100000\n", None),
        ("100000 0\n", None),
        ("", None),
    ],
)
def test_cgroup_quota_in_whole_cpus(tmp_path: Path, text: str, expected: int | None) -> None:
    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text(text)
    assert parallel.cgroup_cpu_quota(cpu_max) == expected


def test_no_cgroup_file_means_no_quota(tmp_path: Path) -> None:
    assert parallel.cgroup_cpu_quota(tmp_path / "absent") is None


@pytest.mark.parametrize(("cores", "expected"), [(1, 1), (3, 3), (4, 4), (5, 4), (16, 4), (64, 4)])
def test_default_follows_the_cores_up_to_the_measured_ceiling(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, cores: int, expected: int
) -> None:
    """Up to DEFAULT_MAX_THREADS (4: the fastest count on two 16-core machines for norms
    and clip, benchmarks/RESULTS.md), then no more: at, below and just past the ceiling."""
    assert parallel.DEFAULT_MAX_THREADS == 4
    monkeypatch.delenv("CLIPCLI_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(cores)))
    monkeypatch.setattr(parallel, "CGROUP_CPU_MAX", tmp_path / "absent")
    assert parallel.worker_count() == expected


def test_default_is_bounded_by_the_cgroup_quota(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("CLIPCLI_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(64)))
    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text("200000 100000\n")
    monkeypatch.setattr(parallel, "CGROUP_CPU_MAX", cpu_max)
    assert parallel.worker_count() == 2
    cpu_max.write_text("300000 100000\n")
    assert parallel.worker_count() == 3
    cpu_max.write_text("max 100000\n")
    assert parallel.worker_count() == 4


def test_the_variable_still_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLIPCLI_THREADS", "3")
    assert parallel.worker_count() == 3
    monkeypatch.setenv("CLIPCLI_THREADS", "16")  # past the default's ceiling: as asked
    assert parallel.worker_count() == 16


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")
def test_affinity_of_a_real_process_decides() -> None:
    """taskset to one CPU: one thread (a real affinity mask, not a stand-in)."""
    env = {k: v for k, v in os.environ.items() if k != "CLIPCLI_THREADS"}
    code = (
        "import os; os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]}); "
        "from clipcli.system.parallel import worker_count; print(worker_count())"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1"


def test_results_in_order_and_errors_at_their_place() -> None:
    def work(i: int) -> int:
        if i == 57:
            raise KeyError(i)
        return i * i

    got: list[int] = []

    def consume() -> None:
        for value in parallel.ordered_map(work, range(200), workers=4):
            got.append(value)

    with pytest.raises(KeyError):
        consume()
    assert got == [i * i for i in range(57)]


def test_stopping_early_cancels_what_has_not_started() -> None:
    """The consumer stops after the first result: items that no thread took are never
    run, and those running are waited for before ordered_map returns."""
    gate = threading.Event()
    started: list[int] = []
    lock = threading.Lock()

    def work(i: int) -> int:
        with lock:
            started.append(i)
        if i == 0:
            return i
        gate.wait()  # every other item blocks until released
        return i

    results = cast("Generator[int, None, None]", parallel.ordered_map(work, range(1000), workers=2))
    assert next(results) == 0
    gate.set()
    results.close()  # runs the generator's finally: cancel, wait
    with lock:
        ran = list(started)
    assert len(ran) < 1000
    assert len(ran) <= 2 * 2 + 2  # at most the lookahead was ever handed out


def test_norms_in_threads_are_the_sequential_ones_bit_for_bit() -> None:
    """Each thread widens into its own scratch buffer (numerics.norms._widened): chunks
    measured in 4 threads at once give exactly what one thread gives, and the float64
    sums equal an exact rational reference's rounding within 2**-40."""
    from fractions import Fraction

    import numpy as np

    from clipcli.numerics.norms import CACHE_BLOCK, NormAccumulator

    rng = np.random.default_rng(20)
    chunks = [
        rng.standard_normal(size, dtype=np.float32)
        for size in (1, 7, CACHE_BLOCK - 1, CACHE_BLOCK, CACHE_BLOCK + 1, 3 * CACHE_BLOCK)
    ] * 6

    def measured(chunk: np.ndarray) -> tuple[float, int, float, float]:
        acc = NormAccumulator()
        acc.add(chunk)
        return acc.sumsq.mant, acc.sumsq.exp, acc.max_value, acc.min_value

    alone = [measured(c) for c in chunks]
    together = list(parallel.ordered_map(measured, chunks, workers=4))
    assert together == alone
    for chunk, (mant, exp, high, low) in zip(chunks[:6], alone[:6], strict=True):
        exact = sum(Fraction(float(v)) ** 2 for v in chunk.tolist())
        got = Fraction(mant) * Fraction(2) ** exp
        assert abs(got - exact) <= exact * Fraction(1, 2**40)
        assert (high, low) == (float(chunk.max()), float(chunk.min()))
