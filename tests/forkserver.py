"""A warm parent for clipcli runs in tests (tests/forked_cli.py): `python forkserver.py`.

Starting a fresh interpreter and importing numpy, h5py, rich and clipcli costs ~0.3 s per
command, and the tests run hundreds of commands. This process imports all of that
once, then forks one child per command: each child is still its own process, with its own
memory cap, its own exit code (or signal), its own stdout/stderr and a timeout enforced
from outside, and it runs clipcli through the same entry point as `python -m clipcli`
(`clipcli.__main__.run`).

Protocol, one JSON line each way per batch (stdin -> stdout):
  request  {"commands": [[arg, ...], ...], "cwd": str, "timeout": float,
            "memory_cap": int (0: none), "outdir": str}
  response {"results": [{"returncode": int | null, "seconds": float}, ...]}
A child's stdout and stderr go to `outdir/<i>.out` and `outdir/<i>.err`; returncode is
null when the child was killed at the timeout, -N when a signal N ended it.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import resource
import signal
import sys
import time
import traceback
from typing import Any

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # no BLAS threads in the forking parent

import clipcli.__main__ as entry  # after the environment is set
import clipcli.cli.entry  # noqa: F401


def _warm_up() -> None:
    """Import what commands import on first use, through clipcli's own code paths (h5py
    through clipcli's importer, which disables HDF5 plugins first)."""
    preload = getattr(entry, "_preload", None)
    if preload is not None:
        preload(["norms"])
    try:
        import clipcli.formats.hdf5 as hdf5

        getattr(hdf5, "_h5py", lambda: None)()
    except ImportError:
        pass


def _child(args: list[str], cwd: str, memory_cap: int, out: str, err: str) -> None:
    """In the forked child: become `python -m clipcli ARGS`; never returns."""
    code = 70
    try:
        # The handlers a fresh interpreter starts with.
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        if memory_cap:
            resource.setrlimit(resource.RLIMIT_AS, (memory_cap, memory_cap))
        os.chdir(cwd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, path in ((1, out), (2, err)):
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(target, fd)
            os.close(target)
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=False)
        sys.stderr = io.TextIOWrapper(
            io.FileIO(2, "w", closefd=False), errors="backslashreplace", line_buffering=True
        )
        sys.argv = ["clipcli", *args]
        try:
            entry.run()
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:  # what an uncaught exception does to a fresh interpreter
            traceback.print_exc()
            code = 1
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
    finally:
        os._exit(code)


def _batch(request: dict[str, Any]) -> list[dict[str, Any]]:
    start = time.monotonic()
    deadline = start + float(request["timeout"])
    pids: list[int] = []
    for number, args in enumerate(request["commands"]):
        out = os.path.join(request["outdir"], f"{number}.out")
        err = os.path.join(request["outdir"], f"{number}.err")
        pid = os.fork()
        if pid == 0:
            _child(list(args), request["cwd"], int(request["memory_cap"]), out, err)
        pids.append(pid)
    results: list[dict[str, Any] | None] = [None] * len(pids)
    waiting = dict(enumerate(pids))
    while waiting:
        for number, pid in list(waiting.items()):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                code = os.waitstatus_to_exitcode(status)
                results[number] = {"returncode": code, "seconds": time.monotonic() - start}
                del waiting[number]
        if waiting and time.monotonic() >= deadline:
            for number, pid in waiting.items():
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                results[number] = {"returncode": None, "seconds": time.monotonic() - start}
            waiting.clear()
        if waiting:
            time.sleep(0.002)
    return [result for result in results if result is not None]


def serve() -> None:
    _warm_up()
    sys.stdout.write('{"ready": true}\n')
    sys.stdout.flush()
    for line in sys.stdin:
        results = _batch(json.loads(line))
        sys.stdout.write(json.dumps({"results": results}) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    serve()
