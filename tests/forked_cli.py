"""Running clipcli as `python -m clipcli ...` in its own process, without paying for a new
interpreter each time: `run_forked(commands, cwd)`.

Each command is forked from a warm parent (tests/forkserver.py) that has numpy, h5py, rich
and clipcli imported, and runs through `clipcli.__main__.run` as `python -m clipcli` does:
its own process, exit code (or signal), stdout, stderr, optional memory cap, and a timeout
enforced from outside. That saves ~0.3 s of CPU per command. Tests whose point is the
interpreter's start-up (lazy imports, signals while starting) must start a real
`python -m clipcli` instead.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

NO_CAP = 0


@dataclass(frozen=True)
class Forked:
    returncode: int | None  # None: killed at the timeout; -N: ended by signal N
    stdout: str
    stderr: str
    seconds: float


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("CLIPCLI_DEBUG", None)  # the traceback switch must be off
    return env


class _ForkServer:
    """The warm parent (tests/forkserver.py), started on first use and stopped
    when the test process exits."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("forkserver.py"))],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=_child_env(),
        )
        assert self.proc.stdout is not None
        assert json.loads(self.proc.stdout.readline()) == {"ready": True}
        atexit.register(self.stop)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def run(
        self, commands: Sequence[Sequence[str]], cwd: Path, timeout: float, memory_cap: int
    ) -> list[Forked]:
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        with tempfile.TemporaryDirectory(prefix="clipcli-forkserver-") as outdir:
            request = {
                "commands": [list(args) for args in commands],
                "cwd": str(cwd),
                "timeout": timeout,
                "memory_cap": memory_cap,
                "outdir": outdir,
            }
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            reply = self.proc.stdout.readline()
            assert reply, "the fork server died"
            results = json.loads(reply)["results"]
            runs = []
            for number, result in enumerate(results):
                out = Path(outdir, f"{number}.out").read_bytes()
                err = Path(outdir, f"{number}.err").read_bytes()
                runs.append(
                    Forked(
                        result["returncode"],
                        out.decode("utf-8", "replace"),
                        err.decode("utf-8", "replace"),
                        result["seconds"],
                    )
                )
            return runs


_server: list[_ForkServer] = []


def run_forked(
    commands: Sequence[Sequence[str]], cwd: Path, timeout: float = 120.0, memory_cap: int = NO_CAP
) -> list[Forked]:
    """Run the commands at once, each as its own clipcli process; results in order."""
    if not _server or _server[0].proc.poll() is not None:
        _server[:] = [_ForkServer()]
    return _server[0].run(commands, cwd, timeout, memory_cap)
