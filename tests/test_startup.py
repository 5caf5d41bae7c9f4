"""Start-up (issue 12, item 7): `clipcli ls` in a shell loop imports only what listing
needs. The times themselves are measured by benchmarks/startup.py, not here: a test
checks which modules a run loads, which does not depend on the machine's load."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from handmade import write_safetensors

HEAVY = ("rich", "h5py", "matplotlib", "clipcli.pipeline", "clipcli.diff", "clipcli.numerics")


def _modules_after(argv: list[str]) -> set[str]:
    code = (
        "import sys\n"
        f"sys.argv = ['clipcli', *{argv!r}]\n"
        "from clipcli.__main__ import run\n"
        "try:\n    run()\nexcept SystemExit:\n    pass\n"
        "print(' '.join(sorted(sys.modules)), file=sys.stderr)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    return set(done.stderr.split())


def _loaded(modules: set[str], prefix: str) -> bool:
    return any(m == prefix or m.startswith(prefix + ".") for m in modules)


@pytest.mark.parametrize("fmt", ["table", "json"])
def test_ls_loads_no_job_module_rich_or_h5py(tmp_path: Path, fmt: str) -> None:
    path = write_safetensors(tmp_path / "m.safetensors", {"w": np.ones(4, np.float32)})
    modules = _modules_after(["ls", str(path), "--format", fmt])
    assert "clipcli.formats.safetensors" in modules  # the run did list the file
    assert [m for m in HEAVY if _loaded(modules, m)] == []
    assert not _loaded(modules, "clipcli.formats.npz")  # only the reader this file needs


def test_norms_table_loads_no_rich_h5py_or_diff(tmp_path: Path) -> None:
    path = write_safetensors(tmp_path / "m.safetensors", {"w": np.ones(4, np.float32)})
    modules = _modules_after(["norms", str(path)])
    assert "clipcli.pipeline" in modules  # the measuring job (was clipcli.engine)
    assert [m for m in ("rich", "h5py", "matplotlib", "clipcli.diff") if _loaded(modules, m)] == []
