"""The measuring pass counts 8/16-bit float chunks in helper processes (issue 20, "threads
that scale": np.bincount holds the GIL for a third of each call, so threads stop near
2.7x one; processes each have their own).

A helper is forked before the pass, is sent a chunk's place in the file with the file's
descriptor, preads it and counts it with the parent's own function (system.counting).
References: the same command with the helpers turned off (CLIPCLI_COUNTING_PROCESSES=0),
whose bytes and reports must be the same; lookup.bit_pattern_counts on the same bytes;
/proc for what a helper holds and whether it is gone.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_counting_once_over import _checkpoint as mixed_checkpoint

from clipcli.formats import base
from clipcli.formats.base import FileRange
from clipcli.formats.opening import open_reader
from clipcli.jobs import pipeline
from clipcli.jobs.selection import Selection
from clipcli.numerics import lookup
from clipcli.system import counting


def _checkpoint(tmp_path: Path) -> Path:
    """bfloat16, float16 and float8 weights of growing norm, and a float32 one."""
    path, _ = mixed_checkpoint(tmp_path)
    return path


def _helpers_used(monkeypatch: pytest.MonkeyPatch, threads: str = "3") -> list[int]:
    """Helpers for every counted chunk, however small the file (chunks of 256 bytes, in
    worker threads); the list of chunks the helpers counted (their sizes), as it grows."""
    monkeypatch.setenv("CLIPCLI_THREADS", threads)
    monkeypatch.delenv(counting.KNOB, raising=False)
    monkeypatch.setattr(pipeline, "INLINE_BELOW_BYTES", 0)
    monkeypatch.setattr(pipeline, "COUNTING_PROCESSES_FROM", 0)
    monkeypatch.setattr(base, "CHUNK_BYTES", 256)
    counted: list[int] = []
    real = counting.CountingProcesses.count

    def spy(self: counting.CountingProcesses, where: Any, itemsize: int) -> Any:
        counts = real(self, where, itemsize)
        if counts is not None:
            counted.append(int(counts.sum()))
        return counts

    monkeypatch.setattr(counting.CountingProcesses, "count", spy)
    return counted


def _clip(run_main: Any, src: Path, out: Path, mode: list[str]) -> tuple[dict[str, Any], bytes]:
    result = run_main("clip", *mode, "--no-fsync", "--force", "--format", "json", src, out)
    assert result.code == 0, result.stderr
    assert result.stderr == ""
    report: dict[str, Any] = json.loads(result.stdout)
    del report["out"]  # the one difference: its name
    return report, out.read_bytes()


def _without_helpers(run_main: Any, monkeypatch: pytest.MonkeyPatch, *args: Any) -> Any:
    with monkeypatch.context() as off:
        off.setenv(counting.KNOB, "0")
        return _clip(run_main, *args)


MODES = [["--global", "0.5"], ["--norm", "0.5"], ["--global", "30"], ["--norm", "20"]]


def assert_helpers_count_as_threads(
    run_main: Any, monkeypatch: pytest.MonkeyPatch, src: Path, mode: list[str]
) -> dict[str, Any]:
    """The clip of `src` with helpers counting (some chunks at least) writes and reports
    what it does with the threads counting; the outputs go beside `src`. Its report."""
    counted = _helpers_used(monkeypatch)
    by_helpers = _clip(run_main, src, src.with_stem("by-helpers"), mode)
    assert counted, "the helpers counted nothing"
    assert by_helpers == _without_helpers(
        run_main, monkeypatch, src, src.with_stem("by-threads"), mode
    )
    return by_helpers[0]


@pytest.mark.parametrize("mode", MODES, ids=" ".join)
def test_a_clip_counted_by_helpers_writes_and_reports_what_threads_did(
    tmp_path: Path, run_main: Any, monkeypatch: pytest.MonkeyPatch, mode: list[str]
) -> None:
    assert_helpers_count_as_threads(run_main, monkeypatch, _checkpoint(tmp_path), mode)


def test_the_knob_turns_the_helpers_off(
    tmp_path: Path, run_main: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = _checkpoint(tmp_path)
    counted = _helpers_used(monkeypatch)
    _without_helpers(run_main, monkeypatch, src, tmp_path / "b.safetensors", ["--global", "0.5"])
    assert not counted


def _pool(count: int = 2) -> counting.CountingProcesses:
    pool = counting.CountingProcesses(lookup.bit_pattern_counts, count)
    assert pool.size == count
    return pool


class _Range:
    """A FileRange over a descriptor the test holds."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def at(self, start: int, stop: int) -> FileRange:
        return FileRange(self.in_use, start, stop)

    def in_use(self) -> Any:
        import contextlib

        return contextlib.nullcontext(self.fd)


def _gone(pids: list[int]) -> bool:
    """Whether every one of these processes has ended and been reaped."""
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        return False
    return True


def test_counts_are_bit_pattern_counts_of_the_same_bytes_at_every_length(tmp_path: Path) -> None:
    data = np.random.default_rng(3).integers(0, 256, 300_001, dtype=np.uint8)
    path = tmp_path / "bytes"
    path.write_bytes(data.tobytes())
    fd = os.open(path, os.O_RDONLY)
    pool = _pool()
    pids = [helper.pid for helper in pool._helpers]
    try:
        where = _Range(fd)
        edge = lookup.PAIRED_FROM
        for itemsize in (1, 2):
            for start, length in [
                (0, 2),
                (7, 2 * edge - 2),
                (7, 2 * edge),
                (8, 2 * edge + 2),
                (1, 262_144),
                (0, 300_000),
            ]:
                counts = pool.count(where.at(start, start + length), itemsize)
                raw = data[start : start + length]
                want = lookup.bit_pattern_counts(raw.view(np.uint16 if itemsize == 2 else np.uint8))
                assert counts is not None
                assert counts.dtype == want.dtype
                assert np.array_equal(counts, want), (itemsize, start, length)
        # Past the end of the file, or running past it: not counted (the reader's own read
        # then says what is wrong), one byte short of the end and exactly at it counted.
        assert pool.count(where.at(data.size, data.size + 2), 2) is None
        assert pool.count(where.at(data.size - 3, data.size + 1), 2) is None
        assert pool.count(where.at(data.size - 3, data.size - 1), 2) is not None
        assert pool.count(where.at(data.size - 2, data.size), 2) is not None
    finally:
        pool.close()
        os.close(fd)
    assert _gone(pids)


def test_a_helper_holds_no_descriptor_of_ours_and_ignores_sigint(tmp_path: Path) -> None:
    """Forked while this process has files open: the helper keeps only /dev/null on 0-2 and
    its socket, ignores SIGINT (the parent acts on it) and takes SIGTERM's default."""
    kept = tmp_path / "kept-open"
    kept.write_bytes(b"x")
    with kept.open("rb"):
        pool = _pool(1)
        pid = pool._helpers[0].pid
        try:
            fd_dir = Path(f"/proc/{pid}/fd")
            # The helper closes what it inherited as it starts: asked once, it has.
            where = _Range(os.open(kept, os.O_RDONLY))
            assert pool.count(where.at(0, 1), 1) is not None
            os.close(where.fd)
            targets = sorted(os.readlink(fd_dir / name) for name in os.listdir(fd_dir))
            assert targets[:-1] == ["/dev/null"] * (len(targets) - 1), targets
            assert targets[-1].startswith("socket:"), targets
            status = Path(f"/proc/{pid}/status").read_text()
            ignored = int(
                next(line for line in status.splitlines() if line.startswith("SigIgn")).split()[1],
                16,
            )
            caught = int(
                next(line for line in status.splitlines() if line.startswith("SigCgt")).split()[1],
                16,
            )
            assert ignored >> (signal.SIGINT - 1) & 1
            assert not caught >> (signal.SIGTERM - 1) & 1
        finally:
            pool.close()
    assert _gone([pid])


def test_no_helper_where_fork_is_refused(
    tmp_path: Path, run_main: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = _checkpoint(tmp_path)
    counted = _helpers_used(monkeypatch)

    def refused() -> int:
        raise BlockingIOError(11, "Resource temporarily unavailable")

    with monkeypatch.context() as patched:
        patched.setattr(os, "fork", refused)
        got = _clip(run_main, src, tmp_path / "a.safetensors", ["--global", "0.5"])
    assert not counted
    assert got == _without_helpers(
        run_main, monkeypatch, src, tmp_path / "b.safetensors", ["--global", "0.5"]
    )


def _signal_the_helpers(
    monkeypatch: pytest.MonkeyPatch, signum: int, *, after_first_count: bool
) -> list[int]:
    """Every helper sent `signum` once, at the first request (before it is sent, or once
    its counts are back): their process ids, filled in then (the spy of _helpers_used
    stays in the chain)."""
    real = counting.CountingProcesses.count
    pids: list[int] = []
    once = threading.Lock()

    def signal_all(self: counting.CountingProcesses) -> None:
        with once:
            if not pids:
                pids.extend(helper.pid for helper in self._helpers)
                for pid in pids:
                    os.kill(pid, signum)

    def count(self: counting.CountingProcesses, where: Any, itemsize: int) -> Any:
        if not after_first_count:
            signal_all(self)
        counts = real(self, where, itemsize)
        if after_first_count:
            signal_all(self)
        return counts

    monkeypatch.setattr(counting.CountingProcesses, "count", count)
    return pids


def test_helpers_killed_mid_pass_change_nothing(
    tmp_path: Path, run_main: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every helper SIGKILLed once the first chunk is counted: the threads count the rest
    themselves, with the same bytes and report and nothing on stderr."""
    src = _checkpoint(tmp_path)
    counted = _helpers_used(monkeypatch)
    pids = _signal_the_helpers(monkeypatch, signal.SIGKILL, after_first_count=True)
    got = _clip(run_main, src, tmp_path / "a.safetensors", ["--norm", "0.5"])
    # Counts finished before the kill (one per helper at most: those in flight), then none.
    assert pids
    assert 1 <= len(counted) <= len(pids)
    assert got == _without_helpers(
        run_main, monkeypatch, src, tmp_path / "b.safetensors", ["--norm", "0.5"]
    )
    assert _gone(pids)


def test_helpers_stopped_on_their_own_are_left_and_the_threads_count(
    tmp_path: Path, run_main: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every helper SIGSTOPped (alone, not with clipcli) before the first chunk is sent:
    a helper stopped never answers, and the thread that asked it waited for good (attack
    s45). Each waiting thread now sees its helper stopped, leaves it and counts the chunk
    itself: the same bytes and report; the stopped helpers are killed and reaped."""
    src = _checkpoint(tmp_path)
    counted = _helpers_used(monkeypatch)
    pids = _signal_the_helpers(monkeypatch, signal.SIGSTOP, after_first_count=False)
    got = _clip(run_main, src, tmp_path / "a.safetensors", ["--norm", "0.5"])
    assert pids
    assert not counted  # stopped before any request: none counted
    assert got == _without_helpers(
        run_main, monkeypatch, src, tmp_path / "b.safetensors", ["--norm", "0.5"]
    )
    assert _gone(pids)


def test_a_helper_is_stopped_as_proc_tells() -> None:
    """_stopped reads the state from /proc: running, stopped, continued, gone."""
    import subprocess
    import sys

    waiting = [sys.executable, "-c", "import sys; sys.stdin.read()"]
    child = subprocess.Popen(waiting, stdin=subprocess.PIPE)
    try:
        assert not counting._stopped(child.pid)
        os.kill(child.pid, signal.SIGSTOP)
        _wait_for_state(child.pid, b"T")
        assert counting._stopped(child.pid)
        os.kill(child.pid, signal.SIGCONT)
        _wait_for_state(child.pid, b"S", b"R")
        assert not counting._stopped(child.pid)
    finally:
        child.kill()
        child.wait()
        assert child.stdin is not None
        child.stdin.close()
    assert counting._stopped(child.pid)  # gone: nothing to wait for


def _wait_for_state(pid: int, *states: bytes) -> None:
    """Until /proc says the process is in one of `states` (an event, not a delay)."""
    while True:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            if stat.read().rsplit(b")", 1)[1].split()[0] in states:
                return
        os.sched_yield()


def test_an_input_cut_short_while_helpers_count_is_exit_3(
    tmp_path: Path, run_main: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The file truncated at a known point (before a helper's first read): the helper
    counts nothing, the thread's own read finds the file short, exit 3 in one line."""
    src = _checkpoint(tmp_path)
    _helpers_used(monkeypatch)
    real = counting.CountingProcesses.count
    cut: list[bool] = []

    def cutting(self: counting.CountingProcesses, where: Any, itemsize: int) -> Any:
        if not cut:
            cut.append(True)
            os.truncate(src, src.stat().st_size // 2)
        return real(self, where, itemsize)

    monkeypatch.setattr(counting.CountingProcesses, "count", cutting)
    out = tmp_path / "a.safetensors"
    result = run_main("clip", "--global", "0.5", "--no-fsync", src, out)
    assert cut
    assert result.code == 3, result.stderr
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert not out.exists()


def test_helpers_are_gone_when_the_pass_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = _checkpoint(tmp_path)
    _helpers_used(monkeypatch)
    pids: list[int] = []
    real = counting.CountingProcesses.count

    def failing(self: counting.CountingProcesses, where: Any, itemsize: int) -> Any:
        pids.extend(helper.pid for helper in self._helpers)
        real(self, where, itemsize)
        raise RuntimeError("a failure while counting")

    monkeypatch.setattr(counting.CountingProcesses, "count", failing)
    with open_reader(src) as reader, pytest.raises(RuntimeError, match="while counting"):
        pipeline.measure(
            reader, list(reader.infos), Selection().describe, histograms=lambda _: True
        )
    assert pids
    assert _gone(pids)


def test_helpers_close_where_sigchld_is_ignored() -> None:
    """SIGCHLD ignored (inherited so from a parent): the kernel reaps each helper itself,
    and closing them must not fail on ECHILD."""
    previous = signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    try:
        pool = _pool(2)
        pids = [helper.pid for helper in pool._helpers]
        pool.close()
    finally:
        signal.signal(signal.SIGCHLD, previous)
    assert _gone(pids)


def test_a_descriptor_above_the_soft_limit_is_closed_in_a_helper(tmp_path: Path) -> None:
    """Inherited at 5,000 under a soft RLIMIT_NOFILE of 256 (attack s45): closed too."""
    import resource

    kept = tmp_path / "secret"
    kept.write_bytes(b"x")
    fd = os.open(kept, os.O_RDONLY)
    high = os.dup2(fd, 5000)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    try:
        pool = _pool(1)
        pid = pool._helpers[0].pid
        try:
            where = _Range(fd)
            assert pool.count(where.at(0, 1), 1) is not None  # it has closed what it had
            listed = os.listdir(f"/proc/{pid}/fd")
        finally:
            pool.close()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        os.close(high)
        os.close(fd)
    assert sorted(int(name) for name in listed)[:3] == [0, 1, 2]
    assert len(listed) == 4, listed


def test_a_helper_dumps_no_core() -> None:
    """SIGQUIT (Ctrl-\\) to the group would leave a helper's memory as a core file: its
    core size limit is 0."""
    pool = _pool(1)
    pid = pool._helpers[0].pid
    try:
        assert pool.count(_Range(0).at(0, 0), 1) is not None  # set up and answering
        limits = Path(f"/proc/{pid}/limits").read_text().splitlines()
    finally:
        pool.close()
    core = next(line for line in limits if line.startswith("Max core file size")).split()
    assert core[4:6] == ["0", "0"], core


def test_a_stopped_helper_dies_with_its_parent() -> None:
    """The parent SIGKILLed while a helper is stopped (it can never read its socket's end):
    the helper is killed with it (PR_SET_PDEATHSIG), not left stopped for good."""
    import subprocess
    import sys
    import time

    script = (
        "import sys\n"
        "from clipcli.numerics import lookup\n"
        "from clipcli.system import counting\n"
        "import contextlib\n"
        "from clipcli.formats.base import FileRange\n"
        "pool = counting.CountingProcesses(lookup.bit_pattern_counts, 1)\n"
        "nothing = FileRange(lambda: contextlib.nullcontext(0), 0, 0)\n"
        "assert pool.count(nothing, 1) is not None  # set up and answering\n"
        "print(pool._helpers[0].pid, flush=True)\n"
        "sys.stdin.read()\n"
    )
    with subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as parent:
        assert parent.stdout is not None
        pid = int(parent.stdout.readline())
        os.kill(pid, signal.SIGSTOP)
        parent.kill()
        parent.wait()
    # The event waited for is the helper's end; the bound only keeps a failure from hanging.
    deadline = time.monotonic() + 30
    while Path(f"/proc/{pid}").exists() and "State:\tZ" not in _status(pid):
        assert time.monotonic() < deadline, f"helper {pid} outlived its parent"
        time.sleep(0.01)


def _status(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return "State:\tZ (gone)"
