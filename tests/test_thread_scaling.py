"""Issue 20, threads that scale: the default thread count follows the machine (affinity and
a cgroup CPU quota) up to the measured ceiling of DEFAULT_MAX_THREADS, CLIPCLI_THREADS sets
any count, and the task hand-off stays correct."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Generator, Iterator
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


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("1", 1),
        ("16", 16),
        ("63", 63),
        ("64", 64),  # MAX_THREADS: as asked
        ("65", 64),  # one past: the most
        ("100", 64),
        ("99999999999999999999999", 64),  # never thousands of threads, a file in memory
        ("0" * 5000 + "5", 5),  # leading zeros past int()'s 4,300 digits
        ("9" * 5000, 64),
    ],
)
def test_the_variable_is_capped_at_max_threads(
    monkeypatch: pytest.MonkeyPatch, value: str, expected: int
) -> None:
    assert parallel.MAX_THREADS == 64
    monkeypatch.setenv("CLIPCLI_THREADS", value)
    assert parallel.worker_count() == expected


@pytest.mark.parametrize("value", ["0", "000", "-1", "", " 4", "4 ", "4.0", "abc", "²", "٣", "４"])
def test_a_variable_that_is_not_a_count_leaves_the_default(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, value: str
) -> None:
    """Not ASCII digits, or zero: the default ('²' and '٣' pass isdigit() and int()
    refuses or reads them; neither may decide anything)."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(2)))  # no digit's value
    monkeypatch.setattr(parallel, "CGROUP_CPU_MAX", tmp_path / "absent")
    monkeypatch.setenv("CLIPCLI_THREADS", value)
    assert parallel.worker_count() == 2


def test_a_huge_or_unicode_count_runs_a_real_job(tmp_path: Path) -> None:
    """Whole processes on a file measured in threads (past the inline size): the same
    report with every value, exit 0."""
    import numpy as np
    from handmade import write_safetensors

    path = write_safetensors(tmp_path / "m.safetensors", {"w": np.ones(5 << 20, np.float32)})
    reports = set()
    for value in ("1", "99999999999999999999999", "²", "0" * 5000 + "7"):
        env = {**os.environ, "CLIPCLI_THREADS": value}
        done = subprocess.run(
            [sys.executable, "-m", "clipcli", "norms", "--format", "json", str(path)],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, (value, done.stderr)
        assert done.stderr == ""
        reports.add(done.stdout)
    assert len(reports) == 1


def test_items_in_flight_follow_the_threads_that_started(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Asked for 50 workers where only 3 threads can start: at most 2 * 3 items are read
    ahead of the consumer, not 2 * 50."""
    started: list[int] = []
    real_start = threading.Thread.start

    def start(self: threading.Thread) -> None:
        if self.name.startswith("clipcli_") and len(started) >= 3:
            raise RuntimeError("can't start new thread")
        if self.name.startswith("clipcli_"):
            started.append(1)
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    monkeypatch.setattr(parallel, "_POOLS", {})
    pulled = 0
    ahead: list[int] = []

    def items() -> Iterator[int]:
        nonlocal pulled
        for i in range(200):
            pulled += 1
            yield i

    for consumed, value in enumerate(parallel.ordered_map(lambda i: i * 2, items(), 50), 1):
        assert value == 2 * (consumed - 1)
        ahead.append(pulled - consumed)
    assert parallel._POOLS[(os.getpid(), 50)].size == 3
    assert max(ahead) <= 2 * 3


def test_cpu_max_read_up_to_its_limit(tmp_path: Path) -> None:
    """A valid line padded to exactly CPU_MAX_BYTES is read; one byte more is not cpu.max."""
    cpu_max = tmp_path / "cpu.max"
    line = "300000 100000"
    cpu_max.write_text(line + " " * (parallel.CPU_MAX_BYTES - len(line) - 1) + "\n")
    assert cpu_max.stat().st_size == parallel.CPU_MAX_BYTES
    assert parallel.cgroup_cpu_quota(cpu_max) == 3
    cpu_max.write_text(line + " " * (parallel.CPU_MAX_BYTES - len(line)) + "\n")
    assert parallel.cgroup_cpu_quota(cpu_max) is None


def test_cpu_max_that_is_not_a_small_regular_file_is_ignored(tmp_path: Path) -> None:
    """A FIFO (opening it would block with no writer, and no signal ends that wait), a
    character device without end (/dev/zero), a directory, non-ASCII digits: no quota."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    answers: list[int | None] = []
    reader = threading.Thread(target=lambda: answers.append(parallel.cgroup_cpu_quota(fifo)))
    reader.start()
    reader.join(60)  # a guard against a hang, not a timing: the open does not block
    if reader.is_alive():  # unblock the thread before failing
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("cgroup_cpu_quota blocked on a FIFO")
    assert answers == [None]
    assert parallel.cgroup_cpu_quota(Path("/dev/zero")) is None
    assert parallel.cgroup_cpu_quota(tmp_path) is None
    odd = tmp_path / "cpu.max"
    odd.write_text("٣00000 100000\n")
    assert parallel.cgroup_cpu_quota(odd) is None


def test_a_fifo_at_cpu_max_never_holds_a_real_job(tmp_path: Path) -> None:
    """Whole process, default thread count, on a file measured in threads: a FIFO where
    cpu.max would be is no quota, and the job ends on its own."""
    import numpy as np
    from handmade import write_safetensors

    path = write_safetensors(tmp_path / "m.safetensors", {"w": np.ones(5 << 20, np.float32)})
    fifo = tmp_path / "cpu.max"
    os.mkfifo(fifo)
    code = (
        "import sys\nfrom pathlib import Path\nfrom clipcli.system import parallel\n"
        f"parallel.CGROUP_CPU_MAX = Path({str(fifo)!r})\n"
        f"sys.argv = ['clipcli', 'norms', '-q', {str(path)!r}]\n"
        "from clipcli.__main__ import run\nrun()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "CLIPCLI_THREADS"}
    try:
        done = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
        )
    finally:  # whatever happened, leave no reader blocked on the FIFO
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    assert done.returncode == 0, done.stderr


def test_no_thread_is_started_without_room_for_it() -> None:
    """A real address-space limit just above what the process uses: no room for a thread
    (THREAD_ROOM), so none is started and the work runs in the calling thread, whole.
    (A thread started there could die of MemoryError before it says it has started, and
    Thread.start() would wait for it forever, through SIGTERM: found by the attack.)"""
    code = (
        "import resource\n"
        "from clipcli.system import parallel\n"
        "status = dict(l.split(':', 1) for l in open('/proc/self/status'))\n"
        "used = int(status['VmSize'].split()[0]) << 10\n"
        "limit = used + parallel.THREAD_ROOM - (4 << 20)\n"
        "resource.setrlimit(resource.RLIMIT_AS, (limit, limit))\n"
        "print(parallel._Workers(4).size, len(parallel.start_threads(lambda: None, 3, 't')))\n"
        "print(sum(parallel.ordered_map(lambda i: i, range(1000), 4)))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "CLIPCLI_THREADS"}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0", "0", str(sum(range(1000)))]


def test_threads_start_where_there_is_room(monkeypatch: pytest.MonkeyPatch) -> None:
    """The other side: with room (no limit), the threads asked for are started."""
    monkeypatch.setattr(parallel, "_POOLS", {})
    assert parallel._Workers(3).size == 3
