"""Cases found by an attacker who did not write clipcli, kept as regression tests. Each
segfaulted, exited 70, or was accepted against the README before its fix. Files are built
with h5py / numpy and then patched byte by byte, as the attacker did."""

from __future__ import annotations

import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import h5py
import numpy as np
import pytest
from hostile_cli import Run, run_clipcli

COMMANDS = ("norms", "clip", "convert")


def run(*args: str | Path) -> Run:
    """One clipcli process (forked from the warm parent of hostile_cli), memory-capped."""
    (done,) = run_clipcli([str(a) for a in args], cwd=Path(tempfile.gettempdir()), timeout=120)
    return done


def refused_everywhere(path: Path, tmp_path: Path, says: str) -> None:
    """norms, clip and convert each exit 3 with one line, and leave nothing behind."""
    out = tmp_path / "out"
    out.mkdir()
    for command in COMMANDS:
        argvs: dict[str, list[str | Path]] = {
            "norms": ["norms", path],
            "clip": ["clip", "--global", "1", path, out / "o.h5"],
            "convert": ["convert", path, out / "c.h5"],
        }
        argv = argvs[command]
        done = run(*argv)
        assert done.returncode == 3, (command, done.returncode, done.stderr)
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1
        assert lines[0].startswith("clipcli: error: ")
        assert says in lines[0]
    assert list(out.iterdir()) == []


@pytest.mark.parametrize("filters", [{"fletcher32": True}, {"compression": "gzip"}])
def test_hdf5_chunk_stored_with_zero_bytes(tmp_path: Path, filters: dict[str, object]) -> None:
    """fletcher32 over an empty stored chunk crashed libhdf5 (SIGSEGV)."""
    path = tmp_path / "zero_chunk.h5"
    with h5py.File(path, "w") as handle:
        handle.create_dataset("z", data=np.ones((64, 64), np.float32), chunks=(16, 16), **filters)
    with h5py.File(path, "r") as handle:
        size = handle["z"].id.get_chunk_info(0).size
    data = bytearray(path.read_bytes())
    key = data.find(struct.pack("<IIQQ", size, 0, 0, 0))  # v1 B-tree key of chunk (0, 0)
    assert key > 0
    data[key : key + 4] = b"\0\0\0\0"
    path.write_bytes(data)
    refused_everywhere(path, tmp_path, "empty or runs past the end")


def test_hdf5_float_type_with_a_wild_bit_offset(tmp_path: Path) -> None:
    """A float32 whose datatype message puts its bits at offset 0xEA00: segfault on copy."""
    path = tmp_path / "bad_float.h5"
    with h5py.File(path, "w") as handle:
        handle.create_dataset("w", data=np.ones(16, np.float32))
    data = bytearray(path.read_bytes())
    message = bytes.fromhex("11201f00040000000000200017080017 7f".replace(" ", ""))
    at = data.find(message)
    assert at > 0
    data[at + 9] = 0xEA
    path.write_bytes(data)
    refused_everywhere(path, tmp_path, "non-standard bit layout")


def test_hdf5_contiguous_dataset_with_a_larger_maximum_shape(tmp_path: Path) -> None:
    path = tmp_path / "extendible.h5"
    with h5py.File(path, "w") as handle:
        handle.create_dataset("e", data=np.ones(100, np.float32))
    data = bytearray(path.read_bytes())
    at = data.find(struct.pack("<QQ", 100, 100))  # dataspace: dims, then max dims
    struct.pack_into("<Q", data, at + 8, 108)
    path.write_bytes(data)
    refused_everywhere(path, tmp_path, "maximum shape")


def test_npz_with_an_unknown_zip_version(tmp_path: Path) -> None:
    np.savez(tmp_path / "v.npz", a=np.ones(3, np.float32))
    data = bytearray((tmp_path / "v.npz").read_bytes())
    data[data.find(b"PK\x01\x02") + 6] = 0xFF  # "version needed to extract": 25.5
    (tmp_path / "v.npz").write_bytes(data)
    for command in ("ls", "norms"):
        done = run(command, tmp_path / "v.npz")
        assert done.returncode == 3, done.stderr
        assert "zip file version" in done.stderr, done.stderr


@pytest.mark.parametrize("dtype", ['["F32"]', '{"a": 1}', "null", "32"])
def test_safetensors_dtype_that_is_not_a_string(tmp_path: Path, dtype: str) -> None:
    entry = '"shape":[1],"data_offsets":[0,4]'
    header = ('{"x":{"dtype":' + dtype + "," + entry + "}}").encode()
    header += b" " * (-len(header) % 8)
    path = tmp_path / "dt.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 4)
    done = run("norms", path)
    assert done.returncode == 3, done.stderr
    assert "unknown dtype" in done.stderr, done.stderr


@pytest.mark.parametrize(("offset", "field"), [(14, "crc"), (18, "compressed size")])
def test_npz_local_header_disagreeing_with_the_central_directory(
    tmp_path: Path, offset: int, field: str
) -> None:
    """numpy writes ZIP64 local headers (sizes 0xFFFFFFFF, the real ones in an extra
    field), so the comparison has to read that field too."""
    path = tmp_path / "lh.npz"
    np.savez(path, a=np.ones(8, np.float32))
    data = bytearray(path.read_bytes())
    struct.pack_into("<I", data, offset, 9999)
    path.write_bytes(data)
    done = run("norms", path)
    assert done.returncode == 3, field
    assert "disagrees with the central directory" in done.stderr, field


def test_closed_or_full_stdout_is_one_line_not_an_internal_error(tmp_path: Path) -> None:
    np.savez(tmp_path / "m.npz", a=np.ones(8, np.float32))
    m = tmp_path / "m.npz"
    cli = f"{sys.executable} -m clipcli"
    cases = {
        f"{cli} norms {m} >&-": 5,
        f"{cli} norms {m} > /dev/full": 5,
        f"{cli} norms {tmp_path / 'missing.npz'} 2>&-": 3,
        f"{cli} clip --global 1 -q {m} {tmp_path / 'o.npz'} >&-": 0,
    }
    for command, code in cases.items():
        done = subprocess.run(["bash", "-c", command], capture_output=True, text=True)
        assert done.returncode == code, (command, done.stderr)
        assert "internal error" not in done.stderr
        assert done.stderr.count("\n") <= 1
