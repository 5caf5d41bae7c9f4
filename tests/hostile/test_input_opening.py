"""Item 8 and the user-block case of issue 9: every input is opened with O_NONBLOCK and
checked to be a regular file on the opened descriptor; an HDF5 file with a user block is
an HDF5 file. Also item 13: the global-heap scan is linear in the file size."""

from __future__ import annotations

import json
import os
import struct
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
from hostile_cli import SLOW_LIMIT, assert_refused, run_clipcli
from safetensors.numpy import save_file

from clipcli.formats import registry


def sharded_model(directory: Path, shards: int = 2) -> Path:
    """A model directory of `shards` shards (one tensor each) and its index, official writer."""
    directory.mkdir()
    weight_map = {}
    for number in range(shards):
        name = f"model-{number + 1:05d}-of-{shards:05d}.safetensors"
        tensor = f"layer{number}.weight"
        save_file({tensor: np.full(4, number + 1, np.float32)}, str(directory / name))
        weight_map[tensor] = name
    index = {"metadata": {"total_size": 16 * shards}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    (directory / "config.json").write_text("{}")
    return directory


@pytest.mark.parametrize("which", ["shard", "index", "side_file"])
def test_fifo_in_a_model_directory_never_blocks(tmp_path: Path, which: str) -> None:
    """Nobody writes to the FIFO: opening it without O_NONBLOCK blocks forever."""
    model = sharded_model(tmp_path / "model")
    target = {
        "shard": model / "model-00002-of-00002.safetensors",
        "index": model / "model.safetensors.index.json",
        "side_file": model / "config.json",
    }[which]
    target.unlink()
    os.mkfifo(target)
    out = tmp_path / "out"
    assert_refused(
        [["norms", str(model)], ["clip", "--global", "1", str(model), str(out)]],
        3,
        [target.name],
        watch=tmp_path,
        timeout=20,
    )


def test_fifo_as_index_file_named_directly(tmp_path: Path) -> None:
    model = sharded_model(tmp_path / "model")
    index = model / "model.safetensors.index.json"
    index.unlink()
    os.mkfifo(index)
    assert_refused(["ls", str(index)], 3, [index.name], watch=tmp_path, timeout=20)


def test_hdf5_with_a_user_block_is_read(tmp_path: Path) -> None:
    """HDF5 allows a 512-byte (or 1024, 2048, ...) user block before the superblock."""
    for userblock in (512, 1024, 4096):
        path = tmp_path / f"ub{userblock}.h5"
        with h5py.File(path, "w", userblock_size=userblock) as f:
            f["w"] = np.array([3.0, 4.0])
        with open(path, "rb") as handle:
            assert handle.read(8) != b"\x89HDF\r\n\x1a\n"  # the signature is not at 0
        (run,) = run_clipcli(["norms", "--format", "json", str(path)], cwd=tmp_path)
        assert run.returncode == 0, run.describe()
        assert json.loads(run.stdout)["global_norm"] == 5.0


def test_file_with_hdf5_signature_at_a_non_power_of_two_offset_is_not_hdf5(
    tmp_path: Path,
) -> None:
    path = tmp_path / "junk"
    path.write_bytes(b"\0" * 700 + b"\x89HDF\r\n\x1a\n" + b"\0" * 100)
    # The line lists every format read (formats.registry), HDF5 among them.
    assert_refused(
        ["ls", str(path)], 3, [f"not an {registry.readable_labels()} file"], watch=tmp_path
    )


def _gcol_lattice(count: int) -> bytes:
    """32-byte records: b"GCOL" claiming a 1 TB collection, then an object header of length
    16, so a walk from each GCOL steps through every later record: quadratic when each
    candidate is walked separately."""
    record = b"GCOL" + bytes([1, 0, 0, 0]) + struct.pack("<Q", 1 << 40)
    record += struct.pack("<HHIQ", 1, 0, 0, 16)
    return record * count


@pytest.mark.parametrize("size", [256 << 10, 1 << 20])
def test_heap_signature_lattice_costs_linear_time(tmp_path: Path, size: int) -> None:
    """Attribute bytes that spell GCOL every 32 bytes: 33 s at 256 KB before, hours at 1 MB."""
    path = tmp_path / "lattice.h5"
    with h5py.File(path, "w", libver="latest") as f:
        f["w"] = np.ones(4, np.float32)
        f.attrs.create("blob", np.frombuffer(_gcol_lattice(size // 32), np.uint8))
    start = time.monotonic()
    (run,) = run_clipcli(["ls", str(path)], cwd=tmp_path, timeout=60)
    seconds = time.monotonic() - start
    assert run.returncode in (0, 3), run.describe()
    assert seconds < SLOW_LIMIT, run.describe()


@pytest.mark.parametrize("path", ["/proc/self/environ", "/proc/self/maps", "/sys/kernel/notes"])
def test_kernel_files_are_never_read(tmp_path: Path, path: str) -> None:
    link = tmp_path / "model.safetensors"
    link.symlink_to(path)
    assert_refused(["norms", str(link)], 3, ["kernel or device file"], watch=tmp_path)


def test_a_checkpoint_in_dev_shm_is_read(tmp_path: Path) -> None:
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK)):
        pytest.skip("no writable /dev/shm on this machine")
    path = shm / f"clipcli-test-{os.getpid()}.safetensors"
    save_file({"w": np.array([3.0, 4.0], np.float32)}, str(path))
    try:
        (run,) = run_clipcli(["norms", "--format", "json", str(path)], cwd=tmp_path)
    finally:
        path.unlink()
    assert run.returncode == 0, run.describe()
    assert json.loads(run.stdout)["global_norm"] == 5.0
