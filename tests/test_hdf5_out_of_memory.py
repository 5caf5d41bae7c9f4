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
from clipcli.system import address_space

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
    codes = exit_codes_under_limits(path, (140, 180, 300, 1024), threads)
    assert 0 in codes  # the ample limit works


def exit_codes_under_limits(path: Path, limits_mib: tuple[int, ...], threads: str) -> list[int]:
    """`norms` of `path` under each address-space limit: each exit 0, or 5 saying out of
    memory, in at most one line."""
    codes = []
    for mib in limits_mib:
        done = subprocess.run(
            ["prlimit", f"--as={mib << 20}", sys.executable, "-m", "clipcli", "norms", "-q", path],
            env={**os.environ, "CLIPCLI_THREADS": threads},
            capture_output=True,
            text=True,
            timeout=300,
        )
        codes.append(done.returncode)
        assert done.returncode in (0, 5), (mib, done.returncode, done.stderr)
        assert done.stderr.count("\n") <= 1, done.stderr
        if done.returncode == 5:
            assert "out of memory" in done.stderr
    return codes


FILTER_FAILED = "Can't synchronously read data (filter returned failure during read)"


@pytest.mark.parametrize("room", [True, False])
def test_a_filter_failure_is_memory_only_without_room_for_the_filter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, room: bool
) -> None:
    """HDF5 says a gzip chunk failed in the same words whether the chunk is corrupt or the
    filter's buffer was refused (THREAT_MODEL open item 12 until 2026-11-27): where the
    address-space limit leaves less than the filter needs, it is the environment."""
    asked: list[int] = []

    def has_room(needed: int) -> bool:
        asked.append(needed)
        return room

    monkeypatch.setattr(address_space, "has_room", has_room)
    reading = library.input_errors(
        tmp_path, "cannot read [0, 4)", "w", reading_data=True, filter_room=12345
    )
    expected = InputError if room else MemoryError
    with pytest.raises(expected, match="filter returned failure"), reading:
        raise OSError(FILTER_FAILED)
    assert asked == [12345]


def test_a_filter_failure_without_a_filter_room_blames_the_input(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Outside data reads, or for a dataset read without filters, room is never asked."""
    monkeypatch.setattr(address_space, "has_room", lambda _: False)
    for reading in (
        library.input_errors(tmp_path, "cannot read", "w", reading_data=True),
        library.input_errors(tmp_path, "cannot open", "w", filter_room=10),
    ):
        with pytest.raises(InputError), reading:
            raise OSError(FILTER_FAILED)


def test_the_filter_room_is_three_chunks_for_filtered_datasets_only(tmp_path: Path) -> None:
    path = tmp_path / "m.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset(
            "gz", data=np.ones((64, 64), np.float32), chunks=(16, 32), compression="gzip"
        )
        f.create_dataset("sh", data=np.ones(100, np.float64), chunks=(10,), shuffle=True)
        f.create_dataset("plain", data=np.ones(100, np.float32), chunks=(10,))
        f.create_dataset("flat", data=np.ones(100, np.float32))
    from clipcli.formats.hdf5.reader import Hdf5Reader

    with Hdf5Reader(path) as reader:
        rooms = {i.name: library.filter_room(reader.dataset(i.name), i) for i in reader.infos}
    assert rooms == {"gz": 3 * 16 * 32 * 4, "sh": 3 * 10 * 8, "plain": 0, "flat": 0}


def test_a_corrupt_gzip_chunk_is_still_the_input(tmp_path: Path) -> None:
    path = tmp_path / "bad.h5"
    with h5py.File(path, "w") as f:
        d = f.create_dataset(
            "w", data=np.arange(4096, dtype=np.float32), chunks=(4096,), compression="gzip"
        )
        d.id.write_direct_chunk((0,), b"\x78\x9c" + bytes(range(256)) * 8)
    done = subprocess.run(
        [sys.executable, "-m", "clipcli", "norms", "-q", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 3, done.stderr
    assert done.stderr.count("\n") == 1


@pytest.mark.skipif(sys.platform != "linux", reason="prlimit, Linux")
def test_gzip_chunks_under_a_real_address_space_limit_are_exit_0_or_5_never_3(
    tmp_path: Path,
) -> None:
    """The attack's file: 8 MiB gzip chunks of noise, read under limits from tight to ample
    (the filter failing for want of memory was exit 3 at 160-180 MiB)."""
    path = tmp_path / "gz.h5"
    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        for i in range(2):
            data = rng.standard_normal(4 << 20).astype(np.float32)
            f.create_dataset(
                f"w{i}", data=data, chunks=(2 << 20,), compression="gzip", compression_opts=1
            )
    codes = exit_codes_under_limits(path, (140, 150, 160, 170, 180, 190, 200, 1024), "2")
    assert codes[-1] == 0
