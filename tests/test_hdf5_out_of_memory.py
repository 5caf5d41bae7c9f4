"""HDF5 failing to allocate memory while reading chunks (`ulimit -v`, a container's limit)
is the environment refusing a resource, exit 5 `out of memory`, as everywhere else; not
exit 3, which blames the input (found by the attack of 2026-11-27: a chunked HDF5 file
under `prlimit --as` was exit 3 with two threads and exit 0 with one). Chunks are at most
256 MiB before any read, so a file cannot make HDF5 ask for more by itself. Elsewhere
(opening, listing) h5py's messages may quote names from the file, and a name must never
decide the exit code."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from clipcli.cli.entry import main
from clipcli.errors import InputError
from clipcli.formats.hdf5 import library

ALLOCATION_FAILED = "Can't synchronously read data (memory allocation failed for chunk)"


def test_a_failed_allocation_while_reading_data_is_memory_error(tmp_path: Path) -> None:
    reading = library.input_errors(tmp_path, "cannot read [0, 4)", "w", reading_data=True)
    with pytest.raises(MemoryError, match="memory allocation failed for chunk"), reading:
        raise OSError(ALLOCATION_FAILED)


def test_other_read_errors_still_blame_the_input(tmp_path: Path) -> None:
    reading = library.input_errors(tmp_path, "cannot read [0, 4)", "w", reading_data=True)
    with pytest.raises(InputError, match="filter returned failure"), reading:
        raise OSError("Can't synchronously read data (filter returned failure during read)")


def test_a_name_in_a_message_outside_data_reads_decides_nothing(tmp_path: Path) -> None:
    """Opening an object: the message quotes its name, which the file chose."""
    message = "Unable to open object (object 'out of memory allocation failed' doesn't exist)"
    with pytest.raises(InputError), library.input_errors(tmp_path, "cannot open object 'x'"):
        raise KeyError(message)


def test_the_command_says_out_of_memory_with_exit_5(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "m.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("w", data=np.ones(1 << 20, np.float32), chunks=(1 << 16,))
    from clipcli.formats.hdf5.reader import Hdf5Reader

    def refuse(*_args: object) -> np.ndarray:
        raise OSError(ALLOCATION_FAILED)

    monkeypatch.setattr(Hdf5Reader, "_read_range", staticmethod(refuse))
    monkeypatch.setattr(Hdf5Reader, "read", lambda *_a: refuse())
    capsys.readouterr()
    assert main(["norms", "-q", str(path)]) == 5
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "out of memory" in err


@pytest.mark.skipif(sys.platform != "linux", reason="prlimit, Linux")
@pytest.mark.parametrize("threads", ["1", "2", "64"])
def test_a_real_address_space_limit_is_exit_0_or_5_never_3(tmp_path: Path, threads: str) -> None:
    """A chunked HDF5 file under address-space limits from tight to ample: whatever the
    thread count, each run succeeds or says out of memory (exit 5), in one line."""
    path = tmp_path / "m.h5"
    rng = np.random.default_rng(1)
    with h5py.File(path, "w") as f:  # 44 chunked datasets, 77 MB (the attack's file)
        for i in range(40):
            n = int(rng.integers(100_000, 700_000))
            data = (rng.standard_normal(n) * (10 ** rng.uniform(-3, 3))).astype(np.float32)
            f.create_dataset(f"model/layers/{i % 12}/w{i}", data=data, chunks=True)
        f.create_dataset("model/f16", data=rng.standard_normal(1_500_000).astype(np.float16))
        f.create_dataset("model/embed/f64", data=rng.standard_normal(900_000), chunks=True)
        f.create_dataset("pos_ids", data=np.arange(100_000, dtype=np.int64), chunks=True)
    codes = set()
    for mib in (140, 180, 300, 1024):
        done = subprocess.run(
            ["prlimit", f"--as={mib << 20}", sys.executable, "-m", "clipcli", "norms", "-q", path],
            env={**os.environ, "CLIPCLI_THREADS": threads},
            capture_output=True,
            text=True,
            timeout=300,
        )
        codes.add(done.returncode)
        assert done.returncode in (0, 5), (mib, done.returncode, done.stderr)
        assert done.stderr.count("\n") <= 1, done.stderr
        if done.returncode == 5:
            assert "out of memory" in done.stderr
    assert 0 in codes  # the ample limit works
