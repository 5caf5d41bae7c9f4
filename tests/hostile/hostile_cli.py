"""Running the real CLI on hostile input: a subprocess with a memory cap and a timeout, and
the one check every refusal must pass (`assert_refused`).

Every refusal must be: the documented exit code (never a signal, never 70), exactly one
stderr line starting `clipcli: error:` that names the file (and the tensor where there is
one), no traceback, no raw control characters, and the output directory exactly as it was
(no OUT, no temp file).
"""

from __future__ import annotations

import math
import os
import resource
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from forked_cli import run_forked

# Address-space cap for every clipcli run. 1 GiB is enough for healthy runs, numpy's and
# the worker threads' mappings included (test_general_hostile checks this on a healthy
# file of each format); a hostile file that makes clipcli allocate what it declares fails.
MEMORY_CAP = 1 << 30
TIMEOUT = 20.0  # seconds per clipcli run; a hostile file must not make clipcli hang
# For the few cases whose point is the time a small hostile file costs (a 3-17 MB file
# that keeps clipcli busy for 30-60 s): what such a file needs when handled well is ~2 s
# at most. 10 s still tells the two apart, with 5x headroom for a loaded CI machine
# (at 6 s the 50,000-tensor listing failed once while two test processes shared 2 cores).
SLOW_LIMIT = 10.0
INTERNAL_ERROR = 70
PREFIX = "clipcli: error: "


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP))


@dataclass(frozen=True)
class Run:
    args: tuple[str, ...]
    returncode: int | None  # None: killed after TIMEOUT
    stdout: str
    stderr: str
    seconds: float

    def describe(self) -> str:
        return (
            f"clipcli {' '.join(self.args)!r} -> {self.returncode} in {self.seconds:.1f}s; "
            f"stderr={self.stderr[-2000:]!r}"
        )


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("CLIPCLI_DEBUG", None)  # the traceback switch must be off
    return env


def _start(args: Sequence[str], cwd: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "clipcli", *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=cwd,
        env=_child_env(),
        preexec_fn=_limit_memory,
    )


def _finish(
    proc: subprocess.Popen[bytes], args: Sequence[str], start: float, timeout: float
) -> Run:
    try:
        out, err = proc.communicate(timeout=max(0.0, start + timeout - time.monotonic()))
        code: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        code = None
    return Run(
        tuple(args),
        code,
        out.decode("utf-8", "replace"),
        err.decode("utf-8", "replace"),
        time.monotonic() - start,
    )


def _run_fresh(commands: Sequence[Sequence[str]], cwd: Path, timeout: float) -> list[Run]:
    """One new interpreter per command (`python -m clipcli ...`)."""
    start = time.monotonic()
    procs = [_start(args, cwd) for args in commands]
    with ThreadPoolExecutor(max_workers=len(procs)) as pool:
        futures = [
            pool.submit(_finish, proc, args, start, timeout)
            for proc, args in zip(procs, commands, strict=True)
        ]
        return [future.result() for future in futures]


def run_clipcli(*commands: Sequence[str], cwd: Path, timeout: float = TIMEOUT) -> list[Run]:
    """Run each command as clipcli would run from `python -m clipcli ...`, all at once (two
    cores: half the wall time), each in its own process under the memory cap and the
    timeout.

    The processes are forked from a warm parent that has numpy, h5py and clipcli imported
    (tests/forked_cli.py), which saves ~0.3 s of interpreter start-up per command;
    HOSTILE_FRESH_INTERPRETERS=1 starts a new interpreter per command instead."""
    if os.environ.get("HOSTILE_FRESH_INTERPRETERS") == "1":
        return _run_fresh(commands, cwd, timeout)
    return [
        Run(tuple(args), done.returncode, done.stdout, done.stderr, done.seconds)
        for args, done in zip(commands, run_forked(commands, cwd, timeout, MEMORY_CAP), strict=True)
    ]


def listing(directory: Path) -> list[str]:
    """Every entry below directory, hidden ones (temp files) included."""
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*"))


def check_error_line(run: Run, code: int, must_mention: Sequence[str] = ()) -> str:
    """The checks one refusal must pass; returns the error line."""
    assert run.returncode is not None, f"killed at its timeout: {run.describe()}"
    assert run.returncode >= 0, f"killed by signal {-run.returncode}: {run.describe()}"
    assert run.returncode != INTERNAL_ERROR, f"internal error (a bug): {run.describe()}"
    assert run.returncode == code, f"expected exit {code}: {run.describe()}"
    assert "Traceback" not in run.stderr, run.describe()
    assert run.stderr.endswith("\n"), run.describe()
    lines = run.stderr[:-1].split("\n")
    assert len(lines) == 1, f"expected one stderr line: {run.describe()}"
    line = lines[0]
    assert line.startswith(PREFIX), run.describe()
    assert "\x1b" not in line, f"raw control characters: {line!r}"
    assert "\r" not in line, f"raw control characters: {line!r}"
    assert all(ch.isprintable() for ch in line), f"unprintable characters: {line!r}"
    for mention in must_mention:
        assert mention in line, f"{mention!r} not in {line!r}"
    return line


def assert_refused(
    args: Sequence[str] | Sequence[Sequence[str]],
    code: int,
    must_mention: Sequence[str] = (),
    *,
    watch: Path,
    timeout: float = TIMEOUT,
) -> list[Run]:
    """Run one command (or several, concurrently) in `watch` and check each is refused with
    exit `code`, one clean error line mentioning every string in `must_mention`, and that
    nothing in `watch` changed (no OUT, no temp file)."""
    commands: list[Sequence[str]] = (
        [args] if args and isinstance(args[0], str) else list(args)  # type: ignore[list-item]
    )
    before = listing(watch)
    runs = run_clipcli(*commands, cwd=watch, timeout=timeout)
    for run in runs:
        check_error_line(run, code, must_mention)
    assert listing(watch) == before, "the output directory changed"
    return runs


OUT_SUFFIX = {".npz": ".npz", ".h5": ".h5", ".hdf5": ".h5", ".safetensors": ".safetensors"}


def refuse_input(path: Path, code: int = 3, *mentions: str, timeout: float = TIMEOUT) -> list[Run]:
    """`norms PATH` and `clip --global 1 PATH OUT` (OUT in PATH's directory, same format)
    must both be refused, naming the file and every string in `mentions`."""
    out = path.parent / f"clipped_out{OUT_SUFFIX.get(path.suffix, '.safetensors')}"
    return assert_refused(
        [["norms", str(path)], ["clip", "--global", "1", str(path), str(out)]],
        code,
        [str(path), *mentions],
        watch=path.parent,
        timeout=timeout,
    )


def exact_norm(array: np.ndarray) -> float:
    """sqrt(sum x^2) in float64 without overflow or underflow, within ~1 ulp: scale by a
    power of two (exact), square in float64 (exact for float16/32 inputs), fsum, sqrt.
    inf when the norm itself is past float64's range."""
    values = np.asarray(array, dtype=np.float64).ravel()
    peak = float(np.max(np.abs(values))) if values.size else 0.0
    if peak == 0.0:
        return 0.0
    exponent = math.frexp(peak)[1]
    scaled = [math.ldexp(float(v), -exponent) for v in values]
    try:
        return math.ldexp(math.sqrt(math.fsum(v * v for v in scaled)), exponent)
    except OverflowError:
        return math.inf
