"""Timing whole processes: warm-up, median of N interleaved runs, peak RSS, retries when
other processes made a run noisy, and pinning the inputs into the page cache."""

from __future__ import annotations

import os
import shlex
import statistics
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from common import MIB, PY, log

TIME = "/usr/bin/time" if os.access("/usr/bin/time", os.X_OK) else None
# Fallback when GNU time is missing: one wrapper process per run, reporting its children's
# peak RSS (KiB on Linux), CPU seconds and blocks read from disk in the same "%M %U %S %I"
# format.
WRAPPER = (
    "import resource,subprocess,sys\n"
    "rc=subprocess.call(sys.argv[2:],stdout=subprocess.DEVNULL)\n"
    "u=resource.getrusage(resource.RUSAGE_CHILDREN)\n"
    "open(sys.argv[1],'w').write(f'{u.ru_maxrss} {u.ru_utime} {u.ru_stime} {u.ru_inblock}')\n"
    "sys.exit(rc)\n"
)


@dataclass
class Cmd:
    argv: list[str]
    fresh: Path | None = None  # OUT: deleted (and os.sync()ed) before every run

    @property
    def key(self) -> tuple[str, ...]:
        return tuple(self.argv)


@dataclass
class Stat:
    cmd: Cmd
    group: str = ""  # set when a command is measured again inside a comparison group
    samples: list[Sample] = field(default_factory=list)  # the timed runs
    retried: int = 0  # runs redone because other processes were busy
    error: str | None = None

    @property
    def walls(self) -> list[float]:
        return [x.wall for x in self.samples]

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.samples)

    @property
    def median(self) -> float:
        return statistics.median(self.walls)

    @property
    def peak(self) -> float:
        return max(x.rss for x in self.samples)


class Failure(Exception):
    pass


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
NOISY = 0.25  # cores of CPU used by other processes during a run: redo it (a few times)
RETRIES = 2


def busy_seconds() -> float:
    """CPU seconds the whole machine has spent busy (all but idle and iowait), incl. steal."""
    try:
        with open("/proc/stat") as stat:
            ticks = [int(x) for x in stat.readline().split()[1:9]]
    except (OSError, ValueError):
        return 0.0
    return (sum(ticks) - ticks[3] - ticks[4]) / CLOCK_TICKS


COLD_MIB = 8.0  # a run that reads more than this from the disk did not find a warm cache


@dataclass
class Sample:
    wall: float  # s
    rss: float  # peak RSS, MiB
    cpu: float  # user + sys of the command, s
    foreign: float  # load of other processes during the run, in cores
    disk: float  # MiB the command read from the block device (page-cache misses)

    @property
    def clean(self) -> bool:
        return self.foreign <= NOISY and self.disk <= COLD_MIB


def run_once(cmd: Cmd) -> Sample:
    if cmd.fresh is not None:
        cmd.fresh.unlink(missing_ok=True)
        os.sync()  # a quiet page cache: no writeback from earlier runs competes with this one
    with tempfile.NamedTemporaryFile("r", suffix=".rusage") as report:
        if TIME:
            argv = [TIME, "-f", "%M %U %S %I", "-o", report.name, *cmd.argv]
        else:
            argv = [PY, "-c", WRAPPER, report.name, *cmd.argv]
        busy = busy_seconds()
        started = time.perf_counter()
        # From a neutral folder: `python -m clipcli` puts the working folder first on
        # sys.path, so run from a checkout it imported that checkout's clipcli whatever
        # PYTHONPATH named (axes_shapes.py's --other rows ran this checkout's code).
        proc = subprocess.run(
            argv,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            cwd=tempfile.gettempdir(),
        )
        wall = time.perf_counter() - started
        busy = busy_seconds() - busy
        usage = report.read().split()
    if proc.returncode != 0:
        stderr = proc.stderr.decode(errors="replace").strip()
        raise Failure(f"exit {proc.returncode}: {stderr[-2000:]}")
    rss_kib, user, system, blocks = usage[-4:]
    cpu = float(user) + float(system)
    # /proc/stat counts in clock ticks (10 ms): allow two ticks of rounding, or every
    # sub-0.1 s command would look loaded.
    foreign = max(0.0, busy - cpu - 2 / CLOCK_TICKS) / wall
    return Sample(wall, int(rss_kib) / 1024, cpu, foreign, int(blocks) * 512 / MIB)


class Pinned:
    """Input files mmap'ed and mlock'ed into the page cache while a group runs, so that "warm
    page cache" holds: some VMs evict idle page-cache pages within seconds (e.g. a DAMON
    `pageout` scheme), and a timed run would then read its input from the disk. The pages
    are mapped in this harness process only; the measured commands' RSS is unaffected."""

    def __init__(self) -> None:
        import ctypes
        import ctypes.util

        self.ctypes = ctypes
        self.libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        self.libc.mmap.restype = ctypes.c_void_p
        self.libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                   ctypes.c_int, ctypes.c_int, ctypes.c_long]  # fmt: skip
        self.libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self.libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self.maps: list[tuple[int, int]] = []
        self.failed: str | None = None

    def pin(self, paths: Sequence[Path]) -> None:
        import mmap

        for path in paths:
            size = path.stat().st_size
            fd = os.open(path, os.O_RDONLY)
            try:
                addr = self.libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            finally:
                os.close(fd)
            if addr is None or addr == self.ctypes.c_void_p(-1).value:
                self.failed = f"mmap {path.name}: {os.strerror(self.ctypes.get_errno())}"
                continue
            self.maps.append((addr, size))
            if self.libc.mlock(addr, size) != 0:
                self.failed = f"mlock {path.name}: {os.strerror(self.ctypes.get_errno())}"

    def release(self) -> None:
        for addr, size in self.maps:
            self.libc.munmap(addr, size)
        self.maps = []


def quiet_load(window: float = 1.0) -> float:
    """Cores kept busy by other processes over `window` seconds (the harness is idle)."""
    before = busy_seconds()
    time.sleep(window)
    return (busy_seconds() - before) / window


class Bench:
    def __init__(self, runs: int, workdir: Path, max_wait: float, retries: int, pin: bool) -> None:
        self.pinned = Pinned() if pin else None
        self.runs = runs
        self.retries = retries
        self.workdir = workdir
        self.max_wait = max_wait
        self.waited = 0.0
        self.cache: dict[tuple[str, ...], Stat] = {}

    def wait_quiet(self) -> None:
        """Before each group: wait (at most max_wait s) until other processes use less than
        NOISY cores, so clipcli and its baselines run on an otherwise idle machine."""
        started = time.perf_counter()
        while time.perf_counter() - started < self.max_wait:
            if quiet_load() <= NOISY:
                break
        waited = time.perf_counter() - started
        if waited > 1.5:
            log(f"  (waited {waited:.0f} s for other processes to go quiet)")
        self.waited += waited

    def measure(self, *cmds: Cmd, group: str = "") -> list[Stat]:
        """One warm-up each, then `runs` rounds in which the commands take turns
        (interleaved), so slow drift in the machine affects clipcli and baselines alike.
        A command measured before is reused, unless `group` is given: then every command
        is measured afresh within the group (for comparisons whose ratio matters)."""
        keys = [(group, *c.key) if group else c.key for c in cmds]
        todo = [Stat(c, group) for c, k in zip(cmds, keys, strict=True) if k not in self.cache]
        for stat, key in zip(todo, [k for k in keys if k not in self.cache], strict=True):
            self.cache[key] = stat
        if todo:
            self.wait_quiet()
        inputs = sorted(
            {
                Path(arg)
                for stat in todo
                for arg in stat.cmd.argv
                if arg.startswith(str(self.workdir))
                and Path(arg) != stat.cmd.fresh
                and Path(arg).is_file()
            }
        )
        if self.pinned is not None:
            self.pinned.pin(inputs)
        try:
            for stat in todo:
                self._run(stat, record=False)
            for _ in range(self.runs):
                for stat in todo:
                    if stat.error is None:
                        self._run(stat, record=True)
        finally:
            if self.pinned is not None:
                self.pinned.release()
        for stat in todo:
            shown = f"{stat.median:.3f} s, {stat.peak:.0f} MiB" if stat.ok else "FAILED"
            log(f"  {shown:>22}  {self.show(stat.cmd)}")
        return [self.cache[k] for k in keys]

    def _run(self, stat: Stat, record: bool) -> None:
        """A timed run during which other processes kept > NOISY cores busy, or which read
        > COLD_MIB from the disk (its input had been evicted from the page cache), is redone
        (at most `retries` times; then the last attempt is kept and counted as unclean)."""
        for attempt in range(self.retries + 1):
            try:
                sample = run_once(stat.cmd)
            except Failure as exc:
                stat.error = str(exc)
                return
            if not record or sample.clean or attempt == self.retries:
                break
            stat.retried += 1
            time.sleep(0.5)
        if record:
            stat.samples.append(sample)

    def show(self, cmd: Cmd) -> str:
        return shlex.join(cmd.argv).replace(str(self.workdir), "$BENCH").replace(PY, "python")
